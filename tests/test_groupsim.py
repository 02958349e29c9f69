"""Whole groups under deterministic simulation (ftcomm.groupsim): random seeds, and the races
the simulation found, each replayed from its seed and fault schedule."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from ftcomm import groupsim
from ftcomm.core import engine as core
from ftcomm.gossip import GossipConfig
from ftcomm.groupsim import GroupSimulation, run_seeds, summarize
from ftcomm.runtime.driver import Driver
from ftcomm.runtime.ports import Reconciled
from ftcomm.runtime.stragglers import Stragglers
from ftcomm.runtime.worker import WorkerLoop
from ftcomm.sim import checks

pytestmark = pytest.mark.timeout(900)  # generous: the seeds are CPU-bound and CI machines may be loaded

NO_LATER_DRAWS = {"misconfigured": False, "model_after_init": False}
"""The world before an operator scaled up with other settings and the first workers built
their model after init (the seeds that name it were found before)."""
BEFORE_RESTARTS_IN_PLACE = {"infant": False, "in_place": False, **NO_LATER_DRAWS}
"""The world before a launcher started workers again at their addresses and new workers
drew faults of their own (the seeds that name it were found in that world)."""
AS_FOUND = {"keep_live": 2, "stop_kills": 0.0, "overlap": False, "log_in_step": False, "transfer_s": 0.0,
            "observe_jitter": 0.0, **BEFORE_RESTARTS_IN_PLACE}
"""The seeds below were found when faults struck only while more than two workers (or
replicas) lived, before a launcher killed stopped workers, and before the scripts
overlapped backward, logged inside a step, sent their state in measurable time or saw
members observe an operation apart: each replays its race in that world."""


def test_five_hundred_random_seeds_keep_every_invariant():
    outcomes = run_seeds(list(range(500)), processes=2)
    summary = summarize(outcomes)
    assert summary["violations"] == 0, summary["first_violation"]
    assert summary["seeds"] == 500 and summary["simulated_commits"] > 100_000
    # every drawn fault kind occurred and was recovered from
    assert {"crash", "hang", "node_loss", "leave"} <= set(summary["recovery_to_next_commit"])


def test_outer_steps_of_diloco_keep_every_invariant():
    """Steps of 0.3-2 s of compute, as DiLoCo's outer steps are: the faults land mostly
    between a step's boundaries, joiners wait a whole step for theirs."""
    summary = summarize(run_seeds(list(range(100)), processes=2, outer_steps=True))
    assert summary["violations"] == 0, summary["first_violation"]
    assert summary["simulated_commits"] > 1000


def test_workers_started_in_turn_the_first_alone_at_min_workers_1_end_in_one_group():
    """As ElasticRayJob starts a job (and a script given one peer's address): the first
    worker starts a gossip cluster alone and, at min_workers=1, founds a group at once; the
    others start within a second, in turn, each given those started before it, and hold
    back from the running group until their state is registered (some register it late).
    With and without faults, every worker ends in one group with all the others (invariant
    6 after the last start) and no two groups commit the same step (invariant 4)."""
    outcomes = [GroupSimulation(seed, min_workers=1, first_alone=True, late_registration=seed % 2 == 0,
                                faults=[] if seed < 10 else None).run() for seed in range(20)]
    assert all(o.first_alone for o in outcomes)
    assert [o.violation for o in outcomes if not o.ok] == []
    assert all(o.commits > 0 and not o.exits for o in outcomes[:10]), [o.exits for o in outcomes[:10]]


@pytest.mark.parametrize("replica_size", [1, 2])
def test_a_member_whose_cpu_is_starved_but_answers_is_never_left_out(replica_size):
    """CPU starvation (a busy host): a member's loop, timers and packets run up to a drawn
    lag late, for seconds, on any member, the prober included. No view leaves out one
    starved by up to checks.STARVED_TOLERATED (invariant 10); starved longer it may be."""
    outcomes = run_seeds(list(range(40)), processes=2, starve=True,
                         replica_size=replica_size)
    summary = summarize(outcomes)
    assert summary["violations"] == 0, summary["first_violation"]
    drawn = summary["starvation"]["windows_by_lag"]
    assert sum(n for lag, n in drawn.items() if float(lag) <= checks.STARVED_TOLERATED) > 20


def test_invariant_10_fails_a_seed_that_leaves_out_a_member_starved_within_what_it_holds_tolerable(monkeypatch):
    # Held to tolerate 0.4 s, which the detector does not: starved members left out fail.
    monkeypatch.setattr(checks, "STARVED_TOLERATED", 0.4)
    outcomes = [GroupSimulation(seed, starve=True).run() for seed in range(20)]
    assert any(not o.ok and "invariant 10" in o.violation for o in outcomes)


@pytest.mark.parametrize("replica_size", [1, 2])
def test_a_worker_paused_by_a_garbage_collection_it_announced_is_never_left_out(replica_size):
    """Full garbage collections drawn: a worker's loop and gossip stop for up to 0.7 s after it
    announced the collection (``pause_grace``). No view leaves it out (invariant 10), and the
    others' probes waited for it; with the notices off (``pause_grace`` 0) the same seeds
    leave such workers out as hung."""
    from ftcomm.gossip import GossipConfig
    seeds = list(range(24))
    summary = summarize(run_seeds(seeds, processes=2, collect=True, replica_size=replica_size))
    assert summary["violations"] == 0, summary["first_violation"]
    assert summary["collections"]["struck"] > 40 and summary["collections"]["probe_verdicts_held"] > 0
    off = summarize(run_seeds(seeds, processes=2, collect=True, replica_size=replica_size,
                              gossip=GossipConfig(pause_grace=0)))
    assert off["violations"] > 0 and "garbage collection" in off["first_violation"]


@pytest.mark.parametrize("replica_size", [1, 2])
def test_a_state_that_goes_wrong_is_caught_and_repaired_within_fingerprint_every_steps(replica_size):
    """Silent corruption drawn: a member's state changes without a commit, now and then the
    same member again soon after. No member commits on a wrong state more than
    fingerprint_every steps while most of its view holds a right one (invariant 12), and
    every other invariant holds through the repairs and StateDiverged exits."""
    summary = summarize(run_seeds(list(range(40)), processes=2, corrupt=True, replica_size=replica_size))
    assert summary["violations"] == 0, summary["first_violation"]
    assert summary["corruption"]["struck"] > 40 and summary["corruption"]["commits_on_a_wrong_state"] > 0


def test_a_repair_inside_the_call_before_the_step_is_not_falling_behind():
    """Seed 172: a member repaired inside the metric call before the step took the repair
    for having fallen behind and skipped the call the others ran (every member then waited
    in another collective for good); a state replaced at the member's own step is not
    behind."""
    outcome = GroupSimulation(172, corrupt=True).run()
    assert outcome.ok, outcome.violation
    assert outcome.corruptions and outcome.wrong_commits


def test_a_member_that_leaves_for_a_state_wrong_again_may_linger_with_its_communicator():
    """Seed 449: a member named again soon after its repair leaves the group; the run ended
    while it lingered in the view it left (leave_grace), its communicator still open, which
    invariant 7 read as a leak. A leaving member holds its view's communicator until its
    leave completes."""
    world = GroupSimulation(449, corrupt=True)
    outcome = world.run()
    assert outcome.ok, outcome.violation
    assert outcome.exits.get("StateDiverged") == 1


