"""DeepSeek-V2 family (DeepSeek-V2-Lite layout): multi-head latent attention over a latent KV cache.

The cache holds, per token, the normalised KV latent ``c_kv [kv_lora_rank]`` and
the rotated shared key ``k_pe [qk_rope_head_dim]``. Attention runs in the
absorbed form: ``W_UK`` is folded into the query and ``W_UV`` applied after the
softmax, so keys and values are never decompressed per cached token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afd.config import ModelConfig
from afd.kvcache import AttentionMetadata
from afd.models.base import MoEModel
from afd.models.layers import RMSNorm, RotaryEmbedding


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.mla = mla
        self.num_heads = config.num_heads
        h, nh, bias = config.hidden_size, config.num_heads, config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, nh * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, nh * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * mla.v_head_dim, h, bias=bias)
        self.scale = mla.qk_head_dim**-0.5 * config.rope.softmax_scale_multiplier()

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        mla, nh = self.mla, self.num_heads
        t = x.shape[0]
        q = self.q_proj(x) if mla.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, nh, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        q_pe = rope.apply(q_pe, cos, sin)  # [T, nh, dr]
        k_pe = rope.apply(k_pe[:, None, :], cos, sin)[:, 0]  # [T, dr]

        (cache,) = kv  # [slots, R + dr]
        cache[meta.slot_mapping] = torch.cat((latent, k_pe), dim=-1).to(cache.dtype)
        ctx = cache[meta.gather_slots]  # [S, L, R + dr]

        w_kv_b = self.kv_b_proj.weight.view(nh, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = w_kv_b.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)  # [nh, dn, R], [nh, dv, R]
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, nh, R]
        query = meta.pad(torch.cat((q_latent, q_pe), dim=-1)).transpose(1, 2)  # [S, nh, Q, R + dr]
        s, q_len = query.shape[0], query.shape[2]
        # one latent key and value shared by every head (MQA in the latent space): fold the heads into
        # the query axis, [S, 1, nh*Q, R + dr], so the keys are read once instead of expanded per head
        query = query.reshape(s, 1, nh * q_len, -1)
        key = ctx[:, None]  # [S, 1, L, R + dr]
        value = ctx[:, None, :, : mla.kv_lora_rank]  # [S, 1, L, R]
        mask = meta.mask.repeat(1, 1, nh, 1)  # row h*Q + q is query q of head h
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scale)
        out_latent = meta.unpad(out.reshape(s, nh, q_len, -1).transpose(1, 2))  # [T, nh, R]
        out = torch.einsum("thr,hvr->thv", out_latent, w_uv).reshape(t, nh * mla.v_head_dim)
        return self.o_proj(out)


class DeepseekV2Model(MoEModel):
    def make_attention(self, layer: int) -> nn.Module:
        return MLAttention(self.config)

    def kv_layout(self) -> tuple[tuple[int, ...], ...]:
        mla = self.config.mla
        return ((mla.kv_lora_rank + mla.qk_rope_head_dim,),)
