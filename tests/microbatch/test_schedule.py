from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afd.microbatch import Action, ping_pong


@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 8), st.data())
def test_schedule_is_complete_causal_and_within_credits(m, layers, credits, data):
    local = data.draw(st.integers(0, layers), label="local layers")
    steps = list(ping_pong(m, layers, credits, local))
    seen = {}
    for i, s in enumerate(steps):
        key = (s.microbatch, s.layer, s.action)
        assert key not in seen, f"{key} twice"
        seen[key] = i
    assert len(steps) == 3 * m * layers
    for mb in range(m):
        for layer in range(layers):
            a, d, c = (seen[(mb, layer, x)] for x in (Action.ATTENTION, Action.DISPATCH, Action.COMBINE))
            assert a < d < c
            if layer < local:
                assert d == a + 1 and c == d + 1  # computed here: nothing can come between
            if layer:
                assert seen[(mb, layer - 1, Action.COMBINE)] < a  # a layer needs the previous layer's output
            if mb:
                assert seen[(mb - 1, layer, Action.ATTENTION)] < a  # earlier pieces' KV is written first (token split)
    in_flight = peak = 0  # messages to the FFN side: the local layers' take no credit
    for s in steps:
        if s.layer >= local:
            in_flight += {Action.DISPATCH: 1, Action.COMBINE: -1}.get(s.action, 0)
        peak = max(peak, in_flight)
        assert in_flight <= credits
    assert peak == (min(m, credits) if local < layers else 0)


def test_without_local_layers_every_microbatch_runs_a_layer_before_any_runs_the_next():
    order = [s.layer for s in ping_pong(3, 4) if s.action is Action.ATTENTION]
    assert order == sorted(order)


@pytest.mark.parametrize("m, layers, local", [(2, 4, 1), (3, 4, 2), (4, 27, 1), (2, 3, 3)])
def test_local_layers_run_one_microbatch_ahead_so_the_first_dispatch_leaves_after_one_microbatchs_fill(m, layers, local):
    """Before the first message to the FFN side only micro-batch 0 runs: its local layers and the first remote
    layer's attention (layer-major, every micro-batch's local layers would come first)."""
    steps = list(ping_pong(m, layers, None, local))
    first = next((i for i, s in enumerate(steps) if s.action is Action.DISPATCH and s.layer >= local), len(steps))
    if local == layers:  # nothing remote: each micro-batch runs through the whole model in turn
        assert [s.microbatch for s in steps] == sorted(s.microbatch for s in steps)
        return
    assert {s.microbatch for s in steps[: first + 1]} == {0}
    assert first == 3 * local + 1
    for mb in range(1, m):  # and the next micro-batch's fill overlaps the previous one's first remote layer
        own = [i for i, s in enumerate(steps) if s.microbatch == mb and s.layer < local]
        back = next(i for i, s in enumerate(steps) if (s.microbatch, s.layer, s.action) == (mb - 1, local, Action.COMBINE))
        assert max(own) < back


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
    with pytest.raises(ValueError):
        list(ping_pong(2, 2, local=3))
