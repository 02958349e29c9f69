"""The SWIM + Lifeguard membership protocol as a pure state machine (no I/O, no clock).

A driver feeds it datagrams (:meth:`Protocol.receive`), stream requests
(:meth:`Protocol.handle_stream`) and clock ticks (:meth:`Protocol.tick`), each with the
current time, and collects what it produced: datagrams to send
(:meth:`take_datagrams`), stream requests to make (:meth:`take_stream_requests`) and
membership events (:meth:`take_events`). :meth:`next_deadline` says when the next tick
is needed. The asyncio runtime, the simulator and the tests are three drivers of this
one class.

Failure semantics: nothing here raises on input from the network. A malformed,
unauthenticated, stale, replayed or foreign packet is dropped and counted in ``stats``
(``dropped`` and ``dropped.<reason>``); a message inside an accepted packet that is
refused (a new member beyond the table cap or the join rate, oversized metadata, a
ping for someone else) is counted under ``rejected.<reason>``.

Time: every ``now`` is the driver's clock (monotonic in the runtime, virtual in the
simulator). Sealed packets carry wall-clock time for the freshness check; it is
``now + wall_offset``, and a driver whose ``now`` is not shared with the other hosts
sets :attr:`Protocol.wall_offset` (the runtime sets it to ``time.time() - now``).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from . import wire
from .broadcast import BroadcastQueue
from .config import GossipConfig, push_pull_interval, suspicion_confirmations
from .lifeguard import Awareness, Suspicion
from .members import (
    ALIVE_STATE,
    DEAD_STATE,
    LEFT_STATE,
    SUSPECT_STATE,
    MemberInfo,
    MemberState,
    MemberTable,
    halved,
)
from .wire import ACK, ALIVE, DEAD, NACK, PAUSE, PING, PING_REQ, SUSPECT

_INF = math.inf


@dataclass(frozen=True)
class MemberEvent:
    """A change in membership: kind is joined, suspect, alive, dead, left, metadata or confirmed
    (the member answered this one directly for the first time, see ``MemberInfo.confirmed``)."""

    kind: str
    member: MemberInfo
    time: float
    source: str  # the member whose message caused it


@dataclass(frozen=True)
class Datagram:
    address: tuple[str, int]
    data: bytes
    target: str | None  # member id the datagram is meant for, when known (fault filters use it)


class StreamRequest:
    """A TCP request/response exchange the driver must perform (push/pull). ``data`` may
    be given as a function that builds it: it is built when first read (a full-state
    message to a member that cannot be reached need never be built)."""

    __slots__ = ("address", "target", "purpose", "_data")

    def __init__(self, address: tuple[str, int], target: str | None, data: bytes | Callable[[], bytes],
                 purpose: str) -> None:
        self.address = address
        self.target = target
        self.purpose = purpose  # join | sync | push_pull | reconnect
        self._data = data

    @property
    def data(self) -> bytes:
        if callable(self._data):
            self._data = self._data()
        return self._data

    def __repr__(self) -> str:
        return f"StreamRequest({self.address!r}, {self.target!r}, {self.purpose!r})"


@dataclass
class _Probe:
    target: str
    address: tuple[str, int]
    seq: int
    ack_deadline: float
    sent: float
    acked: bool = False
    indirect_sent: bool = False
    expected_nacks: int = 0
    nacks: int = 0


@dataclass
class _Relay:
    origin: tuple[str, int]
    origin_id: str
    origin_seq: int
    deadline: float


CONFIRMATION_ATTEMPTS = 3  # confirmation pings per unconfirmed member; then only regular probes
MAX_INCARNATION_STEP = 1 << 20
"""How far above the incarnation known here news of a member may be: each refutation adds
one, so no member ever gets near this; a larger jump is forged (see Protocol._implausible)."""
URGENT_ANSWER_MULT = 4.0
"""An on-demand probe waits at least this many times the member's slowest recent answer."""
URGENT_LATENESS_MULT = 2.0
"""...and ``urgent_probe_timeout`` plus this many times how late the member and this one
said they run (a starved member reads the ping late and sends the ack late)."""


@dataclass
class _Timers:
    probe: float = _INF
    gossip: float = _INF
    push_pull: float = _INF
    reconnect: float = _INF
    reap: float = _INF
    dead_ping: float = _INF


