"""W8A8 int8 checkpoints in compressed-tensors' ``int-quantized`` format, as llm-compressor writes them and vLLM
serves them (issue 29).

A targeted linear weight ``W [out, in]`` is stored as int8 beside ``weight_scale`` ([out, 1], ``strategy:
channel``; or one value, ``strategy: tensor``): the real weight is ``W[o, i] * scale[o]``. Activations are
quantised at run time, per token (``input_activations: {dynamic: true, strategy: token, symmetric: true}``): a row
``x`` becomes ``round(x / s)`` with ``s = max|x| / 127``. A W8A8 linear is then one int8 x int8 -> int32 GEMM with
both scales applied in its epilogue: ``y[t, o] = acc[t, o] * s_x[t] * s_w[o]`` (:func:`int8_linear`;
``torch._int_mm``: oneDNN's int8 GEMM, AVX512-VNNI / AMX where the CPU has them).

Which modules are quantised: those the config's ``targets`` name (a module type, ``Linear``; a name; ``re:`` a
regex) and its ``ignore`` list does not, matched on the checkpoint's module names. What afd reads as it is: int8,
symmetric, channel or tensor weight scales, dynamic per-token activations; everything else (asymmetric, static
activation scales, group scales, 4-bit, fp8 under compressed-tensors) is refused with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from afd.kernels import ops as native_ops

#: the scale suffix of a quantised weight ``X.weight``: ``X.weight_scale``
SCALE_SUFFIX = "_scale"


@dataclass(frozen=True)
class Int8Scheme:
    """A checkpoint's compressed-tensors W8A8 scheme: what is quantised (``targets`` minus ``ignore``)."""

    targets: tuple[str, ...]
    ignore: tuple[str, ...] = ()
    weight_strategy: str = "channel"

    def quantises(self, module: str) -> bool:
        """Whether checkpoint module ``module`` (``model.layers.0.self_attn.q_proj``) is stored int8: it is a linear
        (afd's W8A8 targets are linear weights) that a target names and the ignore list does not."""
        def named(patterns: tuple[str, ...]) -> bool:
            return any(re.fullmatch(p[3:], module) if p.startswith("re:") else p in ("Linear", module) for p in patterns)

        return named(self.targets) and not named(self.ignore)


