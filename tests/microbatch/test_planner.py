from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from afd.microbatch import CostModel, choose_microbatches, plan_microbatches, simulate_step

chunks_st = st.lists(st.tuples(st.integers(0, 50), st.integers(1, 12)), min_size=1, max_size=6)


def flat_tokens(chunks):
    return [(i, s + j) for i, (s, n) in enumerate(chunks) for j in range(n)]


@settings(max_examples=300, deadline=None)
@given(chunks_st, st.integers(1, 8), st.sampled_from(["request", "token"]))
def test_every_token_once_in_order_in_contiguous_pieces(chunks, m, policy):
    plan = plan_microbatches(chunks, m, policy)
    got = [(sp.seq, sp.start + j) for piece in plan.pieces for sp in piece for j in range(sp.length)]
    assert got == flat_tokens(chunks)
    assert all(piece for piece in plan.pieces)
    units = len(chunks) if policy == "request" else sum(n for _, n in chunks)
    assert plan.num_microbatches == min(m, units)
    assert (plan.degraded is not None) == (m > units)
    if policy == "request":
        for piece in plan.pieces:
            for sp in piece:  # whole requests only
                assert (sp.start, sp.length) == chunks[sp.seq]


def brute_force(weights, m):
    best = float("inf")
    n = len(weights)
    for cuts in itertools.combinations(range(1, n), m - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@settings(max_examples=150, deadline=None)
@given(chunks_st, st.integers(1, 4), st.sampled_from(["request", "token"]))
def test_cost_is_within_rounding_of_the_brute_force_optimum(chunks, m, policy):
    cost = CostModel()
    plan = plan_microbatches(chunks, m, policy, cost)
    if policy == "request":
        weights = [cost.span_cost(s, n) for s, n in chunks]
    else:
        weights = [cost.token_cost(p) for _, p in flat_tokens(chunks)]
    k = min(m, len(weights))
    assume(len(weights) <= 14)  # brute force too slow beyond
    assert max(plan.costs) <= brute_force(weights, k) * (1 + 1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1e-6, 1e3), min_size=17, max_size=60), st.integers(1, 8))
def test_bisection_cut_equals_the_exact_programme(weights, m):
    """Above 16 pieces the cut is found by bisection: exactly m contiguous non-empty groups covering every
    piece, with the exact dynamic programme's largest group (within rounding)."""
    from itertools import accumulate

    from afd.microbatch.planner import _greedy_bounds, _partition

    bounds = _greedy_bounds(list(accumulate(weights, initial=0.0)), m)
    assert len(bounds) == m and bounds[0][0] == 0 and bounds[-1][1] == len(weights)
    assert all(a < b for a, b in bounds) and all(b == a2 for (_, b), (a2, _) in zip(bounds, bounds[1:]))
    worst = max(sum(weights[a:b]) for a, b in bounds)
    assert worst <= max(sum(weights[a:b]) for a, b in _partition(weights, m)) * (1 + 1e-9)


def test_token_split_of_one_long_prompt_gives_the_earlier_piece_more_tokens():
    plan = plan_microbatches([(0, 1000)], 2, "token", CostModel(attn_context=0.01))
    first, second = (sum(sp.length for sp in piece) for piece in plan.pieces)
    assert first > second and first + second == 1000
    assert plan.imbalance < 1.01
    # raw token counts would split 500/500: the cost model is what moves the cut
    assert plan_microbatches([(0, 1000)], 2, "token", CostModel(attn_context=0.0)).pieces[0][0].length == 500


def test_impossible_splits_degrade_explicitly():
    plan = plan_microbatches([(7, 1)], 4, "token")
    assert plan.num_microbatches == 1 and "4 micro-batches requested, only 1 tokens" in plan.degraded
    plan = plan_microbatches([(0, 5), (0, 3)], 3, "request")
    assert plan.num_microbatches == 2 and "only 2 requests" in plan.degraded


@pytest.mark.parametrize("m, policy, message", [(0, "token", "num_microbatches"), (9, "token", "num_microbatches"), (2, "chunk", "split policy")])
def test_bad_arguments(m, policy, message):
    with pytest.raises(ValueError, match=message):
        plan_microbatches([(0, 4)], m, policy)


