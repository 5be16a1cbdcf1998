"""Which FFN ranks one attention rank dispatches to, what each gets, and under which expert placement.

* ``alive``: the FFN ranks in use. A lost one leaves at once (each attention rank on its own: the
  unions on the survivors do not depend on who else is alive); a replacement enters only at an agreed
  step (:meth:`FfnMembership.admit` with the step's ``ffn_ready``), so that every contributor sends it
  parts from the same step on.
* ``connected``: FFN ranks with links open and greeted, as a step vote carries them (``ready_mask``).
* Linking to a replacement never blocks a step: :meth:`begin_join` opens the links and says HELLO, the
  replacement's HELLO is read between steps (or in a combine), and a link that does not answer within the
  link timeout is given up. An attention rank that waited for that HELLO inside its step loop could hold
  the other attention ranks' next step, while the replacement waited for that very rank to open its end
  of the link: a stall of minutes (the flaky ``ffn-hang`` test of the serving suite).
* Placements: a rebalance installs a new version (:meth:`install`); it is used from the first step every
  vote has it (:meth:`use`), and older versions are dropped then.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from afd.connectors.dispatch_dtype import QuantizedRows, encode
from afd.connectors.wire import Op, TensorName
from afd.distributed.placement import CopyTable, ExpertPlacement, alive_mask
from afd.distributed.topology import Topology
from afd.types import Routing

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingLink:
    """A replacement FFN rank this attention rank has said HELLO to, and waits to hear from."""

    rank: int
    generation: int
    deadline: float  # time.monotonic() after which the link is given up


class FfnMembership:
    def __init__(self, num_ffn: int, placement: ExpertPlacement, device: torch.device, placement_version: int = 0,
                 generations: dict[int, int] | None = None) -> None:
        self.device = device
        self.alive = list(range(num_ffn))  # FFN ranks in use, ascending
        self.connected = set(self.alive)  # FFN ranks with open, greeted links (a replacement: before it is admitted)
        self.generation = {r: (generations or {}).get(r, 0) for r in self.alive}  # FFN rank -> its links' generation
        self.pending: dict[int, PendingLink] = {}  # replacements greeted, not yet answered
        self.joins: list[tuple[int, float]] = []  # (FFN rank, time.monotonic()) of every replacement admitted
        self.placement = placement
        self.placement_version = placement_version
        self._placements = {placement_version: placement}  # installed, not yet superseded (a rebalance in progress: two)
        self.table: CopyTable = placement.copy_table(self.alive, device)

    @property
    def ffn_members(self) -> int:
        """The FFN ranks in use, as the bitmask a work header carries."""
        return alive_mask(self.alive)

    @property
    def ready_mask(self) -> int:
        """The FFN ranks this rank could use (links open and greeted), as a step vote carries them."""
        return alive_mask(self.connected)

    @property
    def ready_placement(self) -> int:
        """The newest placement version installed here (a step vote carries it; the agreed one is the lowest)."""
        return max(self._placements)

    # ------------------------------------------------------------------ losses and replacements
    def drop(self, rank: int) -> None:
        """Stop using ``rank``. Raises ValueError (naming the experts) if some expert has no copy left."""
        alive = [a for a in self.alive if a != rank]
        self.table = self.placement.copy_table(alive, self.device)
        self.alive = alive
        self.connected.discard(rank)
        self.pending.pop(rank, None)

    def begin_join(self, rank: int, generation: int, timeout: float) -> None:
        """The links to ``rank``'s replacement are open and HELLO is sent: wait for its answer (:meth:`greeted`)."""
        self.connected.discard(rank)
        self.pending[rank] = PendingLink(rank, generation, time.monotonic() + timeout)

    def greeted(self, rank: int) -> PendingLink | None:
        """``rank`` said HELLO: a pending replacement is connected now (returned); else None."""
        link = self.pending.pop(rank, None)
        if link is not None:
            self.connected.add(rank)
            self.generation[rank] = link.generation
        return link

    def expired(self) -> list[PendingLink]:
        """The pending links past their deadline, given up."""
        now = time.monotonic()
        late = [link for link in self.pending.values() if now > link.deadline]
        for link in late:
            del self.pending[link.rank]
        return late

    def admit(self, ready: int) -> list[int]:
        """Use the connected FFN ranks named in ``ready`` (the step's agreement) that are not in use yet."""
        new = sorted(r for r in self.connected if ready >> r & 1 and r not in self.alive)
        if new:
            self.alive = sorted([*self.alive, *new])
            self.table = self.placement.copy_table(self.alive, self.device)
            now = time.monotonic()
            self.joins += [(r, now) for r in new]
        return new

    def plan(self, t: Topology, rank: int, ffn_input: torch.Tensor, routing: Routing | None,
             is_moe: bool, token_ids: torch.Tensor | None = None) -> dict[int, tuple[torch.Tensor, Op, dict[TensorName, torch.Tensor]]]:
        """What each live FFN rank gets of attention rank ``rank``'s ``ffn_input [T, H]`` (one attempt): FFN rank
        -> (rows [n] of the batch, ops, tensors). Routed experts go where their chosen copy is (gate on
        attention: only the rows that chose them, the ids of other ranks' slots set to -1; gate on FFN: every
        row to every rank, which routes and keeps its own slots); shared experts and dense layers placed on
        the FFN side are split by rows, live rank i taking the i-th contiguous slice. ``token_ids`` [T]: the rows'
        tokens, sent with the gate on FFN for a hash-routed layer (its router reads them)."""
        alive = self.alive
        num_ffn = len(alive)
        num_tokens = ffn_input.shape[0]
        all_rows = torch.arange(num_tokens, device=ffn_input.device)
        shared = is_moe and t.shared_experts_on == "ffn"
        bounds = [num_tokens * i // num_ffn for i in range(num_ffn + 1)]  # row slice i: [bounds[i], bounds[i+1])
        in_slice = torch.zeros(num_tokens, dtype=torch.bool, device=ffn_input.device)
        plan: dict[int, tuple[torch.Tensor, Op, dict[TensorName, torch.Tensor]]] = {}
        sent = encode(ffn_input, t.dispatch_dtype)

        def hidden(rows: torch.Tensor | None) -> dict[TensorName, torch.Tensor]:  # the rows as --dispatch-dtype sends them
            if isinstance(sent, QuantizedRows):
                return {TensorName.HIDDEN: sent.values if rows is None else sent.values[rows],
                        TensorName.HIDDEN_SCALES: sent.scales if rows is None else sent.scales[rows]}
            return {TensorName.HIDDEN: sent if rows is None else sent[rows]}

        if not is_moe:  # a dense layer placed on the FFN side
            for i, r in enumerate(alive):
                rows = all_rows[bounds[i] : bounds[i + 1]]
                plan[r] = (rows, Op.DENSE, hidden(rows if num_ffn > 1 else None))
            return plan
        # [T, k] FFN rank computing each selected slot; with one FFN rank it computes them all (no lookup)
        owner = None
        if routing is not None and num_ffn > 1:
            owner = self.table.owner(routing.topk_ids, all_rows + rank)
        for i, r in enumerate(alive):
            mask = in_slice
            if shared:
                mask = in_slice.clone()
                mask[bounds[i] : bounds[i + 1]] = True
            tensors: dict[TensorName, torch.Tensor] = {}
            if t.gate == "ffn":
                rows, ops = all_rows, Op.ROUTE | Op.ROUTED
                if token_ids is not None:
                    tensors[TensorName.TOKEN_IDS] = token_ids.to(torch.int32)
            else:
                ids = routing.topk_ids
                if owner is None:
                    rows = all_rows
                else:
                    mine = owner == r  # [T, k]
                    rows = (mine.any(dim=1) | mask).nonzero().flatten()
                    ids = torch.where(mine, ids, -1)
                whole = len(rows) == num_tokens  # the whole batch, in order: sent as it is, no gathers
                tensors[TensorName.EXPERT_IDS] = (ids if whole else ids[rows]).to(torch.int32)
                tensors[TensorName.WEIGHTS] = (routing.topk_weights if whole else routing.topk_weights[rows]).float()
                ops = Op.ROUTED
            whole = len(rows) == num_tokens
            tensors.update(hidden(None if whole else rows))
            if shared:
                tensors[TensorName.SHARED_ROWS] = (mask if whole else mask[rows]).to(torch.uint8)
                ops |= Op.SHARED
            plan[r] = (rows, ops, tensors)
        return plan

    # ------------------------------------------------------------------ placements
    def install(self, version: int, placement: ExpertPlacement) -> None:
        """A rebalance: ``placement`` becomes usable as ``version`` (every FFN rank holds its copies already)."""
        if version <= self.placement_version:
            raise ValueError(f"placement version {version} is not newer than the one in use ({self.placement_version})")
        placement.copy_table(self.alive)  # its experts must be servable by the live ranks
        self._placements[version] = placement

    def use(self, version: int) -> bool:
        """Dispatch under placement ``version`` from now on (the step's agreement); True when it changed."""
        if version == self.placement_version or version < 0:
            return False
        placement = self._placements[version]
        self.placement, self.placement_version = placement, version
        self.table = placement.copy_table(self.alive, self.device)
        for old in [v for v in self._placements if v < version]:
            del self._placements[old]
        return True
