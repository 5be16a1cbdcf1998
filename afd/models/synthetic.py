"""Random-weight models for benchmarks, in memory or written as a checkpoint.

``deepseek_v2_lite_shaped()`` has the layer shapes of DeepSeek-V2-Lite (hidden
2048, 16 heads, MLA 512/64/128, 64 experts x 1408, top-6, 2 shared experts)
with fewer layers and a smaller vocabulary, so a CPU can run it.
``deepseek_v3_shaped()`` has DeepSeek-V3's attention and expert dims (hidden
7168, 128 heads, q_lora 1536, MLA 512/64/128, experts x 2048, a dense layer of
18432) with 4 layers, 16 routed experts (top-4 of 4 groups, keep 2) and a 32k
vocabulary, so that it fits in 24 GiB.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from afd.models.base import MoEModel
from afd.models.hf_config import parse_hf_config
from afd.models.loader import _is_linear, _target_dtype, build_meta_model


def deepseek_v2_lite_shaped(num_layers: int = 8, vocab_size: int = 32000) -> dict[str, Any]:
    """A config.json dict with DeepSeek-V2-Lite's layer shapes (1 dense layer)."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab_size,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": num_layers,
        "first_k_dense_replace": 1,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "dtype": "bfloat16",
    }


def deepseek_v3_shaped(num_layers: int = 4, vocab_size: int = 32000, num_experts: int = 16) -> dict[str, Any]:
    """A config.json dict with DeepSeek-V3's layer shapes (1 dense layer; fewer, smaller-vocab layers)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": num_layers,
        "first_k_dense_replace": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": num_experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "dtype": "bfloat16",
    }


def deepseek_v4_flash_shaped(num_layers: int = 4, vocab_size: int = 32000, num_experts: int = 16) -> dict[str, Any]:
    """A config.json dict with DeepSeek-V4-Flash's layer shapes (hidden 4096, 64 heads on one KV head of 512, q_lora
    1024, 8 output groups of 1024, a window of 128, CSA (rate 4, an indexer of 64 x 128, top-512) and HCA (rate 128),
    4 streams, experts x 2048 top-6, the first layer hash-routed) with fewer layers (the first sliding only, then CSA
    and HCA alternating), 16 routed experts and a 32k vocabulary."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": vocab_size, "hidden_size": 4096,
        "moe_intermediate_size": 2048, "num_hidden_layers": num_layers, "num_attention_heads": 64, "num_key_value_heads": 1,
        "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "compress_ratios": [0] + [4 if i % 2 else 128 for i in range(1, num_layers)], "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "n_routed_experts": num_experts, "n_shared_experts": 1, "num_experts_per_tok": 6, "num_hash_layers": 1,
        "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "max_position_embeddings": 1 << 20, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "dtype": "bfloat16",
    }


SYNTHETIC_SHAPES = {"deepseek-v2-lite": deepseek_v2_lite_shaped, "deepseek-v3": deepseek_v3_shaped, "deepseek-v4-flash": deepseek_v4_flash_shaped}


def _random(name: str, shape, dtype: torch.dtype, std: float, gen: torch.Generator, num_experts: int) -> torch.Tensor:
    """A random tensor for parameter ``name``: norms 1, a hash table distinct experts per token, else N(0, std)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("tid2eid"):
        return torch.stack([torch.randperm(num_experts, generator=gen)[: shape[1]] for _ in range(shape[0])])
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen).to(dtype)


@torch.no_grad()
def random_model(raw_config: dict[str, Any], dtype: torch.dtype, std: float = 0.02, seed: int = 0) -> MoEModel:
    """Materialise every parameter with N(0, std) (norm weights 1), seeded."""
    config = parse_hf_config(raw_config)
    model = build_meta_model(config)
    gen = torch.Generator().manual_seed(seed)
    for name, param in list(model.named_parameters()):
        value = _random(name, param.shape, _target_dtype(model, name, dtype), std, gen, config.moe.num_experts)
        module_name, _, attr = name.rpartition(".")
        model.get_submodule(module_name)._parameters[attr] = nn.Parameter(value, requires_grad=False)
    return model.eval()


@torch.no_grad()
def write_random_checkpoint(
    raw_config: dict[str, Any], path, dtype: torch.dtype = torch.bfloat16, std: float = 0.02, seed: int = 0, shard_bytes: int = 1 << 30,
    fp8_block: tuple[int, int] | None = None, w8a8: bool = False,
) -> int:
    """Write a random-weight checkpoint in the Hugging Face layout (per-expert keys), shard by shard
    (``model.safetensors.index.json`` + shards of about ``shard_bytes``). Returns the tensor bytes written.
    ``fp8_block``: store the linear weights as DeepSeek-V3's release does (e4m3 + block ``weight_scale_inv``).
    ``w8a8``: as llm-compressor's W8A8 does (compressed-tensors int-quantized: every linear weight but the LM head
    int8 per output channel beside ``weight_scale`` [out, 1]; activations quantised per token at run time)."""
    from afd.models.quant import SCALE_SUFFIX, is_quantizable, quantize

    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from afd.models.weight_plan import plan_copies

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = parse_hf_config(raw_config)
    model = build_meta_model(config)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    size, index, total = 0, 0, 0

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, path / name, metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, index = {}, 0, index + 1

    for c in plan_copies(model, range(config.moe.num_experts)):
        shape = params[c.param].shape
        if c.index is not None:
            shape = shape[1:]
        if c.rows is not None:
            shape = (c.rows.stop - c.rows.start, *shape[1:])
        t = _random(c.param, shape, _target_dtype(model, c.param, dtype), std, gen, config.moe.num_experts)
        stored = {c.source: t}
        if fp8_block is not None and is_quantizable(c.source, tuple(shape)):
            q, scale = quantize(t, fp8_block)
            stored = {c.source: q, c.source + SCALE_SUFFIX: scale}
        elif w8a8 and c.param != "lm_head.weight" and _is_linear(model, c.param):
            scale = (t.float().abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
            stored = {c.source: torch.round(t.float() / scale).clamp(-127, 127).to(torch.int8), c.source + "_scale": scale}
        for name, t in stored.items():
            shard[name] = t
            size += t.numel() * t.element_size()
            total += t.numel() * t.element_size()
        if size > shard_bytes:
            flush()
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = {**raw_config, "dtype": str(dtype).removeprefix("torch.")}
    if fp8_block is not None:
        raw["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": list(fp8_block)}
    if w8a8:
        int8 = {"num_bits": 8, "type": "int", "symmetric": True}
        raw["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**int8, "strategy": "channel"},
                                                                    "input_activations": {**int8, "strategy": "token", "dynamic": True}}}}
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return total
