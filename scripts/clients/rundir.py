"""The client scripts' per-run directory: a checkpoint, vLLM's cache, the clients' logs (hundreds of MB a run)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable


def in_run_dir(prefix: str, body: Callable[[Path], int]) -> int:
    """``body(directory)`` in a fresh directory under the system's temporary one: removed when the body returns 0,
    kept (and named on stderr) when it fails or raises, for its logs."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    rc = 1
    try:
        rc = body(path)
    finally:
        if rc == 0:
            shutil.rmtree(path, ignore_errors=True)
        else:
            print(f"the run's logs and files are kept in {path}", file=sys.stderr)
    return rc
