"""Read a Hugging Face ``config.json`` into afd's :class:`~afd.config.ModelConfig`.

Two schemas are seen in the wild and both are accepted: the hub files of
DeepSeek-V2(-Lite) (``rope_theta`` at top level plus ``rope_scaling: {"type":
"yarn", ...}``) and what transformers 5 writes (``rope_parameters: {"rope_type":
..., "rope_theta": ...}``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from afd.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture is not one afd implements."""


ARCHITECTURES = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def read_config_json(model_dir: Path) -> dict[str, Any]:
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model directory needs a Hugging Face config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def parse_hf_config(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type not in ARCHITECTURES:
        supported = ", ".join(f"{a} (model_type {t!r})" for t, a in ARCHITECTURES.items())
        raise UnsupportedArchitectureError(
            f"unsupported architecture {archs or model_type!r}; afd supports: {supported}"
        )
    if model_type == "deepseek_v2":
        return _parse_deepseek_v2(raw)
    return _parse_qwen3_moe(raw)


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _rope(raw: dict[str, Any], dim: int, interleaved: bool) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    params = {**legacy, **params}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kwargs: dict[str, Any] = {}
    if rope_type == "yarn":
        kwargs = dict(
            factor=float(params["factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
            ),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )
    return RopeConfig(theta=float(theta), dim=dim, interleaved=interleaved, type=rope_type, **kwargs)


def _parse_deepseek_v2(raw: dict[str, Any]) -> ModelConfig:
    num_layers = raw["num_hidden_layers"]
    first_dense = raw.get("first_k_dense_replace", 0)
    freq = raw.get("moe_layer_freq", 1)
    num_experts = raw.get("n_routed_experts") or raw.get("num_local_experts")
    if not num_experts:
        raise UnsupportedArchitectureError("DeepSeek-V2 config without n_routed_experts is a dense model; afd serves MoE models")
    moe_layers = tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0)
    mla = MLAConfig(
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
    )
    topk_method = raw.get("topk_method") or "greedy"
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=raw["num_experts_per_tok"],
        intermediate_size=raw["moe_intermediate_size"],
        layers=moe_layers,
        num_shared_experts=raw.get("n_shared_experts") or 0,
        topk_method=topk_method,
        num_groups=raw.get("n_group") or 1,
        topk_groups=raw.get("topk_group") or 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        router_fp32=True,
    )
    return ModelConfig(
        architecture="DeepseekV2ForCausalLM",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=num_layers,
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=mla.qk_head_dim,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rope=_rope(raw, mla.qk_rope_head_dim, interleaved=True),
        moe=moe,
        mla=mla,
        attention_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        hidden_act=raw.get("hidden_act", "silu"),
    )


def _parse_qwen3_moe(raw: dict[str, Any]) -> ModelConfig:
    num_layers = raw["num_hidden_layers"]
    only_mlp = set(raw.get("mlp_only_layers") or [])
    step = raw.get("decoder_sparse_step", 1) or 1
    num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    moe_layers = tuple(i for i in range(num_layers) if i not in only_mlp and num_experts > 0 and (i + 1) % step == 0)
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    if not num_experts:
        raise UnsupportedArchitectureError("Qwen3-MoE config without num_experts is a dense model; afd serves MoE models")
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=raw["num_experts_per_tok"],
        intermediate_size=raw["moe_intermediate_size"],
        layers=moe_layers,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )
    if raw.get("use_sliding_window"):
        raise UnsupportedArchitectureError("Qwen3-MoE with use_sliding_window=true is not supported")
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=num_layers,
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=head_dim,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rope=_rope(raw, head_dim, interleaved=False),
        moe=moe,
        attention_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        hidden_act=raw.get("hidden_act", "silu"),
    )


def load_model_config(model_dir: Path) -> ModelConfig:
    return parse_hf_config(read_config_json(model_dir))
