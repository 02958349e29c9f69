"""Wire format of the gossip layer: sealed msgpack packets and the messages inside them.

A packet is one of::

    version (1) | FLAG_AUTH     | time in ms (8) | HMAC-SHA256 (32) | body     (a secret is set)
    version (1) | FLAG_CHECKSUM | XXH3-64 (8)                       | body     (no secret)

and the body is one msgpack array ``[cluster, sender_id, [message, ...]]``. The HMAC
covers version, flags, time and body; the checksum covers version, flags and body, so
a corrupted packet of a group without a secret is dropped too (it proves nothing
about the sender: without a secret anyone who can reach the port can forge packets).
A sealed packet is accepted only within ``freshness_window`` seconds of the receiver's
wall clock and only once (:class:`ReplayGuard`). Each message is a msgpack array whose
first element is its type code; its fields are type- and range-checked here, so the
protocol core only ever sees well-formed messages whose numbers it can do arithmetic
on without leaving what msgpack encodes. UDP datagrams and TCP (pyzmq) frames use the
same envelope.

Anything malformed raises :class:`WireError` with a short, countable reason; callers
drop the packet and count the reason.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import struct
from collections.abc import Sequence
from typing import NamedTuple

import msgpack
import xxhash

VERSION = 2
FLAG_AUTH = 0x01  # time and HMAC-SHA256 follow the flags
FLAG_CHECKSUM = 0x02  # an XXH3-64 checksum follows the flags
HMAC_BYTES = 32
CHECKSUM_BYTES = 8
_STAMP = struct.Struct(">Q")  # milliseconds since the epoch, by the sender's wall clock
_AUTH_HEAD = 2 + _STAMP.size + HMAC_BYTES
_CHECKSUM_HEAD = 2 + CHECKSUM_BYTES
REPLAY_KEY_BYTES = 16  # how much of each accepted HMAC the replay guard remembers

# Ranges checked at decode. Each keeps the arithmetic the protocol does on a received
# value (a refutation is max(own, received) + 1) far inside what msgpack can encode
# (uint64), so no answer to a packet can fail to encode.
MAX_INCARNATION = 2**62 - 1
MAX_SEQ = 2**32 - 1  # probe sequence numbers wrap at 32 bits
MAX_PORT = 65535
MAX_ID_CHARS = 128
MAX_HOST_CHARS = 255
MAX_METADATA_BYTES = 4096  # one member's metadata (GossipConfig.max_metadata_bytes is lower)
MAX_REASON_CHARS = 256
MAX_MESSAGES = 1024  # messages in one packet
MAX_RECORDS = 65536  # member records in one push/pull or members reply

# Datagram message types.
PING = 0  # [PING, seq, target_id]
ACK = 1  # [ACK, seq(, lateness_ms)]: the answering member's own lateness, when it runs late
PING_REQ = 2  # [PING_REQ, seq, target_id, target_host, target_port]
NACK = 3  # [NACK, seq]
ALIVE = 4  # [ALIVE, member_id, incarnation, host, port, metadata]
SUSPECT = 5  # [SUSPECT, member_id, incarnation, from_id]
DEAD = 6  # [DEAD, member_id, incarnation, from_id(, metadata)]; from_id == member_id means "left" (+ final metadata)
PAUSE = 7  # [PAUSE, incarnation, number]: the sender starts a pause of its own (a full garbage collection) now

# Stream (TCP request/response) message types.
PUSH_PULL = 10  # [PUSH_PULL, join, [member_record, ...]]
MEMBERS_QUERY = 11  # [MEMBERS_QUERY]
MEMBERS_REPLY = 12  # [MEMBERS_REPLY, [member_record, ...], [confirmed, ...]]
ERROR = 13  # [ERROR, reason]

# member_record = [member_id, host, port, incarnation, state, metadata]
STATE_ALIVE, STATE_SUSPECT, STATE_DEAD, STATE_LEFT = 0, 1, 2, 3
STATE_NAMES = ("alive", "suspect", "dead", "left")


class _Field(NamedTuple):
    """One message field: its msgpack type, the range of its value (ints) or length (the
    rest), and whether it must be printable ASCII (ids and hosts end up in logs and sockets)."""

    name: str
    type: type
    low: int = 0
    high: int = 0
    printable: bool = False


_SEQ = _Field("seq", int, 0, MAX_SEQ)
_INCARNATION = _Field("incarnation", int, 0, MAX_INCARNATION)
_PORT = _Field("port", int, 1, MAX_PORT)
_STATE = _Field("state", int, 0, len(STATE_NAMES) - 1)
_ID = _Field("member id", str, 1, MAX_ID_CHARS, printable=True)
_HOST = _Field("host", str, 1, MAX_HOST_CHARS, printable=True)
_METADATA = _Field("metadata", bytes, 0, MAX_METADATA_BYTES)
_REASON = _Field("reason", str, 0, MAX_REASON_CHARS, printable=True)
_RECORDS = _Field("records", list, 0, MAX_RECORDS)
_FLAGS = _Field("confirmed flags", list, 0, MAX_RECORDS)
_BOOL = _Field("flag", bool)
MAX_LATENESS_MS = 60_000
_LATENESS = _Field("lateness", int, 0, MAX_LATENESS_MS)

_SCHEMAS: dict[int, tuple[_Field, ...]] = {
    PING: (_SEQ, _ID),
    ACK: (_SEQ,),
    PING_REQ: (_SEQ, _ID, _HOST, _PORT),
    NACK: (_SEQ,),
    ALIVE: (_ID, _INCARNATION, _HOST, _PORT, _METADATA),
    SUSPECT: (_ID, _INCARNATION, _ID),
    DEAD: (_ID, _INCARNATION, _ID),
    PAUSE: (_INCARNATION, _SEQ),
    PUSH_PULL: (_BOOL, _RECORDS),
    MEMBERS_QUERY: (),
    MEMBERS_REPLY: (_RECORDS, _FLAGS),
    ERROR: (_REASON,),
}
_DEAD_LEFT = (_ID, _INCARNATION, _ID, _METADATA)
_ACK_LATE = (_SEQ, _LATENESS)
_RECORD_SCHEMA = (_ID, _HOST, _PORT, _INCARNATION, _STATE, _METADATA)
DATAGRAM_TYPES = frozenset({PING, ACK, PING_REQ, NACK, ALIVE, SUSPECT, DEAD, PAUSE})
STREAM_TYPES = frozenset({PUSH_PULL, MEMBERS_QUERY, MEMBERS_REPLY, ERROR})


class WireError(ValueError):
    """A packet that must be dropped; ``reason`` is a short label for the drop counters."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def encode(message: Sequence[object]) -> bytes:
    """Encode one message (a list whose first element is its type code)."""
    return msgpack.packb(message, use_bin_type=True)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


