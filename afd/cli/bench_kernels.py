"""``afd bench kernels``: each native CPU kernel (afd/kernels) against the torch path it replaces, on the same
inputs in one process, alternating the two: medians of ``--runs`` and their ratio.

* decode attention: D decode tokens, each with a context of L positions scattered over a paged cache, MLA's
  absorbed shapes by default (16 heads on one 576-wide latent, 512 values: DeepSeek-V2-Lite's);
* the routed experts: T tokens, top-k of E experts (V2-Lite's 64 of 2048 x 1408 by default is large; the
  default here is the vLLM-comparison model's 8 experts of 256 x 192, where the loop's overhead shows);
* decode-size linears: M rows against an N x K weight (the vLLM-comparison model's projections and LM head by
  default), the weights cycled through copies larger than the last-level cache, as a decode step reads them;
* gated deltanet decode (``--gdn-tokens``, ``--gdn``): D tokens of a Qwen3.5-shaped linear-attention layer (32
  value heads, 128 x 128 fp32 states, a cache of 64 slots), the state read and written in place in its slots
  against ``recurrent_step`` with the gather, zeroing and scatter of the slots around it (GatedDeltaNet.forward);
* MXFP4 experts (``--mxfp4-experts``, gpt-oss's shapes: biases, clamped SwiGLU): the blocks kept and decoded
  inside the C++ loop (``--mxfp4-weights keep``) against the same weights decoded at load, memory and time.

A case's token list may be empty (``--decode-tokens``, ``--tokens``, ``--rows``, ``--gdn-tokens``,
``--mxfp4-tokens`` with no values): that case is skipped. The torch side runs with the kernels off (afd.models.layers sees none), so the experts' torch path is the
whole Python loop over F.linear.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

from afd.cli.common import alternate, print_table


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("kernels", help="native CPU kernels against the torch paths they replace")
    p.add_argument("--decode-tokens", type=int, nargs="*", default=[1, 8, 32], help="decode attention: tokens (none: skip)")
    p.add_argument("--context", type=int, nargs="+", default=[80, 1024])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 32], help="experts: tokens per call (none: skip)")
    p.add_argument("--experts", type=int, nargs=4, default=[8, 2, 256, 192], metavar=("E", "K", "H", "I"),
                   help="experts, top-k, hidden, intermediate")
    p.add_argument("--rows", type=int, nargs="*", default=[1, 8, 16], help="linears: rows of x (none: skip)")
    p.add_argument("--linears", nargs="+", default=["576x256", "384x256", "4096x256", "256x768"], metavar="NxK",
                   help="linears: weight shapes (out x in)")
    p.add_argument("--gdn-tokens", type=int, nargs="*", default=[1, 8, 32],
                   help="gated deltanet decode: tokens (sequences) per call (none: skip)")
    p.add_argument("--gdn", type=int, nargs=4, default=[32, 128, 128, 64], metavar=("H", "DK", "DV", "SLOTS"),
                   help="gated deltanet decode: value heads, key and value head sizes, state slots (Qwen3.5's layers)")
    p.add_argument("--mxfp4-experts", type=int, nargs=4, default=[8, 4, 2880, 2880], metavar=("E", "K", "H", "I"),
                   help="MXFP4 keep vs dequantize: experts, top-k, hidden, intermediate (gpt-oss's 2880 x 2880)")
    p.add_argument("--mxfp4-tokens", type=int, nargs="*", default=[1, 8], help="MXFP4: tokens per call (none: skip)")
    p.add_argument("--int8-rows", type=int, nargs="*", default=[1, 8, 32, 512, 2048],
                   help="W8A8 linear (afd/models/int8.py): rows of x, decode and prefill sizes (none: skip)")
    p.add_argument("--int8-linears", nargs="+", default=["2816x2048", "2048x1408"], metavar="NxK",
                   help="W8A8 linear shapes (default: a DeepSeek-V2-Lite expert's gate_up and down)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's own choice)")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--json", dest="json_out", help="write the results as JSON to this file")
    p.set_defaults(func=run)


@contextlib.contextmanager
def _torch_only():
    """The models' layers without the native kernels (what AFD_KERNELS=0 runs)."""
    from afd.models import layers

    native = layers.native_ops
    layers.native_ops = lambda: None
    try:
        yield
    finally:
        layers.native_ops = native


