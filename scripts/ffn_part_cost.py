"""What one work part costs an FFN rank outside its GEMMs: receiving it and answering it, warm and right after a union.

    python scripts/ffn_part_cost.py [MODEL] [--attention-ranks 1,4] [--rows 6] [--unions 400]

An FFN rank receives a part from every contributor of a union (the header parsed and checked, the tensors
copied out of the shm ring, the part kept in the union book), computes the union, and answers every part
(its rows under a header of their own). The receiving and answering are Python, per part; with 4 attention
ranks there are 4 of them per union where 1 attention rank sends 1. This runs that path in one process and
one thread over real shm links (the attention ranks' mailboxes beside the FFN rank's), once without computing
the unions and once computing the model's routed experts on each, and prints the CPU of each half per part.
Computing the union streams the layer's expert weights through the caches, so the answers right after it,
and the next union's receiving, run on cold caches: the gap between the two columns is that
(docs/benchmarks.md, "Issue 30, seventh stop").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from afd.cli.common import resolve_model  # noqa: E402
from afd.connectors.shm import ShmMailbox, create_links  # noqa: E402
from afd.connectors.wire import Header, Kind, Op, Role, TensorName, make_message, result_header  # noqa: E402
from afd.connectors.work import parse_work  # noqa: E402
from afd.ffn.unions import Unions  # noqa: E402
from afd.models.loader import load_model  # noqa: E402
from afd.types import Routing  # noqa: E402


def run(model, attention_ranks: int, rows: int, unions: int, compute: bool) -> tuple[float, float]:
    """(receive, answer): median CPU seconds per part over ``unions`` unions of ``attention_ranks`` parts."""
    cfg = model.config
    layers = [layer for layer in range(cfg.num_layers) if cfg.is_moe_layer(layer)]
    slot = 1 << 20
    with tempfile.TemporaryDirectory(prefix="afd-part-cost-") as run_dir:
        create_links(run_dir, attention_ranks, 1, 8, slot)
        ffn = ShmMailbox(run_dir, Role.FFN, 0, attention_ranks, 8, slot)
        attention = [ShmMailbox(run_dir, Role.ATTENTION, a, 1, 8, slot) for a in range(attention_ranks)]
        for box in (ffn, *attention):
            box.connect(10)
        book = Unions(ffn.name, 0, cfg)
        members = (1 << attention_ranks) - 1
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(rows, cfg.hidden_size, generator=gen)
        ids = torch.randint(0, cfg.moe.num_experts, (rows, cfg.moe.top_k), generator=gen, dtype=torch.int32)
        weights = torch.rand(rows, cfg.moe.top_k, generator=gen)
        receive, answer = [], []
        for u in range(unions):
            seq, layer = 1 + u // len(layers), layers[u % len(layers)]
            for a, box in enumerate(attention):
                header = Header(Kind.WORK, Role.ATTENTION, a, 0, layer, 0, seq, rows, Op.ROUTED, (), members=members, ffn_members=1)
                box.send(0, make_message(header, {TensorName.HIDDEN: hidden, TensorName.EXPERT_IDS: ids, TensorName.WEIGHTS: weights}))
            c0 = time.thread_time()
            whole = None
            for _ in range(attention_ranks):
                msg = ffn.recv(5.0)
                book.check(msg.header)
                whole = book.add(parse_work(msg, ffn.name), {0}) or whole
            c1 = time.thread_time()
            items = [whole[1].parts[a] for a in sorted(whole[1].parts)]
            x = torch.cat([it.hidden for it in items])
            out = model.experts(layer, x, Routing(torch.cat([it.routing.topk_ids for it in items]),
                                                  torch.cat([it.routing.topk_weights for it in items]))) if compute else x
            c2 = time.thread_time()
            for i, it in enumerate(items):
                part = out[i * rows : (i + 1) * rows]
                ffn.send_packed(it.header.src_index, result_header(it.header, 0, part), [part])
                book.owed[it.header.src_index] -= 1
            c3 = time.thread_time()
            for box in attention:
                box.recv(5.0)
            if u >= unions // 10:  # the first tenth warms up
                receive.append((c1 - c0) / attention_ranks)
                answer.append((c3 - c2) / attention_ranks)
        for box in (ffn, *attention):
            box.close()
    return statistics.median(receive), statistics.median(answer)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="model directory (default: $AFD_MODEL or the built-in model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attention-ranks", default="1,4", help="parts per union (comma list)")
    ap.add_argument("--rows", type=int, default=6, help="rows a part holds (default 6: 16 streams' decode over 4 ranks and 2 micro-batches)")
    ap.add_argument("--unions", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(str(resolve_model(args.model)), dtype=getattr(torch, args.dtype))[0]
    print(f"{args.rows} rows a part, {args.dtype}, one thread; CPU per part, median of {args.unions - args.unions // 10} unions")
    print(f"{'parts/union':>11} {'receive, warm':>14} {'answer, warm':>13} {'receive, after compute':>23} {'answer, after compute':>22}")
    with torch.inference_mode():
        for a in (int(x) for x in args.attention_ranks.split(",")):
            warm = run(model, a, args.rows, args.unions, compute=False)
            cold = run(model, a, args.rows, args.unions, compute=True)
            print(f"{a:11d} {1e6 * warm[0]:11.1f} us {1e6 * warm[1]:10.1f} us {1e6 * cold[0]:20.1f} us {1e6 * cold[1]:19.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
