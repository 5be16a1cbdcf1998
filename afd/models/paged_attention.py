"""Attention over the paged KV cache whose memory and time follow the real work: nothing is padded to
the longest query or the longest context of a step, and no full q x L score matrix is built.

* **Decode rows** (chunks of one new token) on the CPU read their contexts in place from the cache, once,
  in afd's native kernel (afd/kernels: a block of keys scored and folded into an online softmax while it
  is in cache; no copy of the context). Elsewhere, or where the kernel is off or cannot be built, they go
  in one batched pass of torch ops (:func:`decode_attention_reference`), flash-decoding style: each
  context is cut into pages of whole KV blocks (about ``afd.kvcache.PAGE_TOKENS`` slots; only a sequence's last
  page is partial), gathered a block at a time, one batched matmul scores every page against its token's query, each page keeps
  its own softmax maximum and sum, and the pages of a token are merged exactly (log-sum-exp). Pages
  are taken ``WORKSPACE_BYTES`` at a time, so a step's decode workspace is bounded whatever the number
  of sequences or their contexts.
* **Prefill chunks** (q > 1 new tokens) attend per sequence: its context gathered once, its queries in
  tiles of rows so that a tile's scores ``[heads, rows, L]`` stay within ``WORKSPACE_BYTES``; causal
  with the chunk's offset (query i of a chunk starting at position s sees keys 0..s+i). Chunks that start
  their sequence (no cached context: their keys are their own tokens) and share a length are attended
  together instead (:func:`fresh_groups`, :func:`causal_attention`): a burst of new prompts is then a few
  batched calls, not one per prompt and layer. Both run torch's fused kernel (:func:`fused_attention`).

Heads may be grouped: queries ``[*, Hq, D]`` against keys ``[*, Hk, D]`` with Hq a multiple of Hk
(Qwen3's GQA; MLA's absorbed form is Hk = 1, one latent key shared by every head). Matmuls run in the
input dtype, softmax statistics in fp32.

gpt-oss adds two things, both exact in every path here:

* **sinks**: a learned logit per query head joins each softmax with no value (the probabilities of the
  real keys sum to less than one). In decode it is one more "page" per token in the log-sum-exp merge,
  with maximum = the sink, sum = 1 and output 0.
* **sliding windows**: a query at position i sees keys i-W+1..i (W keys, itself included). Decode reads
  the window's pages only (:meth:`AttentionMetadata.decode_pages`); a prefill chunk gathers the keys from
  its first query's window on and masks both ends.

The native decode kernel does both: it starts at the window's first block and masks the rows before it,
and folds the sink into its softmax sum at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from afd.kernels import ops as native_ops
from afd.kvcache import DecodePages

#: the most bytes one attention op's temporaries take (scores of a prefill tile; a group of decode pages)
WORKSPACE_BYTES = 32 << 20
def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache[slots]`` for an index tensor of any shape, by ``index_select`` (3x faster on CPU than
    advanced indexing, which the KV reads of every step would otherwise pay)."""
    return torch.index_select(cache, 0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slots of whole KV blocks: cache [slots, *rest] (slots a multiple of ``block_size``), blocks [p, b]
    -> [p, b * block_size, *rest]. One row per block, not per slot: a block's slots are contiguous, and
    ``index_select`` copies rows of ``block_size`` slots 2-3x faster here than single slots."""
    rest = cache.shape[1:]
    rows = torch.index_select(cache.view(-1, block_size * rest.numel()), 0, blocks.reshape(-1))
    return rows.view(blocks.shape[0], blocks.shape[1] * block_size, *rest)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, pages: DecodePages,
                     scale: float, value_dim: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [D, Hq, Dk] (one query per decode token); k_cache [slots, Hk, Dk]; v_cache [slots, Hk, Dv], or
    None when the values are the first ``value_dim`` channels of the keys (MLA's latent); sinks [Hq] or
    None. -> [D, Hq, Dv]. The native kernel where it applies (CPU tensors of one dtype, contiguous caches),
    else the reference."""
    kernels = native_ops() if q.device.type == "cpu" else None
    if kernels is not None and q.dtype != torch.float32 and not kernels.paged_decode_vectorized:
        kernels = None  # half precision without AVX-512 or AVX2: scalar conversions, slower than the batched matmuls below
    if (kernels is not None and k_cache.dtype == q.dtype and k_cache.is_contiguous()
            and (v_cache is None or (v_cache.dtype == q.dtype and v_cache.is_contiguous()))):
        empty = k_cache.new_empty(0)
        return kernels.paged_decode_attention(q.contiguous(), k_cache, empty if v_cache is None else v_cache,
                                              pages.block_tables, pages.context_lens, pages.block_size, scale, value_dim or 0,
                                              pages.window, empty.float() if sinks is None else sinks.float().contiguous())
    return decode_attention_reference(q, k_cache, v_cache, pages, scale, value_dim)


def native_mla(q: torch.Tensor, cache: torch.Tensor, w_kv_b: torch.Tensor):
    """The native kernels where MLA's absorbed decode runs in one call of theirs (``mla_decode``: W_UK into the
    query, :func:`decode_attention`'s kernel, W_UV after it, kv_b_proj read in place): CPU tensors of one dtype,
    contiguous, half precision only where the decode kernel is vectorised. Else None: the torch ops of
    ``MLAttention.forward``, its twin."""
    kernels = native_ops() if cache.device.type == "cpu" else None
    if kernels is None or not (q.dtype == cache.dtype == w_kv_b.dtype and cache.is_contiguous() and w_kv_b.is_contiguous()):
        return None
    return kernels if cache.dtype == torch.float32 or kernels.paged_decode_vectorized else None


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None, pages: DecodePages,
                               scale: float, value_dim: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`decode_attention` in torch ops: contexts gathered a group of pages at a time, scored by batched
    matmuls in q's dtype, softmax statistics in fp32, the pages of a token merged by log-sum-exp (a sink is
    one more page of each token: maximum = the sink, sum 1, output 0)."""
    num, hq, dk = q.shape
    hk = k_cache.shape[1]
    g = hq // hk
    dv = value_dim if v_cache is None else v_cache.shape[-1]
    n = pages.page_slots.shape[1]
    # gathered keys (and an einsum's copy of them), values, fp32 scores, probabilities and partial outputs
    per_page = n * (hk * (2 * dk + dv) * q.element_size() + hq * 4 * 3) + hq * (dv + 2) * 4
    step = max(1, WORKSPACE_BYTES // per_page)
    m_all, l_all, o_all = [], [], []
    for a in range(0, pages.page_row.shape[0], step):
        rows, blocks, valid = pages.page_row[a : a + step], pages.page_blocks[a : a + step], pages.page_valid[a : a + step]
        keys = gather_blocks(k_cache, blocks, pages.block_size)  # [p, N, Hk, Dk]: the one copy of the context a step makes
        values = keys[..., :dv] if v_cache is None else gather_blocks(v_cache, blocks, pages.block_size)  # [p, N, Hk, Dv]
        if hk == 1:  # every head against one key (MLA's latent): plain batched matmuls, heads as rows
            scores = torch.bmm(q[rows], keys[:, :, 0].transpose(1, 2)).float().mul_(scale)[:, None]  # [p, 1, G, N]
        else:
            scores = torch.einsum("pkgd,pnkd->pkgn", q[rows].view(-1, hk, g, dk), keys).float().mul_(scale)  # [p, Hk, G, N]
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        m = scores.amax(-1)  # [p, Hk, G]; a page holds at least one context position
        e = torch.exp_(scores.sub_(m[..., None]))
        # (a window's first page starts at a whole block, so it holds at least one visible position too)
        l_all.append(e.sum(-1))
        if hk == 1:
            o_all.append(torch.bmm(e[:, 0].to(values.dtype), values[:, :, 0]).float()[:, None])  # [p, 1, G, Dv]
        else:
            o_all.append(torch.einsum("pkgn,pnkv->pkgv", e.to(values.dtype), values).float())  # [p, Hk, G, Dv]
        m_all.append(m)
    page_row = pages.page_row
    if sinks is not None:  # one more page per token: the sink's logit, no value
        m_all.append(sinks.float().view(1, hk, g).expand(num, hk, g))
        l_all.append(torch.ones(num, hk, g, device=q.device))
        o_all.append(torch.zeros(num, hk, g, dv, device=q.device))
        page_row = torch.cat((page_row, torch.arange(num, device=q.device)))
    m, l, o = (torch.cat(x) if len(x) > 1 else x[0] for x in (m_all, l_all, o_all))
    if m.shape[0] == num:  # one page per token (every context within a page): no merge
        return (o / l[..., None]).view(num, hq, dv).to(q.dtype)
    # merge the pages of each token: weights exp(m_page - max_m) (exact softmax over the whole context)
    index = page_row[:, None, None].expand_as(m)
    top = torch.full((num, hk, g), float("-inf"), device=q.device).scatter_reduce_(0, index, m, "amax")
    w = torch.exp(m - top[page_row])  # [P, Hk, G]
    den = torch.zeros(num, hk, g, device=q.device).index_add_(0, page_row, l * w)
    out = torch.zeros(num, hk, g, dv, device=q.device).index_add_(0, page_row, o * w[..., None])
    return (out / den[..., None]).view(num, hq, dv).to(q.dtype)


def window_start(start: int, window: int) -> int:
    """The first key position a prefill chunk starting at ``start`` can see with this window (0: none)."""
    return max(0, start - window + 1) if window else 0


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float,
                      window: int = 0, sinks: torch.Tensor | None = None, first: int = 0,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's chunk: q [q, Hq, Dk] at positions start..start+q-1; keys [L, Hk, Dk] and values
    [L, Hk, Dv] of positions first..first+L-1 (first: 0, or :func:`window_start` where a window lets the
    chunk skip the keys before it). A query at i sees keys up to i, and with a window only those > i - window;
    ``mask`` [q, L] (DeepSeek Sparse Attention's selection) narrows that further. sinks [Hq] or None.
    -> [q, Hq, Dv]."""
    length, hq = q.shape[0], q.shape[1]
    total, hk = keys.shape[0], keys.shape[1]
    rows = max(1, WORKSPACE_BYTES // (hq * total * 4 * 2))  # a tile's fp32 scores and probabilities
    key = keys.transpose(0, 1)  # [Hk, L, Dk]
    value = values.transpose(0, 1)  # [Hk, L, Dv]
    j = first + torch.arange(total, device=q.device)  # the keys' positions
    outs = []
    for a in range(0, length, rows):
        b = min(length, a + rows)
        i = start + torch.arange(a, b, device=q.device)[:, None]  # the queries' positions
        visible = j[None, :] <= i  # [r, L] causal with the offset
        if window:
            visible &= j[None, :] > i - window
        if mask is not None:
            visible &= mask[a:b]
        query = q[a:b].transpose(0, 1)  # [Hq, r, Dk]
        if sinks is not None:
            outs.append(_attend_with_sinks(query, key, value, visible, scale, sinks).transpose(0, 1))
            continue
        if hk == 1:  # one key for every head: fold the heads into the query rows, read the keys once
            out = fused_attention(query.reshape(1, 1, hq * (b - a), -1), key[None], value[None], scale,
                                  mask=visible.repeat(hq, 1)).reshape(hq, b - a, -1)
        else:
            out = fused_attention(query[None], key[None], value[None], scale, mask=visible)[0]
        outs.append(out.transpose(0, 1))  # [r, Hq, Dv]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def fresh_groups(prefills, fits=lambda chunk: True) -> tuple[list[list[int]], list[int]]:
    """The step's prefill chunks as (groups, rest): groups of at least two chunks that start their sequence
    (``start`` 0: their context is their own tokens) with the same length and that ``fits`` (the caller's
    limits: a window shorter than the chunk, a mask), to attend together with :func:`causal_attention`;
    the indices of the others, attended one by one. A group is cut where its chunks' [L, L] float32 score matrices
    would pass ``WORKSPACE_BYTES`` (the fused kernel keeps none: the bound now limits a group's decompressed keys and
    values, which grow with it)."""
    by_length: dict[int, list[int]] = {}
    rest = []
    for n, chunk in enumerate(prefills):
        if chunk.start == 0 and fits(chunk):
            by_length.setdefault(chunk.length, []).append(n)
        else:
            rest.append(n)
    groups = []
    for length, members in by_length.items():
        if len(members) < 2:
            rest += members
            continue
        most = max(1, WORKSPACE_BYTES // (length * length * 4))  # chunks whose [L, L] fp32 scores (one head) fit
        groups += [members[i:i + most] for i in range(0, len(members), most)]
    return groups, sorted(rest)


def fresh_rows(prefills, group: list[int], device) -> torch.Tensor | slice:
    """The step's rows of a group's chunks, chunk after chunk: a slice where they are one run of rows (a burst of
    new prompts laid out one after another, the usual case: views instead of gathers and scatters of every
    query and output row), else [G * L] int64."""
    chunks = [prefills[n] for n in group]
    if all(b.row == a.row + a.length for a, b in zip(chunks, chunks[1:])):
        return slice(chunks[0].row, chunks[-1].row + chunks[-1].length)
    return torch.cat([torch.arange(c.row, c.row + c.length, device=device) for c in chunks])


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Chunks of equal length L that start their sequences, together: q [G, L, Hq, Dk], keys [G, L, Hk, Dk],
    values [G, L, Hk, Dv]; query i sees keys 0..i of its own chunk. -> [G, L, Hq, Dv]. One call of torch's fused
    kernel over the whole group: it keeps no score matrix, so a group's memory is its inputs'."""
    out = fused_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), scale, causal=True)
    return out.transpose(1, 2)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
                    causal: bool = False) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention`` on its fused (flash) path: q [B, Hq, r, Dk], k [B, Hk, L, Dk],
    v [B, Hk, L, Dv], mask [r, L] (True: visible) or None -> [B, Hq, r, Dv]. On the CPU that path takes only 4-D
    inputs whose key and value have one head size; anything else falls to the math path, which builds the scores in
    full. MLA's heads are such (Dk = dn + dr > Dv), so the narrower side is zero-padded here: zero value channels
    give outputs that are dropped, zero query and key channels add nothing to a score (one thread, bf16: V2-Lite's
    16 heads over 4 x 512 tokens 187 -> 31 ms, the built-in model's 32 x 64-token burst 4.2 -> 1.2 ms a layer)."""
    dk, dv = q.shape[-1], v.shape[-1]
    if dv < dk:
        v = F.pad(v, (0, dk - dv))
    elif dk < dv:
        q, k = F.pad(q, (0, dv - dk)), F.pad(k, (0, dv - dk))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[..., :dv] if dv < dk else out


def _attend_with_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scale: float,
                       sinks: torch.Tensor) -> torch.Tensor:
    """query [Hq, r, Dk], key [Hk, L, Dk], value [Hk, L, Dv], visible [r, L], sinks [Hq] -> [Hq, r, Dv]: the
    softmax over the visible keys' logits and the head's sink logit, whose probability is dropped."""
    hq, r, _ = query.shape
    hk = key.shape[0]
    grouped = query.reshape(hk, (hq // hk) * r, -1)  # the heads of a group share their key
    scores = torch.bmm(grouped, key.transpose(1, 2)).float().mul_(scale).view(hq, r, -1)
    scores.masked_fill_(~visible, float("-inf"))
    sink = sinks.float().view(hq, 1, 1).expand(hq, r, 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return torch.bmm(probs.to(value.dtype).view(hk, (hq // hk) * r, -1), value).view(hq, r, -1)