class Protocol:
    """One member's view of the cluster and the protocol that maintains it."""

    def __init__(self, member_id: str, host: str, port: int, *, cluster: str = "ftcomm",
                 secret: bytes | None = None, config: GossipConfig | None = None,
                 metadata: bytes = b"", seed: int | None = None) -> None:
        self.config = cfg = config or GossipConfig()
        self.id = member_id
        self._rng = random.Random(seed)
        freshness = dict(freshness_window=cfg.freshness_window, replay_cache_entries=cfg.replay_cache_entries)
        self._dgram = wire.Sealer(cluster, member_id, secret, cfg.max_datagram_bytes, **freshness)
        self._stream = wire.Sealer(cluster, member_id, secret, cfg.max_stream_bytes, **freshness)
        self._check_metadata(metadata)
        self._self = MemberState(member_id, host, port, 0, ALIVE_STATE, metadata, 0.0, confirmed=True)
        self._table = MemberTable(self._self, self._rng, capacity=cfg.max_members, join_rate=cfg.join_rate)
        self._suspicions: dict[str, Suspicion] = {}
        self._relays: dict[int, _Relay] = {}
        self._probe: _Probe | None = None
        self._urgent: dict[int, _Probe] = {}  # seq -> probe started by probe_now
        self._confirmations: dict[int, tuple[str, tuple[str, int], float]] = {}  # seq -> (id, address, deadline)
        self._corrected: dict[str, float] = {}  # member -> when it was last sent this member's record
        self._dead_turn = -1  # the dead member pinged last round (see _ping_the_dead)
        self._dead_pings: dict[int, str] = {}  # seq -> dead member pinged with it
        self._pushed: tuple[list[list], bytes] = ([], wire.encode([]))
        """The member records of the last push/pull built here and their encoding, reused while
        the table reads the same: every ``reconnect_interval`` a push/pull carries the whole
        table to a dead member, a thousand records in a large group, mostly unchanged."""
        self._seq = self._rng.getrandbits(32)  # unpredictable: an ack must answer a ping that was seen
        self._now = 0.0
        self.wall_offset = 0.0
        """Wall-clock seconds minus the driver's ``now``: sealed packets are stamped with,
        and checked for freshness against, ``now + wall_offset``. 0 when ``now`` is a
        clock every member shares (the simulator's virtual clock)."""
        self._broadcasts = BroadcastQueue()
        self._awareness = Awareness(self.config.awareness_max_multiplier)
        self._timers = _Timers()
        self._out: list[Datagram] = []
        self._streams: list[StreamRequest] = []
        self._events: list[MemberEvent] = []
        self.stats: Counter[str] = Counter()
        self.leaving = False
        self.last_refuted = float("-inf")  # the driver's clock when this member last refuted a suspicion
        self._armed = _INF  # when the driver's timer is set to fire (see timer_armed)
        self._late, self._late_at = 0.0, 0.0  # how late this member's ticks came (see lateness)
        self.started = False

    # ---------------------------------------------------------------- public API
    @property
    def incarnation(self) -> int:
        return self._self.incarnation

    @property
    def metadata(self) -> bytes:
        return self._self.meta

    @property
    def address(self) -> tuple[str, int]:
        """Where this member receives datagrams and stream requests."""
        return self._self.address

    @property
    def awareness(self) -> int:
        return self._awareness.score

    def lateness(self, now: float) -> float:
        """How late this member runs: the latest of its ticks behind the time the driver's
        timer was set for (:meth:`timer_armed`), halved every ``ANSWER_HALF_LIFE_S`` since. A
        starved CPU delays its timers (busy processes take its cores); its answers to pings
        say so, and the members probing it on demand wait longer before they suspect it
        (Lifeguard's local health, told to the prober). A pause longer than a probe interval
        does not count: the process was stopped, not slow (see ``tick``)."""
        return halved(self._late, self._late_at, now)

    def num_members(self) -> int:
        """Members believed alive or suspect, this one included."""
        return self._table.num_live()

    def members(self) -> list[MemberInfo]:
        return [m.info() for m in self._table.by_id.values()]

    def table_size(self) -> int:
        """How many members :meth:`members` lists (dead, left and this one included)."""
        return len(self._table.by_id)

    def member_states(self) -> list[tuple[str, str, bytes, bool]]:
        """``(id, state, metadata, confirmed)`` of every member, in :meth:`members` order:
        the fields a reader of status records needs, without building a snapshot of each
        member (the whole-group simulator reads a thousand tables of a thousand members)."""
        names = wire.STATE_NAMES
        return [(m.id, names[m.state], m.meta, m.confirmed) for m in self._table.by_id.values()]

    def member(self, member_id: str) -> MemberInfo | None:
        m = self._table.get(member_id)
        return m.info() if m else None

    def start(self, now: float) -> None:
        """Begin probing and announce this member."""
        self._now = now
        self.started = True
        self._self.since = now
        self._queue_alive_self()
        cfg = self.config
        self._timers.probe = now + self._rng.uniform(0, cfg.probe_interval)
        self._timers.gossip = now + self._rng.uniform(0, cfg.gossip_interval)
        if cfg.push_pull_interval > 0:
            self._timers.push_pull = now + self._rng.uniform(0.5, 1.0) * cfg.push_pull_interval
        self._timers.reconnect = now + cfg.reconnect_interval if cfg.reconnect_interval > 0 else _INF
        self._timers.reap = now + 1.0
        self._timers.dead_ping = now + cfg.probe_interval

    def bootstrap(self, records: list[list], now: float) -> None:
        """Adopt a member table known out of band (``[id, host, port, incarnation, state, meta]``
        records) without announcing each entry or emitting events: a static host list, or a
        simulator starting from a converged cluster. They count as confirmed (the list
        comes from the operator, not the network) and are not subject to ``max_members``."""
        for member_id, host, port, incarnation, state, meta in records:
            if member_id == self.id or self._table.get(member_id) is not None:
                continue
            state = ALIVE_STATE if state == SUSPECT_STATE else state
            self._table.add(MemberState(member_id, host, port, incarnation, state, meta, now, confirmed=True))

    def record(self) -> list:
        """This member's own record, as exchanged by push/pull."""
        return self._self.record()

    def join_request(self, now: float) -> bytes:
        """The first push/pull to send to a seed address."""
        self._now = now
        return self._push_pull_message(join=True)

    def set_metadata(self, metadata: bytes, now: float) -> None:
        """Replace this member's metadata; it spreads under a new incarnation. Ignored once
        leaving: a new alive record would replace the leave notice and undo it."""
        self._check_metadata(metadata)
        self._now = now
        if self.leaving:
            self.stats["metadata_after_leave"] += 1
            return
        self._self.meta = metadata
        self._raise_incarnation(self._self.incarnation)
        self._queue_alive_self()

    def declare_dead(self, member_id: str, now: float) -> bool:
        """Declare a member dead on outside evidence (its host refused a connection).

        The death is gossiped like any other; a member declared dead by mistake refutes
        it. Returns False when the member is unknown or already dead or left.
        """
        self._now = now
        m = self._table.get(member_id)
        if m is None or member_id == self.id or m.state in (DEAD_STATE, LEFT_STATE):
            return False
        self._declare_dead(member_id, m.incarnation, now)
        return True

    def announce(self, member_ids: list[str], now: float) -> int:
        """Send this member's current record directly to each of ``member_ids`` (live ones
        only; also gossiped as usual), with the notices of the members that died or left
        lately. For news a known set of members waits on, where an epidemic would take a
        few gossip rounds: a proposal that drops a dead member arrives with the evidence for
        it (piggybacked news would not do: its few transmissions go to the first targets of
        every such announcement, the same ones on every member). Returns how many were sent."""
        self._now = now
        alive = self._alive_self_message()
        room = self.config.max_datagram_bytes - self._dgram.overhead - len(alive) - 1
        messages = [alive, *self._departures(min(room, self.config.max_datagram_bytes // 2))]
        sent = 0
        for member_id in member_ids:
            address = self.reachable(member_id)
            if address is not None:
                self._send(address, member_id, messages)
                sent += 1
        self.stats["announced"] += sent
        return sent

    def _departures(self, budget: int) -> list[bytes]:
        """Notices of the members that died or left lately (newest first), within ``budget``
        bytes: a departure as its member announced it (with its final record), a death as
        this member's own claim."""
        notices = []
        for member_id, _ in sorted(self._table.recent_dead.items(), key=lambda item: -item[1]):
            m = self._table.get(member_id)
            if m is None:
                continue
            if m.state == LEFT_STATE:
                notice = wire.encode([DEAD, m.id, m.incarnation, m.id, m.meta])
            else:
                notice = wire.encode([DEAD, m.id, m.incarnation, self.id])
            if len(notice) + 1 > budget:
                continue  # a long final record must not keep the shorter notices out
            budget -= len(notice) + 1
            notices.append(notice)
        return notices

    def push_pull_request(self, now: float) -> bytes:
        """A push/pull request (this member's full table) for the driver to send itself."""
        self._now = now
        self.stats["push_pull_requested"] += 1
        return self._push_pull_message(False)

    def contact(self, address: tuple[str, int], now: float) -> None:
        """Send a join request (a push/pull) to whoever lives at ``address`` now: for a
        member known by its address only, not from this table (see
        :meth:`ftcomm.core.engine.Engine.group_probed`). Nothing happens when nobody answers."""
        self._now = now
        self._streams.append(StreamRequest(tuple(address), None, self._push_pull_message(join=True), "join"))

    def sync_with(self, member_id: str, now: float) -> bool:
        """Exchange full state with one member now (a push/pull), outside the periodic ones.

        For a caller that waits on news a member has published and that has not arrived:
        gossip delivers every update with high probability, not certainty, and the
        periodic push/pull that repairs a miss may be many seconds away. Returns False
        when the member is unknown, this member, or dead or left.
        """
        address = self.reachable(member_id)
        if address is None:
            return False
        self._streams.append(StreamRequest(address, member_id, self.push_pull_request(now), "sync"))
        return True

    def reachable(self, member_id: str) -> tuple[str, int] | None:
        """The address of another member believed alive or suspect; None otherwise."""
        m = self._table.get(member_id)
        if m is None or member_id == self.id or m.state in (DEAD_STATE, LEFT_STATE):
            return None
        return m.address

    def leave(self, now: float) -> None:
        """Announce a graceful departure: every member will mark this one *left*.

        The notice is sent directly to every live member and also gossiped; keep
        driving the protocol for ``leave_propagate_time`` afterwards.
        """
        if self.leaving:
            return
        self._now = now
        self.leaving = True
        # The notice carries the final metadata (receivers see how this member left even if
        # its last update was lost) and replaces the queued alive message.
        notice = wire.encode([DEAD, self.id, self._self.incarnation, self.id, self._self.meta])
        self._broadcasts.queue(self.id, notice)
        for member_id in self._table.live:
            self._send(self._table.get(member_id).address, member_id, [notice])

    def receive(self, data: bytes, source: tuple[str, int], now: float) -> None:
        """Handle one datagram from ``source``."""
        self._now = now
        try:
            sender, messages = self._dgram.open(data, now=self._wall())
        except wire.WireError as err:
            self._drop(err.reason)
            return
        self.stats["datagrams_received"] += 1
        self.stats["bytes_received"] += len(data)
        for message in messages:
            kind = message[0]
            if kind == PING:
                self._on_ping(message, source, sender)
            elif kind == ACK:
                self._on_ack(message[1], sender, now, message[2] / 1000 if len(message) > 2 else 0.0)
            elif kind == PING_REQ:
                self._on_ping_req(message, source, sender, now)
            elif kind == NACK:
                probe = self._probe if self._probe is not None and self._probe.seq == message[1] \
                    else self._urgent.get(message[1])
                if probe is not None:
                    probe.nacks += 1
            elif kind == ALIVE:
                self._on_alive(message[1], message[2], message[3], message[4], message[5], sender, now)
            elif kind == SUSPECT:
                self._correct_stale(message, sender, now)
                self._on_suspect(message[1], message[2], message[3], now)
            elif kind == DEAD:
                self._correct_stale(message, sender, now)
                self._on_dead(message[1], message[2], message[3], now, message[4] if len(message) > 4 else None)
            elif kind == PAUSE:
                self._on_pause(sender, message[1], message[2], now)

    def handle_stream(self, data: bytes, now: float) -> bytes:
        """Answer one TCP request (push/pull or a members query); never raises."""
        self._now = now
        try:
            sender, messages = self._stream.open(data, wire.STREAM_TYPES, now=self._wall())
            if len(messages) != 1 or messages[0][0] not in (wire.PUSH_PULL, wire.MEMBERS_QUERY):
                raise wire.WireError("unexpected_request", "a request is one push/pull or members query")
        except wire.WireError as err:
            self._drop(err.reason)
            return self._seal_stream([wire.ERROR, err.reason])
        message = messages[0]
        self.stats["streams_received"] += 1
        if message[0] == wire.PUSH_PULL:
            self._merge(message[2], sender, now)
            return self._push_pull_message(join=False)
        members = self._table.by_id.values()
        return self._seal_stream([wire.MEMBERS_REPLY, [m.record() for m in members], [m.confirmed for m in members]])

    def handle_stream_reply(self, data: bytes, now: float, address: tuple[str, int] | None = None) -> bool:
        """Merge the reply to a push/pull this member made to ``address``; False when it was
        unusable (an error reply, say because the peer found the request stale, counts as
        ``dropped.error_reply``). A reply from the member that lives at ``address``
        confirms it, as an ack to a ping would: a joiner trusts its seed at once."""
        self._now = now
        try:
            sender, messages = self._stream.open(data, wire.STREAM_TYPES, now=self._wall())
            if len(messages) != 1 or messages[0][0] != wire.PUSH_PULL:
                error = len(messages) == 1 and messages[0][0] == wire.ERROR
                raise wire.WireError("error_reply" if error else "unexpected_reply")
        except wire.WireError as err:
            self._drop(err.reason)
            return False
        self.stats["stream_replies_received"] += 1
        self._merge(messages[0][2], sender, now)
        if address is not None:
            self._confirm(sender, address, now)
        return True

    def tick(self, now: float) -> None:
        """Run every timer that is due at ``now``."""
        if not self.started:
            return
        self._now = now
        cfg = self.config
        if self._armed < now <= self._armed + cfg.probe_interval:
            self._late, self._late_at = max(now - self._armed, self.lateness(now)), now
        self._armed = _INF
        if self._relays:
            self._expire_relays(now)
        for seq in [seq for seq, p in self._urgent.items() if now >= p.ack_deadline]:
            held = self._paused_until(self._urgent[seq].target, now)
            if held:  # its answer is due once the pause it announced ends
                self._urgent[seq].ack_deadline = held
                self.stats["pause_holds"] += 1
                continue
            urgent = self._urgent.pop(seq)
            if now - urgent.ack_deadline <= self.config.probe_interval:  # else this member was paused
                self._judge_probe(urgent, now, urgent=True)
        probe = self._probe
        if probe and not probe.acked and not probe.indirect_sent and now >= probe.ack_deadline:
            self._send_indirect_probes(probe)
        if now >= self._timers.probe:
            if probe is not None:
                stalled = now - self._timers.probe > cfg.probe_interval
                if stalled:  # this member was paused: its own silence explains a missing ack
                    self._probe = None
                    self._awareness.apply(1)
                    self.stats["probes_abandoned_after_stall"] += 1
                else:
                    self._finish_probe(probe, now)
            if not self.leaving:
                self._start_probe(now)
                self._send_confirmation_pings(now)
            self._timers.probe = now + self._awareness.scale(cfg.probe_interval)
        if self._suspicions:
            for member_id, suspicion in list(self._suspicions.items()):
                if now >= suspicion.deadline:
                    self._declare_dead(member_id, suspicion.incarnation, now)
        if now >= self._timers.gossip:
            self._timers.gossip = now + cfg.gossip_interval
            if len(self._broadcasts):
                self._gossip(now)
        if now >= self._timers.push_pull:
            self._timers.push_pull = now + self._push_pull_period()
            self._start_push_pull(now)
        if now >= self._timers.reconnect:
            self._timers.reconnect = now + cfg.reconnect_interval
            self._start_reconnect()
        if now >= self._timers.dead_ping:
            # At the probe interval, not scaled by this member's awareness: a member that missed
            # many acks (it was cut off) is slow to accuse, but must not be slow to find the
            # members it declared dead alive again once the network is back.
            self._timers.dead_ping = now + cfg.probe_interval
            if not self.leaving:
                self._ping_the_dead()
        if now >= self._timers.reap:
            self._timers.reap = now + 1.0
            self._table.reap(now, cfg.gossip_to_the_dead_time, cfg.dead_member_retention, cfg.left_member_retention)

    def next_deadline(self) -> float:
        """The earliest time at which :meth:`tick` has work to do (a driver that sets its
        timer for it says so with :meth:`timer_armed`)."""
        t = self._timers
        deadline = min(t.probe, t.push_pull)
        if len(self._broadcasts):
            deadline = min(deadline, t.gossip)
        if self._table.has_gone_members():
            deadline = min(deadline, t.reap, t.reconnect, t.dead_ping)
        probe = self._probe
        if probe and not probe.acked and not probe.indirect_sent:
            deadline = min(deadline, probe.ack_deadline)
        for suspicion in self._suspicions.values():
            deadline = min(deadline, suspicion.deadline)
        for relay in self._relays.values():
            deadline = min(deadline, relay.deadline)
        for urgent in self._urgent.values():
            deadline = min(deadline, urgent.ack_deadline)
        return deadline

    def timer_armed(self, at: float) -> None:
        """The driver set its timer to call :meth:`tick` at ``at`` (a deadline from
        :meth:`next_deadline`; at once for one already past): a tick that comes later than
        that ran late (see :meth:`lateness`). A driver that keeps an earlier timer armed does
        not call it; one that never calls it measures no lateness."""
        self._armed = at

    def take_datagrams(self) -> list[Datagram]:
        out, self._out = self._out, []
        return out

    def take_stream_requests(self) -> list[StreamRequest]:
        out, self._streams = self._streams, []
        return out

    def take_events(self) -> list[MemberEvent]:
        out, self._events = self._events, []
        return out

    # ---------------------------------------------------------------- accounting
    def _wall(self) -> float:
        """Wall-clock time of the latest ``now``: what sealed packets are stamped and checked with."""
        return self._now + self.wall_offset

    def _drop(self, reason: str) -> None:
        """Count a packet dropped whole (it was never acted on)."""
        self.stats["dropped"] += 1
        self.stats["dropped." + reason] += 1

    # ---------------------------------------------------------------- probing
    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return self._seq

    def _start_probe(self, now: float) -> None:
        target = self._table.next_probe_target()
        if target is None:
            return
        m = self._table.get(target)
        seq = self._next_seq()
        buddy = None
        if m.state == SUSPECT_STATE:  # Lifeguard buddy system: tell the suspect first
            buddy = wire.encode([SUSPECT, target, m.incarnation, self.id])
        self._send((m.host, m.port), target, [wire.encode([PING, seq, target])], buddy)
        self._probe = _Probe(target, m.address, seq, now + self._awareness.scale(self.config.probe_timeout), now)

    def _ping_the_dead(self) -> None:
        """Every probe interval, ping one member declared dead (in turn; not one that left). One
        that answers is alive after all (a partition healed, it was paused) and may not know
        it was declared dead, so it would never refute: it is told (see _on_ack), refutes,
        and its new incarnation spreads at once, instead of at the next reconnection to it
        (one random dead member every ``reconnect_interval``)."""
        dead = self._table.dead()
        if not dead:
            return
        self._dead_turn = (self._dead_turn + 1) % len(dead)
        m = dead[self._dead_turn]
        seq = self._next_seq()
        if len(self._dead_pings) > 64:
            self._dead_pings.clear()
        self._dead_pings[seq] = m.id
        self._send(m.address, m.id, [wire.encode([PING, seq, m.id])], piggyback=False)
        self.stats["dead_pinged"] += 1

    def _send_indirect_probes(self, probe: _Probe) -> None:
        probe.indirect_sent = True
        target = self._table.get(probe.target)
        if target is None or target.state not in (ALIVE_STATE, SUSPECT_STATE):
            return
        helpers = self._table.random_live(self.config.indirect_checks, exclude=probe.target)
        request = wire.encode([PING_REQ, probe.seq, target.id, target.host, target.port])
        for helper_id in helpers:
            self._send(self._table.get(helper_id).address, helper_id, [request])
        probe.expected_nacks = len(helpers)

    def probe_now(self, member_ids: list[str], now: float) -> int:
        """Probe these members at once, directly and through ``indirect_checks`` helpers in
        the same moment (the driver asks when a collective has waited on them far longer than
        usual). A member that answers neither within ``urgent_probe_timeout`` (stretched on a
        busy host, see :meth:`_urgent_timeout`: a loaded host answers late but answers) is
        suspected, as after a regular probe; Lifeguard's suspicion timeout and
        refutation still decide whether it is declared dead. One such probe per member at a
        time; returns how many started. A suspect is told it is suspected with the ping (it
        refutes at once if it runs)."""
        self._now = now
        if self.leaving or not self.started:
            return 0
        busy = {p.target for p in self._urgent.values()}
        started = 0
        for member_id in member_ids:
            m = self._table.get(member_id)
            if m is None or member_id == self.id or member_id in busy or m.state not in (ALIVE_STATE, SUSPECT_STATE):
                continue
            seq = self._next_seq()
            timeout = self._urgent_timeout(m, now)
            probe = _Probe(member_id, m.address, seq, now + timeout, now)
            buddy = None
            if m.state == SUSPECT_STATE:  # Lifeguard buddy system: tell the suspect first, it refutes
                buddy = wire.encode([SUSPECT, member_id, m.incarnation, self.id])
            self._send(m.address, member_id, [wire.encode([PING, seq, member_id])], buddy)
            self._send_indirect_probes(probe)
            self._urgent[seq] = probe
            started += 1
        self.stats["urgent_probes"] += started
        return started

    def _urgent_timeout(self, m: MemberState, now: float) -> float:
        """How long an on-demand probe of ``m`` waits: ``urgent_probe_timeout`` on a quiet
        host; stretched to four times ``m``'s slowest recent answer, up to ``probe_timeout``,
        both scaled by this member's awareness (Lifeguard); or to ``urgent_probe_timeout``
        plus twice how late ``m`` and this member said they run, up to ``probe_interval``
        (not scaled again: a starved member's lateness is its health already)."""
        cfg = self.config
        slow = min(URGENT_ANSWER_MULT * m.recent_slowest(now), cfg.probe_timeout)
        late = min(cfg.urgent_probe_timeout + URGENT_LATENESS_MULT * (m.recent_lateness(now) + self.lateness(now)),
                   cfg.probe_interval)
        return max(self._awareness.scale(max(cfg.urgent_probe_timeout, slow)), late)

    def _finish_probe(self, probe: _Probe, now: float) -> None:
        self._probe = None
        self._judge_probe(probe, now)

    def _judge_probe(self, probe: _Probe, now: float, urgent: bool = False) -> None:
        """A probe's time is up: a target that did not answer is suspected. A regular probe
        also tells about this member's own health (a missed ack, and helpers' nacks that did
        not arrive, raise its awareness); an urgent one does not: it is judged after
        ``urgent_probe_timeout``, before a helper could have tried the target and sent its
        nack, and it is started on demand when a target may well be gone (a stalled
        collective, a member that does not propose), so counting it would stretch every
        timeout of a healthy member whose peers died."""
        if probe.acked:
            return
        if self._paused_until(probe.target, now):
            self.stats["pause_holds"] += 1
            return  # a pause it announced explains the silence; the next probe judges it
        if urgent:
            pass
        elif probe.expected_nacks:
            self._awareness.apply(probe.expected_nacks - probe.nacks)
        else:
            self._awareness.apply(1)
        m = self._table.get(probe.target)
        if m is not None and m.state in (ALIVE_STATE, SUSPECT_STATE):
            self.stats["probes_failed"] += 1
            self._on_suspect(m.id, m.incarnation, self.id, now)

    def pause_notice(self, wall: float, number: int) -> bytes:
        """The sealed datagram by which this member announces a pause of its own that starts
        now (a full garbage collection, which holds the GIL: the gossip thread cannot answer
        until it ends). Reads only the incarnation and the sealer, so that a garbage
        collector's callback may build it on any thread, even while this one is stopped in
        the middle of a method (see GossipNode). ``wall``: the wall-clock time it is sealed
        with; ``number``: larger than any this member sent before (copies are numbered
        apart, so that a secret's replay guard takes each once)."""
        return self._dgram.seal([wire.encode([PAUSE, self._self.incarnation, number % (wire.MAX_SEQ + 1)])], now=wall)

    def _on_pause(self, sender: str, incarnation: int, number: int, now: float) -> None:
        """``sender`` announced a pause: probes it leaves unanswered are judged only once
        ``pause_grace`` has passed since its latest notice (each notice is another
        collection; between two it runs and answers). Its incarnation may be newer than the
        one known here (its refutation may not have come round yet), not older; its number
        must be above the last one honoured (a copy or a replay of an older notice holds
        nothing)."""
        m = self._table.get(sender)
        grace = self.config.pause_grace
        if m is None or sender == self.id or grace <= 0 or incarnation < m.incarnation \
                or m.state not in (ALIVE_STATE, SUSPECT_STATE):
            self.stats["pause_notices_ignored"] += 1
            return
        if number <= m.pause_number:
            self.stats["pause_notices_old"] += 1
            return
        self.stats["pause_notices"] += 1
        m.pause_number = number
        m.paused_until = max(m.paused_until, now + grace)

    def _paused_until(self, member_id: str, now: float) -> float:
        """When the pause ``member_id`` announced ends, if one is under way; else 0."""
        m = self._table.get(member_id)
        return m.paused_until if m is not None and m.paused_until > now else 0.0

    def _on_ping(self, message: list, source: tuple[str, int], sender: str) -> None:
        if message[2] != self.id:
            self.stats["rejected.wrong_target"] += 1
            return
        notice = None
        m = self._table.get(sender)
        if m is not None and m.state == DEAD_STATE:  # it must learn it was declared dead
            notice = wire.encode([DEAD, sender, m.incarnation, self.id])
        late = min(round(self.lateness(self._now) * 1000), wire.MAX_LATENESS_MS)
        self._send(source, sender, [wire.encode([ACK, message[1], late] if late else [ACK, message[1]])], notice)

    def _on_ack(self, seq: int, sender: str, now: float, lateness: float = 0.0) -> None:
        if self._dead_pings.get(seq) == sender:  # a member declared dead answers: tell it, it refutes
            del self._dead_pings[seq]
            m = self._table.get(sender)
            if m is not None and m.state == DEAD_STATE:
                self._send(m.address, m.id, [wire.encode([DEAD, sender, m.incarnation, self.id])], piggyback=False)
                self.stats["dead_told"] += 1
            return
        probe = self._probe if self._probe is not None and self._probe.seq == seq else self._urgent.get(seq)
        if probe is not None:
            if not probe.acked:
                probe.acked = True
                self._awareness.apply(-1)
            if sender == probe.target:  # not an ack relayed by a helper
                self._confirm(sender, probe.address, now)
                m = self._table.get(sender)
                if m is not None:  # (an honest member's figure never exceeds its probe interval)
                    m.answered(now - probe.sent, now, min(lateness, self.config.probe_interval))
            return
        confirmation = self._confirmations.get(seq)
        if confirmation is not None:
            if sender == confirmation[0]:  # an ack from anyone else does not use up the ping
                del self._confirmations[seq]
                self._confirm(sender, confirmation[1], now)
            return
        relay = self._relays.pop(seq, None)
        if relay is not None:
            self._send(relay.origin, relay.origin_id, [wire.encode([ACK, relay.origin_seq])])

    def _on_ping_req(self, message: list, source: tuple[str, int], sender: str, now: float) -> None:
        _, origin_seq, target_id, host, port = message
        seq = self._next_seq()
        deadline = now + self.config.probe_timeout * self.config.nack_timeout_fraction
        self._relays[seq] = _Relay(source, sender, origin_seq, deadline)
        self._send((host, port), target_id, [wire.encode([PING, seq, target_id])])

    # ---------------------------------------------------------------- confirmation
    def _send_confirmation_pings(self, now: float) -> None:
        """Ping members learned through gossip that have not answered us directly yet.

        Separate from the failure detector: an unanswered confirmation ping is no
        evidence against anyone; the regular probes still judge every member.
        """
        if self._confirmations:
            self._confirmations = {seq: c for seq, c in self._confirmations.items() if c[2] > now}
        for member_id in self._table.next_to_confirm(self.config.confirmation_pings, CONFIRMATION_ATTEMPTS):
            self._ping_to_confirm(self._table.get(member_id), now)

    def _ping_to_confirm(self, m: MemberState, now: float, piggyback: bool = True) -> None:
        """One confirmation ping. A newcomer gets one at once, besides the rounds' attempts (a
        joiner is of use only once confirmed; admissions are bounded by ``join_rate``)."""
        seq = self._next_seq()
        self._confirmations[seq] = (m.id, m.address, now + self._awareness.scale(self.config.probe_interval))
        self._send(m.address, m.id, [wire.encode([PING, seq, m.id])], piggyback=piggyback)
        self.stats["confirmation_pings"] += 1

    def _confirm(self, member_id: str, pinged: tuple[str, int], now: float) -> None:
        """``member_id`` answered, with its own id, a ping this member sent to ``pinged``:
        proof that it lives there, if that is still its address."""
        m = self._table.get(member_id)
        if m is not None and m.address == pinged and self._table.confirm(member_id):
            self._emit("confirmed", m, now, member_id)

    def _expire_relays(self, now: float) -> None:
        for seq in [s for s, r in self._relays.items() if now >= r.deadline]:
            relay = self._relays.pop(seq)
            self._send(relay.origin, relay.origin_id, [wire.encode([NACK, relay.origin_seq])])

    # ---------------------------------------------------------------- state changes
    def _implausible(self, member_id: str, incarnation: int) -> bool:
        """News of ``member_id`` at an incarnation further above the one known here than any
        member ever refutes (``MAX_INCARNATION_STEP``): forged (with the secret, or in a group
        without one), it would put the member at the top of the range, beyond refutation.
        Dropped and counted; a member not known yet is judged by nothing."""
        known = self._self if member_id == self.id else self._table.get(member_id)
        if known is None or incarnation <= known.incarnation + MAX_INCARNATION_STEP:
            return False
        self.stats["rejected.incarnation_jump"] += 1
        return True

    def _on_alive(self, member_id: str, incarnation: int, host: str, port: int, meta: bytes,
                  source: str, now: float) -> None:
        if self._implausible(member_id, incarnation):
            return
        if member_id == self.id:
            if incarnation > self._self.incarnation and not self.leaving:
                self._refute(incarnation)
            return
        if len(meta) > self.config.max_metadata_bytes:
            self.stats["rejected.oversized_metadata"] += 1
            return
        m = self._table.get(member_id)
        if m is None:
            m = MemberState(member_id, host, port, incarnation, ALIVE_STATE, meta, now)
            refused = self._table.admit(m, now)
            if refused is not None:
                self.stats["rejected." + refused] += 1
                return
            self._emit("joined", m, now, source)
            if not m.confirmed and self.started and not self.leaving:
                self._ping_to_confirm(m, now, piggyback=False)  # news goes to the members that spread it
        else:
            if incarnation <= m.incarnation:
                return
            previous_state, previous_meta = m.state, m.meta
            moved = (host, port) != m.address
            m.incarnation, m.host, m.port, m.meta = incarnation, host, port, meta
            if moved and m.confirmed:
                self._table.unconfirm(member_id)
            if previous_state != ALIVE_STATE:
                self._suspicions.pop(member_id, None)
                m.state, m.since = ALIVE_STATE, now
                self._table.mark_live(member_id)
                self._emit("alive", m, now, source)
            if meta != previous_meta:
                self._emit("metadata", m, now, source)
        self._broadcasts.queue(member_id, wire.encode([ALIVE, member_id, incarnation, host, port, meta]))

    def _on_suspect(self, member_id: str, incarnation: int, suspecter: str, now: float) -> None:
        if self._implausible(member_id, incarnation):
            return
        if member_id == self.id:
            if not self.leaving and incarnation >= self._self.incarnation:
                self._refute(incarnation)
                # The suspecter's timer started first and runs out first: it hears the
                # refutation at once rather than when gossip brings it round.
                if self._tell_alive(suspecter, now):
                    self.stats["refutations_sent_to_suspecter"] += 1
            return
        m = self._table.get(member_id)
        if m is None or incarnation < m.incarnation or m.state in (DEAD_STATE, LEFT_STATE):
            return
        if m.state == SUSPECT_STATE and incarnation == m.incarnation:
            suspicion = self._suspicions.get(member_id)
            if suspicion is not None and suspicion.confirm(suspecter):
                self._broadcasts.queue(member_id, wire.encode([SUSPECT, member_id, incarnation, suspecter]))
            return
        n = self.num_members()
        cfg = self.config
        self._suspicions[member_id] = Suspicion(
            incarnation, suspecter, now, suspicion_confirmations(cfg.suspicion_mult, n),
            cfg.min_suspicion_timeout(n), cfg.max_suspicion_timeout(n))
        m.state, m.incarnation, m.since = SUSPECT_STATE, incarnation, now
        self._emit("suspect", m, now, suspecter)
        self._broadcasts.queue(member_id, wire.encode([SUSPECT, member_id, incarnation, suspecter]))

    def _on_dead(self, member_id: str, incarnation: int, reporter: str, now: float,
                 meta: bytes | None = None) -> None:
        """``meta``: a leaving member's final metadata, carried by its notice (so that every
        member learns how it left even where the update sent just before was lost)."""
        if self._implausible(member_id, incarnation):
            return
        if member_id == self.id:
            if not self.leaving and incarnation >= self._self.incarnation:
                self._refute(incarnation)
            return
        m = self._table.get(member_id)
        left = reporter == member_id
        if m is None or incarnation < m.incarnation:
            return
        if m.state == LEFT_STATE:
            # a later departure notice (a newer incarnation) may carry a newer final record
            if left and meta is not None and incarnation > m.incarnation and \
                    len(meta) <= self.config.max_metadata_bytes:
                m.meta, m.incarnation = meta, incarnation
                self._emit("metadata", m, now, reporter)
            return
        if left and meta is not None and len(meta) <= self.config.max_metadata_bytes and meta != m.meta:
            m.meta = meta
            self._emit("metadata", m, now, reporter)  # the final record first, then the departure
        if m.state == DEAD_STATE and not left:
            return
        self._suspicions.pop(member_id, None)
        self._table.mark_gone(member_id, now)
        m.state, m.incarnation, m.since = (LEFT_STATE if left else DEAD_STATE), incarnation, now
        self._emit("left" if left else "dead", m, now, reporter)
        notice = [DEAD, member_id, incarnation, reporter] + ([m.meta] if left else [])
        self._broadcasts.queue(member_id, wire.encode(notice))

    def _correct_stale(self, message: list, sender: str, now: float) -> None:
        """A suspicion or death notice of an incarnation of this member older than its own:
        whoever sent or started it missed the refutation, and nobody gossips that again (the
        others know the newer incarnation and drop the stale notice), so its suspicion would
        run out and bury a live member. Both get this member's current record straight away,
        at most once per probe interval each."""
        if message[1] != self.id or message[2] >= self._self.incarnation or self.leaving:
            return
        for holder in dict.fromkeys((sender, message[3])):  # (in a fixed order: a seed replays exactly)
            if self._tell_alive(holder, now):
                self.stats["stale_news_corrected"] += 1

    def _tell_alive(self, holder: str, now: float) -> bool:
        """Send this member's current record straight to ``holder`` (one that suspects it),
        at most once per probe interval per holder; True when sent."""
        if len(self._corrected) > 64:
            self._corrected = {k: t for k, t in self._corrected.items() if now - t < self.config.probe_interval}
        m = self._table.get(holder)
        if m is None or holder == self.id or now - self._corrected.get(holder, float("-inf")) < self.config.probe_interval:
            return False
        self._corrected[holder] = now
        self._send(m.address, m.id, [self._alive_self_message()], piggyback=False)
        return True

    def _declare_dead(self, member_id: str, incarnation: int, now: float) -> None:
        if self._table.get(member_id) is None:  # forgotten while suspected, to make room in a full table
            self._suspicions.pop(member_id, None)
            return
        self.stats["declared_dead"] += 1
        self._on_dead(member_id, incarnation, self.id, now)

    def _refute(self, incarnation: int) -> None:
        self.stats["refutations"] += 1
        self.last_refuted = self._now
        self._raise_incarnation(incarnation)
        self._awareness.apply(1)
        self._queue_alive_self()

    def _raise_incarnation(self, seen: int) -> None:
        """Move this member's incarnation above ``seen`` (and its own), within the wire's range.

        Decoding caps every received incarnation at ``wire.MAX_INCARNATION``, so only
        forged news in a group without a secret can bring a member there; it then stays
        at the cap (counted) rather than sending numbers its peers would drop.
        """
        if max(self._self.incarnation, seen) >= wire.MAX_INCARNATION:
            self.stats["incarnation_exhausted"] += 1
        self._self.incarnation = min(max(self._self.incarnation, seen) + 1, wire.MAX_INCARNATION)

    def _queue_alive_self(self) -> None:
        self._broadcasts.queue(self.id, self._alive_self_message())

    def _alive_self_message(self) -> bytes:
        s = self._self
        return wire.encode([ALIVE, s.id, s.incarnation, s.host, s.port, s.meta])

    def _emit(self, kind: str, m: MemberState, now: float, source: str) -> None:
        self._events.append(MemberEvent(kind, m.info(), now, source))

    # ---------------------------------------------------------------- dissemination
    def _send(self, address: tuple[str, int], target: str | None, messages: list[bytes],
              first: bytes | None = None, piggyback: bool = True) -> None:
        budget = self.config.max_datagram_bytes - self._dgram.overhead - sum(len(m) + 1 for m in messages)
        extra = self._broadcasts.take(budget, self.config.retransmit_limit(self.num_members()), first) \
            if piggyback else []
        data = self._dgram.seal(messages + extra, now=self._wall())
        self._out.append(Datagram(address, data, target))
        self.stats["datagrams_sent"] += 1
        self.stats["bytes_sent"] += len(data)

    def _gossip(self, now: float) -> None:
        targets = self._table.random_live(self.config.gossip_nodes)
        if self._table.recent_dead:
            targets.extend(self._rng.sample(sorted(self._table.recent_dead), 1))
        budget = self.config.max_datagram_bytes - self._dgram.overhead
        limit = self.config.retransmit_limit(self.num_members())
        for target in targets:
            messages = self._broadcasts.take(budget, limit)
            if not messages:
                return
            m = self._table.get(target)
            if m is None:
                continue
            data = self._dgram.seal(messages, now=self._wall())
            self._out.append(Datagram((m.host, m.port), data, target))
            self.stats["datagrams_sent"] += 1
            self.stats["bytes_sent"] += len(data)

    # ---------------------------------------------------------------- anti-entropy
    def _push_pull_message(self, join: bool) -> bytes:
        records = self._table.records()
        pushed = self._pushed
        if records != pushed[0]:
            pushed = self._pushed = (records, wire.encode(records))
        return self._stream.seal([wire.encode_push_pull(join, pushed[1])], now=self._wall())

    def _seal_stream(self, message: list) -> bytes:
        return self._stream.seal([wire.encode(message)], now=self._wall())

    def _push_pull_period(self) -> float:
        return push_pull_interval(self.config.push_pull_interval, self.num_members())

    def _start_push_pull(self, now: float) -> None:
        picked = self._table.random_live(1)
        if picked:
            m = self._table.get(picked[0])
            self._streams.append(StreamRequest((m.host, m.port), m.id, self._push_pull_message(False), "push_pull"))

    def _start_reconnect(self) -> None:
        dead = self._table.dead()
        if dead:
            m = self._rng.choice(dead)
            self._streams.append(StreamRequest((m.host, m.port), m.id, lambda: self._push_pull_message(False), "reconnect"))

    def _merge(self, records: list[list], sender: str, now: float) -> None:
        for member_id, host, port, incarnation, state, meta in records:
            if state == ALIVE_STATE:
                self._on_alive(member_id, incarnation, host, port, meta, sender, now)
            elif state == LEFT_STATE:
                self._on_dead(member_id, incarnation, member_id, now, meta)
            else:  # a remote "dead" is only a suspicion here: let the member refute
                self._on_suspect(member_id, incarnation, sender, now)

    def _check_metadata(self, metadata: bytes) -> None:
        if len(metadata) > self.config.max_metadata_bytes:
            raise ValueError(
                f"member metadata is {len(metadata)} bytes; the limit is "
                f"max_metadata_bytes={self.config.max_metadata_bytes}: keep it to small status fields")
