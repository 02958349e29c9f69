"""The rendezvous store: authenticated, fresh, bounded, on the bind address only."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import pytest
import torch
import torch.distributed as dist
import zmq

from ftcomm.core.view import View
from ftcomm.errors import CommunicatorError
from ftcomm.runtime import rendezvous
from ftcomm.runtime.rendezvous import Framing, Rendezvous, StoreClient

from .polling import wait_until

pytestmark = pytest.mark.timeout(60)
SECRET = b"k" * 32


@pytest.fixture
def store():
    r = Rendezvous("127.0.0.1", 2.0, SECRET)
    yield r
    r.close()


def raw_request(port: int, frame: bytes, wait: float = 0.5) -> bytes | None:
    """Send one frame as an outsider would; the answer, or None."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(frame)
        return sock.recv() if sock.poll(wait * 1000) else None
    finally:
        sock.close()


def contents(r: Rendezvous, key: str) -> bytes | None:
    client = StoreClient("127.0.0.1", r.port, SECRET, 1.0)
    try:
        return client.get(key) if client.check([key]) else None
    finally:
        client.close()


def test_gloo_forms_through_the_store_and_proposals_round_trip(store):
    store.publish_proposal(3, "ab", ("a:1/x", "b:2/y"))
    assert store.fetch_proposal("127.0.0.1", store.port, 3, "ab") == ("a:1/x", "b:2/y")
    assert store.fetch_proposal("127.0.0.1", store.port, 4, "ab") is None
    out = {}

    def rank(i: int) -> None:
        group = dist.ProcessGroupGloo(store.view_store(View(1, ("a", "b")), "127.0.0.1", store.port), i, 2,
                                      datetime.timedelta(seconds=20))
        t = torch.full((2,), float(i + 1))
        group.allreduce([t]).wait()
        out[i] = t.tolist()
    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: [3.0, 3.0], 1: [3.0, 3.0]}


def test_a_proposal_read_from_a_worker_that_died_since_gives_up_after_its_own_bound():
    """The reader keeps its connection; the owner's death closes nothing it would notice,
    so the read waits for its bound, not the store timeout (a joiner's driver once sat out
    a whole agreement on such a read). The store timeout here outlasts the test's own
    limit: the read returning at all shows its bound held."""
    reader, owner = Rendezvous("127.0.0.1", 300.0, SECRET), Rendezvous("127.0.0.1", 300.0, SECRET)
    try:
        owner.publish_proposal(7, "ab", ("a", "b"))
        port = owner.port
        assert reader.fetch_proposal("127.0.0.1", port, 7, "ab", timeout=0.2) == ("a", "b")
        owner.close()
        assert reader.fetch_proposal("127.0.0.1", port, 7, "ab", timeout=0.2) is None
        assert reader.fetch_proposal("127.0.0.1", port, 7, "ab", timeout=0.2) is None  # a new connection: refused
    finally:
        reader.close()
        owner.close()


def test_a_member_id_names_its_gossip_address_or_nothing():
    from ftcomm.runtime.driver import member_address

    assert member_address("10.1.2.3:7946/ab12cd34") == ("10.1.2.3", 7946)
    for forged in ("127.0.0.1:99999/x", "127.0.0.1:\u00b2/x", "a\x00b:7946/x", "[::1]:7946/x", "host:7946/x",
                   "127.0.0.1:0/x", "no-port/x", ""):
        assert member_address(forged) is None, forged
    assert rendezvous.refused("127.0.0.1", 99999) is False  # not an address: nothing refused, nothing raised


def test_it_listens_on_the_bind_address_only(store):
    endpoint = store._server._socket.getsockopt_string(zmq.LAST_ENDPOINT)
    assert endpoint == f"tcp://127.0.0.1:{store.port}"


