"""A busy host: view changes without a fault, throughput, and fault detection while
busy-loop processes compete with the workers for every core.

    python benchmarks/busy_host.py [--levels 0,1,2,4] [--duration 120] [--workers 4] [--replicas]

Users' hosts are rarely quiet: data-loader processes, tokenizers and other jobs take
cores from the training processes. For each level L, L busy-loop processes per core
(``while True: pass``) run beside a group of ``--workers`` workers
(``examples/train_elastic.py`` on 127.0.0.1, default configuration, 0.01 s of extra work
per step) for ``--duration`` seconds with no fault. Reported per level: the view changes
in that time (each with its reason, and whether the members recorded one reason), the
committed steps per second, then under the same load a SIGSTOP of one worker and a kill -9
of another, each measured from the signal until every survivor committed a step in the
new view. Level 0 is the baseline of the same run. With ``--replicas`` the group is 2
sharded replicas of 2 processes instead (see :func:`replica_level`).

    python benchmarks/busy_host.py --collections 16 [--levels 2] [--objects 3000000]

Full garbage collections instead (see :func:`collections_level`): at each level, the
workers take turns at a full collection over a heap of ``--objects`` objects each (the GIL
held throughout), ``--collections`` in all, once with the pause notices on (the default
``pause_grace``) and once off (``pause_grace`` 0), in the same run: the pauses and the view
changes they caused.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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
from benchmarks.hsdp import Job, launcher  # noqa: E402


@contextlib.contextmanager
def busy_loops(per_core: int):
    """``per_core`` busy-loop processes per core, killed on the way out."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(per_core * (os.cpu_count() or 1))]
    try:
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


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
    with busy_loops(busy_per_core) as loops:
        group = Group(args.workers, ["--report-every", "10", "--hidden", str(args.hidden),
                                      "--loader-workers", str(args.loader_workers)])
        try:
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
            group.close()


PAUSE_EVERY_S = 2.0  # seconds between two workers' collections (see collections_level)


