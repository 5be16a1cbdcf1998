"""The launcher: the rendezvous of a run, its ranks' processes, their READY, the sweep that reads what they
say, and the shutdown that leaves nothing behind. Policy -- which losses a run survives -- is the
supervisor's (afd/runtime/supervisor.py); the state here is owned by one thread (afd/runtime/cluster.py).

* The topology is validated before anything starts; a bad one starts nothing.
* Every process of a run carries its run id (``AFD_RUN_ID``) in its environment: the fork server is
  started with it, and every rank is forked from that server (afd/runtime/forkserver.py).
* The rendezvous (shm files, or the TCPStore of the tcp and torch transports) is made before any rank
  starts; FFN ranks start first, so they listen by the time an attention rank links to them.
* :meth:`Launcher.shutdown` is idempotent: SHUTDOWN, then SIGTERM, then SIGKILL; ranks also die with the
  fork server, which dies with the launcher (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing as mp
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Sequence

from afd.config import EngineArgs, FaultPlan, PipelineConfig, Timeouts
from afd.connectors.factory import REOPENABLE, LinkSpec
from afd.connectors.transport import LoopbackHub
from afd.connectors.wire import Role
from afd.distributed.devices import check_present
from afd.distributed.topology import MULTI_HOST_TRANSPORTS, Topology, backend_for, validate_topology
from afd.engine.budget import engine_limits, no_prefix_cache_reason
from afd.models.hf_config import load_model_config
from afd.models.loader import resolve_dtype
from afd.runtime.forkserver import RunForkServer
from afd.runtime.messages import AttentionGone, Bye, Shutdown
from afd.runtime.procs import make_run_dir
from afd.runtime.rank import run_rank
from afd.runtime.spec import RankSpec

log = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """A rank died or reported an error; the whole job was stopped."""


@dataclass(frozen=True)
class NodeSpec:
    """Where this launcher sits in a run over several hosts (torchrun's flags)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes); got --nnodes {self.nnodes}, --node-rank {self.node_rank}")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("a multi-node run needs --master-port (and --master-addr: node 0's address)")


@dataclass
class RankHandle:
    """The launcher's handle on one rank: its spec, pipe and process, and what is known of it."""

    spec: RankSpec
    conn: Connection
    proc: Any  # a RankProcess, or a threading.Thread (loopback)
    ready: Any = None  # its ReadyReport
    done: bool = False  # said bye / exited as asked
    failed: bool = False  # already reported
    lost: bool = False  # the run goes on without it (an FFN rank whose experts have copies; an attention rank whose
    # requests moved or wait for its restart)
    joined: bool = True  # a replacement: every attention rank has linked to it; a restart: it is serving
    joining: bool = False  # a restarted attention rank asked the others to take it into their steps
    linked: set = field(default_factory=set)  # a replacement: the attention ranks linked to it so far
    started_at: float = 0.0
    final_stats: Any = None  # what the rank said on exit (FFN: items, batches, mean expert GEMM rows)
    live_stats: Any = None  # the latest counters an FFN rank reported while serving
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def is_thread(self) -> bool:
        return isinstance(self.proc, threading.Thread)

    @property
    def sentinel(self):
        return None if self.is_thread else self.proc.sentinel

    @property
    def pid(self) -> int:
        return self.proc.pid if not self.is_thread else 0

    def send(self, msg: object) -> None:
        """Send one command (from any thread: a front end's sends and the owner's share the pipe)."""
        with self.send_lock:
            self.conn.send(msg)


def build_launch_order(topology: Topology, local: Sequence[tuple[Role, int]] | None = None) -> list[tuple[Role, int]]:
    """The one place that decides start order: FFN ranks first, so that they listen and serve by the time an
    attention rank links to them and reports READY. ``local``: only these ranks (the ones this node runs)."""
    order = [(Role.FFN, f) for f in range(topology.num_ffn_ranks)] + [
        (Role.ATTENTION, a) for a in range(topology.num_attention_ranks)
    ]
    return [ri for ri in order if local is None or ri in local]


