"""The FFN worker loop: receive work items, compute, send results. It never needs the request schedule.

It batches: after the first work item arrives, every item already waiting is
drained too, and items of the same layer and operations -- from any attention
rank and any micro-batch -- run as one grouped GEMM per expert; each sender
still gets its own result, with its own header.

Every work item is checked before it is computed: a known layer, operations
that fit that layer, and, per attention rank, (sequence, layer, micro-batch)
strictly increasing (the ping-pong schedule dispatches in that order) -- a message from the past or a skipped layer is a protocol error
naming both ranks, never a silently mispaired tensor.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from afd.connectors.endpoints import error_message, parse_work, result_message
from afd.connectors.protocol import Header, Kind, Op, ProtocolError, Role, make_message
from afd.connectors.transport import Mailbox
from afd.models.base import MoEModel
from afd.types import Routing

log = logging.getLogger(__name__)


class FFNWorker:
    def __init__(self, model: MoEModel, mailbox: Mailbox, num_attention_ranks: int, poll_interval: float = 1.0) -> None:
        self.model = model
        self.mailbox = mailbox
        self._held = torch.tensor(model.expert_ids, device=mailbox.device)  # the expert ids this rank computes
        self.num_attention_ranks = num_attention_ranks
        self.poll_interval = poll_interval
        self.items_served = 0
        self.tokens_served = 0
        self.batches = 0  # grouped computations (one or more work items each)
        self.expert_gemms = 0  # expert GEMM pairs run
        self.expert_gemm_rows = 0  # rows over all of them
        self.max_drain = 64
        self.delay = 0.0  # seconds slept per batch: a slow FFN side, for tests and benchmarks
        self.busy_s = 0.0  # time spent computing
        self.owed: dict[int, int] = {}  # attention rank -> work items received, results not yet sent
        self.spans: deque = deque(maxlen=200_000)  # (start, end, layer, ((attention rank, mb, seq), ...), rows)
        self._last: dict[int, tuple[int, int, int]] = {}  # attention rank -> last (seq, layer, micro-batch)
        self.on_tick = None  # called with no arguments when counters changed, at most every tick_interval s
        self.tick_interval = 1.0
        self._ticked_at = 0.0
        self._ticked_batches = 0

    def compute(self, layer: int, ops: Op, hidden: torch.Tensor, routing) -> torch.Tensor:
        m = self.model
        if Op.DENSE in ops:
            return m.dense_mlp(layer, hidden)
        if Op.ROUTE in ops:
            routing = m.router(layer, hidden)
        self._count_gemms(routing.topk_ids)
        out = m.experts(layer, hidden, routing)
        if Op.SHARED in ops:
            shared = m.shared_experts(layer, hidden)
            if shared is not None:
                out = out + shared
        return out

    def _count_gemms(self, ids: torch.Tensor) -> None:
        mine = ids[torch.isin(ids, self._held.to(ids.dtype))]
        if mine.numel():
            counts = torch.bincount(mine)
            self.expert_gemms += int((counts > 0).sum())
            self.expert_gemm_rows += int(mine.numel())

    @property
    def mean_gemm_rows(self) -> float:
        return self.expert_gemm_rows / max(1, self.expert_gemms)

    def stats(self) -> dict[str, float]:
        return {"items": self.items_served, "tokens": self.tokens_served, "batches": self.batches,
                "expert_gemms": self.expert_gemms, "mean_gemm_rows": self.mean_gemm_rows, "busy_s": self.busy_s,
                "items_per_batch": self.items_served / max(1, self.batches),
                "heartbeats_received": self.mailbox.stats.heartbeats_received, "spans": list(self.spans)}

    def _check(self, h) -> None:
        me = self.mailbox.name
        cfg = self.model.config
        if not 0 <= h.layer < cfg.num_layers:
            raise ProtocolError(f"{me}: work from {h.source} for layer {h.layer}, the model has {cfg.num_layers}")
        if (Op.DENSE in h.ops) == cfg.is_moe_layer(h.layer):
            raise ProtocolError(f"{me}: work from {h.source} asks for ops {int(h.ops)} on layer {h.layer}, which is {'an MoE' if cfg.is_moe_layer(h.layer) else 'a dense'} layer")
        key = (h.seq, h.layer, h.microbatch)
        last = self._last.get(h.src_index)
        if last is not None and key <= last:
            raise ProtocolError(
                f"{me}: work from {h.source} out of order: (seq {h.seq}, layer {h.layer}, micro-batch {h.microbatch}) "
                f"after (seq {last[0]}, layer {last[1]}, micro-batch {last[2]})"
            )
        self._last[h.src_index] = key

    @torch.inference_mode()
    def serve(self) -> None:
        """Serve until every attention rank has said SHUTDOWN."""
        open_ranks = set(range(self.num_attention_ranks))
        while open_ranks:
            self._tick()
            msg = self.mailbox.recv(self.poll_interval)
            if msg is None:
                self.mailbox.check_silence()  # idle is not failure; a silent attention rank is
                continue
            batch = [msg]
            while len(batch) < self.max_drain:  # everything already waiting joins this round
                more = self.mailbox.recv(0.0)
                if more is None:
                    break
                batch.append(more)
            work = []
            for msg in batch:
                h = msg.header
                if h.kind == Kind.SHUTDOWN:  # the mailbox stopped listening to it as it read this
                    open_ranks.discard(h.src_index)
                elif h.kind == Kind.HEARTBEAT:
                    continue
                elif h.kind == Kind.HELLO:  # the version was checked when the header was read
                    self.mailbox.send(h.src_index, make_message(Header(Kind.HELLO, Role.FFN, self.mailbox.index, h.src_index), {}))
                else:
                    try:
                        if h.kind != Kind.WORK:
                            raise ProtocolError(f"{self.mailbox.name}: unexpected {h.kind.name} from {h.source}")
                        self._check(h)
                        work.append(parse_work(msg, self.mailbox.name))
                        self.owed[h.src_index] = self.owed.get(h.src_index, 0) + 1
                    except ProtocolError as e:
                        self._report(h.src_index, str(e))
                        raise
            self._serve_batch(work)

    def owes(self, attention_rank: int) -> bool:
        """Whether results are still owed to this attention rank (it waits, so it reads its link)."""
        return self.owed.get(attention_rank, 0) > 0

    def _tick(self) -> None:
        """Call ``on_tick`` (live counters) at most every ``tick_interval`` s, and only after new work."""
        if self.on_tick is None or self.batches == self._ticked_batches:
            return
        now = time.monotonic()
        if now - self._ticked_at >= self.tick_interval:
            self._ticked_at, self._ticked_batches = now, self.batches
            self.on_tick()

    def live_stats(self) -> dict:
        """The counters a server exports (no spans): work served, busy time, per-expert tokens."""
        return {"items": self.items_served, "tokens": self.tokens_served, "batches": self.batches,
                "mean_gemm_rows": self.mean_gemm_rows, "busy_s": self.busy_s, "expert_tokens": self.model.expert_token_counts()}

    def _serve_batch(self, work: list) -> None:
        groups: dict[tuple[int, int], list] = {}
        for item in work:
            groups.setdefault((item.header.layer, int(item.header.ops)), []).append(item)
        for (layer, ops), items in groups.items():
            hidden = torch.cat([it.hidden for it in items])
            routing = None
            if items[0].routing is not None:
                routing = Routing(torch.cat([it.routing.topk_ids for it in items]), torch.cat([it.routing.topk_weights for it in items]))
            t0 = time.perf_counter()
            out = self.compute(layer, Op(ops), hidden, routing).to(hidden.dtype)
            if self.delay:  # an injected slow FFN side counts as compute time
                time.sleep(self.delay)
            t1 = time.perf_counter()
            self.busy_s += t1 - t0
            self.spans.append((t0, t1, layer, tuple((it.header.src_index, it.header.microbatch, it.header.seq) for it in items), int(hidden.shape[0])))
            self.batches += 1
            start = 0
            for it in items:
                n = it.hidden.shape[0]
                h = it.header
                self.mailbox.send(h.src_index, result_message(h, self.mailbox.index, out[start : start + n]))
                self.owed[h.src_index] -= 1
                start += n
                self.items_served += 1
                self.tokens_served += n

    def _report(self, attention_rank: int, text: str) -> None:
        try:
            self.mailbox.send(attention_rank, error_message(self.mailbox.index, attention_rank, text))
        except Exception:  # the peer may be gone too; the launcher reports this rank's exit
            log.debug("could not report error to attention rank %d", attention_rank)
