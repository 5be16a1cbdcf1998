"""``afd bench sampler``: one step's sampling (everything before the draw, then each request's draw)
for S requests over a vocabulary of V, per option mix, on random logits. Medians of ``--runs``."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from afd.cli.common import print_table
from afd.config import SamplingParams

MIXES = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy + penalties": SamplingParams(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5),
    "temperature 1": SamplingParams(temperature=1.0),
    "top_k 50": SamplingParams(temperature=0.8, top_k=50),
    "top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "everything": SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5,
                                 logit_bias=((5, 1.0),)),
}


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("sampler", help="time of one step's sampling per option mix (batched processing + per-request draws)")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--vocab", type=int, nargs="+", default=[2000, 102400], help="vocabulary sizes (default: built-in, DeepSeek-V2)")
    p.add_argument("--history", type=int, default=200, help="prompt and output tokens each request has seen (penalties)")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--json", dest="json_out", help="write the results as JSON to this file")
    p.set_defaults(func=run)


class _Row:
    def __init__(self, params: SamplingParams, history: int, vocab: int, seed: int) -> None:
        from afd.engine.sampling import PenaltyState, make_generator

        self.params, self.generator = params, make_generator(seed)
        self.prompt_ids = list(range(history))
        self.output_ids = list(range(history, 2 * history))
        self.penalty = PenaltyState.start(self.prompt_ids, self.output_ids, vocab) if params.has_penalties else None


def run(args: argparse.Namespace) -> int:
    from afd.engine.sampling import sample

    rows_out, results = [("V", "mix", f"ms / step ({args.num_seqs} requests)")], {}
    for vocab in args.vocab:
        logits = torch.randn(args.num_seqs, vocab, generator=torch.Generator().manual_seed(0)) * 3
        for name, params in MIXES.items():
            rows = [_Row(params, args.history, vocab, i) for i in range(args.num_seqs)]
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                sample(logits, rows, frozenset({1}))
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            results[f"{vocab} {name}"] = ms
            rows_out.append((str(vocab), name, f"{ms:.2f}"))
    print_table(rows_out)
    print(f"summary: sampling {args.num_seqs} requests, torch threads {torch.get_num_threads()}, medians of {args.runs}: "
          + ", ".join(f"V={v} greedy {results[f'{v} greedy']:.1f} ms, top_p {results[f'{v} top_p 0.9']:.1f} ms" for v in args.vocab))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0
