"""The driver over fake ports: each engine action performed through its port, and each
answer of a port (a store that does not answer, a refused or silent probe, a mismatched
setting) turned into the engine's next input. (The phases of a re-formation and a step,
over the same ports, are tests/test_worker.py's.)"""

from __future__ import annotations

import dataclasses

import pytest

from ftcomm.core import engine as core
from ftcomm.core.engine import Form, Recontact, Rejoined
from ftcomm.core.view import JOINING, LEAVING, Status, View
from ftcomm.errors import CollectiveAborted, CommunicatorError, ConfigMismatch, GroupEnded
from ftcomm.runtime.driver import Driver, member_address
from ftcomm.runtime.ports import Done, Failed, Formed, MemberRecord
from tests.conftest import status
from tests.fakeports import FakeClock, FakeMembership, FakeProber, FakeProposals, world_for


def driver_for(member: str, statuses: dict, **engine_fields) -> tuple[Driver, FakeMembership, FakeProposals,
                                                                       FakeProber, FakeClock]:
    world = world_for(member, statuses, facts=lambda: (7, 0.25), **engine_fields)
    return world.driver, world.membership, world.proposals, world.prober, world.clock


def test_a_look_publishes_the_record_and_proposal_announces_it_and_hands_back_the_view_to_form():
    statuses = {m: status(m, JOINING, joined_at=i) for i, m in enumerate("ab")}
    driver, membership, proposals, _, clock = driver_for("a", statuses)
    assert driver.look() == (None, False)  # the candidate settles first
    clock.t += 0.06
    assert driver.look() == (None, True)  # its own proposal published: the next look is due at once
    key = driver.engine.proposal
    assert proposals.stored == {key: ("a", "b")} and membership.announced == [("a", "b")]
    record = Status.from_metadata("a", "alive", membership.published[-1])
    assert (record.proposal, record.step, record.compute_s) == (key, 7, 0.25)  # the driver's facts
    membership.shown["b"] = dataclasses.replace(membership.shown["b"], proposal=key)
    clock.t += 0.01
    assert driver.look().form == View(1, ("a", "b")) and driver.engine.state == core.FORMING


def test_a_proposal_a_store_does_not_answer_is_asked_of_the_next_proposer():
    key = (2, View(2, ("a", "b", "j")).digest)
    statuses = {"a": status("a", cv=1, proposal=key), "b": status("b", cv=1, proposal=key),
                "j": status("j", JOINING, joined_at=5.0)}
    driver, membership, proposals, _, clock = driver_for("j", statuses, joined_at=5.0)
    proposals.answers = {"a": None, "b": ("a", "b", "j")}  # "a" died since it proposed
    assert driver.look() == (None, True)
    assert proposals.asked[-1][0] == "a" and proposals.asked[-1][1] == ("10.0.0.1", 4000)
    clock.t += 0.01
    assert driver.look() == (None, True) and proposals.asked[-1][0] == "b"
    driver.look()  # the list read is looked at at once: it adopts the proposal
    assert driver.engine.proposal == key
    assert membership.announced[-1] == ("a", "b", "j")


def test_a_group_is_gone_only_when_every_worker_that_held_a_view_refuses():
    key = (4, View(4, ("a", "b", "c")).digest)
    statuses = {"a": status("a", cv=4, proposal=key), "j": status("j", JOINING, joined_at=5.0)}
    driver, membership, proposals, prober, clock = driver_for("j", statuses, joined_at=5.0)
    proposals.answers = {"a": ("a", "b", "c")}
    driver.look()  # reads the list of the group's view
    clock.t += 0.01
    membership.shown["a"] = dataclasses.replace(statuses["a"], alive=False, dead=True)
    driver.look()  # no live member of the group: it holds back
    assert driver.engine.state == core.HOLDING_BACK
    # b and c are not in its table: probed at the gossip port their ids name (none parse here)
    b, c = "10.0.0.2:7946/x", "10.0.0.3:7946/y"
    members = ("a", b, c)
    prober.answers = {("10.0.0.1", 4000): True, ("10.0.0.2", 7946): True, ("10.0.0.3", 7946): False}
    assert not driver.group_gone(members)
    assert prober.probed[-1][0] == [("10.0.0.1", 4000), ("10.0.0.2", 7946), ("10.0.0.3", 7946)]
    assert membership.contacted == [("10.0.0.3", 7946)]  # it may be alive: told of this worker
    prober.answers[("10.0.0.3", 7946)] = True
    assert driver.group_gone(members)