def test_a_commit_on_a_wrong_state_counts_toward_its_replica_s_whole_step():
    """Found by seed 960 of replicas (before the reconcile compared fingerprints): a replica
    whose shard 0 committed step 27 on a wrong state was read as one that committed it on
    some processes only, so the StateLost that followed its loss seemed a violation."""
    import collections

    from ftcomm.core.view import View

    world = types.SimpleNamespace(taint={5: 20}, whole={}, wrong_commits=0, wrong_steps=set(), k=2,
                                  options=types.SimpleNamespace(fingerprint_every=10),
                                  sim=types.SimpleNamespace(now=1.0), by_id={})
    view = View(3, ("r0s0", "r0s1"))
    worker = types.SimpleNamespace(id="r0s0", shard=0, replica=("R0", 0, 2), committed=[],
                                   loop=types.SimpleNamespace(step=27), state=types.SimpleNamespace(value=5),
                                   last_view=None)
    world.by_id = {"r0s0": worker, "r0s1": types.SimpleNamespace(state=types.SimpleNamespace(value=9))}
    checks._committed_wrong(world, worker, view, 20)
    assert world.whole[27] == collections.defaultdict(set, {"R0": {0}})
    assert world.wrong_steps == {27} and worker.state.value in world.taint


def test_invariant_12_fails_seeds_whose_members_never_compare_fingerprints(monkeypatch):
    from ftcomm.runtime.fingerprints import FingerprintCheck
    monkeypatch.setattr(FingerprintCheck, "due", lambda self, step: False)
    outcomes = [GroupSimulation(seed, corrupt=True).run() for seed in (5, 6, 9)]
    assert all(not o.ok and "invariant 12" in o.violation for o in outcomes), [o.violation for o in outcomes]


@pytest.mark.parametrize("seed, replica_size", [(1400, 1), (1000, 2)])
def test_a_member_left_out_for_a_worse_starvation_or_a_cut_is_not_held_merely_starved(seed, replica_size):
    """Seed 1400: a member starved by 0.4 s was suspected then, and left out 1.7 s later,
    during a second starvation of 0.02 s; seed 1000 (replicas): a view formed just after a
    partition healed left out a replica whose process was starved by 0.01 s. Each exclusion
    is the worse fault's, which invariant 10 does not forbid; the check once judged the
    member by its latest starvation alone."""
    outcome = GroupSimulation(seed, starve=True, replica_size=replica_size).run()
    assert outcome.ok, outcome.violation
    assert any(lag <= checks.STARVED_TOLERATED for *_, lag in outcome.starvations)


def test_no_liveness_is_owed_to_a_replica_two_states_behind_a_group_that_was_lost_whole():
    """Seed 7754 (replicas of 2): a replica cut off at step 33 is left out; the group
    commits step 34 without it; its last replica is then stopped and killed by the
    launcher. The replica left behind holds step 33 of a view that never committed 34: it
    cannot go on (it would train step 34 again) and is owed no liveness."""
    world = GroupSimulation(7754, replica_size=2, **BEFORE_RESTARTS_IN_PLACE)
    outcome = world.run()
    assert outcome.ok, outcome.violation
    assert not outcome.quorum_survived
    assert any(kind == "stopped_killed" for _, kind, _ in world.fault_log)


def test_joiners_holding_back_for_their_state_neither_wait_for_ever_nor_found_a_second_group():
    """Seeds 868 and 5075 (workers started in turn): joiners that held back from the first
    worker's group until their state was registered saw it vanish (cut off, then crashed).
    One never read the group's member list, so nothing could show the group gone: it
    waited for ever (868). Another, reading only the first view's list, found its one member
    gone and joined a group founded from scratch beside the job's (5075: a restarted first
    worker had been given no peer). They now read the list while holding back, count every
    worker out of sight as possibly the group's, and a restarted worker gets the running
    ones as peers."""
    outcomes = run_seeds([868, 5075], **BEFORE_RESTARTS_IN_PLACE)
    assert all(o.ok for o in outcomes), [o.violation for o in outcomes]
    assert all(o.first_alone for o in outcomes)


def test_sharded_replicas_keep_every_invariant_shard_by_shard():
    """Replicas of 2 processes: crashes and hangs strike one process, node losses,
    partitions, joins and leaves whole replicas; a replica whose process failed is started
    again as a whole. The invariants hold per shard (the shards' states differ)."""
    summary = summarize(run_seeds(list(range(150)), processes=2, replica_size=2))
    assert summary["violations"] == 0, summary["first_violation"]
    assert {"crash", "hang", "node_loss", "leave"} <= set(summary["recovery_to_next_commit"])


def test_a_replica_that_loses_a_process_leaves_whole_and_comes_back_with_every_shard():
    sim = GroupSimulation(2, n=6, faults=[(3.0, "crash", {"pick": 0.3})], duration=8.0, replica_size=2)
    outcome = sim.run()
    assert outcome.ok, outcome.violation
    crashed = next(w for w in sim.workers.values() if w.crashed)
    partner = next(w for w in sim.workers.values() if w.replica == (crashed.replica[0], 1 - crashed.replica[1]))
    assert partner.gone or partner.crashed  # stopped by the launcher: it left, or was killed 0.5 s later
    restarted = [w for w in sim.live() if w.replica[0] == "R3"]
    assert [w.replica[1] for w in restarted] == [0, 1]
    final = sim.live()[0].loop.engine.view
    assert len(final.members) == 6 and all(w.loop.engine.view == final for w in sim.live())
    for shard in (0, 1):  # the restarted replica holds every other replica's shard
        assert len({(w.loop.step, w.state.value) for w in sim.live() if w.shard == shard}) == 1
    assert {w.state.value for w in sim.live() if w.shard == 0} != {w.state.value for w in sim.live() if w.shard == 1}




def test_a_replica_that_loses_a_process_is_repaired_in_place_and_its_survivor_keeps_its_process():
    """With repair in place (ftcomm run's default), the crashed process's partner is neither
    stopped nor started again: a replacement takes the lost shard under the replica's next
    key, the two rejoin whole, and every shard ends with one state in every replica."""
    sim = GroupSimulation(2, n=6, faults=[(3.0, "crash", {"pick": 0.3})], duration=10.0, replica_size=2, repair=True)
    outcome = sim.run()
    assert outcome.ok, outcome.violation
    assert outcome.repairs == (1, 1)
    crashed = next(w for w in sim.workers.values() if w.crashed)
    survivor = sim.workers[crashed.node ^ 1]  # its partner from the start (replicas of two consecutive nodes)
    assert not (survivor.gone or survivor.crashed) and survivor.replica[1] == 1 - crashed.replica[1]
    assert survivor.replica[0] != crashed.replica[0]  # the replica's next key
    replacement = next(w for w in sim.live() if w.replica == (survivor.replica[0], crashed.replica[1]))
    assert replacement.started_at > 0
    final = sim.live()[0].loop.engine.view
    assert len(final.members) == 6 and {survivor.id, replacement.id} <= final.member_set
    assert all(w.loop.engine.view == final for w in sim.live())
    for shard in (0, 1):
        assert len({(w.loop.step, w.state.value) for w in sim.live() if w.shard == shard}) == 1


@pytest.mark.parametrize("replica_size", [2, 3])
def test_sharded_replicas_repaired_in_place_keep_every_invariant(replica_size):
    summary = summarize(run_seeds(list(range(60)), processes=2, replica_size=replica_size, repair=True))
    assert summary["violations"] == 0, summary["first_violation"]
    assert summary["replica_repairs"]["formed_again"] > 0


