"""The runner protocol an engine steps through, and the monolithic model runner.

An :class:`~afd.engine.llm_engine.LLMEngine` runs every step through a :class:`Runner`: the
:class:`ModelRunner` here (the whole model on one device: the monolithic reference), or an attention
rank's ``DisaggregatedRunner`` (afd/attention/disagg_runner.py: the FFN halves over the connector, the
steps agreed with the other attention ranks). The engine knows nothing else of either.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from afd.config import CacheConfig
from afd.kvcache import PagedKVCache, SeqChunk, build_attention_metadata, last_token_rows
from afd.models.base import MoEModel, Observer


class Waves(Protocol):
    """The agreed steps of a replica that steps together with others (afd/attention/steps.py). While a
    wave goes on, the replica steps every agreed step, with work or without (:meth:`Runner.idle`)."""

    @property
    def in_wave(self) -> bool: ...

    @property
    def wants_wave(self) -> bool:
        """Something other than work needs a wave (a restarted peer waits to be voted in)."""

    @property
    def waves_done(self) -> int: ...

    def join_wave(self, wave: int) -> bool:
        """Join wave ``wave`` unless it is done already; True if joined."""


class Runner(Protocol):
    """What an engine needs of whatever executes its steps."""

    #: the agreed steps this replica takes part in; None: it steps alone, whenever it has work
    waves: Waves | None

    def run(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], observer: Observer | None = None) -> torch.Tensor:
        """One step: the last layer's hidden states [T, H] of every token, in batch order."""

    def idle(self) -> None:
        """An agreed step with no work here (only with ``waves``)."""

    def maintain(self) -> None:
        """Between steps, and while idle: work that must go on without a step (linking a replacement)."""


class ModelRunner:
    """Owns the model and its KV cache on one device. The monolithic reference executor."""

    waves = None  # it steps alone

    def __init__(self, model: MoEModel, cache: CacheConfig, device: str | torch.device = "cpu") -> None:
        self.model = model
        self.cache_config = cache
        self.device = torch.device(device)
        self.kv_cache = PagedKVCache.for_model(model, cache, self.device)

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], observer: Observer | None = None) -> torch.Tensor:
        """token_ids: the chunks' new tokens, concatenated in chunk order. Returns the last layer's hidden
        states [T, H] of every token (before the final norm: ``model.head`` applies it)."""
        meta = build_attention_metadata(chunks, self.cache_config.block_size, self.device, windows=self.model.config.windows,
                                            rates=self.model.config.compression_rates)
        if len(token_ids) != meta.num_tokens:
            raise ValueError(f"{len(token_ids)} token ids for chunks holding {meta.num_tokens} tokens")
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.model(input_ids, meta, self.kv_cache, observer)

    def execute(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], observer: Observer | None = None) -> torch.Tensor:
        """Logits [S, V] fp32 of each chunk's last token."""
        return self.model.head(self.run(token_ids, chunks, observer)[last_token_rows(chunks)])

    def idle(self) -> None:
        raise RuntimeError("a monolithic engine steps alone: it has no agreed step to sit out")

    def maintain(self) -> None:
        """Nothing goes on between a monolithic engine's steps."""