def test_a_group_member_whose_address_a_restarted_process_answers_from_is_gone_without_a_probe():
    """A launcher started the group's members again at their addresses (seed 205 of
    replicas: the new processes answer there, so a probe never refused and the group was
    never shown gone). The old record is gone, as in refusing; so is a member of the list
    it has no record of whose address a live member answers from."""
    statuses = {"j": status("j", JOINING, joined_at=5.0)}
    driver, membership, _, prober, _ = driver_for("j", statuses, joined_at=5.0)
    old = dataclasses.replace(status("a", cv=4), alive=False, dead=True)
    table = [MemberRecord("j", "alive", "10.0.0.9", 7000, statuses["j"]),
             MemberRecord("a", "dead", "10.0.0.1", 7000, old),
             MemberRecord("a2", "alive", "10.0.0.1", 7000, status("a2", JOINING)),
             MemberRecord("b2", "alive", "10.0.0.2", 7946, status("b2", JOINING))]
    membership.records = lambda: table
    prober.answers = {}  # nothing refuses: every port answers
    assert driver.group_gone(("a", "10.0.0.2:7946/b"))
    assert all(not addresses for addresses, *_ in prober.probed)  # neither probed
    table[2] = table[2]._replace(confirmed=False)  # a record that never answered this worker proves nothing
    assert not driver.group_gone(("a",))
    # two live records answer from one address (one is stale, which is not known): probed
    table[2] = table[2]._replace(confirmed=True)
    table.append(MemberRecord("a3", "alive", "10.0.0.1", 7000, status("a3", JOINING)))
    assert not driver.group_gone(("a",)) and prober.probed[-1][0] == [("10.0.0.1", 4000)]
    assert driver.refusing(["a2"]) == [] and prober.probed[-1][0] == [("10.0.0.1", 4000)]


def test_only_the_members_asked_about_that_refuse_are_proven_gone():
    """A member that lost its view refounds once the members it waits on are gone for sure:
    each is probed where it can be reached, and only a refusal counts (not an empty probe,
    not another worker's refusal, not silence)."""
    unlisted, unaddressable = "10.0.0.3:7946/y", "no-address"
    statuses = {"a": status("a", cv=1), "b": dataclasses.replace(status("b", cv=1), rendezvous_port=None),
                "c": status("c", cv=1)}
    driver, membership, _, prober, _ = driver_for("c", statuses)
    prober.answers = {("10.0.0.1", 4000): True, ("10.0.0.1", 7001): False, ("10.0.0.3", 7946): True}
    assert driver.refusing(["a", "b", unlisted, unaddressable, "a"]) == ["a", unlisted]
    # a at its rendezvous port, b (no rendezvous port published) at its gossip port, the
    # unlisted one at the port its id names; nothing for an id that names no address
    assert prober.probed[-1][0] == [("10.0.0.1", 4000), ("10.0.0.1", 7001), ("10.0.0.3", 7946)]
    assert driver.refusing([]) == []  # nothing asked, nothing proven


def test_a_member_whose_address_another_live_process_answers_from_is_gone_without_a_probe():
    """One port, one process: a member started again at the dead one's gossip address (as a
    launcher restarts it) proves the old process gone, whatever its rendezvous port does.
    A record that never answered this member directly proves nothing (it may be forged)."""
    statuses = {"n": status("n", JOINING, joined_at=5.0), "c": status("c", cv=1)}  # n answers at 10.0.0.1:7000
    driver, membership, _, prober, _ = driver_for("c", statuses)
    membership.unconfirmed["f"] = status("f", JOINING)  # unconfirmed, at 10.0.0.9:7000
    old, elsewhere, forged = "10.0.0.1:7000/old", "10.0.0.1:7005/old", "10.0.0.9:7000/old"
    prober.answers = {}
    assert driver.refusing([old, elsewhere, forged]) == [old]
    assert prober.probed[-1][0] == [("10.0.0.1", 7005), ("10.0.0.9", 7000)]  # the old one: not probed
    assert driver.refusing(["n"]) == []  # (a member is not its own replacement)