@pytest.mark.parametrize("length", [8.0, 1.6])
def test_a_hang_no_launcher_sees_in_the_replica_holding_the_tie_stalls_the_other_replica_no_longer_than_detection(
        length):
    """Two replicas of two; a process hangs (no launcher stops it). In the replica that holds
    rank 0 of the tie, its partner stands aside once it has been silent for a chase interval
    (then leaves when it is declared dead), so the other replica commits again within about
    a second, not after the seconds a death takes to be declared. Back in time, the hung
    process and its partner rejoin as a whole replica; hung for good, it is replaced."""
    for pick in (0.0, 0.3, 0.6, 0.9):  # each process of the view once
        sim = GroupSimulation(3, n=4, faults=[(3.0, "hang", {"pick": pick, "length": length})], duration=12.0,
                              replica_size=2, keep_live=1)
        outcome = sim.run()
        assert outcome.ok, outcome.violation
        assert max(outcome.recovery["hang"]) < 2.0, (pick, outcome.recovery)
        final = sim.live()[0].loop.engine.view
        assert all(w.loop.engine.view == final for w in sim.live())
        hung = next(member for _, kind, member in sim.fault_log if kind == "hang")
        assert len(final.members) == 4 and (hung in final.members) == (length < 5), (pick, final)


def test_seeds_agreeing_through_rank_0_keep_every_invariant():
    """With an announce limit of 1, every view of two or more agrees as a view above
    ANNOUNCE_LIMIT does: each member announces its proposal to the view's rank 0 only, and
    enters on rank 0's word once rank 0 saw every member propose it (Engine._witnessed)."""
    summary = summarize(run_seeds(list(range(100)), processes=2, announce_limit=1))
    assert summary["violations"] == 0, summary["first_violation"]
    assert summary["simulated_commits"] > 25_000


def test_a_converged_start_is_known_to_every_member_and_agrees_at_once():
    """A static host list: every member knows every other one and its first record from the
    start, so nobody publishes it again; the first view is agreed within a few ticks."""
    sim = GroupSimulation(1, n=100, faults=[], loss=0.0, converged=True)
    assert all(node.protocol.incarnation == 0 for node in sim.sim.nodes)
    sim.sim.run_until(0.5)
    views = {w.loop.engine.view for w in sim.workers.values()}
    assert len(views) == 1 and None not in views and next(iter(views)).size == 100


def test_a_worker_reading_only_its_news_reads_what_the_whole_table_says(monkeypatch):
    """Each look re-reads only the members a worker has news of since its last one (a table
    of a thousand members is read a thousand times a tick otherwise); the records, and their
    order, are those a read of the whole table gives."""
    looks = []
    statuses = GroupSimulation.statuses

    def checked(self, w):
        fresh = w.statuses is None or w.news is None or bool(w.news)
        out = statuses(self, w)
        if fresh:
            assert list(out.items()) == list(self.read_statuses(w).items())
            looks.append(w.id)
        return out
    monkeypatch.setattr(GroupSimulation, "statuses", checked)
    assert all(o.ok for o in run_seeds(list(range(12))))
    assert len(looks) > 1000


def partition_then_winner_leaves(seed: int = 13, gap: float = 0.3) -> groupsim.Outcome:
    """A 2|2 partition of four heals; right after, the winning side's rank 0 leaves."""
    return GroupSimulation(seed, n=4, faults=[(3.0, "partition", {"length": 2.0, "pick": 0.0, "split": 0.5}),
                                              (5.0 + gap, "leave", {"pick": 0.0})]).run()


def test_a_healed_partition_whose_winner_leaves_does_not_split_the_job():
    outcomes = [partition_then_winner_leaves(seed, gap) for seed in range(16) for gap in (0.1, 0.3, 0.6, 1.0)]
    assert all(o.ok for o in outcomes), next(o.violation for o in outcomes if not o.ok)


HANG_AND_NODE_LOSS_SEEDS = [319, 323, 325, 327]  # seeds where a member finished a step the others had abandoned
STRAGGLER_SEEDS = [66, 146, 165]  # seeds where a slow member stands aside while the group is at min_workers


def test_a_member_cut_off_mid_step_confirms_before_committing():
    """After a hang or a short node loss, the member's old collective can still complete (the
    others' abandoned communicators finish it). It exchanges state with a view member first,
    sees the view moved on, and discards the step: no commit has to be rolled back."""
    outcomes = run_seeds(HANG_AND_NODE_LOSS_SEEDS, **AS_FOUND)
    assert all(o.ok for o in outcomes) and sum(o.rolled_back for o in outcomes) == 0


def test_without_the_confirmation_such_steps_commit_and_are_rolled_back(monkeypatch):
    monkeypatch.setattr(Driver, "confirmation", lambda self, *args: None)  # the driver's check, off
    assert sum(o.rolled_back for o in run_seeds(HANG_AND_NODE_LOSS_SEEDS, **AS_FOUND)) > 0


def test_a_straggler_chosen_by_a_step_stands_aside_and_returns_after_its_cooldown():
    """straggler_policy="exclude" through the shipped driver: the slow member asks with its
    step, every member sees the same verdict, it leaves the view at the step boundary (the
    others re-form without it), and after the cooldown it joins again."""
    sim = GroupSimulation(5, n=4, faults=[(3.0, "slow", {"pick": 0.1, "factor": 4.0, "length": 2.0})],
                          duration=10.0, exclude_stragglers=True, straggler_cooldown=1.5)
    straggler = sim.live()[0]
    outcome = sim.run()
    assert outcome.ok, outcome.violation
    benched = [line for line in sim.log if "standing aside as a straggler" in line]
    assert len(benched) == 1 and straggler.id in benched[0]
    views = [view for _, _, view in straggler.committed]
    final = straggler.loop.engine.view
    assert straggler.id in final.members and len(final.members) == 4  # back in the group
    others = sim.live()[1]
    left_out = [view for _, _, view in others.committed if view not in views]
    assert left_out, "the others committed in a view without the straggler"
    sim = GroupSimulation(5, n=4, faults=[(3.0, "slow", {"pick": 0.1, "factor": 4.0, "length": 2.0})],
                          duration=10.0, exclude_stragglers=False)
    assert sim.run().ok and not any("straggler" in line for line in sim.log)  # the policy off: nobody leaves


def test_a_member_cut_off_until_the_group_forgot_it_finds_the_group_again():
    """Its view's other members left while it was cut off (it holds them dead, no quorum),
    and the worker that joined meanwhile never heard of it: two gossip clusters. Without
    asking its seeds again it waited forever beside a group of one (invariant 6)."""
    faults = [(2.371, "partition", {"length": 3.002, "pick": 0.872, "split": 0.716}),
              (3.590, "leave", {"pick": 0.817}), (4.816, "leave", {"pick": 0.440}), (5.712, "join", {}),
              (5.907, "node_loss", {"length": 3.733, "pick": 0.537, "split": 0.677}),
              (7.044, "leave_after_commit", {"pick": 0.210}), (8.236, "leave", {"pick": 0.534}),
              (9.734, "partition", {"length": 5.655, "pick": 0.250, "split": 0.953})]
    sim = GroupSimulation(961, n=4, loss=0.1, formation_timeout=2.0, duration=30.0, faults=faults)
    outcome = sim.run()
    assert outcome.ok, outcome.violation
    assert outcome.settle_s is not None and len(sim.live()) == 2


