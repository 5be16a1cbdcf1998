"""The ping-pong schedule: the order in which an attention rank runs (micro-batch, layer, action) steps.

Per layer, each micro-batch runs its attention and dispatches its FFN input;
its combine is taken only when it is needed -- right before the same
micro-batch's attention at the next layer -- so while micro-batch k is in
transfer or on the FFN side, the attention of micro-batches k+1, k+2, ... runs.
At most ``credits`` dispatches are in flight: before a dispatch that would
exceed them, the oldest outstanding one is combined first.

Pure: the runtime executes exactly the steps this generator yields.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Iterator


class Action(enum.Enum):
    ATTENTION = "attention"  # attention half of (micro-batch, layer), incl. router
    DISPATCH = "dispatch"  # send the FFN input (or run the FFN half locally)
    COMBINE = "combine"  # wait for the FFN output and add it to the residual


@dataclass(frozen=True, slots=True)
class Step:
    microbatch: int
    layer: int
    action: Action


def ping_pong(num_microbatches: int, num_layers: int, credits: int | None = None) -> Iterator[Step]:
    if num_microbatches < 1 or num_layers < 1:
        raise ValueError("need at least one micro-batch and one layer")
    credits = num_microbatches if credits is None else credits
    if credits < 1:
        raise ValueError(f"credits must be >= 1, got {credits}")
    in_flight: deque[tuple[int, int]] = deque()  # (microbatch, layer) dispatched, not combined
    combined: set[tuple[int, int]] = set()

    def combine(key: tuple[int, int]) -> Iterator[Step]:
        while key not in combined:  # combines are taken oldest first
            mb, layer = in_flight.popleft()
            combined.add((mb, layer))
            yield Step(mb, layer, Action.COMBINE)

    for layer in range(num_layers):
        for mb in range(num_microbatches):
            if layer > 0:
                yield from combine((mb, layer - 1))
            yield Step(mb, layer, Action.ATTENTION)
            if len(in_flight) >= credits:
                yield from combine(in_flight[0])
            in_flight.append((mb, layer))
            yield Step(mb, layer, Action.DISPATCH)
    while in_flight:
        mb, layer = in_flight.popleft()
        yield Step(mb, layer, Action.COMBINE)
