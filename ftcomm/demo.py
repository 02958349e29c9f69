"""Demonstrations that run on one machine: ``ftcomm demo gossip``."""

from __future__ import annotations

import signal
import time

from .gossip.config import GossipConfig
from .gossip.local import LocalCluster


def gossip_demo(members: int = 8, out=print) -> int:
    """Start ``members`` local gossip members, SIGKILL one, and show who noticed when."""
    config = GossipConfig()
    bound = config.detection_bound(members)
    out(f"starting {members} gossip members on 127.0.0.1 ...")
    with LocalCluster(members) as cluster:
        waited = cluster.wait_converged()
        out(f"all {members} members see each other ({waited * 1000:.0f} ms after the last one joined)")
        victim = cluster.agents[members // 2]
        out(f"\nkill -9 {victim.id} (pid {victim.pid})")
        killed_at = time.time()
        victim.signal(signal.SIGKILL)
        survivors = [a for a in cluster.agents if a is not victim]
        out(f"waiting for every survivor to mark it dead (bound {bound:.1f} s) ...\n")
        rows = []
        for agent in survivors:
            dead = agent.wait_for(lambda e: e.get("member") == victim.id and e.get("kind") == "dead",
                                  bound + 5, "death notice")
            suspect = agent.member_events(victim.id, "suspect")
            rows.append((agent.id, suspect[0]["t"] - killed_at if suspect else None, dead["t"] - killed_at,
                         dead["source"]))
        out(f"{'member':32s} {'suspected after':>16s} {'marked dead after':>18s}  declared by")
        for member_id, suspected, dead, source in sorted(rows, key=lambda r: r[2]):
            suspected_text = f"{suspected:.3f} s" if suspected is not None else "-"
            out(f"{member_id:32s} {suspected_text:>16s} {dead:>16.3f} s  {source}")
        first, last = min(r[2] for r in rows), max(r[2] for r in rows)
        out(f"\nfirst survivor marked it dead after {first:.3f} s, the last after {last:.3f} s "
            f"(min suspicion timeout {config.min_suspicion_timeout(members):.2f} s, "
            f"probe interval {config.probe_interval:.2f} s)")
    return 0
