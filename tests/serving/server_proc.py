"""``afd serve`` as a real process for tests: started on a free port, stopped (and checked) on exit."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid

import httpx

from afd.cli.common import BUILTIN_MODEL
from afd.serving.spawn import ServerProcess
from tests.support import run_processes, wait_for

MODEL_NAME = BUILTIN_MODEL.name


class Server(ServerProcess):
    """The built-in model in fp32, one torch thread per process, under its own run id (so that every
    process of the run can be found, and checked gone, afterwards)."""

    def __init__(self, *args: str, startup_timeout: float = 180.0, env: dict | None = None, model_dir=BUILTIN_MODEL) -> None:
        self.run_id = uuid.uuid4().hex[:12]
        super().__init__(model_dir, "--dtype", "float32", *args, startup_timeout=startup_timeout,
                         env={"AFD_NUM_THREADS": "1", "AFD_RUN_ID": self.run_id, **(env or {})})

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, timeout=120, **kw)

    def metric(self, name: str, wait: float = 5.0) -> float:
        """Sum of a metric's samples over its labels (e.g. afd_kv_blocks_used over replicas). Engine
        counters appear with the replicas' first report, just after start: wait for them a little."""
        deadline = time.monotonic() + wait
        while True:
            samples = [line for line in self.get("/metrics").text.splitlines() if line.startswith((name + "{", name + " "))]
            if samples or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert samples, f"metric {name} not exported"
        return sum(float(line.rsplit(" ", 1)[1]) for line in samples)

    def stream_text(self, payload: dict, chunks: list[int] | None = None, index: int = 0) -> tuple[str, str]:
        """One streaming completion: (outcome, text); outcome is done, ``error: ...``, ``status N`` or ``cut: ...``.
        ``chunks[index]`` counts the text chunks received so far (for a caller waiting on this stream)."""
        text, outcome = [], "cut"
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=payload, timeout=120) as r:
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
                            if chunks is not None:
                                chunks[index] += 1
        except httpx.HTTPError as e:
            outcome = f"cut: {type(e).__name__}"
        return outcome, "".join(text)

    def streams(self, payloads: list[dict], fault=None) -> dict[int, tuple[str, str]]:
        """Every payload streamed at once; ``fault()`` once each stream has received a few chunks (under load:
        counted per stream, since a total can be reached by the first streams before the last one starts)."""
        out: dict = {}
        chunks = [0] * len(payloads)
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, self.stream_text(payloads[i], chunks, i))) for i in range(len(payloads))]
        for t in threads:
            t.start()
        if fault is not None:
            wait_for(lambda: all(c >= 4 or i in out for i, c in enumerate(chunks)), 60, "every stream producing tokens (or done)")
            fault()
        for t in threads:
            t.join(120)
        return out

    def rank_metric(self, name: str, rank: str) -> float:
        """One sample of a metric with a ``rank`` label (0 when that rank has none yet)."""
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + "{") and f'rank="{rank}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def rank_pids(self, prefix: str) -> list[int]:
        return [r["pid"] for r in self.get("/health").json()["ranks"] if r["name"].startswith(prefix)]

    def stop(self, timeout: float = 60.0) -> int:
        code = super().stop(timeout)
        if code is None:
            raise AssertionError("afd serve did not stop within its SIGTERM deadline")
        return code

    def assert_nothing_left(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while run_processes(self.run_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = run_processes(self.run_id)
        for pid in left:  # only ever the processes of this run
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes of run {self.run_id} left behind: {left}"

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.assert_nothing_left()
