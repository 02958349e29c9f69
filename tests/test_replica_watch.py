"""The replica watch (ftcomm.training.replica_watch): when it tears a sharded replica's
collectives down, and that a torn-down connection wakes a thread waiting on it."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

from ftcomm.backends import admission
from ftcomm.localproc import stat_fields
from ftcomm.training import replica_watch
from ftcomm.training.replica_watch import ReplicaWatch
from tests.conftest import free_port
from tests.polling import wait_until


@dataclasses.dataclass
class Member:
    id: str
    state: str
    metadata: dict


class Node:
    """The gossip node as the watch reads it: its table, and the urgent probes it is asked for."""

    def __init__(self, **partners: str) -> None:
        self.id = "a0"
        self.states = {"a0": "alive", "b0": "alive", "b1": "alive", **partners}
        self.probed: list[list[str]] = []

    def snapshot(self) -> tuple[Member, ...]:
        replica = {"a0": ["A", 0, 2], "b0": ["B", 0, 2], "b1": ["B", 1, 2]}
        return tuple(Member(m, state, {"rp": replica.get(m, ["A", 1, 2])}) for m, state in self.states.items())

    def probe_now(self, members: list[str]) -> None:
        self.probed.append(members)


class Replica:
    """Process A's shard 0; its partner's state as this host's /proc shows it (None: the
    partner runs on another host)."""
    key, shard_rank = "A", 0

    def __init__(self, partner: str | None) -> None:
        self.partner = partner

    def process_state(self, shard: int) -> str | None:
        assert shard == 1
        return self.partner


def watch(node: Node, steps: list[int], in_view: bool | list = True, partner: str | None = "S") -> ReplicaWatch:
    view = in_view if isinstance(in_view, list) else [in_view]  # True: in view 1; False: in none; or an id
    return ReplicaWatch(Replica(partner), node, lambda: steps[0],
                        lambda: None if view[0] is False else 1 if view[0] is True else view[0],
                        probe_interval=0.5, clock=lambda: 0.0)


def stall_until_reason(w: ReplicaWatch, t: float, limit: float) -> tuple[float, str | None]:
    """Look every 0.05 s from ``t`` until the watch gives a reason (or ``limit``)."""
    while (why := w.look(t)) is None and t < limit:
        t += 0.05
    return t, why


def train(w: ReplicaWatch, steps: list[int], until: float, every: float = 0.1, look: float = 0.05) -> float:
    """Commit a step each ``every`` seconds up to ``until``, the watch looking each ``look``."""
    t = 0.0
    while t < until:
        if t // every > (t - look) // every:
            steps[0] += 1
        assert w.look(t) is None
        t += look
    return t


def test_a_partner_that_died_tears_the_replica_down_at_once_and_one_that_left_does_not():
    node, steps = Node(a1="alive"), [0]
    w = watch(node, steps)
    assert w.look(0.0) is None
    node.states["a1"] = "dead"
    assert w.look(0.05) == "a1, a process of this replica, died"
    node, steps = Node(a1="alive"), [0]
    w = watch(node, steps)
    assert w.look(0.0) is None
    del node.states["a1"]  # gone from the table
    assert w.look(0.05) == "a1, a process of this replica, died"
    # A partner leaves after its last collective (the job ends, a graceful leave): this
    # process may still finish its own work; the driver raises ReplicaLost at its next look.
    node, steps = Node(a1="alive"), [0]
    w = watch(node, steps)
    node.states["a1"] = "left"
    assert w.look(0.0) is None
    del node.states["a1"]
    assert all(w.look(t / 10) is None for t in range(1, 50))


def test_a_suspected_partner_is_not_enough_while_steps_commit():
    node, steps = Node(a1="suspect"), [0]
    w = watch(node, steps)
    train(w, steps, until=5.0)
    assert node.probed == []  # nothing stalls: nothing is probed


def test_a_stalled_step_probes_the_partners_and_a_partner_that_answers_is_never_a_reason():
    node, steps = Node(a1="alive", b1="suspect"), [0]  # (another replica's suspect is no partner)
    w = watch(node, steps)
    t = train(w, steps, until=2.0)  # steps of 0.1 s: a stall is 0.4 s (4 x 0.1 s)
    while t < 10.0:  # then none for 8 s, the partner answering all the while (a slow step)
        assert w.look(t) is None
        t += 0.05
    assert node.probed and all(p == ["a1"] for p in node.probed)
    assert 14 <= len(node.probed) <= 16  # at most once per probe interval, from 0.4 s into the stall


@pytest.mark.parametrize("partner, said, silent", [("T", "is stopped while", replica_watch.SILENT_S),
                                                   ("gone", "is gone while", replica_watch.SILENT_S),
                                                   (None, "has not answered for", replica_watch.SILENT_REMOTE_S)],
                         ids=["stopped-here", "gone-here", "on-another-host"])
def test_a_partner_suspected_while_the_step_stalls_is_a_reason_once_the_suspicion_held(partner, said, silent):
    """Stopped or gone on this host (as /proc shows it): after SILENT_S of suspicion; on
    another host, which this one cannot look at: after SILENT_REMOTE_S."""
    node, steps = Node(a1="alive"), [0]
    w = watch(node, steps, partner=partner)
    t = train(w, steps, until=2.0, every=0.2)  # typical step 0.2 s: a stall is 0.8 s
    stalled_from = t
    node.states["a1"] = "suspect"
    t, why = stall_until_reason(w, t, stalled_from + 10.0)
    assert why is not None and why.startswith(f"a1, a process of this replica, {said}")
    assert t - stalled_from == pytest.approx(0.8 + silent, abs=0.11)  # the stall, then the suspicion held


def test_a_partner_on_this_host_that_runs_is_no_reason_until_gossip_declares_it_dead():
    """A thread holding the GIL for seconds starves the partner's gossip too: suspected, but
    running (R), it only counts once declared dead (as the other replicas count it)."""
    node, steps = Node(a1="alive"), [0]
    w = watch(node, steps, partner="R")
    t = train(w, steps, until=2.0)
    node.states["a1"] = "suspect"
    t, why = stall_until_reason(w, t, t + 10.0)
    assert why is None
    node.states["a1"] = "dead"
    assert w.look(t) == "a1, a process of this replica, died"


def test_the_stall_counts_from_when_the_process_entered_its_view():
    """A process that held back for a minute (building its model) is not stalled on entry."""
    node, steps, in_view = Node(a1="suspect"), [0], [False]
    w = watch(node, steps, in_view=in_view, partner="S")  # (its gossip starved meanwhile: suspected, running)
    assert all(w.look(t / 10) is None for t in range(600))
    assert node.probed == []
    w.replica.partner = "T"  # stopped from when the process enters its view
    in_view[0] = True
    t, why = stall_until_reason(w, 60.0, 70.0)
    assert why is not None and t - 60.0 == pytest.approx(replica_watch.STALL_MIN_S + replica_watch.SILENT_S, abs=0.11)
    assert float(re.search(r"waited ([0-9.]+) s for a step", why).group(1)) < 1.0  # not the minute held back


def test_a_suspicion_refuted_before_it_held_starts_over():
    node, steps = Node(a1="alive"), [0]
    w = watch(node, steps, partner="T")
    t = train(w, steps, until=1.0)
    t += 1.0  # stalled
    node.states["a1"] = "suspect"
    assert w.look(t) is None
    node.states["a1"] = "alive"  # refuted
    assert w.look(t + 0.4) is None
    node.states["a1"] = "suspect"
    assert w.look(t + 0.45) is None and w.look(t + 0.8) is None  # 0.35 s since suspected again
    assert w.look(t + 0.95) is not None


@pytest.mark.parametrize("partner, said", [("T", "is stopped"), ("gone", "is gone")])
def test_out_of_its_view_a_suspected_partner_stopped_or_gone_here_is_a_reason_once_the_suspicion_held(partner, said):
    """Left out of the others' view (its partner stopped), a process owes no step, so nothing
    stalls; a partner that /proc shows stopped or gone keeps the replica out for good: a
    reason after SILENT_S of suspicion, without probing. One that runs here, or runs on
    another host, is waited for."""
    for state, expect in ((partner, said), ("S", None), (None, None)):
        node, steps = Node(a1="suspect"), [0]
        w = watch(node, steps, in_view=False, partner=state)
        t, why = stall_until_reason(w, 0.0, 10.0)
        if expect is None:
            assert why is None
            continue
        assert why is not None and why.startswith(f"a1, a process of this replica, {said}") and "in no view" in why
        assert t == pytest.approx(replica_watch.SILENT_S, abs=0.06) and w.culprit == 1
        assert node.probed == []


def test_a_step_that_waited_for_a_view_to_form_is_not_a_typical_step():
    """Early in a job the first step waits for the model's build, and the next ones for
    the other replicas to join (seconds each, each in a view of its own): those are not
    what a step takes, so a partner lost just after still stalls the step within the usual
    stall, not four times those waits."""
    node, steps, view = Node(a1="alive"), [0], [1]
    w = watch(node, steps, in_view=view, partner=None)
    assert w.look(0.0) is None
    t = 20.0  # the first commit, after the build
    steps[0] += 1
    assert w.look(t) is None
    for joined in range(2, 6):  # four steps, each in a view that waited 3 s for a joiner
        t += 3.0
        view[0], steps[0] = joined, steps[0] + 1
        assert w.look(t) is None
    for _ in range(2):  # then steps of 0.05 s in one view
        t += 0.05
        steps[0] += 1
        assert w.look(t) is None
    stalled_from = t
    node.states["a1"] = "suspect"
    t, why = stall_until_reason(w, t, t + 20.0)
    assert why is not None and "has not answered" in why
    assert t - stalled_from == pytest.approx(replica_watch.STALL_MIN_S + replica_watch.SILENT_REMOTE_S, abs=0.11)


def test_no_stall_counts_before_the_process_is_in_a_view():
    node, steps = Node(a1="suspect"), [0]
    w = watch(node, steps, in_view=False)
    assert all(w.look(t / 10) is None for t in range(100))
    assert node.probed == []


def test_a_shut_connection_wakes_the_thread_waiting_on_it_and_a_reused_descriptor_is_left_alone():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(client.recv(10)), daemon=True)
    reader.start()
    wait_until(lambda: reader.native_id is not None and (stat_fields(f"self/task/{reader.native_id}") or ["?"])[0]
               == "S", 10, "the reader waiting in recv")
    descriptors = admission.socket_descriptors()
    assert client.fileno() in descriptors
    assert not admission.shut_connection(client.fileno(), descriptors[client.fileno()] + 1)  # another socket now
    assert reader.is_alive()
    assert admission.shut_connection(client.fileno(), descriptors[client.fileno()])
    reader.join(5)
    assert not reader.is_alive() and got == [b""]
    for s in (client, accepted, server):
        s.close()


def two_shards(tmp_path, source: str, stopped: int) -> tuple[subprocess.Popen, subprocess.Popen]:
    """The two processes of a replica running ``source`` (argv: shard rank, store port):
    shard ``stopped`` (which the test will stop), then the other, which reads its stdin."""
    script = tmp_path / "shard.py"
    script.write_text(source)
    port = free_port()
    first = subprocess.Popen([sys.executable, str(script), str(stopped), str(port)], stdout=subprocess.PIPE,
                             text=True)
    other = subprocess.Popen([sys.executable, str(script), str(1 - stopped), str(port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return first, other


REPLICA_PROCESS = """
import sys, threading, time
import torch, torch.distributed as dist
from ftcomm.training.replica import Replica
rank, port = int(sys.argv[1]), int(sys.argv[2])
replica = Replica(2, rank, f"127.0.0.1:{port}", "gloo", 600)
if rank == 1:
    print("ready", flush=True)
    time.sleep(120)
