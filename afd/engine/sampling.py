"""Sampling: greedy, temperature, top-k, top-p, each request drawing from its own random stream."""

from __future__ import annotations

import torch

from afd.config import SamplingParams


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits [V] fp32 -> one token id. Only ``generator`` is consumed, so batch mates never matter."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    scaled = logits.float().cpu() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        scaled[order[drop]] = float("-inf")
    probs = scaled.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The model's log-probability of ``token`` and its ``n`` most likely tokens, from the raw logits
    (before temperature, top-k or top-p: what the model thinks, not what the sampler was allowed)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if n:
        values, ids = torch.topk(lp, n)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return float(lp[token]), top
