"""Start, watch and stop every rank of a disaggregated run on one host.

* The topology is validated before anything starts; a bad one starts nothing.
* Every process carries ``AFD_RUN_ID`` in its environment, so leftovers can be found.
* Ranks start in :func:`build_launch_order`; each reports READY (with the tensors
  it holds and the bytes it read) within ``ready_timeout``.
* While the launcher waits for anything it also watches every rank: a rank that
  exits or reports an error fails the whole job at once, naming the rank, its
  role and the reason, and every other rank is stopped -- except an FFN rank
  whose experts all have a copy on another live FFN rank (``--redundant-experts``,
  shm transport): the attention ranks re-dispatch its work, the launcher logs
  and counts the loss (and kills a rank the attention side found hung).
* :meth:`Cluster.shutdown` is idempotent and leaves no process behind: polite
  SHUTDOWN, then SIGTERM, then SIGKILL; children also die with the launcher
  (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Sequence

from afd import env
from afd.config import PipelineConfig, SamplingParams
from afd.connectors.factory import REOPENABLE, LinkSpec
from afd.connectors.protocol import Role
from afd.connectors.transport import LoopbackHub
from afd.distributed.devices import check_present
from afd.distributed.topology import MULTI_HOST_TRANSPORTS, Topology, backend_for, validate_topology
from afd.engine.forkserver import RunForkServer
from afd.engine.ranks import EngineArgs, RankSpec, ReadyReport, run_rank
from afd.engine.request import RequestOutput
from afd.models.hf_config import load_model_config

log = logging.getLogger(__name__)

KILL_KEY = "afd/kill"  # multi-node: node 0 asks a node's launcher to kill its hung FFN rank f under <KILL_KEY>/f<f>.g<generation>
JOIN_KEY = "afd/join"  # multi-node: a node's launcher says its replacement of FFN rank f loaded, under <JOIN_KEY>/f<f> (its generation)
JOIN_POLL_S = 0.5  # how often node 0 looks for them


def _limits(model_dir: Path, config, engine: EngineArgs):
    """Every attention rank's KV blocks, context and step budget, from the flags (afd/engine/budget.py)."""
    import json

    from afd.engine.budget import engine_limits
    from afd.models.loader import resolve_dtype

    dtype = resolve_dtype(engine.dtype, json.loads((model_dir / "config.json").read_text()))
    return engine_limits(config, dtype, engine.kv_cache_memory, engine.block_size, engine.max_num_seqs, engine.max_model_len,
                         engine.max_step_memory, engine.max_num_batched_tokens)


class RankFailedError(RuntimeError):
    """A rank died or reported an error; the whole job was stopped."""


def build_launch_order(topology: Topology, local: Sequence[tuple[Role, int]] | None = None) -> list[tuple[Role, int]]:
    """The one place that decides start order, from where the rendezvous lives.

    The rendezvous (shm files, or the TCPStore of the tcp and torch transports) is created
    by the launcher itself before any rank starts, so every rank finds it up; FFN ranks go
    first so that they listen and serve by the time an attention rank connects and
    reports READY. (A remote launcher without the rendezvous waits for it.) ``local``:
    only these ranks (the ones this node runs)."""
    order = [(Role.FFN, f) for f in range(topology.num_ffn_ranks)] + [
        (Role.ATTENTION, a) for a in range(topology.num_attention_ranks)
    ]
    return [ri for ri in order if local is None or ri in local]


def _imbalance(placement, load: Sequence[float]) -> float:
    """Max over mean of the FFN ranks' expected load under ``placement`` (1.0: balanced)."""
    ranks = placement.rank_load(load, len(placement.ranks))
    mean = sum(ranks) / len(ranks)
    return max(ranks) / mean if mean else 1.0


def exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class _Rank:
    spec: RankSpec
    conn: Connection
    proc: Any  # mp.Process or threading.Thread
    ready: ReadyReport | None = None
    done: bool = False  # said bye / exited as asked
    failed: bool = False  # already reported
    lost: bool = False  # an FFN rank the run goes on without (its experts have other copies)
    joined: bool = True  # a replacement: every attention rank has linked to it; a restart: it is serving
    joining: bool = False  # a restarted attention rank asked the others to take it into their steps
    linked: set = field(default_factory=set)  # a replacement: the attention ranks linked to it so far
    started_at: float = 0.0
    final_stats: Any = None  # what the rank said on exit (FFN: items, batches, mean expert GEMM rows)
    live_stats: Any = None  # the latest counters an FFN rank reported while serving

    send_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def sentinel(self):
        return getattr(self.proc, "sentinel", None)

    def send(self, msg: tuple) -> None:
        """Send one command (from any thread: the front end's and the launcher's watching share the pipe)."""
        with self.send_lock:
            self.conn.send(msg)