def collections_level(busy_per_core: int, args) -> dict:
    """``args.collections`` full garbage collections, the workers in turn, one every
    ``PAUSE_EVERY_S`` (the first on each worker grows its heap by ``args.objects`` objects,
    three seconds before it collects), with pause notices on and then off, each in a group
    of its own beside the busy loops: the pauses each worker measured and the view changes
    the members recorded meanwhile."""
    result = {"busy_per_core": busy_per_core}
    with busy_loops(busy_per_core) as loops:
        result["busy_processes"] = len(loops)
        for name, grace in (("notices", None), ("no_notices", 0.0)):
            gossip = "{}" if grace is None else json.dumps({"pause_grace": grace})
            group = Group(args.workers, ["--hidden", str(args.hidden), "--gossip", gossip])
            try:
                before = group.latest_view()
                started = time.time()
                pauses = []
                for i in range(args.collections):
                    w = group.workers[i % len(group.workers)]
                    mark = len(w.snapshot())
                    grow = args.objects if i < len(group.workers) else 0
                    w.request(cmd="collect", objects=grow, after=3.0 if grow else 0.0, timeout=120)
                    pauses.append(w.wait_for(lambda e: e["ev"] == "collected", 60, "the collection", mark)["seconds"])
                    time.sleep(PAUSE_EVERY_S)
                views = {e["view_id"]: e["reason"] for w in group.workers for e in w.snapshot()
                         if e["ev"] == "view" and e["view_id"] > before}
                result[name] = {"collections": len(pauses), "pause_s": {
                                    "median": round(sorted(pauses)[len(pauses) // 2], 3), "max": round(max(pauses), 3)},
                                "view_changes": len(views), "reasons": dict(collections.Counter(views.values())),
                                "seconds": round(time.time() - started, 1)}
                print(json.dumps({"busy_per_core": busy_per_core, name: result[name]}), flush=True)
            finally:
                group.close()
    return result


def replica_level(busy_per_core: int, args) -> dict:
    """Sharded replicas, 2 x 2: ``examples/train_hsdp.py`` under ``ftcomm run --replica-size
    2`` (4 processes, FSDP2 inside each replica, ftcomm across), beside the busy loops. The
    view changes and steps per second of ``--duration`` seconds without a fault, then a
    SIGSTOP of a process of the replica rank 0 is not in (the launcher kills it once seen
    stopped and starts its replica again), then, once the replica is back, a kill -9 of rank
    0's partner: each measured from the signal to the next step committed by the other
    replica."""
    with busy_loops(busy_per_core) as loops:
        job = Job(launcher(4, 2, ["--hidden", "256", "--step-time", "0.01", "--report-every", "1",
                                  "--min-workers", "1"]))
        try:
            return replica_faults(job, busy_per_core, len(loops), args.duration)
        finally:
            job.stop()


def replica_faults(job: Job, busy_per_core: int, busy_processes: int, duration: float) -> dict:
    """:func:`replica_level`'s measurements on the running ``job``."""
    job.wait_for(lambda: len(job.of("ready")) >= 4 and len(job.of("step")) >= 4 * 20, 600, "four processes training")
    before = max(e["view_id"] for _, e in job.of("view"))
    steps_at, started = max(e["step"] for _, e in job.of("step")), time.time()
    time.sleep(duration)
    ended = time.time()
    views: dict[int, dict] = {}
    for t, e in job.of("view"):
        if e["view_id"] > before and t <= ended:
            seen = views.setdefault(e["view_id"], {"view_id": e["view_id"], "reasons": collections.Counter(),
                                                   "members": len(e["members"]), "t": round(t - started, 2)})
            seen["reasons"][e["reason"]] += 1
    steps_now = max(e["step"] for t, e in job.of("step") if t <= ended)
    changes = [{**v, "reasons": dict(v["reasons"])} for v in sorted(views.values(), key=lambda v: v["view_id"])]
    result = {"busy_per_core": busy_per_core, "busy_processes": busy_processes,
              "quiet": {"seconds": duration, "view_changes": len(changes), "changes": changes,
                        "steps_per_s": round((steps_now - steps_at) / (ended - started), 2)}}
    print(json.dumps({"replicas": "2x2", "busy_per_core": busy_per_core, **result["quiet"]}), flush=True)
    ready = {e["rank"]: e for _, e in job.of("ready")}

    def others_commit(victim_pid: int, sig: int) -> float:
        at = max(e["step"] for _, e in job.of("step"))
        signalled = time.time()
        os.kill(victim_pid, sig)
        job.wait_for(lambda: any(t > signalled and e["world"] == 2 and e["step"] > at for t, e in job.of("step")),
                     120, "the other replica committing")
        return round(min(t for t, e in job.of("step") if t > signalled and e["world"] == 2 and e["step"] > at)
                     - signalled, 3)

    result["sigstop_recovery_s"] = others_commit(ready[3]["pid"], signal.SIGSTOP)
    stopped = time.time()
    job.wait_for(lambda: any(t > stopped and len(e["members"]) == 4 for t, e in job.of("view")), 300,
                 "the stopped process's replica back")
    time.sleep(2.0)
    result["kill9_recovery_s"] = others_commit(ready[1]["pid"], signal.SIGKILL)
    print(json.dumps({"replicas": "2x2", "busy_per_core": busy_per_core,
                      "sigstop_recovery_s": result["sigstop_recovery_s"],
                      "kill9_recovery_s": result["kill9_recovery_s"]}), flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="0,1,2,4", help="busy-loop processes per core, one run each")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of training without a fault")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128, help="the example's hidden width (3150: about 10M parameters)")
    parser.add_argument("--loader-workers", type=int, default=0, help="DataLoader processes per worker")
    parser.add_argument("--replicas", action="store_true",
                        help="sharded replicas 2 x 2 (examples/train_hsdp.py) instead of plain workers")
    parser.add_argument("--collections", type=int, default=0,
                        help="full garbage collections in turn, with pause notices and without (see the docstring)")
    parser.add_argument("--objects", type=int, default=3_000_000, help="each worker's heap with --collections")
    parser.add_argument("--out", default=None,
                        help="default: results/busy_host.json (busy_host_replicas.json, busy_host_collections.json)")
    args = parser.parse_args()
    name = "busy_host_replicas" if args.replicas else "busy_host_collections" if args.collections else "busy_host"
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"{name}.json")
    compile_package()  # as an installed package: each worker reads the compiled modules
    run = replica_level if args.replicas else collections_level if args.collections else level
    report = {"benchmark": name, **({"collections": args.collections, "objects": args.objects} if args.collections
                                    else {"duration_s": args.duration}),
              **({"replicas": "2x2"} if args.replicas else {"workers": args.workers}),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "levels": [run(int(n), args) for n in args.levels.split(",")]}
    save(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
