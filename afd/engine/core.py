"""The engine core: a monolithic engine in a process of its own that only schedules and steps.

A server's HTTP process tokenizes, detokenizes, checks stop strings and streams (afd/serving). The engine
core gets token ids and sampling params over a pipe and sends token ids back, in the messages of
afd/engine/serve_loop.py. The step loop then shares no GIL with uvicorn, and the text work runs beside
it. This is the split vLLM v1 makes between its API server and EngineCore. In a disaggregated run every
attention rank is already such a process (afd/engine/ranks.py), so every server has the same shape:
one front end, and engine processes behind it.

The pipe is a ``multiprocessing`` connection: a Unix socket carrying pickled tuples. A step's deltas go
as one message; a request's round trip costs about 1 ms beyond its step here (docs/benchmarks.md,
"Serving against vLLM").
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from afd import env
from afd.engine.launcher import exit_reason
from afd.engine.ranks import EngineArgs, die_with_parent, report_failure


class EngineCoreDied(RuntimeError):
    """The engine-core process died or reported an error."""


@dataclass(frozen=True)
class CoreSpec:
    model_dir: Path
    engine: EngineArgs
    device: str = "cpu"


@dataclass(frozen=True)
class CoreReady:
    pid: int
    max_model_len: int
    limits: str  # EngineLimits.describe(): what the flags came to


def run_core(spec: CoreSpec, conn: Connection) -> None:
    """The engine-core process: load, report READY, serve until ("stop",). Errors reach the parent."""
    try:
        die_with_parent()
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s engine core %(levelname)s %(name)s: %(message)s")
        if (threads := env.num_threads()) is not None:
            import torch

            torch.set_num_threads(threads)
        from afd.engine.llm_engine import LLMEngine
        from afd.engine.serve_loop import serve_requests

        e = spec.engine
        engine = LLMEngine.from_pretrained(spec.model_dir, dtype=e.dtype, kv_cache_memory=e.kv_cache_memory, block_size=e.block_size,
                                           max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                                           device=spec.device, max_step_memory=e.max_step_memory, max_model_len=e.max_model_len,
                                           fp8_weights=e.fp8_weights, enable_prefix_caching=e.enable_prefix_caching)
        conn.send(("ready", CoreReady(os.getpid(), engine.max_model_len, engine.limits.describe())))
        serve_requests(engine, conn)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the server
        report_failure(conn, "engine core", e)
        os._exit(1)


class EngineCoreProcess:
    """The server's handle on its engine core: start, send, poll (which notices a death at once), stop."""

    def __init__(self, spec: CoreSpec, ready_timeout: float = 300.0) -> None:
        import multiprocessing as mp

        self.spec = spec
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=run_core, args=(spec, child), name="afd-engine-core", daemon=True)
        self.proc.start()
        child.close()
        self.stopping = False
        deadline = time.monotonic() + ready_timeout
        self.ready: CoreReady | None = None
        try:
            while self.ready is None:
                if time.monotonic() > deadline:
                    raise EngineCoreDied(f"the engine core (pid {self.proc.pid}) was not ready within {ready_timeout:g} s")
                for msg in self.poll(0.5):
                    if msg[0] == "ready":
                        self.ready = msg[1]
        except BaseException:
            self.close(0.0)
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, cmd: tuple) -> None:
        self.conn.send(cmd)

    def poll(self, timeout: float) -> list[tuple]:
        """Messages within ``timeout`` s. Raises :class:`EngineCoreDied` on an error report or a death."""
        out = []
        ready = wait([self.conn, self.proc.sentinel], timeout)
        while self.conn in ready and self.conn.poll():
            try:
                msg = self.conn.recv()
            except EOFError:
                break
            if msg[0] == "error":
                logging.getLogger(__name__).debug("%s", msg[2])
                raise EngineCoreDied(msg[1])
            out.append(msg)
        if self.proc.sentinel in ready and not self.stopping:
            self.proc.join(1.0)
            raise EngineCoreDied(f"the engine core (pid {self.proc.pid}) died: {exit_reason(self.proc.exitcode)}")
        return out

    def close(self, timeout: float) -> None:
        """Ask it to stop (it aborts what is left), then SIGTERM, then SIGKILL. Idempotent."""
        self.stopping = True
        if self.proc.is_alive() and timeout > 0:
            try:
                self.conn.send(("stop",))
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
