"""Bad input gets a clear OpenAI-style error and nothing else breaks; a client that disconnects frees its
blocks; a dead FFN rank fails in-flight requests promptly and the server exits non-zero; SIGTERM drains."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.serving.server_proc import MODEL_NAME, Server
from tests.support import wait_for

pytestmark = pytest.mark.procs

ONE_A_ONE_F = ["--attention-ranks", "1", "--ffn-ranks", "1", "--transport", "shm", "--mode", "async", "--num-microbatches", "2", "--split", "token"]


@pytest.fixture(scope="module")
def server():
    with Server() as s:
        yield s


def body(**kw):
    return {"model": MODEL_NAME, "prompt": "ROMEO:", "max_tokens": 4, **kw}


BAD = [
    # (what, path, request kwargs, status, words in the message)
    ("malformed JSON", "/v1/completions", {"content": b'{"model": "x", ', "headers": {"content-type": "application/json"}}, 400, "malformed JSON"),
    ("not an object", "/v1/completions", {"json": [1, 2]}, 400, "JSON object"),
    ("unimplemented field at another value", "/v1/completions", {"json": body(use_beam_search=True)}, 400,
     "use_beam_search is not supported by afd (beam search); it accepts only false or null"),
    ("best_of other than n", "/v1/completions", {"json": body(best_of=3)}, 400, "best_of is not supported"),
    ("tools", "/v1/chat/completions", {"json": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                                "tools": [{"type": "function", "function": {"name": "f"}}]}}, 400, "tools is not supported"),
    ("an image part", "/v1/chat/completions", {"json": {"model": MODEL_NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}}, 400, "afd serves text only"),
    ("a lone surrogate in the model name", "/v1/completions",
     {"content": b'{"model": "\\udcff", "prompt": "x"}', "headers": {"content-type": "application/json"}}, 400, "invalid Unicode"),
    ("a lone surrogate in the prompt", "/v1/completions",
     {"content": b'{"prompt": ["ok", "\\ud800"]}', "headers": {"content-type": "application/json"}}, 400, "prompt: invalid Unicode"),
    ("max_tokens 0 without echo", "/v1/completions", {"json": body(max_tokens=0)}, 400, "only allowed with echo"),
    ("prompt_logprobs while streaming", "/v1/completions", {"json": body(prompt_logprobs=1, stream=True)}, 400, "prompt_logprobs"),
    ("logit_bias key not a token id", "/v1/completions", {"json": body(logit_bias={"x": 1})}, 400, "logit_bias"),
    ("stop token id outside the vocabulary", "/v1/completions", {"json": body(stop_token_ids=[10**7])}, 400, "stop_token_ids"),
    ("min_tokens beyond max_tokens", "/v1/completions", {"json": body(min_tokens=9)}, 400, "min_tokens"),
    ("repetition_penalty 0", "/v1/completions", {"json": body(repetition_penalty=0)}, 400, "repetition_penalty"),
    ("negative max_tokens", "/v1/completions", {"json": body(max_tokens=-5)}, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {"json": body(max_tokens=10**9)}, 400, "maximum context length is 1024"),
    ("prompt beyond the context", "/v1/completions", {"json": body(prompt="To be or not " * 400)}, 400, "maximum context length"),
    ("unknown model", "/v1/completions", {"json": body(model="gpt-7")}, 404, "The model 'gpt-7' does not exist"),
    ("missing prompt", "/v1/completions", {"json": {"model": MODEL_NAME}}, 400, "prompt"),
    ("wrong type", "/v1/completions", {"json": body(temperature="hot")}, 400, "temperature"),
    ("too many choices", "/v1/completions", {"json": body(n=1000)}, 400, "n:"),
    ("too many logprobs", "/v1/completions", {"json": body(logprobs=99)}, 400, "logprobs"),
    ("token id outside the vocabulary", "/v1/completions", {"json": body(prompt=[1, 2, 10**7])}, 400, "outside the vocabulary"),
    ("empty stop string", "/v1/completions", {"json": body(stop=[""])}, 400, "stop"),
    ("penalty out of range", "/v1/completions", {"json": body(presence_penalty=2.5)}, 400, "presence_penalty"),
    ("chat prompt filling the context", "/v1/chat/completions",
     {"json": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "To be or not " * 400}]}}, 400, "maximum context length"),
    ("empty messages", "/v1/chat/completions", {"json": {"model": MODEL_NAME, "messages": []}}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"json": {"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]}}, 400, "role"),
    ("chat unknown model", "/v1/chat/completions", {"json": {"model": "x", "messages": [{"role": "user", "content": "hi"}]}}, 404, "does not exist"),
    ("wrong method", "/v1/completions", {"method": "GET"}, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize("what, path, kwargs, status, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_error(server, what, path, kwargs, status, words):
    kwargs = dict(kwargs)
    method = kwargs.pop("method", "POST")
    r = httpx.request(method, server.url + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    # and everyone else keeps being served
    ok = server.post("/v1/completions", json=body())
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def _aborted(server) -> float:
    """The server's count of aborted requests (0 before its first one: the sample appears then)."""
    lines = [line for line in server.get("/metrics").text.splitlines() if line.startswith('afd_requests_total{finish_reason="abort"')]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_client_disconnect_mid_stream_frees_its_blocks(server):
    aborted_before = _aborted(server)
    with httpx.stream("POST", server.url + "/v1/completions", json=body(max_tokens=900, ignore_eos=True, stream=True), timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip((x for x in lines if x.startswith("data:")), range(3))]
        assert len(got) == 3
    # closed after 3 tokens of 900: the request is aborted and its KV blocks return to the pool
    wait_for(lambda: not (server.metric("afd_kv_blocks_used") or server.metric("afd_requests_in_flight")), 10,
             "the aborted request's KV blocks freed")
    assert _aborted(server) > aborted_before
    assert server.post("/v1/completions", json=body()).status_code == 200


