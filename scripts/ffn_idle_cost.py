"""What one FFN union costs after the FFN rank idled: the same union, its CPU time after a gap of sleep or spin.

    python scripts/ffn_idle_cost.py [MODEL] [--rows 26] [--gaps 0,0.5,2,5,20] [--reps 30] [--rounds 2]

An FFN rank's CPU per token grows when it waits longer between unions: its layers' weights are read from
further away each time (the caches and TLBs cooled meanwhile, by other processes and, on a VM, by other
guests). With 4 attention ranks on a 2-core VM the attention side is the slower one, the FFN rank idles ~3x
longer between unions than with 1, and its CPU per token rises though each union holds more rows
(docs/benchmarks.md, "Issue 30, sixth stop"). This times the FFN half of every MoE layer (router and routed
experts, as an FFN rank with the gate computes it) on ``--rows`` random rows, each call after ``gap`` ms of
``time.sleep`` (the core may halt) or of a busy loop (it may not), one thread, and prints the median CPU time
of a call per gap; the rounds alternate the gaps so that the machine's drift does not read as an effect.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from afd.cli.common import resolve_model  # noqa: E402
from afd.models.loader import load_model  # noqa: E402


def wait(gap_s: float, spin: bool) -> None:
    if not spin:
        time.sleep(gap_s)
        return
    end = time.perf_counter() + gap_s
    while time.perf_counter() < end:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model directory (default: $AFD_MODEL or the built-in model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, default=26, help="rows a union holds (default 26: 4 attention ranks' unions at 16 streams)")
    ap.add_argument("--gaps", default="0,0.5,2,5,20", help="idle gaps before each call, ms (comma list)")
    ap.add_argument("--reps", type=int, default=30, help="passes over the MoE layers per gap and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(str(resolve_model(args.model)), dtype=getattr(torch, args.dtype))[0]
    cfg = model.config
    layers = [layer for layer in range(cfg.num_layers) if cfg.is_moe_layer(layer)]
    gaps = [float(g) for g in args.gaps.split(",")]
    torch.manual_seed(0)
    xs = [torch.randn(args.rows, cfg.hidden_size, dtype=getattr(torch, args.dtype)) for _ in layers]
    cpu: dict[tuple[float, bool], list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for gap in gaps:
                for spin in ([False, True] if gap else [False]):
                    for _ in range(args.reps):
                        for layer, x in zip(layers, xs):
                            wait(gap / 1e3, spin)
                            c0 = time.thread_time()
                            model.experts(layer, x, model.router(layer, x, None))
                            cpu.setdefault((gap, spin), []).append(time.thread_time() - c0)
    base = statistics.median(cpu[(gaps[0], False)])
    print(f"{len(layers)} MoE layers, {args.rows} rows, {args.dtype}, {args.threads} thread(s); CPU per union, median of "
          f"{args.rounds * args.reps * len(layers)} calls")
    print(f"{'gap ms':>7} {'waiting':>8} {'CPU us':>8} {'x gap ' + format(gaps[0], 'g'):>10}")
    for (gap, spin), xs_ in cpu.items():
        med = statistics.median(xs_)
        print(f"{gap:7g} {'spin' if spin else 'sleep':>8} {1e6 * med:8.1f} {med / base:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
