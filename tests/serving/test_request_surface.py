"""The request surface the field's clients use, on a real ``afd serve``: echo and prompt logprobs equal
transformers' log_softmax over the prompt (monolithic and 2A1F async), batched prompts and n, every
known-but-unimplemented field accepted at its no-op values and refused otherwise, unknown fields
ignored and logged once, the stop and usage options, and /tokenize, /detokenize, /version,
/openapi.json."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from afd.cli.common import BUILTIN_MODEL
from afd.engine.tokenizer import Tokenizer
from afd.serving.api_models import ChatCompletionRequest, CompletionRequest, _accepted
from tests.serving.server_proc import MODEL_NAME, Server

pytestmark = pytest.mark.procs

DISAGG = ["--attention-ranks", "2", "--ffn-ranks", "1", "--transport", "shm", "--mode", "async", "--num-microbatches", "2", "--split", "token"]
PROMPTS = ["KING.\nWhat say you, my lord?", "To be, or not to be, that is the question"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(BUILTIN_MODEL)


@pytest.fixture(scope="module")
def hf_logprobs(tok):
    """transformers' log_softmax over each prompt: position i's log-probability of token i + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(BUILTIN_MODEL, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        ids = tok.encode(p)
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        out.append((ids, lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1), lp))
    return out


@pytest.fixture(scope="module", params=["monolithic", "2A1F-async-shm"])
def server(request):
    with Server(*([] if request.param == "monolithic" else DISAGG)) as s:
        yield s


@pytest.fixture(scope="module")
def mono():
    with Server() as s:
        yield s


