"""Faults at the edge: a :class:`FaultyMailbox` wraps a rank's mailbox when a :class:`~afd.config.FaultPlan`
asks for one (tests and benchmarks: ``AFD_FAULT``, ``AFD_SEND_JITTER_MS``). The mailbox itself, the FFN
work loop and the engine's step loop carry no fault checks.

* a protocol fault damages attention rank 0's N-th work message on the wire; the receiver must catch
  it (and name both ranks), never mispair it;
* ``ffn-kill`` / ``ffn-hang``: an FFN rank SIGKILLs / SIGSTOPs itself on receiving its N-th work part,
  so the unit is in flight when it goes;
* send jitter: a random sleep before each message, so arrival order varies.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from dataclasses import replace

import torch

from afd.config import FaultPlan
from afd.connectors.transport import Mailbox
from afd.connectors.wire import Header, Kind, Message, encode, flat_bytes

log = logging.getLogger(__name__)


def damage(kind: str, header: Header, header_bytes: bytes, payload: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    """One encoded frame with a protocol fault. ``payload``: the frame's 1-d uint8 tensors."""
    if kind == "corrupt-header":
        return b"XXXX" + header_bytes[4:], payload
    if kind == "wrong-layer":
        return replace(header, layer=header.layer + 1).pack(), payload
    if kind == "wrong-seq":
        return replace(header, seq=header.seq - 1).pack(), payload
    if kind == "truncate":
        last = payload[-1]
        return header_bytes, [*payload[:-1], last[: max(0, len(last) - 16)]]
    raise ValueError(f"unknown protocol fault {kind!r}")


class FaultyMailbox:
    """A mailbox that injects the plan's faults into what passes through it, and is the mailbox in all else."""

    def __init__(self, inner: Mailbox, plan: FaultPlan, damage_work: bool = False, die_on_work: bool = False) -> None:
        """``damage_work``: this rank's sends carry the plan's protocol fault; ``die_on_work``: this rank
        receives the plan's ffn-kill / ffn-hang."""
        self._inner = inner
        self._plan = plan
        self._damage = plan.kind if damage_work and plan.is_protocol else None
        self._signal = {"ffn-kill": signal.SIGKILL, "ffn-hang": signal.SIGSTOP}.get(plan.kind) if die_on_work else None
        self._work_sent = 0
        self._work_received = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def send(self, peer: int, message: Message) -> None:
        if self._plan.send_jitter:
            time.sleep(random.uniform(0.0, self._plan.send_jitter))
        if self._damage is None or message.header.kind != Kind.WORK:
            self._inner.send(peer, message)
            return
        self._work_sent += 1
        header_bytes, tensors = encode(message)
        payload = [flat_bytes(t.to(self._inner.wire_device)) for t in tensors]
        if self._work_sent == self._plan.nth:
            log.warning("%s: injected fault %s in work message %d", self._inner.name, self._damage, self._work_sent)
            header_bytes, payload = damage(self._damage, message.header, header_bytes, payload)
        self._inner.send_frame(peer, message.header, header_bytes, payload)

    def send_packed(self, peer: int, header_bytes: bytes, tensors: list[torch.Tensor], header: Header | None = None) -> None:
        if self._plan.send_jitter:
            time.sleep(random.uniform(0.0, self._plan.send_jitter))
        self._inner.send_packed(peer, header_bytes, tensors, header)

    def recv(self, timeout: float) -> Message | None:
        msg = self._inner.recv(timeout)
        if self._signal is not None and msg is not None and msg.header.kind == Kind.WORK:
            self._work_received += 1
            if self._work_received == self._plan.nth:
                log.warning("%s: injected fault %s at work part %d", self._inner.name, self._plan.kind, self._work_received)
                os.kill(os.getpid(), self._signal)
        return msg
