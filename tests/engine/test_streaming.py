"""The streaming side of the engine (what a server sends): deltas concatenate to the batch API's text and
never leak a piece of a stop string; abort frees a request's blocks at any stage; the serving loop speaks
its pipe protocol and its counters add up."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest
import torch

from afd.cli.common import BUILTIN_MODEL
from afd.config import EngineArgs, SamplingParams
from afd.engine.llm_engine import LLMEngine
from afd.engine.messages import (
    AbortRequest,
    AddRequests,
    Deltas,
    NewRequest,
    Rejected,
    StatsReport,
    Stopped,
    StopServing,
    UnhandledMessage,
)
from afd.engine.serve_loop import serve_requests


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_pretrained(BUILTIN_MODEL, EngineArgs(dtype="float32", kv_cache_memory=16 << 20))


def stream(engine, prompt, params):
    engine.add_request(prompt, params)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step_deltas()
    return deltas


@pytest.mark.parametrize("prompt", ["ROMEO:", "KING.\nWhat say you"])
def test_deltas_concatenate_to_the_final_text(engine, prompt):
    params = SamplingParams(max_tokens=40, temperature=0)
    full = engine.generate([prompt], params)[0]
    deltas = stream(engine, prompt, params)
    assert [d.token_id for d in deltas] == full.token_ids
    assert "".join(d.text for d in deltas) == full.text
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [full.finish_reason]
    # a stop string taken from the middle of the text: never streamed, not even its first characters
    stop = full.text[10:14]
    cut = stream(engine, prompt, SamplingParams(max_tokens=40, temperature=0, stop=(stop,)))
    streamed = "".join(d.text for d in cut)
    assert streamed == full.text[: full.text.index(stop)] and cut[-1].finish_reason == "stop"
    running = ""
    for d in cut:  # at no point did the visible text hold a prefix of the stop string that was later cut
        running += d.text
        assert full.text.startswith(running) and len(running) <= full.text.index(stop)


def test_logprobs_are_the_models_log_softmax(engine):
    deltas = stream(engine, "To be", SamplingParams(max_tokens=5, temperature=0, logprobs=4))
    ids = engine.tokenizer.encode("To be")
    for d in deltas:
        ref = _reference_logprobs(engine, ids)
        assert d.logprob == pytest.approx(float(ref[d.token_id]), abs=1e-5)
        top = torch.topk(ref, 4)
        assert [t for t, _ in d.top_logprobs] == top.indices.tolist()
        ids.append(d.token_id)


def _reference_logprobs(engine, ids):
    """log_softmax of a fresh one-shot prefill (a separate engine: no shared cache state)."""
    ref = LLMEngine(engine.model, engine.tokenizer, engine.config)
    logits = ref.runner.execute(ids, [_chunk(ref, ids)])
    return torch.log_softmax(logits[-1].float(), -1)


def _chunk(engine, ids):
    from afd.kvcache import SeqChunk

    return SeqChunk(engine.blocks.ensure(0, len(ids)), 0, len(ids))


def test_abort_frees_blocks_waiting_or_running(engine):
    free = engine.blocks.num_free_blocks
    a = engine.add_request("ROMEO:", SamplingParams(max_tokens=50, temperature=0))
    engine.step_deltas()  # a is running and holds blocks
    b = engine.add_request("JULIET:", SamplingParams(max_tokens=50, temperature=0))  # b waits
    assert engine.blocks.num_free_blocks < free
    assert engine.abort(a) and engine.abort(b)
    assert not engine.abort(a)  # already gone
    assert engine.blocks.num_free_blocks == free and not engine.has_unfinished()
    s = engine.stats()
    assert s["kv_blocks_used"] == 0 and s["kv_blocks_peak"] > 0 and s["waiting"] == s["running"] == 0


def test_serving_loop_protocol(engine):
    front, back = mp.Pipe()
    t = threading.Thread(target=serve_requests, args=(engine, back), daemon=True)
    t.start()
    want = engine.generate(["ROMEO:"], SamplingParams(max_tokens=12, temperature=0))[0]
    front.send(AddRequests((NewRequest(7, tuple(engine.tokenizer.encode("ROMEO:")), SamplingParams(max_tokens=12, temperature=0)),
                            NewRequest(8, tuple(range(2000)), SamplingParams(max_tokens=4)))))  # longer than the context
    front.send(AddRequests((NewRequest(9, tuple(engine.tokenizer.encode("KING:")), SamplingParams(max_tokens=500, temperature=0)),)))
    front.send(AbortRequest(9))
    text, rejected, last_stats = "", None, None
    while True:
        match front.recv():
            case Rejected() as rejected:
                pass
            case Deltas(deltas, stats):
                assert all(d.tag in (7, 9) for d in deltas)
                text += "".join(d.text for d in deltas if d.tag == 7)
                last_stats = stats
                if any(d.tag == 7 and d.finish_reason for d in deltas):
                    break
            case StatsReport():
                pass
    assert text == want.text
    assert rejected.rid == 8 and "context" in rejected.message
    front.send(StopServing())
    while not isinstance(msg := front.recv(), Stopped):
        pass
    t.join(10)
    assert not t.is_alive()
    assert msg.stats["kv_blocks_used"] == 0 and msg.stats["steps"] >= last_stats["steps"]
    assert sum(msg.stats["expert_tokens"].values()) > 0


def test_a_message_the_loop_does_not_know_fails_it_loudly(engine):
    """An unknown command is a bug the loop names, not a tuple it skips."""
    front, back = mp.Pipe()
    front.send(("add", 7, [1, 2, 3], SamplingParams(max_tokens=2)))  # the old string-tagged form
    with pytest.raises(UnhandledMessage, match="serving loop: no handler for tuple"):
        serve_requests(engine, back)
