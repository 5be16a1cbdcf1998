"""Run every multi-process fault test (``-m faults``) many times, and count the failures (the goal is none).

    python scripts/fault_loop.py [--rounds 20] [--busy] [--logs DIR] [-k EXPR]

Each round is one pytest process running every fault test once; every run inside it is isolated: its own
ports (picked free), shm links and run directory, and its own fork server (a fault test never shares the
session's). ``--busy``: a busy loop on every core beside the tests for the whole loop (the machine under
load, where timing bugs show). A failed run's output is kept under ``--logs``. Prints per test its
passes and failures, and the loop's wall time; exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def busy_loops(n: int) -> list[subprocess.Popen]:
    """``n`` processes that spin forever (ours: killed by PID when the loop ends)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_round(k: str | None, log: Path) -> tuple[dict[str, str], float]:
    """One pytest process over every fault test: test id -> passed / failed / error, and its wall time."""
    cmd = [sys.executable, "-m", "pytest", "-m", "faults", "-p", "no:cacheprovider", "-rA", "-q", "--timeout", "600"]
    if k:
        cmd += ["-k", k]
    t0 = time.monotonic()
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate()
        except BaseException:  # this loop stopped (Ctrl-C, SIGTERM): pytest tears its runs down, then exits
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)
            raise
    res = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    took = time.monotonic() - t0
    outcomes = {}
    for line in res.stdout.splitlines():
        m = re.match(r"^(PASSED|FAILED|ERROR) (.+?)(?: - .*)?$", line)
        if m:
            outcomes[m.group(2)] = m.group(1).lower()
    if res.returncode not in (0, 1) or not outcomes:
        outcomes["<pytest>"] = f"error (exit {res.returncode})"
    if res.returncode != 0:
        log.write_text(res.stdout + res.stderr)
    return outcomes, took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--busy", action="store_true", help="a busy loop on every core beside the tests")
    ap.add_argument("--logs", help="where failed rounds' output goes (default: a temp dir)")
    ap.add_argument("-k", help="only the fault tests pytest -k selects")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the round's pytest and the spinners go too
    logs = Path(args.logs or tempfile.mkdtemp(prefix="afd-fault-loop-"))
    logs.mkdir(parents=True, exist_ok=True)
    spinners = busy_loops(os.cpu_count() or 1) if args.busy else []
    passed: Counter = Counter()
    failed: Counter = Counter()
    times = []
    t0 = time.monotonic()
    try:
        for r in range(args.rounds):
            outcomes, took = run_round(args.k, logs / f"round-{r}.log")
            times.append(took)
            for test, outcome in outcomes.items():
                (passed if outcome == "passed" else failed)[test] += 1
            bad = [t for t, o in outcomes.items() if o != "passed"]
            print(f"round {r + 1}/{args.rounds}: {len(outcomes) - len(bad)} passed, {len(bad)} failed in {took:.0f} s"
                  + (f": {', '.join(bad)} (log {logs / f'round-{r}.log'})" if bad else ""), flush=True)
    finally:
        for p in spinners:  # only ours, by PID
            p.send_signal(signal.SIGKILL)
            p.wait()
    wall = time.monotonic() - t0
    print(f"\n{'test':100s} passed failed")
    for test in sorted(set(passed) | set(failed)):
        print(f"{test:100s} {passed[test]:6d} {failed[test]:6d}")
    runs = sum(passed.values()) + sum(failed.values())
    print(f"\nsummary: {len(set(passed) | set(failed))} fault tests x {args.rounds} rounds{' beside a busy loop on every core' if args.busy else ''}: "
          f"{runs} runs, {sum(failed.values())} failed, wall {wall / 60:.1f} min (a round: median {sorted(times)[len(times) // 2]:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
