"""The engine core: a monolithic engine in a process of its own that only schedules and steps.

A server's HTTP process tokenizes, detokenizes, checks stop strings and streams (afd/serving). The engine
core gets token ids and sampling params over a pipe and sends token ids back, in the messages of
afd/engine/messages.py. The step loop then shares no GIL with uvicorn, and the text work runs beside
it. This is the split vLLM v1 makes between its API server and EngineCore. In a disaggregated run every
attention rank is already such a process (afd/runtime/attention_rank.py), so every server has the same
shape: one front end, and engine processes behind it.

The pipe is a ``multiprocessing`` connection: a Unix socket carrying pickled dataclasses. A step's deltas
go as one message; a request's round trip costs about 1 ms beyond its step here (docs/benchmarks.md,
"Serving against vLLM").
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from afd.config import EngineArgs, FaultPlan, Timeouts
from afd.engine.messages import StopServing
from afd.runtime.messages import CoreReady, Failed
from afd.runtime.procs import die_with_parent, exit_reason, keep_freed_memory, report_failure, set_title


class EngineCoreDied(RuntimeError):
    """The engine-core process died or reported an error."""


@dataclass(frozen=True)
class CoreSpec:
    model_dir: Path
    engine: EngineArgs
    device: str = "cpu"
    threads: int | None = None  # torch threads (None: torch's own choice)
    faults: FaultPlan | None = None  # tests (afd/runtime/faults.py)


def run_core(spec: CoreSpec, conn: Connection) -> None:
    """The engine-core process: load, report READY, serve until StopServing. Errors reach the parent."""
    try:
        die_with_parent()
        set_title("afd core")
        keep_freed_memory()
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s engine core %(levelname)s %(name)s: %(message)s")
        if spec.threads is not None:
            import torch

            torch.set_num_threads(spec.threads)
        from afd.engine.llm_engine import LLMEngine
        from afd.engine.serve_loop import serve_requests
        from afd.runtime.faults import engine_runner

        engine = LLMEngine.from_pretrained(spec.model_dir, spec.engine, device=spec.device)
        engine.runner = engine_runner(engine.runner, spec.faults)
        conn.send(CoreReady(os.getpid(), engine.max_model_len, engine.limits.describe()))
        serve_requests(engine, conn)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the server
        report_failure(conn, "engine core", e)
        os._exit(1)


class EngineCoreProcess:
    """The server's handle on its engine core: start, send, poll (which notices a death at once), stop."""

    def __init__(self, spec: CoreSpec, timeouts: Timeouts = Timeouts()) -> None:
        self.spec, self.timeouts = spec, timeouts
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=run_core, args=(spec, child), name="afd-engine-core", daemon=True)
        self.proc.start()
        child.close()
        self.stopping = False
        deadline = time.monotonic() + timeouts.ready
        self.ready: CoreReady | None = None
        try:
            while self.ready is None:
                if time.monotonic() > deadline:
                    raise EngineCoreDied(f"the engine core (pid {self.proc.pid}) was not ready within {timeouts.ready:g} s")
                for msg in self.poll(0.5):
                    if isinstance(msg, CoreReady):
                        self.ready = msg
        except BaseException:
            self.close(0.0)
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: object) -> None:
        self.conn.send(msg)

    def poll(self, timeout: float) -> list:
        """Messages within ``timeout`` s. Raises :class:`EngineCoreDied` on a failure report or a death."""
        out, broken = [], False
        ready = wait([self.conn, self.proc.sentinel], timeout)
        while self.conn in ready and self.conn.poll():
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the pipe ended, or was reset (a process killed with bytes unread): it is dying
                broken = True
                break
            if isinstance(msg, Failed):
                logging.getLogger(__name__).debug("%s", msg.detail)
                raise EngineCoreDied(msg.text)
            out.append(msg)
        if (broken or self.proc.sentinel in ready) and not self.stopping:
            self.proc.join(5.0 if broken else 1.0)  # its exit names the cause (a broken pipe may come before the exit)
            raise EngineCoreDied(f"the engine core (pid {self.proc.pid}) died: {exit_reason(self.proc.exitcode)}")
        return out

    def close(self, timeout: float | None = None) -> None:
        """Ask it to stop (it aborts what is left), then SIGTERM, then SIGKILL. Idempotent."""
        timeout = self.timeouts.shutdown if timeout is None else timeout
        self.stopping = True
        if self.proc.is_alive() and timeout > 0:
            try:
                self.conn.send(StopServing())
                deadline = time.monotonic() + timeout
                while self.proc.is_alive() and time.monotonic() < deadline:
                    if self.conn.poll(0.1):
                        self.conn.recv()
            except (OSError, EOFError):
                pass
        for stop in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                stop()
                self.proc.join(2.0)
        self.conn.close()
