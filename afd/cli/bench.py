"""``afd bench``: benchmarks as programs. Each prints a table and one summary line, and can write JSON.

``afd bench generate``: prefill and decode tokens/s and memory of the monolithic engine, on a
checkpoint or on a synthetic random-weight model (DeepSeek-V2-Lite- or V3-shaped; with ``--fp8`` the
synthetic model is written as an fp8 block-scaled checkpoint and loaded through the loader).
``afd bench connector``: one-way latency and bandwidth of each transport
(:mod:`afd.cli.bench_connector`).
``afd bench pipeline``: async vs sync vs monolithic on one topology (:mod:`afd.cli.bench_pipeline`).
``afd bench costs``: fits the micro-batch planner's cost model (:mod:`afd.cli.bench_costs`).
``afd bench serve``: a load generator against ``afd serve`` (:mod:`afd.cli.bench_serve`).
``afd bench sampler``: one step's sampling per option mix (:mod:`afd.cli.bench_sampler`).
``afd bench mixed``: long prompts beside decoding sequences: TTFT, decode tok/s, peak RSS (:mod:`afd.cli.bench_mixed`).
``afd bench kernels``: the native CPU kernels against the torch paths they replace (:mod:`afd.cli.bench_kernels`).
``afd bench roofline``: a model's decode bytes and prefill FLOPs against the machine's measured limits
(:mod:`afd.cli.bench_roofline`).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from datetime import date

import torch

from afd.cli.bench_models import add_model_args, load_for_bench, make_engine
from afd.cli.common import print_table

def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (print a table, optionally write JSON)")
    bsub = p.add_subparsers(dest="bench", required=True)
    g = bsub.add_parser("generate", help="prefill and decode throughput of the monolithic path")
    add_model_args(g)
    g.add_argument("--num-seqs", type=int, default=8)
    g.add_argument("--prompt-len", type=int, default=128)
    g.add_argument("--new-tokens", type=int, default=64)
    g.add_argument("--runs", type=int, default=5)
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--device", default="cpu", help="cpu (default), cuda:N or npu:N")
    g.add_argument("--json", dest="json_out", help="write the results as JSON to this file")
    g.set_defaults(func=run_generate)
    from afd.cli import (bench_attention, bench_connector, bench_costs, bench_hybrid, bench_kernels, bench_mixed, bench_pipeline,
                         bench_roofline, bench_sampler, bench_serve, bench_v4)

    bench_connector.add_parser(bsub)
    bench_pipeline.add_parser(bsub)
    bench_costs.add_parser(bsub)
    bench_serve.add_parser(bsub)
    bench_sampler.add_parser(bsub)
    bench_mixed.add_parser(bsub)
    bench_kernels.add_parser(bsub)
    bench_attention.add_parser(bsub)
    bench_hybrid.add_parser(bsub)
    bench_v4.add_parser(bsub)
    bench_roofline.add_parser(bsub)


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if not t.is_meta)


def _one_run(model, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """One batch: returns (prefill seconds, decode seconds)."""
    engine = make_engine(model, args.num_seqs, args.prompt_len, args.new_tokens, args.device, seed)
    t0 = time.perf_counter()
    engine.step()  # every prompt prefilled in one step
    t1 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def run_generate(args: argparse.Namespace) -> int:
    t_load = time.perf_counter()
    model, label = load_for_bench(args)
    t_load = time.perf_counter() - t_load
    print(f"model: {label}; loaded in {t_load:.1f} s; torch threads {torch.get_num_threads()}", file=sys.stderr)
    for i in range(args.warmup):
        _one_run(model, args, seed=10_000 + i)
    prefill, decode = [], []
    for i in range(args.runs):
        p, d = _one_run(model, args, seed=i)
        prefill.append(p)
        decode.append(d)
        print(f"run {i}: prefill {p:.3f} s, decode {d:.3f} s", file=sys.stderr)
    prefill_tokens = args.num_seqs * args.prompt_len
    decode_tokens = args.num_seqs * (args.new_tokens - 1)  # the first new token comes from the prefill step
    result = {
        "bench": "generate",
        "model": label,
        "dtype": str(model.model.embed_tokens.weight.dtype).removeprefix("torch."),
        "workload": {"num_seqs": args.num_seqs, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
        "runs": args.runs,
        "prefill_s_median": statistics.median(prefill),
        "decode_s_median": statistics.median(decode),
        "prefill_tok_s": prefill_tokens / statistics.median(prefill),
        "decode_tok_s": decode_tokens / statistics.median(decode) if decode_tokens else 0.0,
        "decode_ms_per_step": 1e3 * statistics.median(decode) / max(1, args.new_tokens - 1),
        "weights_mib": _weight_bytes(model) / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "device": args.device,
        "date": date.today().isoformat(),
    }
    rows = [
        ("phase", "tokens", "median s", "tokens/s"),
        ("prefill", str(prefill_tokens), f"{result['prefill_s_median']:.3f}", f"{result['prefill_tok_s']:.1f}"),
        ("decode", str(decode_tokens), f"{result['decode_s_median']:.3f}", f"{result['decode_tok_s']:.1f}"),
    ]
    print_table(rows)
    print(
        f"summary: {label} {result['dtype']}, {args.num_seqs} seqs x {args.prompt_len} prompt + {args.new_tokens} new, "
        f"median of {args.runs}: prefill {result['prefill_tok_s']:.1f} tok/s, decode {result['decode_tok_s']:.1f} tok/s "
        f"({result['decode_ms_per_step']:.1f} ms/step); weights {result['weights_mib']:.0f} MiB, peak RSS {result['peak_rss_mib']:.0f} MiB"
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0
