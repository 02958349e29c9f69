"""The member table: who may enter (a size cap and a join rate) and who has proved to be real.

Finding behind these tests: forty forged alive records of "joining" members, one every
0.5 s, stalled a two-worker group for ~112 s. The table now bounds how many members it
holds and how fast new ones enter, and marks which members answered this one directly.
"""

from __future__ import annotations

import random

from ftcomm.gossip import wire
from ftcomm.gossip.config import GossipConfig
from ftcomm.gossip.members import MemberState, MemberTable
from ftcomm.gossip.protocol import CONFIRMATION_ATTEMPTS, Protocol
from ftcomm.gossip.sim import Simulation
from ftcomm.gossip.wire import ACK, ALIVE, PING

from .helpers import address, decode, member_id, packet


def alive(i: int, incarnation: int = 1) -> list:
    return [ALIVE, member_id(i), incarnation, *address(i), b"ph=joining"]


def fresh(config: GossipConfig) -> Protocol:
    node = Protocol(member_id(0), *address(0), config=config, seed=1)
    node.start(0.0)
    return node


def test_the_table_never_grows_past_max_members():
    node = fresh(GossipConfig(max_members=10))
    for i in range(1, 40):
        node.receive(packet(alive(i)), address(99), 0.5)
    assert len(node.members()) == 10
    assert node.stats["rejected.member_table_full"] == 40 - 10
    assert node.stats["datagrams_received"] == 39 and node.stats["dropped"] == 0


def test_a_full_table_makes_room_by_forgetting_the_oldest_dead_member():
    node = fresh(GossipConfig(max_members=4))
    for i in (1, 2, 3):
        node.receive(packet(alive(i)), address(99), 0.5)
    node.declare_dead(member_id(2), 1.0)
    node.declare_dead(member_id(1), 2.0)
    node.receive(packet(alive(4)), address(99), 3.0)
    assert {m.id for m in node.members()} == {member_id(i) for i in (0, 1, 3, 4)}
    node.receive(packet(alive(5)), address(99), 3.0)
    node.receive(packet(alive(6)), address(99), 3.0)
    assert node.member(member_id(5)) is not None and node.member(member_id(6)) is None
    assert node.stats["rejected.member_table_full"] == 1


def test_new_member_ids_enter_at_most_at_the_join_rate_once_the_bucket_is_empty():
    node = fresh(GossipConfig(max_members=3, join_rate=2.0))  # a bucket of 3 tokens, 2 more per second
    node.receive(packet(alive(1), alive(2)), address(99), 0.0)  # two tokens spent; the table is full
    node.declare_dead(member_id(1), 0.0)
    node.declare_dead(member_id(2), 0.0)  # room for two more ...
    node.receive(packet(alive(3), alive(4)), address(99), 0.0)  # ... but one token
    assert node.member(member_id(3)) is not None and node.member(member_id(4)) is None
    assert node.stats["rejected.join_rate"] == 1
    node.receive(packet(alive(4)), address(99), 0.5)  # half a second at 2/s: one token
    assert node.member(member_id(4)) is not None


def test_a_member_known_only_through_gossip_is_unconfirmed_until_it_answers_a_ping():
    node = fresh(GossipConfig())
    node.receive(packet(alive(3)), address(99), 0.0)
    assert node.member(member_id(3)).confirmed is False and node.member(member_id(0)).confirmed is True
    pings: list[tuple[int, str]] = []
    t = 0.0
    while not pings:
        t = round(t + 0.01, 6)
        node.tick(t)
        pings += [(decode(d.data)[0][1], d.target) for d in node.take_datagrams() if decode(d.data)[0][0] == PING]
    assert t <= node.config.probe_interval + 0.01 and pings[0][1] == member_id(3)
    seq = pings[0][0]
    node.receive(packet([ACK, seq], sender=member_id(7)), address(7), t)  # someone else answering for it
    assert node.member(member_id(3)).confirmed is False
    node.receive(packet([ACK, seq + 12345], sender=member_id(3)), address(3), t)  # an ack to no ping of ours
    assert node.member(member_id(3)).confirmed is False
    node.receive(packet([ACK, seq], sender=member_id(3)), address(3), t)
    assert node.member(member_id(3)).confirmed is True
    assert [e.kind for e in node.take_events()] == ["joined", "confirmed"]


def test_a_member_that_moves_must_answer_at_its_new_address():
    node = fresh(GossipConfig())
    node.bootstrap([[member_id(3), *address(3), 0, wire.STATE_ALIVE, b""]], 0.0)
    assert node.member(member_id(3)).confirmed is True  # an out-of-band list is trusted
    node.receive(packet([ALIVE, member_id(3), 1, "10.9.9.9", 7946, b""]), address(99), 0.1)
    assert node.member(member_id(3)).confirmed is False


