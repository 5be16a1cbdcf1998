"""Sampling with vLLM's definitions: everything before the draw is one batched pass over the step's
logits ``[S, V]``; only the draw itself is per request, each from its own random stream, so a seeded
request samples the same tokens whatever else is in its batch.

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

#: logits computed at once when scoring prompt positions (bounds the [rows, V] fp32 temporaries)
PROMPT_LOGITS_BYTES = 64 << 20


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


@dataclass(slots=True)
class PenaltyState:
    """What the penalties need of one request, kept as it generates (none for requests without penalties)."""

    output_counts: torch.Tensor  # [V] int32: occurrences of each token among the generated ones
    prompt_mask: torch.Tensor  # [V] bool: tokens of the prompt (the repetition penalty counts them too)

    @classmethod
    def start(cls, prompt_ids: Sequence[int], output_ids: Sequence[int], vocab_size: int) -> "PenaltyState":
        counts = torch.zeros(vocab_size, dtype=torch.int32)
        if output_ids:
            counts.index_put_((torch.tensor(output_ids),), torch.ones(len(output_ids), dtype=torch.int32), accumulate=True)
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[torch.tensor(prompt_ids, dtype=torch.long)] = True
        return cls(counts, mask)

    def add(self, token: int) -> None:
        self.output_counts[token] += 1


class SamplingRow(Protocol):
    """One request's view for sampling (an :class:`afd.engine.request.Request` is one)."""

    params: SamplingParams
    generator: torch.Generator
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
    # 3. penalties, over the penalized rows only
    if penalized:
        idx = _rows(penalized, dev)
        p = [rows[i].params for i in penalized]
        counts = torch.stack([rows[i].penalty.output_counts for i in penalized]).to(dev)  # [P, V] int32
        present = counts > 0
        x = out[idx]  # [P, V]
        rep = _column([q.repetition_penalty for q in p], dev)
        seen = present | torch.stack([rows[i].penalty.prompt_mask for i in penalized]).to(dev)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - _column([q.frequency_penalty for q in p], dev) * counts
        x = x - _column([q.presence_penalty for q in p], dev) * present
        out[idx] = x
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
        kth = x.sort(-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))  # [R, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if any(q.top_p < 1.0 for q in params):
        sorted_x, order = x.sort(-1, descending=True)
        probs = sorted_x.softmax(-1)
        # keep the smallest prefix reaching top_p; a row without top_p keeps all (rounding could make its
        # cumulative mass reach 1.0 before the tail)
        drop = probs.cumsum(-1) - probs >= _column([q.top_p if q.top_p < 1.0 else INF for q in params], dev)
        x = x.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))
    return x


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


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], eos_ids: frozenset[int]) -> list[int]:
    """logits [S, V] fp32 (one row per request, in ``rows`` order) -> one token id per request."""
    x = process_logits(logits, rows, eos_ids)
    tokens = x.argmax(-1).tolist()
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if sampled:
        probs = x[_rows(sampled, x.device)].softmax(-1).cpu()
        for j, i in enumerate(sampled):  # the draw: each request's own stream
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=rows[i].generator))
    return tokens


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
