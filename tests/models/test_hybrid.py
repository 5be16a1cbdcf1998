"""Qwen3.5-MoE and Qwen3-Next: Gated DeltaNet state carried across chunks and steps, the published layouts, and
canaries that show each check can fail. (Per-layer, routing, cached-decode and greedy parity against transformers
run in test_parity_hf.py over support.HYBRID_CASES; the split in tests/runtime/test_split_parity.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from afd.kvcache import SeqChunk, build_attention_metadata
from afd.models import load_model, parse_hf_config
from afd.models import gated_deltanet as gdn
from afd.models import qwen3_moe
from afd.models.layers import RotaryEmbedding
from afd.testing.parity import compare_values
from tests import support

PROMPTS = [[0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99], [0, 200, 13, 7, 2], [0, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def hybrid(checkpoints):
    return {case: (load_model(checkpoints[case][0], dtype="float32")[0], checkpoints[case][1]) for case in support.HYBRID_CASES}


@torch.no_grad()
def layer_in_chunks(layer, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """One linear-attention layer's output [L, H] for input x [L, H] fed in chunks of ``sizes`` (repeated), its
    state carried in slot 1 of a 3-slot state cache (slots 0 and 2 hold garbage that must never be read)."""
    conv = torch.randn(3, layer.conv_dim, layer.kernel - 1)
    rec = torch.randn(3, layer.num_v_heads, layer.dk, layer.dv)
    out, pos, i = [], 0, 0
    while pos < len(x):
        n = min(sizes[i % len(sizes)], len(x) - pos)
        meta = build_attention_metadata([SeqChunk(list(range(-(-(pos + n) // 16))), pos, n, state_slot=1)], 16)
        out.append(layer(x[pos:pos + n], None, None, None, (conv, rec), meta))
        pos, i = pos + n, i + 1
    return torch.cat(out)


def test_layer_kinds_come_from_the_config(checkpoints):
    raw = json.loads((checkpoints["qwen35-moe"][0] / "config.json").read_text())
    assert parse_hf_config(raw).linear.layers == (0, 1, 3)  # layer_types: layer 2 is full attention
    assert parse_hf_config({**raw, "layer_types": None, "full_attention_interval": 2}).linear.layers == (0, 2)
    nxt = parse_hf_config(json.loads((checkpoints["qwen3-next"][0] / "config.json").read_text()))
    assert nxt.linear.fused_projections and nxt.linear.num_value_heads == 3 * nxt.linear.num_key_heads
    assert not nxt.is_moe_layer(1) and nxt.is_moe_layer(0)  # mlp_only_layers


def test_the_multimodal_release_reads_its_language_model_and_skips_the_rest(checkpoints, caplog):
    path, hf = checkpoints["qwen35-moe-vl"]
    config = parse_hf_config(json.loads((path / "config.json").read_text()))
    assert config.checkpoint_prefix == "model.language_model." and config.linear.layers == (0, 1, 2)
    with caplog.at_level("INFO", logger="afd.models.loader"):
        _, report = load_model(path, dtype="float32")
    assert report.skipped_mtp == 3 and report.skipped_vision == sum(1 for n, _ in hf.named_parameters() if ".visual." in n)
    assert "skipping the multi-token-prediction: 3 tensors" in caplog.text and "skipping the vision tower" in caplog.text
    assert all(n.startswith(("model.language_model.", "lm_head.")) for n in report.tensors)


def test_mrope_of_text_positions_is_plain_rotary(checkpoints):
    """M-RoPE's three position ids are equal for text, so its sections collapse to the plain rotary afd applies."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    path, hf = checkpoints["qwen35-moe-vl"]
    text = hf.config.text_config
    assert text.rope_parameters["mrope_section"] == [1, 1, 0]
    positions = torch.arange(300)
    cos, sin = Qwen3_5MoeTextRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float32), positions[None, None].expand(3, 1, -1))
    ours = RotaryEmbedding(parse_hf_config(json.loads((path / "config.json").read_text())).rope).cos_sin(positions)
    assert cos.shape[-1] == 4  # partial rotary: a quarter of the 16 channels
    torch.testing.assert_close(cos[0], torch.cat((ours[0], ours[0]), -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[0], torch.cat((ours[1], ours[1]), -1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["qwen35-moe", "qwen3-next"])
def test_chunked_prefill_equals_one_step(hybrid, case):
    """A linear-attention layer fed one input whole, in 16-token chunks, in chunks that cut the conv window
    (1, 2, 3 tokens: the conv state carries inputs of several earlier chunks) and with single decode tokens."""
    model, _ = hybrid[case]
    layer = model.model.layers[model.config.linear.layers[0]].self_attn
    x = torch.randn(150, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    whole = layer_in_chunks(layer, x, [len(x)])
    for sizes in ([16], [1, 2, 3, 7], [70, 1, 64], [100, *[1] * 50]):
        report = compare_values(f"chunks {sizes}", whole, layer_in_chunks(layer, x, sizes))
        assert report.ok, str(report)


def test_a_4k_prompt_in_16_token_chunks_equals_one_step(hybrid):
    model, _ = hybrid["qwen35-moe"]
    layer = model.model.layers[0].self_attn
    x = torch.randn(4096, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    report = compare_values("4096 tokens in 16-token chunks", layer_in_chunks(layer, x, [4096]), layer_in_chunks(layer, x, [16]))
    assert report.ok, str(report)


@pytest.mark.parametrize("case", ["qwen35-moe", "qwen3-next"])
def test_chunked_engine_texts_equal_whole_prompt_texts(hybrid, case):
    """End to end, the greedy texts of prompts prefilled in 7-token chunks equal those of one-step prefills (rule 3:
    through 4 layers of decisive weights, batch composition moves fp32 values by ~1e-5 relative, see parity.md)."""
    from afd.config import EngineConfig, SamplingParams
    from afd.engine.llm_engine import LLMEngine
    from afd.testing.parity import compare_greedy

    model, _ = hybrid[case]
    prompts = [PROMPTS[0] * 3, PROMPTS[2] * 4]
    compared = 0
    engine = LLMEngine(model, None, EngineConfig(cache=support.cache_config(model, 4, 128), max_num_batched_tokens=7))
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref, gaps = support.greedy_with_gaps(model, prompt, 16)
        report = compare_greedy(ref, out.token_ids, gaps)
        assert report.ok, str(report)
        compared += report.num_compared
    assert compared >= 16


def test_chunked_delta_rule_equals_the_recurrence():
    g = torch.Generator().manual_seed(3)
    length, heads, dk, dv = 150, 3, 8, 5
    q, k = (gdn.l2norm(torch.randn(length, heads, dk, generator=g)) for _ in range(2))
    v = torch.randn(length, heads, dv, generator=g)
    decay, beta = -torch.rand(length, heads, generator=g), torch.rand(length, heads, generator=g)
    state0 = torch.randn(heads, dk, dv, generator=g)
    out, state = gdn.chunked_delta_rule(q, k, v, decay, beta, state0, chunk=64)
    s, ref = state0[None], []
    for t in range(length):
        o, s = gdn.recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1], s)
        ref.append(o[0])
    torch.testing.assert_close(out, torch.stack(ref), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, s[0], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------- canaries: each check must be able to fail
def _hf_failures(model, hf) -> list[str]:
    """Last-token logits of every prompt against transformers (after a chunked prefill and decode steps)."""
    runner, blocks = support.runner_and_blocks(model, 4, 64, len(PROMPTS))
    failures = []
    for s, prompt in enumerate(PROMPTS):
        first = min(6, len(prompt) - 1)
        blocks.ensure(s, first)
        runner.execute(prompt[:first], [blocks.chunk(s, 0, first)])
        for pos in range(first, len(prompt)):
            blocks.ensure(s, pos + 1)
            logits = runner.execute([prompt[pos]], [blocks.chunk(s, pos, 1)])[0]
        report = compare_values(f"seq {s}", support.hf_reference(hf, prompt)[2][-1], logits)
        failures += [] if report.ok else [str(report)]
    return failures


def test_the_canaries_baseline_passes(hybrid):
    for case in ("qwen35-moe", "qwen3-next"):
        assert not _hf_failures(*hybrid[case])


def test_canary_qk_repeat_as_a_tile_fails(hybrid, monkeypatch):
    """num_v_heads > num_k_heads: each key head serves consecutive value heads; tiled instead, parity fails."""
    real = torch.Tensor.repeat_interleave
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda x, r, dim: x.repeat(1, r, 1) if dim == 1 else real(x, r, dim=dim))
    assert _hf_failures(*hybrid["qwen3-next"])


def test_canary_state_not_carried_across_chunks_fails(hybrid, monkeypatch):
    model, _ = hybrid["qwen35-moe"]
    layer = model.model.layers[0].self_attn
    x = torch.randn(150, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    whole = layer_in_chunks(layer, x, [len(x)])
    real = gdn.chunked_delta_rule
    monkeypatch.setattr(gdn, "chunked_delta_rule", lambda q, k, v, g, b, state, **kw: real(q, k, v, g, b, torch.zeros_like(state), **kw))
    assert not compare_values("chunks", whole, layer_in_chunks(layer, x, [16])).ok


def test_canary_conv_state_shifted_by_one_fails(hybrid, monkeypatch):
    monkeypatch.setattr(gdn, "conv_tail", lambda x, kernel: x[..., x.shape[-1] - kernel:-1])
    assert _hf_failures(*hybrid["qwen35-moe"])


def test_canary_output_gate_without_sigmoid_fails(hybrid, monkeypatch):
    monkeypatch.setattr(qwen3_moe, "output_gate", lambda out, gate: out * gate)
    assert _hf_failures(*hybrid["qwen35-moe"])


def test_canary_state_slots_swapped_between_two_sequences_fails(hybrid):
    """Two sequences of one batch decode with each other's state slot: their logits leave transformers'."""
    model, hf = hybrid["qwen35-moe"]
    runner, blocks = support.runner_and_blocks(model, 4, 64, 2)
    a, b = PROMPTS[0], PROMPTS[2]
    runner.execute(a[:-1] + b[:-1], [support.new_chunk(blocks, 0, a[:-1]), support.new_chunk(blocks, 1, b[:-1])])
    for s, p in ((0, a), (1, b)):
        blocks.ensure(s, len(p))
    right = [blocks.chunk(0, len(a) - 1, 1), blocks.chunk(1, len(b) - 1, 1)]
    kv = [t.clone() for layer in runner.kv_cache.layers for t in layer]
    logits = runner.execute([a[-1], b[-1]], right)
    assert compare_values("right slots", support.hf_reference(hf, a)[2][-1], logits[0]).ok
    for t, saved in zip((t for layer in runner.kv_cache.layers for t in layer), kv):
        t.copy_(saved)  # back to before the step, then the same step with the slots swapped
    swapped = [right[0].__class__(c.block_table, c.start, c.length, c.window_table, o.state_slot) for c, o in zip(right, right[::-1])]
    logits = runner.execute([a[-1], b[-1]], swapped)
    assert not compare_values("swapped slots", support.hf_reference(hf, a)[2][-1], logits[0]).ok
