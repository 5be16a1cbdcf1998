"""Process helpers every process of a run uses: dying with its parent, reporting a failure, naming itself,
and saying why a child exited."""

from __future__ import annotations

import ctypes
import os
import signal
import traceback

from afd.runtime.messages import Failed

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


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
