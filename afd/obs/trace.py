"""Runtime traces in the Chrome trace-event format (opens in Perfetto / chrome://tracing).

Spans are recorded at run time on each rank -- attention ranks per (micro-batch,
layer, action), FFN ranks per computed batch (layer, the micro-batches it
served) -- with ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every
process of a host). Plan degradations appear as instant events.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

INSTANTS = ("degraded", "plan", "ffn_lost", "ffn_joined", "placement")  # drawn as instants, with their note
COLORS = {"attention": "#4C72B0", "local_ffn": "#DA8BC3", "dispatch": "#DD8452", "combine": "#55A868", "shared": "#937860", "merge": "#8C8C8C", "ffn": "#C44E52", "degraded": "#8172B3"}


def chrome_trace(attention: dict[str, Sequence], ffn: dict[str, Sequence[tuple]]) -> dict:
    """attention: rank name -> TraceEvents; ffn: rank name -> FFN spans. Returns the trace JSON object."""
    events: list[dict] = []
    starts = [e.start for evs in attention.values() for e in evs] + [s[0] for spans in ffn.values() for s in spans]
    t0 = min(starts) if starts else 0.0
    pid = 0
    for name, evs in attention.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        for e in evs:
            if e.action in INSTANTS:  # instants: a plan that degraded, an adaptive choice of m, a fault and its handling
                events.append({"ph": "i", "s": "p", "name": e.action, "pid": pid, "tid": 0, "ts": 1e6 * (e.start - t0), "args": {"why": e.note, "seq": e.seq}})
                continue
            events.append({
                "ph": "X", "cat": e.action, "name": f"{e.action} L{e.layer} mb{e.microbatch}", "pid": pid, "tid": 0,
                "ts": 1e6 * (e.start - t0), "dur": 1e6 * (e.end - e.start),
                "args": {"layer": e.layer, "microbatch": e.microbatch, "seq": e.seq, "in_flight": e.in_flight},
            })
        pid += 1
    for name, spans in ffn.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        for start, end, layer, items, rows in spans:
            mbs = ",".join(f"a{a}mb{m}" for a, m, _ in items)
            events.append({
                "ph": "X", "cat": "ffn", "name": f"ffn L{layer} {mbs}", "pid": pid, "tid": 0,
                "ts": 1e6 * (start - t0), "dur": 1e6 * (end - start),
                "args": {"layer": layer, "items": [list(i) for i in items], "rows": rows},
            })
        pid += 1
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, trace: dict) -> None:
    Path(path).write_text(json.dumps(trace))


def plot_trace(trace_path: str | Path, out_path: str | Path, title: str | None = None) -> None:
    """Draw the trace as a timeline: one row per rank, one bar per span, colored by phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    trace = json.loads(Path(trace_path).read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    rows = sorted(names)
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.7 * len(rows)))
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            y = rows.index(e["pid"])
            color = COLORS.get(e.get("cat", ""), "#999999")
            ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, 0.01))], (y - 0.35, 0.7), facecolors=color, edgecolor="none")
            if e.get("cat") in ("attention", "ffn") and e["dur"] > 0:
                mb = e["args"].get("microbatch")
                if mb is not None:
                    ax.text(e["ts"] / 1e3 + e["dur"] / 2e3, y, str(mb), ha="center", va="center", fontsize=6, color="white")
        elif e.get("ph") == "i":
            ax.axvline(e["ts"] / 1e3, color=COLORS["degraded"], linewidth=0.6, linestyle=":")
    ax.set_yticks(range(len(rows)), [names[p] for p in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title or Path(trace_path).name)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper right", fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(out_path, dpi=130)
    plt.close(fig)


