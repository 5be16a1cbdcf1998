"""One replica's serving loop: requests come in over a pipe, token deltas go out.

The same loop runs in an attention rank (its pipe to the launcher) and, for a
monolithic server, in a thread of the server process (one end of an in-process
pipe), so the front end talks to every replica the same way.

Commands (front end -> replica):
    ("add", rid, prompt_ids, SamplingParams)   rid: the front end's request id
    ("adds", [(rid, prompt_ids, SamplingParams[, output_ids])])  the requests the front end took in one event-loop turn
                                               (output_ids: a request moved from a lost replica, what it streamed)
    ("abort", rid)                             the client went away: free its blocks
    ("start_wave", w)                          every attention rank joins wave w of agreed steps
    ("ffn_join", f, g)                         an attention rank: link to FFN rank f's replacement (generation g)
    ("admit", a, i)                            an attention rank: vote attention rank a's restart (incarnation i) in
    ("stop",)                                  abort everything, reply ("stopped", stats), return
Events (replica -> front end):
    ("deltas", [TokenDelta], stats)            after every step that produced tokens; delta.tag is the rid
    ("rejected", rid, message)                 the request could not be admitted
    ("need_wave", w)                           work (or a restart to admit) arrived while the attention ranks wait: start wave w
    ("stats", stats)                           counters, when they changed while idle
    ("ffn_lost", f, g, reason, hung) / ("ffn_joined", f, g)  an attention rank stopped using FFN rank f / linked to its replacement

Attention ranks step together (afd/attention/steps.py): work arriving while they wait
asks for the next wave, and the front end starts it on every rank, once.
"""

from __future__ import annotations

import time
from typing import Callable

from afd import env
from afd.engine.llm_engine import LLMEngine

#: how often the (larger) per-expert counters ride along with the step events
EXPERT_COUNTS_INTERVAL_S = 1.0


def serve_requests(engine: LLMEngine, conn, extra_stats: Callable[[], dict] | None = None, idle_poll: float = 0.5,
                   capture: str | None = None, commands: dict[str, Callable[[tuple], None]] | None = None) -> None:
    """Serve until ("stop",). Exceptions propagate: the caller reports them (the replica has failed).
    Deltas carry token ids, no text: the front end detokenizes and checks stop strings (and aborts a
    request a stop string ended). ``capture``: record every step's boundaries, keyed by the front
    end's request ids, to this file (written before "stopped" is sent). ``commands``: the replica's own
    commands (an attention rank: ``ffn_join``), run between steps."""
    detokenize, engine.detokenize = engine.detokenize, False
    if capture is not None:
        from afd.obs.capture import CaptureStore

        engine.capture = CaptureStore()
    try:
        _serve(engine, conn, extra_stats, idle_poll, capture, commands or {})
    finally:
        engine.detokenize = detokenize
        engine.capture = None


def _serve(engine: LLMEngine, conn, extra_stats: Callable[[], dict] | None, idle_poll: float, capture: str | None,
           commands: dict[str, Callable[[tuple], None]]) -> None:
    rids: dict[int, int] = {}  # front-end id -> engine request id
    counts_sent = 0.0
    fault = env.fault()
    fail_at = fault[1] if fault is not None and fault[0] == "engine-step" else None  # tests: a failing replica

    def stats(with_counts: bool = False) -> dict:
        nonlocal counts_sent
        out = engine.stats()
        if extra_stats is not None:
            out.update(extra_stats())
        if with_counts or time.monotonic() - counts_sent > EXPERT_COUNTS_INTERVAL_S:
            out["expert_tokens"] = engine.model.expert_token_counts()
            counts_sent = time.monotonic()
        return out

    plane = getattr(engine.runner, "plane", None)  # the step agreement of a disaggregated rank (None: steps alone)
    asked = -1  # the wave this rank last asked for
    stopping = False
    changed = True
    while True:
        stepping = engine.has_unfinished() if plane is None else plane.in_wave
        timeout = 0.0 if stepping or stopping else idle_poll
        while not stopping and conn.poll(timeout):
            timeout = 0.0
            cmd = conn.recv()
            changed = True
            if cmd[0] in ("add", "adds"):
                for rid, prompt_ids, params, *resume in (cmd[1] if cmd[0] == "adds" else [cmd[1:]]):
                    try:
                        rids[rid] = engine.add_request(prompt_ids, params, tag=rid, output_ids=resume[0] if resume else ())
                    except ValueError as e:
                        conn.send(("rejected", rid, str(e)))
            elif cmd[0] == "abort":
                eid = rids.pop(cmd[1], None)
                if eid is not None:
                    engine.abort(eid)
            elif cmd[0] == "start_wave":
                plane.join_wave(cmd[1])
            elif cmd[0] in commands:
                commands[cmd[0]](cmd)
            elif cmd[0] == "stop":
                for eid in rids.values():
                    engine.abort(eid)
                stopping = True  # the wave this rank is in ends with the others' (all are stopping)
            else:
                raise ValueError(f"serving loop: unknown command {cmd[0]!r}")
        if plane is not None and not plane.in_wave and (engine.has_unfinished() or plane.wants_wave) and asked < plane.waves_done:
            asked = plane.waves_done  # work (or a restart to take in) while the ranks wait: every rank must join the next wave
            conn.send(("need_wave", asked))
        if stopping and not (plane is not None and plane.in_wave):
            if capture is not None:
                engine.capture.save(capture)
            conn.send(("stopped", stats(with_counts=True)))
            return
        if engine.must_step() and (plane is None or plane.in_wave):
            if fail_at is not None and engine.num_steps + 1 >= fail_at:
                raise RuntimeError(f"injected engine fault at step {engine.num_steps + 1} (AFD_FAULT=engine-step@{fail_at})")
            deltas = engine.step_deltas()
            if deltas:  # an idle step of a wave (a vote, no model pass) produces none
                for d in deltas:
                    if d.finish_reason is not None:
                        rids.pop(d.tag, None)
                conn.send(("deltas", deltas, stats()))
                changed = True  # the idle report after the last step carries the final counters
        elif changed:
            conn.send(("stats", stats(with_counts=True)))
            changed = False
