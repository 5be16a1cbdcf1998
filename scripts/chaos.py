#!/usr/bin/env python
"""Chaos trials against a real ``afd serve`` with redundant experts: every fault of the matrix, under load.

Each trial starts a fresh server (A attention ranks (``--attention-ranks``, default 1) + 2 FFN ranks on
shm or tcp (``--transport``), every expert on both FFN ranks, ``--hang-timeout`` T), streams S greedy requests at once, injects one fault, and
checks what the fault-tolerance page promises: no failed request, every text identical to a fault-free
run's, ``/health`` 200 afterwards, a replacement FFN rank (or a restarted attention rank) serving (the FFN
counters move), no process left after shutdown.

Faults (``--faults``, default all):
  kill                 SIGKILL of FFN rank 1 once every stream produced tokens
  hang                 SIGSTOP of FFN rank 1 (found hung after T, killed by the launcher)
  kill@mid-combine     AFD_FAULT=ffn-kill@N: FFN rank 1 dies on receiving its N-th work part (N from the seed)
  hang@mid-combine     AFD_FAULT=ffn-hang@N: it stops there instead
  kill@rebalance       POST /rebalance, then SIGKILL of FFN rank 0 while both load their new copies
  kill@replacement     SIGKILL of FFN rank 1, then of its replacement while it starts
  attention-kill       SIGKILL of attention rank A-1, restarted (A = 1: its requests wait and resume; A > 1: they
                       move to the others, and the restart rejoins their agreed steps)
  attention-hang       SIGSTOP of attention rank A-1 (found hung by the FFN ranks after T, killed, restarted)
  attention-kill@replacement  SIGKILL of FFN rank 1, then of attention rank A-1 while the replacement starts
                       (the replacement stops waiting for the dead rank's links; the restart links to it)

Reported per trial: failed requests, texts changed, the time from the fault to the next token of any
stream, the longest stall of a stream, p99 inter-token latency (all tokens of the trial) against the
fault-free run's, and the replacement's (or restart's) time to rejoin (from the launcher's log).

    python scripts/chaos.py --seeds 1 --out chaos.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from afd.cli.common import BUILTIN_MODEL  # noqa: E402
from afd.serving.spawn import ServerProcess  # noqa: E402

FAULTS = ("kill", "hang", "kill@mid-combine", "hang@mid-combine", "kill@rebalance", "kill@replacement", "attention-kill",
          "attention-hang", "attention-kill@replacement")


def flags(hang_timeout: float, transport: str, attention_ranks: int) -> list[str]:
    return ["--dtype", "float32", "--attention-ranks", str(attention_ranks), "--ffn-ranks", "2", "--redundant-experts", "8",
            "--hang-timeout", str(hang_timeout), "--transport", transport]


def start(hang_timeout: float, transport: str, attention_ranks: int, fault_env: str | None = None) -> ServerProcess:
    run_id = uuid.uuid4().hex[:12]
    env = {"AFD_NUM_THREADS": "1", "AFD_RUN_ID": run_id}
    if fault_env:
        env["AFD_FAULT"] = fault_env
    server = ServerProcess(BUILTIN_MODEL, *flags(hang_timeout, transport, attention_ranks), env=env)
    server.run_id = run_id
    return server


def left_behind(run_id: str) -> list[int]:
    """Live processes whose environment carries this run's id (the launcher sets it on every rank)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"AFD_RUN_ID={run_id}".encode() in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def stream(url: str, model: str, i: int, max_tokens: int, out: dict) -> None:
    payload = {"model": model, "prompt": f"KING {i}:", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    times, text, outcome = [], [], "cut"
    try:
        with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=300) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    outcome = "done"
                elif line.startswith("data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        outcome = "error: " + event["error"]["message"]
                    else:
                        times.append(time.monotonic())
                        text.append(event["choices"][0]["text"])
    except httpx.HTTPError as e:
        outcome = f"cut: {type(e).__name__}"
    out[i] = {"outcome": outcome, "text": "".join(text), "times": times}


def metric(url: str, name: str) -> float:
    lines = [x for x in httpx.get(url + "/metrics", timeout=30).text.splitlines() if x.startswith((name + " ", name + "{"))]
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines)


def ranks(url: str) -> list[dict]:
    return httpx.get(url + "/health", timeout=30).json().get("ranks", [])


def load(server: ServerProcess, streams: int, max_tokens: int, fault=None) -> tuple[dict, float | None]:
    out: dict = {}
    before = metric(server.url, "afd_generation_tokens_total")
    threads = [threading.Thread(target=stream, args=(server.url, server.model, i, max_tokens, out)) for i in range(streams)]
    for t in threads:
        t.start()
    t_fault = None
    if fault is not None:
        deadline = time.monotonic() + 60
        while metric(server.url, "afd_generation_tokens_total") - before < 4 * streams and time.monotonic() < deadline:
            time.sleep(0.05)
        t_fault = time.monotonic()
        fault(server)
    for t in threads:
        t.join(600)
    return out, t_fault


