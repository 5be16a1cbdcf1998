"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) beyond the shared parity suite (tests/models/test_parity_hf.py
runs both there: per layer, cached decode, 24 greedy steps): the canaries issue 26 names, the decode selection
against a direct reference, dense equality below the top-k, and where the index keys live."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import afd.models.sparse_attention as sa
from afd.config import CacheConfig
from afd.kernels import ops as native_ops
from afd.engine.model_runner import ModelRunner
from afd.kvcache import BlockManager, PagedKVCache, SeqChunk, build_attention_metadata
from afd.models import load_model
from afd.models.hf_config import load_model_config
from tests import support
from tests.models.test_parity_hf import PROMPTS, parity_reports

V32, GLM5 = "dsv32-top6", "glm5-shared-top5"


def failures(model, hf):
    return [r for r in parity_reports(model, hf, PROMPTS) if not r.ok]


@pytest.fixture(params=[V32, GLM5])
def dsa(request, checkpoints):
    path, hf = checkpoints[request.param]
    model, _ = load_model(path, dtype="float32")
    assert not failures(model, hf), "the unbroken model must pass before a canary means anything"
    return model, hf


def test_the_prompts_are_longer_than_the_top_k(checkpoints):
    for case in (V32, GLM5):
        config = load_model_config(checkpoints[case][0])
        assert max(len(p) for p in PROMPTS) > 2 * config.dsa.index_topk
    glm5 = load_model_config(checkpoints[GLM5][0]).dsa
    assert glm5.shared_layers == (1, 3) and glm5.rope_interleaved
    assert not load_model_config(checkpoints[V32][0]).dsa.rope_interleaved


def test_canary_top_k_over_the_wrong_axis_fails(dsa, monkeypatch):
    """The top-k of each query over its keys; taken per key over the queries it must fail."""
    model, hf = dsa

    def per_key(scores, start, topk):
        length, total = scores.shape
        causal = torch.arange(total)[None, :] <= start + torch.arange(length)[:, None]
        if topk >= length:
            return causal
        picked = scores.masked_fill(~causal, float("-inf")).topk(topk, dim=0).indices
        return torch.zeros_like(causal).scatter_(0, picked, True) & causal

    monkeypatch.setattr(sa, "topk_mask", per_key)
    assert failures(model, hf), "a top-k over the wrong axis went unnoticed"


def test_canary_top_k_without_the_causal_limit_fails(dsa, monkeypatch):
    """Future positions must not compete for the top-k (they would take places, then be masked)."""
    model, hf = dsa

    def acausal(scores, start, topk):
        length, total = scores.shape
        causal = torch.arange(total)[None, :] <= start + torch.arange(length)[:, None]
        if topk >= total:
            return causal
        return torch.zeros_like(causal).scatter_(1, scores.topk(topk, dim=-1).indices, True) & causal

    monkeypatch.setattr(sa, "topk_mask", acausal)
    assert failures(model, hf), "a top-k without the causal limit went unnoticed"


def test_canary_glm5_indexer_rotary_in_halves_fails(checkpoints):
    path, hf = checkpoints[GLM5]
    model, _ = load_model(path, dtype="float32")
    for layer in model.model.layers:
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            indexer.dsa = replace(indexer.dsa, rope_interleaved=False)
    assert failures(model, hf), "GLM-5's indexer rotated in halves went unnoticed"


def test_canary_glm5_shared_layer_with_its_own_selection_fails(checkpoints):
    """A shared layer reuses the previous layer's top-k; selecting anew (with the previous layer's indexer
    weights, the only ones there are) must fail."""
    path, hf = checkpoints[GLM5]
    model, _ = load_model(path, dtype="float32")
    for shared in model.config.dsa.shared_layers:
        model.model.layers[shared].self_attn.indexer = model.model.layers[shared - 1].self_attn.indexer
    assert failures(model, hf), "recomputing a shared layer's selection went unnoticed"


def test_sparse_attention_below_the_top_k_equals_dense(checkpoints):
    """A context no longer than index_topk selects every position: the result is dense MLA's."""
    path, _ = checkpoints[V32]
    sparse, _ = load_model(path, dtype="float32")
    dense, _ = load_model(path, dtype="float32")
    for layer in dense.model.layers:
        layer.self_attn.sparse = False
    prompt = PROMPTS[2][:6]  # 6 tokens: top-6 takes them all
    torch.testing.assert_close(support.monolithic_capture(sparse, [prompt])[1], support.monolithic_capture(dense, [prompt])[1])
    long = PROMPTS[0]  # 13 tokens: the selection matters, so the two must differ
    assert not torch.allclose(support.monolithic_capture(sparse, [long])[1], support.monolithic_capture(dense, [long])[1], atol=1e-4)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contexts", [[1, 5, 9], [30, 200, 7]])
