"""The threaded runtime in one process: joining, events, metadata, faults, clean shutdown."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from ftcomm.errors import GossipError, JoinError
from ftcomm.gossip import FaultFilter, GossipConfig, GossipNode, query_members, runtime, wire

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


def test_a_publisher_is_called_back_once_its_own_record_reads_back(nodes):
    (a,) = nodes(1)
    read_back, called = [], threading.Event()

    def applied() -> None:
        read_back.append(a.member(a.id).metadata.get("proposal"))
        called.set()
    a.set_metadata({"proposal": 8}, applied)
    assert called.wait(2) and read_back == [8]


def _udp_and_tcp_on_one_port() -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket bound to one port of 127.0.0.1 (the two a node binds): held,
    the port's TCP side cannot be taken meanwhile by another process's connection."""
    for _ in range(100):
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            tcp.bind(("127.0.0.1", udp.getsockname()[1]))
            return udp, tcp
        except OSError:
            udp.close()
            tcp.close()
    raise AssertionError("no port free for both UDP and TCP")


def test_an_explicit_port_still_held_by_an_exiting_predecessor_is_bound_once_free():
    udp, tcp = _udp_and_tcp_on_one_port()
    port = udp.getsockname()[1]

    def exit_predecessor() -> None:  # the killed process this one replaces, exiting
        udp.close()
        tcp.close()
    threading.Timer(0.3, exit_predecessor).start()
    node = GossipNode(("127.0.0.1", port), config=FAST).start()
    try:
        assert node.port == port
    finally:
        node.stop()


def test_an_explicit_port_held_for_good_is_refused_with_a_clear_error():
    held = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    held.bind(("127.0.0.1", 0))
    try:
        with pytest.raises(GossipError, match="cannot bind UDP"):
            GossipNode(("127.0.0.1", held.getsockname()[1]), config=FAST).start()
    finally:
        held.close()


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


@pytest.mark.parametrize("theirs", ["two", None])
def test_wrong_secret_members_never_join_and_are_told_so_at_once(theirs):
    a = GossipNode(config=FAST, secret="one").start()
    b = GossipNode(config=FAST.with_overrides(join_timeout=30.0, request_timeout=0.5), secret=theirs)
    try:
        started = time.monotonic()
        with pytest.raises(JoinError, match="use different secrets"):
            b.start([a.address])
        assert time.monotonic() - started < 25  # the first answer says it, not the 30 s join timeout
        assert [m.id for m in a.members()] == [a.id]
        assert a.stats()["dropped.bad_hmac" if theirs else "dropped.unauthenticated"] >= 1
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


def test_a_forged_accusation_with_an_overflowing_incarnation_is_dropped_and_the_member_stays(nodes):
    # Finding: SUSPECT(victim, 2**64 - 1) made the victim's refutation overflow msgpack; the
    # exception stopped its TCP server, the peers declared it dead and it never came back.
    a, b = nodes(2)
    wait_until(lambda: all(len(n.live_members()) == 2 for n in (a, b)), 5, "convergence")
    forged = wire.Sealer(a.cluster, "10.66.0.9:7946/0badc0de", None, 1400).seal(
        [wire.encode([wire.SUSPECT, a.id, 2**64 - 1, "10.66.0.9:7946/0badc0de"])], now=time.time())
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for node in (a, b):
        s.sendto(forged, (node.host, node.port))
    s.close()
    wait_until(lambda: a.stats().get("dropped.out_of_range") == b.stats().get("dropped.out_of_range") == 1, 2,
               "the forgery to be dropped")
    time.sleep(3 * FAST.probe_interval)
    assert a.incarnation() == 0 and b.member(a.id).state == "alive" and b.member(a.id).incarnation == 0
    assert {m.id for m in query_members(a.address)} == {a.id, b.id}
    assert a.stats().get("errors", 0) == 0