def test_a_probe_members_action_answers_the_engine_with_the_refusals_only():
    driver, membership, _, prober, _ = driver_for("c", {"a": status("a", cv=1), "c": status("c", cv=1)})
    answered = []
    driver.engine.members_probed = answered.append
    prober.answers = {("10.0.0.1", 4000): False}
    driver.perform([core.ProbeMembers(("a", "10.0.0.3:7946/y"))])
    assert answered == [[]] and membership.recontacts == 1
    prober.answers[("10.0.0.3", 7946)] = True
    driver.perform([core.ProbeMembers(("a", "10.0.0.3:7946/y"))])
    assert answered[-1] == ["10.0.0.3:7946/y"]


def test_a_probe_group_action_recontacts_the_seeds_and_answers_the_engine():
    statuses = {"a": status("a", cv=2, alive=False, dead=True), "j": status("j", JOINING, joined_at=5.0)}
    driver, membership, _, prober, clock = driver_for("j", statuses, joined_at=5.0)
    driver.engine.saw_group = 2  # it saw the group's view 2, never its member list
    driver.look()
    assert driver.engine.state == core.HOLDING_BACK
    clock.t += 1.0
    driver.look()
    assert membership.recontacts == 1 and not driver.engine.group_gone  # without the list nothing shows it gone


def test_a_recontact_sends_the_seeds_a_join_request():
    driver, membership, *_ = driver_for("a", {"a": status("a", cv=1)})
    driver.perform([Recontact()])
    assert membership.recontacts == 1


def test_a_rejoin_takes_a_new_join_time_and_is_noticed():
    statuses = {"a": status("a", cv=1), "b": status("b", cv=1)}
    driver, membership, _, _, clock = driver_for("a", statuses)
    noticed = []
    driver.notice = noticed.append
    driver.perform([Rejoined("a newer view exists without this worker")])
    assert driver.engine.joined_at == clock.wall() and "rejoins the group" in noticed[0]


def test_a_member_with_other_settings_stops_the_look_with_a_clear_error():
    theirs = Status("b", True, False, "active", 1, None, 0.0, "other", settings=("gloo", 2, None, "quorum", 2))
    driver, *_ = driver_for("a", {"a": status("a", JOINING, joined_at=5.0), "b": theirs}, joined_at=5.0,
                            settings=("gloo", 1, None, "quorum", 2))
    with pytest.raises(ConfigMismatch, match="min_workers=1 but the group uses min_workers=2"):
        driver.look()


def test_forming_is_the_callers_and_never_performed_here():
    driver, *_ = driver_for("a", {"a": status("a", JOINING)})
    with pytest.raises(core.IllegalTransition):
        driver.perform([Form(View(1, ("a",)))])


@pytest.mark.parametrize("member_id, address", [("10.1.2.3:7946/ab", ("10.1.2.3", 7946)), ("host:7946/x", None),
                                                ("10.1.2.3:0/x", None), ("garbage", None), ("::1:80/x", None)])
def test_member_ids_name_an_address_only_when_well_formed(member_id, address):
    assert member_address(member_id) == address


@pytest.mark.parametrize("member_id", ["0.0.0.0:7946/x", "255.255.255.255:7946/x", "224.0.0.1:7946/x",
                                       " 10.1.2.3:7946/x", "10.1.2.3:7946/x\n", ("10.1.2.3", 7946)])
def test_member_ids_naming_no_unicast_host_or_padded_name_no_address(member_id):
    assert member_address(member_id) is None


def test_a_member_list_naming_one_address_many_times_probes_it_once():
    driver, membership, _, prober, _ = driver_for("j", {"j": status("j", JOINING)})
    assert not driver.group_gone(["10.0.0.9:7946/x"] * 1000 + ["10.0.0.9:7946/y"])
    assert prober.probed[-1][0] == [("10.0.0.9", 7946)] and membership.contacted == [("10.0.0.9", 7946)]


