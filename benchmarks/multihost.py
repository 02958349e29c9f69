"""Recovery across hosts: process crash, node loss and partition, side by side in one run.

    python benchmarks/multihost.py [--runs 3]        # as root, with iproute2

Five training workers (examples/train_elastic.py, default configuration), each on a host
of its own: a Linux network namespace with its own address (tests/netns.py), hosts 0-2
on one bridge and 3-4 on another, the bridges joined by one link. No environment
variable but the secret is set for any worker. Faults, each measured until every worker that should go
on has committed its next step in the new view (times from the fault):

- *process crash*: kill -9 of one worker (its host refuses connections at once); it is
  replaced by a fresh worker on the same host before the next fault;
- *node loss*: the host's link goes down (its packets vanish; nothing refuses anything),
  then comes back: *rejoin* is from the link's return until all five commit again;
- *partition 3|2*: the link between the bridges goes down: the majority's recovery; the
  minority must commit nothing; *heal* is from the link's return until all five commit.

Phases (median over the workers): *detect* (from the fault until the worker gave up on
the view: recovery's view-ready time less agree, form and reconcile), *agree*, *form*
(the Gloo group and its verification), *reconcile*.
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

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from group_recovery import measure_recovery, save  # noqa: E402
from tests import netns  # noqa: E402
from tests.train_cluster import TrainCluster  # noqa: E402

HOSTS = 5


def with_detect(result: dict) -> dict:
    detect = result["view_ready_s"] - result["agree_s"] - result["form_s"] - result["reconcile_s"]
    return {**result, "detect_from_fault_s": round(detect, 4)}


def latest_view(workers) -> int:
    return max((e["view_id"] for w in workers for e in w.snapshot() if e["ev"] == "view"), default=0)


def crash(cluster: TrainCluster, workers: list, victim: int) -> dict:
    before = latest_view(workers)
    survivors = workers[:victim] + workers[victim + 1:]
    result = with_detect(measure_recovery(survivors, lambda: workers[victim].signal(signal.SIGKILL), before,
                                          size=HOSTS - 1))
    workers[victim].close(timeout=10)
    workers[victim] = cluster.start(1, ["--min-workers", "1"], hosts=[victim])[0]
    cluster.wait_view(workers, HOSTS, timeout=90, after=before)
    return result


def node_loss(lab: netns.Lab, cluster: TrainCluster, workers: list, victim: int) -> dict:
    before = latest_view(workers)
    survivors = workers[:victim] + workers[victim + 1:]
    result = with_detect(measure_recovery(survivors, lambda: lab.set_host_link(victim, False), before,
                                          size=HOSTS - 1))
    time.sleep(1.0)
    back = measure_recovery(workers, lambda: lab.set_host_link(victim, True), latest_view(survivors), size=HOSTS,
                            timeout=120)
    return {**result, "rejoin_s": back["recovery_s"], "rejoin_reason": back["reason"]}


def partition(lab: netns.Lab, cluster: TrainCluster, workers: list) -> dict:
    before = latest_view(workers)
    majority, minority = workers[:3], workers[3:]
    result = with_detect(measure_recovery(majority, lambda: lab.set_bridge_link(False), before, size=3))
    steps = [cluster.status(w) for w in minority]
    time.sleep(2.0)
    committed_while_cut = sum(cluster.status(w) for w in minority) - sum(steps)
    healed = measure_recovery(workers, lambda: lab.set_bridge_link(True), latest_view(majority), size=HOSTS,
                              timeout=120)
    return {**result, "minority_steps_while_cut": committed_while_cut, "heal_s": healed["recovery_s"]}


def summarize(runs: list[dict], keys: list[str]) -> dict:
    return {"runs": runs, **{f"median_{k}": round(statistics.median(r[k] for r in runs), 4) for k in keys}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "multihost.json"))
    args = parser.parse_args()
    reason = netns.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    report: dict = {"benchmark": "multihost", "hosts": HOSTS, "runs": args.runs,
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    phases = ["recovery_s", "detect_from_fault_s", "agree_s", "form_s", "reconcile_s"]
    with netns.Lab(HOSTS, split=3) as lab:
        cluster = TrainCluster(lab)
        try:
            workers = cluster.start(HOSTS, ["--min-workers", "1"], hosts=list(range(HOSTS)))
            cluster.wait_view(workers, HOSTS, timeout=120)
            crashes, losses, cuts = [], [], []
            for i in range(args.runs):
                time.sleep(1.0)
                crashes.append(crash(cluster, workers, 1 + i % 2))
                print(json.dumps({"crash": crashes[-1]}), flush=True)
                time.sleep(1.0)
                losses.append(node_loss(lab, cluster, workers, 4 - i % 2))
                print(json.dumps({"node_loss": losses[-1]}), flush=True)
                time.sleep(1.0)
                cuts.append(partition(lab, cluster, workers))
                print(json.dumps({"partition": cuts[-1]}), flush=True)
        finally:
            cluster.close()
    report["process_crash"] = summarize(crashes, phases)
    report["node_loss"] = summarize(losses, phases + ["rejoin_s"])
    report["partition_3_2"] = summarize(cuts, phases + ["heal_s"])
    report["partition_3_2"]["minority_steps_while_cut"] = [c["minority_steps_while_cut"] for c in cuts]
    for key in ("process_crash", "node_loss", "partition_3_2"):
        print(json.dumps({key: {k: v for k, v in report[key].items() if k != "runs"}}), flush=True)
    save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
