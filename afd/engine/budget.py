"""A step's memory, bounded and known before the step runs.

A step of T batch tokens from at most S sequences takes at most

    fixed + T x per_token + min(3 x WORKSPACE_BYTES, T x scores_per_token)

bytes of temporaries (beyond the weights and the KV cache):

* ``per_token``: the activations one batch token holds at the peak of a layer -- the hidden state,
  residual and FFN input, the attention projections (MLA: the query, its absorbed form and the output
  per head; GQA: q, k, v), and the FFN half's temporaries (the routed slots' rows, the largest expert's
  or MLP's intermediate, the router scores);
* ``fixed``: what does not grow with T: a prefill chunk's gathered context (at most ``max_model_len``
  tokens of one layer's KV, decompressed too when that stays small), and the logits of S sequences
  with the sampler's copies;
* the attention workspace: per (token, key) at the longest context, fp32 scores per head and a decode
  token's gathered keys and values, but never above three ``WORKSPACE_BYTES`` -- every attention op is
  tiled to ``afd.models.paged_attention.WORKSPACE_BYTES``. The gathered keys are the torch path's; on the
  CPU the native decode kernel (afd/kernels) reads them in place, so there the bound is looser, never short.

Nothing in a step is padded to its longest query or context (afd/models/paged_attention.py), so no
term grows with S x L. ``--max-step-memory`` caps that sum (default: as much as the KV cache, between a
512- and an 8192-token step); the default token cap is the largest T that fits. On an FFN rank a union holds at most A x T rows (A contributors of at most T
tokens each): its workspace is that many rows of the FFN half's per-token bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd.config import ModelConfig
from afd.kvcache import layout_bytes
from afd.models.deepseek_v4 import cache_layouts
from afd.models.gated_deltanet import CHUNK
from afd.models.paged_attention import WORKSPACE_BYTES

#: token caps are multiples of this, and never above the most a step may take
TOKEN_STEP = 16
MAX_TOKENS = 16384


@dataclass(frozen=True)
class StepBudget:
    per_token: int  # bytes of activations per batch token
    fixed: int  # bytes that do not grow with the batch's tokens
    ffn_per_token: int  # bytes per row of the FFN half alone (an FFN rank's union)
    scores_per_token: int = 0  # attention scores per batch token at the longest context, until the tiles' cap

    @classmethod
    def for_model(cls, config: ModelConfig, dtype: torch.dtype, max_model_len: int, max_num_seqs: int) -> "StepBudget":
        b = torch.empty((), dtype=dtype).element_size()
        h, moe = config.hidden_size, config.moe
        if config.compressed is not None:  # DeepSeek-V4: q and its output per head, the q latent, the key and the
            v = config.compressed  # compressor's projections, the indexer's query; the fp32 streams and their mixing
            attention = 3 * config.num_heads * v.head_dim + v.q_lora_rank + 6 * v.head_dim + (v.index_heads + 4) * v.index_head_dim
            attention += v.o_groups * v.o_lora_rank + 2 * (4 // b) * v.hc_mult * (h + v.hc_mult + 2)
            kv_per_token, decompressed = v.head_dim, 0
        elif config.mla is not None:
            m = config.mla
            attention = config.num_heads * (m.qk_head_dim + m.kv_lora_rank + m.qk_rope_head_dim + m.v_head_dim)
            kv_per_token = m.kv_lora_rank + m.qk_rope_head_dim  # one layer's cache entry
            decompressed = config.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        else:
            attention = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim * 2
            kv_per_token = 2 * config.num_kv_heads * config.head_dim
            decompressed = 0
        dense = config.intermediate_size if len(moe.layers) < config.num_layers else 0
        widest = max(moe.intermediate_size, moe.shared_intermediate_size, dense)
        ffn = moe.top_k * h + 2 * h + 3 * widest  # routed slots' rows, one expert's input and output, its intermediate
        per_token = b * (4 * h + attention + ffn) + 4 * (moe.num_experts + moe.top_k)
        if config.dsa is not None:  # a prefill query's selection: one byte per context position (its scores are tiled)
            per_token += max_model_len + 4 * config.dsa.index_heads * (1 + config.dsa.index_head_dim)
        context = max_model_len * b * (kv_per_token + min(decompressed, WORKSPACE_BYTES // (b * max_model_len)))
        if config.linear is not None:  # Gated DeltaNet: its projections, fp32 heads and chunk matrices per token;
            lin = config.linear  # a prefill chunk's state and a decode batch's gathered states (the torch path's)
            heads = lin.num_value_heads
            per_token += b * 2 * (lin.conv_dim + lin.value_dim) + 4 * heads * (3 * (2 * lin.key_head_dim + lin.value_head_dim) + 4 * CHUNK)
            context += 4 * heads * lin.key_head_dim * lin.value_head_dim * (2 + 2 * max_num_seqs)
        logits = 4 * max_num_seqs * config.vocab_size * 4  # fp32 logits, processed copy, probabilities, logprobs
        # per (token, key) at the longest context: fp32 scores, probabilities and a mask per head, and a
        # decode token's gathered key (with an einsum's copy) and value
        scores = max_model_len * (12 * config.num_heads + 3 * b * kv_per_token)
        if config.compressed is not None:  # a query reads its window and at most one entry per window of the smallest rate
            v = config.compressed
            scores = (v.window + max_model_len // min(config.compression_rates)) * (12 * (config.num_heads + v.index_heads) + 3 * b * v.head_dim)
        return cls(per_token, context + logits, b * (2 * h + ffn) + 4 * (moe.num_experts + moe.top_k), scores)

    def bytes_for(self, num_tokens: int) -> int:
        """The most a step of ``num_tokens`` batch tokens takes: activations, the gathered context and
        logits, and the attention workspace until the tiles' cap (an op's tile, its inputs and output)."""
        return self.fixed + num_tokens * self.per_token + min(3 * WORKSPACE_BYTES, num_tokens * self.scores_per_token)

    def tokens_for(self, num_bytes: int) -> int:
        """The most batch tokens (a multiple of TOKEN_STEP, at most MAX_TOKENS) whose step fits ``num_bytes``."""
        lo, hi = 0, MAX_TOKENS // TOKEN_STEP  # bytes_for grows with the tokens: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.bytes_for(mid * TOKEN_STEP) <= num_bytes else (lo, mid - 1)
        return lo * TOKEN_STEP

    def default_step_memory(self, kv_cache_memory: int) -> int:
        """As much as the KV cache, kept between a 512-token and an 8192-token step."""
        return int(min(self.bytes_for(8192), max(self.bytes_for(512), kv_cache_memory)))


def kv_layer_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """One token's KV cache entry in one layer (MLA: the latent and the shared key, with DeepSeek Sparse
    Attention the index key too; GQA: k and v): what the models' ``kv_layout`` holds."""
    if config.mla is not None:
        per_layer = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim + (config.dsa.index_head_dim if config.dsa else 0)
    else:
        per_layer = 2 * config.num_kv_heads * config.head_dim
    return per_layer * torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """One token's KV cache entries over every layer that caches KV."""
    return kv_layer_bytes(config, dtype) * len(config.kv_layers)


