"""Micro-batch planner: split one step's batch into m contiguous micro-batches of balanced cost.

Pure Python. The cost of a token is what it costs to push it through one layer
of the pipeline: attention grows with the token's context (it attends to every
earlier token of its sequence), the FFN side is per token:

    cost(token at position p) = attn_token + attn_context * (p + 1) + ffn_token

Policies:

* ``request``: cuts only between sequences of the batch;
* ``token``: cuts anywhere, also inside a prompt; the later piece's attention
  reads the earlier piece's KV through the paged cache (the earlier piece runs
  first at every layer), so a split prompt computes the same values.

The split minimises the most expensive micro-batch (the pipeline's stage
time). When m pieces cannot be formed (one token, m > tokens or requests) the
plan degrades to fewer pieces and says why in ``degraded`` -- never silently.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Sequence

from afd.config import CostModel

POLICIES = ("request", "token")
MAX_MICROBATCHES = 8


@dataclass(frozen=True, slots=True)
class Span:
    """``length`` tokens of batch sequence ``seq``, starting at absolute position ``start``."""

    seq: int
    start: int
    length: int


@dataclass(frozen=True)
class MicrobatchPlan:
    pieces: tuple[tuple[Span, ...], ...]
    costs: tuple[float, ...]
    requested: int
    policy: str
    degraded: str | None = None

    @property
    def num_microbatches(self) -> int:
        return len(self.pieces)

    @property
    def imbalance(self) -> float:
        """max cost / mean cost (1.0 = perfectly balanced)."""
        return max(self.costs) / (sum(self.costs) / len(self.costs))


def plan_microbatches(
    chunks: Sequence[tuple[int, int]],
    num_microbatches: int,
    policy: str = "token",
    cost: CostModel = CostModel(),
    min_tokens: int = 1,
) -> MicrobatchPlan:
    """chunks: per sequence of the step, (start position, number of new tokens), in batch order.

    ``min_tokens``: fewest tokens worth a micro-batch of their own. A small step (a decode step of a
    few sequences) is cut into fewer pieces: on a memory-bound FFN side every micro-batch re-reads the
    expert weights, so splitting 8 decode tokens in two costs more than it overlaps.
    """
    if policy not in POLICIES:
        raise ValueError(f"split policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not 1 <= num_microbatches <= MAX_MICROBATCHES:
        raise ValueError(f"num_microbatches must be in [1, {MAX_MICROBATCHES}], got {num_microbatches}")
    if not chunks or any(n < 1 for _, n in chunks):
        raise ValueError("a step needs at least one sequence chunk, each with >= 1 token")
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    m = num_microbatches
    degraded = None
    total = sum(n for _, n in chunks)
    units = total if policy == "token" else len(chunks)  # indivisible pieces: tokens, or requests
    if m > units:
        what = "tokens" if policy == "token" else "requests"
        degraded = f"{m} micro-batches requested, only {units} {what} in the step: running {units}"
        m = units
    if m > 1 and total < m * min_tokens:
        fewer = max(1, total // min_tokens)
        degraded = f"{m} micro-batches requested, {total} tokens < {m} x {min_tokens} (min tokens per micro-batch): running {fewer}"
        m = fewer
    if policy == "token":
        groups = _split_tokens(chunks, m, cost)
    else:
        bounds = _cut([cost.span_cost(s, n) for s, n in chunks], m)
        groups = [tuple(Span(i, *chunks[i]) for i in range(a, b)) for a, b in bounds]
    costs = tuple(sum(cost.span_cost(sp.start, sp.length) for sp in g) for g in groups)
    return MicrobatchPlan(tuple(groups), costs, num_microbatches, policy, degraded)


def _cut(weights: Sequence[float], m: int) -> list[tuple[int, int]]:
    """Contiguous min-max partition into exactly m groups: exact DP when small, bisection otherwise."""
    return _partition(weights, m) if len(weights) <= 16 else _greedy_bounds(list(accumulate(weights, initial=0.0)), m)


def _partition(weights: Sequence[float], m: int) -> list[tuple[int, int]]:
    """Contiguous partition of ``weights`` into exactly m non-empty groups minimising the largest sum.

    Exact O(n^2 m) dynamic programme over prefix sums, for small n (:func:`_cut`).
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(m + 1)]
    cut = [[0] * (n + 1) for _ in range(m + 1)]
    best[0][0] = 0.0
    for g in range(1, m + 1):
        for end in range(g, n - (m - g) + 1):
            for start in range(g - 1, end):
                value = max(best[g - 1][start], prefix[end] - prefix[start])
                if value < best[g][end]:
                    best[g][end], cut[g][end] = value, start
    bounds, end = [], n
    for g in range(m, 0, -1):
        start = cut[g][end]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def _split_tokens(chunks: Sequence[tuple[int, int]], m: int, cost: CostModel) -> list[tuple[Span, ...]]:
    """Token policy: exact min-max cut over the flat token sequence."""
    bounds = _cut([cost.token_cost(s + j) for s, n in chunks for j in range(n)], m)
    starts = list(accumulate((n for _, n in chunks), initial=0))  # flat index of each chunk's first token
    groups = []
    for a, b in bounds:  # the chunks that [a, b) overlaps, as spans
        spans = []
        for i in range(bisect_right(starts, a) - 1, len(chunks)):
            lo, hi = max(a, starts[i]), min(b, starts[i + 1])
            if lo >= hi:
                break
            spans.append(Span(i, chunks[i][0] + lo - starts[i], hi - lo))
        groups.append(tuple(spans))
    return groups


