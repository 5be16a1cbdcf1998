"""The supervisor: which losses a run survives, and how it heals -- an FFN rank replaced, an attention rank
restarted and admitted back into the agreed steps. It acts on the launcher's ranks from the cluster's owner
thread only (afd/runtime/cluster.py), and keeps the run's record of losses and comebacks.

* An FFN rank whose experts all have a live copy elsewhere (``--redundant-experts``, shm or tcp) is
  dropped: the attention ranks re-dispatch its in-flight work, a hung one is killed (so every attention
  rank sees the same loss), and a replacement is started. It loads its experts, opens its readers and says
  :class:`Loaded`; every attention rank links to it (:class:`FfnJoin`, never waiting inside a step) and
  it is used from the first agreed step whose every vote names it.
* An attention rank with a live peer is dropped: its requests move to the peer (the front end resends
  them), and it is restarted and voted back in at a step every member names. The only attention rank is
  restarted with its requests waiting.
* Anything else fails the run, naming the root cause first.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from afd.attention.steps import DEAD_KEY
from afd.connectors.wire import Role
from afd.engine.messages import ReplicaLost, ReplicaRestarted
from afd.runtime.launcher import Launcher, RankHandle
from afd.runtime.messages import Admit, AttentionGone, AttentionJoin, FfnJoin
from afd.runtime.procs import exit_reason
from afd.runtime.spec import failover_enabled

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    """What the supervisor may do (each on by default; tests turn them off to see the fail-stop path)."""

    replace_ffn: bool = True  # start a replacement for every lost FFN rank
    max_replacements: int = 3  # per FFN rank, over the run
    replica_failover: bool = True  # a lost attention rank's requests move to another (A >= 2, shm or tcp)
    restart_replicas: bool = True  # a lost attention rank is restarted (A = 1: its requests wait for it)
    max_restarts: int = 3  # per attention rank, over the run


@dataclass(frozen=True)
class Event:
    """One entry of the run's record: a loss, or a comeback (``seconds`` from loss to use)."""

    rank: int
    pid: int | None
    cause: str = ""
    at: float = field(default_factory=time.time)
    node: int | None = None
    generation: int = 0  # a replacement's; a restart's incarnation
    seconds: float = 0.0
    replacement: bool = False  # a loss: the rank lost was itself a replacement that never joined


@dataclass
class Record:
    """What happened to a run's ranks, for /metrics and the logs."""

    ffn_losses: list[Event] = field(default_factory=list)
    ffn_replacements: list[Event] = field(default_factory=list)
    replica_losses: list[Event] = field(default_factory=list)
    replica_restarts: list[Event] = field(default_factory=list)


