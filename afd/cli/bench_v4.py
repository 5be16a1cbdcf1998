"""``afd bench v4``: DeepSeek-V4's compressed attention against context length, and what its cache holds.

DeepSeek-V4-Flash's shapes by default (hidden 4096; 64 query heads on one shared KV head of 512, the last 64
rotated; q_lora 1024; 8 output groups of 1024; a window of 128; CSA at rate 4 with an indexer of 64 heads x 128 and
top-512; HCA at rate 128). At each context one sequence decodes one token through one CSA and one HCA layer (the
whole attention module: projections, the compressor's write, the indexer, the attention over the window, the
entries and the sink, the grouped output), over afd's paged cache filled to that context (random weights and
cache: the time does not depend on the values); medians of ``--runs``, the two kinds alternating. Beside them,
DeepSeek-V3's absorbed MLA decode over the same context (128 heads on the 512 + 64 latent, afd's decode kernel;
its projections left out, so the V4 columns carry more work than the MLA one).

The bytes one sequence holds are counted from the model's cache layouts (afd/models/deepseek_v4.py): the full pool
grows with the context (CSA: an entry and an index key per 4 tokens; HCA: an entry per 128, kept one per block of
``--block-size``), the window pool does not (the window's keys and the compressors' pending inputs). V3's MLA keeps
576 values per token on each of its 61 layers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from afd.cli.common import alternate, print_table

FLASH = dict(model_type="deepseek_v4", vocab_size=1024, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512,
             q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512,
             moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2, compress_ratios=[0, 0] + [4, 128] * 20 + [4],
             max_position_embeddings=1 << 20)
V3_LAYERS, V3_ENTRY = 61, 512 + 64


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("v4", help="DeepSeek-V4's compressed attention (CSA, HCA) decode and cache bytes against context length")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--json", dest="json_out", help="write the results as JSON to this file")
    p.set_defaults(func=run)


def _layers(config, dtype: torch.dtype):
    from afd.models.deepseek_v4 import V4Attention

    gen = torch.Generator().manual_seed(0)
    csa, hca = (V4Attention(config, config.compressed.rates.index(r)) for r in (4, 128))
    with torch.no_grad():
        for module in (csa, hca):
            for name, p in module.named_parameters():
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.02 * noise)
            for m in module.modules():
                if isinstance(m, torch.nn.Linear):  # the projections in the compute dtype; norms, sinks, biases fp32
                    m.to(dtype)
    return csa, hca


def cache_bytes(config, context: int, block: int, dtype: torch.dtype) -> dict:
    """One sequence at ``context`` tokens: V4's full-pool and window-pool bytes (blocks x bytes per block of every
    layer's layout) against V3's MLA cache."""
    from afd.kvcache import layout_bytes
    from afd.models.deepseek_v4 import cache_layouts

    full, window = layout_bytes(cache_layouts(config), block, dtype)
    window_blocks = -(-(config.compressed.window - 1) // block) + 1  # the decode token's window
    v4 = -(-context // block) * full + window_blocks * window
    v3 = context * V3_LAYERS * V3_ENTRY * dtype.itemsize
    return {"v4_full_mb": -(-context // block) * full / 1e6, "v4_window_mb": window_blocks * window / 1e6, "v4_mb": v4 / 1e6,
            "v3_mb": v3 / 1e6, "v3_over_v4": v3 / v4}


@torch.inference_mode()
def _case(config, csa, hca, context: int, block: int, dtype: torch.dtype, runs: int) -> dict:
    from afd.config import CacheConfig
    from afd.kvcache import BlockManager, PagedKVCache, WindowedBlocks, build_attention_metadata
    from afd.models.deepseek_v4 import cache_layouts
    from afd.models.layers import RotaryEmbedding
    from afd.models.paged_attention import decode_attention

    step = 4096
    window = config.compressed.window
    blocks = WindowedBlocks(BlockManager(-(-context // block) + 1, block),
                            BlockManager(-(-(window + step) // block) + 2, block), window)
    for start in range(0, context, step):  # as a long prefill would: the window pool released behind the window
        blocks.advance(0, start)
        blocks.ensure(0, min(context, start + step))
    blocks.advance(0, context - 1)
    meta = build_attention_metadata([blocks.chunk(0, context - 1, 1)], block, windows=(window,), rates=(4, 128))
    layouts = cache_layouts(config)
    kinds = [layouts[config.compressed.rates.index(r)] for r in (4, 128)]
    cache = PagedKVCache(CacheConfig(block_size=block, num_blocks=blocks.full.num_blocks, num_window_blocks=blocks.window.num_blocks),
                         2, (), dtype, layouts=kinds)
    gen = torch.Generator().manual_seed(context)
    for layer in cache.layers:
        for t in layer:
            t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    x = torch.randn(1, config.hidden_size, generator=gen).to(dtype)
    rope = RotaryEmbedding(config.compressed.compress_rope)
    t_csa, t_hca = alternate(lambda: csa(x, meta, cache.layer(0), rope), lambda: hca(x, meta, cache.layer(1), rope), runs)

    mla_blocks = BlockManager(-(-context // 64) + 1, 64)
    mla_blocks.ensure(0, context)
    mla_meta = build_attention_metadata([mla_blocks.chunk(0, context - 1, 1)], 64)
    latent = (torch.randn(mla_blocks.num_blocks * 64, 1, V3_ENTRY, generator=gen) * 0.5).to(dtype)
    query = (torch.randn(1, 128, V3_ENTRY, generator=gen) * 0.05).to(dtype)
    t_mla, _ = alternate(lambda: decode_attention(query, latent, None, mla_meta.decode, 192**-0.5, 512), lambda: None, runs)
    return {"context": context, "csa_ms": t_csa * 1e3, "hca_ms": t_hca * 1e3, "mla_core_ms": t_mla * 1e3}


def run(args: argparse.Namespace) -> int:
    from afd.kernels import ops
    from afd.models.hf_config import parse_hf_config

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    config = parse_hf_config(FLASH)
    csa, hca = _layers(config, dtype)
    kernels = ops()
    print(f"DeepSeek-V4-Flash-shaped attention, {args.dtype}, one decode token, medians of {args.runs} runs "
          f"(kernels: {kernels.simd if kernels is not None else 'off'}); V3 MLA: 128 heads, the absorbed decode only")
    rows = [{**_case(config, csa, hca, c, args.block_size, dtype, args.runs), **cache_bytes(config, c, args.block_size, dtype)}
            for c in args.contexts]
    print_table([["context", "CSA layer ms", "HCA layer ms", "V3 MLA core ms", "V4 cache MB (full + window)", "V3 MLA cache MB", "V3 / V4"],
                 *[[str(r["context"]), f"{r['csa_ms']:.2f}", f"{r['hca_ms']:.2f}", f"{r['mla_core_ms']:.2f}",
                    f"{r['v4_mb']:.1f} ({r['v4_full_mb']:.1f} + {r['v4_window_mb']:.1f})", f"{r['v3_mb']:.1f}", f"{r['v3_over_v4']:.1f}x"]
                   for r in rows]])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"dtype": args.dtype, "runs": args.runs, "rows": rows}, indent=2))
    return 0
