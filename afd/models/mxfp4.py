"""MXFP4 expert weights, as gpt-oss's release stores them (OCP Microscaling, FP4 e2m1 with e8m0 scales).

A weight ``W [R, C]`` of one expert is stored as ``W_blocks [R, C/32, 16]`` uint8 beside ``W_scales
[R, C/32]`` uint8: each group of 32 values along a row shares one scale, and each byte holds two values,
the even one in its low nibble, the odd one in its high nibble. A nibble is an e2m1 number (sign, 2
exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives); a scale byte ``s`` is the
exponent 2^(s - 127). So ``W[r, 32 g + 2 j + h] = FP4[nibble h of blocks[r, g, j]] * 2^(scales[r, g] - 127)``.

gpt-oss stores ``gate_up_proj`` as rows of the interleaved gate/up outputs over the hidden size, and
``down_proj`` as rows of the hidden size over the intermediate size: once decoded, the first is afd's
``[2I, H]`` with its rows interleaved, the second afd's ``[H, I]`` as is.

Two ways to run such a checkpoint (``--mxfp4-weights``); either way only the held experts' rows are read:

``dequantize``  decode each held expert once at load into the compute dtype (the memory of a bf16 checkpoint);
``keep``        hold the blocks and scales (4.25 bits a value: about a quarter of bf16) and decode each
                expert that has rows inside the expert loop, in C++ (afd/kernels/csrc/moe_experts.cpp: a lookup
                of 16 values and an exponent), into a scratch weight its two GEMMs then read.
"""

from __future__ import annotations

from typing import Any

import torch

from afd.config import DEFAULT_MXFP4_MODE, MXFP4_MODES

__all__ = ["DEFAULT_MXFP4_MODE", "MXFP4_MODES", "as_mxfp4", "dequantize_mxfp4", "is_mxfp4"]
GROUP = 32  # values per scale
#: e2m1, indexed by the nibble
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127  # e8m0


def is_mxfp4(raw_config: dict[str, Any]) -> bool:
    """Whether the checkpoint's experts are MXFP4 (gpt-oss's ``quant_method: mxfp4``; DeepSeek-V4's release:
    ``expert_dtype: fp4`` beside fp8 attention); refuses what afd cannot read under it."""
    q = raw_config.get("quantization_config") or {}
    expert_dtype = q.get("expert_dtype", raw_config.get("expert_dtype"))
    if raw_config.get("model_type") == "deepseek_v4" and expert_dtype is not None:
        if expert_dtype not in ("fp4", "fp8"):
            raise ValueError(f"DeepSeek-V4 expert_dtype {expert_dtype!r} is not supported: afd reads fp4 (MXFP4: e2m1 values, "
                             "an e8m0 scale per 32) and fp8 (block-scaled, as the attention) experts")
        return expert_dtype == "fp4"
    if q.get("quant_method") != "mxfp4":
        return False
    if raw_config.get("model_type") != "gpt_oss":
        raise ValueError(f"quant_method mxfp4 is read for gpt-oss's experts only, not for model_type {raw_config.get('model_type')!r}")
    return True


def as_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored weight as MXFP4 blocks [..., R, C/32, 16] and scales [..., R, C/32], both uint8: gpt-oss stores them so;
    DeepSeek-V4's release packs an expert's weight as [R, C/2] (int8 or float4_e2m1fn_x2: two e2m1 values a byte, low
    nibble first, the same bytes) with float8_e8m0fnu scales [R, C/32] (the same exponent bytes)."""
    if scales.dtype != torch.uint8:
        if scales.dtype != torch.float8_e8m0fnu:
            raise ValueError(f"MXFP4 scales must be uint8 or float8_e8m0fnu exponents, got {scales.dtype}")
        scales = scales.view(torch.uint8)
    if packed.dim() == scales.dim():  # [..., R, C/2]
        if packed.shape[-1] != scales.shape[-1] * GROUP // 2:
            raise ValueError(f"packed FP4 weight {list(packed.shape)} does not match its scales {list(scales.shape)} (32 values a scale)")
        packed = packed.view(torch.uint8).reshape(*scales.shape, GROUP // 2)
    return packed, scales


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., R, C/32, 16] uint8, scales [..., R, C/32] uint8 -> [..., R, C] in ``dtype`` (exact: every
    e2m1 value times a power of two is representable in float32, and in bf16 unless it under/overflows)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} (want [..., G, 16] and [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [..., G, 16, 2]: low nibble first
    values = torch.ldexp(values.flatten(-2), (scales.int() - SCALE_BIAS)[..., None].float())  # [..., G, 32]
    return values.flatten(-2).to(dtype)
