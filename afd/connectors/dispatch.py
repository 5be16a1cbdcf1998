"""The attention side of the connector: paired ``dispatch``/``combine``, and failover.

``dispatch`` ships one layer's FFN input to the FFN ranks that must see it and
returns a :class:`DispatchHandle`; ``combine`` takes that handle, receives
every expected partial result (checked against the handle: kind, source rank,
sequence, layer, micro-batch, row count, shapes) and adds them **in FFN-rank
order**, never in arrival order, so the sum is the same every run.

Which FFN ranks and placement it dispatches to, and how a replacement is linked without blocking a
step: afd/connectors/membership.py.

**Failover** (with redundant expert copies): an FFN rank that dies (its link closes) or hangs (silent
past the link timeout) while work is in flight is dropped from this rank's live set. Every in-flight
(step, layer, micro-batch) it held is sent again, whole, to the surviving copies, as a union of its
own marked ``Op.RETRY``; results of the abandoned attempt (their header names the FFN members they
were sent to) are dropped. The sum is over one attempt's results, so it is what a fault-free run
computes, up to the row grouping of the expert GEMMs.

The bytes on the wire per token and layer, for every placement: docs/connectors.md (checked against this
code's counters in tests/connectors/test_dispatch.py). Each row of FFN input costs, by ``--dispatch-dtype``
(afd/connectors/dispatch_dtype.py): ``model`` H x the compute dtype's bytes (4 H in fp32), ``bf16`` 2 H, ``int8``
and ``fp8`` H + 4 (a byte a value and an fp32 scale; tests/connectors/test_dispatch_dtype.py counts them). The
combine returns H x the compute dtype's bytes a row whatever the dispatch sent.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from afd.connectors.membership import FfnMembership
from afd.connectors.transport import ConnectorTimeout, Mailbox, PeerDiedError, PeerSilentError
from afd.connectors.wire import Header, Kind, Message, Op, ProtocolError, Role, TensorName, make_message
from afd.distributed.placement import ExpertPlacement, mask_ranks
from afd.distributed.topology import Topology
from afd.types import Routing

log = logging.getLogger(__name__)


class RemoteError(RuntimeError):
    """An FFN rank reported an error instead of a result."""


@dataclass(slots=True)
class DispatchHandle:
    """Joins a dispatch to its combine: what was sent where, for which (seq, layer, micro-batch), and what a
    re-dispatch needs (the inputs, by reference: a sent tensor is never modified)."""

    seq: int
    layer: int
    microbatch: int
    num_tokens: int
    rows: dict[int, torch.Tensor]  # FFN rank -> [n_r] row indices of the batch it received (non-empty parts)
    sent_at: float = 0.0  # time.perf_counter() of the dispatch
    ffn_members: int = 0  # the FFN ranks this attempt went to (results of another attempt are stale)
    ffn_input: torch.Tensor | None = None
    routing: Routing | None = None
    token_ids: torch.Tensor | None = None  # [T]: the rows' tokens, for a hash-routed layer's gate on the FFN side
    is_moe: bool = True
    epoch: int = 0
    members: int = 0
    placement: int = 0  # the placement version its copies were chosen under
    retries: int = 0  # times re-dispatched after an FFN rank failed
    ffn_busy_s: float = 0.0  # the longest an FFN rank answering it computed its union (RESULT headers' busy_us)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.seq, self.layer, self.microbatch)


@dataclass(frozen=True, slots=True)
class FFNLoss:
    """An FFN rank this attention rank stopped using: who, why, when, and the work it re-dispatched."""

    rank: int
    generation: int  # of its links: which incarnation of the rank was lost
    reason: str
    at: float  # time.monotonic()
    redispatched: int  # in-flight (seq, layer, micro-batch) units sent again to surviving copies
    hung: bool = False  # silent past the link timeout (else its link closed: it died)


class AttentionEndpoint:
    """``failover`` (default: when the placement has redundant copies): an FFN rank that dies or hangs is
    dropped -- its in-flight work is re-dispatched, whole and marked ``Op.RETRY``, to the surviving copies,
    and later work goes to them -- instead of failing the run. Without a surviving copy of every expert the
    error names the experts lost."""

    def __init__(self, mailbox: Mailbox, topology: Topology, placement: ExpertPlacement, timeout: float,
                 failover: bool | None = None, placement_version: int = 0, generations: dict[int, int] | None = None,
                 link_timeout: float | None = None) -> None:
        """``timeout``: the backstop of a combine's wait (liveness is the link timeout's, in the mailbox);
        ``link_timeout``: how long a replacement may take to answer HELLO (default ``timeout``).
        ``placement_version``, ``generations`` (FFN rank -> its links' generation): where a restarted
        attention rank starts (default: the run's start)."""
        self.mailbox = mailbox
        self.topology = topology
        self.rank = mailbox.index
        self.device = mailbox.device  # the rank's compute device: results arrive here
        self.members = FfnMembership(topology.num_ffn_ranks, placement, self.device, placement_version, generations)
        self.failover = placement.redundant > 0 if failover is None else failover
        self.timeout = timeout
        self.link_timeout = link_timeout or timeout
        # several dispatches may be in flight (async micro-batches): results are matched by key
        self._handles: dict[tuple[int, int, int], DispatchHandle] = {}
        self._stash: dict[tuple[int, int, int], dict[int, torch.Tensor]] = {}
        self._superseded: dict[tuple[int, int, int], set[int]] = {}  # key -> FFN-member masks of abandoned attempts
        self.round_trips = 0  # combines completed
        self.round_trip_s = 0.0  # their summed dispatch -> combine-complete time
        self.wait_s = 0.0  # of which this side was blocked in combine
        self.losses: list[FFNLoss] = []
        self.stale_results = 0  # results of abandoned attempts, dropped
        self.rows_sent: dict[int, int] = {}  # FFN rank -> rows sent to it (a retry's too): what it answers, once settled
        self.on_ffn_lost = None  # called with the FFNLoss (an attention rank tells its launcher)
        self.on_link = None  # called with (FFN rank, generation, error or None) when a replacement's link is up or given up

    # ------------------------------------------------------------------ membership
    def join(self, rank: int, generation: int) -> None:
        """Open the links to FFN rank ``rank``'s replacement (generation ``generation``) and say HELLO, without
        waiting: its answer is read between steps (:meth:`poll_links`) or in a combine, and ``on_link`` says
        when it came. It is used from the first step whose agreed ``ffn_ready`` names it (:meth:`admit`). A rank
        that had not noticed the loss yet (idle since) drops the lost one first, as every other rank did: the
        replacement must enter every sender's set at the same agreed step, or its unions would wait for parts."""
        if rank in self.members.alive:
            self._lose(PeerDiedError(f"{self.mailbox.name}: {self.mailbox.peer_name(rank)} was replaced", peer=rank))
        self.mailbox.reconnect(rank, generation, self.link_timeout)
        self.members.begin_join(rank, generation, self.link_timeout)
        self.mailbox.send(rank, make_message(Header(Kind.HELLO, Role.ATTENTION, self.rank, rank), {}))

    def poll_links(self) -> None:
        """Between steps: read what the links hold (a replacement's HELLO, heartbeats, stale results) without
        waiting, and give up replacements silent past the link timeout. Nothing is in flight here."""
        if not self.members.pending:
            return
        while self.members.pending:
            try:
                msg = self.mailbox.recv(0.0)
            except PeerDiedError as e:
                self._lose(e)
                continue
            if msg is None:
                break
            self._accept(msg, None)
        for link in self.members.expired():
            self.mailbox.forget(link.rank)
            if self.on_link is not None:
                self.on_link(link.rank, link.generation, f"no HELLO within {self.link_timeout:.0f} s")

    def _greeted(self, rank: int) -> None:
        link = self.members.greeted(rank)
        if link is None:
            return
        log.warning("%s: linked to the replacement of %s (generation %d)", self.mailbox.name, self.mailbox.peer_name(rank),
                    link.generation)
        if self.on_link is not None:
            self.on_link(rank, link.generation, None)

    @property
    def ready_mask(self) -> int:
        return self.members.ready_mask

    @property
    def ready_placement(self) -> int:
        return self.members.ready_placement

    def admit(self, ready: int) -> None:
        """Use the connected FFN ranks named in ``ready`` (the step's agreement) that are not in use yet."""
        new = self.members.admit(ready)
        if new:
            log.warning("%s: FFN ranks %s back in use: now %s", self.mailbox.name, new, self.members.alive)

    def install(self, version: int, placement: ExpertPlacement) -> None:
        """A rebalance: ``placement`` becomes usable as ``version`` (every FFN rank holds its copies already)."""
        self.members.install(version, placement)

    def use(self, version: int) -> bool:
        """Dispatch under placement ``version`` from now on (the step's agreement); True when it changed."""
        changed = self.members.use(version)
        if changed:
            log.warning("%s: expert placement version %d in use: %s", self.mailbox.name, version, self.members.placement.describe())
        return changed

    # ------------------------------------------------------------------ dispatch
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
        token_ids: torch.Tensor | None = None,
    ) -> DispatchHandle:
        """Send one (step, layer, micro-batch) part of ``ffn_input [T, H]`` (and, with the gate on
        attention, ``routing``) to **every** live FFN rank: each computes the union of every contributor's
        part, so one with no rows for a rank sends it an empty part (T may be 0). ``members`` is the
        bitmask of the step's contributors (default: this rank alone), ``epoch`` the membership epoch.

        Who computes what: routed experts where their chosen copy is (afd/distributed/placement.py; gate
        on attention: only the rows that chose them, with the ids of other ranks' slots set to -1; gate on
        FFN: every row to every rank, which routes and keeps its own slots); shared experts and dense
        layers placed on the FFN side are replicated on every FFN rank and split by rows, live rank i
        taking the i-th contiguous slice (``SHARED_ROWS`` marks it). ``token_ids`` [T]: sent with the gate on FFN for
        a hash-routed layer (DeepSeek-V4), kept for a retry."""
        key = (seq, layer, microbatch)
        if key in self._handles:
            raise ProtocolError(f"{self.mailbox.name}: dispatch of (seq {seq}, layer {layer}, micro-batch {microbatch}) twice")
        handle = DispatchHandle(seq, layer, microbatch, ffn_input.shape[0], {}, ffn_input=ffn_input, routing=routing, token_ids=token_ids, is_moe=is_moe,
                                epoch=epoch, members=members or 1 << self.rank, placement=self.members.placement_version)
        self._handles[key] = handle
        self._stash[key] = {}
        self._send(handle, retry=False)
        return handle

    def _send(self, handle: DispatchHandle, retry: bool) -> None:
        """Send one attempt. A first attempt goes to every live rank (empty parts complete the unions); a
        retry only to the ranks with rows, as a union of its own (contributors: this rank alone)."""
        plan = self.members.plan(self.topology, self.rank, handle.ffn_input, handle.routing, handle.is_moe, handle.token_ids)
        handle.rows = {r: rows for r, (rows, _, _) in plan.items() if len(rows)}  # results come back only for these
        handle.ffn_members = self.members.ffn_members
        handle.sent_at = time.perf_counter()
        members = 1 << self.rank if retry else handle.members
        lost: list[PeerDiedError] = []
        for r, (rows, ops, tensors) in plan.items():
            if retry and not len(rows):
                continue
            header = Header(Kind.WORK, Role.ATTENTION, self.rank, r, handle.layer, handle.microbatch, handle.seq, len(rows),
                            ops | Op.RETRY if retry else ops, (), epoch=handle.epoch, members=members, ffn_members=handle.ffn_members,
                            placement=handle.placement)
            try:
                self.mailbox.send(r, make_message(header, tensors))
                self.mailbox.expect(r)  # its silence counts from here, not from its last answer
                self.rows_sent[r] = self.rows_sent.get(r, 0) + len(rows)
            except PeerDiedError as e:  # keep sending: the other ranks' unions need this rank's part
                lost.append(e)
        for e in lost:
            self._lose(e)

    def _lose(self, error: PeerDiedError) -> None:
        """Stop using a dead or hung FFN rank and re-dispatch the in-flight work it held; re-raise without failover."""
        r = error.peer
        if r is None or not self.failover:
            raise error
        if r not in self.members.alive:  # gone before it was used (a replacement that died starting), or lost already
            if r in self.members.connected or r in self.members.pending:
                self.members.connected.discard(r)
                link = self.members.pending.pop(r, None)
                self.mailbox.forget(r)
                if link is not None and self.on_link is not None:
                    self.on_link(r, link.generation, str(error))
            return
        try:
            self.members.drop(r)
        except ValueError as e:
            raise PeerDiedError(f"{error}; {e}", peer=r) from None
        self.mailbox.forget(r)  # its link closing or its late messages are not news any more
        alive = self.members.alive
        redo = [h for h in self._handles.values() if r in h.rows and r not in self._stash[h.key]]
        loss = FFNLoss(r, self.members.generation.get(r, 0), str(error), time.monotonic(), len(redo), isinstance(error, PeerSilentError))
        self.losses.append(loss)
        log.warning("%s: lost %s (%s); re-dispatching %d in-flight units to FFN ranks %s", self.mailbox.name,
                    self.mailbox.peer_name(r), error, len(redo), alive)
        if self.on_ffn_lost is not None:
            self.on_ffn_lost(loss)
        for h in redo:
            if r not in h.rows:  # already re-sent by a nested loss
                continue
            self._superseded.setdefault(h.key, set()).add(h.ffn_members)
            if len(self._superseded) > 4096:
                del self._superseded[next(iter(self._superseded))]
            self._stash[h.key].clear()
            h.retries += 1
            self._send(h, retry=True)

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    @property
    def num_retried(self) -> int:
        return sum(loss.redispatched for loss in self.losses)

    def combine(self, handle: DispatchHandle, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Receive every partial result of ``handle``; return their sum [T, H], added in FFN-rank order.

        Results of other in-flight dispatches that arrive meanwhile are kept for their own combine. An FFN
        rank that dies, or sends nothing for the link timeout, while this waits: see ``failover``."""
        key = handle.key
        if self._handles.get(key) is not handle:
            raise ProtocolError(f"{self.mailbox.name}: combine of a handle that is not in flight: {key}")
        partial = self._stash[key]
        waited_from = time.perf_counter()
        deadline = time.monotonic() + self.timeout
        me = self.mailbox.name
        while len(partial) < len(handle.rows):
            left = deadline - time.monotonic()
            try:
                msg = self.mailbox.recv(min(left, 0.5)) if left > 0 else None
                if msg is None and left > 0:
                    # a rank we wait on that sends nothing, not even a heartbeat, is hung
                    self.mailbox.check_silence(peers=set(handle.rows) - set(partial))
                    continue
            except PeerDiedError as e:
                self._lose(e)
                deadline = time.monotonic() + self.timeout  # the re-dispatched attempt gets a wait of its own
                continue
            if msg is None:
                waiting = sorted(set(handle.rows) - set(partial))
                raise ConnectorTimeout(
                    f"{me}: no result from FFN ranks {waiting} for layer {handle.layer} seq {handle.seq} "
                    f"micro-batch {handle.microbatch} within {self.timeout:.0f} s"
                )
            self._accept(msg, hidden_size)
        del self._handles[key], self._stash[key]
        handle.ffn_input = handle.routing = handle.token_ids = None
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

    def _accept(self, msg: Message, hidden_size: int | None) -> None:
        """Check one incoming message against the dispatches in flight and stash its result (``hidden_size``
        None: nothing is in flight). A replacement's HELLO connects it."""
        h, me = msg.header, self.mailbox.name
        if h.kind == Kind.ERROR:
            text = bytes(msg.get(TensorName.TEXT).tolist()).decode(errors="replace")
            raise RemoteError(f"{me}: {h.source} failed: {text}")
        if h.kind == Kind.HEARTBEAT:
            return
        if h.kind == Kind.HELLO and h.src_index in self.members.pending:
            self._greeted(h.src_index)
            return
        if h.kind != Kind.RESULT:
            raise ProtocolError(f"{me}: unexpected {h.kind.name} from {h.source}")
        key = (h.seq, h.layer, h.microbatch)
        handle = self._handles.get(key)
        if h.ffn_members in self._superseded.get(key, ()) and (handle is None or h.ffn_members != handle.ffn_members):
            self.stale_results += 1  # the answer to an attempt re-dispatched since
            return
        if handle is None:
            raise ProtocolError(
                f"{me}: message from {h.source} does not pair: (seq {h.seq}, layer {h.layer}, micro-batch {h.microbatch}) "
                f"matches no dispatch in flight {sorted(self._handles)}"
            )
        r = h.src_index
        if r not in handle.rows or r in self._stash[key] or h.ffn_members != handle.ffn_members:
            raise ProtocolError(f"{me}: unexpected result from {h.source} for layer {h.layer} seq {h.seq} "
                                f"(FFN members {mask_ranks(h.ffn_members)}, dispatched to {mask_ranks(handle.ffn_members)})")
        rows = handle.rows[r]
        out = msg.get(TensorName.OUTPUT)
        if h.num_tokens != len(rows) or tuple(out.shape) != (len(rows), hidden_size or out.shape[-1]):
            raise ProtocolError(
                f"{me}: result from {h.source} has {h.num_tokens} rows of shape {list(out.shape)}, "
                f"expected {len(rows)} x {hidden_size}"
            )
        self._stash[key][r] = out
        handle.ffn_busy_s = max(handle.ffn_busy_s, h.busy_us * 1e-6)

    def handshake(self, epoch: int = 0) -> None:
        """HELLO to every FFN rank and HELLO back from each: the protocol version is checked on both sides
        (Header.unpack refuses another version, naming the sender) before any work is sent. A restart that
        rejoins the step agreement says the epoch it steps from (the FFN ranks count it in unions from there)."""
        for r in self.members.alive:
            self.mailbox.send(r, make_message(Header(Kind.HELLO, Role.ATTENTION, self.rank, r, epoch=epoch), {}))
        waiting = set(self.members.alive)
        deadline = time.monotonic() + self.timeout
        while waiting:
            left = deadline - time.monotonic()
            msg = self.mailbox.recv(left) if left > 0 else None
            if msg is None:
                raise ConnectorTimeout(f"{self.mailbox.name}: no HELLO from FFN ranks {sorted(waiting)} within {self.timeout:.0f} s")
            msg.header.expect(self.mailbox.name, kind=Kind.HELLO)
            waiting.discard(msg.header.src_index)

    def shutdown(self) -> None:
        """SHUTDOWN on every open link (a replacement still greeting included): the last message on each."""
        for r in sorted(self.members.connected | set(self.members.pending)):
            try:
                self.mailbox.send(r, make_message(Header(Kind.SHUTDOWN, Role.ATTENTION, self.rank, r), {}))
            except PeerDiedError:  # gone meanwhile: nothing to tell it
                pass


