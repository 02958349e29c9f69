"""Wire format of the gossip layer: sealed msgpack packets and the messages inside them.

A packet is::

    version (1 byte) | flags (1 byte) | HMAC-SHA256 (32 bytes, when flags & AUTH) | body

and the body is one msgpack array ``[cluster, sender_id, [message, ...]]``. The HMAC
covers version, flags and body. Each message is a msgpack array whose first element
is its type code; its fields are validated here, so the protocol core only ever sees
well-formed messages. UDP datagrams and TCP (pyzmq) frames use the same envelope.

Anything malformed raises :class:`WireError` with a short, countable reason; callers
drop the packet and count the reason.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

import msgpack

VERSION = 1
FLAG_AUTH = 0x01
HMAC_BYTES = 32
MAX_ID_CHARS = 128
MAX_HOST_CHARS = 255

# Datagram message types.
PING = 0  # [PING, seq, target_id]
ACK = 1  # [ACK, seq]
PING_REQ = 2  # [PING_REQ, seq, target_id, target_host, target_port]
NACK = 3  # [NACK, seq]
ALIVE = 4  # [ALIVE, member_id, incarnation, host, port, metadata]
SUSPECT = 5  # [SUSPECT, member_id, incarnation, from_id]
DEAD = 6  # [DEAD, member_id, incarnation, from_id]; from_id == member_id means "left"

# Stream (TCP request/response) message types.
PUSH_PULL = 10  # [PUSH_PULL, join, [member_record, ...]]
MEMBERS_QUERY = 11  # [MEMBERS_QUERY]
MEMBERS_REPLY = 12  # [MEMBERS_REPLY, [member_record, ...]]
ERROR = 13  # [ERROR, reason]

# member_record = [member_id, host, port, incarnation, state, metadata]
STATE_ALIVE, STATE_SUSPECT, STATE_DEAD, STATE_LEFT = 0, 1, 2, 3
STATE_NAMES = ("alive", "suspect", "dead", "left")

_STR, _INT, _BYTES, _BOOL, _LIST = str, int, bytes, bool, list
_SCHEMAS: dict[int, tuple[type, ...]] = {
    PING: (_INT, _STR),
    ACK: (_INT,),
    PING_REQ: (_INT, _STR, _STR, _INT),
    NACK: (_INT,),
    ALIVE: (_STR, _INT, _STR, _INT, _BYTES),
    SUSPECT: (_STR, _INT, _STR),
    DEAD: (_STR, _INT, _STR),
    PUSH_PULL: (_BOOL, _LIST),
    MEMBERS_QUERY: (),
    MEMBERS_REPLY: (_LIST,),
    ERROR: (_STR,),
}
_RECORD_SCHEMA = (_STR, _STR, _INT, _INT, _INT, _BYTES)
DATAGRAM_TYPES = frozenset({PING, ACK, PING_REQ, NACK, ALIVE, SUSPECT, DEAD})
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


class Sealer:
    """Seals and opens packets for one member: cluster name, sender id and secret fixed."""

    def __init__(self, cluster: str, sender_id: str, secret: bytes | None, max_bytes: int) -> None:
        self.cluster = cluster
        self.secret = secret or None
        self.max_bytes = max_bytes
        self._prefix = bytes((VERSION, FLAG_AUTH if self.secret else 0))
        self._body_head = b"\x93" + encode(cluster) + encode(sender_id)
        self._cluster_bytes = encode(cluster)
        self.overhead = len(self._prefix) + (HMAC_BYTES if self.secret else 0) + len(self._body_head) + 3

    def seal(self, encoded_messages: Sequence[bytes]) -> bytes:
        """Build a packet from already-encoded messages (see :func:`encode`)."""
        body = self._body_head + _array_header(len(encoded_messages)) + b"".join(encoded_messages)
        if self.secret:
            mac = hmac.new(self.secret, self._prefix + body, hashlib.sha256).digest()
            return self._prefix + mac + body
        return self._prefix + body

    def open(self, data: bytes, allowed_types: frozenset[int] = DATAGRAM_TYPES) -> tuple[str, list[list]]:
        """Verify and decode a packet into ``(sender_id, messages)``; raise WireError."""
        if len(data) > self.max_bytes:
            raise WireError("oversized", f"{len(data)} > {self.max_bytes} bytes")
        if len(data) < 3:
            raise WireError("truncated")
        if data[0] != VERSION:
            raise WireError("bad_version", f"version {data[0]}, expected {VERSION}")
        flags = data[1]
        if flags & ~FLAG_AUTH:
            raise WireError("bad_flags")
        if self.secret:
            if not flags & FLAG_AUTH:
                raise WireError("unauthenticated", "packet carries no HMAC but a secret is configured")
            if len(data) < 2 + HMAC_BYTES:
                raise WireError("truncated")
            mac, body = data[2 : 2 + HMAC_BYTES], data[2 + HMAC_BYTES :]
            expected = hmac.new(self.secret, data[:2] + body, hashlib.sha256).digest()
            if not hmac.compare_digest(mac, expected):
                raise WireError("bad_hmac")
        else:
            if flags & FLAG_AUTH:
                raise WireError("unexpected_auth", "packet is authenticated but no secret is configured")
            body = data[2:]
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
        if type(sender) is not str or not 0 < len(sender) <= MAX_ID_CHARS:
            raise WireError("malformed", "bad sender id")
        if type(messages) is not list:
            raise WireError("malformed", "messages is not a list")
        for message in messages:
            validate_message(message, allowed_types)
        return sender, messages


def validate_message(message: object, allowed_types: frozenset[int]) -> None:
    """Raise WireError unless ``message`` is a well-formed message of an allowed type."""
    if type(message) is not list or not message or type(message[0]) is not int:
        raise WireError("malformed", "message is not [type, ...]")
    kind = message[0]
    if kind not in allowed_types:
        raise WireError("unknown_type", str(kind))
    schema = _SCHEMAS[kind]
    if len(message) != len(schema) + 1:
        raise WireError("malformed", f"type {kind} has {len(message) - 1} fields, expected {len(schema)}")
    for value, expected in zip(message[1:], schema):
        if type(value) is not expected:
            raise WireError("malformed", f"type {kind}: {type(value).__name__} where {expected.__name__} expected")
    if kind in (ALIVE, SUSPECT, DEAD, PING, PING_REQ):
        _check_id(message[2] if kind in (PING, PING_REQ) else message[1])
    if kind in (SUSPECT, DEAD):
        _check_id(message[3])
    if kind in (ALIVE, PING_REQ):
        _check_address(message[3], message[4])  # both carry host and port at 3 and 4
    if kind == PUSH_PULL:
        for record in message[2]:
            validate_record(record)
    if kind == MEMBERS_REPLY:
        for record in message[1]:
            validate_record(record)


def validate_record(record: object) -> None:
    """Raise WireError unless ``record`` is a well-formed member record."""
    if type(record) is not list or len(record) != len(_RECORD_SCHEMA):
        raise WireError("malformed", "member record has the wrong shape")
    for value, expected in zip(record, _RECORD_SCHEMA):
        if type(value) is not expected:
            raise WireError("malformed", "member record field of the wrong type")
    _check_id(record[0])
    _check_address(record[1], record[2])
    if not 0 <= record[4] < len(STATE_NAMES):
        raise WireError("malformed", "member state out of range")


def _check_id(member_id: str) -> None:
    if not 0 < len(member_id) <= MAX_ID_CHARS:
        raise WireError("malformed", "member id length")


def _check_address(host: str, port: int) -> None:
    if not 0 < len(host) <= MAX_HOST_CHARS or not 0 < port < 65536:
        raise WireError("malformed", "bad address")
