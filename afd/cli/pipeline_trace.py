"""What a traced pipeline run says about its overlap (``afd bench pipeline``): each side's own work, the overlap's
ideal from a sync run, what splitting the step cost each side, and the share spent filling and draining.

A run's window is (start, end, the attention rank's busy seconds in its trace); the FFN rank's spans are
(start, end, ...) of each union it computed, on the same clock (``time.perf_counter``: one clock per host).
"""

from __future__ import annotations

from collections import defaultdict

from afd.microbatch.planner import simulate_schedule

BUSY = ("attention", "local_ffn", "dispatch", "shared", "merge")  # the attention rank's own work in its trace (the rest: waiting on the FFN side)


def run_window(events) -> tuple[float, float, float]:
    """A traced run's window: (its first event's start, its last event's end, the attention rank's busy seconds)."""
    return min(e.start for e in events), max(e.end for e in events), sum(e.end - e.start for e in events if e.action in BUSY)


def side_work(window: tuple[float, float, float], spans) -> tuple[float, float]:
    """(T_attn, T_ffn) of one traced run (``window``: (start, end, attention busy seconds)): T_ffn is the FFN
    rank's ``spans`` ((start, end, ...) of each computed union, on the attention rank's clock) within the run, cut
    at its edges."""
    start, end, attn = window
    return attn, sum(min(b, end) - max(a, start) for a, b, *_ in spans if b > start and a < end)


def overlap_ideals(windows, spans) -> tuple[list[float], list[float], list[float]]:
    """Per sync run (``windows``: (start, end, attention busy seconds)), the overlap's ideal (T_attn + T_ffn) /
    max(T_attn, T_ffn), the run's slack 1 - (T_attn + T_ffn) / its length (:func:`side_work`), and its reach, its
    length / max(T_attn, T_ffn): the most any overlap could gain on this run. The ideal assumes a serial sync run;
    one that already overlaps some of its work (the shared experts beside the FFN side's routed ones) is shorter
    than T_attn + T_ffn, and then its reach is below the ideal."""
    ideals, slack, reach = [], [], []
    for window in windows:
        attn, ffn = side_work(window, spans)
        length = window[1] - window[0]
        ideals.append((attn + ffn) / max(attn, ffn, 1e-9))
        slack.append(max(0.0, 1 - (attn + ffn) / length))
        reach.append(length / max(attn, ffn, 1e-9))
    return ideals, slack, reach


def split_costs(sync_windows, split_windows, spans) -> list[dict[str, float]]:
    """Per round, what splitting the step cost each side: its work in the split run over its work in the sync
    run (``attention``, ``ffn``); ``bound``, the most the split run could gain on the sync one with its own
    work overlapped perfectly, (T_attn + T_ffn of the sync run) / max(T_attn, T_ffn of the split run); and
    ``reach``, the same against the sync run's own length (below ``bound`` where the sync run overlaps some work)."""
    out = []
    for sync, split in zip(sync_windows, split_windows):
        (a_s, f_s), (a_m, f_m) = side_work(sync, spans), side_work(split, spans)
        most = max(a_m, f_m, 1e-9)
        out.append({"attention": a_m / max(a_s, 1e-9), "ffn": f_m / max(f_s, 1e-9), "bound": (a_s + f_s) / most,
                    "reach": (sync[1] - sync[0]) / most})
    return out


def schedule_bound(events, spans, m: int) -> float:
    """A traced sync run's length under the ping-pong schedule of ``m`` micro-batches, simulated with the run's own
    work (:func:`afd.microbatch.planner.simulate_schedule`): per step, each layer's attention-side work before its
    dispatch (attention, a local layer's FFN half, the dispatch), at its combine (the shared experts before the wait,
    the merge after) and the FFN rank's (its unions of that layer within the step), split evenly over the
    micro-batches; no transfer time and no cost of splitting; the time between steps as it was. The order the issue's
    ideal leaves out is in it: nothing leaves before micro-batch 0's local layers, and every layer waits for the one
    before. The run's length over it is the most that schedule could gain on the run."""
    steps: dict[int, list] = defaultdict(list)
    for e in events:
        if e.action in (*BUSY, "combine"):
            steps[e.seq].append(e)
    start, end = min(e.start for e in events), max(e.end for e in events)
    total = end - start
    for evs in steps.values():
        a, b = min(e.start for e in evs), max(e.end for e in evs)
        layers = 1 + max(e.layer for e in evs)
        pre, shared, merge, ffn = ([0.0] * layers for _ in range(4))
        for e in evs:
            work = {"shared": shared, "merge": merge, "combine": None}.get(e.action, pre)
            if work is not None:
                work[e.layer] += e.end - e.start
        for s0, s1, layer, *_ in spans:
            if s1 > a and s0 < b and layer < layers:
                ffn[layer] += min(s1, b) - max(s0, a)
        local = min((e.layer for e in evs if e.action == "dispatch"), default=layers)
        for layer in range(local):  # a local layer's combine is not simulated (nothing sent): its work in the layer's own
            pre[layer] += shared[layer] + merge[layer]
        total += simulate_schedule(lambda k, l: pre[l] / m, lambda k, l: ffn[l] / m, m, layers, local_layers=local,
                                   combine=lambda k, l: (shared[l] / m, merge[l] / m)) - (b - a)
    return total


def fill_drain(events) -> float:
    """Share of the run's step time spent filling and draining the pipeline: per step, from its first
    attention to its first dispatch (the FFN side has nothing yet), and from its last dispatch to its
    last combine (the attention side has nothing left)."""
    steps: dict[int, list] = {}
    for e in events:
        if e.action in (*BUSY, "combine"):
            steps.setdefault(e.seq, []).append(e)
    edge = total = 0.0
    for evs in steps.values():
        start, end = min(e.start for e in evs), max(e.end for e in evs)
        dispatches = [e for e in evs if e.action == "dispatch"]
        if not dispatches:  # nothing sent (every layer computed here): no pipeline to fill
            continue
        edge += (min(e.start for e in dispatches) - start) + (end - max(e.end for e in dispatches))
        total += end - start
    return edge / total if total else 0.0
