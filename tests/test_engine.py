"""The engine core: its transition table, agreement decisions and what breaks a view."""

from __future__ import annotations

import dataclasses

import pytest

from ftcomm.core import engine as core
from ftcomm.core.engine import (
    Announce,
    Engine,
    Fetch,
    Form,
    ProbeMembers,
    Publish,
    PublishProposal,
    Recontact,
    Rejoined,
    Sync,
)
from ftcomm.core.view import ACTIVE, JOINING, LEAVING, Candidate, Status, View
from tests.conftest import CFG, published, status


def engine(member: str = "a", **kw) -> Engine:
    return Engine(member, CFG, settle_interval=0.05, chase_interval=0.6, rendezvous_port=4000, **kw)


def agree_until_form(e: Engine, statuses: dict, start: float = 0.0) -> tuple[list, float]:
    """Call agree every 10 ms (others echo this member's proposal) until it forms."""
    now, actions = start, []
    for _ in range(100):
        step = e.agree(now, statuses)
        actions += step
        if step and isinstance(step[-1], Form):
            return actions, now
        if e.proposal is not None:
            statuses = {m: (s if m == e.id else Status(**{**s.__dict__, "proposal": e.proposal}))
                        for m, s in statuses.items()}
            statuses[e.id] = Status(**{**statuses[e.id].__dict__, "proposal": e.proposal})
        now += 0.01
    raise AssertionError(f"no Form after 1 s: {actions}")


def test_a_fresh_group_agrees_publishes_and_forms_after_the_settle_interval():
    e = engine()
    statuses = {m: status(m, JOINING, joined_at=i) for i, m in enumerate("abc")}
    actions, formed_at = agree_until_form(e, statuses)
    assert formed_at >= 0.05
    proposal = next(a for a in actions if isinstance(a, PublishProposal))
    assert proposal.members == ("a", "b", "c") and proposal.view_id == 1
    assert any(isinstance(a, Publish) for a in actions)
    assert Announce(("a", "b", "c")) in actions  # the proposal goes straight to the members waiting on it
    assert e.state == core.FORMING and e.forming == View(1, ("a", "b", "c"))
    e.formed()
    assert (e.state, e.view, e.phase, e.current_view) == (core.RECONCILING, View(1, ("a", "b", "c")), ACTIVE, 1)
    e.reconciled()
    assert e.state == core.RUNNING


def test_illegal_inputs_raise():
    e = engine()
    with pytest.raises(core.IllegalTransition):
        e.formed()
    with pytest.raises(core.IllegalTransition):
        e.broken()
    e.leave()
    with pytest.raises(core.IllegalTransition):
        e.agree(0.0, {})
    e.closed()
    assert e.state == core.CLOSED and e.leave() == []


def running(e: Engine, members=("a", "b", "c"), view_id: int = 1) -> Engine:
    statuses = {m: status(m, JOINING, joined_at=i) for i, m in enumerate(members)}
    agree_until_form(e, statuses)
    e.formed()
    e.reconciled()
    assert e.view.id == view_id
    return e


def test_a_failed_formation_withdraws_the_proposal_and_raises_the_floor():
    e = engine()
    statuses = {m: status(m, JOINING, joined_at=i) for i, m in enumerate("ab")}
    agree_until_form(e, statuses)
    assert e.form_failed() == [Publish()]
    assert (e.state, e.proposal, e.floor) == (core.JOINING, None, 2)  # had no view: a joiner again
    actions, _ = agree_until_form(e, statuses)
    assert next(a for a in actions if isinstance(a, PublishProposal)).view_id == 2


def test_a_member_without_a_quorum_asks_its_seeds_to_let_it_in_again_once_per_chase_interval():
    """Cut off long enough, the group may have forgotten it (and it the group's newer
    members): a join request to its seeds lets the two sides meet again after the heal."""
    e = running(engine())
    e.broken()
    statuses = {"a": status("a", cv=1), "b": status("b", cv=1, alive=False, dead=True),
                "c": status("c", cv=1, alive=False, dead=True)}
    def recontacts(now: float) -> list:
        return [a for a in e.agree(now, statuses) if not isinstance(a, core.ProbeMembers)]  # (b and c: no answer)
    assert recontacts(5.0) == [Recontact()]
    assert recontacts(5.3) == []
    assert recontacts(5.7) == [Recontact()] and e.state == core.AGREEING
    assert recontacts(6.5) == []  # then twice as long each time
    assert recontacts(6.95) == [Recontact()]


def test_a_member_below_min_workers_with_its_quorum_waits_for_workers_without_recontacting():
    e = running(engine(min_workers=3))
    e.broken()
    statuses = {"a": status("a", cv=1), "b": status("b", cv=1), "c": status("c", cv=1, alive=False, dead=True)}
    assert [a for t in range(20) for a in e.agree(5.0 + t, statuses) if isinstance(a, Recontact)] == []


def test_a_member_that_lost_its_view_and_sees_no_group_recontacts_too():
    e = running(engine())
    e.broken()
    newer = {"a": status("a", cv=1), "b": status("b", cv=2), "c": status("c", cv=2)}
    e.agree(5.0, newer)  # superseded: it rejoins
    assert e.state == core.REJOINING
    cut_off = {"a": status("a", JOINING), "b": status("b", cv=2, alive=False, dead=True),
               "c": status("c", cv=2, alive=False, dead=True)}
    assert Recontact() in e.agree(6.0, cut_off)


def test_a_member_left_out_of_a_newer_view_rejoins():
    e = running(engine())
    e.broken()
    statuses = {"a": status("a", cv=1), "b": status("b", cv=3), "c": status("c", cv=3)}
    actions = e.agree(1.0, statuses)
    assert isinstance(actions[0], Rejoined) and Publish() in actions
    assert (e.state, e.view, e.lost, e.phase) == (core.REJOINING, None, View(1, ("a", "b", "c")), JOINING)


def test_a_joiner_fetches_the_proposal_then_adopts_it():
    e = engine("j", joined_at=5.0)
    key = (2, View(2, ("a", "b", "j")).digest)
    statuses = {"a": status("a", cv=1, proposal=key), "b": status("b", cv=1, proposal=key),
                "j": status("j", JOINING, joined_at=5.0)}
    assert e.agree(0.0, statuses) == [Fetch("a", key)]  # one read per proposal and look
    e.fetched_proposal(key, None)  # no answer (not stored yet, or "a" died since it proposed)
    assert e.agree(0.01, statuses) == [Fetch("b", key)]  # the proposer not asked yet
    e.fetched_proposal(key, None)
    # both asked a moment ago; meanwhile its record goes straight to the group (at most
    # every chase interval: a record changed while it was cut off may not have reached it)
    assert e.agree(0.02, statuses) == [Announce(("a", "b"))]
    assert e.agree(0.03, statuses) == []
    assert e.agree(0.07, statuses) == [Fetch("a", key)]  # then again, the one asked longest ago first
    e.fetched_proposal(key, ("a", "b", "j"))
    assert e.agree(0.08, statuses) == [Publish(), Announce(("a", "b", "j"))] and e.proposal == key
    statuses["j"] = status("j", JOINING, joined_at=5.0, proposal=key)
    assert e.agree(0.09, statuses) == [Form(View(2, ("a", "b", "j")))]