def _greedy_bounds(prefix: Sequence[float], m: int) -> list[tuple[int, int]]:
    """Min-max contiguous cut of the weights whose prefix sums are ``prefix``: binary search on the
    largest group sum, each probe a greedy fill by bisection (O(m log n)); then pad to exactly m groups."""
    n = len(prefix) - 1
    lo, hi = max(prefix[i + 1] - prefix[i] for i in range(n)), prefix[-1]
    for _ in range(60):
        mid = (lo + hi) / 2
        if len(_fill(prefix, mid, m + 1)) <= m:
            hi = mid
        else:
            lo = mid
    bounds = _fill(prefix, hi, n)
    while len(bounds) < m:  # split the largest group (cannot raise the maximum)
        k = max(range(len(bounds)), key=lambda j: bounds[j][1] - bounds[j][0])
        a, b = bounds[k]
        mid = (a + b) // 2
        bounds[k : k + 1] = [(a, mid), (mid, b)]
    return bounds


def _fill(prefix: Sequence[float], limit: float, most: int) -> list[tuple[int, int]]:
    """Greedy groups of sum <= ``limit`` (at least one weight each); stops after ``most`` groups."""
    n, bounds, start = len(prefix) - 1, [], 0
    while start < n and len(bounds) < most:
        end = max(start + 1, bisect_right(prefix, prefix[start] + limit, start + 1) - 1)
        bounds.append((start, end))
        start = end
    if start < n:
        bounds.append((start, n))  # more groups than asked: the caller only counts them
    return bounds


# ----------------------------------------------------------------------------- choosing m


def simulate_step(plan: MicrobatchPlan, num_layers: int, cost: CostModel, credits: int | None = None, local_layers: int = 0) -> float:
    """Estimated time of one step run by the ping-pong schedule: the attention rank executes the
    schedule's steps in order; the FFN side serves dispatches first come, first served; a message
    takes ``cost.transfer`` each way. The first ``local_layers`` run their FFN half on the attention rank
    (a dense MLP there): it costs ``cost.local_cost`` there on top of the layer's attention, and nothing is
    sent. (Pure; the schedule is the one the runtime executes.)"""
    attn = [cost.attention_cost(piece) for piece in plan.pieces]
    tokens = [sum(sp.length for sp in piece) for piece in plan.pieces]
    return _simulate(attn, [cost.ffn_cost(n) for n in tokens], num_layers, cost.transfer, credits, local_layers,
                     [cost.local_cost(n) for n in tokens])


