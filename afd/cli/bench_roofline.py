"""``afd bench roofline``: how far a model's decode and prefill run from this machine's limits.

The machine, measured by the command itself on torch's threads (both cores here):

* **read bandwidth**: a reduction over a buffer far larger than the last-level cache (``torch.sum`` of float32:
  one load per 4 bytes, vectorised, on every thread), median of ``--runs``;
* **GEMM peak per dtype**: the best large square matmul torch has for it (float32: MKL; bfloat16: oneDNN; int8:
  oneDNN's, as ``torch._int_mm`` and as a quantised linear on a prepacked weight), sizes 1024-4096, median of
  ``--runs`` each, the best size kept. A dtype is marked native where the CPU has the instructions for it
  (bfloat16: AVX512-BF16 or AMX-BF16; int8: VNNI or AMX-INT8); elsewhere its peak is an emulation's.

The model (a checkpoint, the built-in one, or a synthetic DeepSeek-V2-Lite/V3-shaped one, as ``afd bench generate``):

* **decode** at each ``--batch``: the bytes one step reads, counted, against the step's time. Every parameter
  but the embedding table and the routed experts (which every step reads whole: attention, dense and shared MLPs,
  routers, norms, the LM head); the routed experts the step's tokens touched (counted per step from the experts'
  own counters, ``GroupedExperts.tokens_routed``); the KV cache each sequence attends over (its context x the
  bytes a token holds). Achieved fraction = bytes / step time / the read bandwidth a probe measured just before
  that step (each step has its own: a shared VM's bandwidth moves between minutes); medians over the decode steps.
* **prefill** of each ``--prefill-tokens`` M (sequences of ``--prefill-len``, one step): the FLOPs of the linear
  layers, 2 x rows x in x out for every weight the tokens pass (attention's, the dense MLP's, shared experts', the
  router's, top-k routed experts' per token, the LM head's for one row per sequence). Attention's own T^2 term
  is not counted (at ``--prefill-len`` 512 it is a few percent of a MoE layer's). Achieved fraction = FLOPs /
  time / the GEMM peak of the dtype the model's linears compute in (int8 for a W8A8 checkpoint). Then one more
  step under forward hooks, by phase (afd/cli/roofline_phases.py): attention projections, attention core, dense
  MLP, shared and routed experts, router, LM head, norms, other; each GEMM phase's rate against the peak and
  against its own roofline bound, min(peak, FLOP/byte x bandwidth), which is the bandwidth's for routed experts
  that get few rows each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from afd.cli.bench_models import add_model_args, kv_bytes_per_token, load_for_bench, make_engine
from afd import env
from afd.cli.common import cpu_features, instruction_sets, print_table
from afd.cli.roofline_phases import PhaseTimer, gemm_totals, phase_rows


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("roofline", help="bytes and FLOPs a model's decode and prefill need, against the machine's measured limits")
    add_model_args(p)
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8], help="decode batch sizes (none: skip decode)")
    p.add_argument("--context", type=int, default=64, help="decode: each sequence's prompt before the steps are timed")
    p.add_argument("--steps", type=int, default=12, help="decode steps timed per batch (after 2 untimed)")
    p.add_argument("--prefill-tokens", type=int, nargs="*", default=[512, 2048], help="prefill step sizes (none: skip prefill)")
    p.add_argument("--prefill-len", type=int, default=512, help="prefill: tokens per sequence")
    p.add_argument("--runs", type=int, default=5, help="repetitions of each machine probe and of each prefill step")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="the read probe's buffer")
    p.add_argument("--gemm-sizes", type=int, nargs="+", default=[1024, 2048, 4096], help="the GEMM probe's square sizes")
    p.add_argument("--json", dest="json_out", help="write the results as JSON to this file")
    p.set_defaults(func=run)


#: besides AFD_KERNELS_MARCH (afd's kernels), what makes this run use fewer instructions than the CPU has (an
#: AVX2 machine measured on a newer one): oneDNN's, MKL's and ATen's own dispatch
LIMITS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def instruction_limits() -> dict[str, str]:
    march = env.kernels_march()
    return {**({"AFD_KERNELS_MARCH": march} if march != "native" else {}), **{k: os.environ[k] for k in LIMITS if os.environ.get(k)}}


def native_dtypes(flags: set[str]) -> dict[str, bool]:
    return {"float32": True, "bfloat16": bool(flags & {"avx512_bf16", "amx_bf16"}),
            "int8": bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})}


def _median_s(fn, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class ReadProbe:
    """Bytes/s of a vectorised read over ``mib`` MiB on torch's threads (a buffer larger than the last-level cache:
    it also leaves no weights cached for the step timed after it)."""

    def __init__(self, mib: int) -> None:
        self.buf = torch.ones(mib << 18)  # float32: mib MiB

    def once(self) -> float:
        t0 = time.perf_counter()
        self.buf.sum()
        return self.buf.numel() * 4 / (time.perf_counter() - t0)

    def median(self, runs: int) -> float:
        self.once()  # warm-up
        return statistics.median(self.once() for _ in range(runs))


PROBE_BUDGET_S = 30.0  # the most one GEMM probe (one way of one dtype) may take over its sizes


def gemm_peak(dtype: str, runs: int, sizes: list[int], budget_s: float = PROBE_BUDGET_S) -> tuple[float, int]:
    """(FLOP/s, n) of the best n x n x n matmul torch has for ``dtype``: for int8, the better of oneDNN's GEMM as
    ``torch._int_mm`` runs it (the weight packed per call) and oneDNN's quantised linear on a weight packed once
    (``onednn.qlinear_prepack``, where torch has it: AMX-INT8 or VNNI kernels). Sizes ascend; a size whose timing
    would take a probe past ``budget_s`` at the speed the last size ran is skipped, and said so (a CPU where one
    way is slow -- oneDNN's quantised linear on an AMD EPYC ran minutes a call at n=4096 -- must not stall the
    command)."""
    best = (0.0, 0)
    for name, make in _gemm_probes(dtype):
        spent, speed = 0.0, None
        for n in sorted(sizes):
            if speed is not None and spent + (runs + 1) * 2 * n**3 / speed > budget_s:
                print(f"GEMM peak {dtype} ({name}): n={n} skipped: ~{2 * n**3 / speed:.1f} s a call at this CPU's "
                      f"{speed / 1e9:.3g} GFLOP/s (the probe's budget is {budget_s:.0f} s)", file=sys.stderr, flush=True)
                break
            fn = make(n)
            if fn is None:
                break
            t0 = time.perf_counter()
            t = _median_s(fn, runs)
            spent += time.perf_counter() - t0
            speed = 2 * n**3 / t
            best = max(best, (speed, n))
    return best


def _gemm_probes(dtype: str):
    """(name, n -> a call of an n x n x n product, or None where torch lacks it) for each way torch multiplies ``dtype``."""
    if dtype != "int8":
        def matmul(n):
            a, b = torch.randn(n, n).to(getattr(torch, dtype)), torch.randn(n, n).to(getattr(torch, dtype))
            return lambda: a @ b

        return [("matmul", matmul)]

    def int_mm(n):
        a, b = torch.randint(-127, 128, (n, n), dtype=torch.int8), torch.randint(-127, 128, (n, n), dtype=torch.int8)
        return lambda: torch._int_mm(a, b)

    def qlinear(n):
        a, b = torch.randint(-127, 128, (n, n), dtype=torch.int8), torch.randint(-127, 128, (n, n), dtype=torch.int8)
        packed = _qlinear_packed(b.t().contiguous(), n)
        if packed is None:
            return None
        scale, zero = torch.ones(n), torch.zeros(n, dtype=torch.int32)
        return lambda: torch.ops.onednn.qlinear_pointwise(a, 1.0, 0, packed, scale, zero, None, 1.0, 0, torch.float32, "none", [], "")

    return [("torch._int_mm", int_mm), ("oneDNN qlinear, packed once", qlinear)]


def _qlinear_packed(weight: torch.Tensor, rows: int):
    try:
        return torch.ops.onednn.qlinear_prepack(weight, [rows, weight.shape[1]])
    except (AttributeError, RuntimeError):
        return None


class Counts:
    """What a model's steps read and compute, from its modules."""

    def __init__(self, model) -> None:
        from afd.models.layers import GroupedExperts

        self.model = model
        self.experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        held = {id(p) for m in self.experts for p in m.parameters()}
        embed = model.model.embed_tokens.weight
        tied = model.lm_head.weight is embed
        self.always_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                                if id(p) not in held and (p is not embed or tied))
        # bytes of one routed expert of each GroupedExperts (its weights, scales and biases split evenly)
        self.expert_bytes = [sum(p.numel() * p.element_size() for p in m.parameters()) / max(1, len(m.expert_ids)) for m in self.experts]
        self.lm_head_values = model.config.vocab_size * model.config.hidden_size
        # linear values every token passes (2-D weights outside the routed experts, the LM head and the embedding)
        head = {id(model.lm_head.weight), id(embed)}
        self.per_token_values = sum(p.numel() for p in model.parameters() if id(p) not in held and id(p) not in head and p.dim() == 2)
        moe = model.config.moe
        self.routed_values = sum(3 * m.down_proj.shape[1] * m.intermediate_size for m in self.experts[:1]) * (moe.top_k if moe else 0)
        self.moe_layers = len(self.experts)

    def snapshot(self) -> list[list[int]]:
        return [list(m.tokens_routed) for m in self.experts]

    def touched_bytes(self, before: list[list[int]], after: list[list[int]]) -> float:
        """Bytes of the routed experts that computed rows between two snapshots."""
        return sum(size * sum(1 for b, a in zip(bs, as_) if a > b) for size, bs, as_ in zip(self.expert_bytes, before, after))

    def prefill_flops(self, tokens: int, sequences: int) -> float:
        return 2.0 * (tokens * (self.per_token_values + self.moe_layers * self.routed_values) + sequences * self.lm_head_values)


