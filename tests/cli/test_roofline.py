"""``afd bench roofline``'s counts against independent ones: the prefill FLOPs it derives from the model's modules
against torch's FLOP counter over the same prefill (the matrix products of the linear layers, counted as they run),
and the bytes a decode step reads against the model's parameters."""

from __future__ import annotations

import pytest
from torch.utils.flop_counter import FlopCounterMode

from afd.cli.bench_roofline import Counts
from afd.models import load_model
from tests import support


@pytest.mark.parametrize("case", ["ds-noqlora-greedy", "qwen3-norm-topk"])
def test_prefill_flops_equal_torch_s_count_of_the_linear_products(checkpoints, case, monkeypatch):
    from afd.models import deepseek_v2, layers

    monkeypatch.setattr(layers, "native_ops", lambda: None)  # every product an ATen matmul the counter sees
    # MLA's prefill decompresses the context through kv_b_proj (an mm); its absorbed form spends the same FLOPs on
    # W_UK/W_UV as einsums (bmm), which the counter files with attention's own products
    monkeypatch.setattr(deepseek_v2.MLAttention, "_absorbed_is_cheaper", lambda self, q, length: False)
    model = load_model(checkpoints[case][0], dtype="float32")[0]
    prompts = [[3, 17, 44, 9, 120, 31, 5, 77, 8], [2, 200, 13, 7, 2, 9]]
    runner, blocks = support.runner_and_blocks(model, 4, 64, 2)
    with FlopCounterMode(display=False) as counter:
        runner.execute([t for p in prompts for t in p], [support.new_chunk(blocks, i, p) for i, p in enumerate(prompts)])
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linear = by_op.get("aten.mm", 0) + by_op.get("aten.addmm", 0)
    assert linear > 0, by_op
    assert Counts(model).prefill_flops(sum(map(len, prompts)), len(prompts)) == linear, by_op


def test_the_bytes_every_step_reads_plus_every_expert_are_the_model_less_its_embedding(checkpoints):
    model = load_model(checkpoints["ds-noqlora-greedy"][0], dtype="float32")[0]
    counts = Counts(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    experts = sum(size * len(m.expert_ids) for size, m in zip(counts.expert_bytes, counts.experts))
    assert counts.always_bytes + experts == pytest.approx(total - embed.numel() * embed.element_size())
    # a snapshot diff counts the experts that took rows, no more
    before = counts.snapshot()
    counts.experts[0].tokens_routed[1] += 3
    assert counts.touched_bytes(before, counts.snapshot()) == counts.expert_bytes[0]


@pytest.mark.parametrize("case", ["ds-noqlora-greedy", "qwen3-norm-topk"])
def test_prefill_phases_count_the_flops_the_model_s_weights_imply(checkpoints, case, monkeypatch):
    """The phase hooks count each linear, router and expert call as it runs; their FLOPs over a prefill equal the
    count derived from the parameters alone (Counts), and the phases' times fit inside the step's."""
    import time

    from afd.cli.roofline_phases import GEMM_PHASES, PhaseTimer, gemm_totals, phase_rows
    from afd.models import deepseek_v2

    monkeypatch.setattr(deepseek_v2.MLAttention, "_absorbed_is_cheaper", lambda self, q, length: False)  # kv_b_proj as a call
    model = load_model(checkpoints[case][0], dtype="float32")[0]
    prompts = [[3, 17, 44, 9, 120, 31, 5, 77, 8], [2, 200, 13, 7, 2, 9]]
    runner, blocks = support.runner_and_blocks(model, 4, 64, 2)
    timer = PhaseTimer(model)
    t0 = time.perf_counter()
    runner.execute([t for p in prompts for t in p], [support.new_chunk(blocks, i, p) for i, p in enumerate(prompts)])
    step = time.perf_counter() - t0
    phases = timer.close(step)
    assert sum(phases[n].flops for n in GEMM_PHASES if n in phases) == Counts(model).prefill_flops(sum(map(len, prompts)), len(prompts))
    assert {"attention projections", "routed experts", "router", "LM head", "attention core", "other"} <= set(phases)
    assert sum(p.seconds for p in phases.values()) == pytest.approx(step) and all(p.seconds >= 0 for p in phases.values())
    assert not model.model.layers[0].self_attn._forward_hooks, "the hooks outlive the timer"
    rows = phase_rows(phases, step, peak=1e12, bandwidth=1e10)
    experts = next(r for r in rows if r["phase"] == "routed experts")
    # an expert takes a few rows here: a few FLOPs per byte, so its bound is the bandwidth's, not the peak
    assert experts["flop_per_byte"] < 20 and experts["bound_gflop_s"] == pytest.approx(experts["flop_per_byte"] * 10)
    assert 0 < gemm_totals(phases, 1e12, 1e10)["gflop_s"]


def test_a_gemm_probe_that_would_run_past_its_budget_stops_and_says_so(capsys):
    """On a CPU where one way of multiplying is slow, the peak probe skips the sizes it cannot afford rather than stall
    the command (oneDNN's quantised linear on an AMD EPYC: minutes a call at n=4096); what it measured stands."""
    from afd.cli.bench_roofline import gemm_peak

    flops, n = gemm_peak("float32", 1, [4096, 32, 64], budget_s=1e-4)  # sizes ascend whatever the order given
    assert n == 32 and flops > 0  # the first size is always timed; 64 would pass the budget at 32's speed
    err = capsys.readouterr().err
    assert "GEMM peak float32 (matmul): n=64 skipped" in err and "4096" not in err
    flops, n = gemm_peak("float32", 1, [32, 64], budget_s=60)
    assert n in (32, 64) and "skipped" not in capsys.readouterr().err
