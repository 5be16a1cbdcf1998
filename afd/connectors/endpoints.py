"""Connector endpoints: the attention side's paired ``dispatch``/``combine``, the FFN side's work loop I/O.

``dispatch`` ships one layer's FFN input to the FFN ranks that must see it and
returns a :class:`DispatchHandle`; ``combine`` takes that handle, receives
every expected partial result (checked against the handle: kind, source rank,
sequence, layer, micro-batch, row count, shapes) and adds them **in FFN-rank
order**, never in arrival order, so the sum is the same every run.

Bytes per token per MoE layer (wire dtype b bytes, hidden H, top-k k, F FFN ranks):

* gate on attention: for each FFN rank r owning >= 1 of the token's experts,
  dispatch ``H*b + 8k`` (hidden, int32 ids, fp32 weights) and combine ``H*b``;
  so ``sum over tokens of n_t * (2*H*b + 8k)`` with n_t = ranks the token reaches;
* gate on FFN: every token to every rank: ``F * 2*H*b``;
* shared experts on the FFN side (replicated on every FFN rank, split by rows):
  each token also goes to the rank of its row slice (``2*H*b + 8k`` when not
  otherwise routed there), plus one byte per row sent;
* dense layer on the FFN side: ``2*H*b`` per token, to the rank of its row slice.

Plus one header per message (50 bytes + 3 per tensor + 4 per dimension), and
one empty part per FFN rank that gets no row of a (step, layer, micro-batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from afd.connectors.protocol import Header, Kind, Message, Op, ProtocolError, Role, TensorName, make_message
from afd.connectors.transport import ConnectorTimeout, Mailbox
from afd.distributed.topology import ExpertPlacement, Topology
from afd.types import Routing


class RemoteError(RuntimeError):
    """An FFN rank reported an error instead of a result."""


@dataclass(frozen=True, slots=True)
class DispatchHandle:
    """Joins a dispatch to its combine: what was sent where, for which (seq, layer, micro-batch)."""

    seq: int
    layer: int
    microbatch: int
    num_tokens: int
    rows: dict[int, torch.Tensor]  # FFN rank -> [n_r] row indices of the batch it received
    sent_at: float = 0.0  # time.perf_counter() of the dispatch


class AttentionEndpoint:
    def __init__(self, mailbox: Mailbox, topology: Topology, placement: ExpertPlacement, timeout: float = 60.0) -> None:
        self.mailbox = mailbox
        self.topology = topology
        self.rank = mailbox.index
        self.device = mailbox.device  # the rank's compute device: results arrive here
        self.owner = torch.tensor(placement.expert_to_rank, dtype=torch.long, device=self.device)  # [E] expert -> FFN rank
        self.timeout = timeout
        # several dispatches may be in flight (async micro-batches): results are matched by key
        self._handles: dict[tuple[int, int, int], DispatchHandle] = {}
        self._stash: dict[tuple[int, int, int], dict[int, torch.Tensor]] = {}
        self.round_trips = 0  # combines completed
        self.round_trip_s = 0.0  # their summed dispatch -> combine-complete time
        self.wait_s = 0.0  # of which this side was blocked in combine

    def dispatch(
        self,
        layer: int,
        seq: int,
        ffn_input: torch.Tensor,
        routing: Routing | None,
        is_moe: bool,
        microbatch: int = 0,
        epoch: int = 0,
        members: int = 0,
    ) -> DispatchHandle:
        """Send one (step, layer, micro-batch) part of ``ffn_input [T, H]`` (and, with the gate on
        attention, ``routing``) to **every** FFN rank: each computes the union of every contributor's
        part, so one with no rows for a rank sends it an empty part (T may be 0). ``members`` is the
        bitmask of the step's contributors (default: this rank alone), ``epoch`` the membership epoch.

        Who computes what: routed experts where they are placed (gate on attention: only the rows that
        chose them, with the ids of other ranks' experts set to -1; gate on FFN: every row to every rank,
        which routes); shared experts and dense layers placed on the FFN side are replicated on every
        FFN rank and split by rows, rank r taking the r-th contiguous slice (``SHARED_ROWS`` marks it)."""
        t = self.topology
        num_ffn = t.num_ffn_ranks
        num_tokens = ffn_input.shape[0]
        all_rows = torch.arange(num_tokens, device=ffn_input.device)
        shared = is_moe and t.shared_experts_on == "ffn"
        bounds = [num_tokens * r // num_ffn for r in range(num_ffn + 1)]  # row slice r: [bounds[r], bounds[r+1])
        in_slice = torch.zeros(num_tokens, dtype=torch.bool, device=ffn_input.device)
        plan: dict[int, tuple[torch.Tensor, Op, dict[TensorName, torch.Tensor]]] = {}
        if not is_moe:  # a dense layer placed on the FFN side
            for r in range(num_ffn):
                rows = all_rows[bounds[r] : bounds[r + 1]]
                plan[r] = (rows, Op.DENSE, {TensorName.HIDDEN: ffn_input[rows] if num_ffn > 1 else ffn_input})
        else:
            # [T, k] FFN rank of each selected expert; with one FFN rank it owns them all (no lookup)
            owner = self.owner[routing.topk_ids] if routing is not None and num_ffn > 1 else None
            for r in range(num_ffn):
                mask = in_slice
                if shared:
                    mask = in_slice.clone()
                    mask[bounds[r] : bounds[r + 1]] = True
                tensors: dict[TensorName, torch.Tensor] = {}
                if t.gate == "ffn":
                    rows, ops = all_rows, Op.ROUTE | Op.ROUTED
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
                tensors[TensorName.HIDDEN] = ffn_input if whole else ffn_input[rows]
                if shared:
                    tensors[TensorName.SHARED_ROWS] = (mask if whole else mask[rows]).to(torch.uint8)
                    ops |= Op.SHARED
                plan[r] = (rows, ops, tensors)
        # results come back only for non-empty parts
        handle = DispatchHandle(seq, layer, microbatch, num_tokens, {r: rows for r, (rows, _, _) in plan.items() if len(rows)},
                                time.perf_counter())
        key = (seq, layer, microbatch)
        if key in self._handles:
            raise ProtocolError(f"{self.mailbox.name}: dispatch of (seq {seq}, layer {layer}, micro-batch {microbatch}) twice")
        self._handles[key] = handle
        self._stash[key] = {}
        members = members or 1 << self.rank
        for r, (rows, ops, tensors) in plan.items():
            header = Header(Kind.WORK, Role.ATTENTION, self.rank, r, layer, microbatch, seq, len(rows), ops, (),
                            epoch=epoch, members=members)
            self.mailbox.send(r, make_message(header, tensors))
        return handle

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    def combine(self, handle: DispatchHandle, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Receive every partial result of ``handle``; return their sum [T, H], added in FFN-rank order.

        Results of other in-flight dispatches that arrive meanwhile are kept for their own combine.
        """
        key = (handle.seq, handle.layer, handle.microbatch)
        if self._handles.get(key) is not handle:
            raise ProtocolError(f"{self.mailbox.name}: combine of a handle that is not in flight: {key}")
        partial = self._stash[key]
        waited_from = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        me = self.mailbox.name
        while len(partial) < len(handle.rows):
            left = deadline - time.monotonic()
            msg = self.mailbox.recv(min(left, 0.5)) if left > 0 else None
            if msg is None and left > 0:
                # a rank we wait on that sends nothing, not even a heartbeat, is hung
                self.mailbox.check_silence(peers=set(handle.rows) - set(partial))
                continue
            if msg is None:
                waiting = sorted(set(handle.rows) - set(partial))
                raise ConnectorTimeout(
                    f"{me}: no result from FFN ranks {waiting} for layer {handle.layer} seq {handle.seq} "
                    f"micro-batch {handle.microbatch} within {self.timeout:.0f} s"
                )
            self._accept(msg, hidden_size)
        del self._handles[key], self._stash[key]
        done = time.perf_counter()
        self.round_trips += 1
        self.round_trip_s += done - handle.sent_at
        self.wait_s += done - waited_from
        if len(partial) == 1 and len(next(iter(handle.rows.values()))) == handle.num_tokens:
            return next(iter(partial.values())).to(dtype)  # one rank had every row, in order: nothing to add
        if not partial and handle.num_tokens:
            raise ProtocolError(f"{me}: (seq {handle.seq}, layer {handle.layer}) sent {handle.num_tokens} rows to no FFN rank")
        total = torch.zeros(handle.num_tokens, hidden_size, dtype=dtype, device=self.device)
        for r in sorted(partial):  # fixed rank order, never arrival order
            total.index_add_(0, handle.rows[r], partial[r].to(dtype))
        return total

    def _accept(self, msg: Message, hidden_size: int) -> None:
        """Check one incoming message against the dispatches in flight and stash its result."""
        h, me = msg.header, self.mailbox.name
        if h.kind == Kind.ERROR:
            text = bytes(msg.get(TensorName.TEXT).tolist()).decode(errors="replace")
            raise RemoteError(f"{me}: {h.source} failed: {text}")
        if h.kind == Kind.HEARTBEAT:
            return
        if h.kind != Kind.RESULT:
            raise ProtocolError(f"{me}: unexpected {h.kind.name} from {h.source}")
        key = (h.seq, h.layer, h.microbatch)
        handle = self._handles.get(key)
        if handle is None:
            raise ProtocolError(
                f"{me}: message from {h.source} does not pair: (seq {h.seq}, layer {h.layer}, micro-batch {h.microbatch}) "
                f"matches no dispatch in flight {sorted(self._handles)}"
            )
        r = h.src_index
        if r not in handle.rows or r in self._stash[key]:
            raise ProtocolError(f"{me}: unexpected result from {h.source} for layer {h.layer} seq {h.seq}")
        rows = handle.rows[r]
        out = msg.get(TensorName.OUTPUT)
        if h.num_tokens != len(rows) or tuple(out.shape) != (len(rows), hidden_size):
            raise ProtocolError(
                f"{me}: result from {h.source} has {h.num_tokens} rows of shape {list(out.shape)}, "
                f"expected {len(rows)} x {hidden_size}"
            )
        self._stash[key][r] = out

    def handshake(self) -> None:
        """HELLO to every FFN rank and HELLO back from each: the protocol version is checked on both sides
        (Header.unpack refuses another version, naming the sender) before any work is sent."""
        for r in range(self.topology.num_ffn_ranks):
            self.mailbox.send(r, make_message(Header(Kind.HELLO, Role.ATTENTION, self.rank, r), {}))
        waiting = set(range(self.topology.num_ffn_ranks))
        deadline = time.monotonic() + self.timeout
        while waiting:
            left = deadline - time.monotonic()
            msg = self.mailbox.recv(left) if left > 0 else None
            if msg is None:
                raise ConnectorTimeout(f"{self.mailbox.name}: no HELLO from FFN ranks {sorted(waiting)} within {self.timeout:.0f} s")
            msg.header.expect(self.mailbox.name, kind=Kind.HELLO)
            waiting.discard(msg.header.src_index)

    def shutdown(self) -> None:
        for r in range(self.topology.num_ffn_ranks):
            self.mailbox.send(r, make_message(Header(Kind.SHUTDOWN, Role.ATTENTION, self.rank, r), {}))


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One contributor's part of a (step, layer, micro-batch) union (``n`` may be 0)."""

    header: Header
    hidden: torch.Tensor  # [n, H]
    routing: Routing | None  # ids [n, k] (-1: not for this rank), weights [n, k]
    shared_rows: torch.Tensor | None  # [n] bool: rows whose shared experts this rank computes
    received_at: float = 0.0  # time.perf_counter() when it arrived (straggler wait)


