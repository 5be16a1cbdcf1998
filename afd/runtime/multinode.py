"""A run over several hosts: node 0 runs the front end, the attention ranks and the rendezvous store (a
``TCPStore``); every other node a launcher for its FFN ranks. The launchers talk through that store only:

* node 0 found a remote FFN rank hung: it asks that rank's node to kill it (``afd/kill/f<f>.g<g>``), so
  every attention rank sees the same loss;
* a node replaced a lost FFN rank and the replacement is loaded: it says so (``afd/join/f<f>``), and node 0's
  attention ranks link to it;
* a remote FFN rank found an attention rank hung: its node says so (``afd/hung/a<a>``), and node 0 kills it
  or fails the run, as it does when one of its own FFN ranks finds it;
* node 0 is gone (its store does not answer): the other nodes stop, unless their ranks are finishing a
  normal end (SHUTDOWN on its way).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import time

from afd.runtime.launcher import Launcher, RankHandle
from afd.runtime.messages import FfnJoin
from afd.runtime.supervisor import Event, Record

log = logging.getLogger(__name__)

KILL_KEY = "afd/kill"  # <KILL_KEY>/f<f>.g<generation>: node 0 asks FFN rank f's node to kill it (the value: why)
JOIN_KEY = "afd/join"  # <JOIN_KEY>/f<f>: the generation of FFN rank f's replacement, loaded on its node
HUNG_KEY = "afd/hung"  # <HUNG_KEY>/a<a>: an FFN rank of another node found attention rank a hung (the value: why)
POLL_S = 0.5  # how often a launcher looks in the store
GRACE_S = 2.0  # at the end of a run node 0 goes first: an FFN node's ranks get this long to finish


class RemoteFfnRanks:
    """Node 0's view of the FFN ranks that other nodes run."""

    def __init__(self, launcher: Launcher, supervisor, record: Record) -> None:
        self.launcher, self.supervisor, self.record = launcher, supervisor, record
        self._lost: set[int] = set()  # remote FFN ranks node 0's attention ranks lost
        self._generation: dict[int, int] = {}  # remote FFN rank -> the generation node 0 uses (or waits for)
        self._joining: dict[int, dict] = {}  # remote FFN rank -> its replacement being linked
        self._checked = 0.0

    def live(self) -> set[int]:
        return set(self.launcher.remote_ffn()) - self._lost

    def joining(self, index: int) -> bool:
        return index in self._joining

    def lost(self, index: int, generation: int, reason: str, by: RankHandle) -> None:
        """A remote FFN rank is gone (dead, or hung: its node is asked to kill it, so that every attention rank
        sees the same loss). Its node starts the replacement and says so in the store (:meth:`tick`)."""
        if index in self._lost or generation < self._generation.get(index, 0):
            return
        self._lost.add(index)
        self._joining.pop(index, None)
        node = self.launcher.topology.node_of("ffn", index)
        self.launcher.store.set(f"{KILL_KEY}/f{index}.g{generation}", reason)
        self.record.ffn_losses.append(Event(index, None, reason, node=node))
        log.warning("run %s: ffn rank %d on node %d lost (%s, found by %s): going on without it; its experts %s are served by their "
                    "copies on FFN ranks %s", self.launcher.run_id, index, node, reason, by.spec.name,
                    list(self.launcher.placement.experts_of(index)), self.supervisor.live_ffn())

    def linked(self, by: RankHandle, index: int, generation: int) -> None:
        joining = self._joining[index]
        if generation != joining["generation"]:
            return
        joining["linked"].add(by.spec.index)
        if {a.spec.index for a in self.supervisor.live_attention()} <= joining["linked"]:
            del self._joining[index]
            self._lost.discard(index)
            took = time.monotonic() - joining["started"]
            node = self.launcher.topology.node_of("ffn", index)
            self.record.ffn_replacements.append(Event(index, None, node=node, generation=generation, seconds=took))
            log.warning("run %s: ffn rank %d on node %d replaced (generation %d), linked in %.1f s: back in use from the next step",
                        self.launcher.run_id, index, node, generation, took)

    def tick(self) -> list[tuple[int, str]]:
        """Look in the store: replacements other nodes loaded (node 0's attention ranks link to them), and
        attention ranks other nodes' FFN ranks found hung. Returns those: (attention rank, why)."""
        now = time.monotonic()
        store = self.launcher.store
        if store is None or now - self._checked < POLL_S:
            return []
        self._checked = now
        for f in sorted(self._lost):
            key = f"{JOIN_KEY}/f{f}"
            if not store.check([key]):
                continue
            generation = int(store.get(key).decode())
            if generation <= self._generation.get(f, 0) or f in self._joining:
                continue
            self._generation[f] = generation
            self._joining[f] = {"generation": generation, "linked": set(), "started": now}
            for a in self.supervisor.live_attention():
                a.send(FfnJoin(f, generation))
        hung = []
        for a in self.launcher.attention_ranks():
            key = f"{HUNG_KEY}/a{a.spec.index}"
            if store.check([key]):
                hung.append((a.spec.index, store.get(key).decode()))
                store.delete_key(key)
        return hung


