"""The view-agreement rules: candidate order, quorum, agreement, supersession."""

from __future__ import annotations

import dataclasses

from ftcomm.core.view import (
    ACTIVE,
    JOINING,
    LEAVING,
    PROTOCOL,
    Status,
    StatusRecord,
    View,
    agreed,
    candidate,
    gone_from,
    has_quorum,
    replica_broken,
    superseded,
    whole_replicas,
)

CFG = "cfg1"


def st(member_id, phase=ACTIVE, alive=True, left=False, cv=1, proposal=None, joined_at=0.0, config=CFG):
    return Status(member_id, alive, left, phase, cv, proposal, joined_at, config)


def table(*statuses):
    return {s.id: s for s in statuses}


def test_survivors_keep_their_order_and_joiners_follow_by_join_time():
    previous = View(4, ("c", "a", "b"))
    statuses = table(st("a", cv=4), st("b", cv=4), st("c", cv=4, alive=False),
                     st("y", JOINING, cv=0, joined_at=2.0), st("x", JOINING, cv=0, joined_at=1.0),
                     st("z", JOINING, cv=0, joined_at=3.0, config="other"))
    cand = candidate("a", previous, statuses, CFG, max_workers=None)
    assert cand.members == ("a", "b", "x", "y") and cand.view_id == 5 and cand.quorum


def test_max_workers_puts_the_newest_joiners_on_standby():
    statuses = table(st("a"), st("b"), st("j1", JOINING, cv=0, joined_at=1), st("j2", JOINING, cv=0, joined_at=2))
    cand = candidate("a", View(1, ("a", "b")), statuses, CFG, max_workers=3)
    assert cand.members == ("a", "b", "j1") and cand.standby == ("j2",)


def test_quorum_majority_tie_to_old_rank_zero_and_left_members_do_not_count():
    old = View(3, ("a", "b", "c", "d"))
    assert has_quorum(old, ["a", "b", "c"], set())
    assert not has_quorum(old, ["d"], set())
    assert has_quorum(old, ["a", "b"], set())  # tie, holds rank 0
    assert not has_quorum(old, ["c", "d"], set())  # tie without rank 0
    assert has_quorum(old, ["c"], {"a", "b"})  # a and b left gracefully: c and d are what counts
    assert has_quorum(None, ["anyone"], set())


def test_leaving_members_are_not_candidates():
    statuses = table(st("a"), st("b", LEAVING))
    assert candidate("a", View(1, ("a", "b")), statuses, CFG, None).members == ("a",)


def test_agreed_only_when_every_member_publishes_the_same_proposal():
    statuses = table(st("a"), st("b"))
    cand = candidate("a", View(1, ("a", "b")), statuses, CFG, None)
    key = (cand.view_id, cand.digest)
    assert not agreed(cand, table(st("a", proposal=key), st("b", proposal=None)))
    assert not agreed(cand, table(st("a", proposal=key), st("b", proposal=(2, "other"))))
    assert not agreed(cand, table(st("a", proposal=key), st("b", proposal=key, alive=False)))
    assert agreed(cand, table(st("a", proposal=key), st("b", proposal=key)))


def test_a_retry_after_a_failed_formation_gets_a_new_view_id_everyone_follows():
    previous = View(3, ("a", "b", "c"))
    statuses = table(st("a", cv=3), st("b", cv=3), st("c", cv=3))
    first = candidate("b", previous, statuses, CFG, None)
    assert first.view_id == 4
    # a's formation of view 4 failed: it publishes floor 5, and everybody proposes view 5
    statuses["a"] = Status("a", True, False, ACTIVE, 3, None, 0.0, CFG, floor=5)
    retry = candidate("b", previous, statuses, CFG, None)
    assert retry.view_id == 5 and retry.members == first.members and retry.digest != first.digest
    assert candidate("c", previous, statuses, CFG, None) == retry
    # a joiner's floor counts too: the group cannot keep proposing a view it refuses
    statuses["j"] = Status("j", True, False, JOINING, 0, None, 1.0, CFG, floor=7)
    assert candidate("b", previous, statuses, CFG, None).view_id == 7


