from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afd.microbatch import Action, ping_pong


@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 8))
def test_schedule_is_complete_causal_and_within_credits(m, layers, credits):
    steps = list(ping_pong(m, layers, credits))
    seen = {}
    for i, s in enumerate(steps):
        key = (s.microbatch, s.layer, s.action)
        assert key not in seen, f"{key} twice"
        seen[key] = i
    for mb in range(m):
        for layer in range(layers):
            a, d, c = (seen[(mb, layer, x)] for x in (Action.ATTENTION, Action.DISPATCH, Action.COMBINE))
            assert a < d < c
            if layer:
                assert seen[(mb, layer - 1, Action.COMBINE)] < a  # a layer needs the previous layer's output
            if mb:
                assert seen[(mb - 1, layer, Action.ATTENTION)] < a  # earlier pieces' KV is written first (token split)
    in_flight = peak = 0
    for s in steps:
        in_flight += {Action.DISPATCH: 1, Action.COMBINE: -1}.get(s.action, 0)
        peak = max(peak, in_flight)
    assert peak == min(m, credits)


def test_attention_of_the_next_microbatch_overlaps_the_previous_ones_transfer():
    steps = [(s.microbatch, s.layer, s.action) for s in ping_pong(2, 3)]
    for layer in range(3):
        assert steps.index((1, layer, Action.ATTENTION)) < steps.index((0, layer, Action.COMBINE))


def test_fill_and_drain_cost_at_most_one_microbatch_attention():
    """Attention steps with nothing in flight (the pipeline bubble): only the very first one."""
    for m in range(2, 6):
        in_flight, idle_attention = 0, 0
        for s in ping_pong(m, 4):
            if s.action is Action.ATTENTION and in_flight == 0:
                idle_attention += 1
            in_flight += {Action.DISPATCH: 1, Action.COMBINE: -1}.get(s.action, 0)
        assert idle_attention == 1


def test_bad_arguments():
    with pytest.raises(ValueError):
        list(ping_pong(0, 2))
    with pytest.raises(ValueError):
        list(ping_pong(2, 2, credits=0))
