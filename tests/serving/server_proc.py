"""``afd serve`` as a real process for tests: started on a free port, stopped (and checked) on exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx

from afd.cli.common import BUILTIN_MODEL
from afd.serving.server import parse_listening_line
from tests.support import run_processes

MODEL_NAME = BUILTIN_MODEL.name


class Server:
    def __init__(self, *args: str, startup_timeout: float = 180.0, env: dict | None = None) -> None:
        self.run_id = uuid.uuid4().hex[:12]
        cmd = [sys.executable, "-m", "afd.cli.main", "serve", str(BUILTIN_MODEL), "--port", "0", "--dtype", "float32", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "AFD_NUM_THREADS": "1", "AFD_RUN_ID": self.run_id, **(env or {})})
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr), daemon=True).start()
        deadline = time.monotonic() + startup_timeout
        self.url = None
        while self.url is None:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(10)
                raise RuntimeError(f"afd serve exited ({self.proc.returncode}) before listening:\n{''.join(self.stderr)}")
            self.stdout.append(line)
            if (listening := parse_listening_line(line)) is not None:
                self.url = listening[1]
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("afd serve did not start in time")
        threading.Thread(target=self._drain, args=(self.proc.stdout, self.stdout), daemon=True).start()

    @staticmethod
    def _drain(pipe, sink: list[str]) -> None:
        for line in pipe:
            sink.append(line)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

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

    def rank_pids(self, prefix: str) -> list[int]:
        return [r["pid"] for r in self.get("/health").json()["ranks"] if r["name"].startswith(prefix)]

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError("afd serve did not stop within its SIGTERM deadline")
        return self.proc.returncode

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
