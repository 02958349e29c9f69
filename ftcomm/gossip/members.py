"""The member table of one member: every known member's state, the live set, the probe order,
and who may enter it (a size cap and a join rate) and who has proved to be real."""

from __future__ import annotations

import random
from dataclasses import dataclass

from . import wire

ALIVE_STATE, SUSPECT_STATE, DEAD_STATE, LEFT_STATE = (
    wire.STATE_ALIVE, wire.STATE_SUSPECT, wire.STATE_DEAD, wire.STATE_LEFT)


ANSWER_HALF_LIFE_S = 5.0  # see MemberState.recent_slowest


def halved(value: float, since: float, now: float) -> float:
    """``value`` as of ``since``, halved every ``ANSWER_HALF_LIFE_S`` until ``now``."""
    return value * 0.5 ** (max(0.0, now - since) / ANSWER_HALF_LIFE_S)


@dataclass(frozen=True)
class MemberInfo:
    """A snapshot of one member as this member sees it."""

    id: str
    host: str
    port: int
    incarnation: int
    state: str  # alive | suspect | dead | left
    metadata: bytes
    since: float  # time of the last state change, in the driver's clock
    confirmed: bool = False
    """This member has answered a ping of ours directly, with its own id, at its address
    (or came from an out-of-band list). A member known only through others' gossip is
    not confirmed: it may be a forgery. This member itself is always confirmed."""

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)


@dataclass
class MemberState:
    """The mutable entry of one member in the table."""

    id: str
    host: str
    port: int
    incarnation: int
    state: int
    meta: bytes
    since: float
    confirmed: bool = False
    slowest_answer: float = 0.0
    """The longest of this member's direct answers to our pings, in seconds, as of
    ``answered_at``; it halves every ``ANSWER_HALF_LIFE_S`` (see :meth:`recent_slowest`)."""
    answered_at: float = 0.0
    lateness: float = 0.0
    """How late this member said it runs (its own timers fired up to this many seconds
    late: its CPU is starved), in its answers to our pings, as of ``answered_at``; it
    halves like ``slowest_answer``."""
    paused_until: float = 0.0
    """Until when a pause this member announced (a full garbage collection: see
    ``GossipConfig.pause_grace``) holds the verdicts of probes it leaves unanswered."""
    pause_number: int = -1
    """The number of the latest of its pause notices honoured here."""

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def answered(self, round_trip: float, now: float, lateness: float = 0.0) -> None:
        self.slowest_answer = max(round_trip, self.recent_slowest(now))
        self.lateness = max(lateness, self.recent_lateness(now))
        self.answered_at = now

    def recent_slowest(self, now: float) -> float:
        """How slow this member's answers were lately: the slowest, halved for every
        ``ANSWER_HALF_LIFE_S`` since, so that one slow answer (or a pause of this member
        while an answer waited to be read) stops counting within seconds."""
        return halved(self.slowest_answer, self.answered_at, now)

    def recent_lateness(self, now: float) -> float:
        """How late this member said it runs, lately (halved as :meth:`recent_slowest`)."""
        return halved(self.lateness, self.answered_at, now)

    def info(self) -> MemberInfo:
        return MemberInfo(self.id, self.host, self.port, self.incarnation,
                          wire.STATE_NAMES[self.state], self.meta, self.since, self.confirmed)

    def record(self) -> list:
        return [self.id, self.host, self.port, self.incarnation, self.state, self.meta]


