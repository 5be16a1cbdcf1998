"""The split-aware MoE decoder shared by every family.

A model exposes its halves -- ``embed``, ``attention``, ``router``, ``experts``,
``shared_experts``, ``dense_mlp``, ``head`` -- and :meth:`MoEModel.forward`
composes them into the monolithic forward, the reference every disaggregated
mode is compared with. Communication never hides in here: a disaggregated
runtime calls the same halves on different processes.

Module and parameter names follow the Hugging Face checkpoints
(``model.layers.{i}.self_attn...``) so loading is a name lookup; routed experts
are stacked per layer (``mlp.experts.gate_up_proj [E_local, 2I, H]``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from afd.config import ModelConfig, MoEConfig
from afd.kvcache import AttentionMetadata, PagedKVCache
from afd.models.layers import GatedMLP, GroupedExperts, Linear, RMSNorm, RotaryEmbedding, linear
from afd.types import AttentionOutput, Routing

#: ``observer(layer, boundary, tensor)``; boundaries: layer_input, attn_output,
#: topk_ids, ffn_output, final_hidden (layer = num_layers for final_hidden).
Observer = Callable[[int, str, torch.Tensor], None]


class MissingWeightsError(RuntimeError):
    """A half was called on a process that did not load its weights (role-aware loading)."""


class Router(nn.Module):
    """The MoE gate of every family: scoring, then selection, then weights (:class:`~afd.config.MoEConfig`).

    * scores: ``softmax`` (DeepSeek-V2, Qwen3) or ``sigmoid`` (DeepSeek-V3, GLM-4.5) of the logits, in fp32;
    * selection: greedy top-k; ``group_limited_greedy`` (V2: keep the ``topk_group`` groups whose best
      expert scores highest); ``noaux_tc`` (V3: on score + ``e_score_correction_bias``, keep the groups whose
      top two sum highest). The bias only *chooses* experts: it never enters the weights;
    * weights: the unbiased scores of the chosen experts. V2/Qwen normalise them (``norm_topk_prob``, k > 1)
      *or* multiply by ``routed_scaling_factor``; V3/GLM (``scale_after_norm``) normalise *then* scale.

    A hash-routed layer (DeepSeek-V4's first layers, ``hashed``) chooses its experts by the token: ``tid2eid
    [token id]`` (a frozen table of the checkpoint); the scores only weight them, as above.
    """

    def __init__(self, hidden_size: int, moe: MoEConfig, hashed: bool = False, vocab_size: int = 0) -> None:
        super().__init__()
        self.moe, self.hashed = moe, hashed
        if hashed:
            self.tid2eid = nn.Parameter(torch.empty(vocab_size, moe.top_k, dtype=torch.long), requires_grad=False)
        dtype = torch.float32 if moe.router_fp32 else None
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=dtype))
        if moe.score_bias and not hashed:  # a hash layer's table chooses: it has no selection bias
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32))
        if moe.router_bias:
            self.bias = nn.Parameter(torch.empty(moe.num_experts, dtype=dtype))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> router logits [T, E] (fp32 for DeepSeek and GLM, model dtype for Qwen)."""
        bias = self.bias if self.moe.router_bias else None
        if self.moe.router_fp32:
            return linear(x.float(), self.weight.float(), None if bias is None else bias.float())
        return linear(x, self.weight, bias)

    def selection_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores [T, E] -> what the top-k is taken over: biased, and -inf outside the kept groups."""
        moe = self.moe
        if moe.topk_method == "greedy":
            return scores
        choice = scores + self.e_score_correction_bias if moe.score_bias else scores
        grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
        if moe.topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values
        top_groups = group_scores.topk(moe.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        return choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] -> fp32 scores [T, E]."""
        if self.moe.scoring == "softmax":
            return logits.softmax(dim=-1, dtype=torch.float32)
        if self.moe.scoring == "sqrtsoftplus":
            return F.softplus(logits.float()).sqrt()
        return logits.float().sigmoid()

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> Routing:
        """x [T, H] -> the top-k experts and their weights; ``token_ids`` [T]: the tokens, for a hash-routed layer."""
        moe = self.moe
        scores = self.scores(self.logits(x))  # [T, E]
        if self.hashed:
            if token_ids is None or token_ids.shape != x.shape[:1]:
                raise ValueError("a hash-routed MoE layer chooses its experts by token id: the router needs the step's token ids, "
                                 f"one per row ({x.shape[0]} rows, got {None if token_ids is None else tuple(token_ids.shape)})")
            ids = self.tid2eid[token_ids.to(self.tid2eid.device)].to(torch.long)  # [T, k]
        else:
            ids = self.selection_scores(scores).topk(moe.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, ids)
        if moe.scale_after_norm:
            if moe.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * moe.routed_scaling_factor
        elif moe.norm_topk_prob and moe.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            weights = weights * moe.routed_scaling_factor
        return Routing(topk_ids=ids, topk_weights=weights)


class MoEBlock(nn.Module):
    """The FFN half of an MoE layer: router, the held routed experts, shared experts."""

    def __init__(self, config: ModelConfig, expert_ids: Sequence[int], layer: int = -1) -> None:
        super().__init__()
        moe = config.moe
        self.gate = Router(config.hidden_size, moe, hashed=layer in moe.hash_layers, vocab_size=config.vocab_size)
        swiglu = (moe.swiglu_limit, moe.swiglu_alpha, moe.swiglu_offset)  # the shared experts use the routed ones' activation
        self.experts = GroupedExperts(moe.num_experts, config.hidden_size, moe.intermediate_size, expert_ids, moe.expert_bias, *swiglu)
        self.shared_experts = (
            GatedMLP(config.hidden_size, moe.shared_intermediate_size, *swiglu) if moe.num_shared_experts else None
        )
        if moe.shared_expert_gate:  # Qwen3-Next: the shared expert's output times sigmoid(gate . x)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[DecoderLayer]) -> None:
        super().__init__()
        # _weight skips nn.Embedding's normal_ init: weights always come from a loader
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MoEModel(nn.Module):
    """Base of every family. Subclasses provide the attention module and the KV layout."""

    def __init__(self, config: ModelConfig, expert_ids: Sequence[int] | None = None) -> None:
        super().__init__()
        self.config = config
        held = range(config.moe.num_experts) if expert_ids is None else expert_ids
        layers = []
        for i in range(config.num_layers):
            mlp = MoEBlock(config, held, i) if config.is_moe_layer(i) else GatedMLP(config.hidden_size, config.intermediate_size)
            layers.append(DecoderLayer(config, self.make_attention(i), mlp))
        self.model = Backbone(config, layers)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope)

    # ------------------------------------------------------------------ family hooks
    #: (afd name part, checkpoint name part) renames, applied in order, the first that matches wins
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    #: per-expert checkpoint tensors ``{prefix}{e}.{name}.weight`` of gate, up and down
    expert_tensors: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    #: the checkpoint stores each layer's experts stacked in one tensor (gpt-oss), not one tensor per expert
    stacked_experts: bool = False

    @classmethod
    def checkpoint_layout(cls, config: ModelConfig, names: set[str]) -> ModelConfig:
        """The config for the tensor names the checkpoint holds, where a family has more than one layout (DeepSeek-V4:
        what transformers writes, or the release's own names)."""
        return config

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint tensor that fills afd's parameter ``name`` (afd's names follow the Hugging Face ones;
        a multimodal release keeps the language model under its own prefix)."""
        prefix = self.config.checkpoint_prefix
        if prefix != "model." and name.startswith("model."):
            name = prefix + name.removeprefix("model.")
        for ours, theirs in self.checkpoint_renames:
            if ours in name:
                return name.replace(ours, theirs)
        return name

    def load_convert(self, name: str) -> str | None:
        """How the checkpoint's tensor becomes parameter ``name`` (a key of ``afd.models.loader``'s converts);
        None: as stored."""
        return None

    def state_layout(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of what one sequence keeps per linear-attention layer (its state slot); () without such layers."""
        return ()

    #: module names whose parameters stay fp32 whatever the model's dtype (DeepSeek-V4's norms, sinks, hyper-connections)
    fp32_modules: frozenset[str] = frozenset()

    def cache_layouts(self) -> list[tuple] | None:
        """Per layer, the ``afd.kvcache.CacheTensor`` s it caches, for a model whose cache is more than per-token KV
        and state (DeepSeek-V4); None: ``kv_layout`` and ``state_layout`` say it."""
        return None

    def make_attention(self, layer: int) -> nn.Module:
        raise NotImplementedError

    def kv_layout(self) -> tuple[tuple[int, ...], ...]:
        """Shapes of what one token caches per layer."""
        raise NotImplementedError

    # ------------------------------------------------------------------ properties
    @property
    def expert_ids(self) -> tuple[int, ...]:
        """Logical ids of the routed experts this instance holds."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoEBlock):
                return layer.mlp.experts.expert_ids
        return ()

    def expert_token_counts(self) -> dict[tuple[int, int], int]:
        """Tokens each held routed expert has computed so far, keyed by (layer, logical expert id)."""
        counts = {}
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, MoEBlock):
                experts = layer.mlp.experts
                counts.update({(i, e): n for e, n in zip(experts.expert_ids, experts.tokens_routed)})
        return counts

    def expert_gemm_counts(self) -> tuple[int, int]:
        """(expert GEMM pairs run, rows over all of them) by the routed experts held here, so far."""
        blocks = [layer.mlp.experts for layer in self.model.layers if isinstance(layer.mlp, MoEBlock)]
        return sum(sum(e.gemms_run) for e in blocks), sum(sum(e.tokens_routed) for e in blocks)

    def _check_loaded(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.is_meta:
            raise MissingWeightsError(
                f"{what} weights were not loaded on this process (role-aware loading); "
                "load them with a WeightSelection that includes them"
            )

    def _moe(self, layer: int) -> MoEBlock:
        mlp = self.model.layers[layer].mlp
        if not isinstance(mlp, MoEBlock):
            raise ValueError(f"layer {layer} is a dense layer, not an MoE layer")
        return mlp

    # ------------------------------------------------------------------ halves
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> hidden [T, H]."""
        self._check_loaded(self.model.embed_tokens.weight, "embedding")
        return self.model.embed_tokens(input_ids)

    def attention(self, layer: int, hidden: torch.Tensor, meta: AttentionMetadata, kv: tuple[torch.Tensor, ...]) -> AttentionOutput:
        """Attention half of ``layer``: norm -> attention over the paged cache -> residual -> norm.

        hidden [T, H]; writes this batch's KV into ``kv`` (the layer's cache tensors).
        """
        block = self.model.layers[layer]
        self._check_loaded(block.input_layernorm.weight, "attention")
        cos, sin = self.rotary.cos_sin_of(meta)
        attn = block.self_attn(block.input_layernorm(hidden), self.rotary, cos, sin, kv, meta)
        residual = hidden + attn
        return AttentionOutput(residual, block.post_attention_layernorm(residual))

    def merge(self, layer: int, out: AttentionOutput, ffn_output: torch.Tensor) -> torch.Tensor:
        """The next layer's input from the attention half's output and the FFN half's: the residual sum (DeepSeek-V4
        mixes its streams instead)."""
        return out.residual + ffn_output

    def router(self, layer: int, ffn_input: torch.Tensor, token_ids: torch.Tensor | None = None) -> Routing:
        """The layer's top-k; ``token_ids`` [T] (the rows' tokens) are read by a hash-routed layer only."""
        gate = self._moe(layer).gate
        self._check_loaded(gate.weight, "router")
        return gate(ffn_input, token_ids)

    def experts(self, layer: int, ffn_input: torch.Tensor, routing: Routing, quantized=None) -> torch.Tensor:
        """Weighted sum over the routed experts held here. [T, H] -> [T, H]. ``quantized``: the rows as an int8
        dispatch sent them (values, per-row scales), which W8A8 experts read instead of requantising ``ffn_input``."""
        experts = self._moe(layer).experts
        self._check_loaded(experts.gate_up_proj, "routed expert")
        return experts(ffn_input, routing.topk_ids, routing.topk_weights, quantized)

    def shared_experts(self, layer: int, ffn_input: torch.Tensor) -> torch.Tensor | None:
        block = self._moe(layer)
        shared = block.shared_experts
        if shared is None:
            return None
        self._check_loaded(next(shared.parameters()), "shared expert")
        if self.config.moe.shared_expert_gate:
            return torch.sigmoid(block.shared_expert_gate(ffn_input)) * shared(ffn_input)
        return shared(ffn_input)

    def dense_mlp(self, layer: int, ffn_input: torch.Tensor) -> torch.Tensor:
        mlp = self.model.layers[layer].mlp
        if isinstance(mlp, MoEBlock):
            raise ValueError(f"layer {layer} is an MoE layer, not a dense layer")
        self._check_loaded(next(mlp.parameters()), "dense MLP")
        return mlp(ffn_input)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: hidden [N, H] -> logits [N, V] in fp32."""
        self._check_loaded(self.lm_head.weight, "LM head")
        return self.lm_head(self.final_norm(hidden)).float()

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output [N, H] -> what the LM head reads (DeepSeek-V4 collapses its streams first)."""
        return self.model.norm(hidden)

    # ------------------------------------------------------------------ monolithic
    def ffn(self, layer: int, ffn_input: torch.Tensor, observer: Observer | None = None,
            token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The whole FFN half of a layer on one process: routed + shared experts, or the dense MLP."""
        if not self.config.is_moe_layer(layer):
            return self.dense_mlp(layer, ffn_input)
        routing = self.router(layer, ffn_input, token_ids)
        if observer is not None:
            observer(layer, "topk_ids", routing.topk_ids)
        out = self.experts(layer, ffn_input, routing)
        shared = self.shared_experts(layer, ffn_input)
        return out if shared is None else out + shared

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: PagedKVCache,
        observer: Observer | None = None,
    ) -> torch.Tensor:
        """Monolithic forward of a flat batch. input_ids [T] -> last hidden state [T, H] (before the final norm)."""
        hidden = self.embed(input_ids)
        for i in range(self.config.num_layers):
            if observer is not None:
                observer(i, "layer_input", hidden)
            out = self.attention(i, hidden, meta, kv_cache.layer(i))
            if observer is not None:
                observer(i, "attn_output", out.residual)
            hidden = self.merge(i, out, self.ffn(i, out.ffn_input, observer, input_ids))
            if observer is not None:
                observer(i, "ffn_output", hidden)
        if observer is not None:
            observer(self.config.num_layers, "final_hidden", self.final_norm(hidden))
        return hidden
