"""DeepSeek-V2 family (DeepSeek-V2-Lite layout): multi-head latent attention over a latent KV cache.

The cache holds, per token, the normalised KV latent ``c_kv [kv_lora_rank]`` and
the rotated shared key ``k_pe [qk_rope_head_dim]``. Decode runs in the absorbed
form: ``W_UK`` is folded into the query and ``W_UV`` applied after the softmax,
so keys and values are never decompressed per cached token. A prefill chunk
takes whichever form costs fewer multiply-adds (:meth:`MLAttention._absorbed_is_cheaper`):
a long one decompresses its context's keys and values once and attends at head
dimension dn + dr instead of R + dr, as vLLM and SGLang do.

DeepSeek-V3.2 and GLM-5 add DeepSeek Sparse Attention (:mod:`afd.models.sparse_attention`): each query
attends only to the positions its layer's indexer selects; the absorbed decode reads just those.
"""

from __future__ import annotations

import torch
from torch import nn

from afd.config import ModelConfig
from afd.kvcache import AttentionMetadata
from afd.models.base import MoEModel
from afd.models.layers import Linear, RMSNorm, RotaryEmbedding
from afd.models.paged_attention import causal_attention, decode_attention, fresh_groups, fresh_rows, gather, native_mla, prefill_attention
from afd.models.sparse_attention import STATE_KEY, Indexer, Selection, gathered


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.mla = mla
        self.num_heads = config.num_heads
        h, nh, bias = config.hidden_size, config.num_heads, config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = Linear(h, nh * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(h, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank)
            self.q_b_proj = Linear(mla.q_lora_rank, nh * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank)
        self.kv_b_proj = Linear(mla.kv_lora_rank, nh * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = Linear(nh * mla.v_head_dim, h, bias=bias)
        self.scale = mla.qk_head_dim**-0.5 * config.rope.softmax_scale_multiplier()
        dsa = config.dsa
        self.sparse = dsa is not None  # DeepSeek Sparse Attention: attend to the indexer's selection
        if dsa is not None and layer not in dsa.shared_layers:
            self.indexer = Indexer(config)  # shared layers (GLM-5) have none: they reuse the previous selection

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
        q_latent = None if mla.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_proj(x) if q_latent is None else self.q_b_proj(q_latent)
        q = q.view(t, nh, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        q_pe = q_pe.copy_(rope.apply(q_pe, cos, sin))  # [T, nh, dr], rotated in q: q is then the whole query
        k_pe = rope.apply(k_pe[:, None, :], cos, sin)[:, 0]  # [T, dr]

        cache = kv[0]  # [slots, R + dr]: the latent and the rotated shared key of every cached token
        cache.index_copy_(0, meta.slot_mapping, torch.cat((latent, k_pe), dim=-1).to(cache.dtype))
        selection = self._select(x, q_latent, rope, cos, sin, kv, meta) if self.sparse else None
        w_kv_b = self.kv_b_proj.weight.view(nh, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = w_kv_b.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)  # [nh, dn, R], [nh, dv, R]
        out = x.new_empty(t, nh, mla.v_head_dim)  # [T, nh, dv]
        kernels = native_mla(q, cache, w_kv_b) if selection is None else None
        if meta.decode is not None and kernels is not None:  # the absorbed decode below in one native call
            pages = meta.decode
            out[pages.rows] = kernels.mla_decode(q_nope[pages.rows], q_pe[pages.rows], w_kv_b, cache, pages.block_tables,
                                                 pages.context_lens, pages.block_size, self.scale, pages.window)
        elif meta.decode is not None:  # absorbed: one latent key and value shared by every head
            rows = meta.decode.rows
            keys, pages = cache, meta.decode
            if selection is not None:  # sparse: the selected latents only, gathered
                keys, pages = gathered(cache, *selection.decode, rows)
            # per head: q_nope W_UK, as one bmm over heads (an einsum adds permuted copies: ~40 % slower here)
            query = torch.cat((torch.bmm(q_nope[rows].transpose(0, 1), w_uk), q_pe[rows].transpose(0, 1)), dim=-1)  # [nh, D, R + dr]
            out_latent = decode_attention(query.transpose(0, 1), keys[:, None, :], None, pages, self.scale, mla.kv_lora_rank)  # [D, nh, R]
            # W_UV on the left: its rows are read as they lie in kv_b_proj (out_latent @ W_UV^T had bf16's bmm
            # copy the transposed weight every call: 0.63 vs 0.10 ms a layer at V2-Lite's shapes)
            out[rows] = torch.bmm(w_uv, out_latent.transpose(0, 1).transpose(1, 2)).permute(2, 0, 1).to(out.dtype)  # [D, nh, dv]
        groups, rest = fresh_groups(meta.prefills) if selection is None else ([], range(len(meta.prefills)))
        for group in groups:  # prompts that start their sequence, of one length: decompressed and attended together
            rows, g = fresh_rows(meta.prefills, group, x.device), len(group)
            key, value = self._decompress(gather(cache, torch.cat([meta.prefills[n].slots for n in group])))  # [G L, nh, *]
            query = q[rows]  # (q_nope, q_pe)
            batched = (y.reshape(g, -1, nh, y.shape[-1]) for y in (query, key, value))  # [G, L, nh, *]
            out[rows] = causal_attention(*batched, self.scale).flatten(0, 1).to(out.dtype)
        for n in rest:
            chunk = meta.prefills[n]
            rows = slice(chunk.row, chunk.row + chunk.length)
            ctx = gather(cache, chunk.slots)  # [L, R + dr]
            mask = None if selection is None else selection.prefill[n]
            if self._absorbed_is_cheaper(chunk.length, ctx.shape[0]):
                query = torch.cat((torch.einsum("thd,hdr->thr", q_nope[rows], w_uk), q_pe[rows]), dim=-1)  # [q, nh, R + dr]
                out_latent = prefill_attention(query, ctx[:, None, :], ctx[:, None, : mla.kv_lora_rank], chunk.start, self.scale,
                                               mask=mask)
                out[rows] = torch.einsum("thr,hvr->thv", out_latent, w_uv).to(out.dtype)
            else:  # decompress the context's keys and values once, attend per head at head dim dn + dr
                key, value = self._decompress(ctx)
                query = q[rows]  # [q, nh, dn + dr]: (q_nope, q_pe)
                out[rows] = prefill_attention(query, key, value, chunk.start, self.scale, mask=mask).to(out.dtype)
        return self.o_proj(out.reshape(t, nh * mla.v_head_dim))

    def _decompress(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents and rotated keys ``ctx`` [L, R + dr] -> each head's keys [L, nh, dn + dr] (the decompressed
        part, then the shared rotated one) and values [L, nh, dv]."""
        mla, nh = self.mla, self.num_heads
        kv = self.kv_b_proj(ctx[:, : mla.kv_lora_rank]).view(-1, nh, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, value = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        return torch.cat((k_nope, ctx[:, None, mla.kv_lora_rank :].expand(-1, nh, -1)), dim=-1), value

    def _select(self, x: torch.Tensor, q_latent: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> Selection:
        """This layer's sparse selection: its indexer's (after caching this step's index keys), or, for a
        GLM-5 shared layer, the one the layer before it left on the step's metadata."""
        indexer = getattr(self, "indexer", None)
        if indexer is None:
            selection = meta.layer_state.get(STATE_KEY)
            if selection is None:
                raise RuntimeError("a shared DSA layer ran before any indexer layer of its step")
            return selection
        index_cache = kv[1]  # [slots, index_head_dim], at the latents' slots
        index_cache.index_copy_(0, meta.slot_mapping, indexer.keys(x, rope, cos, sin).to(index_cache.dtype))
        selection = indexer.select(x, q_latent, rope, cos, sin, index_cache, meta)
        meta.layer_state[STATE_KEY] = selection
        return selection

    def _absorbed_is_cheaper(self, q: int, length: int) -> bool:
        """Multiply-adds of one chunk: absorbed, every (query, key) pair costs R + dr (scores) and R
        (values) per head, plus folding W_UK/W_UV into q rows; not absorbed, the context is decompressed
        once (R x (dn + dv) per token and head) and a pair costs dn + dr and dv. Long prefills decompress."""
        mla, nh = self.mla, self.num_heads
        r, dr, dn, dv = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim
        absorbed = q * length * nh * (2 * r + dr) + q * nh * r * (dn + dv)
        decompressed = length * nh * r * (dn + dv) + q * length * nh * (dn + dr + dv)
        return absorbed <= decompressed


class DeepseekV2Model(MoEModel):
    def make_attention(self, layer: int) -> nn.Module:
        return MLAttention(self.config, layer)

    def kv_layout(self) -> tuple[tuple[int, ...], ...]:
        """The latent and rotated shared key; with DeepSeek Sparse Attention, the index key beside it."""
        mla, dsa = self.config.mla, self.config.dsa
        latent = (mla.kv_lora_rank + mla.qk_rope_head_dim,)
        return (latent,) if dsa is None else (latent, (dsa.index_head_dim,))


class DeepseekV3Model(DeepseekV2Model):
    """DeepSeek-V3 family (V3, R1, Kimi-K2): V2's MLA with q_lora; what differs lives in the config --
    sigmoid routing with ``e_score_correction_bias`` (noaux_tc), ``rope_interleave``, MTP layers skipped."""


class DeepseekV32Model(DeepseekV3Model):
    """DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``): V3's MLA and MoE with DeepSeek Sparse Attention; what
    differs between the two (the indexer's rotary layout, shared layers, head counts) lives in ``config.dsa``."""
