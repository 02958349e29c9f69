"""Group benchmarks 2-5: recovery after kill -9 and SIGSTOP, join time, re-formation time by size.

    python benchmarks/group_recovery.py [--runs 5] [--sizes 2,3,4,5,6,7,8] [--only recovery,join,sizes,two]

Workers are ``examples/train_elastic.py`` processes on 127.0.0.1 with the default
configuration. *Recovery* is the time from the signal to the moment every survivor has
committed its next step in the new view; the phase breakdown (detect, agree, form,
reconcile) comes from the survivors' view-change records (median over survivors).
*Join* is the time from the new process calling ``ftcomm.init()`` to its first committed
step, joining a group of 2 that trains, with the example's small model and with about 10M
parameters. The baseline measured
in the same run is a cold start: the time from ``init()`` to the first committed step
when all workers start together (what a restart-everybody system pays at minimum,
before any re-initialisation of its own). *Re-formation by size* kills one of N
lightweight workers (a tiny model; their extra work per step is a sleep), so that the
protocol's own cost shows on a 2-core machine running up to 8 of them. *Two* kills rank 0
of two workers (the survivor goes on once rank 0's port refuses), with rank 1's kill as
the baseline in the same run (``--only two``; not in the default set).
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bytecode import compile_package  # noqa: E402
from ftcomm.localproc import ChildProcess  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "train_elastic.py")
LIGHT = ["--hidden", "8", "--report-every", "5"]
"""Workers of the size sweep: a tiny model (the 0.01 s of extra work per step is a sleep),
so that the protocol's own cost shows on a 2-core machine running up to 8 of them. Their
step reports give the steady step time before each kill."""


def worker(seed: str | None, extra: list[str] = (), env: dict | None = None) -> ChildProcess:
    command = [sys.executable, "-u", EXAMPLE, "--bind", "127.0.0.1:0", "--control", "--steps", "100000000",
               "--step-time", "0.01", "--report-every", "100000000", *extra]
    if seed:
        command += ["--peers", seed]
    return ChildProcess(command, ready_timeout=None, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


class Group:
    """``env()``: variables added to each new worker's environment."""

    def __init__(self, size: int, extra: list[str] = (), env=dict) -> None:
        self.extra, self.env = list(extra), env
        self.workers = [worker(None, self.extra, env())]
        self.workers[0].wait_ready(60)
        self.seed = self.workers[0].address
        self.grow(size)

    def grow(self, size: int) -> None:
        self.seed = self.workers[0].address  # (the first worker may be gone)
        fresh = [worker(self.seed, self.extra, self.env()) for _ in range(size - len(self.workers))]
        for w in fresh:
            w.wait_ready(90)
        self.workers += fresh
        self.wait_size(size)

    def wait_size(self, size: int) -> int:
        """Wait until every worker is in a view of ``size`` (the newest one each has seen)."""
        deadline = time.monotonic() + 90
        while True:
            newest = [max((e for e in w.snapshot() if e["ev"] == "view"), key=lambda e: e["view_id"], default=None)
                      for w in self.workers]
            if all(v is not None and len(v["members"]) == size for v in newest) and \
                    len({v["view_id"] for v in newest}) == 1:
                return newest[0]["view_id"]
            if time.monotonic() > deadline:
                raise TimeoutError(f"no common view of {size} within 90 s")
            time.sleep(0.05)

    def latest_view(self) -> int:
        return max((e["view_id"] for w in self.workers for e in w.snapshot() if e["ev"] == "view"), default=0)

    def close(self) -> None:
        for w in self.workers:
            w.close(timeout=10)  # resumes a stopped worker first


def measure_recovery(workers: list[ChildProcess], fault, before: int, size: int | None = None,
                     timeout: float = 60.0) -> dict:
    """Call ``fault()``; measure until every one of ``workers`` has committed a step in a view
    newer than ``before`` (of ``size`` members, when given). Times from the fault."""
    marks = [len(w.snapshot()) for w in workers]
    t0 = time.time()
    fault()
    # A view ready before the fault answers something else (on a loaded machine, a member
    # stalled a moment earlier and was suspected): it is not this fault's recovery.
    views = [w.wait_for(lambda e: e["ev"] == "view" and e["view_id"] > before and e["time"] >= t0
                        and (size is None or len(e["members"]) == size), timeout, "new view", m)
             for w, m in zip(workers, marks)]
    new_view = max(v["view_id"] for v in views)
    firsts = [w.wait_for(lambda e: e["ev"] == "first_step" and e["view_id"] >= new_view, timeout, "a commit", m)
              for w, m in zip(workers, marks)]
    return {
        "recovery_s": round(max(f["t"] for f in firsts) - t0, 4),
        "reason": views[0]["reason"],
        "detect_s": round(statistics.median(v["detect_s"] for v in views), 4),
        "agree_s": round(statistics.median(v["agree_s"] for v in views), 4),
        "form_s": round(statistics.median(v["form_s"] for v in views), 4),
        "reconcile_s": round(statistics.median(v["reconcile_s"] for v in views), 4),
        "view_ready_s": round(max(v["time"] for v in views) - t0, 4),
    }


