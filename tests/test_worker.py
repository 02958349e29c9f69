"""The worker loop over ports answered by hand: each phase of a re-formation (agree, form,
verify, reconcile), of a step (contribute, wait, confirm, verdict, commit), of a collective
between steps and of leaving, and what each does when a port fails. (The same loop runs in
every seed of the whole-group simulation: tests/test_groupsim.py.)"""

from __future__ import annotations

import dataclasses
import types

import pytest

from ftcomm.core import engine as core
from ftcomm.core.view import JOINING, LEAVING, Status, StatusRecord, View
from ftcomm.errors import (CollectiveAborted, CommunicatorError, FtcommTimeout, OutOfStep, QuorumLost,
                           RetryLimitExceeded, StateLost)
from ftcomm.options import GroupOptions
from ftcomm.runtime.ports import Contribution, Counters, Formed, StateSummary
from ftcomm.runtime.worker import BEFORE_STEP, IN_STEP
from tests.conftest import CFG, status
from tests.fakeports import Op, Phase, World, world_for


def agreed(world: World, phase: Phase) -> Op:
    """Let ``b`` propose what ``a`` proposes; the forming operation the phase then waits on."""
    phase.settle()
    for _ in range(50):
        if world.engine.proposal is not None:
            break
        world.clock.t += 0.03
        phase.step()
    world.membership.shown["b"] = dataclasses.replace(world.membership.shown["b"], proposal=world.engine.proposal)
    return phase.until("form", clock=world.clock)


def pair(registered: bool = True, **options) -> tuple[World, Phase]:
    """Member "a" of a fresh pair a, b recovering ("init") up to its forming of view 1."""
    statuses = {m: status(m, JOINING, joined_at=i) for i, m in enumerate("ab")}
    world = world_for("a", statuses, GroupOptions(leave_grace=0.5, **options), registered=registered)
    phase = Phase(world.loop.recover("init", world.clock.t, 30.0))
    form = agreed(world, phase)
    assert form.args == (View(1, ("a", "b")),) and world.engine.state == core.FORMING
    return world, phase


def formed(world: World, phase: Phase, founding: bool = True, reason: str | None = None) -> None:
    """Answer the forming and the verification (every member founding, none begun; rank 0's
    ``reason``, else this member's)."""
    phase.waiting.done(None)
    verify = phase.until("verify")
    probe = verify.args[0]
    code = probe[8] if reason is None else core.reason_code(reason)
    verify.done([probe[0], probe[1], 1, 0 if not founding else 1, 1, 0, probe[6], probe[7], code])


def running(world: World | None = None, phase: Phase | None = None) -> World:
    """A pair that formed view 1 and reconciled (both at step 0, one state): RUNNING."""
    if world is None:
        world, phase = pair()
    formed(world, phase)
    gather = phase.until("gather_states")
    mine = gather.args[0]
    gather.done([mine, mine])
    assert phase.done and world.engine.state == core.RUNNING
    return world


# ---------------------------------------------------------------------- re-forming
def test_a_re_formation_agrees_forms_verifies_reconciles_and_records_the_view_change():
    world, phase = pair()
    formed(world, phase)
    gather = phase.until("gather_states")
    assert gather.args == (StateSummary(0, 11, 5),) and world.engine.state == core.RECONCILING
    gather.done([StateSummary(0, 11, 5), StateSummary(3, 14, 5)])  # b holds a newer state
    transfer = phase.until("transfer")
    assert transfer.args == (View(1, ("a", "b")), 1, True, 0)  # from rank 1, loaded here
    transfer.done(3)
    assert phase.done and phase.result is True  # the state was replaced
    assert world.engine.state == core.RUNNING and world.loop.step == 3
    change = world.loop.events[-1]
    assert (change.view_id, change.reason, change.added, change.step, change.state_digest) == (
        1, "init", ("a", "b"), 3, 14)
    assert world.engine.founding and world.engine.restorable


def test_every_member_records_rank_0_s_reason_for_a_view():
    """A member that saw the view break differently (here: it founds the view, rank 0 saw a
    crash) records the reason the verification reduced: rank 0's."""
    world, phase = pair()
    formed(world, phase, reason="crash")
    gather = phase.until("gather_states")
    gather.done([gather.args[0]] * 2)
    assert phase.done and world.loop.events[-1].reason == "crash"


