"""Behaviour of the sans-I/O protocol core, one behaviour per test, on a virtual clock."""

from __future__ import annotations

from ftcomm.gossip import wire
from ftcomm.gossip.config import GossipConfig
from ftcomm.gossip.members import ANSWER_HALF_LIFE_S, MemberState
from ftcomm.gossip.wire import ACK, ALIVE, DEAD, NACK, PING, PING_REQ, SUSPECT

from ftcomm.gossip.protocol import Protocol

from .helpers import MiniNet, address, decode, lone_node, member_id, packet

CFG = GossipConfig()


def test_probe_is_acked_and_nobody_is_suspected():
    net = MiniNet(2)
    net.run(5.0)
    pings = [t for t in net.trace if t[1] == 0 and PING in t[3]]
    acks = [t for t in net.trace if t[1] == 1 and t[2] == 0 and ACK in t[3]]
    assert len(pings) >= 8 and len(acks) == len(pings)
    assert all(ping[0] == ack[0] for ping, ack in zip(pings, acks))  # answered in the same instant
    assert net.nodes[0].awareness == 0
    assert net.kinds(0, 1) == [] and net.kinds(1, 0) == []


def test_indirect_probe_rescues_a_member_whose_direct_path_drops():
    net = MiniNet(5)
    net.blocked |= {(0, 1), (1, 0)}
    net.run(10.0)
    assert any(t[1] == 0 and PING_REQ in t[3] for t in net.trace), "member 0 never asked for help"
    relayed_acks = [t for t in net.trace if t[2] == 0 and ACK in t[3] and t[1] != 1]
    assert relayed_acks, "no ack was relayed back to member 0"
    assert "suspect" not in net.kinds(0, 1)
    assert all("dead" not in net.kinds(i, 1) for i in range(5))


def test_suspect_only_after_direct_and_indirect_probes_fail():
    net = MiniNet(4)
    net.down.add(3)
    net.run(3.0)
    suspicion = next(e for i in range(3) for e in net.events[i]
                     if e.member.id == member_id(3) and e.kind == "suspect" and e.source == member_id(i))
    suspecter = int(suspicion.source.split(".")[3].split(":")[0])
    ping_reqs = [t for t in net.trace if t[1] == suspecter and PING_REQ in t[3] and t[0] < suspicion.time]
    assert ping_reqs, "suspected without indirect probes"
    # the probe that failed started at least one probe interval before the suspicion
    assert suspicion.time - ping_reqs[-1][0] >= CFG.probe_interval - CFG.probe_timeout - 0.01


def test_dead_after_the_suspicion_timeout():
    net = MiniNet(3)  # too few members to confirm, so the timeout is the minimum
    net.down.add(2)
    net.run(8.0)
    for i in (0, 1):
        suspected, dead = net.first(i, 2, "suspect"), net.first(i, 2, "dead")
        assert suspected is not None and dead is not None
    origin = min((net.first(i, 2, "suspect") for i in (0, 1)), key=lambda e: e.time)
    first_dead = min(net.first(i, 2, "dead").time for i in (0, 1))
    assert abs((first_dead - origin.time) - CFG.min_suspicion_timeout(3)) < 0.02


def test_refutation_with_a_higher_incarnation_cancels_suspicion():
    net = MiniNet(3)
    rumour = packet([SUSPECT, member_id(1), 0, member_id(0)], sender=member_id(0))
    net.nodes[2].receive(rumour, address(0), net.now)
    net.nodes[1].receive(rumour, address(0), net.now)
    net.run(CFG.max_suspicion_timeout(3) + 2.0)
    assert net.nodes[1].incarnation == 1
    assert net.kinds(2, 1)[:2] == ["suspect", "alive"]
    assert net.nodes[2].member(member_id(1)).state == "alive"
    assert net.nodes[2].member(member_id(1)).incarnation == 1
    assert all("dead" not in net.kinds(i, 1) for i in range(3))


def test_buddy_system_puts_the_suspicion_on_the_probe_to_the_suspect():
    node = lone_node(1, GossipConfig(retransmit_mult=1))
    node.receive(packet([SUSPECT, member_id(1), 0, member_id(99)]), address(99), 0.0)
    t = 0.0
    while len(node._broadcasts):  # let ordinary gossip retire the news first
        t += 0.05
        node.tick(t)
    node.take_datagrams()
    for _ in range(200):
        t += 0.05
        node.tick(t)
        pings = [decode(d.data) for d in node.take_datagrams() if d.target == member_id(1)]
        pings = [m for m in pings if m[0][0] == PING]
        if pings:
            break
    messages = pings[0]
    assert [SUSPECT, member_id(1), 0, member_id(0)] in messages


