"""DeepSeek-V4 split (issue 28): with the gate on the FFN side a hash-routed layer's router reads the rows' token ids,
which cross the wire in the work header's table (``TensorName.TOKEN_IDS``), only for the hash-routed layers. The
split's parity for every topology runs in tests/runtime/test_split_parity.py (``V4``); here: what the wire carries,
that losing it fails loudly, and an FFN rank killed mid-batch under redundant experts (the retry carries the ids)."""

from __future__ import annotations

import pytest
import torch

from afd.config import EngineArgs, FaultPlan, PipelineConfig, SamplingParams, Timeouts
from afd.connectors import membership
from afd.connectors.wire import TensorName
from afd.distributed.topology import Topology, parse_devices
from afd.models import load_model
from afd.runtime.cluster import Cluster
from afd.runtime.messages import Capture
from afd.serving.offline import generate
from afd.testing.parity import compare_greedy
from tests import support

CASE = "v4-hca-first"  # two hash-routed layers
PROMPTS = [[0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99], [0, 200, 13, 7, 2], [0, 5, 6, 7, 8, 9, 10, 11, 12]]
ENGINE = EngineArgs(dtype="float32", kv_cache_memory=16 << 20, block_size=4)


def topology(a, f, **kw):
    return Topology(parse_devices(",".join(["cpu"] * a)), parse_devices(",".join(["cpu"] * f)), **kw)


def test_token_ids_go_with_every_row_only_for_hash_layers_with_the_gate_on_ffn(checkpoints, monkeypatch):
    """Counted from the work messages as the attention rank builds them: per layer, whether a part carried
    TOKEN_IDS, and that they are the rows' own tokens, as int32."""
    from afd.connectors import dispatch
    from afd.connectors.wire import Kind

    path, _ = checkpoints[CASE]
    model = load_model(path, dtype="float32")[0]
    sent: dict[int, list] = {}
    plain = dispatch.make_message

    def spy(header, tensors):
        if header.kind == Kind.WORK:
            sent.setdefault(header.layer, []).append(tensors.get(TensorName.TOKEN_IDS))
        return plain(header, tensors)

    monkeypatch.setattr(dispatch, "make_message", spy)
    for gate in ("ffn", "attention"):
        sent.clear()
        with support.cluster(path, topology(1, 2, transport="loopback", gate=gate), ENGINE, pipeline=PipelineConfig("sync")) as cluster:
            cluster.request(0, Capture(PROMPTS[:1]))
        assert sorted(sent) == list(range(model.config.num_layers)), "every layer dispatched"
        for layer, parts in sent.items():
            carried = [p for p in parts if p is not None]
            if gate == "ffn" and layer in model.config.moe.hash_layers:
                assert len(carried) == len(parts) == 2 and all(p.dtype == torch.int32 for p in carried)
                assert carried[0].tolist() == PROMPTS[0]
            else:
                assert not carried, f"layer {layer} (gate on {gate}) sent token ids"


# the rank threads end on the error they raise (that is the loudness asserted): pytest's report of it is expected
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_canary_token_ids_missing_with_the_gate_on_ffn_fail_loudly(checkpoints, monkeypatch):
    """Token ids dropped from the wire: the FFN rank's hash-routed router refuses (naming why), and the attention
    rank's request fails with that error -- never a silent routing by some other token."""
    path, _ = checkpoints[CASE]
    plain = membership.FfnMembership.plan

    def drop(self, t, rank, ffn_input, routing, is_moe, token_ids=None):
        return plain(self, t, rank, ffn_input, routing, is_moe, None)

    monkeypatch.setattr(membership.FfnMembership, "plan", drop)
    with pytest.raises(Exception, match="hash-routed MoE layer chooses its experts by token id"):
        with support.cluster(path, topology(1, 2, transport="loopback", gate="ffn"), ENGINE, pipeline=PipelineConfig("sync")) as cluster:
            cluster.request(0, Capture(PROMPTS[:1]))


def test_a_retried_hash_layer_part_carries_its_token_ids(checkpoints):
    """Through the real endpoint and FFN worker loops (threads, loopback): every expert on two of three FFN ranks, the
    gate on the FFN side, rank 1 never answers; its loss re-dispatches the hash-routed layer's parts as retries,
    which carry the same token ids: the combined output equals the monolithic FFN with the rows' tokens."""
    from tests.connectors.test_failover import PLACEMENT, Ranks, lose

    from afd.models import WeightSelection
    from afd.testing.parity import compare_values

    path, _ = checkpoints[CASE]
    model = load_model(path, dtype="float32")[0]
    ffn_models = [load_model(path, dtype="float32", selection=WeightSelection.experts_only(PLACEMENT.experts_of(r), shared_experts=True,
                                                                                          routers=True))[0] for r in range(3)]
    layer = model.config.moe.hash_layers[-1]
    with Ranks(ffn_models, dead=(1,), gate="ffn") as ranks:
        torch.manual_seed(3)
        x = torch.randn(29, model.config.hidden_size)
        ids = torch.randint(0, model.config.vocab_size, (29,))
        handles = [ranks.endpoint.dispatch(layer, 1, x, None, is_moe=True, microbatch=mb, token_ids=ids) for mb in range(2)]
        support.wait_for(lambda: sum(w.items_served for w in ranks.workers) >= 4, 10, "ranks 0 and 2 answering the first attempt")
        lose(ranks.endpoint, 1)
        assert [h.retries for h in handles] == [1, 1]
        for h in handles:
            y = ranks.endpoint.combine(h, model.config.hidden_size, x.dtype) + model.shared_experts(layer, x)
            report = compare_values("combine after failover", model.ffn(layer, x, token_ids=ids), y)
            assert report.ok, str(report)
        assert sum(w.unions.retries for w in ranks.workers) == 4


@pytest.mark.procs
@pytest.mark.faults
def test_an_ffn_rank_killed_mid_batch_changes_no_v4_output(checkpoints):
    """Real processes over shm, 2A3F async with every expert on two FFN ranks and the gate on the FFN side: FFN rank 2
    dies on its 30th work part; every text equals the monolithic model's greedy text. The FFN ranks read the hash
    tables (``tid2eid``), the attention ranks do not."""
    path, _ = checkpoints[CASE]
    model = load_model(path, dtype="float32")[0]
    t = topology(2, 3, transport="shm", gate="ffn", dense_on="ffn", shared_experts_on="ffn", redundant_experts=8)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with Cluster(path, t, ENGINE, pipeline=PipelineConfig("async", 2, "token"), timeouts=Timeouts(hang=2.0, heartbeat=0.5),
                 faults=FaultPlan("ffn-kill", 30)) as c:
        outs = generate(c, PROMPTS, params)
        for r in c.ranks:
            if r.spec.generation == 0:
                holds = any(n.endswith(".ffn.gate.tid2eid") for n in r.ready.tensors)  # checkpoint names
                assert holds == (r.spec.role.name == "FFN"), r.spec.name
        assert len(c.status.ffn_losses) == 1 and "SIGKILL" in c.status.ffn_losses[0].cause
    for prompt, out in zip(PROMPTS, outs):
        ref, gaps = support.greedy_with_gaps(model, prompt, params.max_tokens)
        report = compare_greedy(ref, out.token_ids, gaps, min_compared=8)
        assert report.ok, f"{prompt}: {report}"
