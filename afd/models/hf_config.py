"""Read a Hugging Face ``config.json`` into afd's :class:`~afd.config.ModelConfig`.

Two schemas are seen in the wild and both are accepted: the hub files
(``rope_theta`` at top level plus ``rope_scaling: {"type": "yarn", ...}``, a
top-level ``partial_rotary_factor``) and what transformers 5 writes
(``rope_parameters: {"rope_type": ..., "rope_theta": ...}``). Keys afd does not
use (``auto_map``, ``aux_loss_alpha``, ``seq_aux``, ``ep_size`` ...) are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dataclasses import replace

from afd.config import CompressedAttentionConfig, DSAConfig, LinearAttentionConfig, MLAConfig, ModelConfig, MoEConfig, RopeConfig


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture is not one afd implements."""


ARCHITECTURES = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",  # Kimi-K2 ships V3's architecture under its own model_type
    "glm4_moe": "Glm4MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",  # the release: a vision tower beside the language model
    "deepseek_v4": "DeepseekV4ForCausalLM",
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
    if model_type in ("deepseek_v2", "deepseek_v3", "kimi_k2"):
        return _parse_deepseek(raw, v3=model_type != "deepseek_v2")
    if model_type in ("deepseek_v32", "glm_moe_dsa"):
        return _parse_dsa(raw, glm=model_type == "glm_moe_dsa")
    if model_type == "glm4_moe":
        return _parse_glm4_moe(raw)
    if model_type == "minimax_m2":
        return _parse_minimax_m2(raw)
    if model_type == "gpt_oss":
        return _parse_gpt_oss(raw)
    if model_type in ("qwen3_next", "qwen3_5_moe_text"):
        return _parse_hybrid(raw, next_layout=model_type == "qwen3_next")
    if model_type == "qwen3_5_moe":
        return _parse_multimodal(raw)
    if model_type == "deepseek_v4":
        return _parse_deepseek_v4(raw)
    return _parse_qwen3_moe(raw)


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _mtp_layers(raw: dict[str, Any]) -> int:
    """Multi-token-prediction layers the checkpoint carries after its decoder layers (afd skips them at load)."""
    return int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers")) or 0)


def _sigmoid_router(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """V3/GLM routing fields: sigmoid scores, noaux_tc selection, normalise then scale."""
    scoring, method = raw.get("scoring_func", "sigmoid"), raw.get("topk_method", "noaux_tc")
    if (scoring, method) != ("sigmoid", "noaux_tc"):
        raise UnsupportedArchitectureError(f"{family} routing with scoring_func={scoring!r}, topk_method={method!r} is not "
                                           "supported (only sigmoid + noaux_tc, as transformers implements it)")
    return dict(scoring="sigmoid", topk_method="noaux_tc", scale_after_norm=True, router_fp32=True,
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)))


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


def _common(raw: dict[str, Any], eps: float = 1e-6) -> dict[str, Any]:
    """The ModelConfig fields every family reads from the same keys."""
    return dict(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", eps),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        attention_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        hidden_act=raw.get("hidden_act", "silu"),
    )


def _deepseek_style_moe(raw: dict[str, Any], family: str, layers: tuple[int, ...], **routing: Any) -> MoEConfig:
    """The MoE of DeepSeek's keys (n_routed_experts, n_shared_experts, n_group, ...), which GLM shares."""
    num_experts = raw.get("n_routed_experts") or raw.get("num_local_experts")
    if not num_experts:
        raise UnsupportedArchitectureError(f"{family} config without n_routed_experts is a dense model; afd serves MoE models")
    return MoEConfig(
        num_experts=num_experts,
        top_k=raw["num_experts_per_tok"],
        intermediate_size=raw["moe_intermediate_size"],
        layers=layers,
        num_shared_experts=raw.get("n_shared_experts") or 0,
        num_groups=raw.get("n_group") or 1,
        topk_groups=raw.get("topk_group") or 1,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        **routing,
    )


def _parse_deepseek(raw: dict[str, Any], v3: bool) -> ModelConfig:
    num_layers = raw["num_hidden_layers"]
    first_dense = raw.get("first_k_dense_replace", 0)
    freq = raw.get("moe_layer_freq", 1)
    moe_layers = tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0)
    if raw.get("mlp_layer_types"):  # transformers 5's spelling for V3.2 and GLM-5: "dense" or "sparse" per layer
        moe_layers = tuple(i for i, kind in enumerate(raw["mlp_layer_types"]) if kind == "sparse")
    mla = MLAConfig(
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
    )
    if v3:
        routing = _sigmoid_router(raw, "DeepSeek-V3")
    else:
        routing = dict(topk_method=raw.get("topk_method") or "greedy", norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                       router_fp32=True)
    return ModelConfig(
        architecture="DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM",
        **_common(raw),
        head_dim=mla.qk_head_dim,
        rope=_rope(raw, mla.qk_rope_head_dim, interleaved=bool(raw.get("rope_interleave", True)) if v3 else True),
        moe=_deepseek_style_moe(raw, "DeepSeek", moe_layers, **routing),
        mla=mla,
        num_mtp_layers=_mtp_layers(raw) if v3 else 0,
    )