def test_awareness_rises_on_missed_acks_and_nacks_stretches_the_interval_and_falls_on_success():
    node = lone_node(3)
    t, ping_times, score_after_failure = 0.0, [], None
    while t < 6.0:
        t = round(t + 0.01, 6)
        node.tick(t)
        for d in node.take_datagrams():
            messages = decode(d.data)
            if messages[0][0] == PING and messages[0][1] not in node._dead_pings:  # a probe, not a ping to the dead
                ping_times.append(t)
                seq = messages[0][1]
    assert node.awareness > 0
    gaps = [b - a for a, b in zip(ping_times, ping_times[1:])]
    assert max(gaps) > CFG.probe_interval * 1.5, f"probe interval not stretched: {gaps}"
    score_after_failure = node.awareness
    node.receive(packet([ACK, seq], sender=member_id(1)), address(1), t)
    assert node.awareness == score_after_failure - 1


def test_nacks_from_healthy_helpers_do_not_raise_awareness():
    node = lone_node(3)
    t = 0.0
    while node.stats["probes_failed"] == 0:
        t = round(t + 0.01, 6)
        node.tick(t)
        for d in node.take_datagrams():
            messages = decode(d.data)
            if messages[0][0] == PING_REQ:  # the helper cannot reach the target either
                node.receive(packet([NACK, messages[0][1]], sender=d.target), d.address, t)
    assert node.awareness == 0


def test_old_incarnations_and_dead_replays_are_ignored():
    node = lone_node(1)
    b, now = member_id(1), 1.0
    node.receive(packet([ALIVE, b, 5, *address(1), b"new"]), address(9), now)
    node.receive(packet([ALIVE, b, 3, *address(1), b"old"]), address(9), now)
    node.receive(packet([SUSPECT, b, 4, member_id(9)]), address(9), now)
    node.receive(packet([DEAD, b, 4, member_id(9)]), address(9), now)
    info = node.member(b)
    assert (info.state, info.incarnation, info.metadata) == ("alive", 5, b"new")
    node.receive(packet([DEAD, b, 5, member_id(9)]), address(9), now)
    assert node.member(b).state == "dead"
    node.receive(packet([ALIVE, b, 5, *address(1), b"new"]), address(9), now)  # replay of the old alive
    assert node.member(b).state == "dead"
    node.receive(packet([ALIVE, b, 6, *address(1), b"new"]), address(9), now)  # a real rejoin
    assert node.member(b).state == "alive" and node.member(b).incarnation == 6
    kinds = [e.kind for e in node.take_events()]
    assert kinds == ["metadata", "dead", "alive"]


def test_leave_is_seen_as_left_not_dead_within_a_second():
    net = MiniNet(6)
    net.run(1.0)
    net.nodes[5].leave(net.now)
    left_at = net.now
    net.run(1.0)
    for i in range(5):
        event = net.first(i, 5, "left")
        assert event is not None and event.time - left_at < 1.0
        assert "dead" not in net.kinds(i, 5)
    net.down.add(5)
    net.run(CFG.max_suspicion_timeout(6) + 2)
    assert all(net.nodes[i].member(member_id(5)).state == "left" for i in range(5))


def test_metadata_set_just_before_leaving_arrives_before_the_leave_notice():
    net = MiniNet(4)
    net.run(1.0)
    net.nodes[3].set_metadata(b"final", net.now)  # queued, then replaced by the notice at once
    net.nodes[3].leave(net.now)
    net.run(1.0)
    for i in range(3):
        member = net.nodes[i].member(member_id(3))
        assert (member.state, member.metadata) == ("left", b"final")
        kinds = net.kinds(i, 3)
        assert "metadata" in kinds and kinds.index("metadata") < kinds.index("left")


def test_push_pull_merges_a_divergent_table():
    from ftcomm.gossip.protocol import Protocol

    a = Protocol(member_id(0), *address(0), seed=1)
    b = Protocol(member_id(1), *address(1), seed=2)
    a.bootstrap([[member_id(2), *address(2), 3, wire.STATE_ALIVE, b"c"]], 0.0)
    b.bootstrap([[member_id(3), *address(3), 7, wire.STATE_ALIVE, b"d"]], 0.0)
    a.start(0.0)
    b.start(0.0)
    reply = b.handle_stream(a.join_request(1.0), 1.0)
    assert a.handle_stream_reply(reply, 1.0)
    for node in (a, b):
        ids = {m.id for m in node.members() if m.state == "alive"}
        assert ids == {member_id(i) for i in range(4)}
    assert a.member(member_id(3)).incarnation == 7 and b.member(member_id(2)).metadata == b"c"


