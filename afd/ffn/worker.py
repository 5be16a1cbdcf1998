"""The FFN worker loop: receive work parts, compute each (step, layer, micro-batch) union once, send results.

Work is aggregated: the attention ranks agree on each step (afd/attention/steps.py), and every
contributor of a (step, micro-batch) sends this rank a part for each layer -- empty when it has no
rows for it -- with the membership epoch and the contributor bitmask in the header. When a union
holds a part from every contributor it is computed once: the non-empty parts concatenated in
attention-rank order (never arrival order, so the result is the same every run), one grouped GEMM pair
per expert over all their rows; each sender gets its own rows back, under its own header. A union is
never merged with another micro-batch or layer and never waits on a timer: it is computed the moment
it is whole. Messages already waiting are drained (``recv(0.0)``) before computing, so every union
they complete is computed in that round.

Work re-dispatched after an FFN rank failed (``Op.RETRY``) is its sender's alone: it is computed as soon
as it arrives, never merged. With redundant expert copies and the gate here, this rank keeps only the
slots whose chosen copy is its own (afd/distributed/placement.py), under the FFN members each part names.

The parts are checked and kept in afd/ffn/unions.py.

Counters: unions computed (``batches``), non-empty parts per union, expert GEMMs and their rows, the
straggler wait (first part to last part of a union), and busy time both as CPU time of the computing
thread (what the work costs) and as wall time (which also grows when processes outnumber cores).
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque

import torch

from afd.connectors.dispatch_dtype import QuantizedRows
from afd.connectors.transport import Mailbox, PeerDiedError, PeerSilentError
from afd.connectors.wire import Header, Kind, Op, ProtocolError, Role, make_message, result_header
from afd.connectors.work import WorkItem, error_message, parse_work
from afd.distributed.placement import CopyTable, ExpertPlacement, mask_ranks
from afd.ffn.unions import Union, Unions
from afd.models.base import MoEModel
from afd.models.layers import experts_dtype
from afd.types import Routing

log = logging.getLogger(__name__)

SILENCE_CHECK_S = 0.25  # while busy, the attention ranks' silence is checked at most this often


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts' rows in one tensor (a union of one part: that part, not a copy)."""
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class FFNWorker:
    def __init__(self, model: MoEModel, mailbox: Mailbox, num_attention_ranks: int, poll_interval: float = 1.0,
                 placement: ExpertPlacement | None = None, placement_version: int = 0, relink_timeout: float = 30.0) -> None:
        """``relink_timeout``: how long a restarted attention rank's links may take to open (a rank passes its
        hang timeout; the restart opened its ends before it said it was loaded)."""
        self.model = model  # the newest placement version's experts
        self.dtype = experts_dtype(model)  # what rows sent in another dtype (--dispatch-dtype) are computed in
        self.placement = placement  # with redundant copies: the gate's slots this rank keeps depend on it
        self.placement_version = placement_version
        # placement version -> (its experts, the placement): during a rebalance two, until every sender uses the new one
        self.versions: dict[int, tuple[MoEModel, ExpertPlacement | None]] = {placement_version: (model, placement)}
        self._offered: queue.Queue = queue.Queue()  # (version, model, placement) loaded by another thread, installed between rounds
        self.on_installed = None  # called with the version once its experts are usable here
        self._retired_counts: dict[tuple[int, int], int] = {}  # per-expert tokens of the experts of retired versions
        self._retired_gemms = (0, 0)  # their expert GEMM pairs and rows
        self._tables: dict[tuple[int, int], CopyTable] = {}  # (placement version, FFN members mask) -> the copy choice
        self.mailbox = mailbox
        self.num_attention_ranks = num_attention_ranks
        self.poll_interval = poll_interval
        self.relink_timeout = relink_timeout
        self.unions = Unions(mailbox.name, mailbox.index, model.config)
        self.items_served = 0  # non-empty parts computed
        self.tokens_served = 0
        self.batches = 0  # unions computed (one or more non-empty parts each)
        self.attention_restart = False  # a lost attention rank is restarted: wait for it (its HELLO takes it back)
        self.attention_restarts = 0  # attention ranks taken back after a restart
        self._greeted: set[int] = set()  # attention ranks that said HELLO (another HELLO is a restart's)
        self._relink: queue.Queue = queue.Queue()  # (attention rank, incarnation): open its restart's links; None: it is
        # not restarted, stop waiting for it (another thread asks)
        self._open: set[int] = set()
        self.on_attention_silent = None  # called with (attention rank, reason) when one is found hung
        self._checked_at = 0.0
        self._late: list = []
        self.max_drain = 256
        self.busy_s = 0.0  # wall time computing
        self.busy_cpu_s = 0.0  # CPU time of this thread computing
        self.straggler_wait_s = 0.0  # summed over unions: first part received -> last part received
        self.tokens_by_rank: dict[int, int] = {}  # attention rank -> rows computed for it
        self.spans: deque = deque(maxlen=200_000)  # (start, end, layer, ((attention rank, mb, seq), ...), rows)
        self.on_tick = None  # called with no arguments when counters changed, at most every tick_interval s
        self.tick_interval = 1.0
        self._ticked_at = 0.0
        self._ticked_batches = 0
        self.idle = True  # as of the last report: no work waited (the counters had settled)

    def compute(self, layer: int, ops: Op, hidden: torch.Tensor, routing, shared_rows: torch.Tensor | None = None,
                model: MoEModel | None = None, token_ids: torch.Tensor | None = None,
                quantized: QuantizedRows | None = None) -> torch.Tensor:
        """One union's FFN half: hidden [N, H] -> [N, H]; ``shared_rows`` [N] bool: where this rank adds
        the shared experts (their rows' slice). ``model``: the experts of the union's placement version;
        ``token_ids`` [N]: the rows' tokens (a hash-routed layer's router reads them); ``quantized``: the rows as an
        int8 dispatch sent them, which W8A8 experts read as they are (``hidden`` is their dequantised copy)."""
        m = model or self.model
        if Op.DENSE in ops:
            return m.dense_mlp(layer, hidden)
        if Op.ROUTE in ops:
            routing = m.router(layer, hidden, token_ids)
        out = m.experts(layer, hidden, routing, quantized)
        if Op.SHARED in ops and shared_rows is not None:
            rows = shared_rows.nonzero().squeeze(1)
            if rows.numel():
                shared = m.shared_experts(layer, hidden[rows])
                if shared is not None:
                    out = out.index_add(0, rows, shared.to(out.dtype))
        return out

    def _gemm_counts(self) -> tuple[int, int]:
        """(expert GEMM pairs, rows over them) run here, over every placement version held (the experts count their own)."""
        gemms, rows = self._retired_gemms
        for model, _ in self.versions.values():
            g, r = model.expert_gemm_counts()
            gemms, rows = gemms + g, rows + r
        return gemms, rows

    @property
    def expert_gemms(self) -> int:
        return self._gemm_counts()[0]

    @property
    def mean_gemm_rows(self) -> float:
        gemms, rows = self._gemm_counts()
        return rows / max(1, gemms)

    def stats(self) -> dict[str, float]:
        return {**self.live_stats(), "heartbeats_received": self.mailbox.stats.heartbeats_received, "spans": list(self.spans),
                "arrivals": list(self.unions.arrivals)}

    def _check_silence(self, open_ranks: set[int]) -> list:
        """A hung attention rank (silent past the link timeout): reported, then treated as lost; the unions
        that makes whole. Without a report callback (ranks as threads) the run fails, naming it."""
        self._checked_at = time.monotonic()
        try:
            self.mailbox.check_silence()
        except PeerSilentError as e:
            if e.peer is None or self.on_attention_silent is None:
                raise
            self.on_attention_silent(e.peer, str(e))  # the launcher kills it (its requests move), or fails the run
            return self._attention_lost(e.peer, open_ranks)
        return []

    def _attention_lost(self, rank: int, open_ranks: set[int], forget: bool = True) -> list:
        """An attention rank's link closed without a SHUTDOWN: it died. It sends no more parts, so every
        union waiting on it is whole without it (its rows are independent of the others'); the unions that
        now are, to compute. Its own parts are computed with them, their results dropped. ``forget``: close
        its link (not when the link may be its restart's already)."""
        log.warning("%s: lost %s; completing the unions that waited on it", self.mailbox.name, self.mailbox.peer_name(rank))
        if forget:
            self.mailbox.forget(rank)
        if not self.attention_restart:  # else it stays open: its restart says HELLO on new links
            open_ranks.discard(rank)
        return self.unions.lose(rank)

    @torch.inference_mode()
    def serve(self) -> None:
        """Serve until every attention rank has said SHUTDOWN."""
        open_ranks = self._open = set(range(self.num_attention_ranks))
        if self.on_tick is not None:  # the counters before any work (a benchmark's baseline: the load's CPU, no rows)
            self._ticked_at = time.monotonic()
            self.on_tick()
        while open_ranks:
            late, self._late = self._late, []  # unions a lost attention rank made whole while answering
            for key, union in sorted(late, key=lambda kv: kv[0]):
                self._serve_union(key[2], union)
            self._tick()
            self._install_offered()
            self._relink_restarted()
            self._retire(open_ranks)
            whole = []
            try:
                msg = self.mailbox.recv(self.poll_interval)
            except PeerDiedError as e:
                if e.peer is None:
                    raise
                whole = self._attention_lost(e.peer, open_ranks)
                msg = None
            if msg is None:
                if not whole:
                    whole = self._check_silence(open_ranks)  # idle is not failure; a silent attention rank is
                for key, union in sorted(whole, key=lambda kv: kv[0]):
                    self._serve_union(key[2], union)
                self._tick(idle=not whole)
                continue
            batch = [msg]
            while len(batch) < self.max_drain:  # everything already waiting joins this round
                try:
                    more = self.mailbox.recv(0.0)
                except PeerDiedError as e:
                    if e.peer is None:
                        raise
                    whole += self._attention_lost(e.peer, open_ranks)
                    break
                if more is None:
                    # nothing left unread: a peer's silence is real now (the others' heartbeats keep the
                    # receive above from ever timing out, so a hung one is found here too)
                    if time.monotonic() - self._checked_at > SILENCE_CHECK_S:
                        whole += self._check_silence(open_ranks)
                    break
                batch.append(more)
            for msg in batch:
                h = msg.header
                if h.kind == Kind.SHUTDOWN:  # the mailbox stopped listening to it as it read this
                    open_ranks.discard(h.src_index)
                elif h.kind == Kind.HEARTBEAT:
                    continue
                elif h.kind == Kind.HELLO:  # the version was checked when the header was read
                    if self.unions.lost >> h.src_index & 1 or h.src_index in self._greeted:  # a restart
                        if not self.unions.lost >> h.src_index & 1:  # its predecessor's end was not seen (tcp: its link replaced)
                            whole += self._attention_lost(h.src_index, open_ranks, forget=False)
                        self._readmit(h.src_index, h.epoch)
                    self._greeted.add(h.src_index)
                    self.mailbox.send(h.src_index, make_message(Header(Kind.HELLO, Role.FFN, self.mailbox.index, h.src_index), {}))
                else:
                    try:
                        if h.kind != Kind.WORK:
                            raise ProtocolError(f"{self.mailbox.name}: unexpected {h.kind.name} from {h.source}")
                        self.unions.check(h)
                        done = self.unions.add(parse_work(msg, self.mailbox.name), self.versions)
                        if done is not None:
                            whole.append(done)
                    except ProtocolError as e:
                        self._report(h.src_index, str(e))
                        raise
            for key, union in sorted(whole, key=lambda kv: kv[0]):
                self._serve_union(key[2], union)
            if not any(m.header.kind == Kind.WORK for m in batch):  # heartbeats only: the work so far is all done
                self._tick(idle=True)
        if self.unions.lost == (1 << self.num_attention_ranks) - 1:  # nobody said SHUTDOWN: their host is gone
            raise PeerDiedError(f"{self.mailbox.name}: every attention rank is gone without a SHUTDOWN (their node, or the run, died)")

    def relink(self, attention_rank: int, incarnation: int | None) -> None:
        """A lost attention rank was restarted (any thread): open the links of its ``incarnation``, between two
        rounds. None: it will not be (restarts used up); stop waiting for its SHUTDOWN."""
        self._relink.put((attention_rank, incarnation))

    def _relink_restarted(self) -> None:
        while not self._relink.empty():
            rank, incarnation = self._relink.get()
            if incarnation is None:
                self._open.discard(rank)
                log.warning("%s: attention rank %d is not restarted; serving without it", self.mailbox.name, rank)
                continue
            self.mailbox.readmit(rank, incarnation, self.relink_timeout)
            log.warning("%s: linked to attention rank %d's restart (incarnation %d)", self.mailbox.name, rank, incarnation)

    def _readmit(self, rank: int, epoch: int) -> None:
        """A lost attention rank's restart said HELLO: it contributes again from ``epoch`` (the one the other
        attention ranks took it back in; 0 for the only one, whose steps count from the start again)."""
        self.unions.readmit(rank, epoch)
        self._open.add(rank)
        self.attention_restarts += 1
        log.warning("%s: attention rank %d is back (restarted), a contributor from epoch %d", self.mailbox.name, rank, epoch)

    def offer(self, version: int, model: MoEModel, placement: ExpertPlacement) -> None:
        """A rebalance (any thread): the experts of placement ``version``, loaded; installed between two rounds."""
        self._offered.put((version, model, placement))

    def _install_offered(self) -> None:
        while not self._offered.empty():
            version, model, placement = self._offered.get()
            self.versions[version] = (model, placement)
            self.model, self.placement, self.placement_version = model, placement, version
            log.warning("%s: experts of placement version %d installed: %s", self.mailbox.name, version, list(model.expert_ids))
            if self.on_installed is not None:
                self.on_installed(version)

    def _retire(self, open_ranks: set[int]) -> None:
        """Drop the experts of versions no sender uses any more (every open one sent work under a newer one)."""
        if len(self.versions) < 2 or not open_ranks:
            return
        oldest_used = min(self.unions.newest_seen.get(a, 0) for a in open_ranks)
        for v in [v for v in self.versions if v < oldest_used]:
            model, _ = self.versions.pop(v)
            gemms, rows = model.expert_gemm_counts()
            self._retired_gemms = (self._retired_gemms[0] + gemms, self._retired_gemms[1] + rows)
            for key, n in model.expert_token_counts().items():
                self._retired_counts[key] = self._retired_counts.get(key, 0) + n

    def expert_token_counts(self) -> dict[tuple[int, int], int]:
        """Tokens each (layer, expert) has computed on this rank, over every placement version it held."""
        counts = dict(self._retired_counts)
        for model, _ in self.versions.values():
            for key, n in model.expert_token_counts().items():
                counts[key] = counts.get(key, 0) + n
        return counts

    def owes(self, attention_rank: int) -> bool:
        """Whether results are still owed to this attention rank (it waits, so it reads its link)."""
        return self.unions.owed.get(attention_rank, 0) > 0

    def _tick(self, idle: bool = False) -> None:
        """Call ``on_tick`` (live counters) only after new work: at most every ``tick_interval`` s while busy, and
        at once when the rank falls idle (so the counters a server exports settle with the work)."""
        if self.on_tick is None or (self.batches == self._ticked_batches and (self.idle or not idle)):
            return
        now = time.monotonic()
        if idle or now - self._ticked_at >= self.tick_interval:
            self._ticked_at, self._ticked_batches, self.idle = now, self.batches, idle
            self.on_tick()

    def live_stats(self) -> dict:
        """The counters a server exports (no spans): work served, busy time, per-expert tokens."""
        return {"items": self.items_served, "empty_parts": self.unions.empty_parts, "tokens": self.tokens_served, "batches": self.batches,
                "items_per_batch": self.items_served / max(1, self.batches), "expert_gemms": self.expert_gemms,
                "mean_gemm_rows": self.mean_gemm_rows, "busy_s": self.busy_s, "busy_cpu_s": self.busy_cpu_s,
                "process_cpu_s": time.process_time(),  # the process the rank runs in (its own; loopback: the launcher's)
                "straggler_wait_s": self.straggler_wait_s, "tokens_by_rank": dict(self.tokens_by_rank), "retries": self.unions.retries,
                "idle": self.idle,
                "expert_tokens": self.expert_token_counts(), "placement_version": self.placement_version}

    def _serve_union(self, layer: int, union: Union) -> None:
        arrived = [it.received_at for it in union.parts.values()]
        self.straggler_wait_s += max(arrived) - min(arrived)
        items = [union.parts[a] for a in sorted(union.parts) if union.parts[a].header.num_tokens]  # attention-rank order
        if not items:
            return  # every contributor had nothing for this rank
        hidden = _joined([it.hidden for it in items])
        model, placement = self.versions[union.placement]
        quantized = None
        if items[0].hidden_scales is not None:  # an int8 / fp8 dispatch: the values and their per-row scales
            quantized = QuantizedRows(hidden, _joined([it.hidden_scales for it in items]))
            hidden = quantized.dequantize(self.dtype)
            if quantized.values.dtype != torch.int8:
                quantized = None  # fp8 rows: dequantised for every consumer
        elif hidden.dtype != self.dtype:  # a bf16 dispatch to an fp32 rank
            hidden = hidden.to(self.dtype)
        routing = None
        if items[0].routing is not None:
            routing = Routing(_joined([it.routing.topk_ids for it in items]), _joined([it.routing.topk_weights for it in items]))
        shared = _joined([it.shared_rows for it in items]) if items[0].shared_rows is not None else None
        token_ids = None
        if items[0].token_ids is not None:  # a hash-routed layer's gate here: every part carries its rows' tokens
            token_ids = _joined([it.token_ids for it in items])
        t0, c0 = time.perf_counter(), time.thread_time()
        ops = union.ops
        if Op.ROUTE in ops and placement is not None and placement.redundant:
            routing, ops = self._own_slots(layer, hidden, items, model, union.placement, token_ids), ops & ~Op.ROUTE
        out = self.compute(layer, ops, hidden, routing, shared, model, token_ids, quantized).to(hidden.dtype)
        t1 = time.perf_counter()
        self.busy_s += t1 - t0
        self.busy_cpu_s += time.thread_time() - c0
        self.spans.append((t0, t1, layer, tuple((it.header.src_index, it.header.microbatch, it.header.seq) for it in items), int(hidden.shape[0])))
        self.batches += 1
        start = 0
        for it in items:
            n = it.hidden.shape[0]
            h = it.header
            if self.unions.excused(h.epoch) >> h.src_index & 1:  # computed with the others; nobody to answer (a lost one's part)
                start += n
                continue
            try:
                rows = out[start : start + n]
                self.mailbox.send_packed(h.src_index, result_header(h, self.mailbox.index, rows, t1 - t0), [rows])
            except PeerDiedError as e:  # it died since it sent this part
                if e.peer is None:
                    raise
                self._late += self._attention_lost(e.peer, self._open)
                start += n
                continue
            self.unions.owed[h.src_index] -= 1
            start += n
            self.items_served += 1
            self.tokens_served += n
            self.tokens_by_rank[h.src_index] = self.tokens_by_rank.get(h.src_index, 0) + n

    def _own_slots(self, layer: int, hidden: torch.Tensor, items: list[WorkItem], model: MoEModel, version: int,
                   token_ids: torch.Tensor | None = None) -> Routing:
        """The gate here, with redundant copies: route the union, keep the slots whose chosen copy is this rank
        (the key of a row: its index in its part plus its sender; the copies alive under the part's FFN members)."""
        routing = model.router(layer, hidden, token_ids)
        placement = self.versions[version][1]
        owners = []
        start = 0
        for it in items:
            h, n = it.header, it.hidden.shape[0]
            table = self._tables.get((version, h.ffn_members))
            if table is None:
                table = self._tables[(version, h.ffn_members)] = placement.copy_table(mask_ranks(h.ffn_members), hidden.device)
            keys = torch.arange(n, device=hidden.device) + h.src_index
            owners.append(table.owner(routing.topk_ids[start : start + n], keys))
            start += n
        owner = torch.cat(owners) if len(owners) > 1 else owners[0]
        return Routing(torch.where(owner == self.mailbox.index, routing.topk_ids, -1), routing.topk_weights)

    def _report(self, attention_rank: int, text: str) -> None:
        try:
            self.mailbox.send(attention_rank, error_message(self.mailbox.index, attention_rank, text))
        except Exception:  # the peer may be gone too; the launcher reports this rank's exit
            log.debug("could not report error to attention rank %d", attention_rank)
