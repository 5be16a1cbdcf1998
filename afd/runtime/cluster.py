"""A disaggregated run, and the one thread that owns its state.

:class:`Cluster` starts a run's ranks (afd/runtime/launcher.py) and then hands the run to its **owner
thread**, which alone reads the ranks' pipes and changes the run's state: the launcher's ranks, the
supervisor's losses and restarts (afd/runtime/supervisor.py), the rebalancer's moves (rebalance.py),
the multi-node view (multinode.py). Every other thread -- the front end's pump, an HTTP handler, a test --
*posts* to it and waits for the answer (:meth:`Cluster.request`, :meth:`Cluster.rebalance`), and reads
what it publishes: the replica events of the serving front end (a queue) and a :class:`RunStatus`
snapshot (an immutable object, replaced whole). A front end sends requests to an attention rank's pipe
directly, through the routes the owner publishes; a pipe has its own lock.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Sequence

from afd.config import EngineArgs, FaultPlan, PipelineConfig, Timeouts
from afd.connectors.wire import Role
from afd.distributed.topology import Topology
from afd.engine.messages import Deltas, NeedWave, Rejected, StartWave, StatsReport, Stopped, UnhandledMessage
from afd.runtime.forkserver import RunForkServer
from afd.runtime.launcher import Launcher, NodeSpec, RankFailedError, RankHandle, build_launch_order
from afd.runtime.messages import (AttentionSilent, Bye, Failed, FfnJoined, FfnJoinFailed, FfnLost, FfnStats, Joining, Loaded,
                                  PlacementInUse, PlacementReady, Ready, Reply, Request, Serve)
from afd.runtime.multinode import FfnNode, RemoteFfnRanks
from afd.runtime.owner import Mailslot, result
from afd.runtime.rebalance import Decision, Rebalancer
from afd.runtime.status import RunStatus, run_status
from afd.runtime.supervisor import Policy, Record, Supervisor

log = logging.getLogger(__name__)

SWEEP_S = 0.5  # the owner's longest wait (it also wakes for every message and every post)
GATHER_S = 0.3  # after a failure, how long the owner gathers the peers' reports (the root cause is named first)
START_PROGRESS_S = 30.0  # a start that takes longer says, this often, which ranks it still waits for


class Cluster:
    """Every rank of one disaggregated run this node runs. Requests reach the attention ranks through a
    replica client (afd/runtime/clients.py)."""

    def __init__(self, model_dir: str | Path, topology: Topology, engine: EngineArgs = EngineArgs(), *, timeouts: Timeouts = Timeouts(),
                 pipeline: PipelineConfig = PipelineConfig(), node: NodeSpec = NodeSpec(), run_id: str | None = None,
                 io_log: bool = False, faults: FaultPlan | None = None, threads: int | None = None,
                 forks: RunForkServer | None = None, policy: Policy = Policy()) -> None:
        """``forks``: a fork server to share (its owner stops it); None: the run starts and stops its own.
        ``threads``: torch threads per rank (None: one per core of its core set, else one)."""
        self.launcher = Launcher(model_dir, topology, engine, timeouts, pipeline, node, run_id, io_log, faults, threads, forks)
        self.record = Record()
        self.supervisor = Supervisor(self.launcher, policy, self.record, self._notify)
        self.rebalancer = self.supervisor.rebalancer = Rebalancer(self.launcher, self.supervisor)
        if node.node_rank == 0 and self.launcher.remote_ffn():
            self.supervisor.remote = RemoteFfnRanks(self.launcher, self.supervisor, self.record)
        self.status = RunStatus()
        self.failure: str | None = None
        self._thread: threading.Thread | None = None
        self._slot = Mailslot()  # posts from other threads to the owner
        self._stopping: bool | None = None  # graceful or not, once a stop was posted
        self._events: queue.Queue | None = None  # the attached replica client's events
        self._serving: tuple[PipelineConfig | None, str | None] | None = None  # (pipeline, capture dir) while serving
        self._replies: dict[int, list[Future]] = {}  # id(rank) -> the futures of its requests, oldest first
        self._wave = -1  # the last wave of agreed steps started on every attention rank
        self._routes: tuple[RankHandle | None, ...] = ()

    # ------------------------------------------------------------------ what it is
    run_id = property(lambda self: self.launcher.run_id)
    topology = property(lambda self: self.launcher.topology)
    pipeline = property(lambda self: self.launcher.pipeline)
    engine = property(lambda self: self.launcher.engine)  # the engine flags, resolved (token cap, step memory, context)
    limits = property(lambda self: self.launcher.limits)
    model_dir = property(lambda self: self.launcher.model_dir)
    placement = property(lambda self: self.launcher.placement)

    @property
    def ranks(self) -> list[RankHandle]:
        """Every rank started (a replacement or a restart too). Its fields are the owner's: read them once the
        run has shut down (``final_stats``), or for what does not change (``spec``, the pid)."""
        return list(self.launcher.ranks)

    def describe_limits(self) -> str:
        return self.launcher.describe_limits()

    def describe_redundancy(self) -> str:
        return self.supervisor.describe_redundancy()

    @functools.cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer (None without tokenizer.json: token-id prompts only)."""
        from afd.engine.tokenizer import Tokenizer

        return Tokenizer(self.model_dir) if (self.model_dir / "tokenizer.json").is_file() else None

    # ------------------------------------------------------------------ start and stop
    def start(self) -> "Cluster":
        """Start every local rank and wait for their READY (on this thread), then hand the run to its owner."""
        launcher = self.launcher
        try:
            launcher.rendezvous()
            log.warning("%s", self.describe_redundancy())
            for role, index in build_launch_order(launcher.topology, launcher.local_ranks()):
                launcher.spawn(launcher.spec_for(role, index))
            started = time.monotonic()
            deadline, told = started + launcher.timeouts.ready, started
            while any(r.ready is None for r in launcher.ranks):
                slow = [r.spec.name for r in launcher.ranks if r.ready is None]
                if time.monotonic() > deadline:
                    self._fail(f"timed out after {launcher.timeouts.ready:.0f} s waiting for READY ({', '.join(slow)})")
                if time.monotonic() - told > START_PROGRESS_S:  # a long start says what it waits for
                    told = time.monotonic()
                    log.warning("run %s: still waiting for READY after %.0f s of %.0f s: %s%s", launcher.run_id, told - started,
                                launcher.timeouts.ready, ", ".join(slow),
                                " (their links wait for every node's ranks: is every node started?)" if launcher.node.nnodes > 1 else "")
                self._round(min(SWEEP_S, deadline - time.monotonic()))
            if launcher.node.node_rank > 0:
                self.supervisor.ffn_node = FfnNode(launcher)
            self.supervisor.started = True
            self._publish()
        except BaseException:
            self.shutdown(graceful=False)
            raise
        self._thread = threading.Thread(target=self._own, name=f"afd-cluster-{launcher.run_id}", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank. Idempotent; from any thread (the owner does it), safe after a failure."""
        if self._thread is not None and self._thread.is_alive() and not self._slot.is_owner:
            if self._stopping is None:
                self._stopping = graceful
                self._slot.wake()
            self._thread.join()
        else:
            self._teardown(graceful)

    def wait(self) -> None:
        """A node without attention ranks: serve until every local rank has finished (or one fails)."""
        if self._thread is not None:
            self._thread.join()
        if self.failure is not None:
            raise RankFailedError(self.failure)

    @property
    def closed(self) -> bool:
        """Shut down (by :meth:`shutdown`, or after a failure stopped every rank)."""
        return self.launcher.closed

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown(graceful=exc[0] is None)

    # ------------------------------------------------------------------ for other threads
    def send(self, replica: int, msg: object) -> None:
        """Send attention rank ``replica`` a replica-plane message (nothing if it is lost or restarting)."""
        routes = self._routes
        rank = routes[replica] if replica < len(routes) else None
        if rank is not None:
            rank.send(msg)

    def request(self, rank: int, command: Request, timeout: float = 600.0):
        """Send attention rank ``rank`` a request and wait for its reply (outside serving)."""
        return self.request_all({rank: command}, timeout)[rank]

    def request_all(self, commands: dict[int, Request] | Sequence[Request], timeout: float = 600.0) -> dict | list:
        """Send each attention rank its request at once and wait for every reply (a list, in rank order, for a list)."""
        items = dict(enumerate(commands)) if not isinstance(commands, dict) else commands
        futures = {i: self._post(functools.partial(self._request, i, cmd)) for i, cmd in items.items()}
        replies = {i: self._result(f, timeout) for i, f in futures.items()}
        return replies if isinstance(commands, dict) else [replies[i] for i in range(len(commands))]

    def rebalance(self, load: Sequence[float] | None = None, min_gain: float = 0.0) -> Decision:
        """Recompute the expert placement from the measured (or given) per-expert load and move to it while
        serving (afd/runtime/rebalance.py). Returns the decision; the move completes in the background.
        Raises RebalanceRefused when a move cannot start now."""
        def start(future: Future) -> None:
            future.set_result(self.rebalancer.start(load, min_gain))

        return self._result(self._post(start), 60.0)

    def start_serving(self, pipeline: PipelineConfig | None = None, capture_dir: str | None = None) -> queue.Queue:
        """Every attention rank serves requests from now on; returns the queue of their events, (replica, event)."""
        events: queue.Queue = queue.Queue()

        def attach(future: Future) -> None:
            self._events, self._serving = events, (pipeline, capture_dir)
            for i, rank in enumerate(self.launcher.attention_ranks()):
                if not rank.lost and (rank.joined or rank.joining):
                    rank.send(self._serve_msg(i))
            future.set_result(events)

        return self._result(self._post(attach), 60.0)

    def stop_serving(self) -> None:
        """The attention ranks left their serving loops (a client saw them stop): their events go nowhere now."""
        def detach(future: Future) -> None:
            self._events = self._serving = None
            future.set_result(None)

        if self.failure is None and not self.closed:
            self._result(self._post(detach), 60.0)

    # ------------------------------------------------------------------ posting
    def _post(self, fn: Callable[[Future], None]) -> Future:
        return self._slot.post(fn, RankFailedError)

    def _result(self, future: Future, timeout: float):
        return result(future, timeout, f"run {self.run_id}")

    def _request(self, index: int, command: Request, future: Future) -> None:
        rank = self.launcher.attention_ranks()[index]
        self._replies.setdefault(id(rank), []).append(future)
        rank.send(command)

    def _serve_msg(self, index: int) -> Serve:
        pipeline, capture_dir = self._serving
        capture = str(Path(capture_dir) / f"attention-rank-{index}.safetensors") if capture_dir else None
        return Serve(pipeline, capture)

    # ------------------------------------------------------------------ the owner thread
    def _own(self) -> None:
        self._slot.own()
        try:
            while self._stopping is None and not self._finished():
                self._round(SWEEP_S)
        except RankFailedError:
            return  # _fail stopped every rank and told everyone
        except BaseException as e:  # noqa: BLE001 - a bug here must fail the run loudly, not hang it
            log.exception("run %s: the cluster's owner thread failed", self.run_id)
            try:
                self._fail(f"the cluster's owner thread failed: {type(e).__name__}: {e}")
            except RankFailedError:
                return
        self._teardown(bool(self._stopping) if self._stopping is not None else True)

    def _finished(self) -> bool:
        """A node without attention ranks is done when every local rank has finished."""
        return self.launcher.node.node_rank > 0 and all(r.done for r in self.launcher.ranks)

    def _round(self, timeout: float) -> None:
        """One turn of the owner: posts, then the ranks' messages and exits, then what waits on time."""
        self._slot.run_posted()
        got, exited = self.launcher.sweep(max(0.0, timeout), also=[self._slot.wake_fd])
        failures = []
        changed = bool(exited)
        for rank, msg in got:
            failures += self._handle(rank, msg)
            changed |= not isinstance(msg, (Deltas, StatsReport))
        for rank in self._unexplained(exited):  # a rank that said why (Failed, Bye) or was dropped already is no news
            cause = self.supervisor.on_exit(rank)
            if cause is not None:
                failures.append((0, cause, ""))
            self._drop_replies(rank)
        failures += self._tick()
        if failures:
            # one death usually makes its peers fail too ("... is gone"): gather them, report the cause first
            time.sleep(GATHER_S)
            got, exited = self.launcher.sweep(0.0)
            for rank, msg in got:
                failures += self._handle(rank, msg)
            for rank in self._unexplained(exited):
                cause = self.supervisor.on_exit(rank)
                if cause is not None:
                    failures.append((0, cause, ""))
            failures.sort(key=lambda f: f[0])
            self._fail("; then ".join(text for _, text, _ in failures), "\n".join(d for *_, d in failures if d))
        if changed:
            self._publish()

    @staticmethod
    def _unexplained(exited: list[RankHandle]) -> list[RankHandle]:
        return [r for r in exited if not (r.done or r.failed or r.lost)]

    def _tick(self) -> list[tuple[int, str, str]]:
        self.supervisor.tick()
        failures = []
        if self.supervisor.remote is not None:
            for rank, report in self.supervisor.remote.tick():
                cause = self.supervisor.hung_attention(rank, report)
                if cause is not None:
                    failures.append((0, cause, ""))
        if self.supervisor.ffn_node is not None:
            cause = self.supervisor.ffn_node.tick()
            if cause is not None:
                failures.append((0, cause, ""))
        return failures

    def _handle(self, rank: RankHandle, msg: object) -> list[tuple[int, str, str]]:
        """One message from a rank; returns the failures it reports: (priority, text, detail)."""
        s = self.supervisor
        match msg:
            case Deltas() | Rejected() | StatsReport() | Stopped():
                if self._events is not None:
                    self._events.put((rank.spec.index, msg))
            case NeedWave(wave):  # a rank got work while all wait: every rank joins the next wave, once
                if wave > self._wave:
                    self._wave = wave
                    for r in self._routes:
                        if r is not None:
                            r.send(StartWave(wave))
            case Ready(report):
                rank.ready = report
                log.info("%s READY (pid %d): %d tensors, %.1f MB read", rank.spec.name, report.pid, len(report.tensors),
                         report.bytes_read / 1e6)
                if rank.spec.role == Role.ATTENTION and rank.spec.incarnation:
                    if self._serving is not None and not rank.joining:  # (a joiner was told at its join)
                        rank.send(self._serve_msg(rank.spec.index))
                    s.restarted(rank)
            case Failed(text, detail):
                rank.failed = True  # its exit that follows is not news
                secondary = "PeerDiedError" in text or "RemoteError" in text
                return [(2 if secondary else 1, text, detail)]
            case Bye(stats):
                rank.done, rank.final_stats = True, stats
            case FfnStats(stats):
                rank.live_stats = stats
            case FfnLost(index, generation, reason, hung):
                s.on_ffn_lost(rank, index, generation, reason, hung)
            case Loaded():
                s.on_loaded(rank)
            case FfnJoined(index, generation):
                s.on_ffn_joined(rank, index, generation)
            case FfnJoinFailed(index, generation, reason):
                s.on_ffn_join_failed(rank, index, generation, reason)
            case PlacementReady(version):
                self.rebalancer.on_ready(rank, version)
            case PlacementInUse(version):
                self.rebalancer.on_in_use(rank, version)
            case AttentionSilent(index, reason):
                cause = s.on_attention_silent(rank, index, reason)
                return [(0, cause, "")] if cause is not None else []
            case Joining():  # a restart joins the others' steps: it serves (and takes their waves) from now on
                s.on_joining(rank)
                if self._serving is not None:
                    rank.send(self._serve_msg(rank.spec.index))
            case Reply(value):
                waiting = self._replies.get(id(rank))
                if not waiting:
                    raise UnhandledMessage(f"run {self.run_id}: no request of {rank.spec.name} waits for", msg)
                waiting.pop(0).set_result(value)
            case _:
                raise UnhandledMessage(f"run {self.run_id}: from {rank.spec.name}", msg)
        return []

    def _drop_replies(self, rank: RankHandle) -> None:
        """A rank is gone: the requests it had not answered fail, naming it."""
        for future in self._replies.pop(id(rank), []):
            if not future.done():
                future.set_exception(RankFailedError(f"run {self.run_id}: {rank.spec.name} is gone (pid {rank.pid}) before it answered"))

    def _notify(self, replica: int, event: object) -> None:
        """A replica-plane event the supervisor made (a lost or restarted replica)."""
        self._publish()  # routes first: the front end re-sends to the live ones
        if self._events is not None:
            self._events.put((replica, event))

    def _publish(self) -> None:
        """Replace the routes and the status other threads read."""
        attention = self.launcher.attention_ranks()
        self._routes = () if self.launcher.closed else tuple(r if not r.lost and (r.joined or r.joining) else None for r in attention)
        self.status = run_status(self.launcher, self.supervisor, self.rebalancer, self.record)

    def _fail(self, reason: str, detail: str = "") -> None:
        """The run cannot go on: stop every rank, tell every waiter and the front end, raise RankFailedError."""
        if detail:
            log.debug("rank failure detail:\n%s", detail)
        self.failure = f"run {self.run_id}: {reason}"
        error = RankFailedError(self.failure)
        self._teardown(graceful=False)  # the posts still waiting fail with the cause, not "shut down"
        for futures in self._replies.values():
            for f in futures:
                if not f.done():
                    f.set_exception(error)
        if self._events is not None:
            self._events.put((-1, error))
        raise error

    def _teardown(self, graceful: bool) -> None:
        if not self.launcher.closed:
            self._routes = ()
            why = self.failure or f"run {self.run_id} is shut down"
            self._slot.close(why, RankFailedError(why))
            self.launcher.shutdown(graceful)
            self._publish()
