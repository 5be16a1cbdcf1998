"""Replica clients: the serving front end's one interface to its engines, whatever runs them.

Like vLLM v1's ``EngineCoreClient`` family, every way afd runs engines implements :class:`ReplicaClient`:

* :class:`LocalClient`: a monolithic engine on a thread of this process (tests, ``afd generate --capture``);
* :class:`EngineCoreClient`: a monolithic engine in its engine-core process (``afd serve``, ``afd generate``);
* :class:`ClusterClient`: the attention ranks of a disaggregated run, each a replica.

Requests go in with :meth:`ReplicaClient.send` and the replica-plane messages of afd/engine/messages.py;
events come back from :meth:`ReplicaClient.poll` as (replica, event). A replica's failure that the run
does not survive is raised from ``poll`` as :class:`ReplicaFailed`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Protocol

from afd.config import PipelineConfig, Timeouts
from afd.engine.messages import StopServing, Stopped
from afd.runtime.cluster import Cluster
from afd.runtime.core import EngineCoreDied, EngineCoreProcess
from afd.runtime.launcher import RankFailedError
from afd.runtime.messages import Failed
from afd.runtime.rebalance import RebalanceRefused
from afd.runtime.status import RankInfo, RunStatus

log = logging.getLogger(__name__)


class ReplicaFailed(RuntimeError):
    """A replica (or a rank behind it) died or reported an error, and the run cannot go on without it."""


@dataclass(frozen=True)
class CacheShape:
    """What prefix-aware routing needs of the replicas' KV caches (each replica has its own)."""

    block_size: int
    num_blocks: int
    max_num_batched_tokens: int


class ReplicaClient(Protocol):
    num_replicas: int
    max_model_len: int
    #: the replicas' cache, where requests are worth sending where their prefix is cached (None: by load only)
    cache_shape: CacheShape | None
    #: whether the run has FFN ranks whose expert placement can move (POST /rebalance)
    can_rebalance: bool

    def start(self) -> None:
        """Every replica serves from now on."""

    def send(self, replica: int, msg: object) -> None:
        """A replica-plane message to one replica (nothing if it is lost or restarting)."""

    def poll(self, timeout: float) -> list[tuple[int, object]]:
        """The replicas' events within ``timeout`` s. Raises :class:`ReplicaFailed`."""

    def status(self) -> RunStatus:
        """The ranks and their record, as the run's owner last published them."""

    def rebalance(self, min_gain: float = 0.0) -> dict:
        """Move the expert placement to the measured load. Raises RebalanceRefused."""

    def stop_serving(self, timeout: float) -> None:
        """Every replica leaves its serving loop (what runs them stays up)."""

    def close(self, timeout: float) -> None:
        """Stop serving, then stop whatever runs the replicas."""


class _Monolithic:
    """What the two monolithic clients share: one replica, nothing to rebalance."""

    num_replicas = 1
    cache_shape = None
    can_rebalance = False

    def rebalance(self, min_gain: float = 0.0) -> dict:
        raise RebalanceRefused("a monolithic server has no FFN ranks to rebalance")


class LocalClient(_Monolithic):
    """A monolithic engine on a thread of this process, spoken to over an in-process pipe (tests, and
    offline generation with tensor capture, whose hooks live on an engine of this process)."""

    def __init__(self, engine, capture: str | None = None) -> None:
        from afd.engine.serve_loop import serve_requests

        self.engine = engine
        self.max_model_len = engine.max_model_len
        self._conn, back = mp.Pipe()
        self._lock = threading.Lock()
        self._stopped = False

        def run() -> None:
            try:
                serve_requests(engine, back, capture=capture)
            except BaseException as e:  # noqa: BLE001 - reported to the front end, which fails the server
                back.send(Failed(f"engine thread failed: {type(e).__name__}: {e}", traceback.format_exc()))

        self._thread = threading.Thread(target=run, name="afd-engine", daemon=True)
        self._status = RunStatus(ranks=(RankInfo("monolithic", os.getpid(), "serving"),), disaggregated=False)

    def start(self) -> None:
        self._thread.start()

    def send(self, replica: int, msg: object) -> None:
        with self._lock:
            self._conn.send(msg)

    def poll(self, timeout: float) -> list[tuple[int, object]]:
        out = []
        if self._conn.poll(timeout):
            while self._conn.poll():
                msg = self._conn.recv()
                if isinstance(msg, Failed):
                    log.error("%s\n%s", msg.text, msg.detail)
                    raise ReplicaFailed(msg.text)
                out.append((0, msg))
        if not self._thread.is_alive() and not self._stopped:
            raise ReplicaFailed("the engine thread ended unexpectedly")
        return out

    def status(self) -> RunStatus:
        return self._status

    def close(self, timeout: float) -> None:
        self._stopped = True
        if self._thread.is_alive():
            try:
                self.send(0, StopServing())
            except OSError:
                pass
            self._thread.join(timeout)

    stop_serving = close  # the engine outlives its thread


