"""The pooled KV cache tensors: per layer, one tensor per cached component, indexed by slot."""

from __future__ import annotations

from typing import Sequence

import torch

from afd.config import CacheConfig


class PagedKVCache:
    """Per layer, tensors of shape ``[num_blocks * block_size, *component_shape]``; the ``window_layers``
    (sliding-window layers) hold ``num_window_blocks`` blocks instead when the cache has a window pool.

    The model says what one token caches (``kv_layout``): MLA caches one latent
    vector ``(kv_lora_rank + qk_rope_head_dim,)`` (and, with DeepSeek Sparse Attention, its index key);
    GQA caches ``k`` and ``v``, each ``(num_kv_heads, head_dim)``.
    """

    def __init__(
        self,
        cache: CacheConfig,
        num_layers: int,
        kv_layout: Sequence[tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        window_layers: Sequence[int] = (),
    ) -> None:
        self.config = cache
        windowed = set(window_layers) if cache.num_window_blocks else set()
        self.layers: list[tuple[torch.Tensor, ...]] = [
            tuple(torch.zeros((cache.num_window_blocks if i in windowed else cache.num_blocks) * cache.block_size, *shape,
                              dtype=dtype, device=device) for shape in kv_layout)
            for i in range(num_layers)
        ]

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.layers[i]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    @staticmethod
    def bytes_per_block(cache: CacheConfig, num_layers: int, kv_layout: Sequence[tuple[int, ...]], dtype: torch.dtype) -> int:
        per_token = sum(int(torch.Size(s).numel()) for s in kv_layout)
        return per_token * cache.block_size * num_layers * torch.empty((), dtype=dtype).element_size()