def _simulate(attn: Sequence[float], ffn: Sequence[float], num_layers: int, transfer: float, credits: int | None,
              local_layers: int = 0, local: Sequence[float] | None = None) -> float:
    """:func:`simulate_step` of micro-batches whose attention and FFN work per layer are ``attn`` and ``ffn``, and
    whose local layers' FFN half costs ``local`` (default nothing)."""
    return simulate_schedule(lambda k, layer: attn[k] + (local[k] if local and layer < local_layers else 0.0), lambda k, _: ffn[k],
                             len(attn), num_layers, transfer, credits, local_layers)


def simulate_schedule(attn: Callable[[int, int], float], ffn: Callable[[int, int], float], m: int, num_layers: int,
                      transfer: float = 0.0, credits: int | None = None, local_layers: int = 0,
                      combine: Callable[[int, int], tuple[float, float]] | None = None) -> float:
    """The ping-pong schedule's step time with micro-batch k's work at layer l ``attn(k, l)`` on the attention rank
    and ``ffn(k, l)`` on the FFN side: the attention rank executes the schedule's steps in order, the FFN side serves
    dispatches first come, first served, a message takes ``transfer`` each way; a leading local layer's FFN half is
    in its ``attn`` (nothing sent). ``combine(k, l)``: the attention rank's work at that combine, (before its wait:
    the shared experts; after: the merge)."""
    from afd.microbatch.schedule import Action, ping_pong

    t_attn = t_ffn = 0.0
    ready: dict[tuple[int, int], float] = {}
    for step in ping_pong(m, num_layers, min(credits or m, m), local_layers):
        k, layer = step.microbatch, step.layer
        if step.action is Action.ATTENTION:
            t_attn += attn(k, layer)
        elif layer < local_layers:
            pass  # the FFN half computed here: in the layer's attention cost, nothing sent
        elif step.action is Action.DISPATCH:
            t_ffn = max(t_ffn, t_attn + transfer) + ffn(k, layer)
            ready[(k, layer)] = t_ffn + transfer
        else:
            before, after = combine(k, layer) if combine is not None else (0.0, 0.0)
            t_attn = max(t_attn + before, ready.pop((k, layer))) + after
    return t_attn


def choose_microbatches(
    votes: Sequence[Sequence[tuple[int, int]]],
    max_microbatches: int,
    num_layers: int,
    policy: str = "token",
    cost: CostModel = CostModel(),
    credits: int | None = None,
    min_gain: float = 0.03,
    local_layers: int = 0,
) -> tuple[int, tuple[tuple[int, float], ...]]:
    """Adaptive m for a step of several contributors (each attention rank's chunks, non-empty): plan every
    contributor's batch for every m in 1..``max_microbatches`` and simulate the step with the cost model --
    micro-batch k's attention the slowest contributor's piece k (the ranks compute theirs side by side), its
    FFN work the union of every piece k (the FFN ranks compute it once) -- and keep the fastest. More
    micro-batches must win by ``min_gain`` (relative) to be chosen: every extra one pays its fixed costs
    for real, while the estimate's gain may be noise. Returns (m, the (m, estimate) of every m tried)."""
    best, best_t, estimates = 1, float("inf"), []
    for m in range(1, max_microbatches + 1):
        plans = [plan_microbatches(v, m, policy, cost) for v in votes]
        pieces = max(p.num_microbatches for p in plans)
        if pieces < m:
            break  # no more pieces to be had (one token, or fewer requests than m, on every contributor)
        attn = [max(cost.attention_cost(p.pieces[k]) if k < p.num_microbatches else 0.0 for p in plans) for k in range(m)]
        ffn = [cost.ffn_cost(sum(sp.length for p in plans if k < p.num_microbatches for sp in p.pieces[k])) for k in range(m)]
        local = [max(cost.local_cost(sum(sp.length for sp in p.pieces[k])) if k < p.num_microbatches else 0.0 for p in plans)
                 for k in range(m)]  # each contributor's own, side by side
        t = _simulate(attn, ffn, num_layers, cost.transfer, credits, local_layers, local)
        estimates.append((m, t))
        if t < best_t * (1 - min_gain):
            best, best_t = m, t
    return best, tuple(estimates)
