"""The backend interface: a communicator per view whose every wait can be abandoned.

Each collective returns a :class:`Handle`. ``Handle.wait(abort, timeout)`` returns the
result when the collective completes (the waiting thread polls it, see
:class:`Completion`), raises :class:`~ftcomm.errors.CollectiveAborted` as soon as the
abort signal fires (within milliseconds: the signal wakes the waiting
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
from typing import Any, Callable, Protocol

from ..errors import CollectiveAborted, FtcommTimeout

log = logging.getLogger(__name__)

POLL_MIN_S = 5e-5
"""A waiting thread asks whether its collective is done this soon after it starts waiting ..."""
POLL_MAX_S = 1e-3
"""... and backs off to this: the latency with which a completion may go unnoticed."""
EXIT_WAIT_S = 15.0
"""How long interpreter exit waits, at least, for :func:`start_lingering` threads."""
_LINGERING: list[tuple[threading.Thread, Callable[[], None] | None, float]] = []


def start_lingering(target: Callable[[], None], name: str, cancel: Callable[[], None] | None = None,
                    bound: float = 0.0) -> threading.Thread:
    """Start a daemon thread that may block inside a backend call (a store read while a
    communicator forms, ``ncclCommAbort``), and that interpreter exit waits for.

    A thread still inside such a call when the interpreter finalizes dies with SIGABRT
    once the call returns (its peers closing their connections at exit make it return),
    taking the process's exit status with it. So at exit ``cancel`` (if given) is called
    to make the blocked call give up (a store read fails at once), and exit waits for the
    thread up to ``bound`` seconds (what the call may still take after cancelling: a
    Gloo connection attempt) or ``EXIT_WAIT_S``, whichever is longer.
    Raises RuntimeError when the interpreter is already exiting.
    """
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    _LINGERING[:] = [entry for entry in _LINGERING if entry[0].is_alive()] + [(thread, cancel, bound)]
    return thread


@atexit.register
def _wait_for_lingering() -> None:
    alive = [entry for entry in _LINGERING if entry[0].is_alive()]
    for _, cancel, _ in alive:
        if cancel is not None:
            cancel()
    wait = max([EXIT_WAIT_S] + [bound + 1.0 for _, _, bound in alive])
    deadline = time.monotonic() + wait
    for thread, _, _ in alive:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [thread.name for thread, _, _ in alive if thread.is_alive()]
    if stuck:
        log.warning("exiting while %s still run (waited %g s)", ", ".join(stuck), wait)


class AbortSignal:
    """Fired (with a reason) when the view breaks; wakes every waiting collective at once.

    ``on_wait``: the owner's news handler, run by the waiting thread on each wake-up (and
    at least every ``POLL_MAX_S`` while it polls): other threads only post news and
    :meth:`nudge`; the handler, on the thread that waits, decides whether to fire.
    """

    def __init__(self, on_wait: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._on_wait = on_wait
        self._clock = clock  # the times it records (a simulation passes its virtual clock)
        self._lock = threading.Lock()
        self._reason: str | None = None
        self.fired_at: float | None = None  # time.monotonic() of the first fire
        self.noticed_at: float | None = None  # when a waiting collective first gave up because of it
        self._waiters: set[threading.Event] = set()

    @property
    def reason(self) -> str | None:
        return self._reason

    def fire(self, reason: str, at: float | None = None) -> None:
        """Fire (the first reason wins). ``at``: when the news that fires it arrived
        (``time.monotonic()``), if earlier than now: the abort latency counts from there."""
        with self._lock:
            if self._reason is None:
                self._reason = reason
                self.fired_at = self._clock() if at is None else at
            waiters = list(self._waiters)
        for event in waiters:
            event.set()

    def check(self) -> str | None:
        """The reason, after judging the news posted so far (for a thread that polls a
        backend itself instead of waiting in :meth:`wait`)."""
        if self._on_wait is not None and self._reason is None:
            self._on_wait()
        return self._reason

    def nudge(self) -> None:
        """Wake the waiting threads without firing: news arrived for ``on_wait``."""
        with self._lock:
            waiters = list(self._waiters)
        for event in waiters:
            event.set()

    def wait(self, wake: threading.Event, is_done: Callable[[], bool], timeout: float | None, what: str,
             poll: bool = False) -> None:
        """Block until ``is_done()``; raise if the signal fires first or time runs out.

        ``wake`` is set by whoever completes the work; firing the signal sets it too. With
        ``poll``, nobody completes the work: ``is_done()`` is asked again after
        ``POLL_MIN_S``, backing off to ``POLL_MAX_S`` (a firing signal still wakes at once).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = POLL_MIN_S
        with self._lock:
            self._waiters.add(wake)
        try:
            while True:
                if self._on_wait is not None:
                    wake.clear()  # news posted from here on wakes the next wait
                    self._on_wait()
                if self._reason is not None or is_done():
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                if not poll:
                    wake.wait(remaining)
                    continue
                wake.wait(delay if remaining is None else min(delay, remaining))
                delay = min(POLL_MAX_S, delay * 2)
        finally:
            with self._lock:
                self._waiters.discard(wake)
        if is_done():
            return
        if self._reason is not None:
            if self.noticed_at is None:
                self.noticed_at = self._clock()
            raise CollectiveAborted(f"{what} abandoned: {self._reason}")
        raise FtcommTimeout(f"{what} did not complete within {timeout:g} s")


def check_root(src: int, size: int) -> None:
    """A broadcast's root must be a rank of the view (a bad one is the caller's error, not a fault)."""
    if not 0 <= src < size:
        raise ValueError(f"broadcast root {src} is not a rank of this view (ranks 0..{size - 1})")


