"""Rendezvous without a shared service: each worker serves an authenticated key-value store.

A worker's store holds the member lists of the views it proposes (so a joiner can read
the proposal it is asked to agree to) and, when the worker is rank 0 of a view, the
keys the other ranks use to form that view's communicator (prefixed by view id and
digest). No shared filesystem, no external store.

The store is a pyzmq ROUTER socket on the bind address alone. Every request and reply
is a frame::

    b"FZ" | version (1) | flags (1) | time in ms (8) | nonce (16) | tag | msgpack body

With a secret the tag is HMAC-SHA256 over header and body (a reply's also covers the
nonce of the request it answers); the server drops a request whose time is outside
the freshness window or whose nonce it has seen, so a captured request cannot be
replayed and a reply cannot be forged or reused. Without a secret the tag is an
XXH3-64 checksum (corruption is dropped; anyone who can reach the port can use the
store, which is why a group that is not on loopback needs a secret, see
docs/SECURITY.md). Anything malformed is dropped and counted, never answered.

Clients implement ``torch.distributed.Store``, so Gloo and NCCL form through them.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import errno
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import msgpack
import torch.distributed as dist
import xxhash
import zmq
from zmq.utils.monitor import recv_monitor_message

from .. import netif
from ..core.view import View
from ..errors import CommunicatorError
from ..gossip import connections
from ..gossip.wire import ReplayGuard

log = logging.getLogger(__name__)

MAGIC, VERSION, FLAG_AUTH = b"FZ", 1, 0x01
_HEADER = struct.Struct(">2sBBq16s")
HMAC_BYTES, CHECKSUM_BYTES = 32, 8
FRESHNESS_S = 30.0  # a request older or newer than this (by the sender's clock) is dropped
MAX_FRAME_BYTES = 4 << 20
RECEIVE_QUEUE = 4  # requests queued per connection before zmq stops reading it (its default: 1000)
MAX_KEY_CHARS = 1024
MAX_VALUE_BYTES = 1 << 20
MAX_KEYS = 65536
MAX_STORED_BYTES = 64 << 20
MAX_WAITERS = 4096
MAX_WAITERS_PER_CLIENT = 256
"""Waiting requests of one connection: a worker forming a view waits on a few keys at a
time. Beyond it a request is refused; and when all MAX_WAITERS are taken, a new request
evicts the oldest of the connection that holds the most (one client cannot jam the store
for the others: a group without a secret is open to every local user)."""
MAX_WAIT_MS = 1 << 31  # about 25 days: a longer wait is clamped to this
MAX_HELD_MS = 600_000
"""The longest the store holds a waiting request (10 minutes): a longer wait is answered
``timeout`` then, and the client asks again."""
CANCEL_POLL_S = 0.05
"""How soon a :meth:`StoreClient.cancel` ends the request in flight."""
REPLAY_CACHE = 1 << 16


class FrameError(ValueError):
    """A frame that must be dropped; ``reason`` labels the drop counter."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Framing:
    """Seals and opens rendezvous frames with one secret (or a checksum without one)."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret or None
        self._flags = FLAG_AUTH if self.secret else 0

    def seal(self, body: bytes, answers: bytes = b"", nonce: bytes | None = None) -> tuple[bytes, bytes]:
        """A frame carrying ``body``, and its nonce. ``answers``: the nonce of the request a reply answers."""
        nonce = nonce or os.urandom(16)
        header = _HEADER.pack(MAGIC, VERSION, self._flags, int(time.time() * 1000), nonce)
        return header + self._tag(header, answers, body) + body, nonce

    def open(self, frame: bytes, answers: bytes = b"") -> tuple[int, bytes, bytes]:
        """``(time_ms, nonce, body)`` of a frame whose tag verifies; raise FrameError."""
        tag_bytes = HMAC_BYTES if self.secret else CHECKSUM_BYTES
        if not _HEADER.size + tag_bytes <= len(frame) <= MAX_FRAME_BYTES:
            raise FrameError("size")
        magic, version, flags, sent_ms, nonce = _HEADER.unpack_from(frame)
        if magic != MAGIC or version != VERSION:
            raise FrameError("bad_version")
        if flags != self._flags:
            raise FrameError("unauthenticated" if self.secret else "unexpected_auth")
        header, tag = frame[:_HEADER.size], frame[_HEADER.size:_HEADER.size + tag_bytes]
        body = frame[_HEADER.size + tag_bytes:]
        if not hmac.compare_digest(tag, self._tag(header, answers, body)):
            raise FrameError("bad_hmac" if self.secret else "bad_checksum")
        return sent_ms, nonce, body

    def _tag(self, header: bytes, answers: bytes, body: bytes) -> bytes:
        if self.secret:
            return hmac.new(self.secret, header + answers + body, hashlib.sha256).digest()
        return xxhash.xxh3_64_digest(header + answers + body)


def refused(host: str, port: int, timeout: float = 0.25, settle: float = 0.0) -> bool:
    """True when the host actively refuses a TCP connection: no process owns the port.

    A crashed process's port is refused by its host's kernel at once; a paused or
    partitioned process's port is not (the connect succeeds or times out). ``settle``: a
    port that still accepts is tried again, at growing intervals, for this long: a killed
    process's sockets close one by one, so a peer that saw one of its connections reset
    may find another port still open for a few milliseconds.
    """
    deadline = time.monotonic() + settle
    delay = 0.01
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            try:
                s.connect((host, port))
            except ConnectionRefusedError:
                return True
            except OSError as exc:
                return exc.errno == errno.ECONNREFUSED  # no answer: lost or partitioned, not refused
            except (OverflowError, ValueError, TypeError):
                return False  # not an address at all: nothing refused
        if time.monotonic() + delay > deadline:
            return False
        time.sleep(delay)
        delay *= 2


def refused_many(addresses: list[tuple[str, int]], timeout: float = 0.25, settle: float = 0.0) -> list[bool]:
    """:func:`refused` for several addresses at once."""
    if not addresses:
        return []
    if len(addresses) > 1:
        try:
            with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
                return list(pool.map(lambda a: refused(a[0], a[1], timeout, settle), addresses))
        except RuntimeError:  # the interpreter is shutting down (a leave from an exit hook): one by one
            pass
    return [refused(host, port, timeout, settle) for host, port in addresses]


class StoreServer:
    """The key-value store this worker serves, on one thread, until :meth:`close`.

    Failure semantics: a malformed, unauthenticated, stale or replayed request is
    dropped (counted in :attr:`drops`) and gets no answer; a request over a limit
    (key count, sizes, waiters) is answered with an error.
    """

    def __init__(self, host: str, secret: bytes | None) -> None:
        self._framing = Framing(secret)
        self._guard = ReplayGuard(FRESHNESS_S, REPLAY_CACHE) if secret else None  # the gossip layer's
        self._data: dict[str, bytes] = {}
        self._stored_bytes = 0
        self._waiters: list[tuple[bytes, bytes, str, list[str], float]] = []  # peer, nonce, op, keys, deadline
        self.drops: collections.Counter[str] = collections.Counter()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)  # per connection: a flood waits in the kernel, not here
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            self.port = self._socket.bind_to_random_port(f"tcp://{netif.resolve(host)}")
        except zmq.ZMQError as exc:
            self._socket.close()
            self._context.term()
            raise CommunicatorError(f"cannot serve the rendezvous store on {host}: {exc}") from None
        # A client's waiting requests go with its connection: the socket's monitor reports
        # each closed connection by its descriptor, and each request is tagged with the
        # descriptor it came through (the descriptor is closed only after the event is
        # sent, so it cannot name a newer connection yet).
        self._monitor = self._socket.get_monitor_socket(connections.EVENTS)
        self.connections = connections.ConnectionCap(self.port, *connections.caps())
        self._peer_of_fd: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ftcomm-rendezvous", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if not self._thread.is_alive():
            self._socket.disable_monitor()
            self._monitor.close()
            self._socket.close()
            self._context.term()

    # ------------------------------------------------------------------ serving thread
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            timeout = 100.0
            if self._waiters:
                timeout = min(timeout, max(0.0, (min(w[4] for w in self._waiters) - time.monotonic()) * 1000))
            if poller.poll(timeout):
                while True:
                    self._disconnected()  # before each request: its descriptor may be a reused one
                    try:
                        parts = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(parts) < 2:
                        self.drops["malformed"] += 1
                        continue
                    with contextlib.suppress(zmq.ZMQError):
                        self._peer_of_fd[parts[1].get(zmq.SRCFD)] = parts[0].bytes
                    try:
                        self._handle(parts[0].bytes, parts[1].bytes)
                    except Exception:  # one request never stops the store
                        self.drops["error"] += 1
                        log.exception("rendezvous request failed")
            self._disconnected()
            self._expire()

    def _disconnected(self) -> None:
        """Drop the waiting requests of every connection that closed (and shut down new ones
        over the connection cap)."""
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.connections.event(event)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            peer = self._peer_of_fd.pop(event["value"], None)
            if peer is None:
                continue
            gone = [w for w in self._waiters if w[0] == peer]
            for waiter in gone:
                self._waiters.remove(waiter)
            self.drops["waiter_client_gone"] += len(gone)

    def _handle(self, peer: bytes, frame: bytes) -> None:
        try:
            sent_ms, nonce, body = self._framing.open(frame)
        except FrameError as exc:
            self.drops[exc.reason] += 1
            return
        if self._guard is not None:
            reason = self._guard.admit(nonce, sent_ms, int(time.time() * 1000))
            if reason is not None:
                self.drops[reason] += 1
                return
        try:
            request = msgpack.unpackb(body, raw=False, max_str_len=MAX_VALUE_BYTES, max_bin_len=MAX_VALUE_BYTES,
                                      max_array_len=MAX_KEYS, max_map_len=0, max_ext_len=0)
            op, args = _check_request(request)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            self.drops["malformed"] += 1
            return
        if op in ("get", "wait"):
            keys = [args[0]] if op == "get" else args[0]
            if all(k in self._data for k in keys):
                self._reply(peer, nonce, True, self._data[keys[0]] if op == "get" else None)
            elif self._make_room(peer):
                self._waiters.append((peer, nonce, op, keys, time.monotonic() + min(args[1], MAX_HELD_MS) / 1000))
            else:
                self._reply(peer, nonce, False, "too many waiting requests")
            return
        ok, value = self._apply(op, args)
        self._reply(peer, nonce, ok, value)
        if op in ("set", "add", "cas"):
            self._wake()

    def _make_room(self, peer: bytes) -> bool:
        """Whether a waiting request of ``peer`` may be held: under its own quota, and, when
        the store holds MAX_WAITERS, after evicting (answered as refused) the oldest waiter
        of the connection that holds more than ``peer`` would."""
        held = collections.Counter(w[0] for w in self._waiters)
        if held[peer] >= MAX_WAITERS_PER_CLIENT:
            self.drops["waiter_quota"] += 1
            return False
        if len(self._waiters) < MAX_WAITERS:
            return True
        heaviest, count = held.most_common(1)[0]
        if count <= held[peer] + 1:
            return False
        evicted = next(w for w in self._waiters if w[0] == heaviest)
        self._waiters.remove(evicted)
        self.drops["waiter_evicted"] += 1
        self._reply(evicted[0], evicted[1], False, "too many waiting requests")
        return True

    def _apply(self, op: str, args: list) -> tuple[bool, Any]:
        data = self._data
        if op == "check":
            return True, all(k in data for k in args[0])
        if op == "delete":
            value = data.pop(args[0], None)
            self._stored_bytes -= len(value or b"")
            return True, value is not None
        if op == "num":
            return True, len(data)
        if op == "add":
            try:
                current = int(data.get(args[0], b"0") or b"0")
            except ValueError:
                return False, "its value is not an integer"
            return self._put(args[0], str(current + args[1]).encode(), current + args[1])
        if op == "cas":
            key, expected, desired = args
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                return self._put(key, desired, desired)
            return True, current if current is not None else expected
        return self._put(args[0], args[1], None)  # set

    def _put(self, key: str, value: bytes, result: Any) -> tuple[bool, Any]:
        old = self._data.get(key)
        grows = len(value) - len(old or b"")
        if (old is None and len(self._data) >= MAX_KEYS) or self._stored_bytes + grows > MAX_STORED_BYTES:
            return False, "the rendezvous store is full"
        self._data[key] = value
        self._stored_bytes += grows
        return True, result

    def _wake(self) -> None:
        ready = [w for w in self._waiters if all(k in self._data for k in w[3])]
        for waiter in ready:
            self._waiters.remove(waiter)
            peer, nonce, op, keys, _ = waiter
            self._reply(peer, nonce, True, self._data[keys[0]] if op == "get" else None)

    def _expire(self) -> None:
        now = time.monotonic()
        for waiter in [w for w in self._waiters if w[4] <= now]:
            self._waiters.remove(waiter)
            self._reply(waiter[0], waiter[1], False, "timeout")

    def _reply(self, peer: bytes, nonce: bytes, ok: bool, value: Any) -> None:
        frame, _ = self._framing.seal(msgpack.packb([ok, value], use_bin_type=True), answers=nonce)
        try:
            self._socket.send_multipart([peer, frame], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the requester went away


def _check_request(request: Any) -> tuple[str, list]:
    """``(op, args)`` of a well-formed request; raise ValueError otherwise."""
    if type(request) is not list or not request or type(request[0]) is not str:
        raise ValueError("request is not [op, ...]")
    op, args = request[0], request[1:]
    schema = _REQUESTS.get(op)
    if schema is None or len(args) != len(schema) or any(type(a) is not t for a, t in zip(args, schema)):
        raise ValueError(f"bad request {op!r:.40}")
    for value, kind in zip(args, schema):
        keys = value if kind is list else [value] if kind is str else []
        if any(type(k) is not str or not 0 < len(k) <= MAX_KEY_CHARS for k in keys):
            raise ValueError("bad key")
    if op in ("get", "wait") and not 0 <= args[1] <= MAX_WAIT_MS:
        raise ValueError("bad wait")
    if op == "add" and not -(1 << 62) <= args[1] <= 1 << 62:
        raise ValueError("bad increment")
    if op in ("wait", "check") and not args[0]:
        raise ValueError("no keys")
    return op, args


_REQUESTS: dict[str, tuple[type, ...]] = {
    "set": (str, bytes), "get": (str, int), "check": (list,), "wait": (list, int), "add": (str, int),
    "cas": (str, bytes, bytes), "delete": (str,), "num": (),
}


class StoreClient(dist.Store):
    """A ``torch.distributed.Store`` backed by another worker's :class:`StoreServer`.

    Failure semantics: every call is bounded by ``timeout`` (a wait by its own) and raises
    :class:`~ftcomm.errors.CommunicatorError` when no authenticated answer arrives in time
    (the server is gone, partitioned, or uses another secret), or when it reports an error.
    Thread-safe; one request at a time. Each client has its own zmq context, terminated
    when it closes: a socket of a shared context is closed later by zmq's I/O thread, so
    its connection outlived the group that closed it. Keys are prefixed with ``prefix`` (torch's
    ``PrefixStore`` cannot wrap a store written in Python). :meth:`cancel`, from any
    thread, ends the request in flight and every later one with that error at once: a
    communicator builder that was given up on stops waiting on the store.
    """

    def __init__(self, host: str, port: int, secret: bytes | None, timeout: float, prefix: str = "") -> None:
        super().__init__()
        self.address = f"{host}:{port}"
        self._prefix = f"{prefix}/" if prefix else ""
        self._framing = Framing(secret)
        self._timeout = timeout
        self._lock = threading.Lock()
        self._context = zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._socket.connect(f"tcp://{host}:{port}")
        self._closed = False
        self._cancelled: str | None = None

    def cancel(self, reason: str) -> None:
        """Fail the request in flight (within ``CANCEL_POLL_S``) and every later one, and
        close the connection (at once when no request is in flight, else when it ends):
        an abandoned formation's client is kept alive by its builder, and its socket must
        not outlive it (a process has 1023 of them)."""
        self._cancelled = reason
        if self._lock.acquire(blocking=False):
            try:
                self._close_locked()
            finally:
                self._lock.release()

    def _cancelled_error(self, what: str) -> CommunicatorError:
        self._close_locked()
        return CommunicatorError(f"{what} on the rendezvous store at {self.address} cancelled: {self._cancelled}")

    def _close_locked(self) -> None:
        if not self._closed:
            self._closed = True
            self._socket.close(linger=0)
            self._context.term()  # returns once zmq's threads closed the connection

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._socket.close(linger=0)
            self._context.term()

    # ------------------------------------------------------------------ torch.distributed.Store
    def set(self, key: str, value: Any) -> None:
        self._request(["set", self._prefix + key, _bytes(value)])

    def get(self, key: str) -> bytes:
        wait_ms = _wait_ms(self._timeout)
        return self._request(["get", self._prefix + key, wait_ms], wait_ms / 1000)

    def check(self, keys: list[str]) -> bool:
        return bool(self._request(["check", [self._prefix + k for k in keys]]))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        wait_ms = _wait_ms(self._timeout if timeout is None else timeout.total_seconds())
        self._request(["wait", [self._prefix + k for k in keys], wait_ms], wait_ms / 1000)

    def add(self, key: str, value: int) -> int:
        return int(self._request(["add", self._prefix + key, int(value)]))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._request(["cas", self._prefix + key, _bytes(expected), _bytes(desired)])

    def delete_key(self, key: str) -> bool:
        return bool(self._request(["delete", self._prefix + key]))

    def num_keys(self) -> int:
        return int(self._request(["num"]))

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout.total_seconds()

    # ------------------------------------------------------------------ transport
    def _request(self, request: list, waits: float = 0.0) -> Any:
        body = msgpack.packb(request, use_bin_type=True)
        deadline = time.monotonic() + waits + self._timeout
        with self._lock:
            if self._cancelled is not None:
                raise self._cancelled_error(request[0])
            if self._closed:
                raise CommunicatorError(f"the connection to the rendezvous store at {self.address} was closed")
            frame, nonce = self._framing.seal(body)
            self._socket.send(frame)
            while (left := deadline - time.monotonic()) > 0 and self._cancelled is None:
                if not self._socket.poll(min(left, CANCEL_POLL_S) * 1000):
                    continue
                reply = self._socket.recv()
                try:
                    _, _, payload = self._framing.open(reply, answers=nonce)
                    ok, value = msgpack.unpackb(payload, raw=False)
                except (FrameError, ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError):
                    continue  # the answer to an earlier, abandoned request, or noise
                if not ok:
                    raise CommunicatorError(f"the rendezvous store at {self.address} answered {request[0]} "
                                            f"{request[1] if len(request) > 1 else ''!r:.80}: {value}")
                return value
            if self._cancelled is not None:
                raise self._cancelled_error(request[0])
        raise CommunicatorError(f"no authenticated answer from the rendezvous store at {self.address} within "
                                f"{waits + self._timeout:.1f} s (the worker is gone or uses another secret)")


def _wait_ms(seconds: float) -> int:
    """A wait of ``seconds`` as the store takes it: whole milliseconds, at most MAX_WAIT_MS."""
    return int(max(0.0, min(seconds * 1000, MAX_WAIT_MS)))


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Rendezvous:
    """This worker's store server and its clients to other workers' stores."""

    def __init__(self, host: str, timeout: float, secret: bytes | None = None) -> None:
        self.host = host
        self.timeout = timeout
        self._secret = secret
        self._server: StoreServer | None = StoreServer(host, secret)
        self.port: int = self._server.port
        self._clients: dict[tuple[str, int, float], StoreClient] = {}

    def trust(self, is_member_host: Callable[[str], bool]) -> None:
        """At its connection cap, this worker's store makes room for a member's host
        (``is_member_host``, called on the store's thread) by shutting down a connection
        of a host that is not (see :class:`~ftcomm.gossip.connections.ConnectionCap`)."""
        if self._server is not None:
            self._server.connections.trusted = is_member_host

    @property
    def drops(self) -> collections.Counter[str]:
        """Requests this worker's store dropped, by reason."""
        return self._server.drops if self._server is not None else collections.Counter()

    def publish_proposal(self, view_id: int, digest: str, members: tuple[str, ...]) -> None:
        self._client(self.host, self.port).set(f"proposal/{view_id}/{digest}", "\n".join(members).encode())

    def fetch_proposal(self, host: str, port: int, view_id: int, digest: str,
                       timeout: float | None = None) -> tuple[str, ...] | None:
        """The member list a worker proposed, or None if it cannot be read now (not stored
        yet, or no answer within ``timeout``, default the store timeout). The connection is
        kept for the next read; it does not notice its worker's death, so a read from a
        worker that died since answers nothing: keep ``timeout`` short where the caller
        waits on nothing else."""
        key = f"proposal/{view_id}/{digest}"
        limit = self.timeout if timeout is None else min(timeout, self.timeout)
        try:
            store = self._client(host, port, limit)
            if not store.check([key]):
                return None
            return tuple(store.get(key).decode("utf-8", "replace").split("\n"))
        except CommunicatorError:
            client = self._clients.pop((host, port, limit), None)
            if client is not None:
                client.close()
            return None

    def view_store(self, view: View, host: str, port: int) -> Any:
        """The store the ranks of ``view`` form their communicator through (rank 0's).

        Always a new connection: a formation that is abandoned may keep its builder
        thread blocked on its store, and a client serializes its requests.
        """
        return self._connect(host, port, prefix=f"view/{view.id}/{view.digest}")

    def shard_store(self, view: View, shard: int, host: str, port: int) -> Any:
        """The store through which the shard-``shard`` processes of ``view``'s sharded
        replicas form their communicator (served by the first of them)."""
        return self._connect(host, port, prefix=f"shard/{view.id}/{view.digest}/{shard}")

    def pair_store(self, view: View, a: str, b: str, host: str, port: int) -> Any:
        """The store through which members ``a`` and ``b`` of ``view`` form a two-rank
        communicator of their own (the network check), served by ``a``."""
        return self._connect(host, port, prefix=f"pair/{view.id}/{view.digest}/{a}/{b}")

    def close(self) -> None:
        """Stop serving (the listener closes) and drop the connections to other stores."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _client(self, host: str, port: int, timeout: float | None = None) -> StoreClient:
        """A cached connection for short reads (proposals), each bounded by ``timeout``
        (default the store timeout); never used by a formation."""
        timeout = self.timeout if timeout is None else timeout
        client = self._clients.get((host, port, timeout))
        if client is None:
            client = self._clients[(host, port, timeout)] = self._connect(host, port, timeout=timeout)
        return client

    def _connect(self, host: str, port: int, prefix: str = "", timeout: float | None = None) -> StoreClient:
        if refused(host, port):
            raise CommunicatorError(f"the rendezvous store at {host}:{port} refused the connection")
        return StoreClient(host, port, self._secret, self.timeout if timeout is None else timeout, prefix)
