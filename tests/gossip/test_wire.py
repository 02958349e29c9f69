"""Bad packets are dropped and counted, never raised, and the member keeps working."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftcomm.gossip import wire
from ftcomm.gossip.config import GossipConfig
from ftcomm.gossip.protocol import Protocol
from ftcomm.gossip.wire import ACK, ALIVE, PING

from .helpers import address, decode, member_id, packet

SECRET = b"s3cret"


def node(secret: bytes | None = None) -> Protocol:
    n = Protocol(member_id(0), *address(0), secret=secret, seed=1)
    n.start(0.0)
    n.take_datagrams()
    return n


def still_answers(n: Protocol, secret: bytes | None = None) -> bool:
    n.receive(packet([PING, 77, member_id(0)], sender=member_id(5), secret=secret), address(5), 1.0)
    replies = n.take_datagrams()
    sealer = wire.Sealer("ftcomm", "t", secret, 1400)
    return any([ACK, 77] in sealer.open(d.data)[1] for d in replies)


def body(*items) -> bytes:
    return bytes((wire.VERSION, 0)) + msgpack.packb(list(items), use_bin_type=True)


CASES = {
    "truncated": b"\x01",
    "bad_version": bytes((9, 0)) + msgpack.packb(["ftcomm", "x", []]),
    "wrong_cluster": packet([PING, 1, member_id(0)], cluster="other"),
    "malformed": body("ftcomm", "x", [[PING, "not-an-int", member_id(0)]]),
    "unknown_type": body("ftcomm", "x", [[42, 1]]),
    "oversized": b"\x01\x00" + b"\x00" * 2000,
}


@pytest.mark.parametrize("reason", sorted(CASES))
def test_bad_packet_is_dropped_and_counted(reason):
    n = node()
    n.receive(CASES[reason], address(5), 0.5)
    assert n.stats["dropped." + reason] == 1 and n.stats["dropped"] == 1
    assert n.take_events() == [] and n.take_datagrams() == []
    assert still_answers(n)


def test_truncated_msgpack_and_huge_declared_lengths_are_dropped():
    n = node()
    good = packet([ALIVE, member_id(3), 1, *address(3), b"m"])
    for cut in range(3, len(good)):
        n.receive(good[:cut], address(5), 0.5)
    huge_array = bytes((wire.VERSION, 0)) + b"\xdd" + struct.pack(">I", 2**31) + b"\x00"
    huge_str = bytes((wire.VERSION, 0)) + b"\x93\xdb" + struct.pack(">I", 2**31 - 1) + b"ab"
    n.receive(huge_array, address(5), 0.5)
    n.receive(huge_str, address(5), 0.5)
    assert n.stats["dropped"] == len(good) - 3 + 2
    assert n.member(member_id(3)) is None
    assert still_answers(n)


def test_hmac_required_verified_and_never_acted_on_when_wrong():
    n = node(SECRET)
    news = [ALIVE, member_id(3), 1, *address(3), b""]
    n.receive(packet(news), address(5), 0.5)  # no HMAC at all
    n.receive(packet(news, secret=b"wrong"), address(5), 0.5)
    tampered = bytearray(packet(news, secret=SECRET))
    tampered[-1] ^= 0x01
    n.receive(bytes(tampered), address(5), 0.5)
    assert (n.stats["dropped.unauthenticated"], n.stats["dropped.bad_hmac"]) == (1, 2)
    assert n.member(member_id(3)) is None
    n.receive(packet(news, secret=SECRET), address(5), 0.5)
    assert n.member(member_id(3)) is not None
    assert still_answers(n, SECRET)


def test_member_without_secret_drops_authenticated_packets():
    n = node()
    n.receive(packet([PING, 1, member_id(0)], secret=SECRET), address(5), 0.5)
    assert n.stats["dropped.unexpected_auth"] == 1


def test_stream_requests_with_bad_input_get_an_error_reply():
    n = node(SECRET)
    reply = n.handle_stream(b"garbage", 0.5)
    messages = wire.Sealer("ftcomm", "t", SECRET, 1 << 20).open(reply, wire.STREAM_TYPES)[1]
    assert messages[0][0] == wire.ERROR and n.stats["dropped"] == 1


def test_every_datagram_fits_the_size_limit():
    cfg = GossipConfig()
    n = Protocol(member_id(0), *address(0), config=cfg, seed=1)
    records = [[member_id(i), *address(i), 0, wire.STATE_ALIVE, b"x" * 200] for i in range(1, 200)]
    n.bootstrap(records, 0.0)
    n.start(0.0)
    for i in range(1, 200):  # 199 pieces of news of ~250 bytes each are queued
        n.receive(packet([ALIVE, member_id(i), 1, *address(i), b"y" * 200]), address(i), 0.0)
    sizes = []
    for step in range(1, 100):
        n.tick(step * 0.05)
        sizes += [len(d.data) for d in n.take_datagrams()]
    assert sizes and max(sizes) <= cfg.max_datagram_bytes
    assert max(len(decode(d)) for d in [packet([PING, 1, "x"])]) == 1


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=1600))
def test_random_bytes_never_raise_or_change_state(data):
    n = node()
    n.receive(data, address(5), 0.5)
    assert n.take_events() == []
    assert [m.id for m in n.members()] == [member_id(0)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=8))
def test_bit_flipped_authenticated_packets_are_never_acted_on(flips):
    n = node(SECRET)
    original = packet([ALIVE, member_id(3), 1, *address(3), b"meta"], secret=SECRET)
    data = bytearray(original)
    for position, value in flips:
        data[position % len(data)] = value
    n.receive(bytes(data), address(5), 0.5)
    if bytes(data) != original:  # later writes may restore what earlier ones changed
        assert n.member(member_id(3)) is None and n.stats["dropped"] == 1


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=20) | st.binary(max_size=20),
                    lambda children: st.lists(children, max_size=6), max_leaves=30))
def test_arbitrary_msgpack_bodies_never_raise(value):
    n = node()
    n.receive(body("ftcomm", member_id(5), [value]), address(5), 0.5)
    n.receive(body("ftcomm", member_id(5), value), address(5), 0.5)
    n.receive(bytes((wire.VERSION, 0)) + msgpack.packb(value, use_bin_type=True), address(5), 0.5)
    assert still_answers(n)
