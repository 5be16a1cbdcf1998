"""How a disaggregated run steps and waits: the micro-batch pipeline and its cost model, every timeout, and the
faults tests inject."""

from __future__ import annotations

import math
from dataclasses import dataclass

@dataclass(frozen=True)
class CostModel:
    """Costs of one layer, in one unit (``afd bench costs`` fits them in seconds on a model; the defaults
    are relative, from the built-in model on CPU). Per token: ``attn_token`` + ``attn_context`` x
    (position + 1) on the attention side, ``ffn_token`` on the FFN side. Per micro-batch and layer (used
    only to choose m, see :func:`choose_microbatches`): ``attn_call`` and ``ffn_call`` (a call's fixed cost),
    ``transfer`` (one message, one way), and ``ffn_expert`` per distinct routed expert the micro-batch
    touches (reading its weights): n tokens choosing ``top_k`` of ``num_experts`` touch
    E·(1 − (1 − k/E)^n) experts in expectation, so halving a decode step does not halve the weight
    reads, and halving a large prefill doubles them. ``local_token`` and ``local_call``: a leading local
    layer's FFN half (a dense MLP computed beside attention, e.g. DeepSeek's first dense layers), per token
    and per call, on the attention side: nothing leaves for the FFN side before a micro-batch has passed
    them, so they lengthen the pipeline's fill, not every layer."""

    attn_token: float = 1.0
    attn_context: float = 0.01
    ffn_token: float = 2.0
    attn_call: float = 40.0
    ffn_call: float = 60.0
    transfer: float = 50.0
    ffn_expert: float = 0.0
    num_experts: int = 0  # the model's routing shape (set by the runner); 0: no per-expert term
    top_k: int = 0
    ffn_curve: tuple[tuple[int, float], ...] = ()  # measured (tokens, cost) points; when given, ffn_cost reads the FFN cost off them
    local_token: float = 0.0
    local_call: float = 0.0

    def __post_init__(self) -> None:
        coefficients = (self.attn_token, self.attn_context, self.ffn_token, self.attn_call, self.ffn_call, self.transfer, self.ffn_expert,
                        self.local_token, self.local_call)
        if not all(math.isfinite(c) and c >= 0 for c in coefficients) or max(self.attn_token, self.attn_context, self.ffn_token) <= 0:
            raise ValueError(f"costs must be non-negative with a positive per-token cost, got {coefficients}")
        ns = [n for n, _ in self.ffn_curve]
        if ns and (ns != sorted(set(ns)) or ns[0] < 1 or min(c for _, c in self.ffn_curve) < 0):
            raise ValueError(f"ffn_curve must be (tokens >= 1, cost >= 0) points with increasing tokens, got {self.ffn_curve}")

    @classmethod
    def from_fit(cls, fit: dict, transfer: float = 100e-6) -> "CostModel":
        """The cost model in a fit of ``afd bench costs`` (its JSON; seconds). ``transfer``: the one-way
        message cost where the fit has none (it measures compute, not the connector)."""
        keys = ("attn_token", "attn_context", "ffn_token", "attn_call", "ffn_call")
        missing = [k for k in keys if k not in fit]
        if missing:
            raise ValueError(f"the cost model lacks {', '.join(missing)}: write it with `afd bench costs --json FILE`")
        return cls(*(max(0.0, float(fit[k])) for k in keys), transfer=max(0.0, float(fit.get("transfer", transfer))),
                   ffn_expert=max(0.0, float(fit.get("ffn_expert", 0.0))),
                   local_token=max(0.0, float(fit.get("local_token", 0.0))), local_call=max(0.0, float(fit.get("local_call", 0.0))),
                   ffn_curve=tuple((int(n), float(t)) for n, t in fit.get("ffn_curve") or ()))

    def experts_touched(self, num_tokens: int) -> float:
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** num_tokens)

    @staticmethod
    def context(spans) -> float:
        """Sum of (position + 1) over the spans' tokens: the keys their attention reads."""
        return sum(sp.length * sp.start + sp.length * (sp.length + 1) / 2 for sp in spans)

    def attention_cost(self, spans) -> float:
        return self.attn_call + self.attn_token * sum(sp.length for sp in spans) + self.attn_context * self.context(spans)

    def ffn_cost(self, num_tokens: int) -> float:
        """Per micro-batch and layer. With a measured ``ffn_curve``: linear between its points (and along
        its last segment beyond it) -- whatever the shape, e.g. superlinear where a parametric fit is not."""
        curve = self.ffn_curve
        if curve:
            if num_tokens <= curve[0][0] or len(curve) == 1:
                return curve[0][1]
            for (n0, c0), (n1, c1) in zip(curve, curve[1:]):
                if num_tokens <= n1:
                    break
            return max(0.0, c0 + (c1 - c0) * (num_tokens - n0) / (n1 - n0))
        return self.ffn_call + self.ffn_token * num_tokens + self.ffn_expert * self.experts_touched(num_tokens)

    def local_cost(self, num_tokens: int) -> float:
        """A local layer's FFN half on ``num_tokens`` tokens (none: nothing to compute)."""
        return self.local_call + self.local_token * num_tokens if num_tokens else 0.0

    def token_cost(self, position: int) -> float:
        return self.attn_token + self.attn_context * (position + 1) + self.ffn_token

    def span_cost(self, start: int, length: int) -> float:
        """Sum of token costs for positions start .. start+length-1 (closed form)."""
        positions_sum = length * start + length * (length + 1) / 2  # sum of (p + 1)
        return length * (self.attn_token + self.ffn_token) + self.attn_context * positions_sum


