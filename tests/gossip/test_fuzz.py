"""Fuzzing the gossip layer: bad packets built from real ones, fed to the sans-I/O core in
process (over 100,000) and to a live member of the real runtime over the network (over 10,000).

Whatever arrives, no exception escapes, every packet is either acted on or dropped and
counted under one reason, nothing but real packets is acted on when a secret is set
(so no phantom member appears), and a live member keeps serving without being suspected.
"""

from __future__ import annotations

import random
import socket
import time
from collections import Counter
from collections.abc import Callable

import msgpack
import pytest
import zmq

from ftcomm.gossip import GossipConfig, query_members, wire
from ftcomm.gossip.local import LocalCluster
from ftcomm.gossip.protocol import Protocol
from ftcomm.gossip.wire import ACK, ALIVE, DEAD, NACK, PING, PING_REQ, PUSH_PULL, SUSPECT

from ..polling import wait_until
from .helpers import MiniNet, address, member_id

SECRET = b"fuzz-secret"
EPOCH = 1_700_000_000.0  # the group's wall clock at virtual time 0
GROUP = 6
TARGET = 1  # the member the packets are fed to (a fresh instance of it)

# Where the numbers sit in each message (index in the message) and values outside their range.
_NUMERIC_FIELDS = {PING: [1], ACK: [1], NACK: [1], PING_REQ: [1, 4], ALIVE: [2, 4], SUSPECT: [2], DEAD: [2]}
_RECORD_NUMERIC_FIELDS = [2, 3, 4]  # port, incarnation, state
_BAD_VALUES = {
    "seq": [-1, wire.MAX_SEQ + 1, 2**64 - 1],
    "incarnation": [-1, wire.MAX_INCARNATION + 1, 2**64 - 1, -(2**63)],
    "port": [0, -1, wire.MAX_PORT + 1, 2**64 - 1],
    "state": [-1, len(wire.STATE_NAMES), 255],
}
_FIELD_NAMES = {(PING, 1): "seq", (ACK, 1): "seq", (NACK, 1): "seq", (PING_REQ, 1): "seq", (PING_REQ, 4): "port",
                (ALIVE, 2): "incarnation", (ALIVE, 4): "port", (SUSPECT, 2): "incarnation",
                (DEAD, 2): "incarnation", ("record", 2): "port", ("record", 3): "incarnation",
                ("record", 4): "state"}


def capture_real_traffic(secret: bytes | None) -> list[tuple[float, str, bytes]]:
    """Packets of a six-member group living through metadata changes, a crash and a leave."""
    net = MiniNet(GROUP, GossipConfig(push_pull_interval=1.0, reconnect_interval=1.0), seed=3, secret=secret)
    for node in net.nodes:
        node.wall_offset = EPOCH
    net.run(1.0)
    net.nodes[2].set_metadata(b"ph=active st=1", net.now)
    net.run(1.0)
    net.down.add(5)  # crash: probes fail, suspicion, death
    net.run(3.0)
    net.nodes[4].leave(net.now)
    net.run(1.0)
    net.down.add(4)
    net.nodes[3].set_metadata(b"ph=active st=2", net.now)
    net.run(2.0)
    return net.captured


