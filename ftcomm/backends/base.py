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

import atexit
import logging
import threading
import time
from typing import Any, Callable

from ..errors import CollectiveAborted, FtcommTimeout

log = logging.getLogger(__name__)

EXIT_WAIT_S = 15.0
"""How long interpreter exit waits, in all, for :func:`start_lingering` threads."""
_LINGERING: list[threading.Thread] = []


def start_lingering(target: Callable[[], None], name: str) -> threading.Thread:
    """Start a daemon thread that may block inside a backend call (a store read while a
    communicator forms, ``ncclCommAbort``), and that interpreter exit waits for.

    A thread still inside such a call when the interpreter finalizes dies with SIGABRT
    once the call returns (its peers closing their connections at exit make it return),
    taking the process's exit status with it. These calls are bounded (store reads by
    ``formation_timeout``, aborts by NCCL), so exit waits up to ``EXIT_WAIT_S`` in all.
    Raises RuntimeError when the interpreter is already exiting.
    """
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    _LINGERING[:] = [t for t in _LINGERING if t.is_alive()] + [thread]
    return thread


@atexit.register
def _wait_for_lingering() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in list(_LINGERING):
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in _LINGERING if t.is_alive()]
    if stuck:
        log.warning("exiting while %s still run (waited %g s)", ", ".join(stuck), EXIT_WAIT_S)


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


def check_root(src: int, size: int) -> None:
    """A broadcast's root must be a rank of the view (a bad one is the caller's error, not a fault)."""
    if not 0 <= src < size:
        raise ValueError(f"broadcast root {src} is not a rank of this view (ranks 0..{size - 1})")


class Watcher:
    """One thread per communicator that completes handles by polling their collectives.

    Completion is polled (each entry's ``done()``) rather than signalled by the backend
    calling into Python: a backend thread that calls back into Python once the interpreter
    has begun to exit crashes the process (seen with the works of abandoned Gloo groups
    failing as their peers exit), and a thread blocked in a backend's wait cannot be
    stopped. ``check()``, polled while anything is pending, returns a description of the
    communicator's failure or None; on a failure every pending handle completes and
    :attr:`error` says why. Polls follow a change by ``MIN_POLL_S`` and back off to
    ``MAX_POLL_S`` while nothing changes: the latency a completion may go unnoticed.
    """

    MIN_POLL_S = 5e-5
    MAX_POLL_S = 5e-4

    def __init__(self, name: str, check: Callable[[], str | None] | None = None) -> None:
        self._check = check
        self._pending: list[tuple[Callable[[], bool], Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self.error: str | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def add(self, done: Callable[[], bool], complete: Callable[[], None]) -> None:
        with self._lock:
            if not self._stopped:
                self._pending.append((done, complete))
                self._wake.set()
                return
        complete()  # stopped: nothing will poll it; it reads the watcher's error

    def _poll(self, pending: list) -> list:
        """The entries that are done, all of them once the communicator failed."""
        try:
            done = [entry for entry in pending if entry[0]()]
            if len(done) < len(pending) and self.error is None and self._check is not None:
                self.error = self._check()
        except Exception as exc:  # noqa: BLE001 - a backend that cannot be polled has failed
            self.error = f"polling the collectives failed: {type(exc).__name__}: {exc}"
        return pending if self.error is not None else done

    def stop(self) -> None:
        """No more polling: handles still pending complete now and read as failed."""
        with self._lock:
            self._stopped = True
            if self.error is None:
                self.error = "the communicator was abandoned"  # no pending handle may read as a success
        self._wake.set()

    def _run(self) -> None:
        delay = self.MIN_POLL_S
        while not self._stopped:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                self._wake.wait(0.05)
                self._wake.clear()
                delay = self.MIN_POLL_S
                continue
            done = self._poll(pending)
            if done:
                finished = {id(entry) for entry in done}  # the entries themselves, not copies
                with self._lock:
                    self._pending = [p for p in self._pending if id(p) not in finished]
                for _, complete in done:
                    _complete(complete)
                delay = self.MIN_POLL_S
            else:
                delay = min(self.MAX_POLL_S, delay * 2)
            if self._wake.wait(delay):
                self._wake.clear()
                delay = self.MIN_POLL_S
        with self._lock:
            pending, self._pending = self._pending, []
        for _, complete in pending:
            _complete(complete)


def _complete(complete: Callable[[], None]) -> None:
    try:
        complete()
    except Exception:  # noqa: BLE001 - one waiter's callback must not stop the watcher
        log.exception("completing a collective's handle failed")


class Handle:
    """A pending collective: its completion is observed by a :class:`Watcher`, never by blocking."""

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
