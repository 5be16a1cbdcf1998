"""Split equals monolithic (rules of parity.md): every topology, transport, gate and FFN placement.

The full product runs over the loopback transport (ranks as threads, each with
its own separately loaded weights); real processes over shm and over torch
(gloo) run every topology once per transport (tcp once, with redundant experts), with the settings varied across
launches so that each gate and FFN placement is covered by both.
"""

from __future__ import annotations

import itertools

import pytest

from afd.cli.common import BUILTIN_MODEL
from afd.config import EngineArgs, PipelineConfig, SamplingParams
from afd.distributed.topology import Topology, parse_devices
from afd.engine.tokenizer import Tokenizer
from afd.models import load_model
from afd.runtime.messages import Capture
from afd.serving.offline import generate
from afd.testing.parity import compare_greedy
from tests import support

TOPOLOGIES = [(1, 1), (2, 1), (1, 2), (3, 2), (2, 3)]
PROMPTS = [[0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99], [0, 200, 13, 7, 2], [0, 5, 6, 7, 8, 9, 10, 11, 12]]
ENGINE = EngineArgs(dtype="float32", kv_cache_memory=16 << 20, block_size=4)
NEW_FAMILIES = ("dsv3-grouped-yarn", "glm4-qknorm-bias")  # DeepSeek-V3 (sigmoid + bias routing, MTP skipped), GLM-4.5
#: MiniMax-M2 (whole-projection q/k norm), gpt-oss (sinks, sliding windows, biased experts, stacked checkpoint),
#: DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention; GLM-5 with shared layers)
FAMILIES_2026 = ("minimax-m2-rotary8", "gptoss-window6", "dsv32-top6", "glm5-shared-top5")
#: Qwen3.5-MoE as released (multimodal layout) and Qwen3-Next: linear-attention state on the attention ranks, the
#: gated shared expert on either side
HYBRID = ("qwen35-moe-vl", "qwen3-next")
#: DeepSeek-V4: compressed attention and hyper-connections on the attention ranks, hash-routed layers whose token ids
#: cross the wire with the gate on the FFN side
V4 = tuple(support.V4_CASES)


def topology(a, f, **kw):
    return Topology(parse_devices(",".join(["cpu"] * a)), parse_devices(",".join(["cpu"] * f)), **kw)


@pytest.fixture(scope="module")
def references(checkpoints):
    out = {}
    for case in ("ds-qlora-grouped-yarn", "qwen3-norm-topk", *NEW_FAMILIES, *FAMILIES_2026, *HYBRID, *V4):
        model = load_model(checkpoints[case][0], dtype="float32")[0]
        out[case] = (checkpoints[case][0], model, *support.monolithic_capture(model, PROMPTS))
    return out


def check_cluster(cluster, model, ref_values, ref_logits, gate):
    for rank in range(cluster.topology.num_attention_ranks):
        values, logits = cluster.request(rank, Capture(PROMPTS))
        failures = support.split_parity_failures(model, ref_values, ref_logits, values, logits, check_topk=gate == "attention")
        assert not failures, f"attention rank {rank}:\n" + "\n".join(failures)


SETTINGS = list(itertools.product(["attention", "ffn"], ["attention", "ffn"], ["attention", "ffn"]))


@pytest.mark.parametrize("case", ["ds-qlora-grouped-yarn", "qwen3-norm-topk"])
@pytest.mark.parametrize("a, f", TOPOLOGIES)
def test_loopback_full_product(references, case, a, f):
    path, model, ref_values, ref_logits = references[case]
    for gate, dense_on, shared_on in SETTINGS:
        t = topology(a, f, transport="loopback", gate=gate, dense_on=dense_on, shared_experts_on=shared_on)
        with support.cluster(path, t, ENGINE, pipeline=PipelineConfig("sync")) as cluster:
            check_cluster(cluster, model, ref_values, ref_logits, gate)


