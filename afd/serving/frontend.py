"""The serving front end: requests in, balanced over replicas by load, token deltas streamed back.

A *replica* is one engine behind the messages of afd/engine/messages.py, reached through a replica
client (afd/runtime/clients.py): one attention rank of a disaggregated run, or the monolithic engine in
its engine-core process (on a thread of this process for tests and offline use). Engines send token ids;
the front end works out each request's text and stop strings (afd/engine/detokenizer.py) and aborts a
request a stop string ended. A pump thread reads every replica's events and hands each delta to the
asyncio stream of its request; the first replica failure the run does not survive fails every in-flight
request at once and marks the front end dead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

from afd.config import SamplingParams
from afd.engine.detokenizer import OutputText
from afd.engine.messages import (AbortRequest, AddRequests, Deltas, NewRequest, Rejected, ReplicaLost, ReplicaRestarted, StatsReport,
                                 Stopped, UnhandledMessage)
from afd.engine.request import TokenDelta
from afd.runtime.clients import ReplicaClient, ReplicaFailed
from afd.serving.routing import PrefixRouter

log = logging.getLogger(__name__)

#: the pump's longest wait for replica events: what stopping a front end waits for it to notice (a
#: wait on pipes, not a busy loop)
PUMP_POLL_S = 0.02


class RequestRejected(ValueError):
    """The engine refused the request (e.g. it can never fit the KV cache)."""


class ServiceUnavailable(RuntimeError):
    """The front end is stopping (SIGTERM) or has failed; no new requests."""


# ----------------------------------------------------------------------------- front end


@dataclass
class _Stream:
    rid: int
    replica: int
    load: int
    queue: asyncio.Queue
    num_prompt_tokens: int
    text: OutputText | None = None  # its output text, worked out here (the engine sends token ids)
    prompt_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None
    token_ids: list[int] = field(default_factory=list)  # what it streamed: a move to another replica resumes from it
    moves: int = 0
    created: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None
    finished: bool = False
    stopped: bool = False  # a stop string ended it here; the engine's later tokens for it are dropped


class Frontend:
    """Balances requests over replicas by outstanding tokens (or by cached prefix: afd/serving/routing.py)
    and streams their deltas to asyncio tasks."""

    def __init__(self, client: ReplicaClient, metrics=None, on_failure: Callable[[str], None] | None = None, tokenizer=None) -> None:
        self.client = client
        self.tokenizer = tokenizer  # detokenizes and checks stop strings here; None: token ids only, no text
        self.metrics = metrics
        self.on_failure = on_failure
        self.failure: str | None = None
        self.draining = False
        self.replica_stats: list[dict] = [{} for _ in range(client.num_replicas)]
        self._load = [0] * client.num_replicas
        shape = client.cache_shape  # several replicas with prefix caching: send a prompt where its prefix is cached
        self.router = PrefixRouter(client.num_replicas, shape.block_size, shape.num_blocks, shape.max_num_batched_tokens) \
            if shape is not None else None
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._adds: dict[int, list[NewRequest]] = {}  # replica -> requests not yet sent (see _add)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop (streams live there)
        self._pump: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.client.start()
        self._pump = threading.Thread(target=self._pump_events, name="afd-frontend-pump", daemon=True)
        self._pump.start()

    def close(self, timeout: float = 10.0, shutdown: bool = True) -> None:
        """Abort what is left, stop the pump, stop every replica and rank (``shutdown`` False: the
        replicas only leave their serving loops)."""
        self._stop.set()
        if self._pump is not None:
            self._pump.join(timeout)
        (self.client.close if shutdown else self.client.stop_serving)(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenDelta]:
        """Token deltas of one request, the last with ``finish_reason`` set. Leaving early (client gone,
        task cancelled) aborts the request on its replica, which frees its KV blocks."""
        if self.failure is not None:
            raise ServiceUnavailable(f"the engine has failed: {self.failure}")
        if self.draining:
            raise ServiceUnavailable("the server is shutting down")
        rid = next(self._ids)
        loads = self._live_loads()
        if self.router is not None:
            replica = self.router.choose(prompt_ids, loads)
        else:
            replica = min(range(self.client.num_replicas), key=lambda i: loads[i])
        text = OutputText(self.tokenizer, params) if self.tokenizer is not None else None
        stream = _Stream(rid, replica, len(prompt_ids) + params.max_tokens, asyncio.Queue(), len(prompt_ids), text,
                         prompt_ids=list(prompt_ids), params=params)
        self._streams[rid] = stream
        self._load[replica] += stream.load
        if self.metrics is not None:
            self.metrics.request_started(len(prompt_ids))
        outcome = "abort"  # unless it finishes, is rejected, or the engine fails
        try:
            self._add(replica, NewRequest(rid, tuple(prompt_ids), params))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    outcome = "rejected" if isinstance(item, RequestRejected) else "error"
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._streams.pop(rid, None)
            self._load[stream.replica] -= stream.load  # where it is now (a lost replica's requests move)
            if not stream.finished:
                if self.failure is None and outcome != "rejected":
                    try:
                        self.client.send(stream.replica, AbortRequest(rid))
                    except OSError:
                        pass
                if self.metrics is not None:
                    self.metrics.request_finished(outcome, stream)

    def _live_loads(self) -> list[float]:
        lost = self.client.status().unavailable
        return [float("inf") if i in lost else load for i, load in enumerate(self._load)]

    def _move_from(self, lost: int, cause: str) -> None:
        """A replica died: every request it held goes to the least-loaded live one, as its prompt plus the
        tokens it streamed (recomputed there; the client sees no error and no repeated text). Event loop."""
        status = self.client.status()
        live = [i for i in range(self.client.num_replicas) if i not in status.unavailable]
        if not live and lost in status.restarting:
            waiting = sum(1 for s in self._streams.values() if s.replica == lost and not s.finished and not s.stopped)
            log.warning("replica %d lost (%s): %d requests wait for its restart", lost, cause, waiting)
            return  # they stay on it, and resume there (_resume_on)
        if not live:
            self._fail(cause)
            return
        pending = self._adds.pop(lost, [])
        pending_ids = {r.rid for r in pending}
        moved = 0
        for stream in list(self._streams.values()):
            if stream.replica != lost or stream.finished or stream.stopped:
                continue
            loads = self._live_loads()
            target = min(live, key=lambda i: loads[i])
            self._load[lost] -= stream.load
            self._load[target] += stream.load
            stream.replica = target
            stream.moves += 1
            moved += 1
            resume = () if stream.rid in pending_ids else tuple(stream.token_ids)
            self._add(target, NewRequest(stream.rid, tuple(stream.prompt_ids), stream.params, resume))
        if self.metrics is not None:
            self.metrics.requests_moved.inc(moved)
        log.warning("replica %d lost (%s): %d requests moved to replicas %s", lost, cause, moved, live)

    def _resume_on(self, replica: int) -> None:
        """A lost replica is back (restarted): every request that waited for it resumes there from what it
        streamed, as a moved request does. Event loop."""
        self._adds.pop(replica, None)  # what was queued for it while it was away is in the streams below
        resumed = 0
        for stream in list(self._streams.values()):
            if stream.replica != replica or stream.finished or stream.stopped:
                continue
            stream.moves += 1
            resumed += 1
            self._add(replica, NewRequest(stream.rid, tuple(stream.prompt_ids), stream.params, tuple(stream.token_ids)))
        if self.metrics is not None:
            self.metrics.requests_moved.inc(resumed)
        if resumed:
            log.warning("replica %d restarted: %d requests resume on it", replica, resumed)
        else:
            log.warning("replica %d restarted: it serves again", replica)

    def _add(self, replica: int, request: NewRequest) -> None:
        """Queue a request for its replica; what arrives in one turn of the event loop goes as one message,
        so a burst (a batch of clients, ``afd generate``'s prompts) reaches the engine before its next step."""
        if not self._adds:
            self.loop.call_soon(self._send_adds)
        self._adds.setdefault(replica, []).append(request)

    def _send_adds(self) -> None:
        adds, self._adds = self._adds, {}
        for replica, requests in adds.items():
            live = tuple(r for r in requests if r.rid in self._streams)  # a client may have left already
            if live:
                try:
                    self.client.send(replica, AddRequests(live))
                except OSError as e:  # the replica is gone: the pump reports why
                    log.warning("could not send to replica %d: %s", replica, e)

    # ------------------------------------------------------------------ events
    def _pump_events(self) -> None:
        while not self._stop.is_set():
            try:
                self._pump_round(self.client.poll(PUMP_POLL_S))
            except ReplicaFailed as e:
                self._fail(str(e))
                return
            except Exception as e:  # noqa: BLE001 - anything else here is a front-end bug: fail loudly
                log.exception("front end pump failed")
                self._fail(f"front end failed: {e}")
                return

    def _pump_round(self, events: list[tuple[int, object]]) -> None:
        batch = []  # everything of this round reaches the event loop in one wake-up, not one per token
        lost, back = [], []
        for replica, msg in events:
            match msg:
                case Deltas(deltas, stats):
                    self._update_stats(replica, stats)
                    for d in deltas:
                        if (d := self._with_text(replica, d)) is not None:
                            batch.append((d.tag, d))
                case Rejected(rid, message):
                    batch.append((rid, RequestRejected(message)))
                case StatsReport(stats) | Stopped(stats):
                    self._update_stats(replica, stats)
                case ReplicaLost(cause):
                    lost.append((replica, cause))
                case ReplicaRestarted():
                    back.append(replica)
                case _:
                    raise UnhandledMessage("front end", msg)
        if batch:
            self.loop.call_soon_threadsafe(self._put_all, batch)
        for replica, cause in lost:  # after the deltas it sent before it died
            self.loop.call_soon_threadsafe(self._move_from, replica, cause)
        for replica in back:
            self.loop.call_soon_threadsafe(self._resume_on, replica)

    def _with_text(self, replica: int, d: TokenDelta) -> TokenDelta | None:
        """The delta with the text its token makes visible, and the end a stop string makes (then the
        engine is told to abort the request); None for a token after that end. Pump thread."""
        stream = self._streams.get(d.tag)
        if stream is not None and d.token_id is not None and not stream.stopped:
            stream.token_ids.append(d.token_id)
        if stream is None or stream.text is None:
            return d
        if stream.stopped:
            return None
        reason, stop_reason = d.finish_reason, d.stop_reason
        if d.token_id is not None:
            # the engine core ends a request by length or by token (EOS, stop_token_ids), never by a stop string
            hit = stream.text.add(d.token_id, ends_by_token=reason == "stop")
            if hit is not None:
                reason, stop_reason, stream.stopped = "stop", hit, True
                if d.finish_reason is None:
                    try:
                        self.client.send(replica, AbortRequest(d.tag))
                    except OSError:
                        pass
        return replace(d, text=stream.text.piece(reason is not None), finish_reason=reason, stop_reason=stop_reason)

    def _update_stats(self, replica: int, stats: dict) -> None:
        if "expert_tokens" not in stats:  # the per-expert counters ride along only now and then
            stats["expert_tokens"] = self.replica_stats[replica].get("expert_tokens")
        self.replica_stats[replica] = stats

    def _put_all(self, batch: list[tuple[int, object]]) -> None:
        """Hand each (request id, delta or error) to its stream. Event-loop thread."""
        now = time.perf_counter()
        for rid, item in batch:
            stream = self._streams.get(rid)
            if stream is None:
                continue  # the request was aborted meanwhile
            if isinstance(item, TokenDelta):
                if self.metrics is not None and item.token_id is not None:  # None: a prefill-only request's end
                    self.metrics.token(stream, now)
                    stream.last_token_at = now
                if self.metrics is not None and item.finish_reason is not None:
                    self.metrics.request_finished(item.finish_reason, stream)
                if item.finish_reason is not None:
                    stream.finished = True  # counted here: a consumer cancelled before reading it must not count it again
            stream.queue.put_nowait(item)

    def abort_all(self, reason: str) -> None:
        """End every in-flight request with a 503 error (shutdown deadline reached). Event-loop thread."""
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(ServiceUnavailable(reason))

    def _fail(self, reason: str) -> None:
        log.error("serving failed: %s", reason)
        self.failure = reason

        def fail_all() -> None:
            for stream in list(self._streams.values()):
                stream.queue.put_nowait(ReplicaFailed(reason))

        self.loop.call_soon_threadsafe(fail_all)
        if self.on_failure is not None:
            self.on_failure(reason)
