"""`afd bench pipeline`'s overlap ideal: the attention rank's own work and the FFN rank's unions within each sync run."""

from __future__ import annotations

import pytest

from afd.cli.pipeline_trace import overlap_ideals


def test_the_ideal_takes_each_side_s_own_work_within_its_run():
    # two sync runs: 0-10 s (attention busy 3 s) and 20-30 s (attention busy 6 s)
    windows = [(0.0, 10.0, 3.0), (20.0, 30.0, 6.0)]
    spans = [(-1.0, 1.0, 1, (), 8),  # straddles the first run's start: 1 s of it inside
             (2.0, 6.0, 1, (), 8),  # 4 s inside
             (12.0, 18.0, 1, (), 8),  # between the runs (an async run's): in neither
             (21.0, 23.0, 2, (), 8), (29.0, 31.0, 2, (), 8)]  # 2 s, and 1 s of the straddling one
    ideals, slack, reach = overlap_ideals(windows, spans)
    assert ideals == pytest.approx([(3 + 5) / 5, (6 + 3) / 6])
    assert slack == pytest.approx([1 - 8 / 10, 1 - 9 / 10])
    assert reach == pytest.approx([10 / 5, 10 / 6])  # serial runs with slack: the run's length over the larger side


def test_a_sync_run_that_overlaps_some_work_reaches_less_than_the_ideal():
    # attention busy 4 s, the FFN 5 s, in a run of 6 s: 3 s of the two overlapped (shared experts beside routed ones)
    ideals, slack, reach = overlap_ideals([(0.0, 6.0, 4.0)], [(0.5, 5.5, 1, (), 8)])
    assert ideals == pytest.approx([9 / 5]) and slack == [0.0]
    assert reach == pytest.approx([6 / 5])  # what any overlap could still gain on this run


def test_a_run_without_ffn_work_has_the_ideal_one():
    ideals, slack, reach = overlap_ideals([(0.0, 4.0, 2.0)], [])
    assert ideals == [1.0] and slack == pytest.approx([0.5]) and reach == pytest.approx([2.0])


def test_a_split_run_s_cost_is_each_side_s_work_against_the_sync_run_s():
    from afd.cli.pipeline_trace import split_costs

    sync = [(0.0, 10.0, 3.0)]  # attention 3 s; the FFN's 5 s below
    split = [(20.0, 28.0, 3.3)]  # attention 3.3 s; the FFN's 6 s below
    spans = [(1.0, 6.0, 1, (), 8), (20.0, 26.0, 1, (), 4)]
    (cost,) = split_costs(sync, split, spans)
    assert cost["attention"] == pytest.approx(1.1) and cost["ffn"] == pytest.approx(1.2)
    assert cost["bound"] == pytest.approx((3 + 5) / 6)  # not the sync run's ideal (3 + 5) / 5: the split's FFN work is 6 s
    assert cost["reach"] == pytest.approx(10 / 6)  # the sync run's 10 s (2 s of slack) over the split's larger side


def test_the_schedule_bound_runs_the_sync_run_s_own_work_through_the_schedule():
    from afd.attention.disagg_runner import TraceEvent
    from afd.cli.pipeline_trace import schedule_bound

    def step(seq, t):  # a local first layer (attention 1 s, its MLP 3 s, its merge 0.5 s), an MoE layer (attention 1 s,
        # shared experts 1 s, then the wait)
        return [TraceEvent(t + 0, t + 1, "attention", 0, 0, seq, 0), TraceEvent(t + 1, t + 4, "local_ffn", 0, 0, seq, 0),
                TraceEvent(t + 4, t + 4, "combine", 0, 0, seq, 0), TraceEvent(t + 4, t + 4.5, "merge", 0, 0, seq, 0),
                TraceEvent(t + 4.5, t + 5.5, "attention", 0, 1, seq, 0), TraceEvent(t + 5.5, t + 5.5, "dispatch", 0, 1, seq, 1),
                TraceEvent(t + 5.5, t + 6.5, "shared", 0, 1, seq, 1), TraceEvent(t + 6.5, t + 9.5, "combine", 0, 1, seq, 1),
                TraceEvent(t + 9.5, t + 9.5, "merge", 0, 1, seq, 0)]

    events = step(1, 0.0) + step(2, 10.5)  # 1 s between the steps
    spans = [(5.5, 9.5, 1, (), 8), (16.0, 20.0, 1, (), 8)]  # the FFN's 4 s of each step's MoE layer
    assert schedule_bound(events, spans, 1) == pytest.approx(20.0)  # one micro-batch: the run as it ran
    # two: micro-batch 0 through the local layer to its dispatch (2.25 + 0.5 s), its FFN half 2 s (to 4.75 s);
    # micro-batch 1 through them (to 5.5 s), its FFN half 5.5-7.5 s; the combines: shared 0.5 s each, the last at 7.5 s
    assert schedule_bound(events, spans, 2) == pytest.approx(7.5 + 1.0 + 7.5)
