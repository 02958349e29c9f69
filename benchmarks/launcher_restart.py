"""``ftcomm run``: a worker killed with kill -9, restarted by the launcher, back in the
group and committing. Phases per run, from the kill:

- *restart*: the launcher noticed the exit and started a new process (backoff 0);
- *startup*: the new process's interpreter start until it calls ``ftcomm.init`` (the
  example's ``started`` event: torch imported, the model and optimizer built; building
  the first optimizer imports ``torch._dynamo``, about 1.5 s of it); the process start
  time is read from /proc, so the launcher's own delay is not counted here;
- *join*: from calling ``ftcomm.init`` until the worker is in a view (``ready``);
- *first commit*: in the view until its first committed step (state received, a step
  taken with the others);
- *total*: the kill until that first committed step.

The survivors go on meanwhile: *survivors resume* is the kill until every survivor has
committed a step in a view without the killed worker (the baseline: what the group
needs without waiting for anyone). One launcher per mode, ``--runs`` kills of different
workers, a few seconds apart.

Modes, run one after the other in the same invocation: *cold* (a new process per
restart, what ``ftcomm run`` does by default) and *standby* (``--standby 1``: a warm
interpreter takes the worker's place; *startup* is then counted from the takeover, and
before each kill the benchmark waits until the launcher reports a standby ready). The
memory of an idle standby (RSS, and PSS: its share of pages it shares with the workers)
is read from /proc before the kills.

    python benchmarks/launcher_restart.py --runs 5 [--modes cold,standby]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time

from ftcomm.ops.worker_output import untagged

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.bytecode import compile_package  # noqa: E402
EXAMPLE = ROOT / "examples" / "train_elastic.py"


def process_start_time(pid: int) -> float | None:
    """Wall-clock start time of ``pid`` from /proc (10 ms resolution); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except OSError:
        return None
    age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return time.time() - age


class Job:
    def __init__(self, workers: int, step_time: float, launcher: tuple = ()) -> None:
        command = [sys.executable, "-m", "ftcomm", "run", "--nproc-per-node", str(workers), "--restart-backoff",
                   "0", "--max-restarts", "100", "--status-interval", "3600", *launcher, str(EXAMPLE), "--steps",
                   "100000000", "--step-time", str(step_time), "--report-every", "100000000"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTCOMM_")}
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=env, cwd=ROOT)
        self.events: list[dict] = []
        self.starts: dict[int, float] = {}  # pid -> when the launcher reported starting it
        self.standbys_ready: list[int] = []  # pids of standbys the launcher reported ready
        self.log: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read_out, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read_out(self) -> None:
        for line in self.process.stdout:
            line = untagged(line)
            if line.startswith("{"):
                event = json.loads(line)
                event["seen"] = time.time()
                with self._lock:
                    self.events.append(event)

    def _read_err(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            if " started: pid " in line:
                pid = int(line.split(" started: pid ")[1].split(",")[0])
                self.starts[pid] = time.time()
            if "standby ready: pid " in line:
                self.standbys_ready.append(int(line.split("standby ready: pid ")[1].split(",")[0]))

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.events)

    def wait(self, predicate, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.snapshot():
                if predicate(event):
                    return event
            if self.process.poll() is not None:
                break
            time.sleep(0.005)
        raise RuntimeError(f"no {what} within {timeout} s; launcher log:\n{''.join(self.log[-30:])}")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def memory_mb(pid: int) -> dict:
    """RSS and PSS of ``pid`` in MB (from /proc; PSS counts shared pages by share)."""
    values = {}
    for path, keys in ((f"/proc/{pid}/status", ("VmRSS",)), (f"/proc/{pid}/smaps_rollup", ("Pss",))):
        try:
            for line in open(path):
                name = line.split(":")[0]
                if name in keys:
                    values[name.lower().replace("vm", "")] = round(int(line.split()[1]) / 1024, 1)
        except OSError:
            pass
    return values


def one_restart(job: Job, victim: dict, live: list[dict], standby: bool) -> dict:
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    new = job.wait(lambda e: e["ev"] == "started" and e["t"] > killed_at, 120, "restarted process")
    pid = new["pid"]
    born = job.starts.get(pid) if standby else process_start_time(pid) or job.starts.get(pid)
    ready = job.wait(lambda e: e["ev"] == "ready" and e["pid"] == pid, 120, "restarted worker in the group")
    first = job.wait(lambda e: e["ev"] == "first_step" and e.get("pid") == pid, 120, "its first commit")
    survivors = [w for w in live if w["pid"] != victim["pid"]]
    resumed = [job.wait(lambda e, w=w: e["ev"] == "first_step" and e.get("pid") == w["pid"] and e["t"] > killed_at,
                        120, "a survivor's commit") for w in survivors]
    return {
        "restart_s": round(job.starts.get(pid, born) - killed_at, 3),
        "startup_s": round(new["t"] - born, 3),
        "join_s": round(ready["t"] - new["t"], 3),
        "first_commit_s": round(first["t"] - ready["t"], 3),
        "total_s": round(first["t"] - killed_at, 3),
        "survivors_resume_s": round(max(e["t"] for e in resumed) - killed_at, 3),
        "ready_event": ready,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--modes", default="cold,standby", help="cold, standby or both (in this order)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "launcher_restart.json"))
    args = parser.parse_args()
    compile_package()  # as an installed package: each worker reads the compiled modules
    keys = ["restart_s", "startup_s", "join_s", "first_commit_s", "total_s", "survivors_resume_s"]
    result = {"benchmark": "launcher_restart", "workers": args.workers, "step_time_s": args.step_time,
              "modes": {}, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    complete = True
    for mode in args.modes.split(","):
        standby = mode == "standby"
        job = Job(args.workers, args.step_time, ("--standby", "1") if standby else ())
        rows, memory = [], {}
        try:
            live = []
            for _ in range(args.workers):
                live.append(job.wait(lambda e: e["ev"] == "ready" and e["pid"] not in {w["pid"] for w in live},
                                     120, "a worker in the group"))
            for run in range(args.runs):
                time.sleep(3.0)  # training goes on a while between kills
                if standby:
                    deadline = time.monotonic() + 60
                    while len(job.standbys_ready) <= run and time.monotonic() < deadline:
                        time.sleep(0.05)
                    if len(job.standbys_ready) <= run:
                        raise RuntimeError("no standby ready within 60 s:\n" + "".join(job.log[-30:]))
                    if not memory:
                        memory = memory_mb(job.standbys_ready[run])
                victim = live[run % len(live)]
                row = one_restart(job, victim, live, standby)
                live[live.index(victim)] = row.pop("ready_event")
                rows.append(row)
                print(json.dumps({"mode": mode, "run": run + 1, **row}), flush=True)
        finally:
            status = job.stop()
        medians = {k: round(statistics.median(r[k] for r in rows), 3) for k in keys} if rows else {}
        result["modes"][mode] = {"runs": rows, "median": medians, "launcher_exit_status": status,
                                 **({"standby_memory_mb": memory} if standby else {})}
        print(json.dumps({"mode": mode, "median": medians, "launcher_exit_status": status,
                          **({"standby_memory_mb": memory} if standby else {})}), flush=True)
        complete &= len(rows) == args.runs
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
