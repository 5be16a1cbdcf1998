"""Sampling with vLLM's definitions: everything before the draw is one batched pass over the step's
logits ``[S, V]``. The draw is one batched call for the requests without a seed (from the engine's
stream), and per request for those with one, each from its own stream, so a seeded request samples
the same tokens whatever else is in its batch.

Before the draw, in vLLM's order:

1. ``min_tokens``: while a request has fewer tokens, its stop tokens (EOS unless ``ignore_eos``, and
   ``stop_token_ids``) are masked to -inf;
2. ``logit_bias`` is added;
3. penalties: ``repetition_penalty`` r divides positive and multiplies negative logits of every token in
   the prompt or the output; ``frequency_penalty`` is subtracted once per occurrence in the output,
   ``presence_penalty`` once for a token present in the output;
4. greedy requests take the argmax here; the others go on with temperature, then ``min_p`` (drop
   tokens below min_p x the top probability), ``top_k`` and ``top_p``.

Log-probabilities are always the raw model's (before any of this), as the API documents them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

import torch

from afd.config import SamplingParams

INF = float("inf")

#: top_p searches its cut among this many most likely tokens first (see _top_p_drop)
TOP_P_CANDIDATES = 1024

#: logits computed at once when scoring prompt positions (bounds the [rows, V] fp32 temporaries)
PROMPT_LOGITS_BYTES = 64 << 20


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


_MASK63 = (1 << 63) - 1


def token_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's draw of output token ``index``: a pure function of (seed, index)
    (splitmix64-style mixing), so a request resumed elsewhere with its first ``index`` tokens draws the
    rest exactly as it would have."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


@dataclass(slots=True)
class PenaltyState:
    """What the penalties need of one request, kept as it generates (none for requests without
    penalties). Penalties touch only tokens the request has seen, so they are applied there alone:
    O(seen tokens) per step, not O(V)."""

    output_counts: torch.Tensor  # [V] int32: occurrences of each token among the generated ones
    in_prompt: torch.Tensor  # [V] bool
    seen: torch.Tensor  # [n] int64: the distinct tokens of the prompt and the output, in no order

    @classmethod
    def start(cls, prompt_ids: Sequence[int], output_ids: Sequence[int], vocab_size: int) -> "PenaltyState":
        counts = torch.zeros(vocab_size, dtype=torch.int32)
        if output_ids:
            counts.index_put_((torch.tensor(output_ids),), torch.ones(len(output_ids), dtype=torch.int32), accumulate=True)
        in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
        in_prompt[torch.tensor(prompt_ids, dtype=torch.long)] = True
        return cls(counts, in_prompt, (in_prompt | (counts > 0)).nonzero().squeeze(1))

    def add(self, token: int) -> None:
        if not (self.output_counts[token] or self.in_prompt[token]):
            self.seen = torch.cat([self.seen, torch.tensor([token])])
        self.output_counts[token] += 1


class SamplingRow(Protocol):
    """One request's view for sampling (an :class:`afd.engine.request.Request` is one)."""

    params: SamplingParams
    generator: torch.Generator | None  # its own stream when it has a seed; None: the engine's
    output_ids: list[int]
    penalty: PenaltyState | None


class PositionLogprobs(NamedTuple):
    """The model's log-probability of one token at one position, its rank (1: the most likely) and the
    ``n`` most likely tokens there as (token id, log-probability)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def _rows(indices: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(indices, dtype=torch.long, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def apply_processors(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_ids: frozenset[int]) -> torch.Tensor:
    """Steps 1-3 (min_tokens, logit_bias, penalties) on logits [S, V] fp32 -> new logits [S, V];
    the input is left as it is (it is the raw distribution the logprobs come from)."""
    out = logits
    dev = logits.device
    # 1. min_tokens: (row, token) pairs of the stop tokens still forbidden
    pairs = [(i, t) for i, r in enumerate(rows) if len(r.output_ids) < r.params.min_tokens
             for t in _stop_ids(r.params, eos_ids)]
    # 2. logit_bias: (row, token, bias)
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
    penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not (pairs or bias or penalized):
        return out
    out = logits.clone()
    if pairs:
        out[_rows([i for i, _ in pairs], dev), _rows([t for _, t in pairs], dev)] = float("-inf")
    if bias:
        out.index_put_((_rows([i for i, _, _ in bias], dev), _rows([t for _, t, _ in bias], dev)),
                       torch.tensor([b for _, _, b in bias], dtype=out.dtype, device=dev), accumulate=True)
    # 3. penalties, over each penalized row's seen tokens only (elsewhere they change nothing)
    if penalized:
        states = [rows[i].penalty for i in penalized]
        lens = torch.tensor([len(st.seen) for st in states])
        where_row = _rows(penalized, dev).repeat_interleave(lens.to(dev))  # [N]
        ids = torch.cat([st.seen for st in states]).to(dev)  # [N]
        counts = torch.cat([st.output_counts[st.seen] for st in states]).to(dev, torch.float32)  # [N]

        def per_token(name: str) -> torch.Tensor:
            return torch.tensor([getattr(rows[i].params, name) for i in penalized], dtype=torch.float32).repeat_interleave(lens).to(dev)

        x = out[where_row, ids]
        rep = per_token("repetition_penalty")
        x = torch.where(x > 0, x / rep, x * rep)  # every seen token: prompt or output
        x = x - per_token("frequency_penalty") * counts - per_token("presence_penalty") * (counts > 0)
        out[where_row, ids] = x
    return out


def _stop_ids(params: SamplingParams, eos_ids: frozenset[int]) -> tuple[int, ...]:
    return tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos_ids))


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Step 4 for sampled (non-greedy) rows: logits [R, V] -> temperature-scaled logits with what
    ``min_p``, ``top_k`` and ``top_p`` drop set to -inf. Their softmax is the distribution drawn from."""
    dev = logits.device
    x = logits / _column([q.temperature for q in params], dev)
    if any(q.min_p > 0 for q in params):
        probs = x.softmax(-1)
        floor = probs.amax(-1, keepdim=True) * _column([q.min_p for q in params], dev)
        x = x.masked_fill(probs < floor, float("-inf"))
    vocab = x.shape[-1]
    if any(0 < q.top_k < vocab for q in params):
        k = torch.tensor([q.top_k if 0 < q.top_k < vocab else vocab for q in params], device=dev)
        kth = x.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))  # [R, 1]; a topk, not a sort of V
        x = x.masked_fill(x < kth, float("-inf"))
    nucleus = [i for i, q in enumerate(params) if q.top_p < 1.0]
    if nucleus:
        idx = _rows(nucleus, dev)
        x[idx] = x[idx].masked_fill(_top_p_drop(x[idx], _column([params[i].top_p for i in nucleus], dev)), float("-inf"))
    return x