def check_rows(tensor: Any, size: int) -> None:
    if tensor.dim() < 1 or tensor.shape[0] != size:
        raise ValueError(f"alltoall needs a tensor whose first dimension is the view's size ({size}), got shape "
                         f"{tuple(tensor.shape)}")


class Completion:
    """How the collectives of one communicator are seen to finish: polled by the thread that
    waits for them, never signalled by the backend calling into Python.

    A backend thread that calls back into Python once the interpreter has begun to exit
    crashes the process (seen with the works of abandoned Gloo groups failing as their
    peers exit), a thread blocked in a backend's own wait cannot be stopped, and a thread
    that polls in the background costs CPU whether anyone waits or not. ``check()``
    (optional) is asked while a collective is not done, and returns a description of the
    communicator's failure or None. Once :attr:`error` is set (a failure, a poll that
    raised, :meth:`fail`), every collective of the communicator reads as finished and
    failed.
    """

    def __init__(self, check: Callable[[], str | None] | None = None) -> None:
        self._check = check
        self.error: str | None = None

    def fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason

    def finished(self, done: Callable[[], bool]) -> bool:
        """``done()`` of one collective, or True once the communicator failed."""
        if self.error is not None:
            return True
        try:
            if done():
                return True
            if self._check is not None:
                self.error = self._check()
        except Exception as exc:  # noqa: BLE001 - a backend that cannot be polled has failed
            self.fail(f"polling the collective failed: {type(exc).__name__}: {exc}")
        return self.error is not None


class Handle:
    """A pending collective: ``done()`` polls it (through the communicator's :class:`Completion`)."""

    def __init__(self, what: str, done: Callable[[], bool], finish: Callable[[], Any]) -> None:
        self.what = what
        self._done = done
        self._completed = False
        self._finish = finish
        self.waiting: AbortSignal | None = None  # the signal of the last wait

    @property
    def completed(self) -> bool:
        if not self._completed:
            self._completed = self._done()
        return self._completed

    def wait(self, abort: AbortSignal, timeout: float | None = None) -> Any:
        """The result; raises CollectiveAborted, CommunicatorError or FtcommTimeout (see module)."""
        self.waiting = abort
        abort.wait(threading.Event(), lambda: self.completed, timeout, self.what, poll=True)
        return self._finish()


def then(first: Handle, second: Callable[[Any], Handle], what: str,
         result: Callable[[Any], Any] = lambda value: value) -> Handle:
    """One handle for two collectives in a row: ``second(result of first)`` is started by
    whoever polls the handle once ``first`` is done (nothing runs in the background),
    unless the signal of its wait has fired (nothing more is started on a communicator
    about to be abandoned); the handle's result is ``result(the second's result)``. A
    failure of either shows in ``wait`` as theirs do."""
    started: list[Handle] = []

    def done() -> bool:
        if not started:
            if not first.completed or (handle.waiting is not None and handle.waiting.reason is not None):
                return False
            started.append(second(first._finish()))
        return started[0].completed

    handle = Handle(what, done, lambda: result(started[0]._finish()))  # (finish is asked only once done)
    return handle


class Communicator(Protocol):
    """What a backend provides for one view (:class:`~ftcomm.backends.gloo.GlooCommunicator`,
    :class:`~ftcomm.backends.nccl.NcclCommunicator`). Every collective returns a
    :class:`Handle` at once; nothing blocks outside ``Handle.wait``."""

    name: str
    rank: int
    size: int
    device: Any  # where its tensors live

    @classmethod
    def form(cls, store: Any, rank: int, size: int, view_id: int, abort: AbortSignal, timeout: float,
             host: str | None = None, sources: Any = None) -> "Communicator":
        """Form the communicator of view ``view_id`` through ``store``; abandoned when
        ``abort`` fires, FtcommTimeout after ``timeout`` seconds. ``host``: the address to
        listen on; ``sources``: the IPv4 addresses the other members connect from (a backend
        that can, admits only these while forming)."""

    @staticmethod
    def retain(host: str | None) -> None:
        """A group of this process forms communicators bound to ``host`` until ``release``."""

    @staticmethod
    def release(host: str | None) -> None:
        """That group forms nothing more: what listens for its formations may close."""

    @staticmethod
    def prepare(host: str | None) -> None:
        """Make ahead, in the background, what the first formation on ``host`` needs. Called
        once the group's own listeners are open, while it joins."""

    def allreduce(self, tensors: list[Any], op: str = "sum") -> Handle:
        """Start reducing each tensor in place (``op``: sum, mean, max, min; ValueError for
        another). Never blocks: a peer that dies or hangs shows in the handle's ``wait``
        (CommunicatorError, or CollectiveAborted once the abort signal fires); the tensors'
        contents are undefined after a failure. A backend may also raise CommunicatorError
        here, when it already knows a peer is gone (NCCL at enqueue)."""

    def broadcast(self, tensor: Any, src: int) -> Handle:
        """Start copying rank ``src``'s tensor into every member's, in place. ValueError for a
        ``src`` outside the view; failures as :meth:`allreduce`."""

    def allgather(self, tensor: Any) -> Handle:
        """Start gathering every member's tensor; the handle's result is the list in rank
        order. Failures as :meth:`allreduce`."""

    def alltoall(self, tensor: Any) -> Handle:
        """Start sending row ``j`` of ``tensor`` (its first dimension is the view's size) to
        rank ``j``; the handle's result is a tensor of the same shape whose row ``i`` came
        from rank ``i``. Failures as :meth:`allreduce`."""

    def barrier(self) -> Handle:
        """Start a barrier; its handle completes once every member reached it. Failures as
        :meth:`allreduce`."""

    def abandon(self) -> None:
        """Drop it without waiting for anything (a peer may be dead or hung)."""

    def close(self) -> None:
        """Release it after the group's last collective completed everywhere."""