def steady_step(workers: list[ChildProcess], since: float) -> float | None:
    """Median over ``workers`` of the time per committed step since ``since`` (from their
    ``step`` reports; None without two reports from some worker)."""
    periods = []
    for w in workers:
        steps = [e for e in w.snapshot() if e["ev"] == "step" and e["t"] >= since]
        if len(steps) >= 2 and steps[-1]["step"] > steps[0]["step"]:
            periods.append((steps[-1]["t"] - steps[0]["t"]) / (steps[-1]["step"] - steps[0]["step"]))
    return round(statistics.median(periods), 4) if periods else None


def fault_run(group: Group, sig: int, victim_index: int = 1, steady: float = 0.5) -> dict:
    """Signal one worker after ``steady`` seconds of training in the current view; measure
    until every survivor committed a step in the new view."""
    before = group.latest_view()
    started = time.time()
    time.sleep(steady)
    victim = group.workers[victim_index]
    survivors = [w for w in group.workers if w is not victim]
    step = steady_step(survivors, started)
    result = measure_recovery(survivors, lambda: victim.signal(sig), before)
    if step is not None:
        result["steady_step_s"] = step
    if sig == signal.SIGSTOP:
        victim.signal(signal.SIGKILL)
    victim.close(timeout=10)
    group.workers.remove(victim)
    return result