# ---------------------------------------------------------------------- what broke, and operations
def running(member: str = "a"):
    """A driver whose member runs view 1 with "b"."""
    statuses = {m: status(m, cv=1) for m in "ab"}
    driver, membership, proposals, prober, clock = driver_for(member, statuses)
    driver.engine.view, driver.engine.state = View(1, ("a", "b")), core.RUNNING
    return driver, membership, prober, clock


def test_a_broken_connection_does_not_wait_for_ports_to_close_when_its_member_is_known_dead():
    driver, membership, prober, _ = running("a")
    membership.shown["c"] = status("c", alive=False, dead=True)
    driver.probe_crashed(["a", "b", "c"], settle=0.15)
    assert prober.probed[-1] == ([("10.0.0.1", 7001)], 0.03)  # only long enough for processes killed with it


def test_begin_recovery_breaks_a_running_view_and_drops_its_communicator():
    driver, _, _, clock = running()
    comms = driver.ports.communicators
    abandoned = comms.abandoned
    clock.t += 1.0
    driver.begin_recovery("crash")
    assert driver.engine.agreeing and driver.recovering and comms.abandoned == abandoned + 1
    assert driver.reason == "crash" and driver.reconciled == [] and driver.agreeing_since == clock.t


def test_blocking_ports_return_done_or_failed_operations():
    assert Done(Formed(True, False)).poll() == (True, False)
    with pytest.raises(CommunicatorError):
        Failed(CommunicatorError("gone")).poll()


def test_completed_operations_count_in_the_record_and_feed_the_stall_watch():
    driver, membership, _, clock = running()
    driver.operation_done(0.01)
    driver.operation_done(0.01)
    view = driver.engine.view
    probed = membership.probed
    driver.watch_stall(clock.t - 0.5, clock.t - 1.0, probe_after=0.1, probe_interval=1.0)
    assert probed == [["b"]]  # waited 0.5 s, 50 times the usual: the others are probed at once
    driver.watch_stall(clock.t - 0.5, clock.t - 1.0, probe_after=0.1, probe_interval=1.0)
    assert probed == [["b"]]  # at most once per probe interval
    driver.perform(driver.engine.leave())  # a leave names the operations completed in the view
    assert Status.from_metadata("a", "alive", membership.published[-1]).done_ops == (view.id, 2)


def test_when_a_process_of_a_sharded_replica_leaves_the_rest_of_its_replica_is_probed_for_a_crash():
    # The launcher stops the other processes of a replica whose process crashed: the view
    # may break on the graceful leave first. The crashed one is found all the same.
    view = View(3, ("a0", "a1", "b0", "b1"))
    statuses = {m: status(m, cv=3, replica=(m[0].upper(), int(m[1]), 2)) for m in view.members}
    driver, membership, _, prober, _ = driver_for("a0", statuses, replica=("A", 0, 2))
    driver.engine.view, driver.engine.state = view, core.RUNNING
    prober.answers = {("10.0.0.1", 7003): True}
    driver.news.fault("left", "b0")
    assert driver.classify(CollectiveAborted("b0 left")) == "leave"
    assert membership.declared == ["b1"] and len(prober.probed) == 1  # b1 alone: a1 shares no replica with b0
    states = {"b0": "left", "b1": "dead"}
    assert core.reason_for("leave", view.members, ("a0", "a1"), states, replica_size=2) == "crash"
    # one replica of two lost is no partition; two of three are
    assert core.classify([("suspect", "b0"), ("suspect", "b1")], 4, replica_size=2) == "hang"
    assert core.reason_for("hang", ("a0", "a1", "b0", "b1", "c0", "c1"), ("a0", "a1"),
                           {m: "suspect" for m in ("b0", "b1", "c0", "c1")}, replica_size=2) == "partition"


def test_a_joiner_whose_group_ended_by_leaving_raises_rather_than_founding_one():
    # It saw view 3 of a group; every member of it then left gracefully (the job finished):
    # founding a group of its own would train from scratch beside the job's result.
    left = {m: dataclasses.replace(status(m, LEAVING, done_ops=(3, 40)), alive=False, left=True) for m in "ab"}
    driver, membership, _, _, _ = driver_for("j", {"j": status("j", JOINING, joined_at=5.0), **left},
                                             joined_at=5.0, saw_group=3)
    with pytest.raises(GroupEnded, match="left before it was admitted"):
        driver.look()
    # a member that died instead is no end of the group: the joiner probes and waits as before
    membership.shown["b"] = dataclasses.replace(left["b"], left=False, dead=True)
    driver.look()


