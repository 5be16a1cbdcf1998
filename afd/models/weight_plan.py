"""Which checkpoint tensor fills which parameter: the copy plan of a role-aware load (afd/models/loader.py).

A family names its checkpoint tensors through :meth:`MoEModel.checkpoint_name`, its experts' tensors through
:attr:`MoEModel.expert_tensors` / :attr:`MoEModel.stacked_experts`, and a stored tensor's conversion to afd's
layout through :meth:`MoEModel.load_convert` (a key of :data:`CONVERTS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from afd.config import ModelConfig
from afd.models.base import MoEModel


@dataclass(frozen=True, slots=True)
class _Copy:
    """Copy checkpoint tensor ``source`` (``source[expert]`` when the checkpoint stacks every expert in one
    tensor), after ``convert`` (a name in :data:`CONVERTS`), into ``param[index][rows]``."""

    source: str
    param: str
    index: int | None = None
    rows: slice | None = None
    expert: int | None = None
    convert: str | None = None
    scales: str | None = None  # MXFP4: ``source`` holds the blocks, this tensor their scales (afd/models/mxfp4.py)


def _deinterleave(w: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate and up interleaved (even columns gate, odd up) -> [..., 2I] gate first."""
    return torch.cat((w[..., 0::2], w[..., 1::2]), dim=-1)


#: how a stored tensor becomes afd's layout, and the stored shape of afd's shape ``want``
CONVERTS = {
    # gpt-oss: gate_up_proj [H, 2I] interleaved -> [2I, H] gate rows first; its bias [2I] likewise
    "interleaved_t": (lambda w: _deinterleave(w).t(), lambda want: (want[1], want[0])),
    "interleaved": (_deinterleave, lambda want: want),
    # gpt-oss: down_proj [I, H] -> [H, I]
    "t": (lambda w: w.t(), lambda want: (want[1], want[0])),
    # gpt-oss's MXFP4 gate_up, decoded: [2I, H] with gate and up rows interleaved -> gate rows first
    "rows_interleaved": (lambda w: torch.cat((w[0::2], w[1::2])), lambda want: want),
    # a zero-centred RMSNorm's w -> the 1 + w it scales by (Qwen3-Next), added in fp32
    "plus_one": (lambda w: w.float() + 1, lambda want: want),
}


def category(param: str) -> str:
    if ".mlp.experts." in param:
        return "experts"
    if ".mlp.shared_expert" in param:  # the shared experts, and Qwen3-Next's gate of its shared expert
        return "shared_experts"
    if param.endswith((".mlp.gate.weight", ".mlp.gate.bias", ".mlp.gate.e_score_correction_bias", ".mlp.gate.tid2eid")):
        return "routers"
    if ".mlp." in param:
        return "dense_mlp"
    return "attention"


def plan_copies(model: MoEModel, expert_ids: Iterable[int], mxfp4: bool = False) -> list[_Copy]:
    """Every copy needed to fill ``model``'s parameters, routed experts expanded to ``expert_ids``, named as
    the family's checkpoints name them (:meth:`MoEModel.checkpoint_name`, :attr:`MoEModel.expert_tensors`);
    ``mxfp4``: the stacked experts' weights are MXFP4 blocks and scales."""
    inter = model.config.moe.intermediate_size
    ids = list(expert_ids)
    gate_name, up_name, down_name = model.expert_tensors
    plan: list[_Copy] = []
    for name, _ in model.named_parameters():
        source = model.checkpoint_name(name)
        if model.stacked_experts and ".mlp.experts." in name:  # one tensor holds every expert: read each held one's row
            attr = name.rpartition(".")[2]
            if mxfp4 and attr in ("gate_up_proj", "down_proj"):
                convert = "rows_interleaved" if attr == "gate_up_proj" else None
                plan.extend(_Copy(f"{source}_blocks", name, local, expert=e, convert=convert, scales=f"{source}_scales")
                            for local, e in enumerate(ids))
                continue
            convert = {"gate_up_proj": "interleaved_t", "gate_up_proj_bias": "interleaved", "down_proj": "t"}.get(attr)
            plan.extend(_Copy(source, name, local, expert=e, convert=convert) for local, e in enumerate(ids))
        elif name.endswith("mlp.experts.gate_up_proj"):  # one tensor per expert (MXFP4: each with its .scale, DeepSeek-V4)
            prefix = source.removesuffix("gate_up_proj")
            for local, e in enumerate(ids):
                for part, rows in ((gate_name, slice(0, inter)), (up_name, slice(inter, 2 * inter))):
                    plan.append(_Copy(f"{prefix}{e}.{part}.weight", name, local, rows, scales=f"{prefix}{e}.{part}.scale" if mxfp4 else None))
        elif name.endswith("mlp.experts.down_proj"):
            prefix = source.removesuffix("down_proj")
            plan.extend(_Copy(f"{prefix}{e}.{down_name}.weight", name, local, scales=f"{prefix}{e}.{down_name}.scale" if mxfp4 else None)
                        for local, e in enumerate(ids))
        else:
            plan.append(_Copy(source, name, convert=model.load_convert(name)))
    return plan


def skipped_tensors(names: Iterable[str], config: ModelConfig) -> dict[str, set[str]]:
    """Checkpoint tensors a text engine leaves unread, by what they are: the multi-token-prediction layers
    (DeepSeek's ``model.layers.{num_layers + i}.*``, Qwen's ``mtp.*``) and a multimodal release's vision tower."""
    names = list(names)
    mtp_layers = tuple(f"model.layers.{config.num_layers + i}." for i in range(config.num_mtp_layers))
    skipped = {"multi-token-prediction": {n for n in names if n.startswith("mtp.") or (mtp_layers and n.startswith(mtp_layers))}}
    if config.checkpoint_prefix != "model.":
        skipped["vision tower"] = {n for n in names if n.startswith(("model.visual.", "visual."))}
    return {what: found for what, found in skipped.items() if found}
