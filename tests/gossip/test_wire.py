"""Bad packets are dropped and counted, never raised, and the member keeps working."""

from __future__ import annotations

import ipaddress
import random
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftcomm.gossip import wire
from ftcomm.gossip.config import GossipConfig
from ftcomm.gossip.protocol import Protocol
from ftcomm.gossip.wire import ACK, ALIVE, DEAD, PING, PING_REQ, SUSPECT

from .helpers import MiniNet, address, decode, member_id, packet

SECRET = b"s3cret"


def node(secret: bytes | None = None) -> Protocol:
    n = Protocol(member_id(0), *address(0), secret=secret, seed=1)
    n.start(0.0)
    n.take_datagrams()
    return n


def still_answers(n: Protocol, secret: bytes | None = None, now: float = 1.0) -> bool:
    n.receive(packet([PING, 77, member_id(0)], sender=member_id(5), secret=secret, now=now), address(5), now)
    replies = n.take_datagrams()
    sealer = wire.Sealer("ftcomm", "t", secret, 1400)
    return any([ACK, 77] in sealer.open(d.data, now=now)[1] for d in replies)


def sealed(raw_body: bytes, secret: bytes | None = None, now: float = 0.0) -> bytes:
    """A packet with a valid checksum (or HMAC) around a body built by hand."""
    return wire.Sealer("ftcomm", "x", secret, 1 << 20).seal_body(raw_body, now=now)


def decode_stream(data: bytes) -> list[list]:
    return wire.Sealer("ftcomm", "t", None, 1 << 20).open(data, wire.STREAM_TYPES, now=0.0)[1]


def body(*items) -> bytes:
    return sealed(msgpack.packb(list(items), use_bin_type=True))


