"""Automatic prefix caching on the engine: with and without the cache, greedy tokens are identical and
logprobs agree within the parity rules; hits are counted; prompt-logprob requests never read the cache."""

from __future__ import annotations

import pytest
import torch

from afd.config import CacheConfig, EngineConfig, SamplingParams
from afd.engine.llm_engine import LLMEngine
from afd.models import load_model
from afd.testing.parity import compare_values

SHARED = [0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99, 41, 42, 43, 7, 7, 9, 11, 200, 13]  # 22 tokens
PROMPTS = [SHARED + [5, 6], SHARED + [100, 101, 102], SHARED[:9] + [66, 67], SHARED + [5, 6]]
BLOCK = 4


@pytest.fixture(scope="module")
def model(checkpoints):
    return load_model(checkpoints["ds-qlora-grouped-yarn"][0], dtype="float32")[0]


def make(model, caching: bool, num_blocks: int = 128) -> LLMEngine:
    config = EngineConfig(cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks), enable_prefix_caching=caching)
    return LLMEngine(model, None, config)


def run(engine: LLMEngine, prompts, params: SamplingParams, one_by_one: bool):
    """Each prompt's (tokens, logprobs of the chosen tokens, prompt logprobs); one request after another
    (so that later ones find the earlier ones' blocks) or all at once."""
    out = {}
    waves = [[i] for i in range(len(prompts))] if one_by_one else [list(range(len(prompts)))]
    for wave in waves:
        for i in wave:
            engine.add_request(prompts[i], params, tag=i)
        while engine.has_unfinished():
            for d in engine.step_deltas():
                tokens, lps, plp = out.setdefault(d.tag, ([], [], []))
                if d.token_id is not None:
                    tokens.append(d.token_id)
                    lps.append(d.logprob)
                if d.prompt_logprobs is not None:
                    plp.extend(p.logprob for p in d.prompt_logprobs if p is not None)
    return [out[i] for i in range(len(prompts))]


def test_cached_prefixes_give_the_same_tokens_and_logprobs(model):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    cold = run(make(model, caching=False), PROMPTS, params, one_by_one=True)
    engine = make(model, caching=True)
    warm = run(engine, PROMPTS, params, one_by_one=True)
    s = engine.scheduler
    # full blocks only, leaving the last prompt token to compute: request 1 finds SHARED's first 5 blocks (its
    # 6th differs), request 2 the 2 blocks within SHARED[:9], request 3 (= request 0) 5 of its 6 blocks
    assert s.prefix_hits == 20 + 8 + 20, f"hits {s.prefix_hits} of {s.prefix_queries}"
    assert s.prefix_queries == sum(len(p) for p in PROMPTS)
    for i, ((t0, l0, _), (t1, l1, _)) in enumerate(zip(cold, warm)):
        assert t0 == t1, f"prompt {i}: greedy tokens differ with the prefix cache"
        report = compare_values(f"prompt {i} logprobs", torch.tensor(l0), torch.tensor(l1))
        assert report.ok, str(report)
    assert engine.blocks.num_used_blocks == 0 and engine.blocks.num_cached_blocks > 0
    engine.blocks.check()


def test_without_the_cache_nothing_is_hit(model):
    engine = make(model, caching=False)
    run(engine, PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), one_by_one=True)
    assert engine.scheduler.prefix_hits == 0 and engine.blocks.num_cached_blocks == 0


def test_prompt_logprob_requests_never_read_the_cache(model):
    engine = make(model, caching=True)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run(engine, [PROMPTS[0]], greedy, one_by_one=True)  # fills the cache with SHARED
    hits = engine.scheduler.prefix_hits
    scored = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    (_, _, plp), = run(engine, [PROMPTS[1]], scored, one_by_one=True)
    assert engine.scheduler.prefix_hits == hits, "a prompt-logprob request read the prefix cache"
    (_, _, ref), = run(make(model, caching=False), [PROMPTS[1]], scored, one_by_one=True)
    assert len(plp) == len(PROMPTS[1]) - 1
    report = compare_values("prompt logprobs", torch.tensor(ref), torch.tensor(plp))
    assert report.ok, str(report)
    # ... but it fills the cache: the next plain request with its prompt hits its blocks
    run(engine, [PROMPTS[1]], greedy, one_by_one=True)
    assert engine.scheduler.prefix_hits - hits == (len(PROMPTS[1]) - 1) // BLOCK * BLOCK


def test_preemption_with_shared_blocks_keeps_outputs(model):
    """A small pool: requests sharing a prefix preempt each other; outputs equal the cache-off engine's."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    cold = run(make(model, caching=False, num_blocks=24), PROMPTS, params, one_by_one=False)
    engine = make(model, caching=True, num_blocks=24)
    warm = run(engine, PROMPTS, params, one_by_one=False)
    assert engine.scheduler.num_preemptions > 0, "the pool was not small enough to preempt"
    assert [t for t, _, _ in cold] == [t for t, _, _ in warm]
    assert engine.blocks.num_used_blocks == 0
    engine.blocks.check()