class Launcher:
    """The ranks of one run that this node runs (every rank, on a single host)."""

    def __init__(self, model_dir: str | Path, topology: Topology, engine: EngineArgs = EngineArgs(), timeouts: Timeouts = Timeouts(),
                 pipeline: PipelineConfig = PipelineConfig(), node: NodeSpec = NodeSpec(), run_id: str | None = None,
                 io_log: bool = False, faults: FaultPlan | None = None, threads: int | None = None,
                 forks: RunForkServer | None = None) -> None:
        if topology.num_nodes > node.nnodes:
            raise ValueError(f"the topology places ranks on {topology.num_nodes} nodes, but --nnodes is {node.nnodes}")
        if node.nnodes > 1 and topology.transport not in MULTI_HOST_TRANSPORTS:
            raise ValueError("a multi-node run needs --transport tcp or torch (shm and loopback stay on one host)")
        self.model_dir, self.topology, self.node = Path(model_dir), topology, node
        self.timeouts, self.pipeline, self.io_log, self.faults, self.threads = timeouts, pipeline, io_log, faults, threads
        config = self.model_config = load_model_config(self.model_dir)
        self.placement = validate_topology(topology, config.moe.num_experts)  # before any process starts
        self.placement_version = 0  # of self.placement: a rebalance counts it up
        dtype = resolve_dtype(engine.dtype, json.loads((self.model_dir / "config.json").read_text()))
        self.limits = engine_limits(config, dtype, engine.kv_cache_memory, engine.block_size, engine.max_num_seqs, engine.max_model_len,
                                    engine.max_step_memory, engine.max_num_batched_tokens, engine.state_dtype)  # once, for every rank
        self.engine = replace(engine, max_num_batched_tokens=self.limits.max_num_batched_tokens,
                              max_step_memory=self.limits.max_step_memory, max_model_len=self.limits.max_model_len)
        reason = no_prefix_cache_reason(config, dtype, engine.state_dtype, engine.block_size)
        if engine.enable_prefix_caching and reason:  # said once here; the ranks and the front end's router go without
            log.warning("%s", reason)
            self.engine = replace(self.engine, enable_prefix_caching=False)
        local = self.local_ranks()  # devices are checked on the host that runs them
        if not local:
            raise ValueError(f"node {node.node_rank} runs no rank (attention ranks on nodes {list(topology.attention_nodes)}, FFN "
                             f"ranks on nodes {list(topology.ffn_nodes)})")
        check_present([(topology.attention_devices if role == Role.ATTENTION else topology.ffn_devices)[i] for role, i in local])
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.forks, self._owns_forks = forks, forks is None
        self.ranks: list[RankHandle] = []
        self.run_dir: Path | None = None
        self.link: LinkSpec | None = None
        self.steps: tuple[str, int] | None = None  # the step agreement's store (several attention ranks)
        self.store = None  # node 0 of a tcp or torch run: the rendezvous TCPStore (node k > 0: a client of node 0's)
        self._steps_store = None  # the step agreement's TCPStore, when no rendezvous store can hold it
        self._hub: LoopbackHub | None = None
        self.closed = False

    # ------------------------------------------------------------------ views
    def local_ranks(self) -> list[tuple[Role, int]]:
        """The ranks this node runs (every rank on a single host)."""
        t, me = self.topology, self.node.node_rank
        return [(Role.ATTENTION, a) for a in range(t.num_attention_ranks) if t.node_of("attention", a) == me] + [
            (Role.FFN, f) for f in range(t.num_ffn_ranks) if t.node_of("ffn", f) == me]

    def remote_ffn(self) -> list[int]:
        """FFN ranks another node runs (their losses reach this node through the attention ranks)."""
        return [f for f in range(self.topology.num_ffn_ranks) if (Role.FFN, f) not in self.local_ranks()]

    def attention_ranks(self) -> list[RankHandle]:
        """Each attention rank, in index order: its latest incarnation (a restart replaces a lost one)."""
        latest = {r.spec.index: r for r in self.ranks if r.spec.role == Role.ATTENTION}
        return [latest[a] for a in sorted(latest)]

    def ffn_ranks(self) -> list[RankHandle]:
        return [r for r in self.ranks if r.spec.role == Role.FFN]

    @property
    def steps_store(self):
        """The TCPStore the attention ranks' step agreement votes in (None: one attention rank, or not node 0)."""
        return self._steps_store or (self.store if self.steps is not None else None)

    def describe_limits(self) -> str:
        """Each attention rank's limits, and the workspace of an FFN rank's union (at most A x the token cap)."""
        rows = self.topology.num_attention_ranks * self.limits.max_num_batched_tokens
        return (f"each attention rank: {self.limits.describe()}; an FFN union holds at most {rows} rows "
                f"({self.topology.num_attention_ranks} x {self.limits.max_num_batched_tokens}): "
                f"{rows * self.limits.budget.ffn_per_token >> 20} MiB of FFN temporaries")

    # ------------------------------------------------------------------ start
    def rendezvous(self) -> None:
        """The links' files (shm), the stores (tcp, torch, and the step agreement's), before any rank starts."""
        t, node = self.topology, self.node
        if t.transport == "shm":
            self.run_dir = make_run_dir(self.run_id, "/dev/shm" if Path("/dev/shm").is_dir() else None)
        # 9 slots per direction: up to 8 micro-batches in flight plus a control message, so a
        # full ring can never block both sides at once
        c = self.model_config
        slot_bytes = self.engine.max_num_batched_tokens * (c.hidden_size * 4 + c.moe.top_k * 8) + 4096  # fp32 hidden, ids, weights
        link = LinkSpec(t.transport, self.run_dir, num_slots=9, slot_bytes=slot_bytes, timeouts=self.timeouts, io_log=self.io_log,
                        num_attention=t.num_attention_ranks, num_ffn=t.num_ffn_ranks, backend=backend_for(t))
        if t.transport in ("torch", "tcp"):
            port = node.master_port
            if node.node_rank == 0:  # the rendezvous lives here, in node 0's launcher: up before any rank starts
                self.store = self._tcp_store(node.master_addr, node.master_port, t.num_attention_ranks + t.num_ffn_ranks + 1)
                port = self.store.port
            link = replace(link, master_addr=node.master_addr, master_port=port)
        if t.num_attention_ranks > 1 and node.node_rank == 0:  # the step agreement's votes live here
            if self.store is None:
                self._steps_store = self._tcp_store("127.0.0.1", 0, t.num_attention_ranks + 1)
                self.steps = ("127.0.0.1", self._steps_store.port)
            else:
                self.steps = (node.master_addr, self.store.port)
        if t.transport == "shm":
            from afd.connectors.shm import create_links

            create_links(self.run_dir, t.num_attention_ranks, t.num_ffn_ranks, link.num_slots, link.slot_bytes)
        elif t.transport == "loopback":
            self._hub = LoopbackHub()
        self.link = link
        log.info("run %s: %s, placement %s, run dir %s", self.run_id, t, self.placement.describe(), self.run_dir)

    def _tcp_store(self, host: str, port: int, world: int):
        import torch.distributed as dist

        return dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=self.timeouts.ready))

    def spec_for(self, role: Role, index: int) -> RankSpec:
        return RankSpec(role, index, self.model_dir, self.topology, self.placement, self.link, self.engine, self.pipeline, self.steps,
                        attention_restart=self.restarts_replicas, faults=self.faults, threads=self.threads)

    @property
    def restarts_replicas(self) -> bool:
        """Whether the transport lets a lost attention rank be restarted (its links reopen)."""
        return self.topology.transport in REOPENABLE

    def spawn(self, spec: RankSpec, **state) -> RankHandle:
        parent, child = mp.Pipe()
        if spec.link.transport == "loopback":
            proc = threading.Thread(target=run_rank, args=(spec, child, self._hub, False), name=spec.name, daemon=True)
        else:
            if self.forks is None:  # the run's fork server: torch imported once, every rank forked from it
                self.forks = RunForkServer(self.run_id)
            proc = self.forks.process(run_rank, (spec, child), f"afd-{spec.name.replace(' ', '-')}")
        proc.start()
        if not isinstance(proc, threading.Thread):
            child.close()  # the rank holds its own copy
        rank = RankHandle(spec, parent, proc, **state)
        self.ranks.append(rank)
        return rank

    # ------------------------------------------------------------------ watching
    def sweep(self, timeout: float, also: Sequence = ()) -> tuple[list[tuple[RankHandle, object]], list[RankHandle]]:
        """Wait up to ``timeout`` s for anything from the ranks (or ``also``: more handles to wake on); return the
        messages read, (rank, message) in order, and the ranks found exited (not yet known to be done)."""
        handles = [r.conn for r in self.ranks if not r.conn.closed] + [r.sentinel for r in self.ranks if r.sentinel is not None]
        ready = wait([*handles, *also], timeout=timeout)
        got = []
        for r in self.ranks:
            while not r.conn.closed and r.conn in ready and r.conn.poll():
                try:
                    got.append((r, r.conn.recv()))
                except (EOFError, OSError):  # ended, or reset by a rank killed with bytes unread: its sentinel says how
                    r.conn.close()
                    break
        exited = [r for r in self.ranks if not (r.done or r.failed or r.lost)
                  and ((r.sentinel is not None and r.sentinel in ready) or (r.is_thread and not r.proc.is_alive()))]
        for r in exited:
            if not r.is_thread:
                r.proc.join(1.0)  # reap it, so the exit code is known
        return got, exited

    # ------------------------------------------------------------------ stopping
    def shutdown(self, graceful: bool = True) -> None:
        """Stop every rank. Idempotent; safe after a failure or from ``finally``."""
        if self.closed:
            return
        self.closed = True
        for r in self.ranks:  # a replacement still starting has no link to be told SHUTDOWN on
            if not r.joined and not r.lost and not r.is_thread and r.proc.is_alive():
                r.proc.terminate()
        if graceful:
            for r in self.attention_ranks():
                try:
                    if r.ready is not None and not r.lost and r.joined:
                        r.send(Shutdown())
                    elif self.restarts_replicas:  # lost, or its restart was stopped above: no SHUTDOWN will come from it
                        self.tell_ffn(AttentionGone(r.spec.index))
                except (OSError, BrokenPipeError):
                    pass
            # read last words while waiting: a rank blocked writing a large Bye into a full pipe
            # would otherwise never exit, and its counters would be lost
            deadline = time.monotonic() + self.timeouts.shutdown
            while time.monotonic() < deadline and any(r.proc.is_alive() for r in self.ranks):
                self._read_last_words()
                for r in self.ranks:
                    r.proc.join(0.02)
        self._read_last_words()
        if self._hub is not None:
            self._hub.close()
        for r in self.ranks:
            if r.is_thread:
                r.proc.join(timeout=2.0)
                continue
            for stop in (r.proc.terminate, r.proc.kill):
                if r.proc.is_alive():
                    stop()
                    r.proc.join(2.0)
        self._read_last_words()
        for r in self.ranks:
            r.conn.close()
        if self.forks is not None and self._owns_forks:
            self.forks.stop()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        self.store = self._steps_store = None

    def tell_ffn(self, msg: object) -> None:
        """Send every FFN rank this launcher runs, and that still serves, one command (a rank that died meanwhile
        is skipped: the sweep reports its exit)."""
        for f in self.ffn_ranks():
            if not f.lost and not f.done and f.proc.is_alive():
                try:
                    f.send(msg)
                except OSError:
                    pass

    def _read_last_words(self) -> None:
        """Collect what ranks said on their way out (the exit counters in Bye)."""
        for r in self.ranks:
            try:
                while not r.conn.closed and r.conn.poll():
                    msg = r.conn.recv()
                    if isinstance(msg, Bye):
                        r.done, r.final_stats = True, msg.stats
            except (EOFError, OSError):
                pass
