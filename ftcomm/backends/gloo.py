"""Gloo backend: a ``ProcessGroupGloo`` per view, built from a store, with abandonable waits.

Measured facts this module is built on (torch 2.13, CPU):

- a crashed peer makes pending ops fail at once (connection reset);
- a hung peer blocks an op until Gloo's own timeout, and ``abort()`` does not unblock a
  pending ``wait()``; so the waiting thread polls ``is_completed`` and races it against
  the abort signal. Not through the work future's done callback: the works
  of abandoned groups fail when their peers exit, and a callback that Gloo's thread runs
  into Python while the interpreter is exiting crashes the process (SIGSEGV);
- dropping the last reference to a group whose op is stuck blocks the dropping thread
  until the hung peer's socket closes (tens of seconds). Abandoned groups therefore go
  to a graveyard that is never freed, not even at interpreter exit;
- a group's thread (``pt_gloo_runloop``) drops its finished collective itself, which
  frees the collective's tensors and so takes Python's lock; when the script ends right
  after a collective, that can come after the interpreter began to exit, and the thread,
  ended by Python inside a C++ destructor, aborts the process ("terminate called without
  an active exception", exit status 134 after a script that completed). See
  :func:`quiesce_at_exit`.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import os
import threading
import time
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as c10d

from .. import netif
from . import admission
from ..errors import CommunicatorError
from .base import AbortSignal, Completion, Handle, check_root, check_rows, start_lingering

log = logging.getLogger(__name__)

_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_GRAVEYARD: list[Any] = []
_GRAVEYARD_LOCK = threading.Lock()


def bury(obj: Any) -> None:
    """Keep ``obj`` alive for the rest of the process, so no thread ever runs its destructor."""
    with _GRAVEYARD_LOCK:
        _GRAVEYARD.append(obj)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # survives module teardown at exit too


def graveyard_size() -> int:
    return len(_GRAVEYARD)


def _finish(work: Any, what: str, completion: Completion, value: Any = None):
    def finish() -> Any:
        if completion.error is not None:  # abandoned: the work may still be running
            raise CommunicatorError(f"{what} failed: {completion.error}")
        try:
            work.wait()  # already complete: returns at once, or raises the backend's error
        except RuntimeError as exc:
            raise CommunicatorError(f"{what} failed: {str(exc).splitlines()[0][:300]}") from None
        return value() if callable(value) else value
    return finish


class GlooCommunicator:
    """Collectives over one view. Failure semantics are those of :mod:`ftcomm.backends.base`."""

    name = "gloo"

    def __init__(self, group: Any, rank: int, size: int, view_id: int, op_timeout: float = 600.0) -> None:
        self.group = group
        self.op_timeout = datetime.timedelta(seconds=op_timeout)  # Gloo's own bound on one collective
        self.rank = rank
        self.size = size
        self.view_id = view_id
        self.device = torch.device("cpu")  # where the group puts its own small tensors
        self._pending: list[Handle] = []
        self._completion = Completion()

    @classmethod
    def form(cls, store: Any, rank: int, size: int, view_id: int, abort: AbortSignal, timeout: float,
             host: str | None = None, op_timeout: float = 600.0,
             sources: Iterable[str] | None = None) -> "GlooCommunicator":
        """Build the group in a helper thread; abandon it if the signal fires or time runs out.

        ``host``: the address the group is bound to. Gloo listens on it and tells the other
        ranks to connect there (without it Gloo takes the address of the host name, which
        is loopback on many hosts: no group could form across machines). ``sources``: the
        IPv4 addresses the other ranks connect from; while the group forms, the listener
        admits these alone (None: any address), and nobody once no formation runs (see
        :mod:`ftcomm.backends.admission`).
        """
        options = dist.ProcessGroupGloo._Options()
        # Bounds the rendezvous inside the constructor (a builder that is given up on ends
        # by then); collectives get op_timeout each.
        options._timeout = datetime.timedelta(seconds=timeout)
        gloo_device, door = _device(host)
        options._devices = [gloo_device]
        outcome: dict[str, Any] = {}
        wake = threading.Event()
        # The door opens for this formation until its builder ends or is given up on.
        shut = door.open_for(sources) if door is not None else (lambda: None)

        def build() -> None:
            try:
                outcome["group"] = dist.ProcessGroupGloo(store, rank, size, options)
            except Exception as exc:  # noqa: BLE001 - reported to the waiting thread
                outcome["error"] = exc
            finally:
                shut()
            wake.set()

        what = f"forming the gloo group of view {view_id}"
        cancel = getattr(store, "cancel", None)  # ftcomm's stores can end a blocked read at once
        start_lingering(build, f"ftcomm-gloo-form-{view_id}",  # blocks in store reads until the others come
                        cancel=None if cancel is None else lambda: cancel(f"{what} was given up"), bound=timeout)
        try:
            abort.wait(wake, lambda: bool(outcome), timeout, what)
        except BaseException:
            # The builder ends soon (its store reads fail from now on; a connection attempt
            # ends within ``timeout``); whatever it builds is never used nor destroyed, so
            # the door shuts now: an abandoned formation keeps nobody's connection welcome.
            shut()
            if cancel is not None:
                cancel(f"{what} was given up")
            bury(outcome)
            raise
        if "error" in outcome:
            raise CommunicatorError(f"forming the gloo group of view {view_id} failed: "
                                    f"{str(outcome['error']).splitlines()[0][:300]}")
        return cls(outcome["group"], rank, size, view_id, op_timeout)

    def _options(self, kind: Any, **fields: Any) -> Any:
        options = kind()
        options.timeout = self.op_timeout
        for name, value in fields.items():
            setattr(options, name, value)
        return options

    def _track(self, work: Any, what: str, value: Any = None) -> Handle:
        completion = self._completion
        handle = Handle(what, lambda: completion.finished(work.is_completed), _finish(work, what, completion, value))
        self._pending = [h for h in self._pending if not h.completed] + [handle]
        return handle

    def allreduce(self, tensors: list[torch.Tensor], op: str = "sum") -> Handle:
        """In-place reduction of each tensor across the view; ``mean`` divides by the size."""
        if op not in _OPS:
            raise ValueError(f"unknown reduction {op!r}: use one of {sorted(_OPS)}")
        if len(tensors) == 1:
            work = self.group.allreduce(tensors, self._options(dist.AllreduceOptions, reduceOp=_OPS[op]))
        else:  # several tensors of one call are several reductions (Gloo's allreduce would add them up)
            work = self.group.allreduce_coalesced(tensors, self._options(dist.AllreduceCoalescedOptions,
                                                                         reduceOp=_OPS[op]))
        what = f"allreduce({op}) in view {self.view_id}"

        def result() -> list[torch.Tensor]:
            if op == "mean":
                for t in tensors:  # integers: truncated, as NCCL's ncclAvg
                    t.div_(self.size, rounding_mode=None if t.is_floating_point() else "trunc")
            return tensors
        return self._track(work, what, result)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        check_root(src, self.size)
        work = self.group.broadcast([tensor], self._options(dist.BroadcastOptions, rootRank=src, rootTensor=0))
        what = f"broadcast from rank {src} in view {self.view_id}"
        return self._track(work, what, tensor)

    def allgather(self, tensor: torch.Tensor) -> Handle:
        outputs = [torch.empty_like(tensor) for _ in range(self.size)]
        work = self.group.allgather([outputs], [tensor], self._options(c10d.AllgatherOptions))
        what = f"allgather in view {self.view_id}"
        return self._track(work, what, outputs)

    def alltoall(self, tensor: torch.Tensor) -> Handle:
        check_rows(tensor, self.size)
        output = torch.empty_like(tensor)
        work = self.group.alltoall_base(output, tensor, [], [], self._options(c10d.AllToAllOptions))
        what = f"alltoall in view {self.view_id}"
        return self._track(work, what, output)

    def barrier(self) -> Handle:
        work = self.group.barrier(self._options(dist.BarrierOptions))
        what = f"barrier in view {self.view_id}"
        return self._track(work, what)

    def abandon(self) -> None:
        """Give up on this communicator: nothing is waited for and nothing is destroyed."""
        self._completion.fail("the communicator was abandoned")  # no pending handle may read as a success
        bury((self.group, self._pending))
        self._pending = []

    @staticmethod
    def retain(host: str | None) -> None:
        """A group forms its communicators on ``host`` until ``release`` (see :func:`retain`)."""
        retain(host)

    @staticmethod
    def release(host: str | None) -> None:
        """The group that retained ``host`` forms nothing more (see :func:`release`)."""
        release(host)

    @staticmethod
    def prepare(host: str | None) -> None:
        """Make what the first formation on ``host`` needs ahead (see :func:`prepare`)."""
        prepare(host)

    def close(self) -> None:
        """Release a healthy communicator whose ops all completed; otherwise abandon it."""
        if any(not h.completed for h in self._pending):
            self.abandon()
            return
        self._completion.fail("the communicator was closed")
        try:
            self.group.shutdown()
        except RuntimeError as exc:  # already broken: nothing to release cleanly
            log.debug("gloo shutdown of view %d: %s", self.view_id, exc)
        self.group = None


_DEVICES: dict[str, tuple[Any, admission.Door | None]] = {}
_DEVICES_LOCK = threading.Lock()


def _device(host: str | None) -> tuple[Any, admission.Door | None]:
    """The Gloo transport device for groups bound to ``host`` (listening on that address
    alone; a wildcard or absent host falls back to Gloo's default, the host name's
    address), with the door of its listener.

    One device per address, shared by every group of the process: a device holds a
    listener, a thread and a few descriptors, and groups of abandoned views are never
    destroyed (see :func:`bury`), so a device per group leaked them at every re-formation.
    """
    if host is None or netif.is_wildcard(host):
        key, make, address = "", dist.ProcessGroupGloo.create_default_device, None
    else:
        address = netif.resolve(host)
        key, make = address, lambda: dist.ProcessGroupGloo.create_device(hostname=address)
    with _DEVICES_LOCK:
        if key not in _DEVICES:
            made, door = admission.guard(make, f"the gloo device of {address or 'this host'}", address)
            bury(made)  # a device is never destroyed: buried groups use it, and its listener may be sealed
            _DEVICES[key] = (made, door)
        return _DEVICES[key]


def device(host: str | None) -> Any:
    """The Gloo transport device for groups bound to ``host`` (see :func:`_device`)."""
    return _device(host)[0]


_USERS: dict[str, int] = {}


def _key(host: str | None) -> str:
    return "" if host is None or netif.is_wildcard(host) else netif.resolve(host)


def retain(host: str | None) -> None:
    """A group of this process forms its communicators on ``host`` until :func:`release`."""
    with _DEVICES_LOCK:
        _USERS[_key(host)] = _USERS.get(_key(host), 0) + 1


def prepare(host: str | None) -> None:
    """Make the device for ``host`` (a listener, a thread, its filter: about 25 ms) in the
    background, so that the first formation finds it ready. Called once the group's own
    listeners (gossip, rendezvous, metrics) are open: the door finds the device's listener
    as the one new listening socket, and a listener opened meanwhile would hide it."""
    with _DEVICES_LOCK:
        if _key(host) in _DEVICES:
            return
    threading.Thread(target=_prepare, args=(host,), daemon=True, name="ftcomm-gloo-device").start()


def _prepare(host: str | None) -> None:
    with _DEVICES_LOCK:
        if not _USERS.get(_key(host)):
            return  # released meanwhile
    try:
        _device(host)
    except Exception as exc:  # noqa: BLE001 - the first formation makes it again and says why it cannot
        log.debug("preparing the gloo device of %s: %s", host, exc)
        return
    with _DEVICES_LOCK:  # released while it was being made: nobody will seal it but this
        made_door = _DEVICES.pop(_key(host), None) if not _USERS.get(_key(host)) else None
    _seal(made_door)


def release(host: str | None) -> None:
    """A group that retained ``host`` forms nothing more (it shut down). When it was the
    last, the listening socket of the device on ``host`` is closed (a later group makes a
    new device); communicators already formed keep their connections."""
    key = _key(host)
    with _DEVICES_LOCK:
        users = _USERS.get(key, 0) - 1
        if users > 0:
            _USERS[key] = users
            return
        _USERS.pop(key, None)
        made_door = _DEVICES.pop(key, None)
    _seal(made_door)


def _seal(made_door: tuple[Any, admission.Door | None] | None) -> None:
    """Close the listening socket of a device taken out of use (None: there was none)."""
    if made_door is not None and made_door[1] is not None:
        made_door[1].seal()


QUIESCE_LIMIT_S = 1.0
"""The longest the interpreter's exit waits for the threads of torch's Gloo groups to drop
their finished collectives (see :func:`quiesce_at_exit`)."""
_QUIESCING = threading.Lock()
_quiesce_registered = False


def _runloops() -> list[str] | None:
    """The scheduler state (``R`` running or runnable, ``S`` waiting, ...) of each thread of
    torch's Gloo groups in this process; None where /proc cannot tell."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    states = []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() != "pt_gloo_runloop":
                    continue
            with open(f"/proc/self/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
        except OSError:  # (the thread ended meanwhile)
            continue
    return states


def _quiesce() -> None:
    """Release Python's lock until no thread of a Gloo group runs (twice in a row, 10 ms
    apart: a thread that finished a collective and waits for the lock gets it meanwhile,
    frees the collective and waits for the next one), at most QUIESCE_LIMIT_S."""
    deadline = time.monotonic() + QUIESCE_LIMIT_S
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        states = _runloops()
        if not states:
            return
        time.sleep(0.01)
        quiet = quiet + 1 if "R" not in states else 0


def quiesce_at_exit() -> None:
    """Before the interpreter exits, let the threads of torch's Gloo groups drop their
    finished collectives (see the module's notes). For groups whose collectives Python does
    not hold until they are dropped (a sharded replica's, which FSDP2 and DTensor use
    directly); registered once, and run after the atexit hooks registered later (a group's
    shutdown)."""
    global _quiesce_registered
    with _QUIESCING:
        if not _quiesce_registered:
            _quiesce_registered = True
            atexit.register(_quiesce)