def test_the_verification_carries_each_members_place_and_a_disagreement_on_the_digest_fails_the_view():
    world, phase = pair()
    phase.waiting.done(None)
    verify = phase.until("verify")
    check = int(View(1, ("a", "b")).digest, 16) >> 1
    # first view, no network check, not begun, before its first call
    assert verify.args[0] == [check, -check, 1, 0, 1, 0, 2, -2, core.reason_code("init")]  # a is rank 0
    verify.done([check - 1, -check, 1, 0, 1, 0, 2, -2, 0])  # another member formed another view under this id
    phase.settle()
    assert phase.waiting is not None and world.engine.agreeing and world.engine.floor == 2
    assert world.comms.abandoned >= 1


def test_a_reconcile_waits_for_the_state_to_be_registered():
    world, phase = pair(registered=False)
    formed(world, phase)
    assert phase.done and world.engine.state == core.RECONCILE_DUE and world.driver.reconciled[-1].deferred
    world.state.registered = True
    boundary = Phase(world.loop.boundary())
    gather = boundary.until("gather_states")
    gather.done([gather.args[0]] * 2)
    assert boundary.done and world.engine.state == core.RUNNING


@pytest.mark.parametrize("error", [CommunicatorError("b refused a connection"), FtcommTimeout("too slow"),
                                   CollectiveAborted("b is suspected")])
def test_a_failed_forming_agrees_again_and_declares_dead_the_members_whose_host_refuses(error):
    world, phase = pair()
    world.prober.answers = {("10.0.0.1", 7001): True}  # b's process is gone
    phase.waiting.fail(error)
    phase.step()
    assert world.engine.agreeing and world.engine.proposal is None  # withdrawn: the others stop at once
    assert world.membership.declared == ["b"] and world.comms.abandoned >= 1
    assert ("crash", "b") in [(kind, m) for _, kind, m in world.loop.news.faults]


def test_a_failed_reconcile_agrees_again_and_names_what_broke_the_view():
    world, phase = pair()
    formed(world, phase)
    world.prober.answers = {("10.0.0.1", 7001): True}
    phase.until("gather_states").fail(CommunicatorError("b refused a connection"))
    phase.step()
    assert world.engine.agreeing and world.driver.reason == "crash" and world.membership.declared == ["b"]
    assert world.prober.probed[-1][1] > 0  # a broken connection: a port that still accepts is tried again


def test_no_view_within_the_quorum_timeout_is_quorum_lost_naming_the_view():
    statuses = {"a": status("a", cv=1, alive=False), "b": status("b", cv=1), "c": status("c", cv=1, alive=False)}
    world = world_for("b", statuses)
    world.engine.view, world.engine.state = View(1, ("a", "b", "c")), core.RUNNING
    phase = Phase(world.loop.recover("hang", world.clock.t, 1.0))
    with pytest.raises(QuorumLost, match=r"majority of view 1 \(3 members\)"):
        for _ in range(200):
            world.clock.t += 0.05
            phase.step()


def test_a_worker_without_a_quorum_names_the_members_it_waits_for():
    statuses = {"a": status("a", cv=1, alive=False), "b": status("b", cv=1), "c": status("c", cv=1, alive=False)}
    world = world_for("b", statuses)
    world.engine.view, world.engine.state = View(1, ("a", "b", "c")), core.RUNNING
    text = world.loop._waiting_for()
    assert "majority of view 1 (3 members); a, c answer nothing and are not proven gone" in text
    world.engine.proven_gone = frozenset({"a"})
    assert "; c answers nothing and is not proven gone" in world.loop._waiting_for()


def test_a_fresh_worker_below_min_workers_says_so_in_replicas():
    world = world_for("a", {"a": status("a", JOINING)}, min_workers=2, replica=("R", 0, 2))
    phase = Phase(world.loop.recover("init", world.clock.t, 1.0))
    with pytest.raises(FtcommTimeout, match=r"min_workers=2 replicas \(4 processes\)"):
        for _ in range(200):
            world.clock.t += 0.05
            phase.step()


# ---------------------------------------------------------------------- gradient steps
def test_a_gradient_step_contributes_its_counters_and_commits_on_the_verdict():
    world = running()
    step = Phase(world.loop.gradient_step())
    reduce = step.until("reduce")
    assert reduce.args == (Contribution(True, False, None),)
    reduce.done(Counters(2.0, 0.0, ()))
    assert step.done and step.result is True and world.loop.step == 1 and world.collective.handed_back == [2.0]


