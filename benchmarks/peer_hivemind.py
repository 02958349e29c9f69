"""Side by side with hivemind, the other coordinator-free system: recovery, steady speed and bit-equality.

    python benchmarks/peer_hivemind.py --hivemind-python PATH [--runs 3] [--window 10] [--sync-every 40]

hivemind 1.1.12 pins other versions of libraries than ftcomm's environment has, so it is
run from an environment of its own, given by ``--hivemind-python``::

    python -m venv /tmp/hivemind && /tmp/hivemind/bin/pip install torch==2.13.0 hivemind==1.1.12

The same workload as ``benchmarks/peer_torchft.py`` (``benchmarks/peer_worker.py``: 4
single-process workers on 127.0.0.1, one torch thread each, a small MLP, ``--step-time``
seconds of sleep per step, SGD), under four systems, interleaved in every run, each on a
fresh group:

- ``ftcomm``: gradients averaged every step (``wait_gradients_ready``), defaults;
- ``hivemind_averager``: gradients averaged every step by hivemind's
  ``DecentralizedAverager`` with the settings of hivemind's own averaging benchmark (see
  peer_worker.py); a step whose averaging fails applies the worker's own gradient;
- ``hivemind_averager_tuned``: the same with every wait at 1 s or less
  (``peer_worker.HIVEMIND_AVERAGER_SETTINGS``);
- ``ftcomm_localsgd``: ``ftcomm.LocalSGD``, parameters averaged every ``--sync-every`` steps;
- ``hivemind_optimizer``: ``hivemind.Optimizer`` with its quickstart's settings
  (``use_local_updates=True``, ``matchmaking_time=3``, ``averaging_timeout=10``), an epoch
  (parameter averaging) when the swarm has trained ``--sync-every`` steps per worker.

A commit is a step (per-step systems) or an outer step / epoch; its world is the number
of workers it averaged over (hivemind: the size of the averaging group). In each run, for
each system: the steady rate (commits per second in a world of 4, median over the
workers, over ``--window`` seconds); kill -9 of one worker (its process group: hivemind's
DHT, averagers and p2p daemon are processes of their own, and a machine that fails takes
them with it), then the time until every
survivor committed in a world of 3; a join (from the joiner's start until all 4 committed
together in a world of 4); SIGSTOP of one worker, as kill -9; a second join;
and a final steady window. *Bit-equal*: in a steady window, whether some parameter
digest (``peer_worker.digest``, after a commit) was held by all 4 workers, in the first
window and in the final one (after the faults and joins).

Ratios are hivemind / ftcomm for times, ftcomm / hivemind for rates; medians over the runs.
Every wait has a deadline (``--deadline``); every process started here is killed at the
end. JSON in benchmarks/results/peer_hivemind.json.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bytecode import compile_package  # noqa: E402
from benchmarks.peer_torchft import (LIVE, SIZE, Cluster, close_all, fault, interleave, join, mark,  # noqa: E402
                                     measure_in_turn, start, steady_state)

SYSTEMS = ("ftcomm", "hivemind_averager", "hivemind_averager_tuned", "ftcomm_localsgd", "hivemind_optimizer")
PAIRS = (("ftcomm", "hivemind_averager"), ("ftcomm", "hivemind_averager_tuned"),
         ("ftcomm_localsgd", "hivemind_optimizer"))


class Group(Cluster):
    """One system's 4 workers; the first one's address is the others' seed."""

    def __init__(self, system: str, args) -> None:
        super().__init__(system, args.step_time, args.deadline)
        self.hivemind_python = args.hivemind_python
        self.sync_every = args.sync_every if system in ("ftcomm_localsgd", "hivemind_optimizer") else 0

    def spawn(self):
        common = ["--step-time", str(self.step_time), "--diloco", str(self.sync_every),
                  *(["--peers", self.seed] if self.seed else [])]
        if self.system.startswith("hivemind"):
            tuned = ["--tuned"] if self.system.endswith("_tuned") else []
            worker = start("hivemind", *common, *tuned, python=self.hivemind_python)
        else:
            worker = start("ftcomm", *common, *(["--local-sgd"] if self.sync_every else []))
        self.started += 1
        self.workers.append(worker)
        return worker

    def start(self) -> None:
        first = self.spawn()
        first.wait_ready(self.deadline)
        self.seed = first.address
        while len(self.workers) < SIZE:
            self.spawn()
        for worker in self.workers:
            worker.wait_ready(self.deadline)
        self.wait_world(self.workers, SIZE, time.time())