def test_status_round_trips_through_metadata():
    meta = StatusRecord(ACTIVE, 3, (4, "d4"), 1.5, CFG, 10, 4242, floor=5).encode()
    assert Status.from_metadata("a", "alive", meta) == Status("a", True, False, ACTIVE, 3, (4, "d4"), 1.5, CFG, 5,
                                                              step=10, rendezvous_port=4242)
    leaving = StatusRecord(LEAVING, 0, None, 1.5, CFG, 10, 4242, settings=("gloo", 2, None, "quorum", PROTOCOL),
                            done_ops=(3, 17), insecure=True).encode()
    decoded = Status.from_metadata("a", "left", leaving)
    assert (decoded.left, decoded.done_ops, decoded.settings, decoded.insecure) == \
        (True, (3, 17), ("gloo", 2, None, "quorum", PROTOCOL), True)
    # a record from before the protocol version was carried is version 1
    older = StatusRecord(ACTIVE, 3, None, 1.5, CFG, 10, 4242, settings=("gloo", 2, None, "quorum")).encode()
    assert Status.from_metadata("a", "alive", older).settings == ("gloo", 2, None, "quorum", 1)
    assert Status.from_metadata("a", "alive", {"ph": ACTIVE}) is None
    witness = Status.from_metadata("a", "alive", StatusRecord(ACTIVE, 3, (4, "d4"), 1.5, CFG, 10, 4242,
                                                                agreed=(4, "d4")).encode())
    assert witness.agreed == (4, "d4")


def test_malformed_optional_status_fields_read_as_absent():
    meta = StatusRecord(ACTIVE, 3, None, 1.5, CFG, 10, 4242).encode()
    for key, value in [("st", "10"), ("rz", 70000), ("rz", True), ("op", [1]), ("op", ["1", 2]), ("set", 5),
                       ("insecure", 1), ("ag", [4]), ("ag", [0, "d"]), ("ag", ["4", "d"]), ("ag", [4, 5])]:
        status = Status.from_metadata("a", "alive", {**meta, key: value})
        assert status is not None and status.current_view == 3, (key, value)
    assert Status.from_metadata("a", "alive", {**meta, "rz": 70000}).rendezvous_port is None
    assert Status.from_metadata("a", "alive", {**meta, "op": [1]}).done_ops is None
    assert Status.from_metadata("a", "alive", {**meta, "st": "10"}).step == 0
    assert Status.from_metadata("a", "alive", {**meta, "ag": [4]}).agreed is None


def test_a_member_left_out_of_a_newer_view_knows_it():
    me = st("c", cv=3, proposal=(3, "d3"))
    assert superseded(me, table(me, st("a", cv=4, proposal=(4, "d4"))))
    assert not superseded(me, table(me, st("a", cv=3, proposal=(4, "d4"))))  # others still agreeing
    entered = View(4, ("a", "c"))
    formed = dataclasses.replace(st("a", cv=4), view_digest=entered.digest)
    assert not superseded(me, table(me, formed), entered)  # the view it entered formed on the others
    other = dataclasses.replace(st("a", cv=4), view_digest=View(4, ("a",)).digest)
    assert superseded(me, table(me, other), entered)  # a view 4 without it formed instead
    left = Status("a", False, True, LEAVING, 0, None, 0.0, CFG, done_ops=(5, 3), view_digest="x")
    assert superseded(me, table(me, left))  # a departure from view 5 proves view 5 existed
    assert Status.from_metadata("a", "alive", {**StatusRecord(ACTIVE, 2**40, None, 1.0, CFG, 0, 1).encode()}) is None
    # After a partition heals, the minority may propose a higher id from its stale table;
    # that proposal does not make it a member of the view the majority formed meanwhile.
    stale = st("c", cv=2, proposal=(4, "d4-stale"))
    assert superseded(stale, table(stale, st("a", cv=3, proposal=(3, "d3"))))


def test_digest_depends_on_order_and_id():
    assert View(1, ("a", "b")).digest != View(1, ("b", "a")).digest != View(2, ("b", "a")).digest


def test_a_departure_counts_as_gone_only_by_a_final_record_from_that_view_or_an_older_one():
    previous = View(4, ("m", "n", "x", "a", "b"))

    def left(member, phase=LEAVING, cv=0, done_ops=None):
        return Status(member, False, True, phase, cv, None, 0.0, CFG, done_ops=done_ops)
    statuses = {"x": left("x", done_ops=(4, 9)),  # left view 4 itself: gone
                "a": left("a", done_ops=(6, 2)),  # left a newer view: proves it, is not gone from 4
                "b": left("b", phase=ACTIVE, cv=4),  # its final record never arrived: it may have left a newer one
                "n": left("n")}  # had lost its view when it left: it may have seen a newer one
    assert gone_from(previous, statuses) == {"x"}
    # m alone is not a majority of m, n, a, b (x gone): the stale side gets no quorum
    assert not candidate("m", previous, {**statuses, "m": st("m", cv=4)}, CFG, None).quorum


def rp(member_id, key, shard, size=2, **fields):
    """A status of shard ``shard`` of sharded replica ``key``."""
    return dataclasses.replace(st(member_id, **fields), replica=(key, shard, size))


