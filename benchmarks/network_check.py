"""Network check across hosts: what it finds and what it costs, with and without a slow link.

    python benchmarks/network_check.py [--runs 3] [--hosts 4] [--mbit 100]   # as root, with iproute2

``--hosts`` workers (examples/train_elastic.py with ``network_check`` on), each on a host
of its own (a network namespace on one bridge, tests/netns.py), start a group together.
Two setups, alternating in one run: every link at the bridge's own speed (the baseline),
and host 1's link limited to ``--mbit`` Mbit/s (a token bucket on the bridge's end).
Reported per setup: the check's duration (from the report), the median latency and
bandwidth of the links, whom it named slow, and whether that is exactly the limited host
(the baseline: nobody); and the time from starting the workers to every ``init``
returning.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from group_recovery import save  # noqa: E402
from tests import netns  # noqa: E402
from tests.train_cluster import TrainCluster  # noqa: E402

SLOW_HOST = 1


def one_run(hosts: int, mbit: int | None, probe_mb: float) -> dict:
    with netns.Lab(hosts) as lab, tempfile.TemporaryDirectory() as tmp:
        if mbit is not None:
            lab.limit_host_link(SLOW_HOST, mbit)
        cluster = TrainCluster(lab)
        try:
            addresses = [f"{lab.address(i)}:{cluster.PORT}" for i in range(hosts)]
            options = json.dumps({"network_check": True, "network_check_mb": probe_mb})
            started = time.monotonic()
            workers = []
            for i in range(hosts):
                cluster.seed_address = ",".join(a for a in addresses if a != addresses[i])
                workers += cluster.start(1, ["--min-workers", str(hosts), "--options", options], wait=False,
                                         env={"FTCOMM_NETWORK_REPORT": os.path.join(tmp, f"{i}.json")}, hosts=[i])
            for w in workers:
                w.wait_ready(180)
            ready_s = time.monotonic() - started
            report = json.loads(open(os.path.join(tmp, "0.json")).read())
            names = {w.id: i for i, w in enumerate(workers)}
            named = sorted(names[m] for m in report["slow_members"])
            expected = [SLOW_HOST] if mbit is not None else []
            return {"limit_mbit": mbit, "check_s": round(report["seconds"], 3), "ready_s": round(ready_s, 2),
                    "median_latency_ms": round(statistics.median(l["latency_s"] for l in report["links"]) * 1e3, 3),
                    "median_bandwidth_gbs": round(statistics.median(l["bandwidth"] for l in report["links"]) / 1e9, 3),
                    "slowest_link_gbs": round(min(l["bandwidth"] for l in report["links"]) / 1e9, 4),
                    "slow_hosts": named, "slow_links": len(report["slow_links"]),
                    "correct": named == expected and not report["slow_links"]}
        finally:
            for w in cluster.workers:
                w.close(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--mbit", type=int, default=100)
    parser.add_argument("--probe-mb", type=float, default=8.0, help="network_check_mb")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "network_check.json"))
    args = parser.parse_args()
    reason = netns.unavailable()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 1
    runs = []
    for r in range(args.runs):
        for mbit in (None, args.mbit):
            result = one_run(args.hosts, mbit, args.probe_mb)
            runs.append(result)
            print(json.dumps(result), flush=True)
    summary = {}
    for setup, mbit in (("uniform", None), ("slow_link", args.mbit)):
        mine = [r for r in runs if r["limit_mbit"] == mbit]
        summary[setup] = {"check_s_median": statistics.median(r["check_s"] for r in mine),
                          "ready_s_median": statistics.median(r["ready_s"] for r in mine),
                          "correct": sum(r["correct"] for r in mine), "runs": len(mine)}
    report = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "hosts": args.hosts,
              "probe_mb": args.probe_mb, "runs": runs, "summary": summary}
    save(report, args.out)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
