"""``afd serve`` as a child process on a free port: the one way tests, benchmarks and scripts start a
server. Started with ``--port 0``; the bound address is read from its listening line. Stopped with
SIGTERM (then SIGKILL past the deadline), so nothing is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from afd.serving.server import parse_listening_line


class ServerProcess:
    """One ``afd serve MODEL --port 0 FLAGS...``. Its stdout and stderr lines are kept (``stdout``,
    ``stderr``) for the caller to read or show when something fails."""

    def __init__(self, model_dir: str | Path, *flags: str, env: dict | None = None, startup_timeout: float = 180.0,
                 host: str = "127.0.0.1") -> None:
        cmd = [sys.executable, "-m", "afd.cli.main", "serve", str(model_dir), "--host", host, "--port", "0", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr), daemon=True).start()
        deadline = time.monotonic() + startup_timeout
        self.url: str | None = None
        self.model: str | None = None
        try:
            while self.url is None:
                line = self.proc.stdout.readline()
                if not line:
                    self.proc.wait(10)
                    raise RuntimeError(f"afd serve {' '.join(flags)} exited ({self.proc.returncode}) before listening:\n"
                                       + "".join(self.stderr)[-4000:])
                self.stdout.append(line)
                if (listening := parse_listening_line(line)) is not None:
                    self.model, self.url = listening
                if time.monotonic() > deadline:
                    raise RuntimeError(f"afd serve {' '.join(flags)} did not start within {startup_timeout:g} s")
        except BaseException:
            self.kill()
            raise
        threading.Thread(target=self._drain, args=(self.proc.stdout, self.stdout), daemon=True).start()

    @staticmethod
    def _drain(pipe, sink: list[str]) -> None:
        for line in pipe:
            sink.append(line)

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL (``.../v1``)."""
        return self.url + "/v1"

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait for the drain; SIGKILL if it does not end in ``timeout``. Returns the exit
        status, or None when it had to be killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