def test_an_exception_while_handling_a_packet_is_counted_logged_once_and_the_node_goes_on(nodes, caplog):
    a, b = nodes(2)
    wait_until(lambda: all(len(n.live_members()) == 2 for n in (a, b)), 5, "convergence")
    protocol = a._protocol
    receive, handle_stream, tick = protocol.receive, protocol.handle_stream, protocol.tick
    ticks_failed = []

    def failing_receive(data, source, now):
        if data.startswith(b"boom"):
            raise RuntimeError("a bug in datagram handling")
        return receive(data, source, now)

    def failing_handle_stream(data, now):
        if data.startswith(b"boom"):
            raise KeyError("a bug in stream handling")
        return handle_stream(data, now)

    def failing_tick(now):
        if not ticks_failed:
            ticks_failed.append(now)
            raise ZeroDivisionError("a bug in a timer")
        return tick(now)

    protocol.receive, protocol.handle_stream, protocol.tick = failing_receive, failing_handle_stream, failing_tick
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(3):
        s.sendto(b"boom", (a.host, a.port))
    s.close()
    with pytest.raises(GossipError, match="no answer"):
        _send_frame(a, b"boom")
    wait_until(lambda: a.stats().get("errors.datagram.RuntimeError") == 3, 2, "datagram errors to be counted")
    stats = a.stats()
    assert stats["errors.stream.KeyError"] == 1 and stats["errors.timer.ZeroDivisionError"] == 1
    assert stats["errors"] == 5
    logged = [r for r in caplog.records if r.name == "ftcomm.gossip.runtime" and r.levelname == "ERROR"]
    assert len(logged) == 3  # once per kind
    assert {m.id for m in query_members(a.address)} == {a.id, b.id}  # still serving
    b.set_metadata({"after": "errors"})
    wait_until(lambda: a.member(b.id).metadata.get("after") == "errors", 3, "a working member")
    probes = a.stats()["datagrams_sent"]
    wait_until(lambda: a.stats()["datagrams_sent"] > probes + 2, 3, "the timer to keep probing")


def _send_frame(node: GossipNode, frame: bytes) -> None:
    """Send one raw request to a node's TCP port; GossipError when nothing answers (as query_members)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{node.address}")
        sock.send(frame)
        if not sock.poll(500):
            raise GossipError("no answer")
    finally:
        sock.close(linger=0)
        ctx.term()


FLOOD = r"""
import os, sys, time, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.SNDHWM, 100000)
sock.connect("tcp://" + sys.argv[1])
frame, end, sent = os.urandom(164), time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    for _ in range(100):
        sock.send(frame, copy=True)
    sent += 100
