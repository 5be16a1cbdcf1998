"""Expert placement: which FFN ranks hold a physical copy of each logical expert, and which copy a row uses.

A placement maps every logical expert to one or more FFN ranks. With one copy per expert (the
default, contiguous blocks) an FFN failure stops the server; ``--redundant-experts N`` adds N copies
beyond the logical experts, so that a rank's experts survive on other ranks (afd/connectors/dispatch.py
re-dispatches the work a failed rank held).

**The copy a row uses** is a pure function of (logical expert, the row's key, the live FFN ranks):
the live copies of expert e, in ascending rank order, indexed by ``(key + e) mod n_live(e)``. The key
is the row's index in its sender's part plus the sender's attention rank, so the attention side
(which splits rows by copy) and the FFN side (which, with the gate there, routes and keeps its own
slots) compute the same choice without talking. Rows of one expert spread evenly over its copies.

:meth:`ExpertPlacement.from_load` packs copies from measured per-expert load (the hottest experts
get the extra copies, then copies go heaviest first to the least-loaded rank), as EPLB does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch


class TopologyError(ValueError):
    """A topology that cannot run (devices, transport, placement); raised before any process starts."""


@dataclass(frozen=True)
class ExpertPlacement:
    """Logical expert -> the FFN ranks holding a copy of it (ascending, no repeats)."""

    copies: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        for e, ranks in enumerate(self.copies):
            if not ranks:
                raise TopologyError(f"expert {e} has no copy: every expert needs an FFN rank")
            if list(ranks) != sorted(set(ranks)):
                raise TopologyError(f"expert {e}'s copies {list(ranks)} must be distinct FFN ranks, ascending")

    # ------------------------------------------------------------------ construction
    @classmethod
    def contiguous(cls, num_experts: int, num_ffn_ranks: int, redundant: int = 0) -> "ExpertPlacement":
        """The slot sequence ``0, 1, ..., E-1, 0, 1, ...`` (E + ``redundant`` slots: every expert once, then the
        extra copies in expert order) cut into F contiguous blocks of near-equal size (ceil first). Without
        redundancy: blocks of experts in order. A block holds at most ceil((E + N) / F) <= E slots and two
        copies of an expert are E slots apart, so no rank holds an expert twice."""
        if num_ffn_ranks > num_experts:
            raise TopologyError(
                f"{num_ffn_ranks} FFN ranks for {num_experts} experts: every FFN rank needs at least one expert; "
                f"use at most {num_experts} FFN ranks"
            )
        if redundant > num_experts * (num_ffn_ranks - 1):
            raise TopologyError(f"{redundant} redundant copies of {num_experts} experts over {num_ffn_ranks} FFN ranks: "
                                f"at most {num_experts * (num_ffn_ranks - 1)} (one copy of an expert per rank)")
        base, extra = divmod(num_experts + redundant, num_ffn_ranks)
        copies: list[list[int]] = [[] for _ in range(num_experts)]
        slot = 0
        for rank in range(num_ffn_ranks):
            for _ in range(base + (rank < extra)):
                copies[slot % num_experts].append(rank)
                slot += 1
        return cls(tuple(tuple(sorted(c)) for c in copies))

    @classmethod
    def from_load(cls, load: Sequence[float], num_ffn_ranks: int, redundant: int = 0) -> "ExpertPlacement":
        """A placement balanced for measured per-expert ``load`` (tokens routed to each logical expert):
        each of the ``redundant`` extra copies goes to the expert with the most load per copy, then copies
        are packed heaviest first onto the rank with the least load so far (one copy of an expert per
        rank). Every rank gets at least one copy."""
        num_experts = len(load)
        if num_ffn_ranks > num_experts + redundant:
            raise TopologyError(f"{num_ffn_ranks} FFN ranks for {num_experts + redundant} expert copies: every FFN rank needs one")
        counts = [1] * num_experts
        for _ in range(redundant):
            e = max((e for e in range(num_experts) if counts[e] < num_ffn_ranks), key=lambda e: (load[e] / counts[e], -e), default=None)
            if e is None:
                raise TopologyError(f"{redundant} redundant copies of {num_experts} experts over {num_ffn_ranks} FFN ranks: "
                                     "an expert has at most one copy per rank")
            counts[e] += 1
        slots = sorted(((load[e] / counts[e], e) for e in range(num_experts) for _ in range(counts[e])), key=lambda s: (-s[0], s[1]))
        rank_load = [0.0] * num_ffn_ranks
        rank_slots = [0] * num_ffn_ranks
        copies: list[set[int]] = [set() for _ in range(num_experts)]
        for i, (per_copy, e) in enumerate(slots):
            left = len(slots) - i
            empty = [r for r in range(num_ffn_ranks) if rank_slots[r] == 0]
            pool = [r for r in (empty if len(empty) >= left else range(num_ffn_ranks)) if r not in copies[e]]
            r = min(pool, key=lambda r: (rank_load[r], rank_slots[r], r))
            copies[e].add(r)
            rank_load[r] += per_copy
            rank_slots[r] += 1
        return cls(tuple(tuple(sorted(c)) for c in copies))

    @classmethod
    def parse(cls, text: str, num_experts: int) -> "ExpertPlacement":
        """``"0-3:0,4-7:1"``: expert ranges to FFN ranks; an expert listed on several ranks has a copy on each
        (``"0-7:0,0-7:1"``: every expert on both)."""
        owner: dict[int, list[int]] = {}
        for part in text.split(","):
            ranges, sep, rank = part.partition(":")
            if not sep or not rank.strip().isdigit():
                raise TopologyError(f"bad placement entry {part!r}: use EXPERTS:RANK, e.g. 0-3:0")
            for r in ranges.split("+"):
                lo, _, hi = r.strip().partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise TopologyError(f"bad expert range {r!r} in placement")
                for e in range(int(lo), int(hi or lo) + 1):
                    ranks = owner.setdefault(e, [])
                    if int(rank) in ranks:
                        raise TopologyError(f"expert {e} placed twice on FFN rank {rank}")
                    ranks.append(int(rank))
        missing = sorted(set(range(num_experts)) - set(owner))
        extra = sorted(set(owner) - set(range(num_experts)))
        if missing:
            raise TopologyError(f"placement misses experts {missing}: every expert needs an FFN rank")
        if extra:
            raise TopologyError(f"placement names experts {extra} but the model has {num_experts}")
        return cls(tuple(tuple(sorted(owner[e])) for e in range(num_experts)))

    # ------------------------------------------------------------------ queries
    @property
    def num_experts(self) -> int:
        return len(self.copies)

    @property
    def num_slots(self) -> int:
        """Physical expert copies over all ranks (logical experts + redundant copies)."""
        return sum(len(c) for c in self.copies)

    @property
    def redundant(self) -> int:
        return self.num_slots - self.num_experts

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for c in self.copies for r in c}))

    @property
    def expert_to_rank(self) -> tuple[int, ...]:
        """Each expert's first copy (the whole placement when every expert has one copy)."""
        return tuple(c[0] for c in self.copies)

    def experts_of(self, rank: int) -> tuple[int, ...]:
        """The logical experts FFN rank ``rank`` holds a copy of: exactly the slots it loads."""
        return tuple(e for e, c in enumerate(self.copies) if rank in c)

    def single_copy(self) -> tuple[int, ...]:
        """Experts with one copy: lost with their rank."""
        return tuple(e for e, c in enumerate(self.copies) if len(c) == 1)

    def orphans(self, alive: Iterable[int]) -> tuple[int, ...]:
        """Experts with no copy on a rank in ``alive``."""
        live = set(alive)
        return tuple(e for e, c in enumerate(self.copies) if not live.intersection(c))

    def describe(self) -> str:
        return ",".join(f"{e}:{'+'.join(map(str, c))}" for e, c in enumerate(self.copies))

    def rank_load(self, load: Sequence[float], num_ffn_ranks: int) -> list[float]:
        """Expected load of each FFN rank when every expert's rows spread evenly over its copies."""
        out = [0.0] * num_ffn_ranks
        for e, c in enumerate(self.copies):
            for r in c:
                out[r] += load[e] / len(c)
        return out

    def copy_table(self, alive: Iterable[int], device: torch.device | str = "cpu") -> "CopyTable":
        return CopyTable.build(self, alive, device)


