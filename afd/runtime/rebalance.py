"""Rebalancing while serving: recompute the expert placement from the measured per-expert load and move to
it, with no step lost and no text changed.

1. Every FFN rank loads its copies of the new placement from the checkpoint beside the ones it serves
   (:class:`InstallPlacement`), and says :class:`PlacementReady`.
2. Once every live FFN rank holds them, every attention rank installs the placement; the step agreement
   switches at the first step every vote has it (the work header's placement version says which copies
   a part was cut for), and each attention rank says :class:`PlacementInUse`.
3. Once every live attention rank uses it, it is the run's placement; FFN ranks retire the old copies
   when no sender uses them any more. Lost FFN ranks whose replacement waited for the move are replaced.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

from afd.distributed.placement import ExpertPlacement
from afd.runtime.launcher import Launcher, RankHandle
from afd.runtime.messages import InstallPlacement

log = logging.getLogger(__name__)


class RebalanceRefused(RuntimeError):
    """A rebalance cannot start now (one in progress, a rank starting, a single FFN rank, ...): says why."""


@dataclass(frozen=True)
class Decision:
    """What a rebalance decided: the load's max/mean under the placement in use and under the new one."""

    version: int
    before: float
    after: float
    placement: str
    changed: bool

    def as_dict(self) -> dict:
        return {"version": self.version, "before": self.before, "after": self.after, "placement": self.placement,
                "changed": self.changed}


@dataclass(frozen=True)
class Move:
    """A rebalance done: its decision and how long the move took."""

    decision: Decision
    seconds: float
    at: float = field(default_factory=time.time)


@dataclass
class _InProgress:
    decision: Decision
    new: ExpertPlacement
    started: float
    ready: set = field(default_factory=set)  # FFN ranks that hold the new copies
    in_use: set = field(default_factory=set)  # attention ranks that dispatch under it
    sent: bool = False  # the attention ranks were told

    @property
    def version(self) -> int:
        return self.decision.version


def imbalance(placement: ExpertPlacement, load: Sequence[float]) -> float:
    """Max over mean of the FFN ranks' expected load under ``placement`` (1.0: balanced)."""
    ranks = placement.rank_load(load, len(placement.ranks))
    mean = sum(ranks) / len(ranks)
    return max(ranks) / mean if mean else 1.0


class Rebalancer:
    def __init__(self, launcher: Launcher, supervisor) -> None:
        self.launcher, self.supervisor = launcher, supervisor
        self.current: _InProgress | None = None
        self.moves: list[Move] = []
        self.deferred: list[RankHandle] = []  # lost FFN ranks to replace once the move in progress is done

    def expert_load(self) -> list[float]:
        """Tokens routed to each logical expert so far, summed over layers and FFN ranks (their latest counters)."""
        load = [0.0] * self.launcher.placement.num_experts
        for r in self.launcher.ffn_ranks():
            if r.live_stats is not None:
                for (_, e), n in r.live_stats.get("expert_tokens", {}).items():
                    load[e] += n
        return load

    def load_imbalance(self) -> float:
        """Max over mean of the FFN ranks' load under the placement in use, from the measured per-expert load
        (1.0: balanced, or nothing measured yet)."""
        load = self.expert_load()
        return imbalance(self.launcher.placement, load) if sum(load) else 1.0

    def start(self, load: Sequence[float] | None = None, min_gain: float = 0.0) -> Decision:
        """Decide a placement packed by ``load`` (default: the measured one) and start the move if it lowers the
        max/mean by more than ``min_gain``. Raises :class:`RebalanceRefused` when a move cannot start now."""
        launcher = self.launcher
        if self.current is not None:
            raise RebalanceRefused(f"a rebalance to placement version {self.current.version} is in progress")
        if any(not r.joined for r in launcher.ffn_ranks() if not r.lost):
            raise RebalanceRefused("a replacement FFN rank is starting: rebalance once it is back in use")
        if self.supervisor.restarting:
            raise RebalanceRefused(f"attention ranks {sorted(self.supervisor.restarting)} are restarting: rebalance once they are back")
        if launcher.topology.num_ffn_ranks < 2:
            raise RebalanceRefused("one FFN rank holds every expert: there is nothing to rebalance")
        if launcher.remote_ffn():
            raise RebalanceRefused("a rebalance needs every FFN rank started by this node's launcher; FFN ranks "
                                   f"{launcher.remote_ffn()} run on other nodes")
        load = list(self.expert_load() if load is None else load)
        new = ExpertPlacement.from_load(load, launcher.topology.num_ffn_ranks, launcher.placement.redundant)
        live = self.supervisor.live_ffn()
        if launcher.placement.orphans(live) or new.orphans(live):
            raise RebalanceRefused(f"a rebalance needs every expert on a live FFN rank (live: {live})")
        before, after = imbalance(launcher.placement, load), imbalance(new, load)
        changed = new != launcher.placement and before - after > min_gain  # else not worth a move
        decision = Decision(launcher.placement_version + 1, before, after, new.describe(), changed)
        if not changed:
            return decision
        self.current = _InProgress(decision, new, time.monotonic())
        for r in launcher.ffn_ranks():
            if not r.lost:
                r.send(InstallPlacement(decision.version, new))
        log.warning("run %s: rebalancing to placement version %d (load max/mean %.2f -> %.2f): %s", launcher.run_id, decision.version,
                    before, after, new.describe())
        return decision

    def on_ready(self, r: RankHandle, version: int) -> None:
        if self.current is not None and version == self.current.version:
            self.current.ready.add(r.spec.index)
            self.advance()

    def on_in_use(self, r: RankHandle, version: int) -> None:
        if self.current is not None and version == self.current.version:
            self.current.in_use.add(r.spec.index)
            self.advance()

    def advance(self) -> None:
        """Move on as far as the ranks let it (a lost rank is waited for no longer)."""
        move = self.current
        if move is None:
            return
        live_attention = self.supervisor.live_attention()
        if not move.sent and set(self.supervisor.live_ffn()) <= move.ready:
            move.sent = True
            for a in live_attention:
                a.send(InstallPlacement(move.version, move.new))
        if move.sent and {a.spec.index for a in live_attention} <= move.in_use:
            launcher = self.launcher
            launcher.placement, launcher.placement_version = move.new, move.version
            took = time.monotonic() - move.started
            self.moves.append(Move(move.decision, took))
            self.current = None
            log.warning("run %s: placement version %d in use on every rank after %.1f s", launcher.run_id, move.version, took)
            deferred, self.deferred = self.deferred, []
            for lost in deferred:
                self.supervisor.replace(lost)