def test_contact_sends_a_join_request_to_an_address_outside_the_table():
    """A member known by its address only (not in the table) is sent a join request; its
    answer confirms it and merges both tables."""
    from ftcomm.gossip.protocol import Protocol

    a = Protocol(member_id(0), *address(0), seed=1)
    b = Protocol(member_id(1), *address(1), seed=2)
    a.start(0.0)
    b.start(0.0)
    a.take_stream_requests()
    a.contact(address(1), 1.0)
    [request] = a.take_stream_requests()
    assert request.address == address(1) and request.target is None and request.purpose == "join"
    assert a.handle_stream_reply(b.handle_stream(request.data, 1.0), 1.0, request.address)
    assert a.member(member_id(1)).state == "alive" and a.member(member_id(1)).confirmed
    assert b.member(member_id(0)).state == "alive"


def test_metadata_change_reaches_every_member():
    net = MiniNet(20)
    net.run(0.5)
    net.nodes[7].set_metadata(b"step=42", net.now)
    changed_at = net.now
    net.run(2.0)
    times = []
    for i in range(20):
        if i == 7:
            continue
        assert net.nodes[i].member(member_id(7)).metadata == b"step=42"
        times.append(net.first(i, 7, "metadata").time - changed_at)
    assert max(times) < 2.0


def test_a_member_declared_dead_learns_it_and_rejoins_with_a_new_incarnation():
    net = MiniNet(4)
    net.down.add(3)
    net.run(CFG.max_suspicion_timeout(4) + 2)
    assert all(net.nodes[i].member(member_id(3)).state == "dead" for i in range(3))
    net.down.discard(3)  # it was only paused: it resumes with its old table
    net.run(3.0)
    assert net.nodes[3].incarnation >= 1
    for i in range(3):
        info = net.nodes[i].member(member_id(3))
        assert info.state == "alive" and info.incarnation == net.nodes[3].incarnation


def test_declared_dead_on_evidence_spreads_and_a_live_member_refutes_it():
    net = MiniNet(4)
    net.run(0.5)
    assert net.nodes[0].declare_dead(member_id(3), net.now)
    assert not net.nodes[0].declare_dead(member_id(3), net.now)  # already dead
    net.run(0.5)
    assert all(net.first(i, 3, "dead") is not None for i in (1, 2))
    net.run(3.0)  # member 3 is alive: it hears of its death and rejoins
    assert all(net.nodes[i].member(member_id(3)).state == "alive" for i in range(3))


def test_probe_now_suspects_a_silent_member_within_the_probe_timeout_and_spares_a_live_one():
    net = MiniNet(5)
    net.run(1.0)
    net.down.add(4)  # stopped: answers nothing, refuses nothing
    started = net.now
    assert net.nodes[0].probe_now([member_id(1), member_id(4), member_id(0)], net.now) == 2  # not itself
    assert net.nodes[0].probe_now([member_id(4)], net.now) == 0  # one at a time per member
    net._deliver()
    assert any(t[1] == 0 and PING_REQ in t[3] and t[0] == started for t in net.trace), "helpers asked at once"
    net.run(CFG.probe_timeout + 0.02)
    suspected = net.first(0, 4, "suspect")
    assert suspected is not None and suspected.time - started <= CFG.probe_timeout + 0.02
    assert "suspect" not in net.kinds(0, 1)
    assert net.nodes[0].stats["urgent_probes"] == 2


def test_an_urgent_probe_waits_longer_on_a_member_that_answered_slowly_of_late():
    net = MiniNet(3)
    net.run(1.0)
    prober = net.nodes[0]
    prober.probe_now([member_id(1)], net.now)
    held = [d for d in prober.take_datagrams() if d.address == address(1)]  # the helpers' requests are lost
    net.now += 0.04  # member 1's host is loaded: its answer comes 40 ms late
    for d in held:
        net.nodes[1].receive(d.data, address(0), net.now)
    net._deliver()
    slowest = prober._table.get(member_id(1)).recent_slowest(net.now)
    assert 0.039 <= slowest <= 0.041
    net.run(0.3)
    assert "suspect" not in net.kinds(0, 1)
    net.down |= {1, 2}  # both stop; only member 1 was slow before
    started = net.now
    slowest = prober._table.get(member_id(1)).recent_slowest(net.now)
    assert slowest > 0.03
    assert prober.probe_now([member_id(1), member_id(2)], net.now) == 2
    net.run(CFG.probe_timeout + 0.02)
    quick, slow = net.first(0, 2, "suspect"), net.first(0, 1, "suspect")
    assert quick is not None and quick.time - started <= CFG.urgent_probe_timeout + 0.01
    assert slow is not None and slow.time - started >= min(4 * slowest, CFG.probe_timeout) - 0.01 > quick.time - started