@pytest.mark.parametrize("case", ["ds-qlora-grouped-yarn", "qwen3-norm-topk"])
def test_redundant_experts_split_equals_monolithic(references, case):
    """Every gate and shared-expert placement with every expert on two of three FFN ranks: whichever copy
    computes a row (the copy choice runs on the attention side, or on the FFN side with the gate there), the
    split equals the model."""
    path, model, ref_values, ref_logits = references[case]
    for gate, shared_on in itertools.product(["attention", "ffn"], ["attention", "ffn"]):  # the copy choice's two sides, and
        dense_on = "ffn" if gate == shared_on else "attention"  # the FFN side's replicated work; each dense placement twice
        t = topology(2, 3, transport="loopback", gate=gate, dense_on=dense_on, shared_experts_on=shared_on, redundant_experts=8)
        with support.cluster(path, t, ENGINE, pipeline=PipelineConfig("async", 2, "token")) as cluster:
            assert cluster.placement.single_copy() == ()
            check_cluster(cluster, model, ref_values, ref_logits, gate)


REAL = [  # (transport, A, F, case, gate, dense_on, shared_on): every topology x transport once, every setting at least once
    ("shm", 1, 1, "builtin", "attention", "attention", "attention"),
    ("shm", 2, 1, "qwen3-norm-topk", "ffn", "ffn", "attention"),
    ("shm", 1, 2, "builtin", "attention", "ffn", "ffn"),
    ("shm", 3, 2, "ds-qlora-grouped-yarn", "attention", "attention", "ffn"),
    ("shm", 2, 3, "builtin", "ffn", "attention", "attention"),
    ("torch", 1, 1, "ds-qlora-grouped-yarn", "ffn", "ffn", "ffn"),
    ("torch", 2, 1, "builtin", "attention", "attention", "ffn"),
    ("torch", 1, 2, "qwen3-norm-topk", "attention", "attention", "attention"),
    ("torch", 3, 2, "builtin", "attention", "ffn", "attention"),
    ("torch", 2, 3, "ds-qlora-grouped-yarn", "ffn", "attention", "ffn"),
    ("shm-redundant", 2, 3, "builtin", "attention", "attention", "ffn"),  # every expert on two FFN ranks, as real processes
    ("tcp-redundant", 3, 2, "qwen3-norm-topk", "ffn", "ffn", "ffn"),  # the multi-host transport, copies chosen FFN-side
]


@pytest.mark.procs
@pytest.mark.parametrize("transport, a, f, case, gate, dense_on, shared_on", REAL)
def test_real_processes(references, transport, a, f, case, gate, dense_on, shared_on):
    if case == "builtin":
        path, model = BUILTIN_MODEL, load_model(BUILTIN_MODEL, dtype="float32")[0]
        ref_values, ref_logits = support.monolithic_capture(model, PROMPTS)
    else:
        path, model, ref_values, ref_logits = references[case]
    redundant = 8 if transport.endswith("-redundant") else 0
    t = topology(a, f, transport=transport.removesuffix("-redundant"), gate=gate, dense_on=dense_on, shared_experts_on=shared_on,
                 redundant_experts=redundant)
    with support.cluster(path, t, ENGINE, pipeline=PipelineConfig("sync")) as cluster:
        assert all(r.ready.pid != 0 for r in cluster.ranks) and len(set([r.pid for r in cluster.ranks])) == a + f
        check_cluster(cluster, model, ref_values, ref_logits, gate)
        if case == "builtin":
            tok = Tokenizer(path)
            prompts = ["ROMEO:", "KING.\nWhat say you", "Enter a Messenger.\n\n", "To be, or not"]
            outs = generate(cluster, prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), PipelineConfig("sync"))
            for prompt, out in zip(prompts, outs):
                ref, gaps = support.greedy_with_gaps(model, tok.encode(prompt), 24)
                report = compare_greedy(ref, out.token_ids, gaps, min_compared=8)
                assert report.ok, f"{prompt!r}: {report}"
        # each rank holds only its own weights
        for r in cluster.ranks:
            names = r.ready.tensors
            if r.spec.role.name == "ATTENTION":
                assert not any(".mlp.experts." in n for n in names)
            else:
                mine = {f".mlp.experts.{e}." for e in cluster.placement.experts_of(r.spec.index)}
                experts = [n for n in names if ".mlp.experts." in n]
                assert experts and all(any(m in n for m in mine) for n in experts)
                assert not any("self_attn" in n or "embed_tokens" in n for n in names)


