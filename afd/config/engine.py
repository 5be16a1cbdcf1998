"""An engine's cache, batching and sampling, and the flags every engine is started with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from afd.config.model import _positive

FP8_MODES = ("dequantize", "keep")
MXFP4_MODES = ("dequantize", "keep")  # gpt-oss's MXFP4 experts (afd/models/mxfp4.py)
DEFAULT_MXFP4_MODE = "dequantize"
DEFAULT_FP8_MODE = "dequantize"  # faster decode at batch 8 on the synthetic V3 (docs/benchmarks.md)
#: the linear-attention layers' recurrent state: fp32 (as transformers and vLLM keep it), or the model's dtype
STATE_DTYPES = ("float32", "model")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots per layer; a model with sliding
    windows (gpt-oss) may give its sliding layers a pool of ``num_window_blocks`` of their own (0: none,
    they share the full pool). A model with linear-attention layers (Qwen3-Next) keeps ``num_state_slots``
    fixed-size states beside the blocks, one per running sequence, the recurrent one in ``state_dtype``."""

    block_size: int = 16
    num_blocks: int = 256
    num_window_blocks: int = 0
    num_state_slots: int = 0
    state_dtype: str = "float32"

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_blocks", self.num_blocks)
        if self.num_window_blocks < 0:
            raise ValueError(f"num_window_blocks must be >= 0, got {self.num_window_blocks}")
        if self.num_state_slots < 0:
            raise ValueError(f"num_state_slots must be >= 0, got {self.num_state_slots}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state dtype must be one of {', '.join(STATE_DTYPES)}; got {self.state_dtype!r}")


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
class EngineArgs:
    """An engine's flags, as the user gives them: the one spelling ``afd serve``, ``afd generate``, the
    engine-core process and every attention rank share. None: derived from the model and the memory
    budget (afd/engine/budget.py; a disaggregated run resolves them once, before any rank starts, so
    every rank and the links are sized alike)."""

    dtype: str = "auto"
    kv_cache_memory: int = 256 << 20
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_step_memory: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    fp8_weights: str = DEFAULT_FP8_MODE  # fp8 block-scaled checkpoints: dequantize at load | keep (afd/models/quant.py)
    mxfp4_weights: str = DEFAULT_MXFP4_MODE  # MXFP4 experts (gpt-oss): dequantize at load | keep (afd/models/mxfp4.py)
    state_dtype: str = "float32"  # hybrid models: the linear layers' recurrent state (STATE_DTYPES)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        for name in ("kv_cache_memory", "block_size", "max_num_seqs"):
            _positive(f"--{name.replace('_', '-')}", getattr(self, name))
        for name in ("max_num_batched_tokens", "max_step_memory", "max_model_len"):
            if getattr(self, name) is not None:
                _positive(f"--{name.replace('_', '-')}", getattr(self, name))
        if self.fp8_weights not in FP8_MODES:
            raise ValueError(f"--fp8-weights must be one of {', '.join(FP8_MODES)}, got {self.fp8_weights!r}")
        if self.mxfp4_weights not in MXFP4_MODES:
            raise ValueError(f"--mxfp4-weights must be one of {', '.join(MXFP4_MODES)}, got {self.mxfp4_weights!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"--state-dtype must be one of {', '.join(STATE_DTYPES)}, got {self.state_dtype!r}")
