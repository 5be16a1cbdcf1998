"""Response pieces: log-probabilities in the completions (legacy) and chat formats, and vLLM's
``prompt_logprobs``. JSON has no -inf: a log-probability below -9999 is sent as -9999, as OpenAI and
vLLM do."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterable, NamedTuple, Sequence

from afd.engine.request import TokenDelta
from afd.engine.sampling import PositionLogprobs

LOGPROB_FLOOR = -9999.0


class Scored(NamedTuple):
    """One token of a response's logprobs: its id, its log-probability (None: the first prompt token,
    which nothing predicts) and the most likely tokens at its position."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def token_texts(tokenizer, as_ids: bool) -> Callable[[int], str]:
    """token id -> its text in logprobs (special tokens included), or ``token_id:N`` with
    ``return_tokens_as_token_ids``."""
    if as_ids:
        return lambda t: f"token_id:{t}"

    @lru_cache(maxsize=65536)
    def text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    return text


def generated(deltas: Iterable[TokenDelta]) -> list[Scored]:
    return [Scored(d.token_id, d.logprob, d.top_logprobs) for d in deltas if d.token_id is not None]


def prompt_scored(prompt_ids: Sequence[int], logprobs: Sequence[PositionLogprobs | None]) -> list[Scored]:
    return [Scored(t, None, ()) if lp is None else Scored(t, lp.logprob, lp.top) for t, lp in zip(prompt_ids, logprobs)]


def completion_logprobs(items: Sequence[Scored], n: int, text: Callable[[int], str], offset: int) -> tuple[dict, int]:
    """The legacy format: tokens, their log-probabilities, text offsets, and for each token a dict of
    that token and the ``n`` most likely (so up to n + 1 entries, as OpenAI documents). Returns the
    body and the offset after the last token."""
    out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token, logprob, top in items:
        t = text(token)
        out["tokens"].append(t)
        out["text_offset"].append(offset)
        offset += len(t)
        if logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(logprob))
        entries = {t: _lp(logprob)}
        for tid, v in top[:n]:
            entries.setdefault(text(tid), _lp(v))
        out["top_logprobs"].append(entries)
    return out, offset


def chat_logprobs(items: Sequence[Scored], text: Callable[[int], str]) -> dict:
    def entry(t: int, lp: float) -> dict:
        s = text(t)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode())}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]} for t, lp, top in items]}


def vllm_prompt_logprobs(logprobs: Sequence[PositionLogprobs | None], n: int, text: Callable[[int], str]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else {token id: {logprob, rank,
    decoded_token}} for the token itself and the ``n`` most likely."""
    out: list[dict | None] = []
    for lp in logprobs:
        if lp is None:
            out.append(None)
            continue
        entries = {str(lp.token_id): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": text(lp.token_id)}}
        for rank, (tid, v) in enumerate(lp.top[:n], start=1):
            entries.setdefault(str(tid), {"logprob": _lp(v), "rank": rank, "decoded_token": text(tid)})
        out.append(entries)
    return out
