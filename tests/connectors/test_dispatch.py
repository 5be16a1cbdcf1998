"""dispatch/combine against a pure-torch reference of the routing, byte counters against the formula."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from afd.connectors.dispatch import AttentionEndpoint
from afd.connectors.transport import LoopbackHub, LoopbackMailbox
from afd.connectors.wire import Role, TensorName
from afd.connectors.work import parse_work, result_message
from afd.distributed.topology import Topology, parse_devices, validate_topology
from afd.ffn.worker import FFNWorker
from afd.models import load_model
from afd.testing.parity import compare_values

F = 3


CASE = "ds-qlora-grouped-yarn"


@pytest.fixture(scope="module")
def model(checkpoints):
    return load_model(checkpoints[CASE][0], dtype="float32")[0]


@pytest.fixture(scope="module")
def ffn_models(checkpoints):
    """What each FFN rank loads: its experts, the routers (for gate on FFN), the shared experts."""
    from afd.distributed.topology import ExpertPlacement
    from afd.models import WeightSelection

    placement = ExpertPlacement.contiguous(8, F)
    return [
        load_model(checkpoints[CASE][0], dtype="float32", selection=WeightSelection.experts_only(placement.experts_of(r), shared_experts=True, routers=True))[0]
        for r in range(F)
    ]


def harness(model, placement=None, **topo):
    topology = Topology(parse_devices("cpu"), parse_devices(",".join(["cpu"] * F)), transport="loopback", placement=placement, **topo)
    placement = validate_topology(topology, model.config.moe.num_experts)
    hub = LoopbackHub()
    attn_box = LoopbackMailbox(hub, Role.ATTENTION, 0, F)
    ffn_boxes = [LoopbackMailbox(hub, Role.FFN, r, 1) for r in range(F)]
    return AttentionEndpoint(attn_box, topology, placement, timeout=5), ffn_boxes, placement


def serve_once(model, box):
    """One FFN rank's turn: compute the work item it received with its own weights."""
    msg = box.recv(1)
    if msg is None:
        return None
    item = parse_work(msg, box.name)
    if msg.header.num_tokens:  # an empty part gets no result
        out = FFNWorker(model, box, 1).compute(msg.header.layer, msg.header.ops, item.hidden, item.routing, item.shared_rows)
        box.send(0, result_message(msg.header, box.index, out))
    return msg


def test_each_ffn_rank_gets_exactly_its_rows_ids_and_weights(model):
    endpoint, boxes, placement = harness(model)
    layer = model.config.moe.layers[0]
    torch.manual_seed(0)
    x = torch.randn(23, model.config.hidden_size)
    routing = model.router(layer, x)
    endpoint.dispatch(layer, 1, x, routing, is_moe=True)
    owner = torch.tensor(placement.expert_to_rank)
    for r, box in enumerate(boxes):
        # pure-torch reference of M2N routing
        ref_rows = [t for t in range(23) if any(owner[e] == r for e in routing.topk_ids[t].tolist())]
        msg = box.recv(1)  # every FFN rank gets a part of the union, empty where no row chose its experts
        assert msg.header.members == 1 and msg.header.epoch == 0
        if not ref_rows:
            assert msg.header.num_tokens == 0 and msg.tensors[TensorName.HIDDEN].shape[0] == 0
            continue
        ids = msg.tensors[TensorName.EXPERT_IDS].long()
        assert msg.header.num_tokens == len(ref_rows)
        assert torch.equal(msg.tensors[TensorName.HIDDEN], x[ref_rows])
        ref_ids = routing.topk_ids[ref_rows].masked_fill(owner[routing.topk_ids[ref_rows]] != r, -1)
        assert torch.equal(ids, ref_ids)
        assert torch.equal(msg.tensors[TensorName.WEIGHTS], routing.topk_weights[ref_rows])
        assert set(ids[ids >= 0].tolist()) <= set(placement.experts_of(r))


@pytest.mark.parametrize("gate, shared_on", [("attention", "attention"), ("attention", "ffn"), ("ffn", "attention"), ("ffn", "ffn")])
def test_combine_equals_the_monolithic_ffn_and_bytes_match_the_formula(model, ffn_models, gate, shared_on):
    endpoint, boxes, placement = harness(model, gate=gate, shared_experts_on=shared_on)
    layer = model.config.moe.layers[-1]
    torch.manual_seed(1)
    x = torch.randn(17, model.config.hidden_size)
    routing = model.router(layer, x)
    handle = endpoint.dispatch(layer, 1, x, routing if gate == "attention" else None, is_moe=True)
    for box in boxes:
        serve_once(ffn_models[box.index], box)
    y = endpoint.combine(handle, model.config.hidden_size, x.dtype)
    if shared_on == "attention":
        y = y + model.shared_experts(layer, x)
    report = compare_values("combine", model.ffn(layer, x), y)
    assert report.ok, str(report)
    # bytes on the wire equal the documented formula
    h, k, b = model.config.hidden_size, model.config.moe.top_k, 4
    owner = torch.tensor(placement.expert_to_rank)
    for r, box in enumerate(boxes):
        in_slice = torch.zeros(17, dtype=torch.bool)
        if shared_on == "ffn":  # shared experts replicated, split by rows: rank r takes the r-th slice
            in_slice[17 * r // F : 17 * (r + 1) // F] = True
        shared_byte = 1 if shared_on == "ffn" else 0
        if gate == "ffn":
            n, per_row = 17, h * b + shared_byte
        else:
            n = int(((owner[routing.topk_ids] == r).any(1) | in_slice).sum())
            per_row = h * b + 8 * k + shared_byte
        assert endpoint.mailbox.stats.payload_bytes_sent.get(r, 0) == n * per_row
        assert box.stats.payload_bytes_sent.get(0, 0) == n * h * b


def test_canary_misrouted_tokens_fail_parity(model, ffn_models):
    """An attention side whose expert->rank map disagrees with what the FFN ranks hold must be caught."""
    endpoint, boxes, placement = harness(model)
    table = endpoint.members.table
    wrong = table.ranks.clone()
    wrong[[0, -1]] = wrong[[-1, 0]]  # expert 0 and the last expert sent to each other's rank
    endpoint.members.table = dataclasses.replace(table, ranks=wrong)
    layer = model.config.moe.layers[0]
    torch.manual_seed(2)
    x = torch.randn(31, model.config.hidden_size)
    routing = model.router(layer, x)
    handle = endpoint.dispatch(layer, 1, x, routing, is_moe=True)
    for box in boxes:
        serve_once(ffn_models[box.index], box)
    y = endpoint.combine(handle, model.config.hidden_size, x.dtype) + model.shared_experts(layer, x)
    assert not compare_values("combine", model.ffn(layer, x), y).ok