def test_cost_model_fit_feeds_the_planner(checkpoints, tmp_path):
    from afd.cli.bench_costs import fit
    from afd.config import PipelineConfig
    from afd.models import load_model

    model = load_model(checkpoints["ds-noqlora-greedy"][0], dtype="float32")[0]
    coef = fit(model, repeats=1)
    assert coef["attn_token"] >= 0 and coef["attn_context"] >= 0 and coef["ffn_token"] > 0
    assert coef["local_token"] > 0  # its first two layers are dense: their MLP, run beside attention, is timed too
    cost = CostModel.from_fit(coef)
    assert (cost.local_token, cost.local_call) == (coef["local_token"], coef["local_call"])
    assert PipelineConfig("async", 4, "token", cost=cost, adaptive=True).cost is cost
    plan = plan_microbatches([(0, 300)], 2, "token", cost)
    assert plan.num_microbatches == 2
    assert cost.transfer == 100e-6  # the fit measures compute; the message cost is the default's
    with pytest.raises(ValueError, match="lacks attn_call, ffn_call: write it with `afd bench costs"):
        CostModel.from_fit({k: coef[k] for k in ("attn_token", "attn_context", "ffn_token")})  # fixed costs in another unit
    with pytest.raises(ValueError, match="costs must be non-negative"):
        CostModel(1.0, -1.0, 1.0)
    curve = cost.ffn_curve
    assert [n for n, _ in curve] == sorted({n for n, _ in curve}) and all(t > 0 for _, t in curve)
    assert cost.ffn_cost(curve[3][0]) == pytest.approx(curve[3][1])  # the curve, not the parametric fit
    from afd.cli.common import pipeline_from_args
    from afd.cli.main import build_parser

    (tmp_path / "costs.json").write_text(json.dumps(coef))  # as `afd bench costs --json` writes it
    args = build_parser().parse_args(["generate", "--prompt", "x", "--num-microbatches", "auto", "--cost-model", str(tmp_path / "costs.json")])
    assert pipeline_from_args(args).cost == cost and pipeline_from_args(args).adaptive


def test_small_steps_keep_fewer_microbatches_and_say_why():
    decode = [(100 + i, 1) for i in range(8)]  # 8 sequences, one new token each
    plan = plan_microbatches(decode, 2, "token", min_tokens=16)
    assert plan.num_microbatches == 1 and "8 tokens < 2 x 16" in plan.degraded
    prefill = [(0, 128)] * 8
    assert plan_microbatches(prefill, 2, "token", min_tokens=16).num_microbatches == 2
    assert plan_microbatches(decode, 4, "token", min_tokens=4).num_microbatches == 2
    with pytest.raises(ValueError, match="min_tokens"):
        plan_microbatches(decode, 2, "token", min_tokens=0)


# ----------------------------------------------------------------------------- adaptive m


def test_simulated_step_time_by_hand():
    """Two layers, a 2-token step, 1 unit per token on each side, no fixed costs: sync (m=1) takes
    2 x (2 + 2) = 8; two micro-batches ping-ponged take 2 x 2 x max(a, f) + min(a, f) = 5."""
    cost = CostModel(attn_token=1, attn_context=0, ffn_token=1, attn_call=0, ffn_call=0, transfer=0)
    one, two = (plan_microbatches([(0, 2)], m, "token", cost) for m in (1, 2))
    assert simulate_step(one, 2, cost) == 8 and simulate_step(two, 2, cost) == 5
    with_transfer = CostModel(attn_token=1, attn_context=0, ffn_token=1, attn_call=0, ffn_call=0, transfer=0.5)
    assert simulate_step(one, 2, with_transfer) == 2 * (2 + 2 + 2 * 0.5)
    assert choose_microbatches([[(0, 2)]], 2, 2, "token", cost) == (2, ((1, 8), (2, 5)))


def test_simulated_step_with_a_local_first_layer_by_hand():
    """Three layers, the first one's FFN half on the attention rank (free here: ``local_token`` 0, the next test
    charges it), 1 unit per token each side: sync takes 3 x 2 + 2 x 2 = 10; two micro-batches, each
    through the local layer and on to its first dispatch before the next starts, take 7 (the FFN side idle
    only for micro-batch 0's first two layers)."""
    cost = CostModel(attn_token=1, attn_context=0, ffn_token=1, attn_call=0, ffn_call=0, transfer=0)
    one, two = (plan_microbatches([(0, 2)], m, "token", cost) for m in (1, 2))
    assert simulate_step(one, 3, cost, local_layers=1) == 10 and simulate_step(two, 3, cost, local_layers=1) == 7
    assert simulate_step(one, 3, cost, local_layers=3) == simulate_step(two, 3, cost, local_layers=3) == 6  # nothing sent
    assert choose_microbatches([[(0, 2)]], 2, 3, "token", cost, local_layers=1) == (2, ((1, 10), (2, 7)))