def _parse_dsa(raw: dict[str, Any], glm: bool) -> ModelConfig:
    """DeepSeek-V3.2 and GLM-5: V3's MLA and MoE plus DeepSeek Sparse Attention. GLM-5 rotates its indexer's
    keys in pairs (V3.2: halves), may mark layers ``indexer_types: shared``, and defaults to 32 index heads."""
    family = "GLM-5" if glm else "DeepSeek-V3.2"
    base = _parse_deepseek(raw, v3=True)
    types = raw.get("indexer_types") or ["full"] * base.num_layers
    if len(types) != base.num_layers or set(types) - {"full", "shared"}:
        raise UnsupportedArchitectureError(f"{family} indexer_types must be 'full' or 'shared' for each of {base.num_layers} layers; got {types}")
    dsa = DSAConfig(index_heads=int(raw.get("index_n_heads", 32 if glm else 64)), index_head_dim=int(raw.get("index_head_dim", 128)),
                    index_topk=int(raw.get("index_topk", 2048)), rope_interleaved=glm,
                    shared_layers=tuple(i for i, t in enumerate(types) if t == "shared"))
    return replace(base, architecture="GlmMoeDsaForCausalLM" if glm else "DeepseekV32ForCausalLM", dsa=dsa)


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
    return ModelConfig(architecture="Qwen3MoeForCausalLM", **_common(raw), head_dim=head_dim,
                       rope=_rope(raw, head_dim, interleaved=False), moe=moe, qk_norm=True)


def _parse_glm4_moe(raw: dict[str, Any]) -> ModelConfig:
    num_layers = raw["num_hidden_layers"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    params = raw.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))
    first_dense = raw.get("first_k_dense_replace", 1)
    moe = _deepseek_style_moe(raw, "GLM-4 MoE", tuple(range(first_dense, num_layers)), **_sigmoid_router(raw, "GLM-4 MoE"))
    return ModelConfig(
        architecture="Glm4MoeForCausalLM",
        **_common(raw, eps=1e-5),
        head_dim=head_dim,
        rope=_rope(raw, int(head_dim * partial), interleaved=False),
        moe=moe,
        qk_norm=bool(raw.get("use_qk_norm", False)),
        num_mtp_layers=_mtp_layers(raw),
    )


def _head_dim(raw: dict[str, Any]) -> int:
    return raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]


def _parse_minimax_m2(raw: dict[str, Any]) -> ModelConfig:
    """MiniMax-M2 as published: ``rotary_dim`` (or ``partial_rotary_factor``) rotates the first channels of
    each head (halves convention); every layer is MoE; sigmoid + bias selection, normalised weights."""
    head_dim = _head_dim(raw)
    params = raw.get("rope_parameters") or {}
    rotary = raw.get("rotary_dim") or int(head_dim * params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedArchitectureError(f"MiniMax-M2 with scoring_func={raw['scoring_func']!r} is not supported (only sigmoid)")
    num_experts = raw.get("num_local_experts")
    if not num_experts:
        raise UnsupportedArchitectureError("MiniMax-M2 config without num_local_experts is a dense model; afd serves MoE models")
    moe = MoEConfig(num_experts=num_experts, top_k=raw["num_experts_per_tok"], intermediate_size=raw["intermediate_size"],
                    layers=tuple(range(raw["num_hidden_layers"])), scoring="sigmoid", topk_method="noaux_tc",
                    scale_after_norm=True, norm_topk_prob=True, routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))
    return ModelConfig(architecture="MiniMaxM2ForCausalLM", **_common(raw), head_dim=head_dim,
                       rope=_rope(raw, rotary, interleaved=False), moe=moe, qk_norm=bool(raw.get("use_qk_norm", True)),
                       qk_norm_span="all", num_mtp_layers=_mtp_layers(raw))


