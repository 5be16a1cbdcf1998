"""A hybrid model's second kind of per-sequence memory: state slots beside the KV blocks, through the scheduler,
preemption, the budget and the prefix cache."""

from __future__ import annotations

import logging

import pytest
import torch

from afd.config import CacheConfig, EngineArgs, EngineConfig, SamplingParams
from afd.engine.budget import engine_limits, state_slot_bytes
from afd.engine.llm_engine import LLMEngine
from afd.kvcache import BlockManager, OutOfBlocksError, PagedKVCache
from afd.models import load_model
from afd.testing.parity import compare_greedy
from tests import support


@pytest.fixture(scope="module")
def qwen35(checkpoints):
    return load_model(checkpoints["qwen35-moe"][0], dtype="float32")[0]


def test_a_sequence_holds_a_slot_from_its_first_block_to_its_free():
    blocks = BlockManager(8, 4, num_state_slots=2)
    blocks.ensure(10, 5)
    blocks.ensure(11, 1)
    assert {blocks.state_slot(10), blocks.state_slot(11)} == {0, 1} and blocks.num_free_slots == 0
    assert not blocks.can_admit(1), "a third sequence was admitted without a state slot"
    with pytest.raises(OutOfBlocksError, match="state slot"):
        blocks.ensure(12, 1)
    assert blocks.chunk(10, 4, 1).state_slot == blocks.state_slot(10)
    blocks.free(10)
    assert blocks.num_free_slots == 1 and blocks.can_admit(1)
    blocks.ensure(12, 1)
    assert blocks.state_slot(12) == 0  # the freed slot, reused
    blocks.check()
    blocks.free(11)
    blocks.free(12)
    blocks.check()
    assert blocks.num_free_slots == 2 and blocks.num_used_blocks == 0


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [[0, *(int(t) for t in torch.randint(2, 300, (5 + (7 * i) % 23,), generator=g))] for i in range(n)]


def _check_against_unpreempted(model, prompts, outs, steps):
    compared = 0
    for prompt, out in zip(prompts, outs):
        ref, gaps = support.greedy_with_gaps(model, prompt, steps)
        report = compare_greedy(ref, out.token_ids, gaps)
        assert report.ok, f"{prompt}: {report}"
        compared += report.num_compared
    assert compared >= len(prompts) * steps // 2, f"only {compared} greedy steps compared"


def test_48_sequences_preempted_by_a_small_pool_equal_their_unpreempted_runs(qwen35):
    """48 sequences, a KV pool that holds about a third of them: preemption frees blocks and state slots; a
    preempted sequence is recomputed from position 0 (the chunked form, where it first ran the recurrent one)."""
    prompts, steps = _prompts(48), 12
    cache = CacheConfig(block_size=4, num_blocks=120, num_state_slots=48)
    engine = LLMEngine(qwen35, None, EngineConfig(cache=cache, max_num_seqs=48, max_num_batched_tokens=256))
    outs = engine.generate(prompts, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    assert engine.scheduler.num_preemptions >= 10, engine.scheduler.num_preemptions
    _check_against_unpreempted(qwen35, prompts, outs, steps)
    engine.blocks.check()
    assert engine.blocks.num_used_blocks == 0 and engine.blocks.num_free_slots == 48


def test_requests_wait_for_a_state_slot(qwen35):
    """Fewer state slots than requests: the rest wait (as for blocks), and the running count never exceeds them."""
    prompts, steps = _prompts(12), 6
    engine = LLMEngine(qwen35, None, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=256, num_state_slots=3), max_num_seqs=16))
    assert engine.scheduler.max_num_seqs == 3
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    outs, most = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        most = max(most, len(engine.scheduler.running))
    assert most == 3
    _check_against_unpreempted(qwen35, prompts, [outs[i] for i in sorted(outs)], steps)
    assert engine.blocks.num_free_slots == 3


def test_prefix_cache_is_off_for_hybrid_models_and_says_why(qwen35, caplog):
    shared = _prompts(1)[0] * 3
    with caplog.at_level(logging.WARNING, logger="afd.engine.llm_engine"):
        engine = LLMEngine(qwen35, None, EngineConfig(cache=support.cache_config(qwen35, 4, 64), enable_prefix_caching=True))
    assert "prefix caching is off for Qwen3_5MoeForCausalLM" in caplog.text and "linear-attention state" in caplog.text
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = engine.generate([shared + [5, 6]], params)[0]
    second = engine.generate([shared + [5, 6]], params)[0]
    assert not engine.blocks.enable_caching and engine.blocks.num_cached_blocks == 0
    assert engine.scheduler.prefix_queries == 0 and engine.scheduler.prefix_hits == 0  # nothing looked up, nothing read
    assert first.token_ids == second.token_ids


def test_the_budget_counts_the_state_slots(qwen35):
    config, dtype = qwen35.config, torch.float32
    per_slot = state_slot_bytes(config, dtype)
    lin = config.linear
    assert per_slot == len(lin.layers) * 4 * (lin.conv_dim * (lin.conv_kernel - 1) + lin.num_value_heads * lin.key_head_dim * lin.value_head_dim)
    limits = engine_limits(config, dtype, 8 << 20, 4, max_num_seqs=16)
    assert limits.num_state_slots == 16 and limits.state_bytes == 16 * per_slot
    assert "16 state slots" in limits.describe()
    cache = PagedKVCache.for_model(qwen35, CacheConfig(block_size=4, num_blocks=limits.num_blocks, num_state_slots=16))
    state = sum(t.numel() * t.element_size() for i in lin.layers for t in cache.layer(i))
    assert state == limits.state_bytes and cache.num_bytes <= 8 << 20  # the slots and the blocks fit the memory given
    few = engine_limits(config, dtype, 40 * per_slot, 4, max_num_seqs=64)  # at most half the memory for states
    assert few.num_state_slots == 20
    bf16 = engine_limits(config, torch.bfloat16, 8 << 20, 4, max_num_seqs=16, state_dtype="model")
    assert bf16.state_bytes == 16 * state_slot_bytes(config, torch.bfloat16, "model") < limits.state_bytes // 2 + 1
    with pytest.raises(ValueError, match="linear-attention state"):
        engine_limits(config, dtype, per_slot, 4, max_num_seqs=4)


def test_from_pretrained_bounds_max_num_seqs_by_the_slots(checkpoints):
    path = checkpoints["qwen35-moe"][0]
    per_slot = state_slot_bytes(load_model(path, dtype="float32")[0].config, torch.float32)
    engine = LLMEngine.from_pretrained(path, EngineArgs(dtype="float32", kv_cache_memory=10 * per_slot, max_num_seqs=64))
    assert engine.config.cache.num_state_slots == 5 and engine.scheduler.max_num_seqs == 5
    out = engine.generate([[0, 5, 6, 7]] * 8, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in out}) == 1