def test_a_joiner_asks_the_proposers_in_turn_while_one_of_them_does_not_answer():
    """A proposer died after it proposed, before gossip says so: each read from it gets no
    answer (the driver gives up after FETCH_TIMEOUT_S). The joiner asks the other proposer
    next and adopts the view the survivors wait on it for."""
    e = engine("j", joined_at=5.0)
    key = (5, View(5, ("a", "b", "j")).digest)
    statuses = {"a": status("a", cv=4, proposal=key), "b": status("b", cv=4, proposal=key),
                "j": status("j", JOINING, joined_at=5.0)}
    dead, now, asked = "a", 0.0, []
    for _ in range(10):
        actions = e.agree(now, statuses)
        fetches = [a for a in actions if isinstance(a, Fetch)]
        assert len(fetches) <= 1
        for fetch in fetches:
            asked.append(fetch.member)
            e.fetched_proposal(fetch.key, None if fetch.member == dead else ("a", "b", "j"))
            now += core.FETCH_TIMEOUT_S if fetch.member == dead else 0.001
        if e.proposal == key:
            break
        now += 0.02
    assert asked == ["a", "b"] and e.proposal == key


def with_proposal(s: Status, key, agreed=None) -> Status:
    return Status(**{**s.__dict__, "proposal": key, "agreed": agreed})


def test_above_the_announce_limit_rank_0_collects_the_proposals_and_tells_every_member():
    """One datagram per member to rank 0 and one from it to each, instead of one per pair;
    a member enters only a view that rank 0 saw every member propose."""
    statuses = {m: status(m, JOINING, joined_at=i) for i, m in enumerate("abc")}
    b = engine("b", announce_limit=2)
    actions = []
    for now in (0.0, 0.03, 0.06):
        actions += b.agree(now, statuses)
    key = b.proposal
    assert key is not None and Announce(("a",)) in actions and Announce(("a", "b", "c")) not in actions
    # rank 0 saw b and c propose it: it enters, says so in its record and announces that record to all
    a = engine("a", announce_limit=2)
    for now in (0.0, 0.03, 0.06):
        a.agree(now, statuses)
    echo = {m: with_proposal(s, key) for m, s in statuses.items()}
    assert a.agree(0.09, echo) == [Publish(), Announce(("a", "b", "c")), Form(View(1, ("a", "b", "c")))]
    assert a.witnessed == key and a.vouched == frozenset()
    # b has not seen c's proposal (gossip is slow at this size): rank 0's word suffices
    seen = {"a": with_proposal(statuses["a"], key, agreed=key), "b": with_proposal(statuses["b"], key),
            "c": statuses["c"]}
    assert b.agree(0.09, {**seen, "a": with_proposal(statuses["a"], key)}) == []  # rank 0 has not seen them all
    assert b.agree(0.10, seen) == [Form(View(1, ("a", "b", "c")))] and b.vouched == {"c"}
    # c's older record (from before its proposal) may still arrive: not held against the view
    assert b.damage("metadata", "c", statuses["c"], 0) is None
    assert b.damage("metadata", "c", Status(**{**statuses["c"].__dict__, "floor": 2}), 0) is not None  # gave up
    assert b.damage("metadata", "a", statuses["a"], 0) is not None  # rank 0's was seen here: news
    assert b.damage("suspect", "c", statuses["c"], 0) is not None
    # rank 0 giving up tells every member at once, and withdraws its word
    assert a.form_failed() == [Publish(), Announce(("a", "b", "c"))] and a.witnessed is None


def test_a_member_whose_proposal_is_late_gets_a_sync_each_interval():
    e = engine()
    statuses = {m: status(m, JOINING, joined_at=i) for i, m in enumerate("abcde")}
    now = 0.0
    for _ in range(10):  # settle and publish
        e.agree(now, statuses)
        now += 0.01
    key = e.proposal
    echo = {m: Status(**{**s.__dict__, "proposal": key}) for m, s in statuses.items() if m != "e"}
    echo["e"] = statuses["e"]  # e never shows the proposal
    syncs = []
    while now < 2.0:
        syncs += [(round(now, 2), a.member) for a in e.agree(now, echo) if isinstance(a, Sync)]
        now += 0.01
    assert [m for _, m in syncs] == ["e"] * len(syncs) and 2 <= len(syncs) <= 3
    assert all(b - a >= 0.6 - 1e-9 for (a, _), (b, _) in zip(syncs, syncs[1:]))


def test_damage_decides_abort_defer_or_nothing():
    e = running(engine())
    view = e.view
    assert e.damage("suspect", "b", status("b", cv=1), 0).reason == "b is suspect"
    assert e.damage("suspect", "x", status("x"), 0) is None  # not in the view
    left = status("b", LEAVING, done_ops=(view.id, 4), alive=False)
    assert e.damage("left", "b", left, 3).defer  # b completed the operation this member is in
    assert not e.damage("left", "b", left, 4).defer  # it is not ahead: abort
    assert not e.damage("left", "b", status("b", LEAVING, done_ops=(view.id - 1, 9), alive=False), 0).defer
    moved = status("c", cv=1, proposal=(2, "d"))
    assert e.damage("metadata", "c", moved, 0) == core.Damage("c proposes view 2", None, member="c")
    assert e.damage("metadata", "x", status("x", cv=2), 0).fault == "superseded"
    assert e.damage("metadata", "c", status("c", cv=1, proposal=(view.id, view.digest)), 0) is None


def test_a_joiner_that_saw_the_group_but_reaches_none_of_its_members_founds_nothing():
    e = engine("j", joined_at=5.0)
    unreachable = {"a": status("a", cv=2, alive=False), "j": status("j", JOINING, joined_at=5.0)}
    for t in range(20):  # well past the settle interval
        assert e.agree(t * 0.05, unreachable) == []
    assert e.seen_view == 2 and e.proposal is None and e.state == core.JOINING
    # Once that member is known dead it still founds nothing: it never read who the group's
    # members are, so nothing can show them all gone. It holds back, and its record says
    # so (no candidate view includes it: a fresh worker beside it is not held up).
    # Each chase interval it has its seeds contacted again (ProbeGroup without a list);
    # even an answer "all gone" cannot show the members it never knew gone.
    gone = {**unreachable, "a": Status(**{**unreachable["a"].__dict__, "dead": True})}
    assert e.agree(1.0, gone) == [Publish()] and e.state == core.HOLDING_BACK and e.holding
    probes = []
    for t in range(20):
        actions = e.agree(1.01 + t * 0.1, gone)
        probes += actions
        assert actions in ([], [core.ProbeGroup(None)])
        e.group_probed(True)
    assert len(probes) == 4  # every 0.6 s over 2 s
    assert e.proposal is None and e.state == core.HOLDING_BACK and not e.group_gone
    # Without that sight it founds a group of its own, as the first worker of a job does.
    fresh = engine("j", joined_at=5.0)
    actions, _ = agree_until_form(fresh, {"j": status("j", JOINING, joined_at=5.0)})
    assert isinstance(actions[-1], Form) and actions[-1].view.members == ("j",)


def test_the_newest_state_wins_reconciliation_from_its_lowest_rank():
    assert core.reconcile_source([(5, 11), (5, 11), (5, 11)]) is None
    assert core.reconcile_source([(5, 11), (7, 12), (7, 12)]) == 1
    assert core.reconcile_source([(7, 13), (5, 11), (7, 12)]) == 0


