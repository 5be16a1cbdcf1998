"""What a run's owner thread publishes for every other thread: an immutable :class:`RunStatus`, replaced whole
whenever something changes (/health, /metrics and the front end read it without a lock)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from afd.runtime.launcher import Launcher
from afd.runtime.rebalance import Move, Rebalancer
from afd.runtime.supervisor import Event, Record, Supervisor


@dataclass(frozen=True)
class RankInfo:
    name: str
    pid: int
    state: str  # starting | serving | lost


@dataclass(frozen=True)
class RunStatus:
    """What a run's owner publishes for other threads (/health, /metrics, the front end). Immutable."""

    ranks: tuple[RankInfo, ...] = ()
    unavailable: frozenset[int] = frozenset()  # replicas (attention ranks) lost or not serving yet
    restarting: frozenset[int] = frozenset()  # lost replicas being restarted: their requests wait for them
    ffn_stats: Mapping[str, dict] = field(default_factory=lambda: MappingProxyType({}))  # FFN rank name -> its live counters
    ffn_losses: tuple[Event, ...] = ()
    ffn_replacements: tuple[Event, ...] = ()
    replica_losses: tuple[Event, ...] = ()
    replica_restarts: tuple[Event, ...] = ()
    rebalances: tuple[Move, ...] = ()
    placement_version: int = 0
    load_imbalance: float = 1.0  # the FFN ranks' measured load, max over mean, under the placement in use
    disaggregated: bool = True


def run_status(launcher: Launcher, supervisor: Supervisor, rebalancer: Rebalancer, record: Record) -> RunStatus:
    """The status of a run, read from its owner's state (on the owner thread)."""
    attention = launcher.attention_ranks()
    ffn = {r.spec.name: r.live_stats for r in launcher.ffn_ranks() if r.live_stats is not None and not r.lost}
    return RunStatus(
        ranks=tuple(RankInfo(r.spec.name, r.ready.pid if r.ready is not None else r.pid,
                             "lost" if r.lost else "serving" if r.joined and r.ready is not None else "starting")
                    for r in launcher.ranks),
        unavailable=frozenset(i for i, r in enumerate(attention) if r.lost or not r.joined),
        restarting=frozenset(supervisor.restarting),
        ffn_stats=MappingProxyType(ffn),
        ffn_losses=tuple(record.ffn_losses), ffn_replacements=tuple(record.ffn_replacements),
        replica_losses=tuple(record.replica_losses), replica_restarts=tuple(record.replica_restarts),
        rebalances=tuple(rebalancer.moves), placement_version=launcher.placement_version,
        load_imbalance=rebalancer.load_imbalance())
