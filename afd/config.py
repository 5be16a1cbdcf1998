"""Frozen configuration objects. Validated on construction; change with ``dataclasses.replace``.

Nothing here imports the rest of afd. Parsing of Hugging Face ``config.json``
files lives in :mod:`afd.models.hf_config`; these classes are the normalised
result every other layer reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from afd.pipeline.planner import CostModel

SUPPORTED_ACTIVATIONS = ("silu",)
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn")


def _positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding. ``interleaved``: pairs (x0,x1),(x2,x3) (DeepSeek) vs halves (Qwen)."""

    theta: float
    dim: int
    interleaved: bool
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.type!r}; supported: {', '.join(ROPE_TYPES)}")
        _positive("rope theta", self.theta)
        if self.dim % 2:
            raise ValueError(f"rope dim must be even, got {self.dim}")
        if self.type == "yarn":
            _positive("yarn factor", self.factor)
            if self.original_max_position_embeddings is None:
                raise ValueError("yarn rope scaling needs original_max_position_embeddings")

    def softmax_scale_multiplier(self) -> float:
        """DeepSeek's YaRN correction of the attention softmax scale (mscale_all_dim squared)."""
        if self.type == "default" or not self.mscale_all_dim:
            return 1.0
        m = yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek multi-head latent attention. The KV cache holds kv_lora_rank + qk_rope_head_dim per token."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts, shared experts and the router of the MoE layers.

    The router's variants (:class:`afd.models.base.Router`):
    scoring            softmax (DeepSeek-V2, Qwen3) or sigmoid (DeepSeek-V3, GLM-4.5)
    topk_method        greedy; group_limited_greedy (V2: a group scores its best expert);
                       noaux_tc (V3: experts are *selected* on score + e_score_correction_bias,
                       a group scores the sum of its top two; weights use the unbiased score)
    scale_after_norm   V3/GLM: normalise the top-k weights (norm_topk_prob), then always scale by
                       routed_scaling_factor; otherwise (V2/Qwen) normalise *or* scale
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    layers: tuple[int, ...]
    num_shared_experts: int = 0
    topk_method: str = "greedy"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    router_fp32: bool = False  # DeepSeek and GLM keep the gate weight and logits in fp32
    scoring: str = "softmax"
    scale_after_norm: bool = False

    def __post_init__(self) -> None:
        _positive("num_experts", self.num_experts)
        _positive("moe_intermediate_size", self.intermediate_size)
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.top_k}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {self.topk_method!r}; supported: {', '.join(TOPK_METHODS)}")
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"unsupported scoring_func {self.scoring!r}; supported: {', '.join(SCORING_FUNCS)}")
        if self.topk_method in ("group_limited_greedy", "noaux_tc"):
            if self.num_experts % self.num_groups:
                raise ValueError(f"n_group={self.num_groups} must divide n_routed_experts={self.num_experts}")
            if not 1 <= self.topk_groups <= self.num_groups:
                raise ValueError(f"topk_group must be in [1, n_group={self.num_groups}], got {self.topk_groups}")
            if self.topk_groups * (self.num_experts // self.num_groups) < self.top_k:
                raise ValueError(f"topk_group={self.topk_groups} groups of {self.num_experts // self.num_groups} experts "
                                 f"hold fewer than num_experts_per_tok={self.top_k}")
        if self.topk_method == "noaux_tc" and self.num_experts // self.num_groups < 2:
            raise ValueError("noaux_tc scores a group by its top two experts: every group needs at least 2")

    @property
    def score_bias(self) -> bool:
        """Whether the router holds ``e_score_correction_bias`` (selection only)."""
        return self.topk_method == "noaux_tc"

    @property
    def shared_intermediate_size(self) -> int:
        return self.intermediate_size * self.num_shared_experts


@dataclass(frozen=True)
class ModelConfig:
    """The normalised description of one checkpoint's architecture."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA head dim (Qwen); for MLA see ``mla``
    intermediate_size: int  # dense MLP layers
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    moe: MoEConfig
    mla: MLAConfig | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    qk_norm: bool = False  # GQA: per-head RMSNorm of q and k before RoPE (Qwen3, GLM with use_qk_norm)
    num_mtp_layers: int = 0  # multi-token-prediction layers in the checkpoint (skipped at load)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_position_embeddings"):
            _positive(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} must be a multiple of num_key_value_heads={self.num_kv_heads}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        bad = [i for i in self.moe.layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"MoE layer indices {bad} outside [0, {self.num_layers})")

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe.layers


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots per layer."""

    block_size: int = 16
    num_blocks: int = 256

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_blocks", self.num_blocks)


MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, with vLLM's definitions. ``temperature == 0`` is greedy; ``seed`` fixes the
    request's own random stream.

    Before the draw, in this order (afd/engine/sampling.py): ``min_tokens`` masks the stop tokens,
    ``logit_bias`` is added, the penalties apply (``repetition_penalty`` over prompt and generated
    tokens, ``frequency_penalty``/``presence_penalty`` over generated tokens), then temperature,
    ``min_p``, ``top_k``, ``top_p``. Returned log-probabilities are always the raw model's.
    """

    max_tokens: int = 16  # 0: prefill only (for prompt logprobs): no token is generated
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability; 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # generating one ends the request (finish_reason "stop")
    include_stop_str_in_output: bool = False  # keep the stop string or stop token's text in the output
    ignore_eos: bool = False
    min_tokens: int = 0  # no EOS, stop token or stop string before this many tokens
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (divides positive logits)
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of each token already generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    skip_special_tokens: bool = True  # in the output text
    logprobs: int | None = None  # None: none; N: the sampled token's log-probability and the N most likely
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's log-probability and the N most likely

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {token}: {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class EngineConfig:
    """What a generation engine needs beyond the model: cache shape, batching limits, dtype, device."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's context (afd.engine.budget caps it to the KV cache)
    enable_prefix_caching: bool = True  # reuse the KV blocks of cached prompt prefixes (afd/kvcache/block_manager.py)

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")


@dataclass(frozen=True)
class PipelineConfig:
    """How an attention rank runs one step over the connector; a per-step setting, not a launch property.

    mode              ``sync``: one micro-batch, dispatch then wait, per layer;
                      ``async``: ``num_microbatches`` micro-batches ping-ponged so that
                      attention of one overlaps the transfer and FFN work of the others
    num_microbatches  1..8 (async); with ``adaptive``, the most the planner may choose
    adaptive          choose m per step (1..num_microbatches) by simulating the schedule with the
                      cost model (``--num-microbatches auto``)
    split             ``request`` (cut between sequences) or ``token`` (cut anywhere)
    credits           max dispatches in flight per attention rank (default: num_microbatches)
    cost              the planner's :class:`CostModel`, e.g. fitted by ``afd bench costs``
                      (``CostModel.from_fit``); None: the defaults
    min_microbatch_tokens  a step with fewer than m x this many tokens runs fewer micro-batches
                      (1: always m when possible)
    """

    mode: str = "sync"
    num_microbatches: int = 2
    split: str = "token"
    credits: int | None = None
    cost: CostModel | None = None
    min_microbatch_tokens: int = 1
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("sync", "async"):
            raise ValueError(f"--mode must be sync or async, got {self.mode!r}")
        if not 1 <= self.num_microbatches <= 8:
            raise ValueError(f"--num-microbatches must be in [1, 8], got {self.num_microbatches}")
        if self.split not in ("request", "token"):
            raise ValueError(f"--split must be request or token, got {self.split!r}")
        if self.credits is not None and not 1 <= self.credits <= 8:
            raise ValueError(f"credits must be in [1, 8], got {self.credits}")
        if self.min_microbatch_tokens < 1:
            raise ValueError(f"--min-microbatch-tokens must be >= 1, got {self.min_microbatch_tokens}")

    @property
    def effective_microbatches(self) -> int:
        return 1 if self.mode == "sync" else self.num_microbatches

    @property
    def effective_credits(self) -> int:
        return self.credits or self.effective_microbatches
