"""DeepSeek-V4: compressed attention over afd's paged cache, hyper-connections, hash-routed experts (issue 28;
the design and its sources: docs/design/deepseek-v4.md).

**The cache** (:func:`cache_layouts`). Every layer keeps a sliding window of shared-KV keys; a layer of rate r also
keeps one compressed entry per r tokens (CSA: with its index key). afd keeps

* in the **window pool**, per token: the window key, and for a compressing layer the token's compressor inputs
  (its projected kv and gate, before the bias; CSA: the indexer's too). The tokens a compressor still waits on
  lie inside the window (a CSA window's entry pools the window before it too: 2r <= W, HCA r <= W, checked by the
  config), so the window pool *is* the compressor's state: nothing per sequence besides it, a chunk boundary
  anywhere, preemption by recompute and the prefix cache's window rule (afd/kvcache/windowed.py) all hold;
* in the **full pool**, per block, the entries of the windows that end in it (afd/kvcache/metadata.py
  ``entry_rows``): a block's name covers every token its entries depend on.

**The attention** runs per sequence (``AttentionMetadata.compressed``): the new tokens' kv and compressor inputs
are written first; the windows that close in the chunk are pooled (:func:`~afd.models.v4_compressor.compress_span`,
the same function the reference's stateful compressor calls); then each query attends to its window, its visible
entries (CSA: the lightning indexer's top-k of them) and a sink, in query tiles. The pure-torch reference for one
sequence is :func:`afd.models.v4_attention.reference_attention`; both are checked against transformers.

**The split**: the hyper-connections stay on the attention side. ``attention`` returns the streams after the
attention block and the FFN input; :meth:`DeepseekV4Model.merge` mixes the FFN output back into the streams.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Sequence

import torch
from torch import nn

from afd.config import ModelConfig
from afd.kvcache import AttentionMetadata, CacheTensor, CompressedSeq
from afd.models.v4_compressor import compress_span, rms_norm_fp32_weight, rotate_tail
from afd.models.base import MoEModel
from afd.models.hyper_connections import HyperConnection, HyperHead, mix, unweighted_rms_norm
from afd.models.layers import Linear, RotaryEmbedding
from afd.models.paged_attention import WORKSPACE_BYTES
from afd.models.v4_attention import attend_with_sinks, grouped_output, index_scores
from afd.types import AttentionOutput

#: afd's (transformers' module) names -> the names in the checkpoints transformers writes (the release's, under
#: ``model.``), applied in order
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"^lm_head\.", "head."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."), (r"\.sinks$", ".attn_sink"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."), (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.q_a_proj\.", ".wq_a."), (r"\.q_b_proj\.", ".wq_b."), (r"\.q_a_norm\.", ".q_norm."), (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."), (r"\.kv_norm\.", ".norm."), (r"\.position_bias$", ".ape"), (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."), (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.", ".hc_attn_"), (r"\.ffn_hc\.", ".hc_ffn_"), (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
))


class V4Norm(nn.Module):
    """V4's RMSNorm: an fp32 weight, normalised and scaled in fp32, cast once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32_weight(x, self.weight, self.eps)


class _Scorer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weights_proj = Linear(hidden, heads, bias=False)


class V4Compressor(nn.Module):
    """A compressor's projections (kv, gate: 2 x head_dim wide when the windows overlap), norm and position bias;
    a CSA layer's holds the lightning indexer (itself an overlapping compressor with a query and a scorer)."""

    def __init__(self, config: ModelConfig, layer: int, head_dim: int, overlap: bool, indexer: bool = False) -> None:
        super().__init__()
        v, h = config.compressed, config.hidden_size
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = Linear(h, width, bias=False)
        self.gate_proj = Linear(h, width, bias=False)
        self.kv_norm = V4Norm(head_dim, config.rms_norm_eps)
        self.position_bias = nn.Parameter(torch.empty(v.rate(layer), width, dtype=torch.float32))
        if indexer:
            self.q_b_proj = Linear(v.q_lora_rank, v.index_heads * v.index_head_dim, bias=False)
            self.scorer = _Scorer(h, v.index_heads)
        elif v.is_csa(layer):
            self.indexer = V4Compressor(config, layer, v.index_head_dim, overlap=True, indexer=True)


