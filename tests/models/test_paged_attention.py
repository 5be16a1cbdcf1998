"""Attention over the paged cache without padding, against a direct reference (each sequence's softmax in
float64): decode pages merged by log-sum-exp, prefill query tiles with the chunk's causal offset, grouped
and shared heads; MLA's absorbed and decompressed prefill agree; a mixed step equals one-by-one runs."""

from __future__ import annotations

import pytest
import torch

from afd.config import CacheConfig
from afd.engine.model_runner import ModelRunner
from afd.kernels import ops as native_ops
from afd.kvcache import BlockManager, SeqChunk, build_attention_metadata
from afd.models import load_model
from afd.models import paged_attention as pa
from afd.testing.parity import compare_values
from tests import support

BS = 4


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float, window: int = 0,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [q, Hq, D] at positions start.., keys/values [L, Hk, *] of positions 0.. -> [q, Hq, Dv], in float64;
    with a window only keys > i - window, with sinks a logit per head in the softmax, its probability dropped."""
    g = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(g, dim=1)
    v = values.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q.double(), k) * scale
    j, i = torch.arange(keys.shape[0])[None, :], start + torch.arange(q.shape[0])[:, None]
    visible = (j <= i) & ((j > i - window) if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double().view(-1, 1, 1).expand(-1, q.shape[0], 1)), dim=-1)
    probs = scores.softmax(-1)[..., : keys.shape[0]]
    return torch.einsum("hql,lhv->qhv", probs, v)


def cache_and_tables(contexts: list[int], hk: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    blocks = BlockManager(512, BS)
    tables = [blocks.ensure(i, n) for i, n in enumerate(contexts)]
    slots = 512 * BS
    return torch.randn(slots, hk, dk, generator=gen), torch.randn(slots, hk, dv, generator=gen), tables


DECODE = {"kernel": pa.decode_attention, "reference": pa.decode_attention_reference}


@pytest.fixture(autouse=True)
def the_kernel_is_built_where_compared(request):
    """A "kernel" case compares the native decode kernel: it must be the one that ran, not its torch twin."""
    if getattr(request.node, "callspec", None) is not None and request.node.callspec.params.get("impl") == "kernel":
        assert native_ops() is not None, "afd/kernels did not build here: the kernel case would test the reference"


def test_the_native_decode_kernel_is_built_here():
    """CI builds and runs the C++ kernel: a machine where it silently fell back would test only the reference.
    On an AVX-512 or AVX2 CPU its register-tiled path must be the one built (half precision depends on it)."""
    assert native_ops() is not None, "afd/kernels did not build (see the warning in the log); AFD_KERNELS=0 turns it off"
    assert native_ops().simd == support.expected_simd()
    assert native_ops().paged_decode_vectorized == (native_ops().simd != "none")


@pytest.mark.parametrize("impl", DECODE)
@pytest.mark.parametrize("hq, hk", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("workspace", [pa.WORKSPACE_BYTES, 4096])  # 4 KiB: many page groups (the reference)
def test_decode_pages_equal_the_reference(monkeypatch, impl, hq, hk, workspace):
    monkeypatch.setattr(pa, "WORKSPACE_BYTES", workspace)
    contexts = [1, 5, 37, 130, 300]
    k_cache, v_cache, tables = cache_and_tables(contexts, hk, 16, 8)
    chunks = [SeqChunk(t, n - 1, 1) for t, n in zip(tables, contexts)]
    meta = build_attention_metadata(chunks, BS, page_tokens=8)
    q = torch.randn(len(contexts), hq, 16)
    got = DECODE[impl](q, k_cache, v_cache, meta.decode, 0.3)
    for i, (c, n) in enumerate(zip(chunks, contexts)):
        s = build_attention_metadata([SeqChunk(c.block_table, 0, n)], BS).prefills[0].slots if n > 1 else torch.tensor([c.block_table[0] * BS])
        want = reference(q[i : i + 1], k_cache[s], v_cache[s], n - 1, 0.3)
        torch.testing.assert_close(got[i : i + 1].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", DECODE)
@pytest.mark.parametrize("window", [0, 1, 6, 9])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_sinks_and_windows_equals_the_reference(impl, window, sinks, dtype):
    """gpt-oss: the window (W keys, the query included: 1 and a window inside one block, 6 and 9 across
    blocks) and the sinks (large enough to matter) in the kernel and the torch path."""
    contexts = [1, 5, 8, 37, 130]
    hq, hk = 8, 2
    k_cache, v_cache, tables = cache_and_tables(contexts, hk, 16, 8, seed=7)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    chunks = [SeqChunk(t, n - 1, 1) for t, n in zip(tables, contexts)]
    meta = build_attention_metadata(chunks, BS, page_tokens=8, windows=(window,) if window else ())
    q = torch.randn(len(contexts), hq, 16).to(dtype)
    sink = torch.randn(hq) * 2 if sinks else None
    got = DECODE[impl](q, k_cache, v_cache, meta.decode_pages(window), 0.3, sinks=sink)
    for i, (t, n) in enumerate(zip(tables, contexts)):
        s = build_attention_metadata([SeqChunk(t, 0, n)], BS).prefills[0].slots if n > 1 else torch.tensor([t[0] * BS])
        want = reference(q[i : i + 1], k_cache[s], v_cache[s], n - 1, 0.3, window, sink)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got[i : i + 1].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("hq", [16, 6, 3])
def test_one_token_of_one_key_head_splits_its_query_heads_over_the_threads(threads, hq):
    """Fewer (token, key head) pairs than threads (MLA's absorbed form at batch 1): the kernel splits a pair's query
    heads into parts of 4 (16 heads: 2 or 4 parts; 6: 2 parts, the last short; 3: one part), each with its own slice
    of the sinks; every part's heads must equal the reference, whatever the thread count."""
    contexts = [70]
    k_cache, v_cache, tables = cache_and_tables(contexts, 1, 24, 16, seed=3)
    chunks = [SeqChunk(t, n - 1, 1) for t, n in zip(tables, contexts)]
    meta = build_attention_metadata(chunks, BS, page_tokens=8, windows=(20,))
    q = torch.randn(1, hq, 24)
    sink = torch.randn(hq) * 2
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = pa.decode_attention(q, k_cache, v_cache, meta.decode_pages(20), 0.3, sinks=sink)
    finally:
        torch.set_num_threads(before)
    s = build_attention_metadata([SeqChunk(tables[0], 0, 70)], BS).prefills[0].slots
    want = reference(q, k_cache[s], v_cache[s], 69, 0.3, 20, sink)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 3, 6])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("start", [0, 5, 11])
