"""``afd capture diff A B``: the first layer, boundary and request position where two captures diverge."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capture", help="work with tensor captures written by --capture")
    csub = p.add_subparsers(dest="capture_command", required=True)
    d = csub.add_parser("diff", help="compare two captures (files or directories) token by token")
    d.add_argument("a", help="reference capture (file or directory)")
    d.add_argument("b", help="capture to check")
    d.add_argument("--rtol", type=float, default=1e-5, help="per-row tolerance: rtol * max(1, |a|_inf) (default 1e-5, fp32)")
    d.set_defaults(func=run_diff)


def run_diff(args: argparse.Namespace) -> int:
    from afd.obs.capture import diff_captures, load_capture

    a, b = load_capture(args.a), load_capture(args.b)
    divergence, only, compared = diff_captures(a, b, args.rtol)
    if only:
        print(f"{len(only)} entries in only one capture, e.g. {', '.join(only[:4])}")
    if divergence is not None:
        print(divergence)
        return 1
    print(f"no divergence: {compared} token rows compared within rtol {args.rtol}")
    return 0
