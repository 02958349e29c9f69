"""Whole-group simulation benchmark: invariants over many random seeds, recovery by fault
kind, and agreement time after a crash by group size.

    python benchmarks/group_sim.py --seeds 10000 --replica-seeds 10000   # about an hour on 2 cores
    python benchmarks/group_sim.py --scale 8,64,256,1000  # one crash per size; about a minute
    python benchmarks/group_sim.py --starve-seeds 2000    # CPU starvation drawn too; about 10 minutes
    python benchmarks/group_sim.py --corrupt-seeds 1000   # silent data corruption drawn too (invariant 12)
    python benchmarks/group_sim.py --repair-seeds 1000    # sharded replicas of 2 and 3 repaired in place

Seeds: each draws the users' world and a fault schedule (see ftcomm/sim); the summary
counts invariant violations and gives the time from when the world allowed each
recovery to the next commit of every survivor (median, p99, max per kind), apart for
faults that struck a settled group alone and for faults that struck while another was
active; with
``--baseline-seeds N`` the first N seeds run again without the driver's on-demand probing
of a stalled operation, the baseline of the same run. Scale: N workers start from a static
host list (every member knows every other one and its first record: the gossip cluster
has converged, the first view is still to be agreed; ``--joins`` makes them join through
the first worker instead, which costs many minutes from 256 members up), and once all
run one view, one crashes mid-training; *detected* is when the first survivor, then the
last, declares it suspect or dead (its view breaks there; a crash is usually found by
the connection error of the step in flight); *formed* is when every survivor runs the
new view; *agreement after detection* is formed minus last detection; *datagrams* are
those sent per member from the crash until formed, and how many of them carried a
proposal straight to a member (announcements). Simulated seconds, not wall seconds;
the wall time of the simulation is reported too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ftcomm.core.engine import RUNNING  # noqa: E402
from ftcomm.groupsim import GroupSimulation, run_seeds, summarize  # noqa: E402


def scale_run(n: int, seed: int = 1, converged: bool = True) -> dict:
    """Start ``n`` workers, wait until they all run one view, crash one, time the recovery."""
    sim = GroupSimulation(seed, n=n, faults=[], loss=0.0, duration=300.0, converged=converged)
    victim: list = []
    detected: dict[str, float] = {}

    def listen(index, event):
        if victim and event.member.id == victim[0] and event.kind in ("suspect", "dead"):
            detected.setdefault(sim.sim.member_id(index), sim.sim.now)
    sim.sim.listeners.append(listen)
    started = time.perf_counter()
    t = 0.0
    while not sim._settled_view(sim.live()) and t < 240.0:
        t += 0.5
        sim.sim.run_until(t)
    formed_whole = t
    crash_at = t + 1.0
    sim.sim.run_until(crash_at)
    sent_before = traffic(sim)
    target = sim.live()[n // 2]
    victim.append(target.id)
    sim._crash(target)
    survivors = [w for w in sim.workers.values() if not w.crashed]
    formed_at, t = None, crash_at
    while t < crash_at + 60.0:
        t += 0.02
        sim.sim.run_until(t)
        views = {w.loop.engine.view for w in survivors}
        if len(views) == 1 and None not in views and all(w.loop.engine.state == RUNNING for w in survivors) and \
                victim[0] not in next(iter(views)).members:
            formed_at = t
            break
    sent = [after - before for after, before in zip(traffic(sim), sent_before)]
    last_detect = max(detected.get(w.id, float("inf")) for w in survivors)
    return {
        "n": n,
        "all_in_one_view_at_s": formed_whole,
        "first_detection_s": round(min(detected.values()) - crash_at, 3) if detected else None,
        "last_detection_s": round(last_detect - crash_at, 3),
        "formed_s": round(formed_at - crash_at, 3) if formed_at else None,
        "agreement_after_detection_s": round(formed_at - last_detect, 3) if formed_at else None,
        "datagrams_per_member": round(sent[0] / n, 1),
        "bytes_per_member": round(sent[2] / n),
        "announcements_per_member": round(sent[1] / n, 2),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def traffic(sim: GroupSimulation) -> tuple[int, int, int]:
    """Datagrams sent by all members so far, how many of them were announcements, and bytes."""
    stats = [node.protocol.stats for node in sim.sim.nodes]
    return (sum(s["datagrams_sent"] for s in stats), sum(s["announced"] for s in stats),
            sum(s["bytes_sent"] for s in stats))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=0)
    parser.add_argument("--replica-seeds", type=int, default=0,
                        help="also run N seeds of sharded replicas of 2 processes")
    parser.add_argument("--starve-seeds", type=int, default=0,
                        help="also run N seeds with CPU starvation drawn, plain and sharded replicas of 2")
    parser.add_argument("--corrupt-seeds", type=int, default=0,
                        help="also run N seeds with silent data corruption drawn, plain and sharded replicas of 2")
    parser.add_argument("--repair-seeds", type=int, default=0,
                        help="also run N seeds each of sharded replicas of 2 and of 3 repaired in place (ftcomm run's "
                             "default: a lost process replaced while the others keep their state)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--baseline-seeds", type=int, default=0,
                        help="also run the first N seeds with and without on-demand stall probing")
    parser.add_argument("--scale", default="")
    parser.add_argument("--joins", action="store_true", help="scale: workers join through the first worker")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "group_sim.json"))
    args = parser.parse_args()
    logging.getLogger("ftcomm").setLevel(logging.ERROR)  # the workers' own waits and warnings are noise here
    logging.getLogger("ftcomm.runtime.fingerprints").setLevel(logging.CRITICAL)  # drawn corruption
    result: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result.update(json.load(f))
    if args.seeds:
        started = time.perf_counter()
        summary = summarize(run_seeds(list(range(args.seeds)), processes=args.processes))
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        result["seeds"] = summary
        print(json.dumps(summary, indent=2), flush=True)
    if args.replica_seeds:
        started = time.perf_counter()
        summary = summarize(run_seeds(list(range(args.replica_seeds)), processes=args.processes, replica_size=2))
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        result["replica_seeds"] = summary
        print(json.dumps(summary, indent=2), flush=True)
    for replica_size in (2, 3) if args.repair_seeds else ():
        started = time.perf_counter()
        summary = summarize(run_seeds(list(range(args.repair_seeds)), processes=args.processes,
                                      replica_size=replica_size, repair=True))
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        result[f"repair_replica_seeds_k{replica_size}"] = summary
        print(f"repair, replicas of {replica_size}", json.dumps(summary, indent=2), flush=True)
    drawn = (("starvation", args.starve_seeds, {"starve": True}), ("corruption", args.corrupt_seeds, {"corrupt": True}))
    for world, count, knob in drawn:  # plain workers, then sharded replicas of 2
        for name, replica_size in ((f"{world}_seeds", 1), (f"{world}_replica_seeds", 2)):
            if count:
                started = time.perf_counter()
                summary = summarize(run_seeds(list(range(count)), processes=args.processes,
                                              replica_size=replica_size, **knob))
                summary["wall_s"] = round(time.perf_counter() - started, 1)
                result[name] = summary
                print(name, json.dumps(summary, indent=2), flush=True)
    if args.baseline_seeds:
        # The same seeds with the driver's on-demand probing of a stalled operation off (what
        # the simulation modelled before it ran the driver's watch_stall): its gain.
        kept = {}
        for name, probe_after in (("stall_probe_after_default", None), ("stall_probe_after_0", 0.0)):
            kwargs = {} if probe_after is None else {"stall_probe_after": probe_after}
            kept[name] = summarize(run_seeds(list(range(args.baseline_seeds)), processes=args.processes, **kwargs))
            print(name, json.dumps(kept[name]["recovery_to_next_commit"]), flush=True)
        result["stall_probe_comparison"] = kept
    if args.scale:
        rows = []
        for n in (int(x) for x in args.scale.split(",")):
            rows.append(scale_run(n, converged=not args.joins))
            print(json.dumps(rows[-1]), flush=True)
        result["scale"] = rows
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    violations = sum(result.get(key, {}).get("violations", 0)
                     for key in ("seeds", "replica_seeds", "starvation_seeds", "starvation_replica_seeds",
                                 "repair_replica_seeds_k2", "repair_replica_seeds_k3"))
    return 0 if violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
