"""Requests recorded from one real run of each client people point at a vLLM-style server
(tests/serving/fixtures, written by scripts/clients/record.py with each client's version), replayed
against ``afd serve``. Each must be served as that client reads it: vLLM's load client (streams with
usage, /tokenize), lm-eval (echo logprobs over token-id prompts, equal to the reference engine;
generation with stop strings; chat), and the openai client."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from afd.cli.common import BUILTIN_MODEL
from afd.config import CacheConfig
from afd.engine.model_runner import ModelRunner
from afd.engine.tokenizer import Tokenizer
from afd.kvcache import BlockManager, SeqChunk
from afd.models import load_model
from tests.serving.server_proc import Server

pytestmark = pytest.mark.procs

FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("*.json"))
CASES = [(f.stem, i, r) for f in FIXTURES for i, r in enumerate(json.loads(f.read_text())["requests"])]


@pytest.fixture(scope="module")
def server():
    with Server() as s:
        yield s


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(BUILTIN_MODEL)


@pytest.fixture(scope="module")
def prompt_logprobs():
    """token ids -> [len - 1] log-probability of token i + 1 after 0..i, from one monolithic forward."""
    model = load_model(BUILTIN_MODEL, dtype="float32")[0]

    def score(ids: list[int]) -> torch.Tensor:
        runner = ModelRunner(model, CacheConfig(block_size=16, num_blocks=80))
        chunk = SeqChunk(BlockManager(80, 16).ensure(0, len(ids)), 0, len(ids))
        lp = torch.log_softmax(model.head(runner.run(ids, [chunk])), -1)
        return lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)

    return score


def test_every_client_was_recorded():
    assert {f.stem for f in FIXTURES} == {"vllm-bench-serve", "lm-eval-local-completions", "lm-eval-local-chat-completions", "openai"}
    for f in FIXTURES:
        meta = json.loads(f.read_text())
        assert meta["client"] and meta["requests"], f


def _prompts(body: dict, tok) -> list[list[int]]:
    p = body["prompt"]
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        p = [p]
    return [tok.encode(x) if isinstance(x, str) else x for x in p]


def _events(r: httpx.Response) -> list[dict]:
    lines = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]", lines[-3:]
    events = [json.loads(x) for x in lines[:-1]]
    assert not any("error" in e for e in events), events
    return events


@pytest.mark.parametrize("client, i, req", CASES, ids=[f"{c}-{i}" for c, i, _ in CASES])
def test_recorded_request_is_served(server, tok, prompt_logprobs, client, i, req):
    path, body = req["path"], req["body"]
    if path == "/tokenize":
        r = server.post(path, json=body).json()
        assert r["tokens"] == tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        return
    if body.get("stream"):
        with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            events = _events(r)
        chunks = [e for e in events if e["choices"]]
        key = "text" if path == "/v1/completions" else "delta"
        assert all(key in c["choices"][0] for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = events[-1]["usage"]
            assert events[-1]["choices"] == [] and usage["completion_tokens"] == len(chunks)
            if body.get("ignore_eos"):
                assert usage["completion_tokens"] == (body.get("max_tokens") or body.get("max_completion_tokens"))
        return
    r = server.post(path, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    n = body.get("n", 1)
    if path == "/v1/chat/completions":
        assert [c["index"] for c in out["choices"]] == list(range(n))
        for c in out["choices"]:
            text = c["message"]["content"]
            assert isinstance(text, str) and not any(s in text for s in body.get("stop") or [])
            if body.get("logprobs"):
                assert len(c["logprobs"]["content"]) == out["usage"]["completion_tokens"] // n
        return
    prompts = _prompts(body, tok)
    assert [c["index"] for c in out["choices"]] == list(range(len(prompts) * n))
    for index, c in enumerate(out["choices"]):
        ids = prompts[index // n]
        assert not any(s in c["text"] for s in body.get("stop") or [])
        if body.get("echo") and body.get("logprobs") is not None:
            got = c["logprobs"]["token_logprobs"]
            assert len(got) == len(ids) + body["max_tokens"] and got[0] is None
            torch.testing.assert_close(torch.tensor(got[1 : len(ids)]), prompt_logprobs(ids), atol=1e-4, rtol=0)
            # lm-eval's reading: the continuation's log-likelihood and whether it is greedy
            for lp, top in zip(got[1 : len(ids)], c["logprobs"]["top_logprobs"][1 : len(ids)]):
                assert lp in top.values() and len(top) <= body["logprobs"] + 1
        elif body.get("logprobs") is not None:
            assert len(c["logprobs"]["tokens"]) == out["usage"]["completion_tokens"] // (len(prompts) * n)