def test_real_joiners_are_confirmed_at_once_and_forged_ones_never():
    cfg = GossipConfig()
    sim = Simulation(8, cfg, bootstrap=False, seed=9)  # everyone joins through member 0 within 1 s
    joined, confirmed = {}, {}

    def listen(observer: int, event) -> None:
        if event.kind in ("joined", "confirmed"):
            (joined if event.kind == "joined" else confirmed)[(observer, event.member.id)] = event.time
    sim.listeners.append(listen)
    phantom = [ALIVE, "10.200.0.1:7946/feedbeef", 1, "10.200.0.1", 7946, b"ph=joining"]
    sim.at(1.5, lambda: sim.nodes[3].protocol.receive(packet(phantom), ("10.200.0.2", 7946), sim.now))
    sim.run_until(20.0)
    everyone = {sim.member_id(i) for i in range(8)}
    for node in sim.nodes:
        assert {m.id for m in node.protocol.members() if m.confirmed} == everyone
        seen = node.protocol.member(phantom[1])
        assert seen is not None and not seen.confirmed  # it spread, as gossip does, but nobody vouches for it
    delays = [confirmed[key] - joined[key] for key in joined if key[1] != phantom[1]]
    # a newcomer is pinged the moment it is learned of: confirmed within a round trip
    assert len(delays) == 8 * 7 and max(delays) <= 0.05
    pings = sum(node.protocol.stats["confirmation_pings"] for node in sim.nodes)
    assert pings <= 8 * 7 + 8 * 4  # about one per real pair; per member, one at once and three more for the phantom


def test_a_table_full_of_members_that_never_answer_makes_room_for_a_newcomer():
    cfg = GossipConfig(max_members=6)
    node = fresh(cfg)
    for i in range(1, 6):
        node.receive(packet(alive(i)), address(99), 0.0)
    t = 0.0
    while node.member(member_id(6)) is None and t < 30.0:  # nobody answers: pings run out, suspicions start
        t = round(t + 0.05, 6)
        node.tick(t)
        node.take_datagrams()
        node.receive(packet(alive(6)), address(99), t)
    assert node.member(member_id(6)) is not None and len(node.members()) == 6
    assert t < 3 * CONFIRMATION_ATTEMPTS * cfg.probe_interval  # well before any of them died
    for _ in range(400):  # the forgotten member's suspicion, if any, ends quietly
        t = round(t + 0.05, 6)
        node.tick(t)
        node.take_datagrams()
    assert node.next_deadline() > t


def test_dead_and_left_members_are_forgotten_after_their_retention_and_one_that_came_back_is_kept():
    own = MemberState(member_id(0), *address(0), 0, wire.STATE_ALIVE, b"", 0.0, confirmed=True)
    table = MemberTable(own, random.Random(1))
    for i in (1, 2, 3, 4):
        table.add(MemberState(member_id(i), *address(i), 1, wire.STATE_ALIVE, b"", 0.0, confirmed=True))
    table.add(MemberState(member_id(5), *address(5), 1, wire.STATE_DEAD, b"", 0.0, confirmed=True))  # listed dead
    for i, state in ((1, wire.STATE_DEAD), (2, wire.STATE_LEFT), (3, wire.STATE_DEAD)):
        table.mark_gone(member_id(i), 1.0)
        m = table.get(member_id(i))
        m.state, m.since = state, 1.0
    m = table.get(member_id(3))  # refuted its death
    m.state, m.since = wire.STATE_ALIVE, 2.0
    table.mark_live(member_id(3))
    table.reap(5.0, gossip_to_the_dead_time=2.0, dead_retention=10.0, left_retention=3.0)
    assert set(table.by_id) == {member_id(i) for i in (0, 1, 3, 4, 5)} and table.recent_dead == {}
    table.reap(13.0, gossip_to_the_dead_time=2.0, dead_retention=10.0, left_retention=3.0)
    assert set(table.by_id) == {member_id(i) for i in (0, 3, 4)}
    assert not table.has_gone_members() and sorted(table.live) == [member_id(3), member_id(4)]


def test_a_push_pull_carries_the_table_as_it_is_when_sent():
    node = fresh(GossipConfig())
    node.receive(packet(alive(1), alive(2)), address(99), 0.5)

    def pushed(now: float) -> list[list]:
        data = node.push_pull_request(now)
        return wire.Sealer("ftcomm", "t", None, 1 << 20).open(data, wire.STREAM_TYPES, now=now)[1][0][2]

    assert pushed(0.6) == pushed(0.7) == [m.record() for m in node._table.by_id.values()]
    node.set_metadata(b"ph=training", 0.8)
    node.declare_dead(member_id(1), 0.8)
    node.receive(packet(alive(3)), address(99), 0.8)
    records = {r[0]: r for r in pushed(0.9)}
    assert sorted(records) == [member_id(i) for i in range(4)]
    assert records[member_id(0)][3:] == [1, wire.STATE_ALIVE, b"ph=training"]
    assert records[member_id(1)][4] == wire.STATE_DEAD and records[member_id(2)][4] == wire.STATE_ALIVE
