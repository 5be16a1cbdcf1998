"""DeepSeek-V4's attention, afd's pure-torch reference against transformers' own, driven through its cache with
the same chunking, prompts longer than the window and several compression windows (issue 28)."""

from __future__ import annotations

import pytest
import torch

from afd.config import RopeConfig
from afd.models import v4_attention as v4a
from afd.models import v4_compressor as v4c
from afd.models.layers import RotaryEmbedding
from afd.testing.parity import compare_values

H, HEADS, HEAD, WINDOW = 64, 4, 32, 6
KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
CHUNKS = [[30], [1] * 30, [5, 1, 9, 2, 13], [7, 7, 7, 9]]


@pytest.fixture(scope="module")
def layers():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

    gen = torch.Generator().manual_seed(9)
    out = {}
    for kind in KINDS:  # one layer per model: the sliding-window mask is built from layer 0's cache
        config = DeepseekV4Config(vocab_size=64, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS, head_dim=HEAD,
                                  q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=WINDOW, compress_rates=RATES,
                                  index_n_heads=2, index_head_dim=16, index_topk=2, layer_types=[kind], mlp_layer_types=["moe"])
        config._attn_implementation = "eager"
        attn = DeepseekV4Attention(config, 0).eval()
        with torch.no_grad():
            for name, p in attn.named_parameters():  # transformers starts sinks and position biases at zero
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "sinks" in name or "position_bias" in name else 0.3))
        out[kind] = attn
    return config, out, DeepseekV4RotaryEmbedding(config)


def _theirs(config, attn, rotary, x, sizes):
    from transformers import DynamicCache
    from transformers.masking_utils import create_sliding_window_causal_mask

    cache, pos, outs = DynamicCache(config=config), 0, []
    for n in sizes:
        chunk, positions = x[None, pos:pos + n], torch.arange(pos, pos + n)[None]
        mask = create_sliding_window_causal_mask(config=config, inputs_embeds=chunk, attention_mask=None, cache=cache,
                                                 position_ids=positions)
        pe = {t: rotary(chunk, position_ids=positions, layer_type=t) for t in ("main", "compress")}
        outs.append(attn(chunk, pe, positions, mask, cache=cache)[0][0])
        pos += n
    return torch.cat(outs)


def _ours(config, attn, kind, x, sizes):
    rate = RATES.get(kind, 0)
    params = config.rope_parameters["main" if kind == "sliding_attention" else "compress"]
    rope = RotaryEmbedding(RopeConfig(params["rope_theta"], int(HEAD * params["partial_rotary_factor"]), True))
    shapes = v4a.V4Shapes(HEADS, HEAD, WINDOW, rate, 2, 2, 16, 2 if rate == 4 else 0, config.rms_norm_eps)
    nan = lambda *s: torch.full(s, float("nan"))  # noqa: E731 - a fresh sequence's state is never read
    width = 2 * HEAD if rate == 4 else HEAD
    cache = v4a.SequenceCache(compressor=v4c.CompressorState(nan(max(rate, 1), width), nan(max(rate, 1), width),
                                                             nan(max(rate, 1), HEAD), nan(max(rate, 1), HEAD)),
                              indexer=v4c.CompressorState(nan(4, 32), nan(4, 32), nan(4, 16), nan(4, 16)))
    weights = dict(attn.named_parameters())
    pos, outs = 0, []
    for n in sizes:
        outs.append(v4a.reference_attention(weights, shapes, x[pos:pos + n], pos, cache, rope))
        pos += n
    return torch.cat(outs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sizes", CHUNKS)
@torch.no_grad()
def test_attention_equals_transformers(layers, kind, sizes):
    config, attns, rotary = layers
    x = torch.randn(30, H, generator=torch.Generator().manual_seed(2))
    ref = _theirs(attns[kind].config, attns[kind], rotary, x, sizes)
    report = compare_values(f"{kind} chunks {sizes}", ref, _ours(config, attns[kind], kind, x, sizes))
    assert report.ok, str(report)


@pytest.mark.parametrize("kind", ["sliding_attention", "compressed_sparse_attention"])
@torch.no_grad()
def test_canary_sinks_dropped_fails(layers, kind, monkeypatch):
    config, attns, rotary = layers
    x = torch.randn(30, H, generator=torch.Generator().manual_seed(2))
    ref = _theirs(attns[kind].config, attns[kind], rotary, x, [30])
    real = v4a.attend_with_sinks
    monkeypatch.setattr(v4a, "attend_with_sinks", lambda q, k, allowed, sinks, scale: real(q, k, allowed, sinks - 1e4, scale))
    assert not compare_values("sinks dropped", ref, _ours(config, attns[kind], kind, x, [30])).ok


@torch.no_grad()
def test_canary_output_rotated_slice_not_rotated_back_fails(layers, monkeypatch):
    config, attns, rotary = layers
    kind = "heavily_compressed_attention"
    x = torch.randn(30, H, generator=torch.Generator().manual_seed(2))
    ref = _theirs(attns[kind].config, attns[kind], rotary, x, [30])
    real = v4c.rotate_tail
    monkeypatch.setattr(v4a, "rotate_tail", lambda t, positions, rope: t if (positions < 0).any() else real(t, positions, rope))
    assert not compare_values("not rotated back", ref, _ours(config, attns[kind], kind, x, [30])).ok