def alive_mask(alive: Iterable[int]) -> int:
    return sum(1 << r for r in set(alive))


def mask_ranks(mask: int) -> tuple[int, ...]:
    return tuple(r for r in range(mask.bit_length()) if mask >> r & 1)


@dataclass(frozen=True)
class CopyTable:
    """A placement restricted to the live FFN ranks, as tensors: ``ranks [E, C]`` (each expert's live copies,
    ascending, padded by repeating) and ``count [E]``. :meth:`owner` is the copy choice."""

    ranks: torch.Tensor
    count: torch.Tensor
    alive: int  # the live FFN ranks as a bitmask

    @classmethod
    def build(cls, placement: ExpertPlacement, alive: Iterable[int], device: torch.device | str = "cpu") -> "CopyTable":
        live = set(alive)
        orphans = placement.orphans(live)
        if orphans:
            lost = sorted({r for e in orphans for r in placement.copies[e]})
            raise TopologyError(f"experts {list(orphans)} have no surviving copy (their copies were on FFN ranks {lost}): "
                                 "no redundancy for them, so this FFN failure stops the server")
        rows = [[r for r in c if r in live] for c in placement.copies]
        width = max(len(r) for r in rows)
        padded = [r + [r[0]] * (width - len(r)) for r in rows]
        return cls(torch.tensor(padded, dtype=torch.long, device=device), torch.tensor([len(r) for r in rows], dtype=torch.long, device=device),
                   alive_mask(live))

    def owner(self, ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The FFN rank computing each selected slot: ``ids [T, k]`` logical experts (>= 0), ``keys [T]`` row keys."""
        ids = ids.long()
        if self.ranks.shape[1] == 1:  # one live copy each: no choice to make
            return self.ranks[ids, 0]
        choice = (keys.long().unsqueeze(1) + ids) % self.count[ids]
        return self.ranks[ids, choice]
