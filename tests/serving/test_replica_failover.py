"""An attention replica dies or hangs under load and its requests move (real processes: ``afd serve`` with 2
attention ranks and 1 FFN rank on shm): each is recomputed on the survivor from its prompt plus the tokens
it streamed. No client sees an error or repeated text, greedy and seeded texts equal a fault-free run's."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
from tests.serving.server_proc import MODEL_NAME, Server

FLAGS = ["--attention-ranks", "3", "--ffn-ranks", "1", "--hang-timeout", "2", "--no-enable-prefix-caching"]
STREAMS = 8


def _payload(i: int) -> dict:
    sampled = i % 2 == 1  # every other stream samples with a seed: the move must not change its draws
    return {"model": MODEL_NAME, "prompt": f"KING {i}:", "max_tokens": 24, "ignore_eos": True, "stream": True,
            "temperature": 0.8 if sampled else 0, "seed": 100 + i if sampled else None, "presence_penalty": 0.5 if sampled else 0}


def _stream(url: str, i: int, out: dict) -> None:
    text, outcome = [], "cut"
    try:
        with httpx.stream("POST", url + "/v1/completions", json=_payload(i), timeout=120) as r:
            outcome = f"status {r.status_code}" if r.status_code != 200 else outcome
            for line in r.iter_lines() if r.status_code == 200 else ():
                if line == "data: [DONE]":
                    outcome = "done"
                elif line.startswith("data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        outcome = "error: " + event["error"]["message"]
                    else:
                        text.append(event["choices"][0]["text"])
    except httpx.HTTPError as e:
        outcome = f"cut: {type(e).__name__}"
    out[i] = (outcome, "".join(text))


def _run(s: Server, fault=None) -> dict:
    out: dict = {}
    before = s.metric("afd_generation_tokens_total", wait=0)
    threads = [threading.Thread(target=_stream, args=(s.url, i, out)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    if fault is not None:
        deadline = time.monotonic() + 60
        while s.metric("afd_generation_tokens_total", wait=0) - before < 4 * STREAMS and time.monotonic() < deadline:
            time.sleep(0.05)
        fault()
    for t in threads:
        t.join(120)
    return out


def test_lost_replicas_requests_move_and_finish_unchanged():
    """Three attention replicas: one is killed under load, then another is stopped (found hung by the FFN
    rank after 2 s and killed by the launcher); every request ends on the last one, unchanged."""
    with Server(*FLAGS) as s:
        reference = _run(s)
        assert all(outcome == "done" for outcome, _ in reference.values()), reference
        pids = {r["name"]: r["pid"] for r in s.get("/health").json()["ranks"]}
        for n, (victim, sig) in enumerate([("attention rank 2", signal.SIGKILL), ("attention rank 1", signal.SIGSTOP)], start=1):
            out = _run(s, fault=lambda: os.kill(pids[victim], sig))
            for i in range(STREAMS):
                assert out[i][0] == "done", (victim, out[i])
                assert out[i][1] == reference[i][1], f"stream {i} changed after {victim} was lost"
            assert s.get("/health").status_code == 200
            states = {r["name"]: r["state"] for r in s.get("/health").json()["ranks"]}
            assert states[victim] == "lost" and states["attention rank 0"] == "serving"
            assert s.metric("afd_replicas_lost_total") == n and s.metric("afd_requests_moved_total") >= n
        again = _run(s)  # the survivor serves everything now
        assert all(again[i] == reference[i] for i in range(STREAMS))