def _engine(model, num_seqs: int, prompt_len: int, new_tokens: int):
    return make_engine(model, num_seqs, prompt_len, new_tokens, "cpu", seed=0)


def decode(model, counts: Counts, batch: int, context: int, steps: int, probe: ReadProbe) -> dict:
    """Each timed step right after a read probe of its own: its fraction is against the bandwidth of that moment
    (a shared VM's bandwidth moves by 20 % within minutes), and no weight is left in the cache for it."""
    engine = _engine(model, batch, context, steps + 3)
    engine.step()  # the prefill
    engine.step(), engine.step()  # untimed
    per_token = kv_bytes_per_token(model)
    times, weights, kv, bandwidths = [], [], [], []
    for i in range(steps):
        before = counts.snapshot()
        bandwidths.append(probe.once())
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        weights.append(counts.always_bytes + counts.touched_bytes(before, counts.snapshot()))
        kv.append(batch * (context + 3 + i) * per_token)
    while engine.has_unfinished():
        engine.step()
    fractions = [(w + k) / t / bw for w, k, t, bw in zip(weights, kv, times, bandwidths)]
    return {"batch": batch, "weight_bytes": statistics.median(weights), "kv_bytes": statistics.median(kv),
            "step_s": statistics.median(times), "fraction": statistics.median(fractions),
            "bandwidth_gb_s": statistics.median(bandwidths) / 1e9,
            "gb_s": statistics.median([(w + k) / t for w, k, t in zip(weights, kv, times)]) / 1e9}


