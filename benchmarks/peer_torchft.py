"""Side by side with torchft: recovery and steady-state speed of ftcomm and torchft 0.2.0, same run.

    python benchmarks/peer_torchft.py [--runs 3] [--window 10] [--step-time 0.005] [--diloco H] [--own-netns]

The same workload under three systems, interleaved in every run (ftcomm, then torchft with
its defaults, then torchft tuned: 1 s timeouts, 2 s for its quorum), each on a fresh group: 4 single-process
workers (``benchmarks/peer_worker.py``; replica groups of one process for torchft, with a
lighthouse started here on 127.0.0.1), Gloo on the CPU, one torch thread each, a small MLP
and ``--step-time`` seconds of sleep per step. Every worker prints each committed step with
its wall-clock time and world size. In each run, for each system:

1. *steady state*: committed steps per second of the 4 workers over ``--window`` seconds
   (median over the workers);
2. *kill -9* of one of the 4: the time from the signal until every survivor has committed a
   step in a world of 3;
3. *join*: a new worker is started; the time from the start of its ``ftcomm.init`` (torchft:
   the creation of its store, process group and Manager) to its first committed step, and
   until all 4 have committed a step together;
4. *SIGSTOP* of one of the 4: as 2; the stopped worker is then killed and a worker joins
   again (a second join sample).

``--diloco H`` runs both systems' DiLoCo instead (``ftcomm.DiLoCo``,
``torchft.local_sgd.DiLoCo``; the same inner SGD step and an outer step every H inner steps,
outer SGD 0.7 with Nesterov momentum 0.9): a committed step is then an outer step, so the
rates are outer steps per second (times H: inner steps), and a recovery ends at the
survivors' first committed outer step (up to H inner steps after the fault by design).

The steady window also counts the bytes the loopback sent, per worker and committed step;
``--own-netns`` (root) runs the benchmark in a network namespace of its own, so that they
are the systems' bytes alone (the systems run one after the other).

Ratios are torchft / ftcomm for times and bytes, ftcomm / torchft for steps per second; medians
over the runs. The torchft settings are ``peer_worker.TORCHFT_SETTINGS``. Every wait has a
deadline (``--deadline``); every process started here is killed at the end, whatever
happens. torchft is optional for the project: without it this prints how to install it
and exits with status 2.
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
from benchmarks.diloco import loopback_sent  # noqa: E402
from ftcomm.localproc import ChildProcess  # noqa: E402
from peer_worker import TORCHFT_SETTINGS  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "peer_worker.py")
SYSTEMS = ("ftcomm", "torchft_default", "torchft_tuned")
SIZE = 4
LIVE: list[ChildProcess] = []  # every process started here, killed at exit whatever happens


def child_env() -> dict:
    """One torch thread; library logs at warning level (torchft's Rust side logs every step at
    info level by default); no TORCHFT_* or FTCOMM_* variable that would override a setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHFT_", "FTCOMM_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RUST_LOG": "warn"}


def start(role: str, *args: str, python: str = sys.executable) -> ChildProcess:
    child = ChildProcess([python, "-u", WORKER, role, *args], ready_timeout=None, env=child_env())
    LIVE.append(child)
    return child


