from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from afd.distributed.devices import check_present
from afd.distributed.topology import (
    DeviceSpec,
    ExpertPlacement,
    Topology,
    TopologyError,
    backend_for,
    parse_devices,
    parse_topology_args,
    validate_topology,
)


def topo(attn="cpu", ffn="cpu", **kw):
    return Topology(parse_devices(attn), parse_devices(ffn), **kw)


@given(st.integers(1, 64), st.integers(1, 64))
def test_contiguous_placement_covers_every_expert_once(num_experts, num_ranks):
    if num_ranks > num_experts:
        with pytest.raises(TopologyError, match="at most"):
            ExpertPlacement.contiguous(num_experts, num_ranks)
        return
    p = ExpertPlacement.contiguous(num_experts, num_ranks)
    sizes = [len(p.experts_of(r)) for r in range(num_ranks)]
    assert sum(sizes) == num_experts and max(sizes) - min(sizes) <= 1
    assert list(p.expert_to_rank) == sorted(p.expert_to_rank)  # contiguous blocks


@pytest.mark.parametrize("attn, ffn", [("cpu", "cpu"), ("cpu,cpu", "cpu"), ("cpu", "cpu,cpu"), ("cpu,cpu,cpu", "cpu,cpu"), ("cpu,cpu", "cpu,cpu,cpu")])
def test_any_ratio_is_valid(attn, ffn):
    p = validate_topology(topo(attn, ffn), num_experts=8)
    assert sorted(e for r in range(len(ffn.split(","))) for e in p.experts_of(r)) == list(range(8))


def test_explicit_placement():
    p = ExpertPlacement.parse("0-2:1,3+7:0,4-6:1", 8)
    assert p.experts_of(0) == (3, 7) and p.experts_of(1) == (0, 1, 2, 4, 5, 6)
    with pytest.raises(TopologyError, match=r"misses experts \[7\]"):
        ExpertPlacement.parse("0-6:0", 8)
    with pytest.raises(TopologyError, match="expert 3 placed twice on FFN rank 0"):
        ExpertPlacement.parse("0-3:0,3-7:0", 8)
    with pytest.raises(TopologyError, match=r"names experts \[8\]"):
        ExpertPlacement.parse("0-8:0", 8)


@pytest.mark.parametrize(
    "topology, message",
    [
        (topo("cpu", ",".join(["cpu"] * 9)), "9 FFN ranks for a model with 8 routed experts"),
        (topo("cuda:0", "cuda:0", transport="torch"), "cuda:0 is used twice .* never on both sides"),
        (topo("cuda:0,cuda:0", "cuda:1", transport="torch"), "cuda:0 is used twice"),
        (topo("cpu:0-1", "cpu:1", transport="shm"), "CPU core 1 .* must not overlap"),
        (topo("cpu", "cpu", transport="carrier-pigeon"), "--transport 'carrier-pigeon' is not one of"),
        (topo("cpu", "cpu", gate="router"), "--gate 'router' is not one of"),
        (topo("cpu", "cpu,cpu", placement=ExpertPlacement(((0,),) * 8)), r"FFN ranks \[1\] own no expert"),
    ],
)
def test_bad_topologies_are_rejected_with_actionable_messages(topology, message):
    with pytest.raises(TopologyError, match=message):
        validate_topology(topology, num_experts=8)


@pytest.mark.parametrize(
    "attention, ffn, backend",
    [("cuda:0", "cuda:1,cuda:2", "nccl"), ("npu:0", "npu:1", "hccl"), ("cuda:0", "cpu", "gloo"), ("cpu", "cpu", "gloo")],
)
def test_backend_follows_the_devices(attention, ffn, backend):
    """NCCL/HCCL only when every rank is on that accelerator; any mix is staged through host memory over gloo."""
    t = topo(attention, ffn, transport="torch")
    validate_topology(t, num_experts=8)  # accelerators are accepted on every transport
    assert backend_for(t) == backend


