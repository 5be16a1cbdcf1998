"""``afd trace plot TRACE.json -o OUT.png``: draw a runtime trace as a timeline picture."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="work with runtime traces written by --trace")
    tsub = p.add_subparsers(dest="trace_command", required=True)
    plot = tsub.add_parser("plot", help="draw a trace as a timeline (PNG)")
    plot.add_argument("trace_file")
    plot.add_argument("-o", "--output", required=True)
    plot.add_argument("--title")
    plot.set_defaults(func=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    from afd.obs.trace import plot_trace

    plot_trace(args.trace_file, args.output, args.title)
    print(f"timeline written to {args.output}", file=sys.stderr)
    return 0