def steady_and_equal(group: Group, window: float) -> dict:
    """The steady rate, and whether one parameter digest was held by all 4 workers in the window."""
    marks = [mark(w) for w in group.workers]
    result = steady_state(group, window)
    held = [{e["digest"] for e in w.snapshot()[m:] if e["ev"] == "commit" and "digest" in e}
            for w, m in zip(group.workers, marks)]
    common = set.intersection(*held) if held else set()
    last = {w.snapshot()[-1].get("digest") for w in group.workers if w.snapshot()}
    return {**result, "bit_equal": bool(common), "digests_held_by_all": len(common),
            "distinct_last_digests": len(last)}


def one_run(system: str, args) -> dict:
    group = Group(system, args)
    steps = [("steady", lambda: steady_and_equal(group, args.window)),
             ("kill9", lambda: fault(group, signal.SIGKILL, whole_group=True)),
             ("join_after_kill9", lambda: join(group)),
             ("sigstop", lambda: fault(group, signal.SIGSTOP, whole_group=True)),
             ("join_after_sigstop", lambda: join(group)),
             ("final", lambda: steady_and_equal(group, args.window))]
    return measure_in_turn(system, group, steps)


def summarize(runs: list[dict]) -> dict:
    def median(values):
        return round(statistics.median(values), 4) if values else None

    medians = {}
    for system in SYSTEMS:
        mine = [r for r in runs if r["system"] == system]
        # until all 4 average together: a hivemind.Optimizer joiner's first epoch comes from the
        # state it loads (in a world of 1), not from averaging with the others
        joins = [r[k]["all_committed_s"] for r in mine for k in ("join_after_kill9", "join_after_sigstop") if k in r]
        medians[system] = {
            "steady_commits_per_s": median([r["steady"]["steps_per_s"] for r in mine if "steady" in r]),
            "kill9_recovery_s": median([r["kill9"]["recovery_s"] for r in mine if "kill9" in r]),
            "sigstop_recovery_s": median([r["sigstop"]["recovery_s"] for r in mine if "sigstop" in r]),
            "join_s": median(joins),
            "bit_equal_first": [r["steady"]["bit_equal"] for r in mine if "steady" in r],
            "bit_equal_final": [r["final"]["bit_equal"] for r in mine if "final" in r],
            "runs_kill9_s": [r["kill9"]["recovery_s"] for r in mine if "kill9" in r],
            "runs_sigstop_s": [r["sigstop"]["recovery_s"] for r in mine if "sigstop" in r],
            "runs_join_s": joins,
            "failed_runs": sum(1 for r in mine if "failed" in r),
        }
    ratios = {}
    for ours, theirs in PAIRS:
        a, b = medians[ours], medians[theirs]

        def ratio(x, y):
            return round(x / y, 2) if x and y else None
        ratios[theirs] = {"kill9_hivemind_over_ftcomm": ratio(b["kill9_recovery_s"], a["kill9_recovery_s"]),
                          "sigstop_hivemind_over_ftcomm": ratio(b["sigstop_recovery_s"], a["sigstop_recovery_s"]),
                          "join_hivemind_over_ftcomm": ratio(b["join_s"], a["join_s"]),
                          "steady_ftcomm_over_hivemind": ratio(a["steady_commits_per_s"], b["steady_commits_per_s"])}
    return {"medians": medians, "ratios": ratios}