def encode_push_pull(join: bool, encoded_records: bytes) -> bytes:
    """``encode([PUSH_PULL, join, records])`` around records already encoded with
    :func:`encode`: the same bytes, and a table that did not change is not encoded again."""
    return _array_header(3) + encode(PUSH_PULL) + encode(join) + encoded_records


class ReplayGuard:
    """Refuses sealed packets outside the freshness window and exact copies inside it.

    Remembers the HMAC of every packet it accepted until the packet's time leaves the
    window, at most ``capacity`` of them. When full it forgets the oldest and raises the
    window's lower edge to that packet's time: the window shrinks, and a forgotten
    packet is refused as stale rather than accepted a second time.
    """

    def __init__(self, window: float, capacity: int) -> None:
        self.window_ms = int(window * 1000)
        self.capacity = max(1, capacity)
        self._seen: dict[bytes, int] = {}
        self._by_time: list[tuple[int, bytes]] = []  # heap of (sent_ms, key)
        self._floor_ms = -1

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, key: bytes, sent_ms: int, now_ms: int) -> str | None:
        """None when the packet is fresh (and remember it), else the drop reason."""
        by_time = self._by_time
        while by_time and by_time[0][0] < now_ms - self.window_ms:
            del self._seen[heapq.heappop(by_time)[1]]
        if sent_ms > now_ms + self.window_ms:
            return "future"
        if sent_ms < now_ms - self.window_ms or sent_ms <= self._floor_ms:
            return "stale"
        if key in self._seen:
            return "replayed"
        if len(self._seen) >= self.capacity:
            oldest_ms, oldest = heapq.heappop(by_time)
            del self._seen[oldest]
            self._floor_ms = max(self._floor_ms, oldest_ms)
        self._seen[key] = sent_ms
        heapq.heappush(by_time, (sent_ms, key))
        return None


