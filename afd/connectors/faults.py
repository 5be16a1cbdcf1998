"""Deliberate protocol faults for tests (``AFD_FAULT``): each must be caught by the receiver, never mispaired."""

from __future__ import annotations

from dataclasses import replace

import torch

from afd.connectors.protocol import Header


def inject(kind: str, header: Header, header_bytes: bytes, payload: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    """``payload``: the frame's 1-d uint8 tensors."""
    if kind == "corrupt-header":
        return b"XXXX" + header_bytes[4:], payload
    if kind == "wrong-layer":
        return replace(header, layer=header.layer + 1).pack(), payload
    if kind == "wrong-seq":
        return replace(header, seq=header.seq - 1).pack(), payload
    if kind == "truncate":
        last = payload[-1]
        return header_bytes, [*payload[:-1], last[: max(0, len(last) - 16)]]
    raise ValueError(f"unknown fault {kind!r}")
