"""A busy host: view changes without a fault, throughput, and fault detection while
busy-loop processes compete with the workers for every core.

    python benchmarks/busy_host.py [--levels 0,1,2,4] [--duration 120] [--workers 4]

Users' hosts are rarely quiet: data-loader processes, tokenizers and other jobs take
cores from the training processes. For each level L, L busy-loop processes per core
(``while True: pass``) run beside a group of ``--workers`` workers
(``examples/train_elastic.py`` on 127.0.0.1, default configuration, 0.01 s of extra work
per step) for ``--duration`` seconds with no fault. Reported per level: the view changes
in that time (each with its reason, and whether the members recorded one reason), the
committed steps per second, then under the same load a SIGSTOP of one worker and a kill -9
of another, each measured from the signal until every survivor committed a step in the
new view. Level 0 is the baseline of the same run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bytecode import compile_package  # noqa: E402
from benchmarks.group_recovery import Group, fault_run, save  # noqa: E402


def busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def quiet_period(group: Group, duration: float) -> dict:
    """Train ``duration`` seconds without a fault: the view changes the members recorded
    meanwhile (each view once, with every reason its members gave) and the committed steps
    per second (the slowest member's)."""
    before = group.latest_view()
    marks = [len(w.snapshot()) for w in group.workers]
    started = time.time()
    steps_at = [max([e["step"] for e in w.snapshot() if e["ev"] in ("step", "first_step")] + [0])
                for w in group.workers]
    time.sleep(duration)
    views: dict[int, dict] = {}
    for w, mark in zip(group.workers, marks):
        for e in w.snapshot()[mark:]:
            if e["ev"] == "view" and e["view_id"] > before:
                seen = views.setdefault(e["view_id"], {"view_id": e["view_id"], "reasons": collections.Counter(),
                                                       "members": len(e["members"]), "t": e["time"] - started})
                seen["reasons"][e["reason"]] += 1
    steps_now = [max([e["step"] for e in w.snapshot() if e["ev"] in ("step", "first_step")] + [0])
                 for w in group.workers]
    rates = [(now - then) / duration for now, then in zip(steps_now, steps_at)]
    changes = [{**v, "reasons": dict(v["reasons"]), "t": round(v["t"], 2)} for v in sorted(views.values(),
                                                                                             key=lambda v: v["view_id"])]
    return {"seconds": duration, "view_changes": len(changes), "changes": changes,
            "one_reason_each": all(len(c["reasons"]) == 1 for c in changes),
            "steps_per_s": round(min(rates), 2)}


def level(busy_per_core: int, args) -> dict:
    loops = busy_loops(busy_per_core * (os.cpu_count() or 1))
    group = None
    try:
        group = Group(args.workers, ["--report-every", "10", "--hidden", str(args.hidden),
                                      "--loader-workers", str(args.loader_workers)])
        result = {"busy_per_core": busy_per_core, "busy_processes": len(loops)}
        result["quiet"] = quiet_period(group, args.duration)
        print(json.dumps({"busy_per_core": busy_per_core, **result["quiet"]}), flush=True)
        result["sigstop"] = fault_run(group, signal.SIGSTOP, victim_index=1, steady=2.0)
        group.grow(args.workers)
        result["kill9"] = fault_run(group, signal.SIGKILL, victim_index=2, steady=2.0)
        print(json.dumps({"busy_per_core": busy_per_core,
                          "sigstop_recovery_s": result["sigstop"]["recovery_s"],
                          "kill9_recovery_s": result["kill9"]["recovery_s"]}), flush=True)
        return result
    finally:
        if group is not None:
            group.close()
        for loop in loops:
            loop.kill()
            loop.wait()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="0,1,2,4", help="busy-loop processes per core, one run each")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of training without a fault")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128, help="the example's hidden width (3150: about 10M parameters)")
    parser.add_argument("--loader-workers", type=int, default=0, help="DataLoader processes per worker")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "busy_host.json"))
    args = parser.parse_args()
    compile_package()  # as an installed package: each worker reads the compiled modules
    report = {"benchmark": "busy_host", "workers": args.workers, "duration_s": args.duration,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "levels": [level(int(n), args) for n in args.levels.split(",")]}
    save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