def test_sharded_replicas_reconcile_shard_by_shard_from_the_newest_state():
    # rank r holds shard r % 2; (step, digest) per rank
    assert core.shard_sources([(5, 1), (5, 2), (5, 1), (5, 2)], 2) == (5, [None, None])
    # a replica that joins (ranks 2, 3) takes each shard from the lowest rank of that shard
    assert core.shard_sources([(5, 1), (5, 2), (0, 7), (0, 8)], 2) == (5, [0, 1])
    # a replica that committed one step more than the others (ranks 2, 3) gives it to them
    assert core.shard_sources([(5, 1), (5, 2), (6, 3), (6, 4), (5, 1), (5, 2)], 2) == (6, [2, 3])


def test_a_sharded_replica_is_admitted_only_once_every_one_of_its_processes_waits():
    e = running(engine())
    half = {"a": status("a", cv=1), "j0": Status(**{**status("j0", JOINING).__dict__, "replica": ("J", 0, 2)})}
    assert not e.admits_joiner(half)
    whole = {**half, "j1": Status(**{**status("j1", JOINING).__dict__, "replica": ("J", 1, 2)})}
    assert e.admits_joiner(whole)


def test_a_step_commits_only_when_every_batch_counted():
    assert core.step_verdict(3.0, 0.0, 3, batches_checked=True) == (True, False)
    assert core.step_verdict(2.0, 1.0, 3, batches_checked=True) == (False, True)  # one batch off the plan
    assert core.step_verdict(2.0, 0.0, 3, batches_checked=False) == (True, False)  # no sampler: average of two
    assert core.step_verdict(0.0, 0.0, 3, batches_checked=False) == (False, False)  # every member just got state


def test_view_changes_are_named_by_what_happened():
    assert core.classify([("left", "b"), ("suspect", "c")], 4) == "leave"
    assert core.classify([("suspect", "b"), ("crash", "b")], 4) == "crash"
    assert core.classify([("suspect", "b"), ("suspect", "c")], 4) == "partition"
    assert core.classify([("suspect", "b")], 4) == "hang"
    assert core.classify([("dead", "b")], 4) == "crash"
    assert core.classify([], 4) == "backend"
    before = ("a", "b", "c", "d")
    assert core.reason_for("hang", before, ("a", "b", "c"), {"d": "left"}) == "leave"
    assert core.reason_for("backend", before, ("a", "b", "c"), {"d": "dead"}) == "crash"
    assert core.reason_for("backend", before, ("a", "b"), {"c": "suspect", "d": "suspect"}) == "partition"
    assert core.reason_for("crash", before, before + ("e",), {}) == "join"
    assert core.reason_for("init", (), ("a",), {}) == "init"


def test_a_joiner_is_admitted_only_with_room_and_the_same_settings():
    e = running(engine(max_workers=4))
    joiner = status("j", JOINING, joined_at=9.0)
    assert e.admits_joiner({"a": status("a", cv=1), "j": joiner})
    assert not e.admits_joiner({"j": Status(**{**joiner.__dict__, "config": "other"})})
    assert not e.admits_joiner({"j": Status(**{**joiner.__dict__, "alive": False})})
    full = running(engine(max_workers=3))
    assert not full.admits_joiner({"j": joiner})


def test_a_worker_with_other_settings_yields_to_the_group():
    e = engine("j", joined_at=5.0)
    theirs = Status("a", True, False, ACTIVE, 1, None, 0.0, "other", settings=("gloo", 2, None, "quorum", 2))
    conflict = core.settings_conflict(e, ("gloo", 1, None, "quorum", 2), {"a": theirs})
    assert conflict is not None and "min_workers=1 but the group uses min_workers=2" in conflict
    later = Status(**{**theirs.__dict__, "phase": JOINING, "joined_at": 9.0})
    assert core.settings_conflict(e, ("gloo", 1, None, "quorum", 2), {"a": later}) is None  # it yields to this one


def test_a_worker_of_another_ftcomm_version_is_told_so():
    e = engine("j", joined_at=5.0)
    older = Status("a", True, False, ACTIVE, 1, None, 0.0, "other", settings=("gloo", 1, None, "quorum", 1))
    conflict = core.settings_conflict(e, ("gloo", 1, None, "quorum", 2), {"a": older})
    assert conflict is not None and "group protocol 2 but the group speaks protocol 1" in conflict
    assert "min_workers" not in conflict


def test_a_straggler_stands_aside_the_others_re_form_without_it_and_it_rejoins_after_the_cooldown():
    import dataclasses

    from ftcomm.core.view import candidate, gone_from

    straggler, peer = running(engine("c")), running(engine("a"))
    view = straggler.view
    with pytest.raises(core.IllegalTransition):
        straggler.bench(now=10.0, seconds=5.0)  # only a member the last step chose stands aside
    straggler.step_reduced(admit=True, aside=True)  # chosen: standing aside re-forms anyway
    assert straggler.state == core.ASIDE_DUE
    actions = straggler.bench(now=10.0, seconds=5.0)
    assert actions[0] == Rejoined("standing aside as a straggler for 5 s") and Publish() in actions
    assert (straggler.state, straggler.view, straggler.benched, straggler.phase) == (core.STANDING_ASIDE, None, 1,
                                                                                     JOINING)
    aside = published(straggler, step=7)
    assert aside.benched == 1 and aside.proposal is None
    # The others: its withdrawn proposal breaks their view; it is neither a candidate nor
    # admitted as a joiner, and it counts as gone for the quorum (a view of 1 of 2 may form).
    assert peer.damage("metadata", "c", aside, 0) is not None
    statuses = {"a": status("a", cv=1), "b": status("b", cv=1), "c": aside}
    assert gone_from(view, statuses) == {"c"}
    cand = candidate("a", view, statuses, CFG, None)
    assert cand.members == ("a", "b") and cand.quorum
    assert candidate("a", View(1, ("c", "a")), {"a": status("a", cv=1), "c": aside}, CFG, None).quorum
    assert not peer.admits_joiner(statuses)
    # It proposes and adopts nothing while it stands aside ...
    assert straggler.agree(12.0, {"a": status("a", cv=2, proposal=(2, "d")), "c": aside}) == []
    # ... and afterwards publishes itself as an ordinary joiner, whom the group admits.
    assert straggler.agree(15.0, {"c": aside}) == [Publish()] and straggler.state == core.REJOINING
    back = dataclasses.replace(aside, aside=False)
    without = running(engine("a"), ("a", "b"))  # the view the others formed without it
    assert not without.admits_joiner({**statuses, "c": aside}) and without.admits_joiner({**statuses, "c": back})
    with pytest.raises(core.IllegalTransition):
        engine().bench(0.0, 1.0)  # a joiner has no view to stand aside from


def test_a_re_formation_without_a_benched_straggler_is_named_for_it():
    assert core.reason_for("backend", ("a", "b", "c"), ("a", "b"), {"a": "alive", "b": "alive", "c": "benched"}) \
        == "straggler"


