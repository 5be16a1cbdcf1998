"""Topology: which devices the attention and FFN ranks run on, and which FFN rank owns which expert.

Pure Python (the expert placement and its copy choice: afd/distributed/placement.py). :func:`validate_topology` rejects a bad combination before any
process starts, with a message that says what is wrong and what is allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from afd.distributed.placement import ExpertPlacement, TopologyError

__all__ = ["DeviceSpec", "ExpertPlacement", "Topology", "TopologyError", "parse_device", "parse_devices", "parse_topology_args",
           "validate_topology", "backend_for"]

TRANSPORTS = ("loopback", "shm", "tcp", "torch")
DISPATCH_DTYPES = ("model", "bf16", "fp8", "int8")  # what a dispatch sends of each row: afd/connectors/dispatch_dtype.py
MULTI_HOST_TRANSPORTS = ("tcp", "torch")
GATE_PLACEMENTS = ("attention", "ffn")
SIDES = ("attention", "ffn")


@dataclass(frozen=True)
class DeviceSpec:
    """``cpu``, ``cpu:0``, ``cpu:1-3`` (a core set), ``cuda:1`` or ``npu:0``."""

    kind: str
    index: int | None = None
    cores: frozenset[int] | None = None

    def __str__(self) -> str:
        if self.cores is not None:
            return "cpu:" + ",".join(str(c) for c in sorted(self.cores))
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def is_accelerator(self) -> bool:
        return self.kind in ("cuda", "npu")

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"


_CORES = re.compile(r"^\d+(-\d+)?$")


def parse_device(text: str) -> DeviceSpec:
    t = text.strip().lower()
    kind, _, rest = t.partition(":")
    if kind == "cpu":
        if not rest:
            return DeviceSpec("cpu")
        cores: set[int] = set()
        for part in rest.split("+"):
            if not _CORES.match(part):
                raise TopologyError(f"bad CPU core set {text!r}: use cpu, cpu:N or cpu:A-B (cores joined with '+')")
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi or lo)
            if b < a:
                raise TopologyError(f"bad CPU core range {text!r}: {a} > {b}")
            cores.update(range(a, b + 1))
        return DeviceSpec("cpu", cores=frozenset(cores))
    if kind in ("cuda", "npu"):
        if not rest.isdigit():
            raise TopologyError(f"bad device {text!r}: {kind} needs an index, e.g. {kind}:0")
        return DeviceSpec(kind, index=int(rest))
    raise TopologyError(f"unknown device {text!r}: use cpu[:cores], cuda:N or npu:N")


def parse_devices(text: str) -> tuple[DeviceSpec, ...]:
    items = [s for s in text.split(",") if s.strip()]
    if not items:
        raise TopologyError("an empty device list: give at least one device, e.g. cpu")
    return tuple(parse_device(s) for s in items)


@dataclass(frozen=True)
class Topology:
    attention_devices: tuple[DeviceSpec, ...]
    ffn_devices: tuple[DeviceSpec, ...]
    transport: str = "shm"
    gate: str = "attention"
    dense_on: str = "attention"
    shared_experts_on: str = "attention"
    placement: ExpertPlacement | None = None  # None: contiguous blocks (plus redundant_experts copies)
    redundant_experts: int = 0  # physical expert copies beyond the logical experts (EPLB)
    attention_nodes: tuple[int, ...] = ()  # the node of each attention rank (empty: every rank on node 0)
    ffn_nodes: tuple[int, ...] = ()  # the node of each FFN rank (empty: node 0)
    dispatch_dtype: str = "model"  # what a dispatch sends of each FFN input row (afd/connectors/dispatch_dtype.py)

    def node_of(self, role_name: str, index: int) -> int:
        """``role_name``: "attention" or "ffn"."""
        nodes = self.attention_nodes if role_name == "attention" else self.ffn_nodes
        return nodes[index] if nodes else 0

    @property
    def num_nodes(self) -> int:
        return max((*self.attention_nodes, *self.ffn_nodes, 0)) + 1

    @property
    def num_attention_ranks(self) -> int:
        return len(self.attention_devices)

    @property
    def num_ffn_ranks(self) -> int:
        return len(self.ffn_devices)

    def placement_for(self, num_experts: int) -> ExpertPlacement:
        return self.placement or ExpertPlacement.contiguous(num_experts, self.num_ffn_ranks, self.redundant_experts)


MAX_ATTENTION_RANKS = 64  # the contributor bitmask of a work header (afd/connectors/wire.py)


def validate_topology(topology: Topology, num_experts: int) -> ExpertPlacement:
    """Check everything that can be checked before a process starts; return the expert placement.

    Whether the devices exist is a property of the host that runs them:
    :func:`afd.distributed.devices.check_present`, called by the launcher for its own ranks.
    """
    t = topology
    if not t.attention_devices or not t.ffn_devices:
        raise TopologyError("a disaggregated run needs at least one attention and one FFN device")
    for name, value, allowed in (
        ("transport", t.transport, TRANSPORTS),
        ("gate", t.gate, GATE_PLACEMENTS),
        ("dense-on", t.dense_on, SIDES),
        ("shared-experts-on", t.shared_experts_on, SIDES),
        ("dispatch-dtype", t.dispatch_dtype, DISPATCH_DTYPES),
    ):
        if value not in allowed:
            raise TopologyError(f"--{name} {value!r} is not one of: {', '.join(allowed)}")
    if t.num_attention_ranks > MAX_ATTENTION_RANKS:
        raise TopologyError(f"{t.num_attention_ranks} attention ranks: at most {MAX_ATTENTION_RANKS} (a step's contributors "
                            "travel as a 64-bit mask in every work header)")
    if t.num_ffn_ranks > num_experts:
        raise TopologyError(
            f"{t.num_ffn_ranks} FFN ranks for a model with {num_experts} routed experts: "
            f"use at most {num_experts} FFN ranks"
        )
    if t.redundant_experts < 0:
        raise TopologyError(f"--redundant-experts {t.redundant_experts}: give 0 or more copies")
    if t.redundant_experts and t.num_ffn_ranks == 1:
        raise TopologyError("--redundant-experts needs at least 2 FFN ranks: a copy of an expert on the same rank survives nothing")
    if t.redundant_experts and t.placement is not None:
        raise TopologyError("give --redundant-experts or an explicit --placement (which may list an expert on several ranks), not both")
    if t.redundant_experts > num_experts * (t.num_ffn_ranks - 1):
        raise TopologyError(f"--redundant-experts {t.redundant_experts}: at most {num_experts * (t.num_ffn_ranks - 1)} "
                            f"({num_experts} experts x {t.num_ffn_ranks - 1} other FFN ranks; one copy of an expert per rank)")
    placement = t.placement_for(num_experts)
    if placement.num_experts != num_experts:
        raise TopologyError(f"placement covers {placement.num_experts} experts, the model has {num_experts}")
    idle = [r for r in range(t.num_ffn_ranks) if not placement.experts_of(r)]
    if idle:
        raise TopologyError(f"FFN ranks {idle} own no expert: give every FFN rank at least one expert")
    stray = sorted(r for r in placement.ranks if r >= t.num_ffn_ranks)
    if stray:
        raise TopologyError(f"placement names FFN ranks {stray} but only {t.num_ffn_ranks} exist")
    _check_nodes(t)
    _check_devices(t)
    return placement


def default_nodes(nnodes: int, num_attention: int, num_ffn: int, attention_nodes: str | None = None,
                  ffn_nodes: str | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each rank's node: the flags' lists (``0,0`` / ``1,2,1``), else attention ranks on node 0 (beside the
    front end) and FFN ranks round-robin over nodes 1..N-1 (node 0 with one node)."""
    def parse(text: str, count: int, flag: str) -> tuple[int, ...]:
        try:
            nodes = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise TopologyError(f"{flag} {text!r}: give one node index per rank, e.g. {','.join(['0'] * count)}") from None
        if len(nodes) != count:
            raise TopologyError(f"{flag} {text!r}: {len(nodes)} nodes for {count} ranks (one per rank)")
        bad = [n for n in nodes if not 0 <= n < nnodes]
        if bad:
            raise TopologyError(f"{flag} {text!r}: nodes {bad} are outside 0..{nnodes - 1} (--nnodes {nnodes})")
        return nodes

    if nnodes < 1:
        raise TopologyError(f"--nnodes {nnodes}: give 1 or more")
    if (attention_nodes or ffn_nodes) and nnodes == 1:
        raise TopologyError("--attention-nodes / --ffn-nodes need --nnodes 2 or more")
    attn = parse(attention_nodes, num_attention, "--attention-nodes") if attention_nodes else (0,) * num_attention
    ffn = (parse(ffn_nodes, num_ffn, "--ffn-nodes") if ffn_nodes else
           tuple(0 if nnodes == 1 else 1 + f % (nnodes - 1) for f in range(num_ffn)))
    return (attn, ffn) if nnodes > 1 else ((), ())