print(sent, flush=True)
"""


def test_a_flood_of_unauthenticated_tcp_frames_does_not_silence_a_member():
    """An outsider with no secret sends frames with a bad HMAC on one connection as fast as
    it can. The member drops each, and its loop still answers probes between them: its peer
    never suspects it (while frames were queued, the loop used to read them back to back,
    never getting to its timers or its UDP port, and was named dead within seconds)."""
    import subprocess
    import sys

    a = GossipNode(config=FAST, secret="s").start()
    b = GossipNode(config=FAST, secret="s").start([a.address])
    suspected = []
    b.subscribe(lambda event: suspected.append(event.kind) if event.member.id == a.id else None)
    try:
        wait_until(lambda: b.member(a.id) is not None and b.member(a.id).state == "alive", 5, "b to know a")
        flood = subprocess.run([sys.executable, "-c", FLOOD, str(a.address), "6"], capture_output=True,
                               text=True, timeout=60)
        assert flood.returncode == 0, flood.stderr
        assert int(flood.stdout) > 10000  # (it did flood)
        assert sum(v for k, v in a.stats().items() if k.startswith("dropped")) > 1000, a.stats()
        assert b.member(a.id).state == "alive" and "suspect" not in suspected and "dead" not in suspected, suspected
    finally:
        b.stop()
        a.stop()


def test_a_member_whose_loop_runs_late_measures_it_even_when_packets_wait_for_it(nodes):
    """The gossip loop of member b is held 0.15 s at a time (a starved CPU) while member a
    pings it, so that a datagram waits for b each time it runs again. Before, the datagram
    was handled first and re-armed the measurement at that moment: the overdue timer then
    read as on time, and a starved member said it ran on time."""
    a, b = nodes(2)
    wait_until(lambda: len(a.members()) == 2 and len(b.members()) == 2, 10, "both members")
    for _ in range(8):
        held = threading.Event()
        b._loop.call_soon_threadsafe(lambda: (held.set(), time.sleep(0.15)))
        held.wait(5)
        a.probe_now([b.id])  # its ping waits in b's socket while b's loop is held
        time.sleep(0.25)
    assert b._protocol.lateness(time.monotonic()) > 0.05


def test_a_full_garbage_collection_is_announced_to_the_other_members_signed(nodes):
    import gc
    a, b = nodes(2, secret="k")
    wait_until(lambda: all(len(n.live_members()) == 2 for n in (a, b)), 5, "convergence")
    gc.collect(1)  # not a full collection: nothing said
    time.sleep(0.2)
    assert a.stats().get("pause_notices", 0) == b.stats().get("pause_notices", 0) == 0
    gc.collect()  # each node says so to the other, from this thread
    wait_until(lambda: a.stats().get("pause_notices", 0) >= 1 and b.stats().get("pause_notices", 0) >= 1, 5, "the notices")
    assert a.pause_notices >= 1 and b.stats().get("dropped", 0) == 0
    a.stop()
    assert a not in runtime._announcing and b in runtime._announcing
    gc.collect()  # a stopped node says nothing, and nothing fails


def test_pause_notices_are_off_with_no_grace():
    import gc
    node = GossipNode(config=GossipConfig(pause_grace=0)).start()
    try:
        assert node not in runtime._announcing
        gc.collect()
        assert node.pause_notices == 0
    finally:
        node.stop()


def test_a_forked_child_announces_no_collection_of_its_parents():
    import gc
    import os
    a, b = GossipNode(config=FAST).start(), None
    try:
        b = GossipNode(config=FAST).start([a.address])
        wait_until(lambda: len(a.live_members()) == 2, 5, "convergence")
        before = a.stats().get("pause_notices", 0)
        child = os.fork()
        if child == 0:  # a data loader's worker, say: the callback came with the fork
            gc.collect()
            os._exit(0 if b.pause_notices == 0 else 1)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.3)
        assert a.stats().get("pause_notices", 0) == before
    finally:
        for node in (a, b):
            if node is not None:
                node.stop()


def test_a_wedged_gossip_loop_is_not_excused_by_a_thread_that_keeps_collecting():
    """Member x's gossip thread answers nothing (blocked, as a subscriber callback that
    blocks would block it) while another thread of its process runs a full collection
    twice a second: it announces none after its loop stopped, so the others suspect it as
    they would any silent member."""
    import gc
    config = GossipConfig(probe_interval=0.2, probe_timeout=0.08, gossip_interval=0.05, suspicion_mult=3)
    a = GossipNode(config=config).start()
    b = x = None
    release = threading.Event()
    try:
        b = GossipNode(config=config).start([a.address])
        x = GossipNode(config=config).start([a.address])
        wait_until(lambda: all(len(n.live_members()) == 3 for n in (a, b, x)), 5, "convergence")
        suspected = threading.Event()
        a.subscribe(lambda e: e.member.id == x.id and e.kind in ("suspect", "dead") and suspected.set())
        x._loop.call_soon_threadsafe(lambda: release.wait(15))
        time.sleep(0.1)
        announced = x.pause_notices
        deadline = time.monotonic() + 6
        while not suspected.is_set() and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.5)
        assert suspected.is_set(), f"x announced {x.pause_notices - announced} collections with its loop wedged"
        assert x.pause_notices - announced <= 1
    finally:
        release.set()
        for node in (a, b, x):
            if node is not None:
                node.stop()


@pytest.mark.parametrize("grace", [-1.0, float("nan"), float("inf"), 1000.0])
def test_a_pause_grace_that_could_hide_a_stopped_member_for_long_is_refused(grace):
    with pytest.raises(ValueError, match="pause_grace"):
        GossipConfig(pause_grace=grace)


def test_ctrl_c_while_a_collection_is_announced_still_interrupts_the_script(nodes):
    """A signal handler that raises while the notices go out (on the main thread, in the
    collector's callback, where an exception is dropped) raises once the collection ended."""
    import gc
    import signal

    class Interrupting(FaultFilter):
        fired = False

        def allows(self, source, target) -> bool:
            if not Interrupting.fired and threading.current_thread() is threading.main_thread():  # the notice's
                Interrupting.fired = True
                signal.raise_signal(signal.SIGINT)  # Ctrl-C, now
            return super().allows(source, target)
    a, b = nodes(2)
    wait_until(lambda: all(len(n.live_members()) == 2 for n in (a, b)), 5, "convergence")
    a.faults = Interrupting()
    time.sleep(0.3)  # a's loop ran since its last notice
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a test before may have set another)
    try:
        with pytest.raises(KeyboardInterrupt):
            gc.collect()
            for _ in range(100):  # where the script goes on
                time.sleep(0.001)
    finally:
        signal.signal(signal.SIGINT, before)
    assert Interrupting.fired