def state_slot_bytes(config: ModelConfig, dtype: torch.dtype, state_dtype: str = "float32") -> int:
    """One sequence's state over the linear-attention layers (0 without them): the conv state in the model's
    dtype, the recurrent state in ``state_dtype`` -- what the models' ``state_layout`` holds."""
    lin = config.linear
    if lin is None:
        return 0
    b = torch.empty((), dtype=dtype).element_size()
    s = 4 if state_dtype == "float32" else b
    return len(lin.layers) * (lin.conv_dim * (lin.conv_kernel - 1) * b + lin.num_value_heads * lin.key_head_dim * lin.value_head_dim * s)


def no_prefix_cache_reason(config: ModelConfig, dtype: torch.dtype, state_dtype: str, block_size: int) -> str | None:
    """Why a model runs without the prefix cache (None: it may use it). A hybrid model's cached prefix would have
    to restore the linear layers' state at its end too: one snapshot per block, each the size of a state slot."""
    if config.linear is None:
        return None
    tokens = state_slot_bytes(config, dtype, state_dtype) // kv_bytes_per_token(config, dtype)
    return (f"prefix caching is off for {config.architecture} (a hybrid model): a cached prefix must restore the "
            f"linear-attention state at its end too, and one state snapshot costs as much memory as the KV of {tokens} "
            f"tokens, so one per {block_size}-token block would outgrow the KV it saves (docs/user-guide.md)")