def _check_nodes(t: Topology) -> None:
    if not (t.attention_nodes or t.ffn_nodes):
        return
    if len(t.attention_nodes) != t.num_attention_ranks or len(t.ffn_nodes) != t.num_ffn_ranks:
        raise TopologyError(f"node lists for {len(t.attention_nodes)} attention and {len(t.ffn_nodes)} FFN ranks; the run has "
                            f"{t.num_attention_ranks} and {t.num_ffn_ranks}")
    if any(t.attention_nodes):
        raise TopologyError(f"attention ranks on nodes {sorted(set(t.attention_nodes) - {0})}: every attention rank runs on node 0, "
                            "beside the front end, which drives them over local pipes")
    if t.transport not in MULTI_HOST_TRANSPORTS:
        raise TopologyError(f"a multi-node run needs --transport tcp (survives an FFN rank's or node's loss) or torch "
                            f"(NCCL/HCCL payloads); {t.transport} stays on one host")


def backend_for(topology: Topology) -> str:
    """The torch.distributed backend of a ``torch``-transport run: NCCL when every rank is on CUDA, HCCL
    when every rank is on an Ascend NPU (payloads move device to device), else gloo (staged through host
    memory, as on the ``shm`` and ``loopback`` transports)."""
    kinds = {d.kind for d in (*topology.attention_devices, *topology.ffn_devices)}
    return {frozenset({"cuda"}): "nccl", frozenset({"npu"}): "hccl"}.get(frozenset(kinds), "gloo")