class MemberTable:
    """All known members; the *live* ones (alive or suspect, this member excluded) are
    kept in a list for O(1) random picks and walked in a shuffled round-robin order.

    Members learned from the network enter through :meth:`admit`: at most ``capacity``
    entries, and new ids at most ``join_rate`` per second from a bucket of ``capacity``.
    Live members that have not answered this member directly wait in ``unconfirmed``.
    """

    def __init__(self, own: MemberState, rng: random.Random, *, capacity: int = 1024,
                 join_rate: float = 50.0) -> None:
        self.own = own
        self.by_id: dict[str, MemberState] = {own.id: own}
        self.live: list[str] = []
        self._live_index: dict[str, int] = {}
        self.recent_dead: dict[str, float] = {}  # id -> time it was declared dead or left
        self._gone: dict[str, None] = {}  # ids of the dead and left members, for reap
        self.unconfirmed: dict[str, int] = {}  # id -> confirmation pings sent, oldest first
        self._rng = rng
        self._probe_order: list[str] = []
        self._probe_pos = 0
        self.capacity = capacity
        self._join_rate = join_rate
        self._join_tokens = float(capacity)
        self._tokens_at: float | None = None

    def get(self, member_id: str) -> MemberState | None:
        return self.by_id.get(member_id)

    def num_live(self) -> int:
        """Members believed alive or suspect, this one included."""
        return len(self.live) + 1

    def has_gone_members(self) -> bool:
        return len(self.by_id) > len(self.live) + 1

    def dead(self) -> list[MemberState]:
        """The members declared dead (not those that left), in the order they went; walks
        the gone members only (a large table has few)."""
        by_id = self.by_id
        return [m for m in map(by_id.__getitem__, self._gone) if m.state == DEAD_STATE]

    def add(self, member: MemberState) -> None:
        self.by_id[member.id] = member
        if member.state in (ALIVE_STATE, SUSPECT_STATE):
            self.mark_live(member.id)
        else:
            self._gone[member.id] = None

    def admit(self, member: MemberState, now: float) -> str | None:
        """Add a member learned from the network; or the reason it was refused:
        ``join_rate`` (too many new ids lately) or ``member_table_full``."""
        if self._tokens_at is not None:
            self._join_tokens = min(self.capacity, self._join_tokens + (now - self._tokens_at) * self._join_rate)
        self._tokens_at = now
        if self._join_tokens < 1:
            return "join_rate"
        if len(self.by_id) >= self.capacity and not self._make_room():
            return "member_table_full"
        self._join_tokens -= 1
        self.add(member)
        return None

    def _make_room(self) -> bool:
        """Forget the member least likely to matter: the oldest dead or left one, else the
        oldest live one that ignored every confirmation ping (most likely a forgery)."""
        candidates = [m for m in self.by_id.values() if m.state in (DEAD_STATE, LEFT_STATE)]
        if not candidates:
            candidates = [m for m in self.by_id.values() if not m.confirmed and m.id not in self.unconfirmed]
        if not candidates:
            return False
        self._forget(min(candidates, key=lambda m: m.since).id)
        return True

    def _forget(self, member_id: str) -> None:
        self._remove_live(member_id)
        del self.by_id[member_id]
        self._gone.pop(member_id, None)
        self.recent_dead.pop(member_id, None)
        self.unconfirmed.pop(member_id, None)

    def confirm(self, member_id: str) -> bool:
        """Record a direct answer from ``member_id``; True when it was not confirmed before."""
        self.unconfirmed.pop(member_id, None)
        m = self.by_id.get(member_id)
        if m is None or m.confirmed:
            return False
        m.confirmed = True
        return True

    def unconfirm(self, member_id: str) -> None:
        """The member moved to another address: it must answer there before it counts again."""
        m = self.by_id[member_id]
        m.confirmed = False
        if member_id in self._live_index:
            self.unconfirmed.setdefault(member_id, 0)

    def next_to_confirm(self, count: int, attempts: int) -> list[str]:
        """Up to ``count`` live unconfirmed members to ping now, oldest first; each is
        picked at most ``attempts`` times (after that only the regular probes confirm it)."""
        picked: list[str] = []
        gone: list[str] = []
        for member_id in self.unconfirmed:
            if len(picked) == count:
                break
            (picked if member_id in self._live_index else gone).append(member_id)
        for member_id in gone:
            del self.unconfirmed[member_id]
        for member_id in picked:
            sent = self.unconfirmed.pop(member_id) + 1
            if sent < attempts:
                self.unconfirmed[member_id] = sent  # to the back of the queue
        return picked

    def mark_live(self, member_id: str) -> None:
        self.recent_dead.pop(member_id, None)
        self._gone.pop(member_id, None)
        if member_id in self._live_index:
            return
        if not self.by_id[member_id].confirmed:
            self.unconfirmed.setdefault(member_id, 0)
        self._live_index[member_id] = len(self.live)
        self.live.append(member_id)
        # Probe a newcomer within the current round, at a random place in it.
        position = self._rng.randint(self._probe_pos, len(self._probe_order))
        self._probe_order.insert(position, member_id)

    def mark_gone(self, member_id: str, now: float) -> None:
        """A member became dead or left: out of the live set, into the recently dead."""
        self.recent_dead[member_id] = now
        self._gone[member_id] = None
        self._remove_live(member_id)

    def _remove_live(self, member_id: str) -> None:
        index = self._live_index.pop(member_id, None)
        if index is None:
            return
        last = self.live.pop()
        if last != member_id:
            self.live[index] = last
            self._live_index[last] = index

    def next_probe_target(self) -> str | None:
        for _ in range(2 * len(self.live) + 2):
            if self._probe_pos >= len(self._probe_order):
                self._probe_order = list(self.live)
                self._rng.shuffle(self._probe_order)
                self._probe_pos = 0
                if not self._probe_order:
                    return None
            member_id = self._probe_order[self._probe_pos]
            self._probe_pos += 1
            if member_id in self._live_index:
                return member_id
        return None

    def random_live(self, count: int, exclude: str | None = None) -> list[str]:
        pool = self.live
        if len(pool) <= count + 1:
            return [m for m in pool if m != exclude][:count]
        picked = self._rng.sample(pool, count + 1)
        return [m for m in picked if m != exclude][:count]

    def records(self) -> list[list]:
        return [m.record() for m in self.by_id.values()]

    def reap(self, now: float, gossip_to_the_dead_time: float, dead_retention: float,
             left_retention: float) -> None:
        """Forget the recently dead after a while, and dead and left members after longer.

        Runs every second on every member: it looks at the dead and left members only (kept
        in ``_gone``), not at the whole table."""
        for member_id, since in list(self.recent_dead.items()):
            if now - since > gossip_to_the_dead_time:
                del self.recent_dead[member_id]
        for member_id in list(self._gone):
            m = self.by_id[member_id]
            retention = left_retention if m.state == LEFT_STATE else dead_retention
            if now - m.since > retention:
                self._forget(member_id)