def summarize(runs: list[dict]) -> dict:
    keys = ["recovery_s", "detect_s", "agree_s", "form_s", "reconcile_s", "view_ready_s"]
    keys += ["steady_step_s"] if all("steady_step_s" in r for r in runs) else []
    return {"runs": runs, **{f"median_{k}": round(statistics.median(r[k] for r in runs), 4) for k in keys}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", default="2,3,4,5,6,7,8")
    parser.add_argument("--size-runs", type=int, default=3, help="kills per world size (one at size 2)")
    parser.add_argument("--only", default="recovery,join,sizes", help="parts to run")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "group_recovery.json"))
    args = parser.parse_args()
    compile_package()  # as an installed package: each worker reads the compiled modules
    report: dict = {}
    if os.path.exists(args.out):  # a run of some parts keeps the others' latest figures
        with open(args.out) as f:
            report = json.load(f)
    report.update({"benchmark": "group_recovery",
                   "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}})

    parts = set(args.only.split(","))
    if "recovery" in parts:
        recovery(args, report)
    if "join" in parts:
        join(args, report)
    if "sizes" in parts:
        sizes_sweep(args, report)
    if "two" in parts:
        two(args, report)
    return 0


def two(args, report: dict) -> None:
    """Two workers, kill -9 of rank 0: the survivor alone is no majority of their view (a tie
    goes to rank 0), and goes on once rank 0's port refuses a connection. The baseline in
    the same run: kill -9 of rank 1, whose survivor holds the tie."""
    group = Group(2)
    try:
        results: dict[str, list[dict]] = {"rank0": [], "rank1": []}
        for _ in range(args.runs):
            for name, victim in (("rank1", 1), ("rank0", 0)):
                results[name].append(fault_run(group, signal.SIGKILL, victim_index=victim))
                group.grow(2)
    finally:
        group.close()
    report["kill9_rank0_of_two"] = summarize(results["rank0"])
    report["kill9_rank1_of_two"] = summarize(results["rank1"])
    print(json.dumps({k: {m: v for m, v in report[k].items() if m != "runs"}
                      for k in ("kill9_rank0_of_two", "kill9_rank1_of_two")}), flush=True)
    save(report, args.out)


def recovery(args, report: dict) -> None:
    group = Group(4)
    try:
        crash, hang = [], []
        for _ in range(args.runs):
            crash.append(fault_run(group, signal.SIGKILL))
            group.grow(4)
        for _ in range(args.runs):
            hang.append(fault_run(group, signal.SIGSTOP))
            group.grow(4)
    finally:
        group.close()
    report["kill9_one_of_four"] = {**summarize(crash), "target_median_s": 1.0}
    report["sigstop_one_of_four"] = {**summarize(hang), "target_median_s": 3.0}
    print(json.dumps({k: {m: v for m, v in report[k].items() if m != "runs"}
                      for k in ("kill9_one_of_four", "sigstop_one_of_four")}), flush=True)
    save(report, args.out)


def join_parts(events: list[dict], first: dict) -> dict:
    """Where a joiner's time went, from its own events, each counted from its ``init()``
    call: ``init`` returned (gossip join, admission, the first view formed) and the state
    registered; its first view ready (the state received); its first committed step. With
    the first view's agree, form and reconcile phases."""
    init_started = first["t"] - first["since_init_s"]
    ready = next(e for e in events if e["ev"] == "ready")
    view = next(e for e in events if e["ev"] == "view")
    return {"init_returned_at": ready["t"] - init_started, "view_ready_at": view["time"] - init_started,
            "first_commit_at": first["since_init_s"],
            "agree": view["agree_s"], "form": view["form_s"], "reconcile": view["reconcile_s"]}


JOINS = (("join_small_model", [], 0.15), ("join_10m_params", ["--hidden", "3150"], 0.5))
"""The join measurements: the example's default model (hidden 128, about 17k parameters)
and about 10M parameters, each with its target from init() to the first committed step."""


def join(args, report: dict) -> None:
    for name, model, target in JOINS:
        joins, cold, parts = [], [], []
        for _ in range(max(3, args.runs // 2 + 1)):
            start = [worker(None, model)]
            start[0].wait_ready(60)
            start.append(worker(start[0].address, model))
            start[1].wait_ready(60)
            cold += [w.wait_for(lambda e: e["ev"] == "first_step", 60, "first step")["since_init_s"] for w in start]
            for w in start:
                w.wait_for(lambda e: e["ev"] == "view" and len(e["members"]) == 2, 60, "a view of 2")
            time.sleep(1.0)  # the group trains a while before the joiner comes
            joiner = worker(start[0].address, model)
            first = joiner.wait_for(lambda e: e["ev"] == "first_step", 90, "the joiner's first step")
            joins.append(round(first["since_init_s"], 4))
            joiner.wait_for(lambda e: e["ev"] == "view", 30, "the joiner's view change")  # reported after the step
            parts.append(join_parts(joiner.snapshot(), first))
            for w in start + [joiner]:
                w.close(timeout=10)
        report[name] = {"init_to_first_commit_s": joins, "median_s": statistics.median(joins), "target_s": target,
                        "parts_median_s": {k: round(statistics.median(p[k] for p in parts), 4) for k in parts[0]},
                        "baseline_cold_start_init_to_first_commit_s": round(statistics.median(cold), 4)}
        print(json.dumps({name: report[name]}), flush=True)
        save(report, args.out)


def sizes_sweep(args, report: dict) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    by_size = []
    for n in sizes:
        runs: list[dict] = []
        try:
            g = Group(n, LIGHT)
            try:
                for run in range(args.size_runs if n > 2 else 1):
                    if run:
                        g.grow(n)
                    runs.append(fault_run(g, signal.SIGKILL, victim_index=n - 1, steady=1.5))
            finally:
                g.close()
        except (TimeoutError, RuntimeError) as exc:  # recorded, not hidden: a failure is a result
            by_size.append({"world_size_before": n, "failed": str(exc).splitlines()[0], "runs": runs})
            print(json.dumps({"n": n, "failed": by_size[-1]["failed"]}), flush=True)
            report["reformation_by_size"] = by_size
            save(report, args.out)
            continue
        by_size.append({"world_size_before": n, **summarize(runs)})
        report["reformation_by_size"] = by_size
        save(report, args.out)
        print(json.dumps({"n": n, "median_recovery_s": by_size[-1]["median_recovery_s"],
                          "median_agree_s": by_size[-1]["median_agree_s"],
                          "median_form_s": by_size[-1]["median_form_s"],
                          "median_steady_step_s": by_size[-1].get("median_steady_step_s")}), flush=True)
    report["reformation_by_size"] = by_size
    save(report, args.out)


def save(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
