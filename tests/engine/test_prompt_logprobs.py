"""Prompt logprobs score every prompt position once, whatever the chunking or preemption, and equal one
forward's log_softmax over the whole prompt; max_tokens 0 only prefills."""

from __future__ import annotations

import pytest
import torch

from afd.config import CacheConfig, EngineConfig, SamplingParams
from afd.engine.llm_engine import LLMEngine
from afd.engine.tokenizer import Tokenizer
from afd.kvcache import BlockManager, SeqChunk
from afd.models import load_model

PROMPT = list(range(3, 26))  # 23 tokens


@pytest.fixture(scope="module")
def setup(checkpoints):
    model_dir = checkpoints["ds-qlora-grouped-yarn"][0]
    return load_model(model_dir, dtype="float32")[0], model_dir


def engine(setup, **kw) -> LLMEngine:
    model, model_dir = setup
    cache = CacheConfig(block_size=4, num_blocks=kw.pop("num_blocks", 256))
    return LLMEngine(model, Tokenizer(model_dir), EngineConfig(cache=cache, **kw))


def run(e: LLMEngine, prompts, params) -> list[list]:
    """Each request's deltas."""
    ids = [e.add_request(p, params) for p in prompts]
    out: dict[int, list] = {i: [] for i in ids}
    while e.has_unfinished():
        for d in e.step_deltas():
            out[d.request_id].append(d)
    return [out[i] for i in ids]


def reference(setup, prompt: list[int]) -> torch.Tensor:
    """[len - 1] log-probability of prompt token i + 1 after tokens 0..i, from one forward."""
    e = engine(setup)
    chunk = SeqChunk(BlockManager(256, 4).ensure(0, len(prompt)), 0, len(prompt))
    lp = torch.log_softmax(e.model.head(e.runner.run(prompt, [chunk])), -1)
    return lp[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("budget", [4096, 5, 1])
def test_chunked_prompt_logprobs_equal_one_forward(setup, budget):
    want = reference(setup, PROMPT)
    (deltas,) = run(engine(setup, max_num_batched_tokens=budget), [PROMPT], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2))
    pl = deltas[0].prompt_logprobs
    assert len(pl) == len(PROMPT) and pl[0] is None
    assert [p.token_id for p in pl[1:]] == PROMPT[1:]
    torch.testing.assert_close(torch.tensor([p.logprob for p in pl[1:]]), want, atol=1e-5, rtol=0)
    assert all(len(p.top) == 2 and p.rank >= 1 for p in pl[1:])
    assert all(d.prompt_logprobs is None for d in deltas[1:])  # sent once, with the first token


def test_preemption_does_not_score_twice(setup):
    prompts = [PROMPT, [7] * 20, [9] * 20, [11] * 20]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=1)
    e = engine(setup, num_blocks=16)
    out = run(e, prompts, params)
    assert e.scheduler.num_preemptions > 0
    alone = run(engine(setup), prompts, params)
    for got, ref in zip(out, alone):
        assert len(got[0].prompt_logprobs) == len(ref[0].prompt_logprobs)
        assert [p and p.token_id for p in got[0].prompt_logprobs] == [p and p.token_id for p in ref[0].prompt_logprobs]
        assert sum(d.prompt_logprobs is not None for d in got) == 1


def test_max_tokens_zero_prefills_only(setup):
    e = engine(setup)
    (deltas,) = run(e, [PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=0))
    (d,) = deltas
    assert d.token_id is None and d.finish_reason == "length" and d.text == "" and len(d.prompt_logprobs) == len(PROMPT)
    assert e.blocks.num_free_blocks == e.blocks.num_blocks