def test_views_hold_whole_replicas_in_shard_order_and_a_replica_missing_a_process_is_left_out():
    previous = View(4, ("a0", "a1", "b0", "b1", "c0", "c1"))
    statuses = table(rp("a0", "A", 0, cv=4), rp("a1", "A", 1, cv=4), rp("b0", "B", 0, cv=4),
                     rp("b1", "B", 1, cv=4, alive=False), rp("c0", "C", 0, cv=4), rp("c1", "C", 1, cv=4),
                     # a replica joining: its shard 1 came first, and another replica's only process
                     rp("d1", "D", 1, phase=JOINING, cv=0, joined_at=1.0), rp("d0", "D", 0, phase=JOINING, cv=0, joined_at=2.0),
                     rp("e0", "E", 0, phase=JOINING, cv=0, joined_at=0.5))
    cand = candidate("a0", previous, statuses, CFG, max_workers=None)
    assert cand.members == ("a0", "a1", "c0", "c1", "d0", "d1")  # B lost a process; E is not whole yet
    assert [m for m in cand.members if m in statuses] == list(cand.members)
    assert [statuses[m].replica[1] for m in cand.members] == [0, 1] * 3
    # max_workers (in processes) cuts at whole replicas: 5 processes hold two replicas
    assert candidate("a0", previous, statuses, CFG, max_workers=5).members == ("a0", "a1", "c0", "c1")
    # replicas whose other process shows an older view (neither a survivor nor a joiner)
    stale = table(rp("a0", "A", 0, cv=4), rp("a1", "A", 1, cv=4), rp("f0", "F", 0, phase=JOINING, cv=0),
                  rp("f1", "F", 1, cv=2), rp("g0", "G", 0, phase=JOINING, cv=0), rp("g1", "G", 1, cv=2))
    assert candidate("a0", View(4, ("a0", "a1")), stale, CFG, max_workers=None).members == ("a0", "a1")
    # in a group of replicas a member without one (a malformed or forged record) is no candidate
    plain = table(rp("a0", "A", 0, cv=4), rp("a1", "A", 1, cv=4), st("x", JOINING, cv=0))
    assert candidate("a0", View(4, ("a0", "a1")), plain, CFG, max_workers=None).members == ("a0", "a1")
    # processes of one key that disagree on its size are no whole replica, in any order
    for order in (("b0", "b1"), ("b1", "b0")):
        sizes = {"b0": rp("b0", "B", 0, 3, phase=JOINING, cv=0), "b1": rp("b1", "B", 1, 2, phase=JOINING, cv=0)}
        assert whole_replicas({m: sizes[m] for m in order}) == {}
    # two processes claiming one shard of a replica are no whole replica
    twice = table(rp("x0", "X", 0, phase=JOINING, cv=0), rp("x1", "X", 0, phase=JOINING, cv=0))
    assert candidate("x0", None, twice, CFG, max_workers=None).members == ()


def test_a_replica_of_which_one_process_survives_and_one_joins_gets_consecutive_ranks():
    """a1 stood aside (its partner a0 was silent); a0 answered again before the others formed
    without them: a0 survives the view, a1 joins, and the replica still gets ranks in shard
    order next to each other (torch's mesh inside it needs them)."""
    previous = View(4, ("a0", "a1", "b0", "b1"))
    statuses = table(rp("a0", "A", 0, cv=4), rp("a1", "A", 1, phase=JOINING, cv=0, joined_at=9.0),
                     rp("b0", "B", 0, cv=4), rp("b1", "B", 1, cv=4))
    cand = candidate("b0", previous, statuses, CFG, max_workers=None)
    assert cand.members == ("a0", "a1", "b0", "b1") and cand.quorum
    assert [statuses[m].replica[1] for m in cand.members] == [0, 1, 0, 1]


def test_a_replica_whose_process_died_or_left_is_broken_and_one_merely_suspected_is_not():
    own = ("A", 0, 2)
    assert replica_broken(own, table(rp("a0", "A", 0), rp("a1", "A", 1, alive=False))) is None  # suspect
    died = dataclasses.replace(rp("a1", "A", 1, alive=False), dead=True)
    assert replica_broken(own, table(rp("a0", "A", 0), died)) == "a1"
    assert replica_broken(own, table(rp("a0", "A", 0), rp("a1", "A", 1, alive=False, left=True))) == "a1"
    # a process of an earlier start of the replica (another key), or of another replica, is not its
    assert replica_broken(own, table(dataclasses.replace(rp("z1", "Z", 1, alive=False), dead=True))) is None
    assert replica_broken(None, table(died)) is None


def test_a_replica_record_round_trips_and_a_malformed_one_reads_as_absent():
    encoded = StatusRecord(ACTIVE, 3, None, 1.5, CFG, replica=("0f3a", 1, 4)).encode()
    assert Status.from_metadata("a", "alive", encoded).replica == ("0f3a", 1, 4)
    for bad in (["k", 4, 4], ["k", -1, 2], ["", 0, 2], ["k", 0, 1], ["k", 0, 5000], [1, 0, 2], ["k", True, 2]):
        assert Status.from_metadata("a", "alive", {**encoded, "rp": bad}).replica is None, bad