def test_a_view_that_only_drops_members_confirmed_gone_is_proposed_without_settling():
    import dataclasses

    def proposes(e: Engine, statuses: dict, now: float) -> bool:
        return any(isinstance(a, PublishProposal) for a in e.agree(now, statuses))

    for gone, settles in [({"dead": True, "alive": False}, False), ({"left": True, "alive": False}, False),
                          ({"alive": False}, True)]:  # suspect: more news may follow, it settles
        e = running(engine("a"))
        e.broken()
        statuses = {"a": status("a", cv=1), "b": status("b", cv=1), "c": dataclasses.replace(status("c", cv=1), **gone)}
        assert proposes(e, statuses, 10.0) is not settles
        if settles:
            assert proposes(e, statuses, 10.0 + e.settle_interval)
    # a joiner among the changes: settles too
    e = running(engine("a"))
    e.broken()
    statuses = {"a": status("a", cv=1), "b": status("b", cv=1), "c": dataclasses.replace(status("c", cv=1), dead=True),
                "d": status("d", JOINING, joined_at=5.0)}
    assert not proposes(e, statuses, 20.0)


@pytest.mark.parametrize("members, stragglers", [(("c", "d", "a", "b"), ("d",)),
                                                 (("c", "d", "e", "a", "b"), ("d", "e"))])
def test_a_straggler_back_from_the_bench_lends_no_vote_to_the_view_it_stood_aside_from(members, stragglers):
    from ftcomm.core.view import candidate

    # c is rank 0: it wins a tie
    group = {m: engine(m, joined_at=float(i)) for i, m in enumerate(members)}
    now = 0.0
    while not all(e.state == core.FORMING for e in group.values()):
        records = {m: published(e) for m, e in group.items()}
        for e in group.values():
            if e.state == core.JOINING:
                e.agree(now, records)
        now += 0.01
        assert now < 2.0
    for e in group.values():
        e.formed()
        e.reconciled()
    c = group["c"]
    view = c.view
    for s in stragglers:
        group[s].step_reduced(admit=False, aside=True)
        group[s].bench(now=10.0, seconds=5.0)
    # A partition cuts {a, b} from the others before the view without the stragglers forms.
    # a and b saw them stand aside (gone for the quorum): 2 of the 3 others is a majority.
    seen_by_ab = {"a": published(group["a"]), "b": published(group["b"]), "c": published(c, alive=False),
                  **{s: published(group[s]) for s in stragglers}}
    majority = candidate("a", view, seen_by_ab, CFG, None)
    assert majority.members == ("a", "b") and majority.quorum
    # c and the stragglers: a and b are dead to them. Once the cooldown is over, nothing may form here.
    c.broken()
    stored: dict = {}  # the proposals on each member's rendezvous store
    formed = {}
    now = 10.0
    while now < 20.0:
        records = {"a": published(group["a"], alive=False), "b": published(group["b"], alive=False),
                   **{m: published(group[m]) for m in ("c", *stragglers)}}
        for e in (group[m] for m in ("c", *stragglers)):
            if e.id in formed:
                continue
            for action in e.agree(now, records):
                if isinstance(action, PublishProposal):
                    stored[(e.id, action.view_id, action.digest)] = action.members
                elif isinstance(action, Fetch):
                    e.fetched_proposal(action.key, stored.get((action.member, *action.key)))
                elif isinstance(action, Form):
                    formed[e.id] = action.view
        now += 0.01
    assert formed == {}, f"the minority side formed {formed} while a and b formed a view of their own"


def test_the_last_two_members_a_straggler_cut_off_after_standing_aside_founds_no_second_group():
    from ftcomm.core.view import candidate

    group = {m: engine(m, joined_at=float(i)) for i, m in enumerate(("d", "a"))}  # d is rank 0
    now = 0.0
    while not all(e.state == core.FORMING for e in group.values()):
        records = {m: published(e) for m, e in group.items()}
        for e in group.values():
            if e.state == core.JOINING:
                e.agree(now, records)
        now += 0.01
        assert now < 2.0
    for e in group.values():
        e.formed()
        e.reconciled()
    d, a = group["d"], group["a"]
    view = a.view
    d.step_reduced(admit=False, aside=True)
    d.bench(now=10.0, seconds=5.0)
    alone = candidate("a", view, {"a": published(a), "d": published(d)}, CFG, None)
    assert alone.members == ("a",) and alone.quorum  # a goes on without the straggler
    # Then d is cut off from a. Whatever d sees after its cooldown, it must not found a group.
    formed = []
    now = 10.0
    while now < 20.0 and not formed:
        records = {"a": published(a, alive=False), "d": published(d)}
        formed = [act.view for act in d.agree(now, records) if isinstance(act, Form)]
        now += 0.01
    assert formed == [], f"the straggler founded {formed} while a goes on in a view of its own"


def test_two_groups_founded_apart_notice_each_other_when_their_gossip_merges():
    a, b = running(engine("a"), ("a",)), running(engine("b"), ("b",))
    assert a.view.id == b.view.id == 1 and a.view != b.view
    seen_by_a, seen_by_b = published(b), published(a)
    assert a.damage("metadata", "b", seen_by_a, 0) is not None or b.damage("metadata", "a", seen_by_b, 0) is not None
    # exactly one side yields: the one whose view digest is lower
    loser, winner = sorted([a, b], key=lambda e: e.view.digest)
    assert loser.damage("metadata", winner.id, published(winner), 0).fault == "superseded"
    assert winner.damage("metadata", loser.id, published(loser), 0) is None


def test_a_joiner_whose_only_contact_left_founds_only_once_the_group_is_gone_for_sure():
    """It saw the group through "a" alone and read the member list of its view; "a" left.
    Gossip shows no live member, but "b" and "c" may be alive out of its sight: it asks
    the driver to probe them (and to contact them) each chase interval, and founds a group
    only when the driver answers that they are all gone. With the availability policy it
    founds at once."""
    def run(policy: str) -> tuple[Engine, dict, float]:
        e = engine("j", joined_at=5.0, partition_policy=policy)
        key = (4, View(4, ("a", "b", "c")).digest)
        statuses = {"a": status("a", cv=4, proposal=key), "j": status("j", JOINING, joined_at=5.0)}
        assert e.agree(0.0, statuses) == [Fetch("a", key)]
        e.fetched_proposal(key, ("a", "b", "c"))
        # a view without it: it waits to be admitted (and tells the group it waits)
        assert e.agree(0.01, statuses) == [Announce(("a",))]
        statuses["a"] = Status("a", False, True, LEAVING, 0, None, 0.0, CFG, rendezvous_port=4000, done_ops=(4, 9))
        return e, statuses, 0.02

    e, statuses, now = run("quorum")
    assert e.agree(now, statuses) == [Publish()] and e.holding  # its record: holding back
    assert e.agree(now + 0.01, statuses) == [core.ProbeGroup(("a", "b", "c"))]
    e.group_probed(False)  # "b" does not answer
    assert e.agree(now + 0.1, statuses) == []
    assert e.agree(now + 0.7, statuses) == [core.ProbeGroup(("a", "b", "c"))]
    e.group_probed(True)
    assert e.agree(now + 0.71, statuses) == [Publish()] and not e.holding
    actions, _ = agree_until_form(e, statuses, now + 0.72)
    assert Form(View(1, ("j",))) in actions

    e, statuses, now = run("availability")
    actions, _ = agree_until_form(e, statuses, now)
    assert not any(isinstance(a, core.ProbeGroup) for a in actions) and Form(View(1, ("j",))) in actions


