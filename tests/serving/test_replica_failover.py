"""An attention replica dies or hangs under load and its requests move (real processes: ``afd serve`` with 3
attention ranks and 1 FFN rank on shm): each is recomputed on the survivor from its prompt plus the tokens
it streamed. A single attention rank is restarted instead, its requests waiting for it (1 attention + 2 FFN
ranks, over shm and over tcp). No client sees an error or repeated text, greedy and seeded texts equal a fault-free run's."""

from __future__ import annotations

import os
import signal

import pytest

from tests.serving.server_proc import MODEL_NAME, Server

FLAGS = ["--attention-ranks", "3", "--ffn-ranks", "1", "--hang-timeout", "2", "--no-enable-prefix-caching"]
STREAMS = 8


def _payload(i: int) -> dict:
    sampled = i % 2 == 1  # every other stream samples with a seed: the move must not change its draws
    return {"model": MODEL_NAME, "prompt": f"KING {i}:", "max_tokens": 24, "ignore_eos": True, "stream": True,
            "temperature": 0.8 if sampled else 0, "seed": 100 + i if sampled else None, "presence_penalty": 0.5 if sampled else 0}


def _run(s: Server, fault=None) -> dict:
    """STREAMS concurrent streams; ``fault()`` once every stream has produced tokens."""
    return s.streams([_payload(i) for i in range(STREAMS)], fault)


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


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_single_replica_is_restarted_and_its_requests_wait_for_it(transport):
    """One attention rank: killed under load, it is restarted (new links, the same weights), and every request
    resumes on the restart from what it streamed; then the restart is stopped, found hung by the FFN ranks
    after 2 s, killed, and restarted again."""
    with Server("--attention-ranks", "1", "--ffn-ranks", "2", "--transport", transport, "--hang-timeout", "2") as s:
        reference = _run(s)
        assert all(outcome == "done" for outcome, _ in reference.values()), reference
        for n, sig in enumerate([signal.SIGKILL, signal.SIGSTOP], start=1):
            victim = next(r["pid"] for r in s.get("/health").json()["ranks"] if r["name"] == "attention rank 0" and r["state"] == "serving")
            out = _run(s, fault=lambda: os.kill(victim, sig))
            for i in range(STREAMS):
                assert out[i][0] == "done", (sig, out[i])
                assert out[i][1] == reference[i][1], f"stream {i} changed after the attention rank was lost ({sig.name})"
            assert s.get("/health").status_code == 200
            ranks = [(r["pid"], r["state"]) for r in s.get("/health").json()["ranks"] if r["name"] == "attention rank 0"]
            assert (victim, "lost") in ranks and len([pid for pid, state in ranks if state == "serving"]) == 1
            assert s.metric("afd_replicas_lost_total") == n and s.metric("afd_replicas_restarted_total") == n
        assert _run(s) == reference  # the second restart serves on
