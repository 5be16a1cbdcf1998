"""The ``auto`` planner's costs, learned from the run's own steps.

``--num-microbatches auto`` chooses m per step by simulating the schedule with a :class:`CostModel`
(:func:`afd.microbatch.planner.choose_microbatches`). A model fitted offline (``afd bench costs``) or the built-in
relative defaults describe another machine, another load, another connector; this learner replaces them
with what the run measures, in seconds, once it has seen enough:

* **attention side**, per micro-batch and layer: the attention rank's own work on it (attention, routing,
  packing the dispatch, merging the answer), fitted as ``attn_call + attn_token * tokens +
  attn_context * sum(position + 1)`` -- least squares with every coefficient >= 0;
* **local layers**, per micro-batch and leading dense layer whose MLP runs on the attention rank: that MLP's time,
  fitted as ``local_call + local_token * tokens`` and kept out of the attention fit: it happens once per micro-batch
  at the front of the step (the pipeline's fill), not in every layer;
* **FFN side**, per micro-batch and layer: the time the FFN rank computed the micro-batch's *union* (every
  contributor's rows), which each RESULT header carries (``busy_us``; the slowest FFN rank when several
  answer). Kept as a curve of medians by size class (powers of two of the union's tokens), the planner
  interpolating between them: the FFN side's cost is not linear (expert weights are read once per
  micro-batch whatever its size), and a curve says so without a model of it;
* **transfer**, one way: half of (round trip - FFN compute), its 20th percentile (a round trip waits
  behind other micro-batches' work at times; its fast ones are the wire's).

The model exists once it has ``min_steps`` steps, two size classes of FFN work and a round trip; until then
the planner uses the configured model. Every attention rank learns its own, and the step agreement uses
one (afd/attention/steps.py: the lowest member's), so that every member plans alike. Pure Python.
"""

from __future__ import annotations

from collections import deque
from itertools import combinations
from statistics import median
from typing import Sequence

from afd.config import CostModel

WINDOW = 256  # observations kept per kind (older ones drop out: the costs may drift with the load)
CLASS_WINDOW = 32  # FFN observations kept per size class
WARMUP_STEPS = 2  # the first steps (allocation, first-touch of the weights) are not learned from
MIN_STEPS = 8
REFIT_EVERY = 16  # steps between fits


class CostLearner:
    def __init__(self, min_steps: int = MIN_STEPS, refit_every: int = REFIT_EVERY, warmup: int = WARMUP_STEPS) -> None:
        self.min_steps, self.refit_every, self.warmup = min_steps, refit_every, warmup
        self.attention: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)  # (tokens, context, seconds per layer)
        self.local: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (tokens, seconds per local layer)
        self.ffn: dict[int, deque[tuple[int, float]]] = {}  # size class -> (union tokens, seconds per layer)
        self.transfer: deque[float] = deque(maxlen=WINDOW)
        self.steps = 0  # steps observed (warm-up included)
        self.model: CostModel | None = None
        self.fits = 0
        self._since_fit = 0

    def observe(self, attention: Sequence[tuple[int, float, float]], ffn: Sequence[tuple[int, float]], transfer: Sequence[float],
                local: Sequence[tuple[int, float]] = ()) -> None:
        """One step: per micro-batch with rows here, (tokens, sum of (position + 1), attention-side seconds per
        layer, its local layers' FFN half left out); per micro-batch that went to the FFN side, (union tokens, FFN
        seconds per layer); one-way transfer estimates in seconds; per micro-batch with rows here, (tokens, seconds
        per local layer) where the model has local layers."""
        self.steps += 1
        if self.steps <= self.warmup:
            return
        self.attention.extend((float(n), float(c), s) for n, c, s in attention)
        for n, s in ffn:
            if n > 0:
                self.ffn.setdefault(n.bit_length(), deque(maxlen=CLASS_WINDOW)).append((n, s))
        self.transfer.extend(max(0.0, t) for t in transfer)
        self.local.extend((float(n), s) for n, s in local if n > 0)
        self._since_fit += 1
        learned = self.steps - self.warmup
        if (self.model is None and learned >= self.min_steps) or self._since_fit >= self.refit_every:
            self.model = self.fit()
            self._since_fit = 0

    def fit(self) -> CostModel | None:
        """The model from what is kept now (None: not enough seen yet)."""
        if len(self.attention) < self.min_steps or len(self.ffn) < 2 or not self.transfer:
            return None
        attn_call, attn_token, attn_context = nonnegative_least_squares([(1.0, n, c) for n, c, _ in self.attention],
                                                                        [s for *_, s in self.attention])
        curve = tuple((round(median(n for n, _ in obs)), median(s for _, s in obs)) for _, obs in sorted(self.ffn.items()))
        flat = [o for obs in self.ffn.values() for o in obs]
        ffn_call, ffn_token = nonnegative_least_squares([(1.0, float(n)) for n, _ in flat], [s for _, s in flat])
        if max(attn_token, attn_context, ffn_token) <= 0:
            return None  # times that do not grow with the work: nothing to plan with
        local_call, local_token = nonnegative_least_squares([(1.0, n) for n, _ in self.local], [s for _, s in self.local]) \
            if self.local else (0.0, 0.0)
        self.fits += 1
        return CostModel(attn_token, attn_context, ffn_token, attn_call, ffn_call, transfer=_quantile(self.transfer, 0.2),
                         ffn_curve=curve, local_token=local_token, local_call=local_call)


def nonnegative_least_squares(rows: Sequence[Sequence[float]], y: Sequence[float]) -> tuple[float, ...]:
    """argmin ||X b - y|| over b >= 0, for a few columns: the best unconstrained fit over every support whose
    solution is non-negative (the optimum is one of them). Columns are scaled to unit size first; the normal
    equations are formed once and every support reads its part of them."""
    k = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    x = [[r[j] / scale[j] for j in range(k)] for r in rows]
    gram = [[sum(r[i] * r[j] for r in x) for j in range(k)] for i in range(k)]
    xy = [sum(r[i] * v for r, v in zip(x, y)) for i in range(k)]
    best, best_err = [0.0] * k, 0.0  # err relative to ||y||^2: b = 0 leaves it all
    for size in range(1, k + 1):
        for support in combinations(range(k), size):
            b = _solve([[gram[i][j] for j in support] for i in support], [xy[i] for i in support])
            if b is None or min(b) < 0:
                continue
            err = sum(b[p] * b[q] * gram[i][j] for p, i in enumerate(support) for q, j in enumerate(support)) \
                - 2 * sum(bp * xy[i] for bp, i in zip(b, support))
            if err < best_err:
                best, best_err = [0.0] * k, err
                for j, bj in zip(support, b):
                    best[j] = bj
    return tuple(b / s for b, s in zip(best, scale))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    norm = max(abs(v) for row in a for v in row) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * norm:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][c] * out[c] for c in range(r + 1, n))) / m[r][r]
    return out


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def pack_costs(cost: CostModel | None) -> list | None:
    """A learned model as JSON-able numbers (a step vote carries it)."""
    if cost is None:
        return None
    return [cost.attn_token, cost.attn_context, cost.ffn_token, cost.attn_call, cost.ffn_call, cost.transfer,
            [[n, c] for n, c in cost.ffn_curve], cost.local_token, cost.local_call]


def unpack_costs(fields: list | None) -> CostModel | None:
    if fields is None:
        return None
    *coefficients, curve, local_token, local_call = fields
    return CostModel(*(float(c) for c in coefficients), ffn_curve=tuple((int(n), float(c)) for n, c in curve),
                     local_token=float(local_token), local_call=float(local_call))
