"""``afd bench costs``: fit the micro-batch planner's cost model on a model, on this machine.

Times the halves of one MoE layer on the shapes steps have (batches of
sequences, decode and prefill; the FFN half fed the attention half's output),
records the FFN time per token count as a curve, and fits, by least squares,

    attention(n tokens after c cached) ~ attn_call + attn_token * n + attn_context * sum_{p=c}^{c+n-1} (p + 1)
    ffn(n tokens)                      ~ ffn_call + ffn_token * n + ffn_expert * E * (1 - (1 - k/E)^n)
    local(n tokens)                    ~ local_call + local_token * n

(seconds; the FFN's last term is the expected number of distinct routed experts n
tokens touch, i.e. the expert weights read; ``local`` is a leading dense layer's
MLP, which runs beside attention: 0 where the model has none). It times with ``--threads`` torch
threads (default 1, as one rank runs). The JSON it writes is what
``--cost-model FILE`` reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from afd.cli.common import resolve_model


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("costs", help="fit the micro-batch planner's cost model (attention/FFN per-token costs)")
    p.add_argument("model", nargs="?")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads while timing (default 1: as one rank runs)")
    p.add_argument("--json", dest="json_out", help="write the fitted coefficients here (for --cost-model)")
    p.set_defaults(func=run)


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit(model, repeats: int = 5, threads: int | None = 1) -> dict:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _fit(model, repeats)
    finally:
        torch.set_num_threads(before)


@torch.inference_mode()
def _fit(model, repeats: int) -> dict:
    """Time one MoE layer's halves on the shapes steps have: S sequences x n new tokens after c cached
    (decode and prefill batches), the FFN fed the attention half's real output."""
    from afd.config import CacheConfig
    from afd.kvcache import PagedKVCache, build_attention_metadata, make_blocks
    from afd.microbatch.learn import nonnegative_least_squares

    cfg = model.config
    layer = next((i for i in cfg.moe.layers if i not in cfg.moe.hash_layers), cfg.moe.layers[0])  # a hash layer routes by token id
    dtype = model.model.embed_tokens.weight.dtype
    block = 16
    shapes = [(1, 1, 128), (8, 1, 128), (8, 1, 512), (1, 64, 0), (1, 256, 256), (4, 128, 0), (8, 128, 0), (1, 512, 0)]
    longest = max(n + c for _, n, c in shapes)
    num_seqs = max(s for s, _, _ in shapes)
    num_blocks = num_seqs * (longest // block + 1)
    window = num_blocks if cfg.compressed is not None else 0  # DeepSeek-V4 keeps its window in a pool of its own
    blocks = make_blocks(num_blocks, block, False, window, cfg.sliding_window or 0)
    layouts = model.cache_layouts()
    cache = PagedKVCache(CacheConfig(block, num_blocks, num_window_blocks=window), 1, model.kv_layout(), dtype,
                         layouts=None if layouts is None else [layouts[layer]])
    for s in range(num_seqs):
        blocks.ensure(s, longest)
    gen = torch.Generator().manual_seed(0)

    def batch(seqs: int, n: int, c: int):
        meta = build_attention_metadata([blocks.chunk(s, c, n) for s in range(seqs)], block, windows=cfg.windows if window else (),
                                        rates=cfg.compression_rates)
        return meta, model.embed(torch.randint(cfg.vocab_size, (seqs * n,), generator=gen))  # the layer input (V4: its streams)

    rows, t_attn = [], []
    for seqs, n, c in shapes:
        meta, x = batch(seqs, n, c)
        t_attn.append(_median_time(lambda: model.attention(layer, x, meta, cache.layer(0)), repeats))
        rows.append([1.0, seqs * n, seqs * (n * c + n * (n + 1) / 2)])  # a per-call constant, so overhead is not per-token cost
    a = torch.tensor(rows, dtype=torch.float64)
    coef = torch.linalg.lstsq(a, torch.tensor(t_attn, dtype=torch.float64).unsqueeze(1)).solution.flatten()
    e, k = cfg.moe.num_experts, cfg.moe.top_k
    curve, ns = [], (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    for n in ns:  # decode batches (n sequences x 1) up to 8, then 8 sequences x n/8
        meta, x = batch(n, 1, 128) if n <= 8 else batch(8, n // 8, 0)
        ffn_input = model.attention(layer, x, meta, cache.layer(0)).ffn_input
        curve.append((n, _median_time(lambda: model.ffn(layer, ffn_input), repeats)))
    local_call = local_token = 0.0
    dense = next((i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)), None)
    if dense is not None and dense < cfg.moe.layers[0]:  # a leading dense layer: what --dense-on attention runs there
        times, local_ns = [], (1, 16, 128, 512)
        for n in local_ns:
            meta, x = batch(n, 1, 128) if n <= 8 else batch(8, n // 8, 0)
            ffn_input = model.attention(layer, x, meta, cache.layer(0)).ffn_input  # the MLP's input: any layer's will do
            times.append(_median_time(lambda: model.dense_mlp(dense, ffn_input), repeats))
        local_call, local_token = nonnegative_least_squares([(1.0, float(n)) for n in local_ns], times)
    touched = [e * (1 - (1 - k / e) ** n) for n in ns]
    f = torch.linalg.lstsq(torch.tensor([[1.0, n, t] for n, t in zip(ns, touched)], dtype=torch.float64),
                           torch.tensor([t for _, t in curve], dtype=torch.float64).unsqueeze(1)).solution.flatten()
    # the per-call and per-expert terms do not move the planner's cut (every micro-batch pays them once);
    # they, or the measured curve, decide how many micro-batches a step is worth (--num-microbatches auto)
    return {"attn_token": max(float(coef[1]), 0.0), "attn_context": max(float(coef[2]), 0.0), "ffn_token": max(float(f[1]), 1e-12),
            "attn_call": max(float(coef[0]), 0.0), "ffn_call": max(float(f[0]), 0.0), "ffn_expert": max(float(f[2]), 0.0),
            "ffn_curve": [[n, t] for n, t in curve], "local_token": local_token, "local_call": local_call}


def run(args: argparse.Namespace) -> int:
    from afd.models import load_model

    model_dir = resolve_model(args.model)
    model, _ = load_model(model_dir, dtype=args.dtype)
    coef = fit(model, args.repeats, args.threads)
    ratio = coef["ffn_token"] / coef["attn_token"] if coef["attn_token"] else float("inf")
    print(f"attn_token    {1e6 * coef['attn_token']:.2f} us/token")
    print(f"attn_context  {1e9 * coef['attn_context']:.3f} ns/(token x context token)")
    print(f"ffn_token     {1e6 * coef['ffn_token']:.2f} us/token")
    print(f"per call      attention {1e3 * coef['attn_call']:.2f} ms, FFN {1e3 * coef['ffn_call']:.2f} ms")
    print(f"ffn_expert    {1e6 * coef['ffn_expert']:.1f} us per distinct routed expert touched")
    print("ffn measured  " + ", ".join(f"{n}: {1e3 * t:.1f}" for n, t in coef["ffn_curve"]) + " (tokens: ms; used by auto)")
    if coef["local_token"] or coef["local_call"]:
        print(f"local layer   {1e6 * coef['local_token']:.2f} us/token + {1e3 * coef['local_call']:.2f} ms per call "
              "(a leading dense layer's MLP, beside attention)")
    print(f"summary: {model_dir}: one MoE layer, ffn/attention per-token cost ratio {ratio:.2f}; use with --cost-model")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(coef, f, indent=2)
    return 0