class V4Attention(nn.Module):
    """One layer's attention over afd's paged cache (the module docstring); parameters named as transformers'."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        v, h = config.compressed, config.hidden_size
        self.heads, self.head_dim, self.eps = config.num_heads, v.head_dim, config.rms_norm_eps
        self.window, self.rate, self.csa, self.groups = v.window, v.rate(layer), v.is_csa(layer), v.o_groups
        self.index_heads, self.index_dim, self.topk = v.index_heads, v.index_head_dim, v.index_topk
        self.sinks = nn.Parameter(torch.empty(self.heads, dtype=torch.float32))
        self.q_a_proj = Linear(h, v.q_lora_rank, bias=False)
        self.q_a_norm = V4Norm(v.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(v.q_lora_rank, self.heads * v.head_dim, bias=False)
        self.kv_proj = Linear(h, v.head_dim, bias=False)
        self.kv_norm = V4Norm(v.head_dim, config.rms_norm_eps)
        self.o_a_proj = Linear(self.heads * v.head_dim // v.o_groups, v.o_groups * v.o_lora_rank, bias=False)
        self.o_b_proj = Linear(v.o_groups * v.o_lora_rank, h, bias=False)
        if self.rate:
            self.compressor = V4Compressor(config, layer, v.head_dim, overlap=self.csa)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: Sequence[torch.Tensor], rope: RotaryEmbedding) -> torch.Tensor:
        """x [T, H] (normed) -> [T, H]; writes the step's keys, compressor inputs and closed windows' entries."""
        t, positions, slots = x.shape[0], meta.positions, meta.window_slot_mapping
        q_res = self.q_a_norm(self.q_a_proj(x))
        q = rotate_tail(unweighted_rms_norm(self.q_b_proj(q_res).view(t, self.heads, self.head_dim), self.eps), positions, rope)
        cache[0][slots] = rotate_tail(self.kv_norm(self.kv_proj(x)), positions, rope)
        iq = iw = None
        if self.rate:
            comp = self.compressor
            cache[1][slots], cache[2][slots] = comp.kv_proj(x), comp.gate_proj(x)
            if self.csa:
                idx = comp.indexer
                cache[4][slots], cache[5][slots] = idx.kv_proj(x), idx.gate_proj(x)
                iq = rotate_tail(idx.q_b_proj(q_res).view(t, self.index_heads, self.index_dim), positions, rope)
                iw = idx.scorer.weights_proj(x).float() * self.index_heads**-0.5
        out = torch.empty_like(q)
        for seq in meta.compressed:
            if self.rate:
                self._emit(seq, cache, rope)
            self._attend(seq, q, iq, iw, cache, out)
        out = rotate_tail(out, -positions, rope)  # the values' rotation undone at the query's position
        return grouped_output(out.reshape(t, -1), self.o_a_proj.weight, self.o_b_proj.weight, self.groups)

    def _emit(self, seq: CompressedSeq, cache: Sequence[torch.Tensor], rope: RotaryEmbedding) -> None:
        """Pool the windows that close in this chunk into entries (CSA: and index keys) and write them."""
        r = self.rate
        first = seq.start // r
        n = seq.end // r - first
        if n == 0:
            return
        rows = seq.entry_rows[r][first:first + n]
        sources = [(self.compressor, 1, 3, self.csa)] + ([(self.compressor.indexer, 4, 6, True)] if self.csa else [])
        for comp, at, to, overlap in sources:
            begin = (first - 1) * r if overlap and first else first * r  # the window before, for its Ca
            span = seq.window_slots[begin - seq.window_start: (first + n) * r - seq.window_start]
            kv, gate = cache[at][span], cache[at + 1][span]
            prev = None
            if begin < first * r:
                width = comp.kv_norm.weight.shape[0]
                prev, kv, gate = (kv[:r, :width], gate[:r, :width]), kv[r:], gate[r:]
            cache[to][rows] = compress_span(kv, gate, first, r, comp.position_bias, comp.kv_norm.weight, comp.kv_norm.eps, rope,
                                            overlap, prev)

    def _attend(self, seq: CompressedSeq, q, iq, iw, cache: Sequence[torch.Tensor], out: torch.Tensor) -> None:
        """Each query of the sequence over its window, its visible entries (CSA: only the entries the indexer picks
        for some query of the tile are gathered) and the sink, in tiles of queries whose fp32 scores stay within
        the attention workspace."""
        w, r = self.window, self.rate
        keys_per_query = w + (seq.end // r if r else 0)
        tile = max(1, min(seq.length, WORKSPACE_BYTES // (12 * keys_per_query * (self.heads + self.index_heads))))
        for a in range(0, seq.length, tile):
            b = min(seq.length, a + tile)
            rows = slice(seq.row + a, seq.row + b)
            qpos = torch.arange(seq.start + a, seq.start + b, device=q.device)
            lo = max(seq.window_start, seq.start + a - w + 1)  # the tile's first window position
            keys = cache[0][seq.window_slots[lo - seq.window_start: seq.start + b - seq.window_start]]
            kpos = torch.arange(lo, seq.start + b, device=q.device)
            allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - w)
            count = (seq.start + b) // r if r else 0
            if count:
                entry_rows = seq.entry_rows[r][:count]
                visible = torch.arange(count, device=q.device)[None, :] < ((qpos + 1) // r)[:, None]  # [t, count]
                if self.csa:
                    scores = index_scores(iq[rows], cache[6][entry_rows], iw[rows], self.index_dim).masked_fill(~visible, float("-inf"))
                    chosen = torch.zeros_like(visible).scatter_(1, scores.topk(min(self.topk, count), dim=-1).indices, True)
                    picked = (chosen & visible).any(dim=0).nonzero().flatten()  # the tile's picks, in entry order
                    entry_rows, visible = entry_rows[picked], (chosen & visible)[:, picked]
                keys = torch.cat((keys, cache[3][entry_rows]))
                allowed = torch.cat((allowed, visible), dim=1)
            out[rows] = attend_with_sinks(q[rows], keys, allowed, self.sinks, self.head_dim**-0.5)


def cache_layouts(config: ModelConfig) -> list[tuple[CacheTensor, ...]]:
    """Per layer: [0] the window key; a compressing layer's [1, 2] compressor kv and gate (window pool) and [3] its
    entries (a row per r tokens); a CSA layer's [4, 5] indexer kv and gate and [6] its index keys."""
    v = config.compressed
    layouts = []
    for i in range(config.num_layers):
        r, d = v.rate(i), v.head_dim
        layout = [CacheTensor((d,), window=True)]
        if r:
            width = 2 * d if v.is_csa(i) else d
            layout += [CacheTensor((width,), window=True), CacheTensor((width,), window=True), CacheTensor((d,), rate=r)]
        if v.is_csa(i):
            layout += [CacheTensor((2 * v.index_head_dim,), window=True), CacheTensor((2 * v.index_head_dim,), window=True),
                       CacheTensor((v.index_head_dim,), rate=r)]
        layouts.append(tuple(layout))
    return layouts


