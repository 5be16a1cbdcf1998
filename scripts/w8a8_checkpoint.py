"""A W8A8 copy of a single-file checkpoint, as llm-compressor's round-to-nearest W8A8 writes it (compressed-tensors
int-quantized): for benchmarks and for serving the same files with afd and vLLM.

    python scripts/w8a8_checkpoint.py SRC DST [--ignore lm_head 're:.*mlp\\.gate$']
"""

from __future__ import annotations

import argparse

from afd.models.int8 import quantize_checkpoint


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--ignore", nargs="*", default=["lm_head", r"re:.*mlp\.gate$"])
    ap.add_argument("--strategy", choices=["channel", "tensor"], default="channel")
    args = ap.parse_args()
    decoded = quantize_checkpoint(args.src, args.dst, tuple(args.ignore), args.strategy)
    print(f"{len(decoded)} weights int8 in {args.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
