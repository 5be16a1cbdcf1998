"""The FFN side's I/O: a work part parsed and checked, and the messages an FFN rank answers with."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from afd.connectors.wire import Header, Kind, Message, Op, ProtocolError, Role, TensorName, busy_us, make_message
from afd.types import Routing


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One contributor's part of a (step, layer, micro-batch) union (``n`` may be 0)."""

    header: Header
    hidden: torch.Tensor  # [n, H]
    routing: Routing | None  # ids [n, k] (-1: not for this rank), weights [n, k]
    shared_rows: torch.Tensor | None  # [n] bool: rows whose shared experts this rank computes
    token_ids: torch.Tensor | None = None  # [n] int64: the rows' tokens (a hash-routed layer's gate here)
    hidden_scales: torch.Tensor | None = None  # [n, 1] fp32: ``hidden`` is quantised (int8 / fp8 dispatch), these its scales
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
    shared = _per_row(msg, TensorName.SHARED_ROWS, receiver).bool() if Op.SHARED in h.ops else None
    token_ids = _per_row(msg, TensorName.TOKEN_IDS, receiver).long() if TensorName.TOKEN_IDS in msg.tensors else None
    scales = None
    if hidden.dtype in (torch.int8, torch.float8_e4m3fn):
        scales = msg.get(TensorName.HIDDEN_SCALES)
        if tuple(scales.shape) != (h.num_tokens, 1) or scales.dtype != torch.float32:
            raise ProtocolError(f"{receiver}: work from {h.source}: {hidden.dtype} rows need fp32 scales [{h.num_tokens}, 1], "
                                f"got {scales.dtype} {list(scales.shape)}")
    return WorkItem(h, hidden, routing, shared, token_ids, scales, time.perf_counter())


def _per_row(msg: Message, name: TensorName, receiver: str) -> torch.Tensor:
    """A tensor of one value per row of the part ([n]), checked."""
    h, t = msg.header, msg.get(name)
    if tuple(t.shape) != (h.num_tokens,):
        raise ProtocolError(f"{receiver}: work from {h.source}: {name.name} {list(t.shape)} for {h.num_tokens} tokens")
    return t


def result_message(work: Header, ffn_rank: int, output: torch.Tensor, busy_s: float = 0.0) -> Message:
    header = Header(Kind.RESULT, Role.FFN, ffn_rank, work.src_index, work.layer, work.microbatch, work.seq, output.shape[0], work.ops,
                    (), epoch=work.epoch, members=work.members, ffn_members=work.ffn_members, placement=work.placement,
                    busy_us=busy_us(busy_s))
    return make_message(header, {TensorName.OUTPUT: output})


def error_message(ffn_rank: int, dst: int, text: str) -> Message:
    data = torch.tensor(list(text.encode()[:4000]), dtype=torch.uint8)
    return make_message(Header(Kind.ERROR, Role.FFN, ffn_rank, dst, num_tokens=len(data)), {TensorName.TEXT: data})
