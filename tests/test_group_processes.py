"""Real training workers on loopback: crash, hang, join, leave, partitions, config mismatch.

Each test asserts DESIGN §2: equal registered-state digests after every re-formation and
at the end, abort latency within 100 ms, and no two sides committing during a partition.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from ftcomm.localproc import ChildProcess

from .conftest import free_port
from .polling import wait_until
from .train_cluster import BASE_ARGS, EXAMPLE, TrainCluster, assert_invariants, stalls

pytestmark = pytest.mark.timeout(150)


def four(cluster: TrainCluster):
    workers = cluster.start(4, ["--min-workers", "1"])
    views = cluster.wait_view(workers, 4, timeout=60)
    return workers, max(v["view_id"] for v in views)


def by_rank(workers, view_event):
    order = {m: i for i, m in enumerate(view_event["members"])}
    return sorted(workers, key=lambda w: order[w.id])


def test_crash_of_one_of_four_at_a_random_step(cluster):
    workers, view_id = four(cluster)
    time.sleep(random.uniform(0.2, 1.5))  # the fault lands at a random step
    victim = workers[random.randrange(4)]
    killed = time.time()
    victim.signal(signal.SIGKILL)
    survivors = [w for w in workers if w is not victim]
    views = cluster.wait_view(survivors, 3, timeout=20, after=view_id)
    assert {v["reason"] for v in views} == {"crash"}
    assert max(v["t"] for v in views) - killed < 5.0
    assert_invariants(survivors, cluster.finish(survivors))


def test_hang_then_resume_rejoins_with_synced_state(cluster):
    workers, view_id = four(cluster)
    victim = workers[1]
    victim.signal(signal.SIGSTOP)
    survivors = [w for w in workers if w is not victim]
    views = cluster.wait_view(survivors, 3, timeout=20, after=view_id)
    assert {v["reason"] for v in views} == {"hang"}
    stopped_step = max(cluster.status(w) for w in survivors)
    wait_until(lambda: min(cluster.status(w) for w in survivors) > stopped_step + 20, 20, "progress without it")
    victim.signal(signal.SIGCONT)
    rejoined = victim.wait_for(lambda e: e["ev"] == "view" and len(e["members"]) == 4 and e["view_id"] > view_id,
                               30, "the resumed worker to rejoin")
    # one reason on every member of that view: rank 0's (a join, or a rejoin when rank 0
    # is the member that came back)
    others = [w.wait_for(lambda e: e["ev"] == "view" and e["view_id"] == rejoined["view_id"], 30, "the view")
              for w in survivors]
    assert rejoined["reason"] in ("join", "rejoin") and {v["reason"] for v in others} == {rejoined["reason"]}
    assert_invariants(workers, cluster.finish(workers))


def test_join_two_to_four_switches_at_the_same_step_and_joiners_get_state(cluster):
    first = cluster.start(2, ["--min-workers", "1"])
    cluster.wait_view(first, 2, timeout=30)
    joiners = cluster.start(2, ["--min-workers", "1"])
    everyone = first + joiners
    views = cluster.wait_view(everyone, 4, timeout=30)
    assert len({(v["view_id"], v["step"], v["state_digest"]) for v in views}) == 1, views
    assert {v["reason"] for v in views[:2]} == {"join"}
    assert_invariants(everyone, cluster.finish(everyone))


@pytest.mark.parametrize("peers", ["the first alone", "each other"])
def test_two_founders_at_min_workers_1_started_together_end_in_one_group(cluster, peers):
    """Two processes started at the same moment, either may found a group alone (one is
    enough at min_workers=1): the first given no peer and the second the first (as
    ElasticRayJob and a script given one address start them), or each given the other (as
    ftcomm run does), started in a random order. They end in one group, one state."""
    ports = [free_port(), free_port()]
    first, second = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
    given = {first: [] if peers == "the first alone" else [second], second: [first]}
    order = random.sample([first, second], 2)
    workers = []
    for bind in order:
        command = [sys.executable, "-u", str(EXAMPLE), "--bind", bind, *BASE_ARGS, "--min-workers", "1"]
        command += ["--peers", ",".join(given[bind])] if given[bind] else []
        worker = ChildProcess(command, ready_timeout=None, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        cluster.workers.append(worker)
        workers.append(worker)
        time.sleep(random.uniform(0.0, 0.3))
    views = cluster.wait_view(workers, 2, timeout=60)
    assert len({(v["view_id"], v["state_digest"]) for v in views}) == 1, views
    assert_invariants(workers, cluster.finish(workers))


def test_graceful_leave_reforms_without_waiting_for_suspicion(cluster):
    workers, view_id = four(cluster)
    leaver = workers[3]
    leaver.signal(signal.SIGTERM)
    stayers = workers[:3]
    views = cluster.wait_view(stayers, 3, timeout=10, after=view_id)
    assert {v["reason"] for v in views} == {"leave"}  # announced: no suspicion wait
    assert leaver.process.wait(30) == 128 + signal.SIGTERM
    assert_invariants(stayers, cluster.finish(stayers))


def test_an_uncaught_exception_leaves_gracefully(cluster):
    workers, view_id = four(cluster)
    failing = workers[1]
    failing.send(cmd="fail")
    assert failing.process.wait(30) != 0
    assert any("failure injected" in line for line in failing.stderr_tail)
    stayers = [w for w in workers if w is not failing]
    views = cluster.wait_view(stayers, 3, timeout=10, after=view_id)
    assert {v["reason"] for v in views} == {"leave"}  # announced: no suspicion timeout
    assert_invariants(stayers, cluster.finish(stayers))


def test_sigterm_while_a_collective_hangs_on_a_stopped_peer_exits_promptly(cluster):
    workers, view_id = four(cluster)
    stopped, leaver = workers[3], workers[0]
    stopped.signal(signal.SIGSTOP)
    time.sleep(0.2)  # the others are now blocked in an allreduce that waits for the stopped worker
    leaver.signal(signal.SIGTERM)
    assert leaver.process.wait(30) == 128 + signal.SIGTERM  # not stuck in the pending collective
    stayers = workers[1:3]
    cluster.wait_view(stayers, 2, timeout=20, after=view_id)
    stopped.signal(signal.SIGCONT)
    rest = workers[1:]
    cluster.wait_view(rest, 3, timeout=30, after=view_id)
    assert_invariants(rest, cluster.finish(rest))


@pytest.mark.parametrize("split", [2, 3])
def test_partition_only_the_quorum_side_commits_and_heals_to_one_state(cluster, split):
    workers, view_id = four(cluster)
    current = max((e for w in workers for e in w.snapshot() if e["ev"] == "view"), key=lambda e: e["view_id"])
    ranked = by_rank(workers, current)
    majority, minority = ranked[:split], ranked[split:]  # the majority (or the tie) holds rank 0
    a, b = [w.address for w in majority], [w.address for w in minority]
    for w in workers:
        w.send(cmd="partition", a=a, b=b)
    views = cluster.wait_view(majority, split, timeout=30, after=view_id)
    cut_view = max(v["view_id"] for v in views)
    minority_steps = [cluster.status(w) for w in minority]
    majority_steps = [cluster.status(w) for w in majority]
    wait_until(lambda: min(cluster.status(w) for w in majority) > max(majority_steps) + 30, 20,
               "the majority to keep committing")
    # The cut-off side forms no view and commits nothing past where it stood: a member that
    # reported one step less may still finish the step whose collective all four ran before
    # the cut (its status was read before its commit), as the one beside it had.
    assert max(cluster.status(w) for w in minority) <= max(minority_steps), "the minority committed steps"
    assert not [e for w in minority for e in w.snapshot() if e["ev"] == "view" and e["view_id"] > view_id
                and set(e["members"]) <= {m.id for m in minority}], "the minority formed a view without a quorum"
    for w in workers:
        w.send(cmd="heal")
    try:
        cluster.wait_view(workers, 4, timeout=40, after=cut_view)
    except TimeoutError as exc:
        tails = "\n".join(f"--- {w.address}\n" + "".join(line for line in w.stderr_tail[-40:] if "DEBUG" not in line)
                          for w in workers)
        raise AssertionError(f"no single view after healing; logs:\n{tails}") from exc
    assert_invariants(workers, cluster.finish(workers))


def test_mismatched_settings_are_refused_with_a_clear_error(cluster):
    cluster.start(1, ["--max-workers", "4"])
    command_args = ["--max-workers", "8"]
    (stranger,) = cluster.start(1, command_args, wait=False)
    stranger.process.wait(60)
    assert stranger.process.returncode != 0
    wait_until(lambda: any("ConfigMismatch" in line for line in stranger.stderr_tail), 10, "the error")
    text = "".join(stranger.stderr_tail)
    assert "max_workers=8 but the group uses max_workers=4" in text


def views_of(worker: ChildProcess) -> list[tuple[int, str, int]]:
    """The views the worker reported so far: (view id, reason, members)."""
    return [(e["view_id"], e["reason"], len(e["members"])) for e in worker.snapshot() if e["ev"] == "view"]


def test_a_slow_worker_is_reported_as_a_straggler_by_everyone_and_nothing_is_lost(cluster):
    # One OpenMP thread per worker, as `ftcomm run` sets with several workers per node:
    # with torch's default, the spinning threads of one worker slow the others' compute down.
    workers = cluster.start(3, ["--min-workers", "1"], env={"OMP_NUM_THREADS": "1"})
    cluster.wait_view(workers, 3, timeout=60)
    views_before = [len(views_of(w)) for w in workers]
    slow = workers[2]

    def report(w, flagged: bool) -> dict:
        return w.wait_for(lambda e: e["ev"] == "straggler" and e["member"] == slow.id and e["slow"] is flagged,
                          90, "a straggler report" if flagged else "a recovery report")
    slow.request(cmd="step_time", seconds=0.15)
    for w in workers:  # every member judges the same published figures, itself included
        flagged = report(w, True)
        assert flagged["compute_s"] > 2 * flagged["others_s"]
    slow.request(cmd="step_time", seconds=0.01)
    for w in workers:
        report(w, False)
    done = cluster.finish(workers)
    assert {e["member"] for w in workers for e in w.snapshot() if e["ev"] == "straggler"} == {slow.id}
    # Reported, not excluded: no view formed since the slow phase began leaves it out (a
    # re-formation of the same three would show as a view of three; its reason is printed).
    views = [views_of(w)[n:] for w, n in zip(workers, views_before)]
    why = [[line for line in w.stderr_tail if any(k in line for k in ("view broke", "stalled", "members ("))]
           for w in workers]
    # A whole process stopped or starved for more than the detector's window (the machine
    # overloaded: its own gossip timer says so) is a hang to its peers, slow or not.
    if not any(stalls(w) for w in workers):
        assert all(size == 3 for v in views for _, _, size in v), (views, why)
        assert [len(v) for v in views] == [0, 0, 0], (views, why)
    assert_invariants(workers, done)


def test_a_full_garbage_collection_in_a_worker_the_others_wait_on_is_not_taken_for_a_hang(cluster):
    """Worker 0 runs a full garbage collection over a large heap (the GIL held throughout,
    its gossip thread silent) at the start of a step, while the others wait on its share;
    they probe it on demand within the wait. It announced the collection: no view change.
    (The same pauses unannounced re-form the view: ``benchmarks/busy_host.py --collections``
    measures both in one run; on a loaded machine the others' windows stretch and they
    may not, so that half is no test here.)"""
    workers = cluster.start(3, ["--min-workers", "1"], env={"OMP_NUM_THREADS": "1"})
    cluster.wait_view(workers, 3, timeout=60)
    time.sleep(2.0)  # steady: the waits' median is a step's
    views_before = [len(views_of(w)) for w in workers]
    paused = workers[0]
    paused.request(cmd="collect", objects=6_000_000, timeout=60)
    collected = paused.wait_for(lambda e: e["ev"] == "collected", 60, "the collection")
    # what a hang is told from: the others probe 0.05 s into a wait, and give 0.1 s to answer
    assert collected["seconds"] > 0.15, f"a collection of {collected['seconds']:.3f} s cannot tell a hang"
    time.sleep(3.0)
    views = [views_of(w)[n:] for w, n in zip(workers, views_before)]
    # Unless a process stalled past the detector's window for another reason (an overloaded
    # machine: the collecting one's own timer late by more than its collection, or another's),
    # or the collection outlasted what a notice covers (pause_grace, 1 s: a loaded machine
    # stretches a 0.25 s collection several times), after which it is a hang by design.
    overloaded = any(stalls(w) for w in workers[1:]) or any(
        late > collected["seconds"] + 0.25 for late in stalls(paused))
    if not overloaded and collected["seconds"] < 0.8:
        assert views == [[], [], []], (views, collected, [stalls(w) for w in workers])
    done = cluster.finish(workers)
    assert_invariants(workers, done)


def test_an_excluded_straggler_stands_aside_and_rejoins_once_fast_again_with_every_sample_once(cluster):
    from benchmarks.convergence import check_exactly_once

    options = '{"straggler_policy": "exclude", "straggler_cooldown": 3}'
    workers = cluster.start(3, ["--min-workers", "1", "--log-indices", "--options", options],
                            env={"OMP_NUM_THREADS": "1"})
    first = max(v["view_id"] for v in cluster.wait_view(workers, 3, timeout=60))
    slow, others = workers[2], workers[:2]
    slow.request(cmd="step_time", seconds=0.15)
    aside = cluster.wait_view(others, 2, timeout=90, after=first)
    assert {v["reason"] for v in aside} == {"straggler"} and all(slow.id not in v["members"] for v in aside)
    slow.request(cmd="step_time", seconds=0.01)  # read by the next step it trains, once back
    back = cluster.wait_view([slow], 3, timeout=60, after=first)[0]
    assert back["reason"] in ("join", "rejoin") and back["view_id"] > aside[0]["view_id"]
    cluster.wait_view(others, 3, timeout=30, after=aside[0]["view_id"])
    done = cluster.finish(workers)
    assert_invariants(workers, done)
    reports = [e for e in slow.snapshot() if e["ev"] == "straggler" and e["member"] == slow.id and e["slow"]]
    assert reports, "the straggler judged itself"
    logs = [[e for e in w.snapshot() if e["ev"] == "batch"] for w in workers]
    once = check_exactly_once(logs, done[0]["step"], samples=8192, seed=0)
    assert once["ok"], once["problems"]


def test_random_churn_among_four_to_six_workers(cluster):
    """Kills, pauses, graceful leaves and joins at random for a while; no hang, one state."""
    duration = float(__import__("os").environ.get("FTCOMM_CHURN_SECONDS", "30"))
    rng = random.Random(20261121)
    live = cluster.start(4, ["--min-workers", "1"])
    cluster.wait_view(live, 4, timeout=60)
    paused: list = []
    ends = time.monotonic() + duration
    actions = []
    while time.monotonic() < ends:
        time.sleep(rng.uniform(1.5, 4.0))
        for w in paused:
            w.signal(signal.SIGCONT)
        paused.clear()
        action = rng.choice(["kill", "pause", "leave", "join"])
        if action == "join" and len(live) < 6 or len(live) <= 4:
            live += cluster.start(1, ["--min-workers", "1"], wait=False)
            action = "join"
        elif action == "kill":
            victim = live.pop(rng.randrange(len(live)))
            victim.signal(signal.SIGKILL)
        elif action == "leave":
            victim = live.pop(rng.randrange(len(live)))
            victim.signal(signal.SIGTERM)
        else:
            victim = live[rng.randrange(len(live))]
            victim.signal(signal.SIGSTOP)
            paused.append(victim)
        actions.append(action)
    for w in paused:
        w.signal(signal.SIGCONT)
    for w in live:
        w.wait_ready(90)
    deadline = time.monotonic() + 90
    while True:  # no hang: every live worker ends up in one view with all the others
        # a worker reports its views from the training loop: one just ready may have none yet
        newest = [max((e for e in w.snapshot() if e["ev"] == "view"), key=lambda e: e["view_id"], default=None)
                  for w in live]
        ids = [v["view_id"] if v is not None else None for v in newest]
        if None not in ids and len(set(ids)) == 1 and len(newest[0]["members"]) == len(live):
            break
        assert time.monotonic() < deadline, f"no common view after churn {actions}: {ids}"
        time.sleep(0.1)
    assert_invariants(live, cluster.finish(live))


SIGTERM_INSIDE_A_LOCK = """
import os, signal, sys, time
import ftcomm
ft = ftcomm.init(bind="127.0.0.1:0")
left = []
ft.gossip.announce_leave = lambda: left.append(1) or print("left", flush=True)
with ft._loop.news.abort._lock:  # the handler interrupts the main thread while it holds the signal's lock
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
print("not interrupted", flush=True)
"""


def test_sigterm_while_the_main_thread_holds_the_abort_lock_exits_and_leaves():
    """The handler takes no lock: the main thread unwinds and the exit hook leaves the group."""
    done = subprocess.run([sys.executable, "-c", SIGTERM_INSIDE_A_LOCK], capture_output=True, text=True, timeout=30)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert done.stdout.split() == ["left"], (done.stdout, done.stderr[-2000:])
