"""DeepSeek-V4's attention, the pure-torch reference for one sequence (issue 28; the paged form over afd's cache
comes next and is checked against this and transformers).

Shared-KV MQA: one key per token, read as key and value. Per layer kind (``rate``): 0 sliding only (the main
rotary), 4 CSA and 128 HCA (the compressed branch's rotary for the whole layer). A query at position t reads

* the window: keys of positions t - W + 1 .. t (uncompressed, rotated at their positions);
* with ``rate`` > 0, the compressed entries e < (t + 1) // rate (afd/models/v4_compressor.py), CSA only the
  ``index_topk`` its lightning indexer picks among them;

plus a learned sink logit per head. Then the rotated (trailing) slice of the output is rotated back by t, the
heads are cut into ``o_groups`` groups, each projected to ``o_lora_rank`` (``o_a_proj``, block diagonal) and
mixed to the hidden size (``o_b_proj``). The query is q_b(rmsnorm(q_a(x))) with an unweighted RMSNorm per head;
the key is rmsnorm(kv_proj(x)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from afd.models.v4_compressor import CompressorState, compress, rms_norm_fp32_weight, rotate_tail
from afd.models.hyper_connections import unweighted_rms_norm
from afd.models.layers import RotaryEmbedding


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [t, Hq, d], keys [L, d] (also the values), allowed [t, L] bool, sinks [Hq] -> [t, Hq, d]; fp32 softmax."""
    scores = torch.einsum("thd,ld->thl", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    logits = torch.cat((scores, sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)), dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.einsum("thl,ld->thd", probs.to(keys.dtype), keys)


def index_scores(iq: torch.Tensor, index_keys: torch.Tensor, weights: torch.Tensor, index_dim: int) -> torch.Tensor:
    """The lightning indexer's score of each entry for each query: iq [t, heads, d], index_keys [E, d], weights
    [t, heads] (fp32, already scaled by heads^-1/2) -> [t, E] fp32: sum_h w_h relu(q_h . k_e) d^-1/2."""
    scores = F.relu(torch.einsum("thd,ed->the", iq.float(), index_keys.float())) * index_dim**-0.5
    return (scores * weights[..., None]).sum(dim=1)


def grouped_output(out: torch.Tensor, o_a: torch.Tensor, o_b: torch.Tensor, groups: int) -> torch.Tensor:
    """out [t, Hq * d] -> hidden [t, H]: each of ``groups`` slices projected by its block of ``o_a`` [G * r, Hq d / G],
    the concatenation mixed by ``o_b`` [H, G * r]."""
    t = out.shape[0]
    x = out.view(t, groups, -1).transpose(0, 1)  # [G, t, Hq d / G]
    y = torch.bmm(x, o_a.view(groups, -1, x.shape[-1]).transpose(1, 2)).transpose(0, 1)  # [t, G, r]
    return F.linear(y.reshape(t, -1), o_b)


@dataclass
class SequenceCache:
    """What one sequence keeps for one layer (the reference's form): its window's keys and their positions, the
    compressed entries so far, and the compressors' states (CSA: the indexer's too)."""

    keys: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    entries: list[torch.Tensor] = field(default_factory=list)
    index_keys: list[torch.Tensor] = field(default_factory=list)
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


@dataclass(frozen=True)
class V4Shapes:
    heads: int
    head_dim: int
    window: int
    rate: int  # 0: sliding only
    groups: int
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    eps: float = 1e-6


def reference_attention(w: dict[str, torch.Tensor], s: V4Shapes, x: torch.Tensor, start: int, cache: SequenceCache,
                        rope: RotaryEmbedding) -> torch.Tensor:
    """One chunk x [t, H] of a sequence at positions start.. through one V4 attention layer whose weights ``w`` are
    named as transformers names them (``q_a_proj.weight`` ...); updates ``cache``. ``rope``: the layer's rotary
    (the main one for sliding layers, the compressed branch's otherwise)."""
    t = x.shape[0]
    positions = torch.arange(start, start + t)
    q_res = rms_norm_fp32_weight(F.linear(x, w["q_a_proj.weight"]), w["q_a_norm.weight"], s.eps)
    q = unweighted_rms_norm(F.linear(q_res, w["q_b_proj.weight"]).view(t, s.heads, s.head_dim), s.eps)
    q = rotate_tail(q, positions, rope)
    kv = rotate_tail(rms_norm_fp32_weight(F.linear(x, w["kv_proj.weight"]), w["kv_norm.weight"], s.eps), positions, rope)
    keys = kv if cache.keys is None else torch.cat((cache.keys, kv))
    key_pos = positions if cache.positions is None else torch.cat((cache.positions, positions))
    allowed = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] > positions[:, None] - s.window)
    keep = key_pos > start + t - 1 - (s.window - 1)  # what the next chunk's queries may still read
    cache.keys, cache.positions = keys[keep], key_pos[keep]
    if s.rate:
        entries, entry_allowed = _compressed(w, s, x, q_res, start, positions, cache, rope)
        keys = torch.cat((keys, entries))
        allowed = torch.cat((allowed, entry_allowed), dim=1)
    out = attend_with_sinks(q, keys, allowed, w["sinks"], s.head_dim**-0.5)
    out = rotate_tail(out, -positions, rope)  # the values' rotation undone at the query's position
    return grouped_output(out.reshape(t, -1), w["o_a_proj.weight"], w["o_b_proj.weight"], s.groups)


def _compressed(w, s: V4Shapes, x, q_res, start: int, positions, cache: SequenceCache, rope: RotaryEmbedding):
    csa = s.index_topk > 0  # CSA: overlapping windows and the lightning indexer; HCA: neither
    c = "compressor."
    new, _ = compress(F.linear(x, w[c + "kv_proj.weight"]), F.linear(x, w[c + "gate_proj.weight"]), start, cache.compressor,
                          s.rate, w[c + "position_bias"], w[c + "kv_norm.weight"], s.eps, rope, overlap=csa)
    cache.entries.append(new)
    entries = torch.cat(cache.entries)
    visible = torch.arange(entries.shape[0])[None, :] < ((positions + 1) // s.rate)[:, None]  # [t, E]
    if not csa:
        return entries, visible
    i = c + "indexer."
    index_new, _ = compress(F.linear(x, w[i + "kv_proj.weight"]), F.linear(x, w[i + "gate_proj.weight"]), start, cache.indexer,
                                s.rate, w[i + "position_bias"], w[i + "kv_norm.weight"], s.eps, rope, overlap=True)
    cache.index_keys.append(index_new)
    index_keys = torch.cat(cache.index_keys)
    iq = rotate_tail(F.linear(q_res, w[i + "q_b_proj.weight"]).view(x.shape[0], s.index_heads, s.index_dim), positions, rope)
    weights = F.linear(x, w[i + "scorer.weights_proj.weight"]).float() * s.index_heads**-0.5
    scores = index_scores(iq, index_keys, weights, s.index_dim).masked_fill(~visible, float("-inf"))  # [t, E]
    chosen = torch.zeros_like(visible)
    if entries.shape[0]:
        top = scores.topk(min(s.index_topk, entries.shape[0]), dim=-1).indices
        chosen.scatter_(1, top, True)
    return entries, chosen & visible
