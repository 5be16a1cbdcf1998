"""An FFN rank dies or hangs under load and no request is lost (real processes: ``afd serve``, 1 attention +
2 FFN ranks on shm, every expert on both FFN ranks). One seeded trial per fault; the full matrix of
injection points is ``scripts/chaos.py``."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.serving.server_proc import MODEL_NAME, Server
from tests.support import wait_for

pytestmark = pytest.mark.procs

REDUNDANT = ["--attention-ranks", "1", "--ffn-ranks", "2", "--redundant-experts", "8", "--hang-timeout", "2"]
STREAMS = 6


def _payload(i: int) -> dict:
    return {"model": MODEL_NAME, "prompt": f"KING {i}:", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}


def _run(s: Server, fault=None) -> dict:
    """STREAMS concurrent streams; ``fault()`` once every stream has produced tokens."""
    return s.streams([_payload(i) for i in range(STREAMS)], fault)


@pytest.mark.faults
def test_ffn_ranks_killed_then_hung_under_load_cost_no_request_and_change_no_text():
    """Two attention ranks, two FFN ranks, every expert on both. FFN rank 1 is killed under load: each
    attention rank sees the loss on its own, and the replacement is taken back at an agreed step. Then FFN
    rank 0 is stopped (SIGSTOP) under load: found hung after the 2 s timeout, killed by the launcher, and
    replaced in turn."""
    with Server(*REDUNDANT[:1], "2", *REDUNDANT[2:]) as s:
        assert any("every expert is on at least two FFN ranks" in line for line in s.stderr + s.stdout)
        reference = _run(s)
        assert all(outcome == "done" for outcome, _ in reference.values()), reference
        first = {r["name"]: r["pid"] for r in s.get("/health").json()["ranks"]}
        for n, (victim, sig) in enumerate([("ffn rank 1", signal.SIGKILL), ("ffn rank 0", signal.SIGSTOP)], start=1):
            pid = first[victim]
            out = _run(s, fault=lambda: os.kill(pid, sig))
            for i in range(STREAMS):
                assert out[i][0] == "done", (victim, out[i])
                assert out[i][1] == reference[i][1], f"stream {i} changed after {victim} was lost"
            assert s.get("/health").status_code == 200
            assert s.metric("afd_ffn_ranks_lost_total") == n and s.metric("afd_connector_redispatched_total") >= n
            if sig == signal.SIGSTOP:  # found hung and killed by the launcher, so no one waits on it again
                wait_for(lambda: _state(pid) in ("Z", "gone"), 10, f"{victim} (stopped) killed")
            # the launcher starts a replacement, which loads its experts and is linked back in
            wait_for(lambda: s.metric("afd_ffn_replacements_total", wait=0) >= n, 90, f"the replacement of {victim} back in use")
            assert s.metric("afd_ffn_replacements_total", wait=0) == n
            ranks = [r for r in s.get("/health").json()["ranks"] if r["name"] == victim]
            assert (pid, "lost") in [(r["pid"], r["state"]) for r in ranks]
            assert len([r for r in ranks if r["state"] == "serving" and r["pid"] != pid]) == 1
            rows = s.rank_metric("afd_ffn_rows_total", victim[-1])
            again = _run(s)  # the replacement is back in use
            assert all(again[i] == reference[i] for i in range(STREAMS))
            # its own counters move: it computed rows (its report of the run's end may reach the server just after
            # the last token does: a read at once saw the counters of before the run, one round in twenty)
            wait_for(lambda: s.rank_metric("afd_ffn_rows_total", victim[-1]) > rows, 10, f"rows computed by the replacement of {victim}")


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"




def _rows_by_rank(s: Server) -> list[float]:
    """Rows each FFN rank computed so far, once its reports account for every row the attention ranks sent it
    (an FFN rank reports at most once a second while busy: read too soon, a run's last rows would count in the
    next one)."""
    def settled() -> list[float] | None:
        text = s.get("/metrics").text
        ffn = [_sample(text, "afd_ffn_rows_total", f'rank="{r}"') for r in range(2)]
        sent = [_sample(text, "afd_connector_rows_sent_total", f'ffn="{r}"') for r in range(2)]
        return ffn if ffn == sent else None

    return wait_for(settled, 30, "the FFN ranks' counters accounting for every row sent")


def _sample(text: str, name: str, label: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") and label in line)


def _imbalance(before: list[float], after: list[float]) -> float:
    delta = [b - a for a, b in zip(before, after)]
    return max(delta) / (sum(delta) / len(delta))


def test_a_rebalance_while_serving_lowers_the_max_over_mean_ffn_load_and_changes_no_text():
    """A placement skewed against the load (every expert on FFN rank 0, one copy of expert 0 on rank 1):
    the rebalance packs copies by measured load, at an agreed step, with the new copies loaded from the
    checkpoint while the old ones serve."""
    with Server("--attention-ranks", "1", "--ffn-ranks", "2", "--placement", "0-7:0,0:1") as s:
        reference = _run(s)
        assert all(outcome == "done" for outcome, _ in reference.values()), reference
        rows = _rows_by_rank(s)
        second = _run(s)
        before = _imbalance(rows, _rows_by_rank(s))
        decision = s.post("/rebalance").json()
        assert decision["changed"] and decision["after"] < decision["before"], decision
        pending = _run(s)  # requests served while the move happens
        wait_for(lambda: s.metric("afd_placement_version", wait=0) >= 1, 60, "placement version 1 in use")
        assert s.metric("afd_placement_version") == 1 and s.metric("afd_rebalances_total") == 1
        rows = _rows_by_rank(s)
        after_run = _run(s)
        after = _imbalance(rows, _rows_by_rank(s))
        assert after < before and after < 1.3, (before, after)
        for run in (second, pending, after_run):
            assert all(run[i] == reference[i] for i in range(STREAMS))
        assert s.post("/rebalance").status_code == 200  # again, on the new load: allowed, nothing in progress


def test_the_rebalance_timer_moves_a_skewed_placement_by_itself():
    """--rebalance-every: the server checks the measured load and moves the placement when its max/mean is
    above the threshold, with no request to /rebalance; texts unchanged; the moves settle (the load is
    counted since the start: early, partial counts may take a second move)."""
    with Server("--attention-ranks", "1", "--ffn-ranks", "2", "--placement", "0-7:0,0:1", "--rebalance-every", "0.5") as s:
        reference = _run(s)
        deadline = time.monotonic() + 60
        while s.metric("afd_placement_version", wait=0) < 1 and time.monotonic() < deadline:
            _run(s)  # the switch happens at a step: keep steps coming (a wait with work in it)
        assert s.metric("afd_rebalances_total") >= 1
        assert any("automatic rebalance: FFN load max/mean" in line for line in s.stderr)
        for _ in range(3):
            assert _run(s) == reference
        moves, checks = s.metric("afd_rebalances_total"), s.metric("afd_rebalance_checks_total")
        wait_for(lambda: s.metric("afd_rebalance_checks_total", wait=0) >= checks + 3, 30, "three more checks of the load")
        assert _run(s) == reference
        assert s.metric("afd_rebalances_total") == moves <= 3, "the timer keeps moving a placement the load has settled"