def _decode_case(d: int, context: int, heads: int, dtype: torch.dtype, runs: int):
    from afd.kvcache import BlockManager, SeqChunk, build_attention_metadata
    from afd.models import paged_attention as pa

    block_size = 16
    num_blocks = 4 * d * -(-context // block_size)  # a cache 4x the contexts, as a serving pool is larger than a step
    blocks = BlockManager(num_blocks, block_size)
    tables = [blocks.ensure(i, context) for i in range(d)]
    cache = torch.randn(num_blocks * block_size, 1, 576).to(dtype)
    meta = build_attention_metadata([SeqChunk(t, context - 1, 1) for t in tables], block_size)
    q = torch.randn(d, heads, 576).to(dtype)
    return alternate(lambda: pa.decode_attention(q, cache, None, meta.decode, 576**-0.5, 512),
                      lambda: pa.decode_attention_reference(q, cache, None, meta.decode, 576**-0.5, 512), runs)


def _experts_case(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, runs: int):
    from afd.models import layers

    experts = layers.GroupedExperts(e, h, i, range(e))
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    experts = experts.to(dtype)
    x = torch.randn(t, h).to(dtype)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    weights = torch.rand(t, k)
    def torch_path():
        with _torch_only():
            experts.reference(x, ids, weights)

    return alternate(lambda: experts(x, ids, weights), torch_path, runs)


def _linear_case(m: int, n: int, k: int, dtype: torch.dtype, runs: int):
    import torch.nn.functional as F

    from afd.kernels import ops

    copies = [torch.randn(n, k).to(dtype) for _ in range(max(2, (64 << 20) // (n * k * 4)))]  # > 64 MB: from memory
    x = torch.randn(m, k).to(dtype)
    turn = [0, len(copies) // 2]  # apart: neither side reads the copy the other just brought into cache

    def cycled(f, side):
        def call():
            turn[side] = (turn[side] + 1) % len(copies)
            f(x, copies[turn[side]])
        return call

    return alternate(cycled(ops().linear, 0), cycled(F.linear, 1), runs)


def _int8_case(m: int, n: int, k: int, runs: int) -> dict:
    """One W8A8 linear (x quantised per token, int8 GEMM, both scales in the epilogue) against F.linear in fp32 and
    bf16 on the same shape, each over weights cycled from memory (> 64 MB of copies: none read from cache)."""
    import statistics
    import time

    import torch.nn.functional as F

    from afd.models.int8 import int8_linear, kernel_row_bias

    count = max(2, (64 << 20) // (n * k))
    int8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(count)]
    weights = {"int8": [(w, torch.rand(n) + 0.5, None, kernel_row_bias(w)) for w in int8],  # as Int8Linear holds them
               "float32": [torch.randn(n, k) for _ in range(max(2, count // 4))], "bfloat16": [torch.randn(n, k).bfloat16() for _ in range(max(2, count // 2))]}
    x = {"int8": torch.randn(m, k), "float32": torch.randn(m, k), "bfloat16": torch.randn(m, k).bfloat16()}
    calls = {"int8": lambda w: int8_linear(x["int8"], *w), "float32": lambda w: F.linear(x["float32"], w),
             "bfloat16": lambda w: F.linear(x["bfloat16"], w)}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(runs + 1):  # in turn, the first round a warm-up
        for name, call in calls.items():
            w = weights[name][r % len(weights[name])]
            t0 = time.perf_counter()
            call(w)
            if r:
                times[name].append(time.perf_counter() - t0)
    out = {f"{name}_ms": statistics.median(t) * 1e3 for name, t in times.items()}
    out["int8_weight_gbs"] = n * k / (out["int8_ms"] * 1e-3) / 1e9
    return out


def _gdn_case(d: int, h: int, dk: int, dv: int, num_slots: int, runs: int):
    """Gated DeltaNet decode: D sequences' fp32 states in a cache of num_slots, updated in place, each side on a
    cache of its own (the same start)."""
    from afd.kernels import ops
    from afd.models.gated_deltanet import l2norm, recurrent_step

    gen = torch.Generator().manual_seed(d)
    q = l2norm(torch.randn(d, h, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(d, h, dk, generator=gen))
    v, g, beta = torch.randn(d, h, dv, generator=gen), -torch.rand(d, h, generator=gen), torch.rand(d, h, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:d]
    fresh = torch.zeros(d, dtype=torch.bool)
    native_state = torch.randn(num_slots, h, dk, dv, generator=gen) * 0.1
    torch_state = native_state.clone()

    def torch_path():  # GatedDeltaNet.forward's torch path
        s = torch_state[slots].masked_fill(fresh[:, None, None, None], 0)
        _, s = recurrent_step(q, k, v, g, beta, s)
        torch_state[slots] = s

    return alternate(lambda: ops().gdn_decode(q, k, v, g, beta, native_state, slots, fresh), torch_path, runs)


def _mxfp4_case(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, runs: int) -> dict:
    """gpt-oss experts held as MXFP4 blocks (decoded per call) against the same values decoded at load."""
    from afd.models.layers import GroupedExperts
    from afd.models.mxfp4 import dequantize_mxfp4

    gen = torch.Generator().manual_seed(t)
    kept = GroupedExperts(e, h, i, range(e), bias=True, swiglu_limit=7.0)
    gate_up = torch.randint(0, 256, (e, 2 * i, h // 32, 16), dtype=torch.uint8, generator=gen)
    down = torch.randint(0, 256, (e, h, i // 32, 16), dtype=torch.uint8, generator=gen)
    scales = [torch.randint(118, 122, (e, rows, cols // 32), dtype=torch.uint8, generator=gen) for rows, cols in ((2 * i, h), (h, i))]
    plain = GroupedExperts(e, h, i, range(e), bias=True, swiglu_limit=7.0)
    with torch.no_grad():
        for m in (kept, plain):
            m.gate_up_proj_bias.data, m.down_proj_bias.data = torch.zeros(e, 2 * i, dtype=dtype), torch.zeros(e, h, dtype=dtype)
        plain.gate_up_proj.data = dequantize_mxfp4(gate_up, scales[0], dtype)
        plain.down_proj.data = dequantize_mxfp4(down, scales[1], dtype)
    kept.gate_up_proj, kept.down_proj = (torch.nn.Parameter(b, requires_grad=False) for b in (gate_up, down))
    kept.hold_mxfp4(scales[0], scales[1], dtype)
    x = torch.randn(t, h, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=gen)
    t_keep, t_plain = alternate(lambda: kept(x, ids, w), lambda: plain(x, ids, w), runs)
    nbytes = lambda m, names: sum(getattr(m, n).numel() * getattr(m, n).element_size() for n in names)  # noqa: E731
    return {"keep_ms": t_keep * 1e3, "dequantized_ms": t_plain * 1e3,
            "keep_mib": nbytes(kept, ("gate_up_proj", "down_proj", "gate_up_proj_scales", "down_proj_scales")) / 2**20,
            "dequantized_mib": nbytes(plain, ("gate_up_proj", "down_proj")) / 2**20}


def run(args: argparse.Namespace) -> int:
    from afd.kernels import ops

    if ops() is None:
        print("afd bench kernels: the native kernels are not built here (AFD_KERNELS=0, or see the warning above)")
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows, results = [("op", "shape", "native ms", "torch ms", "torch / native")], {}
    for context in args.context:
        for d in args.decode_tokens:
            native, ref = _decode_case(d, context, args.heads, dtype, args.runs)
            results[f"decode attention D={d} L={context}"] = {"native_ms": native * 1e3, "torch_ms": ref * 1e3}
            rows.append(("decode attention", f"{d} tokens x {context} ctx, {args.heads} heads x 576", f"{native * 1e3:.3f}",
                         f"{ref * 1e3:.3f}", f"{ref / native:.2f}x"))
    e, k, h, i = args.experts
    for t in args.tokens:
        native, ref = _experts_case(t, e, k, h, i, dtype, args.runs)
        results[f"experts T={t}"] = {"native_ms": native * 1e3, "torch_ms": ref * 1e3}
        rows.append(("experts", f"{t} tokens, top-{k} of {e} ({h} x {i})", f"{native * 1e3:.3f}", f"{ref * 1e3:.3f}",
                     f"{ref / native:.2f}x"))
    for shape in args.linears:
        n, k = (int(v) for v in shape.lower().split("x"))
        for m in args.rows:
            native, ref = _linear_case(m, n, k, dtype, args.runs)
            results[f"linear M={m} N={n} K={k}"] = {"native_ms": native * 1e3, "torch_ms": ref * 1e3}
            rows.append(("linear", f"{m} rows x ({n} x {k})", f"{native * 1e3:.3f}", f"{ref * 1e3:.3f}", f"{ref / native:.2f}x"))
    h, dk, dv, num_slots = args.gdn
    for d in args.gdn_tokens:
        native, ref = _gdn_case(d, h, dk, dv, num_slots, args.runs)
        results[f"gdn decode D={d}"] = {"native_ms": native * 1e3, "torch_ms": ref * 1e3}
        rows.append(("gated deltanet decode", f"{d} tokens, {h} heads x {dk} x {dv} fp32 states, {num_slots} slots",
                     f"{native * 1e3:.3f}", f"{ref * 1e3:.3f}", f"{ref / native:.2f}x"))
    if len(rows) > 1:
        print_table(rows)
    speedups = [r["torch_ms"] / r["native_ms"] for r in results.values()]
    if args.mxfp4_tokens:
        e, k, h, i = args.mxfp4_experts
        table = [("MXFP4 experts", "keep ms", "dequantized ms", "keep / dequantized", "keep MiB", "dequantized MiB")]
        for t in args.mxfp4_tokens:
            r = _mxfp4_case(t, e, k, h, i, dtype, max(3, args.runs // 4))
            results[f"mxfp4 T={t}"] = r
            table.append((f"{t} tokens, top-{k} of {e} ({h} x {i})", f"{r['keep_ms']:.2f}", f"{r['dequantized_ms']:.2f}",
                          f"{r['keep_ms'] / r['dequantized_ms']:.2f}x", f"{r['keep_mib']:.0f}", f"{r['dequantized_mib']:.0f}"))
        print_table(table)
    if args.int8_rows:
        table = [("W8A8 linear", "int8 ms", "fp32 ms", "bf16 ms", "fp32 / int8", "bf16 / int8", "int8 weight GB/s")]
        for shape in args.int8_linears:
            n, k = (int(v) for v in shape.lower().split("x"))
            for m in args.int8_rows:
                r = _int8_case(m, n, k, args.runs)
                results[f"int8 linear M={m} N={n} K={k}"] = r
                table.append((f"{m} rows x ({n} x {k})", f"{r['int8_ms']:.3f}", f"{r['float32_ms']:.3f}", f"{r['bfloat16_ms']:.3f}",
                              f"{r['float32_ms'] / r['int8_ms']:.2f}x", f"{r['bfloat16_ms'] / r['int8_ms']:.2f}x", f"{r['int8_weight_gbs']:.1f}"))
        print_table(table)
    if speedups:
        print(f"summary: {args.dtype}, torch threads {torch.get_num_threads()}, medians of {args.runs} alternating runs: "
              f"native kernels ({ops().simd} register tiles) {min(speedups):.2f}x-{max(speedups):.2f}x the torch paths")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0