class Cluster:
    """All ranks of one disaggregated run (requests reach them through afd/serving/frontend.py)."""

    def __init__(
        self,
        model_dir: str | Path,
        topology: Topology,
        engine: EngineArgs = EngineArgs(),
        ready_timeout: float = 180.0,
        link_timeout: float = 60.0,
        io_log: bool = False,
        pipeline: PipelineConfig = PipelineConfig(),
        heartbeat_interval: float = 1.0,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
    ) -> None:
        if nnodes < 1 or not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes); got --nnodes {nnodes}, --node-rank {node_rank}")
        if topology.num_nodes > nnodes:
            raise ValueError(f"the topology places ranks on {topology.num_nodes} nodes, but --nnodes is {nnodes}")
        if nnodes > 1 and topology.transport not in MULTI_HOST_TRANSPORTS:
            raise ValueError("a multi-node run needs --transport tcp or torch (shm and loopback stay on one host)")
        if nnodes > 1 and not master_port:
            raise ValueError("a multi-node run needs --master-port (and --master-addr: node 0's address)")
        self.nnodes, self.node_rank = nnodes, node_rank
        self.pipeline = pipeline
        self.heartbeat_interval = heartbeat_interval
        self.master_addr, self.master_port = master_addr, master_port
        self.model_dir = Path(model_dir)
        self.topology = topology
        self.ready_timeout = ready_timeout
        self.link_timeout = link_timeout
        self.io_log = io_log
        config = load_model_config(self.model_dir)
        self.placement = validate_topology(topology, config.moe.num_experts)  # before any process starts
        self.limits = _limits(self.model_dir, config, engine)  # once, for every rank and the links
        self.engine = engine = replace(engine, max_num_batched_tokens=self.limits.max_num_batched_tokens,
                                       max_step_memory=self.limits.max_step_memory, max_model_len=self.limits.max_model_len)
        local = self.local_ranks()  # devices are checked on the host that runs them
        if not local:
            raise ValueError(f"node {node_rank} runs no rank (attention ranks on nodes {list(topology.attention_nodes)}, FFN ranks on "
                             f"nodes {list(topology.ffn_nodes)})")
        check_present([(topology.attention_devices if role == Role.ATTENTION else topology.ffn_devices)[i] for role, i in local])
        self.model_config = config
        self.run_id = env.run_id() or uuid.uuid4().hex[:12]  # a supervisor may choose it
        self.run_dir: Path | None = None
        self.ranks: list[_Rank] = []
        self._hub: LoopbackHub | None = None
        self._closed = False
        self._set_run_id = False
        self._store = None  # torch transport: the TCPStore rendezvous
        self._steps_store = None  # the step agreement's TCPStore, when no rendezvous store can hold it
        self.ffn_losses: list[dict] = []  # every FFN rank the run went on without: rank, pid, cause, when
        self.ffn_replacements: list[dict] = []  # every replacement back in use: rank, pid, generation, seconds to join
        self.max_replacements = 3  # per FFN rank, over the run
        self.replace_ffn = True  # start a replacement for every lost FFN rank
        self.replica_failover = True  # a lost attention rank's requests move to another (A >= 2, shm or tcp)
        self.replica_losses: list[dict] = []
        self.restart_replicas = True  # a lost attention rank is restarted (A = 1: its requests wait for it)
        self.max_restarts = 3  # per attention rank, over the run
        self.restarting: set[int] = set()  # attention ranks being restarted
        self._unrestarted: list[_Rank] = []  # lost attention ranks whose restart waits (an FFN replacement, a rebalance)
        self.replica_restarts: list[dict] = []  # every restart back in use: rank, pid, incarnation, seconds
        self.placement_version = 0  # of self.placement: a rebalance counts it up
        self.rebalances: list[dict] = []  # every rebalance done: version, load max/mean before and after, seconds
        self._rebalance: dict | None = None  # the one in progress
        self._deferred: list[_Rank] = []  # lost FFN ranks to replace once the rebalance in progress is done
        self._remote_lost: set[int] = set()  # FFN ranks of other nodes that node 0's attention ranks lost
        self._remote_gen: dict[int, int] = {}  # FFN rank of another node -> the generation node 0 uses (or waits for)
        self._remote_joining: dict[int, dict] = {}  # FFN rank of another node -> its replacement being linked
        self._joins_checked = 0.0
        self._node_store = None  # a node other than 0: its client of node 0's rendezvous store
        self._forks: RunForkServer | None = None
        self._started = False

    def describe_limits(self) -> str:
        """Each attention rank's limits, and the workspace of an FFN rank's union (at most A x the token cap)."""
        rows = self.topology.num_attention_ranks * self.limits.max_num_batched_tokens
        return (f"each attention rank: {self.limits.describe()}; an FFN union holds at most {rows} rows "
                f"({self.topology.num_attention_ranks} x {self.limits.max_num_batched_tokens}): "
                f"{rows * self.limits.budget.ffn_per_token >> 20} MiB of FFN temporaries")

    def describe_redundancy(self) -> str:
        """What an FFN rank's failure costs, said at start."""
        from afd.engine.ranks import failover_enabled

        p = self.placement
        if p.redundant == 0:
            return "no redundancy: an FFN failure stops the server (add --redundant-experts N for copies on other FFN ranks)"
        if not failover_enabled(self.topology, p):
            return (f"{p.redundant} redundant expert copies, but failover needs the shm or tcp transport: an FFN failure stops the "
                    f"server on --transport {self.topology.transport}")
        single = p.single_copy()
        if single:
            return (f"{p.redundant} redundant expert copies; experts {list(single)} have a single copy: losing their FFN rank "
                    "stops the server")
        return f"{p.redundant} redundant expert copies: every expert is on at least two FFN ranks, an FFN rank's loss is survived"

    def _survivable(self, rank: _Rank) -> bool:
        """Whether the run can go on without this FFN rank (and every FFN rank lost before it)."""
        from afd.engine.ranks import failover_enabled

        if rank.spec.role != Role.FFN or not self._started or not failover_enabled(self.topology, self.placement):
            return False
        if not rank.joined:  # a replacement that died starting: nobody used it yet
            return True
        if self.node_rank > 0:  # node 0's attention ranks see the loss too, and node 0 decides whether the run goes on
            return True
        alive = [f for f in self._live_ffn() if f != rank.spec.index]
        return bool(alive) and not self.placement.orphans(alive)

    def _replica_survivable(self, rank: _Rank) -> bool:
        """An attention rank's loss is survived when another one serves (its requests move there) on the shm
        transport, once serving began."""
        if (rank.spec.role != Role.ATTENTION or not self._started or not self.replica_failover
                or self.topology.transport not in REOPENABLE):
            return False
        return any(not r.lost for r in self.attention_ranks() if r is not rank) or self._can_restart(rank)

    def _restarts_replicas(self) -> bool:
        """Whether a lost attention rank is restarted, on a transport whose links reopen. With one attention
        rank its requests wait for the restart; with several they move to the others, and the restart joins
        their step agreement (afd/attention/steps.py)."""
        return self.restart_replicas and self.topology.transport in REOPENABLE

    def _can_restart(self, rank: _Rank) -> bool:
        """Whether a lost attention rank may be restarted (its restarts not used up), now or once
        :meth:`_restart_waits` is over."""
        return self._restarts_replicas() and not self._closed and rank.spec.incarnation < self.max_restarts

    def _restart_waits(self) -> str:
        """Why a restart must wait ("" if it need not): its links and placement would be out of date at once."""
        unsettled = [f.spec.name for f in self.ranks if f.spec.role == Role.FFN and not f.lost and not f.joined]
        if unsettled:
            return f"{', '.join(unsettled)} {'is' if len(unsettled) == 1 else 'are'} starting"
        if self._rebalance is not None:
            return f"the rebalance to placement version {self._rebalance['version']} is in progress"
        return ""

    def _restart_or_forget(self, lost: _Rank) -> None:
        """A lost attention rank: restart it now, later (:meth:`_restart_waits`), or never (its restarts are used
        up: the FFN ranks stop waiting for it)."""
        if not self._can_restart(lost):
            if self._restarts_replicas() and not self._closed:
                log.warning("run %s: %s is not restarted again (%d restarts); the others serve without it", self.run_id,
                            lost.spec.name, lost.spec.incarnation)
                self._tell_ffn(("attention_gone", lost.spec.index))
            return
        why = self._restart_waits()
        if why:
            log.warning("run %s: %s is restarted once %s", self.run_id, lost.spec.name, why)
            self.restarting.add(lost.spec.index)
            self._unrestarted.append(lost)
            return
        self._restart_replica(lost)

    def _tell_ffn(self, msg: tuple) -> None:
        """Send every FFN rank this launcher runs, and that still serves, one command."""
        for f in self.ranks:
            if f.spec.role == Role.FFN and not f.lost and not f.done and f.proc.is_alive():
                f.send(msg)

    def _restart_waiting(self) -> None:
        """Restarts that waited, once nothing holds them back."""
        if self._unrestarted and not self._restart_waits():
            waiting, self._unrestarted = self._unrestarted, []
            for lost in waiting:
                self._restart_replica(lost)

    def _restart_replica(self, lost: _Rank) -> None:
        """Start a lost attention rank again: the same index, links of a new incarnation to every FFN rank (at its
        generation now), the placement in use. Its requests wait in the front end and resume on it once it is
        READY (:meth:`_restarted`)."""
        from afd.connectors.shm import create_attention_links

        incarnation = lost.spec.incarnation + 1
        live = {f.spec.index: f for f in self.ranks if f.spec.role == Role.FFN and not f.lost}
        generations = tuple(live[f].spec.generation if f in live else 0 for f in range(self.topology.num_ffn_ranks))
        link = lost.spec.link
        if link.transport == "shm":
            create_attention_links(self.run_dir, lost.spec.index, incarnation, generations, link.num_slots, link.slot_bytes)
        spec = replace(lost.spec, incarnation=incarnation, ffn_generations=generations, placement=self.placement,
                       placement_version=self.placement_version)
        rank = self._spawn(spec, joined=False, started_at=time.monotonic())
        self.restarting.add(lost.spec.index)
        log.warning("run %s: restarting %s (pid %d, incarnation %d); %s", self.run_id, lost.spec.name, rank.proc.pid, incarnation,
                    "it joins the others' steps" if self.topology.num_attention_ranks > 1 else "its requests wait for it")

    def _joining(self, r: _Rank) -> tuple:
        """A restart of one of several attention ranks asks to join the step agreement: every other one that
        steps (serving, or joining itself) votes it in; the front end may talk to it from now on."""
        r.joining = True
        for a in self.attention_ranks():
            if a is not r and not a.lost and (a.joined or a.joining) and a.ready is not None:
                a.send(("admit", r.spec.index, r.spec.incarnation))
        return ("replica_joining", r.spec.incarnation)

    def _restarted(self, r: _Rank) -> tuple:
        r.joined = True
        self.restarting.discard(r.spec.index)
        took = time.monotonic() - r.started_at
        self.replica_restarts.append({"rank": r.spec.index, "pid": r.proc.pid, "incarnation": r.spec.incarnation, "seconds": took,
                                      "at": time.time()})
        log.warning("run %s: %s restarted (pid %d, incarnation %d) in %.1f s", self.run_id, r.spec.name, r.proc.pid,
                    r.spec.incarnation, took)
        return ("replica_restarted", r.spec.incarnation)

    def _lose_replica(self, rank: _Rank, cause: str) -> None:
        """Mark an attention rank dead where the step agreement looks (its peers go on in a new epoch)."""
        import json

        from afd.attention.steps import DEAD_KEY

        rank.lost = rank.done = True
        dead: dict[int, int] = {}  # index -> its newest incarnation lost (a restart, one up, is not the dead one)
        for a in self.ranks:
            if a.spec.role == Role.ATTENTION and a.lost:
                dead[a.spec.index] = max(dead.get(a.spec.index, -1), a.spec.incarnation)
        for r in self.ranks:  # a replacement, or a rebalance, waits no longer for it
            if not r.joined and not r.lost and r.spec.role == Role.FFN and {a.spec.index for a in self._live_attention()} <= r.linked:
                self._replacement_event(rank, ("ffn_joined", r.spec.index, r.spec.generation))
        self._advance_rebalance()
        store = self._steps_store or self._store  # where the step agreement's votes live
        if store is not None:
            store.set(DEAD_KEY, json.dumps(dead))
        if self.run_dir is not None:  # shm: a replacement still opening its links stops waiting for this rank's end
            from afd.connectors.shm import mark_attention_dead

            mark_attention_dead(self.run_dir, rank.spec.index, rank.spec.incarnation)
        self.replica_losses.append({"rank": rank.spec.index, "pid": rank.proc.pid, "cause": cause, "at": time.time()})
        if any(not a.lost for a in self.attention_ranks()):
            log.warning("run %s: %s: its requests move to the other attention ranks; the steps go on without it", self.run_id, cause)
        else:
            log.warning("run %s: %s: its requests wait for its restart", self.run_id, cause)

    def _lose_ffn(self, rank: _Rank, cause: str) -> None:
        rank.lost = rank.done = True
        self.ffn_losses.append({"rank": rank.spec.index, "pid": rank.proc.pid, "cause": cause, "at": time.time(),
                                "replacement": rank.spec.generation > 0 and not rank.joined})
        if self.node_rank > 0:
            log.warning("run %s: %s: node 0's attention ranks go on without it (on its experts' copies)", self.run_id, cause)
            if self.replace_ffn:
                self._replace(rank)
            return
        log.warning("run %s: %s: going on without it; its experts %s are served by their copies on FFN ranks %s", self.run_id, cause,
                    list(self.placement.experts_of(rank.spec.index)), self._live_ffn())
        if self.replace_ffn:
            self._replace(rank)
        self._advance_rebalance()  # a rebalance waits no longer for it

    def _ffn_reported_lost(self, index: int, generation: int, reason: str, by: _Rank, hung: bool = True) -> None:
        """An attention rank stopped using an FFN rank (dead, or silent past the link timeout): a hung one
        is killed, so that every attention rank sees the same loss (its links close)."""
        if index in self.remote_ffn():
            self._lose_remote_ffn(index, generation, reason, by)
            return
        rank = next((r for r in self.ranks if r.spec.role == Role.FFN and (r.spec.index, r.spec.generation) == (index, generation)), None)
        if rank is None or rank.lost:
            return
        if not hung:  # its link closed: it died, and its exit is at most a moment behind (the fork server reaps it)
            rank.proc.join(1.0)
        if rank.proc.is_alive():
            try:
                os.kill(rank.proc.pid, signal.SIGKILL)  # our own rank, by PID
            except ProcessLookupError:
                pass
            rank.proc.join(2.0)
            self._lose_ffn(rank, f"{rank.spec.name} (pid {rank.proc.pid}) was killed: {by.spec.name} found it {reason.split(': ', 1)[-1]}")
        else:
            self._lose_ffn(rank, f"{rank.spec.name} (pid {rank.proc.pid}) died: {exit_reason(rank.proc.exitcode)}")

    def _lose_remote_ffn(self, index: int, generation: int, reason: str, by: _Rank) -> None:
        """An FFN rank of another node is gone (dead, or hung: its node's launcher is asked to kill it, so
        that every attention rank sees the same loss). Its node's launcher starts the replacement and says
        so in the store (:meth:`_check_remote_joins`)."""
        if index in self._remote_lost or generation < self._remote_gen.get(index, 0):
            return
        self._remote_lost.add(index)
        self._remote_joining.pop(index, None)
        node = self.topology.node_of("ffn", index)
        self._store.set(f"{KILL_KEY}/f{index}.g{generation}", reason)
        self.ffn_losses.append({"rank": index, "pid": None, "node": node, "cause": reason, "at": time.time(), "replacement": False})
        log.warning("run %s: ffn rank %d on node %d lost (%s, found by %s): going on without it; its experts %s are served by their "
                    "copies on FFN ranks %s", self.run_id, index, node, reason, by.spec.name, list(self.placement.experts_of(index)),
                    self._live_ffn())

    # ------------------------------------------------------------------ start
    def _slot_bytes(self) -> int:
        c = self.model_config
        per_token = c.hidden_size * 4 + c.moe.top_k * 8  # fp32 hidden worst case, int32 ids, fp32 weights
        return self.engine.max_num_batched_tokens * per_token + 4096

    def start(self) -> "Cluster":
        t = self.topology
        self._set_run_id = env.run_id() is None
        os.environ["AFD_RUN_ID"] = self.run_id  # inherited by every rank process
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        if t.transport == "shm":  # the links' files (the other transports keep nothing on disk)
            self.run_dir = Path(tempfile.mkdtemp(prefix=f"afd-{self.run_id}-", dir=base))
        # 9 slots per direction: up to 8 micro-batches in flight plus a control message, so a
        # full ring can never block both sides at once
        link = LinkSpec(t.transport, self.run_dir, num_slots=9, slot_bytes=self._slot_bytes(), connect_timeout=self.ready_timeout,
                        io_log=self.io_log, num_attention=t.num_attention_ranks, num_ffn=t.num_ffn_ranks,
                        heartbeat_interval=self.heartbeat_interval, link_timeout=self.link_timeout, backend=backend_for(t))
        if t.transport in ("torch", "tcp"):
            import datetime

            import torch.distributed as dist

            if self.node_rank == 0:  # the rendezvous lives here, in node 0's launcher: up before any rank starts
                self._store = dist.TCPStore(self.master_addr, self.master_port, t.num_attention_ranks + t.num_ffn_ranks + 1,
                                            is_master=True, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=self.ready_timeout))
                port = self._store.port
            else:
                port = self.master_port
            link = replace(link, master_addr=self.master_addr, master_port=port)
        steps = None
        if t.num_attention_ranks > 1 and self.node_rank == 0:  # the step agreement's votes live here
            if self._store is None:
                import datetime

                import torch.distributed as dist

                self._steps_store = dist.TCPStore("127.0.0.1", 0, t.num_attention_ranks + 1, is_master=True, wait_for_workers=False,
                                                  timeout=datetime.timedelta(seconds=self.ready_timeout))
                steps = ("127.0.0.1", self._steps_store.port)
            else:
                steps = (self.master_addr, self._store.port)
        if t.transport == "shm":
            from afd.connectors.shm import create_links

            create_links(self.run_dir, t.num_attention_ranks, t.num_ffn_ranks, link.num_slots, link.slot_bytes)
        elif t.transport == "loopback":
            self._hub = LoopbackHub()
        log.info("run %s: %s, placement %s, run dir %s", self.run_id, t, self.placement.describe(), self.run_dir)
        log.warning("%s", self.describe_redundancy())
        try:
            for role, index in build_launch_order(t, self.local_ranks()):
                self._spawn(RankSpec(role, index, self.model_dir, t, self.placement, link, self.engine, self.link_timeout, self.pipeline,
                                     steps, attention_restart=self._restarts_replicas()))
            deadline = time.monotonic() + self.ready_timeout
            while any(r.ready is None for r in self.ranks):
                self._poll(deadline, "READY")
            self._started = True
            return self
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, spec: RankSpec, **state) -> _Rank:
        parent, child = mp.Pipe()
        if spec.link.transport == "loopback":
            proc = threading.Thread(target=run_rank, args=(spec, child, self._hub, False), name=spec.name, daemon=True)
        else:
            if self._forks is None:  # the run's fork server: torch imported once, every rank forked from it
                self._forks = RunForkServer.of_run(self.run_id)
            spec = replace(spec, env=dict(os.environ))  # the rank's environment: this one, now
            proc = self._forks.process(run_rank, (spec, child), f"afd-{spec.name.replace(' ', '-')}")
        proc.start()
        if not isinstance(proc, threading.Thread):
            child.close()  # the rank holds its own copy
        rank = _Rank(spec, parent, proc, **state)
        self.ranks.append(rank)
        return rank

    def _replace(self, lost: _Rank) -> None:
        """Start a replacement for a lost FFN rank: links of a new generation, the same experts loaded from the
        checkpoint. When its weights are in, every attention rank links to it (``ffn_join``); the step
        agreement then takes it back (afd/attention/steps.py)."""
        from afd.connectors.shm import create_links

        if self._rebalance is not None:  # it would start on the placement being replaced
            self._deferred.append(lost)
            return
        index = lost.spec.index
        tries = sum(1 for r in self.ranks if r.spec.role == Role.FFN and r.spec.index == index) - 1
        if self._closed or tries > self.max_replacements:
            log.warning("run %s: ffn rank %d: not replaced again (%d replacements started); serving without it", self.run_id, index, tries)
            return
        generation = max(r.spec.generation for r in self.ranks if r.spec.role == Role.FFN and r.spec.index == index) + 1
        link = lost.spec.link
        if link.transport == "shm":  # tcp: the replacement listens under its generation's key in the rendezvous store
            create_links(self.run_dir, self.topology.num_attention_ranks, self.topology.num_ffn_ranks, link.num_slots, link.slot_bytes,
                         ffn_ranks=[index], generation=generation)
        rank = self._spawn(replace(lost.spec, generation=generation, placement=self.placement, placement_version=self.placement_version),
                           joined=False, started_at=time.monotonic())
        log.warning("run %s: starting a replacement for ffn rank %d (pid %d, generation %d)", self.run_id, index, rank.proc.pid, generation)

    def _replacement_event(self, r: _Rank, msg: tuple) -> None:
        """A replacement's progress: weights loaded (attention ranks link to it), then every attention rank linked."""
        if msg[0] == "loaded" and r.spec.role == Role.ATTENTION:  # a restarted attention rank: the FFN ranks open its links
            self._tell_ffn(("attention_join", r.spec.index, r.spec.incarnation))
            return
        if msg[0] == "loaded" and self.node_rank > 0:  # node 0's attention ranks link to it once they hear (the store)
            self._node_store.set(f"{JOIN_KEY}/f{r.spec.index}", str(r.spec.generation))
            r.joined = True
            log.warning("run %s: the replacement of ffn rank %d (pid %d, generation %d) is loaded; node 0 links to it", self.run_id,
                        r.spec.index, r.proc.pid, r.spec.generation)
            return
        if msg[0] == "loaded":
            for a in self._live_attention():
                a.send(("ffn_join", r.spec.index, r.spec.generation))
            return
        if msg[1] in self._remote_joining:
            self._remote_linked(r, msg)
            return
        target = next((f for f in self.ranks if f.spec.role == Role.FFN and f.spec.index == msg[1] and f.spec.generation == msg[2]), None)
        if target is None or target.lost:
            return
        if msg[0] == "ffn_join_failed":
            log.warning("run %s: %s could not link to ffn rank %d generation %d: %s", self.run_id, r.spec.name, msg[1], msg[2], msg[3])
            return
        target.linked.add(r.spec.index)
        if {a.spec.index for a in self._live_attention()} <= target.linked and not target.joined:
            target.joined = True
            took = time.monotonic() - target.started_at
            self.ffn_replacements.append({"rank": target.spec.index, "pid": target.proc.pid, "generation": target.spec.generation,
                                          "seconds": took, "at": time.time()})
            log.warning("run %s: ffn rank %d replaced (pid %d, generation %d) in %.1f s: back in use from the next step",
                        self.run_id, target.spec.index, target.proc.pid, target.spec.generation, took)

    def _check_remote_joins(self) -> None:
        """Node 0: replacements another node's launcher started (and loaded) for FFN ranks node 0 lost."""
        now = time.monotonic()
        if not self._remote_lost or now - self._joins_checked < JOIN_POLL_S or self._store is None:
            return
        self._joins_checked = now
        for f in sorted(self._remote_lost):
            key = f"{JOIN_KEY}/f{f}"
            if not self._store.check([key]):
                continue
            generation = int(self._store.get(key).decode())
            if generation <= self._remote_gen.get(f, 0) or f in self._remote_joining:
                continue
            self._remote_gen[f] = generation
            self._remote_joining[f] = {"generation": generation, "linked": set(), "started": now}
            for a in self._live_attention():
                a.send(("ffn_join", f, generation))

    def _remote_linked(self, r: _Rank, msg: tuple) -> None:
        joining = self._remote_joining[msg[1]]
        if msg[2] != joining["generation"]:
            return
        if msg[0] == "ffn_join_failed":
            log.warning("run %s: %s could not link to ffn rank %d generation %d: %s", self.run_id, r.spec.name, msg[1], msg[2], msg[3])
            return
        joining["linked"].add(r.spec.index)
        if {a.spec.index for a in self._live_attention()} <= joining["linked"]:
            del self._remote_joining[msg[1]]
            self._remote_lost.discard(msg[1])
            took = time.monotonic() - joining["started"]
            self.ffn_replacements.append({"rank": msg[1], "pid": None, "node": self.topology.node_of("ffn", msg[1]),
                                          "generation": msg[2], "seconds": took, "at": time.time()})
            log.warning("run %s: ffn rank %d on node %d replaced (generation %d), linked in %.1f s: back in use from the next step",
                        self.run_id, msg[1], self.topology.node_of("ffn", msg[1]), msg[2], took)

    # ------------------------------------------------------------------ rebalancing
    def expert_load(self) -> list[float]:
        """Tokens routed to each logical expert so far, summed over layers and FFN ranks (their latest counters)."""
        load = [0.0] * self.placement.num_experts
        for r in self.ranks:
            if r.spec.role == Role.FFN and r.live_stats is not None:
                for (_, e), n in r.live_stats.get("expert_tokens", {}).items():
                    load[e] += n
        return load

    def load_imbalance(self) -> float:
        """Max over mean of the FFN ranks' load under the placement in use, from the measured per-expert load
        (1.0: balanced, or nothing measured yet)."""
        load = self.expert_load()
        return _imbalance(self.placement, load) if sum(load) else 1.0

    def rebalance(self, load: Sequence[float] | None = None, min_gain: float = 0.0) -> dict:
        """Recompute the expert placement from measured per-expert load (default: :meth:`expert_load`) and
        move to it while serving: every FFN rank loads its new copies from the checkpoint beside the old ones,
        then every attention rank installs the placement and the step agreement switches at the first step
        every vote has it (the work header's placement version says which copies a part was cut for).
        Returns what was decided; the move completes in the background (:attr:`rebalances`). ``min_gain``:
        move only if the predicted max/mean falls by more than this."""
        from afd.distributed.placement import ExpertPlacement

        if self._rebalance is not None:
            raise RuntimeError(f"a rebalance to placement version {self._rebalance['version']} is in progress")
        if any(not r.joined for r in self.ranks if r.spec.role == Role.FFN and not r.lost):
            raise RuntimeError("a replacement FFN rank is starting: rebalance once it is back in use")
        if self.restarting:
            raise RuntimeError(f"attention ranks {sorted(self.restarting)} are restarting: rebalance once they are back")
        if self.topology.num_ffn_ranks < 2:
            raise RuntimeError("one FFN rank holds every expert: there is nothing to rebalance")
        if self.remote_ffn():
            raise RuntimeError("a rebalance needs every FFN rank started by this node's launcher; FFN ranks "
                               f"{self.remote_ffn()} run on other nodes")
        load = list(self.expert_load() if load is None else load)
        new = ExpertPlacement.from_load(load, self.topology.num_ffn_ranks, self.placement.redundant)
        live = self._live_ffn()
        if self.placement.orphans(live) or new.orphans(live):
            raise RuntimeError(f"a rebalance needs every expert on a live FFN rank (live: {live})")
        decision = {"version": self.placement_version + 1, "before": _imbalance(self.placement, load), "after": _imbalance(new, load),
                    "placement": new.describe(), "changed": new != self.placement}
        if decision["before"] - decision["after"] <= min_gain:
            decision["changed"] = False  # not worth a move
        if not decision["changed"]:
            return decision
        self._rebalance = {**decision, "new": new, "ready": set(), "in_use": set(), "started": time.monotonic()}
        for r in self.ranks:
            if r.spec.role == Role.FFN and not r.lost:
                r.send(("placement", decision["version"], new))
        log.warning("run %s: rebalancing to placement version %d (load max/mean %.2f -> %.2f): %s", self.run_id, decision["version"],
                    decision["before"], decision["after"], new.describe())
        return decision

    def _live_attention(self) -> list[_Rank]:
        return [a for a in self.attention_ranks() if not a.lost and a.joined]

    def _live_ffn(self) -> list[int]:
        local = {r.spec.index for r in self.ranks if r.spec.role == Role.FFN and not r.lost and r.joined}
        return sorted(local | (set(self.remote_ffn()) - self._remote_lost))

    def _rebalance_event(self, r: _Rank, msg: tuple) -> None:
        rb = self._rebalance
        if rb is None or msg[1] != rb["version"]:
            return
        if msg[0] == "placement_ready":
            rb["ready"].add(r.spec.index)
        else:
            rb["in_use"].add(r.spec.index)
        self._advance_rebalance()

    def _advance_rebalance(self) -> None:
        rb = self._rebalance
        if rb is None:
            return
        if "sent" not in rb and set(self._live_ffn()) <= rb["ready"]:
            rb["sent"] = time.monotonic()
            for a in self._live_attention():
                a.send(("placement", rb["version"], rb["new"]))
        if {a.spec.index for a in self._live_attention()} <= rb["in_use"]:
            self.placement, self.placement_version = rb["new"], rb["version"]
            took = time.monotonic() - rb["started"]
            self.rebalances.append({k: rb[k] for k in ("version", "before", "after", "placement")} | {"seconds": took, "at": time.time()})
            self._rebalance = None
            log.warning("run %s: placement version %d in use on every rank after %.1f s", self.run_id, rb["version"], took)
            for lost in self._deferred:
                self._replace(lost)
            self._deferred.clear()

    # ------------------------------------------------------------------ watching
    def _poll(self, deadline: float, waiting_for: str, max_wait: float = 0.5) -> list[tuple[_Rank, tuple]]:
        """Wait for messages from ranks; fail fast on any death or error. Returns (rank, message) pairs."""
        left = deadline - time.monotonic()
        if left <= 0:
            slow = [r.spec.name for r in self.ranks if r.ready is None]
            self._fail(f"timed out after {self.ready_timeout:.0f} s waiting for {waiting_for} ({', '.join(slow) or 'results'})")
        got, failures = self._sweep(min(left, max_wait))
        if failures:
            # one death usually makes its peers fail too ("... is gone"): gather them, report the cause first
            time.sleep(0.3)
            failures += self._sweep(0.0)[1]
            failures.sort(key=lambda f: f[0])
            self._fail("; then ".join(text for _, text, _ in failures), detail="\n".join(d for *_, d in failures if d))
        return got

    def _sweep(self, timeout: float) -> tuple[list[tuple[_Rank, tuple]], list[tuple[int, str, str]]]:
        self._check_remote_joins()
        self._restart_waiting()
        handles = [r.conn for r in self.ranks if not r.conn.closed] + [r.sentinel for r in self.ranks if r.sentinel is not None]
        ready = wait(handles, timeout=timeout)
        got, failures = [], []
        for r in self.ranks:
            while not r.conn.closed and r.conn in ready and r.conn.poll():
                try:
                    msg = r.conn.recv()
                except EOFError:
                    r.conn.close()
                    break
                if msg[0] == "error":
                    r.failed = True  # its exit that follows is not news
                    secondary = "PeerDiedError" in msg[1] or "RemoteError" in msg[1]
                    failures.append((2 if secondary else 1, msg[1], msg[2] if len(msg) > 2 else ""))
                elif msg[0] == "ready":
                    r.ready = msg[1]
                    log.info("%s READY (pid %d): %d tensors, %.1f MB read", r.spec.name, msg[1].pid, len(msg[1].tensors), msg[1].bytes_read / 1e6)
                    if r.spec.role == Role.ATTENTION and r.spec.incarnation:
                        got.append((r, self._restarted(r)))
                elif msg[0] == "joining":
                    got.append((r, self._joining(r)))
                elif msg[0] == "bye":
                    r.done = True
                    r.final_stats = msg[1]
                elif msg[0] == "ffn_stats":
                    r.live_stats = msg[1]
                elif msg[0] == "ffn_lost":
                    self._ffn_reported_lost(msg[1], msg[2], msg[3], r, hung=msg[4])
                elif msg[0] in ("loaded", "ffn_joined", "ffn_join_failed"):
                    self._replacement_event(r, msg)
                elif msg[0] in ("placement_ready", "placement_in_use"):
                    self._rebalance_event(r, msg)
                elif msg[0] == "attention_silent":  # an FFN rank found an attention rank hung
                    target = self.attention_ranks()[msg[1]]
                    if target.lost or target.done:
                        continue
                    if self._replica_survivable(target) and target.proc.is_alive():
                        log.warning("run %s: %s; killing it (pid %d): its requests move", self.run_id, msg[2], target.proc.pid)
                        os.kill(target.proc.pid, signal.SIGKILL)  # our own child, by PID; its sentinel does the rest
                    else:
                        failures.append((0, f"{r.spec.name} (pid {r.proc.pid}) reports: {msg[2]}", ""))
                else:
                    got.append((r, msg))
        for r in self.ranks:
            if r.done or r.failed:
                continue
            if r.sentinel is not None and r.sentinel in ready:
                r.proc.join(1.0)  # reap it, so the exit code is known
                cause = f"{r.spec.name} (pid {r.proc.pid}) died: {exit_reason(r.proc.exitcode)}"
                if self._survivable(r):
                    self._lose_ffn(r, cause)
                    continue
                if self._replica_survivable(r):
                    self._lose_replica(r, cause)
                    self._restart_or_forget(r)
                    got.append((r, ("replica_lost", cause)))
                    continue
                r.failed = True
                failures.append((0, cause, ""))
            elif r.sentinel is None and not r.proc.is_alive():
                r.failed = True
                failures.append((0, f"{r.spec.name} thread ended unexpectedly", ""))
        return got, failures

    def _fail(self, reason: str, detail: str = "") -> None:
        if detail:
            log.debug("rank failure detail:\n%s", detail)
        self.shutdown(graceful=False)
        raise RankFailedError(f"run {self.run_id}: {reason}")

    def local_ranks(self) -> list[tuple[Role, int]]:
        """The ranks this node runs (every rank on a single host)."""
        t = self.topology
        return [(Role.ATTENTION, a) for a in range(t.num_attention_ranks) if t.node_of("attention", a) == self.node_rank] + [
            (Role.FFN, f) for f in range(t.num_ffn_ranks) if t.node_of("ffn", f) == self.node_rank]

    def remote_ffn(self) -> list[int]:
        """FFN ranks another node runs (their losses reach this node's launcher through the attention ranks)."""
        return [f for f in range(self.topology.num_ffn_ranks) if (Role.FFN, f) not in self.local_ranks()]

    def wait_until_done(self) -> None:
        """On a node without attention ranks: serve until every local rank has finished (or one fails).
        A local rank node 0 found hung (and asks, in the rendezvous store, to be killed) is killed."""
        import datetime

        import torch.distributed as dist

        store = self._node_store = dist.TCPStore(self.master_addr, self.master_port, is_master=False, wait_for_workers=False,
                                                 timeout=datetime.timedelta(seconds=self.ready_timeout))
        while not all(r.done for r in self.ranks):
            self._poll(time.monotonic() + 24 * 3600, "the run to end")
            try:
                socket.create_connection((self.master_addr, self.master_port), timeout=2.0).close()  # is node 0 there? (a
                # store call on a dead store would also say so, after torch's C++ logger printed a stack trace)
                asked = {(r.spec.index, r.spec.generation) for r in self.ranks
                         if r.spec.role == Role.FFN and store.check([f"{KILL_KEY}/f{r.spec.index}.g{r.spec.generation}"])}
            except Exception as e:  # noqa: BLE001 - node 0's launcher hosts the store: it is gone
                grace = time.monotonic() + 2.0  # at the end of a run it goes first: the SHUTDOWNs are on their way
                while not all(r.done for r in self.ranks) and time.monotonic() < grace:
                    self._poll(grace + 1.0, "the run to end", max_wait=0.2)
                if all(r.done for r in self.ranks):
                    break
                self._fail(f"node 0's rendezvous ({self.master_addr}:{self.master_port}) is gone: node 0 was lost "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__})")
            for r in self.ranks:
                key = f"{KILL_KEY}/f{r.spec.index}.g{r.spec.generation}"
                if r.spec.role == Role.FFN and not r.done and r.proc.is_alive() and (r.spec.index, r.spec.generation) in asked:
                    log.warning("run %s: killing %s (pid %d): node 0 %s", self.run_id, r.spec.name, r.proc.pid, store.get(key).decode())
                    os.kill(r.proc.pid, signal.SIGKILL)  # our own child, by PID; its sentinel does the rest

    # ------------------------------------------------------------------ serving
    def attention_ranks(self) -> list[_Rank]:
        """Each attention rank, in index order: its latest incarnation (a restart replaces a lost one)."""
        latest = {r.spec.index: r for r in self.ranks if r.spec.role == Role.ATTENTION}
        return [latest[a] for a in sorted(latest)]

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        pipeline: PipelineConfig | None = None,
        capture_dir: str | Path | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion through the serving front end (balanced as a server balances them);
        outputs in prompt order. ``capture_dir``: each attention rank records its steps there, keyed by
        the prompt's index."""
        from afd.serving.frontend import ClusterReplicas, run_offline

        if self.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError(f"{self.model_dir} has no tokenizer.json: pass token ids")
        from afd.serving.frontend import ReplicaFailed

        replicas = ClusterReplicas(self, pipeline, str(capture_dir) if capture_dir is not None else None)
        try:
            return run_offline(replicas, self.tokenizer, prompts, params, progress=progress, shutdown=False)
        except ReplicaFailed as e:
            raise RankFailedError(str(e).removeprefix(f"run {self.run_id}: ")) from None

    @functools.cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer (None without tokenizer.json: token-id prompts only)."""
        from afd.engine.tokenizer import Tokenizer

        return Tokenizer(self.model_dir) if (self.model_dir / "tokenizer.json").is_file() else None

    def poll(self, timeout: float) -> list[tuple[int, tuple]]:
        """Messages from the attention ranks within ``timeout`` s, as (attention rank index, message).
        Raises :class:`RankFailedError` (after stopping every rank) when any rank fails."""
        return [(r.spec.index, msg) for r, msg in self._poll(time.monotonic() + 24 * 3600, "events", max_wait=timeout)
                if r.spec.role == Role.ATTENTION]

    def request_all(self, commands: Sequence[tuple], reply: str, timeout: float = 600.0) -> list:
        """Send attention rank i ``commands[i]`` (all at once) and wait for every reply, in rank order."""
        ranks = self.attention_ranks()
        if len(commands) != len(ranks):
            raise ValueError(f"{len(commands)} commands for {len(ranks)} attention ranks")
        for r, command in zip(ranks, commands):
            r.send(command)
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < len(ranks):
            for r, msg in self._poll(deadline, reply):
                if msg[0] == reply:
                    replies[ranks.index(r)] = msg[1]
        return [replies[i] for i in range(len(ranks))]

    def request(self, rank: int, command: tuple, reply: str, timeout: float = 600.0):
        """Send one command to an attention rank and wait for its reply (tests, stats, capture)."""
        target = self.attention_ranks()[rank]
        target.send(command)
        deadline = time.monotonic() + timeout
        while True:
            for r, msg in self._poll(deadline, reply):
                if r is target and msg[0] == reply:
                    return msg[1]

    @property
    def closed(self) -> bool:
        """Shut down (by :meth:`shutdown`, or after a failure stopped every rank)."""
        return self._closed

    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.ranks if getattr(r.proc, "pid", None)]

    # ------------------------------------------------------------------ stopping
    def shutdown(self, graceful: bool = True, timeout: float = 10.0) -> None:
        """Stop every rank. Idempotent; safe after a failure or from ``finally``."""
        if self._closed:
            return
        self._closed = True
        for r in self.ranks:  # a replacement still starting has no link to be told SHUTDOWN on
            if not r.joined and not r.lost and r.proc.is_alive() and not isinstance(r.proc, threading.Thread):
                r.proc.terminate()
        if graceful:
            for r in self.attention_ranks():
                try:
                    if r.ready is not None and not r.lost and r.joined:
                        r.send(("shutdown",))
                    elif self._restarts_replicas():  # lost, or its restart was stopped above: no SHUTDOWN will come from it
                        self._tell_ffn(("attention_gone", r.spec.index))
                except (OSError, BrokenPipeError):
                    pass
            # read last words while waiting: a rank blocked writing a large "bye" into a full pipe
            # would otherwise never exit, and its counters would be lost
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and any(r.proc.is_alive() for r in self.ranks):
                self._read_last_words()
                for r in self.ranks:
                    r.proc.join(0.02)
        self._read_last_words()
        if self._hub is not None:
            self._hub.close()
        for r in self.ranks:
            proc = r.proc
            if isinstance(proc, threading.Thread):
                proc.join(timeout=2.0)
                continue
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        self._read_last_words()
        for r in self.ranks:
            r.conn.close()
        if self._forks is not None:
            if self._set_run_id:  # this run's own id: nobody else forks from it (a preset id's server stays for the next run)
                self._forks.stop()
            self._forks = None
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self._store = self._steps_store = None
        if self._set_run_id:
            os.environ.pop("AFD_RUN_ID", None)

    def _read_last_words(self) -> None:
        """Collect what ranks said on their way out (the exit counters in "bye")."""
        for r in self.ranks:
            try:
                while not r.conn.closed and r.conn.poll():
                    msg = r.conn.recv()
                    if msg[0] == "bye":
                        r.done, r.final_stats = True, msg[1]
            except (EOFError, OSError):
                pass

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown(graceful=exc[0] is None)