def close_all(children: list[ChildProcess], grace: float = 5.0) -> None:
    """Close every stdin at once (each stops at its next step boundary), wait up to ``grace``
    seconds, then kill what is left, with its process group."""
    for child in children:
        try:
            os.kill(child.process.pid, signal.SIGCONT)
            child.process.stdin.close()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace
    while any(c.alive() for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    for child in children:
        child.close(timeout=2)
        if child in LIVE:
            LIVE.remove(child)


class Cluster:
    """One system's group of workers (and, for torchft, its lighthouse)."""

    def __init__(self, system: str, step_time: float, deadline: float, torchft_ddp: bool = False,
                 diloco: int = 0, streaming: tuple[int, int] = (1, 0)) -> None:
        self.system, self.step_time, self.deadline = system, step_time, deadline
        self.torchft_ddp, self.diloco = torchft_ddp, diloco
        self.fragments, self.delay = streaming
        self.workers: list[ChildProcess] = []
        self.lighthouse: ChildProcess | None = None
        self.seed: str | None = None
        self.started = 0

    def spawn(self) -> ChildProcess:
        common = ["--step-time", str(self.step_time), "--diloco", str(self.diloco),
                  "--fragments", str(self.fragments), "--delay", str(self.delay)]
        if self.system == "ftcomm":
            worker = start("ftcomm", *common, *(["--peers", self.seed] if self.seed else []))
        else:
            tuned = ["--tuned"] if self.system == "torchft_tuned" else []
            ddp = ["--ddp"] if self.torchft_ddp else []
            worker = start("torchft", *common, *tuned, *ddp, "--lighthouse", self.lighthouse.address,
                           "--replica-id", f"replica_{self.started}")
        self.started += 1
        self.workers.append(worker)
        return worker

    def start(self) -> None:
        """``SIZE`` workers, until each has committed a step in a world of ``SIZE``."""
        if self.system == "ftcomm":
            first = self.spawn()
            first.wait_ready(self.deadline)
            self.seed = first.address
        else:
            self.lighthouse = start("lighthouse", *(["--tuned"] if self.system == "torchft_tuned" else []))
            self.lighthouse.wait_ready(self.deadline)
        while len(self.workers) < SIZE:
            self.spawn()
        for worker in self.workers:
            worker.wait_ready(self.deadline)
        self.wait_world(self.workers, SIZE, time.time())

    def wait_world(self, workers: list[ChildProcess], size: int, after: float,
                   marks: list[int] | None = None) -> list[dict]:
        """Each worker's first commit in a world of ``size`` later than ``after`` (wall clock),
        looking at its events from ``marks`` on (default: from now, for ``after`` = now)."""
        marks = marks or [mark(w) for w in workers]
        return [w.wait_for(lambda e: e["ev"] == "commit" and e["world"] == size and e["t"] > after,
                           self.deadline, f"a commit in a world of {size}", m)
                for w, m in zip(workers, marks)]

    def errors(self) -> list[dict]:
        """The ``error`` events of the workers still in the group (a worker's traceback)."""
        return [e for w in self.workers for e in w.snapshot() if e["ev"] == "error"]

    def close(self) -> None:
        close_all(self.workers + ([self.lighthouse] if self.lighthouse else []))
        self.workers, self.lighthouse = [], None


def mark(worker: ChildProcess) -> int:
    return len(worker.events)


def loopback_bytes() -> int:
    """Bytes this network namespace's loopback has sent (with ``--own-netns``: every byte
    the system under test sends, gossip, store and lighthouse included)."""
    with open("/proc/net/dev") as f:
        return loopback_sent(f.read())


def steady_state(cluster: Cluster, window: float) -> dict:
    """Committed steps per second of each worker over ``window`` seconds, all in a world of
    SIZE; and the loopback's bytes per committed step per worker over the window."""
    cluster.wait_world(cluster.workers, SIZE, time.time())
    time.sleep(1.0)
    marks = [mark(w) for w in cluster.workers]
    sent = loopback_bytes()
    time.sleep(window)
    sent = loopback_bytes() - sent
    rates, commits = [], []
    for worker, m in zip(cluster.workers, marks):
        times = [e["t"] for e in worker.snapshot()[m:] if e["ev"] == "commit" and e["world"] == SIZE]
        if len(times) < 2:
            raise RuntimeError(f"{len(times)} commits in a world of {SIZE} within {window:g} s")
        rates.append((len(times) - 1) / (times[-1] - times[0]))
        commits.append(len(times))
    return {"steps_per_s": round(statistics.median(rates), 2), "per_worker": [round(r, 2) for r in rates],
            "bytes_per_step": round(sent / SIZE / statistics.median(commits))}


def fault(cluster: Cluster, sig: int, victim_index: int = 1, whole_group: bool = False) -> dict:
    """Signal one worker (``whole_group``: with the processes it forked); the time until every
    survivor committed a step in a world of SIZE - 1. A stopped worker is killed afterwards."""
    cluster.wait_world(cluster.workers, SIZE, time.time())
    time.sleep(0.5)
    victim = cluster.workers[victim_index]
    survivors = [w for w in cluster.workers if w is not victim]
    marks = [mark(w) for w in survivors]
    t0 = time.time()
    victim.signal(sig, whole_group)
    try:
        firsts = cluster.wait_world(survivors, SIZE - 1, t0, marks)
    finally:
        if sig == signal.SIGSTOP:
            victim.signal(signal.SIGKILL, whole_group)
        close_all([victim], grace=0)
        cluster.workers.remove(victim)
    return {"recovery_s": round(max(f["t"] for f in firsts) - t0, 4),
            "per_survivor_s": [round(f["t"] - t0, 4) for f in firsts]}


def join(cluster: Cluster) -> dict:
    """Start a worker; from its init to its first commit, and until all SIZE committed together."""
    marks = [mark(w) for w in cluster.workers]
    joiner = cluster.spawn()
    started = joiner.wait_for(lambda e: e["ev"] == "started", cluster.deadline, "start")
    first = joiner.wait_for(lambda e: e["ev"] == "commit", cluster.deadline, "the joiner's first commit")
    together = cluster.wait_world(cluster.workers, SIZE, started["init_t"], marks + [0])
    return {"join_s": round(first["t"] - started["init_t"], 4), "first_commit_world": first["world"],
            "all_committed_s": round(max(e["t"] for e in together) - started["init_t"], 4)}


def one_run(system: str, args) -> dict:
    """Steady state, kill -9, join, SIGSTOP, join on a fresh group (see :func:`measure_in_turn`)."""
    cluster = Cluster(system, args.step_time, args.deadline, args.torchft_ddp, args.diloco,
                      (args.fragments, args.delay))
    steps = [("steady", lambda: steady_state(cluster, args.window)),
             ("kill9", lambda: fault(cluster, signal.SIGKILL)),
             ("join_after_kill9", lambda: join(cluster)),
             ("sigstop", lambda: fault(cluster, signal.SIGSTOP)),
             ("join_after_sigstop", lambda: join(cluster))]
    return measure_in_turn(system, cluster, steps)


def measure_in_turn(system: str, cluster: Cluster, steps: list) -> dict:
    """Start ``cluster`` and take each ``(name, measure)`` of ``steps`` in turn; a measurement
    that fails is recorded with its error and ends the run (the group's state is unknown)."""
    result: dict = {"system": system}
    try:
        cluster.start()
        for name, measure in steps:
            result[name] = measure()
            print(json.dumps({"system": system, name: result[name]}), flush=True)
    except (TimeoutError, RuntimeError) as exc:  # recorded, not hidden: a failure is a result
        result["failed"] = str(exc)[-3000:]
        result["worker_errors"] = cluster.errors()
        print(json.dumps({"system": system, "failed": str(exc).splitlines()[0],
                          "worker_errors": [e["message"] for e in result["worker_errors"]]}), flush=True)
    finally:
        cluster.close()
    return result


def median_of(runs: list[dict], key: str, field: str) -> float | None:
    values = [r[key][field] for r in runs if key in r]
    return round(statistics.median(values), 4) if values else None


def summarize(runs: list[dict]) -> dict:
    summary: dict = {}
    for system in SYSTEMS:
        mine = [r for r in runs if r["system"] == system]
        joins = [r[k]["join_s"] for r in mine for k in ("join_after_kill9", "join_after_sigstop") if k in r]
        summary[system] = {
            "steady_steps_per_s": median_of(mine, "steady", "steps_per_s"),
            "bytes_per_step": median_of(mine, "steady", "bytes_per_step"),
            "runs_bytes_per_step": [r["steady"]["bytes_per_step"] for r in mine if "steady" in r],
            "kill9_recovery_s": median_of(mine, "kill9", "recovery_s"),
            "sigstop_recovery_s": median_of(mine, "sigstop", "recovery_s"),
            "join_s": round(statistics.median(joins), 4) if joins else None,
            "runs_steady": [r["steady"]["steps_per_s"] for r in mine if "steady" in r],
            "runs_kill9_s": [r["kill9"]["recovery_s"] for r in mine if "kill9" in r],
            "runs_sigstop_s": [r["sigstop"]["recovery_s"] for r in mine if "sigstop" in r],
            "runs_join_s": joins,
            "failed_runs": sum(1 for r in mine if "failed" in r),
        }
    ours = summary["ftcomm"]
    ratios = {}
    for system in SYSTEMS[1:]:
        theirs = summary[system]

        def ratio(a, b):
            return round(a / b, 2) if a and b else None
        ratios[system] = {
            "kill9_recovery_torchft_over_ftcomm": ratio(theirs["kill9_recovery_s"], ours["kill9_recovery_s"]),
            "sigstop_recovery_torchft_over_ftcomm": ratio(theirs["sigstop_recovery_s"], ours["sigstop_recovery_s"]),
            "join_torchft_over_ftcomm": ratio(theirs["join_s"], ours["join_s"]),
            "steady_ftcomm_over_torchft": ratio(ours["steady_steps_per_s"], theirs["steady_steps_per_s"]),
            "bytes_torchft_over_ftcomm": ratio(theirs["bytes_per_step"], ours["bytes_per_step"]),
        }
    return {"medians": summary, "ratios": ratios}


def print_table(summary: dict) -> None:
    medians, ratios = summary["medians"], summary["ratios"]

    def cell(value, unit=""):
        return "-" if value is None else f"{value:g}{unit}"
    rows = [("kill -9 of 1 of 4: recovery (s)", "kill9_recovery_s", "kill9_recovery_torchft_over_ftcomm",
             "runs_kill9_s"),
            ("SIGSTOP of 1 of 4: recovery (s)", "sigstop_recovery_s", "sigstop_recovery_torchft_over_ftcomm",
             "runs_sigstop_s"),
            ("join: init to first commit (s)", "join_s", "join_torchft_over_ftcomm", "runs_join_s"),
            ("steady state, 4 workers (steps/s)", "steady_steps_per_s", "steady_ftcomm_over_torchft", "runs_steady"),
            ("bytes per step per worker (steady)", "bytes_per_step", "bytes_torchft_over_ftcomm",
             "runs_bytes_per_step")]
    header = ["measure (median)", "ftcomm", "torchft default", "ratio", "torchft tuned", "ratio"]
    lines = [header]
    for title, key, ratio_key, _ in rows:
        lines.append([title, cell(medians["ftcomm"][key]),
                      cell(medians["torchft_default"][key]), cell(ratios["torchft_default"][ratio_key], "x"),
                      cell(medians["torchft_tuned"][key]), cell(ratios["torchft_tuned"][ratio_key], "x")])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    print()
    for line in lines:
        print("  ".join(text.ljust(w) for text, w in zip(line, widths)))
    print("ratios: torchft / ftcomm for times, ftcomm / torchft for steps/s")
    for title, key, _, runs_key in rows:
        print(f"{title}, every run: " + "; ".join(f"{s} {medians[s][runs_key]}" for s in SYSTEMS))
    failed = {s: medians[s]["failed_runs"] for s in SYSTEMS if medians[s]["failed_runs"]}
    if failed:
        print(f"runs with a failed measurement: {failed} (errors in the JSON)")


def torchft_version() -> str | None:
    """The installed torchft's version, or None when this Python cannot import it."""
    probe = subprocess.run([sys.executable, "-c", "import importlib.metadata, torchft; "
                            "print(importlib.metadata.version('torchft'))"],
                           capture_output=True, text=True, timeout=120, cwd=os.path.dirname(__file__))
    return probe.stdout.strip() if probe.returncode == 0 else None


def save(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def in_own_namespace() -> int:
    """Run this benchmark again, with the same arguments, in a new network namespace whose
    loopback is up; the namespace is deleted afterwards."""
    name = f"ftpeer{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True, timeout=30)
        return subprocess.run(["ip", "netns", "exec", name, sys.executable, *sys.argv],
                              env={**os.environ, "PEER_TORCHFT_NETNS": name}).returncode
    finally:
        subprocess.run(["ip", "netns", "delete", name], timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--window", type=float, default=10.0, help="seconds of steady state measured per run")
    parser.add_argument("--step-time", type=float, default=0.005, help="extra seconds of work per step (sleep)")
    parser.add_argument("--deadline", type=float, default=180.0,
                        help="seconds any one wait may take (torchft's default Gloo timeout is 60 s)")
    parser.add_argument("--torchft-ddp", action="store_true",
                        help="torchft workers average through torchft.DistributedDataParallel (see peer_worker.py)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="a subset of " + ", ".join(SYSTEMS))
    parser.add_argument("--diloco", type=int, default=0,
                        help="train with DiLoCo, an outer step every this many inner steps, in both systems (a "
                             "commit is an outer step); results in peer_torchft_diloco.json")
    parser.add_argument("--fragments", type=int, default=1,
                        help="with --diloco: Streaming DiLoCo, the model in this many fragments (both systems)")
    parser.add_argument("--delay", type=int, default=0,
                        help="with --diloco: each outer step's reduction overlaps this many inner steps (ftcomm "
                             "delay, torchft fragment_sync_delay); results in peer_torchft_streaming.json")
    parser.add_argument("--own-netns", action="store_true",
                        help="run in a network namespace of its own (root), so that the loopback's bytes are the "
                             "systems' alone (without it, the bytes per step count the host's loopback traffic too)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/peer_torchft[_diloco].json")
    args = parser.parse_args()
    args.out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                        f"peer_torchft{'_streaming' if args.fragments > 1 or args.delay else ''}"
                                        f"{'_diloco' if args.diloco and args.fragments == 1 and not args.delay else ''}"
                                        f".json")
    if args.diloco and args.torchft_ddp:
        parser.error("--diloco trains through each system's DiLoCo: not with --torchft-ddp")
    if (args.fragments != 1 or args.delay) and not args.diloco:
        parser.error("--fragments and --delay are DiLoCo's: give --diloco")
    if args.own_netns and os.environ.get("PEER_TORCHFT_NETNS") is None:
        return in_own_namespace()
    compile_package()  # as an installed package: each worker reads the compiled modules
    systems = [s for s in args.systems.split(",") if s]
    if not systems or set(systems) - set(SYSTEMS):
        parser.error(f"--systems: choose from {', '.join(SYSTEMS)}")

    version = torchft_version()
    if version is None:
        print("torchft is not importable with this Python. Install it (with a torch it supports) and run again:\n"
              "    pip install torchft==0.2.0", file=sys.stderr)
        return 2
    if version != "0.2.0":
        print(f"note: torchft {version} is installed; peer_worker.py is written against 0.2.0", file=sys.stderr)
    atexit.register(close_all, LIVE)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(1))  # through the finally blocks and atexit

    report: dict = {
        "benchmark": "peer_torchft",
        "own_netns": os.environ.get("PEER_TORCHFT_NETNS") is not None,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_start": os.getloadavg()},
        "versions": {"torch": importlib.metadata.version("torch"), "torchft": version,
                     "ftcomm": importlib.metadata.version("ftcomm")},
        "workload": {"workers": SIZE, "backend": "gloo (CPU, 127.0.0.1)", "torch_threads": 1,
                     "model": "MLP 32-128-128-4, batch 64, SGD", "step_time_s": args.step_time,
                     "diloco_sync_every": args.diloco or None,
                     "diloco_fragments": args.fragments, "diloco_delay": args.delay,
                     "window_s": args.window},
        "settings": {"ftcomm": "defaults (ftcomm.init(backend='gloo', bind='127.0.0.1:0', min_workers=1))",
                     "torchft": TORCHFT_SETTINGS,
                     "torchft_common": "Manager(min_replica_size=1, rank=0, world_size=1), lighthouse "
                                       "min_replicas=1, heartbeat_interval 100 ms (default), RUST_LOG=warn",
                     "torchft_gradients": "torchft.DistributedDataParallel" if args.torchft_ddp
                     else "one Manager.allreduce of a flat buffer"},
        "definitions": {
            "recovery_s": "from the signal to the moment every survivor has committed a step in a world of 3",
            "join_s": "from the joiner's init (ftcomm.init; torchft: its store, process group and Manager) to its "
                      "first committed step; a torchft joiner's first step is committed while it heals, in a "
                      "world of the others (first_commit_world)",
            "all_committed_s": "from the joiner's init until all 4 have committed a step in a world of 4",
            "steps_per_s": "committed steps per second of each worker over the window, median over the 4",
            "bytes_per_step": "bytes the loopback sent during the steady window, per worker and committed step "
                              "(every byte of the system: with --own-netns nothing else's)",
        },
        "runs": [],
    }
    return interleave(report, systems, args, one_run, summarize, print_table)


def interleave(report: dict, systems: list[str], args, run_one, summarize_runs, print_summary) -> int:
    """``args.runs`` runs, each of every system in turn (``run_one(system, args)``); the report
    saved to ``args.out`` after each, summarized, printed at the end; 1 if a run failed."""
    try:
        for run in range(args.runs):
            for system in systems:
                print(f"run {run + 1}/{args.runs}: {system}", flush=True)
                report["runs"].append({"run": run + 1, **run_one(system, args)})
                report.update(summarize_runs(report["runs"]))
                save(report, args.out)
    finally:
        close_all(list(LIVE))
    if report["runs"]:
        print_summary(report)
    print(f"written to {args.out}")
    return 0 if not any("failed" in r for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
