"""The pooled KV cache tensors: per layer, one tensor per cached component, indexed by slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from afd.config import CacheConfig
from afd.kvcache.metadata import rows_per_block


@dataclass(frozen=True)
class CacheTensor:
    """One tensor of a layer whose cache is more than per-token KV (DeepSeek-V4): ``shape`` per row; a row per
    token of the window pool (``window``), or a row per ``rate`` tokens of the full pool (compressed entries)."""

    shape: tuple[int, ...]
    window: bool = False
    rate: int = 1

    def rows(self, cache: CacheConfig) -> int:
        blocks = cache.num_window_blocks if self.window else cache.num_blocks
        return blocks * rows_per_block(self.rate, cache.block_size)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return rows_per_block(self.rate, block_size) * int(torch.Size(self.shape).numel()) * dtype.itemsize


def layout_bytes(layouts: Sequence[Sequence[CacheTensor]], block_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per full-pool block, bytes per window-pool block) of every layer's ``layouts``."""
    full = sum(t.bytes_per_block(block_size, dtype) for layout in layouts for t in layout if not t.window)
    window = sum(t.bytes_per_block(block_size, dtype) for layout in layouts for t in layout if t.window)
    return full, window


class PagedKVCache:
    """Per layer, tensors of shape ``[num_blocks * block_size, *component_shape]``; the ``window_layers``
    (sliding-window layers) hold ``num_window_blocks`` blocks instead when the cache has a window pool.
    The ``state_layers`` (linear attention) hold no KV: per state slot, the tensors of ``state_layout`` (the
    conv state in ``dtype``, the recurrent state in the cache's ``state_dtype``), ``[num_state_slots, *shape]``.

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
        state_layers: Sequence[int] = (),
        state_layout: Sequence[tuple[int, ...]] = (),
        layouts: Sequence[Sequence[CacheTensor]] | None = None,
    ) -> None:
        self.config = cache
        if layouts is not None:  # per layer, what the model says (DeepSeek-V4)
            if not cache.num_window_blocks and any(t.window for layout in layouts for t in layout):
                raise ValueError("this model keeps its windows in a window pool: CacheConfig.num_window_blocks must be > 0")
            self.layers = [tuple(torch.zeros(t.rows(cache), *t.shape, dtype=dtype, device=device) for t in layout) for layout in layouts]
            return
        windowed = set(window_layers) if cache.num_window_blocks else set()
        if state_layers and not cache.num_state_slots:
            raise ValueError("a model with linear-attention layers needs state slots (CacheConfig.num_state_slots)")
        dtypes = self.state_dtypes(cache, dtype, len(state_layout))
        self.layers: list[tuple[torch.Tensor, ...]] = [
            tuple(torch.zeros(cache.num_state_slots, *shape, dtype=d, device=device) for shape, d in zip(state_layout, dtypes))
            if i in state_layers else
            tuple(torch.zeros((cache.num_window_blocks if i in windowed else cache.num_blocks) * cache.block_size, *shape,
                              dtype=dtype, device=device) for shape in kv_layout)
            for i in range(num_layers)
        ]

    @staticmethod
    def state_dtypes(cache: CacheConfig, dtype: torch.dtype, n: int) -> tuple[torch.dtype, ...]:
        """The conv state (the first) in the model's dtype, the recurrent one (the last) in the state dtype."""
        recurrent = torch.float32 if cache.state_dtype == "float32" else dtype
        return tuple(recurrent if i == n - 1 else dtype for i in range(n))

    @classmethod
    def for_model(cls, model, cache: CacheConfig, device: torch.device | str = "cpu") -> "PagedKVCache":
        """The cache of a model (an ``afd.models.MoEModel``): its KV layout, sliding and linear-attention layers."""
        c = model.config
        return cls(cache, c.num_layers, model.kv_layout(), model.model.embed_tokens.weight.dtype, device, c.sliding_layers,
                   c.linear.layers if c.linear is not None else (), model.state_layout(), model.cache_layouts())

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.layers[i]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    @staticmethod
    def bytes_per_block(cache: CacheConfig, num_layers: int, kv_layout: Sequence[tuple[int, ...]], dtype: torch.dtype) -> int:
        """One block of ``num_layers`` KV layers."""
        per_token = sum(int(torch.Size(s).numel()) for s in kv_layout)
        return per_token * cache.block_size * num_layers * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def bytes_per_slot(cls, cache: CacheConfig, num_layers: int, state_layout: Sequence[tuple[int, ...]], dtype: torch.dtype) -> int:
        """One state slot of ``num_layers`` linear-attention layers."""
        dtypes = cls.state_dtypes(cache, dtype, len(state_layout))
        return num_layers * sum(int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size() for s, d in zip(state_layout, dtypes))