@dataclass(frozen=True)
class PipelineConfig:
    """How an attention rank runs one step over the connector; a per-step setting, not a launch property.

    mode              ``sync``: one micro-batch, dispatch then wait, per layer;
                      ``async``: ``num_microbatches`` micro-batches ping-ponged so that
                      attention of one overlaps the transfer and FFN work of the others
    num_microbatches  1..8 (async); with ``adaptive``, the most the planner may choose
    adaptive          choose m per step (1..num_microbatches) by simulating the schedule with the
                      cost model (``--num-microbatches auto``)
    learn_costs       with ``adaptive``: plan with the costs the run measures (afd/microbatch/learn.py)
                      once it has seen enough, ``cost`` until then; False: ``cost`` only (``--fixed-costs``)
    split             ``request`` (cut between sequences) or ``token`` (cut anywhere)
    credits           max dispatches in flight per attention rank (default: num_microbatches)
    cost              the planner's :class:`CostModel`, e.g. fitted by ``afd bench costs``
                      (``CostModel.from_fit``); None: the defaults
    min_microbatch_tokens  a step with fewer than m x this many tokens runs fewer micro-batches
                      (1: always m when possible)
    """

    mode: str = "sync"
    num_microbatches: int = 2
    split: str = "token"
    credits: int | None = None
    cost: CostModel | None = None
    min_microbatch_tokens: int = 1
    adaptive: bool = False
    learn_costs: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"--mode must be sync or async, got {self.mode!r}")
        if not 1 <= self.num_microbatches <= 8:
            raise ValueError(f"--num-microbatches must be in [1, 8], got {self.num_microbatches}")
        if self.split not in ("request", "token"):
            raise ValueError(f"--split must be request or token, got {self.split!r}")
        if self.credits is not None and not 1 <= self.credits <= 8:
            raise ValueError(f"credits must be in [1, 8], got {self.credits}")
        if self.min_microbatch_tokens < 1:
            raise ValueError(f"--min-microbatch-tokens must be >= 1, got {self.min_microbatch_tokens}")

    @property
    def effective_microbatches(self) -> int:
        return 1 if self.mode == "sync" else self.num_microbatches

    @property
    def effective_credits(self) -> int:
        return self.credits or self.effective_microbatches