def test_a_member_that_runs_late_says_so_and_is_probed_on_demand_with_a_window_that_fits():
    """Lifeguard's local health, told to the prober: member 1's timers fire 150 ms late (its
    cores are taken by busy processes); its answers say so, and an on-demand probe of it
    then waits long enough for an answer as late as that, while a quiet member's window
    stays ``urgent_probe_timeout``."""
    net = MiniNet(3, config=GossipConfig(probe_interval=0.5))
    net.run(1.0)
    starved = net.nodes[1]
    for _ in range(4):  # its timer is set for the deadline; it runs 150 ms later
        due = starved.next_deadline()
        starved.timer_armed(due)
        starved.tick(due + 0.15)
        net._deliver()
    assert 0.14 < starved.lateness(net.now) <= 0.151
    prober = net.nodes[0]
    prober.probe_now([member_id(1)], net.now)
    net._deliver()  # member 1 answers at once this time, saying how late it runs
    said = prober._table.get(member_id(1))
    assert 0.14 < said.recent_lateness(net.now) <= 0.151
    quiet, late = prober._table.get(member_id(2)), said
    assert prober._urgent_timeout(quiet, net.now) < CFG.urgent_probe_timeout + 0.05
    assert prober._urgent_timeout(late, net.now) >= CFG.urgent_probe_timeout + 2 * 0.14
    assert prober._urgent_timeout(late, net.now) <= 0.5  # never beyond a probe interval
    # A stopped process is not a slow one: a pause of seconds is not published as lateness.
    paused = net.nodes[2]
    paused.timer_armed(paused.next_deadline())
    paused.tick(paused.next_deadline() + 3.0)
    assert paused.lateness(net.now + 3.0) < 0.01
    # What a member says is held to a probe interval: one answer cannot stretch it for long.
    prober.probe_now([member_id(2)], net.now)
    (ping,) = [d for d in prober.take_datagrams() if d.address == address(2)][:1]
    seq = decode(ping.data)[0][1]
    prober.receive(packet([ACK, seq, wire.MAX_LATENESS_MS], sender=member_id(2)), address(2), net.now)
    assert 0.49 < prober._table.get(member_id(2)).recent_lateness(net.now) <= 0.5  # (60 s said)
    assert prober._urgent_timeout(prober._table.get(member_id(2)), net.now) <= 0.5


def test_a_slow_answer_stops_stretching_the_urgent_probe_within_seconds():
    # One slow answer (or this member paused while the answer waited to be read) must not
    # stretch the on-demand probe of that member for minutes in a large group, where the
    # member is probed directly only now and then.
    m = MemberState("m", "10.0.0.1", 7946, 0, wire.STATE_ALIVE, b"", 0.0)
    m.answered(1.5, now=10.0)
    assert m.recent_slowest(10.0) == 1.5
    assert m.recent_slowest(10.0 + 6 * ANSWER_HALF_LIFE_S) * 4 < CFG.urgent_probe_timeout
    m.answered(0.001, now=10.0 + ANSWER_HALF_LIFE_S)
    assert abs(m.recent_slowest(10.0 + ANSWER_HALF_LIFE_S) - 0.75) < 1e-9  # the slow one still counts, halved


def test_an_urgent_probe_is_not_held_against_its_target_when_the_prober_itself_was_paused():
    net = MiniNet(3)
    net.run(1.0)
    net.nodes[0].probe_now([member_id(1)], net.now)
    net.nodes[0].take_datagrams()  # the ping is lost with the pause
    net.now += 3 * CFG.probe_interval  # member 0's process did not run meanwhile
    net.nodes[0].tick(net.now)
    assert "suspect" not in [e.kind for e in net.nodes[0].take_events() if e.member.id == member_id(1)]