def int8_scheme(raw_config: dict[str, Any]) -> Int8Scheme | None:
    """The checkpoint's W8A8 scheme (``quant_method: compressed-tensors``), None for another method; refuses, with
    the reason, every compressed-tensors scheme afd does not run."""
    q = raw_config.get("quantization_config") or raw_config.get("compression_config") or {}
    if q.get("quant_method") != "compressed-tensors":
        return None
    fmt = q.get("format")
    if fmt not in ("int-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported: afd reads int-quantized W8A8 (int8 weights, "
                         "dynamic per-token int8 activations)")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups is not supported (one W8A8 group)")
    group = next(iter(groups.values()))
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    why = []
    if (w.get("type"), w.get("num_bits")) != ("int", 8):
        why.append(f"weights {w.get('type')}{w.get('num_bits')} (int8 only)")
    if not w.get("symmetric", True):
        why.append("asymmetric weights (a zero point)")
    if w.get("strategy") not in ("channel", "tensor"):
        why.append(f"weight strategy {w.get('strategy')!r} (channel or tensor; group scales are not read)")
    if (a.get("type"), a.get("num_bits")) != ("int", 8) or not a.get("dynamic") or a.get("strategy") != "token":
        why.append(f"input activations {a or None} (dynamic per-token int8 only: static scales are not read)")
    if a and not a.get("symmetric", True):
        why.append("asymmetric activations")
    if why:
        raise ValueError("compressed-tensors scheme not supported: " + "; ".join(why))
    return Int8Scheme(tuple(group.get("targets") or ()), tuple(q.get("ignore") or ()), w["strategy"])


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (int8 [T, K], fp32 scales [T, 1]), symmetric: x ~ q * s. A zero row gets scale 1 (q = 0), never a
    0/0 NaN; a zero-row batch stays empty."""
    amax = x.abs().amax(dim=-1, keepdim=True).float() if x.shape[0] else x.new_zeros(0, 1, dtype=torch.float32)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8), scale


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                row_bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: x [T, K] (any float dtype) quantised per token, times int8 ``qweight`` [N, K] in int32, both scales
    (``weight_scale`` [N] fp32) applied to the accumulator -> [T, N] in x's dtype. ``row_bias``: :func:`kernel_row_bias`
    of ``qweight``, computed once where the weight is held. On the CPU the three steps run in one native call
    (afd/kernels/csrc/int8_linear.cpp: ``int8_linear``, bit for bit these ops); :func:`int8_linear_reference` is its twin."""
    kernels = native_ops() if x.device.type == "cpu" and x.shape[0] else None
    if kernels is not None:
        return kernels.int8_linear(x, qweight, weight_scale, bias, row_bias)
    return int8_linear_reference(x, qweight, weight_scale, bias, row_bias)


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                          row_bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`int8_linear` in torch ops: quantise, the int32 product, the epilogue."""
    q, s = quantize_per_token(x)
    return int8_matmul(q, s, qweight, weight_scale, x.dtype, bias, row_bias)


def kernel_row_bias(qweight: torch.Tensor) -> torch.Tensor | None:
    """What the native VNNI tiles subtract per output row (128 x the row's sum, int32); None where they do not run."""
    kernels = native_ops() if qweight.device.type == "cpu" else None
    return kernels.int8_row_bias(qweight.reshape(-1, qweight.shape[-1])).reshape(qweight.shape[:-1]) \
        if kernels is not None and kernels.int8_needs_row_bias else None


def int8_matmul(q: torch.Tensor, s: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype,
                bias: torch.Tensor | None = None, row_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Already quantised activations (int8 [T, K], scales [T, 1]) times ``qweight`` [N, K] -> [T, N] in ``dtype``: the
    int32 product from afd's int8 tiles (afd/kernels/csrc: AMX-INT8 at 5-256 rows, amx.cpp; AVX512-VNNI or AVX2 at
    decode sizes, int8_linear.cpp), else oneDNN's (``torch._int_mm``)."""
    if q.shape[0] == 0:
        return torch.zeros(0, qweight.shape[0], dtype=dtype, device=q.device)
    if q.device.type != "cpu":
        acc = q.float() @ qweight.float().t()
    else:
        kernels = native_ops()
        acc = kernels.int8_matmul(q, qweight, row_bias) if kernels is not None else torch._int_mm(q, qweight.t())
    y = acc.float() * s * weight_scale
    return (y if bias is None else y + bias.float()).to(dtype)


def dequantize_int8(qweight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [N, K] with per-row scales [N] (or one) -> the real weight in ``dtype``."""
    return (qweight.float() * weight_scale.float().reshape(-1, 1)).to(dtype)


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A stored ``weight_scale`` ([rows, 1], [rows] or one value) -> [rows] fp32."""
    scale = scale.float().reshape(-1)
    return scale.expand(rows).contiguous() if scale.numel() == 1 else scale


class Int8Linear(nn.Module):
    """A linear layer of a W8A8 checkpoint: int8 ``qweight`` [out, in] and fp32 ``weight_scale`` [out]; activations
    quantised per token on every call. ``weight`` reads as the dequantised weight (for code that needs it whole)."""

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = nn.Parameter(qweight, requires_grad=False)
        self.weight_scale = nn.Parameter(row_scales(weight_scale, qweight.shape[0]), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("row_bias", kernel_row_bias(qweight), persistent=False)
        self.dtype = dtype
        self.out_features, self.in_features = qweight.shape

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.weight_scale, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return int8_linear(x.reshape(-1, shape[-1]), self.qweight, self.weight_scale, self.bias, self.row_bias).reshape(*shape[:-1], -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, W8A8"



def quantize_checkpoint(src, dst, ignore: tuple[str, ...] = ("lm_head", r"re:.*mlp\.gate$"), strategy: str = "channel") -> dict[str, torch.Tensor]:
    """A single-file checkpoint (``src``: ``model.safetensors``, ``config.json``, tokenizer files) rewritten as
    llm-compressor's round-to-nearest W8A8 writes it (compressed-tensors ``int-quantized``): every 2-D weight but the
    embeddings and ``ignore`` as int8 rounded per output row (``strategy: channel``: ``weight_scale`` [out, 1];
    ``tensor``: one scale), activations declared dynamic per token. For tests and benchmarks (no calibration, no
    SmoothQuant). Returns the weights the int8 ones decode to, by name."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    scheme = Int8Scheme(("Linear",), tuple(ignore))
    tensors, decoded = load_file(src / "model.safetensors"), {}
    for name in [n for n, w in tensors.items() if w.dim() == 2 and n.endswith(".weight") and "embed_tokens" not in n]:
        if not scheme.quantises(name.removesuffix(".weight")):
            continue
        w = tensors[name].float()
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1, 1)
        scale = (amax / 127).clamp(min=1e-12)
        tensors[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        tensors[name + SCALE_SUFFIX] = scale if strategy == "channel" else scale.reshape(1)
        decoded[name] = tensors[name].float() * scale
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    for extra in src.iterdir():
        if extra.name not in ("model.safetensors", "config.json") and extra.is_file():
            shutil.copy(extra, dst / extra.name)
    raw = json.loads((src / "config.json").read_text())
    act = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    raw["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed", "ignore": list(ignore),
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": act,
                                      "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy, "dynamic": False}}}}
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return decoded