def state_slots(config: ModelConfig, dtype: torch.dtype, kv_cache_memory: int, max_num_seqs: int, state_dtype: str = "float32") -> int:
    """State slots of a hybrid model (0 without linear-attention layers): one per sequence the engine may run,
    taken from ``kv_cache_memory`` before its KV blocks, but never more than half of it (fewer slots bound
    ``max_num_seqs`` instead)."""
    per_slot = state_slot_bytes(config, dtype, state_dtype)
    if not per_slot:
        return 0
    slots = min(max_num_seqs, kv_cache_memory // 2 // per_slot)
    if slots < 1:
        raise ValueError(f"kv cache memory {kv_cache_memory >> 20} MiB holds no sequence's linear-attention state "
                         f"({per_slot / 2**20:.1f} MiB each, at most half the memory); raise --kv-cache-memory")
    return int(slots)


def window_pool_blocks(config: ModelConfig, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                       max_model_len: int) -> int:
    """Blocks of a sliding-window pool that hold every sequence at once, or 0 where a pool does not pay (no
    sliding layers, or a window as long as the context). A sequence computing n tokens from ``start`` holds
    the blocks of positions start-W+1 .. start+n-1: at most ceil((W-1)/b) + ceil(n/b) + 1 blocks; over a step's
    sequences, S (ceil((W-1)/b) + 2) + ceil(T/b)."""
    if not config.sliding_layers:
        return 0
    per_seq = -(-(config.sliding_window - 1) // block_size) + 2
    if per_seq >= -(-max_model_len // block_size) and config.compressed is None:  # DeepSeek-V4 keeps more than keys there: always a pool
        return 0
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


def kv_pools(config: ModelConfig, dtype: torch.dtype, kv_cache_memory: int, block_size: int, window_blocks: int) -> int:
    """Full-pool blocks of a KV cache of ``kv_cache_memory`` bytes once a window pool of ``window_blocks``
    (its sliding layers' share) is taken out."""
    if config.compressed is not None:  # DeepSeek-V4: what its layers keep in each pool (afd/models/deepseek_v4.py)
        full, window = layout_bytes(cache_layouts(config), block_size, dtype)
        num_blocks = (kv_cache_memory - window_blocks * window) // full
        if num_blocks < 1:
            raise ValueError(f"kv cache memory {kv_cache_memory} B holds no block of {full} B of compressed entries (the "
                             f"sliding-window pool takes {window_blocks * window} B); raise --kv-cache-memory")
        return int(num_blocks)
    layer_block = kv_layer_bytes(config, dtype) * block_size
    windowed = len(config.sliding_layers) if window_blocks else 0
    rest = kv_cache_memory - window_blocks * layer_block * windowed
    layers = len(config.kv_layers)
    num_blocks = rest // (layer_block * (layers - windowed)) if rest > 0 else 0
    if num_blocks < 1:
        raise ValueError(f"kv cache memory {kv_cache_memory} B holds no block of {layer_block * layers} B "
                         f"(a sliding-window pool takes {window_blocks * layer_block * windowed} B); raise --kv-cache-memory")
    return int(num_blocks)


@dataclass(frozen=True)
class EngineLimits:
    """What one engine (a monolithic engine, or an attention rank) may hold, resolved once at start."""

    num_blocks: int  # KV cache blocks (of the full-attention layers where there is a window pool)
    max_model_len: int  # capped to what the KV cache holds, when it holds less than the model's context
    max_num_batched_tokens: int
    max_step_memory: int
    budget: StepBudget
    model_max_len: int  # the model's own context (for the log line when capped)
    num_window_blocks: int = 0  # the sliding layers' own pool (gpt-oss), 0: none
    num_state_slots: int = 0  # a hybrid model's linear-attention states, one per running sequence; 0: none
    state_bytes: int = 0  # of all the state slots

    def describe(self) -> str:
        capped = f" (capped from the model's {self.model_max_len}: the KV cache holds no more)" if self.max_model_len < self.model_max_len else ""
        window = f" + {self.num_window_blocks} sliding-window blocks" if self.num_window_blocks else ""
        state = f" + {self.num_state_slots} state slots, {self.state_bytes / 2**20:.1f} MiB" if self.num_state_slots else ""
        return (f"max_model_len {self.max_model_len}{capped}; step memory {self.max_step_memory >> 20} MiB -> "
                f"max_num_batched_tokens {self.max_num_batched_tokens} ({self.budget.per_token / 1024:.1f} KiB per token, "
                f"{self.budget.fixed >> 20} MiB fixed); KV cache {self.num_blocks} blocks{window}{state}")


def engine_limits(config: ModelConfig, dtype: torch.dtype, kv_cache_memory: int, block_size: int, max_num_seqs: int,
                  max_model_len: int | None = None, max_step_memory: int | None = None,
                  max_num_batched_tokens: int | None = None, state_dtype: str = "float32") -> EngineLimits:
    """The KV blocks, context and step budget of an engine from its flags. A context longer than the KV
    cache holds is capped to it (and said, by :meth:`EngineLimits.describe`); a missing step memory or
    token cap derives from the other, the step memory by default from the KV size. A model with sliding
    windows gets a pool for its sliding layers sized for every sequence at once (:func:`window_pool_blocks`);
    the full layers take the rest, and the context is what they hold. A hybrid model's state slots
    (:func:`state_slots`) come out of the memory first, and bound ``max_num_seqs``."""
    slots = state_slots(config, dtype, kv_cache_memory, max_num_seqs, state_dtype)
    state_bytes = slots * state_slot_bytes(config, dtype, state_dtype)
    kv_cache_memory -= state_bytes
    max_num_seqs = slots or max_num_seqs
    num_blocks = kv_pools(config, dtype, kv_cache_memory, block_size, 0)
    if max_model_len is not None and max_model_len > config.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_model_len} is beyond the model's context of {config.max_position_embeddings} tokens")
    wanted = max_model_len or config.max_position_embeddings
    length = min(wanted, num_blocks * block_size)
    budget, memory, tokens = resolve(config, dtype, length, max_num_seqs, kv_cache_memory, max_step_memory, max_num_batched_tokens)
    window_blocks = window_pool_blocks(config, block_size, max_num_seqs, tokens, wanted)
    if window_blocks:  # the full layers hold the context; a longer one fits only fewer tokens per step
        num_blocks = kv_pools(config, dtype, kv_cache_memory, block_size, window_blocks)
        length = min(wanted, num_blocks * block_size)
        budget, memory, tokens = resolve(config, dtype, length, max_num_seqs, kv_cache_memory, max_step_memory, max_num_batched_tokens)
    return EngineLimits(int(num_blocks), length, tokens, memory, budget, config.max_position_embeddings, window_blocks, slots, state_bytes)


def resolve(config: ModelConfig, dtype: torch.dtype, max_model_len: int, max_num_seqs: int, kv_cache_memory: int,
            max_step_memory: int | None, max_num_batched_tokens: int | None) -> tuple[StepBudget, int, int]:
    """(budget, step memory, token cap) from the flags: a missing one derives from the other (the step
    memory from the KV size). A token cap whose worst-case step exceeds the step memory is refused."""
    budget = StepBudget.for_model(config, dtype, max_model_len, max_num_seqs)
    memory = max_step_memory if max_step_memory is not None else (
        budget.bytes_for(max_num_batched_tokens) if max_num_batched_tokens is not None else budget.default_step_memory(kv_cache_memory))
    fits = budget.tokens_for(memory)
    if fits < 1:
        raise ValueError(f"--max-step-memory {memory >> 20} MiB holds no step: a step takes {budget.fixed >> 20} MiB before its "
                         f"tokens and {budget.per_token / 1024:.1f} KiB per token; raise it to at least "
                         f"{budget.bytes_for(TOKEN_STEP) >> 20} MiB")
    tokens = max_num_batched_tokens if max_num_batched_tokens is not None else fits
    if budget.bytes_for(tokens) > memory:
        raise ValueError(f"--max-num-batched-tokens {tokens} needs up to {budget.bytes_for(tokens) >> 20} MiB per step, above "
                         f"--max-step-memory {memory >> 20} MiB: lower it to {fits} or raise the step memory")
    return budget, memory, tokens