class Sealer:
    """Seals and opens packets for one member: cluster name, sender id and secret fixed.

    ``now`` arguments are wall-clock seconds (``time.time()`` on a real host, the
    virtual clock in the simulator). They matter only with a secret: a sealed packet
    carries its sender's time and is accepted within ``freshness_window`` of the
    receiver's, so the hosts' clocks must agree to well within that window.
    """

    def __init__(self, cluster: str, sender_id: str, secret: bytes | None, max_bytes: int, *,
                 freshness_window: float = 30.0, replay_cache_entries: int = 16384) -> None:
        self.cluster = cluster
        self.secret = secret or None
        self.max_bytes = max_bytes
        self._flags = bytes((VERSION, FLAG_AUTH if self.secret else FLAG_CHECKSUM))
        self._body_head = b"\x93" + encode(cluster) + encode(sender_id)
        self._replays = ReplayGuard(freshness_window, replay_cache_entries) if self.secret else None
        head = _AUTH_HEAD if self.secret else _CHECKSUM_HEAD
        self.overhead = head + len(self._body_head) + 3

    def seal(self, encoded_messages: Sequence[bytes], *, now: float) -> bytes:
        """Build a packet from already-encoded messages (see :func:`encode`)."""
        return self.seal_body(self._body_head + _array_header(len(encoded_messages)) + b"".join(encoded_messages),
                              now=now)

    def seal_body(self, body: bytes, *, now: float) -> bytes:
        """Wrap an already-encoded body (tests and fuzzers build odd bodies by hand)."""
        if self.secret:
            head = self._flags + _STAMP.pack(max(0, int(now * 1000)))
            return head + hmac.new(self.secret, head + body, hashlib.sha256).digest() + body
        return self._flags + xxhash.xxh3_64_digest(self._flags + body) + body

    def open(self, data: bytes, allowed_types: frozenset[int] = DATAGRAM_TYPES, *,
             now: float) -> tuple[str, list[list]]:
        """Verify and decode a packet into ``(sender_id, messages)``; raise WireError."""
        body = self._verify(data, now)
        try:
            decoded = msgpack.unpackb(
                body,
                raw=False,
                use_list=True,
                strict_map_key=True,
                max_str_len=self.max_bytes,
                max_bin_len=self.max_bytes,
                max_array_len=self.max_bytes,
                max_map_len=0,
                max_ext_len=0,
            )
        except Exception as exc:  # msgpack raises several unrelated exception types
            raise WireError("malformed", type(exc).__name__) from None
        if not (isinstance(decoded, list) and len(decoded) == 3):
            raise WireError("malformed", "body is not [cluster, sender, messages]")
        cluster, sender, messages = decoded
        if cluster != self.cluster:
            raise WireError("wrong_cluster", repr(cluster)[:64])
        _check_fields((sender,), (_ID,), "sender")
        if type(messages) is not list:
            raise WireError("malformed", "messages is not a list")
        if len(messages) > MAX_MESSAGES:
            raise WireError("out_of_range", f"{len(messages)} messages > {MAX_MESSAGES}")
        for message in messages:
            validate_message(message, allowed_types)
        return sender, messages

    def _verify(self, data: bytes, now: float) -> bytes:
        """The body of a packet whose envelope checks out; raise WireError."""
        if len(data) > self.max_bytes:
            raise WireError("oversized", f"{len(data)} > {self.max_bytes} bytes")
        if len(data) < 2:
            raise WireError("truncated")
        if data[0] != VERSION:
            raise WireError("bad_version", f"version {data[0]}, expected {VERSION}")
        flags = data[1]
        if flags not in (FLAG_AUTH, FLAG_CHECKSUM):
            raise WireError("bad_flags")
        if not self.secret:
            if flags == FLAG_AUTH:
                raise WireError("unexpected_auth", "packet is authenticated but no secret is configured")
            if len(data) < _CHECKSUM_HEAD:
                raise WireError("truncated")
            body = data[_CHECKSUM_HEAD:]
            if xxhash.xxh3_64_digest(data[:2] + body) != data[2:_CHECKSUM_HEAD]:
                raise WireError("bad_checksum")
            return body
        if flags != FLAG_AUTH:
            raise WireError("unauthenticated", "packet carries no HMAC but a secret is configured")
        if len(data) < _AUTH_HEAD:
            raise WireError("truncated")
        head, mac, body = data[:_AUTH_HEAD - HMAC_BYTES], data[_AUTH_HEAD - HMAC_BYTES:_AUTH_HEAD], data[_AUTH_HEAD:]
        if not hmac.compare_digest(mac, hmac.new(self.secret, head + body, hashlib.sha256).digest()):
            raise WireError("bad_hmac")
        sent_ms = _STAMP.unpack_from(head, 2)[0]
        refused = self._replays.admit(mac[:REPLAY_KEY_BYTES], sent_ms, int(now * 1000))
        if refused is not None:
            raise WireError(refused, f"sent at {sent_ms} ms, received at {int(now * 1000)} ms")
        return body