def test_a_fetched_member_list_that_does_not_match_its_digest_is_dropped():
    e = engine("j")
    key = (2, View(2, ("a", "j")).digest)
    e.fetched_proposal(key, ("a", "127.0.0.1:99999/forged"))
    assert key not in e.fetched
    e.fetched_proposal(key, ("a", "j"))
    assert e.fetched[key] == ("a", "j")


def test_a_joiner_holding_back_reads_as_standing_aside():
    """Its record keeps it out of a fresh worker's candidate view."""
    from ftcomm.core.view import StatusRecord, candidate
    held = Status.from_metadata("j", "alive", StatusRecord(JOINING, 0, None, 1.0, CFG, 0, 4000, holding=True).encode())
    fresh = Status.from_metadata("f", "alive", StatusRecord(JOINING, 0, None, 2.0, CFG, 0, 4001).encode())
    assert held.aside and not fresh.aside
    assert candidate("f", None, {"j": held, "f": fresh}, CFG, None).members == ("f",)


def test_every_state_is_in_the_table_and_every_transition_leads_to_one():
    states = {core.JOINING, core.HOLDING_BACK, core.STANDING_ASIDE, core.REJOINING, core.AGREEING, core.FORMING,
              core.RECONCILING, core.RUNNING, core.RECONCILE_DUE, core.BROKEN, core.JOIN_DUE, core.ASIDE_DUE,
              core.LEAVING, core.CLOSED}
    assert {source for source, _ in core.TRANSITIONS} | set(core.TRANSITIONS.values()) == states
    assert set(core.JOINERS) < states
    diagram = core.state_diagram()
    assert all(f"{s} --> {t}: {e}" in diagram for (s, e), t in core.TRANSITIONS.items() if s != t and e != "leave")
    assert {s for (s, e) in core.TRANSITIONS if e == "leave"} == states - {core.LEAVING, core.CLOSED}


def test_a_failed_formation_returns_to_the_state_it_agreed_from():
    # a member with a view: AGREEING (the view it had is kept)
    e = running(engine())
    e.broken()
    statuses = {m: status(m, cv=1) for m in "ab"}
    agree_until_form(e, statuses, 1.0)
    e.form_failed()
    assert (e.state, e.view.id) == (core.AGREEING, 1)
    # a member that lost its view: REJOINING, still remembering the view it lost
    e = running(engine())
    e.broken()
    key = (3, View(3, ("b", "a")).digest)
    statuses = {"a": status("a", cv=1), "b": status("b", cv=2, proposal=key)}
    assert isinstance(e.agree(2.0, statuses)[0], Rejoined) and e.state == core.REJOINING
    assert e.agree(2.01, statuses) == [Fetch("b", key)]
    e.fetched_proposal(key, ("b", "a"))
    statuses["a"] = status("a", core.JOINING.lower(), proposal=key)
    actions, _ = agree_until_form(e, statuses, 2.02)
    assert actions[-1] == Form(View(3, ("b", "a")))
    e.form_failed()
    assert (e.state, e.lost, e.floor) == (core.REJOINING, View(1, ("a", "b", "c")), 4)


def test_inputs_outside_the_table_raise_in_every_new_state():
    aside = running(engine("c"))
    aside.step_reduced(admit=False, aside=True)
    aside.bench(now=0.0, seconds=5.0)
    for call in (aside.formed, aside.reconciled, aside.broken, lambda: aside.bench(0.0, 1.0)):
        with pytest.raises(core.IllegalTransition):
            call()
    held = engine("j", joined_at=5.0)
    gone = {"a": status("a", cv=2, alive=False, dead=True), "j": status("j", JOINING, joined_at=5.0)}
    held.agree(0.0, {"a": status("a", cv=2, alive=False), "j": gone["j"]})  # it saw the group
    held.agree(0.1, gone)
    assert held.state == core.HOLDING_BACK
    for call in (held.formed, held.form_failed, held.broken):
        with pytest.raises(core.IllegalTransition):
            call()
    assert held.leave() == [Publish()] and held.state == core.LEAVING


def test_between_collectives_a_member_is_running_or_has_something_due():
    e = engine()
    statuses = {m: status(m, JOINING, joined_at=i) for i, m in enumerate("ab")}
    agree_until_form(e, statuses)
    e.formed()
    e.deferred()  # no state registered yet
    assert e.state == core.RECONCILE_DUE
    e.reconciled()
    e.restored()  # a checkpoint loaded here only
    assert e.state == core.RECONCILE_DUE
    assert e.failed("crash") == [Publish()] and (e.state, e.fault, e.proposal) == (core.BROKEN, "crash", None)
    e.restored()  # re-formed anyway: nothing changes
    assert e.broken() == [] and (e.state, e.fault) == (core.AGREEING, None)  # withdrawn already
    e = running(engine())
    e.step_reduced(admit=False, aside=False)
    assert e.state == core.RUNNING
    e.step_reduced(admit=True, aside=False)
    assert e.state == core.JOIN_DUE
    for call in (e.reconciled, lambda: e.step_reduced(True, False)):
        with pytest.raises(core.IllegalTransition):
            call()
    # a collective between steps runs in the view the joiner waits on (BETWEEN), and may fail
    assert e.failed("crash") == [Publish()] and e.state == core.BROKEN
    assert e.broken() == [] and e.state == core.AGREEING


def test_a_view_formed_from_rejoining_is_named_a_rejoin():
    e = running(engine())
    e.broken()
    key = (3, View(3, ("b", "a")).digest)
    statuses = {"a": status("a", cv=1), "b": status("b", cv=2, proposal=key)}
    e.agree(2.0, statuses)
    e.agree(2.01, statuses)
    e.fetched_proposal(key, ("b", "a"))
    statuses["a"] = status("a", JOINING, proposal=key)
    agree_until_form(e, statuses, 2.02)
    assert e.formed_from == core.REJOINING
    e.formed()
    assert e.formed_from == core.REJOINING  # until it enters another formation


def test_one_name_per_input_a_formation_failure_is_not_a_collective_failure():
    e = running(engine())
    with pytest.raises(core.IllegalTransition):
        e.form_failed()  # nothing is being formed
    forming = engine("j", joined_at=5.0)
    agree_until_form(forming, {"j": status("j", JOINING, joined_at=5.0)})
    with pytest.raises(core.IllegalTransition):
        forming.failed("crash")  # no collective runs while forming
    assert forming.state == core.FORMING


def test_a_restored_checkpoint_is_taken_in_any_open_state_and_reconciled_with_the_next_view():
    e = engine()
    e.restored()  # joining: the first view reconciles anyway
    assert e.state == core.JOINING
    e = running(engine())
    e.broken()
    e.restored()  # a re-formation that raised left it agreeing
    assert e.state == core.AGREEING
    e = running(engine())
    e.restored()
    assert e.state == core.RECONCILE_DUE