def test_an_outsider_without_the_secret_can_neither_read_nor_write(store):
    store.publish_proposal(1, "d", ("a",))
    for secret in (None, b"wrong"):
        frame, _ = Framing(secret).seal(msgpack.packb(["set", "proposal/1/d", b"evil"]))
        assert raw_request(store.port, frame) is None  # no answer: not even an error to learn from
        frame, _ = Framing(secret).seal(msgpack.packb(["get", "proposal/1/d", 0]))
        assert raw_request(store.port, frame) is None
    assert contents(store, "proposal/1/d") == b"a"
    assert sum(store.drops.values()) == 4 and store.drops["bad_hmac"] == 2
    with pytest.raises(CommunicatorError, match="another secret"):
        StoreClient("127.0.0.1", store.port, b"wrong", 0.3).get("proposal/1/d")


def test_a_captured_request_cannot_be_replayed(store):
    frame, _ = Framing(SECRET).seal(msgpack.packb(["set", "k", b"first"]))
    assert raw_request(store.port, frame) is not None
    StoreClient("127.0.0.1", store.port, SECRET, 1.0).set("k", b"second")
    assert raw_request(store.port, frame) is None  # the same frame again: dropped
    assert contents(store, "k") == b"second" and store.drops["replayed"] == 1


def test_a_stale_request_is_dropped(store, monkeypatch):
    real = time.time
    monkeypatch.setattr(rendezvous.time, "time", lambda: real() - rendezvous.FRESHNESS_S - 5)
    frame, _ = Framing(SECRET).seal(msgpack.packb(["set", "k", b"old"]))
    monkeypatch.setattr(rendezvous.time, "time", real)
    assert raw_request(store.port, frame) is None
    assert store.drops["stale"] == 1 and contents(store, "k") is None


def test_a_reply_is_bound_to_its_request():
    framing = Framing(SECRET)
    _, nonce = framing.seal(b"request")
    reply, _ = framing.seal(msgpack.packb([True, b"v"]), answers=nonce)
    framing.open(reply, answers=nonce)
    with pytest.raises(rendezvous.FrameError):
        framing.open(reply, answers=b"\0" * 16)  # an answer to another request


@pytest.mark.parametrize("body", [
    b"\xc1", msgpack.packb("set"), msgpack.packb(["set", "k"]), msgpack.packb(["set", "", b"v"]),
    msgpack.packb(["set", "k" * 5000, b"v"]), msgpack.packb(["get", "k", -1]), msgpack.packb(["nope"]),
    msgpack.packb(["add", "k", 1 << 63]), msgpack.packb(["wait", [], 10]), msgpack.packb(["check", [1]]),
])
def test_malformed_requests_are_dropped_and_the_store_keeps_serving(store, body):
    frame, _ = Framing(SECRET).seal(body)
    assert raw_request(store.port, frame, wait=0.2) is None
    assert store.drops["malformed"] == 1
    assert contents(store, "absent") is None  # still answering


def test_garbage_frames_are_counted_not_raised(store):
    for frame in (b"", b"FZ", b"x" * 100, bytes(60)):
        assert raw_request(store.port, frame, wait=0.1) is None
    assert sum(store.drops.values()) == 4
    assert contents(store, "absent") is None


def test_the_store_is_bounded(store, monkeypatch):
    monkeypatch.setattr(rendezvous, "MAX_KEYS", 3)
    client = StoreClient("127.0.0.1", store.port, SECRET, 1.0)
    for i in range(3):
        client.set(f"k{i}", b"v")
    with pytest.raises(CommunicatorError, match="full"):
        client.set("k3", b"v")
    client.set("k0", b"replaced")  # an existing key may still change


def test_one_client_cannot_jam_the_waiting_requests_of_the_others(store, monkeypatch):
    """A client may hold a few waiting requests; when every slot is taken, a newcomer's wait
    evicts the oldest one of the client holding the most (a group without a secret is open
    to every local user, who could otherwise hold every slot and stall formations)."""
    monkeypatch.setattr(rendezvous, "MAX_WAITERS", 6)
    monkeypatch.setattr(rendezvous, "MAX_WAITERS_PER_CLIENT", 4)
    context = zmq.Context.instance()
    flooders = []
    for count in (5, 2):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{store.port}")
        for i in range(count):
            sock.send(Framing(SECRET).seal(msgpack.packb(["wait", [f"never{i}"], 60_000]))[0])
        flooders.append(sock)
    try:
        first = flooders[0]
        assert first.poll(2000), "the fifth wait of one client was not refused"
        assert store.drops["waiter_quota"] == 1
        done = []
        waiter = threading.Thread(target=lambda: done.append(
            StoreClient("127.0.0.1", store.port, SECRET, 5.0).wait(["k"], datetime.timedelta(seconds=5))))
        waiter.start()
        wait_until_evicted = time.monotonic() + 5
        while store.drops["waiter_evicted"] < 1 and time.monotonic() < wait_until_evicted:
            time.sleep(0.01)
        assert store.drops["waiter_evicted"] == 1  # the oldest of the client holding the most
        StoreClient("127.0.0.1", store.port, SECRET, 1.0).set("k", b"v")
        waiter.join(5)
        assert done == [None]  # the newcomer's wait was held and answered
    finally:
        for sock in flooders:
            sock.close()


