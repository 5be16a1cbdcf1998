"""Where a prefill step's time goes, phase by phase, each GEMM phase against its own roofline (``afd bench roofline``).

A step's modules are timed by forward hooks (one step, after the timed ones, so the hooks' microseconds touch no
figure of the step table) and gathered into phases by what they compute:

* **attention projections**: the linear layers inside a layer's attention (q, kv, o; an indexer's);
* **attention core**: the attention module's time less its linear layers' and norms' (scores, softmax, the cache's
  writes);
* **dense MLP**, **shared experts**: their linear layers; **routed experts**: ``GroupedExperts`` (its rows from the
  experts' own counters); **router**; **LM head**; **norms**; **other**: the step less every phase (embedding,
  the engine's own work, sampling).

A GEMM phase's bound is the roofline's: min(GEMM peak, FLOPs / bytes x read bandwidth), its bytes the weights it
read plus its inputs and outputs once (a lower bound of its traffic). The routed experts of a prefill get
M x top-k / E rows each (48 at 512 tokens for 64 experts, top-6): 48 FLOP per weight byte in bf16, so a 25 GB/s
machine caps them at ~1.2 TFLOP/s whatever the peak; the table says so instead of calling it a shortfall.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

GEMM_PHASES = ("attention projections", "dense MLP", "shared experts", "routed experts", "router", "LM head")


@dataclass
class Phase:
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _weight_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


class PhaseTimer:
    """Forward hooks on a model's modules, adding each call's time, FLOPs and bytes to its phase while active."""

    def __init__(self, model: nn.Module) -> None:
        from afd.models.base import Router
        from afd.models.int8 import Int8Linear
        from afd.models.layers import GroupedExperts, RMSNorm

        self.phases: dict[str, Phase] = defaultdict(Phase)
        self._handles, self._starts = [], {}
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, Int8Linear)):
                phase = ("LM head" if name.endswith("lm_head") else "shared experts" if "shared_expert" in name
                         else "dense MLP" if ".mlp." in name else "attention projections")
                self._hook(module, phase, self._linear)
            elif isinstance(module, GroupedExperts):
                self._hook(module, "routed experts", self._experts)
            elif isinstance(module, Router):
                self._hook(module, "router", self._router)
            elif isinstance(module, RMSNorm):  # one inside attention (MLA's latent norms, q/k norms) is attention's too
                self._hook(module, "attention norms" if ".self_attn." in name else "norms", None)
            elif name.endswith(".self_attn"):
                self._hook(module, "attention", None)

    def _hook(self, module: nn.Module, phase: str, count) -> None:
        def pre(m, args):
            self._starts[id(m)] = (time.perf_counter(), list(getattr(m, "tokens_routed", ())))

        def post(m, args, out):
            start, routed = self._starts.pop(id(m))
            p = self.phases[phase]
            p.seconds += time.perf_counter() - start
            if count is not None:
                flops, moved = count(m, args[0], out, routed)
                p.flops += flops
                p.bytes += moved

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    @staticmethod
    def _linear(m, x, out, _):
        rows = x.numel() // x.shape[-1]
        return 2.0 * rows * m.in_features * m.out_features, _weight_bytes(m) + _bytes(x, out)

    @staticmethod
    def _experts(m, x, out, before):
        rows = [a - b for a, b in zip(m.tokens_routed, before)]
        per_expert = _weight_bytes(m) / max(1, len(rows))
        return 2.0 * sum(rows) * 3 * m.down_proj.shape[1] * m.intermediate_size, per_expert * sum(r > 0 for r in rows) + _bytes(x, out)

    @staticmethod
    def _router(m, x, out, _):
        weight = m.weight
        return 2.0 * (x.numel() // x.shape[-1]) * weight.numel(), _bytes(weight, x)

    def close(self, step_s: float) -> dict[str, Phase]:
        """The phases of the step that took ``step_s`` (the attention core split off, the rest as "other")."""
        for h in self._handles:
            h.remove()
        phases = dict(self.phases)
        attention, inner_norms = phases.pop("attention", Phase()), phases.pop("attention norms", Phase())
        projections = phases.get("attention projections", Phase())
        phases["attention core"] = Phase(max(0.0, attention.seconds - projections.seconds - inner_norms.seconds))
        if inner_norms.seconds:
            phases["norms"] = Phase(phases.get("norms", Phase()).seconds + inner_norms.seconds)
        phases["other"] = Phase(max(0.0, step_s - sum(p.seconds for p in phases.values())))
        return phases


def phase_rows(phases: dict[str, Phase], step_s: float, peak: float, bandwidth: float) -> list[dict]:
    """One row per phase, slowest first: its time, share, FLOPs and (for a GEMM phase) its rate against the peak
    and against its own roofline bound."""
    rows = []
    for name, p in sorted(phases.items(), key=lambda kv: -kv[1].seconds):
        row = {"phase": name, "ms": 1e3 * p.seconds, "share": p.seconds / step_s if step_s else 0.0}
        if name in GEMM_PHASES and p.flops and p.seconds:
            rate = p.flops / p.seconds
            bound = min(peak, p.flops / p.bytes * bandwidth)
            row.update(gflop=p.flops / 1e9, gflop_s=rate / 1e9, flop_per_byte=p.flops / p.bytes, bound_gflop_s=bound / 1e9,
                       of_peak=rate / peak, of_bound=rate / bound)
        rows.append(row)
    return rows


def gemm_totals(phases: dict[str, Phase], peak: float, bandwidth: float) -> dict:
    """The step's GEMM phases together: their rate against the peak and against the time each phase's bound allows."""
    gemms = [phases[n] for n in GEMM_PHASES if n in phases and phases[n].flops]
    flops, seconds = sum(p.flops for p in gemms), sum(p.seconds for p in gemms)
    floor = sum(p.flops / min(peak, p.flops / p.bytes * bandwidth) for p in gemms)  # the seconds the bounds allow
    return {"gflop": flops / 1e9, "ms": 1e3 * seconds, "gflop_s": flops / seconds / 1e9 if seconds else 0.0,
            "of_peak": flops / seconds / peak if seconds else 0.0, "of_bound": floor / seconds if seconds else 0.0}