def test_a_member_that_leaves_its_view_never_adopts_that_view_again():
    """A straggler back from standing aside, whose peer has not yet seen it leave and still
    proposes the view it left: it does not enter that view (its rendezvous keys are stale)."""
    a = running(engine("a"), ("a", "b"))
    view = a.view
    a.step_reduced(admit=False, aside=True)
    a.bench(now=0.0, seconds=1.0)
    assert a.floor == view.id + 1
    key = (view.id, view.digest)
    statuses = {"a": published(a), "b": status("b", cv=view.id, proposal=key)}
    for t in range(30):
        actions = a.agree(1.0 + 0.1 * t, statuses)
        assert not any(isinstance(x, Fetch) and x.key == key for x in actions)
        assert not any(isinstance(x, Form) for x in actions)
    assert a.state == core.REJOINING


def test_a_joiner_whose_view_breaks_before_it_received_the_state_is_a_joiner_again():
    """It never held the group's state: going on from that view would let a majority of
    joiners carry on from their own state (step 0). A member that held a view before goes
    on from the new one as ever."""
    j = engine("j", joined_at=5.0)
    key = (2, View(2, ("a", "j")).digest)
    statuses = {"a": status("a", cv=1, proposal=key), "j": status("j", JOINING, joined_at=5.0)}
    j.agree(0.0, statuses)
    j.fetched_proposal(key, ("a", "j"))
    statuses["j"] = status("j", JOINING, joined_at=5.0, proposal=key)
    agree_until_form(j, statuses, 0.01)
    j.formed()
    assert j.broken() == [Publish()]
    assert (j.state, j.view, j.floor, j.proposal) == (core.JOINING, None, 3, None)
    a = running(engine())
    a.broken()
    agree_until_form(a, {m: status(m, cv=1) for m in "ab"}, 1.0)
    a.formed()
    a.broken()
    assert a.state == core.AGREEING and a.view.id == 2


def test_a_joiner_adopts_the_proposal_of_members_that_entered_the_newest_view_although_it_formed_elsewhere():
    """View 5 formed only on a member that died since (its record, naming view 5, outlives
    it); the survivors entered view 5 too (their floor is above it) and propose view 6
    from their view 4. A joiner takes their proposal: a member that entered a view is not
    left out of it. Reading only current views, it would wait for a proposal from a
    member of view 5 for ever."""
    key = (6, View(6, ("a", "b", "j")).digest)
    statuses = {"a": status("a", cv=4, proposal=key, floor=6), "b": status("b", cv=4, proposal=key, floor=6),
                "d": status("d", cv=5, alive=False), "j": status("j", JOINING, joined_at=9.0)}
    e = engine("j", joined_at=9.0)
    actions = e.agree(0.0, statuses)
    assert [a for a in actions if isinstance(a, Fetch)] == [Fetch("a", key)]
    e.fetched_proposal(key, ("a", "b", "j"))
    e.agree(0.01, statuses)
    assert e.proposal == key
    assert Engine._holds_newest(statuses["a"], 5)  # (entered view 5: floor 6)
    assert not Engine._holds_newest(status("x", cv=4), 5)  # neither formed nor entered it


def test_the_boundary_dispatch_is_a_table_and_joins_wait_for_a_step_boundary():
    e = engine()
    for state, due in core.BOUNDARY.items():
        e.state = state
        assert e.due() == due
        assert e.due(boundary=False) == (None if due in ("join", "aside") else due)
    e.state = core.AGREEING
    assert e.due() == "resume" and e.due(boundary=False) == "resume"


def test_failures_in_a_row_are_counted_for_steps_and_for_calls_and_a_call_does_not_break_a_row_of_steps():
    """Seed 330 of replicas: a metric averaged before each step completed every time while
    every step failed and re-formed; counted as one row of operations, each metric reset
    it and the user never learned that every step was discarded."""
    e = engine(max_retries=2)
    assert [e.count_failure() for _ in range(3)] == [False, False, True]
    assert e.failures == 0  # a caller that goes on gets max_retries more
    e.count_failure()
    e.count_call_success()  # a metric between the steps completed
    assert [e.count_failure() for _ in range(2)] == [False, True]
    assert [e.count_call_failure() for _ in range(3)] == [False, False, True]
    e.count_call_failure()
    e.count_failure()
    e.count_success()  # a step completed: both rows start again
    assert e.failures == e.call_failures == 0


def test_min_workers_counts_replicas_and_views_count_processes():
    e = engine(min_workers=2, max_workers=3, replica=("R", 0, 2))
    assert e.replica_size == 2 and e.max_processes == 6
    assert not e.usable(Candidate(("a", "b", "c"), 1, True, ()))  # 3 processes: not 2 replicas
    assert e.usable(Candidate(("a", "b", "c", "d"), 1, True, ()))


def test_a_member_that_joined_a_view_and_deferred_its_reconcile_is_a_joiner_again_when_it_breaks():
    """A joiner whose reconcile was deferred (its state not registered yet) never received
    the group's state in that view; when the view breaks, it is a joiner again, not a member
    that goes on from it (a majority of such joiners would carry on from their own, older
    state: seed 668 of sharded replicas). Where nobody had begun training when the view
    formed (restorable) it loses nothing by staying, and stays, to restore with the others."""
    for restorable, joiner_again in ((False, True), (True, False)):
        e = engine()
        agree_until_form(e, {m: status(m, JOINING, joined_at=i) for i, m in enumerate("ab")})
        e.formed(restorable=restorable)
        e.deferred()
        assert e.state == core.RECONCILE_DUE
        e.broken()
        assert (e.state == core.JOINING, e.view is None) == (joiner_again, joiner_again)
        assert e.state == (core.JOINING if joiner_again else core.AGREEING)


def rejoining_after_the_newer_group_ended(step_of_the_newer: int = 30) -> tuple[Engine, dict]:
    """Member c of view 1 (a, b, c), cut off: a and b formed view 2 without it, trained, and
    ended: b left (its final record names view 2), a died. c, at step 30, lost its view."""
    c = running(engine("c"))
    c.broken()
    statuses = {"a": status("a", cv=2, alive=False, dead=True, step=step_of_the_newer),
                "b": dataclasses.replace(status("b", LEAVING, alive=False, done_ops=(2, 0), step=step_of_the_newer),
                                         left=True),
                "c": published(c, step=30)}
    c.agree(1.0, statuses)
    assert c.state == core.REJOINING and c.lost.id == 1
    statuses["c"] = published(c, step=30)
    return c, statuses


def test_a_member_that_lost_its_view_refounds_once_the_newer_group_ended_for_sure():
    """Two replicas, the one holding rank 0 dies while the other rejoins: once every member
    that went on without it left or refuses connections, and none holds a newer step, the
    survivor trains on from its state instead of waiting for ever."""
    c, statuses = rejoining_after_the_newer_group_ended()
    actions = c.agree(2.0, statuses)
    probe = next(a for a in actions if isinstance(a, core.ProbeMembers))
    assert probe.members == ("a",)  # b's departure is certain; a is dead only by gossip's word
    assert not any(isinstance(a, (PublishProposal, Form)) for a in c.agree(2.1, statuses))  # not before the answer
    c.members_probed(["a"])  # a's port refuses connections
    actions, _ = agree_until_form(c, statuses, 3.0)
    formed = actions[-1].view
    assert formed.members == ("c",) and formed.id > 2  # above every view the ended group formed