def _stream_until_done(url: str, payload: dict, out: list, t_kill: list, chunks: list[int] | None = None, index: int = 0) -> None:
    """Read one stream; record (outcome, seconds after the kill) where outcome is done/error/cut;
    ``chunks[index]`` counts its chunks so far."""
    outcome = "cut"
    try:
        with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=60) as r:
            if r.status_code != 200:
                outcome = f"status {r.status_code}"
            else:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        outcome = "done"
                    elif line.startswith("data:") and "error" in json.loads(line[5:]):
                        outcome = "error: " + json.loads(line[5:])["error"]["message"]
                    elif line.startswith("data:") and chunks is not None:
                        chunks[index] += 1
    except httpx.HTTPError as e:
        outcome = f"cut: {type(e).__name__}"
    out.append((outcome, time.monotonic() - t_kill[0] if t_kill else None))


def _kill_under_load(s: Server, pid: int, streams: int = 6) -> list:
    """SIGKILL ``pid`` once every one of ``streams`` streaming requests is producing tokens (counted per
    stream: a total of tokens can come from the first streams before the last one has started); their outcomes."""
    results: list = []
    t_kill: list = []
    chunks = [0] * streams
    threads = [threading.Thread(target=_stream_until_done, args=(s.url, body(prompt=f"KING {i}:", max_tokens=1000, ignore_eos=True, stream=True),
                                                                 results, t_kill, chunks, i))
               for i in range(streams)]
    for t in threads:
        t.start()
    wait_for(lambda: min(chunks) >= 5, 30, "every stream producing tokens")
    t_kill.append(time.monotonic())
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert len(results) == streams
    return results


@pytest.mark.faults
def test_killing_an_ffn_rank_fails_in_flight_requests_and_exits_nonzero():
    s = Server(*ONE_A_ONE_F)
    try:
        assert any("no redundancy: an FFN failure stops the server" in line for line in s.stderr + s.stdout)  # said at start
        ffn = s.rank_pids("ffn")
        assert len(ffn) == 1
        for outcome, after in _kill_under_load(s, ffn[0]):
            assert outcome.startswith("error") and "ffn rank 0" in outcome and "SIGKILL" in outcome, outcome
            assert after < 10, f"error came {after:.1f} s after the kill"
        s.proc.wait(30)
        assert s.proc.returncode not in (0, None), s.proc.returncode
        assert "exiting after a failure" in "".join(s.stdout)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        s.assert_nothing_left()


