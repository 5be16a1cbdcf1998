"""State that one thread owns: every other thread posts a function to run on the owner and waits for its
future. The owner wakes for a post through a pipe it waits on beside its other handles."""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable


class Mailslot:
    """Posts to one owner thread. Until an owner is named (:meth:`own`), or when the poster is the owner, a
    post runs at once on the poster's thread: before the hand-over, that thread owns the state."""

    def __init__(self) -> None:
        self._posts: queue.Queue = queue.Queue()
        self._owner: int | None = None
        self.wake_fd, self._wake_w = os.pipe()  # readable while posts wait
        os.set_blocking(self.wake_fd, False)
        self.closed: str | None = None  # why posts are refused now

    def own(self) -> None:
        """The calling thread owns the state from now on."""
        self._owner = threading.get_ident()

    @property
    def is_owner(self) -> bool:
        return self._owner is None or threading.get_ident() == self._owner

    def post(self, fn: Callable[[Future], None], error: type[Exception] = RuntimeError) -> Future:
        """Run ``fn(future)`` on the owner (it resolves the future, now or later). Refused with ``error`` once closed."""
        future: Future = Future()
        if self.closed is not None:
            future.set_exception(error(self.closed))
        elif self.is_owner:
            fn(future)
        else:
            self._posts.put((fn, future))
            self.wake()
        return future

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\x01")
        except OSError:
            pass

    def run_posted(self) -> None:
        """On the owner: run what was posted. An exception goes to the poster's future."""
        try:
            os.read(self.wake_fd, 4096)
        except BlockingIOError:
            pass
        while not self._posts.empty():
            fn, future = self._posts.get()
            try:
                fn(future)
            except BaseException as e:  # noqa: BLE001 - the poster gets it
                if not future.done():
                    future.set_exception(e)

    def close(self, why: str, error: Exception) -> None:
        """Refuse posts from now on; fail the ones still waiting with ``error``."""
        self.closed = why
        while not self._posts.empty():
            _, future = self._posts.get()
            if not future.done():
                future.set_exception(error)

    def __del__(self) -> None:
        for fd in (self.wake_fd, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def result(future: Future, timeout: float, what: str):
    """The future's value within ``timeout`` s; a TimeoutError naming ``what`` otherwise."""
    try:
        return future.result(timeout)
    except TimeoutError:
        raise TimeoutError(f"{what}: no answer within {timeout:g} s") from None
