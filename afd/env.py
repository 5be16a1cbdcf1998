"""Every ``AFD_*`` environment variable afd reads, in one place.

Read through these functions, once, where a run is configured (the command line, a launcher), and
passed on from there as configuration: nothing else in afd reads ``os.environ`` for an ``AFD_*`` name,
and nothing in afd writes one (a rank gets its run id and fault plan in its spec, and the run's
fork server is started with the run id in its environment).
"""

from __future__ import annotations

import os
from pathlib import Path

from afd.config import FaultPlan

#: Name -> one-line description, for ``afd --help`` and the docs.
VARIABLES: dict[str, str] = {
    "AFD_MODEL": "default model directory for every command (overrides the built-in model)",
    "AFD_NUM_THREADS": "torch intra-op threads per process (default: torch's own choice)",
    "AFD_RUN_ID": "the run id (default: a fresh one); every process of the run carries it in its environment",
    "AFD_IO_LOG": "1: log every connector send and receive header (INFO level)",
    "AFD_E2E_ATTENTION_DEVICES": "tests/e2e: the attention devices of every end-to-end case (default cpu)",
    "AFD_E2E_FFN_DEVICES": "tests/e2e: the FFN devices of every end-to-end case (default cpu,cpu)",
    "AFD_FFN_DELAY_MS": "testing/benchmarks only: FFN ranks sleep this long per computed batch (a slow FFN side)",
    "AFD_SEND_JITTER_MS": "testing only: every rank sleeps a random 0..N ms before each message it sends (arrival order varies)",
    "AFD_KERNELS": "0: never build or use afd's native CPU kernels (afd/kernels), run the pure-torch paths (default 1)",
    "AFD_KERNELS_MARCH": "the CPU the native kernels are built for, as gcc's -march (default native; x86-64-v3: the AVX2 "
                         "paths only, as an AVX2 CPU runs them, on a newer one)",
    "AFD_FAULT": "testing only: inject a protocol fault on attention rank 0's N-th work message "
    "(corrupt-header|wrong-layer|wrong-seq|truncate[@N], default N=3); engine-step@N: a replica's N-th step raises; "
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


def kernels_march() -> str:
    """AFD_KERNELS_MARCH (default native): gcc's -march for the native kernels' build."""
    value = os.environ.get("AFD_KERNELS_MARCH", "native")
    if not value or not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(f"AFD_KERNELS_MARCH must be a gcc -march name such as native or x86-64-v3, got {value!r}")
    return value


def io_log() -> bool:
    return os.environ.get("AFD_IO_LOG", "") not in ("", "0")


def fault_plan() -> FaultPlan | None:
    """The faults to inject (tests and benchmarks only): None unless ``AFD_FAULT``, ``AFD_SEND_JITTER_MS`` or
    ``AFD_FFN_DELAY_MS`` is set (afd/config.py, :class:`FaultPlan`)."""
    fault = os.environ.get("AFD_FAULT") or None
    jitter = _milliseconds("AFD_SEND_JITTER_MS")
    delay = _milliseconds("AFD_FFN_DELAY_MS")
    if fault is None and not jitter and not delay:
        return None
    kind, nth = None, 3
    if fault is not None:
        kind, _, n = fault.partition("@")
        try:
            nth = int(n or 3)
        except ValueError:
            raise ValueError(f"AFD_FAULT must be KIND[@N] with an integer N, got {fault!r}") from None
    return FaultPlan(kind, nth, send_jitter=jitter, ffn_delay=delay)


def _milliseconds(name: str) -> float:
    """A variable in milliseconds, as seconds (unset: 0)."""
    value = os.environ.get(name)
    if not value:
        return 0.0
    try:
        return float(value) / 1000
    except ValueError:
        raise ValueError(f"{name} must be a number of milliseconds, got {value!r}") from None


def e2e_devices() -> tuple[str, str]:
    """(attention devices, FFN devices) for the end-to-end cases, as --attention-devices/--ffn-devices values."""
    return os.environ.get("AFD_E2E_ATTENTION_DEVICES", "cpu"), os.environ.get("AFD_E2E_FFN_DEVICES", "cpu,cpu")