@pytest.mark.faults
def test_killing_the_engine_core_process_fails_in_flight_requests_and_exits_naming_it():
    """A monolithic server's engine runs in a process of its own: its death is a replica's death."""
    s = Server()
    try:
        core = s.rank_pids("engine core")
        assert len(core) == 1 and core[0] != s.proc.pid
        for outcome, after in _kill_under_load(s, core[0], streams=4):
            assert outcome.startswith("error") and "engine core" in outcome and "SIGKILL" in outcome, outcome
            assert after < 5, f"error came {after:.1f} s after the kill"
        s.proc.wait(30)
        assert s.proc.returncode not in (0, None), s.proc.returncode
        assert "exiting after a failure" in "".join(s.stdout) and "engine core" in "".join(s.stderr + s.stdout)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        s.assert_nothing_left()


@pytest.mark.faults
def test_monolithic_engine_failure_fails_requests_and_exits_nonzero():
    """The engine core of a monolithic server raises (injected at its 30th step): the stream in flight
    gets an error naming it, a request after it gets 503 or no connection, the server exits 1."""
    s = Server(env={"AFD_FAULT": "engine-step@30"})
    try:
        results: list = []
        t0 = [time.monotonic()]
        _stream_until_done(s.url, body(max_tokens=200, ignore_eos=True, stream=True), results, t0)
        (outcome, after), = results
        assert outcome.startswith("error") and "injected engine fault at step 30" in outcome, outcome
        assert after < 10
        try:
            r = httpx.post(s.url + "/v1/completions", json=body(), timeout=5)
            assert r.status_code == 503 and "has failed" in r.json()["error"]["message"]
        except httpx.ConnectError:
            pass  # already gone
        s.proc.wait(30)
        assert s.proc.returncode == 1
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        s.assert_nothing_left()


@pytest.mark.faults
def test_sigterm_finishes_short_requests_aborts_long_ones_and_leaves_nothing():
    # a slowed FFN side (20 ms per batch, >= 60 ms per step) makes 1000 tokens take a minute whatever the
    # machine, while 8 tokens still finish well within the 3 s deadline
    s = Server(*ONE_A_ONE_F, "--shutdown-timeout", "3", env={"AFD_FFN_DELAY_MS": "20"})
    try:
        results: list = []
        t_term: list = []
        payloads = [body(prompt="ROMEO:", max_tokens=8, stream=True)] * 2 + [body(prompt="KING:", max_tokens=1000, ignore_eos=True, stream=True)] * 2
        threads = [threading.Thread(target=_stream_until_done, args=(s.url, p, results, t_term)) for p in payloads]
        for t in threads:
            t.start()
        wait_for(lambda: s.metric("afd_requests_in_flight", wait=0) >= 4, 30, "four requests in flight")
        t_term.append(time.monotonic())
        s.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: _refuses(s.url), 5, "the server refusing new connections after SIGTERM")
        for t in threads:
            t.join(30)
        s.proc.wait(30)
        stopped_after = time.monotonic() - t_term[0]
        assert s.proc.returncode == 0, "".join(s.stderr)
        outcomes = sorted(o for o, _ in results)
        assert outcomes[:2] == ["done", "done"], outcomes  # short: finished within the deadline
        for o in outcomes[2:]:  # long: ended by the deadline with a clear error, not a cut connection
            assert o.startswith("error: the server is shutting down"), outcomes
        assert stopped_after < 3 + 15, stopped_after
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
        s.assert_nothing_left()


def _refuses(url: str) -> bool:
    """Whether the server takes no new request: the connection is refused, or (one that reached the listening
    socket's backlog just before the server closed it) reset unanswered."""
    try:
        httpx.post(url + "/v1/completions", json=body(), timeout=5)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
    return False


def test_busy_port_fails_at_once_and_starts_nothing():
    import socket
    import subprocess
    import sys
    import uuid

    from afd.cli.common import BUILTIN_MODEL
    from tests.support import run_processes

    run_id = uuid.uuid4().hex[:12]
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        res = subprocess.run([sys.executable, "-m", "afd.cli.main", "serve", str(BUILTIN_MODEL), "--port", port, *ONE_A_ONE_F],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "AFD_RUN_ID": run_id})
    assert res.returncode == 1 and "afd: error:" in res.stderr and "in use" in res.stderr and "Traceback" not in res.stderr
    assert "starting" not in res.stderr  # bound before any rank started
    assert not run_processes(run_id)
