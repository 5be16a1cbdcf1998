"""``afd bench hybrid``: a hybrid model's decode against context length, per layer kind, in one process.

Qwen3.5-35B-A3B's shapes by default (hidden 2048; 30 Gated DeltaNet layers of 32 value heads over 16 key heads,
128 x 128 each, conv kernel 4; 10 gated full-attention layers of 16 heads over 2 KV heads of 256, a quarter of
them rotated). At each context one sequence decodes one token through one layer of each kind, over a state slot
and a paged KV cache filled to that context (random weights and cache: the time does not depend on the values).
The two kinds alternate; medians of ``--runs``. The MoE half, alike at every context, is left out; the per-token
line adds the layers up as the model stacks them. A linear layer reads a fixed-size state, so its time is flat in
the context; only the full-attention layers grow.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from afd.cli.common import alternate, print_table

QWEN35 = dict(model_type="qwen3_5_moe_text", vocab_size=1024, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
              num_key_value_heads=2, head_dim=256, intermediate_size=512, moe_intermediate_size=512, num_experts=8,
              num_experts_per_tok=2, shared_expert_intermediate_size=512, linear_num_key_heads=16, linear_num_value_heads=32,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
              max_position_embeddings=262144, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def add_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("hybrid", help="a hybrid model's decode (Gated DeltaNet and full-attention layers) against context length")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--json", dest="json_out", help="write the results as JSON to this file")
    p.set_defaults(func=run)


def _layers(dtype: torch.dtype):
    from afd.models.gated_deltanet import GatedDeltaNet
    from afd.models.hf_config import parse_hf_config
    from afd.models.qwen3_moe import GQAttention

    config = parse_hf_config(QWEN35)
    gen = torch.Generator().manual_seed(0)
    linear, full = GatedDeltaNet(config), GQAttention(config, config.kv_layers[0])
    with torch.no_grad():
        for module in (linear, full):
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            module.to(dtype)
        linear.A_log.copy_(torch.rand(linear.A_log.shape, generator=gen).log())
    return config, linear, full


@torch.inference_mode()
def _case(config, linear, full, context: int, dtype: torch.dtype, runs: int) -> dict:
    from afd.config import CacheConfig
    from afd.kvcache import BlockManager, PagedKVCache, build_attention_metadata
    from afd.models.layers import RotaryEmbedding

    block, gen = 16, torch.Generator().manual_seed(context)
    blocks = BlockManager(-(-context // block) + 1, block, num_state_slots=1)
    blocks.ensure(0, context)
    meta = build_attention_metadata([blocks.chunk(0, context - 1, 1)], block)
    lin = config.linear
    cache = CacheConfig(block_size=block, num_blocks=blocks.num_blocks, num_state_slots=1)
    kv = PagedKVCache(cache, 1, ((config.num_kv_heads, config.head_dim),) * 2, dtype)
    for t in kv.layer(0):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    state = (torch.randn(1, lin.conv_dim, lin.conv_kernel - 1, generator=gen).to(dtype),
             torch.randn(1, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim, generator=gen) * 0.1)
    x = torch.randn(1, config.hidden_size, generator=gen).to(dtype)
    rope = RotaryEmbedding(config.rope)
    cos, sin = rope.cos_sin(meta.positions)
    saved = [t.clone() for t in state]

    def run_linear():
        linear(x, rope, cos, sin, state, meta)
        for t, s in zip(state, saved):  # the same state every run
            t.copy_(s)

    t_linear, t_full = alternate(run_linear, lambda: full(x, rope, cos, sin, kv.layer(0), meta), runs)
    n_linear, n_full = len(lin.layers), len(config.kv_layers)
    return {"context": context, "linear_ms": t_linear * 1e3, "full_ms": t_full * 1e3,
            "per_token_ms": (n_linear * t_linear + n_full * t_full) * 1e3, "layers": [n_linear, n_full]}


def run(args: argparse.Namespace) -> int:
    from afd.kernels import ops

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    config, linear, full = _layers(dtype)
    kernels = ops()
    print(f"Qwen3.5-35B-A3B-shaped layers, {args.dtype}, one decode token, medians of {args.runs} runs "
          f"(kernels: {kernels.simd if kernels is not None else 'off'})")
    rows = [_case(config, linear, full, c, dtype, args.runs) for c in args.contexts]
    first = rows[0]
    table = [[str(r["context"]), f"{r['linear_ms']:.3f}", f"{r['linear_ms'] / first['linear_ms']:.2f}x", f"{r['full_ms']:.3f}",
              f"{r['full_ms'] / first['full_ms']:.2f}x", f"{r['per_token_ms']:.2f}"] for r in rows]
    print_table([["context", "linear layer ms", "vs first", "full layer ms", "vs first",
                  f"{first['layers'][0]} linear + {first['layers'][1]} full ms"], *table])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"dtype": args.dtype, "runs": args.runs, "rows": rows}, indent=2))
    return 0