def parse_work(msg: Message, receiver: str) -> WorkItem:
    h = msg.header
    hidden = msg.get(TensorName.HIDDEN)
    if hidden.dim() != 2 or hidden.shape[0] != h.num_tokens:
        raise ProtocolError(f"{receiver}: work from {h.source} declares {h.num_tokens} tokens, hidden is {list(hidden.shape)}")
    routing = None
    if Op.ROUTED in h.ops and Op.ROUTE not in h.ops:
        ids, weights = msg.get(TensorName.EXPERT_IDS), msg.get(TensorName.WEIGHTS)
        if ids.shape != weights.shape or ids.shape[0] != h.num_tokens:
            raise ProtocolError(f"{receiver}: work from {h.source}: ids {list(ids.shape)} / weights {list(weights.shape)} for {h.num_tokens} tokens")
        routing = Routing(ids.long(), weights)
    shared = None
    if Op.SHARED in h.ops:
        shared = msg.get(TensorName.SHARED_ROWS)
        if tuple(shared.shape) != (h.num_tokens,):
            raise ProtocolError(f"{receiver}: work from {h.source}: shared rows {list(shared.shape)} for {h.num_tokens} tokens")
        shared = shared.bool()
    return WorkItem(h, hidden, routing, shared, time.perf_counter())


def result_message(work: Header, ffn_rank: int, output: torch.Tensor) -> Message:
    header = Header(Kind.RESULT, Role.FFN, ffn_rank, work.src_index, work.layer, work.microbatch, work.seq, output.shape[0], work.ops,
                    (), epoch=work.epoch, members=work.members)
    return make_message(header, {TensorName.OUTPUT: output})


def error_message(ffn_rank: int, dst: int, text: str) -> Message:
    data = torch.tensor(list(text.encode()[:4000]), dtype=torch.uint8)
    return make_message(Header(Kind.ERROR, Role.FFN, ffn_rank, dst, num_tokens=len(data)), {TensorName.TEXT: data})