def test_the_survivor_of_a_view_of_two_goes_on_once_rank_0_is_proven_dead():
    """A tie goes to rank 0, so b alone is no quorum of view 1 (a, b): it probes a, and a
    refused connection (a's process is gone, its host answers) takes a out of the count."""
    b = running(engine("b"), members=("a", "b"))
    b.broken()
    statuses = {"a": status("a", cv=1, alive=False, dead=True), "b": published(b)}
    actions = b.agree(1.0, statuses)
    probe = next(a for a in actions if isinstance(a, core.ProbeMembers))
    assert probe.members == ("a",)
    assert not any(isinstance(a, (PublishProposal, Form)) for a in b.agree(1.1, statuses))  # not before the answer
    b.members_probed(["a"])
    actions, _ = agree_until_form(b, statuses, 2.0)
    assert actions[-1].view == View(2, ("b",))


def test_the_survivor_of_a_view_of_two_waits_while_rank_0_does_not_answer():
    """Silence is no proof: a may be across a partition, training on (a tie is its)."""
    b = running(engine("b"), members=("a", "b"))
    b.broken()
    statuses = {"a": status("a", cv=1, alive=False, dead=True), "b": published(b)}
    b.agree(1.0, statuses)
    b.members_probed(["c"])  # no answer from a (an answer it did not ask for changes nothing)
    probed = []
    for t in range(60):
        actions = b.agree(1.1 + 0.1 * t, statuses)
        assert not any(isinstance(a, (PublishProposal, Form)) for a in actions)
        if any(isinstance(a, core.ProbeMembers) for a in actions):
            probed.append(1.1 + 0.1 * t)
            b.members_probed([])  # no answer (the driver answers at once)
    # Probed every chase interval while a was seen alive lately (4 chase intervals: 2.4 s
    # after b began to agree at 1.0); not after: lost sight of for longer, a may have gone
    # on without b in a newer view before it died.
    assert len(probed) >= 2 and max(probed) <= 1.0 + 4 * 0.6 + 1e-9, probed
    b.members_probed(["a"])  # (an answer is for the probe it follows at once: this one is none)
    assert not any(isinstance(a, (PublishProposal, Form)) for a in b.agree(8.0, statuses))
    # Seen alive again, a is probed again once it is not (alive, but not usable here, it answers).
    leaving = {**statuses, "a": status("a", LEAVING, cv=1)}
    assert not any(isinstance(a, core.ProbeMembers) for a in b.agree(9.0, leaving))
    assert any(isinstance(a, core.ProbeMembers) for a in b.agree(10.0, statuses))


def replicas_of_two(member: str, shard: int, members=("a0", "a1", "b0", "b1")) -> tuple[Engine, dict]:
    """Process ``member`` of view 1 of replicas of two (a0 and a1 are replica A), agreeing
    after the view broke; every other process alive."""
    key = member[0].upper()
    e = engine(member, replica=(key, shard, 2))
    statuses = {m: dataclasses.replace(status(m, JOINING, joined_at=i), replica=(m[0].upper(), int(m[1]), 2))
                for i, m in enumerate(members)}
    statuses[member] = published(e)
    agree_until_form(e, statuses)
    e.formed()
    e.reconciled()
    e.broken()
    statuses = {m: dataclasses.replace(status(m, cv=1), replica=(m[0].upper(), int(m[1]), 2)) for m in members}
    statuses[member] = published(e)
    return e, statuses


def test_a_process_whose_partner_stays_silent_stands_aside_so_the_other_replica_has_a_quorum():
    """Replica A holds rank 0: with a0 hung, B alone is a tie without rank 0, and A cannot
    train (it is not whole). a1 stands aside once a0 has been silent for a chase interval;
    its record says from which view, so b0 and b1 are a majority of the rest (a0, b0, b1)."""
    a1, statuses = replicas_of_two("a1", 1)
    statuses["a0"] = dataclasses.replace(statuses["a0"], alive=False)  # suspect: not dead yet
    assert not any(isinstance(x, Rejoined) for x in a1.agree(1.0, statuses))
    assert a1.state == core.AGREEING  # silent for less than a chase interval
    actions = a1.agree(1.0 + 0.6, statuses)
    assert any(isinstance(x, Rejoined) and "a0" in x.why for x in actions) and a1.state == core.REJOINING
    b0, others = replicas_of_two("b0", 0)
    others.update(a0=statuses["a0"], a1=published(a1))
    formed, _ = agree_until_form(b0, {**others, "b1": dataclasses.replace(others["b1"], proposal=None)}, 2.0)
    assert formed[-1].view.members == ("b0", "b1")


def test_a_process_that_stood_aside_lends_no_vote_to_a_proposal_that_counts_it_present():
    """a1 stood aside for a0; a0, back and cut off from B, read a1's record from before and
    proposes (a0, a1) as a tie holding rank 0, while B may have formed (b0, b1) counting a1
    gone. a1 does not adopt it; it adopts one that is a quorum with it counted gone."""
    a1, statuses = replicas_of_two("a1", 1)
    statuses["a0"] = dataclasses.replace(statuses["a0"], alive=False)
    a1.agree(1.0, statuses)
    a1.agree(1.6, statuses)
    assert a1.state == core.REJOINING and a1.benched == 1
    pair, everyone = View(2, ("a0", "a1")), View(2, ("a0", "a1", "b0", "b1"))
    for view, adopted in ((pair, False), (everyone, True)):
        seen = {**statuses, "a0": dataclasses.replace(statuses["a0"], alive=True, proposal=(2, view.digest)),
                "a1": published(a1)}
        actions = a1.agree(2.0, seen)
        for fetch in (x for x in actions if isinstance(x, Fetch)):
            a1.fetched_proposal(fetch.key, view.members)
        a1.agree(2.01, seen)
        assert (a1.proposal == (2, view.digest)) == adopted, view


def test_a_process_stands_aside_for_its_silent_partner_only_over_the_view_it_holds():
    """a1 entered view 2 (all four), whose formation failed here but which formed on the
    others: it agrees over view 2, not the view 1 it holds. Standing aside from view 2
    would leave its record naming a view other than the one it loses (which the guard
    against a second vote reads): it waits for a0's death instead, as before."""
    a1, statuses = replicas_of_two("a1", 1)
    everyone = View(2, ("a0", "a1", "b0", "b1"))
    agreed_all = {m: dataclasses.replace(s, proposal=(2, everyone.digest)) for m, s in statuses.items()}
    actions, _ = agree_until_form(a1, agreed_all, 0.5)
    assert actions[-1].view == everyone
    a1.form_failed()
    assert a1.state == core.AGREEING and a1.view.id == 1 and a1.entered_view == everyone
    formed = {m: dataclasses.replace(s, current_view=2, view_digest=everyone.digest)
              for m, s in statuses.items() if m != "a1"}
    formed["a0"] = dataclasses.replace(formed["a0"], alive=False)
    formed["a1"] = published(a1)
    for t in range(30):
        assert not any(isinstance(x, Rejoined) for x in a1.agree(1.0 + 0.1 * t, formed))
    assert a1.benched is None


