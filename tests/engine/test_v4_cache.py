"""DeepSeek-V4's cache in afd's memory model (afd/models/deepseek_v4.py): the window pool holds the window keys and
the compressors' pending inputs and is released behind the window; compressed entries live in full-pool blocks.
Counted from the block manager and the cache tensors; the text checked against transformers and against the engine
without pressure (chunked prefill across windows, preemption by recompute, prefix-cache hits)."""

from __future__ import annotations

import pytest
import torch

from afd.config import CacheConfig, EngineConfig, SamplingParams
from afd.engine.budget import engine_limits
from afd.engine.llm_engine import LLMEngine
from afd.kvcache import PagedKVCache, WindowedBlocks, layout_bytes
from afd.models import load_model
from afd.models.deepseek_v4 import cache_layouts
from afd.testing.parity import compare_greedy
from tests import support

CASE = "v4-csa-hca"
BLOCK = 4
PROMPTS = [list(range(2, 2 + 21)), [0, 200, 13, 7, 2, 9, 41, 5], list(range(40, 40 + 15))]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def engine(path, num_blocks: int = 96, window_blocks: int = 48, tokens_per_step: int = 8, caching: bool = False) -> LLMEngine:
    model, _ = load_model(path, dtype="float32")
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, num_window_blocks=window_blocks)
    return LLMEngine(model, None, EngineConfig(cache=cache, max_num_seqs=4, max_num_batched_tokens=tokens_per_step,
                                               enable_prefix_caching=caching))


@pytest.fixture(scope="module")
def unpressed(checkpoints):
    return [o.token_ids for o in engine(checkpoints[CASE][0], tokens_per_step=64).generate(PROMPTS, GREEDY)]


def test_chunked_prefill_across_windows_equals_transformers(checkpoints, unpressed):
    path, hf = checkpoints[CASE]
    e = engine(path)  # 8 tokens a step: prompts of 21 and 15 tokens prefill in chunks across windows of 8 and 4
    outs = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
    assert outs == unpressed
    for prompt, out in zip(PROMPTS, outs):
        ref, gaps = support.hf_greedy(hf, prompt, GREEDY.max_tokens)
        report = compare_greedy(ref, out, gaps)
        assert report.ok, str(report)
    e.blocks.check()
    assert e.blocks.window.num_used_blocks == 0 and e.blocks.num_used_blocks == 0, "finished requests hold nothing"


def test_a_sequence_at_8x_the_window_holds_only_its_window(checkpoints):
    path, _ = checkpoints[CASE]
    e = engine(path, tokens_per_step=4)
    window = e.model.config.sliding_window
    rid = e.add_request(list(range(2, 10)), SamplingParams(max_tokens=8 * window, temperature=0.0, ignore_eos=True))
    most_window, most_full = support.most_blocks_held(e, rid)
    assert most_window <= -(-(window - 1 + 4) // BLOCK) + 1, most_window
    assert most_full == -(-(8 + 8 * window) // BLOCK)


def test_preemption_by_recompute_gives_the_same_text(checkpoints, unpressed):
    """A full pool too small for the three sequences at once: the newest is preempted (its blocks freed, its
    compressors' inputs lost with its window blocks) and recomputed from position 0."""
    path, _ = checkpoints[CASE]
    e = engine(path, num_blocks=22, tokens_per_step=64)
    outs = [o.token_ids for o in e.generate(PROMPTS, GREEDY)]
    assert e.scheduler.num_preemptions > 0
    assert outs == unpressed
    e.blocks.check()


def test_prefix_cache_hits_give_the_same_text(checkpoints):
    """The second run of a prompt reuses its full blocks (entries) and the window blocks (keys and the compressors'
    pending inputs) its next token reaches, and gives the same text as the cold run."""
    path, _ = checkpoints[CASE]
    e = engine(path, caching=True, tokens_per_step=64)
    prompt = list(range(2, 2 + 23))
    first = e.generate([prompt], GREEDY)[0].token_ids
    hits = e.scheduler.prefix_hits
    second = e.generate([prompt], GREEDY)[0].token_ids
    assert e.scheduler.prefix_hits - hits == 20, "the 5 full blocks before the last token"
    assert second == first
    cold = engine(path, tokens_per_step=64).generate([prompt], GREEDY)[0].token_ids
    assert first == cold
    e.blocks.check()


def test_the_budget_sums_the_pools_as_the_cache_allocates_them(checkpoints):
    path, _ = checkpoints[CASE]
    model, _ = load_model(path, dtype="float32")
    memory = 4 << 20
    limits = engine_limits(model.config, torch.float32, memory, 16, max_num_seqs=8)
    assert limits.num_window_blocks > 0, "V4 always keeps its window in a pool"
    cache = CacheConfig(block_size=16, num_blocks=limits.num_blocks, num_window_blocks=limits.num_window_blocks)
    allocated = PagedKVCache.for_model(model, cache).num_bytes
    full, window = layout_bytes(cache_layouts(model.config), 16, torch.float32)
    assert allocated == limits.num_blocks * full + limits.num_window_blocks * window
    assert memory - full < allocated <= memory
    assert limits.max_model_len == model.config.max_position_embeddings
    assert isinstance(LLMEngine(model, None, EngineConfig(cache=cache)).blocks, WindowedBlocks)
