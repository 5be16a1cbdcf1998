"""Process helpers every process of a run uses: dying with its parent, reporting a failure, naming itself,
keeping the memory its steps free, saying why a child exited, and a run directory that a later run removes if
its launcher died without."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import tempfile
import traceback
from pathlib import Path

from afd.runtime.messages import Failed

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_MMAP_THRESHOLD_MAX = 32 << 20  # the largest glibc takes on 64 bits (half its heap size)
_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt's value is an int
_OWNER = "owner"  # in a run directory: "<pid> <start time>" of the launcher that made it

log = logging.getLogger(__name__)


def die_with_parent() -> None:
    """This process dies with the one that started it, whatever kills that one (PR_SET_PDEATHSIG: when the
    parent's *thread* that started it ends, so start processes from a thread that outlives them). If the
    parent went while this was being set, exit now."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() != parent:
        os._exit(1)


def set_title(title: str) -> None:
    """What ``ps`` and ``/proc/<pid>/comm`` show for this process (at most 15 bytes)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, title.encode()[:15])
    except OSError:
        pass


def keep_freed_memory() -> bool:
    """glibc's malloc keeps what a step frees for the next step instead of handing it back to the kernel: blocks
    up to 32 MiB come from the heap, not from a fresh mmap each, and the heap's free top is not trimmed.

    A step's activations are the same few hundred MB step after step. By default glibc returns most of them
    (mmap'd blocks unmapped when freed, the heap trimmed), so every step faults them in again: ~25,000 minor
    faults a 4,096-token prefill of the vLLM-shaped built-in model. On a VM whose balloon reports free pages to
    the host (Firecracker's here) a page the guest freed a while ago costs the host a fault too: the same step
    then spent 100-430 ms in the kernel against ~20 ms, and a burst's time to first token swung 2-3x between
    otherwise equal runs (docs/benchmarks.md). The process keeps its peak step memory instead, which the step
    budget bounds (afd/engine/budget.py). Blocks above 32 MiB are still mapped per step (glibc's limit).
    Not set where the user chose (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``)
    or where the C library is not glibc. True where it was set."""
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc's: musl's mallopt does nothing
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def report_failure(conn, who: str, e: BaseException) -> None:
    """Tell the parent why this process fails: :class:`Failed` with one line naming ``who`` and its pid."""
    detail = "".join(traceback.format_exception_only(type(e), e)).strip()
    try:
        conn.send(Failed(f"{who} (pid {os.getpid()}) failed: {detail}", traceback.format_exc()))
    except Exception:  # noqa: BLE001 - the parent may be gone too; its own sentinel says so
        pass


def exit_reason(code: int | None) -> str:
    """A child's exit code in words: ``exit code 1``, ``killed by SIGKILL``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _start_time(pid: int) -> str | None:
    """A process's start time (``/proc/<pid>/stat`` field 22: with the pid, it names one process), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def make_run_dir(run_id: str, base: str | None) -> Path:
    """A run's directory (``afd-<run id>-*`` under ``base``), owned by this process. First, the directories of
    runs whose launcher is gone (killed with SIGKILL, say: nothing of theirs could clean up) are removed:
    under /dev/shm their link files hold memory until someone does."""
    sweep_stale_run_dirs(base)
    path = Path(tempfile.mkdtemp(prefix=f"afd-{run_id}-", dir=base))
    (path / _OWNER).write_text(f"{os.getpid()} {_start_time(os.getpid())}")
    return path


def sweep_stale_run_dirs(base: str | None) -> list[Path]:
    """Remove ``afd-*`` run directories under ``base`` whose owner process is no longer the one that made them
    (gone, or its pid reused). A directory without an owner file is left alone: nobody can say whose it is."""
    removed = []
    for path in Path(base or tempfile.gettempdir()).glob("afd-*"):
        try:
            pid, started = (path / _OWNER).read_text().split()
        except (OSError, ValueError):
            continue
        if _start_time(int(pid)) == started:
            continue
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s (%.1f MiB), left by a run whose launcher (pid %s) is gone", path, size / 2**20, pid)
        removed.append(path)
    return removed