def validate_message(message: object, allowed_types: frozenset[int]) -> None:
    """Raise WireError unless ``message`` is a well-formed message of an allowed type."""
    if type(message) is not list or not message or type(message[0]) is not int:
        raise WireError("malformed", "message is not [type, ...]")
    kind = message[0]
    if kind not in allowed_types:
        raise WireError("unknown_type", str(kind))
    schema = _SCHEMAS[kind]
    if kind == DEAD and len(message) == len(_DEAD_LEFT) + 1:
        schema = _DEAD_LEFT  # a departure notice carries the member's final metadata
    elif kind == ACK and len(message) == len(_ACK_LATE) + 1:
        schema = _ACK_LATE  # an answer from a member that runs late says how late
    if len(message) != len(schema) + 1:
        raise WireError("malformed", f"type {kind} has {len(message) - 1} fields, expected {len(schema)}")
    _check_fields(message[1:], schema, "message")
    if kind == PUSH_PULL:
        for record in message[2]:
            validate_record(record)
    elif kind == MEMBERS_REPLY:
        for record in message[1]:
            validate_record(record)
        if len(message[2]) != len(message[1]) or any(type(flag) is not bool for flag in message[2]):
            raise WireError("malformed", "confirmed flags do not match the records")


def validate_record(record: object) -> None:
    """Raise WireError unless ``record`` is a well-formed member record.

    The checks of ``_RECORD_SCHEMA`` written out in one expression for the record that
    passes them (a push/pull carries one record per member, a thousand in a large group);
    a record that fails any goes through :func:`_check_fields`, which names the fault."""
    if type(record) is not list or len(record) != len(_RECORD_SCHEMA):
        raise WireError("malformed", "member record has the wrong shape")
    member_id, host, port, incarnation, state, metadata = record
    if not (type(member_id) is str and 1 <= len(member_id) <= MAX_ID_CHARS
            and member_id.isascii() and member_id.isprintable()
            and type(host) is str and _IPV4_LITERAL.fullmatch(host) is not None
            and type(port) is int and 1 <= port <= MAX_PORT
            and type(incarnation) is int and 0 <= incarnation <= MAX_INCARNATION
            and type(state) is int and 0 <= state < len(STATE_NAMES)
            and type(metadata) is bytes and len(metadata) <= MAX_METADATA_BYTES):
        _check_fields(record, _RECORD_SCHEMA, "member record")


def _check_fields(values: Sequence[object], schema: tuple[_Field, ...], where: str) -> None:
    """Raise WireError unless each value has its field's type and lies in its range (one loop:
    this runs for every record of every push/pull)."""
    for value, (name, expected, low, high, printable) in zip(values, schema):
        if type(value) is not expected:
            raise WireError("malformed", f"{where}: {name} is {type(value).__name__}, not {expected.__name__}")
        if expected is int:
            size = value
        elif expected is bool:
            continue
        else:
            size = len(value)
            if printable and not (value.isascii() and value.isprintable()):
                raise WireError("out_of_range", f"{where}: {name} holds unprintable or non-ASCII characters")
        if not low <= size <= high:
            raise WireError("out_of_range", f"{where}: {name} {size} outside [{low}, {high}]")
        if name == "host" and not _ipv4_literal(value):  # a name would be looked up, blocking, on send
            raise WireError("out_of_range", f"{where}: host {value[:40]!r} is not an IPv4 address")


_IPV4_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4_LITERAL = re.compile(rf"{_IPV4_OCTET}(?:\.{_IPV4_OCTET}){{3}}")
"""An IPv4 address as ``str(ipaddress.IPv4Address(...))`` writes it: four decimal octets of
0-255 without leading zeros. A pattern rather than a round trip through ``ipaddress``,
which costs about eight times as much, and every host of every record of every push/pull
is checked."""


def _ipv4_literal(text: str) -> bool:
    return _IPV4_LITERAL.fullmatch(text) is not None