class Supervisor:
    def __init__(self, launcher: Launcher, policy: Policy, record: Record, notify: Callable[[int, object], None]) -> None:
        """``notify(replica, event)``: a replica-plane event for the front end (ReplicaLost, ReplicaRestarted)."""
        self.launcher, self.policy, self.record, self.notify = launcher, policy, record, notify
        self.started = False  # READY everywhere: from now on a loss may be survived
        self.restarting: set[int] = set()  # attention ranks being restarted
        self._unrestarted: list[RankHandle] = []  # lost attention ranks whose restart waits (an FFN replacement, a rebalance)
        self.rebalancer = None  # afd/runtime/rebalance.py: a move in progress holds back restarts and replacements
        self.remote = None  # afd/runtime/multinode.py, node 0: the FFN ranks other nodes run
        self.ffn_node = None  # afd/runtime/multinode.py, a node without attention ranks: its link to node 0

    @property
    def run_id(self) -> str:
        return self.launcher.run_id

    # ------------------------------------------------------------------ views
    def live_attention(self) -> list[RankHandle]:
        return [a for a in self.launcher.attention_ranks() if not a.lost and a.joined]

    def live_ffn(self) -> list[int]:
        local = {r.spec.index for r in self.launcher.ffn_ranks() if not r.lost and r.joined}
        return sorted(local | (self.remote.live() if self.remote is not None else set()))

    def describe_redundancy(self) -> str:
        """What an FFN rank's failure costs, said at start."""
        p = self.launcher.placement
        if p.redundant == 0:
            return "no redundancy: an FFN failure stops the server (add --redundant-experts N for copies on other FFN ranks)"
        if not failover_enabled(self.launcher.topology, p):
            return (f"{p.redundant} redundant expert copies, but failover needs the shm or tcp transport: an FFN failure stops the "
                    f"server on --transport {self.launcher.topology.transport}")
        single = p.single_copy()
        if single:
            return (f"{p.redundant} redundant expert copies; experts {list(single)} have a single copy: losing their FFN rank "
                    "stops the server")
        return f"{p.redundant} redundant expert copies: every expert is on at least two FFN ranks, an FFN rank's loss is survived"

    # ------------------------------------------------------------------ exits
    def on_exit(self, rank: RankHandle) -> str | None:
        """A rank's process ended unasked. Returns the cause if the run cannot go on without it."""
        cause = f"{rank.spec.name} (pid {rank.pid}) died: {exit_reason(rank.proc.exitcode)}" if not rank.is_thread \
            else f"{rank.spec.name} thread ended unexpectedly"
        if self._survivable(rank):
            self.lose_ffn(rank, cause)
            return None
        if self._replica_survivable(rank):
            self.lose_replica(rank, cause)
            self._restart_or_forget(rank)  # first: the front end looks whether it restarts when it hears of the loss
            self.notify(rank.spec.index, ReplicaLost(cause))
            return None
        rank.failed = True
        return cause

    def _survivable(self, rank: RankHandle) -> bool:
        """Whether the run can go on without this FFN rank (and every FFN rank lost before it)."""
        if rank.spec.role != Role.FFN or not self.started or not failover_enabled(self.launcher.topology, self.launcher.placement):
            return False
        if not rank.joined:  # a replacement that died starting: nobody used it yet
            return True
        if self.launcher.node.node_rank > 0:  # node 0's attention ranks see the loss too, and node 0 decides
            return True
        alive = [f for f in self.live_ffn() if f != rank.spec.index]
        return bool(alive) and not self.launcher.placement.orphans(alive)

    def _replica_survivable(self, rank: RankHandle) -> bool:
        """An attention rank's loss is survived when another one serves (its requests move there), or it can be
        restarted, on a transport whose links reopen, once serving began."""
        if (rank.spec.role != Role.ATTENTION or not self.started or not self.policy.replica_failover
                or not self.launcher.restarts_replicas):
            return False
        return any(not r.lost for r in self.launcher.attention_ranks() if r is not rank) or self._can_restart(rank)

    # ------------------------------------------------------------------ attention ranks
    def _restarts(self) -> bool:
        return self.policy.restart_replicas and self.launcher.restarts_replicas

    def _can_restart(self, rank: RankHandle) -> bool:
        return self._restarts() and not self.launcher.closed and rank.spec.incarnation < self.policy.max_restarts

    def _restart_waits(self) -> str:
        """Why a restart must wait ("" if it need not): its links and placement would be out of date at once."""
        unsettled = [f.spec.name for f in self.launcher.ffn_ranks() if not f.lost and not f.joined]
        if unsettled:
            return f"{', '.join(unsettled)} {'is' if len(unsettled) == 1 else 'are'} starting"
        if self.rebalancer is not None and self.rebalancer.current is not None:
            return f"the rebalance to placement version {self.rebalancer.current.version} is in progress"
        return ""

    def _restart_or_forget(self, lost: RankHandle) -> None:
        """A lost attention rank: restart it now, later (:meth:`_restart_waits`), or never (its restarts are used
        up: the FFN ranks stop waiting for it)."""
        if not self._can_restart(lost):
            if self.launcher.restarts_replicas and not self.launcher.closed:  # the FFN ranks wait for a restart unless told
                log.warning("run %s: %s is not restarted (%d restarts so far); the others serve without it", self.run_id,
                            lost.spec.name, lost.spec.incarnation)
                self.launcher.tell_ffn(AttentionGone(lost.spec.index))
            return
        why = self._restart_waits()
        self.restarting.add(lost.spec.index)
        if why:
            log.warning("run %s: %s is restarted once %s", self.run_id, lost.spec.name, why)
            self._unrestarted.append(lost)
            return
        self._restart(lost)

    def tick(self) -> None:
        """Restarts that waited, once nothing holds them back."""
        if self._unrestarted and not self._restart_waits():
            waiting, self._unrestarted = self._unrestarted, []
            for lost in waiting:
                self._restart(lost)

    def _restart(self, lost: RankHandle) -> None:
        """Start a lost attention rank again: the same index, links of a new incarnation to every FFN rank (at its
        generation now), the placement in use. Its requests resume on it once it is READY (:meth:`restarted`)."""
        launcher = self.launcher
        incarnation = lost.spec.incarnation + 1
        live = {f.spec.index: f for f in launcher.ffn_ranks() if not f.lost}
        generations = tuple(live[f].spec.generation if f in live else 0 for f in range(launcher.topology.num_ffn_ranks))
        link = lost.spec.link
        if link.transport == "shm":
            from afd.connectors.shm import create_attention_links

            create_attention_links(launcher.run_dir, lost.spec.index, incarnation, generations, link.num_slots, link.slot_bytes)
        spec = replace(lost.spec, incarnation=incarnation, ffn_generations=generations, placement=launcher.placement,
                       placement_version=launcher.placement_version)
        rank = launcher.spawn(spec, joined=False, started_at=time.monotonic())
        log.warning("run %s: restarting %s (pid %d, incarnation %d); %s", self.run_id, lost.spec.name, rank.pid, incarnation,
                    "it joins the others' steps" if launcher.topology.num_attention_ranks > 1 else "its requests wait for it")

    def on_joining(self, r: RankHandle) -> None:
        """A restart of one of several attention ranks asks to join the step agreement: every other one that
        steps (serving, or joining itself) votes it in; the front end may talk to it from now on."""
        r.joining = True
        for a in self.launcher.attention_ranks():
            if a is not r and not a.lost and (a.joined or a.joining) and a.ready is not None:
                a.send(Admit(r.spec.index, r.spec.incarnation))

    def restarted(self, r: RankHandle) -> None:
        """A restarted attention rank is READY: it serves, and the requests that waited for it resume there."""
        r.joined = True
        self.restarting.discard(r.spec.index)
        took = time.monotonic() - r.started_at
        self.record.replica_restarts.append(Event(r.spec.index, r.pid, generation=r.spec.incarnation, seconds=took))
        log.warning("run %s: %s restarted (pid %d, incarnation %d) in %.1f s", self.run_id, r.spec.name, r.pid, r.spec.incarnation, took)
        self.notify(r.spec.index, ReplicaRestarted(r.spec.incarnation))

    def lose_replica(self, rank: RankHandle, cause: str) -> None:
        """Mark an attention rank dead where the step agreement looks (its peers go on in a new epoch)."""
        launcher = self.launcher
        rank.lost = rank.done = True
        dead: dict[int, int] = {}  # index -> its newest incarnation lost (a restart, one up, is not the dead one)
        for a in launcher.ranks:
            if a.spec.role == Role.ATTENTION and a.lost:
                dead[a.spec.index] = max(dead.get(a.spec.index, -1), a.spec.incarnation)
        live = {a.spec.index for a in self.live_attention()}
        for r in launcher.ffn_ranks():  # a replacement waits no longer for it
            if not r.joined and not r.lost and live <= r.linked:
                self._joined_everywhere(r)
        if self.rebalancer is not None:
            self.rebalancer.advance()  # a rebalance waits no longer for it
        store = launcher.steps_store  # where the step agreement's votes live
        if store is not None:
            store.set(DEAD_KEY, json.dumps(dead))
        if launcher.run_dir is not None:  # shm: a replacement still opening its links stops waiting for this rank's end
            from afd.connectors.shm import mark_attention_dead

            mark_attention_dead(launcher.run_dir, rank.spec.index, rank.spec.incarnation)
        self.record.replica_losses.append(Event(rank.spec.index, rank.pid, cause))
        if any(not a.lost for a in launcher.attention_ranks()):
            log.warning("run %s: %s: its requests move to the other attention ranks; the steps go on without it", self.run_id, cause)
        else:
            log.warning("run %s: %s: its requests wait for its restart", self.run_id, cause)

    def on_attention_silent(self, by: RankHandle, rank: int, reason: str) -> str | None:
        """An FFN rank found attention rank ``rank`` hung: kill it (its requests move), or return the cause
        that fails the run. On a node without attention ranks, node 0 is told (afd/runtime/multinode.py)."""
        if self.ffn_node is not None:
            self.ffn_node.report_hung(by, rank, reason)
            return None
        return self.hung_attention(rank, f"{by.spec.name} (pid {by.pid}) reports: {reason}")

    def hung_attention(self, rank: int, report: str) -> str | None:
        """Attention rank ``rank`` was found hung (``report`` says by whom): kill it if its loss is survived (its
        requests move; its exit does the rest), else return the cause that fails the run."""
        target = self.launcher.attention_ranks()[rank]
        if target.lost or target.done or not target.joined:
            return None
        if self._replica_survivable(target) and target.proc.is_alive():
            log.warning("run %s: %s; killing %s (pid %d): its requests move", self.run_id, report, target.spec.name, target.pid)
            os.kill(target.pid, signal.SIGKILL)  # our own child, by PID; its sentinel does the rest
            return None
        return report

    # ------------------------------------------------------------------ FFN ranks
    def lose_ffn(self, rank: RankHandle, cause: str) -> None:
        rank.lost = rank.done = True
        self.record.ffn_losses.append(Event(rank.spec.index, rank.pid, cause, replacement=rank.spec.generation > 0 and not rank.joined))
        if self.launcher.node.node_rank > 0:
            log.warning("run %s: %s: node 0's attention ranks go on without it (on its experts' copies)", self.run_id, cause)
        else:
            log.warning("run %s: %s: going on without it; its experts %s are served by their copies on FFN ranks %s", self.run_id,
                        cause, list(self.launcher.placement.experts_of(rank.spec.index)), self.live_ffn())
        if self.policy.replace_ffn:
            self.replace(rank)
        if self.rebalancer is not None:
            self.rebalancer.advance()  # a rebalance waits no longer for it

    def on_ffn_lost(self, by: RankHandle, index: int, generation: int, reason: str, hung: bool) -> None:
        """An attention rank stopped using an FFN rank (dead, or silent past the hang timeout): a hung one is
        killed, so that every attention rank sees the same loss (its links close)."""
        if index in self.launcher.remote_ffn():
            self.remote.lost(index, generation, reason, by)
            return
        rank = next((r for r in self.launcher.ffn_ranks() if (r.spec.index, r.spec.generation) == (index, generation)), None)
        if rank is None or rank.lost:
            return
        if not hung:  # its link closed: it died, and its exit is at most a moment behind (the fork server reaps it)
            rank.proc.join(1.0)
        if rank.proc.is_alive():
            try:
                os.kill(rank.pid, signal.SIGKILL)  # our own rank, by PID
            except ProcessLookupError:
                pass
            rank.proc.join(2.0)
            self.lose_ffn(rank, f"{rank.spec.name} (pid {rank.pid}) was killed: {by.spec.name} found it {reason.split(': ', 1)[-1]}")
        else:
            self.lose_ffn(rank, f"{rank.spec.name} (pid {rank.pid}) died: {exit_reason(rank.proc.exitcode)}")

    def replace(self, lost: RankHandle) -> None:
        """Start a replacement for a lost FFN rank: links of a new generation, the same experts loaded from the
        checkpoint. Once its readers are open it says :class:`Loaded`, and every attention rank links to it."""
        launcher = self.launcher
        if self.rebalancer is not None and self.rebalancer.current is not None:  # it would start on the placement being replaced
            self.rebalancer.deferred.append(lost)
            return
        index = lost.spec.index
        tries = sum(1 for r in launcher.ffn_ranks() if r.spec.index == index) - 1
        if launcher.closed or tries > self.policy.max_replacements:
            log.warning("run %s: ffn rank %d: not replaced again (%d replacements started); serving without it", self.run_id, index, tries)
            return
        generation = max(r.spec.generation for r in launcher.ffn_ranks() if r.spec.index == index) + 1
        link = lost.spec.link
        if link.transport == "shm":  # tcp: the replacement listens under its generation's key in the rendezvous store
            from afd.connectors.shm import create_links

            t = launcher.topology
            create_links(launcher.run_dir, t.num_attention_ranks, t.num_ffn_ranks, link.num_slots, link.slot_bytes,
                         ffn_ranks=[index], generation=generation)
        rank = launcher.spawn(replace(lost.spec, generation=generation, placement=launcher.placement,
                                      placement_version=launcher.placement_version), joined=False, started_at=time.monotonic())
        log.warning("run %s: starting a replacement for ffn rank %d (pid %d, generation %d)", self.run_id, index, rank.pid, generation)

    def on_loaded(self, r: RankHandle) -> None:
        """A replacement FFN rank (or a restarted attention rank) has its readers open: its peers link to it."""
        launcher = self.launcher
        if r.spec.role == Role.ATTENTION:  # the FFN ranks open their ends of the restart's links
            launcher.tell_ffn(AttentionJoin(r.spec.index, r.spec.incarnation))
        elif self.ffn_node is not None:  # node 0's attention ranks link to it once they hear
            self.ffn_node.announce(r)
        else:
            for a in self.live_attention():
                a.send(FfnJoin(r.spec.index, r.spec.generation))

    def on_ffn_joined(self, by: RankHandle, index: int, generation: int) -> None:
        """Attention rank ``by`` linked to FFN rank ``index``'s replacement."""
        if self.remote is not None and self.remote.joining(index):
            self.remote.linked(by, index, generation)
            return
        target = next((f for f in self.launcher.ffn_ranks() if (f.spec.index, f.spec.generation) == (index, generation)), None)
        if target is None or target.lost:
            return
        target.linked.add(by.spec.index)
        if {a.spec.index for a in self.live_attention()} <= target.linked and not target.joined:
            self._joined_everywhere(target)

    def _joined_everywhere(self, target: RankHandle) -> None:
        target.joined = True
        took = time.monotonic() - target.started_at
        self.record.ffn_replacements.append(Event(target.spec.index, target.pid, generation=target.spec.generation, seconds=took))
        log.warning("run %s: ffn rank %d replaced (pid %d, generation %d) in %.1f s: back in use from the next step", self.run_id,
                    target.spec.index, target.pid, target.spec.generation, took)

    def on_ffn_join_failed(self, by: RankHandle, index: int, generation: int, reason: str) -> None:
        log.warning("run %s: %s could not link to ffn rank %d generation %d: %s", self.run_id, by.spec.name, index, generation, reason)
