"""Gossip news for the thread that waits on the view: the gossip thread only posts it.

The gossip thread calls :meth:`GossipNews.post` for every membership event and returns at
once: it wakes whoever waits (the agreement loop, or a collective through its abort
signal's ``nudge``). The waiting thread judges what was posted with :meth:`judge` (the
engine core's :meth:`~ftcomm.core.engine.Engine.damage`): it fires the view's abort signal the
moment the view is damaged, or holds the abort until the operation in flight ends when a
member left right after completing it (``leave_grace``). No decision is taken on the
gossip thread, and no lock is held across a judgment that another thread could need.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Iterable

from ..backends.base import AbortSignal
from ..core.engine import Engine
from ..core.view import Status, View

INBOX_LIMIT = 4096
"""News held for the waiting thread; beyond it, the next look re-reads every record."""
FAULT_LIMIT = 4096


def decode_record(member_id: str, state: str, metadata: Any) -> Status | None:
    """A member's status record from what a gossip node's table holds (decoded metadata)."""
    return Status.from_metadata(member_id, state, metadata)


class GossipNews:
    """The inbox, the faults seen in the current view, and aborts held for a graceful leave.

    ``table()``: every member's (id, gossip state, metadata) in the local table, read when
    news was dropped; ``decode``: a record from those; ``clock``: monotonic seconds (a
    simulation passes its virtual clock)."""

    def __init__(self, engine: Engine, table: Callable[[], Iterable[tuple[str, str, Any]]], ops: Callable[[], int],
                 leave_grace: float, on_look: Callable[[], None] | None = None,
                 decode: Callable[[str, str, Any], Status | None] = decode_record,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._table = table
        self._ops = ops  # group operations completed in the current view (see Engine.damage)
        self._leave_grace = leave_grace
        self._on_look = on_look  # also run on each look by a waiting thread (see look)
        self._decode = decode
        self._clock = clock
        self._inbox: collections.deque = collections.deque()  # (time posted, kind, member id, state, metadata)
        self._overflowed = False
        self._judging = threading.Lock()
        self.changed = threading.Event()  # set by every post: the agreement loop waits on it
        self.abort = AbortSignal(self.look, clock)  # the signal of the view being formed or run
        self.since = 0.0  # news posted before this is not judged: see renew
        self.faults: list[tuple[float, str, str]] = []  # (time, kind, member) since the last view
        self._deferred: list[tuple[AbortSignal, str, float]] = []  # (signal, reason, fire by)

    def post(self, event: Any) -> None:
        """On the gossip thread: keep the news (a membership event: ``kind``, and the
        ``member``'s id, state and metadata) and wake the waiting thread; nothing else."""
        if len(self._inbox) < INBOX_LIMIT:
            member = event.member
            self._inbox.append((self._clock(), event.kind, member.id, member.state, member.metadata))
        else:  # nobody has looked for a long while: the next look reads the members' records
            self._overflowed = True
        self.changed.set()
        self.abort.nudge()

    def renew(self) -> AbortSignal:
        """A view is entered: a fresh abort signal, and news posted before now is not judged
        against it (the members' records read from now on are at least as new)."""
        self.since = self._clock()
        self.abort = AbortSignal(self.look, self._clock)
        return self.abort

    def enter(self, view: View, statuses: dict) -> AbortSignal:
        """This member enters the formation of ``view``: a fresh signal, fired at once by what
        already breaks the view (Engine.entry_damage: the records read now stand for the
        news that came before)."""
        abort = self.renew()
        for damage in self._engine.entry_damage(view, statuses, self._ops()):
            if damage.fault is not None:
                self.fault(damage.fault, damage.member, self.since)
            abort.fire(damage.reason)
        return abort

    def look(self) -> None:
        """What a waiting thread runs on each wake-up: judge the news, then ``on_look``."""
        self.judge()
        if self._on_look is not None:
            self._on_look()

    def fault(self, kind: str, member: str, at: float | None = None) -> None:
        if len(self.faults) < FAULT_LIMIT:
            self.faults.append((self._clock() if at is None else at, kind, member))

    def judge(self) -> None:
        """Judge the news posted since the last look (see the module docstring). Runs on the
        waiting thread; a second thread of this worker looking meanwhile returns at once."""
        if not self._judging.acquire(blocking=False):
            return
        try:
            if self._overflowed:  # news was dropped: judge every member's present record instead
                self._overflowed = False
                now = self._clock()
                self._inbox.extend((now, state if state in ("suspect", "dead", "left") else "metadata", member_id,
                                    state, metadata) for member_id, state, metadata in self._table())
            while self._inbox:
                posted, kind, member_id, state, metadata = self._inbox.popleft()
                if posted < self.since:
                    continue  # about an earlier view
                status = self._decode(member_id, state, metadata)
                damage = self._engine.damage(kind, member_id, status, self._ops())
                if damage is None:
                    continue
                if damage.fault is not None:
                    self.fault(damage.fault, member_id, posted)
                if damage.defer:
                    self._deferred.append((self.abort, damage.reason, posted + self._leave_grace))
                else:
                    self.abort.fire(damage.reason, at=posted)
            now = self._clock()
            for abort, reason, deadline in self._deferred:
                if now >= deadline:
                    abort.fire(reason, at=deadline)
        finally:
            self._judging.release()

    def operation_ended(self) -> None:
        """The operation in flight ended: aborts held for it fire now."""
        while self._deferred:
            abort, reason, _ = self._deferred.pop()
            abort.fire(reason)
