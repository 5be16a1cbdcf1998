"""What a rank of a disaggregated run is told by its launcher (:class:`RankSpec`), and what it loads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from afd.config import EngineArgs, FaultPlan, PipelineConfig
from afd.connectors.factory import REOPENABLE, LinkSpec
from afd.connectors.wire import Role, rank_name
from afd.distributed.topology import DeviceSpec, ExpertPlacement, Topology
from afd.models import WeightSelection, load_model
from afd.models.layers import warm_up_linears
from afd.runtime.messages import ReadyReport


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs, decided by its launcher before it starts (a rank reads no environment)."""

    role: Role
    index: int
    model_dir: Path
    topology: Topology
    placement: ExpertPlacement
    link: LinkSpec  # the transport and every timeout (link.timeouts)
    engine: EngineArgs = field(default_factory=EngineArgs)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    steps: tuple[str, int] | None = None  # (host, port) of the step agreement's store; None: one attention rank
    generation: int = 0  # > 0: the generation-th replacement of a lost FFN rank (links of its own)
    placement_version: int = 0  # of ``placement`` (a replacement started after a rebalance holds a later one)
    incarnation: int = 0  # > 0: the incarnation-th restart of a lost attention rank (links of its own)
    ffn_generations: tuple[int, ...] = ()  # a restarted attention rank: each FFN rank's generation now
    attention_restart: bool = False  # an FFN rank: a lost attention rank is restarted (wait for it, take it back)
    faults: FaultPlan | None = None  # tests and benchmarks (afd/runtime/faults.py)
    threads: int | None = None  # torch threads (None: one per core of the rank's core set, else one)

    @property
    def name(self) -> str:
        return rank_name(self.role, self.index)

    @property
    def device(self) -> DeviceSpec:
        devices = self.topology.attention_devices if self.role == Role.ATTENTION else self.topology.ffn_devices
        return devices[self.index]

    @property
    def title(self) -> str:
        """What ``ps`` and ``/proc/<pid>/comm`` show: ``afd attn 0``, ``afd ffn 1 g2`` (a replacement),
        ``afd attn 0 r1`` (a restart)."""
        role = "attn" if self.role == Role.ATTENTION else "ffn"
        return (f"afd {role} {self.index}" + (f" g{self.generation}" if self.generation else "")
                + (f" r{self.incarnation}" if self.incarnation else ""))


def selection_for(spec: RankSpec) -> WeightSelection:
    """The weights a rank holds: attention side, or its FFN rank's experts (and what else is placed there)."""
    t = spec.topology
    if spec.role == Role.ATTENTION:
        return WeightSelection.attention_only(
            shared_experts=t.shared_experts_on == "attention",
            routers=t.gate == "attention",
            dense_mlp=t.dense_on == "attention",
        )
    return WeightSelection.experts_only(  # shared experts and dense layers on the FFN side: replicated on every FFN rank
        spec.placement.experts_of(spec.index),
        shared_experts=t.shared_experts_on == "ffn",
        routers=t.gate == "ffn",
        dense_mlp=t.dense_on == "ffn",
    )


def failover_enabled(topology: Topology, placement: ExpertPlacement) -> bool:
    """Whether attention ranks survive an FFN rank's loss: redundant copies, on a transport whose links can
    be lost and reopened, shm or tcp (a torch.distributed group cannot lose or gain a member; loopback ranks
    are threads)."""
    return placement.redundant > 0 and topology.transport in REOPENABLE


def load(spec: RankSpec):
    """The rank's model (only its own weights) and its READY report."""
    model, report = load_model(spec.model_dir, dtype=spec.engine.dtype, device=spec.device.torch_device, fp8=spec.engine.fp8_weights, mxfp4=spec.engine.mxfp4_weights,
                               selection=selection_for(spec))
    e = spec.engine  # the rows of a step: an FFN rank's union holds every attention rank's
    rows = max(e.max_num_seqs, e.max_num_batched_tokens or 0) * (spec.topology.num_attention_ranks if spec.role == Role.FFN else 1)
    warm_up_linears(model, rows)
    return model, ReadyReport(spec.name, os.getpid(), report.tensors, report.bytes_read)
