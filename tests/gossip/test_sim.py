"""The simulator: faults it injects and what it measures."""

from __future__ import annotations

import json
import subprocess
import sys

from ftcomm.gossip.config import GossipConfig
from ftcomm.gossip.sim import Simulation, run_scenario


def alive_view(sim: Simulation, index: int) -> set[str]:
    return {m.id for m in sim.nodes[index].protocol.members() if m.state == "alive"}


def test_crash_is_detected_by_every_member_within_the_bound():
    cfg = GossipConfig()
    result = run_scenario(50, duration=30.0, crash_at=10.0, metadata_at=5.0)
    assert result.crash_undetected_members == 0
    assert result.crash_last_dead_s <= cfg.detection_bound(50)
    assert result.crash_first_dead_s >= cfg.min_suspicion_timeout(50)
    assert result.metadata_reached_fraction == 1.0 and result.metadata_9999pct_s < 2.5
    assert result.false_dead_declarations == 0


def test_short_stall_under_loss_is_not_declared_dead():
    result = run_scenario(30, loss=0.05, duration=40.0, crash_at=None, stall_at=10.0, stall_for=2.0, seed=3)
    assert result.stalled_member_declared_dead is False
    assert result.false_dead_declarations == 0


def test_partition_splits_the_cluster_and_healing_merges_it():
    n = 8
    sim = Simulation(n, seed=4)
    left, right = set(range(4)), set(range(4, 8))
    sim.at_partition(2.0, left, right, heal_at=25.0)
    sim.run_until(24.0)
    ids = [sim.member_id(i) for i in range(n)]
    for i in range(n):
        own_side = left if i in left else right
        assert alive_view(sim, i) == {ids[j] for j in own_side}, f"member {i} during the partition"
    sim.run_until(45.0)
    for i in range(n):
        assert alive_view(sim, i) == set(ids), f"member {i} after healing"


def test_large_cluster_joining_through_one_seed_converges():
    sim = Simulation(64, bootstrap=False, seed=5)
    sim.run_until(20.0)
    everyone = {sim.member_id(i) for i in range(64)}
    assert all(alive_view(sim, i) == everyone for i in range(64))


def test_command_line_prints_json():
    out = subprocess.run([sys.executable, "-m", "ftcomm.gossip.sim", "--n", "20", "--duration", "20",
                          "--crash-at", "5", "--json", "--set", "probe_interval=0.4"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    result = json.loads(out)
    assert result["n"] == 20 and result["probe_interval_s"] == 0.4
    assert result["crash_undetected_members"] == 0 and result["messages_per_member_s"] > 0


def test_sync_with_repairs_an_update_that_gossip_missed():
    """A metadata update whose broadcasts were all lost reaches a member that syncs with its
    owner at once (and spreads from there); without the sync nobody has it a second later."""
    from ftcomm.gossip.broadcast import BroadcastQueue

    def run(sync: bool) -> list[bytes]:
        sim = Simulation(4, seed=7)
        owner = sim.nodes[0]

        def update_lost_everywhere() -> None:
            owner.protocol.set_metadata(b"\x81\xa2pv\x03", sim.now)
            owner.protocol._broadcasts = BroadcastQueue()  # every copy of the broadcast lost

        def sync_now() -> None:
            assert sim.nodes[1].protocol.sync_with(owner.protocol.id, sim.now)
            assert not sim.nodes[1].protocol.sync_with(sim.nodes[1].protocol.id, sim.now)  # not with itself
            sim._after(sim.nodes[1])
        sim.at(3.0, update_lost_everywhere)
        if sync:
            sim.at(3.5, sync_now)
        sim.run_until(4.5)
        return [next(m.metadata for m in sim.nodes[i].protocol.members() if m.id == owner.protocol.id)
                for i in (1, 2, 3)]

    assert run(sync=True) == [b"\x81\xa2pv\x03"] * 3
    assert b"\x81\xa2pv\x03" not in run(sync=False)
