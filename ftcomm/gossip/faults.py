"""Fault injection for the gossip transport: drop, delay and partition real traffic.

Part of the testing API; a node has no filter unless one is passed in. The filter is
consulted for every outbound datagram and stream request and every inbound datagram,
by peer *address*: a partition therefore also separates any later incarnation of a
member at the same address, as a network partition would. Configure the same
partition on both sides to cut both directions of inbound stream traffic too.
"""

from __future__ import annotations

import random
import threading


def _address_key(entry: str | tuple[str, int]) -> tuple[str, int]:
    """Accept ``(host, port)``, ``"host:port"`` or a member id ``"host:port/nonce"``."""
    if isinstance(entry, tuple):
        return (entry[0], int(entry[1]))
    host, _, port = entry.split("/", 1)[0].rpartition(":")
    return (host, int(port))


class FaultFilter:
    """Thread-safe settings read by the transport on every packet."""

    def __init__(self, drop_rate: float = 0.0, delay: float = 0.0, seed: int | None = None) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.drop_rate = drop_rate
        self.delay = delay
        self._sides: tuple[frozenset, frozenset] | None = None

    def partition(self, side_a, side_b) -> None:
        """Cut all traffic between two sets of members (ids, ``host:port`` or tuples)."""
        a = frozenset(_address_key(e) for e in side_a)
        b = frozenset(_address_key(e) for e in side_b)
        if a & b:
            raise ValueError("a member cannot be on both sides of a partition")
        self._sides = (a, b)

    def heal(self) -> None:
        self._sides = None

    def clear(self) -> None:
        """Remove every fault: no partition, no loss, no delay."""
        self._sides = None
        self.drop_rate = 0.0
        self.delay = 0.0

    def allows(self, local: tuple[str, int], peer: tuple[str, int]) -> bool:
        """False when the packet must be dropped (partitioned, or lost at random)."""
        sides = self._sides
        if sides is not None:
            a, b = sides
            if (local in a and peer in b) or (local in b and peer in a):
                return False
        if self.drop_rate > 0:
            with self._lock:
                return self._rng.random() >= self.drop_rate
        return True
