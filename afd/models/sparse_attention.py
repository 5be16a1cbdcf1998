"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer picks, for each query, the
``index_topk`` earlier positions MLA attends to; as transformers computes it, with no Hadamard transform and
the index keys in the compute dtype (the release's fp8 index keys are out of scope).

For a query t and an earlier position j::

    q_h = wq_b(q latent)_h  (index_heads heads of index_head_dim; the first qk_rope_head_dim channels rotated)
    k_j = LayerNorm(wk(x_j))  (one key per token, rotated alike)
    score(t, j) = sum_h  weights_proj(x_t)_h * index_heads^-1/2 * relu(index_head_dim^-1/2 * q_h . k_j)

and the top ``index_topk`` scores among positions 0..t (all of them when fewer) are the keys MLA sees.

Where things live:

* **the index keys** are the layer's second cache tensor ``[slots, index_head_dim]`` beside the MLA latents
  (:meth:`DeepseekV32Model.kv_layout`): written at the same slots, counted in the block's bytes, shared by the
  prefix cache with the latents.
* **the indexer** runs on the attention side, inside the attention half: nothing new crosses the connector.
* **the selection** (:class:`Selection`): for decode tokens, the selected cache slots, whose latents are
  gathered into whole blocks of a small cache of their own (:func:`gathered`: k rows, 2.4 MB per token at
  V3.2's top-2048 in bf16) that the paged decode kernel (afd/kernels) then reads like any other, so the
  attention is O(top-k) at the kernel's block speed; for a prefill chunk, a boolean mask over its context.
* **GLM-5's shared layers** reuse the selection of the layer before them, kept on the step's metadata
  (``AttentionMetadata.layer_state``).

At decode on the CPU the indexer's scores and top-k run in afd's native kernel (``dsa_index_topk``: the index
keys read in place a block at a time with the decode kernel's register tiles, then a partial sort per
token); elsewhere in torch (:func:`decode_topk_reference`: a batched pass over the context's pages, as the
reference decode attention reads them). The indexer is O(context) per query, the attention O(top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from afd.config import ModelConfig
from afd.kernels import ops as native_ops
from afd.kvcache import AttentionMetadata, DecodePages
from afd.models.layers import Linear, RotaryEmbedding
from afd.models.paged_attention import WORKSPACE_BYTES, gather, gather_blocks

STATE_KEY = "dsa_selection"  # AttentionMetadata.layer_state: the last indexer layer's Selection


@dataclass(frozen=True)
class Selection:
    """The keys each query of a step attends to.

    decode   the decode tokens' selected cache slots [D, k] (valid ones first) and how many are valid [D]
    prefill  per prefill chunk of the step, in order: [q, L] True where query i may attend context position j
    """

    decode: tuple[torch.Tensor, torch.Tensor] | None
    prefill: tuple[torch.Tensor, ...]


class Indexer(nn.Module):
    """The lightning indexer of one layer (checkpoint names ``self_attn.indexer.*``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dsa, mla = config.dsa, config.mla
        assert dsa is not None and mla is not None and mla.q_lora_rank is not None
        self.dsa = dsa
        self.rope_dim = mla.qk_rope_head_dim
        self.wq_b = Linear(mla.q_lora_rank, dsa.index_heads * dsa.index_head_dim, bias=False)
        self.wk = Linear(config.hidden_size, dsa.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(dsa.index_head_dim, eps=1e-6)
        self.weights_proj = Linear(config.hidden_size, dsa.index_heads, bias=False)

    def _rotate(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope.apply(x, cos, sin, interleaved=self.dsa.rope_interleaved)  # the first rope_dim channels

    def keys(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H] (the attention input) -> the tokens' index keys [T, index_head_dim], to cache."""
        return self._rotate(self.k_norm(self.wk(x))[:, None, :], rope, cos, sin)[:, 0]

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (queries [T, heads, index_head_dim] float32, head weights [T, heads] float32 with
        index_heads^-1/2 and index_head_dim^-1/2 folded in: relu commutes with a positive scale)."""
        dsa = self.dsa
        q = self._rotate(self.wq_b(q_latent).view(-1, dsa.index_heads, dsa.index_head_dim), rope, cos, sin).float()
        weights = self.weights_proj(x).float() * (dsa.index_heads**-0.5 * dsa.index_head_dim**-0.5)
        return q, weights

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
               index_cache: torch.Tensor, meta: AttentionMetadata) -> Selection:
        """The top-k keys of every query of the step, read from the cached index keys (this step's included)."""
        q, weights = self.queries(x, q_latent, rope, cos, sin)
        topk = self.dsa.index_topk
        decode = None
        if meta.decode is not None:
            rows = meta.decode.rows
            decode = decode_topk(q[rows], weights[rows], index_cache, meta.decode, topk)
        masks = []
        for chunk in meta.prefills:
            keys = gather(index_cache, chunk.slots).float()  # [L, d]
            # queries in tiles whose fp32 scores [rows, heads, L] stay within the attention workspace
            rows = max(1, WORKSPACE_BYTES // (4 * self.dsa.index_heads * keys.shape[0]))
            masks.append(torch.cat([
                topk_mask(index_scores(q[chunk.row + a : chunk.row + min(a + rows, chunk.length)],
                                       weights[chunk.row + a : chunk.row + min(a + rows, chunk.length)], keys), chunk.start + a, topk)
                for a in range(0, chunk.length, rows)]))  # [q, L] bool: one byte per (query, key), in the step budget
        return Selection(decode, tuple(masks))


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [*, heads, d], weights [*, heads], keys [*, L, d] or [L, d] -> [*, L]: sum_h w_h relu(q_h . k)."""
    scores = torch.relu(torch.matmul(q, keys.transpose(-1, -2)))  # [*, heads, L]
    return torch.matmul(weights[..., None, :], scores)[..., 0, :]


def topk_mask(scores: torch.Tensor, start: int, topk: int) -> torch.Tensor:
    """A prefill chunk's selection: scores [q, L] of queries at start.. over positions 0..L-1 -> [q, L] bool,
    True at each query's top-k among its causal positions (every causal position when it has fewer)."""
    length, total = scores.shape
    causal = torch.arange(total, device=scores.device)[None, :] <= start + torch.arange(length, device=scores.device)[:, None]
    if topk >= total:
        return causal
    picked = scores.masked_fill(~causal, float("-inf")).topk(topk, dim=-1).indices
    return torch.zeros_like(causal).scatter_(1, picked, True) & causal


def decode_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, pages: DecodePages,
                topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode tokens' selection -> (each token's top-k cache slots [D, k], valid ones first; how many are
    valid [D]). The native kernel on the CPU, else :func:`decode_topk_reference`."""
    kernels = native_ops() if q.device.type == "cpu" else None
    if kernels is not None and index_cache.is_contiguous():
        return kernels.dsa_index_topk(q.float().contiguous(), weights.float().contiguous(), index_cache, pages.block_tables,
                                      pages.context_lens, pages.block_size, topk)
    return decode_topk_reference(q, weights, index_cache, pages, topk)


def decode_topk_reference(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, pages: DecodePages,
                          topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_topk` in torch: each token's context scored page by page (as the reference decode
    attention reads it), the pages of a token side by side, then one top-k."""
    num = q.shape[0]
    keys = gather_blocks(index_cache, pages.page_blocks, pages.block_size).float()  # [P, N, d]
    scores = index_scores(q[pages.page_row], weights[pages.page_row], keys)  # [P, N]
    scores = scores.masked_fill(~pages.page_valid, float("-inf"))
    # each token's pages side by side: page p is the ordinal-th page of its token (pages are listed token by token)
    counts = torch.bincount(pages.page_row, minlength=num)
    first = torch.cumsum(counts, 0) - counts
    ordinal = torch.arange(pages.page_row.shape[0], device=q.device) - first[pages.page_row]
    n = pages.page_slots.shape[1]
    width = int(counts.max()) * n
    flat_scores = torch.full((num, width), float("-inf"), device=q.device)
    flat_slots = torch.zeros((num, width), dtype=torch.long, device=q.device)
    column = ordinal[:, None] * n + torch.arange(n, device=q.device)[None, :]
    flat_scores[pages.page_row[:, None], column] = scores
    flat_slots[pages.page_row[:, None], column] = pages.page_slots
    k = min(topk, width)
    best = flat_scores.topk(k, dim=-1)  # valid (finite) scores first
    slots = flat_slots.gather(1, best.indices)
    lens = torch.isfinite(best.values).sum(1)
    return slots.masked_fill(~torch.isfinite(best.values), 0), lens


#: block size of the gathered selection (:func:`gathered`)
GATHER_BLOCK = 64


def gathered(cache: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, DecodePages]:
    """The selected cache rows of each decode token copied into whole blocks of a compact cache, and the pages
    that read them: cache [slots, *rest], slots [D, k], lens [D] -> ([D * k', *rest], pages), k' = k rounded
    up to GATHER_BLOCK. One copy of k rows per token, then the decode kernel at its block speed (a table of
    one-slot blocks would fold each key into the softmax alone: ~4x slower at V3.2's shapes)."""
    num, k = slots.shape
    width = -(-k // GATHER_BLOCK) * GATHER_BLOCK
    padded = torch.zeros(num, width, dtype=torch.long, device=slots.device)
    padded[:, :k] = slots
    compact = torch.index_select(cache, 0, padded.flatten())
    positions = torch.arange(num * width, device=slots.device).view(num, width)
    per_token = width // GATHER_BLOCK
    tables = torch.arange(num * per_token, device=slots.device).view(num, per_token)
    valid = torch.arange(width, device=slots.device)[None, :] < lens[:, None]
    pages = DecodePages(rows=rows, page_row=torch.arange(num, device=slots.device), page_slots=positions, page_valid=valid,
                        page_blocks=tables, block_tables=tables, context_lens=lens, block_size=GATHER_BLOCK)
    return compact, pages
