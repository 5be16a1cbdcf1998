"""A generation request and its progress through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from afd.config import SamplingParams
from afd.engine.sampling import PenaltyState, PositionLogprobs
from afd.engine.detokenizer import OutputText


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    request_id: int
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None  # its own random stream when it has a seed (None: the engine's)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    tag: int = -1  # the caller's name for it (captures are keyed by it); defaults to request_id
    text: OutputText | None = None  # its output text, when the engine detokenizes (offline; a server's front end does)
    penalty: PenaltyState | None = None  # token counts, for requests with penalties (from their first sample)
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # per prompt token (the first: None), when asked

    @property
    def output_text(self) -> str:
        return self.text.text if self.text is not None else ""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache (the whole prompt at first, one per decode step)."""
        return self.num_tokens - self.num_computed


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: int
    prompt: str
    prompt_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What one step produced for one request: a token, the text it made visible, and, on the last one,
    why the request ended. Streaming servers send these; ``text`` pieces concatenate to the final text.
    A request's first delta carries its prompt logprobs when it asked for them; with ``max_tokens`` 0
    that is its only delta, and it has no token (``token_id`` None)."""

    request_id: int
    tag: int
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    stop_reason: int | str | None = None
    prompt_logprobs: tuple[PositionLogprobs | None, ...] | None = None
