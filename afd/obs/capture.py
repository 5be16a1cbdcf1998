"""Tensor capture at safe boundaries, keyed by (request, position, layer, boundary), and its diff.

Safe boundaries are the values the model's halves hand each other on the
attention rank -- ``layer_input``, ``attn_output`` (residual after attention),
``ffn_output`` (after the combine) and ``final_hidden`` -- observed after they
are computed, never inside a transfer. The same boundaries exist in every mode
(monolithic, sync, async, any split), so two captures can be compared token by
token whatever the batching was.

File layout (safetensors): ``req{R}.L{layer}.{boundary}`` -> [num_positions, H]
and ``req{R}.positions`` -> [num_positions] int64 (sorted; a recomputed position
keeps its last value).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

BOUNDARIES = ("layer_input", "attn_output", "ffn_output", "final_hidden")


class CaptureStore:
    def __init__(self) -> None:
        self._rows: dict[tuple[int, int, str], dict[int, torch.Tensor]] = {}  # (req, layer, boundary) -> pos -> [H]

    def add(self, request: int, positions: Iterable[int], layer: int, boundary: str, rows: torch.Tensor) -> None:
        slot = self._rows.setdefault((request, layer, boundary), {})
        rows = rows.detach().to("cpu", torch.float32, copy=True)  # off the device at once, one copy
        for pos, row in zip(positions, rows):
            slot[int(pos)] = row

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for (req, layer, boundary), by_pos in sorted(self._rows.items()):
            positions = sorted(by_pos)
            out[f"req{req}.L{layer}.{boundary}"] = torch.stack([by_pos[p] for p in positions])
            out.setdefault(f"req{req}.positions", torch.tensor(positions, dtype=torch.int64))
        return out

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors(), str(path), metadata={"format": "afd-capture-1"})


def load_capture(path: str | Path) -> dict[str, torch.Tensor]:
    """A capture file, or a directory of them (one per attention rank) merged."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no capture files in {path}")
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        merged.update(load_file(str(f)))
    return merged


@dataclass
class Divergence:
    layer: int
    boundary: str
    request: int
    position: int
    max_abs_err: float
    tolerance: float

    def __str__(self) -> str:
        return (f"first divergence: layer {self.layer}, boundary {self.boundary}, request {self.request}, "
                f"position {self.position}: max|err| {self.max_abs_err:.3g} > tol {self.tolerance:.3g}")


def _parse(key: str) -> tuple[int, int, str] | None:
    req, layer, boundary = key.split(".", 2)
    return int(req[3:]), int(layer[1:]), boundary


def diff_captures(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-5) -> tuple[Divergence | None, list[str], int]:
    """Compare two captures row by row (parity rule: |a-b| <= rtol * max(1, |a|_inf) per row).

    Returns (the first divergence in (layer, boundary, request, position) order or None, keys present
    in only one capture, number of rows compared).
    """
    only = sorted(set(a) ^ set(b))
    entries = []
    for key in set(a) & set(b):
        if key.endswith(".positions"):
            continue
        req, layer, boundary = _parse(key)
        entries.append((layer, BOUNDARIES.index(boundary) if boundary in BOUNDARIES else 99, req, key))
    compared = 0
    for layer, _, req, key in sorted(entries):
        pa, pb = a[f"req{req}.positions"].tolist(), b[f"req{req}.positions"].tolist()
        common = sorted(set(pa) & set(pb))
        ia, ib = {p: i for i, p in enumerate(pa)}, {p: i for i, p in enumerate(pb)}
        for pos in common:
            ra, rb = a[key][ia[pos]], b[key][ib[pos]]
            compared += 1
            err = (ra - rb).abs().max().item()
            tol = rtol * max(1.0, ra.abs().max().item())
            if not err <= tol:
                return Divergence(layer, key.split(".", 2)[2], req, pos, err, tol), only, compared
    return None, only, compared