def prefill(model, counts: Counts, tokens: int, length: int, runs: int, peak: float, bandwidth: float) -> dict:
    """The step's time (median of ``runs`` after one untimed), then one more step under the phase hooks
    (afd/cli/roofline_phases.py): where its time went, each GEMM phase against its own roofline bound."""
    sequences = max(1, tokens // length)
    times = []
    for i in range(runs + 2):
        engine = _engine(model, sequences, length, 1)
        timer = PhaseTimer(model) if i == runs + 1 else None
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        if timer is not None:
            phases = timer.close(times[-1])
        while engine.has_unfinished():
            engine.step()
    seconds = statistics.median(times[1:-1])
    flops = counts.prefill_flops(sequences * length, sequences)
    return {"tokens": sequences * length, "sequences": sequences, "gflop": flops / 1e9, "step_s": seconds,
            "gflop_s": flops / seconds / 1e9, "fraction": flops / seconds / peak,
            "phases": phase_rows(phases, times[-1], peak, bandwidth), "gemms": gemm_totals(phases, peak, bandwidth)}


def compute_dtype(model) -> str:
    from afd.models.int8 import Int8Linear

    if any(isinstance(m, Int8Linear) for m in model.modules()) or any(getattr(m, "int8", False) for m in Counts(model).experts):
        return "int8"
    return str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")


def run(args: argparse.Namespace) -> int:
    flags = cpu_features()
    native = native_dtypes(flags)
    limits = instruction_limits()
    print(f"machine: {instruction_sets(flags)}; torch threads {torch.get_num_threads()}"
          + (f"; limited to: {' '.join(f'{k}={v}' for k, v in limits.items())}" if limits else ""), file=sys.stderr, flush=True)
    probe = ReadProbe(args.bandwidth_mib)
    bandwidth = probe.median(args.runs)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; timing the GEMM peaks ({', '.join(native)}; sizes {args.gemm_sizes})",
          file=sys.stderr, flush=True)
    peaks = {d: gemm_peak(d, args.runs, args.gemm_sizes) for d in native}
    print_table([("machine", "measured", "native"),
                 ("read bandwidth", f"{bandwidth / 1e9:.1f} GB/s", "-"),
                 *[(f"GEMM peak {d}", f"{p / 1e9:.0f} GFLOP/s (n={n})", "yes" if native[d] else "no") for d, (p, n) in peaks.items()]])
    model, label = load_for_bench(args)
    counts = Counts(model)
    dtype = compute_dtype(model)
    print(f"model: {label}; compute dtype {dtype}; weights read every step {counts.always_bytes / 1e6:.0f} MB, "
          f"a routed expert {max(counts.expert_bytes, default=0) / 1e6:.1f} MB", file=sys.stderr, flush=True)
    decodes = [decode(model, counts, b, args.context, args.steps, probe) for b in args.batch]
    prefills = [prefill(model, counts, m, args.prefill_len, args.runs, peaks[dtype][0], bandwidth) for m in args.prefill_tokens]
    if decodes:
        print_table([("decode batch", "weights MB", "KV MB", "step ms", "GB/s", "probe GB/s", "of bandwidth"),
                     *[(str(d["batch"]), f"{d['weight_bytes'] / 1e6:.0f}", f"{d['kv_bytes'] / 1e6:.1f}", f"{1e3 * d['step_s']:.1f}",
                        f"{d['gb_s']:.1f}", f"{d['bandwidth_gb_s']:.1f}", f"{d['fraction']:.2f}x") for d in decodes]])
    if prefills:
        print_table([("prefill tokens", "GFLOP", "step s", "GFLOP/s", f"of {dtype} peak"),
                     *[(f"{p['tokens']} ({p['sequences']} seq)", f"{p['gflop']:.1f}", f"{p['step_s']:.3f}", f"{p['gflop_s']:.0f}",
                        f"{p['fraction']:.2f}x") for p in prefills]])
    for p in prefills:
        g = p["gemms"]
        print(f"prefill {p['tokens']}, one step by phase (hooks): GEMMs {g['gflop_s']:.0f} GFLOP/s, {g['of_peak']:.2f}x of the "
              f"{dtype} peak, {g['of_bound']:.2f}x of their roofline bounds", file=sys.stderr)
        print_table([("phase", "ms", "share", "GFLOP", "GFLOP/s", "FLOP/byte", "bound GFLOP/s", "of peak", "of bound"),
                     *[(r["phase"], f"{r['ms']:.1f}", f"{r['share']:.0%}", *((f"{r['gflop']:.1f}", f"{r['gflop_s']:.0f}", f"{r['flop_per_byte']:.0f}",
                        f"{r['bound_gflop_s']:.0f}", f"{r['of_peak']:.2f}x", f"{r['of_bound']:.2f}x") if "gflop" in r else ("-",) * 6))
                       for r in p["phases"]]])
    parts = [f"decode b={d['batch']} {d['fraction']:.2f}x of {d['bandwidth_gb_s']:.1f} GB/s" for d in decodes]
    parts += [f"prefill {p['tokens']} {p['fraction']:.2f}x of {peaks[dtype][0] / 1e9:.0f} GFLOP/s ({dtype}; its GEMMs "
              f"{p['gemms']['of_peak']:.2f}x, {p['gemms']['of_bound']:.2f}x of their bounds)" for p in prefills]
    print(f"summary: {label} ({instruction_sets(flags)}): " + "; ".join(parts))
    if args.json_out:
        result = {"bench": "roofline", "model": label, "compute_dtype": dtype, "instruction_sets": instruction_sets(flags), "limited_to": limits,
                  "threads": torch.get_num_threads(), "read_bandwidth_gb_s": bandwidth / 1e9,
                  "gemm_peak_gflop_s": {d: p / 1e9 for d, (p, _) in peaks.items()}, "native": native,
                  "decode": decodes, "prefill": prefills}
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0