def pid_of(server: ServerProcess, name: str, state: str = "serving") -> int | None:
    return next((r["pid"] for r in ranks(server.url) if r["name"] == name and r.get("state") == state), None)


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def run_trial(fault: str, seed: int, args, reference: dict, baseline_p99: float) -> dict:
    rng = random.Random(seed)
    env = None
    if fault.endswith("@mid-combine"):
        env = f"ffn-{fault.split('@')[0]}@{rng.randint(30, 200)}"  # within the trial: ~6 parts per decode step
    server = start(args.hang_timeout, args.transport, args.attention_ranks, env)
    result: dict = {"fault": fault, "seed": seed, "fault_env": env}
    try:
        signals = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}

        def inject(s: ServerProcess) -> None:
            kind = fault.split("@")[0]
            if fault in ("kill", "hang"):
                os.kill(pid_of(s, "ffn rank 1"), signals[kind])
            elif fault == "attention-kill@replacement":
                os.kill(pid_of(s, "ffn rank 1"), signal.SIGKILL)
                wait_for(lambda: pid_of(s, "ffn rank 1", "starting") is not None, 30)
                os.kill(pid_of(s, f"attention rank {args.attention_ranks - 1}"), signal.SIGKILL)
            elif fault.startswith("attention-"):
                os.kill(pid_of(s, f"attention rank {args.attention_ranks - 1}"), signals[fault.split("-")[1]])
            elif fault == "kill@rebalance":
                httpx.post(s.url + "/rebalance", timeout=30)
                os.kill(pid_of(s, "ffn rank 0"), signal.SIGKILL)
            elif fault == "kill@replacement":
                os.kill(pid_of(s, "ffn rank 1"), signal.SIGKILL)
                wait_for(lambda: pid_of(s, "ffn rank 1", "starting") is not None, 30)
                time.sleep(rng.uniform(0.0, 1.0))  # somewhere in its start-up
                pid = pid_of(s, "ffn rank 1", "starting")
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)

        out, t_fault = load(server, args.streams, args.max_tokens, None if env else inject)
        failed = [i for i, r in out.items() if r["outcome"] != "done"]
        changed = [i for i, r in out.items() if r["text"] != reference[i]["text"]]
        gaps = [b - a for r in out.values() for a, b in zip(r["times"], r["times"][1:])]
        result.update(failed=len(failed), changed=len(changed), outcomes=[out[i]["outcome"] for i in failed])
        result["stall_s"] = max(gaps) if gaps else None
        result["p99_itl_ms"] = 1000 * statistics.quantiles(gaps, n=100)[98] if len(gaps) > 1 else None
        result["baseline_p99_itl_ms"] = baseline_p99
        if t_fault is not None:
            after = [t for r in out.values() for t in r["times"] if t > t_fault]
            result["fault_to_next_token_s"] = min(after) - t_fault if after else None
        result["health"] = httpx.get(server.url + "/health", timeout=30).status_code
        result["ranks_lost"] = metric(server.url, "afd_ffn_ranks_lost_total")
        result["redispatched"] = metric(server.url, "afd_connector_redispatched_total")
        back = (["afd_replicas_restarted_total"] if fault.startswith("attention-") else []) + \
            (["afd_ffn_replacements_total"] if not fault.startswith("attention-") or fault.endswith("@replacement") else [])
        result["replaced"] = wait_for(lambda: all(metric(server.url, name) >= 1 for name in back), 120)
        rows_before = metric(server.url, "afd_ffn_rows_total")
        again, _ = load(server, args.streams, 8)
        result["after_ok"] = all(r["outcome"] == "done" for r in again.values()) and metric(server.url, "afd_ffn_rows_total") > rows_before
        joined = [float(m.group(1)) for line in server.stderr
                  if (m := re.search(r"(?:replaced \(pid \d+, generation|restarted \(pid \d+, incarnation) \d+\) in ([\d.]+) s", line))]
        result["replacement_join_s"] = joined[0] if joined else None
    finally:
        code = server.stop()
        result["exit"] = code
    wait_for(lambda: not left_behind(server.run_id), 10)
    result["left_behind"] = left_behind(server.run_id)
    for pid in result["left_behind"]:  # only this run's processes
        os.kill(pid, signal.SIGKILL)
    result["ok"] = bool(result.get("failed") == 0 and result.get("changed") == 0 and result.get("health") == 200
                        and result.get("replaced") and result.get("after_ok") and code == 0 and not result["left_behind"])
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--seeds", type=int, default=1, help="trials per fault (seeds 0..N-1)")
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--hang-timeout", type=float, default=2.0)
    p.add_argument("--transport", choices=["shm", "tcp"], default="shm")
    p.add_argument("--attention-ranks", type=int, default=1)
    p.add_argument("--out", help="write every trial's result here (JSON)")
    args = p.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        p.error(f"unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    print(f"chaos: reference run (no fault), {args.streams} streams x {args.max_tokens} tokens", file=sys.stderr)
    with start(args.hang_timeout, args.transport, args.attention_ranks) as ref_server:
        reference, _ = load(ref_server, args.streams, args.max_tokens)
    gaps = [b - a for r in reference.values() for a, b in zip(r["times"], r["times"][1:])]
    baseline_p99 = 1000 * statistics.quantiles(gaps, n=100)[98]
    results = []
    for fault in faults:
        for seed in range(args.seeds):
            print(f"chaos: {fault} (seed {seed}) ...", file=sys.stderr, flush=True)
            r = run_trial(fault, seed, args, reference, baseline_p99)
            results.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "outcomes"}), file=sys.stderr, flush=True)
    print(f"{'fault':<20} {'seed':>4} {'ok':>3} {'failed':>6} {'changed':>7} {'to next tok s':>13} {'stall s':>7} "
          f"{'p99 ITL ms':>10} {'base p99':>8} {'rejoin s':>8}")
    for r in results:
        def f(key, fmt="{:.2f}"):
            return fmt.format(r[key]) if r.get(key) is not None else "-"
        print(f"{r['fault']:<20} {r['seed']:>4} {'yes' if r['ok'] else 'NO':>3} {r.get('failed', '-'):>6} {r.get('changed', '-'):>7} "
              f"{f('fault_to_next_token_s'):>13} {f('stall_s'):>7} {f('p99_itl_ms', '{:.0f}'):>10} {f('baseline_p99_itl_ms', '{:.0f}'):>8} "
              f"{f('replacement_join_s', '{:.1f}'):>8}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
