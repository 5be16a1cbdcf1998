"""Faults at the edge of a process, built only when a :class:`~afd.config.FaultPlan` exists (tests and
benchmarks: afd/env.py). Each wraps one object a process builds -- its mailbox, its engine's runner, its
FFN worker -- so the hot paths themselves (the send path, the FFN work loop, the step loop) carry no
fault checks."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from afd.config import FaultPlan
from afd.connectors.faults import FaultyMailbox
from afd.connectors.transport import Mailbox
from afd.connectors.wire import Role
from afd.engine.model_runner import Runner
from afd.ffn.worker import FFNWorker
from afd.kvcache import SeqChunk
from afd.runtime.spec import RankSpec


def rank_mailbox(mailbox: Mailbox, spec: RankSpec) -> Mailbox | FaultyMailbox:
    """A rank's mailbox, wrapped where the plan injects into it: attention rank 0 damages a work message,
    the last FFN rank (not its replacement) dies or hangs on a work part, every rank jitters its sends."""
    plan = spec.faults
    if plan is None:
        return mailbox
    damage = spec.role == Role.ATTENTION and spec.index == 0 and plan.is_protocol
    die = (spec.role == Role.FFN and plan.kind in ("ffn-kill", "ffn-hang") and spec.index == spec.topology.num_ffn_ranks - 1
           and spec.generation == 0)
    if not (damage or die or plan.send_jitter):
        return mailbox
    return FaultyMailbox(mailbox, plan, damage_work=damage, die_on_work=die)


class FaultyRunner:
    """An engine's runner whose ``nth`` step raises (``AFD_FAULT=engine-step@N``: a replica whose engine fails)."""

    def __init__(self, inner: Runner, nth: int) -> None:
        self._inner, self._nth, self._steps = inner, nth, 0

    @property
    def waves(self):
        return self._inner.waves

    def run(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], observer=None) -> torch.Tensor:
        self._steps += 1
        if self._steps >= self._nth:
            raise RuntimeError(f"injected engine fault at step {self._steps} (AFD_FAULT=engine-step@{self._nth})")
        return self._inner.run(token_ids, chunks, observer)

    def idle(self) -> None:
        self._inner.idle()

    def maintain(self) -> None:
        self._inner.maintain()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def engine_runner(runner: Runner, plan: FaultPlan | None) -> Runner:
    """The runner an engine steps through, faulty where the plan says so."""
    return FaultyRunner(runner, plan.nth) if plan is not None and plan.kind == "engine-step" else runner


class SlowFFNWorker(FFNWorker):
    """An FFN worker that sleeps ``delay`` s per computed union (``AFD_FFN_DELAY_MS``: a slow FFN side). The
    sleep counts in its wall busy time, not in its CPU time."""

    def __init__(self, *args, delay: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay

    def compute(self, *args, **kwargs) -> torch.Tensor:
        out = super().compute(*args, **kwargs)
        time.sleep(self.delay)
        return out
