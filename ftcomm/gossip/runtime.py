"""The gossip runtime: a background thread driving the protocol over UDP and pyzmq TCP.

One :class:`GossipNode` per process. Its thread runs an asyncio loop (uvloop when
importable) that owns the :class:`~ftcomm.gossip.protocol.Protocol`; other threads only
read an immutable snapshot of the members and post commands to the loop, so the
training thread never blocks on the gossip thread. UDP carries probes and gossip; a
ROUTER socket on the same port number over TCP serves push/pull and requests such as
``ftcomm members``.

Failure semantics: an exception while handling one datagram, stream request, reply
or timer is caught, counted in :meth:`GossipNode.stats` as ``errors.<where>.<type>``
and logged the first time per kind; the node keeps serving.
"""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import errno
import gc
import logging
import os
import random as _random
import secrets as _secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .. import netif
from ..errors import GossipError, JoinError
from . import connections
from .addresses import Resolver, is_dns, parse_address, parse_seed, resolve, system_resolver
from .config import GossipConfig, recontact_targets
from .faults import FaultFilter
from .protocol import MemberEvent, MemberInfo, Protocol

AUTH_FAILURES = ("bad_hmac", "unauthenticated", "unexpected_auth")
"""Why a packet that another secret (or none, against one) sealed is dropped."""

log = logging.getLogger(__name__)

STALL_S = 0.25
"""A protocol timer firing this much later than due means the whole process was stopped
or starved (its timers are never due further apart than a probe interval)."""

STREAM_BATCH = 16  # TCP requests served back to back before the loop lets its timers and UDP reader run
STREAM_QUEUE = 1  # TCP requests queued per connection before zmq stops reading it (its default: 1000)
UDP_BATCH = 256  # datagrams read per call of the UDP reader (the rest: at its next call)
BIND_WAIT_S = 2.0  # how long an explicit port that is in use is tried again (see _bind_sockets)
PAUSE_COPIES = 2
"""Datagrams per member and full garbage collection (numbered apart): one lost is covered."""

_announcing: tuple = ()  # the started nodes whose process's full collections they announce
_announcing_lock = threading.Lock()  # (changes only; the collector's callback reads the tuple)
_collector_hooked = False
_held_signal: int | None = None  # a signal whose handler raised while a notice went out


def _on_collection(phase: str, info: dict) -> None:
    """Python's garbage collector starts or ends a collection, on whichever thread made it:
    at the start of a full one, every node announcing collections says so (see
    ``GossipNode._announce_pause``). One callback for every node, registered once and never
    removed: the collector walks its list while a callback runs, and a node stopped meanwhile
    on another thread would shift it. An exception raised here would be dropped by the
    collector: a signal handler's (Ctrl-C, ftcomm's SIGTERM) is raised again once the
    collection ended, by handing the signal to the main thread again."""
    global _held_signal
    if phase == "stop":
        if _held_signal is not None:
            held, _held_signal = _held_signal, None
            # From another thread, which runs once this one lets go of the GIL, past the
            # collector: its handler then runs where the script is.
            _thread.start_new_thread(_thread.interrupt_main, (held,))  # (Thread.start would wait for it here)
        return
    if info.get("generation") != 2:
        return
    try:
        for node in _announcing:
            node._announce_pause()
    except KeyboardInterrupt:
        _held_signal = signal.SIGINT
    except SystemExit:
        _held_signal = signal.SIGTERM


def _announce_collections(node: "GossipNode", on: bool) -> None:
    """``node`` announces its process's full collections from now on (``on``) or no longer."""
    global _announcing, _collector_hooked
    with _announcing_lock:
        _announcing = tuple(n for n in _announcing if n is not node) + ((node,) if on else ())
        if on and not _collector_hooked:
            gc.callbacks.append(_on_collection)
            _collector_hooked = True


try:  # pragma: no cover - depends on the platform
    import uvloop as _uvloop
except ImportError:  # pragma: no cover
    _uvloop = None