def test_a_local_layers_mlp_is_charged_once_per_micro_batch_at_the_front_by_hand():
    """As above, with the local layer's MLP costing 2 a token on the attention rank (``local_token``): sync takes
    (2 + 4) + 2 x (2 + 2) = 14. Two micro-batches: micro-batch 0 through layer 0 (1 + 2) and layer 1's attention
    (1) leaves at 4, its FFN done at 5; micro-batch 1 the same by 8, FFN done at 9; layer 2 then alternates:
    attention 0 at 8-9, FFN 9-10; attention 1 at 9-10, FFN 10-11: 11. Every layer local: 3 x 6 = 18 either way.
    Several contributors: the slowest's local work per micro-batch (the ranks run theirs side by side)."""
    cost = CostModel(attn_token=1, attn_context=0, ffn_token=1, attn_call=0, ffn_call=0, transfer=0, local_token=2)
    one, two = (plan_microbatches([(0, 2)], m, "token", cost) for m in (1, 2))
    assert simulate_step(one, 3, cost, local_layers=1) == 14 and simulate_step(two, 3, cost, local_layers=1) == 11
    assert simulate_step(one, 3, cost, local_layers=3) == simulate_step(two, 3, cost, local_layers=3) == 18
    assert simulate_step(one, 3, cost) == 12  # no local layer: local_token charges nothing
    # ranks of 2 and 6 tokens, sync: (6 + 12) + (6 + 8) + (6 + 8) = 46 (the FFN side computes the 8-token union)
    assert choose_microbatches([[(0, 2)], [(0, 6)]], 2, 3, "token", cost, local_layers=1)[1][0] == (1, 46)


@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), min_size=1, max_size=5), m=st.integers(1, 4),
       layers=st.integers(1, 4), costs=st.tuples(*[st.floats(0.01, 5)] * 3, *[st.floats(0, 5)] * 3))
def test_simulated_time_is_bounded_by_the_work(chunks, m, layers, costs):
    """No resource finishes faster than its own work; nothing takes longer than doing everything in turn."""
    cost = CostModel(*costs)
    plan = plan_microbatches(chunks, m, "token", cost)
    a = [cost.attention_cost(p) for p in plan.pieces]
    f = [cost.ffn_cost(sum(sp.length for sp in p)) for p in plan.pieces]
    t = simulate_step(plan, layers, cost)
    assert t >= layers * max(sum(a), sum(f)) - 1e-9
    assert t <= layers * sum(x + y + 2 * cost.transfer for x, y in zip(a, f)) + 1e-9
    if plan.num_microbatches == 1:
        assert t == pytest.approx(layers * (a[0] + f[0] + 2 * cost.transfer))


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 300)), min_size=1, max_size=4), ranks=st.integers(2, 4),
       costs=st.tuples(*[st.floats(0.01, 5)] * 3, *[st.floats(0, 5)] * 3))
def test_contributors_attend_side_by_side_and_share_the_ffn_work(chunks, ranks, costs):
    """A step of several attention ranks with the same batch each: every rank computes its own attention at the same time,
    the FFN side computes the union once: each m's estimate is the step of one rank's cut whose FFN work per token were
    ``ranks`` times as much (not the step of one rank holding every batch, which the planner once simulated)."""
    cost = CostModel(*costs)
    m, estimates = choose_microbatches([chunks] * ranks, 4, 3, "token", cost)
    scaled = CostModel(*costs[:2], costs[2] * ranks, *costs[3:])
    expected = [(k, simulate_step(plan_microbatches(chunks, k, "token", cost), 3, scaled)) for k in range(1, min(4, sum(n for _, n in chunks)) + 1)]
    assert [k for k, _ in estimates] == [k for k, _ in expected]
    assert [t for _, t in estimates] == pytest.approx([t for _, t in expected])
    assert m in [k for k, _ in estimates]


