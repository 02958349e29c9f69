"""Simulator: N protocol cores on a virtual clock and a lossy, delaying network, in one process.

Drives the same :class:`~ftcomm.gossip.protocol.Protocol` the runtime drives, with real
encoded packets, so its figures (detection time, dissemination time, false positives,
messages and bytes per member per second) describe the real protocol. It is
event-driven: a heap of deliveries and timer deadlines, so idle members cost nothing.

Command line (``--json`` prints one JSON object)::

    python -m ftcomm.gossip.sim --n 1000 --loss 0.05 --duration 60 --crash-at 20 --json
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .config import GossipConfig, parse_assignments
from .protocol import MemberEvent, Protocol, StreamRequest
from .runtime import PAUSE_COPIES

PORT = 7946
_TIMER, _DELIVER, _STREAM, _STREAM_REPLY, _ACTION = range(5)


@dataclass
class _Node:
    index: int
    protocol: Protocol
    crashed: bool = False
    stalled: bool = False
    inbox: list = field(default_factory=list)
    scheduled: float = math.inf
    due: float = math.inf  # while starved: the protocol's deadline that ``lagged`` delays
    lagged: float = math.inf


class Simulation:
    """A virtual cluster. Schedule faults with the ``at_*`` methods, then :meth:`run_until`.

    With ``secret`` every packet is sealed as on a real cluster (HMAC, and a timestamp
    from the virtual clock, which every member shares). ``metadata``: each member's at the
    start (with ``bootstrap``, every member knows all of it from the start)."""

    def __init__(self, n: int, config: GossipConfig | None = None, *, loss: float = 0.0,
                 delay: tuple[float, float] = (0.0002, 0.002), seed: int = 0,
                 bootstrap: bool = True, secret: bytes | None = None,
                 metadata: list[bytes] | None = None) -> None:
        self.config = config or GossipConfig()
        self.loss = loss
        self.delay = delay
        self.now = 0.0
        self._rng = random.Random(seed)
        self._heap: list[tuple] = []
        self._seq = 0
        self._pause_numbers: dict[int, int] = {}  # the next number of each member's pause notices
        self._partition: tuple[frozenset[int], frozenset[int]] | None = None
        self.slow: dict[int, float] = {}  # member index -> extra delay of every datagram it sends
        # member index -> its CPU starvation: each of its timers, each datagram it sends or
        # receives and each TCP exchange it takes part in runs up to this many seconds late
        self.starved: dict[int, float] = {}
        self._starve_rng = random.Random(f"{seed}/starved")  # (drawn from only while one is starved)
        self.nodes: list[_Node] = []
        self._by_address: dict[tuple[str, int], int] = {}
        self._by_id: dict[str, int] = {}
        self._secret = secret
        self.listeners: list[Callable[[int, MemberEvent], None]] = []
        for i in range(n):
            self._new_node(metadata[i] if metadata is not None else b"")
        records = [node.protocol.record() for node in self.nodes]
        for node in self.nodes:
            if bootstrap:
                node.protocol.bootstrap(records, 0.0)
            node.protocol.start(0.0)
            self._after(node)
        if not bootstrap:  # everyone joins through member 0
            for node in self.nodes[1:]:
                self._push(self._rng.uniform(0, 1.0), _STREAM, (node.index, 0, node.protocol.join_request(0.0)))

    def _new_node(self, metadata: bytes = b"", host: str | None = None) -> _Node:
        i = len(self.nodes)
        host = host or f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}"
        member_id = f"{host}:{PORT}/{self._rng.getrandbits(32):08x}"
        protocol = Protocol(member_id, host, PORT, config=self.config, secret=self._secret,
                            metadata=metadata, seed=self._rng.getrandbits(32))
        node = _Node(i, protocol)
        self.nodes.append(node)
        self._by_address[(host, PORT)] = i
        self._by_id[member_id] = i
        return node

    def add_node(self, seed_index: int = 0, in_place_of: int | None = None) -> int:
        """A new member, started now, that joins through member ``seed_index``; its index.
        During a partition it starts on its seed's side (it reaches what its seed reaches:
        a node that is off the network is off it for newcomers too). ``in_place_of``: a
        member whose process is gone, on whose host this one starts again: at its address
        (what arrives there from then on reaches the new member) and on its side of a
        partition."""
        side = seed_index if in_place_of is None else in_place_of
        host = None if in_place_of is None else self.member_id(in_place_of).split(":")[0]
        node = self._new_node(host=host)
        if self._partition is not None:
            side_a, side_b = self._partition
            self._partition = ((side_a | {node.index}, side_b) if side in side_a
                               else (side_a, side_b | {node.index}))
        node.protocol.start(self.now)
        self._after(node)
        self.join_through(node.index, seed_index)
        return node.index

    def join_through(self, index: int, seed_index: int) -> None:
        """Member ``index`` sends a join request to member ``seed_index`` now."""
        self._push(self.now, _STREAM, (index, seed_index, self.nodes[index].protocol.join_request(self.now)))

    # ------------------------------------------------------------ scheduling faults
    def member_id(self, index: int) -> str:
        return self.nodes[index].protocol.id

    def at(self, t: float, action: Callable[[], None]) -> None:
        self._push(t, _ACTION, action)

    def at_crash(self, t: float, index: int) -> None:
        self.at(t, lambda: setattr(self.nodes[index], "crashed", True))

    def at_stall(self, t: float, index: int, duration: float) -> None:
        self.at(t, lambda: setattr(self.nodes[index], "stalled", True))
        self.at(t + duration, lambda: self._resume(self.nodes[index]))

    def at_partition(self, t: float, side_a: set[int], side_b: set[int], heal_at: float | None = None) -> None:
        self.at(t, lambda: setattr(self, "_partition", (frozenset(side_a), frozenset(side_b))))
        if heal_at is not None:
            self.at(heal_at, lambda: setattr(self, "_partition", None))

    def at_metadata(self, t: float, index: int, metadata: bytes) -> None:
        def change() -> None:
            node = self.nodes[index]
            node.protocol.set_metadata(metadata, self.now)
            self._after(node)
        self.at(t, change)

    def flush(self, index: int) -> None:
        """Route what member ``index``'s protocol produced after a call from outside (a
        driver's announce, sync or metadata change) and re-arm its timer."""
        self._after(self.nodes[index])

    def partition(self, side_a: set[int], side_b: set[int]) -> None:
        """Cut every path between the two sides now (until :meth:`heal`)."""
        self._partition = (frozenset(side_a), frozenset(side_b))

    def heal(self) -> None:
        self._partition = None

    @property
    def partitioned(self) -> bool:
        return self._partition is not None

    def blocked(self, a: int, b: int) -> bool:
        """Whether the partition cuts member ``a`` off from member ``b``."""
        return self._blocked(a, b)

    def announce_pause(self, index: int) -> None:
        """Member ``index`` announces a pause of its own (a full garbage collection) to every
        member it knows, as its runtime's collector callback does (see GossipNode)."""
        node = self.nodes[index]
        number = self._pause_numbers.get(index, 0)
        self._pause_numbers[index] = number + PAUSE_COPIES
        packets = [node.protocol.pause_notice(self.now, number + copy) for copy in range(PAUSE_COPIES)]
        for other in node.protocol.members():
            dst = self._by_address.get((other.host, other.port))
            if dst is None or dst == index or other.state not in ("alive", "suspect") or self._blocked(index, dst):
                continue
            for packet in packets:  # each lost, delayed and late like any datagram
                if self.loss and self._rng.random() < self.loss:
                    continue
                self._push(self.now + self._rng.uniform(*self.delay) + self.slow.get(index, 0.0) + self.late(dst),
                           _DELIVER, (dst, packet, (node.protocol.id.split(":")[0], PORT)))

    def resume(self, index: int) -> None:
        """A stalled member runs again: it takes what arrived meanwhile and catches up."""
        self._resume(self.nodes[index])

    # ------------------------------------------------------------ the event loop
    def run_until(self, t_end: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t_end:
            t, _, kind, payload = heapq.heappop(heap)
            self.now = t
            if kind == _TIMER:
                node = self.nodes[payload]
                if node.crashed or node.stalled or node.scheduled != t:
                    continue
                node.scheduled = math.inf
                node.protocol.tick(t)
                self._after(node)
            elif kind == _DELIVER:
                index, data, source = payload
                node = self.nodes[index]
                if node.crashed:
                    continue
                if node.stalled:
                    node.inbox.append((data, source))
                    continue
                node.protocol.receive(data, source, t)
                self._after(node)
            elif kind == _STREAM:
                self._stream(*payload)
            elif kind == _STREAM_REPLY:
                index, reply, address = payload
                node = self.nodes[index]
                if not (node.crashed or node.stalled):
                    node.protocol.handle_stream_reply(reply, t, address)
                    self._after(node)
            else:
                payload()
        self.now = t_end

    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def _blocked(self, a: int, b: int) -> bool:
        p = self._partition
        return p is not None and ((a in p[0] and b in p[1]) or (a in p[1] and b in p[0]))

    def _after(self, node: _Node) -> None:
        """Route what a protocol produced and re-arm its timer."""
        protocol = node.protocol
        now = self.now
        for datagram in protocol.take_datagrams():
            dst = self._by_address.get(datagram.address)
            if dst is None or self._blocked(node.index, dst):
                continue
            if self.loss and self._rng.random() < self.loss:
                continue
            self._push(now + self._rng.uniform(*self.delay) + self.slow.get(node.index, 0.0)
                       + self.late(node.index) + self.late(dst), _DELIVER,
                       (dst, datagram.data, (protocol.id.split(":")[0], PORT)))
        for request in protocol.take_stream_requests():
            dst = self._by_address.get(request.address)
            if dst is not None:
                if not self.nodes[dst].crashed:  # (a crashed node stays down: its exchange will fail)
                    request.data  # built now, as a driver sends it now
                self._push(now + self._rng.uniform(*self.delay) + self.late(node.index) + self.late(dst), _STREAM,
                           (node.index, dst, request))
        events = protocol.take_events()
        if events and self.listeners:
            for event in events:
                for listener in self.listeners:
                    listener(node.index, event)
        deadline = due = max(now, protocol.next_deadline())
        if node.index in self.starved and deadline < math.inf:  # its timer fires late, by one draw per deadline
            if deadline != node.due:
                node.due, node.lagged = deadline, deadline + self.late(node.index)
            deadline = node.lagged
        if deadline != node.scheduled and deadline < math.inf:
            node.scheduled = deadline
            self._push(deadline, _TIMER, node.index)
            protocol.timer_armed(due)  # (a starved member's timer fires later than that)

    def late(self, index: int) -> float:
        """How late a starved member (:attr:`starved`) runs this once; 0 for any other."""
        lag = self.starved.get(index)
        return self._starve_rng.uniform(0.0, lag) if lag else 0.0

    def _stream(self, src: int, dst: int, message: bytes | StreamRequest) -> None:
        target = self.nodes[dst]
        if target.crashed or target.stalled or self._blocked(src, dst):
            return  # the TCP exchange fails; the requester simply tries again later
        data = message if isinstance(message, bytes) else message.data
        reply = target.protocol.handle_stream(data, self.now)
        self._after(target)
        address = target.protocol.address
        self._push(self.now + self._rng.uniform(*self.delay) + self.late(src), _STREAM_REPLY, (src, reply, address))

    def _resume(self, node: _Node) -> None:
        node.stalled = False
        inbox, node.inbox = node.inbox, []
        for data, source in inbox:
            node.protocol.receive(data, source, self.now)
        node.protocol.tick(self.now)
        node.scheduled = math.inf
        self._after(node)

    # ------------------------------------------------------------ traffic totals
    def traffic(self) -> tuple[int, int]:
        """Datagrams and bytes sent by all members so far (TCP push/pull excluded)."""
        datagrams = sum(node.protocol.stats["datagrams_sent"] for node in self.nodes)
        sent = sum(node.protocol.stats["bytes_sent"] for node in self.nodes)
        return datagrams, sent


@dataclass
class ScenarioResult:
    n: int
    loss: float
    duration_s: float
    wall_s: float
    probe_interval_s: float
    analytic_first_detection_s: float
    crash_first_suspect_s: float | None
    crash_first_dead_s: float | None
    crash_last_dead_s: float | None
    crash_undetected_members: int | None
    metadata_50pct_s: float | None
    metadata_9999pct_s: float | None
    metadata_reached_fraction: float | None
    false_dead_declarations: int  # (observer, member) pairs where a live member was marked dead
    false_suspicions: int  # distinct (member, incarnation) suspicions of live members
    stalled_member_declared_dead: bool | None
    slow_delay_s: float | None
    slow_member_deaths: int | None  # times members marked the slow member dead (its answers delayed, not lost)
    slow_member_suspicions: int | None  # distinct (incarnation) suspicions of the slow member
    messages_per_member_s: float
    bytes_per_member_s: float


def run_scenario(n: int, *, loss: float = 0.0, duration: float = 60.0, crash_at: float | None = 20.0,
                 metadata_at: float | None = 10.0, stall_at: float | None = None, stall_for: float = 2.0,
                 seed: int = 0, config: GossipConfig | None = None, slow_delay: float | None = None) -> ScenarioResult:
    """Run one scenario and measure it.

    Member 0 changes its metadata at ``metadata_at``; member n-1 crashes at ``crash_at``;
    member n-2 stalls for ``stall_for`` seconds at ``stall_at``; member n-3 is slow
    throughout: every datagram it sends (acks included) arrives ``slow_delay`` seconds
    late. Traffic is averaged over the whole run.
    """
    started = time.perf_counter()
    sim = Simulation(n, config, loss=loss, seed=seed)
    cfg = sim.config
    crashed = n - 1 if crash_at is not None else None
    crashed_id = sim.member_id(crashed) if crashed is not None else None
    stalled_id = sim.member_id(n - 2) if stall_at is not None and n > 2 else None
    meta_source_id = sim.member_id(0)
    slow_id = sim.member_id(n - 3) if slow_delay is not None and n > 3 else None
    if slow_id is not None:
        sim.slow[n - 3] = slow_delay
    slow = {"dead": 0, "suspicions": set()}
    first_suspect: list[float] = []
    dead_at: dict[int, float] = {}
    meta_at: dict[int, float] = {}
    false = {"dead": 0, "stalled_dead": False}
    false_suspicions: set[tuple[str, int]] = set()

    def listen(observer: int, event: MemberEvent) -> None:
        target = event.member.id
        if target == crashed_id:
            if event.kind == "suspect" and not first_suspect:
                first_suspect.append(event.time)
            elif event.kind == "dead" and observer not in dead_at:
                dead_at[observer] = event.time
        elif event.kind == "dead":
            false["dead"] += 1
            false["stalled_dead"] |= target == stalled_id
            slow["dead"] += target == slow_id
        elif event.kind == "suspect":
            false_suspicions.add((target, event.member.incarnation))
            if target == slow_id:
                slow["suspicions"].add(event.member.incarnation)
        if (target == meta_source_id and event.kind == "metadata" and event.member.metadata == b"v2"
                and observer != crashed):
            meta_at.setdefault(observer, event.time)

    sim.listeners.append(listen)
    if metadata_at is not None:
        sim.at_metadata(metadata_at, 0, b"v2")
    if crashed is not None:
        sim.at_crash(crash_at, crashed)
    if stalled_id is not None:
        sim.at_stall(stall_at, n - 2, stall_for)
    sim.run_until(duration)
    datagrams, sent = sim.traffic()

    def after(t: float | None, base: float | None) -> float | None:
        return None if t is None or base is None else round(t - base, 4)

    observers = n - 1 - (1 if crashed is not None else 0)  # the metadata source does not count itself
    meta_times = sorted(meta_at.values())
    q9999 = math.ceil(0.9999 * observers)
    survivors = n - 1 if crashed is not None else None
    return ScenarioResult(
        n=n, loss=loss, duration_s=duration, wall_s=round(time.perf_counter() - started, 3),
        probe_interval_s=cfg.probe_interval,
        analytic_first_detection_s=round(cfg.probe_interval * math.e / (math.e - 1), 4),
        crash_first_suspect_s=after(first_suspect[0] if first_suspect else None, crash_at),
        crash_first_dead_s=after(min(dead_at.values()) if dead_at else None, crash_at),
        crash_last_dead_s=after(max(dead_at.values()) if len(dead_at) == survivors else None, crash_at),
        crash_undetected_members=(survivors - len(dead_at)) if survivors is not None else None,
        metadata_50pct_s=after(meta_times[len(meta_times) // 2] if meta_times else None, metadata_at),
        metadata_9999pct_s=after(meta_times[q9999 - 1] if len(meta_times) >= q9999 else None, metadata_at),
        metadata_reached_fraction=round(len(meta_times) / observers, 6) if metadata_at is not None else None,
        false_dead_declarations=false["dead"], false_suspicions=len(false_suspicions),
        stalled_member_declared_dead=false["stalled_dead"] if stalled_id else None,
        slow_delay_s=slow_delay if slow_id else None,
        slow_member_deaths=slow["dead"] if slow_id else None,
        slow_member_suspicions=len(slow["suspicions"]) if slow_id else None,
        messages_per_member_s=round(datagrams / n / duration, 3),
        bytes_per_member_s=round(sent / n / duration, 1),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftcomm.gossip.sim", description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100, help="members")
    parser.add_argument("--loss", type=float, default=0.0, help="datagram loss probability")
    parser.add_argument("--duration", type=float, default=60.0, help="virtual seconds")
    parser.add_argument("--crash-at", type=float, default=20.0, help="crash the last member then (-1: never)")
    parser.add_argument("--metadata-at", type=float, default=10.0, help="member 0 changes metadata then (-1: never)")
    parser.add_argument("--stall-at", type=float, default=-1, help="stall member n-2 then (-1: never)")
    parser.add_argument("--stall-for", type=float, default=2.0, help="stall length in seconds")
    parser.add_argument("--slow", type=float, default=-1,
                        help="member n-3's datagrams (its acks too) arrive this many seconds late (-1: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a GossipConfig field, e.g. --set probe_interval=1.0")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    config = GossipConfig().with_overrides(**parse_assignments(args.set))
    never = lambda v: None if v < 0 else v
    result = run_scenario(args.n, loss=args.loss, duration=args.duration, crash_at=never(args.crash_at),
                          metadata_at=never(args.metadata_at), stall_at=never(args.stall_at),
                          stall_for=args.stall_for, seed=args.seed, config=config, slow_delay=never(args.slow))
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        for key, value in asdict(result).items():
            print(f"{key:32s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
