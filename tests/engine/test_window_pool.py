"""gpt-oss's sliding layers in a block pool of their own (afd/kvcache/windowed.py): the text equals
transformers' and the one-pool engine's, chunked prefill across window boundaries included; a sequence
at 8x the window holds no more window blocks than its window needs; the prefix cache hits under the rule
the module states; the budget sizes the pool and gives the rest to the full layers."""

from __future__ import annotations

import pytest
import torch

from afd.config import CacheConfig, EngineConfig, SamplingParams
from afd.engine.budget import engine_limits, kv_bytes_per_token, window_pool_blocks
from afd.engine.llm_engine import LLMEngine
from afd.kvcache import BlockManager, WindowedBlocks
from afd.kvcache.block_manager import prefix_names
from afd.models import load_model
from afd.testing.parity import compare_greedy
from tests import support

CASE = "gptoss-window6"
BLOCK = 4


def engine(path, window_blocks: int, max_tokens_per_step: int = 8, caching: bool = False, num_blocks: int = 96) -> LLMEngine:
    model, _ = load_model(path, dtype="float32")
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, num_window_blocks=window_blocks)
    return LLMEngine(model, None, EngineConfig(cache=cache, max_num_seqs=4, max_num_batched_tokens=max_tokens_per_step,
                                               enable_prefix_caching=caching))


PROMPTS = [list(range(2, 2 + 21)), [0, 200, 13, 7, 2, 9, 41, 5], list(range(40, 40 + 15))]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def test_window_pool_text_equals_transformers_and_the_one_pool_engine(checkpoints):
    path, hf = checkpoints[CASE]
    pooled = engine(path, window_blocks=window_pool_blocks(load_model(path)[0].config, BLOCK, 4, 8, 256))
    assert isinstance(pooled.blocks, WindowedBlocks)
    outs = pooled.generate(PROMPTS, GREEDY)  # prompts of 21 and 15 tokens prefill in chunks of 8 across windows of 6
    plain = engine(path, window_blocks=0)
    assert isinstance(plain.blocks, BlockManager)
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == [o.token_ids for o in outs]
    for prompt, out in zip(PROMPTS, outs):
        ref, gaps = support.hf_greedy(hf, prompt, GREEDY.max_tokens)
        report = compare_greedy(ref, out.token_ids, gaps)
        assert report.ok, str(report)
    pooled.blocks.check()
    assert pooled.blocks.window.num_used_blocks == 0 and pooled.blocks.num_used_blocks == 0, "finished requests hold nothing"


def test_a_sequence_at_8x_the_window_holds_only_its_window(checkpoints):
    """Counted from the block manager after every step of one sequence that grows to 8x the window: its
    window blocks never exceed what positions start-W+1..start+n-1 span, while its full blocks grow."""
    path, _ = checkpoints[CASE]
    e = engine(path, window_blocks=32, max_tokens_per_step=4)
    window = e.model.config.sliding_window
    rid = e.add_request(list(range(2, 10)), SamplingParams(max_tokens=8 * window, temperature=0.0, ignore_eos=True))
    most_window, most_full = support.most_blocks_held(e, rid)
    bound = -(-(window - 1 + 4) // BLOCK) + 1  # a chunk of up to 4 tokens after W - 1 visible ones
    assert most_window <= bound, (most_window, bound)
    assert most_full == -(-(8 + 8 * window) // BLOCK), "the full layers keep every position"
    assert most_full > 3 * most_window


def test_prefix_cache_hits_under_the_window_rule(checkpoints):
    """The second run of a prompt reuses its cached prefix in both pools (the window blocks its next token
    reaches are still cached, by name) and produces the same text."""
    path, _ = checkpoints[CASE]
    e = engine(path, window_blocks=40, caching=True)
    prompt = list(range(2, 2 + 23))
    first = e.generate([prompt], GREEDY)[0].token_ids
    hits = e.scheduler.prefix_hits
    second = e.generate([prompt], GREEDY)[0].token_ids
    assert e.scheduler.prefix_hits - hits == 20, "5 of the 5 full blocks before the last token"  # (23 - 1) // 4 blocks
    assert second == first
    e.blocks.check()


def test_lookup_shortens_a_hit_whose_window_is_gone():
    """The full pool holds a prefix but the window pool lost (evicted) its last block: the hit shortens to the
    longest prefix whose window is still there."""
    full, window = BlockManager(16, 4, True), BlockManager(16, 4, True)
    blocks = WindowedBlocks(full, window, 6)
    tokens = list(range(100, 117))  # 17 tokens: 4 full blocks before the last
    blocks.ensure(0, 17)
    blocks.commit(0, tokens, 17)
    blocks.free(0)
    assert len(blocks.lookup(tokens)) == 4
    names = prefix_names(tokens, 4)
    victim = window.cached(names[3:4])[0]  # the window block of positions 12..15
    window._evictable.pop(victim)  # evict it by hand, as an allocation would
    h = window._key_of.pop(victim)[0]
    del window._block_of[h]
    window._free.append(victim)
    hit = blocks.lookup(tokens)
    assert len(hit) == 3 and hit.skip == 1  # the next token (12) sees 7..12: window blocks 1 and 2
    window.check()


def test_the_budget_gives_the_sliding_layers_a_pool_and_the_full_layers_the_rest(checkpoints):
    path, _ = checkpoints[CASE]
    config = load_model(path)[0].config
    memory = 4 << 20
    limits = engine_limits(config, torch.float32, memory, 16, max_num_seqs=8)
    assert limits.num_window_blocks == window_pool_blocks(config, 16, 8, limits.max_num_batched_tokens, config.max_position_embeddings) > 0
    one_pool = memory // (kv_bytes_per_token(config, torch.float32) * 16)
    assert limits.num_blocks > one_pool, "the full layers hold more context once the sliding layers stop holding all of it"
    layer_block = kv_bytes_per_token(config, torch.float32) // config.num_layers * 16
    used = layer_block * (limits.num_blocks * (config.num_layers - len(config.sliding_layers))
                          + limits.num_window_blocks * len(config.sliding_layers))
    assert memory - layer_block * config.num_layers < used <= memory
    assert "sliding-window blocks" in limits.describe()


@pytest.mark.parametrize("window, pool", [(6, True), (10_000, False)])
def test_a_window_as_long_as_the_context_gets_no_pool(checkpoints, window, pool):
    from dataclasses import replace

    config = load_model(checkpoints[CASE][0])[0].config
    config = replace(config, sliding_window=window)
    assert bool(window_pool_blocks(config, 16, 8, 64, config.max_position_embeddings)) == pool