def print_table(summary: dict) -> None:
    medians, ratios = summary["medians"], summary["ratios"]

    def cell(value, unit=""):
        return "-" if value is None else f"{value:g}{unit}"

    def equal(values):
        return f"{sum(values)}/{len(values)}" if values else "-"
    print()
    for ours, theirs in PAIRS:
        a, b, r = medians[ours], medians[theirs], ratios[theirs]
        print(f"{ours} vs {theirs} (medians; ratio hivemind/ftcomm for times, ftcomm/hivemind for rates)")
        for title, key, ratio_key in (("kill -9 of 1 of 4: recovery (s)", "kill9_recovery_s", "kill9_hivemind_over_ftcomm"),
                                      ("SIGSTOP of 1 of 4: recovery (s)", "sigstop_recovery_s",
                                       "sigstop_hivemind_over_ftcomm"),
                                      ("join: start to all 4 averaging (s)", "join_s", "join_hivemind_over_ftcomm"),
                                      ("steady commits per second", "steady_commits_per_s",
                                       "steady_ftcomm_over_hivemind")):
            print(f"  {title:36} {cell(a[key]):>8} {cell(b[key]):>8}  {cell(r[ratio_key], 'x')}")
        print(f"  {'bit-equal runs, first / final window':36} {equal(a['bit_equal_first'])} / "
              f"{equal(a['bit_equal_final'])}   {equal(b['bit_equal_first'])} / {equal(b['bit_equal_final'])}")
    failed = {s: medians[s]["failed_runs"] for s in SYSTEMS if medians[s]["failed_runs"]}
    if failed:
        print(f"runs with a failed measurement: {failed} (errors in the JSON)")


def hivemind_version(python: str) -> str | None:
    probe = subprocess.run([python, "-c", "import importlib.metadata, hivemind; "
                            "print(importlib.metadata.version('hivemind'))"],
                           capture_output=True, text=True, timeout=120, cwd="/")
    return probe.stdout.strip() if probe.returncode == 0 else None


def resummarize(path: str) -> None:
    """The summary of a saved report computed again from its runs (after a change to it)."""
    with open(path) as f:
        report = json.load(f)
    report.update(summarize(report["runs"]))
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hivemind-python", help="a Python whose environment has hivemind 1.1.12")
    parser.add_argument("--summarize-only", action="store_true",
                        help="compute the summary of the report in --out again from its runs, print it, run nothing")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--window", type=float, default=10.0, help="seconds of each steady window")
    parser.add_argument("--step-time", type=float, default=0.005, help="extra seconds of work per step (sleep)")
    parser.add_argument("--sync-every", type=int, default=40,
                        help="steps between parameter averagings (ftcomm.LocalSGD; hivemind.Optimizer's "
                             "target_batch_size is 4 x 64 x this: 10,240 at 40, the quickstart's 10,000)")
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds any one wait may take")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="a subset of " + ", ".join(SYSTEMS))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "peer_hivemind.json"))
    args = parser.parse_args()
    if args.summarize_only:
        resummarize(args.out)
        return 0
    if not args.hivemind_python:
        parser.error("--hivemind-python is required (a Python whose environment has hivemind 1.1.12)")
    systems = [s for s in args.systems.split(",") if s]
    if not systems or set(systems) - set(SYSTEMS):
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)}")
    version = hivemind_version(args.hivemind_python)
    if version is None:
        print(f"{args.hivemind_python} cannot import hivemind. Make an environment for it:\n"
              "    python -m venv /tmp/hivemind && /tmp/hivemind/bin/pip install torch==2.13.0 hivemind==1.1.12\n"
              "and pass --hivemind-python /tmp/hivemind/bin/python", file=sys.stderr)
        return 2
    compile_package()
    atexit.register(close_all, LIVE)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(1))
    report: dict = {
        "benchmark": "peer_hivemind",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_start": os.getloadavg()},
        "versions": {"torch": importlib.metadata.version("torch"), "hivemind": version,
                     "ftcomm": importlib.metadata.version("ftcomm")},
        "workload": {"workers": SIZE, "model": "MLP 32-128-128-4, batch 64, SGD 0.05 momentum 0.9",
                     "step_time_s": args.step_time, "sync_every": args.sync_every, "window_s": args.window},
        "runs": [],
    }
    return interleave(report, systems, args, one_run, summarize, print_table)


if __name__ == "__main__":
    sys.exit(main())
