"""An FFN rank's book of work parts: each part checked, kept with the other parts of its union, until the
union of a (membership epoch, step, layer, micro-batch) is whole.

Every part is checked before it is kept: a known layer, operations that fit that layer, per attention
rank (step, layer, micro-batch) strictly increasing (the ping-pong schedule dispatches in that order),
a sender among the contributors, and the same epoch, contributors, operations and placement as the
union's other parts -- a mismatch is a protocol error naming both ranks, never a silently mispaired
tensor. Work re-dispatched after an FFN rank failed (``Op.RETRY``) is its sender's alone: a union of its
own, whole at once.

A lost attention rank sends no more parts, so every union waiting on it is whole without it (its rows
are independent of the others'); a restart of it contributes again from the epoch it was taken back in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from afd.config import ModelConfig
from afd.connectors.wire import Header, Op, ProtocolError
from afd.connectors.work import WorkItem
from afd.distributed.placement import mask_ranks

UnionKey = tuple[int, ...]  # (epoch, step, layer, micro-batch); a retry's own union: + (1 + its sender,)


@dataclass(slots=True)
class Union:
    """The parts of one (epoch, step, layer, micro-batch) received so far."""

    members: int  # contributor bitmask
    ops: Op
    parts: dict[int, WorkItem] = field(default_factory=dict)  # attention rank -> its part
    placement: int = 0  # the placement version every part was dispatched under

    def is_whole(self, lost: int = 0) -> bool:
        """Every contributor's part is here, but for those of the lost attention ranks (bitmask ``lost``)."""
        return all(a in self.parts for a in ranks_of(self.members & ~lost))


