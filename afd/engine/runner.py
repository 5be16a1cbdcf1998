"""Model runner: one forward of a flat batch over the paged KV cache."""

from __future__ import annotations

from typing import Sequence

import torch

from afd.config import CacheConfig
from afd.kvcache import PagedKVCache, SeqChunk, build_attention_metadata, last_token_rows
from afd.models.base import MoEModel, Observer


class ModelRunner:
    """Owns the model and its KV cache on one device. The monolithic reference executor."""

    def __init__(self, model: MoEModel, cache: CacheConfig, device: str | torch.device = "cpu") -> None:
        self.model = model
        self.cache_config = cache
        self.device = torch.device(device)
        dtype = model.model.embed_tokens.weight.dtype
        self.kv_cache = PagedKVCache(cache, model.config.num_layers, model.kv_layout(), dtype, self.device)

    @torch.inference_mode()
    def run(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], observer: Observer | None = None) -> torch.Tensor:
        """token_ids: the chunks' new tokens, concatenated in chunk order. Returns the last layer's hidden
        states [T, H] of every token (before the final norm: ``model.head`` applies it)."""
        meta = build_attention_metadata(chunks, self.cache_config.block_size, self.device)
        if len(token_ids) != meta.num_tokens:
            raise ValueError(f"{len(token_ids)} token ids for chunks holding {meta.num_tokens} tokens")
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.model(input_ids, meta, self.kv_cache, observer)

    def execute(self, token_ids: Sequence[int], chunks: Sequence[SeqChunk], observer: Observer | None = None) -> torch.Tensor:
        """Logits [S, V] fp32 of each chunk's last token."""
        return self.model.head(self.run(token_ids, chunks, observer)[last_token_rows(chunks)])