print("partner", replica.process_state(1), flush=True)
sys.stdin.readline()  # the test stopped the partner
print("partner", replica.process_state(1), flush=True)
threading.Timer(0.5, lambda: replica.tear_down("the test")).start()
try:
    dist.all_reduce(torch.ones(4))
    print("returned", flush=True)
except RuntimeError:
    print("raised", flush=True)
"""


def test_a_torn_down_gloo_replica_fails_the_waiting_collective_and_the_process_exits_cleanly(tmp_path):
    """Two processes of a real replica (torch's Gloo group): the partner stops (SIGSTOP); the
    other sees it stopped in /proc, and tearing the replica down wakes its collective waiting
    for the partner at once, with a RuntimeError, and leaves the process able to exit
    normally (shutting a listener under Gloo's accept loop would abort it)."""
    partner, this = two_shards(tmp_path, REPLICA_PROCESS, stopped=1)
    try:
        assert partner.stdout.readline().strip() == "ready"
        assert this.stdout.readline().split()[:2] in (["partner", "S"], ["partner", "R"])  # it runs
        os.kill(partner.pid, signal.SIGSTOP)
        wait_until(lambda: (stat_fields(partner.pid) or ["?"])[0] == "T", 10, "the partner stopped")
        this.stdin.write("\n")
        this.stdin.flush()
        assert this.stdout.readline().split()[:2] == ["partner", "T"]  # stopped
        out, err = this.communicate(timeout=60)
        assert this.returncode == 0, err  # not killed by an abort
        assert out.split() == ["raised"], out  # within the test's 60 s (the group's timeout: 600 s)
        assert "sharded replica is lost: the test" in err
    finally:
        for p in (this, partner):
            if p.poll() is None:
                p.kill()
                p.wait()


STORE_WAITER = """
import sys, threading, time
from ftcomm.errors import ReplicaLost
from ftcomm.training.replica import Replica
rank, port = int(sys.argv[1]), int(sys.argv[2])
replica = Replica(2, rank, f"127.0.0.1:{port}", "gloo", 600)
print("ready", flush=True)
if rank == 0:  # serves the replica's store
    time.sleep(120)
sys.stdin.readline()  # the test stopped shard 0, and with it the store
threading.Timer(0.5, lambda: replica.tear_down("the test")).start()
try:
    replica.decide("step/1", True, lambda: False, 600)
    print("decided", flush=True)
except ReplicaLost:
    print("raised", flush=True)
"""


def test_a_torn_down_replica_releases_a_decision_waiting_on_a_store_that_went_silent(tmp_path):
    """Shard 0 serves the replica's store and stops (as a host that vanished: no refusal, only
    silence); shard 1 waits in a decision on that store. Tearing the replica down shuts its
    connection to the store too, so the decision raises ReplicaLost at once rather than
    after the store's timeout (600 s here: the test waits 90)."""
    store, this = two_shards(tmp_path, STORE_WAITER, stopped=0)
    try:
        assert store.stdout.readline().strip() == "ready"
        assert this.stdout.readline().strip() == "ready"
        os.kill(store.pid, signal.SIGSTOP)
        wait_until(lambda: (stat_fields(store.pid) or ["?"])[0] == "T", 10, "shard 0 stopped")
        this.stdin.write("\n")
        this.stdin.flush()
        out, err = this.communicate(timeout=90)
        assert this.returncode == 0, err
        assert out.split() == ["raised"], out
    finally:
        for p in (this, store):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
