"""The backend interface: a communicator per view whose every wait can be abandoned.

Each collective returns a :class:`Handle`. ``Handle.wait(abort, timeout)`` returns the
result when the collective completes, raises :class:`~ftcomm.errors.CollectiveAborted`
as soon as the abort signal fires (within milliseconds: the signal wakes the waiting
thread directly), raises :class:`~ftcomm.errors.CommunicatorError` when the backend
reports a failure (a peer's connection reset), and raises
:class:`~ftcomm.errors.FtcommTimeout` after ``timeout`` seconds. A handle that was not
waited to completion belongs to a communicator that must then be abandoned.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..errors import CollectiveAborted, FtcommTimeout


class AbortSignal:
    """Fired (with a reason) by the membership layer; wakes every waiting collective at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self.fired_at: float | None = None  # time.monotonic() of the first fire
        self.noticed_at: float | None = None  # when a waiting collective first gave up because of it
        self._waiters: set[threading.Event] = set()

    @property
    def reason(self) -> str | None:
        return self._reason

    def fire(self, reason: str) -> None:
        with self._lock:
            if self._reason is None:
                self._reason = reason
                self.fired_at = time.monotonic()
            waiters = list(self._waiters)
        for event in waiters:
            event.set()

    def wait(self, wake: threading.Event, is_done: Callable[[], bool], timeout: float | None, what: str) -> None:
        """Block until ``is_done()``; raise if the signal fires first or time runs out.

        ``wake`` is set by whoever completes the work; firing the signal sets it too.
        """
        with self._lock:
            self._waiters.add(wake)
        try:
            if self._reason is None and not is_done():
                wake.wait(timeout)
        finally:
            with self._lock:
                self._waiters.discard(wake)
        if is_done():
            return
        if self._reason is not None:
            if self.noticed_at is None:
                self.noticed_at = time.monotonic()
            raise CollectiveAborted(f"{what} abandoned: {self._reason}")
        raise FtcommTimeout(f"{what} did not complete within {timeout:g} s")


class Handle:
    """A pending collective: completion is observed through a callback, never by blocking."""

    def __init__(self, what: str, register: Callable[[Callable[[], None]], None],
                 finish: Callable[[], Any]) -> None:
        self.what = what
        self._wake = threading.Event()
        self._completed = False
        self._finish = finish
        register(self._complete)

    def _complete(self) -> None:
        self._completed = True
        self._wake.set()

    @property
    def completed(self) -> bool:
        return self._completed

    def wait(self, abort: AbortSignal, timeout: float | None = None) -> Any:
        """The result; raises CollectiveAborted, CommunicatorError or FtcommTimeout (see module)."""
        abort.wait(self._wake, lambda: self._completed, timeout, self.what)
        return self._finish()