def complete(server, **kw) -> dict:
    r = server.post("/v1/completions", json={"model": MODEL_NAME, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_equal_transformers_over_the_prompt(server, hf_logprobs):
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1 (and 0)."""
    for max_tokens in (1, 0):
        out = complete(server, prompt=[ids for ids, _, _ in hf_logprobs], echo=True, logprobs=1, max_tokens=max_tokens, temperature=0)
        assert [c["index"] for c in out["choices"]] == [0, 1]
        for choice, (ids, want, lp) in zip(out["choices"], hf_logprobs):
            got = choice["logprobs"]["token_logprobs"]
            assert len(got) == len(ids) + max_tokens and got[0] is None and choice["logprobs"]["top_logprobs"][0] is None
            torch.testing.assert_close(torch.tensor(got[1 : len(ids)]), want, atol=1e-4, rtol=0)
            for pos, top in enumerate(choice["logprobs"]["top_logprobs"][1 : len(ids)], start=1):
                best = int(lp[pos - 1].argmax())
                assert max(top.values()) == pytest.approx(float(lp[pos - 1, best]), abs=1e-4)  # lm-eval's is_greedy
            assert out["usage"]["completion_tokens"] == 2 * max_tokens
        if max_tokens == 0:
            assert all(c["finish_reason"] == "length" for c in out["choices"])


def test_prompt_logprobs_as_vllm_has_them(server, hf_logprobs, tok):
    ids, want, lp = hf_logprobs[0]
    out = complete(server, prompt=ids, prompt_logprobs=3, max_tokens=2, temperature=0)
    got = out["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for pos, entry in enumerate(got[1:], start=1):
        actual = entry[str(ids[pos])]
        assert actual["logprob"] == pytest.approx(float(want[pos - 1]), abs=1e-4)
        assert actual["rank"] == int((lp[pos - 1] > lp[pos - 1, ids[pos]]).sum()) + 1
        top3 = lp[pos - 1].topk(3).indices.tolist()
        assert set(entry) == {str(t) for t in top3} | {str(ids[pos])}
        assert actual["decoded_token"] == tok.decode([ids[pos]], skip_special_tokens=False)
    chat = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Who art thou?"}], "max_tokens": 2,
                                                      "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_batched_prompts_and_n_index_choices_prompt_major(mono):
    out = complete(mono, prompt=PROMPTS, n=2, max_tokens=4, temperature=0.8, seed=5)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for p, prompt in enumerate(PROMPTS):  # choice p*n + j samples prompt p with seed + j
        for j in range(2):
            alone = complete(mono, prompt=prompt, max_tokens=4, temperature=0.8, seed=5 + j)
            assert out["choices"][p * 2 + j]["text"] == alone["choices"][0]["text"]


def test_echo_streams_the_prompt_first(mono, tok):
    events = _sse(mono, {"prompt": PROMPTS[0], "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0, "stream": True,
                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [e for e in events if e["choices"]]
    assert chunks[0]["choices"][0]["text"].startswith(PROMPTS[0])
    n = len(tok.encode(PROMPTS[0]))
    assert len(chunks[0]["choices"][0]["logprobs"]["tokens"]) == n + 1
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert events[-1]["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3}
    whole = complete(mono, prompt=PROMPTS[0], echo=True, max_tokens=3, temperature=0)["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole


def _sse(server, payload: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": MODEL_NAME, **payload}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_stop_strings_kept_or_cut_and_stop_reason(mono):
    full = complete(mono, prompt="ROMEO:", max_tokens=24, temperature=0, ignore_eos=True)["choices"][0]["text"]
    stop = full[8:11]
    cut = complete(mono, prompt="ROMEO:", max_tokens=24, temperature=0, stop=[stop])["choices"][0]
    kept = complete(mono, prompt="ROMEO:", max_tokens=24, temperature=0, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    at = full.find(stop)
    assert cut["text"] == full[:at] and kept["text"] == full[: at + len(stop)]
    assert cut["finish_reason"] == kept["finish_reason"] == "stop" and cut["stop_reason"] == stop


def test_a_stop_string_found_by_the_front_end_ends_the_request_in_the_engine(mono):
    """The engine core sends token ids; the front end finds the stop string and aborts the request there.
    Without that abort the engine would go on to max_tokens (1000 tokens, seconds) after the response."""
    full = complete(mono, prompt="ROMEO:", max_tokens=24, temperature=0, ignore_eos=True)["choices"][0]["text"]
    stop = full[8:11]
    out = complete(mono, prompt="ROMEO:", max_tokens=1000, temperature=0, ignore_eos=True, stop=[stop])
    assert out["choices"][0]["text"] == full[: full.find(stop)] and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] < 24  # the tokens up to the stop string, not what the engine ran past it
    deadline = time.monotonic() + 5
    while mono.metric("afd_running_seqs") + mono.metric("afd_queue_depth") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mono.metric("afd_running_seqs") + mono.metric("afd_queue_depth") == 0


def test_truncation_special_tokens_and_token_ids(mono, tok):
    ids = tok.encode(PROMPTS[1])
    out = complete(mono, prompt=PROMPTS[1], truncate_prompt_tokens=4, echo=True, max_tokens=1, temperature=0, logprobs=0,
                   return_tokens_as_token_ids=True)
    assert out["usage"]["prompt_tokens"] == 4
    assert out["choices"][0]["logprobs"]["tokens"][:4] == [f"token_id:{t}" for t in ids[-4:]]
    plain = complete(mono, prompt="ROMEO:", add_special_tokens=False, max_tokens=1)["usage"]["prompt_tokens"]
    assert plain == len(tok.encode("ROMEO:")) - 1  # without the BOS token


def _fields(model) -> list[tuple[str, object]]:
    """(field, accepted no-op value) for every known-but-unimplemented field of a request model."""
    out = []
    for name, f in model.model_fields.items():
        accepted = _accepted(f)
        if accepted == "any":
            out.append((name, "anything"))
        elif accepted is not None:
            out += [(name, v) for v in accepted]
    return out


UNIMPLEMENTED = [("/v1/completions", n, v) for n, v in _fields(CompletionRequest)] + \
    [("/v1/chat/completions", n, v) for n, v in _fields(ChatCompletionRequest)]


def _request(path: str, **extra) -> dict:
    if path == "/v1/completions":
        return {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 2, **extra}
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def test_every_unimplemented_field_is_accepted_at_its_no_op_values_and_refused_otherwise(mono):
    assert len(UNIMPLEMENTED) > 60
    with httpx.Client(base_url=mono.url, timeout=60) as client:
        for path, name, value in UNIMPLEMENTED:
            r = client.post(path, json=_request(path, **{name: value}))
            assert r.status_code == 200, (name, value, r.text)
            if value != "anything":
                r = client.post(path, json=_request(path, **{name: "a value that is no default"}))
                assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
                assert f"{name} is not supported by afd" in r.json()["error"]["message"]
        assert client.post("/v1/completions", json=_request("/v1/completions", n=3, best_of=3, temperature=0)).status_code == 200


def test_unknown_fields_are_ignored_and_logged_once(mono):
    for _ in range(3):
        out = complete(mono, prompt="ROMEO:", max_tokens=2, frobnicate={"x": 1}, stream_options=None, zz_top=[1])
        assert out["choices"][0]["finish_reason"] == "length"
    chat = mono.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi", "mood": "wry"}], "max_tokens": 2})
    assert chat.status_code == 200
    log = "".join(mono.stderr)
    for name in ("frobnicate", "zz_top", "messages[].mood"):
        assert log.count(f"ignoring the unknown request field '{name}'") == 1, log


def test_tokenize_detokenize_version_openapi(mono, tok):
    r = mono.post("/tokenize", json={"prompt": "ROMEO: hi", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("ROMEO: hi") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    assert r["token_strs"] == [tok.id_to_token(t) for t in r["tokens"]]
    chat = mono.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    served = mono.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).json()
    assert chat["count"] == served["usage"]["prompt_tokens"]
    assert mono.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": tok.decode(r["tokens"], skip_special_tokens=False)}
    assert mono.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    from afd import __version__

    assert mono.get("/version").json() == {"version": __version__}
    schema = mono.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= set(schema["paths"])
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "repetition_penalty" in props and props["use_beam_search"]["x-afd-accepted"] == [False, None]


def test_chat_template_options(mono, tok):
    msgs = [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "I am"}]
    cont = mono.post("/tokenize", json={"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}).json()
    text = tok.decode(cont["tokens"])
    assert text.endswith("I am") and "ASSISTANT:\nI am" in text
    custom = mono.post("/tokenize", json={"messages": msgs, "chat_template": "{{ greeting }}{% for m in messages %}{{ m.content }}|{% endfor %}",
                                          "chat_template_kwargs": {"greeting": "Hail! "}}).json()
    assert tok.decode(custom["tokens"]) == "Hail! Who art thou?|I am|"
