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
from afd.engine.launcher import Cluster
from tests.support import run_processes


def afd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "afd.cli.main", "generate", str(BUILTIN_MODEL), *args]


def env_with(**extra) -> dict[str, str]:
    return {**os.environ, "AFD_NUM_THREADS": "1", **extra}


@pytest.mark.parametrize("transport", ["shm", "torch"])
@pytest.mark.parametrize("fault, expect", [
    ("corrupt-header", "bad magic"),
    ("wrong-layer", "layer"),
    ("wrong-seq", "out of order|does not pair"),
    ("truncate", "truncated payload"),
])
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


def test_killing_an_ffn_rank_fails_the_job_fast_and_leaves_nothing():
    run_id = uuid.uuid4().hex[:12]
    prompts = [a for p in ("ROMEO:", "KING.", "To be", "Enter") for a in ("--prompt", p)]
    proc = subprocess.Popen(
        afd_cmd(*prompts, "--max-tokens", "900", "--ignore-eos", "--attention-ranks", "1", "--ffn-ranks", "2", "--transport", "shm", "--mode", "async", "--num-microbatches", "2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with(AFD_RUN_ID=run_id),
    )
    try:
        victim = None
        deadline = time.monotonic() + 120
        while victim is None and time.monotonic() < deadline:
            victim = next((pid for pid, rank in run_processes(run_id).items() if rank == "afd ffn 1"), None)
            time.sleep(0.2)
        assert victim is not None, "the FFN rank never started"
        time.sleep(4.0)  # READY and generating
        assert proc.poll() is None, proc.communicate()
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 10, f"took {elapsed:.1f} s to notice"
    assert "ffn rank 1" in err and ("SIGKILL" in err or "gone" in err), err
    deadline = time.monotonic() + 5
    while run_processes(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not run_processes(run_id), "processes of the run outlived it"


def test_bad_topology_starts_nothing():
    t = Topology(parse_devices("cpu"), parse_devices(",".join(["cpu"] * 9)), transport="shm")
    with pytest.raises(TopologyError, match="9 FFN ranks"):
        Cluster(BUILTIN_MODEL, t)
    assert not mp.active_children()
    run_id = uuid.uuid4().hex[:12]
    res = subprocess.run(afd_cmd("--prompt", "x", "--attention-devices", "cpu:0-1", "--ffn-devices", "cpu:1"),
                         capture_output=True, text=True, timeout=60, env=env_with(AFD_RUN_ID=run_id))
    assert res.returncode == 2 and "CPU core 1" in res.stderr and "must not overlap" in res.stderr


def test_ctrl_c_stops_every_rank():
    run_id = uuid.uuid4().hex[:12]
    proc = subprocess.Popen(
        afd_cmd("--prompt", "ROMEO:", "--max-tokens", "900", "--ignore-eos", "--attention-ranks", "2", "--ffn-ranks", "1", "--mode", "sync"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with(AFD_RUN_ID=run_id),
        # as from a terminal: a shell without job control starts background jobs with SIGINT ignored,
        # and the child would inherit that (a CI runner may be such a job)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while len(run_processes(run_id)) < 5 and time.monotonic() < deadline:  # launcher, fork server, 3 ranks
            time.sleep(0.2)
        time.sleep(3.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    deadline = time.monotonic() + 5
    while run_processes(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not run_processes(run_id)
