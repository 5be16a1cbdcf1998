"""The async connector: micro-batches ping-ponged over the connector equal the monolithic model, really
overlap, respect credits, and a token split cannot diverge."""

from __future__ import annotations

import pytest
import torch

from afd.cli.common import BUILTIN_MODEL
from afd.config import (
    CacheConfig,
    EngineArgs,
    FaultPlan,
    PipelineConfig,
    SamplingParams,
    Timeouts,
)
from afd.distributed.topology import Topology, parse_devices
from afd.engine.tokenizer import Tokenizer
from afd.kvcache import BlockManager, PagedKVCache, SeqChunk, build_attention_metadata
from afd.models import load_model
from afd.runtime.messages import Capture, GetRunnerStats, GetTrace, SetPipeline, SetTrace, Sleep
from afd.serving.offline import generate
from afd.testing.parity import compare_greedy, compare_values
from tests import support

PROMPTS = [[0, 17, 44, 9, 120, 301, 5, 77, 8, 250, 3, 12, 99], [0, 200, 13, 7, 2], [0, 5, 6, 7, 8, 9, 10, 11, 12]]
ENGINE = EngineArgs(dtype="float32", kv_cache_memory=16 << 20, block_size=4)
PIPELINES = [PipelineConfig("async", m, split) for m in (1, 2, 3, 4) for split in ("request", "token")]


def topology(a, f, **kw):
    return Topology(parse_devices(",".join(["cpu"] * a)), parse_devices(",".join(["cpu"] * f)), **kw)


@pytest.fixture(scope="module")
def reference():
    model = load_model(BUILTIN_MODEL, dtype="float32")[0]
    return model, *support.monolithic_capture(model, PROMPTS)


def check_all_pipelines(cluster, model, ref_values, ref_logits, pipelines, gate="attention"):
    for pipeline in pipelines:
        for rank in range(cluster.topology.num_attention_ranks):
            cluster.request(rank, SetPipeline(pipeline))
            values, logits = cluster.request(rank, Capture(PROMPTS))
            failures = support.split_parity_failures(model, ref_values, ref_logits, values, logits, check_topk=gate == "attention")
            assert not failures, f"{pipeline}, attention rank {rank}:\n" + "\n".join(failures)


@pytest.mark.parametrize("gate", ["attention", "ffn"])
@pytest.mark.parametrize("a, f", [(1, 1), (2, 1), (1, 2), (2, 3)])
def test_async_parity_over_loopback(reference, a, f, gate):
    model, ref_values, ref_logits = reference
    with support.cluster(BUILTIN_MODEL, topology(a, f, transport="loopback", gate=gate), ENGINE) as cluster:
        check_all_pipelines(cluster, model, ref_values, ref_logits, PIPELINES, gate)


@pytest.mark.procs
@pytest.mark.parametrize("transport", ["shm", "torch"])
@pytest.mark.parametrize("a, f, gate", [(1, 1, "attention"), (2, 1, "ffn"), (1, 2, "attention"), (2, 3, "ffn")])
def test_async_parity_real_processes(reference, transport, a, f, gate):
    model, ref_values, ref_logits = reference
    pipelines = [PipelineConfig("async", 2, "token"), PipelineConfig("async", 3, "request")]
    with support.cluster(BUILTIN_MODEL, topology(a, f, transport=transport, gate=gate), ENGINE, pipeline=pipelines[0]) as cluster:
        check_all_pipelines(cluster, model, ref_values, ref_logits, pipelines, gate)
        tok = Tokenizer(BUILTIN_MODEL)
        prompts = ["ROMEO:", "KING.\nWhat say you", "Enter a Messenger.\n\n"]
        outs = generate(cluster, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), PipelineConfig("async", 2, "token"))
        for prompt, out in zip(prompts, outs):
            ref, gaps = support.greedy_with_gaps(model, tok.encode(prompt), 16)
            report = compare_greedy(ref, out.token_ids, gaps, min_compared=8)
            assert report.ok, f"{prompt!r}: {report}"


