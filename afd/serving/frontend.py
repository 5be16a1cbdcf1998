"""The serving front end: requests in, balanced over replicas by load, token deltas streamed back.

A *replica* is one engine behind the message protocol of :mod:`afd.engine.serve_loop`:
one attention rank of a disaggregated run, or the monolithic engine in its engine-core
process (afd/engine/core.py; in a thread of this process for tests and offline use).
Engines send token ids; the front end works out each request's text and stop strings
(afd/engine/detokenizer.py) and aborts a request a stop string ended. A pump thread
reads every replica's events and hands each delta to the asyncio stream of its
request; the first replica failure fails every in-flight request at once and marks
the front end dead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence

from afd.config import PipelineConfig, SamplingParams
from afd.engine.detokenizer import OutputText
from afd.engine.request import RequestOutput, TokenDelta

log = logging.getLogger(__name__)

#: the pump's longest wait for replica events: what stopping a front end waits for it to notice (a
#: wait on pipes, not a busy loop)
PUMP_POLL_S = 0.02


class ReplicaFailed(RuntimeError):
    """A replica (or a rank behind it) died or reported an error."""


class RequestRejected(ValueError):
    """The engine refused the request (e.g. it can never fit the KV cache)."""


class ServiceUnavailable(RuntimeError):
    """The front end is stopping (SIGTERM) or has failed; no new requests."""


# ----------------------------------------------------------------------------- replicas


class CoreReplicas:
    """A monolithic engine in its engine-core process (what ``afd serve`` runs without topology flags)."""

    def __init__(self, core) -> None:
        self.core = core
        self.num = 1
        self.max_model_len = core.ready.max_model_len
        self._lock = threading.Lock()

    def start(self) -> None:
        pass

    def send(self, replica: int, cmd: tuple) -> None:
        with self._lock:
            self.core.send(cmd)

    def poll(self, timeout: float) -> list[tuple[int, tuple]]:
        from afd.engine.core import EngineCoreDied

        try:
            return [(0, msg) for msg in self.core.poll(timeout)]
        except EngineCoreDied as e:
            raise ReplicaFailed(str(e)) from None

    def rank_info(self) -> list[dict]:
        return [{"name": "engine core", "pid": self.core.pid}]

    def ffn_stats(self) -> dict[str, dict]:
        return {}

    def close(self, timeout: float) -> None:
        self.core.close(timeout)

    def stop_serving(self, timeout: float) -> None:
        """Nothing to do: the engine core serves for its whole life (a later front end may use it)."""


class LocalReplicas:
    """A monolithic engine on a thread of this process, spoken to over an in-process pipe (tests, and
    offline generation, where no HTTP server competes for the GIL)."""

    def __init__(self, engine, capture: str | None = None) -> None:
        from afd.engine.serve_loop import serve_requests

        self.engine = engine
        self.num = 1
        self.max_model_len = engine.max_model_len
        self._conn, back = mp.Pipe()
        self._lock = threading.Lock()
        self._stopped = False

        def run() -> None:
            try:
                serve_requests(engine, back, capture=capture)
            except BaseException as e:  # noqa: BLE001 - reported to the front end, which fails the server
                back.send(("error", f"engine thread failed: {type(e).__name__}: {e}", traceback.format_exc()))

        self._thread = threading.Thread(target=run, name="afd-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, replica: int, cmd: tuple) -> None:
        with self._lock:
            self._conn.send(cmd)

    def poll(self, timeout: float) -> list[tuple[int, tuple]]:
        out = []
        if self._conn.poll(timeout):
            while self._conn.poll():
                msg = self._conn.recv()
                if msg[0] == "error":
                    log.error("%s\n%s", msg[1], msg[2])
                    raise ReplicaFailed(msg[1])
                out.append((0, msg))
        if not self._thread.is_alive() and not self._stopped:
            raise ReplicaFailed("the engine thread ended unexpectedly")
        return out

    def rank_info(self) -> list[dict]:
        return [{"name": "monolithic", "pid": os.getpid()}]

    def ffn_stats(self) -> dict[str, dict]:
        return {}

    def close(self, timeout: float) -> None:
        self._stopped = True
        if self._thread.is_alive():
            try:
                self.send(0, ("stop",))
            except OSError:
                pass
            self._thread.join(timeout)

    stop_serving = close  # the engine outlives its thread


class ClusterReplicas:
    """The attention ranks of a disaggregated run (each its own engine and KV cache)."""

    def __init__(self, cluster, pipeline: PipelineConfig | None = None, capture_dir: str | None = None) -> None:
        self.cluster = cluster
        self.pipeline = pipeline
        self.capture_dir = capture_dir  # each attention rank records its steps' boundaries here (afd generate --capture)
        self.num = len(cluster.attention_ranks())
        self.max_model_len = cluster.limits.max_model_len
        self.router = None  # several replicas with prefix caching: send a prompt where its prefix is cached
        if self.num > 1 and cluster.engine.enable_prefix_caching:
            from afd.serving.routing import PrefixRouter

            self.router = PrefixRouter(self.num, cluster.engine.block_size, cluster.limits.num_blocks,
                                       cluster.engine.max_num_batched_tokens)
        self._wave = -1  # the last wave of agreed steps started on every rank

    def start(self) -> None:
        for i in range(self.num):
            options = {"capture": str(Path(self.capture_dir) / f"attention-rank-{i}.safetensors")} if self.capture_dir else {}
            self.send(i, ("serve", self.pipeline, options))

    @property
    def lost(self) -> set[int]:
        """Replicas (attention ranks) not serving: lost, or restarting."""
        return {i for i, r in enumerate(self.cluster.attention_ranks()) if r.lost or not r.joined}

    @property
    def restarting(self) -> set[int]:
        """Lost replicas being restarted: their requests wait for them."""
        return set(self.cluster.restarting)

    def send(self, replica: int, cmd: tuple) -> None:
        rank = self.cluster.attention_ranks()[replica]
        if rank.lost or not (rank.joined or rank.joining):  # its requests were moved, or wait for its restart: nobody to reach
            return
        rank.send(cmd)

    def poll(self, timeout: float) -> list[tuple[int, tuple]]:
        from afd.engine.launcher import RankFailedError

        try:
            events = self.cluster.poll(timeout)
        except RankFailedError as e:
            raise ReplicaFailed(str(e)) from None
        out = []
        for replica, msg in events:
            if msg[0] == "replica_joining":  # a restart joins the others' steps: it serves (and takes their waves) from now on
                self.send(replica, ("serve", self.pipeline, {}))
            elif msg[0] == "replica_restarted":  # serving from now on; the front end resumes its requests on it
                if not self.cluster.attention_ranks()[replica].joining:  # (a joiner was told at its join)
                    self.send(replica, ("serve", self.pipeline, {}))
                out.append((replica, msg))
            elif msg[0] == "need_wave":  # a rank got work while all wait: every rank joins the next wave, once
                if msg[1] > self._wave:
                    self._wave = msg[1]
                    for i in range(self.num):
                        self.send(i, ("start_wave", msg[1]))  # not to a lost one (send skips it)
            else:
                out.append((replica, msg))
        return out

    def rank_info(self) -> list[dict]:
        return [{"name": r.spec.name, "pid": r.proc.pid if r.ready is None else r.ready.pid,
                 "state": "lost" if r.lost else "serving" if r.joined and r.ready is not None else "starting"}
                for r in self.cluster.ranks]

    def ffn_stats(self) -> dict[str, dict]:
        return {r.spec.name: r.live_stats for r in self.cluster.ranks if r.live_stats is not None and not r.lost}

    def replica_losses(self) -> list[dict]:
        return list(self.cluster.replica_losses)

    def replica_restarts(self) -> list[dict]:
        return list(self.cluster.replica_restarts)

    def ffn_losses(self) -> list[dict]:
        """The FFN ranks the run went on without (afd/engine/launcher.py)."""
        return list(self.cluster.ffn_losses)

    def ffn_replacements(self) -> list[dict]:
        return list(self.cluster.ffn_replacements)

    def rebalance(self, min_gain: float = 0.0) -> dict:
        """Recompute the expert placement from the measured load and move to it (afd/engine/launcher.py)."""
        return self.cluster.rebalance(min_gain=min_gain)

    def load_imbalance(self) -> float:
        return self.cluster.load_imbalance()

    def rebalances(self) -> list[dict]:
        return list(self.cluster.rebalances)

    def close(self, timeout: float) -> None:
        """Stop serving on every attention rank, then stop every rank (idempotent after a failure)."""
        self.stop_serving(timeout)
        self.cluster.shutdown()

    def stop_serving(self, timeout: float) -> None:
        """Every attention rank leaves its serving loop (the cluster stays up for more commands)."""
        if not self.cluster.closed:
            try:
                for i in range(self.num):
                    self.send(i, ("stop",))
                deadline = time.monotonic() + timeout
                stopped: set[int] = set(self.lost)
                while len(stopped) < self.num and time.monotonic() < deadline:
                    stopped |= {i for i, msg in self.cluster.poll(0.2) if msg[0] == "stopped"}
            except Exception as e:  # noqa: BLE001 - a rank failing while stopping: shutdown still runs
                log.warning("while stopping: %s", e)


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

    def __init__(self, replicas, metrics=None, on_failure: Callable[[str], None] | None = None, tokenizer=None) -> None:
        self.replicas = replicas
        self.tokenizer = tokenizer  # detokenizes and checks stop strings here; None: token ids only, no text
        self.metrics = metrics
        self.on_failure = on_failure
        self.failure: str | None = None
        self.draining = False
        self.replica_stats: list[dict] = [{} for _ in range(replicas.num)]
        self._load = [0] * replicas.num
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._adds: dict[int, list[tuple]] = {}  # replica -> requests not yet sent (see _add)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop (streams live there)
        self._pump: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.replicas.start()
        self._pump = threading.Thread(target=self._pump_events, name="afd-frontend-pump", daemon=True)
        self._pump.start()

    def close(self, timeout: float = 10.0, shutdown: bool = True) -> None:
        """Abort what is left, stop the pump, stop every replica and rank (``shutdown`` False: the
        replicas only leave their serving loops)."""
        self._stop.set()
        if self._pump is not None:
            self._pump.join(timeout)
        (self.replicas.close if shutdown else self.replicas.stop_serving)(timeout)

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
        router = getattr(self.replicas, "router", None)
        loads = self._live_loads()
        if router is not None:
            replica = router.choose(prompt_ids, loads)
        else:
            replica = min(range(self.replicas.num), key=lambda i: loads[i])
        text = OutputText(self.tokenizer, params) if self.tokenizer is not None else None
        stream = _Stream(rid, replica, len(prompt_ids) + params.max_tokens, asyncio.Queue(), len(prompt_ids), text,
                         prompt_ids=list(prompt_ids), params=params)
        self._streams[rid] = stream
        self._load[replica] += stream.load
        if self.metrics is not None:
            self.metrics.request_started(len(prompt_ids))
        outcome = "abort"  # unless it finishes, is rejected, or the engine fails
        try:
            self._add(replica, (rid, list(prompt_ids), params))
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
                        self.replicas.send(stream.replica, ("abort", rid))
                    except OSError:
                        pass
                if self.metrics is not None:
                    self.metrics.request_finished(outcome, stream)

    def _live_loads(self) -> list[float]:
        lost = getattr(self.replicas, "lost", ())
        return [float("inf") if i in lost else load for i, load in enumerate(self._load)]

    def _move_from(self, lost: int, cause: str) -> None:
        """A replica died: every request it held goes to the least-loaded live one, as its prompt plus the
        tokens it streamed (recomputed there; the client sees no error and no repeated text). Event loop."""
        live = [i for i in range(self.replicas.num) if i not in getattr(self.replicas, "lost", ())]
        if not live and lost in getattr(self.replicas, "restarting", ()):
            waiting = sum(1 for s in self._streams.values() if s.replica == lost and not s.finished and not s.stopped)
            log.warning("replica %d lost (%s): %d requests wait for its restart", lost, cause, waiting)
            return  # they stay on it, and resume there (_resume_on)
        if not live:
            self._fail(cause)
            return
        pending = self._adds.pop(lost, [])
        pending_ids = {r[0] for r in pending}
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
            self._add(target, (stream.rid, stream.prompt_ids, stream.params, list(resume)))
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
            self._add(replica, (stream.rid, stream.prompt_ids, stream.params, list(stream.token_ids)))
        if self.metrics is not None:
            self.metrics.requests_moved.inc(resumed)
        if resumed:
            log.warning("replica %d restarted: %d requests resume on it", replica, resumed)
        else:
            log.warning("replica %d restarted: it serves again", replica)

    def _add(self, replica: int, request: tuple) -> None:
        """Queue a request for its replica; what arrives in one turn of the event loop goes as one message,
        so a burst (a batch of clients, ``afd generate``'s prompts) reaches the engine before its next step."""
        if not self._adds:
            self.loop.call_soon(self._send_adds)
        self._adds.setdefault(replica, []).append(request)

    def _send_adds(self) -> None:
        adds, self._adds = self._adds, {}
        for replica, requests in adds.items():
            live = [r for r in requests if r[0] in self._streams]  # a client may have left already
            if live:
                try:
                    self.replicas.send(replica, ("adds", live))
                except OSError as e:  # the replica is gone: the pump reports why
                    log.warning("could not send to replica %d: %s", replica, e)

    # ------------------------------------------------------------------ events
    def _pump_events(self) -> None:
        while not self._stop.is_set():
            try:
                events = self.replicas.poll(PUMP_POLL_S)
            except ReplicaFailed as e:
                self._fail(str(e))
                return
            except Exception as e:  # noqa: BLE001 - anything else here is a front-end bug: fail loudly
                log.exception("front end pump failed")
                self._fail(f"front end failed: {e}")
                return
            batch = []  # everything of this round reaches the event loop in one wake-up, not one per token
            lost, back = [], []
            for replica, msg in events:
                kind = msg[0]
                if kind == "replica_lost":
                    lost.append((replica, msg[1]))
                elif kind == "replica_restarted":
                    back.append(replica)
                elif kind == "deltas":
                    self._update_stats(replica, msg[2])
                    for d in msg[1]:
                        if (d := self._with_text(replica, d)) is not None:
                            batch.append((d.tag, d))
                elif kind == "rejected":
                    batch.append((msg[1], RequestRejected(msg[2])))
                elif kind in ("stats", "stopped"):
                    self._update_stats(replica, msg[1])
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
                        self.replicas.send(replica, ("abort", d.tag))
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


# ----------------------------------------------------------------------------- offline


def run_offline(replicas, tokenizer, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                progress: bool = False, shutdown: bool = True) -> list[RequestOutput]:
    """Every prompt through a :class:`Frontend` over ``replicas`` at once, as a server would take them
    (``afd generate``, :meth:`Cluster.generate`); outputs in prompt order. Prompt i is request i of this
    front end (captures are keyed by it). ``shutdown`` False: the replicas outlive the call."""
    prompts = list(prompts)
    per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
    ids = []
    for p in prompts:
        if isinstance(p, str) and tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        ids.append(tokenizer.encode(p) if isinstance(p, str) else list(p))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(p.max_tokens for p in per_prompt), desc="generate", unit="tok", leave=False)

    async def one(frontend: Frontend, i: int) -> RequestOutput:
        tokens, text, reason = [], [], "stop"
        async for d in frontend.generate(ids[i], per_prompt[i]):
            if d.tag != i:
                raise AssertionError(f"prompt {i} became request {d.tag}")
            if d.token_id is not None:
                tokens.append(d.token_id)
                if bar is not None:
                    bar.update(1)
            text.append(d.text)
            reason = d.finish_reason or reason
        return RequestOutput(i, prompts[i] if isinstance(prompts[i], str) else "", ids[i], "".join(text), tokens, reason)

    async def main() -> list[RequestOutput]:
        frontend = Frontend(replicas, tokenizer=tokenizer)
        frontend.start(asyncio.get_running_loop())
        try:
            return list(await asyncio.gather(*(one(frontend, i) for i in range(len(prompts)))))
        finally:
            await asyncio.get_running_loop().run_in_executor(None, lambda: frontend.close(shutdown=shutdown))
            if frontend.failure is not None:
                raise ReplicaFailed(frontend.failure)

    try:
        return asyncio.run(main())
    finally:
        if bar is not None:
            bar.close()