def test_a_step_that_saw_a_joiner_admits_it_at_the_next_boundary_not_before_a_collective_between_steps():
    world = running()
    world.membership.shown["j"] = status("j", JOINING, joined_at=9.0)
    step = Phase(world.loop.gradient_step())
    reduce = step.until("reduce")
    assert reduce.args[0].join
    reduce.done(Counters(2.0, 1.0, ()))
    assert step.done and world.engine.state == core.JOIN_DUE
    metric = Phase(world.loop.collective("the mean loss"))
    metric.until("run").done(1.0)
    assert metric.done and world.engine.state == core.JOIN_DUE  # run in the view every member is still in
    boundary = Phase(world.loop.boundary())
    boundary.step()
    assert world.engine.agreeing  # re-forming for the joiner


def test_a_failed_step_re_forms_and_returns_false_and_too_many_in_a_row_raise():
    world = running(*pair(max_retries=1))
    step = Phase(world.loop.gradient_step())
    step.until("reduce").fail(CollectiveAborted("b is suspected"))
    agreed(world, step)  # b answers again: view 2
    formed(world, step, founding=False)
    gather = step.until("gather_states")
    gather.done([gather.args[0]] * 2)
    assert step.done and step.result is False and world.engine.view.id == 2
    step = Phase(world.loop.gradient_step())
    step.until("reduce").fail(CollectiveAborted("b is suspected"))
    with pytest.raises(RetryLimitExceeded, match="2 steps in a row"):
        step.settle()
    assert world.engine.state == core.BROKEN  # re-formed at the next call



def test_a_metric_that_completes_between_failed_steps_does_not_break_their_row():
    """Seed 330 of replicas in the simulation, before restarted replicas held back until
    their state was registered: a metric averaged before each step completed every time
    while every step failed and re-formed. Counted as one row of operations, each metric
    reset it and the user never learned that every step was discarded."""
    world = running(*pair(max_retries=1))
    step = Phase(world.loop.gradient_step())
    step.until("reduce").fail(CollectiveAborted("b is suspected"))
    agreed(world, step)
    formed(world, step, founding=False)
    gather = step.until("gather_states")
    gather.done([gather.args[0]] * 2)
    assert step.done and step.result is False
    metric = Phase(world.loop.execute(lambda: world.loop.collective("the mean loss")))  # as ft.execute does
    metric.until("run").done(1.0)
    assert metric.done and metric.result == 1.0  # a call completed between the failed steps
    step = Phase(world.loop.gradient_step())
    step.until("reduce").fail(CollectiveAborted("b is suspected"))
    with pytest.raises(RetryLimitExceeded, match="2 steps in a row"):
        step.settle()

def test_a_member_that_left_after_deciding_the_step_lets_this_replica_decide_it_too():
    """b0 and b1 committed the step and left (the end of the job) while this replica still
    decides it: the departure is held until the decision is in, and the step commits here
    as it did there (the departure, judged first, made this replica alone discard it)."""
    statuses = {m: status(m, cv=1, replica=("A" if m < "b" else "B", m[-1] == "1" and 1 or 0, 2))
                for m in ("a0", "a1", "b0", "b1")}
    world = world_for("a0", statuses, replica=("A", 0, 2))
    view = View(1, ("a0", "a1", "b0", "b1"))
    world.engine.view, world.engine.state = view, core.RUNNING
    step = Phase(world.loop.gradient_step())
    step.until("reduce").done(Counters(2.0, 0.0, ()))
    step.until("view_sum").done([4.0, 0.0, 0.0])
    decide = step.until("replica_decide")
    for member in ("b0", "b1"):  # their final records: this view, one operation completed
        record = StatusRecord(LEAVING, 0, (1, view.digest), 0.0, CFG, 1, 4000, done_ops=(1, 1),
                              view_digest=view.digest)
        world.loop.news.post(types.SimpleNamespace(kind="left", member=types.SimpleNamespace(
            id=member, state="left", metadata=record.encode())))
    world.loop.news.judge()
    assert world.loop.news.abort.reason is None  # held while the step is decided here
    decide.done(True)
    assert step.done and step.result is True and world.loop.step == 1
    assert world.loop.news.abort.reason is not None  # then the view re-forms without them


