"""Random malformed requests (hypothesis) never get a 500: every answer is a 2xx, or a 4xx with an
OpenAI-style error body, and the server keeps serving. The app runs in-process over the built-in
monolithic engine (the same app ``afd serve`` runs)."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afd.cli.common import BUILTIN_MODEL
from afd.config import EngineArgs
from afd.engine.llm_engine import LLMEngine
from afd.runtime.clients import LocalClient
from afd.serving.api_models import ChatCompletionRequest, CompletionRequest
from afd.serving.app import ServerState, create_app
from afd.serving.frontend import Frontend
from afd.serving.metrics import Metrics

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12) | st.sampled_from(["\ud800", "\udcff x", "", "text", "-1", "ROMEO:", "</s>"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.sampled_from(["type", "text", "role", "content"]),
                                                                 inner, max_size=4),
    max_leaves=8,
)
SMALL = st.integers(-3, 6)


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    engine = LLMEngine.from_pretrained(BUILTIN_MODEL, EngineArgs(dtype="float32", kv_cache_memory=32 << 20))
    metrics = Metrics()
    frontend = Frontend(LocalClient(engine), metrics, tokenizer=engine.tokenizer)
    metrics.bind(frontend)
    app = create_app(ServerState(frontend, metrics, engine.tokenizer, BUILTIN_MODEL.name, engine.max_model_len))

    async def start() -> None:  # on the client's event loop, as run_server does on uvicorn's
        frontend.start(asyncio.get_running_loop())

    with TestClient(app, raise_server_exceptions=False) as c:
        c.portal.call(start)
        yield c
    frontend.close(timeout=10)


def bodies(model, base: dict):
    """A valid body with up to four fields replaced by junk, or small numbers, or dropped."""
    names = sorted(model.model_fields) + ["frobnicate"]
    edits = st.dictionaries(st.sampled_from(names), JUNK | SMALL | st.just("__drop__"), max_size=4)
    return edits.map(lambda e: {k: v for k, v in {**base, **e}.items() if v != "__drop__"})


COMPLETION = {"model": BUILTIN_MODEL.name, "prompt": "ROMEO:", "max_tokens": 2}
CHAT = {"model": BUILTIN_MODEL.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def check(client, path: str, body) -> None:
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep valid requests short
    r = client.post(path, content=json.dumps(body).encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies(CompletionRequest, COMPLETION))
def test_completions_never_500(client, body):
    check(client, "/v1/completions", body)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=bodies(ChatCompletionRequest, CHAT) | st.builds(lambda m: {**CHAT, "messages": m}, JUNK))
def test_chat_never_500(client, body):
    check(client, "/v1/chat/completions", body)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/tokenize", "/detokenize"]), body=JUNK | st.fixed_dictionaries({"prompt": JUNK}) | st.fixed_dictionaries({"tokens": JUNK}))
def test_tokenizer_endpoints_never_500(client, path, body):
    check(client, path, body)


TEXT_FIELDS = [("/v1/completions", COMPLETION, {"prompt": "\ud800"}), ("/v1/completions", COMPLETION, {"prompt": ["a", "\udcff"]}),
               ("/v1/completions", COMPLETION, {"model": "\udcff"}), ("/v1/completions", COMPLETION, {"stop": ["\ud800"]}),
               ("/v1/completions", COMPLETION, {"logit_bias": {"\ud800": 1}}), ("/v1/completions", COMPLETION, {"user": "\ud800"}),
               ("/v1/chat/completions", CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}),
               ("/v1/chat/completions", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}),
               ("/v1/chat/completions", CHAT, {"chat_template_kwargs": {"x": "\ud800"}}), ("/tokenize", {}, {"prompt": "\ud800"}),
               ("/v1/completions", COMPLETION, {"\ud800": 1})]


@pytest.mark.parametrize("path, base, edit", TEXT_FIELDS)
def test_invalid_unicode_anywhere_is_a_400(client, path, base, edit):
    body = json.dumps({**base, **edit}).encode()
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid Unicode" in r.json()["error"]["message"], r.text


def test_still_serving_after_the_fuzz(client):
    r = client.post("/v1/completions", json={**COMPLETION, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