def test_the_waiting_requests_of_a_client_that_disconnects_are_dropped(store):
    """A client that leaves (a process that died, a formation given up on) no longer holds
    slots: its waits are dropped when its connection closes, not at their expiry."""
    context = zmq.Context.instance()
    leaving, staying = (context.socket(zmq.DEALER) for _ in range(2))
    for sock, count in ((leaving, 200), (staying, 3)):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{store.port}")
        for i in range(count):
            sock.send(Framing(SECRET).seal(msgpack.packb(["wait", [f"never{i}"], 600_000]))[0])
    try:
        wait_until(lambda: len(store._server._waiters) == 203, 5, "the waits to be held")
        leaving.close()
        wait_until(lambda: len(store._server._waiters) == 3, 5, "the leaving client's waits to be dropped")
        assert store.drops["waiter_client_gone"] == 200
        StoreClient("127.0.0.1", store.port, SECRET, 1.0).set("never0", b"v")
        assert staying.poll(2000), "the staying client's wait was not answered"
    finally:
        staying.close()


@pytest.mark.timeout(10)
def test_a_wait_is_held_at_most_max_held_ms(store, monkeypatch):
    monkeypatch.setattr(rendezvous, "MAX_HELD_MS", 200)
    client = StoreClient("127.0.0.1", store.port, SECRET, 30.0)
    started = time.monotonic()
    with pytest.raises(CommunicatorError, match="timeout"):
        client.wait(["never"], datetime.timedelta(seconds=30))
    assert time.monotonic() - started < 20  # answered by the store's bound, not the client's 30 s


def test_a_wait_is_answered_when_the_key_appears_and_times_out_otherwise(store):
    client = StoreClient("127.0.0.1", store.port, SECRET, 0.3)
    threading.Timer(0.1, lambda: StoreClient("127.0.0.1", store.port, SECRET, 1.0).set("late", b"x")).start()
    assert client.get("late") == b"x"
    with pytest.raises(CommunicatorError, match="timeout"):
        client.wait(["never"], datetime.timedelta(seconds=0.2))


@pytest.mark.timeout(10)
def test_a_wait_longer_than_the_store_allows_is_still_answered(store):
    """Before: a wait over an hour (formation_timeout=7200) was dropped as malformed, unanswered."""
    client = StoreClient("127.0.0.1", store.port, SECRET, 1.0)
    client.set("k", b"v")
    client.wait(["k"], datetime.timedelta(hours=2))
    assert StoreClient("127.0.0.1", store.port, SECRET, 7200.0).get("k") == b"v"
    assert store.drops["malformed"] == 0


def test_adding_to_a_value_that_is_not_a_number_is_answered_with_an_error(store):
    """Before: the server raised, logged a traceback per request and left the client to time out."""
    client = StoreClient("127.0.0.1", store.port, SECRET, 5.0)
    client.set("k", b"not a number")
    with pytest.raises(CommunicatorError, match="not an integer"):  # an answer, not "no authenticated answer"
        client.add("k", 1)
    assert store.drops["error"] == 0


def test_a_port_closed_moments_after_a_broken_connection_still_reads_as_refused():
    """A killed process closes its sockets one by one: a peer whose connection to it was
    reset may find its gossip port still accepting for a few milliseconds."""
    import socket
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        assert not rendezvous.refused("127.0.0.1", port, 0.5)  # open: alive
        threading.Timer(0.03, listener.close).start()
        assert rendezvous.refused("127.0.0.1", port, 0.5, settle=2.0)
    finally:
        listener.close()