@dataclass(frozen=True)
class Timeouts:
    """Every wait of a run, derived once from the user's flags (``--hang-timeout``, ``--ready-timeout``,
    ``--shutdown-timeout``); nothing else in afd holds a default for one of these.

    hang       a peer that sends nothing, not even a heartbeat, for this long once its link is up is hung
               (a death is seen at once, from the link closing); the link timeout of every mailbox
    heartbeat  an idle link carries a heartbeat this often (default min(1, hang / 4); 0: none)
    ready      a rank (or the engine core) loads, links and reports READY within this
    shutdown   a polite stop is waited for this long before SIGTERM, then SIGKILL
    """

    hang: float = 10.0
    ready: float = 300.0
    shutdown: float = 10.0
    heartbeat: float | None = None

    def __post_init__(self) -> None:
        for name in ("hang", "ready", "shutdown"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name}-timeout must be a positive number of seconds, got {getattr(self, name)}")
        if self.heartbeat is None:
            object.__setattr__(self, "heartbeat", min(1.0, self.hang / 4))
        if self.heartbeat < 0 or (self.heartbeat and self.heartbeat >= self.hang):
            raise ValueError(f"the heartbeat interval ({self.heartbeat} s) must be in [0, the hang timeout {self.hang} s)")

    @property
    def backstop(self) -> float:
        """A combine's wait for a peer that beats but never answers (a bug, not a hang): long."""
        return max(300.0, self.hang)

    @property
    def vote(self) -> float:
        """An attention rank's wait for the other members' votes of one step (a dead member is dropped sooner)."""
        return max(600.0, self.hang)

    @property
    def rejoin(self) -> float:
        """A restarted attention rank's wait for the others to take it back into their steps."""
        return 120.0 + self.hang


FAULT_KINDS = ("corrupt-header", "wrong-layer", "wrong-seq", "truncate", "engine-step", "ffn-kill", "ffn-hang")
PROTOCOL_FAULTS = FAULT_KINDS[:4]


@dataclass(frozen=True)
class FaultPlan:
    """Faults injected for tests and benchmarks, parsed once from ``AFD_FAULT``, ``AFD_SEND_JITTER_MS`` and
    ``AFD_FFN_DELAY_MS`` (afd/env.py). The runtime wraps a rank's mailbox (afd/connectors/faults.py) or an
    engine's runner in a faulty twin only when a plan exists: the hot paths carry no fault checks.

    kind         corrupt-header | wrong-layer | wrong-seq | truncate: attention rank 0's ``nth`` work
                 message is damaged on the wire; engine-step: a replica's ``nth`` step raises;
                 ffn-kill | ffn-hang: the last FFN rank SIGKILLs / SIGSTOPs itself on receiving its
                 ``nth`` work part (so the unit is in flight when it goes)
    send_jitter  every rank sleeps a random 0..this many seconds before each message it sends
    ffn_delay    FFN ranks sleep this long per computed union (a slow FFN side)
    """

    kind: str | None = None
    nth: int = 3
    send_jitter: float = 0.0
    ffn_delay: float = 0.0

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in FAULT_KINDS:
            raise ValueError(f"AFD_FAULT must be one of {', '.join(FAULT_KINDS)} (optionally @N), got {self.kind!r}")
        if self.nth < 1:
            raise ValueError(f"AFD_FAULT's @N must be >= 1, got {self.nth}")
        if self.send_jitter < 0 or self.ffn_delay < 0:
            raise ValueError(f"AFD_SEND_JITTER_MS and AFD_FFN_DELAY_MS must be >= 0, got {self.send_jitter}, {self.ffn_delay}")

    @property
    def is_protocol(self) -> bool:
        """A damaged work message (attention rank 0's sends)."""
        return self.kind in PROTOCOL_FAULTS
