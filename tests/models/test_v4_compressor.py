"""DeepSeek-V4's compressors (HCA without overlap, CSA with it) against transformers' own, driven through their
caches with the same chunking: an entry exactly when its window closes, whatever the chunks (issue 28)."""

from __future__ import annotations

import types

import pytest
import torch

from afd.config import RopeConfig
from afd.models import v4_compressor as v4c
from afd.models.layers import RotaryEmbedding
from afd.testing.parity import compare_values

H, HEAD, RATES = 64, 32, {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
CHUNKINGS = [[40], [1] * 40, [3, 5, 13, 1, 18], [7, 7, 7, 7, 12]]


def _config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(vocab_size=64, hidden_size=H, num_hidden_layers=2, head_dim=HEAD, qk_rope_head_dim=8,
                            compress_rates=RATES, layer_types=["heavily_compressed_attention", "compressed_sparse_attention"])


class _NoIndexer(torch.nn.Module):
    def forward(self, hidden, q_residual, positions, cache, layer):
        return torch.zeros(1, positions.shape[1], 1, dtype=torch.long)


@pytest.fixture(scope="module", params=["heavily_compressed_attention", "compressed_sparse_attention"])
def compressor(request):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACompressor, DeepseekV4HCACompressor

    config = _config()
    csa = request.param == "compressed_sparse_attention"
    module = (DeepseekV4CSACompressor if csa else DeepseekV4HCACompressor)(config).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    if csa:  # the indexer's selection is not under test here
        module.indexer = _NoIndexer()
    rope = module.rotary_emb
    dim = 2 * rope.compress_inv_freq.shape[0]
    return request.param, config, module, RotaryEmbedding(RopeConfig(config.rope_parameters["compress"]["rope_theta"], dim, True))


def _theirs(kind, config, module, x, sizes):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache, DeepseekV4HCACache

    cache = types.SimpleNamespace(layers=[(DeepseekV4CSACache if kind == "compressed_sparse_attention" else DeepseekV4HCACache)(config)])
    pos, out = 0, None
    for n in sizes:
        out, _ = module(x[None, pos:pos + n], None, torch.arange(pos, pos + n)[None], cache, 0)
        pos += n
    return out[0, 0]


def _ours(kind, module, rope, x, sizes, emit_early: bool = False):
    rate, csa = RATES[kind], kind == "compressed_sparse_attention"
    width = 2 * HEAD if csa else HEAD
    garbage = lambda *shape: torch.full(shape, float("nan"))  # noqa: E731 - a fresh slot's contents must never be read
    state = v4c.CompressorState(garbage(rate, width), garbage(rate, width), garbage(rate, HEAD) if csa else None,
                                garbage(rate, HEAD) if csa else None)
    kv, gate = torch.nn.functional.linear(x, module.kv_proj.weight), torch.nn.functional.linear(x, module.gate_proj.weight)
    entries, pos = [], 0
    for n in sizes:
        got, first = v4c.compress(kv[pos:pos + n], gate[pos:pos + n], pos + emit_early, state, rate, module.position_bias,
                                  module.kv_norm.weight, module.kv_norm.variance_epsilon, rope, csa)
        assert first == (pos + emit_early) // rate
        entries.append(got)
        pos += n
    return torch.cat(entries)


@pytest.mark.parametrize("sizes", CHUNKINGS)
@torch.no_grad()
def test_entries_equal_transformers_whatever_the_chunks(compressor, sizes):
    kind, config, module, rope = compressor
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(1))
    ref = _theirs(kind, config, module, x, sizes)
    assert ref.shape[0] == 40 // RATES[kind]
    report = compare_values(f"{kind} entries, chunks {sizes}", ref, _ours(kind, module, rope, x, sizes))
    assert report.ok, str(report)


@torch.no_grad()
def test_canary_compressor_emitting_one_token_early_fails(compressor):
    """Counting positions from one past the truth closes every window a token early."""
    kind, config, module, rope = compressor
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(1))
    ref = _theirs(kind, config, module, x, [3, 5, 13, 1, 18])
    got = _ours(kind, module, rope, x, [3, 5, 13, 1, 18], emit_early=True)
    assert got.shape != ref.shape or not compare_values("early", ref, got).ok


@torch.no_grad()
def test_canary_window_buffer_dropped_at_a_chunk_boundary_fails(compressor, monkeypatch):
    kind, config, module, rope = compressor
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(1))
    ref = _theirs(kind, config, module, x, [3, 5, 13, 1, 18])
    real = v4c.compress

    def forgetful(kv, gate, start, state, *args):  # the pending tokens of the open window read as zeros
        state.ring_kv.zero_()
        state.ring_gate.zero_()
        return real(kv, gate, start, state, *args)

    monkeypatch.setattr(v4c, "compress", forgetful)
    assert not compare_values("buffer dropped", ref, _ours(kind, module, rope, x, [3, 5, 13, 1, 18])).ok
