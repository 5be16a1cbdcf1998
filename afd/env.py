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
    "AFD_RUN_ID": "per-run id set by the launcher on every process it starts",
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