def test_a_fresh_worker_that_finds_only_the_final_records_of_a_group_that_trained_raises_rather_than_founding():
    # It joined the gossip of the job's last member while that member announced its
    # departure after step 200: the group trained and ended before this worker arrived.
    # Founding one of its own would train the job a second time from step 0.
    left = {m: dataclasses.replace(status(m, LEAVING, done_ops=(1, 200), step=200), alive=False, left=True)
            for m in "ab"}
    driver, membership, _, _, clock = driver_for("j", {"j": status("j", JOINING, joined_at=5.0), **left},
                                                 joined_at=5.0)
    with pytest.raises(GroupEnded, match="trained and ended before this worker arrived"):
        driver.look()
    # Members that left before training anything leave nothing to lose: it founds.
    for m in "ab":
        membership.shown[m] = dataclasses.replace(left[m], step=0)
    driver.look()
    clock.t += 0.06
    assert driver.look() == (None, True)  # its own proposal published
    assert driver.look().form == View(1, ("j",))


@pytest.mark.parametrize("other", ["rejoining", "standing aside", "dead"])
def test_a_final_record_beside_a_member_of_the_group_in_no_view_now_is_no_end(other):
    # "a" left after step 200; "b" trained too and did not leave: it rejoins after losing
    # its view, stands aside as a straggler, or is dead here (it may live across a cut).
    left = dataclasses.replace(status("a", LEAVING, done_ops=(3, 200), step=200), alive=False, left=True)
    b = {"rejoining": status("b", JOINING, step=200, floor=4),
         "standing aside": status("b", JOINING, step=200, benched=3, aside=True),
         "dead": dataclasses.replace(status("b", cv=3, step=200), alive=False, dead=True)}[other]
    driver, _, _, _, clock = driver_for("j", {"j": status("j", JOINING, joined_at=5.0), "a": left, "b": b},
                                        joined_at=5.0)
    for _ in range(3):
        driver.look()  # no GroupEnded: what it does next is the founding rules' (Engine._may_found)
        clock.t += 0.1


def test_a_final_record_beside_a_live_member_holding_a_view_is_a_scale_down_not_an_end():
    # "a" left after step 200, "c" (not confirmed yet) still trains in view 4: the group lives.
    statuses = {"j": status("j", JOINING, joined_at=5.0),
                "a": dataclasses.replace(status("a", LEAVING, done_ops=(3, 200), step=200), alive=False, left=True)}
    driver, membership, _, _, clock = driver_for("j", statuses, joined_at=5.0)
    membership.unconfirmed["c"] = status("c", cv=4, step=210)
    for _ in range(3):
        driver.look()
        clock.t += 0.1
    assert driver.engine.view is None and driver.engine.state != core.FORMING


# ---------------------------------------------------------------------- founding
def test_a_fresh_worker_founds_only_with_a_majority_of_its_job_and_probes_the_silent_seeds():
    driver, membership, _, prober, clock = driver_for("a", {"a": status("a", JOINING)})
    seeds = [("10.0.0.2", 7946), ("10.0.0.3", 7946)]
    membership.seed_addresses = seeds
    for _ in range(5):
        clock.t += 0.1
        driver.look()
    assert driver.engine.proposal is None  # 1 of 3: the other two may be founding a group of their own
    assert prober.probed[0][0] == seeds and membership.recontacts >= 1
    prober.answers = {seeds[0]: True}  # one seed's process is gone: it counts no more
    clock.t += 1.0
    driver.look()
    assert set(driver.engine.seeds_gone) == {seeds[0]} and driver.engine.proposal is None  # 1 of 2 is no majority
    prober.answers[seeds[1]] = True
    clock.t += 1.0
    driver.look()
    for _ in range(2):  # the candidate settles
        clock.t += 0.1
        driver.look()
    assert driver.engine.proposal is not None  # alone in its job now: it founds


