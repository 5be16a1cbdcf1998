"""Test support: random Hugging Face checkpoints written by transformers itself, and references.

Weights are *decisive* (init std 0.15, non-default routed_scaling_factor,
group-limited top-k with n_group > 1, top-k >= 2) so that a routing bug moves
outputs well past the parity tolerance (see shared/research/parity.md).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Callable

import torch

TOKENIZER_TEXT = [
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles",
    "And by opposing end them. To die: to sleep;",
    "Now is the winter of our discontent made glorious summer.",
]

DEEPSEEK_CASES = {
    # q_lora, group-limited top-k over 4 groups, YaRN with mscale != mscale_all_dim, two dense layers
    "ds-qlora-grouped-yarn": dict(
        q_lora_rank=24,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    ),
    # no q_lora, greedy top-k, default RoPE
    "ds-noqlora-greedy": dict(q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.7, first_k_dense_replace=2),
}

DEEPSEEK_V3_CASES = {
    # q_lora, sigmoid + e_score_correction_bias over 4 groups (keep 2), YaRN, norm_topk_prob then x2.5, 2 dense
    # layers, an MTP layer in the checkpoint
    "dsv3-grouped-yarn": dict(
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    # no group limit, no normalisation (scaled only), halves RoPE layout (rope_interleave false)
    "dsv3-flat-nonorm": dict(n_group=1, topk_group=1, routed_scaling_factor=1.7, norm_topk_prob=False, first_k_dense_replace=1,
                             rope_interleave=False),
}

GLM_CASES = {
    # partial rotary 0.5, q/k/v bias, q/k norm, 2 groups of 4 (keep 1)
    "glm4-qknorm-bias": dict(use_qk_norm=True, attention_bias=True, n_group=2, topk_group=1, routed_scaling_factor=2.5),
    # no q/k norm, no bias, partial rotary 0.25, one group
    "glm4-plain": dict(use_qk_norm=False, attention_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                                  "partial_rotary_factor": 0.25}),
}

QWEN_CASES = {
    "qwen3-norm-topk": dict(norm_topk_prob=True),
    "qwen3-no-norm-topk": dict(norm_topk_prob=False),
}


DSA_CASES = {
    # DeepSeek-V3.2: indexer rotary in halves, 16 index heads, top-6 (shorter than the prompts), groups of 2 of 4
    "dsv32-top6": dict(n_group=4, topk_group=2),
    # GLM-5: interleaved indexer rotary, layers 1 and 3 reuse the top-k of the layer before them, top-5
    "glm5-shared-top5": dict(index_topk=5, indexer_types=["full", "shared", "full", "shared"]),
}

MINIMAX_CASES = {
    # q/k norm over the whole projection, rotary on the first 8 of 16 channels, sigmoid + bias over 8 experts
    "minimax-m2-rotary8": dict(rotary_dim=8),
}

GPT_OSS_CASES = {
    # the default alternation (even layers sliding), a window of 6 across block boundaries (block size 4)
    "gptoss-window6": dict(sliding_window=6),
    # a window of 3 on the middle layers only; YaRN with truncate false (gpt-oss's default rope)
    "gptoss-window3": dict(sliding_window=3, layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"]),
}

HYBRID_CASES = {
    # Qwen3.5-MoE's language model: 4 value heads over 2 key heads, layer_types with layer 2 full, a gated shared expert
    "qwen35-moe": dict(layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"]),
    # the release's multimodal layout (text_config, model.language_model.*, a vision tower, mtp.* tensors), M-RoPE
    # sections over the rotated channels; layer kinds from the default full_attention_interval (every 4th)
    "qwen35-moe-vl": dict(multimodal=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                                            "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
    # Qwen3-Next: fused in_proj_qkvz / in_proj_ba grouped per key head, 3 value heads per key head, a dense layer
    "qwen3-next": dict(next=True, linear_num_value_heads=6, mlp_only_layers=[1], full_attention_interval=2),
}

V4_CASES = {
    # DeepSeek-V4: a hash-routed layer, CSA (rate 4, the indexer's top 3) and HCA (rate 8) over a window of 8, two
    # streams, 3 Sinkhorn rounds; the compressed branch's YaRN (attention_factor 1, as the release's)
    "v4-csa-hca": dict(layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                                    "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    # HCA first, two hash-routed layers, three streams, the default rope
    "v4-hca-first": dict(layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                                      "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=3),
}

#: what every tiny test model shares (decisive init: see the module docstring)
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            max_position_embeddings=256, initializer_range=0.15, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
            num_experts_per_tok=2)
#: DeepSeek's multi-head latent attention, small
TINY_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def deepseek_config(**overrides):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**{**TINY, **TINY_MLA, "first_k_dense_replace": 1, "n_routed_experts": 8, "n_shared_experts": 2, **overrides})


def qwen3_config(**overrides):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
                             "mlp_only_layers": [0], **overrides})


def deepseek_v3_config(**overrides):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**TINY, **TINY_MLA, "q_lora_rank": 24, "n_routed_experts": 8, "n_shared_experts": 1, **overrides})


def glm4_moe_config(**overrides):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**{**TINY, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                            "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True, **overrides})


def dsa_config(**overrides):
    """DeepSeek-V3.2 (or GLM-5 when ``indexer_types`` is given) with DeepSeek Sparse Attention, small."""
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    cls = GlmMoeDsaConfig if "indexer_types" in overrides else DeepseekV32Config
    # 16 index heads: a position scores exactly 0 when every head's q.k is negative (ReLU), and exact ties at
    # the top-k cutoff are broken in an implementation-defined order (torch.topk's, afd's kernel: the lower
    # position); with 8 heads the test's sequences met such a tie, with 16 none
    return cls(**{**TINY, **TINY_MLA, "q_lora_rank": 24, "n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1,
                  "index_n_heads": 16, "index_head_dim": 16, "index_topk": 6, **overrides})


def minimax_m2_config(**overrides):
    from transformers import MiniMaxM2Config

    return MiniMaxM2Config(**{**TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
                              "intermediate_size": 32, **overrides})


def gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    return GptOssConfig(**{**TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
                           "intermediate_size": 32, **overrides})


def hybrid_config(next: bool = False, multimodal: bool = False, **overrides):
    """Qwen3.5-MoE (its language model, or with ``multimodal`` the released ConditionalGeneration layout) or
    Qwen3-Next, small: Gated DeltaNet layers beside full attention."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3NextConfig

    # init std 0.1, the low end of decisive (parity.md rule 1): each layer's gated RMSNorm of the state's output
    # amplifies fp32 rounding, and at 0.15 four layers lift batch-composition differences to ~2e-5 relative
    text = {**TINY, "initializer_range": 0.1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
            "shared_expert_intermediate_size": 48, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, **overrides}
    if next:
        return Qwen3NextConfig(**text)
    if multimodal:
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=TINY["hidden_size"])
        return Qwen3_5MoeConfig(text_config=text, vision_config=vision, initializer_range=text["initializer_range"],
                                tie_word_embeddings=False)
    return Qwen3_5MoeTextConfig(**text)


