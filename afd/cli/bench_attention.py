"""``afd bench attention``: what 2026's attention saves, measured in one process.

* **DeepSeek Sparse Attention** (DeepSeek-V3.2's shapes by default: 128 heads on MLA's 512 + 64 latent, an
  indexer of 64 heads x 128, top-2048): one layer's decode at each context, over one paged cache. Dense:
  the absorbed MLA decode over every position (afd's native kernel). Sparse: the indexer's scores and top-k
  over the cached index keys, then the same decode over the selected positions only. The two alternate;
  medians of ``--runs`` and their ratio. The projections, alike in both, are left out.
* **Sliding windows** (gpt-oss-120b's shapes by default: 36 layers, half of them sliding over 128
  tokens, 8 KV heads of 64): the KV bytes one sequence holds at each context, counted from the block
  managers of a one-pool engine and a window-pool engine driven through the same steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from afd.cli.common import alternate, print_table


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("attention", help="DeepSeek Sparse Attention against dense MLA; sliding-window KV bytes")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536], help="DSA: decode contexts")
    p.add_argument("--decode-tokens", type=int, default=1, help="DSA: decode tokens per step")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--index", type=int, nargs=3, default=[64, 128, 2048], metavar=("HEADS", "DIM", "TOPK"))
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--window-contexts", type=int, nargs="+", default=[8192], help="windows: sequence lengths")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--json", dest="json_out", help="write the results as JSON to this file")
    p.set_defaults(func=run)


def _dsa_case(context: int, d: int, heads: int, index: tuple[int, int, int], dtype: torch.dtype, runs: int) -> dict:
    from afd.kvcache import BlockManager, SeqChunk, build_attention_metadata
    from afd.models.paged_attention import decode_attention
    from afd.models.sparse_attention import decode_topk, gathered

    latent, rope, block = 512, 64, 64
    index_heads, index_dim, topk = index
    gen = torch.Generator().manual_seed(context)
    blocks = BlockManager(d * (-(-context // block)) + 1, block)
    tables = [blocks.ensure(i, context) for i in range(d)]
    slots = blocks.num_blocks * block
    cache = (torch.randn(slots, latent + rope, generator=gen) * 0.5).to(dtype)
    index_cache = torch.randn(slots, index_dim, generator=gen).to(dtype)
    meta = build_attention_metadata([SeqChunk(t, context - 1, 1) for t in tables], block)
    query = (torch.randn(d, heads, latent + rope, generator=gen) * 0.05).to(dtype)
    q_index = torch.randn(d, index_heads, index_dim, generator=gen)
    weights = torch.randn(d, index_heads, generator=gen)
    scale = (128 + rope) ** -0.5

    def dense():
        decode_attention(query, cache[:, None, :], None, meta.decode, scale, latent)

    def sparse():
        compact, pages = gathered(cache, *decode_topk(q_index, weights, index_cache, meta.decode, topk), meta.decode.rows)
        decode_attention(query, compact[:, None, :], None, pages, scale, latent)

    t_dense, t_sparse = alternate(dense, sparse, runs)
    t_index, _ = alternate(lambda: decode_topk(q_index, weights, index_cache, meta.decode, topk), lambda: None, runs)
    return {"context": context, "decode_tokens": d, "dense_ms": t_dense * 1e3, "sparse_ms": t_sparse * 1e3,
            "indexer_ms": t_index * 1e3, "ratio": t_sparse / t_dense}


def _window_case(context: int, window: int) -> dict:
    """KV bytes of one sequence at ``context`` tokens: gpt-oss-120b's cache entry (8 KV heads x 64, k and v,
    bf16) over 36 layers, 18 of them sliding; one pool against a window pool, blocks counted by the managers."""
    from afd.kvcache import BlockManager, WindowedBlocks

    block, layers, sliding = 16, 36, 18
    entry = 2 * 8 * 64 * 2  # bytes per token per layer
    one = BlockManager(-(-context // block) + 1, block)
    two = WindowedBlocks(BlockManager(-(-context // block) + 1, block), BlockManager(-(-(window + 512) // block) + 2, block), window)
    step = 512  # prefill in chunks, then the sequence is at ``context``
    for start in range(0, context, step):
        n = min(step, context - start)
        one.ensure(0, start + n)
        two.advance(0, start)
        two.ensure(0, start + n)
    two.advance(0, context)  # the next decode token's view
    full_one = len(one.table(0)) * block * entry * layers
    held = len([b for b in two.window_table(0) if b is not None])
    full_two = (len(two.table(0)) * (layers - sliding) + held * sliding) * block * entry
    return {"context": context, "window": window, "one_pool_bytes": full_one, "window_pool_bytes": full_two,
            "window_blocks_held": held, "ratio": full_two / full_one}


def run(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    results = {"dsa": [], "windows": []}
    rows = [("context", "decode tokens", "dense ms", "sparse ms", "of which indexer ms", "sparse/dense")]
    for context in args.contexts:
        r = _dsa_case(context, args.decode_tokens, args.heads, tuple(args.index), dtype, args.runs)
        results["dsa"].append(r)
        rows.append((str(context), str(r["decode_tokens"]), f"{r['dense_ms']:.2f}", f"{r['sparse_ms']:.2f}",
                     f"{r['indexer_ms']:.2f}", f"{r['ratio']:.3f}x"))
        print(f"  DSA context {context}: sparse/dense {r['ratio']:.3f}x", flush=True)
    print(f"DeepSeek Sparse Attention, one layer's decode ({args.heads} heads, MLA 512 + 64, indexer "
          f"{args.index[0]} x {args.index[1]}, top-{args.index[2]}, {args.dtype}; median of {args.runs}):")
    print_table(rows)
    rows = [("context", "window", "one pool MiB", "window pool MiB", "window blocks held", "ratio")]
    for context in args.window_contexts:
        r = _window_case(context, args.window)
        results["windows"].append(r)
        rows.append((str(context), str(r["window"]), f"{r['one_pool_bytes'] / 2**20:.1f}", f"{r['window_pool_bytes'] / 2**20:.1f}",
                     str(r["window_blocks_held"]), f"{r['ratio']:.3f}x"))
    print("Sliding windows: KV bytes of one sequence, gpt-oss-120b's cache (36 layers, 18 sliding, 8 KV heads x 64, bf16):")
    print_table(rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0