def test_a_step_a_partner_of_the_replica_did_not_complete_breaks_the_view_here_too():
    statuses = {m: status(m, cv=1, replica=("A" if m < "b" else "B", m[-1] == "1" and 1 or 0, 2))
                for m in ("a0", "a1", "b0", "b1")}
    world = world_for("a0", statuses, replica=("A", 0, 2))
    world.engine.view, world.engine.state = View(1, ("a0", "a1", "b0", "b1")), core.RUNNING
    step = Phase(world.loop.gradient_step())
    step.until("reduce").done(Counters(2.0, 0.0, ()))
    step.until("view_sum").done([4.0, 0.0, 0.0])
    agree = step.until("replica_decide")
    assert agree.args == (("step", 1, world.engine.view.digest, 1), True)
    agree.done(False)  # a1's step failed
    assert step.done and step.result is False and world.engine.state == core.BROKEN and world.loop.step == 0


def joining_replica_process(shard: int) -> tuple[World, Phase]:
    """Shard ``shard`` of replica B, which joined view 2 of replicas A (at step 5) and B (at
    step 0) and reconciles now (deferred until its state was registered): the boundary
    phase, at its gather of the members' states."""
    members = ("a0", "a1", "b0", "b1")
    statuses = {m: status(m, cv=2, replica=(m[0].upper(), int(m[1]), 2)) for m in members}
    me = f"b{shard}"
    world = world_for(me, statuses, replica=("B", shard, 2))
    engine = world.engine
    engine.view, engine.state, engine.joined_unreconciled, engine.started = View(2, members), core.RECONCILE_DUE, True, True
    engine.formed_from = core.JOINING
    return world, Phase(world.loop.boundary())


def summaries(*steps: int) -> list[StateSummary]:
    return [StateSummary(step, 11 + step, 5) for step in steps]


def test_a_replica_that_received_some_of_its_shards_only_is_a_joiner_again_as_a_whole():
    # b1 received its shard from a1; b0's source, a0, died meanwhile: b0 never votes, and its
    # slot is vetoed. b1 holds no model (shard 1 of step 5, shard 0 of step 0): it must not
    # run the view, nor count as a holder of the group's state when the view is re-formed.
    world, phase = joining_replica_process(1)
    phase.until("gather_states").done(summaries(5, 5, 0, 0))
    transfer = phase.until("transfer")
    assert transfer.args[1:] == (0, True, 0)  # from replica A (view replica 0), loaded
    transfer.done(5)
    decide = phase.until("replica_decide")
    assert decide.args == (("reconcile", 2, world.engine.view.digest, 1), True)
    decide.done(False)
    assert phase.done and world.engine.state == core.BROKEN and world.loop.step == 5
    world.engine.broken()
    assert world.engine.state == core.JOINING and world.engine.view is None  # a joiner again


def reconciled_replica_process() -> tuple[World, Op]:
    """Shard 0 of replica B once every shard of it received the state of step 5 (its
    replica decided the reconcile: the decision returned)."""
    world, phase = joining_replica_process(0)
    phase.until("gather_states").done(summaries(5, 5, 0, 0))
    phase.until("transfer").done(5)
    decide = phase.until("replica_decide")
    decide.done(True)
    assert phase.done
    return world, decide


def test_a_replica_whose_every_shard_received_the_state_runs_the_view():
    world, _ = reconciled_replica_process()
    assert world.engine.state == core.RUNNING and world.loop.step == 5
    assert not world.engine.joined_unreconciled


def test_a_second_reconcile_in_the_same_view_is_a_decision_of_its_own():
    # A restore in a running view reconciles again: its vote must not land in the slot the
    # first reconcile's votes filled (write-once: it would read their answer, not its own).
    world, first = reconciled_replica_process()
    assert world.engine.state == core.RUNNING
    world.engine.restored()
    again = Phase(world.loop.boundary())
    again.until("gather_states").done(summaries(5, 5, 5, 5))
    second = again.until("replica_decide")
    assert second.args[0] != first.args[0] and second.args[0][:3] == first.args[0][:3]
    second.done(True)
    assert again.done and world.engine.state == core.RUNNING


def test_shards_whose_newest_states_are_of_different_steps_end_in_state_lost():
    # The replicas that held step 5 are gone; b0 got shard 0 of it before its replica's
    # reconcile failed, b1 never did: no member holds a whole model of the newest step.
    world, phase = joining_replica_process(0)
    with pytest.raises(StateLost, match=r"newest step of each shard: \[5, 0\]"):
        phase.until("gather_states").done(summaries(5, 0, 0, 0))
        phase.settle()


