"""Building blocks shared by the model families: norms, RoPE, MLPs, grouped experts.

Plain single-device PyTorch. Nothing here keeps per-batch state: rotary
cos/sin are computed from each call's positions, never cached in a buffer that
a later micro-batch could overwrite.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from afd.config import RopeConfig, yarn_mscale
from afd.kernels import ops as native_ops
from afd.models.int8 import int8_linear, int8_matmul, kernel_row_bias
from afd.models.mxfp4 import dequantize_mxfp4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; on CPU a few rows (a decode step's) take afd's kernel, which streams the weight once in
    place instead of packing it per call (afd/kernels/csrc/small_linear.cpp; ``kernels.small_linear_max_rows``),
    and bfloat16 up to 128 rows AMX-BF16's tiles where the CPU has them (amx.cpp; ``small_linear_max_bf16_rows``);
    where it has no half-precision dot products, half-precision rows from 64 (AVX2: 128) widen W to float32 for the float32 BLAS
    (widened_linear.cpp; ``small_linear_widen_rows``); float32 rows past the tiles up to 96 with K >= 1,024 (a routed
    expert's in a prefill step), and up to 64 with K of 128-1,023 (a small model's decode step, W from memory), are
    computed transposed, W's values broadcast (broadcast_linear.cpp; ``broadcast_linear_takes``), and so are bfloat16 ones where the CPU emulates bf16, W widened a block at a time,
    and, on bf16 dot products without AMX-BF16, bfloat16 rows from ``broadcast_linear_min_pair_rows`` on vdpbf16ps.
    Half-precision rows past those go to torch padded to ``kernels.linear_rows_bucket`` rows: oneDNN builds a kernel
    for every new shape, which costs more than the product at a serving step's ever-new row counts.
    ``GroupedExperts.reference`` calls it as moe_experts.cpp's ATen loop does, so where that loop runs the two agree
    bit for bit."""
    if x.device.type == "cpu" and x.dim() == 2:
        kernels = native_ops()
        rows = x.shape[0]
        if kernels is not None and (x.dtype != torch.float32 or rows <= kernels.small_linear_max_rows
                                    or kernels.broadcast_linear_takes(x.dtype, rows, x.shape[1])):
            return kernels.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose CPU decode sizes run :func:`linear`'s kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, scaled in the input dtype (the Hugging Face convention)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = native_ops() if x.device.type == "cpu" and x.dtype == self.weight.dtype else None
        if kernels is not None:  # one pass instead of 8 ops (afd/kernels/csrc/norm_rope.cpp)
            return kernels.rms_norm(x.contiguous(), self.weight, self.eps)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)). Used for dense layers and shared experts; with ``swiglu_limit``
    the clamped activation (:func:`clamped_swiglu`: DeepSeek-V4's shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None = None, swiglu_alpha: float = 1.702,
                 swiglu_offset: float = 1.0) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.swiglu = (swiglu_limit, swiglu_alpha, swiglu_offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        limit, alpha, offset = self.swiglu
        if limit is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), limit, alpha, offset))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float, offset: float = 1.0) -> torch.Tensor:
    """The clamped expert activation: (clamp(up, -limit, limit) + offset) * g * sigmoid(alpha * g), where
    g = min(gate, limit) (gate is clamped above only). gpt-oss: offset 1, alpha 1.702; DeepSeek-V4: offset 0,
    alpha 1, which is silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + offset) * gate * torch.sigmoid(gate * alpha)


class RotaryEmbedding:
    """Rotary embedding frequencies (default or YaRN). Holds constants only."""

    def __init__(self, rope: RopeConfig) -> None:
        self.interleaved = rope.interleaved
        inv_freq, self.attention_factor = _inv_freq(rope)
        self.inv_freq = inv_freq  # [dim/2] fp32, on CPU; moved per call

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> (cos, sin), each [T, dim/2] fp32."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def cos_sin_of(self, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`cos_sin` of a batch's positions, computed by its first layer and kept in the batch's
        ``layer_state`` for the others (six ops a layer, ~20 µs on CPU: 0.5 ms a step at 27 layers)."""
        key = f"rope_cos_sin:{id(self)}"
        cached = meta.layer_state.get(key)
        if cached is None:
            cached = meta.layer_state[key] = self.cos_sin(meta.positions)
        return cached

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool | None = None) -> torch.Tensor:
        """x [T, heads, d] -> rotated x, computed in fp32, returned in x's dtype. With partial rotary
        (GLM: rope dim < d) only the first rope-dim channels rotate; the rest pass through. ``interleaved``
        overrides the model's layout (DeepSeek-V3.2's indexer rotates halves where its MLA rotates pairs)."""
        interleaved = self.interleaved if interleaved is None else interleaved
        rot = 2 * cos.shape[-1]
        if x.shape[-1] > rot:
            return torch.cat((self.apply(x[..., :rot], cos, sin, interleaved), x[..., rot:]), dim=-1)
        kernels = native_ops() if x.device.type == "cpu" else None
        if kernels is not None:  # one pass instead of ~12 ops (afd/kernels/csrc/norm_rope.cpp)
            return kernels.rotary(x.contiguous(), cos.contiguous(), sin.contiguous(), interleaved)
        return self.reference(x, cos, sin, interleaved)

    def reference(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool | None = None) -> torch.Tensor:
        """:meth:`apply` in torch ops, for x whose every channel rotates."""
        interleaved = self.interleaved if interleaved is None else interleaved
        x32 = x.float()
        c, s = cos[:, None, :], sin[:, None, :]
        if interleaved:  # pairs (x0, x1), (x2, x3), ... as complex numbers
            x0, x1 = x32[..., 0::2], x32[..., 1::2]
            out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
        else:  # halves: rotate_half convention
            half = x32.shape[-1] // 2
            x0, x1 = x32[..., :half], x32[..., half:]
            out = torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1)
        return out.to(x.dtype)


