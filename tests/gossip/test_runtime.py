"""The threaded runtime in one process: joining, events, metadata, faults, clean shutdown."""

from __future__ import annotations

import socket
import threading

import pytest

from ftcomm.errors import GossipError, JoinError
from ftcomm.gossip import FaultFilter, GossipConfig, GossipNode

from ..polling import wait_until

FAST = GossipConfig(probe_interval=0.2, probe_timeout=0.08, gossip_interval=0.05, suspicion_mult=3)


@pytest.fixture
def nodes():
    started: list[GossipNode] = []

    def make(n: int, **kwargs) -> list[GossipNode]:
        first = GossipNode(config=FAST, **kwargs).start()
        started.append(first)
        for _ in range(n - 1):
            started.append(GossipNode(config=FAST, **kwargs).start([first.address]))
        return started[-n:]
    yield make
    for node in started:
        node.stop()


def test_join_events_metadata_and_leave(nodes):
    a, b, c = nodes(3, secret="k")
    wait_until(lambda: all(len(n.live_members()) == 3 for n in (a, b, c)), 5, "convergence")
    seen = []
    a.subscribe(seen.append)
    c.set_metadata({"step": 12, "status": "active"})
    wait_until(lambda: a.member(c.id).metadata.get("step") == 12, 3, "metadata")
    b.leave()
    wait_until(lambda: a.member(b.id).state == "left", 2, "left")
    kinds = [(e.kind, e.member.id) for e in seen]
    assert ("metadata", c.id) in kinds and ("left", b.id) in kinds and ("dead", b.id) not in kinds


def test_own_metadata_change_shows_in_own_snapshot(nodes):
    (a,) = nodes(1)
    a.set_metadata({"proposal": 7})
    wait_until(lambda: a.member(a.id).metadata.get("proposal") == 7, 2, "own metadata in own snapshot")
    assert a.member(a.id).incarnation == 1


def test_oversized_metadata_is_refused_with_a_clear_error(nodes):
    (a,) = nodes(1)
    with pytest.raises(ValueError, match="max_metadata_bytes"):
        a.set_metadata({"blob": "x" * 1000})


def test_join_with_no_live_seed_fails_clearly_and_cleans_up():
    before = threading.active_count()
    node = GossipNode(config=FAST.with_overrides(join_timeout=0.5, request_timeout=0.2))
    with pytest.raises(JoinError, match="no seed answered"):
        node.start(["127.0.0.1:9"])
    assert threading.active_count() == before


def test_wrong_secret_members_never_join():
    a = GossipNode(config=FAST, secret="one").start()
    b = GossipNode(config=FAST.with_overrides(join_timeout=0.6, request_timeout=0.2), secret="two")
    try:
        with pytest.raises(JoinError):
            b.start([a.address])
        assert [m.id for m in a.members()] == [a.id]
        assert a.stats()["dropped.bad_hmac"] >= 1
    finally:
        a.stop()


def test_fault_filter_partition_and_heal(nodes):
    filters = [FaultFilter() for _ in range(4)]
    first = GossipNode(config=FAST, fault_filter=filters[0]).start()
    others = [GossipNode(config=FAST, fault_filter=f).start([first.address]) for f in filters[1:]]
    group = [first] + others
    try:
        wait_until(lambda: all(len(n.live_members()) == 4 for n in group), 5, "convergence")
        side_a, side_b = [n.address for n in group[:2]], [n.address for n in group[2:]]
        for f in filters:
            f.partition(side_a, side_b)
        wait_until(lambda: all(len(n.live_members()) == 2 for n in group), 15, "each side to drop the other")
        for f in filters:
            f.heal()
        wait_until(lambda: all(len(n.live_members()) == 4 for n in group), 15, "the partition to heal")
    finally:
        for n in group:
            n.stop()


def test_stop_leaves_no_thread_and_frees_the_ports():
    before = threading.active_count()
    node = GossipNode(config=FAST).start()
    host, port = node.host, node.port
    node.stop()
    node.stop()  # idempotent
    assert threading.active_count() == before
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        s = socket.socket(socket.AF_INET, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.close()
    with pytest.raises(GossipError, match="not running"):
        node.set_metadata({})


def test_garbage_on_the_udp_port_is_counted_and_harmless(nodes):
    a, b = nodes(2)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for payload in (b"", b"\x01", b"\xff" * 1500, b"\x01\x00\x93"):
        s.sendto(payload, (a.host, a.port))
    s.close()
    wait_until(lambda: a.stats().get("dropped", 0) >= 3, 2, "drops to be counted")
    b.set_metadata({"after": "garbage"})
    wait_until(lambda: a.member(b.id).metadata.get("after") == "garbage", 3, "a working member")