def _parse_gpt_oss(raw: dict[str, Any]) -> ModelConfig:
    """gpt-oss: sinks on every layer, ``layer_types`` names the sliding ones (default: every even layer),
    biased router and experts, clamped SwiGLU. Unquantised, or its release's MXFP4 experts (afd/models/mxfp4.py)."""
    quant = (raw.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "mxfp4"):
        raise UnsupportedArchitectureError(f"gpt-oss checkpoint quantised with quant_method={quant!r}: afd reads gpt-oss "
                                           "unquantised or with MXFP4 experts (quant_method: mxfp4)")
    num_layers, head_dim = raw["num_hidden_layers"], _head_dim(raw)
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != num_layers:
        raise UnsupportedArchitectureError(f"gpt-oss layer_types must name {num_layers} layers, each sliding_attention or "
                                           f"full_attention; got {types}")
    moe = MoEConfig(num_experts=raw["num_local_experts"], top_k=raw["num_experts_per_tok"], intermediate_size=raw["intermediate_size"],
                    layers=tuple(range(num_layers)), norm_topk_prob=True, router_bias=True, expert_bias=True,
                    swiglu_limit=float(raw.get("swiglu_limit", 7.0)), swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)))
    common = {**_common(raw, eps=1e-5), "attention_bias": bool(raw.get("attention_bias", True))}
    return ModelConfig(architecture="GptOssForCausalLM", **common, head_dim=head_dim, rope=_rope(raw, head_dim, interleaved=False),
                       moe=moe, attention_sinks=True, sliding_window=raw.get("sliding_window") or 128,
                       sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"))


def _parse_hybrid(raw: dict[str, Any], next_layout: bool) -> ModelConfig:
    """Qwen3-Next and Qwen3.5-MoE's language model: Gated DeltaNet layers and gated full attention, as
    ``layer_types`` names them (else every ``full_attention_interval``-th layer is full); zero-centred norms;
    partial rotary (M-RoPE's sections collapse to plain rotary for text, whose three position ids are equal);
    softmax top-k routing plus a sigmoid-gated shared expert. Qwen3-Next may have dense layers
    (``mlp_only_layers``, ``decoder_sparse_step``); Qwen3.5 is MoE on every layer."""
    family = "Qwen3-Next" if next_layout else "Qwen3.5-MoE"
    num_layers, head_dim = raw["num_hidden_layers"], _head_dim(raw)
    interval = raw.get("full_attention_interval") or 4
    types = raw.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise UnsupportedArchitectureError(f"{family} layer_types must name {num_layers} layers, each linear_attention or "
                                           f"full_attention; got {types}")
    linear = LinearAttentionConfig(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        num_key_heads=raw["linear_num_key_heads"], num_value_heads=raw["linear_num_value_heads"],
        key_head_dim=raw["linear_key_head_dim"], value_head_dim=raw["linear_value_head_dim"],
        conv_kernel=raw.get("linear_conv_kernel_dim", 4), fused_projections=next_layout)
    num_experts = raw.get("num_experts") or 0
    if not num_experts:
        raise UnsupportedArchitectureError(f"{family} config without num_experts is a dense model; afd serves MoE models")
    only_mlp, step = set(raw.get("mlp_only_layers") or []), raw.get("decoder_sparse_step", 1) or 1
    moe_layers = tuple(i for i in range(num_layers) if i not in only_mlp and (i + 1) % step == 0) if next_layout else tuple(range(num_layers))
    shared = raw.get("shared_expert_intermediate_size") or 0
    moe = MoEConfig(num_experts=num_experts, top_k=raw["num_experts_per_tok"], intermediate_size=raw["moe_intermediate_size"],
                    layers=moe_layers, norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if next_layout else True,
                    num_shared_experts=1 if shared else 0, shared_size=shared or None, shared_expert_gate=bool(shared))
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    common = _common({"intermediate_size": raw.get("intermediate_size") or raw["moe_intermediate_size"], **raw})
    return ModelConfig(architecture="Qwen3NextForCausalLM" if next_layout else "Qwen3_5MoeForCausalLM", **common, head_dim=head_dim,
                       rope=_rope({**raw, "rope_parameters": params}, int(head_dim * partial), interleaved=False), moe=moe,
                       qk_norm=True, linear=linear, attention_output_gate=True, zero_centred_norm=True)


def _parse_multimodal(raw: dict[str, Any]) -> ModelConfig:
    """Qwen3.5-MoE as released (``Qwen3_5MoeForConditionalGeneration``): a text engine serves its language model,
    ``text_config``, whose tensors live under ``model.language_model.``; the vision tower is not loaded."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedArchitectureError("a qwen3_5_moe checkpoint without text_config: afd serves its language model")
    inherited = {k: raw[k] for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id") if k in raw and k not in text}
    return replace(_parse_hybrid({**inherited, **text}, next_layout=False), checkpoint_prefix="model.language_model.")


_V4_KINDS = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


def _parse_deepseek_v4(raw: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V4 as transformers' ``DeepseekV4Config.__post_init__`` reads it, the legacy keys of the release
    included (``compress_ratios``, ``compress_rate_csa/hca``, ``num_hash_layers``, ``qk_rope_head_dim``): per-layer
    compress rates, hash-routed first layers, the main rotary (sliding layers) and the compressed branch's (its
    YaRN, ``attention_factor`` 1)."""
    n, head_dim = raw["num_hidden_layers"], raw.get("head_dim", 512)
    rates = {**{k: v for k, v in _V4_KINDS.items() if v}, **(raw.get("compress_rates") or {})}
    rates.update({k: raw[f"compress_rate_{a}"] for k, a in (("compressed_sparse_attention", "csa"), ("heavily_compressed_attention", "hca"))
                  if raw.get(f"compress_rate_{a}") is not None})
    legacy = {r: k for k, r in _V4_KINDS.items()}
    if set(raw.get("compress_ratios") or ()) - set(legacy):
        raise UnsupportedArchitectureError(f"DeepSeek-V4 compress_ratios must each be 0, 4 or 128, got {raw['compress_ratios']}")
    kinds = raw.get("layer_types") or (
        [legacy[r] for r in raw["compress_ratios"]] if raw.get("compress_ratios") is not None else
        ["heavily_compressed_attention"] * min(n, 2) + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                                                        for i in range(max(n - 2, 0))])
    kinds = list(kinds)[:n]
    if len(kinds) != n or set(kinds) - set(_V4_KINDS):
        raise UnsupportedArchitectureError(f"DeepSeek-V4 layer_types must name {n} layers, each one of {', '.join(_V4_KINDS)}; got {kinds}")
    mlp = raw.get("mlp_layer_types") or ["hash_moe"] * min(n, raw.get("num_hash_layers", 3)) + ["moe"] * max(0, n - raw.get("num_hash_layers", 3))
    partial = raw.get("partial_rotary_factor") or (raw["qk_rope_head_dim"] / head_dim if raw.get("qk_rope_head_dim") else 64 / 512)
    rope_dim = int(head_dim * partial)
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
    else:
        scaling = {**(raw.get("rope_scaling") or {}), **params}
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        compress = {**scaling, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
        if compress.get("rope_type", compress.get("type", "default")) == "yarn":
            compress.setdefault("attention_factor", 1.0)
    rope = lambda p: _rope({**raw, "rope_parameters": p, "rope_scaling": None}, rope_dim, interleaved=True)  # noqa: E731
    moe = MoEConfig(num_experts=raw["n_routed_experts"], top_k=raw["num_experts_per_tok"], intermediate_size=raw["moe_intermediate_size"],
                    layers=tuple(range(n)), num_shared_experts=raw.get("n_shared_experts", 1), topk_method="noaux_tc",
                    scoring=raw.get("scoring_func", "sqrtsoftplus"), scale_after_norm=True, norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                    routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)), swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
                    swiglu_alpha=1.0, swiglu_offset=0.0, hash_layers=tuple(i for i, t in enumerate(mlp[:n]) if t == "hash_moe"))
    window = raw.get("sliding_window", 128)
    compressed = CompressedAttentionConfig(
        rates=tuple(rates.get(k, 0) for k in kinds), csa_layers=tuple(i for i, k in enumerate(kinds) if k == "compressed_sparse_attention"),
        window=window, head_dim=head_dim, q_lora_rank=raw.get("q_lora_rank", 1024), o_groups=raw.get("o_groups", 8),
        o_lora_rank=raw.get("o_lora_rank", 1024), index_heads=raw.get("index_n_heads", 64), index_head_dim=raw.get("index_head_dim", 128),
        index_topk=raw.get("index_topk", 512), compress_rope=rope(compress), hc_mult=raw.get("hc_mult", 4),
        hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20), hc_eps=float(raw.get("hc_eps", 1e-6)))
    common = _common({"intermediate_size": raw["moe_intermediate_size"], "num_key_value_heads": 1, **raw})
    return ModelConfig(architecture="DeepseekV4ForCausalLM", **common, head_dim=head_dim, rope=rope(main), moe=moe,
                       num_mtp_layers=_mtp_layers(raw), attention_sinks=True, sliding_window=window, sliding_layers=tuple(range(n)),
                       compressed=compressed)


def load_model_config(model_dir: Path) -> ModelConfig:
    return parse_hf_config(read_config_json(model_dir))
