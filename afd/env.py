"""Every ``AFD_*`` environment variable afd reads, in one place.

Read once, at the call site that needs it, through these functions: nothing
else in afd touches ``os.environ`` for an ``AFD_*`` name.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Name -> one-line description, for ``afd --help`` and the docs.
VARIABLES: dict[str, str] = {
    "AFD_MODEL": "default model directory for every command (overrides the built-in model)",
    "AFD_NUM_THREADS": "torch intra-op threads per process (default: torch's own choice)",
    "AFD_RUN_ID": "per-run id the launcher sets on every process it starts (a supervisor may preset it)",
    "AFD_IO_LOG": "1: log every connector send and receive header (INFO level)",
    "AFD_E2E_ATTENTION_DEVICES": "tests/e2e: the attention devices of every end-to-end case (default cpu)",
    "AFD_E2E_FFN_DEVICES": "tests/e2e: the FFN devices of every end-to-end case (default cpu,cpu)",
    "AFD_FFN_DELAY_MS": "testing/benchmarks only: FFN ranks sleep this long per computed batch (a slow FFN side)",
    "AFD_SEND_JITTER_MS": "testing only: every rank sleeps a random 0..N ms before each message it sends (arrival order varies)",
    "AFD_KERNELS": "0: never build or use afd's native CPU kernels (afd/kernels), run the pure-torch paths (default 1)",
    "AFD_FAULT": "testing only: inject a protocol fault on attention rank 0's N-th work message "
    "(corrupt-header|wrong-layer|wrong-seq|truncate[@N], default N=3); engine-step@N: the serving loop fails at step N; "
    "ffn-kill@N / ffn-hang@N: the last FFN rank SIGKILLs / SIGSTOPs itself on receiving its N-th work part",
}


def default_model() -> Path | None:
    value = os.environ.get("AFD_MODEL")
    return Path(value) if value else None


def num_threads() -> int | None:
    value = os.environ.get("AFD_NUM_THREADS")
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"AFD_NUM_THREADS must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"AFD_NUM_THREADS must be a positive integer, got {value!r}")
    return n


def run_id() -> str | None:
    return os.environ.get("AFD_RUN_ID") or None


def kernels_enabled() -> bool:
    """AFD_KERNELS (default on): whether afd builds and uses its native CPU kernels."""
    value = os.environ.get("AFD_KERNELS", "1")
    if value not in ("0", "1"):
        raise ValueError(f"AFD_KERNELS must be 0 or 1, got {value!r}")
    return value == "1"


def io_log() -> bool:
    return os.environ.get("AFD_IO_LOG", "") not in ("", "0")


def fault() -> tuple[str, int] | None:
    """Tests only (AFD_FAULT=KIND[@N]): a protocol fault in attention rank 0's N-th work message;
    ``engine-step``: the serving loop fails at its N-th step (a replica whose engine raises);
    ``ffn-kill`` / ``ffn-hang``: the last FFN rank dies (SIGKILL) or hangs (SIGSTOP) on receiving its N-th
    work part, so the unit is in flight when it goes (the attention side is dispatching or combining)."""
    value = os.environ.get("AFD_FAULT")
    if not value:
        return None
    kind, _, nth = value.partition("@")
    kinds = ("corrupt-header", "wrong-layer", "wrong-seq", "truncate", "engine-step", "ffn-kill", "ffn-hang")
    if kind not in kinds:
        raise ValueError(f"AFD_FAULT must be one of {', '.join(kinds)} (optionally @N), got {value!r}")
    return kind, int(nth or 3)


def ffn_delay() -> float:
    """Seconds an FFN rank sleeps per computed batch (AFD_FFN_DELAY_MS; 0 = off)."""
    value = os.environ.get("AFD_FFN_DELAY_MS")
    return float(value) / 1000 if value else 0.0


def e2e_devices() -> tuple[str, str]:
    """(attention devices, FFN devices) for the end-to-end cases, as --attention-devices/--ffn-devices values."""
    return os.environ.get("AFD_E2E_ATTENTION_DEVICES", "cpu"), os.environ.get("AFD_E2E_FFN_DEVICES", "cpu,cpu")


def send_jitter() -> float:
    """Most seconds a rank sleeps, at random, before each message it sends (AFD_SEND_JITTER_MS; 0 = off)."""
    value = os.environ.get("AFD_SEND_JITTER_MS")
    return float(value) / 1000 if value else 0.0
