"""What a dispatch sends for each token's FFN input (``--dispatch-dtype``, issue 29).

``model`` (the default): the rows in the compute dtype (4 H bytes a token in fp32, 2 H in bf16). ``bf16``: cast
(2 H). ``int8``: each row rounded to int8 with its own fp32 scale ``max|x| / 127``, symmetric, per token -- the
activation scheme of a W8A8 checkpoint, so an FFN rank whose experts are int8 feeds the values straight to its
int8 GEMMs (H + 4 bytes). ``fp8``: each row scaled to e4m3fn's range by its own fp32 scale ``max|x| / 448``
(H + 4 bytes), as DeepEP's low-latency dispatch does. The scales travel as ``TensorName.HIDDEN_SCALES`` [n, 1]
beside ``HIDDEN``; the combine stays in the compute dtype. Quantising is a pure function of the rows, so a retry
after an FFN rank's loss sends the same bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from afd.distributed.topology import DISPATCH_DTYPES
from afd.models.int8 import quantize_per_token

__all__ = ["DISPATCH_DTYPES", "QuantizedRows", "bytes_per_token", "encode"]
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


class QuantizedRows(NamedTuple):
    """Rows as sent: ``values`` [n, H] (int8 or float8_e4m3fn) and their fp32 ``scales`` [n, 1]."""

    values: torch.Tensor
    scales: torch.Tensor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.values.float() * self.scales).to(dtype)


def encode(x: torch.Tensor, kind: str) -> torch.Tensor | QuantizedRows:
    """The FFN input rows [T, H] as ``kind`` sends them."""
    if kind == "model":
        return x
    if kind == "bf16":
        return x.to(torch.bfloat16)
    if kind == "int8":
        return QuantizedRows(*quantize_per_token(x))
    if kind == "fp8":
        amax = x.abs().amax(dim=-1, keepdim=True).float() if x.shape[0] else x.new_zeros(0, 1, dtype=torch.float32)
        scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return QuantizedRows((x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales)
    raise ValueError(f"--dispatch-dtype {kind!r} is not one of: {', '.join(DISPATCH_DTYPES)}")


def bytes_per_token(hidden_size: int, kind: str, model_itemsize: int) -> int:
    """Bytes one token's FFN input takes on the wire."""
    return {"model": model_itemsize * hidden_size, "bf16": 2 * hidden_size}.get(kind, hidden_size + 4)
