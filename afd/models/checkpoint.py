"""Reading tensors from a Hugging Face safetensors checkpoint, one tensor at a time, counting bytes.

Single ``model.safetensors`` or sharded with ``model.safetensors.index.json``.
Files are memory-mapped by safetensors; a shard is opened only when one of its
tensors is asked for, and a tensor's bytes are read only by :meth:`read`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """The checkpoint on disk does not match what the model needs."""


@dataclass
class ReadStats:
    bytes_read: int = 0
    tensors_read: int = 0
    shards_opened: set[str] = field(default_factory=set)


class CheckpointReader:
    """Name -> tensor access over the safetensors files of one model directory."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.stats = ReadStats()
        self._handles: dict[str, object] = {}
        self._where = self._index()

    def _index(self) -> dict[str, str]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map")
            missing = sorted({f for f in weight_map.values() if not (self.model_dir / f).is_file()})
            if missing:
                raise CheckpointError(f"{index} names shard files that do not exist: {', '.join(missing)}")
            return dict(weight_map)
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"no *.safetensors files in {self.model_dir} (only safetensors checkpoints are supported)"
            )
        where: dict[str, str] = {}
        for f in files:
            with safe_open(f, framework="pt") as handle:
                for name in handle.keys():
                    where[name] = f.name
        return where

    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _handle(self, name: str):
        file = self._where[name]
        if file not in self._handles:
            self._handles[file] = safe_open(self.model_dir / file, framework="pt")
            self.stats.shards_opened.add(file)
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape, read from the file header (no tensor bytes)."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor, or only its row ``index`` along dim 0 (the one expert of a stacked tensor: the other
        experts' bytes are not read)."""
        if index is None:
            tensor = self._handle(name).get_tensor(name)
        else:
            tensor = self._handle(name).get_slice(name)[index : index + 1][0]
        self.stats.bytes_read += tensor.numel() * tensor.element_size()
        self.stats.tensors_read += 1
        return tensor

    def close(self) -> None:
        self._handles.clear()
