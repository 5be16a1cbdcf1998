"""Build a rank's mailbox for the run's transport."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from afd.config import Timeouts
from afd.connectors.wire import Role
from afd.connectors.transport import LoopbackHub, LoopbackMailbox, Mailbox


REOPENABLE = ("shm", "tcp")  # transports whose links a rank can lose and reopen to a replacement (failover)


@dataclass(frozen=True)
class LinkSpec:
    """How the ranks of one run reach each other (picklable; the loopback hub is passed separately)."""

    transport: str
    run_dir: Path | None  # shm: where the link files are (None for the other transports)
    num_slots: int = 4
    slot_bytes: int = 1 << 20
    timeouts: Timeouts = Timeouts()  # ready: linking at start; hang: a silent peer; heartbeat: an idle link's beat
    io_log: bool = False
    num_attention: int = 1
    num_ffn: int = 1
    master_addr: str = "127.0.0.1"  # torch and tcp transports: where the launcher's TCPStore listens
    master_port: int = 0
    backend: str = "gloo"  # torch transport: gloo, nccl or hccl (afd.distributed.topology.backend_for)


def make_mailbox(spec: LinkSpec, role: Role, index: int, num_peers: int, hub: LoopbackHub | None = None,
                 device: str = "cpu", generation: int = 0, incarnation: int = 0, ffn_generations: dict[int, int] | None = None) -> Mailbox:
    """``device``: the rank's compute device, where received tensors are delivered. ``generation`` > 0: a
    replacement FFN rank's links; ``incarnation`` > 0: a restarted attention rank's, to FFN ranks at
    ``ffn_generations`` (shm and tcp). The links are open once the caller has called ``connect`` (the
    rank's second step of starting: a replacement says it is loaded between the two)."""
    if (generation or incarnation or ffn_generations) and spec.transport not in REOPENABLE:
        raise ValueError(f"a replacement or restarted rank's links need the shm or tcp transport, not {spec.transport}")
    if role == Role.FFN:
        peer_generations = {p: generation for p in range(num_peers)} if generation else None
    else:
        peer_generations = dict(ffn_generations or {}) or None
    if spec.transport == "loopback":
        if hub is None:
            raise ValueError("the loopback transport needs the run's LoopbackHub (ranks must be threads of one process)")
        return LoopbackMailbox(hub, role, index, num_peers, spec.io_log, device)
    if spec.transport == "shm":
        from afd.connectors.shm import ShmMailbox

        return ShmMailbox(spec.run_dir, role, index, num_peers, spec.num_slots, spec.slot_bytes, spec.io_log, device,
                          generations=peer_generations, incarnation=incarnation)
    if spec.transport == "tcp":
        from afd.connectors.tcp import TcpMailbox

        return TcpMailbox(role, index, spec.num_attention, spec.num_ffn, spec.master_addr, spec.master_port,
                          timeout=spec.timeouts.ready, io_log=spec.io_log, device=device, generation=generation,
                          generations=peer_generations if role == Role.ATTENTION else None)
    if spec.transport == "torch":
        from afd.connectors.torch_dist import TorchMailbox

        return TorchMailbox(role, index, spec.num_attention, spec.num_ffn, spec.master_addr, spec.master_port,
                            backend=spec.backend, timeout=spec.timeouts.ready, io_log=spec.io_log, device=device)
    raise ValueError(f"unknown transport {spec.transport!r}; use loopback, shm, tcp or torch")
