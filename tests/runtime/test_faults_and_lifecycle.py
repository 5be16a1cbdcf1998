"""Faults are reported, never hung on; a dead rank fails the job fast; nothing of a run outlives it."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from afd.cli.common import BUILTIN_MODEL
from afd.distributed.topology import Topology, TopologyError, parse_devices
from tests import support
from tests.support import run_processes

pytestmark = pytest.mark.procs


def afd_cmd(*args: str, verbose: bool = False) -> list[str]:
    return [sys.executable, "-m", "afd.cli.main", *(["-v"] if verbose else []), "generate", str(BUILTIN_MODEL), *args]


def env_with(**extra) -> dict[str, str]:
    return {**os.environ, "AFD_NUM_THREADS": "1", **extra}


@pytest.mark.parametrize("transport", ["shm", "torch"])
@pytest.mark.parametrize("fault, expect", [
    ("corrupt-header", "bad magic"),
    ("wrong-layer", "layer"),
    ("wrong-seq", "out of order|does not pair"),
    ("truncate", "truncated payload"),
])
@pytest.mark.faults
def test_protocol_faults_fail_loudly_naming_both_ranks(transport, fault, expect):
    run_id = uuid.uuid4().hex[:12]
    res = subprocess.run(
        afd_cmd("--prompt", "ROMEO:", "--max-tokens", "8", "--attention-ranks", "1", "--ffn-ranks", "1", "--transport", transport, "--dtype", "float32", "--mode", "sync"),
        capture_output=True, text=True, timeout=120, env=env_with(AFD_FAULT=f"{fault}@3", AFD_RUN_ID=run_id),
    )
    assert res.returncode != 0
    err = res.stderr
    assert "ffn rank 0" in err and "attention rank 0" in err, err
    import re

    assert re.search(expect, err), err
    assert not run_processes(run_id)


@pytest.mark.faults
def test_killing_an_ffn_rank_fails_the_job_fast_and_leaves_nothing():
    run_id = uuid.uuid4().hex[:12]
    prompts = [a for p in ("ROMEO:", "KING.", "To be", "Enter") for a in ("--prompt", p)]
    run = support.Command(afd_cmd(*prompts, "--max-tokens", "900", "--ignore-eos", "--attention-ranks", "1", "--ffn-ranks", "2",
                                  "--transport", "shm", "--mode", "async", "--num-microbatches", "2", verbose=True),
                          env=env_with(AFD_RUN_ID=run_id))
    try:
        run.wait_line("attention rank 0 READY", 120)  # every rank READY: generating
        victim = next(pid for pid, rank in run_processes(run_id).items() if rank == "afd ffn 1")
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        code = run.wait(30)
        elapsed = time.monotonic() - t0
    finally:
        run.kill()
    assert code != 0
    assert elapsed < 10, f"took {elapsed:.1f} s to notice"
    assert "ffn rank 1" in run.output and ("SIGKILL" in run.output or "gone" in run.output), run.output
    support.wait_for(lambda: not run_processes(run_id), 5, "every process of the run gone")


@pytest.mark.faults
def test_a_call_that_meets_a_failure_being_gathered_is_told_its_cause(monkeypatch):
    """Stop 39's CI failure, made certain: the owner notices a dead rank, then waits GATHER_S for the peers'
    reports before it fails the run. A call posted in that wait (here the front end attaching, as ``afd
    generate`` does right after READY) used to get "run ... is shut down" and the cause was never printed."""
    from afd.runtime import cluster as cluster_module
    from afd.runtime.launcher import RankFailedError

    monkeypatch.setattr(cluster_module, "GATHER_S", 3.0)  # the post lands well inside the wait
    topology = Topology(parse_devices("cpu"), parse_devices("cpu,cpu"), transport="shm")
    run = support.cluster(BUILTIN_MODEL, topology, threads=1).start()
    try:
        victim = next(r for r in run.ranks if r.spec.name == "ffn rank 1")
        os.kill(victim.pid, signal.SIGKILL)
        time.sleep(1.0)  # the owner saw the exit at once (it waits on the process's sentinel) and is gathering
        with pytest.raises(RankFailedError, match=r"ffn rank 1 \(pid \d+\) died: .*SIGKILL"):
            run.start_serving()
        assert run.failure is not None and "ffn rank 1" in run.failure
        with pytest.raises(RankFailedError, match="ffn rank 1"):  # and every call after it
            run.request(0, None)
    finally:
        run.shutdown(graceful=False)


def test_bad_topology_starts_nothing():
    t = Topology(parse_devices("cpu"), parse_devices(",".join(["cpu"] * 9)), transport="shm")
    with pytest.raises(TopologyError, match="9 FFN ranks"):
        support.cluster(BUILTIN_MODEL, t)
    assert not mp.active_children()
    run_id = uuid.uuid4().hex[:12]
    res = subprocess.run(afd_cmd("--prompt", "x", "--attention-devices", "cpu:0-1", "--ffn-devices", "cpu:1"),
                         capture_output=True, text=True, timeout=60, env=env_with(AFD_RUN_ID=run_id))
    assert res.returncode == 2 and "CPU core 1" in res.stderr and "must not overlap" in res.stderr


@pytest.mark.faults
def test_ctrl_c_stops_every_rank():
    run_id = uuid.uuid4().hex[:12]
    run = support.Command(afd_cmd("--prompt", "ROMEO:", "--max-tokens", "900", "--ignore-eos", "--attention-ranks", "2",
                                  "--ffn-ranks", "1", "--mode", "sync", verbose=True), env=env_with(AFD_RUN_ID=run_id),
                          # as from a terminal: a shell without job control starts background jobs with SIGINT ignored,
                          # and the child would inherit that (a CI runner may be such a job)
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for rank in ("attention rank 0", "attention rank 1"):
            run.wait_line(f"{rank} READY", 120)  # generating
        titles = sorted(run_processes(run_id).values())  # the command, its fork server and resource tracker, 3 ranks
        assert [t for t in titles if t.startswith("afd ")] == ["afd attn 0", "afd attn 1", "afd ffn 0"], titles
        run.proc.send_signal(signal.SIGINT)
        code = run.wait(20)
    finally:
        run.kill()
    assert code == 130, run.output
    support.wait_for(lambda: not run_processes(run_id), 5, "every process of the run gone")