CASES = {
    "truncated": bytes((wire.VERSION, wire.FLAG_CHECKSUM, 0)),
    "bad_version": bytes((1, 0)) + msgpack.packb(["ftcomm", "x", []]),
    "bad_flags": bytes((wire.VERSION, 0)) + msgpack.packb(["ftcomm", "x", []]),
    "bad_checksum": packet([PING, 1, member_id(0)])[:-1] + b"\x00",
    "wrong_cluster": packet([PING, 1, member_id(0)], cluster="other"),
    "malformed": body("ftcomm", "x", [[PING, "not-an-int", member_id(0)]]),
    "out_of_range": body("ftcomm", "x", [[PING, 2**32, member_id(0)]]),
    "unknown_type": body("ftcomm", "x", [[42, 1]]),
    "oversized": bytes((wire.VERSION, wire.FLAG_CHECKSUM)) + b"\x00" * 2000,
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
    for cut in range(len(good)):
        n.receive(good[:cut], address(5), 0.5)
    huge_array = sealed(b"\xdd" + struct.pack(">I", 2**31) + b"\x00")
    huge_str = sealed(b"\x93\xdb" + struct.pack(">I", 2**31 - 1) + b"ab")
    n.receive(huge_array, address(5), 0.5)
    n.receive(huge_str, address(5), 0.5)
    assert n.stats["dropped"] == len(good) + 2 == n.stats["dropped.malformed"] + n.stats["dropped.truncated"] + \
        n.stats["dropped.bad_checksum"]
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
    messages = wire.Sealer("ftcomm", "t", SECRET, 1 << 20).open(reply, wire.STREAM_TYPES, now=0.5)[1]
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
    n.receive(sealed(msgpack.packb(value, use_bin_type=True)), address(5), 0.5)
    assert still_answers(n)


# ---------------------------------------------------------------- numeric ranges (finding: one forged
# SUSPECT(victim, 2**64 - 1) made the victim's refutation overflow msgpack and broke it for good)
def test_an_accusation_with_an_unencodable_incarnation_is_dropped_and_the_accused_keeps_working():
    n = node()
    n.receive(packet([SUSPECT, member_id(0), 2**64 - 1, member_id(5)]), address(5), 0.5)
    assert (n.stats["dropped.out_of_range"], n.stats["dropped"], n.incarnation) == (1, 1, 0)
    n.tick(1.0)
    assert still_answers(n)
    assert decode_stream(n.handle_stream(n.join_request(1.0), 1.0))[0][0] == wire.PUSH_PULL


OUT_OF_RANGE = {
    "incarnation": [ALIVE, member_id(3), wire.MAX_INCARNATION + 1, *address(3), b""],
    "negative incarnation": [SUSPECT, member_id(3), -1, member_id(4)],
    "seq": [ACK, wire.MAX_SEQ + 1],
    "lateness": [ACK, 1, wire.MAX_LATENESS_MS + 1],
    "negative lateness": [ACK, 1, -1],
    "negative seq": [PING, -5, member_id(0)],
    "port": [PING_REQ, 1, member_id(3), "10.0.0.3", 65536],
    "port zero": [ALIVE, member_id(3), 1, "10.0.0.3", 0, b""],
    "id length": [DEAD, "x" * (wire.MAX_ID_CHARS + 1), 1, member_id(4)],
    "empty id": [DEAD, "", 1, member_id(4)],
    "unprintable host": [ALIVE, member_id(3), 1, "10.0.0.3\x00", 7946, b""],
    # a name would be looked up, blocking the gossip thread, each time something is sent there
    "host name": [ALIVE, member_id(3), 1, "localhost", 7946, b""],
    "host name in a ping request": [PING_REQ, 1, member_id(3), "example.com", 7946],
    "host not in canonical form": [ALIVE, member_id(3), 1, "010.0.0.3", 7946, b""],
    "pause incarnation": [wire.PAUSE, wire.MAX_INCARNATION + 1, 0],
    "negative pause number": [wire.PAUSE, 0, -1],
    "pause number": [wire.PAUSE, 0, wire.MAX_SEQ + 1],
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_every_numeric_and_size_field_is_range_checked(case):
    n = node()
    n.receive(packet(OUT_OF_RANGE[case]), address(5), 0.5)
    assert n.stats["dropped.out_of_range"] == 1 and n.stats["dropped"] == 1
    assert n.member(member_id(3)) is None and n.take_events() == []


@pytest.mark.parametrize("record", [
    [member_id(3), *address(3), 2**63, wire.STATE_ALIVE, b""],
    [member_id(3), *address(3), 1, 4, b""],
    [member_id(3), *address(3), 1, wire.STATE_ALIVE, b"x" * (wire.MAX_METADATA_BYTES + 1)],
    [member_id(3), "localhost", 7946, 1, wire.STATE_ALIVE, b""],
])
def test_stream_records_are_range_checked_too(record):
    n = node()
    reply = n.handle_stream(wire.Sealer("ftcomm", member_id(5), None, 1 << 20).seal(
        [wire.encode([wire.PUSH_PULL, False, [record]])], now=0.5), 0.5)
    assert decode_stream(reply)[0] == [wire.ERROR, "out_of_range"]
    assert n.member(member_id(3)) is None


def test_news_at_an_implausible_incarnation_is_refused_and_nobody_is_put_beyond_refutation():
    # A death notice at the top of the range could never be refuted (a refutation needs a
    # higher incarnation): forged with the secret, or in a group without one, it would bury
    # a live member for good. Each refutation adds one: a jump this large is never real.
    n = node()
    n.receive(packet([ALIVE, member_id(1), 0, *address(1), b""]), address(5), 0.4)  # known at incarnation 0
    for kind in (SUSPECT, DEAD):
        n.receive(packet([kind, member_id(0), wire.MAX_INCARNATION, member_id(5)]), address(5), 0.5)
        n.receive(packet([kind, member_id(1), wire.MAX_INCARNATION, member_id(5)]), address(5), 0.5)
    n.receive(packet([ALIVE, member_id(1), wire.MAX_INCARNATION, *address(1), b""]), address(5), 0.5)
    assert n.incarnation == 0 and n.stats["refutations"] == 0
    assert n.member(member_id(1)).state == "alive" and n.member(member_id(1)).incarnation == 0
    assert n.stats["rejected.incarnation_jump"] == 5
    n.receive(packet([SUSPECT, member_id(1), 3, member_id(5)]), address(5), 0.6)  # a plausible one counts
    assert n.member(member_id(1)).state == "suspect"


# ---------------------------------------------------------------- checksum (finding: without a secret
# 548 of 1000 bit-flipped copies of real packets were accepted)
def real_packets(secret: bytes | None = None, seconds: float = 6.0) -> list[bytes]:
    net = MiniNet(5, GossipConfig(push_pull_interval=1.0), secret=secret)
    net.run(1.0)
    net.nodes[2].set_metadata(b"status=active", net.now)
    net.down.add(4)
    net.run(seconds - 1.0)
    return [data for _, kind, data in net.captured if kind == "datagram"]


def test_bit_flipped_copies_of_real_packets_are_dropped_without_a_secret():
    packets = real_packets()
    rng = random.Random(548)
    n = Protocol(member_id(9), *address(9), seed=1)
    n.start(0.0)
    for i in range(1000):
        data = bytearray(rng.choice(packets))
        bit = rng.randrange(8 * len(data))
        data[bit // 8] ^= 1 << (bit % 8)
        n.receive(bytes(data), address(5), 0.5)
    assert n.stats["datagrams_received"] == 0 and n.stats["dropped"] == 1000
    assert n.stats["dropped.bad_checksum"] > 900
    assert [m.id for m in n.members()] == [member_id(9)] and n.incarnation == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), min_size=1, max_size=8))
