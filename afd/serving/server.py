"""``afd serve``'s process: the listening socket, uvicorn over the app (afd/serving/app.py), SIGTERM's drain,
and the automatic rebalance. SIGTERM stops accepting, lets in-flight requests finish until the shutdown
deadline, aborts the rest and stops every rank; a replica failure the run does not survive makes the
server exit 1, naming it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import time

from afd.runtime.rebalance import RebalanceRefused
from afd.serving.app import ServerState, create_app

log = logging.getLogger(__name__)


def listening_line(model: str, url: str) -> str:
    """What the server prints once it listens (launchers, the load generator and tests read it back)."""
    return f"afd serve: {model} on {url} (pid {os.getpid()})"


def parse_listening_line(line: str) -> tuple[str, str] | None:
    """(model, url) from :func:`listening_line`'s output, else None."""
    m = re.match(r"afd serve: (.+) on (http://\S+) \(pid \d+\)$", line.strip())
    return (m.group(1), m.group(2)) if m else None


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket. Its protocol is named (IPPROTO_TCP) because asyncio turns Nagle's
    algorithm off only on connections whose socket says so: from ``socket.create_server`` (protocol 0)
    every stream's first chunk, written just after its headers, waited about 40 ms for the client's
    delayed ACK (measured: TTFT 80 ms for a 36 ms first token)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


async def auto_rebalance(state: ServerState) -> None:
    """Every ``rebalance_every`` s: when the measured FFN load's max/mean under the placement in use is above
    ``rebalance_threshold``, move to a placement packed by that load (as ``POST /rebalance`` does), if that
    is predicted to lower it by more than 0.05. A move in progress, or a replacement starting, waits for
    the next check."""
    client = state.frontend.client
    while True:
        await asyncio.sleep(state.rebalance_every)
        if state.frontend.draining or state.frontend.failure is not None:
            return
        imbalance = client.status().load_imbalance
        state.metrics.rebalance_checks.inc()
        if imbalance <= state.rebalance_threshold:
            continue
        try:
            decision = await asyncio.get_running_loop().run_in_executor(None, lambda: client.rebalance(min_gain=0.05))
        except RebalanceRefused as e:  # one move at a time
            log.info("automatic rebalance deferred: %s", e)
            continue
        if decision["changed"]:
            log.warning("automatic rebalance: FFN load max/mean %.2f is above %.2f; moving to placement version %d (predicted "
                        "%.2f)", imbalance, state.rebalance_threshold, decision["version"], decision["after"])


def run_server(state: ServerState, sock: socket.socket, shutdown_timeout: float) -> int:
    """Serve on the bound ``sock`` until SIGTERM/SIGINT (exit 0) or a replica failure (exit 1). Prints
    the address once it listens; stops the front end (and every replica and rank) before returning."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            """SIGTERM/SIGINT: uvicorn stops accepting and waits for in-flight requests; just before its
            deadline, whatever still runs is ended with a clear 503 error (not a cut connection)."""
            first = not self.should_exit
            super().handle_exit(sig, frame)
            fe = state.frontend
            if first and fe.loop is not None:
                fe.draining = True
                fe.loop.call_soon_threadsafe(fe.loop.call_later, max(0.0, shutdown_timeout - 0.5), fe.abort_all,
                                             f"the server is shutting down (in-flight requests get {shutdown_timeout:g} s)")

    app = create_app(state)
    host, bound = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=max(1, int(shutdown_timeout)),
                            timeout_keep_alive=5, lifespan="off")
    server = _Server(config)

    def on_signal(signum, _frame) -> None:
        """uvicorn re-raises the signal it caught when it is done: here that means nothing more to do."""

    def on_failure(_reason: str) -> None:
        # in-flight requests already got their error; give their responses a moment to go out
        loop = state.frontend.loop
        loop.call_soon_threadsafe(loop.call_later, 0.5, setattr, server, "should_exit", True)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    state.frontend.on_failure = on_failure
    state.started = time.time()

    async def main() -> None:
        state.frontend.start(asyncio.get_running_loop())
        print(listening_line(state.model_name, f"http://{host}:{bound}"), flush=True)
        checks = asyncio.create_task(auto_rebalance(state)) if state.rebalance_every > 0 else None
        try:
            await server.serve(sockets=[sock])
        finally:
            if checks is not None:
                checks.cancel()
            # the front end's pump hands events to this loop: stop it (and the replicas) while the loop still runs
            state.frontend.draining = True
            await asyncio.get_running_loop().run_in_executor(None, lambda: state.frontend.close(timeout=max(5.0, shutdown_timeout)))

    try:
        asyncio.run(main())
    finally:
        state.frontend.draining = True
        state.frontend.close(timeout=max(5.0, shutdown_timeout))
        for s, h in previous.items():
            signal.signal(s, h)
    if state.frontend.failure is not None:
        print(f"afd serve: exiting after a failure: {state.frontend.failure}", flush=True)
        return 1
    return 0
