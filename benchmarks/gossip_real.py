"""Gossip benchmark 2: 32 real member processes on loopback.

    python benchmarks/gossip_real.py [--members 32] [--idle 60] [--kills 3]

Measures, per member, CPU (fraction of one core) and datagrams and bytes sent per
second over an idle window, then the crash detection latency on real sockets (kill -9
of one member; time until the first and the last survivor mark it dead), repeated
``--kills`` times, then ``--leaves`` graceful leaves (time from the leave until the first
and the last member mark the leaver left). The baseline, computed in the same run, is
the simulator's prediction for the same N and configuration, and the configured
detection bound; a leave is compared with the crashes of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ftcomm.gossip.config import GossipConfig
from ftcomm.gossip.local import LocalCluster
from ftcomm.gossip.sim import run_scenario


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--members", type=int, default=32)
    parser.add_argument("--idle", type=float, default=60.0, help="seconds of the idle window")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--leaves", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gossip_real.json"))
    args = parser.parse_args()
    cfg = GossipConfig()
    n = args.members
    with LocalCluster(n) as cluster:
        converge_s = cluster.wait_converged(timeout=60)
        before = [a.request(cmd="stats") for a in cluster.agents]
        time.sleep(args.idle)  # the measurement window: the members run undisturbed
        after = [a.request(cmd="stats") for a in cluster.agents]
        cpu, msgs, sent = [], [], []
        for b, a in zip(before, after):
            window = a["t"] - b["t"]
            cpu.append((a["cpu_s"] - b["cpu_s"]) / window)
            msgs.append((a["stats"].get("datagrams_sent", 0) - b["stats"].get("datagrams_sent", 0)) / window)
            sent.append((a["stats"].get("bytes_sent", 0) - b["stats"].get("bytes_sent", 0)) / window)
        kills = []
        alive = list(cluster.agents)
        for k in range(args.kills):
            victim = alive[len(alive) // 2]
            alive.remove(victim)
            killed_at = time.time()
            victim.signal(signal.SIGKILL)
            latencies = []
            for agent in alive:
                event = agent.wait_for(lambda e: e.get("member") == victim.id and e.get("kind") == "dead",
                                       cfg.detection_bound(n) + 10, "death notice")
                latencies.append(event["t"] - killed_at)
            kills.append({"first_dead_s": round(min(latencies), 3), "last_dead_s": round(max(latencies), 3)})
            cluster.wait_converged(timeout=30, agents=alive)
        leaves = []
        for k in range(args.leaves):
            leaver = alive[len(alive) // 2]
            alive.remove(leaver)
            marks = [len(agent.snapshot()) for agent in alive]
            leaver.send(cmd="leave")
            leaving = leaver.wait_for(lambda e: e["ev"] == "leaving", 10, "the leave to start")
            latencies, kinds = [], set()
            for agent, mark in zip(alive, marks):
                event = agent.wait_for(lambda e: e.get("member") == leaver.id and e.get("kind") in ("left", "dead"),
                                       cfg.detection_bound(n) + 10, "leave notice", mark)
                latencies.append(event["t"] - leaving["t"])
                kinds.add(event["kind"])
            leaves.append({"first_left_s": round(min(latencies), 3), "last_left_s": round(max(latencies), 3),
                           "seen_as": sorted(kinds)})
            cluster.wait_converged(timeout=30, agents=alive)
    predicted = asdict(run_scenario(n, duration=60.0, crash_at=20.0, metadata_at=None, seed=21))
    idle = asdict(run_scenario(n, duration=args.idle, crash_at=None, metadata_at=None, seed=22))
    report = {
        "benchmark": "gossip_real",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "members": n,
        "idle_window_s": args.idle,
        "converge_s": round(converge_s, 3),
        "cpu_fraction_of_one_core": {"median": round(statistics.median(cpu), 5), "max": round(max(cpu), 5),
                                     "target_max": 0.01},
        "datagrams_per_member_s": {"median": round(statistics.median(msgs), 2), "max": round(max(msgs), 2)},
        "bytes_per_member_s": {"median": round(statistics.median(sent), 1), "max": round(max(sent), 1)},
        "crash_detection": kills,
        "crash_last_dead_median_s": statistics.median(k["last_dead_s"] for k in kills),
        "graceful_leave": leaves,
        "leave_last_left_median_s": statistics.median(k["last_left_s"] for k in leaves) if leaves else None,
        "baseline": {
            "simulated_first_dead_s": predicted["crash_first_dead_s"],
            "simulated_last_dead_s": predicted["crash_last_dead_s"],
            "simulated_idle_messages_per_member_s": idle["messages_per_member_s"],
            "simulated_idle_bytes_per_member_s": idle["bytes_per_member_s"],
            "configured_detection_bound_s": round(cfg.detection_bound(n), 3),
        },
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