# ---------------------------------------------------------------------- collectives between steps
def metric_re_formed_at_the_same_call(world: World) -> Phase:
    """``world``'s execute() of a metric fails ("c left"), re-forms into a view whose every
    member is at the same call, and runs again: the call, its metric answered 2.5."""
    def attempt():
        return (yield from world.loop.collective("the mean loss"))
    call = Phase(world.loop.execute(attempt))
    call.until("run").fail(CollectiveAborted("c left"))
    call.step()
    agreed(world, call)
    world.membership.shown["b"] = dataclasses.replace(world.membership.shown["b"], proposal=world.engine.proposal)
    call.waiting.done(None)
    verify = call.until("verify")
    position = verify.args[0][6]
    assert position == world.loop.position > 0
    verify.done([*verify.args[0][:6], position, -position, verify.args[0][8]])  # every member at this call
    gather = call.until("gather_states")
    gather.done([gather.args[0]] * 2)
    call.until("run").done(2.5)
    return call


def test_execute_runs_again_when_every_member_of_the_new_view_is_at_the_same_call():
    call = metric_re_formed_at_the_same_call(running())
    assert call.done and call.result == 2.5


def test_a_metric_after_the_step_that_chose_a_straggler_re_forms_when_news_broke_the_view():
    """Seed 8081 of plain workers: the step chose this worker to stand aside (ASIDE_DUE,
    done at the next step boundary); before the metric that follows the step, gossip news
    broke the view. It re-forms with the others (its standing aside judged again later)
    instead of raising IllegalTransition."""
    world = running()
    world.engine.state = core.ASIDE_DUE
    world.loop.news.post(types.SimpleNamespace(kind="dead", member=types.SimpleNamespace(
        id="b", state="dead", metadata=None)))

    def attempt():
        return (yield from world.loop.collective("a metric"))
    call = Phase(world.loop.execute(attempt))
    call.settle()
    assert world.engine.state in (core.AGREEING, core.FORMING) and not call.done


def execute_reformed(reason: str) -> tuple[World, Phase, Phase]:
    """A running pair whose execute() failed (``reason``) and re-agreed: the world, the
    call, and the new view's verification, unanswered."""
    world = running()

    def attempt():
        return (yield from world.loop.collective("a metric"))
    call = Phase(world.loop.execute(attempt))
    call.until("run").fail(CollectiveAborted(reason))
    call.step()
    agreed(world, call)
    call.waiting.done(None)
    return world, call, call.until("verify")


def test_execute_whose_new_view_finds_members_elsewhere_is_out_of_step():
    world, call, verify = execute_reformed("c left")
    verify.done([*verify.args[0][:6], 0, -verify.args[0][6], verify.args[0][8]])  # a member is at its gradient step
    gather = call.until("gather_states")
    gather.done([gather.args[0]] * 2)
    with pytest.raises(OutOfStep, match="other places of the training"):
        while not call.done:
            call.step()


@pytest.mark.parametrize("elsewhere", [1 + 4096 + 1, IN_STEP], ids=["in-a-call", "reducing-at-once"])
def test_a_call_after_a_failed_step_whose_new_view_found_members_elsewhere_is_out_of_step_too(elsewhere):
    """A member whose gradient step failed re-formed into a view whose other member was
    elsewhere: in an execute called between backward and the step (it abandons the call,
    OutOfStep; a seed of the simulation found the hang when this one then made that call),
    or in a step whose gradients were computed, re-formed before its reduction and reducing
    at once (IN_STEP). This member computes the step again, so its own next call, before
    the step, is abandoned too instead of waiting for a member that never makes it."""
    world = running()
    step = Phase(world.loop.gradient_step())
    step.until("reduce").fail(CollectiveAborted("c is suspected"))
    agreed(world, step)
    step.waiting.done(None)
    verify = step.until("verify")
    assert verify.args[0][6] == BEFORE_STEP
    verify.done([*verify.args[0][:6], min(elsewhere, BEFORE_STEP), -max(elsewhere, BEFORE_STEP), verify.args[0][8]])
    gather = step.until("gather_states")
    gather.done([gather.args[0]] * 2)
    assert step.done and step.result is False and not world.loop.aligned

    def attempt():
        return (yield from world.loop.collective("the mean loss"))
    with pytest.raises(OutOfStep, match="other places of the training"):
        Phase(world.loop.execute(attempt)).settle()
    assert not any(op.kind == "run" for op in world.collective.ops)


def test_a_step_that_re_forms_before_its_reduction_tells_its_place_apart_from_a_step_boundary():
    """The view broke while this member computed (news before its reduction): it re-forms in
    the step's preparation and reduces at once in the new view, so it tells the verification
    it is in the step (IN_STEP), not at a boundary where a call before the step may come first."""
    world = running()
    world.loop.driver.perform(world.engine.failed("crash"))
    step = Phase(world.loop.gradient_step())
    agreed(world, step)
    step.waiting.done(None)
    verify = step.until("verify")
    assert verify.args[0][6] == IN_STEP == -verify.args[0][7]


