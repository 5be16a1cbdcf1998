"""FFN aggregation: the attention ranks agree on each step and an FFN rank computes each (step, layer,
micro-batch) once over the union of every contributor's rows.

* Split equals monolithic for A in {2, 3, 4} and F in {1, 2, 3}, both modes and both splits, on
  loopback (threads), each rank with its own prompts in one agreed step; six real-process launches
  over shm and torch cover every A and F.
* Counted, not timed: the FFN batch is the union (parts per batch = A), expert GEMMs keep their rows
  as A grows at the same total load, an idle attention rank runs no model pass and sends nothing.
* Deterministic: random per-message delays change the arrival order at the FFN ranks, not one bit
  of the logits.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from afd.cli.common import BUILTIN_MODEL
from afd.config import EngineArgs, FaultPlan, PipelineConfig, SamplingParams
from afd.distributed.topology import Topology, parse_devices
from afd.models import load_model
from afd.runtime.messages import Capture, GetRunnerStats
from afd.serving.offline import generate
from tests import support

ENGINE = EngineArgs(dtype="float32", kv_cache_memory=16 << 20, block_size=4)
CASE = "ds-qlora-grouped-yarn"
POOL = [[0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99], [0, 200, 13, 7, 2], [0, 5, 6, 7, 8, 9, 10, 11, 12], [0, 42],
        [0, 8, 16, 24, 32, 40, 48], [0, 300, 299, 298]]


def topology(a, f, **kw):
    return Topology(parse_devices(",".join(["cpu"] * a)), parse_devices(",".join(["cpu"] * f)), **kw)


def prompts_of(rank: int) -> list[list[int]]:
    """A different batch per attention rank (sizes and lengths differ)."""
    return [POOL[(rank + j) % len(POOL)] for j in range(1 + rank % 3)]


@pytest.fixture(scope="module")
def reference(checkpoints):
    path = checkpoints[CASE][0]
    model = load_model(path, dtype="float32")[0]
    refs = {r: support.monolithic_capture(model, prompts_of(r)) for r in range(4)}
    return path, model, refs


def check_together(cluster, model, refs, gate) -> None:
    """Every attention rank runs its own prompts in one agreed step; each equals the monolithic model."""
    a = cluster.topology.num_attention_ranks
    got = cluster.request_all([Capture(prompts_of(r), True) for r in range(a)])
    for r, (values, logits) in enumerate(got):
        ref_values, ref_logits = refs[r]
        failures = support.split_parity_failures(model, ref_values, ref_logits, values, logits, check_topk=gate == "attention")
        assert not failures, f"attention rank {r}:\n" + "\n".join(failures)


def ffn_stats(cluster) -> list[dict]:
    return [r.final_stats for r in cluster.ranks if r.spec.role.name == "FFN"]


SETTINGS = list(itertools.product(["attention", "ffn"], ["attention", "ffn"], ["attention", "ffn"]))
PIPELINES = [PipelineConfig("sync"), PipelineConfig("async", 2, "request"), PipelineConfig("async", 2, "token")]
MATRIX = [(a, f, p) for a in (2, 3, 4) for f in (1, 2, 3) for p in PIPELINES]


@pytest.mark.parametrize("a, f, pipeline", MATRIX, ids=[f"{a}A{f}F-{p.mode}-{p.split}" for a, f, p in MATRIX])
def test_loopback_matrix_equals_monolithic(reference, a, f, pipeline):
    path, model, refs = reference
    gate, dense_on, shared_on = SETTINGS[(3 * a + f + PIPELINES.index(pipeline)) % len(SETTINGS)]  # every setting, spread
    t = topology(a, f, transport="loopback", gate=gate, dense_on=dense_on, shared_experts_on=shared_on)
    with support.cluster(path, t, ENGINE, pipeline=pipeline) as cluster:
        check_together(cluster, model, refs, gate)
    for stats in ffn_stats(cluster):  # the union: every (layer, micro-batch) had a part from each of the a ranks
        assert (stats["items"] + stats["empty_parts"]) % a == 0
        assert stats["items_per_batch"] > 1  # and one batch computed the parts of several ranks


REAL = [  # every A and every F twice, both transports, both modes and splits, every gate and placement
    ("shm", 2, 1, PipelineConfig("async", 2, "token"), ("attention", "attention", "attention")),
    ("shm", 3, 3, PipelineConfig("sync"), ("ffn", "ffn", "ffn")),
    ("shm", 4, 2, PipelineConfig("async", 2, "request"), ("attention", "ffn", "ffn")),
    ("torch", 2, 3, PipelineConfig("async", 2, "request"), ("attention", "attention", "ffn")),
    ("torch", 3, 1, PipelineConfig("async", 2, "token"), ("ffn", "attention", "attention")),
    ("torch", 4, 2, PipelineConfig("sync"), ("attention", "ffn", "attention")),
]


@pytest.mark.procs
@pytest.mark.parametrize("transport, a, f, pipeline, setting", REAL, ids=[f"{t}-{a}A{f}F-{p.mode}" for t, a, f, p, _ in REAL])
def test_real_processes_aggregate(reference, transport, a, f, pipeline, setting):
    path, model, refs = reference
    gate, dense_on, shared_on = setting
    t = topology(a, f, transport=transport, gate=gate, dense_on=dense_on, shared_experts_on=shared_on)
    with support.cluster(path, t, ENGINE, pipeline=pipeline) as cluster:
        check_together(cluster, model, refs, gate)
    for stats in ffn_stats(cluster):
        assert stats["items_per_batch"] > 1, stats["items_per_batch"]  # parts of several ranks in one batch


def _load_run(a: int, prompts, params, pipeline):
    t = topology(a, 1, transport="loopback")
    # spread by load alone: prefix-aware routing would (rightly) gather the prompts that share a first block
    with support.cluster(BUILTIN_MODEL, t, replace(ENGINE, enable_prefix_caching=False), pipeline=pipeline) as cluster:
        outs = generate(cluster, prompts, params)
        runner = [cluster.request(r, GetRunnerStats()) for r in range(a)]
    return outs, ffn_stats(cluster)[0], runner


def test_more_attention_ranks_keep_the_expert_gemms_whole():
    """4 attention ranks against 1 at the same total load (same mode, m and split): every rank serves a
    fair share, the FFN batches hold four parts, and rows per expert GEMM stay (>= 0.9x)."""
    prompts = [f"KING {i}:\nWhat say you, my lord" for i in range(16)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    pipeline = PipelineConfig("async", 2, "token")
    one, ffn1, _ = _load_run(1, prompts, params, pipeline)
    four, ffn4, runners = _load_run(4, prompts, params, pipeline)
    total = sum(ffn4["tokens_by_rank"].values())
    assert all(ffn4["tokens_by_rank"].get(r, 0) >= 0.2 * total for r in range(4)), ffn4["tokens_by_rank"]
    assert ffn4["items_per_batch"] >= 3.5 and ffn1["items_per_batch"] == 1.0
    assert ffn4["mean_gemm_rows"] >= 0.9 * ffn1["mean_gemm_rows"], (ffn4["mean_gemm_rows"], ffn1["mean_gemm_rows"])
    assert ffn4["batches"] <= ffn1["batches"] * 1.1
    assert all(r.steps > 0 for r in runners)


def test_an_idle_attention_rank_runs_no_model_pass_and_sends_nothing():
    outs, ffn, runners = _load_run(2, ["ROMEO:"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                                   PipelineConfig("async", 2, "token"))
    assert len(outs[0].token_ids) == 6
    busy, idle = runners
    assert busy.steps == 6 and idle.steps == 0  # no model pass at all on the idle rank
    assert idle.idle_steps == busy.steps + 1 == idle.votes == busy.votes  # it only voted; the last vote ends the wave
    assert set(ffn["tokens_by_rank"]) == {0} and ffn["empty_parts"] == 0 and ffn["items_per_batch"] == 1.0


def test_arrival_order_changes_nothing(reference):
    """Random per-message delays on every rank (two runs): the FFN ranks see the parts in another order,
    the logits are bitwise the same."""
    path, model, refs = reference
    a, f = 3, 2
    runs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        t = topology(a, f, transport="loopback")
        with support.cluster(path, t, ENGINE, pipeline=PipelineConfig("async", 2, "token"), faults=FaultPlan(send_jitter=0.003)) as cluster:
            got = cluster.request_all([Capture(prompts_of(r), True) for r in range(a)])
        runs.append(([logits for _, logits in got], [s["arrivals"] for s in ffn_stats(cluster)]))
    (logits1, arrivals1), (logits2, arrivals2) = runs
    assert all(torch.equal(x, y) for x, y in zip(logits1, logits2))
    assert arrivals1 != arrivals2, "the jitter did not change the arrival order: the test shows nothing"
    assert all(sorted(x) == sorted(y) for x, y in zip(arrivals1, arrivals2))
