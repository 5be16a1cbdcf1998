"""The ping-pong schedule: the order in which an attention rank runs (micro-batch, layer, action) steps.

Per layer, each micro-batch runs its attention and dispatches its FFN input;
its combine is taken only when it is needed -- right before the same
micro-batch's attention at the next layer -- so while micro-batch k is in
transfer or on the FFN side, the attention of micro-batches k+1, k+2, ... runs.
At most ``credits`` dispatches are in flight: before a dispatch that would
exceed them, the oldest outstanding one is combined first.

The first ``local`` layers have their FFN half on this rank (a dense MLP kept
beside attention): their DISPATCH computes it and their COMBINE merges it, and
nothing of theirs can overlap. Each micro-batch in turn runs through them and
on to the first remote layer's dispatch before the next one starts, so the FFN
side gets its first work after one micro-batch's local layers, not after every
micro-batch's (layer-major, the fill would be all of them).

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
    COMBINE = "combine"  # the shared experts kept here, then wait for the FFN output; add both to the residual


@dataclass(frozen=True, slots=True)
class Step:
    microbatch: int
    layer: int
    action: Action


def ping_pong(num_microbatches: int, num_layers: int, credits: int | None = None, local: int = 0) -> Iterator[Step]:
    if num_microbatches < 1 or num_layers < 1:
        raise ValueError("need at least one micro-batch and one layer")
    if not 0 <= local <= num_layers:
        raise ValueError(f"local layers must be in 0..{num_layers}, got {local}")
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

    def dispatch(mb: int, layer: int) -> Iterator[Step]:
        if len(in_flight) >= credits:
            yield from combine(in_flight[0])
        in_flight.append((mb, layer))
        yield Step(mb, layer, Action.DISPATCH)

    for mb in range(num_microbatches):  # alone through the local layers (no credit taken) and the first remote one
        for layer in range(local):
            yield from (Step(mb, layer, a) for a in (Action.ATTENTION, Action.DISPATCH, Action.COMBINE))
        if local < num_layers:
            yield Step(mb, local, Action.ATTENTION)
            yield from dispatch(mb, local)
    for layer in range(local + 1, num_layers):
        for mb in range(num_microbatches):
            yield from combine((mb, layer - 1))
            yield Step(mb, layer, Action.ATTENTION)
            yield from dispatch(mb, layer)
    while in_flight:
        mb, layer = in_flight.popleft()
        yield Step(mb, layer, Action.COMBINE)
