"""DeepSeek-V4's FFN half against transformers' own modules (the first step of issue 28: the attention, the
hyper-connections and the cache come next): sqrt(softplus) scoring with the selection bias, hash routing by
token id, the clamped SwiGLU of the routed experts (torch path and the C++ loop) and of the shared expert."""

from __future__ import annotations

import pytest
import torch

from afd.config import MoEConfig
from afd.models.base import MoEBlock
from afd.testing.parity import compare_values

H, E, K, INTER, VOCAB, LIMIT = 64, 8, 2, 32, 320, 1.5


@pytest.fixture(scope="module")
def blocks():
    """transformers' V4 MoE blocks (layer 0 hash-routed, layer 1 top-k), decisive random weights and a random
    tid2eid, and afd's MoEBlocks holding the same weights."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    from afd.config import ModelConfig, RopeConfig

    config = DeepseekV4Config(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=2, num_local_experts=E, num_experts_per_tok=K,
                              intermediate_size=INTER, swiglu_limit=LIMIT, routed_scaling_factor=1.7,
                              mlp_layer_types=["hash_moe", "moe"], layer_types=["sliding_attention", "sliding_attention"])
    moe = MoEConfig(num_experts=E, top_k=K, intermediate_size=INTER, layers=(0, 1), num_shared_experts=1, topk_method="noaux_tc",
                    scoring="sqrtsoftplus", scale_after_norm=True, norm_topk_prob=True, routed_scaling_factor=1.7,
                    swiglu_limit=LIMIT, swiglu_alpha=1.0, swiglu_offset=0.0, hash_layers=(0,))
    ours_config = ModelConfig("DeepseekV4ForCausalLM", VOCAB, H, 2, 4, 1, 16, INTER, 1e-6, 256, RopeConfig(10000.0, 16, False), moe)
    gen = torch.Generator().manual_seed(7)
    out = []
    for layer in (0, 1):
        hf = DeepseekV4SparseMoeBlock(config, layer).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            if layer == 0:
                hf.gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(VOCAB)]))
            else:
                hf.gate.e_score_correction_bias.copy_((torch.rand(E, generator=gen) - 0.5) * 0.5)
        ours = MoEBlock(ours_config, range(E), layer).eval()
        with torch.no_grad():
            ours.gate.weight.copy_(hf.gate.weight)
            if layer == 0:
                ours.gate.tid2eid.copy_(hf.gate.tid2eid)
            else:
                ours.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
            ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)  # [E, 2I, H], gate rows first in both
            ours.experts.down_proj.copy_(hf.experts.down_proj)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(ours.shared_experts, name).weight.copy_(getattr(hf.shared_experts, name).weight)
        out.append((hf, ours))
    return out


def _ours(block: MoEBlock, x: torch.Tensor, ids: torch.Tensor, native: bool = True) -> torch.Tensor:
    routing = block.gate(x, ids)
    experts = block.experts(x, routing.topk_ids, routing.topk_weights) if native else \
        block.experts.reference(x, routing.topk_ids, routing.topk_weights)
    return experts + block.shared_experts(x)


def _inputs(t: int = 24):
    gen = torch.Generator().manual_seed(t)
    return torch.randn(t, H, generator=gen) * 2, torch.randint(0, VOCAB, (t,), generator=gen)


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("t", [1, 3, 24])
@torch.no_grad()
def test_v4_moe_block_equals_transformers(blocks, layer, t):
    """t = 1 and 3 run the C++ loop's decode path, 24 its per-expert GEMMs; the torch twin alike."""
    hf, ours = blocks[layer]
    x, ids = _inputs(t)
    ref = hf(x[None], input_ids=ids[None])[0]
    _, hf_weights, hf_ids = hf.gate(x[None], ids[None]) if layer == 0 else hf.gate(x[None])
    routing = ours.gate(x, ids)
    assert torch.equal(routing.topk_ids.sort(-1).values, hf_ids.sort(-1).values), "other experts chosen"
    torch.testing.assert_close(routing.topk_weights.gather(1, routing.topk_ids.argsort(-1)), hf_weights.gather(1, hf_ids.argsort(-1)))
    for native in (True, False):
        report = compare_values(f"layer {layer} T={t} native={native}", ref, _ours(ours, x, ids, native))
        assert report.ok, str(report)
    clamped = (ours.experts.gate_up_proj[:, :INTER] @ x.T).abs().max()
    assert clamped > 2 * LIMIT, "the inputs never reach the clamp: the check cannot see it"


@torch.no_grad()
def test_a_hash_layer_without_token_ids_is_refused(blocks):
    _, ours = blocks[0]
    with pytest.raises(ValueError, match="chooses its experts by token id"):
        ours.gate(torch.zeros(2, H))


@torch.no_grad()
def test_canary_hash_table_read_with_the_token_before_fails(blocks):
    hf, ours = blocks[0]
    x, ids = _inputs()
    ref = hf(x[None], input_ids=ids[None])[0]
    shifted = torch.cat((ids[:1], ids[:-1]))  # each row routed by the previous position's token
    assert not compare_values("hash off by one", ref, _ours(ours, x, shifted)).ok


@pytest.mark.parametrize("native", [True, False])
@torch.no_grad()
def test_canary_gpt_oss_activation_in_place_of_v4s_fails(blocks, native):
    hf, ours = blocks[1]
    x, ids = _inputs()
    ref = hf(x[None], input_ids=ids[None])[0]
    experts = ours.experts
    experts.swiglu_alpha, experts.swiglu_offset = 1.702, 1.0
    try:
        assert not compare_values("gpt-oss's SwiGLU", ref, _ours(ours, x, ids, native)).ok
    finally:
        experts.swiglu_alpha, experts.swiglu_offset = 1.0, 0.0


@torch.no_grad()
def test_canary_unclamped_shared_expert_fails(blocks):
    hf, ours = blocks[1]
    x, ids = _inputs()
    ref = hf(x[None], input_ids=ids[None])[0]
    saved = ours.shared_experts.swiglu
    ours.shared_experts.swiglu = (None, 1.0, 0.0)
    try:
        assert not compare_values("shared expert unclamped", ref, _ours(ours, x, ids)).ok
    finally:
        ours.shared_experts.swiglu = saved
