"""A tiny instant-delivery network of protocol cores on a virtual clock, for behaviour tests."""

from __future__ import annotations

from ftcomm.gossip import wire
from ftcomm.gossip.config import GossipConfig
from ftcomm.gossip.protocol import Protocol

PORT = 7946


def member_id(i: int) -> str:
    return f"10.0.0.{i}:{PORT}/{i:08x}"


def address(i: int) -> tuple[str, int]:
    return (f"10.0.0.{i}", PORT)


def decode(data: bytes, cluster: str = "ftcomm") -> list[list]:
    """The messages inside a datagram (no secret)."""
    return wire.Sealer(cluster, "test", None, 1 << 20).open(data, now=0.0)[1]


def packet(*messages: list, sender: str = member_id(99), cluster: str = "ftcomm", secret: bytes | None = None,
           now: float = 0.0) -> bytes:
    """A sealed datagram holding ``messages``, as another member would send it at ``now``."""
    return wire.Sealer(cluster, sender, secret, 1400).seal([wire.encode(m) for m in messages], now=now)


def lone_node(n_peers: int, config: GossipConfig | None = None, seed: int = 1) -> Protocol:
    """Member 0 that knows members 1..n_peers (which never answer unless a test answers)."""
    node = Protocol(member_id(0), *address(0), config=config, seed=seed)
    node.bootstrap([[member_id(i), *address(i), 0, wire.STATE_ALIVE, b""] for i in range(1, n_peers + 1)], 0.0)
    node.start(0.0)
    return node


class MiniNet:
    """``n`` bootstrapped members; the clock advances in fixed steps and delivery is instant.

    ``blocked`` holds (src, dst) index pairs whose datagrams are dropped; ``down`` holds
    crashed members. ``trace`` records (time, src, dst, message types) of delivered datagrams
    (without a secret); ``captured`` every delivered packet as (time, "datagram" or
    "stream" or "reply", bytes).
    """

    def __init__(self, n: int, config: GossipConfig | None = None, seed: int = 0,
                 secret: bytes | None = None) -> None:
        self.config = config or GossipConfig()
        self.secret = secret
        self.nodes = [Protocol(member_id(i), *address(i), config=self.config, seed=seed + i, secret=secret)
                      for i in range(n)]
        records = [node.record() for node in self.nodes]
        for node in self.nodes:
            node.bootstrap(records, 0.0)
            node.start(0.0)
        self.now = 0.0
        self.blocked: set[tuple[int, int]] = set()
        self.down: set[int] = set()
        self.events: list[list] = [[] for _ in range(n)]
        self.trace: list[tuple[float, int, int, list[int]]] = []
        self.captured: list[tuple[float, str, bytes]] = []
        self._index = {address(i): i for i in range(n)}

    def run(self, seconds: float, step: float = 0.005) -> None:
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now = round(self.now + step, 6)
            for i, node in enumerate(self.nodes):
                if i not in self.down:
                    node.tick(self.now)
            self._deliver()

    def _deliver(self) -> None:
        moved = True
        while moved:
            moved = False
            for i, node in enumerate(self.nodes):
                for d in node.take_datagrams():
                    moved = True
                    j = self._index.get(d.address)
                    if j is None or j in self.down or i in self.down or (i, j) in self.blocked:
                        continue
                    if self.secret is None:
                        self.trace.append((self.now, i, j, [m[0] for m in decode(d.data)]))
                    self.captured.append((self.now, "datagram", d.data))
                    self.nodes[j].receive(d.data, address(i), self.now)
                for request in node.take_stream_requests():
                    moved = True
                    j = self._index.get(request.address)
                    if j is None or j in self.down or i in self.down or (i, j) in self.blocked:
                        continue
                    reply = self.nodes[j].handle_stream(request.data, self.now)
                    self.captured += [(self.now, "stream", request.data), (self.now, "reply", reply)]
                    node.handle_stream_reply(reply, self.now, request.address)
                self.events[i].extend(node.take_events())

    def kinds(self, observer: int, about: int) -> list[str]:
        return [e.kind for e in self.events[observer] if e.member.id == member_id(about)]

    def first(self, observer: int, about: int, kind: str):
        for e in self.events[observer]:
            if e.member.id == member_id(about) and e.kind == kind:
                return e
        return None