def test_corrupted_packets_without_a_secret_are_never_acted_on(flips):
    n = node()
    original = packet([ALIVE, member_id(3), 1, *address(3), b"meta"])
    data = bytearray(original)
    for position, value in flips:
        data[position % len(data)] = value
    n.receive(bytes(data), address(5), 0.5)
    if bytes(data) != original:
        assert n.member(member_id(3)) is None and n.stats["dropped"] == 1


# ---------------------------------------------------------------- freshness (finding: sealed packets
# could be replayed forever)
def test_a_sealed_packet_is_accepted_once_within_the_window():
    n = node(SECRET)
    news = packet([ALIVE, member_id(3), 1, *address(3), b""], secret=SECRET, now=10.0)
    n.receive(news, address(5), 10.2)
    n.receive(news, address(5), 10.4)
    assert n.member(member_id(3)) is not None and n.stats["dropped.replayed"] == 1
    window = n.config.freshness_window
    n.receive(packet([ALIVE, member_id(4), 1, *address(4), b""], secret=SECRET, now=10.0), address(5),
              10.0 + window + 0.1)
    n.receive(packet([ALIVE, member_id(6), 1, *address(6), b""], secret=SECRET, now=50.0 + window + 0.1),
              address(5), 50.0)
    assert (n.stats["dropped.stale"], n.stats["dropped.future"]) == (1, 1)
    assert n.member(member_id(4)) is None and n.member(member_id(6)) is None


def test_replayed_stream_requests_are_refused():
    n = node(SECRET)
    request = wire.Sealer("ftcomm", member_id(5), SECRET, 1 << 20).seal([wire.encode([wire.MEMBERS_QUERY])], now=3.0)
    sealer = wire.Sealer("ftcomm", "t", SECRET, 1 << 20)
    first = sealer.open(n.handle_stream(request, 3.0), wire.STREAM_TYPES, now=3.0)[1][0]
    again = sealer.open(n.handle_stream(request, 3.5), wire.STREAM_TYPES, now=3.5)[1][0]
    late = sealer.open(n.handle_stream(request, 300.0), wire.STREAM_TYPES, now=300.0)[1][0]
    assert first[0] == wire.MEMBERS_REPLY and again == [wire.ERROR, "replayed"] and late == [wire.ERROR, "stale"]


