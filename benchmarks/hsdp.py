"""Sharded replicas (HSDP): recovery after kill -9 of one process, replica join time by K,
and the steady step against plain FSDP2 HSDP.

    python benchmarks/hsdp.py [--runs 3] [--only recovery,join,steady]

Every job is ``examples/train_hsdp.py`` under ``ftcomm run --replica-size K`` on 127.0.0.1.

*Recovery*: 3 replicas of 2 processes train (hidden 256, 0.02 s of extra work per step);
one process of a replica is killed with SIGKILL, or stopped with SIGSTOP (the launcher's
own killing of stopped processes off: a hang as a stuck kernel makes one), in three
modes side by side in one invocation: the replica repaired in place by a new process
(``repair``), the same with a warm standby ready (``repair_standby``: ``--standby 1``),
and the whole replica restarted (``restart``: ``--replica-restart``, what ``ftcomm run``
did before repair in place). Reported: from the fault to the next step committed by the
other replicas ("others commit again"), to the partner's release (the log line saying its
replica is lost: torch's collectives no longer hold it), and to the first view that holds
the replica again ("replica back"), and whether the partner kept its process.

*Join by K*: one replica of K processes trains a model of about 4.3M parameters (hidden
2048, Adam: 52 MB of state); a second replica of K processes is started by a second
launcher and joins. Reported: the state each process receives (its shard of the
parameters and Adam's moments), the state transfer (the reconcile of the joiners' first
view: each shard's processes receive their shard at once) and the join, from the
joiners' ``ftcomm.init()`` to their first committed step. K = 1 is the same model
unsharded (each replica one process). All 2K processes share this machine's cores, so
the shards' transfers run in parallel only as far as its cores allow.

*Steady step*: 2 replicas of 2 processes under ftcomm against plain FSDP2 HSDP on a
``("replicate", "shard")`` mesh of the same 4 processes, the same model (hidden 1024) and
batches: the median step time over steps 10 to 80 of rank 0, the baseline run first in
the same invocation; and ftcomm once more with the cross-replica reduction after
backward instead of during it (``--no-overlap``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

from ftcomm.ops.worker_output import untagged

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "train_hsdp.py")


class Job:
    """One ``ftcomm run`` (or plain processes); every JSON line printed, with its arrival time."""

    def __init__(self, command: list[str], env: dict | None = None, log: bool = False) -> None:
        """``log``: keep the lines of its standard error too (the launcher's and the library's log)."""
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE if log else subprocess.DEVNULL, text=True,
                                        env={**{k: v for k, v in os.environ.items() if not k.startswith("FTCOMM_")},
                                             **(env or {})}, start_new_session=True)
        self.events: list[tuple[float, dict]] = []
        self.log: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if log:
            threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.log.append((time.time(), line))

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                self.events.append((time.time(), json.loads(untagged(line))))
            except ValueError:
                pass

    def of(self, kind: str) -> list[tuple[float, dict]]:
        return [(t, e) for t, e in list(self.events) if e["ev"] == kind]

    def wait_for(self, test, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not test():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"{what} did not happen within {timeout:g} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._reader.join(5)


def launcher(nproc: int, k: int, args: list[str], extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "ftcomm", "run", "--nproc-per-node", str(nproc), "--replica-size", str(k),
            "--restart-backoff", "0.2", *extra, EXAMPLE, "--steps", "100000000", *args]


RECOVERY_MODES = {"repair": [], "repair_standby": ["--standby", "1"], "restart": ["--replica-restart"]}


def recovery_run(mode: str, sig: int) -> dict:
    extra = RECOVERY_MODES[mode] + (["--kill-stopped-after", "off"] if sig == signal.SIGSTOP else [])
    job = Job(launcher(6, 2, ["--hidden", "256", "--step-time", "0.02", "--report-every", "1", "--min-workers", "2"],
                       extra), log=True)
    try:
        job.wait_for(lambda: len(job.of("ready")) >= 6 and len(job.of("step")) >= 6 * 20, 120, "six processes training")
        if mode == "repair_standby":
            job.wait_for(lambda: any("standby ready" in line for _, line in job.log), 120, "a standby ready")
        ready = [e for _, e in job.of("ready")]
        victim = next(e for e in ready if e["rank"] == 3)
        partner = next(e for e in ready if e["rank"] == 2)
        at_fault = max(e["step"] for _, e in job.of("step"))
        struck = time.time()
        os.kill(victim["pid"], sig)
        job.wait_for(lambda: any(t > struck and e["world"] == 4 and e["step"] > at_fault for t, e in job.of("step")),
                     60, "the other replicas committing")
        job.wait_for(lambda: any(t > struck and len(e["members"]) == 6 and victim["id"] not in e["members"]
                                 for t, e in job.of("view")), 120, "the replica coming back")
        others = min(t for t, e in job.of("step") if t > struck and e["world"] == 4 and e["step"] > at_fault)
        back = min(t for t, e in job.of("view") if t > struck and len(e["members"]) == 6
                   and victim["id"] not in e["members"])
        released = min((t for t, line in job.log if t > struck and "sharded replica is lost" in line), default=None)
        kept = [e for _, e in job.of("ready") if e["pid"] == partner["pid"]] == [partner] and \
            any(partner["id"] in e["members"] for t, e in job.of("view") if t >= back)
        # (None: the partner never said its replica was lost; with --replica-restart it may just
        # leave when the launcher stops it)
        return {"others_commit_s": round(others - struck, 3),
                "partner_released_s": round(released - struck, 3) if released is not None else None,
                "replica_back_s": round(back - struck, 3), "partner_kept_its_process": kept}
    finally:
        if sig == signal.SIGSTOP:
            try:
                os.kill(victim["pid"], signal.SIGKILL)
            except (ProcessLookupError, UnboundLocalError):
                pass
        job.stop()


def join_run(k: int) -> dict:
    env = {"FTCOMM_SECRET": os.urandom(16).hex()}
    port = free_port_block(k)
    args = ["--hidden", "2048", "--step-time", "0.05", "--report-every", "1", "--min-workers", "1"]
    first = Job(launcher(k, k, args, ["--port", str(port)]), env)
    second = None
    try:
        first.wait_for(lambda: len(first.of("step")) >= 10 * k, 180, "the first replica training")
        second = Job(launcher(k, k, args, ["--peers", f"127.0.0.1:{port}"]), env)
        second.wait_for(lambda: len(second.of("step")) >= k, 180, "the second replica committing")
        init = min(t for t, _ in second.of("init"))
        committed = min(t for t, _ in second.of("step"))
        views = [e for _, e in second.of("view")]
        shard_bytes = max(e["param_bytes"] for _, e in second.of("ready")) * 3  # parameters and Adam's two moments
        return {"k": k, "transfer_s": round(statistics.median(e["reconcile_s"] for e in views[:k]), 4),
                "join_s": round(committed - init, 3), "state_bytes_per_process": shard_bytes}
    finally:
        for job in (second, first):
            if job is not None:
                job.stop()


def steady_run() -> dict:
    common = ["--hidden", "1024", "--report-every", "1", "--steps", "80"]
    port = free_port_block(1)
    plain = [Job([sys.executable, "-u", EXAMPLE, *common, "--plain-rank", str(r), "--plain-world", "4",
                  "--plain-port", str(port)]) for r in range(4)]
    for job in plain:
        job.process.wait(600)
        job.stop()
    runs = {}
    for name, extra in (("overlap", []), ("after_backward", ["--no-overlap"])):  # one at a time
        runs[name] = Job([sys.executable, "-m", "ftcomm", "run", "--nproc-per-node", "4", "--replica-size", "2",
                          EXAMPLE, *common, "--min-workers", "2", *extra])
        runs[name].process.wait(600)
        runs[name].stop()

    def median_step(events: list[tuple[float, dict]]) -> float:
        times = {e["step"]: t for t, e in events if e["rank"] == 0}
        return statistics.median(times[s + 1] - times[s] for s in range(10, 80) if s in times and s + 1 in times)

    base, mine = median_step(plain[0].of("step")), median_step(runs["overlap"].of("step"))
    after = median_step(runs["after_backward"].of("step"))
    return {"plain_hsdp_step_s": round(base, 4), "ftcomm_step_s": round(mine, 4),
            "throughput_vs_plain": round(base / mine, 3), "ftcomm_no_overlap_step_s": round(after, 4)}


def free_port_block(n: int) -> int:
    """A port with the ``n`` - 1 above it free too (the launcher counts up from ``--port``)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + n > 65535:
            continue
        try:
            sockets = []
            for p in range(port, port + n):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no block of free ports")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default="recovery,join,steady")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "hsdp.json"))
    args = parser.parse_args()
    parts = set(args.only.split(","))
    report: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    if "recovery" in parts:
        for sig, name in ((signal.SIGKILL, "kill9"), (signal.SIGSTOP, "sigstop")):
            by_mode = {}
            for _ in range(args.runs):  # the modes in turn, each run: the same load for each
                for mode in RECOVERY_MODES:
                    by_mode.setdefault(mode, []).append(recovery_run(mode, sig))
            report[f"recovery_{name}"] = {mode: {
                "runs": runs, **{f"median_{key}": statistics.median(values) if values else None
                                 for key in ("others_commit_s", "partner_released_s", "replica_back_s")
                                 for values in [[r[key] for r in runs if r[key] is not None]]},
                "partner_kept_its_process": sum(r["partner_kept_its_process"] for r in runs)}
                for mode, runs in by_mode.items()}
            for mode, result in report[f"recovery_{name}"].items():
                print(json.dumps({"fault": name, "mode": mode, **{k: v for k, v in result.items() if k != "runs"}}),
                      flush=True)
    if "join" in parts:
        by_k = []
        for k in (1, 2, 4):
            runs = [join_run(k) for _ in range(args.runs)]
            by_k.append({"k": k, "runs": runs, "median_transfer_s": statistics.median(r["transfer_s"] for r in runs),
                         "median_join_s": statistics.median(r["join_s"] for r in runs),
                         "state_bytes_per_process": runs[0]["state_bytes_per_process"]})
            print(json.dumps({m: v for m, v in by_k[-1].items() if m != "runs"}), flush=True)
        report["join_by_k"] = by_k
    if "steady" in parts:
        runs = [steady_run() for _ in range(args.runs)]
        report["steady"] = {"runs": runs,
                            "median_plain_hsdp_step_s": statistics.median(r["plain_hsdp_step_s"] for r in runs),
                            "median_ftcomm_step_s": statistics.median(r["ftcomm_step_s"] for r in runs),
                            "median_throughput_vs_plain": statistics.median(r["throughput_vs_plain"] for r in runs),
                            "median_ftcomm_no_overlap_step_s": statistics.median(r["ftcomm_no_overlap_step_s"]
                                                                                 for r in runs)}
        print(json.dumps({k: v for k, v in report["steady"].items() if k != "runs"}), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