def _inv_freq(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    # YaRN: blend interpolated and extrapolated frequencies over a ramp of dimensions.
    factor = rope.factor
    if rope.attention_factor is not None:
        attention_factor = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    orig = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


class GroupedExperts(nn.Module):
    """The routed experts a process holds, stacked: one GEMM pair per expert over its tokens.

    ``expert_ids`` are the logical ids held here (any subset of ``range(num_experts)``).
    Weights: ``gate_up_proj [E_local, 2I, H]`` (gate rows first) and ``down_proj [E_local, H, I]``;
    with ``bias`` (gpt-oss) also ``gate_up_proj_bias [E_local, 2I]`` and ``down_proj_bias [E_local, H]``,
    each expert's down bias added before its combine weight. ``swiglu_limit``: the clamped activation
    (:func:`clamped_swiglu`) instead of silu(gate) * up.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, expert_ids: Sequence[int],
                 bias: bool = False, swiglu_limit: float | None = None, swiglu_alpha: float = 1.702,
                 swiglu_offset: float = 1.0) -> None:
        super().__init__()
        ids = sorted(set(expert_ids))
        if ids and not (0 <= ids[0] and ids[-1] < num_experts):
            raise ValueError(f"expert ids must be in [0, {num_experts}), got {ids}")
        self.expert_ids = tuple(ids)
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(len(ids), 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(len(ids), hidden_size, intermediate_size))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(len(ids), 2 * intermediate_size))
            self.down_proj_bias = nn.Parameter(torch.empty(len(ids), hidden_size))
        self.bias = bias
        self.swiglu_limit, self.swiglu_alpha, self.swiglu_offset = swiglu_limit, swiglu_alpha, swiglu_offset
        lookup = torch.full((num_experts,), -1, dtype=torch.long, device="cpu")
        lookup[list(ids)] = torch.arange(len(ids), device="cpu")
        self._global_to_local = lookup  # constant [E] -> local index or -1
        self._holds_all = self.expert_ids == tuple(range(num_experts))  # local index = logical id (one FFN rank, monolithic)
        self.tokens_routed = [0] * len(ids)  # (token, slot) rows each held expert has computed (a metric)
        self.gemms_run = [0] * len(ids)  # calls in which each held expert had rows: its GEMM pairs (a metric)
        self.fp8_block: tuple[int, int] | None = None  # set by hold_fp8: weights are fp8, dequantised per expert GEMM
        self.mxfp4 = False  # set by hold_mxfp4: weights are MXFP4 blocks, decoded per expert GEMM
        self.int8 = False  # set by hold_int8: W8A8, int8 weights and per-token int8 activations (afd/models/int8.py)
        self.compute_dtype: torch.dtype | None = None

    def hold_fp8(self, name: str, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> None:
        """``name`` (gate_up_proj or down_proj) now holds fp8 weights with these block scales
        (gate_up: ``[E, 2, ceil(I/br), ceil(H/bc)]``, gate and up blocked apart; down: ``[E, ceil(H/br), ceil(I/bc)]``)."""
        self.register_parameter(f"{name}_scale_inv", nn.Parameter(scale_inv.float(), requires_grad=False))
        self.fp8_block, self.compute_dtype = block, dtype

    def hold_mxfp4(self, gate_up_scales: torch.Tensor, down_scales: torch.Tensor, dtype: torch.dtype) -> None:
        """``gate_up_proj`` [E, 2I, H/32, 16] and ``down_proj`` [E, H, I/32, 16] now hold MXFP4 blocks (gate rows
        first) with these scales (``--mxfp4-weights keep``: afd/models/mxfp4.py)."""
        self.register_parameter("gate_up_proj_scales", nn.Parameter(gate_up_scales, requires_grad=False))
        self.register_parameter("down_proj_scales", nn.Parameter(down_scales, requires_grad=False))
        self.mxfp4, self.compute_dtype = True, dtype

    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert ``e``'s (gate_up [2I, H], down [H, I]) in the compute dtype."""
        if self.mxfp4:
            return (dequantize_mxfp4(self.gate_up_proj[e], self.gate_up_proj_scales[e], self.compute_dtype),
                    dequantize_mxfp4(self.down_proj[e], self.down_proj_scales[e], self.compute_dtype))
        if self.fp8_block is None:
            return self.gate_up_proj[e], self.down_proj[e]
        from afd.models.quant import dequantize

        i, block = self.intermediate_size, self.fp8_block
        gate_up = dequantize(self.gate_up_proj[e].view(2, i, -1), self.gate_up_proj_scale_inv[e], block, self.compute_dtype)
        return gate_up.view(2 * i, -1), dequantize(self.down_proj[e], self.down_proj_scale_inv[e], block, self.compute_dtype)

    def hold_int8(self, gate_up_scale: torch.Tensor, down_scale: torch.Tensor, dtype: torch.dtype) -> None:
        """``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] now hold int8 weights with these per-row scales
        ([E, 2I], [E, H]): each expert's GEMMs run W8A8, its input and its activation quantised per token."""
        self.register_parameter("gate_up_proj_scale", nn.Parameter(gate_up_scale.float(), requires_grad=False))
        self.register_parameter("down_proj_scale", nn.Parameter(down_scale.float(), requires_grad=False))
        self._int8_row_bias = (kernel_row_bias(self.gate_up_proj), kernel_row_bias(self.down_proj))  # the native kernel's
        self.int8, self.compute_dtype = True, dtype

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, quantized=None) -> torch.Tensor:
        """Partial MoE output over the experts held here (``quantized``: x as int8 rows and scales, read as they are
        by int8 experts).

        x [T, H]; topk_ids [T, k] logical expert ids (-1: a slot routed elsewhere); topk_weights [T, k].
        Returns [T, H] = sum over held experts e in topk of weight * expert_e(x);
        ids not held here (or -1) contribute nothing.
        """
        kernels = native_ops() if x.device.type == "cpu" and self.fp8_block is None else None
        if kernels is None:
            return self.reference(x, topk_ids, topk_weights, quantized if self.int8 else None)
        # the loop of :meth:`reference` in one C++ call (afd/kernels/csrc/moe_experts.cpp says how)
        biases = (self.gate_up_proj_bias, self.down_proj_bias) if self.bias else (None, None)
        # every expert held: the ids are the local indices (the kernel checks each is in [-1, E)); else mapped
        local = topk_ids if self._holds_all and topk_ids.dtype == torch.long else self._local_ids(topk_ids)
        if self.int8:
            q, s = quantized if quantized is not None else (None, None)
            out, counts = kernels.moe_experts_int8(x, q, s, local, topk_weights, self.gate_up_proj, self.down_proj,
                                                   self.gate_up_proj_scale, self.down_proj_scale, *self._int8_row_bias, *biases,
                                                   self.swiglu_limit, self.swiglu_alpha, self.swiglu_offset)
        else:
            scales = (self.gate_up_proj_scales, self.down_proj_scales) if self.mxfp4 else (None, None)
            out, counts = kernels.moe_experts(x, local, topk_weights, self.gate_up_proj, self.down_proj,
                                              *biases, self.swiglu_limit, self.swiglu_alpha, *scales, self.swiglu_offset)
        for e, n in enumerate(counts.tolist()):
            if n:  # list items, not module attributes: nn.Module.__setattr__ costs microseconds a call
                self.tokens_routed[e] += n
                self.gemms_run[e] += 1
        return out

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, k] logical ids -> [T, k] local indices, -1 for a slot not held here (or routed elsewhere: -1)."""
        return torch.where(topk_ids >= 0, self._global_to_local.to(topk_ids.device)[topk_ids.clamp(min=0)], -1)

    def _project(self, e: int, which: int, x: torch.Tensor, bias: torch.Tensor | None, weights, quantized=None) -> torch.Tensor:
        """Local expert ``e``'s gate_up (``which`` 0) or down (1) projection of x: over ``weights`` (its
        :meth:`expert_weights`), or W8A8 where it holds int8 (``weights`` None; ``quantized``: x's rows already int8)."""
        if self.int8:
            weight, scale = (self.gate_up_proj, self.gate_up_proj_scale) if which == 0 else (self.down_proj, self.down_proj_scale)
            sums = self._int8_row_bias[which]
            sums = None if sums is None else sums[e]
            if quantized is not None:
                return int8_matmul(quantized[0], quantized[1], weight[e], scale[e], x.dtype, bias, sums)
            return int8_linear(x, weight[e], scale[e], bias, sums)
        return linear(x, weights[which], bias)

    def reference(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, quantized=None) -> torch.Tensor:
        """:meth:`forward` as a Python loop over the held experts (every device; fp8 weights dequantised per expert)."""
        num_tokens, k = topk_ids.shape
        local = self._local_ids(topk_ids).flatten()  # [T*k]
        out = x.new_zeros(num_tokens * k, x.shape[-1])  # one row per (token, slot)
        held = local >= 0
        if held.any():
            order = torch.argsort(local.masked_fill(~held, len(self.expert_ids)), stable=True)
            order = order[: int(held.sum())]  # (token, slot) rows sorted by local expert
            counts = torch.bincount(local[order], minlength=len(self.expert_ids)).tolist()
            weights = topk_weights.flatten()
            start = 0
            for e, n in enumerate(counts):
                if n == 0:
                    continue
                self.tokens_routed[e] += n
                self.gemms_run[e] += 1
                rows = order[start : start + n]
                start += n
                xe = x[rows // k]  # [n, H]
                b_gate_up, b_down = (self.gate_up_proj_bias[e], self.down_proj_bias[e]) if self.bias else (None, None)
                weights_e = None if self.int8 else self.expert_weights(e)
                qe = None if quantized is None else (quantized[0][rows // k], quantized[1][rows // k])
                gate, up = self._project(e, 0, xe, b_gate_up, weights_e, qe).chunk(2, dim=-1)
                if self.swiglu_limit is None:
                    act = F.silu(gate) * up
                else:
                    act = clamped_swiglu(gate, up, self.swiglu_limit, self.swiglu_alpha, self.swiglu_offset)
                ye = self._project(e, 1, act, b_down, weights_e)  # [n, H], the expert's bias before its weight
                out[rows] = (ye * weights[rows, None]).to(out.dtype)
        return out.view(num_tokens, k, -1).sum(dim=1)


def experts_dtype(model) -> torch.dtype:
    """The dtype a model's routed experts compute in (their compute dtype when held fp8, MXFP4 or int8): an FFN
    rank's, which rows sent in another dtype (--dispatch-dtype) are converted to."""
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, GroupedExperts) and not experts.gate_up_proj.is_meta:
            return experts.compute_dtype or experts.gate_up_proj.dtype
    return torch.float32


def warm_up_linears(model: nn.Module, most_rows: int, budget_s: float = 2.0, most_product: int = 1 << 31) -> tuple[int, int]:
    """Has oneDNN build now the kernel of every half-precision linear shape a step of up to ``most_rows`` rows will
    ask of it, instead of inside the first steps that meet each: it JIT-compiles one per (rows, N, K) the first time
    it sees it (0.5-1 ms each at the built-in model's shapes, more at larger ones; rows as :func:`linear` pads them), and
    a server's first steps at each new batch size paid that (vllm_bench.py's first 32-stream round in bf16: 1.09x vLLM,
    the later rounds 1.40-1.48x). float32 (MKL) builds nothing, and neither do the rows afd's kernels take (a bucket
    whose every row count they take: broadcast_linear's on vdpbf16ps, for one). One call per
    distinct weight shape and padded row count, on the model's own weights, fewest rows first, until ``budget_s``
    is spent, and none of more than ``most_product`` rows x N x K (a large model's LM head at a prefill's rows would
    be a GEMM of seconds and gigabytes; its steps ask it for one row a sequence). Returns (calls, the most rows
    warmed)."""
    import logging
    import time

    kernels = native_ops()
    if kernels is None or kernels.small_linear_widen_rows:  # without half-precision dot products no rows reach oneDNN
        return 0, 0
    first_native = {torch.bfloat16: kernels.small_linear_max_bf16_rows, torch.float16: kernels.small_linear_max_half_rows}
    weights = {}  # (shape, dtype) -> a weight of it
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, nn.Linear) and w is not None and w.device.type == "cpu" and w.dtype in first_native:
            weights.setdefault((tuple(w.shape), w.dtype), w)
    if not weights:
        return 0, 0
    buckets = sorted({kernels.linear_rows_bucket(r) for r in range(min(first_native.values()) + 1, most_rows + 1)})

    def ours(first: int, last: int, k: int, dtype: torch.dtype) -> bool:  # every row count padded to this bucket, afd's
        return kernels.broadcast_linear_takes(dtype, first, k) and kernels.broadcast_linear_takes(dtype, last, k)  # an interval

    calls, reached, deadline = 0, 0, time.monotonic() + budget_s
    with torch.no_grad():
        for first, rows in zip([min(first_native.values()) + 1] + [b + 1 for b in buckets], buckets):
            took = [(k, w) for ((n, k), dtype), w in weights.items()
                    if first_native[dtype] < rows and rows * n * k <= most_product and not ours(first, rows, k, dtype)]
            if not took or time.monotonic() >= deadline:
                break
            for k, w in took:
                linear(torch.zeros(rows, k, dtype=w.dtype), w)
                calls += 1
            reached = rows
    logging.getLogger(__name__).info("built oneDNN's kernels of %d linear shapes x row counts, up to %d of %d rows, in %.2f s",
                                     calls, reached, most_rows, time.monotonic() - deadline + budget_s)
    return calls, reached
