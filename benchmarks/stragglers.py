"""Stragglers: the group's pace with one slow worker, reported (``warn``) against excluded
(``exclude``), beside the pace without it, in one run.

    python benchmarks/stragglers.py [--runs 3] [--workers 4] [--slow 0.15] [--window 15]

``--workers`` training workers on 127.0.0.1 (examples/train_elastic.py, one OpenMP thread
each, 0.01 s of extra work per step) train; the committed steps per second of the group
are read over ``--window`` seconds: first with every worker at its normal pace (the
baseline), then after one worker's extra work per step is raised to ``--slow`` seconds.
Under ``warn`` the slow worker stays (every step waits for it); under ``exclude`` it
stands aside once judged a straggler (time from the slow-down to the others' view
without it, and the pace after). Each policy runs in fresh processes; ``--runs`` rounds
alternate the policies, and the medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from group_recovery import save  # noqa: E402
from tests.train_cluster import TrainCluster  # noqa: E402


def pace(cluster: TrainCluster, workers, seconds: float) -> float:
    """Committed steps per second of the group over ``seconds``."""
    first, began = cluster.status(workers[0]), time.monotonic()
    time.sleep(seconds)
    return (cluster.status(workers[0]) - first) / (time.monotonic() - began)


def one_policy(policy: str, n: int, slow_s: float, window: float) -> dict:
    cluster = TrainCluster()
    try:
        options = json.dumps({"straggler_policy": policy, "straggler_cooldown": 600})
        workers = cluster.start(n, ["--min-workers", "1", "--log-level", "WARNING", "--options", options],
                                env={"OMP_NUM_THREADS": "1"})
        first = max(v["view_id"] for v in cluster.wait_view(workers, n, timeout=90))
        time.sleep(3.0)  # past the first steps' warm-up
        baseline = pace(cluster, workers, window)
        slow, others = workers[-1], workers[:-1]
        slowed, slowed_wall = time.monotonic(), time.time()
        slow.request(cmd="step_time", seconds=slow_s)
        result = {"policy": policy, "baseline_steps_per_s": round(baseline, 2)}
        if policy == "exclude":
            views = cluster.wait_view(others, n - 1, timeout=120, after=first)
            result["excluded_after_s"] = round(time.monotonic() - slowed, 2)
            result["reason"] = views[0]["reason"]
            result["steps_per_s"] = round(pace(cluster, others, window), 2)
        else:
            flagged = slow.wait_for(lambda e: e["ev"] == "straggler" and e["slow"], 120, "a straggler report")
            result["flagged_after_s"] = round(flagged["at"] - slowed_wall, 2)
            result["steps_per_s"] = round(pace(cluster, others, window), 2)
        result["ratio_to_baseline"] = round(result["steps_per_s"] / baseline, 3)
        return result
    finally:
        cluster.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="rounds, each running both policies")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slow", type=float, default=0.15, help="the slow worker's extra seconds per step")
    parser.add_argument("--window", type=float, default=15.0, help="seconds over which the pace is read")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "stragglers.json"))
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        for policy in ("warn", "exclude"):
            result = one_policy(policy, args.workers, args.slow, args.window)
            runs.append(result)
            print(json.dumps(result), flush=True)
    summary = {}
    for policy, after in (("warn", "flagged_after_s"), ("exclude", "excluded_after_s")):
        mine = [r for r in runs if r["policy"] == policy]
        summary[policy] = {key: round(statistics.median(r[key] for r in mine), 3)
                           for key in ("baseline_steps_per_s", after, "steps_per_s", "ratio_to_baseline")}
    print(json.dumps(summary), flush=True)
    save({"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "workers": args.workers,
          "slow_s": args.slow, "window_s": args.window, "runs": runs, "summary": summary}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