class DeepseekV4Model(MoEModel):
    fp32_modules = frozenset({"attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "q_a_norm", "kv_norm", "input_layernorm",
                              "post_attention_layernorm", "norm"})
    expert_tensors = ("w1", "w3", "w2")

    def __init__(self, config: ModelConfig, expert_ids: Sequence[int] | None = None) -> None:
        super().__init__(config, expert_ids)
        v, h, eps = config.compressed, config.hidden_size, config.rms_norm_eps
        for layer in self.model.layers:
            layer.input_layernorm, layer.post_attention_layernorm = V4Norm(h, eps), V4Norm(h, eps)
            layer.attn_hc = HyperConnection(h, v.hc_mult, v.hc_sinkhorn_iters, v.hc_eps, eps)
            layer.ffn_hc = HyperConnection(h, v.hc_mult, v.hc_sinkhorn_iters, v.hc_eps, eps)
        self.model.norm = V4Norm(h, eps)
        self.model.hc_head = HyperHead(h, v.hc_mult, v.hc_eps, eps)
        self.compress_rotary = RotaryEmbedding(v.compress_rope)

    def make_attention(self, layer: int) -> nn.Module:
        return V4Attention(self.config, layer)

    def kv_layout(self) -> tuple[tuple[int, ...], ...]:
        return ((self.config.compressed.head_dim,),)  # the window key; the rest: cache_layouts

    def cache_layouts(self) -> list[tuple[CacheTensor, ...]]:
        return cache_layouts(self.config)

    @classmethod
    def checkpoint_layout(cls, config: ModelConfig, names: set[str]) -> ModelConfig:
        """The release names its tensors without transformers' ``model.`` (``embed.weight``, ``layers.N.attn...``,
        ``hc_head_fn``): ``checkpoint_prefix`` "" says so."""
        return replace(config, checkpoint_prefix="") if "embed.weight" in names else config

    def checkpoint_name(self, name: str) -> str:
        for pattern, theirs in _RENAMES:
            name = pattern.sub(theirs, name)
        if self.config.checkpoint_prefix == "":  # the release's own names
            name = name.removeprefix("model.")
            name = {"embed_tokens.weight": "embed.weight"}.get(name, name)
            name = re.sub(r"^hc_head\.", "hc_head_", name)
        return name

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the streams [T, N, H], each the token's embedding."""
        x = super().embed(input_ids)
        return x[:, None, :].expand(-1, self.config.compressed.hc_mult, -1).contiguous()

    def attention(self, layer: int, hidden: torch.Tensor, meta: AttentionMetadata, kv: tuple[torch.Tensor, ...]) -> AttentionOutput:
        """streams [T, N, H] -> the streams after the attention block, the FFN input and the FFN block's mixing."""
        block = self.model.layers[layer]
        self._check_loaded(block.input_layernorm.weight, "attention")
        post, comb, x = block.attn_hc(hidden)
        rope = self.compress_rotary if self.config.compressed.rate(layer) else self.rotary
        streams = mix(post, comb, block.self_attn(block.input_layernorm(x), meta, kv, rope), hidden)
        post, comb, x = block.ffn_hc(streams)
        return AttentionOutput(streams, block.post_attention_layernorm(x), (post, comb))

    def merge(self, layer: int, out: AttentionOutput, ffn_output: torch.Tensor) -> torch.Tensor:
        return mix(*out.mix, ffn_output, out.residual)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(self.model.hc_head(hidden))