def test_absent_accelerators_are_named_before_any_rank_starts(monkeypatch):
    """A device this host lacks is named when the launcher is built: nothing is spawned."""
    from afd.cli.common import BUILTIN_MODEL
    from afd.runtime.cluster import Cluster

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TopologyError, match=r"cuda:1 asked for, but this host has no CUDA device"):
        check_present(parse_devices("cpu,cuda:1"))
    with pytest.raises(TopologyError, match="cuda:0 asked for"):
        Cluster(BUILTIN_MODEL, topo("cuda:0", "cpu", transport="shm"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_present(parse_devices("cuda:0"))
    with pytest.raises(TopologyError, match=r"cuda:1 asked for, but this host has 1 CUDA device\(s\): cuda:0..cuda:0"):
        check_present(parse_devices("cuda:1"))


def test_device_parsing():
    assert parse_devices("cpu,cpu:0,cpu:2-3,cuda:1") == (
        DeviceSpec("cpu"),
        DeviceSpec("cpu", cores=frozenset({0})),
        DeviceSpec("cpu", cores=frozenset({2, 3})),
        DeviceSpec("cuda", index=1),
    )
    for bad in ("gpu:0", "cuda", "cpu:x", "cpu:3-1", ""):
        with pytest.raises(TopologyError):
            parse_devices(bad)


def test_cli_shorthand_and_monolithic_default():
    assert parse_topology_args(None, None, None, None) is None
    t = parse_topology_args(None, None, 2, 3, transport="loopback")
    assert t.num_attention_ranks == 2 and t.num_ffn_ranks == 3
    with pytest.raises(TopologyError, match="both attention and FFN"):
        parse_topology_args(None, None, 2, None)
    with pytest.raises(TopologyError, match="not both"):
        parse_topology_args("cpu", None, 2, 1)


def test_nodes_default_to_attention_on_node_0_and_ffn_round_robin_over_the_others():
    from afd.distributed.topology import default_nodes

    assert default_nodes(1, 2, 3) == ((), ())  # one host: no node lists
    assert default_nodes(3, 2, 3) == ((0, 0), (1, 2, 1))
    assert default_nodes(2, 1, 2) == ((0,), (1, 1))
    assert default_nodes(3, 1, 2, ffn_nodes="2,0") == ((0,), (2, 0))
    for args, message in [((3, 1, 2, None, "1"), "1 nodes for 2 ranks"), ((3, 1, 2, None, "1,3"), r"nodes \[3\] are outside 0..2"),
                          ((1, 1, 2, None, "0,0"), "need --nnodes 2"), ((3, 1, 2, None, "a,b"), "one node index per rank"),
                          ((0, 1, 1), "--nnodes 0")]:
        with pytest.raises(TopologyError, match=message):
            default_nodes(*args)


def test_multi_node_topologies_are_checked_per_host():
    cuda = parse_devices("cuda:0,cuda:0")
    t = Topology(parse_devices("cpu"), cuda, transport="tcp", attention_nodes=(0,), ffn_nodes=(1, 2))
    validate_topology(t, 8)  # cuda:0 on two hosts: two devices
    with pytest.raises(TopologyError, match="cuda:0 on node 1 is used twice"):
        validate_topology(Topology(parse_devices("cpu"), cuda, transport="tcp", attention_nodes=(0,), ffn_nodes=(1, 1)), 8)
    with pytest.raises(TopologyError, match="every attention rank runs on node 0"):
        validate_topology(Topology(parse_devices("cpu"), parse_devices("cpu"), transport="tcp", attention_nodes=(1,), ffn_nodes=(0,)), 8)
    with pytest.raises(TopologyError, match="needs --transport tcp"):
        validate_topology(Topology(parse_devices("cpu"), parse_devices("cpu"), transport="shm", attention_nodes=(0,), ffn_nodes=(1,)), 8)
    assert t.node_of("ffn", 1) == 2 and t.node_of("attention", 0) == 0 and t.num_nodes == 3