@pytest.mark.parametrize("case", NEW_FAMILIES + FAMILIES_2026 + HYBRID + V4)
@pytest.mark.parametrize("a, f, gate", [(2, 3, "ffn"), (3, 2, "attention"), (1, 2, "ffn")])
def test_new_families_async_split(references, case, a, f, gate):
    """DeepSeek-V3, GLM-4.5, MiniMax-M2 and gpt-oss split exactly like V2: async micro-batches, A != F, the
    gate on either side."""
    path, model, ref_values, ref_logits = references[case]
    for dense_on, shared_on in [("attention", "ffn"), ("ffn", "attention")]:
        t = topology(a, f, transport="loopback", gate=gate, dense_on=dense_on, shared_experts_on=shared_on)
        with support.cluster(path, t, ENGINE, pipeline=PipelineConfig("async", 2, "token")) as cluster:
            check_cluster(cluster, model, ref_values, ref_logits, gate)
            # a hybrid model runs without the prefix cache: the ranks and the front end's prefix router alike
            assert cluster.engine.enable_prefix_caching == (case not in HYBRID)


@pytest.mark.procs
@pytest.mark.parametrize("transport, case, gate", [("shm", "dsv3-grouped-yarn", "ffn"), ("torch", "glm4-qknorm-bias", "attention")])
def test_new_families_real_processes(references, transport, case, gate):
    path, model, ref_values, ref_logits = references[case]
    t = topology(2, 3, transport=transport, gate=gate, dense_on="ffn", shared_experts_on="ffn")
    with support.cluster(path, t, ENGINE, pipeline=PipelineConfig("async", 2, "request")) as cluster:
        check_cluster(cluster, model, ref_values, ref_logits, gate)
        for r in cluster.ranks:  # role-aware: the routers (and V3's selection bias) only where the gate runs
            on_rank = any(n.endswith("mlp.gate.e_score_correction_bias") or n.endswith("mlp.gate.weight") for n in r.ready.tensors)
            assert on_rank == ((r.spec.role.name == "ATTENTION") == (gate == "attention")), r.spec.name


@pytest.mark.procs
@pytest.mark.parametrize("transport, case, gate, router", [("shm", "gptoss-window6", "ffn", ".mlp.router."),
                                                           ("torch", "minimax-m2-rotary8", "attention", ".block_sparse_moe.gate."),
                                                           ("shm", "glm5-shared-top5", "ffn", ".mlp.gate."),
                                                           ("shm", "qwen35-moe-vl", "attention", ".mlp.gate."),
                                                           ("torch", "v4-csa-hca", "ffn", ".ffn.gate.")])
def test_2026_families_real_processes(references, transport, case, gate, router):
    """Real processes, 2A3F async with redundant experts: the split equals the model, and the router's tensors
    (named as the family's checkpoint names them) are read only where the gate runs."""
    path, model, ref_values, ref_logits = references[case]
    t = topology(2, 3, transport=transport, gate=gate, dense_on="ffn", shared_experts_on="ffn", redundant_experts=4)
    with support.cluster(path, t, ENGINE, pipeline=PipelineConfig("async", 2, "request")) as cluster:
        check_cluster(cluster, model, ref_values, ref_logits, gate)
        for r in cluster.ranks:
            on_rank = any(router in n for n in r.ready.tensors)
            assert on_rank == ((r.spec.role.name == "ATTENTION") == (gate == "attention")), r.spec.name
            if r.spec.role.name == "FFN":  # the indexer and the linear attention run on the attention side: none crosses
                assert not any(".indexer." in n or ".linear_attn." in n for n in r.ready.tensors), r.spec.name


@pytest.mark.parametrize("case", FAMILIES_2026 + V4)
def test_2026_families_sync_split_with_redundant_experts(references, case):
    """The sync pipeline too, with every expert on two FFN ranks and the copy choice on either side."""
    path, model, ref_values, ref_logits = references[case]
    for gate in ("attention", "ffn"):
        t = topology(2, 2, transport="loopback", gate=gate, dense_on="ffn", shared_experts_on="attention", redundant_experts=8)
        with support.cluster(path, t, ENGINE, pipeline=PipelineConfig("sync")) as cluster:
            check_cluster(cluster, model, ref_values, ref_logits, gate)


@pytest.mark.procs
def test_2026_family_over_tcp(references):
    """DeepSeek-V3.2 over the tcp transport, real processes, 2A3F async, the gate on the FFN side."""
    path, model, ref_values, ref_logits = references["dsv32-top6"]
    t = topology(2, 3, transport="tcp", gate="ffn", dense_on="ffn", shared_experts_on="ffn")
    with support.cluster(path, t, ENGINE, pipeline=PipelineConfig("async", 2, "token")) as cluster:
        check_cluster(cluster, model, ref_values, ref_logits, "ffn")