def test_expert_reads_grow_with_tokens_and_saturate():
    """n tokens choosing k of E experts touch E(1 - (1 - k/E)^n) in expectation: k for one token, never
    more than E; splitting 8 decode tokens in two reads far fewer than twice the experts, splitting a
    512-token prefill reads them twice."""
    c = CostModel(num_experts=64, top_k=6)
    assert c.experts_touched(1) == pytest.approx(6) and c.experts_touched(10_000) == pytest.approx(64)
    assert all(c.experts_touched(n) < c.experts_touched(n + 1) <= 64 for n in range(1, 200))
    assert 2 * c.experts_touched(4) < 1.3 * c.experts_touched(8)
    assert 2 * c.experts_touched(256) == pytest.approx(2 * c.experts_touched(512), rel=1e-6)
    import random

    rng = random.Random(0)  # against counting: uniform routing, 2000 draws
    for n in (1, 4, 16):
        seen = [len({e for _ in range(n) for e in rng.sample(range(64), 6)}) for _ in range(2000)]
        assert sum(seen) / len(seen) == pytest.approx(c.experts_touched(n), rel=0.03)


def test_measured_ffn_curve_interpolates_and_decides():
    curve = ((1, 10.0), (8, 12.0), (512, 100.0), (1024, 400.0))  # superlinear at the top, as measured on V2-Lite
    c = CostModel(attn_token=0.05, attn_context=0, ffn_token=1, attn_call=5, ffn_call=0, transfer=0.1, ffn_curve=curve)
    assert c.ffn_cost(1) == 10 and c.ffn_cost(4) == pytest.approx(10 + 2 * 3 / 7) and c.ffn_cost(768) == pytest.approx(250)
    assert c.ffn_cost(2048) == pytest.approx(400 + 300 * 2)  # along the last segment beyond the curve
    assert choose_microbatches([[(0, 1024)]], 2, 4, "token", c)[0] == 2  # 2 x 100 < 400: split the prefill
    assert choose_microbatches([[(0, 8)]], 2, 4, "token", c)[0] == 1  # 2 x ~11 > 12: keep the decode whole
    with pytest.raises(ValueError, match="increasing tokens"):
        CostModel(ffn_curve=((8, 1.0), (4, 2.0)))


def test_choice_follows_the_costs():
    default = CostModel()
    decode = choose_microbatches([[(40, 1), (12, 1), (70, 1)]], 4, 4, "token", default)
    assert decode[0] == 1 and [m for m, _ in decode[1]] == [1, 2, 3]  # fixed costs dominate
    prefill = choose_microbatches([[(0, 400)]], 4, 4, "token", default)
    assert prefill[0] > 1  # overlap is worth its fixed costs
    assert [m for m, _ in choose_microbatches([[(0, 1)]], 4, 4, "token", default)[1]] == [1]  # one token: nothing to choose
    costly_calls = CostModel(ffn_call=1e6)
    assert choose_microbatches([[(0, 400)]], 4, 4, "token", costly_calls)[0] == 1
    # the request policy cannot split one request
    assert choose_microbatches([[(0, 400)]], 4, 4, "request", default)[0] == 1


def test_a_long_prefill_beside_decodes_splits_by_work_not_tokens():
    """32 decodes at context 2000 beside a 1024-token prefill chunk: attention costs what its keys are
    (sum over tokens of position + 1, as the paged attention computes), so the balanced cut is not the
    token count's half, and the planner's micro-batch costs equal that sum token by token."""
    cost = CostModel(attn_token=1.0, attn_context=0.02, ffn_token=2.0)
    chunks = [(2000, 1)] * 32 + [(0, 1024)]
    plan = plan_microbatches(chunks, 2, "token", cost)
    assert plan.imbalance < 1.02
    by_hand = [sum(cost.token_cost(p) for sp in piece for p in range(sp.start, sp.start + sp.length)) for piece in plan.pieces]
    assert all(abs(a - b) < 1e-6 * b for a, b in zip(plan.costs, by_hand))
    tokens = [sum(sp.length for sp in piece) for piece in plan.pieces]
    assert sum(tokens) == 32 + 1024 and abs(tokens[0] - tokens[1]) > 50  # not the halves of the token count
    halves = [sum(cost.token_cost(p) for p in ps) for ps in ([2000] * 32 + list(range(496)), range(496, 1024))]
    assert max(halves) / (sum(halves) / 2) > 1.1, "a token-count split would have been balanced too: the test cannot tell"