@pytest.mark.parametrize("member,silent", [("b0", ("b1",)), ("b0", ("a0", "b1")), ("a0", ("a1", "c0", "c1"))])
def test_a_process_stands_aside_for_its_silent_partner_only_when_that_gives_the_others_a_quorum(member, silent):
    """b1 silent: A holds the tie and goes on without B, which b0 need not stand aside for.
    a0 and b1 silent (cut in two across the replicas): no replica is whole on either side.
    Of three replicas, a1 and all of C silent: B alone is no majority of the rest. Standing
    aside would give nobody a quorum."""
    members = ("a0", "a1", "b0", "b1") + (("c0", "c1") if "c0" in silent else ())
    e, statuses = replicas_of_two(member, int(member[1]), members)
    for m in silent:
        statuses[m] = dataclasses.replace(statuses[m], alive=False)
    for t in range(30):
        actions = e.agree(1.0 + 0.1 * t, statuses)
        assert not any(isinstance(x, Rejoined) for x in actions)
        if any(isinstance(x, Form) for x in actions):
            break
    assert e.benched is None and e.state == core.AGREEING


def test_some_members_proven_dead_leave_a_majority_of_the_rest():
    """View (a, b, c, d): c and d are a tie without rank 0. a's port refuses, b's does not
    answer: of b, c and d, the two here are a majority."""
    c = running(engine("c"), members=("a", "b", "c", "d"))
    c.broken()
    statuses = {"a": status("a", cv=1, alive=False, dead=True), "b": status("b", cv=1, alive=False),
                "c": published(c), "d": status("d", cv=1)}
    probe = next(x for x in c.agree(1.0, statuses) if isinstance(x, core.ProbeMembers))
    assert probe.members == ("a", "b")
    c.members_probed(["a"])
    statuses["d"] = status("d", cv=1)
    actions, _ = agree_until_form(c, statuses, 2.0)
    assert actions[-1].view.members == ("c", "d")


def test_a_member_that_lost_its_view_waits_while_a_member_of_the_newer_group_may_live():
    c, statuses = rejoining_after_the_newer_group_ended()
    c.agree(2.0, statuses)
    c.members_probed([])  # a does not answer: across a partition, perhaps
    for t in range(20):
        assert not any(isinstance(a, (PublishProposal, Form)) for a in c.agree(3.0 + 0.1 * t, statuses))
    assert c.state == core.REJOINING


def test_a_member_that_lost_its_view_takes_a_departure_only_from_a_final_record():
    """b's gossip state says it left, but the record that arrived is an older one (of view 2
    while it was active): it may have left a newer view that went on without c, and c waits."""
    c, statuses = rejoining_after_the_newer_group_ended()
    statuses["b"] = dataclasses.replace(status("b", cv=2, alive=False, step=30), left=True)
    for t in range(20):
        actions = c.agree(2.0 + 0.1 * t, statuses)
        assert not any(isinstance(a, (core.ProbeMembers, PublishProposal, Form)) for a in actions)
    c.members_probed(["a", "b"])  # (an answer it did not ask for changes nothing)
    assert not any(isinstance(a, (PublishProposal, Form)) for a in c.agree(5.0, statuses))
    assert c.state == core.REJOINING


def test_a_member_that_lost_its_view_never_refounds_from_an_older_state_than_the_newer_group_held():
    c, statuses = rejoining_after_the_newer_group_ended(step_of_the_newer=31)
    for t in range(20):
        actions = c.agree(2.0 + 0.1 * t, statuses)
        assert not any(isinstance(a, (core.ProbeMembers, PublishProposal, Form)) for a in actions)
    c.members_probed(["a"])
    assert not any(isinstance(a, (PublishProposal, Form)) for a in c.agree(5.0, statuses))
    assert c.state == core.REJOINING


def test_a_member_that_lost_its_view_never_counts_on_a_tie_while_a_newer_view_exists():
    """Simulation seed 6472: a (rank 0 of view 1: a, b, c) hung; b and c went on in view 2,
    then c was cut off (its record of view 2 never reached a) and b left. A tie of view 1
    would go to a, but c may be in view 2 and training on: who is in a newer view is not
    known here, so a waits until c is proven dead."""
    a = running(engine("a"))
    a.broken()
    statuses = {"b": dataclasses.replace(status("b", LEAVING, alive=False, done_ops=(2, 0), step=30), left=True),
                "c": status("c", cv=1, alive=False, dead=True, step=30),  # its record of view 1: stale
                "a": published(a, step=30)}
    a.agree(1.0, statuses)
    assert a.state == core.REJOINING
    statuses["a"] = published(a, step=30)
    probe = next(x for x in a.agree(2.0, statuses) if isinstance(x, core.ProbeMembers))
    assert probe.members == ("c",)
    a.members_probed([])  # c does not answer: cut off, not dead
    for t in range(20):
        assert not any(isinstance(x, (PublishProposal, Form)) for x in a.agree(3.0 + 0.1 * t, statuses))
    a.members_probed(["b"])  # an answer about another member proves nothing about c
    for t in range(20):
        assert not any(isinstance(x, (PublishProposal, Form)) for x in a.agree(4.0 + 0.1 * t, statuses))
    a.members_probed(["c"])  # c's port refuses connections: the process is gone
    actions, _ = agree_until_form(a, statuses, 6.0)
    assert actions[-1].view.members == ("a",)


def test_a_member_whose_formation_failed_here_forms_no_view_without_a_quorum_of_the_view_it_entered():
    """a (rank 0 of view 1, a and b) entered view 2 with the joiner c; the cut came as the
    verification completed on b and c but not on a: they formed view 2 and go on from it
    with a majority of it. a, alone and with no sign that view 2 formed, holds the tie of
    view 1; forming alone from it would make a second group. It forms nothing until b and
    c are proven gone (a seed of the simulation found the second group)."""
    e = running(engine(), members=("a", "b"))
    e.broken()
    everyone = View(2, ("a", "b", "c"))
    statuses = {"a": published(e), "b": status("b", cv=1, joined_at=1), "c": status("c", JOINING, joined_at=2)}
    actions, _ = agree_until_form(e, statuses, 0.5)
    assert actions[-1].view == everyone
    e.form_failed()
    assert e.view.id == 1 and e.entered_view == everyone
    cut = {"a": published(e), "b": dataclasses.replace(statuses["b"], alive=False),
           "c": dataclasses.replace(statuses["c"], alive=False)}
    probes = []
    for t in range(40):
        actions = e.agree(1.0 + 0.1 * t, {**cut, "a": published(e)})
        assert not any(isinstance(x, Form) for x in actions)
        probes += [x for x in actions if isinstance(x, ProbeMembers)]
    assert probes and set(probes[-1].members) == {"b", "c"}  # the members of the view it entered are probed
    e.members_probed(["b", "c"])  # their ports refuse: gone for sure
    actions, _ = agree_until_form(e, {**cut, "a": published(e)}, 5.0)
    assert actions[-1].view.members == ("a",)


def test_a_member_repairing_its_replica_leaves_its_view_and_tells_the_others_directly():
    """repair_replica from a view: the member leaves it (benched from it, so the others count
    it gone for the quorum) and sends its record to each other member of the view at once:
    they may be waiting on it to agree a view without its replica."""
    e = running(engine("c"))
    e.broken()
    assert e.state == core.AGREEING
    actions = e.repair_replica("a partner died")
    assert Publish() in actions and Announce(("a", "b")) in actions
    assert (e.state, e.view, e.benched) == (core.REJOINING, None, 1) and e.record().repairing
