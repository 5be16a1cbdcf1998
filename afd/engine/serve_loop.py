"""One replica's serving loop: requests come in over a pipe, token deltas go out.

The same loop runs in the engine-core process of a monolithic server, in every attention rank of a
disaggregated run, and on a thread of the front end's process (tests, ``afd generate --capture``), so
the front end talks to every replica the same way. The messages are afd/engine/messages.py's.

Attention ranks step together (afd/attention/steps.py): work arriving while they wait asks for the
next wave (:class:`NeedWave`), and the runtime starts it on every rank, once (:class:`StartWave`).
"""

from __future__ import annotations

import time
from typing import Callable

from afd.engine.llm_engine import LLMEngine
from afd.engine.messages import (AbortRequest, AddRequests, Deltas, NeedWave, Rejected, StartWave, StatsReport, Stopped,
                                 StopServing, UnhandledMessage)

#: how often the (larger) per-expert counters ride along with the step events
EXPERT_COUNTS_INTERVAL_S = 1.0


def serve_requests(engine: LLMEngine, conn, extra_stats: Callable[[], dict] | None = None, idle_poll: float = 0.5,
                   capture: str | None = None, on_command: Callable[[object], bool] | None = None) -> None:
    """Serve until :class:`StopServing`. Exceptions propagate: the caller reports them (the replica has
    failed). Deltas carry token ids, no text: the front end detokenizes and checks stop strings (and
    aborts a request a stop string ended). ``capture``: record every step's boundaries, keyed by the
    front end's request ids, to this file (written before :class:`Stopped` is sent). ``on_command``: the
    replica's own commands (an attention rank's: afd/runtime/messages.py), run between steps; it returns
    False for a message it does not know."""
    detokenize, engine.detokenize = engine.detokenize, False
    if capture is not None:
        from afd.obs.capture import CaptureStore

        engine.capture = CaptureStore()
    try:
        _Loop(engine, conn, extra_stats, on_command).run(idle_poll, capture)
    finally:
        engine.detokenize = detokenize
        engine.capture = None


class _Loop:
    def __init__(self, engine: LLMEngine, conn, extra_stats: Callable[[], dict] | None,
                 on_command: Callable[[object], bool] | None) -> None:
        self.engine, self.conn = engine, conn
        self.extra_stats, self.on_command = extra_stats, on_command
        self.waves = engine.runner.waves  # the agreed steps of a disaggregated rank (None: it steps alone)
        self.rids: dict[int, int] = {}  # front-end id -> engine request id
        self.counts_sent = 0.0
        self.stopping = False
        self.changed = True

    def stats(self, with_counts: bool = False) -> dict:
        out = self.engine.stats()
        if self.extra_stats is not None:
            out.update(self.extra_stats())
        if with_counts or time.monotonic() - self.counts_sent > EXPERT_COUNTS_INTERVAL_S:
            out["expert_tokens"] = self.engine.model.expert_token_counts()
            self.counts_sent = time.monotonic()
        return out

    def handle(self, msg: object) -> None:
        engine = self.engine
        match msg:
            case AddRequests(requests):
                for r in requests:
                    try:
                        self.rids[r.rid] = engine.add_request(list(r.prompt_ids), r.params, tag=r.rid, output_ids=r.output_ids)
                    except ValueError as e:
                        self.conn.send(Rejected(r.rid, str(e)))
            case AbortRequest(rid):
                eid = self.rids.pop(rid, None)
                if eid is not None:
                    engine.abort(eid)
            case StartWave(wave):
                if self.waves is None:
                    raise UnhandledMessage("a replica that steps alone", msg)
                self.waves.join_wave(wave)
            case StopServing():
                for eid in self.rids.values():
                    engine.abort(eid)
                self.stopping = True  # the wave this rank is in ends with the others' (all are stopping)
            case _:
                if self.on_command is None or not self.on_command(msg):
                    raise UnhandledMessage("serving loop", msg)

    def run(self, idle_poll: float, capture: str | None) -> None:
        engine, waves = self.engine, self.waves
        asked = -1  # the wave this rank last asked for
        while True:
            stepping = engine.has_unfinished() if waves is None else waves.in_wave
            timeout = 0.0 if stepping or self.stopping else idle_poll
            while not self.stopping and self.conn.poll(timeout):
                timeout = 0.0
                self.handle(self.conn.recv())
                self.changed = True
            engine.runner.maintain()
            if waves is not None and not waves.in_wave and (engine.has_unfinished() or waves.wants_wave) and asked < waves.waves_done:
                asked = waves.waves_done  # work (or a restart to take in) while the ranks wait: every rank must join the next wave
                self.conn.send(NeedWave(asked))
            if self.stopping and not (waves is not None and waves.in_wave):
                if capture is not None:
                    engine.capture.save(capture)
                self.conn.send(Stopped(self.stats(with_counts=True)))
                return
            if engine.must_step() and (waves is None or waves.in_wave):
                deltas = engine.step_deltas()
                if deltas:  # an idle step of a wave (a vote, no model pass) produces none
                    for d in deltas:
                        if d.finish_reason is not None:
                            self.rids.pop(d.tag, None)
                    self.conn.send(Deltas(tuple(deltas), self.stats()))
                    self.changed = True  # the idle report after the last step carries the final counters
            elif self.changed:
                self.conn.send(StatsReport(self.stats(with_counts=True)))
                self.changed = False
