"""The FFN worker loop: receive a work item, compute, send the result. It never needs the request schedule.

Every work item is checked before it is computed: a known layer, operations
that fit that layer, and, per attention rank, (sequence, layer) strictly
increasing -- a message from the past or a skipped layer is a protocol error
naming both ranks, never a silently mispaired tensor.
"""

from __future__ import annotations

import logging

import torch

from afd.connectors.endpoints import error_message, parse_work, result_message
from afd.connectors.protocol import Kind, Op, ProtocolError
from afd.connectors.transport import Mailbox
from afd.models.base import MoEModel

log = logging.getLogger(__name__)


class FFNWorker:
    def __init__(self, model: MoEModel, mailbox: Mailbox, num_attention_ranks: int, poll_interval: float = 1.0) -> None:
        self.model = model
        self.mailbox = mailbox
        self.num_attention_ranks = num_attention_ranks
        self.poll_interval = poll_interval
        self.items_served = 0
        self.tokens_served = 0
        self._last: dict[int, tuple[int, int]] = {}  # attention rank -> last (seq, layer)

    def compute(self, layer: int, ops: Op, hidden: torch.Tensor, routing) -> torch.Tensor:
        m = self.model
        if Op.DENSE in ops:
            return m.dense_mlp(layer, hidden)
        if Op.ROUTE in ops:
            routing = m.router(layer, hidden)
        out = m.experts(layer, hidden, routing)
        if Op.SHARED in ops:
            shared = m.shared_experts(layer, hidden)
            if shared is not None:
                out = out + shared
        return out

    def _check(self, h) -> None:
        me = self.mailbox.name
        cfg = self.model.config
        if not 0 <= h.layer < cfg.num_layers:
            raise ProtocolError(f"{me}: work from {h.source} for layer {h.layer}, the model has {cfg.num_layers}")
        if (Op.DENSE in h.ops) == cfg.is_moe_layer(h.layer):
            raise ProtocolError(f"{me}: work from {h.source} asks for ops {int(h.ops)} on layer {h.layer}, which is {'an MoE' if cfg.is_moe_layer(h.layer) else 'a dense'} layer")
        last = self._last.get(h.src_index)
        if last is not None and (h.seq, h.layer) <= last:
            raise ProtocolError(
                f"{me}: work from {h.source} out of order: (seq {h.seq}, layer {h.layer}) after (seq {last[0]}, layer {last[1]})"
            )
        self._last[h.src_index] = (h.seq, h.layer)

    @torch.inference_mode()
    def serve(self) -> None:
        """Serve until every attention rank has said SHUTDOWN."""
        open_ranks = set(range(self.num_attention_ranks))
        while open_ranks:
            msg = self.mailbox.recv(self.poll_interval)
            if msg is None:
                continue  # idle is not failure
            h = msg.header
            if h.kind == Kind.SHUTDOWN:
                open_ranks.discard(h.src_index)
                self.mailbox.forget(h.src_index)
                continue
            if h.kind == Kind.HEARTBEAT:
                continue
            try:
                if h.kind != Kind.WORK:
                    raise ProtocolError(f"{self.mailbox.name}: unexpected {h.kind.name} from {h.source}")
                self._check(h)
                item = parse_work(msg, self.mailbox.name)
                out = self.compute(h.layer, h.ops, item.hidden, item.routing)
            except ProtocolError as e:
                self._report(h.src_index, str(e))
                raise
            self.mailbox.send(h.src_index, result_message(h, self.mailbox.index, out.to(item.hidden.dtype)))
            self.items_served += 1
            self.tokens_served += h.num_tokens

    def _report(self, attention_rank: int, text: str) -> None:
        try:
            self.mailbox.send(attention_rank, error_message(self.mailbox.index, attention_rank, text))
        except Exception:  # the peer may be gone too; the launcher reports this rank's exit
            log.debug("could not report error to attention rank %d", attention_rank)
