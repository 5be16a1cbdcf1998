"""An attention replica dies or hangs under load and its requests move (real processes: ``afd serve`` with 3
attention ranks and 1 FFN rank on shm): each is recomputed on a survivor from its prompt plus the tokens
it streamed, and the lost replica is restarted and rejoins the step agreement. A single attention rank is
restarted too, its requests waiting for it (1 attention + 2 FFN ranks, over shm and over tcp). No client sees an error or repeated text, greedy and seeded texts equal a fault-free run's."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.serving.server_proc import MODEL_NAME, Server

pytestmark = pytest.mark.procs

FLAGS = ["--attention-ranks", "3", "--ffn-ranks", "1", "--hang-timeout", "2", "--no-enable-prefix-caching"]
STREAMS = 8


def _payload(i: int) -> dict:
    sampled = i % 2 == 1  # every other stream samples with a seed: the move must not change its draws
    return {"model": MODEL_NAME, "prompt": f"KING {i}:", "max_tokens": 24, "ignore_eos": True, "stream": True,
            "temperature": 0.8 if sampled else 0, "seed": 100 + i if sampled else None, "presence_penalty": 0.5 if sampled else 0}


def _run(s: Server, fault=None) -> dict:
    """STREAMS concurrent streams; ``fault()`` once every stream has produced tokens."""
    return s.streams([_payload(i) for i in range(STREAMS)], fault)


def _serving(s: Server, name: str, timeout: float = 30.0) -> int:
    """The pid of ``name``'s incarnation that serves, once one does (a restart takes a second or two)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [r["pid"] for r in s.get("/health").json()["ranks"] if r["name"] == name and r["state"] == "serving"]
        if pids:
            return pids[0]
        time.sleep(0.1)
    raise AssertionError(f"{name} did not serve again within {timeout:.0f} s: {s.get('/health').json()['ranks']}")


def _replica_peak(s: Server, replica: int) -> float:
    """The most KV blocks the replica's current process held at once (a restart's counters start at 0)."""
    for line in s.get("/metrics").text.splitlines():
        if line.startswith("afd_kv_blocks_peak{") and f'replica="{replica}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.faults
def test_lost_replicas_requests_move_unchanged_and_their_restarts_rejoin_the_steps():
    """Three attention replicas: one is killed under load, then another is stopped (found hung by the FFN
    rank after 2 s and killed by the launcher). Each time every request moves and ends unchanged, and the
    lost replica is restarted: it joins the others' agreed steps at a step they agree on and serves again."""
    with Server(*FLAGS) as s:
        reference = _run(s)
        assert all(outcome == "done" for outcome, _ in reference.values()), reference
        for n, (victim, sig) in enumerate([("attention rank 2", signal.SIGKILL), ("attention rank 1", signal.SIGSTOP)], start=1):
            pid = _serving(s, victim)
            out = _run(s, fault=lambda: os.kill(pid, sig))
            for i in range(STREAMS):
                assert out[i][0] == "done", (victim, out[i])
                assert out[i][1] == reference[i][1], f"stream {i} changed after {victim} was lost"
            assert s.get("/health").status_code == 200
            assert _serving(s, victim) != pid  # its restart
            states = [(r["pid"], r["state"]) for r in s.get("/health").json()["ranks"] if r["name"] == victim]
            assert (pid, "lost") in states
            assert s.metric("afd_replicas_lost_total") == n and s.metric("afd_replicas_restarted_total") == n
            assert s.metric("afd_requests_moved_total") >= n
        again = _run(s)  # all three serve, the two restarts among them
        assert all(again[i] == reference[i] for i in range(STREAMS))
        assert _replica_peak(s, 1) > 0 and _replica_peak(s, 2) > 0, "a restart took no request"


@pytest.mark.faults
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


@pytest.mark.faults
def test_a_hybrid_release_served_split_refuses_images_and_moves_a_lost_replicas_requests(checkpoints):
    """Qwen3.5-MoE as released (multimodal layout), 2 attention ranks + 1 FFN rank: the start-up line counts the
    state slots, an image is refused with a 400, and a killed replica's requests are recomputed on the survivor
    (their linear-attention state rebuilt from the prompt and the tokens so far) with texts unchanged."""
    path = checkpoints["qwen35-moe-vl"][0]
    with Server("--attention-ranks", "2", "--ffn-ranks", "1", "--hang-timeout", "2", model_dir=path) as s:
        assert "state slots" in "".join(s.stdout + s.stderr)
        image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
        r = s.post("/v1/chat/completions", json={"model": s.model, "messages": [image]})
        assert r.status_code == 400 and "text only" in r.text
        payloads = [{"model": s.model, "prompt": f"To be, or not {i}", "max_tokens": 16, "ignore_eos": True, "stream": True,
                     "temperature": 0} for i in range(6)]
        reference = s.streams(payloads)
        assert all(outcome == "done" for outcome, _ in reference.values()), reference
        pid = _serving(s, "attention rank 1")
        out = s.streams(payloads, fault=lambda: os.kill(pid, signal.SIGKILL))
        assert out == reference
        assert s.metric("afd_requests_moved_total") >= 1
