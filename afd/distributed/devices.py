"""Whether this host has the accelerators a topology asks for, checked before any rank starts."""

from __future__ import annotations

import importlib
from typing import Iterable

import torch

from afd.distributed.topology import DeviceSpec, TopologyError


def device_module(kind: str):
    """``torch.cuda`` / ``torch.npu`` (importing ``torch_npu``, which registers the NPU backend)."""
    if kind == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError:
            raise TopologyError("npu devices need torch_npu (the Ascend PyTorch adapter); it is not installed") from None
    return torch.get_device_module(kind)


def check_present(devices: Iterable[DeviceSpec]) -> None:
    """Raise TopologyError naming the first device this host does not have."""
    for d in devices:
        if not d.is_accelerator:
            continue
        module = device_module(d.kind)
        count = module.device_count() if module.is_available() else 0
        if count == 0:
            build = f"; this torch {torch.__version__} is a CPU build" if d.kind == "cuda" and torch.version.cuda is None else ""
            raise TopologyError(f"{d} asked for, but this host has no {d.kind.upper()} device{build}")
        if d.index >= count:
            raise TopologyError(f"{d} asked for, but this host has {count} {d.kind.upper()} device(s): {d.kind}:0..{d.kind}:{count - 1}")
