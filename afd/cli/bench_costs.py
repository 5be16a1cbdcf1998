"""``afd bench costs``: fit the micro-batch planner's cost model on a model, on this machine.

Times the halves of one MoE layer on synthetic chunks and fits, by least
squares,

    attention(n tokens after c cached) ~ attn_call + attn_token * n + attn_context * sum_{p=c}^{c+n-1} (p + 1)
    ffn(n tokens)                      ~ ffn_call + ffn_token * n + ffn_expert * E * (1 - (1 - k/E)^n)

(seconds; the last term is the expected number of distinct routed experts n
tokens touch, i.e. the expert weights read). It times with ``--threads`` torch
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


def fit(model, repeats: int = 5, threads: int | None = 1) -> dict[str, float]:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _fit(model, repeats)
    finally:
        torch.set_num_threads(before)


@torch.inference_mode()
def _fit(model, repeats: int) -> dict[str, float]:
    from afd.config import CacheConfig
    from afd.kvcache import BlockManager, PagedKVCache, SeqChunk, build_attention_metadata

    cfg = model.config
    layer = cfg.moe.layers[0]
    dtype = model.model.embed_tokens.weight.dtype
    block = 16
    shapes = [(n, c) for n in (16, 64, 256) for c in (0, 256, 768)]
    need = max(n + c for n, c in shapes)
    blocks = BlockManager(need // block + 2, block)
    table = blocks.ensure(0, need)
    cache = PagedKVCache(CacheConfig(block, need // block + 2), 1, model.kv_layout(), dtype)
    rows, t_attn = [], []
    for n, c in shapes:
        meta = build_attention_metadata([SeqChunk(table, c, n)], block)
        x = torch.randn(n, cfg.hidden_size).to(dtype)
        t_attn.append(_median_time(lambda: model.attention(layer, x, meta, cache.layer(0)), repeats))
        rows.append([1.0, n, n * c + n * (n + 1) / 2])  # a per-call constant, so overhead is not taken for per-token cost
    a = torch.tensor(rows, dtype=torch.float64)
    coef = torch.linalg.lstsq(a, torch.tensor(t_attn, dtype=torch.float64).unsqueeze(1)).solution.flatten()
    e, k = cfg.moe.num_experts, cfg.moe.top_k
    t_ffn, ns = [], (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    for n in ns:
        x = torch.randn(n, cfg.hidden_size).to(dtype)
        t_ffn.append(_median_time(lambda: model.ffn(layer, x), repeats))
    touched = [e * (1 - (1 - k / e) ** n) for n in ns]
    f = torch.linalg.lstsq(torch.tensor([[1.0, n, t] for n, t in zip(ns, touched)], dtype=torch.float64),
                           torch.tensor(t_ffn, dtype=torch.float64).unsqueeze(1)).solution.flatten()
    # the per-call and per-expert terms do not move the planner's cut (every micro-batch pays them once);
    # they decide how many micro-batches a step is worth (--num-microbatches auto)
    return {"attn_token": max(float(coef[1]), 0.0), "attn_context": max(float(coef[2]), 0.0), "ffn_token": max(float(f[1]), 1e-12),
            "attn_call": max(float(coef[0]), 0.0), "ffn_call": max(float(f[0]), 0.0), "ffn_expert": max(float(f[2]), 0.0)}


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
    print(f"summary: {model_dir}: one MoE layer, ffn/attention per-token cost ratio {ratio:.2f}; use with --cost-model")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(coef, f, indent=2)
    return 0