def test_a_rejoiner_that_sees_no_group_founds_none(monkeypatch):
    """Seeds where a member left out of a newer view saw no live group (its members
    unconfirmed) and, founding its own, split the job; it now waits to join. (515, 777, 936,
    1150 and 1396 found it first; 87 and 91 strike it in today's world.)"""
    seeds = [87, 91]
    assert all(o.ok for o in run_seeds(seeds, **AS_FOUND))
    monkeypatch.setattr(core.Engine, "_may_refound", lambda self, cand, statuses: True)
    violations = [o for o in run_seeds(seeds, **AS_FOUND) if not o.ok]
    assert violations, "a rejoiner founding its own group should split some of these seeds"
    assert f"python -m ftcomm.groupsim --seed {violations[0].seed}" in violations[0].violation


@pytest.fixture
def founding_as_before(monkeypatch):
    """Founding without the job's majority and without waiting for unconfirmed workers
    (the rules added when the seeds began to draw min_workers and faults from t = 0): the
    races below were found before them, and each guard they test must hold on its own."""
    monkeypatch.setattr(core.Engine, "_may_found_with", lambda self, cand, seeds, now: True)
    agree = core.Engine.agree
    monkeypatch.setattr(core.Engine, "agree", lambda self, now, statuses, unconfirmed=(), seeds=None:
                        agree(self, now, statuses, (), seeds))


def join_then_cut_off(seed: int, gap: float) -> groupsim.Outcome:
    """A fifth worker joins a group of four through its first member; ``gap`` seconds later,
    before its confirmation pings come back, a partition cuts it off from all of them."""
    faults = [(3.0, "join", {"pick": 0.0}), (3.0 + gap, "partition", {"length": 4.0, "pick": 0.0, "split": 0.99})]
    return GroupSimulation(seed, n=4, faults=faults, loss=0.0).run()


def test_a_joiner_that_cannot_reach_the_group_founds_none(monkeypatch, founding_as_before):
    """A worker joined through a member that a partition then cut off: it saw the group's
    view but no live member of it (the one it joined through suspect, the others not
    confirmed yet), founded its own group and committed step 1 a second time. It now waits
    to be admitted."""
    cases = [(seed, gap) for seed in range(4) for gap in (0.0005, 0.001, 0.002)]
    assert all(join_then_cut_off(seed, gap).ok for seed, gap in cases)
    monkeypatch.setattr(core.Engine, "_group_seen", lambda self: False)
    # Once the member it saw is no longer live here, the joiner founds nothing either
    # until the group's members are gone for sure (see the next test).
    assert all(join_then_cut_off(seed, gap).ok for seed, gap in cases)
    monkeypatch.setattr(core.Engine, "_may_found", lambda self: True)
    violations = [o for o in (join_then_cut_off(seed, gap) for seed, gap in cases) if not o.ok]
    assert violations and "commits step 1 in view 1 on the minority side" in violations[0].violation


def joiner_crashes_as_the_lost_node_returns(seed: int) -> groupsim.Outcome:
    """Three workers; worker 0's node is lost for 4.54 s; a worker joins meanwhile and
    crashes the moment the lost node returns, while the view admitting it formed on it
    only; 0.8 s later worker 1 crashes (the schedule of seed 4530, scripted)."""
    faults = [(4.0, "node_loss", {"length": 4.54, "pick": 0.0, "split": 0.5}), (5.2, "join", {"pick": 0.3}),
              (8.54, "crash", {"pick": 0.99}), (9.34, "crash", {"pick": 0.39})]
    # The hang detection the schedule was taken under (faster detection moves the race).
    return GroupSimulation(seed, n=3, faults=faults, loss=0.0, stall_probe_after=0.1,
                           gossip=GossipConfig(urgent_probe_timeout=0.2)).run()


def test_a_view_that_formed_only_on_a_member_that_died_does_not_hold_the_others_back():
    """A view admitting a joiner formed on the joiner only, failed on the others, and the
    joiner then crashed before anyone committed in it. Its record, naming that view,
    outlived it; the survivors entered the view too (their floor is above it), but a
    joiner took no proposal from a member whose current view was older than the newest
    record, and they waited on each other for ever. A member that entered a view is not
    left out of it (tests/test_engine.py shows the rule). Seeds 4530 and 12348 drew the
    race, and its schedule is replayed here, scripted; since a view is verified by every
    member before anyone runs it, a view forms on the joiner only in the instant between
    the others' contributions to the verification and their observing it, and these
    schedules no longer reach that instant."""
    outcomes = run_seeds([4530, 12348], **AS_FOUND) + [joiner_crashes_as_the_lost_node_returns(seed) for seed in (1, 2)]
    assert all(o.ok for o in outcomes), next(o.violation for o in outcomes if not o.ok)


def join_through_a_lost_node_then_crash(seed: int, after: float, crash: float, n: int = 3) -> groupsim.Outcome:
    """A node loss cuts worker 0 off; ``after`` seconds later a worker joins through it
    (only it: the lost node is the one it can reach); ``crash`` seconds later worker 0
    crashes, before or after the joiner read its view's member list."""
    faults = [(3.0, "node_loss", {"length": 15.0, "pick": 0.0, "split": 0.0}), (3.0 + after, "join", {"pick": 0.0}),
              (3.0 + after + crash, "crash", {"pick": 0.0})]
    return GroupSimulation(seed, n=n, faults=faults, loss=0.0).run()


def test_a_joiner_whose_only_contact_crashes_founds_nothing_and_finds_the_group(monkeypatch, founding_as_before):
    """The joiner's only contact, cut off from the group, crashed; the joiner had seen it
    run a view, and may never have read that view's member list. Its process refuses, but
    that proves only its own death. The joiner holds back (founding a group would commit
    the group's steps again), has its seeds contacted again, and is admitted once the
    group hears of it. (Seeds 10027, 11074, 11879, 16466 and 416 drew it first, when a
    worker started during a cut could still reach both sides.)"""
    cases = [(0, 7.0, 0.3), (1, 2.0, 0.005), (1, 4.0, 0.3), (1, 7.0, 1.0)]
    outcomes = [join_through_a_lost_node_then_crash(*case) for case in cases]
    assert all(o.ok for o in outcomes), next(o.violation for o in outcomes if not o.ok)
    monkeypatch.setattr(core.Engine, "_may_found", lambda self: True)
    violations = [o for o in (join_through_a_lost_node_then_crash(*case) for case in cases) if not o.ok]
    assert len(violations) == len(cases) and all("invariant 4" in o.violation for o in violations)


def winners_leave_while_cut_off(seed: int) -> groupsim.Outcome:
    """Five workers; a 3|2 partition for 8 s; the three on the majority side leave one by
    one (at 4, 6 and 8 s) while it lasts."""
    faults = [(3.0, "partition", {"length": 8.0, "pick": 0.0, "split": 0.6})]
    return GroupSimulation(seed, n=5, faults=faults + [(t, "leave", {"pick": 0.0}) for t in (4.0, 6.0, 8.0)],
                           loss=0.0).run()


