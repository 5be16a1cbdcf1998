"""``afd``: the command line entry point."""

from __future__ import annotations

import argparse
import sys

from afd import __version__
from afd.cli import bench, capture, generate, serve, trace
from afd.cli.common import setup_process


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="afd", description="MoE serving with Attention-FFN Disaggregation")
    p.add_argument("--version", action="version", version=f"afd {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log the resolved configuration and progress")
    sub = p.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    trace.add_parser(sub)
    capture.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_process(args.verbose)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"afd: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a port already in use
        print(f"afd: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a rank failed, a link broke: the message names the rank
        print(f"afd: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("afd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