class EngineCoreClient(_Monolithic):
    """A monolithic engine in its engine-core process (what ``afd serve`` runs without topology flags)."""

    def __init__(self, core: EngineCoreProcess) -> None:
        self.core = core
        self.max_model_len = core.ready.max_model_len
        self._lock = threading.Lock()
        self._status = RunStatus(ranks=(RankInfo("engine core", core.pid, "serving"),), disaggregated=False)

    def start(self) -> None:
        """The engine core serves for its whole life."""

    def send(self, replica: int, msg: object) -> None:
        with self._lock:
            self.core.send(msg)

    def poll(self, timeout: float) -> list[tuple[int, object]]:
        try:
            return [(0, msg) for msg in self.core.poll(timeout)]
        except EngineCoreDied as e:
            raise ReplicaFailed(str(e)) from None

    def status(self) -> RunStatus:
        return self._status

    def close(self, timeout: float) -> None:
        self.core.close(timeout)

    def stop_serving(self, timeout: float) -> None:
        """Nothing to do: the engine core serves for its whole life (a later front end may use it)."""


class ClusterClient:
    """The attention ranks of a disaggregated run, each a replica with its own engine and KV cache."""

    can_rebalance = True

    def __init__(self, cluster: Cluster, pipeline: PipelineConfig | None = None, capture_dir: str | None = None) -> None:
        """``capture_dir``: each attention rank records its steps' boundaries there (``afd generate --capture``)."""
        self.cluster, self.pipeline, self.capture_dir = cluster, pipeline, capture_dir
        self.num_replicas = cluster.topology.num_attention_ranks
        self.max_model_len = cluster.limits.max_model_len
        engine = cluster.engine
        self.cache_shape = (CacheShape(engine.block_size, cluster.limits.num_blocks, engine.max_num_batched_tokens)
                            if self.num_replicas > 1 and engine.enable_prefix_caching else None)
        self._events: queue.Queue | None = None

    def start(self) -> None:
        self._events = self.cluster.start_serving(self.pipeline, self.capture_dir)

    def send(self, replica: int, msg: object) -> None:
        self.cluster.send(replica, msg)

    def poll(self, timeout: float) -> list[tuple[int, object]]:
        out = []
        try:
            item = self._events.get(timeout=timeout)
            while True:
                if isinstance(item[1], RankFailedError):
                    raise ReplicaFailed(str(item[1]))
                out.append(item)
                item = self._events.get_nowait()
        except queue.Empty:
            pass
        return out

    def status(self) -> RunStatus:
        return self.cluster.status

    def rebalance(self, min_gain: float = 0.0) -> dict:
        return self.cluster.rebalance(min_gain=min_gain).as_dict()

    def stop_serving(self, timeout: float) -> None:
        """Every attention rank leaves its serving loop (the cluster stays up for more commands)."""
        cluster = self.cluster
        if cluster.closed or cluster.failure is not None or self._events is None:
            return
        try:
            for i in range(self.num_replicas):
                cluster.send(i, StopServing())
            deadline = time.monotonic() + timeout
            stopped = set(cluster.status.unavailable)
            while len(stopped) < self.num_replicas and time.monotonic() < deadline:
                stopped |= {i for i, event in self.poll(0.2) if isinstance(event, Stopped)}
            cluster.stop_serving()
        except Exception as e:  # noqa: BLE001 - a rank failing while stopping: shutdown still runs
            log.warning("while stopping: %s", e)

    def close(self, timeout: float) -> None:
        """Stop serving on every attention rank, then stop every rank (idempotent after a failure)."""
        self.stop_serving(timeout)
        self.cluster.shutdown()


def engine_core_client(model_dir, engine_args, device: str = "cpu", timeouts: Timeouts = Timeouts(), threads: int | None = None,
                       faults=None) -> EngineCoreClient:
    """Start a monolithic engine in its engine-core process; the client once it is READY."""
    from afd.runtime.core import CoreSpec

    return EngineCoreClient(EngineCoreProcess(CoreSpec(model_dir, engine_args, device, threads, faults), timeouts))