class FfnNode:
    """A node without attention ranks: its launcher's link to node 0, through node 0's store."""

    def __init__(self, launcher: Launcher) -> None:
        import torch.distributed as dist

        self.launcher = launcher
        node = launcher.node
        self.store = dist.TCPStore(node.master_addr, node.master_port, is_master=False, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=launcher.timeouts.ready))
        self._checked = 0.0
        self._gone_since: float | None = None

    def announce(self, r: RankHandle) -> None:
        """A replacement of a local FFN rank is loaded: node 0's attention ranks link to it once they read this."""
        self.store.set(f"{JOIN_KEY}/f{r.spec.index}", str(r.spec.generation))
        r.joined = True
        log.warning("run %s: the replacement of ffn rank %d (pid %d, generation %d) is loaded; node 0 links to it",
                    self.launcher.run_id, r.spec.index, r.pid, r.spec.generation)

    def report_hung(self, by: RankHandle, rank: int, reason: str) -> None:
        """A local FFN rank found attention rank ``rank`` hung: node 0 decides what that costs."""
        log.warning("run %s: %s found attention rank %d hung; telling node 0", self.launcher.run_id, by.spec.name, rank)
        self.store.set(f"{HUNG_KEY}/a{rank}", f"{by.spec.name} (pid {by.pid}, node {self.launcher.node.node_rank}) reports: {reason}")

    def tick(self) -> str | None:
        """Kill the local FFN ranks node 0 asks to; notice node 0's loss. Returns why the run must stop, if it must."""
        now = time.monotonic()
        if now - self._checked < (0.2 if self._gone_since is not None else POLL_S):
            return None
        self._checked = now
        ranks = [r for r in self.launcher.ffn_ranks() if not r.done and not r.lost]
        node = self.launcher.node
        try:
            # is node 0 there? (a store call on a dead store would also say so, after torch's C++ logger printed a stack trace)
            socket.create_connection((node.master_addr, node.master_port), timeout=2.0).close()
            asked = [r for r in ranks if self.store.check([f"{KILL_KEY}/f{r.spec.index}.g{r.spec.generation}"])]
        except Exception as e:  # noqa: BLE001 - node 0's launcher hosts the store: it is gone
            if not ranks:
                return None
            if self._gone_since is None:
                self._gone_since = now
            if now - self._gone_since < GRACE_S:
                return None
            return (f"node 0's rendezvous ({node.master_addr}:{node.master_port}) is gone: node 0 was lost "
                    f"({str(e).splitlines()[0] if str(e) else type(e).__name__})")
        for r in asked:
            if r.proc.is_alive():
                why = self.store.get(f"{KILL_KEY}/f{r.spec.index}.g{r.spec.generation}").decode()
                log.warning("run %s: killing %s (pid %d): node 0 %s", self.launcher.run_id, r.spec.name, r.pid, why)
                os.kill(r.pid, signal.SIGKILL)  # our own child, by PID; its sentinel does the rest
        return None