def _check_devices(t: Topology) -> None:
    seen: dict[str, str] = {}  # accelerators and core sets are per host
    for side, devices in (("attention", t.attention_devices), ("ffn", t.ffn_devices)):
        for i, d in enumerate(devices):
            if d.is_accelerator:
                node = t.node_of(side, i)
                key = str(d) + (f" on node {node}" if t.num_nodes > 1 else "")
                if key in seen:
                    where = seen[key]
                    raise TopologyError(
                        f"{key} is used twice ({where} and {side} rank {i}): accelerators must be unique"
                        + (" and never on both sides" if not where.startswith(side) else "")
                    )
                seen[key] = f"{side} rank {i}"
    cores: dict[tuple[int, int], str] = {}
    for side, devices in (("attention", t.attention_devices), ("ffn", t.ffn_devices)):
        for i, d in enumerate(devices):
            node = t.node_of(side, i)
            for c in sorted(d.cores or ()):
                if (node, c) in cores:
                    raise TopologyError(f"CPU core {c} is in the core sets of {cores[node, c]} and {side} rank {i}: core sets must not overlap")
                cores[node, c] = f"{side} rank {i}"


def parse_topology_args(
    attention_devices: str | None,
    ffn_devices: str | None,
    attention_ranks: int | None,
    ffn_ranks: int | None,
    **kwargs,
) -> Topology | None:
    """The CLI's topology flags -> a Topology, or None for a monolithic run."""
    if attention_devices and attention_ranks:
        raise TopologyError("give --attention-devices or --attention-ranks, not both")
    if ffn_devices and ffn_ranks:
        raise TopologyError("give --ffn-devices or --ffn-ranks, not both")
    attn = parse_devices(attention_devices) if attention_devices else (DeviceSpec("cpu"),) * attention_ranks if attention_ranks else None
    ffn = parse_devices(ffn_devices) if ffn_devices else (DeviceSpec("cpu"),) * ffn_ranks if ffn_ranks else None
    if attn is None and ffn is None:
        return None
    if attn is None or ffn is None:
        raise TopologyError("a disaggregated run needs both attention and FFN devices (or --attention-ranks / --ffn-ranks)")
    return Topology(attention_devices=attn, ffn_devices=ffn, **kwargs)
