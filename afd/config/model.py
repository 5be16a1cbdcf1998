"""A checkpoint's architecture, normalised: attention (GQA or MLA), rotary, the MoE layers and their router."""

from __future__ import annotations

import math
from dataclasses import dataclass

SUPPORTED_ACTIVATIONS = ("silu",)
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
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
class DSAConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer scores every earlier position of
    a query with ``index_heads`` small heads of ``index_head_dim`` (the first ``qk_rope_head_dim`` channels
    rotated, ``rope_interleaved`` for GLM-5, halves for V3.2), and MLA attends only to the ``index_topk``
    best. ``shared_layers`` (GLM-5's ``indexer_types: shared``) have no indexer: they reuse the top-k of the
    layer before them."""

    index_heads: int
    index_head_dim: int
    index_topk: int
    rope_interleaved: bool = False
    shared_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("index_heads", "index_head_dim", "index_topk"):
            _positive(name, getattr(self, name))
        if 0 in self.shared_layers:
            raise ValueError("layer 0 cannot share the top-k of a layer before it (indexer_types[0] must be 'full')")


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5-MoE) on ``layers``. Each sequence keeps, per layer,
    a causal-convolution state (the last ``conv_kernel - 1`` inputs of the ``conv_dim`` channels q, k, v) and
    a recurrent state ``[num_value_heads, key_head_dim, value_head_dim]`` updated by the gated delta rule.
    ``num_value_heads`` may be a multiple of ``num_key_heads`` (q and k repeat). ``fused_projections``: the
    checkpoint's projections are Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba``, grouped per key head;
    otherwise Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``."""

    layers: tuple[int, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    fused_projections: bool = False

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
            _positive(name, getattr(self, name))
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.num_value_heads} must be a multiple of linear_num_key_heads={self.num_key_heads}")

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class CompressedAttentionConfig:
    """DeepSeek-V4's attention (afd/models/deepseek_v4.py). Shared-KV MQA of ``head_dim`` (the trailing
    ``rope_dim`` channels rotated) over a sliding ``window`` on every layer; a layer of rate r > 0 also attends to
    one compressed entry per r tokens: CSA (``csa_layers``: overlapping windows, the lightning indexer's
    ``index_topk`` picks of ``index_heads`` x ``index_head_dim``) or HCA (every entry). The CSA and HCA layers rotate
    with ``compress_rope`` (the model's ``rope`` serves the sliding-only ones). The residual stream is ``hc_mult``
    streams wide (hyper-connections, ``hc_sinkhorn_iters`` Sinkhorn rounds); the output projection is grouped
    (``o_groups`` x ``o_lora_rank``)."""

    rates: tuple[int, ...]  # per layer: 0 (the window only) or the tokens per compressed entry
    csa_layers: tuple[int, ...]
    window: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    compress_rope: RopeConfig
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float

    def __post_init__(self) -> None:
        for name in ("window", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "hc_mult", "hc_sinkhorn_iters"):
            _positive(name, getattr(self, name))
        if not any(self.rates):
            raise ValueError("a DeepSeek-V4 model without a compressed layer (every compress rate 0) is not supported")
        for i, r in enumerate(self.rates):  # the compressor's pending tokens lie inside the window (afd's cache keeps them there)
            need = 2 * r if i in self.csa_layers else r
            if r < 0 or need > self.window:
                raise ValueError(f"layer {i}: compress rate {r} needs a sliding window of at least {need} tokens, got {self.window}")
        if any(self.rates[i] == 0 for i in self.csa_layers):
            raise ValueError("a CSA layer needs a compress rate > 0")

    def rate(self, layer: int) -> int:
        return self.rates[layer]

    def is_csa(self, layer: int) -> bool:
        return layer in self.csa_layers


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts, shared experts and the router of the MoE layers.

    The router's variants (:class:`afd.models.base.Router`):
    scoring            softmax (DeepSeek-V2, Qwen3), sigmoid (DeepSeek-V3, GLM-4.5) or sqrt(softplus) (DeepSeek-V4)
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
    router_bias: bool = False  # gpt-oss: the gate's logits have a bias (``mlp.router.bias``)
    expert_bias: bool = False  # gpt-oss: every expert's gate_up and down projections have biases
    #: the clamped SwiGLU: (clamp(up, -l, l) + offset) * g * sigmoid(alpha * g), g = min(gate, l); None: silu(gate) * up.
    #: gpt-oss: offset 1, alpha 1.702; DeepSeek-V4: offset 0, alpha 1 (silu(min(gate, l)) * clamp(up, -l, l)), its
    #: shared experts clamped alike (the shared experts use the routed ones' activation)
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    swiglu_offset: float = 1.0
    #: DeepSeek-V4's hash-routed layers: a frozen ``tid2eid[token id]`` table chooses the experts, the gate only
    #: weights them (the router needs the step's token ids)
    hash_layers: tuple[int, ...] = ()
    #: the shared experts' intermediate size when it is not ``num_shared_experts x intermediate_size`` (Qwen3-Next)
    shared_size: int | None = None
    #: Qwen3-Next, Qwen3.5: the shared expert's output is scaled by sigmoid(``shared_expert_gate`` . x)
    shared_expert_gate: bool = False

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
        if self.swiglu_limit is not None:
            _positive("swiglu_limit", self.swiglu_limit)
        if not set(self.hash_layers) <= set(self.layers):
            raise ValueError(f"hash-routed layers {sorted(set(self.hash_layers) - set(self.layers))} are not MoE layers")
        if self.topk_method == "noaux_tc" and self.num_experts // self.num_groups < 2:
            raise ValueError("noaux_tc scores a group by its top two experts: every group needs at least 2")

    @property
    def score_bias(self) -> bool:
        """Whether the router holds ``e_score_correction_bias`` (selection only)."""
        return self.topk_method == "noaux_tc"

    @property
    def shared_intermediate_size(self) -> int:
        return self.shared_size if self.shared_size is not None else self.intermediate_size * self.num_shared_experts


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
    qk_norm: bool = False  # GQA: RMSNorm of q and k before RoPE (Qwen3, GLM with use_qk_norm, MiniMax-M2)
    #: what one q/k norm spans: "head" (Qwen3, GLM: per head, weight [d]) or "all" (MiniMax-M2: the whole
    #: projection, weight [heads * d])
    qk_norm_span: str = "head"
    num_mtp_layers: int = 0  # multi-token-prediction layers in the checkpoint (skipped at load)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins every softmax (no value)
    sliding_window: int | None = None  # W: a sliding layer's query at i sees keys i-W+1..i
    sliding_layers: tuple[int, ...] = ()  # the layers that attend over the window only
    dsa: DSAConfig | None = None  # DeepSeek Sparse Attention over the MLA cache (DeepSeek-V3.2, GLM-5)
    linear: LinearAttentionConfig | None = None  # Gated DeltaNet layers, which keep state, not KV (Qwen3-Next, Qwen3.5)
    attention_output_gate: bool = False  # Qwen3-Next: q_proj also yields a gate; the output is scaled by its sigmoid
    #: Qwen3-Next, Qwen3.5: every RMSNorm scales by (1 + w); the checkpoint stores w, afd holds 1 + w
    zero_centred_norm: bool = False
    #: where the language model's tensors live in the checkpoint (a multimodal release: ``model.language_model.``)
    checkpoint_prefix: str = "model."
    compressed: CompressedAttentionConfig | None = None  # DeepSeek-V4: compressed attention and hyper-connections

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
        if self.dsa is not None:
            if self.mla is None or self.mla.q_lora_rank is None:
                raise ValueError("DeepSeek Sparse Attention needs MLA with q_lora_rank (its indexer reads the q latent)")
            if self.dsa.index_head_dim < self.mla.qk_rope_head_dim:
                raise ValueError(f"index_head_dim {self.dsa.index_head_dim} < qk_rope_head_dim {self.mla.qk_rope_head_dim}")
        if self.qk_norm_span not in ("head", "all"):
            raise ValueError(f"qk_norm_span must be 'head' or 'all', got {self.qk_norm_span!r}")
        if self.sliding_layers:
            if not self.sliding_window or self.sliding_window < 1:
                raise ValueError(f"sliding layers {list(self.sliding_layers)} need a sliding_window >= 1, got {self.sliding_window}")
            bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"sliding layer indices {bad} outside [0, {self.num_layers})")
        if self.linear is not None:
            bad = [i for i in self.linear.layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"linear-attention layer indices {bad} outside [0, {self.num_layers})")
            if len(self.linear.layers) == self.num_layers:
                raise ValueError("every layer is linear attention: afd needs at least one full-attention layer")

    def window(self, layer: int) -> int:
        """The attention window of ``layer`` in tokens, the query included; 0: the whole context."""
        return self.sliding_window if layer in self.sliding_layers else 0

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct windows of the sliding layers (what a step's metadata pages apart)."""
        return (self.sliding_window,) if self.sliding_layers else ()

    def is_linear_layer(self, layer: int) -> bool:
        """Whether ``layer`` is Gated DeltaNet linear attention (its memory is a state slot, not KV)."""
        return self.linear is not None and layer in self.linear.layers

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that cache KV per token (every layer but the linear-attention ones)."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear_layer(i))

    @property
    def compression_rates(self) -> tuple[int, ...]:
        """The distinct compress rates of a DeepSeek-V4 model's layers (what a step's metadata lays out)."""
        return tuple(sorted(set(self.compressed.rates) - {0})) if self.compressed is not None else ()

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe.layers
