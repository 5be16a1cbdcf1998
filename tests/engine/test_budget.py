"""The step-memory model against what a step really allocates (torch.profiler with profile_memory), on a
few step shapes of a model with DeepSeek-V2-Lite's attention dimensions; and the flags' resolution."""

from __future__ import annotations

import pytest
import torch

from afd.config import CacheConfig
from afd.engine.budget import StepBudget, engine_limits
from afd.engine.model_runner import ModelRunner
from afd.kvcache import BlockManager, SeqChunk
from afd.models import paged_attention
from afd.models.hf_config import parse_hf_config
from afd.models.synthetic import deepseek_v2_lite_shaped, random_model


def small_v2_lite() -> dict:
    """V2-Lite's attention (hidden 2048, 16 heads, MLA 512/64/128), small experts and MLP, 2 layers."""
    raw = deepseek_v2_lite_shaped(num_layers=2, vocab_size=1000)
    raw.update(intermediate_size=512, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1)
    return raw


def peak_bytes(fn) -> int:
    """The highest sum of live CPU allocations made inside ``fn`` (what it held at its peak)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # the allocator's own events: + bytes on allocation, - bytes on free, in time order
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


SHAPES = {  # name -> (chunks as (cached, new) per sequence)
    "32 decodes at context 300": [(300, 1)] * 32,
    "a 1024-token prompt": [(0, 1024)],
    "a 900-token chunk beside 24 decodes": [(200, 900)] + [(150, 1)] * 24,
    "8 prompts of 64": [(0, 64)] * 8,
}


@pytest.mark.parametrize("decode", ["native kernel", "torch ops"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_model_bounds_what_a_step_allocates(monkeypatch, name, decode):
    """The bound holds on both decode paths and is tight on the torch one, which gathers every context (the
    native kernel reads the cache in place and allocates next to nothing: the model keeps the worst case)."""
    if decode == "torch ops":
        monkeypatch.setattr(paged_attention, "native_ops", lambda: None)
    raw = small_v2_lite()
    config = parse_hf_config(raw)
    model = random_model(raw, torch.float32)
    shape = SHAPES[name]
    blocks = BlockManager(4096, 16)
    runner = ModelRunner(model, CacheConfig(16, 4096))
    chunks = [SeqChunk(blocks.ensure(i, c + n), c, n) for i, (c, n) in enumerate(shape)]
    tokens = sum(n for _, n in shape)
    ids = torch.randint(0, 1000, (tokens,)).tolist()
    measured = peak_bytes(lambda: runner.execute(ids, chunks))
    budget = StepBudget.for_model(config, torch.float32, max_model_len=2048, max_num_seqs=len(shape))
    bound = budget.bytes_for(tokens)
    assert measured <= bound, f"{name}: a step allocated {measured >> 20} MiB, the model says at most {bound >> 20} MiB"
    if decode == "torch ops":
        assert bound <= 6 * measured + (32 << 20), f"{name}: the model's {bound >> 20} MiB is far from the {measured >> 20} MiB used"


def test_flags_resolve_and_a_token_cap_beyond_the_step_memory_is_refused():
    config = parse_hf_config(small_v2_lite())
    limits = engine_limits(config, torch.bfloat16, 256 << 20, 16, 64)
    # the default: as much as the KV cache, but at least a 512-token step
    assert limits.max_step_memory == max(256 << 20, limits.budget.bytes_for(512))
    assert limits.budget.bytes_for(limits.max_num_batched_tokens) <= limits.max_step_memory
    assert limits.budget.bytes_for(limits.max_num_batched_tokens + 16) > limits.max_step_memory  # the largest that fits
    with pytest.raises(ValueError, match="--max-num-batched-tokens 16384 needs up to"):
        engine_limits(config, torch.bfloat16, 256 << 20, 16, 64, max_step_memory=400 << 20, max_num_batched_tokens=16384)
    with pytest.raises(ValueError, match="holds no step"):
        engine_limits(config, torch.bfloat16, 256 << 20, 16, 64, max_step_memory=1 << 20)


def test_a_context_longer_than_the_kv_cache_holds_is_capped_and_said():
    config = parse_hf_config(small_v2_lite())
    small = engine_limits(config, torch.bfloat16, 8 << 20, 16, 8)  # 8 MiB of KV: a few thousand tokens, the model has 163840
    assert small.max_model_len == small.num_blocks * 16 < config.max_position_embeddings
    assert "capped from the model's 163840" in small.describe()
    with pytest.raises(ValueError, match="beyond the model's context"):
        engine_limits(config, torch.bfloat16, 8 << 20, 16, 8, max_model_len=10**6)


def test_native_decode_reads_the_cache_in_place(monkeypatch):
    """What the native kernel claims, counted: a decode step makes no copy of its contexts. 32 decodes at
    context 300 of V2-Lite's 576-wide latent gather ~22 MiB a layer on the torch path; the kernel's step
    allocates less than a quarter of the torch path's peak (an engine that silently fell back would not)."""
    raw = small_v2_lite()
    model = random_model(raw, torch.float32)
    runner = ModelRunner(model, CacheConfig(16, 4096))
    blocks = BlockManager(4096, 16)
    chunks = [SeqChunk(blocks.ensure(i, 301), 300, 1) for i in range(32)]
    ids = torch.randint(0, 1000, (32,)).tolist()
    native = peak_bytes(lambda: runner.execute(ids, chunks))
    monkeypatch.setattr(paged_attention, "native_ops", lambda: None)
    gathered = peak_bytes(lambda: runner.execute(ids, chunks))
    assert native * 4 < gathered, f"native decode step peaked at {native >> 20} MiB, the torch path at {gathered >> 20} MiB"