def test_a_group_that_ended_by_leaving_is_not_resumed_from_an_older_state():
    """Every member of the newest view left while members holding an older view lived on:
    either the majority side formed a newer view and then left from it (going on from the
    older state would commit its steps again), or it left before forming one, while cut
    off, so that its final records reached nobody on the other side (its members are dead
    there, and two of five hold no quorum). Either way the minority waits (bounded by
    quorum_timeout and init_timeout in the library) and the simulation owes no liveness."""
    outcomes = [winners_leave_while_cut_off(seed) for seed in range(8)]
    assert all(o.ok for o in outcomes), next(o.violation for o in outcomes if not o.ok)
    assert not any(o.quorum_survived for o in outcomes)


def test_command_line_runs_seeds_and_one_seed():
    out = subprocess.run([sys.executable, "-m", "ftcomm.groupsim", "--seeds", "4", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["seeds"] == 4
    one = subprocess.run([sys.executable, "-m", "ftcomm.groupsim", "--seed", "5"], capture_output=True, text=True,
                         timeout=120)
    assert one.returncode == 0 and one.stdout.strip().endswith("OK"), one.stdout[-2000:]


def cut_before_the_state_arrives(seed: int, dt: float) -> groupsim.Outcome:
    """One worker founds the group and trains; two join at 1 s. Just as the view of all
    three is formed, and its state not yet received, a partition cuts the first worker off
    for 3 s (``dt`` before the view's first commit in the same seed without the fault)."""
    joins = [(1.0, "join", {}), (1.0, "join", {})]
    base = GroupSimulation(seed, n=1, faults=joins, duration=4.0)
    base.run()
    t = min(c[0] for c in base.workers[0].committed if c[2] >= 2)
    faults = joins + [(t + dt, "partition", {"length": 3.0, "pick": 0.0, "split": 0.01})]
    return GroupSimulation(seed, n=1, faults=faults, duration=8.0).run()


def test_joiners_cut_off_from_the_state_holder_before_receiving_it_do_not_go_on_without_it(monkeypatch):
    """The joiners were a majority of the view just formed, and went on from it with their
    own state (step 0), committing the group's steps again beside the state holder. A
    member that agreed as a joiner goes on from a view only once it reconciled in it."""
    cases = [(0, -0.08), (0, -0.06), (1, -0.08), (2, -0.08), (3, -0.08)]
    outcomes = [cut_before_the_state_arrives(*case) for case in cases]
    assert all(o.ok for o in outcomes), next(o.violation for o in outcomes if not o.ok)
    monkeypatch.setattr(core, "JOINED_WITHOUT_STATE", ())
    violations = [o for o in (cut_before_the_state_arrives(*case) for case in cases) if not o.ok]
    assert len(violations) == len(cases) and all("invariant 4" in o.violation for o in violations)


# ---------------------------------------------------------------------- guards of the shipped loop, switched off
# Each guard below is code of the worker loop that every seed runs; switched off, a
# violation appears within the seeds named (and the same seeds keep every invariant with
# it on). Were the simulation no longer to run that code, switching it off would change
# nothing and the test would fail.

def no_reconcile(self):
    """WorkerLoop._reconcile_formed that never transfers: every member keeps its state."""
    return Reconciled(False, None)
    yield  # noqa: unreachable - a phase


def decides_alone(self, decision, vote):
    """WorkerLoop._replica_decides that asks no other process of the replica: a step commits
    on the verdict of its own shard's reduction."""
    return vote
    yield  # noqa: unreachable - a phase


def churn(seed: int) -> GroupSimulation:
    """Seven workers, max_retries=1, a launcher; twelve crashes 0.12 s apart from 2 s."""
    faults = [(2.0 + 0.12 * i, "crash", {"pick": (0.37 * i) % 1}) for i in range(12)]
    return GroupSimulation(seed, n=7, faults=faults, launcher=True, max_retries=1)


GUARDS = {
    # name: (what is switched off, the seeds, what they show, replica size)
    "commit on the replica's verdict": (("_replica_decides", decides_alone), [213, 253], "invariant 3", 2),
    "reconcile after a view change": (("_reconcile_formed", no_reconcile), [0, 2, 3], "invariant 3", 1),
    "a straggler stands aside within min_workers": (
        ("chosen", staticmethod(lambda asking, world, min_workers: sorted(asking, reverse=True))),
        STRAGGLER_SEEDS, "invariant 9", 1),
}


@pytest.mark.parametrize("guard", sorted(GUARDS))
def test_a_guard_of_the_shipped_loop_switched_off_breaks_an_invariant(guard, monkeypatch):
    (name, replacement), seeds, shows, k = GUARDS[guard]
    assert all(o.ok for o in run_seeds(seeds, replica_size=k, **AS_FOUND))
    owner = Stragglers if name == "chosen" else WorkerLoop
    monkeypatch.setattr(owner, name, replacement)
    violations = [o for o in run_seeds(seeds, replica_size=k, **AS_FOUND) if not o.ok]
    assert violations and all(shows in o.violation for o in violations), [o.violation for o in violations]


def test_the_retry_limit_switched_off_lets_steps_fail_on_and_on(monkeypatch):
    outcomes = [churn(seed).run() for seed in range(2)]
    assert all(o.ok for o in outcomes) and all(o.exits.get("RetryLimitExceeded") for o in outcomes)
    monkeypatch.setattr(core.Engine, "count_failure", lambda self: False)
    violations = [o for o in (churn(seed).run() for seed in range(2)) if not o.ok]
    assert len(violations) == 2 and all("invariant 8" in o.violation for o in violations)


def test_a_collective_between_steps_waits_for_the_boundary_to_admit_a_joiner(monkeypatch):
    """Admitted in a metric's preparation, a joiner would be at its first gradient step
    while the others run the metric: every metric with a joiner on its way is abandoned
    (OutOfStep, which the scripts tolerate as the guide says). With joins at the step
    boundary only, none is."""
    seeds = [3, 9, 14]
    assert not any(o.exits.get("OutOfStep (tolerated)") for o in run_seeds(seeds, **AS_FOUND))
    monkeypatch.setattr(core.Engine, "due", lambda self, boundary=True: core.BOUNDARY.get(self.state, "resume"))
    assert all(o.exits.get("OutOfStep (tolerated)") for o in run_seeds(seeds, **AS_FOUND))


def test_a_call_between_steps_that_finds_the_members_elsewhere_is_not_run(monkeypatch):
    """Without OutOfStep, a worker back from a partition with the group's newer state runs
    again the metric of a step the group passed, and waits in it for ever."""
    seeds = [7, 72, 91]
    assert all(o.ok for o in run_seeds(seeds, **AS_FOUND))
    monkeypatch.setattr(WorkerLoop, "_check_in_step", lambda self, replaced, what: None)
    violations = [o for o in run_seeds(seeds, **AS_FOUND) if not o.ok]
    assert violations and all("invariant 6" in o.violation for o in violations)


def test_a_replica_that_received_some_of_its_shards_only_never_runs_with_its_shards_apart():
    """Seeds 2673 and 4309 of replicas: a joining replica's source died during the
    reconcile; one of its processes had received its shard, the other had not. That one ran
    the view alone, and the next view started the replica's shards a step apart. A replica
    now takes a state all or none (tests/test_worker.py shows each step)."""
    outcomes = run_seeds([2673, 4309], replica_size=2, **AS_FOUND)
    assert all(o.ok for o in outcomes), [o.violation for o in outcomes]


def test_a_member_left_out_of_a_group_that_ended_trains_on():
    """Seeds 279 and 1152 of replicas: the replica that went on as the tie's winner died (or
    left) while the other rejoined; the records of the newer view outlived it, and the
    survivor, holding the newest state, waited for ever. It now refounds once every member
    of the newer view left or refuses connections (tests/test_engine.py shows the rule;
    without it seed 1152 commits 114 steps, not 447). (Seed 602 replayed it until restarted
    replicas held back until their state was registered: its joiner no longer enters the
    tie winner's last view, which commits alone and dies with the newest state.)"""
    outcomes = run_seeds([279, 1152], replica_size=2, **AS_FOUND)
    assert all(o.ok for o in outcomes), [o.violation for o in outcomes]
    assert all(o.commits > 300 for o in outcomes)
    # Seed 6472 (plain): not on a tie of the view it lost, while a member of it that may be
    # in the newer view lives on (tests/test_engine.py shows the rule).
    outcome = run_seeds([6472], **AS_FOUND)[0]
    assert outcome.ok, outcome.violation


def test_a_group_that_started_over_is_not_counted_as_recovered():
    """Seeds 268 and 853 of replicas: every replica that held the state left, died or was
    cut off; the replicas left founded anew at step 0. That is no recovery, and its time
    (from the last worker's start to a fresh group's first commit) is not among the
    recoveries'. (Seed 412 showed it until restarted replicas held back until their state
    was registered.)"""
    kinds = set()
    for outcome in run_seeds([268, 853], replica_size=2, **AS_FOUND):
        assert outcome.ok, outcome.violation
        kinds |= {kind for kind, _ in outcome.started_over}
        struck = {t for _, t in outcome.started_over}
        assert not any(t in struck for _, t, *_ in outcome.recoveries)
    assert kinds >= {"leave", "crash", "hang"}


@pytest.mark.parametrize("stop_kills", [1.0, 0.0])
def test_a_stopped_rank_0_of_two_killed_by_its_launcher_leaves_a_survivor_that_trains_on(stop_kills):
    """ftcomm run kills a worker that stays stopped (--kill-stopped-after): its ports then
    refuse, which proves it gone, and the survivor of two goes on alone and is joined by
    the restarted worker. Without the launcher's kill, the survivor waits for the stopped
    one (it may be across a partition) until the stop ends."""
    faults = [(3.0, "hang", {"length": 8.0, "pick": 0.0})]  # the first worker started: rank 0
    world = GroupSimulation(5, n=2, faults=faults, loss=0.0, keep_live=1, launcher=True, min_workers=1,
                            stop_kills=stop_kills)
    outcome = world.run()
    assert outcome.ok, outcome.violation
    killed = [entry for entry in world.fault_log if entry[1] == "stopped_killed"]
    survivor = world.workers[1]  # the second worker started, rank 1
    while_stopped = [t for t, *_ in survivor.committed if 3.5 < t < 11.0]
    if stop_kills:
        assert len(killed) == 1 and 3.25 <= killed[0][0] <= 3.3
        assert while_stopped and min(while_stopped) < 5.0  # it went on soon after the kill
        assert any(entry[1] == "restart" for entry in world.fault_log)
    else:
        assert not killed and not while_stopped  # it waited for the stopped one


def test_a_straggler_standing_aside_counts_as_gone_for_the_majority_of_its_view():
    """Seed 1900: a straggler of a view of three stood aside; a moment later a node loss
    cut rank 1 off from rank 2. Without the straggler the two are a tie, which goes to the
    lower rank: the cut-off worker alone goes on (one group), the other waits; the
    simulation's check counts the straggler gone too, as the engine's quorum rule does."""
    outcome = run_seeds([1900], **AS_FOUND)[0]
    assert outcome.ok, outcome.violation
    assert any(kind == "node_loss" for kind, *_ in outcome.recoveries)


def test_a_fresh_group_needs_a_majority_of_its_job(monkeypatch):
    """Seed 1051: without the majority, two workers founded a group while the group that
    held the newest state lived on."""
    assert run_seeds([1051], **AS_FOUND)[0].ok
    monkeypatch.setattr(core.Engine, "_may_found_with", lambda self, cand, seeds, now: True)
    outcome = run_seeds([1051], **AS_FOUND)[0]
    assert not outcome.ok and "invariant 4" in outcome.violation


def test_production_code_never_imports_the_simulation():
    import pathlib
    import re
    root = pathlib.Path(groupsim.__file__).parent
    for path in [*root.glob("core/*.py"), *root.glob("runtime/*.py"), *root.glob("training/*.py"),
                 *root.glob("backends/*.py"), *root.glob("gossip/*.py"), *root.glob("ops/*.py"), root / "group.py"]:
        assert not re.search(r"^\s*(from|import)\s+(ftcomm\.|\.+)?(sim|groupsim)\b", path.read_text(), re.M), path


def two(kind: str, replica_size: int = 1) -> GroupSimulation:
    """Two workers (or two sharded replicas of two processes) and one fault of rank 0 at 3 s
    (a hang or node loss lasts 3 s)."""
    return GroupSimulation(1, n=2 * replica_size, replica_size=replica_size, duration=10.0, keep_live=1,
                           faults=[(3.0, kind, {"pick": 0.0, "length": 3.0})])


@pytest.mark.parametrize("replica_size", [1, 2], ids=["plain", "replicas"])
def test_the_survivor_of_two_goes_on_when_rank_0_dies(replica_size):
    """Alone, the survivor is no majority of the view of two (a tie goes to rank 0); rank 0's
    port refuses a connection, which proves its process gone: the survivor goes on within
    a second, instead of waiting out the quorum timeout."""
    sim = two("crash", replica_size)
    outcome = sim.run()
    assert outcome.ok, outcome.violation
    survivors = [sim.workers[node] for node in range(replica_size, 2 * replica_size)]  # the other replica
    for w in survivors:
        after = [t for t, *_ in w.committed if t > 3.0]
        assert after and after[0] < 4.0 and len(after) > 50, after[:3]
    assert outcome.recovery["crash"][0] < 1.0


@pytest.mark.parametrize("kind", ["node_loss", "hang"])
def test_the_survivor_of_two_waits_while_rank_0_may_live(kind):
    """A node lost or a process hung refuses nothing: rank 0 may be alive across a cut,
    training on as the tie's winner, so the survivor commits nothing until it is back."""
    sim = two(kind)
    outcome = sim.run()
    assert outcome.ok, outcome.violation
    rank0, survivor = sim.workers[0], sim.workers[1]
    assert not [t for t, *_ in survivor.committed if 3.2 < t < 6.0]
    assert [t for t, *_ in survivor.committed if t > 6.0]  # together again after it
    if kind == "node_loss":  # rank 0, cut off, trained on: the survivor received its state
        assert [t for t, *_ in rank0.committed if 3.2 < t < 6.0]
        assert rank0.loop.step == survivor.loop.step and rank0.state.value == survivor.state.value


def test_a_proof_of_death_that_is_not_fresh_splits_the_group(monkeypatch):
    """Seed 1393: a member cut off (or hung) for seconds came back, found the members it had
    lost sight of dead, and counted them out, while the group had gone on without it in a
    newer view it had not heard of yet: two groups committed the same steps. A refusal
    proves a death only for a member seen alive within PROOF_FRESH chase intervals."""
    assert run_seeds([1393], **BEFORE_RESTARTS_IN_PLACE)[0].ok
    monkeypatch.setattr(core, "PROOF_FRESH", 10 ** 9)
    outcome = run_seeds([1393], **BEFORE_RESTARTS_IN_PLACE)[0]
    assert not outcome.ok and "invariant 4" in outcome.violation, outcome.violation


def test_newcomers_below_min_workers_in_a_gossip_cluster_of_their_own_ask_their_seeds_again():
    """Seed 5855 (min_workers 3): two workers a launcher started again while the survivor
    was cut off and the other newcomer hung joined each other's gossip only; below
    min_workers, a fresh worker never asked its seeds again, and the two clusters never
    met (invariant 6). It now probes, and asks again, the seeds no live member answers from."""
    outcome = run_seeds([5855], **BEFORE_RESTARTS_IN_PLACE)[0]
    assert outcome.ok, outcome.violation
    assert outcome.settle_s is not None


def test_a_side_whose_other_side_died_is_not_a_minority():
    """Seeds 3570, 6920 and 9361: a worker cut off from the rest of its view went on once the
    others' ports refused (they had crashed); the check of the partition's minority counts
    the other side's dead as it counts its departed."""
    outcomes = run_seeds([3570, 6920, 9361], **BEFORE_RESTARTS_IN_PLACE)
    assert all(o.ok for o in outcomes), [o.violation for o in outcomes]


def test_a_member_that_fails_on_its_own_while_a_straggler_is_chosen_is_not_the_choice_s_fault():
    """Seed 7599 (min_workers 5 of 6): the step that chose the straggler was reduced with all
    six members' shares, one of which then raised RetryLimitExceeded (its own step had
    broken on a suspect) before the straggler stood aside, and the four left wait for its
    return. The choice was right for the step it was made in; invariant 9 judges it by the
    members that trained when that step began, and still catches a choice below min_workers
    (the guard test above)."""
    outcome = run_seeds([7599], **BEFORE_RESTARTS_IN_PLACE)[0]
    assert outcome.ok, outcome.violation
    assert outcome.exits.get("RetryLimitExceeded")


# Seeds 9 and 169 of plain workers whose scripts average a metric between backward and the
# step, in the world each was found in (the first call installed the hooks; no metric read).
BEFORE_HOOKS = {"first_step_overlaps": True, "metric_read": False, **BEFORE_RESTARTS_IN_PLACE}
STRADDLED = {9: {"overlap": False, "log_in_step": True, "transfer_s": 0.0, "observe_jitter": 0.02, **BEFORE_HOOKS},
             169: {"overlap": True, "log_in_step": True, "transfer_s": 0.24522133209016897, "observe_jitter": 0.0,
                   **BEFORE_HOOKS}}


def test_a_worker_whose_step_failed_into_a_view_of_members_elsewhere_skips_the_call_they_abandoned(monkeypatch):
    """Seed 9: the metric completed on two members and not yet on a third when the view
    broke; the two re-formed from it (and abandoned it, OutOfStep, the view not aligned),
    the third from its gradient step, and then made the call the others had abandoned,
    waiting in it for ever while they waited in the step. A failed step now settles no
    view: the call after it checks the view it re-formed into."""
    assert GroupSimulation(9, **STRADDLED[9]).run().ok
    settle_always = WorkerLoop._end_step
    monkeypatch.setattr(WorkerLoop, "_end_step", lambda self, committed, reduced=False: settle_always(self, committed, True))
    outcome = GroupSimulation(9, **STRADDLED[9]).run()
    assert not outcome.ok and "invariant 6" in outcome.violation


def test_a_worker_whose_share_of_a_step_went_with_the_old_view_still_runs_the_step(monkeypatch):
    """Seed 169: backward had begun reducing on two members when a straggler stood aside
    inside the metric's call; their share went with the old view (lost). Skipping the
    step, they went round to the metric again while the others waited in the step, for
    ever. The step now runs on every member, counting their gradients as none."""
    assert GroupSimulation(169, **STRADDLED[169]).run().ok
    shipped = WorkerLoop.gradient_step

    def skipping(self):  # the step before: a lost share skipped the step's reduction
        if self.ports.collective.lost:
            self.ports.collective.discard()
            self._end_step(False)
            return False
        return (yield from shipped(self))
    monkeypatch.setattr(WorkerLoop, "gradient_step", skipping)
    outcome = GroupSimulation(169, **STRADDLED[169]).run()
    assert not outcome.ok and "invariant 6" in outcome.violation


def test_a_step_committed_on_some_members_only_and_overwritten_by_a_later_view_is_a_rollback_not_two_groups():
    """Seeds 8392 and 5155 (the check, not the code): in 8392 a step committed on one member of
    a view of two only; the other, holding the tie, formed a view with a joiner and died
    while sending it the state, and the joiner alone committed the step again (view 5 does
    not share a member with view 3, but descends from it through view 4). In 5155 every
    worker of the first group ended on RetryLimitExceeded, its state gone with them, and
    the restarted workers' new group committed its steps again; a worker of that new group,
    cut off, held its step 6: not the old group's state. Neither is two groups committing
    the same step; a view that neither descends from the first commit's view, while a
    worker that ran that one's line still lives, is."""
    worlds = {8392: {"overlap": False, "log_in_step": True, "transfer_s": 0.15062724832125174, "observe_jitter": 0.02,
                     **BEFORE_HOOKS},
              5155: {"overlap": True, "log_in_step": False, "transfer_s": 0.13895733545174613, "observe_jitter": 0.0,
                     **BEFORE_HOOKS}}
    rolled = GroupSimulation(8392, **worlds[8392])
    assert rolled.run().ok and rolled.rolled_back >= 1
    started_over = GroupSimulation(5155, **worlds[5155])
    assert started_over.run().ok and started_over.lost_state > 0


def test_a_member_whose_formation_failed_as_the_others_formed_the_view_forms_no_second_group(monkeypatch):
    """Seed 8418 of plain workers: view 2 (rank 0 and one other) admitted a joiner; the cut
    isolating rank 0 came as view 3's verification completed on the other two and not on
    rank 0. They went on from view 3 (a majority of it); rank 0, seeing no record of view 3
    formed, held the tie of view 2 and formed a view alone, committing beside them. A
    candidate must be a quorum of a view entered and failed here too."""
    world = {"overlap": True, "log_in_step": True, "transfer_s": 0.0, "observe_jitter": 0.02,
             **BEFORE_RESTARTS_IN_PLACE}
    assert GroupSimulation(8418, **world).run().ok
    monkeypatch.setattr(core.Engine, "_quorum_of_entered", staticmethod(lambda *args: True))
    outcome = GroupSimulation(8418, **world).run()
    assert not outcome.ok and "invariant 4" in outcome.violation


def test_failed_steps_in_a_row_between_which_a_metric_completes_end_in_the_retry_limit():
    """Seeds 330 and 1705 of replicas (a metric averaged before each step): in 330 every
    step failed and re-formed while every metric completed, and each metric reset the
    count, so the user was never told (invariant 8); in 1705 a re-formation inside the
    metric was counted as the step's (the check's count now starts at the step). Since
    restarted replicas hold back until their state is registered, seed 330 no longer
    reaches that row (with a call ending the row it still passes): the rule is
    tests/test_worker.py::test_a_metric_that_completes_between_failed_steps_does_not_break_their_row."""
    worlds = {330: {"transfer_s": 0.09017202380220259, "observe_jitter": 0.005, **BEFORE_RESTARTS_IN_PLACE},
              1705: {"transfer_s": 0.12473094961957708, "observe_jitter": 0.02, **BEFORE_RESTARTS_IN_PLACE}}
    for seed, world in worlds.items():
        outcome = GroupSimulation(seed, replica_size=2, overlap=True, log_in_step=True, **world).run()
        assert outcome.ok, outcome.violation


RESTARTED_IN_PLACE = {1876: {"overlap": True, "log_in_step": False, "transfer_s": 0.0, "observe_jitter": 0.0,
                             "infant": True, "in_place": True, **NO_LATER_DRAWS},
                      1012: {"overlap": True, "log_in_step": False, "transfer_s": 0.20631978114970087,
                             "observe_jitter": 0.0, "infant": True, "in_place": False, **NO_LATER_DRAWS},
                      5415: {"overlap": True, "log_in_step": False, "transfer_s": 0.0, "observe_jitter": 0.005,
                             "infant": True, "in_place": False, **NO_LATER_DRAWS},
                      8081: {"overlap": True, "log_in_step": False, "transfer_s": 0.04662251891226672,
                             "observe_jitter": 0.02, "infant": True, "in_place": False, **NO_LATER_DRAWS}}
"""The worlds these seeds were found in: new workers struck soon after their start, and (1876)
a launcher that starts failed workers again at their addresses."""


def _group_members_of_the_newest_list(self, statuses):
    """Engine._group_members before seed 5415: the newest list alone."""
    known = [(key[0], members) for key, members in self.fetched.items() if key[0] >= self.saw_group]
    if self.entered_view is not None and self.entered_view.id >= self.saw_group:
        known.append((self.entered_view.id, self.entered_view.members))
    return max(known)[1] if known else None


def test_workers_restarted_across_a_partition_from_the_group_found_no_second_group(monkeypatch):
    """Seed 1876 of plain workers (six, min_workers 2): two had left, one had crashed, and a
    partition cut off the worker that carried the group on (with a joiner). The launcher
    started two crashed workers again on the other side: of their seeds, the two that left
    and the crashed one refused, the group's own answered nothing, so the two made a
    majority of their job as they knew it and founded a group at step 1 beside it. A
    restarted worker founds only once every seed answers or refuses."""
    world = RESTARTED_IN_PLACE[1876]
    assert GroupSimulation(1876, **world).run().ok
    monkeypatch.setattr(core.Engine, "group_ran", property(lambda self: False, lambda self, value: None))
    outcome = GroupSimulation(1876, **world).run()
    assert not outcome.ok and "invariant 4" in outcome.violation


def test_a_member_alone_in_its_view_waits_for_a_quorum_of_the_view_it_failed_to_form(caplog):
    """Seed 1012 of plain workers: the first worker founded alone (min_workers 1, started in
    turn) and entered a view with three joiners, whose formation failed as one crashed; then
    every joiner died, the last on a node cut off from it (nothing proves it gone). The view
    may have formed on the others, so it waits for a quorum of that view (no liveness is
    owed), and its notice names that view and the member it waits for."""
    outcome = GroupSimulation(1012, **RESTARTED_IN_PLACE[1012]).run()
    assert outcome.ok and not outcome.quorum_survived
    assert ("majority of view 3 (4 members), which this worker entered and failed to form" in caplog.text
            and "10.0.0.3:7946/7ebbc5e5 answers nothing" in caplog.text)


def test_a_group_whose_members_were_restarted_at_their_addresses_is_shown_gone():
    """Seed 205 of replicas: the first view lost a replica to a node loss in its reconcile,
    so every worker was a joiner again that had seen a group; the launcher started the
    replicas that failed again at their addresses. The replica left holding back probed the
    group's members for proof that the group was gone, and the new processes answered at
    the old addresses: no proof, and no group ever formed again. A member whose address
    a live process answers from under another id is gone. (The simulated prober knows a
    host, not a port: a live process answers for every port of its address, where a real
    restarted process binds a new rendezvous port and the old one refuses. The proof by
    address matters in reality for members probed at their gossip port: those in the
    list of the view but in no table of the prober.)"""
    world = {"overlap": True, "log_in_step": True, "transfer_s": 0.0, "observe_jitter": 0.0, "infant": False,
             "in_place": True}
    outcome = GroupSimulation(205, replica_size=2, **world).run()
    assert outcome.ok and outcome.commits > 0


def test_a_joiner_whose_view_committed_nothing_proves_the_group_gone_only_with_the_view_before(monkeypatch):
    """Seed 5415 of plain workers: a joiner entered view 8 with the group's last state
    holder and another joiner, never received the state, and both died; of view 6, which
    view 8 came from, a member left out of view 8 (hung, and in no table of the joiner) held
    the group's newest step. Probing view 8's members proved the group gone, and the joiner
    founded one at step 1 beside that member. View 8 committed nothing: without the list of
    the view before, nothing shows the group gone."""
    assert GroupSimulation(5415, **RESTARTED_IN_PLACE[5415]).run().ok
    monkeypatch.setattr(core.Engine, "_group_members", _group_members_of_the_newest_list)
    outcome = GroupSimulation(5415, **RESTARTED_IN_PLACE[5415]).run()
    assert not outcome.ok and "invariant 4" in outcome.violation


def test_a_straggler_chosen_by_a_step_whose_view_then_broke_re_forms_with_the_others():
    """Seed 8081 of plain workers: the metric after the step that chose a straggler found
    the view broken by gossip news and raised IllegalTransition ('broken' in ASIDE_DUE)."""
    outcome = GroupSimulation(8081, **RESTARTED_IN_PLACE[8081]).run()
    assert outcome.ok, outcome.violation


def test_a_straggler_standing_aside_is_not_waited_for_by_the_recovery_of_a_fault_on_another():
    """Seed 250: a slow member stood aside as a straggler for 2 s; a node loss struck another
    member while it was away. The other four committed in a view without the lost member
    0.86 s later; the straggler came back when its time aside ended, 1.7 s after that. The
    node loss's recovery is the four's: the straggler's return is its own, as a join is."""
    sim = GroupSimulation(250, **NO_LATER_DRAWS)
    outcome = sim.run()
    assert outcome.ok, outcome.violation
    (_, t, allowed, latency, _), = [r for r in sim.recoveries if r[0] == "node_loss"]
    aside = next(w for w in sim.workers.values() if any(kind == "slow" and who == w.id
                                                       for _, kind, who in outcome.faults))
    back = min(c[0] for c in aside.committed if c[0] > t)
    assert allowed + latency < back  # recovered before the straggler returned


def test_a_worker_started_with_other_settings_ends_on_config_mismatch_and_never_joins_a_view():
    """Seed 2: an operator scales up by hand with another min_workers. The new worker ends
    on ConfigMismatch, committing nothing; the group never includes it (invariant 11)."""
    sim = GroupSimulation(2)
    outcome = sim.run()
    assert outcome.ok, outcome.violation
    foreign, = [w for w in sim.workers.values() if w.foreign]
    assert foreign.exited and not foreign.committed and outcome.exits.get("ConfigMismatch") == 1
    assert not any(foreign.id in change.members for w in sim.workers.values() for change in w.loop.events
                   if not w.foreign)


def test_without_the_settings_check_a_worker_with_other_settings_trains_with_the_group(monkeypatch):
    monkeypatch.setattr(core, "settings_conflict", lambda *args: None)
    outcome = GroupSimulation(2).run()
    assert not outcome.ok and "invariant 11" in outcome.violation, outcome.violation