class Fuzzer:
    """Turns real packets into bad ones; each kind of damage is one method, picked at random."""

    def __init__(self, captured: list[tuple[float, str, bytes]], secret: bytes | None, seed: int) -> None:
        self.rng = random.Random(seed)
        self.made: set[bytes] = set()
        self.secret = secret
        self.real = [(channel, data) for _, channel, data in captured]
        self.head = 2 + (8 + wire.HMAC_BYTES if secret else wire.CHECKSUM_BYTES)
        self.insider = wire.Sealer("ftcomm", member_id(3), secret, 1 << 24)
        self.outsider = wire.Sealer("ftcomm", member_id(3), b"not-the-secret" if secret else None, 1 << 24)
        self.kinds: list[tuple[str, Callable[[float], tuple[str, bytes]]]] = [
            ("replay", self.replay), ("bit_flip", self.bit_flip), ("byte_overwrite", self.byte_overwrite),
            ("truncate", self.truncate), ("extend", self.extend), ("random_bytes", self.random_bytes),
            ("out_of_range", self.out_of_range), ("wrong_type", self.wrong_type),
        ]
        if secret:  # without a secret packets carry no time, and a forgery is indistinguishable from news
            self.kinds += [("stale", self.stale), ("future", self.future), ("forged", self.forged)]

    def next(self, now: float) -> tuple[str, str, bytes]:
        name, make = self.rng.choice(self.kinds)
        channel, data = make(now)
        for _ in range(100):
            if name == "replay" or data not in self.made:  # the same damage twice would be a replay
                break
            channel, data = make(now)
        self.made.add(data)
        return name, channel, data

    def _pick(self) -> tuple[str, bytes]:
        return self.rng.choice(self.real)

    def _body(self, data: bytes) -> list:
        return msgpack.unpackb(data[self.head:], raw=False)

    def _reseal(self, body: list, now: float, sealer: wire.Sealer | None = None) -> bytes:
        return (sealer or self.insider).seal_body(msgpack.packb(body, use_bin_type=True), now=now)

    def replay(self, now: float) -> tuple[str, bytes]:
        return self._pick()

    def bit_flip(self, now: float) -> tuple[str, bytes]:
        channel, data = self._pick()
        damaged = bytearray(data)
        for _ in range(self.rng.randint(1, 4)):
            bit = self.rng.randrange(8 * len(damaged))
            damaged[bit // 8] ^= 1 << (bit % 8)
        return channel, bytes(damaged)

    def byte_overwrite(self, now: float) -> tuple[str, bytes]:
        channel, data = self._pick()
        damaged = bytearray(data)
        for _ in range(self.rng.randint(1, 8)):
            damaged[self.rng.randrange(len(damaged))] = self.rng.randrange(256)
        return channel, bytes(damaged)

    def truncate(self, now: float) -> tuple[str, bytes]:
        channel, data = self._pick()
        return channel, data[:self.rng.randrange(len(data))]

    def extend(self, now: float) -> tuple[str, bytes]:
        channel, data = self._pick()
        return channel, data + self.rng.randbytes(self.rng.randint(1, 64))

    def random_bytes(self, now: float) -> tuple[str, bytes]:
        channel = self.rng.choice(("datagram", "stream", "reply"))
        data = self.rng.randbytes(self.rng.randint(0, 1500))
        if self.rng.random() < 0.5:  # a plausible envelope around the noise
            data = bytes((wire.VERSION, self.rng.choice((wire.FLAG_AUTH, wire.FLAG_CHECKSUM)))) + data
        return channel, data

    def out_of_range(self, now: float) -> tuple[str, bytes]:
        """One number of a real packet set outside its range, sealed by a member (with the secret)."""
        channel, data = self._pick()
        body = self._body(data)
        messages = body[2]
        message = self.rng.choice(messages)
        if message[0] in _NUMERIC_FIELDS:
            index = self.rng.choice(_NUMERIC_FIELDS[message[0]])
            message[index] = self.rng.choice(_BAD_VALUES[_FIELD_NAMES[(message[0], index)]])
        elif message[0] == PUSH_PULL and message[2]:
            record = self.rng.choice(message[2])
            index = self.rng.choice(_RECORD_NUMERIC_FIELDS)
            record[index] = self.rng.choice(_BAD_VALUES[_FIELD_NAMES[("record", index)]])
        else:  # a reply without records: too many messages instead
            body[2] = messages * (wire.MAX_MESSAGES + 1)
        return channel, self._reseal(body, now)

    def wrong_type(self, now: float) -> tuple[str, bytes]:
        channel, data = self._pick()
        body = self._body(data)
        message = self.rng.choice(body[2])
        index = self.rng.randrange(1, len(message)) if len(message) > 1 else 0
        replacement = self.rng.choice([None, 1.5, "x", b"x", [], {}, True, 7])
        while type(replacement) is type(message[index]):
            replacement = self.rng.choice([None, 1.5, "x", b"x", [], {}, True, 7])
        message[index] = replacement
        return channel, self._reseal(body, now)

    def stale(self, now: float) -> tuple[str, bytes]:
        channel, data = self._pick()
        return channel, self._reseal(self._body(data), now - GossipConfig().freshness_window - 1)

    def future(self, now: float) -> tuple[str, bytes]:
        channel, data = self._pick()
        return channel, self._reseal(self._body(data), now + GossipConfig().freshness_window + 1)

    def forged(self, now: float) -> tuple[str, bytes]:
        """Phantom members and accusations, as an outsider without the secret would send them."""
        phantom = f"10.66.{self.rng.randrange(256)}.{self.rng.randrange(256)}:7946/{self.rng.getrandbits(32):08x}"
        message = self.rng.choice([
            [ALIVE, phantom, self.rng.randrange(10), "10.66.0.1", 7946, b"ph=joining"],
            [SUSPECT, member_id(self.rng.randrange(GROUP)), 2**64 - 1, phantom],
            [DEAD, member_id(self.rng.randrange(GROUP)), self.rng.randrange(100), phantom],
        ])
        sealer = self.outsider if self.rng.random() < 0.5 else wire.Sealer("ftcomm", phantom, None, 1 << 24)
        return "datagram", sealer.seal([wire.encode(message)], now=now)


def feed(secret: bytes | None, count: int, seed: int) -> tuple[Protocol, Counter, Counter, int]:
    captured = capture_real_traffic(secret)
    fuzzer = Fuzzer(captured, secret, seed)
    records = [[member_id(i), *address(i), 0, wire.STATE_ALIVE, b""] for i in range(GROUP)]
    target = Protocol(member_id(TARGET), *address(TARGET), secret=secret, seed=seed)
    target.wall_offset = EPOCH
    target.bootstrap(records, 0.0)
    target.start(0.0)
    fed, channels = Counter(), Counter()
    start = captured[-1][0] + 1.0
    for i in range(count):
        now = start + i * 1e-4
        kind, channel, data = fuzzer.next(now + EPOCH)
        fed[kind] += 1
        channels[channel] += 1
        if channel == "datagram":
            target.receive(data, address(3), now)
        elif channel == "stream":
            target.handle_stream(data, now)
        else:
            target.handle_stream_reply(data, now)
        if i % 500 == 0:
            target.tick(now)
            target.take_datagrams()
            target.take_stream_requests()
            target.take_events()
    return target, fed, channels, len({data for _, _, data in captured})


def check_accounting(target: Protocol, fed: Counter) -> Counter:
    stats = target.stats
    drops = Counter({key.split(".", 1)[1]: value for key, value in stats.items() if key.startswith("dropped.")})
    accepted = stats["datagrams_received"] + stats["streams_received"] + stats["stream_replies_received"]
    assert sum(fed.values()) == accepted + stats["dropped"], "a packet was neither acted on nor counted"
    assert stats["dropped"] == sum(drops.values()), "a drop without a reason"
    assert drops["out_of_range"] == fed["out_of_range"]
    assert drops["stale"] >= fed["stale"] and drops["future"] == fed["future"]
    return drops


@pytest.mark.timeout(180)
def test_a_hundred_thousand_bad_packets_with_a_secret():
    started = time.perf_counter()
    target, fed, channels, distinct_real = feed(SECRET, 100_000, seed=1)
    drops = check_accounting(target, fed)
    stats = target.stats
    accepted = sum(fed.values()) - stats["dropped"]
    assert accepted <= distinct_real, "something other than a first copy of a real packet was acted on"
    assert drops["replayed"] >= fed["replay"] - distinct_real
    assert drops["bad_hmac"] > 0 and drops["malformed"] == fed["wrong_type"]
    assert {m.id for m in target.members()} <= {member_id(i) for i in range(GROUP)}, "a phantom member"
    assert target.incarnation < 10
    print(f"\nfed {sum(fed.values())} packets in {time.perf_counter() - started:.1f} s "
          f"({dict(channels)}): {dict(fed)}\naccepted {accepted}; dropped {stats['dropped']}: {drops}")


@pytest.mark.timeout(120)
def test_corrupted_and_out_of_range_packets_without_a_secret():
    target, fed, _, distinct_real = feed(None, 25_000, seed=2)
    drops = check_accounting(target, fed)
    accepted = sum(fed.values()) - target.stats["dropped"]
    assert accepted <= fed["replay"], "a damaged packet was acted on"
    assert drops["bad_checksum"] > 0 and drops["malformed"] == fed["wrong_type"]
    assert {m.id for m in target.members()} <= {member_id(i) for i in range(GROUP)}


# ---------------------------------------------------------------- a live member under fire
class Attacker:
    """Bad datagrams and frames for a live member ``a`` of a group holding ``secret``.

    ``outsider`` packets are what anyone on the network can send (noise, forgeries
    without the secret or with a wrong one, damaged or stale copies of sealed packets);
    ``insider`` packets are sealed with the secret but out of range or ill-typed.
    """

    def __init__(self, a_id: str, b_id: str, secret: bytes, seed: int) -> None:
        self.rng = random.Random(seed)
        self.a_id, self.b_id = a_id, b_id
        self.insider = wire.Sealer("ftcomm", "10.66.0.9:7946/0badc0de", secret, 1 << 24)
        self.wrong = wire.Sealer("ftcomm", "10.66.0.9:7946/0badc0de", b"guessed", 1 << 24)
        self.open = wire.Sealer("ftcomm", "10.66.0.9:7946/0badc0de", None, 1 << 24)
        self.window = GossipConfig().freshness_window

    def phantom(self) -> str:
        return f"10.66.{self.rng.randrange(256)}.{self.rng.randrange(256)}:7946/{self.rng.getrandbits(32):08x}"

    def news(self) -> list:
        """A message that would change membership if it were believed."""
        victim = self.rng.choice((self.a_id, self.b_id))
        return self.rng.choice([
            [ALIVE, self.phantom(), self.rng.randrange(5), "10.66.0.1", 7946, b"ph=joining"],
            [SUSPECT, victim, self.rng.randrange(50), self.phantom()],
            [DEAD, victim, self.rng.randrange(50), victim],
            [ALIVE, victim, 1000, "10.66.0.1", 7946, b"stolen"],
        ])

    def out_of_range(self) -> list:
        return self.rng.choice([
            [SUSPECT, self.a_id, 2**64 - 1, self.phantom()],
            [DEAD, self.b_id, wire.MAX_INCARNATION + 1, self.b_id],
            [ALIVE, self.phantom(), -1, "10.66.0.1", 7946, b""],
            [PING, wire.MAX_SEQ + 1, self.a_id],
            [PING_REQ, 1, self.b_id, "10.66.0.1", 70000],
        ])

    def datagram(self) -> bytes:
        now, roll = time.time(), self.rng.random()
        if roll < 0.15:
            return self.rng.randbytes(self.rng.randint(0, 1400))
        if roll < 0.35:
            return self.open.seal([wire.encode(self.news())], now=now)
        if roll < 0.50:
            return self.wrong.seal([wire.encode(self.news())], now=now)
        if roll < 0.65:  # a sealed packet damaged on the way
            damaged = bytearray(self.insider.seal([wire.encode(self.news())], now=now))
            damaged[self.rng.randrange(len(damaged))] ^= 1 << self.rng.randrange(8)
            return bytes(damaged)
        if roll < 0.80:  # captured long ago, or stamped by a clock far ahead
            skew = (self.window + 5) * self.rng.choice((-4, -1, 1))
            return self.insider.seal([wire.encode(self.news())], now=now + skew)
        return self.insider.seal([wire.encode(self.out_of_range())], now=now)

    def frame(self) -> bytes:
        now, roll = time.time(), self.rng.random()
        records = [[self.phantom(), "10.66.0.1", 7946, 1, wire.STATE_ALIVE, b""]]
        if roll < 0.3:
            return self.rng.randbytes(self.rng.randint(0, 3000))
        if roll < 0.5:
            return self.open.seal([wire.encode([wire.PUSH_PULL, True, records])], now=now)
        if roll < 0.7:
            return self.insider.seal([wire.encode([wire.PUSH_PULL, True, records])], now=now - 4 * self.window)
        records[0][3] = 2**64 - 1
        return self.insider.seal([wire.encode([wire.PUSH_PULL, False, records])], now=now)


def _dropped(agent) -> int:
    return agent.request(cmd="stats")["stats"].get("dropped", 0)


@pytest.mark.timeout(150)
def test_a_live_member_keeps_serving_through_ten_thousand_bad_datagrams_and_frames():
    secret = "fuzz-live"
    with LocalCluster(2, args=["--secret", secret]) as cluster:
        a, b = cluster.agents
        group = {a.id, b.id}
        wait_until(lambda: {m["id"] for m in b.request(cmd="members")["members"] if m["confirmed"]} == group, 10,
                   "the two members to confirm each other")
        marks = (len(a.snapshot()), len(b.snapshot()))
        attacker = Attacker(a.id, b.id, secret.encode(), seed=7)
        host, port = a.address.rsplit(":", 1)
        target = (host, int(port))
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{a.address}")
        bad = 0
        try:
            for batch in range(200):
                for _ in range(50):  # small batches: a full receive buffer would drop them uncounted
                    sock.sendto(attacker.datagram(), target)
                for _ in range(2):
                    dealer.send(attacker.frame())
                bad += 52
                wait_until(lambda: _dropped(a) >= bad, 20, f"{bad} drops to be counted")
                if batch % 50 == 49:  # it still answers requests mid-attack
                    assert {m.id for m in query_members(a.address, secret=secret)} == group
            assert bad <= _dropped(a) <= bad + 10  # each counted once (a stray copy from b at most)
            for _ in range(3):  # raw bytes on the TCP port: zmq refuses them or reads them as requests
                with socket.create_connection(target, timeout=2) as raw:
                    raw.sendall(attacker.rng.randbytes(4096))
        finally:
            sock.close()
            dealer.close(linger=0)
            context.term()
        members = query_members(a.address, secret=secret, timeout=5)
        assert {m.id for m in members} == group and all(m.state == "alive" for m in members)
        stats = a.request(cmd="stats")["stats"]
        drops = {k: v for k, v in stats.items() if k.startswith("dropped.")}
        assert stats["dropped"] == sum(drops.values()) and stats["dropped"] >= bad
        assert stats.get("errors", 0) == 0 and a.alive()
        for agent, mark, other in ((b, marks[1], a.id), (a, marks[0], b.id)):
            accused = [e for e in agent.snapshot()[mark:]
                       if e["ev"] == "member" and e["member"] == other and e["kind"] in ("suspect", "dead", "left")]
            assert not accused, f"false suspicion: {accused}"
            assert {m["id"] for m in agent.request(cmd="members")["members"]} == group, "a phantom member"
        print(f"\nsent {bad} bad datagrams and frames; {a.id} dropped {stats['dropped']}: {drops}")