def v4_config(**overrides):
    """DeepSeek-V4, small (see V4_CASES). Eight index heads: with two, relu(q . k) is zero in every head for a
    quarter of the entries, so the indexer's top-k meets exact ties that any two batch shapes break differently."""
    from transformers import DeepseekV4Config

    tiny = {k: v for k, v in TINY.items() if k != "intermediate_size"}
    base = dict(num_attention_heads=4, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=16, o_groups=2, o_lora_rank=16, sliding_window=8,
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, index_n_heads=8,
                index_head_dim=16, index_topk=3, n_routed_experts=8, n_shared_experts=1, hc_mult=2, hc_sinkhorn_iters=3)
    return DeepseekV4Config(**{**tiny, **base, **overrides})


def hf_layers(hf_model):
    """The decoder layers of a transformers model (a multimodal one's language model's)."""
    inner = hf_model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


def build_hf_model(config, seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    if config.model_type == "qwen3_5_moe":
        model = Qwen3_5MoeForConditionalGeneration(config).to(torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for name, p in model.named_parameters():
        if name.endswith("gate.weight"):
            assert p.std() > 0.05, f"{name} is not initialised decisively"
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # transformers initialises it to zero: make it change selections
            b.copy_((torch.rand(b.shape, generator=gen) - 0.5) * 0.6)
    with torch.no_grad():  # gpt-oss: sinks and biases decisive too (transformers starts some at zero)
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.copy_(torch.randn(p.shape, generator=gen) * 1.5)
            elif name.endswith(("mlp.router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith("norm.weight") and "qwen3_" in config.model_type and "visual" not in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)  # zero-centred norms start at 0: make 1 + w matter
            elif name.endswith(("position_bias", "hc.base", "hc_head.hc_base")):  # DeepSeek-V4 starts these at zero
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("hc.scale", "hc_head.hc_scale")):  # ... and these at one
                p.copy_(1 + torch.rand(p.shape, generator=gen) * 3)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):  # DeepSeek-V4's hash table starts at zero: a random one, distinct experts per token
                b.copy_(torch.stack([torch.randperm(config.n_routed_experts, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]))
    return model


def write_tokenizer(model_dir: Path) -> None:
    """A small byte-level BPE with <s>/</s>, BOS added by the post-processor."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TOKENIZER_TEXT, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )


def save_checkpoint(model, model_dir: Path, max_shard_size: str | None = None, hub_style: bool = False,
                    with_mtp: bool = False) -> Path:
    """save_pretrained + tokenizer. ``hub_style`` rewrites config.json in the DeepSeek-V2-Lite hub schema
    (top-level ``rope_theta`` and legacy ``rope_scaling: {"type": ...}``). ``with_mtp`` adds a
    multi-token-prediction layer after the last decoder layer, laid out as DeepSeek-V3's release stores it
    (``model.layers.{L}``: a decoder layer plus enorm, hnorm, eh_proj, shared_head), in its own shard."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(model_dir, **kwargs)
    write_tokenizer(model_dir)
    if with_mtp and model.config.model_type.startswith("qwen3_"):  # Qwen's mtp.* tensors, as Qwen3.5 and Qwen3-Next ship them
        h = model.config.get_text_config().hidden_size
        save_file({"mtp.fc.weight": torch.randn(h, 2 * h), "mtp.norm.weight": torch.zeros(h),
                   "mtp.layers.0.input_layernorm.weight": torch.zeros(h)}, model_dir / "model-mtp.safetensors", metadata={"format": "pt"})
    elif with_mtp:
        n, h = model.config.num_hidden_layers, model.config.hidden_size
        last = f"model.layers.{n - 1}."
        mtp = {f"model.layers.{n}." + k.removeprefix(last): v.clone().contiguous()
               for k, v in model.state_dict().items() if k.startswith(last)}
        mtp.update({f"model.layers.{n}.enorm.weight": torch.ones(h), f"model.layers.{n}.hnorm.weight": torch.ones(h),
                    f"model.layers.{n}.eh_proj.weight": torch.randn(h, 2 * h),
                    f"model.layers.{n}.shared_head.head.weight": torch.randn(model.config.vocab_size, h)})
        save_file(mtp, model_dir / "model-mtp.safetensors", metadata={"format": "pt"})
    if hub_style:
        path = model_dir / "config.json"
        raw = json.loads(path.read_text())
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        rope_type = rope.pop("rope_type")
        raw["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
        raw.pop("dtype", None)
        raw["torch_dtype"] = "float32"
        raw["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV2Config"}
        path.write_text(json.dumps(raw, indent=2))
    return model_dir


_FP64: dict[int, object] = {}


@torch.no_grad()
def fp64_logits_report(hf_model, ids: list[int], got: torch.Tensor, name: str):
    """``got`` (afd's last-token logits of ``ids``) against transformers in float64, allowed twice transformers'
    own fp32 error there (at least parity.md's 1e-5 relative): the rule for the hybrid models, whose gated norms
    of small state outputs amplify fp32 rounding past 1e-5 between any two fp32 implementations."""
    import copy

    from afd.testing.parity import ValueReport

    if id(hf_model) not in _FP64:
        wide = copy.deepcopy(hf_model).double()
        for module in wide.modules():  # torch's grouped GEMM has no float64: the experts' plain loop
            if getattr(module, "config", None) is not None:
                module.config._experts_implementation = "eager"
        _FP64[id(hf_model)] = wide
    ref = _FP64[id(hf_model)](torch.tensor([ids]), use_cache=False).logits[0, -1]
    own = (hf_model(torch.tensor([ids]), use_cache=False).logits[0, -1].double() - ref).abs().max().item()
    norm = ref.abs().max().item()
    return ValueReport(name, (got.double() - ref).abs().max().item(), norm, max(2 * own, 1e-5 * max(1.0, norm)))


def most_blocks_held(engine, rid: int) -> tuple[int, int]:
    """Step ``engine`` until it is done; the most window-pool and full-pool blocks request ``rid`` held after a step."""
    most_window, most_full = 0, 0
    while engine.has_unfinished():
        engine.step()
        if engine.blocks.holds(rid):
            most_window = max(most_window, sum(b is not None for b in engine.blocks.window_table(rid)))
            most_full = max(most_full, len(engine.blocks.table(rid)))
    return most_window, most_full


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``prompt`` (no cache: the whole sequence each step) and the top-2 logit
    gap at each step (the near-tie rule's input)."""
    from afd.testing.parity import top2_gap

    seq, gaps = list(prompt), []
    for _ in range(steps):
        logits = hf_model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        gaps.append(top2_gap(logits))
        seq.append(int(logits.argmax()))
    return seq[len(prompt):], gaps


@torch.no_grad()
def hf_reference(hf_model, ids: list[int]):
    """One sequence through transformers (no cache): per-layer outputs [L][T, H], router (logits, ids), logits [T, V]."""
    layer_out: dict[int, torch.Tensor] = {}
    router: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(hf_layers(hf_model)):
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: layer_out.__setitem__(i, o[0] if isinstance(o, tuple) else o)))
        gate = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)  # gpt-oss: "router"
        if gate is not None:
            hooks.append(gate.register_forward_hook(lambda m, a, o, i=i: router.__setitem__(i, (o[0], o[2]))))
    try:
        out = hf_model(torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {i: v[0] for i, v in layer_out.items()}, router, out.logits[0].float()


def selection_scores(router_logits: torch.Tensor, config, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference scores the top-k is taken over: softmax, then the group mask for group-limited top-k;
    for V3/GLM (``bias`` given: the gate's e_score_correction_bias) sigmoid + bias, groups by their top two;
    MiniMax-M2 sigmoid + bias over every expert."""
    if bias is not None and config.model_type == "minimax_m2":
        return router_logits.float().sigmoid() + bias
    if config.model_type == "deepseek_v4":  # sqrt(softplus), plus the bias of a top-k layer (a hash layer's table chooses)
        scores = torch.nn.functional.softplus(router_logits.float()).sqrt()
        return scores if bias is None else scores + bias
    if bias is not None:
        scores = router_logits.float().sigmoid() + bias
        groups = scores.view(scores.shape[0], config.n_group, -1)
        keep = groups.topk(2, dim=-1).values.sum(-1).topk(config.topk_group, dim=-1).indices
        mask = torch.zeros(scores.shape[0], config.n_group, dtype=torch.bool).scatter_(1, keep, True)
        return scores.masked_fill(~mask.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
    scores = router_logits.float().softmax(-1)
    if getattr(config, "topk_method", None) == "group_limited_greedy":
        groups = scores.view(scores.shape[0], config.n_group, -1)
        keep = groups.max(-1).values.topk(config.topk_group, dim=-1).indices
        mask = torch.zeros(scores.shape[0], config.n_group, dtype=torch.bool).scatter_(1, keep, True)
        scores = scores.masked_fill(~mask.repeat_interleave(groups.shape[-1], dim=1), 0.0)
    return scores


class Capture:
    """An observer for MoEModel.forward that keeps every boundary tensor."""

    def __init__(self) -> None:
        self.values: dict[tuple[int, str], torch.Tensor] = {}

    def __call__(self, layer: int, boundary: str, tensor: torch.Tensor) -> None:
        self.values[(layer, boundary)] = tensor.detach().clone()

    def __getitem__(self, key):
        return self.values[key]


def cache_config(model, block_size: int, num_blocks: int, num_seqs: int = 8):
    """A CacheConfig for ``model``: with state slots for ``num_seqs`` sequences when it has linear-attention layers."""
    from afd.config import CacheConfig

    return CacheConfig(block_size=block_size, num_blocks=num_blocks, num_state_slots=num_seqs if model.config.linear else 0,
                       num_window_blocks=num_blocks if model.config.compressed else 0)


def runner_and_blocks(model, block_size: int, num_blocks: int, num_seqs: int = 8):
    """A monolithic runner and a block manager of the same cache (state slots where the model needs them;
    DeepSeek-V4's window pool, as large as the full one: nothing is released behind the window)."""
    from afd.engine.model_runner import ModelRunner
    from afd.kvcache import make_blocks

    cache = cache_config(model, block_size, num_blocks, num_seqs)
    return ModelRunner(model, cache), make_blocks(num_blocks, block_size, False, cache.num_window_blocks, model.config.sliding_window or 0,
                                                  cache.num_state_slots)


def new_chunk(blocks, seq_id: int, tokens: list[int]):
    """The chunk of a new sequence's whole prompt (its blocks, and its state slot where the model keeps state)."""
    blocks.ensure(seq_id, len(tokens))
    return blocks.chunk(seq_id, 0, len(tokens))


@torch.no_grad()
def monolithic_capture(model, prompts: list[list[int]]):
    """The monolithic reference: one prefill batch with every boundary captured."""

    num_blocks = sum(-(-len(p) // 16) for p in prompts) + 4
    runner, blocks = runner_and_blocks(model, 16, num_blocks, len(prompts))
    chunks = [new_chunk(blocks, i, p) for i, p in enumerate(prompts)]
    cap = Capture()
    logits = runner.execute([t for p in prompts for t in p], chunks, observer=cap)
    return cap.values, logits


def split_parity_failures(model, ref_values, ref_logits, values, logits, check_topk: bool = True) -> list[str]:
    """Per-layer values, expert ids (with the near-tie margin) and logits of a split run vs the monolithic one."""
    from afd.testing.parity import compare_topk, compare_values

    failures = []
    for (layer, boundary), ref in ref_values.items():
        if boundary == "topk_ids":
            if check_topk and (layer, boundary) in values:
                report = compare_topk(f"layer {layer} experts", ref, values[(layer, boundary)], _router_scores(model, ref_values, layer))
                if not report.ok:
                    failures.append(str(report))
            continue
        report = compare_values(f"layer {layer} {boundary}", ref, values[(layer, boundary)])
        if not report.ok:
            failures.append(str(report))
    report = compare_values("logits", ref_logits, logits)
    if not report.ok:
        failures.append(str(report))
    return failures


def _router_scores(model, ref_values, layer):
    block, streams = model.model.layers[layer], ref_values[(layer, "attn_output")]
    ffn_input = block.post_attention_layernorm(block.ffn_hc(streams)[2] if model.config.compressed else streams)
    gate = model.model.layers[layer].mlp.gate
    return gate.logits(ffn_input).softmax(-1)


@torch.no_grad()
def greedy_with_gaps(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Monolithic greedy decode of one prompt over the paged cache; returns tokens and top-2 logit gaps."""
    from afd.testing.parity import top2_gap

    runner, blocks = runner_and_blocks(model, 16, 64, 1)
    seq = list(prompt)
    logits = runner.execute(seq, [new_chunk(blocks, 0, seq)])[0]
    tokens, gaps = [], []
    for _ in range(steps):
        gaps.append(top2_gap(logits))
        tokens.append(int(logits.argmax()))
        seq.append(tokens[-1])
        blocks.ensure(0, len(seq))
        logits = runner.execute([seq[-1]], [blocks.chunk(0, len(seq) - 1, 1)])[0]
    return tokens, gaps


def run_processes(run_id: str) -> dict[int, str]:
    """pid -> process title (``/proc/<pid>/comm``: ``afd ffn 1`` for a rank) of every live process whose
    environment carries this run id (the launcher, the run's fork server, its ranks)."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            comm = open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            continue
        if f"AFD_RUN_ID={run_id}".encode() in env:
            found[int(pid)] = comm
    return found


def cpu_flags() -> set[str]:
    from afd.kernels import _cpu_flags

    return set(_cpu_flags().split())


def amx_granted() -> bool:
    """Whether Linux lets this process use the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, x86-64 syscall 158):
    asked here apart from the kernels, since a CPU with AMX under an older kernel or a sandbox runs without it."""
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0


def expected_simd() -> str:
    """The register tiles afd/kernels must have built on this CPU, read from its flags (not from the build):
    "avx512" (F, BW, VL), "avx2" (with FMA and F16C) or "none"."""
    from afd.kernels import _cpu_flags

    flags = set(_cpu_flags().split())
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "none"


# ----------------------------------------------------------------------------- runs


_FORKS = []  # the session's fork server, started on first use and stopped at the session's end (conftest.py)


def session_forks():
    """One fork server for the runs of this test session that share it: torch imported once, not once per run.
    Fault tests start runs of their own instead (each run isolated: its own fork server)."""
    if not _FORKS:
        from afd.runtime.forkserver import RunForkServer

        _FORKS.append(RunForkServer(f"pytest-{uuid.uuid4().hex[:8]}"))
    return _FORKS[0]


def stop_session_forks() -> None:
    while _FORKS:
        _FORKS.pop().stop()


def cluster(model_dir, topology, engine=None, **kw):
    """A test's Cluster (not started), its ranks forked from the session's fork server."""
    from afd.config import EngineArgs
    from afd.runtime.cluster import Cluster

    return Cluster(model_dir, topology, engine or EngineArgs(), forks=session_forks(), **kw)


def wait_for(condition: Callable[[], object], timeout: float, what: str, every: float = 0.05):
    """Wait until ``condition()`` is true (its value is returned); fail naming ``what`` that did not happen."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:g} s")
        time.sleep(every)


class Command:
    """A command run in the background whose output lines are collected as they come (``lines``), so a test can
    wait for one (:meth:`wait_line`) instead of sleeping."""

    def __init__(self, cmd: list[str], env: dict | None = None, **popen) -> None:
        import subprocess
        import threading

        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **popen)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_line(self, text: str, timeout: float) -> None:
        """Until a line containing ``text`` came out; fail (with the output so far) if the command ended first."""
        wait_for(lambda: any(text in line for line in self.lines) or self.proc.poll() is not None, timeout, f"a line {text!r}")
        assert any(text in line for line in self.lines), f"the command ended ({self.proc.returncode}) before {text!r}:\n{self.output}"

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MXFP4 encoder written here (transformers can only decode): w [..., R, C] -> (blocks [..., R, C/32, 16]
    uint8, scales [..., R, C/32] uint8, the values they decode to [..., R, C] float32). Per group of 32 along a
    row: the e8m0 exponent e = floor(log2(max |w|)) - 2 (e2m1's largest exponent), each value rounded to the
    nearest e2m1 number of w / 2^e (clipped at 6); the even value in the low nibble."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    groups = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exp = torch.floor(torch.log2(amax)) - 2
    scaled = (groups / torch.exp2(exp)[..., None]).clamp(-6, 6)
    magnitude = (scaled.abs()[..., None] - grid).abs().argmin(-1)  # nearest e2m1 magnitude
    nibble = magnitude + 8 * (scaled < 0)
    decoded = torch.where(scaled < 0, -grid[magnitude], grid[magnitude]) * torch.exp2(exp)[..., None]
    blocks = (nibble[..., 0::2] | (nibble[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8), decoded.reshape(w.shape)


def write_mxfp4_checkpoint(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """gpt-oss's checkpoint at ``src`` rewritten as its release stores it: every layer's expert weights as
    MXFP4 ``*_blocks`` / ``*_scales`` (rows = the weight's output dim), ``quantization_config.quant_method:
    mxfp4``. Returns the blocks and scales written, by name."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    written = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors.pop(name).transpose(1, 2).contiguous()  # gate_up [E, H, 2I] -> [E, 2I, H]; down [E, I, H] -> [E, H, I]
        blocks, scales, _ = encode_mxfp4(rows)
        written[f"{name}_blocks"], written[f"{name}_scales"] = blocks, scales
    tensors.update(written)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                                      "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(raw))
    return written


#: DeepSeek-V4's release stores these fp8 (block-scaled, ue8m0 scales); the compressors', the indexer's kv, gate and
#: weights projections ship unquantised (transformers' _keep_in_fp32_modules), as do norms, gates and embeddings
V4_FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123])\.weight$")


def write_v4_release(src: Path, dst: Path, block: tuple[int, int] = (16, 16)) -> Path:
    """A tiny DeepSeek-V4 checkpoint written by transformers (``src``) rewritten as the release stores its weights:
    the release's names (no ``model.``: ``embed.weight``, ``layers.N.attn.wq_a.weight``, ``hc_head_fn``), fp8 e4m3
    attention and shared-expert weights with power-of-two (ue8m0) block scales ``X.scale``, routed experts as FP4
    (two e2m1 values a byte, [R, C/2] int8) with e8m0 scales ``X.scale`` [R, C/32], an ``mtp.0.*`` layer, and
    ``expert_dtype: fp4``. Also writes ``dst``-dequantised: the same model in transformers' layout with every
    quantised weight replaced by what it decodes to (the reference the release must load equal to)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    release, decoded = {}, dict(tensors)
    for name, w in tensors.items():
        short = name.removeprefix("model.")
        short = {"embed_tokens.weight": "embed.weight"}.get(short, short)
        short = re.sub(r"^hc_head\.", "hc_head_", short)
        if V4_FP8.search(short):
            rows, cols = w.shape
            blocks = w.float().reshape(rows // block[0], block[0], cols // block[1], block[1])
            scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(dim=(1, 3)).clamp(min=2.0**-100) / 448)))  # ue8m0
            q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
            decoded[name] = (q.float().reshape(blocks.shape) * scale[:, None, :, None]).reshape(rows, cols)
            release[short], release[short.removesuffix(".weight") + ".scale"] = q, scale.to(torch.float8_e8m0fnu)
        elif re.search(r"\.ffn\.experts\.\d+\.w[123]\.weight$", short):
            blocks, scales, values = encode_mxfp4(w)
            decoded[name] = values
            release[short] = blocks.reshape(w.shape[0], -1).view(torch.int8)
            release[short.removesuffix(".weight") + ".scale"] = scales.view(torch.float8_e8m0fnu)
        else:
            release[short] = w
    release["mtp.0.attn_norm.weight"] = torch.ones(tensors["model.norm.weight"].shape)
    release["mtp.0.e_proj.weight"] = torch.zeros(4, 4)
    raw = json.loads((src / "config.json").read_text())
    for out, weights, quant in ((dst, release, True), (dst.with_name(dst.name + "-dequantised"), decoded, False)):
        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        config = dict(raw)
        if quant:
            config.update(expert_dtype="fp4", quantization_config={"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                                                   "activation_scheme": "dynamic", "weight_block_size": list(block)})
        (out / "config.json").write_text(json.dumps(config))
    return dst


W8A8_IGNORE = ("lm_head", r"re:.*mlp\.gate$")  # llm-compressor's usual recipe: the LM head and the routers stay unquantised


def write_w8a8_checkpoint(src: Path, dst: Path, ignore=W8A8_IGNORE, strategy: str = "channel") -> dict[str, torch.Tensor]:
    """A single-file checkpoint written by transformers (``src``) rewritten as llm-compressor writes a W8A8 model
    (afd.models.int8.quantize_checkpoint); returns the weights the int8 ones decode to, by name."""
    from afd.models.int8 import quantize_checkpoint

    return quantize_checkpoint(src, dst, tuple(ignore), strategy)
