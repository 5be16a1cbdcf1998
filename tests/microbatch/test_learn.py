"""The auto planner's learned costs (afd/microbatch/learn.py): recovered from noisy observations of a known
machine, withheld until enough is seen, and what the plan chooses from them."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd.config import CostModel, PipelineConfig
from afd.attention.steps import decide
from afd.microbatch.learn import MIN_STEPS, WARMUP_STEPS, CostLearner, nonnegative_least_squares, pack_costs, unpack_costs

# The "machine" the observations come from: attention linear in tokens and context, the FFN side a call cost, a
# per-token cost and a read of every expert the micro-batch touches (64 experts, top 6): not linear in tokens.
ATTN_CALL, ATTN_TOKEN, ATTN_CONTEXT = 150e-6, 4e-6, 3e-9
TRANSFER = 60e-6


def ffn_true(n: int) -> float:
    return 200e-6 + 1.5e-6 * n + 25e-6 * 64 * (1 - (1 - 6 / 64) ** n)


def context(spans) -> float:
    return sum(n * s + n * (n + 1) / 2 for s, n in spans)


def observe_steps(learner: CostLearner, steps: int, rng: random.Random, sizes=None) -> None:
    """Steps of one micro-batch each: decode batches and prefills of random sizes, times with +-5 % noise,
    round trips that sometimes wait behind other work (never faster than the wire)."""
    for _ in range(steps):
        if sizes is not None:
            spans = [(rng.randint(50, 900), 1) for _ in range(rng.choice(sizes))]
        elif rng.random() < 0.7:
            spans = [(rng.randint(10, 900), 1) for _ in range(rng.randint(1, 32))]
        else:
            spans = [(0, rng.randint(64, 2048))]
        n = sum(length for _, length in spans)
        attn = (ATTN_CALL + ATTN_TOKEN * n + ATTN_CONTEXT * context(spans)) * rng.uniform(0.95, 1.05)
        learner.observe([(n, context(spans), attn)], [(n, ffn_true(n) * rng.uniform(0.95, 1.05))],
                        [TRANSFER + rng.expovariate(1 / 200e-6) * (rng.random() < 0.5)])


def test_the_learner_recovers_the_costs_it_is_shown():
    rng = random.Random(0)
    learner = CostLearner()
    observe_steps(learner, WARMUP_STEPS + MIN_STEPS - 1, rng)
    assert learner.model is None  # not enough seen yet: the planner keeps its configured model
    observe_steps(learner, 400, rng)
    model = learner.model
    assert model is not None and learner.fits >= 400 // 16
    assert model.attn_call == pytest.approx(ATTN_CALL, rel=0.15)
    assert model.attn_token == pytest.approx(ATTN_TOKEN, rel=0.1)
    assert model.attn_context == pytest.approx(ATTN_CONTEXT, rel=0.1)
    assert TRANSFER <= model.transfer < TRANSFER * 1.5  # the wire, not the queueing
    assert len(model.ffn_curve) >= 5  # decode sizes 1..32 and prefills 64..2048: several size classes
    for n in (1, 3, 8, 20, 100, 300, 700, 1500, 2048):  # between and at the learned points: the curve's shape
        assert model.ffn_cost(n) == pytest.approx(ffn_true(n), rel=0.15), n


def test_a_local_layers_mlp_is_learned_apart_from_attention():
    """A model whose first layer's MLP runs beside attention: the runner reports its time apart (per micro-batch
    and local layer), and the learner fits it as local_call + local_token * tokens without moving the attention
    fit (which it would, spread over every layer, were the two summed)."""
    rng = random.Random(4)
    learner = CostLearner()
    for _ in range(300):
        n = rng.choice([rng.randint(1, 32), rng.randint(64, 2048)])
        spans = [(rng.randint(10, 900), 1) for _ in range(n)] if n <= 32 else [(0, n)]
        attn = (ATTN_CALL + ATTN_TOKEN * n + ATTN_CONTEXT * context(spans)) * rng.uniform(0.95, 1.05)
        local = (300e-6 + 40e-6 * n) * rng.uniform(0.95, 1.05)
        learner.observe([(n, context(spans), attn)], [(n, ffn_true(n))], [TRANSFER], [(n, local)])
    model = learner.model
    assert model.local_call == pytest.approx(300e-6, rel=0.2) and model.local_token == pytest.approx(40e-6, rel=0.05)
    assert model.attn_token == pytest.approx(ATTN_TOKEN, rel=0.1) and model.attn_call == pytest.approx(ATTN_CALL, rel=0.2)
    assert unpack_costs(pack_costs(model)) == model  # a vote carries it


def test_no_model_until_the_ffn_side_was_seen_at_two_sizes():
    """Decode steps of one size class only: a curve of one point cannot say what a split costs."""
    learner = CostLearner()
    observe_steps(learner, 100, random.Random(1), sizes=[16, 20, 31])
    assert learner.model is None
    observe_steps(learner, MIN_STEPS, random.Random(2), sizes=[40])
    assert learner.model is not None and len(learner.model.ffn_curve) == 2


def test_a_learned_model_travels_in_a_vote_unchanged():
    learner = CostLearner()
    observe_steps(learner, 60, random.Random(3))
    assert unpack_costs(pack_costs(learner.model)) == learner.model and unpack_costs(pack_costs(None)) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 1e4), st.floats(-1, 1)), min_size=4, max_size=40),
       st.tuples(st.floats(-3, 3), st.floats(-1, 1), st.floats(-1e-3, 1e-3)))
def test_nonnegative_least_squares_meets_the_optimality_conditions(points, coefficients):
    """Checked by the KKT conditions of the convex problem (an optimality certificate, independent of how it
    was solved): b >= 0; the gradient X^T (X b - y) is ~0 where b > 0 and >= ~0 where b = 0."""
    rows = [(1.0, a, c) for a, c, _ in points]
    y = [coefficients[0] + coefficients[1] * a + coefficients[2] * c + e for a, c, e in points]
    b = nonnegative_least_squares(rows, y)
    x, yt, bt = torch.tensor(rows, dtype=torch.float64), torch.tensor(y, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    scale = x.abs().amax(0).clamp_min(1e-300)
    xs = x / scale  # the problem in the solver's units: tolerances relative to each column's size
    grad = xs.T @ (xs @ (bt * scale) - yt)
    tol = 1e-6 * (1 + yt.abs().sum().item()) * len(rows)
    assert (bt >= 0).all()
    assert (grad[bt * scale > 1e-9].abs() <= tol).all(), (b, grad)
    assert (grad >= -tol).all(), (b, grad)


# ----------------------------------------------------------------------------- what the plan does with them

AUTO = PipelineConfig("async", 4, "token", adaptive=True)
# Learned on a weight-bound FFN side: a micro-batch costs ~1 ms below 64 tokens however small (the expert reads),
# then grows per token; attention ~2 us a token.
WEIGHT_BOUND = CostModel(attn_token=2e-6, attn_context=1e-10, ffn_token=1e-6, attn_call=100e-6, ffn_call=900e-6, transfer=50e-6,
                         ffn_curve=((8, 0.9e-3), (16, 0.95e-3), (64, 1.0e-3), (512, 1.5e-3), (2048, 3.2e-3)))


def test_the_learned_costs_decide_m_not_the_configured_ones():
    """Every member plans with the first learned model voted (member order): a decode step stays whole (halving it
    halves no expert read), a long prefill is split (its attention and FFN halves overlap), and on an FFN side whose
    cost a split does not shrink (every micro-batch reads every expert), beside little attention, the prefill stays whole. The configured model (relative units) is not used once one is voted."""
    decode = ((500, 1),) * 16
    prefill = ((0, 2048),)
    configured = CostModel()

    def plan(votes, learned):
        return decide(0, 1, range(len(votes)), votes, AUTO, 4, configured, learned=learned)

    assert plan([decode], [WEIGHT_BOUND]).num_microbatches == 1
    split = plan([prefill], [WEIGHT_BOUND])
    assert split.num_microbatches >= 2 and split.learned and split.cost == WEIGHT_BOUND
    flat = CostModel(**{**WEIGHT_BOUND.__dict__, "attn_token": 2e-7, "ffn_curve": ((8, 3.0e-3), (2048, 3.2e-3))})
    assert plan([prefill], [flat]).num_microbatches == 1
    # two members: the first member's model decides, whoever computes the plan
    both = plan([prefill, decode], [flat, WEIGHT_BOUND])
    assert both.cost == flat and both.num_microbatches == 1
    later = plan([prefill, decode], [None, WEIGHT_BOUND])
    assert later.cost == WEIGHT_BOUND and later.num_microbatches >= 2
    assert len(later.union_tokens) == later.num_microbatches and sum(later.union_tokens) == 2048 + 16  # every row, once
    unlearned = plan([prefill], [None])
    assert not unlearned.learned and unlearned.cost == configured



def test_the_runner_shows_the_learner_its_local_layers_apart_from_attention():
    """DisaggregatedRunner._learn: a micro-batch's work here over the step, less its local layers' MLP time, per layer is the
    attention sample; the MLP time per local layer is the local sample (the runner times both, disagg_runner.run)."""
    from types import SimpleNamespace

    from afd.attention.disagg_runner import DisaggregatedRunner, _Microbatch
    from afd.microbatch import MicrobatchPlan, Span

    seen = {}
    runner = DisaggregatedRunner.__new__(DisaggregatedRunner)  # only what _learn reads
    runner.model = SimpleNamespace(config=SimpleNamespace(num_layers=4))
    runner.local_layers, runner.ffn_busy_s = 1, 0.0
    runner.learner = SimpleNamespace(observe=lambda *a: seen.setdefault("args", a))
    pieces = ((Span(0, 0, 6),), (Span(0, 6, 2),))
    runner.last_plan = MicrobatchPlan(pieces, (1.0, 1.0), 2, "token")
    mbs = [_Microbatch(0, None, None, work_s=1.0, local_s=0.4, ffn_s=0.3, ffn_layers=3, wire_s=0.02),
           _Microbatch(1, None, None, work_s=0.5, local_s=0.2, ffn_s=0.15, ffn_layers=3, wire_s=0.04)]
    runner._learn(SimpleNamespace(union_tokens=(6, 2)), mbs)
    attention, ffn, transfer, local = seen["args"]
    assert [(n, s) for n, _, s in attention] == [(6, pytest.approx(0.6 / 4)), (2, pytest.approx(0.3 / 4))]
    assert local == [(6, pytest.approx(0.4)), (2, pytest.approx(0.2))] and ffn == [(6, pytest.approx(0.1)), (2, pytest.approx(0.05))]
    assert transfer == [0.01, 0.02] and runner.ffn_busy_s == pytest.approx(0.45)