def test_wall_offset_stamps_and_checks_sealed_packets_in_wall_clock_time():
    n = node(SECRET)
    n.wall_offset = 1_700_000_000.0  # the driver's now is a monotonic clock near 0
    n.receive(packet([PING, 5, member_id(0)], secret=SECRET, now=1_700_000_001.0), address(5), 1.0)
    (ack,) = n.take_datagrams()
    sealer = wire.Sealer("ftcomm", "t", SECRET, 1400)
    assert sealer.open(ack.data, now=1_700_000_001.0)[1][0] == [ACK, 5]
    with pytest.raises(wire.WireError, match="stale"):
        wire.Sealer("ftcomm", "t2", SECRET, 1400).open(ack.data, now=1.0 + 1_700_000_000.0 + 60)


def test_a_full_replay_cache_shrinks_the_window_instead_of_forgetting():
    guard = wire.ReplayGuard(window=30.0, capacity=3)
    assert [guard.admit(key, sent, 10_000) for key, sent in ((b"a", 1_000), (b"b", 2_000), (b"c", 3_000))] == [None] * 3
    assert guard.admit(b"d", 4_000, 10_000) is None and len(guard) == 3  # "a" was forgotten ...
    assert guard.admit(b"a", 1_000, 10_000) == "stale"  # ... so its time is now outside the window
    assert guard.admit(b"c", 3_000, 10_000) == "replayed"
    assert guard.admit(b"e", 1_500, 10_000) is None  # above the edge: accepted, and "b" forgotten
    assert [guard.admit(key, sent, 10_000) for key, sent in ((b"b", 2_000), (b"e", 1_500))] == ["stale"] * 2
    assert guard.admit(b"f", 40_000, 45_000) is None and len(guard) == 1  # old entries expired


HOSTS = ["10.0.0.3", "0.0.0.0", "255.255.255.255", "256.0.0.1", "010.0.0.3", "10.0.0.03", "1.2.3", "1.2.3.4.5",
         "1..2.3", " 1.2.3.4", "1.2.3.4\n", "\u0661.2.3.4", "0x1.2.3.4", "1.2.3.4/32", "localhost", ""]


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.sampled_from(HOSTS), st.text(alphabet="0123456789.", max_size=16), st.text(max_size=16),
                 st.lists(st.integers(0, 300).map(str), min_size=3, max_size=5).map(".".join)))
def test_a_host_is_accepted_exactly_when_ipaddress_writes_it_that_way(host):
    try:
        canonical = str(ipaddress.IPv4Address(host)) == host
    except ValueError:
        canonical = False
    assert wire._ipv4_literal(host) is canonical


ODD_VALUES = [None, True, False, 0, -1, 1, 3, 4, 7946, 65535, 65536, wire.MAX_INCARNATION, wire.MAX_INCARNATION + 1,
              1.0, "", "x" * wire.MAX_ID_CHARS, "x" * (wire.MAX_ID_CHARS + 1), "a\x00b", "\u00e9", "localhost",
              "10.0.0.256", "10.0.0.3", b"", b"x" * wire.MAX_METADATA_BYTES, b"x" * (wire.MAX_METADATA_BYTES + 1), []]


def test_a_record_is_refused_for_the_reason_the_field_by_field_check_gives():
    def refusal(check, record) -> str | None:
        try:
            check(record)
        except wire.WireError as err:
            return str(err)
        return None

    def field_by_field(record):
        wire._check_fields(record, wire._RECORD_SCHEMA, "member record")

    good = [member_id(3), *address(3), 1, wire.STATE_ALIVE, b"ph=training"]
    records = [good] + [good[:i] + [value] + good[i + 1:] for i in range(len(good)) for value in ODD_VALUES]
    records += [[value, "10.0.0.256", *good[2:]] for value in ODD_VALUES]  # the first fault is named
    assert refusal(wire.validate_record, good) is None
    for record in records:
        assert refusal(wire.validate_record, record) == refusal(field_by_field, record), record


@pytest.mark.parametrize("join", [True, False])
def test_a_push_pull_around_encoded_records_is_the_push_pull_encoded_whole(join):
    records = [[member_id(i), *address(i), i, wire.STATE_ALIVE, b"m" * i] for i in range(40)]
    assert wire.encode_push_pull(join, wire.encode(records)) == wire.encode([wire.PUSH_PULL, join, records])