def test_a_seed_found_gone_that_no_longer_refuses_counts_in_the_job_again():
    """A seed's port refused once (its process was between restarts); a worker was started
    there since, out of sight (it may run the group across a cut): the old refusal proves
    nothing of it, so the seed counts in the job again and no majority is made without it."""
    statuses = {"a": status("a", JOINING, joined_at=0.0), "b": status("b", JOINING, joined_at=1.0)}
    driver, membership, _, prober, clock = driver_for("a", statuses)
    seeds = [("10.0.0.1", 7001), ("10.0.0.3", 7946), ("10.0.0.4", 7946), ("10.0.0.5", 7946)]  # b, then three
    membership.seed_addresses = seeds
    prober.answers = {seeds[2]: True, seeds[3]: True}  # between restarts
    clock.t += 1.0
    driver.look()
    assert set(driver.engine.seeds_gone) == {seeds[2], seeds[3]}
    prober.answers = {seeds[3]: True}  # a worker runs at seeds[2] again, silent
    clock.t += 5.0  # the refusals are stale: probed again
    driver.look()
    assert set(driver.engine.seeds_gone) == {seeds[3]}
    for _ in range(5):
        clock.t += 0.1
        driver.look()
    assert driver.engine.proposal is None  # a and b of a, b, silent seeds[1] and seeds[2]: no majority


def test_a_seed_that_answers_as_a_member_of_the_candidate_counts_for_the_majority():
    statuses = {"a": status("a", JOINING, joined_at=0.0), "b": status("b", JOINING, joined_at=1.0)}
    driver, membership, _, prober, clock = driver_for("a", statuses)
    membership.seed_addresses = [("10.0.0.1", 7001), ("10.0.0.3", 7946)]  # b's address, and a silent one
    clock.t += 0.1
    driver.look()
    clock.t += 0.1
    driver.look()
    assert driver.engine.proposal is not None  # a and b: 2 of 3


def test_a_worker_started_again_after_its_group_ran_founds_nothing_while_a_seed_is_silent():
    """Its job ran a group (``group_ran``: its launcher saw it run). A seed that answers
    nothing may run that group on across a partition (a quorum that counts the crashed as
    proven gone can be one member): the restarted workers, though a majority of the job,
    would train it a second time beside it (seed 1876 of plain workers). Once that seed's
    port refuses, it founds."""
    statuses = {"a": status("a", JOINING, joined_at=0.0), "b": status("b", JOINING, joined_at=1.0)}
    world = world_for("a", statuses, facts=lambda: (7, 0.25), group_ran=True)
    driver, membership, prober, clock = world.driver, world.membership, world.prober, world.clock
    silent = ("10.0.0.3", 7946)
    membership.seed_addresses = [("10.0.0.1", 7001), silent]  # b (restarted too), and the group's last member
    for _ in range(10):
        clock.t += 0.1
        driver.look()
    assert driver.engine.proposal is None and driver.engine.silent_seeds == (silent,)  # 2 of 3, yet it waits
    assert silent in prober.probed[0][0]
    assert "founds no new group while 10.0.0.3:7946 answers nothing" in world.loop._waiting_for()
    assert "start the job again without it in its peers" in world.loop._waiting_for()
    prober.answers = {silent: True}  # its process is gone: no group runs there
    for _ in range(4):
        clock.t += 0.5
        driver.look()
    assert driver.engine.proposal is not None


def test_a_fresh_worker_waits_for_the_workers_it_knows_of_that_have_not_answered_yet():
    driver, membership, *_, clock = driver_for("a", {"a": status("a", JOINING)})
    membership.unconfirmed = {"c": status("c", JOINING, joined_at=1.0)}  # it may be founding too
    for _ in range(5):
        clock.t += 0.1
        driver.look()
    assert driver.engine.proposal is None
    membership.unconfirmed = {}
    clock.t += 0.1
    driver.look()
    clock.t += 0.1
    driver.look()
    assert driver.engine.proposal is not None


def test_a_fresh_worker_founds_nothing_beside_a_group_it_knows_only_from_records_not_confirmed_yet():
    driver, membership, *_, clock = driver_for("a", {"a": status("a", JOINING)})
    membership.unconfirmed = {"g": status("g", cv=3)}  # runs view 3, and has not answered this worker yet
    for _ in range(5):
        clock.t += 0.1
        driver.look()
    assert driver.engine.saw_group == 3 and driver.engine.proposal is None  # it waits to be admitted