def test_cancel_ends_a_blocked_read_at_once_and_every_later_request(store):
    client = StoreClient("127.0.0.1", store.port, SECRET, 60.0)
    failures: list[str] = []

    def read() -> None:
        try:
            client.get("never-set")
        except CommunicatorError as exc:
            failures.append(str(exc))
    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.2)
    client.cancel("given up")
    reader.join(20)  # the read alone would block for two minutes
    assert not reader.is_alive()
    assert failures and "cancelled: given up" in failures[0]
    with pytest.raises(CommunicatorError, match="cancelled"):
        client.check(["a"])
    client.close()


ABANDONED_FORMATION = """
import sys, threading, time
from ftcomm.backends.base import AbortSignal
from ftcomm.backends.gloo import GlooCommunicator
from ftcomm.core.view import View
from ftcomm.errors import CollectiveAborted
from ftcomm.runtime.rendezvous import Rendezvous

r = Rendezvous("127.0.0.1", 60.0, b"k" * 32)
abort = AbortSignal()
threading.Timer(0.3, abort.fire, args=("a newer view",)).start()
try:  # rank 0 of 2: rank 1 never comes, so the builder blocks on the store
    GlooCommunicator.form(r.view_store(View(1, ("a", "b")), "127.0.0.1", r.port), 0, 2, 1, abort, 60.0,
                          host="127.0.0.1")
except CollectiveAborted:
    pass
else:
    sys.exit("formed a group of two alone")
builders = [t for t in threading.enumerate() if t.name.startswith("ftcomm-gloo-form")]
deadline = time.monotonic() + 20
while any(t.is_alive() for t in builders) and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(3 if any(t.is_alive() for t in builders) else 0)
"""


def test_an_abandoned_formation_stops_its_builder_and_the_process_exits_cleanly():
    """A Gloo builder blocked on the store of a formation that was given up on ends at
    once; a process exiting with such a builder alive would die with SIGABRT."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", ABANDONED_FORMATION], capture_output=True, text=True, timeout=55)
    assert done.returncode == 0, done.stderr[-2000:]


def test_abandoned_formations_leave_no_sockets_or_threads_behind():
    """Every formation given up on used to leave its store connection and a Gloo device
    (a listener, a thread, descriptors) behind: a long job ran out of descriptors."""
    from ftcomm.backends.base import AbortSignal
    from ftcomm.backends.gloo import GlooCommunicator
    from ftcomm.errors import CollectiveAborted

    r = Rendezvous("127.0.0.1", 30.0, SECRET)

    def abandon(view_id: int) -> None:
        abort = AbortSignal()
        timer = threading.Timer(0.05, abort.fire, args=("a newer view",))
        timer.start()
        with pytest.raises(CollectiveAborted):
            GlooCommunicator.form(r.view_store(View(view_id, ("a", "b")), "127.0.0.1", r.port), 0, 2, view_id,
                                  abort, 30.0, host="127.0.0.1")
        timer.join()

    def settled() -> tuple[int, int]:
        deadline = time.monotonic() + 10
        while any(t.name.startswith("ftcomm-gloo-form") for t in threading.enumerate()) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        return len(os.listdir("/proc/self/fd")), threading.active_count()
    try:
        abandon(1)  # the first one creates the shared device
        fds, threads = settled()
        for view_id in range(2, 22):
            abandon(view_id)
        more_fds, more_threads = settled()
        assert more_fds - fds <= 8 and more_threads - threads <= 2, (fds, more_fds, threads, more_threads)
    finally:
        r.close()


def test_probes_run_from_an_exit_hook_still_answer():
    """A worker leaving from its exit hook probes its peers while the interpreter shuts
    down, when no thread pool takes new work: the probes run one by one instead."""
    code = textwrap.dedent("""
        import atexit, socket
        from ftcomm.runtime.rendezvous import refused_many
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nothing listens there: refused
        atexit.register(lambda: print("probed", refused_many([("127.0.0.1", port)] * 2)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "probed [True, True]" in out.stdout, out.stderr