def test_decode_selection_equals_a_direct_top_k(contexts, dtype, impl):
    """decode_topk (the context scored page by page, pages merged side by side) selects the same slots as
    scoring each context in one piece; gathered() copies exactly those rows into the pages it returns."""
    gen = torch.Generator().manual_seed(len(contexts) + contexts[0])
    block, heads, dim, topk = 4, 3, 8, 6
    blocks = BlockManager(256, block)
    tables = [blocks.ensure(i, n) for i, n in enumerate(contexts)]
    index_cache = torch.randn(256 * block, dim, generator=gen).to(dtype)
    meta = build_attention_metadata([SeqChunk(t, n - 1, 1) for t, n in zip(tables, contexts)], block, page_tokens=8)
    q, w = torch.randn(len(contexts), heads, dim, generator=gen), torch.randn(len(contexts), heads, generator=gen)
    if impl == "kernel":
        assert native_ops() is not None, "afd/kernels did not build here"
    select = sa.decode_topk if impl == "kernel" else sa.decode_topk_reference
    selected, lens = select(q, w, index_cache, meta.decode, topk)
    compact, pages = sa.gathered(index_cache, selected, lens, meta.decode.rows)
    for i, (t, n) in enumerate(zip(tables, contexts)):
        slots = torch.tensor([t[p // block] * block + p % block for p in range(n)])
        scores = sa.index_scores(q[i], w[i], index_cache[slots].float())
        want = set(slots[scores.topk(min(topk, n)).indices].tolist())
        got = selected[i, : lens[i]].tolist()
        assert set(got) == want and int(lens[i]) == min(topk, n) == int(pages.context_lens[i])
        rows = pages.page_slots[i][pages.page_valid[i]]
        assert torch.equal(compact[rows], index_cache[got])  # the gathered rows, in the selection's order


def test_index_keys_live_beside_the_latents_and_count_in_the_block(checkpoints):
    path, _ = checkpoints[V32]
    model, _ = load_model(path, dtype="float32")
    mla, dsa_config = model.config.mla, model.config.dsa
    assert model.kv_layout() == ((mla.kv_lora_rank + mla.qk_rope_head_dim,), (dsa_config.index_head_dim,))
    cache = CacheConfig(block_size=4, num_blocks=8)
    per_block = PagedKVCache.bytes_per_block(cache, model.config.num_layers, model.kv_layout(), torch.float32)
    assert per_block == 4 * 4 * model.config.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim + dsa_config.index_head_dim)
    runner = ModelRunner(model, cache)
    table = BlockManager(8, 4).ensure(0, 9)
    runner.execute(PROMPTS[2], [SeqChunk(table, 0, 9)])
    slots = [table[p // 4] * 4 + p % 4 for p in range(9)]
    index_keys = runner.kv_cache.layer(0)[1][slots]
    assert index_keys.abs().sum(-1).gt(0).all(), "every token's index key is written at its latent's slot"


def test_the_kernel_breaks_exact_ties_by_position():
    """Exact ties (every head's q.k negative scores 0) are implementation-defined in torch.topk; afd's kernel
    takes the lower position first, so its choice is stated and stable."""
    assert native_ops() is not None, "afd/kernels did not build here"
    block, n = 4, 30
    table = BlockManager(16, block).ensure(0, n)
    meta = build_attention_metadata([SeqChunk(table, n - 1, 1)], block)
    index_cache = torch.randn(16 * block, 8)
    q, w = torch.randn(1, 2, 8), torch.zeros(1, 2)  # zero weights: every score is 0
    slots, lens = native_ops().dsa_index_topk(q, w, index_cache, meta.decode.block_tables, meta.decode.context_lens, block, 5)
    assert int(lens[0]) == 5
    assert slots[0].tolist() == [table[p // block] * block + p % block for p in range(5)]


def test_prefill_selection_in_query_tiles_equals_one_piece(checkpoints, monkeypatch):
    """A long chunk's index scores are computed a tile of queries at a time (bounded memory): with tiles of a
    few queries the result still equals transformers."""
    path, hf = checkpoints[V32]
    model, _ = load_model(path, dtype="float32")
    monkeypatch.setattr(sa, "WORKSPACE_BYTES", 4 * 16 * 13 * 3)  # 3 queries of 16 heads over 13 keys per tile
    assert not failures(model, hf)


def test_prefix_cache_hit_keeps_the_index_keys(checkpoints):
    """The index keys sit at the latents' slots: a prompt served again from the prefix cache selects and
    generates as it did the first time."""
    from afd.config import EngineConfig, SamplingParams
    from afd.engine.llm_engine import LLMEngine

    path, _ = checkpoints[GLM5]
    model, _ = load_model(path, dtype="float32")
    engine = LLMEngine(model, None, EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64), enable_prefix_caching=True))
    prompt = list(range(3, 3 + 19))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = engine.generate([prompt], params)[0].token_ids
    second = engine.generate([prompt], params)[0].token_ids
    assert engine.scheduler.prefix_hits == 16 and second == first
