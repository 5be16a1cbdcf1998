"""Qwen3-MoE: grouped-query attention with per-head q/k RMSNorm, softmax top-k routing.

:class:`GQAttention` also serves GLM-4.5 (:mod:`afd.models.glm4_moe`)."""

from __future__ import annotations

import torch
from torch import nn

from afd.config import ModelConfig
from afd.kvcache import AttentionMetadata
from afd.models.base import MoEModel
from afd.models.layers import Linear, RMSNorm, RotaryEmbedding
from afd.models.paged_attention import causal_attention, decode_attention, fresh_groups, fresh_rows, gather, prefill_attention, window_start


def output_gate(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's gated attention: the heads' output scaled by sigmoid(gate), in the model's dtype."""
    return out * torch.sigmoid(gate)


class GQAttention(nn.Module):
    """``attention_bias`` biases q/k/v, and o_proj too unless ``o_bias`` is False (GLM).

    ``config.qk_norm_span`` "head" normalises each head of q and k (Qwen3, GLM); "all" normalises the whole
    q and k projections before they are cut into heads (MiniMax-M2). ``config.attention_sinks`` adds one
    learned logit per head to the softmax (gpt-oss); ``config.window(layer)`` > 0 limits the layer to a
    sliding window. ``config.attention_output_gate`` (Qwen3-Next): q_proj yields each head's query then its gate,
    and the output is scaled by sigmoid(gate) before o_proj."""

    def __init__(self, config: ModelConfig, layer: int = 0, o_bias: bool = True) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.gated = config.attention_output_gate
        self.q_proj = Linear(h, self.num_heads * d * (2 if self.gated else 1), bias=bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=bias and o_bias)
        self.qk_norm = config.qk_norm_span if config.qk_norm else None  # "head", "all" or None
        if config.qk_norm:
            whole = config.qk_norm_span == "all"
            self.q_norm = RMSNorm(self.num_heads * d if whole else d, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.num_kv_heads * d if whole else d, config.rms_norm_eps)
        if config.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads))
        self.window = config.window(layer)
        self.scale = d**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k = self.q_proj(x), self.k_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(t, self.num_heads, 2 * d).split(d, dim=-1)
        if self.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.reshape(t, self.num_heads, d), k.view(t, self.num_kv_heads, d)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)  # [T, nh, d], [T, nkv, d]
        v = self.v_proj(x).view(t, self.num_kv_heads, d)

        k_cache, v_cache = kv  # [slots, nkv, d] each
        slots = meta.slots_for(self.window)  # a sliding layer with a pool of its own writes there
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        out = q.new_empty(t, self.num_heads, d)
        sinks = getattr(self, "sinks", None)
        pages = meta.decode_pages(self.window)
        if pages is not None:
            rows = pages.rows
            out[rows] = decode_attention(q[rows], k_cache, v_cache, pages, self.scale, sinks=sinks)
        # prompts that start their sequence, of one length, together (not with sinks, nor past a window: masks of their own)
        fits = (lambda chunk: sinks is None and (not self.window or chunk.length <= self.window))
        groups, rest = fresh_groups(meta.prefills, fits)
        for group in groups:
            rows, g = fresh_rows(meta.prefills, group, x.device), len(group)
            slots = torch.cat([self._key_slots(meta.prefills[n]) for n in group])
            keys, values = gather(k_cache, slots), gather(v_cache, slots)  # [G L, nkv, d]
            batched = (y.view(g, -1, *y.shape[1:]) for y in (q[rows], keys, values))
            out[rows] = causal_attention(*batched, self.scale).flatten(0, 1).to(out.dtype)
        for n in rest:
            chunk = meta.prefills[n]
            rows = slice(chunk.row, chunk.row + chunk.length)
            slots = self._key_slots(chunk)
            out[rows] = prefill_attention(q[rows], gather(k_cache, slots), gather(v_cache, slots), chunk.start, self.scale,
                                          self.window, sinks, window_start(chunk.start, self.window))
        out = out.reshape(t, self.num_heads * d)
        if gate is not None:
            out = output_gate(out, gate.reshape(t, self.num_heads * d))
        return self.o_proj(out)

    def _key_slots(self, chunk) -> torch.Tensor:
        """The cache slots of the keys a prefill chunk reads: a sliding layer's from its window on (its own pool's,
        where it has one)."""
        if self.window and chunk.window_slots is not None:
            return chunk.window_slots
        return chunk.slots[window_start(chunk.start, self.window):]


class Qwen3MoeModel(MoEModel):
    def make_attention(self, layer: int) -> nn.Module:
        return GQAttention(self.config, layer)

    def kv_layout(self) -> tuple[tuple[int, ...], ...]:
        c = self.config
        return ((c.num_kv_heads, c.head_dim), (c.num_kv_heads, c.head_dim))