def _top_p_drop(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x [R, V], top_p [R, 1] -> [R, V] bool: what the smallest set of most likely tokens whose mass
    reaches top_p leaves out. The cut is searched among the TOP_P_CANDIDATES most likely tokens (a topk,
    not a sort of V: 30x cheaper at V = 102400); rows whose mass lies beyond them are sorted in full."""
    probs = x.softmax(-1)
    n = min(x.shape[-1], TOP_P_CANDIDATES)
    cand, order = probs.topk(n, dim=-1)  # [R, n], descending
    cum = cand.cumsum(-1)
    drop = torch.ones_like(probs, dtype=torch.bool).scatter_(1, order, cum - cand >= top_p)  # beyond the candidates: left out
    short = (cum[:, -1:] < top_p).squeeze(1).nonzero().squeeze(1)
    if short.numel():
        sorted_p, full = probs[short].sort(-1, descending=True)
        drop[short] = torch.zeros_like(sorted_p, dtype=torch.bool).scatter_(1, full, sorted_p.cumsum(-1) - sorted_p >= top_p[short])
    return drop


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_ids: frozenset[int]) -> torch.Tensor:
    """Everything before the draw, logits [S, V] in, logits [S, V] out: a greedy row's argmax and a
    sampled row's softmax are what :func:`sample` takes."""
    x = apply_processors(logits, rows, eos_ids)
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if sampled:
        x = x.clone() if x is logits else x
        idx = _rows(sampled, x.device)
        x[idx] = apply_filters(x[idx], [rows[i].params for i in sampled])
    return x


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_ids: frozenset[int], shared: torch.Generator | None = None) -> list[int]:
    """logits [S, V] fp32 (one row per request, in ``rows`` order) -> one token id per request. Rows
    without a generator of their own draw together from ``shared``."""
    x = process_logits(logits, rows, eos_ids)
    tokens = x.argmax(-1).tolist()
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if sampled:
        probs = x[_rows(sampled, x.device)].softmax(-1).cpu()
        together = [j for j, i in enumerate(sampled) if rows[i].generator is None]
        if together:  # one draw for every row on the engine's stream
            for j, token in zip(together, draw(probs[together], torch.rand(len(together), generator=shared))):
                tokens[sampled[j]] = token
        for j, i in enumerate(sampled):  # each seeded request from its own seed per token, over the row's support only
            r = rows[i]
            if r.generator is not None:
                if r.params.seed is not None:  # a request's seed: one per token, so a resumed request draws on unchanged
                    r.generator.manual_seed(token_seed(r.params.seed, len(r.output_ids)))
                # the exponential race (multinomial), not draw(): the inverse transform flipped a seeded stream
                # between batch sizes (rounding moved a cumulative-sum boundary; tests/serving/test_replica_failover.py),
                # and a seeded request's text must not depend on its batch
                support = probs[j].nonzero().squeeze(1)
                tokens[i] = int(support[torch.multinomial(probs[j, support], 1, generator=r.generator)])
    return tokens


def draw(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """One token per row of probs [S, V] by inverse transform: the first token whose cumulative probability
    exceeds u [S] (uniform in [0, 1)) times the row's total. A token of probability 0 is never drawn (its
    interval is empty). One uniform per row: ~20x faster on CPU than ``torch.multinomial``, which draws an
    exponential per vocabulary entry (5 ms for 32 rows of 4096 here). For the unseeded draws only: a
    rounding change of a cumulative sum (logits differ in the last bits from batch to batch) can move the
    token drawn, and a seeded request's text must not depend on its batch."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, u.to(cdf.dtype)[:, None] * total, side="right")
    last = torch.searchsorted(cdf, total, side="left")  # the last token of nonzero probability (u * total rounded up to total)
    return torch.minimum(picked, last).squeeze(1).tolist()


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, n: int) -> list[PositionLogprobs]:
    """Raw log-probabilities: logits [N, V], tokens [N] int64 -> each token's log-probability and rank,
    and the ``n`` most likely tokens of its row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.unsqueeze(1))  # [N, 1]
    ranks = (lp > chosen).sum(-1) + 1
    if n:
        values, ids = lp.topk(n, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [PositionLogprobs(t, c, r, top) for t, c, r, top in zip(tokens.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), tops)]