@pytest.mark.parametrize("cut", ["first", "middle", "last"])
def test_token_split_cannot_diverge(reference, cut):
    """One prompt cut at offset 1, middle or length-1: both pieces' metadata are built before either runs,
    the FFN halves run in reverse order, and every layer still equals the unsplit run."""
    model, _, _ = reference
    ids = PROMPTS[0] + PROMPTS[2]
    n = len(ids)
    c = {"first": 1, "middle": n // 2, "last": n - 1}[cut]
    bs = 4
    blocks = BlockManager(16, bs)
    table = blocks.ensure(0, n)
    ref_values, _ = support.monolithic_capture(model, [ids])
    metas = [build_attention_metadata([SeqChunk(table, 0, c)], bs), build_attention_metadata([SeqChunk(table, c, n - c)], bs)]
    cache = PagedKVCache(CacheConfig(bs, 16), model.config.num_layers, model.kv_layout(), torch.float32)
    with torch.inference_mode():
        hidden = [model.embed(torch.tensor(ids[c:])), model.embed(torch.tensor(ids[:c]))][::-1]
        for layer in range(model.config.num_layers):
            outs = [model.attention(layer, hidden[k], metas[k], cache.layer(layer)) for k in (0, 1)]  # earlier piece first
            ffn = {k: model.ffn(layer, outs[k].ffn_input) for k in (1, 0)}  # FFN halves in permuted order
            hidden = [outs[k].residual + ffn[k] for k in (0, 1)]
            report = compare_values(f"layer {layer} (cut at {c})", ref_values[(layer, "ffn_output")], torch.cat(hidden))
            assert report.ok, str(report)


@pytest.mark.procs
def test_overlap_is_real_and_credits_bound_in_flight(reference):
    """With a slow FFN side, dispatch of (k+1, L) happens before combine of (k, L), in-flight depth reaches
    min(m, credits), never exceeds the credits, micro-batch k is sent to the FFN side before k + 1 starts the
    dense layers computed here -- read from the runtime trace -- and results stay correct."""
    model, ref_values, ref_logits = reference
    with support.cluster(BUILTIN_MODEL, topology(1, 1, transport="shm"), ENGINE, faults=FaultPlan(ffn_delay=0.02)) as cluster:
        for m, credits in ((2, None), (4, 2), (3, 3)):
            pipeline = PipelineConfig("async", m, "token", credits)
            cluster.request(0, SetPipeline(pipeline))
            cluster.request(0, SetTrace(True))
            values, logits = cluster.request(0, Capture(PROMPTS))
            events, plan = cluster.request(0, GetTrace())
            assert not support.split_parity_failures(model, ref_values, ref_logits, values, logits)
            assert plan.num_microbatches == m
            when = {(e.action, e.microbatch, e.layer): e for e in events}
            for layer in model.config.moe.layers:
                for k in range(m - 1):
                    assert when[("dispatch", k + 1, layer)].start < when[("combine", k, layer)].start
            first = min(model.config.moe.layers)  # the dense layers before it run here, each micro-batch alone:
            assert first > 0  # the FFN side's first work leaves before the next micro-batch starts its dense layers
            for k in range(m - 1):
                assert when[("dispatch", k, first)].end < when[("attention", k + 1, 0)].start
            peak = max(e.in_flight for e in events)
            assert peak == min(m, pipeline.effective_credits), (m, credits, peak)
            # a combine is traced as this rank's shared experts (computed before the wait: they need only the FFN
            # input), its wait for the slow FFN side, then its own work on the result (the residual): what
            # `afd bench pipeline` counts as busy is the first and the last
            merges, shared = traced(events, "merge"), traced(events, "shared")
            combines = [e for e in events if e.action == "combine"]
            assert combines and all(merges[(e.microbatch, e.layer, e.seq)].start == e.end for e in combines)
            assert sum(e.end - e.start for e in merges.values()) < sum(e.end - e.start for e in combines)
            moe = [e for e in combines if e.layer in model.config.moe.layers]
            assert moe and all(shared[(e.microbatch, e.layer, e.seq)].end == e.start for e in moe)
            assert not any(key[1] not in model.config.moe.layers for key in shared)  # a dense layer has none


def traced(events, action: str) -> dict:
    """The trace's events of one action by (micro-batch, layer, step)."""
    return {(e.microbatch, e.layer, e.seq): e for e in events if e.action == action}


def test_impossible_split_degrades_explicitly(reference):
    with support.cluster(BUILTIN_MODEL, topology(1, 1, transport="loopback"), ENGINE, pipeline=PipelineConfig("async", 4, "request")) as cluster:
        cluster.request(0, SetTrace(True))
        cluster.request(0, Capture([PROMPTS[1]]))
        _, plan = cluster.request(0, GetTrace())
        assert plan.num_microbatches == 1 and "only 1 requests" in plan.degraded


@pytest.mark.procs
@pytest.mark.faults
@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_idle_links_live_on_heartbeats(reference, transport):
    """The FFN side idles for >= 3x the link timeout; heartbeats keep the links alive; then it serves correctly."""
    model, ref_values, ref_logits = reference
    t = topology(1, 1, transport=transport)
    with support.cluster(BUILTIN_MODEL, t, ENGINE, timeouts=Timeouts(hang=1.5, heartbeat=0.2), pipeline=PipelineConfig("async", 2, "token")) as cluster:
        cluster.request(0, Capture(PROMPTS))
        cluster.request(0, Sleep(5.0))  # no work on any link for 3.3 x the link timeout
        values, logits = cluster.request(0, Capture(PROMPTS))
        assert not support.split_parity_failures(model, ref_values, ref_logits, values, logits)
    ffn = next(r for r in cluster.ranks if r.spec.role.name == "FFN")
    assert ffn.final_stats is not None, (ffn.done, ffn.proc.exitcode)
    assert ffn.final_stats["heartbeats_received"] >= 5


@pytest.mark.procs
@pytest.mark.faults
def test_silence_without_heartbeats_is_reported_not_hung(reference):
    from afd.runtime.launcher import RankFailedError
    from afd.runtime.supervisor import Policy

    t = topology(1, 1, transport="shm")
    with pytest.raises(RankFailedError, match=r"ffn rank 0 .*attention rank 0 sent nothing for .* \(link timeout 1.0 s\)"):
        # fail-stop: a restart would heal the hung rank (afd/runtime/supervisor.py); here its report must end the run
        with support.cluster(BUILTIN_MODEL, t, ENGINE, timeouts=Timeouts(hang=1.0, heartbeat=0.0), pipeline=PipelineConfig("sync"),
                             policy=Policy(replica_failover=False, restart_replicas=False)) as cluster:
            cluster.request(0, Sleep(3.0))
            cluster.request(0, Capture(PROMPTS))


def test_adaptive_microbatching_chooses_per_step_and_keeps_parity(reference):
    """--num-microbatches auto: a long prefill step is split (overlap pays for the fixed costs), decode
    steps of a few tokens are not; outputs equal the monolithic model's, and the trace says why. (The configured
    model: the run's own costs, learned after a few steps, are the next test's.)"""
    model, ref_values, ref_logits = reference
    auto = PipelineConfig("async", 4, "token", adaptive=True, learn_costs=False)
    with support.cluster(BUILTIN_MODEL, topology(1, 1, transport="loopback"), ENGINE, pipeline=auto) as cluster:
        check_all_pipelines(cluster, model, ref_values, ref_logits, [auto])
        cluster.request(0, SetTrace(True))
        tok = Tokenizer(BUILTIN_MODEL)
        prompt = ("KING.\nWhat say you, my lords? " * 12)[:300]
        out = generate(cluster, [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), auto)[0]
        events, _ = cluster.request(0, GetTrace())
    chosen = [int(e.note.split("m=", 1)[1].split()[0]) for e in events if e.action == "plan"]
    assert len(chosen) == 6  # one choice per step: the prefill, then 5 decode steps
    assert chosen[0] > 1 and chosen[1:] == [1] * 5, chosen
    ref, gaps = support.greedy_with_gaps(model, tok.encode(prompt), 6)
    report = compare_greedy(ref, out.token_ids, gaps, min_compared=4)
    assert report.ok, report


def test_auto_learns_its_costs_from_the_run_and_keeps_parity(reference):
    """--num-microbatches auto learns its costs from the run: the FFN rank's compute of each union comes back in its
    RESULT headers (what the attention rank was told adds up to the FFN rank's own busy time), the learned model
    (seconds) plans the later steps, and the outputs still equal the monolithic model's."""
    model = reference[0]
    auto = PipelineConfig("async", 4, "token", adaptive=True)
    tok = Tokenizer(BUILTIN_MODEL)
    prompts = [("KING.\nWhat say you, my lords? " * 12)[:300], "ROMEO.\nBut soft, what light", "First Citizen:\nBefore we proceed"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with support.cluster(BUILTIN_MODEL, topology(1, 1, transport="loopback"), ENGINE, pipeline=auto) as cluster:
        cluster.request(0, SetTrace(True))
        outs = generate(cluster, prompts[:1], params, auto)  # the first steps are warm-up; then decode steps of one size
        outs += generate(cluster, prompts[1:], params, auto)  # a prefill of another size: a curve of the FFN side
        stats = cluster.request(0, GetRunnerStats())
        events, _ = cluster.request(0, GetTrace())
    ffn = next(r for r in cluster.ranks if r.spec.role.name == "FFN").final_stats
    learned = stats.learned_costs
    assert learned is not None and len(learned.ffn_curve) >= 2, learned  # the prompts' prefill and the decode steps
    assert learned.attn_token + learned.attn_context > 0 and learned.ffn_cost(1) > 0
    assert learned.local_cost(1) > 0  # the built-in model's first layer is dense: its MLP here, learned on its own
    assert stats.ffn_busy_s == pytest.approx(ffn["busy_s"], abs=1e-6 * ffn["items"]), (stats.ffn_busy_s, ffn["busy_s"])
    plans = [e.note for e in events if e.action == "plan"]
    assert len(plans) == stats.steps == 32 and all("learned costs" in note for note in plans[-4:]), plans
    assert not any("learned costs" in note for note in plans[:2])  # the warm-up steps are planned with the configured model
    for prompt, out in zip(prompts, outs):
        ref, gaps = support.greedy_with_gaps(model, tok.encode(prompt), 16)
        report = compare_greedy(ref, out.token_ids, gaps, min_compared=12)
        assert report.ok, report


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.procs
def test_backpressure_bounds_in_flight_and_memory(reference):
    """A slowed FFN rank (15 ms per batch) under a long run with m=4, credits=2: in-flight never exceeds
    the credits, neither rank's memory grows with the run's length (sampled while it runs), and the
    outputs equal the monolithic model's."""
    import threading
    import time

    model, _, _ = reference
    pipeline = PipelineConfig("async", 4, "token", credits=2)
    tok = Tokenizer(BUILTIN_MODEL)
    prompts = ["ROMEO:\n" + "Good morrow, cousin. " * 8, "KING.\nWhat say you", "Enter a Messenger.\n\n"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with support.cluster(BUILTIN_MODEL, topology(1, 1, transport="shm"), ENGINE, pipeline=pipeline,
                         faults=FaultPlan(ffn_delay=0.015)) as cluster:
        pids = [r.pid for r in cluster.ranks]
        generate(cluster, prompts, params, pipeline)  # warm-up: allocator pools, caches
        samples: list[list[float]] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append([_rss_mb(p) for p in pids])
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        cluster.request(0, SetTrace(True))
        outs = [generate(cluster, prompts, params, pipeline) for _ in range(2)]
        events, _ = cluster.request(0, GetTrace())
        done.set()
        sampler.join()
    assert max(e.in_flight for e in events) <= 2
    assert len(samples) > 20
    third = len(samples) // 3
    for rank in range(len(pids)):
        early = max(s[rank] for s in samples[:third])
        late = max(s[rank] for s in samples[-third:])
        print(f"rank pid {pids[rank]}: peak RSS {early:.1f} MB in the first third of the run, {late:.1f} MB in the last")
        assert late - early < 16, f"rank pid {pids[rank]}: RSS {early:.1f} MB early, {late:.1f} MB late in the run"
    for round_outs in outs:
        for prompt, out in zip(prompts, round_outs):
            ref, gaps = support.greedy_with_gaps(model, tok.encode(prompt), 40)
            report = compare_greedy(ref, out.token_ids, gaps, min_compared=8)
            assert report.ok, f"{prompt!r}: {report}"