def test_every_announcement_carries_the_recent_deaths_and_departures():
    # Piggybacked news goes out a few times only: on every member, an announcement to the
    # view's members, in view order, would hand a death to the same first targets and never
    # to the last ones, which then keep proposing a view with the dead member in it.
    node = lone_node(9)
    node.declare_dead(member_id(9), 0.1)
    node.receive(packet([DEAD, member_id(8), 0, member_id(8), b"final"], sender=member_id(8)), address(8), 0.1)
    node.take_datagrams()
    for _ in range(3):  # more announcements than the news' transmissions
        assert node.announce([member_id(i) for i in range(1, 8)], 0.2) == 7
    sent = node.take_datagrams()
    assert len(sent) == 21
    for datagram in sent:
        messages = decode(datagram.data)
        assert [ALIVE, member_id(0)] == messages[0][:2]
        assert [DEAD, member_id(9), 0, member_id(0)] in messages  # its own claim
        assert [DEAD, member_id(8), 0, member_id(8), b"final"] in messages  # the departure as announced


def test_an_announcement_with_long_departure_notices_stays_within_the_datagram_limit():
    config = GossipConfig().with_overrides(max_datagram_bytes=512)
    node = lone_node(9, config=config)
    node.set_metadata(b"s" * 200, 0.05)  # a status record of its own
    for i in (8, 9):  # two members left with long final records
        node.receive(packet([DEAD, member_id(i), 0, member_id(i), bytes([i]) * 240], sender=member_id(i)),
                     address(i), 0.1)
    node.declare_dead(member_id(7), 0.1)
    node.take_datagrams()
    node.announce([member_id(i) for i in range(1, 7)], 0.2)
    sent = node.take_datagrams()
    assert sent and all(len(d.data) <= 512 for d in sent)
    for datagram in sent:
        messages = decode(datagram.data)
        assert messages[0][:2] == [ALIVE, member_id(0)]
        assert [DEAD, member_id(7), 0, member_id(0)] in messages  # a short notice is not kept out by long ones


def test_a_member_that_missed_a_refutation_is_told_directly_and_never_buries_the_member():
    # Member 1 refutes a suspicion and every datagram carrying the refutation to member 2 is
    # lost; once the broadcasts are spent, member 2 alone holds the old incarnation. Its
    # suspicion of that incarnation is stale to everyone else, so nobody gossips the
    # refutation again: member 1 must answer the stale notice itself (no anti-entropy here
    # to repair it sooner or later).
    net = MiniNet(5, GossipConfig(push_pull_interval=0))
    net.run(0.5)
    node = net.nodes[2]
    receive = node.receive

    def lossy(data, source, now):
        if not any(m[0] == ALIVE and m[1] == member_id(1) for m in decode(data)):
            receive(data, source, now)

    node.receive = lossy
    net.nodes[1].receive(packet([SUSPECT, member_id(1), 0, member_id(0)], sender=member_id(0)), address(0), net.now)
    net.run(6.0)
    node.receive = receive
    assert net.nodes[1].incarnation == 1
    assert node.member(member_id(1)).incarnation == 0 and "suspect" not in net.kinds(2, 1)
    node.receive(packet([SUSPECT, member_id(1), 0, member_id(3)], sender=member_id(3)), address(3), net.now)
    net.run(CFG.max_suspicion_timeout(5) + 1.0)
    assert "dead" not in net.kinds(2, 1)
    info = node.member(member_id(1))
    assert (info.state, info.incarnation) == ("alive", 1)


def test_a_member_declared_dead_that_answers_a_ping_is_told_and_refutes():
    """After a partition heals, one side may hold the other dead while it runs on unaware:
    every probe interval it pings one dead member, and one that acks is told it was declared
    dead (it refutes, and its new incarnation spreads), instead of waiting for a reconnection.
    (b only answers here, and a does not gossip to the dead: a probe of b's own, or a's
    gossip of its death, would tell it too.)"""
    a, b = (Protocol(member_id(i), *address(i), config=CFG, seed=i + 1) for i in (0, 1))
    for node in (a, b):
        node.bootstrap([a.record(), b.record()], 0.0)
        node.start(0.0)
    a.declare_dead(b.id, 0.1)
    a._table.recent_dead.clear()  # (as after gossip_to_the_dead_time: no gossip to it any more)
    a.take_datagrams()
    t = 0.1
    while t < 3.0 and not a.stats["dead_told"]:
        t = round(t + 0.05, 6)
        a.tick(t)
        for d in a.take_datagrams():
            if d.target == b.id:
                b.receive(d.data, address(0), t)
        for d in b.take_datagrams():
            if d.target == a.id:
                a.receive(d.data, address(1), t)
    assert a.stats["dead_pinged"] >= 1 and a.stats["dead_told"] == 1
    for d in a.take_datagrams():  # the notice
        if d.target == b.id:
            b.receive(d.data, address(0), t)
    assert b.incarnation > 0  # it learned it was declared dead, and refuted