def test_prefill_with_sinks_and_windows_equals_the_reference(window, sinks, start):
    """A prefill chunk after ``start`` cached tokens, its keys gathered from its first query's window on."""
    hq, hk, length = 8, 2, 7
    gen = torch.Generator().manual_seed(start)
    keys, values = torch.randn(start + length, hk, 16, generator=gen), torch.randn(start + length, hk, 8, generator=gen)
    q = torch.randn(length, hq, 16, generator=gen)
    sink = torch.randn(hq, generator=gen) * 2 if sinks else None
    first = pa.window_start(start, window)
    got = pa.prefill_attention(q, keys[first:], values[first:], start, 0.3, window, sink, first)
    torch.testing.assert_close(got.double(), reference(q, keys, values, start, 0.3, window, sink), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", DECODE)
def test_decode_values_may_be_the_keys_leading_channels(impl):
    """MLA: one latent [R + dr] per token is both the key and (its first R channels) the value."""
    contexts = [3, 50]
    k_cache, _, tables = cache_and_tables(contexts, 1, 12, 1)
    meta = build_attention_metadata([SeqChunk(t, n - 1, 1) for t, n in zip(tables, contexts)], BS, page_tokens=8)
    q = torch.randn(2, 5, 12)
    got = DECODE[impl](q, k_cache, None, meta.decode, 0.5, value_dim=8)
    want = pa.decode_attention_reference(q, k_cache, k_cache[..., :8].contiguous(), meta.decode, 0.5)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("impl", DECODE)
def test_decode_at_deepseek_v2_lite_shapes(impl):
    """MLA's absorbed decode as V2-Lite runs it: 16 heads on one 576-wide latent (512 values), contexts that
    end inside a block and past a 4-head by 4-row tile (the kernel's register tiles and their tails)."""
    contexts = [1, 6, 71]
    k_cache, _, tables = cache_and_tables(contexts, 1, 576, 1, seed=5)
    meta = build_attention_metadata([SeqChunk(t, n - 1, 1) for t, n in zip(tables, contexts)], BS)
    q = torch.randn(len(contexts), 16, 576)
    got = DECODE[impl](q, k_cache, None, meta.decode, 576**-0.5, value_dim=512)
    for i, (t, n) in enumerate(zip(tables, contexts)):
        s = build_attention_metadata([SeqChunk(t, 0, n)], BS).prefills[0].slots if n > 1 else torch.tensor([t[0] * BS])
        want = reference(q[i : i + 1], k_cache[s], k_cache[s][..., :512], n - 1, 576**-0.5)
        torch.testing.assert_close(got[i : i + 1].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_in_half_precision_is_as_close_as_the_reference(dtype):
    """Half-precision caches: the kernel (fp32 sums) is at least as close to the float64 answer as the
    torch path (matmuls in the input dtype), within twice its error (research/parity.md, rule 4). Head sizes
    20 and 12 end in a partial vector (AVX2 loads 16-bit tails through a copy, AVX-512 through a mask)."""
    contexts = [2, 17, 64, 200]
    k_cache, v_cache, tables = cache_and_tables(contexts, 2, 20, 12, seed=3)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    meta = build_attention_metadata([SeqChunk(t, n - 1, 1) for t, n in zip(tables, contexts)], BS)
    q = torch.randn(len(contexts), 4, 20).to(dtype)
    want = torch.cat([reference(q[i : i + 1], k_cache[s], v_cache[s], n - 1, 0.2) for i, (n, s) in enumerate(
        (n, build_attention_metadata([SeqChunk(t, 0, n)], BS).prefills[0].slots) for t, n in zip(tables, contexts))])
    got = pa.decode_attention(q, k_cache, v_cache, meta.decode, 0.2)
    ref = pa.decode_attention_reference(q, k_cache, v_cache, meta.decode, 0.2)
    assert got.dtype == dtype
    kernel_err, torch_err = (x.double().sub(want).abs().max().item() for x in (got, ref))
    assert kernel_err <= 2 * torch_err, (kernel_err, torch_err)


def test_the_kernel_refuses_a_block_outside_the_cache():
    """A corrupt block table must be an error naming the token, not a read of another process's memory."""
    k_cache, v_cache, tables = cache_and_tables([9], 1, 8, 8)
    meta = build_attention_metadata([SeqChunk(tables[0], 8, 1)], BS)
    bad = meta.decode.block_tables.clone()
    bad[0, 1] = k_cache.shape[0] // BS  # one past the last block
    with pytest.raises(RuntimeError, match="decode token 0: block .* outside the cache"):
        native_ops().paged_decode_attention(torch.randn(1, 2, 8), k_cache, v_cache, bad, meta.decode.context_lens, BS, 0.5, 0, 0, torch.empty(0))


@pytest.mark.parametrize("hq, hk", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("start", [0, 9])
def test_prefill_tiles_equal_the_reference(monkeypatch, hq, hk, start):
    monkeypatch.setattr(pa, "WORKSPACE_BYTES", 2048)  # a few rows per tile: many tiles
    length = 23
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(start + length, hk, 16, generator=gen), torch.randn(start + length, hk, 8, generator=gen)
    q = torch.randn(length, hq, 16, generator=gen)
    got = pa.prefill_attention(q, keys, values, start, 0.25)
    torch.testing.assert_close(got.double(), reference(q, keys, values, start, 0.25), atol=1e-5, rtol=1e-5)
    wrong = pa.prefill_attention(q, keys, values, start + 1, 0.25)  # canary: an offset one off is caught
    assert not torch.allclose(wrong.double(), reference(q, keys, values, start, 0.25), atol=1e-3)


@pytest.fixture(scope="module")
def deepseek(checkpoints):
    return load_model(checkpoints["ds-qlora-grouped-yarn"][0], dtype="float32")[0]


@pytest.fixture(scope="module")
def qwen(checkpoints):
    return load_model(checkpoints["qwen3-norm-topk"][0], dtype="float32")[0]


def test_mla_absorbed_and_decompressed_prefill_agree(deepseek, monkeypatch):
    from afd.models.deepseek_v2 import MLAttention

    ids = torch.arange(3, 40)
    outs = []
    for absorbed in (True, False):
        monkeypatch.setattr(MLAttention, "_absorbed_is_cheaper", lambda self, q, n, a=absorbed: a)
        runner = ModelRunner(deepseek, CacheConfig(block_size=BS, num_blocks=64))
        blocks = BlockManager(64, BS)
        first = runner.execute(ids[:20].tolist(), [SeqChunk(blocks.ensure(0, 20), 0, 20)])
        second = runner.execute(ids[20:].tolist(), [SeqChunk(blocks.ensure(0, 37), 20, 17)])  # a chunk after cached tokens
        outs.append((first, second))
    for a, b in zip(*outs):
        assert compare_values("absorbed vs decompressed", a, b).ok


@pytest.mark.parametrize("which", ["deepseek", "qwen"])
def test_a_mixed_step_equals_one_by_one_runs(request, which):
    """A long-context decode, a short decode, a whole prompt and a chunk of a longer prompt in one step
    give each sequence the logits it gets alone."""
    model = request.getfixturevalue(which)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (180, 9, 31, 60)]
    new = [1, 1, 31, 17]  # tokens this step: decode, decode, whole prompt, chunk 43..59 of a 60-token prompt
    done = [n - k for n, k in zip(map(len, seqs), new)]

    def run(which_seqs):
        runner = ModelRunner(model, CacheConfig(block_size=BS, num_blocks=256))
        blocks = BlockManager(256, BS)
        for i in which_seqs:  # what is cached before the step, computed alone
            if done[i]:
                runner.execute(seqs[i][: done[i]], [SeqChunk(blocks.ensure(i, done[i]), 0, done[i])])
        chunks = [SeqChunk(blocks.ensure(i, len(seqs[i])), done[i], new[i]) for i in which_seqs]
        return runner.execute([t for i in which_seqs for t in seqs[i][done[i]:]], chunks)

    mixed = run(range(4))
    for i in range(4):
        report = compare_values(f"sequence {i}", run([i])[0], mixed[i])
        assert report.ok, str(report)


@pytest.mark.parametrize("hq, hk", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dk, dv", [(16, 16), (24, 16), (16, 24)])  # MLA's key is wider than its value
def test_fresh_chunks_attended_together_equal_the_reference(hq, hk, dtype, dk, dv):
    gen = torch.Generator().manual_seed(hq * 10 + hk)
    g, length = 3, 13
    q, k = (torch.randn(g, length, h, dk, generator=gen).to(dtype) for h in (hq, hk))
    v = torch.randn(g, length, hk, dv, generator=gen).to(dtype)
    got = pa.causal_attention(q, k, v, 0.25)
    assert got.shape == (g, length, hq, dv) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(g):
        torch.testing.assert_close(got[i].double(), reference(q[i], k[i], v[i], 0, 0.25), atol=tol, rtol=tol)


@pytest.mark.parametrize("dk, dv", [(24, 16), (16, 24), (16, 16)])
def test_prefill_attention_calls_the_fused_kernel_with_one_head_size_in_4d(monkeypatch, dk, dv):
    """CPU flash attention takes only 4-D inputs of one head size (else torch's math path builds every score):
    every call the prefill paths make is such, and the result still equals the reference."""
    seen = []
    sdpa = pa.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.dim(), k.dim(), v.dim(), q.shape[-1], k.shape[-1], v.shape[-1]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(pa.F, "scaled_dot_product_attention", spy)
    gen = torch.Generator().manual_seed(dk + dv)
    for hq, hk in [(4, 4), (4, 2), (4, 1)]:
        q = torch.randn(5, hq, dk, generator=gen)
        keys, values = torch.randn(9, hk, dk, generator=gen), torch.randn(9, hk, dv, generator=gen)
        torch.testing.assert_close(pa.prefill_attention(q, keys, values, 4, 0.3).double(), reference(q, keys, values, 4, 0.3),
                                   atol=1e-5, rtol=1e-5)
        fresh = [torch.randn(2, 6, h, d, generator=gen) for h, d in ((hq, dk), (hk, dk), (hk, dv))]
        pa.causal_attention(*fresh, 0.3)
    assert len(seen) == 6
    assert all(call == (4, 4, 4) + (max(dk, dv),) * 3 for call in seen), seen


def test_fresh_groups_take_same_length_prompts_that_start_their_sequence(monkeypatch):
    from afd.kvcache.metadata import PrefillChunk

    def chunk(start, length):
        return PrefillChunk(0, start, length, torch.arange(start + length))

    prefills = [chunk(0, 8), chunk(0, 8), chunk(4, 8), chunk(0, 5), chunk(0, 8), chunk(0, 6), chunk(0, 6)]
    assert pa.fresh_groups(prefills) == ([[0, 1, 4], [5, 6]], [2, 3])  # a cached prefix (2) and a lone length (3) alone
    assert pa.fresh_groups(prefills, fits=lambda c: c.length != 6) == ([[0, 1, 4]], [2, 3, 5, 6])
    monkeypatch.setattr(pa, "WORKSPACE_BYTES", 2 * 8 * 8 * 4)  # two chunks' [8, 8] scores
    assert pa.fresh_groups(prefills)[0] == [[0, 1], [4], [5, 6]]


@pytest.mark.parametrize("which", ["deepseek", "qwen"])
def test_a_burst_of_new_prompts_is_attended_together_and_equals_one_by_one_runs(request, monkeypatch, which):
    """Three new prompts of one length (one batched call a layer), a new prompt of another length, a chunk after
    cached tokens and a decode in one step give each sequence the logits it gets alone."""
    import importlib

    model = request.getfixturevalue(which)
    module = importlib.import_module(type(model.model.layers[0].self_attn).__module__)
    calls = []
    real = module.causal_attention
    monkeypatch.setattr(module, "causal_attention", lambda q, *a: calls.append(q.shape[:2]) or real(q, *a))
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (24, 24, 24, 10, 40, 30)]
    new = [24, 24, 24, 10, 24, 1]
    done = [n - k for n, k in zip(map(len, seqs), new)]

    def run(which_seqs):
        runner = ModelRunner(model, CacheConfig(block_size=BS, num_blocks=256))
        blocks = BlockManager(256, BS)
        for i in which_seqs:
            if done[i]:
                runner.execute(seqs[i][: done[i]], [SeqChunk(blocks.ensure(i, done[i]), 0, done[i])])
        chunks = [SeqChunk(blocks.ensure(i, len(seqs[i])), done[i], new[i]) for i in which_seqs]
        return runner.execute([t for i in which_seqs for t in seqs[i][done[i]:]], chunks)

    burst = run(range(6))
    assert calls == [(3, 24)] * model.config.num_layers  # the three fresh 24-token prompts, together, in every layer
    calls.clear()
    for i in range(6):
        report = compare_values(f"sequence {i}", run([i])[0], burst[i])
        assert report.ok, str(report)
    assert calls == []  # alone, every prompt takes the per-chunk path


def test_mla_decode_steps_run_the_native_call_and_equal_its_torch_twin(deepseek, monkeypatch):
    """An MLA model's decode rows take ``mla_decode`` once a layer (counted) and give the logits of the torch ops it
    replaces (``native_mla`` off); prefill rows never take it."""
    from afd.models import deepseek_v2

    calls = []
    real = deepseek_v2.native_mla

    def counted(*args):
        kernels = real(*args)
        if kernels is None:
            return None
        return type("Counted", (), {"mla_decode": lambda self, *a: calls.append(a[0].shape[0]) or kernels.mla_decode(*a)})()

    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (9, 14, 5)]

    def run():
        runner = ModelRunner(deepseek, CacheConfig(block_size=BS, num_blocks=64))
        blocks = BlockManager(64, BS)
        runner.execute([t for s in seqs for t in s[:-1]], [SeqChunk(blocks.ensure(i, len(s) - 1), 0, len(s) - 1) for i, s in enumerate(seqs)])
        return runner.execute([s[-1] for s in seqs], [SeqChunk(blocks.ensure(i, len(s)), len(s) - 1, 1) for i, s in enumerate(seqs)])

    monkeypatch.setattr(deepseek_v2, "native_mla", counted)
    native = run()
    assert calls == [3] * deepseek.config.num_layers  # the decode step's three rows, once a layer; the prefill none
    monkeypatch.setattr(deepseek_v2, "native_mla", lambda *a: None)
    assert compare_values("mla_decode vs torch ops", run(), native).ok
