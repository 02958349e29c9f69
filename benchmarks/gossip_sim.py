"""Gossip benchmark 1 and 3, on the simulator: detection, dissemination, false positives, traffic, speed.

    python benchmarks/gossip_sim.py [--quick] [--out benchmarks/results/gossip_sim.json]

Two suspicion rules side by side, in the same run: *ours* (the defaults: a suspicion
confirmed by K = 3 independent suspecters runs out after ``confirmed_suspicion_mult *
probe_interval`` = 2.5 s at any size, and the refutation goes straight to the suspecter)
and *memberlist* (``confirmed_suspicion_mult=0``: the minimum grows with log10 N, 7.5 s at
N = 1000, as in memberlist and Lifeguard's paper).

Detection and dissemination: N = 10, 100, 1000 at 0% and 5% loss, 60 virtual seconds,
member 0 changes its metadata at t=10 s and the last member crashes at t=20 s (ours).
Beside each detection figure stands SWIM's analytic expectation of the first detection,
T * e / (e - 1), computed for the same probe interval; detection is also repeated over
many crashes at random instants (200 at N=10, 50 at N=100, 10 at N=1000) per loss rate
and rule, with the mean and percentiles of the time until the last member marks the crash
dead. False positives, per rule: 10 virtual minutes at 0% and 5% loss with one member
stalled for 2 s and another slow throughout (every datagram it sends, its acks included,
arrives ``SLOW_S`` late: answers delayed, not lost); and at N = 100 a sweep of how slow a
member may be. Speed: 1000 members for 60 virtual seconds, run alone, wall-clock time.
Scenarios run two at a time (one per core); the speed run runs by itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from ftcomm.gossip.config import GossipConfig
from ftcomm.gossip.sim import run_scenario

TARGET_LAST_DEAD_S = {10: 5.0, 100: 5.0, 1000: 5.0}
TRIALS = {10: 200, 100: 50, 1000: 10}  # crashes per N, loss and rule, at random instants
RULES = {"ours": {}, "memberlist": {"confirmed_suspicion_mult": 0.0}}
SLOW_S = 0.3
SLOW_SWEEP_S = (0.1, 0.3, 0.6, 1.0)


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _scenario(kwargs: dict) -> dict:
    kind, rule = kwargs.pop("kind"), kwargs.pop("rule")
    kwargs["config"] = GossipConfig().with_overrides(**RULES[rule])
    return {"kind": kind, "rule": rule, **asdict(run_scenario(**kwargs))}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="N up to 100 and 2 virtual minutes (a smoke run)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gossip_sim.json"))
    args = parser.parse_args()
    sizes = [10, 100] if args.quick else [10, 100, 1000]
    quiet_duration = 120.0 if args.quick else 600.0
    jobs = [dict(kind="detection", rule="ours", n=n, loss=loss, duration=60.0, crash_at=20.0, metadata_at=10.0,
                 seed=11) for n in sizes for loss in (0.0, 0.05)]
    instants = random.Random(7)
    jobs += [dict(kind="trial", rule=rule, n=n, loss=loss, duration=45.0, crash_at=20.0 + 5.0 * instants.random(),
                  metadata_at=None, seed=100 + seed)
             for rule in RULES for n in sizes for loss in (0.0, 0.05) for seed in range(TRIALS[n])]
    jobs += [dict(kind="false_positives", rule=rule, n=sizes[-1], loss=loss, duration=quiet_duration, crash_at=None,
                  metadata_at=None, stall_at=30.0, stall_for=2.0, slow_delay=SLOW_S, seed=12)
             for rule in RULES for loss in (0.0, 0.05)]
    jobs += [dict(kind="slow_sweep", rule=rule, n=100, loss=0.05, duration=quiet_duration, crash_at=None,
                  metadata_at=None, slow_delay=delay, seed=13) for rule in RULES for delay in SLOW_SWEEP_S]
    jobs.sort(key=lambda j: -j["n"] * j["duration"])  # the longest first: two cores stay busy to the end
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_scenario, jobs))
    speed = asdict(run_scenario(sizes[-1], duration=60.0, crash_at=20.0, metadata_at=10.0, seed=13))

    cfg = GossipConfig()
    detection = [r for r in results if r["kind"] == "detection"]
    for r in detection:
        r["target_last_dead_s"] = TARGET_LAST_DEAD_S[r["n"]]
        r["min_suspicion_timeout_s"] = round(cfg.min_suspicion_timeout(r["n"]), 3)
    trials = []
    for rule in RULES:
        for n in sizes:
            for loss in (0.0, 0.05):
                runs = [r for r in results if r["kind"] == "trial" and r["rule"] == rule and r["n"] == n
                        and r["loss"] == loss]
                # A trial whose crash some member never marked dead counts as infinitely slow.
                last = sorted(math.inf if r["crash_last_dead_s"] is None else r["crash_last_dead_s"] for r in runs)
                trials.append({
                    "rule": rule, "n": n, "loss": loss, "runs": len(runs),
                    "analytic_first_detection_s": runs[0]["analytic_first_detection_s"],
                    "undetected_runs": sum(r["crash_last_dead_s"] is None for r in runs),
                    "mean_first_suspect_s": round(statistics.mean(r["crash_first_suspect_s"] for r in runs), 3),
                    "mean_first_dead_s": round(statistics.mean(r["crash_first_dead_s"] for r in runs), 3),
                    "mean_last_dead_s": round(statistics.mean(last), 3),
                    "p50_last_dead_s": _percentile(last, 0.50),
                    "p90_last_dead_s": _percentile(last, 0.90),
                    "p99_last_dead_s": _percentile(last, 0.99),
                    "max_last_dead_s": last[-1],
                    "within_target_fraction": round(sum(v <= TARGET_LAST_DEAD_S[n] for v in last) / len(last), 3),
                    "target_last_dead_s": TARGET_LAST_DEAD_S[n],
                })
    quiet = {}
    for r in results:
        if r["kind"] == "false_positives":
            quiet.setdefault(f"loss={r['loss']}", {})[r["rule"]] = r
    traffic_vs_memberlist = {
        key: {"messages_ratio": round(v["ours"]["messages_per_member_s"] / v["memberlist"]["messages_per_member_s"], 3),
              "bytes_ratio": round(v["ours"]["bytes_per_member_s"] / v["memberlist"]["bytes_per_member_s"], 3)}
        for key, v in quiet.items() if {"ours", "memberlist"} <= set(v)}
    growth = {}
    if 100 in sizes and 1000 in sizes:
        for loss in (0.0, 0.05):
            small = next(r for r in detection if r["n"] == 100 and r["loss"] == loss)
            large = next(r for r in detection if r["n"] == 1000 and r["loss"] == loss)
            growth[f"loss={loss}"] = {
                "messages_ratio_1000_vs_100": round(large["messages_per_member_s"] / small["messages_per_member_s"], 3),
                "bytes_ratio_1000_vs_100": round(large["bytes_per_member_s"] / small["bytes_per_member_s"], 3),
            }
    report = {
        "benchmark": "gossip_sim",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "config": asdict(cfg),
        "detection": detection,
        "detection_trials": trials,
        "false_positives": [r for r in results if r["kind"] == "false_positives"],
        "slow_member_sweep": [r for r in results if r["kind"] == "slow_sweep"],
        "traffic_growth": growth,
        "traffic_ours_vs_memberlist": traffic_vs_memberlist,
        "speed": {"n": speed["n"], "virtual_s": speed["duration_s"], "wall_s": speed["wall_s"],
                  "target_wall_s": 60.0},
        "total_wall_s": round(time.perf_counter() - started, 1),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("traffic_growth", "traffic_ours_vs_memberlist", "speed",
                                             "total_wall_s")}))
    print(f"{'N':>5} {'loss':>5} {'analytic 1st':>12} {'1st suspect':>11} {'1st dead':>9} {'last dead':>9} "
          f"{'target':>6} {'meta 99.99%':>11} {'msg/s':>6} {'B/s':>7}")
    for r in detection:
        print(f"{r['n']:>5} {r['loss']:>5} {r['analytic_first_detection_s']:>12} {r['crash_first_suspect_s']:>11} "
              f"{r['crash_first_dead_s']:>9} {r['crash_last_dead_s']:>9} {r['target_last_dead_s']:>6} "
              f"{r['metadata_9999pct_s']:>11} {r['messages_per_member_s']:>6} {r['bytes_per_member_s']:>7}")
    print(f"\n{'rule':>10} {'N':>5} {'loss':>5} {'runs':>4} {'analytic 1st':>12} {'mean 1st suspect':>16} "
          f"{'mean 1st dead':>13} {'last dead p50':>13} {'p90':>6} {'p99':>6} {'max':>6} {'target':>6} {'within':>6}")
    for t in trials:
        print(f"{t['rule']:>10} {t['n']:>5} {t['loss']:>5} {t['runs']:>4} {t['analytic_first_detection_s']:>12} "
              f"{t['mean_first_suspect_s']:>16} {t['mean_first_dead_s']:>13} {t['p50_last_dead_s']:>13} "
              f"{t['p90_last_dead_s']:>6} {t['p99_last_dead_s']:>6} {t['max_last_dead_s']:>6} "
              f"{t['target_last_dead_s']:>6} {t['within_target_fraction']:>6}")
    for r in report["false_positives"] + report["slow_member_sweep"]:
        print(f"false positives ({r['rule']}) N={r['n']} {r['duration_s']:.0f}s at {r['loss']:.0%} loss"
              + (" with a 2 s stall" if r["stalled_member_declared_dead"] is not None else "")
              + f", a member slow by {r['slow_delay_s']} s: live members declared dead={r['false_dead_declarations']}"
              f" (the slow one {r['slow_member_deaths']}) stalled_declared_dead={r['stalled_member_declared_dead']}"
              f" suspicions={r['false_suspicions']} (of the slow one {r['slow_member_suspicions']})"
              f" msg/s={r['messages_per_member_s']} B/s={r['bytes_per_member_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