class Unions:
    """The parts one FFN rank (``name``, index ``index``) has received, by union."""

    def __init__(self, name: str, index: int, config: ModelConfig) -> None:
        self.name, self.index, self.config = name, index, config
        self.lost = 0  # bitmask of attention ranks that died (their parts never come)
        self.rejoined: dict[int, int] = {}  # attention rank -> the epoch its restart contributes from (older unions: without it)
        self.owed: dict[int, int] = {}  # attention rank -> parts received with rows, results not yet sent
        self.newest_seen: dict[int, int] = {}  # attention rank -> the newest placement version it sent work under
        self.retries = 0  # re-dispatched parts received (Op.RETRY)
        self.empty_parts = 0
        self.arrivals: deque = deque(maxlen=200_000)  # (attention rank, seq, layer, micro-batch) in arrival order
        self._last: dict[tuple[int, int], tuple[int, int, int]] = {}  # (attention rank, epoch) -> last (seq, layer, micro-batch)
        self._pending: dict[UnionKey, Union] = {}

    def check(self, h: Header) -> None:
        """A work header's fields, against the model and this sender's order; ProtocolError naming both ranks."""
        me, cfg = self.name, self.config
        if not 0 <= h.layer < cfg.num_layers:
            raise ProtocolError(f"{me}: work from {h.source} for layer {h.layer}, the model has {cfg.num_layers}")
        if (Op.DENSE in h.ops) == cfg.is_moe_layer(h.layer):
            kind = "an MoE" if cfg.is_moe_layer(h.layer) else "a dense"
            raise ProtocolError(f"{me}: work from {h.source} asks for ops {int(h.ops)} on layer {h.layer}, which is {kind} layer")
        if not h.members >> h.src_index & 1:
            raise ProtocolError(f"{me}: work from {h.source}, which is not among the step's contributors {ranks_of(h.members)}")
        if not h.ffn_members >> self.index & 1:
            raise ProtocolError(f"{me}: work from {h.source} dispatched to FFN ranks {mask_ranks(h.ffn_members)}, not to this one")
        key = (h.seq, h.layer, h.microbatch)
        last = self._last.get((h.src_index, h.epoch))
        if Op.RETRY in h.ops:  # a re-dispatch: alone, and of work already sent (the first attempt went to every live rank)
            if h.members != 1 << h.src_index:
                raise ProtocolError(f"{me}: re-dispatched work from {h.source} names contributors {ranks_of(h.members)}: a retry "
                                    "is its sender's alone")
            if last is None or key > last:
                raise ProtocolError(f"{me}: re-dispatched work from {h.source} for (seq {h.seq}, layer {h.layer}, micro-batch "
                                    f"{h.microbatch}), which it never dispatched (its last: {last})")
            return
        if last is not None and key <= last:
            raise ProtocolError(
                f"{me}: work from {h.source} out of order: (seq {h.seq}, layer {h.layer}, micro-batch {h.microbatch}) "
                f"after (seq {last[0]}, layer {last[1]}, micro-batch {last[2]}) in epoch {h.epoch}"
            )
        self._last[(h.src_index, h.epoch)] = key

    def add(self, item: WorkItem, versions) -> tuple[UnionKey, Union] | None:
        """Keep one checked part (``versions``: the placement versions this rank holds); the union's key and
        parts when this part made it whole."""
        h = item.header
        key = (h.epoch, h.seq, h.layer, h.microbatch)
        if h.placement not in versions:
            raise ProtocolError(f"{self.name}: work from {h.source} under expert placement version {h.placement}; this rank "
                                f"holds versions {sorted(versions)}")
        if h.placement > self.newest_seen.get(h.src_index, -1):
            self.newest_seen[h.src_index] = h.placement
        self.arrivals.append((h.src_index, h.seq, h.layer, h.microbatch))
        if Op.RETRY in h.ops:  # whole at once: its own union
            self.retries += 1
            self.owed[h.src_index] = self.owed.get(h.src_index, 0) + 1
            return (*key, 1 + h.src_index), Union(h.members, h.ops, {h.src_index: item}, h.placement)
        union = self._pending.get(key)
        if union is None:
            union = self._pending[key] = Union(h.members, h.ops, placement=h.placement)
        elif (union.members, union.ops, union.placement) != (h.members, h.ops, h.placement):
            raise ProtocolError(
                f"{self.name}: work from {h.source} for (epoch {h.epoch}, seq {h.seq}, layer {h.layer}, micro-batch "
                f"{h.microbatch}) names contributors {ranks_of(h.members)}, ops {int(h.ops)} and placement {h.placement}; other "
                f"parts said {ranks_of(union.members)}, {int(union.ops)} and {union.placement}"
            )
        union.parts[h.src_index] = item
        if h.num_tokens:
            self.owed[h.src_index] = self.owed.get(h.src_index, 0) + 1
        else:
            self.empty_parts += 1
        if union.is_whole(self.excused(h.epoch)):
            return key, self._pending.pop(key)
        return None

    def excused(self, epoch: int) -> int:
        """The attention ranks whose parts a union of ``epoch`` does not wait for (bitmask): the lost ones, and
        a restart taken back in a later epoch (the union named its lost predecessor)."""
        mask = self.lost
        for rank, since in self.rejoined.items():
            if epoch < since:
                mask |= 1 << rank
        return mask

    def lose(self, rank: int) -> list[tuple[UnionKey, Union]]:
        """Attention rank ``rank`` died: the unions that are whole without it, taken out of the book."""
        self.lost |= 1 << rank
        self.owed.pop(rank, None)
        whole = [(key, u) for key, u in self._pending.items() if u.is_whole(self.excused(key[0]))]
        for key, _ in whole:
            del self._pending[key]
        return whole

    def readmit(self, rank: int, epoch: int) -> None:
        """A restart of ``rank`` said HELLO: it contributes again from ``epoch``, its steps counted from the start."""
        self.lost &= ~(1 << rank)
        self.rejoined[rank] = epoch
        for key in [k for k in self._last if k[0] == rank]:
            del self._last[key]
        self.newest_seen.pop(rank, None)
        self.owed.pop(rank, None)


def ranks_of(mask: int) -> list[int]:
    return [a for a in range(mask.bit_length()) if mask >> a & 1]
