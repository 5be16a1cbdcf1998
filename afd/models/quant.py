"""fp8 block-scaled weights, as DeepSeek-V3's release stores them.

A quantised linear weight ``W [R, C]`` is stored as ``float8_e4m3fn`` beside
``weight_scale_inv [ceil(R/br), ceil(C/bc)]`` (fp32), one scale per ``br x bc``
block (``quantization_config.weight_block_size``); the last block of a row or
column may be partial. The real weight is ``W[i, j] * scale_inv[i // br, j // bc]``.
Only weights are quantised: activations stay in the compute dtype
(``activation_scheme: dynamic`` is read and ignored).

Two ways to run such a checkpoint (``--fp8-weights``):

``dequantize``  dequantise every weight once at load into the compute dtype
                (the memory of a bf16 checkpoint, the speed of one);
``keep``        keep fp8 and the scales in memory (about half of bf16) and
                dequantise each weight right before its GEMM (:class:`Fp8Linear`,
                and per expert in :class:`~afd.models.layers.GroupedExperts`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv (DeepSeek-V4's release: X.scale, ue8m0)


def fp8_scale_name(weight: str, available) -> str | None:
    """The block scales of fp8 tensor ``weight`` among the checkpoint's ``available`` names: ``X.weight_scale_inv``
    (DeepSeek-V3) or ``X.scale`` (DeepSeek-V4's release); None: it has none (an unquantised tensor)."""
    for name in (weight + SCALE_SUFFIX, weight.removesuffix(".weight") + ".scale"):
        if name in available:
            return name
    return None


@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint's ``quantization_config`` (``quant_method: fp8``)."""

    block: tuple[int, int]
    dtype: torch.dtype = torch.float8_e4m3fn


def fp8_format(raw_config: dict[str, Any]) -> Fp8Format | None:
    """The checkpoint's fp8 format, or None for an unquantised one; refuses what afd cannot run."""
    q = raw_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method in ("mxfp4", "compressed-tensors"):
        return None  # gpt-oss's experts: afd/models/mxfp4.py; W8A8: afd/models/int8.py
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; afd reads fp8 block-scaled "
                         "checkpoints (quant_method: fp8, weight_block_size)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 format {fmt!r} is not supported (e4m3 only)")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"fp8 scale_fmt {scale_fmt!r} is not supported (fp32 scales, or ue8m0: powers of two, DeepSeek-V4)")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"fp8 checkpoints need quantization_config.weight_block_size [rows, cols]; got {block!r} "
                         "(per-tensor fp8 scales are not supported)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"fp8 activation_scheme {scheme!r} is not supported (dynamic only: activations stay unquantised)")
    log.info("fp8 checkpoint: %dx%d block-scaled weights; activation_scheme dynamic is ignored (activations stay in the "
             "compute dtype)", *block)
    return Fp8Format(block=(block[0], block[1]))


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [R, C] -> (e4m3 weight, scale_inv [ceil(R/br), ceil(C/bc)]): each block scaled so that its
    largest magnitude maps to e4m3's 448 (how synthetic fp8 checkpoints are written)."""
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = F.pad(weight.float(), (0, nc * bc - cols, 0, nr * br - rows)).view(nr, br, nc, bc)
    scale = padded.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max  # [nr, nc]
    q = (padded / scale[:, None, :, None]).view(nr * br, nc * bc)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """What DeepSeek-V3's release stores in fp8: the 2-D linear weights of attention, dense MLPs and experts
    (not embeddings, norms, routers or the LM head)."""
    return (len(shape) == 2 and name.endswith(".weight") and (".self_attn." in name or ".mlp." in name)
            and "norm" not in name and not name.endswith("mlp.gate.weight"))


def expand_scales(scale_inv: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Block scales [..., ceil(rows/br), ceil(cols/bc)] -> one per element [..., rows, cols] (fp32)."""
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape[-2:]) != want:
        raise ValueError(f"fp8 scales of shape {list(scale_inv.shape)} do not match a [{rows}, {cols}] weight in "
                         f"{br}x{bc} blocks (expected [..., {want[0]}, {want[1]}])")
    s = scale_inv.float().repeat_interleave(br, dim=-2)[..., :rows, :]
    return s.repeat_interleave(bc, dim=-1)[..., :cols]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """fp8 weight [..., R, C] and its block scales -> the real weight in ``dtype`` (products in fp32)."""
    rows, cols = weight.shape[-2:]
    br, bc = block
    scale_inv = scale_inv.to(weight.device)
    if rows % br == 0 and cols % bc == 0 and tuple(scale_inv.shape[-2:]) == (rows // br, cols // bc):
        # whole blocks: scale a blocked view, no per-element scale tensor
        blocked = weight.float().unflatten(-1, (cols // bc, bc)).unflatten(-3, (rows // br, br))  # [..., nr, br, nc, bc]
        return (blocked * scale_inv.float()[..., :, None, :, None]).flatten(-4, -3).flatten(-2, -1).to(dtype)
    return (weight.float() * expand_scales(scale_inv, rows, cols, block)).to(dtype)


class Fp8Linear(nn.Module):
    """``nn.Linear`` over an fp8 block-scaled weight, dequantised for each call (``--fp8-weights keep``).

    ``weight`` reads as the dequantised weight (what MLA's absorbed decode folds into its queries);
    the stored tensors are ``qweight`` (fp8) and ``weight_scale_inv``.
    """

    def __init__(self, qweight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale_inv.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.block, self.dtype = block, dtype
        self.out_features, self.in_features = qweight.shape

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.qweight, self.weight_scale_inv, self.block, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks {self.block}"