@dataclass(frozen=True)
class Member:
    """One member as seen by this node; ``metadata`` is the decoded record."""

    id: str
    host: str
    port: int
    state: str
    incarnation: int
    metadata: dict
    confirmed: bool = False
    """This node has had a direct answer from the member (see ``MemberInfo.confirmed``);
    a member known only through gossip may be forged, so it is no candidate for a view."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class GossipEvent:
    """A membership change, delivered to subscribers with the wall-clock time it was seen."""

    kind: str  # joined | suspect | alive | dead | left | metadata
    member: Member
    time: float  # time.time() on this host
    source: str  # id of the member whose message caused it


def decode_metadata(raw: bytes) -> dict:
    if not raw:
        return {}
    try:
        value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:
        return {"_undecodable": raw.hex()}
    return value if isinstance(value, dict) else {"_value": value}


def encode_metadata(value: dict) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _member(info: MemberInfo) -> Member:
    return Member(info.id, info.host, info.port, info.state, info.incarnation, decode_metadata(info.metadata),
                  info.confirmed)


_RECONTACT_RNG = _random.Random()  # which seeds a cut-off member asks (see recontact_targets)


class GossipNode:
    """A member of the gossip cluster, running in a background thread.

    Failure semantics: :meth:`start` raises :class:`JoinError` when seeds were given
    and none answered within ``config.join_timeout``; no other method blocks on the
    network. Callbacks run on the gossip thread and must return quickly; an exception
    in one is logged and does not stop the node.
    """

    def __init__(self, bind: str | tuple[str, int] = ("127.0.0.1", 0), *, cluster: str = "ftcomm",
                 secret: str | bytes | None = None, config: GossipConfig | None = None,
                 metadata: dict | None = None, fault_filter: FaultFilter | None = None,
                 resolver: Resolver = system_resolver) -> None:
        self.config = config or GossipConfig()
        self._resolver = resolver
        self._seeds: list[str | tuple[str, int]] = []
        self._resolved: list[tuple[str, int]] = []  # the DNS seeds' addresses as last looked up
        self.cluster = cluster
        self._secret = secret.encode() if isinstance(secret, str) else secret
        host, port = parse_address(bind)
        try:  # records carry the address as an IPv4 literal: peers never look a name up to send
            self._bind = (netif.resolve(host), port)
        except OSError as exc:
            raise GossipError(f"cannot bind gossip to {host!r}: it does not resolve to an IPv4 address "
                              f"({exc.strerror or exc})") from None
        self._initial_metadata = encode_metadata(metadata or {})
        if len(self._initial_metadata) > self.config.max_metadata_bytes:
            raise ValueError(f"metadata is {len(self._initial_metadata)} bytes; the limit is "
                             f"max_metadata_bytes={self.config.max_metadata_bytes}")
        self.faults = fault_filter
        self.id: str = ""
        self.host, self.port = self._bind
        self._protocol: Protocol | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._udp: socket.socket | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self.last_stall = float("-inf")
        """time.monotonic() when this process was last seen to have been stalled (see STALL_S)."""
        self._tasks: set[asyncio.Task] = set()
        self._monitor = None  # the TCP port's connection events (see _watch_connections)
        self.connections: connections.ConnectionCap | None = None
        self._snapshot: tuple[Member, ...] = ()
        self.pause_notices = 0  # full garbage collections announced to the other members
        self.pause_send_errors = 0  # notices a member could not be sent (its address unusable)
        self._pid = 0  # the process whose collections it announces (not a forked child)
        self._loop_ran_at = 0.0  # when the gossip loop last handled a timer or datagrams (monotonic)
        self._noticed_at = float("-inf")  # when it last announced a collection
        self._notices = 0  # numbers its notices carry
        self._member_hosts: tuple[tuple[Member, ...] | None, frozenset[str]] = (None, frozenset())
        self._snapshot_stale = True
        self._subscribers: list[Callable[[GossipEvent], None]] = []
        self._stopped = threading.Event()
        self._stopping = False
        self._errors_logged: set[str] = set()

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, seeds: Iterable[str | tuple[str, int]] = ()) -> GossipNode:
        """Bind, start the thread, and join through ``seeds`` (none: start a new cluster).

        A seed is ``HOST:PORT`` or ``dns://NAME:PORT`` (every IPv4 address NAME resolves
        to; see :mod:`ftcomm.gossip.addresses`). DNS seeds are looked up on every join
        attempt; once they list this member's own address and no other, it starts a new
        cluster (the first of a job's workers), and while it runs they are looked up
        every ``dns_refresh_interval`` seconds.
        """
        if self._thread is not None:
            raise GossipError("this GossipNode was already started")
        seeds = list(seeds)
        for seed in seeds:
            parse_seed(seed)  # ValueError naming a malformed one, before anything starts
        self._seeds = seeds
        dns = any(is_dns(s) for s in seeds)
        self._bind_sockets()
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(ready, failure), name=f"ftcomm-gossip-{self.port}",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        if self.config.pause_grace > 0:
            self._pid = os.getpid()
            _announce_collections(self, True)
        if dns or [a for a in resolve(seeds) if a != (self.host, self.port)]:
            future = asyncio.run_coroutine_threadsafe(self._join(), self._loop)
            try:
                joined = future.result(self.config.join_timeout + self.config.request_timeout + 5)
            except BaseException:
                self.stop()
                raise
            if joined == "secret":
                self.stop()
                raise JoinError(
                    f"the seeds answered, but their answers failed authentication (seeds {', '.join(map(str, seeds))}): "
                    f"this worker and the group use different secrets (FTCOMM_SECRET), or one of them has none")
            if not joined:
                self.stop()
                tried = ", ".join(f"{h}:{p}" for h, p in resolve(seeds, self._resolver)) or "no address"
                raise JoinError(
                    f"no seed answered within {self.config.join_timeout:.1f} s (seeds {', '.join(map(str, seeds))}; "
                    f"tried {tried}): check the addresses, that a member runs there, that cluster name and "
                    f"secret match, and (with a secret) that the hosts' clocks agree within "
                    f"freshness_window={self.config.freshness_window:g} s")
        if dns and self.config.dns_refresh_interval > 0:
            self._loop.call_soon_threadsafe(lambda: self._spawn(self._rediscover()))
        return self

    def leave(self, until: Callable[[], bool] | None = None, timeout: float = 0.0) -> None:
        """Announce a graceful departure (members see *left*, not *dead*), then stop:
        after ``leave_propagate_time`` (the loop keeps forwarding the notice meanwhile), or,
        with ``until``, once it returns True, at most ``timeout`` seconds later."""
        if self._loop is None or self._stopped.is_set():
            return
        self.announce_leave()
        deadline = time.monotonic() + max(timeout, self.config.leave_propagate_time)
        time.sleep(self.config.leave_propagate_time)
        while until is not None and time.monotonic() < deadline and not until():
            time.sleep(0.02)
        self.stop()

    def announce_leave(self) -> None:
        """Announce a graceful departure (members see *left*) without stopping: the loop
        forwards the notice until :meth:`stop`. Nothing happens once stopped."""
        if self._loop is None or self._stopped.is_set():
            return
        self._call(lambda p: p.leave(self._now()))

    def stop(self) -> None:
        """Stop the thread and close every socket. Idempotent; does not announce anything."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or self._stopped.is_set():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(5)
        except (RuntimeError, TimeoutError, asyncio.CancelledError, Exception) as exc:  # loop already gone
            log.debug("gossip shutdown: %r", exc)
        thread.join(5)
        self._stopped.set()

    def __enter__(self) -> GossipNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ public reads and writes
    def members(self) -> list[Member]:
        """A snapshot of every known member, this one included (thread-safe, non-blocking)."""
        return list(self._snapshot)

    def snapshot(self) -> tuple[Member, ...]:
        """:meth:`members` as the node holds them: a new tuple whenever anything in the
        table changed, the same one otherwise (a reader may keep what it derived from it)."""
        return self._snapshot

    def is_member_host(self, host: str) -> bool:
        """Whether ``host`` is this node's or a confirmed member's (one that answered this
        node directly: a member known only through gossip may be forged). Thread-safe."""
        snapshot = self._snapshot
        of, hosts = self._member_hosts  # one attribute: a reader on another thread sees a consistent pair
        if of is not snapshot:
            hosts = frozenset(m.host for m in snapshot if m.confirmed) | {self.host}
            self._member_hosts = (snapshot, hosts)
        return host in hosts

    def live_members(self) -> list[Member]:
        return [m for m in self._snapshot if m.state in ("alive", "suspect")]

    def member(self, member_id: str) -> Member | None:
        for m in self._snapshot:
            if m.id == member_id:
                return m
        return None

    def subscribe(self, callback: Callable[[GossipEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` on the gossip thread for every membership change.

        Returns a function that unsubscribes.
        """
        self._subscribers = self._subscribers + [callback]

        def unsubscribe() -> None:
            self._subscribers = [c for c in self._subscribers if c is not callback]
        return unsubscribe

    def set_metadata(self, metadata: dict, applied: Callable[[], None] | None = None) -> None:
        """Replace this member's metadata record; raises ValueError when it is too large.
        ``applied`` is called on the gossip thread once :meth:`members` shows the new record."""
        encoded = encode_metadata(metadata)
        if len(encoded) > self.config.max_metadata_bytes:
            raise ValueError(f"metadata is {len(encoded)} bytes; the limit is "
                             f"max_metadata_bytes={self.config.max_metadata_bytes}: keep it to small status fields")
        self._call(lambda p: p.set_metadata(encoded, self._now()), applied)

    def declare_dead(self, member_id: str) -> None:
        """Declare a member dead on outside evidence; see :meth:`Protocol.declare_dead`."""
        self._call(lambda p: p.declare_dead(member_id, self._now()))

    def exchange(self, member_id: str, timeout: float | None = None) -> bool:
        """Exchange full state with one member and wait until its answer is merged (and the
        events it caused are published): True, or False when it does not answer within
        ``timeout`` (default: the request timeout) or is unknown, dead or left."""
        if self._loop is None or self._stopped.is_set():
            raise GossipError("the gossip node is not running")
        wait = self.config.request_timeout if timeout is None else timeout

        async def run() -> bool:
            address = self._protocol.reachable(member_id)
            if address is None:
                return False
            request = self._protocol.push_pull_request(self._now())
            return await asyncio.wait_for(self._push_pull(address, request), wait)
        try:
            return asyncio.run_coroutine_threadsafe(run(), self._loop).result(wait + 1.0)
        except (asyncio.TimeoutError, TimeoutError, concurrent.futures.TimeoutError):
            return False

    def probe_now(self, member_ids: list[str]) -> None:
        """Probe these members at once (non-blocking); see :meth:`Protocol.probe_now`."""
        ids = list(member_ids)
        self._call(lambda p: p.probe_now(ids, self._now()))

    def announce(self, member_ids: list[str]) -> None:
        """Send this member's record directly to these members; see :meth:`Protocol.announce`."""
        ids = list(member_ids)
        self._call(lambda p: p.announce(ids, self._now()))

    @property
    def last_refuted(self) -> float:
        """time.monotonic() when this member last refuted a suspicion of itself; -inf before."""
        return self._protocol.last_refuted if self._protocol is not None else float("-inf")

    def sync(self, member_id: str) -> None:
        """Exchange full state with one member now; see :meth:`Protocol.sync_with`."""
        self._call(lambda p: p.sync_with(member_id, self._now()))

    def contact(self, address: tuple[str, int]) -> None:
        """Send a join request to ``address`` now (non-blocking); see :meth:`Protocol.contact`."""
        self._call(lambda p: p.contact(address, self._now()))

    def stats(self) -> dict[str, int]:
        """Protocol counters (datagrams, bytes, drops by reason, ...)."""
        return self._query(lambda p: dict(p.stats))

    def incarnation(self) -> int:
        return self._query(lambda p: p.incarnation)

    # ------------------------------------------------------------------ thread plumbing
    def _now(self) -> float:
        """The protocol's clock (monotonic), with its offset to the wall clock brought up to
        date for the freshness of sealed packets. Called on the gossip thread only."""
        now = time.monotonic()
        self._protocol.wall_offset = time.time() - now
        return now

    def _contain(self, where: str, exc: Exception) -> None:
        """Count an exception from handling one packet or timer; log the first of each kind."""
        kind = f"{where}.{type(exc).__name__}"
        stats = self._protocol.stats
        stats["errors"] += 1
        stats["errors." + kind] += 1
        if kind not in self._errors_logged:
            self._errors_logged.add(kind)
            log.error("gossip: handling a %s raised %r; the node goes on (later %s errors are only counted "
                      "in stats()['errors.%s'])", where, exc, kind, kind, exc_info=exc)

    def _call(self, fn: Callable[[Protocol], None], then: Callable[[], None] | None = None) -> None:
        if self._loop is None or self._stopped.is_set():
            raise GossipError("the gossip node is not running")

        def run() -> None:
            fn(self._protocol)
            self._snapshot_stale = True  # this member's own record may have changed
            self._flush()
            if then is not None:
                try:
                    then()
                except Exception as exc:  # a caller's callback must not break the loop's accounting
                    self._contain("callback", exc)
        self._loop.call_soon_threadsafe(run)

    def _query(self, fn):
        if self._loop is None or self._stopped.is_set():
            raise GossipError("the gossip node is not running")

        async def run():
            return fn(self._protocol)
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(5)

    def _bind_sockets(self) -> None:
        host, port = self._bind
        ctx = zmq.asyncio.Context()
        # An explicit port may still be held for a moment by the process this one replaces
        # (a restarted worker, whose killed predecessor's children are still exiting).
        deadline = time.monotonic() + BIND_WAIT_S

        def held_for_now(code: int | None) -> bool:
            """The explicit port is in use and may be free soon: wait a little, try again."""
            if not port or code != errno.EADDRINUSE or time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
            return True
        automatic_tries = 0
        while automatic_tries < 50:
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                udp.bind((host, port))
            except OSError as exc:
                udp.close()
                if held_for_now(exc.errno):
                    continue
                ctx.term()
                raise GossipError(f"cannot bind UDP {host}:{port}: {exc.strerror}") from None
            bound_port = udp.getsockname()[1]
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, self.config.max_stream_bytes)
            router.setsockopt(zmq.RCVHWM, STREAM_QUEUE)  # per connection: a flood waits in the kernel, not here
            try:
                router.bind(f"tcp://{host}:{bound_port}")
            except zmq.ZMQError as exc:
                router.close()
                udp.close()
                if held_for_now(exc.errno):
                    continue
                if port:  # an explicit port was asked for
                    ctx.term()
                    raise GossipError(f"cannot bind TCP {host}:{port}: {exc}") from None
                automatic_tries += 1  # the TCP twin of an automatic UDP port is taken; pick another
                continue
            udp.setblocking(False)
            self._udp, self._router, self._zmq = udp, router, ctx
            self.host, self.port = host, bound_port
            self.id = f"{host}:{bound_port}/{_secrets.token_hex(4)}"
            return
        ctx.term()
        raise GossipError(f"no free port pair (UDP and TCP) found on {host}")

    def _run(self, ready: threading.Event, failure: list) -> None:
        loop = _uvloop.new_event_loop() if _uvloop else asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self._protocol = Protocol(self.id, self.host, self.port, cluster=self.cluster, secret=self._secret,
                                      config=self.config, metadata=self._initial_metadata)
            self._protocol.start(self._now())
            loop.add_reader(self._udp.fileno(), self._on_readable)
            self._spawn(self._serve_streams())
            self._monitor = self._router.get_monitor_socket(connections.EVENTS)
            self.connections = connections.ConnectionCap(self.port, *connections.caps(), trusted=self.is_member_host)
            self._spawn(self._watch_connections())
            self._flush()
        except BaseException as exc:  # pragma: no cover - reported to start()
            failure.append(exc)
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        self._stopping = True
        _announce_collections(self, False)
        if self._timer is not None:
            self._timer.cancel()
        self._loop.remove_reader(self._udp.fileno())
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._monitor is not None:
            self._router.disable_monitor()
            self._monitor.close(linger=0)
        self._router.close(linger=0)
        self._udp.close()
        self._zmq.term()
        await self._loop.shutdown_default_executor()  # the DNS lookups' thread, if any
        self._loop.stop()

    def _spawn(self, coroutine) -> None:
        task = self._loop.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _announce_pause(self) -> None:
        """A full garbage collection starts, on whichever thread made it: it holds the GIL
        long enough to look like a stopped process to the members probing this one (see
        ``GossipConfig.pause_grace``), so they are told first, by ``PAUSE_COPIES`` sealed
        datagrams each, sent from here since the gossip thread cannot run meanwhile. Only
        the socket, the sealer and the published snapshot are read, never the protocol's
        tables: this thread may have been stopped in the middle of changing them. Said only
        when the gossip loop ran since the last notice and within two probe intervals (a
        wedged loop is not excused by a thread that keeps collecting), at most once per a
        quarter of ``pause_grace``, and never by a process forked from this one (a data
        loader's worker inherits the registration; its collections do not pause this one).
        No error escapes into the collector (a signal handler's exception: see
        :func:`_on_collection`)."""
        now = time.monotonic()
        if self._stopping or os.getpid() != self._pid or self._loop_ran_at <= self._noticed_at \
                or now - self._loop_ran_at > 2 * self.config.probe_interval \
                or now - self._noticed_at < self.config.pause_grace / 4:
            return
        self._noticed_at = now
        try:
            wall, number = time.time(), self._notices
            self._notices += PAUSE_COPIES
            packets = [self._protocol.pause_notice(wall, number + copy) for copy in range(PAUSE_COPIES)]
            local, faults = (self.host, self.port), self.faults
            for m in self._snapshot:
                if m.id == self.id or m.state not in ("alive", "suspect") or (
                        faults is not None and not faults.allows(local, (m.host, m.port))):
                    continue
                for packet in packets:
                    try:
                        self._udp.sendto(packet, (m.host, m.port))
                    except (OSError, ValueError):  # its address unusable, a full buffer, a closed socket
                        self.pause_send_errors += 1
            self.pause_notices += 1
        except Exception:  # (nothing may escape into the collector) the probes judge as before
            pass

    # ------------------------------------------------------------------ driving the protocol
    def _on_readable(self) -> None:
        self._loop_ran_at = time.monotonic()
        if self._drain_udp():
            self._flush()

    def _drain_udp(self) -> bool:
        """Feed the queued datagrams to the protocol, at most UDP_BATCH (the reader is called
        again for the rest, after what else is due); True if any arrived."""
        protocol, faults, local = self._protocol, self.faults, (self.host, self.port)
        received = False
        for _ in range(UDP_BATCH):
            try:
                data, source = self._udp.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return received
            except OSError:
                return received
            if faults is not None and not faults.allows(local, source):
                continue
            try:
                protocol.receive(data, source, self._now())
            except Exception as exc:
                self._contain("datagram", exc)
            received = True
        return received

    def _on_timer(self) -> None:
        self._loop_ran_at = time.monotonic()
        late = self._loop_ran_at - self._timer_at
        if late > STALL_S:  # the whole process was stopped or starved (a timer is never due later than that)
            self.last_stall = time.monotonic()
            log.debug("gossip timer fired %.3f s late: this process was stalled", late)
        self._timer, self._timer_at = None, float("inf")
        try:
            self._drain_udp()  # after a pause, read what arrived before judging anyone by the clock
            self._protocol.tick(self._now())
        except Exception as exc:
            self._contain("timer", exc)
        finally:
            self._flush()  # re-arms the timer whatever happened

    def _flush(self) -> None:
        """Send what the protocol produced, publish events, and re-arm the timer."""
        if self._stopping:
            return
        protocol, faults, local = self._protocol, self.faults, (self.host, self.port)
        for datagram in protocol.take_datagrams():
            if faults is not None:
                if not faults.allows(local, datagram.address):
                    continue
                if faults.delay > 0:
                    self._loop.call_later(faults.delay, self._sendto, datagram.data, datagram.address)
                    continue
            self._sendto(datagram.data, datagram.address)
        for request in protocol.take_stream_requests():
            if faults is None or faults.allows(local, request.address):
                self._spawn(self._push_pull(request.address, request.data))
        events = protocol.take_events()
        if events or self._snapshot_stale:
            self._snapshot_stale = False
            self._snapshot = tuple(_member(info) for info in protocol.members())
        if events:
            self._publish(events)
        deadline = protocol.next_deadline()
        if deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = deadline
            self._timer = self._loop.call_later(max(0.0, deadline - time.monotonic()), self._on_timer)
            protocol.timer_armed(max(deadline, self._now()))

    def _sendto(self, data: bytes, address: tuple[str, int]) -> None:
        try:
            self._udp.sendto(data, address)
        except (OSError, ValueError) as exc:  # unreachable or unusable address, full buffer: like a loss
            self._protocol.stats["send_errors"] += 1
            log.debug("gossip sendto %s failed: %s", address, exc)

    def _publish(self, events: list[MemberEvent]) -> None:
        wall = time.time()
        for event in events:
            published = GossipEvent(event.kind, _member(event.member), wall, event.source)
            for callback in self._subscribers:
                try:
                    callback(published)
                except Exception:
                    log.exception("gossip event subscriber failed on %s", event.kind)

    # ------------------------------------------------------------------ TCP: push/pull and requests
    async def _serve_streams(self) -> None:
        router = self._router
        served = 0
        while True:
            frames = await router.recv_multipart()
            served += 1
            if served % STREAM_BATCH == 0:
                # While frames are queued, pyzmq hands back finished futures: awaiting one does
                # not yield, and a flood (forged frames are dropped, but read) would keep the
                # timers and the UDP port from ever running.
                await asyncio.sleep(0)
            if len(frames) < 2:
                continue
            try:
                reply = self._protocol.handle_stream(frames[-1], self._now())
            except Exception as exc:
                self._contain("stream", exc)
                continue  # the requester times out
            finally:
                self._flush()
            try:
                await router.send_multipart(frames[:-1] + [reply])
            except zmq.ZMQError as exc:  # the requester went away
                log.debug("gossip stream reply failed: %s", exc)

    async def _watch_connections(self) -> None:
        """Feed the TCP port's connection events to its cap (a new connection over it is
        shut down at once), yielding as the request loop does."""
        watched = 0
        while True:
            self.connections.event(parse_monitor_message(await self._monitor.recv_multipart()))
            watched += 1
            if watched % STREAM_BATCH == 0:
                await asyncio.sleep(0)

    async def _request(self, address: tuple[str, int], data: bytes) -> bytes | None:
        sock = self._zmq.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_stream_bytes)
        try:
            sock.connect(f"tcp://{address[0]}:{address[1]}")
            await sock.send(data)
            if await sock.poll(int(self.config.request_timeout * 1000)):
                return await sock.recv()
            return None
        finally:
            sock.close(linger=0)

    async def _push_pull(self, address: tuple[str, int], data: bytes) -> bool:
        try:
            reply = await self._request(address, data)
        except zmq.ZMQError as exc:  # an address zmq cannot connect to
            log.debug("gossip push/pull to %s failed: %s", address, exc)
            reply = None
        if reply is None:
            self._protocol.stats["push_pull_failed"] += 1
            return False
        stats = self._protocol.stats
        refused = sum(stats[f"dropped.{reason}"] for reason in AUTH_FAILURES)
        try:
            merged = self._protocol.handle_stream_reply(reply, self._now(), address)
        except Exception as exc:
            self._contain("stream_reply", exc)
            merged = False
        if sum(stats[f"dropped.{reason}"] for reason in AUTH_FAILURES) > refused:
            stats["replies_failed_authentication"] += 1  # the member there holds another secret
        self._protocol.stats["push_pull_done"] += 1
        self._flush()
        return merged

    async def _resolve_seeds(self) -> list[tuple[str, int]]:
        """The seeds' addresses now (DNS looked up off the loop), this member's own included."""
        if not any(is_dns(s) for s in self._seeds):
            return resolve(self._seeds)  # no lookup: no thread
        self._resolved = await self._loop.run_in_executor(None, resolve, self._seeds, self._resolver)
        return self._resolved

    def seed_addresses(self) -> list[tuple[str, int]]:
        """The addresses of the seeds this member was started with, its own left out (DNS
        seeds: as last looked up; none before the first lookup)."""
        own = (self.host, self.port)
        addresses = self._resolved if any(is_dns(s) for s in self._seeds) else resolve(self._seeds)
        return [a for a in addresses if a != own]

    async def _join(self) -> bool | str:
        """True once a seed answered; "secret" when none did but answers came back that
        failed authentication (another secret: said at once rather than after the join
        timeout); False after ``join_timeout``."""
        deadline = time.monotonic() + self.config.join_timeout
        own = (self.host, self.port)
        dns = any(is_dns(s) for s in self._seeds)
        stats = self._protocol.stats
        refused = stats["replies_failed_authentication"]
        while True:
            addresses = await self._resolve_seeds()
            others = [a for a in addresses if a != own]
            if dns and own in addresses and not others:
                return True  # the name lists this member alone: it is the first
            results = await asyncio.gather(
                *(self._push_pull(seed, self._protocol.join_request(self._now())) for seed in others))
            if any(results):
                return True
            if stats["replies_failed_authentication"] > refused:
                return "secret"
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(self.config.join_retry_interval)

    async def _rediscover(self) -> None:
        """Every ``dns_refresh_interval``: a join request to each address the DNS seeds list
        that is not a live member known here."""
        while True:
            await asyncio.sleep(self.config.dns_refresh_interval)
            await self._recontact()

    async def _recontact(self) -> None:
        """A join request to a few seed addresses (RECONTACT_FANOUT, at random) that are not
        live members known here."""
        try:
            addresses = await self._resolve_seeds()
        except Exception as exc:  # noqa: BLE001 - a resolver failure must not end the loop
            self._contain("rediscover", exc)
            return
        known = {(m.host, m.port) for m in self._protocol.members() if m.state in ("alive", "suspect")}
        unknown = list(dict.fromkeys(a for a in addresses if a != (self.host, self.port) and a not in known))
        for address in recontact_targets(unknown, _RECONTACT_RNG):
            self._protocol.stats["rediscovered"] += 1
            self._spawn(self._push_pull(address, self._protocol.join_request(self._now())))

    def recontact_seeds(self) -> None:
        """Send a join request to a few seeds that are not live members known here (non-blocking):
        for a member whose table lost sight of the others (see
        :meth:`ftcomm.core.engine.Engine._may_found`)."""
        if self._loop is None or self._stopped.is_set():
            raise GossipError("the gossip node is not running")
        self._loop.call_soon_threadsafe(lambda: self._spawn(self._recontact()))


def query_members(peer: str | tuple[str, int], *, cluster: str = "ftcomm", secret: str | bytes | None = None,
                  timeout: float = 2.0) -> list[Member]:
    """Ask the member at ``peer`` for its member table over TCP (no node needed).

    Raises :class:`GossipError` with a one-line reason when there is no answer within
    ``timeout`` or the answer cannot be authenticated.
    """
    from . import wire

    address = parse_address(peer)
    key = secret.encode() if isinstance(secret, str) else secret
    sealer = wire.Sealer(cluster, f"ftcomm-cli/{_secrets.token_hex(4)}", key, GossipConfig().max_stream_bytes)
    ctx = zmq.Context()
    try:  # destroy(), not term(): it closes the socket too, even one an interrupt left half set up
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{address[0]}:{address[1]}")
        sock.send(sealer.seal([wire.encode([wire.MEMBERS_QUERY])], now=time.time()))
        if not sock.poll(int(timeout * 1000)):
            raise GossipError(f"no answer from {address[0]}:{address[1]} within {timeout:g} s "
                              f"(is an ftcomm member running there?)")
        reply = sock.recv()
    finally:
        ctx.destroy(linger=0)
    try:
        _, messages = sealer.open(reply, wire.STREAM_TYPES, now=time.time())
    except wire.WireError as err:
        if err.reason in ("bad_hmac", "unauthenticated", "unexpected_auth"):
            raise GossipError(f"authentication failed with {address[0]}:{address[1]}: "
                              f"the member and this command use different secrets (--secret)") from None
        if err.reason in ("stale", "future"):
            raise GossipError(f"the answer from {address[0]}:{address[1]} is timestamped outside the freshness "
                              f"window: this host's clock and the member's disagree") from None
        if err.reason == "wrong_cluster":
            raise GossipError(f"the member at {address[0]}:{address[1]} belongs to another cluster "
                              f"(--cluster)") from None
        raise GossipError(f"unreadable answer from {address[0]}:{address[1]}: {err}") from None
    message = messages[0] if messages else [wire.ERROR, "empty reply"]
    if message[0] == wire.ERROR:
        raise GossipError(f"the member at {address[0]}:{address[1]} refused the request: {message[1]}")
    if message[0] != wire.MEMBERS_REPLY:
        raise GossipError(f"unexpected answer type {message[0]} from {address[0]}:{address[1]}")
    return [Member(r[0], r[1], r[2], wire.STATE_NAMES[r[4]], r[3], decode_metadata(r[5]), confirmed)
            for r, confirmed in zip(message[1], message[2])]