def test_a_step_whose_reduction_was_dropped_with_the_view_still_takes_part_contributing_none():
    """Backward began reducing, then the view re-formed in an execute before the step: this
    member's share went with the old view. It runs the step's reduction all the same
    (members whose backward had not begun run it) with its gradients counted as none, and
    commits on the same verdict as they do."""
    world = running()
    world.collective.touched = True  # backward began reducing
    call = metric_re_formed_at_the_same_call(world)
    assert call.done and world.collective.lost
    step = Phase(world.loop.gradient_step())
    reduce = step.until("reduce")
    assert reduce.args == (Contribution(False, False, None),) and not world.collective.lost
    reduce.done(Counters(1.0, 0.0, ()))
    assert step.done and step.result is True and world.loop.step == 1


def test_execute_that_received_the_groups_newer_state_is_out_of_step():
    world, call, verify = execute_reformed("the view moved on")
    position = verify.args[0][6]
    probe = verify.args[0]
    verify.done([*probe[:4], 0, probe[5], position, -position, probe[8]])  # the other member has begun training
    gather = call.until("gather_states")
    gather.done([gather.args[0], StateSummary(40, 51, 5)])  # the group went on to step 40
    call.until("transfer").done(40)
    with pytest.raises(OutOfStep, match="state was replaced"):
        call.step()
    assert world.loop.step == 40


def test_a_call_before_training_that_received_another_members_state_runs():
    """In a view where nobody has begun training (a restore, say), a state received from
    another member is no sign of being left behind: the call goes on."""
    world, call, verify = execute_reformed("a member left")
    verify.done(verify.args[0])  # the same place, and nobody has begun
    gather = call.until("gather_states")
    gather.done([gather.args[0], StateSummary(40, 51, 5)])
    call.until("transfer").done(40)
    call.until("run").done(7)
    assert call.done and call.result == 7 and world.loop.step == 40


# ---------------------------------------------------------------------- leaving
def test_leaving_says_so_lets_the_others_finish_and_stops_the_gossip():
    world = running()
    world.loop.operation_done()
    leave = Phase(world.loop.leave())
    assert world.engine.state == core.LEAVING and world.loop.news.abort.reason == "this worker is shutting down"
    record = Status.from_metadata("a", "alive", world.membership.published[-1])
    assert record.phase == "leaving" and world.membership.left
    for _ in range(100):  # b still runs the view: asked directly, until the grace runs out
        if leave.done:
            break
        world.clock.t += 0.05
        leave.step()
    assert leave.done and world.membership.stopped and world.engine.state == core.CLOSED
    assert world.membership.exchanged and world.comms.abandoned >= 1
    assert list(world.loop.leave()) == []  # a second call does nothing


def test_a_leaver_waits_for_a_suspect_member_still_in_its_view():
    """On a busy host a slower member may be suspect for a moment while it still reads the
    operation this worker completed: it has not moved on, so the leaver's connections stay
    up (at most leave_grace). Dead, its port refusing connections, or no longer proposing
    the view, it has moved on."""
    world = running()
    world.loop.operation_done()
    world.membership.shown["b"] = dataclasses.replace(world.membership.shown["b"], alive=False)  # suspect
    leave = Phase(world.loop.leave())
    spread = world.clock.t + world.membership.propagate_time()
    while world.clock.t < spread + 0.2:
        world.clock.t += 0.05
        leave.step()
    assert not leave.done and not world.membership.stopped
    world.membership.shown["b"] = dataclasses.replace(world.membership.shown["b"], dead=True)
    world.clock.t += 0.05
    leave.step()
    assert leave.done and world.membership.stopped


def test_a_leaver_does_not_wait_for_a_suspect_whose_port_refuses():
    world = running()
    world.loop.operation_done()
    world.membership.shown["b"] = dataclasses.replace(world.membership.shown["b"], alive=False)  # suspect
    world.prober.answers = {("10.0.0.1", 4000): True}  # its process is gone (b's rendezvous port)
    began = world.clock.t
    leave = Phase(world.loop.leave())
    while not leave.done and world.clock.t < began + 5:
        world.clock.t += 0.01
        leave.step()
    # gone once the notice spread, well before the grace (0.5 s here) runs out
    assert leave.done and world.clock.t - began < world.membership.propagate_time() + 0.1