def _pause_then_probe(net: MiniNet, announce: bool = True):
    """Member 1 starts a pause (a full garbage collection: its gossip thread cannot answer)
    and, with ``announce``, says so first; member 0 probes it on demand meanwhile. The ping
    waits unread, as in a socket buffer. Returns the prober, the held ping and when it started."""
    prober, paused = net.nodes[0], net.nodes[1]
    if announce:  # to every member it knows
        for i, node in enumerate(net.nodes):
            if node is not paused:
                node.receive(paused.pause_notice(0.0, 0), address(1), net.now)
    started = net.now
    assert prober.probe_now([member_id(1)], net.now) == 1
    held = [d for d in prober.take_datagrams() if d.address == address(1)]
    net.down.add(1)
    return prober, held, started


def test_a_member_that_announced_a_pause_is_not_suspected_while_its_ping_waits_unread():
    net = MiniNet(3)
    net.run(1.0)
    prober, held, _ = _pause_then_probe(net)
    net.run(0.6)  # six times the urgent probe's window; the announced pause (1 s) still runs
    assert "suspect" not in net.kinds(0, 1)
    net.down.discard(1)  # the collection ends: the ping is read and answered
    for d in held:
        net.nodes[1].receive(d.data, address(0), net.now)
    net._deliver()
    net.run(2.0)
    assert "suspect" not in net.kinds(0, 1) and prober.stats["pause_notices"] == 1
    # Without the notice the same silence is a hang (the probe's window is 0.1 s).
    net2 = MiniNet(3)
    net2.run(1.0)
    _, _, started = _pause_then_probe(net2, announce=False)
    net2.run(0.6)
    suspected = net2.first(0, 1, "suspect")
    assert suspected is not None and suspected.time - started <= CFG.urgent_probe_timeout + 0.02


def test_a_member_that_stays_silent_after_its_pause_notice_is_suspected_once_the_grace_ends():
    net = MiniNet(3)
    net.run(1.0)
    _, _, started = _pause_then_probe(net)  # and then stopped for good (SIGSTOP, a lost node)
    net.run(CFG.pause_grace + 0.5)
    suspected = net.first(0, 1, "suspect")
    assert suspected is not None
    assert CFG.pause_grace - 0.01 <= suspected.time - started <= CFG.pause_grace + 0.02


def test_a_pause_notice_is_honoured_only_from_a_live_member_at_its_incarnation_or_newer():
    net = MiniNet(3)
    net.run(1.0)
    prober = net.nodes[0]
    prober.receive(packet([wire.PAUSE, 0, 0], sender=member_id(7)), address(7), net.now)  # not a member
    net.nodes[1].receive(packet([SUSPECT, member_id(1), 0, member_id(2)], sender=member_id(2)), address(2), net.now)
    net.run(0.5)  # member 1 refuted: incarnation 1, known everywhere
    assert prober._table.get(member_id(1)).incarnation == 1
    stale = packet([wire.PAUSE, 0, 0], sender=member_id(1))  # older than its incarnation
    prober.receive(stale, address(1), net.now)
    assert prober.stats["pause_notices_ignored"] == 2 and prober._table.get(member_id(1)).paused_until == 0.0
    prober.receive(packet([wire.PAUSE, 2, 0], sender=member_id(1)), address(1), net.now)  # its refutation still on the way
    assert prober._table.get(member_id(1)).paused_until == net.now + CFG.pause_grace
    prober.receive(net.nodes[1].pause_notice(0.0, 1), address(1), net.now + 0.5)  # another collection
    assert prober._table.get(member_id(1)).paused_until == net.now + 0.5 + CFG.pause_grace
    prober.receive(net.nodes[1].pause_notice(0.0, 1), address(1), net.now + 0.9)  # a copy, or a replay
    assert prober._table.get(member_id(1)).paused_until == net.now + 0.5 + CFG.pause_grace
    assert prober.stats["pause_notices_old"] == 1
    off = MiniNet(2, config=GossipConfig(pause_grace=0))
    off.run(1.0)
    off.nodes[0].receive(off.nodes[1].pause_notice(0.0, 0), address(1), off.now)
    assert off.nodes[0]._table.get(member_id(1)).paused_until == 0.0
