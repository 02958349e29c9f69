"""A local cluster of training workers (examples/train_elastic.py) for the group tests.

Every wait polls with a deadline (``ChildProcess.wait_for``); ``close()`` reaps all.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import subprocess
import sys
import time

from ftcomm.localproc import ChildProcess

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_elastic.py"
BASE_ARGS = ["--control", "--steps", "1000000", "--step-time", "0.01", "--report-every", "1000000",
             "--log-level", "DEBUG"]


class TrainCluster:
    """Workers on 127.0.0.1, or with ``lab`` (a :class:`tests.netns.Lab`), each on a host of
    its own: ``start(..., hosts=[...])`` names the lab hosts they run on."""

    PORT = 7946  # on a lab host of its own, every worker can use the same port

    def __init__(self, lab=None) -> None:
        self.lab = lab
        self.workers: list[ChildProcess] = []
        self.seed_address: str | None = None
        self.secret = secrets.token_hex(16)  # workers on separate hosts need one (protected mode)

    def start(self, n: int, args: list[str] = (), wait: bool = True, env: dict | None = None,
              hosts: list[int] | None = None) -> list[ChildProcess]:
        """Start ``n`` workers (``env``: variables added to theirs); the first worker ever
        started is the seed of the others."""
        started = []
        for i in range(n):
            bind = f"{self.lab.address(hosts[i])}:{self.PORT}" if hosts is not None else "127.0.0.1:0"
            command = [sys.executable, "-u", str(EXAMPLE), "--bind", bind, *BASE_ARGS, *args]
            if self.seed_address is not None:
                command += ["--peers", self.seed_address]
            if hosts is not None:
                command = self.lab.command(hosts[i], command)
            extra = {"FTCOMM_SECRET": self.secret} if hosts is not None else {}
            worker = ChildProcess(command, ready_timeout=None,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **extra, **(env or {})})
            self.workers.append(worker)
            started.append(worker)
            if self.seed_address is None:
                worker.wait_ready(60)
                self.seed_address = worker.address
        if wait:
            for worker in started:
                worker.wait_ready(60)
        return started

    def wait_view(self, workers: list[ChildProcess], size: int, timeout: float = 30.0,
                  after: int = 0, reason: str | None = None) -> list[dict]:
        """Each worker's first view event with ``size`` members and id > ``after``."""
        return [w.wait_for(lambda e: e["ev"] == "view" and len(e["members"]) == size and e["view_id"] > after
                           and (reason is None or e["reason"] == reason), timeout, f"a view of {size}")
                for w in workers]

    def status(self, worker: ChildProcess, timeout: float = 10.0) -> int:
        start = len(worker.snapshot())
        worker.send(cmd="status")
        return worker.wait_for(lambda e: e["ev"] == "status", timeout, "status", start)["step"]

    def finish(self, workers: list[ChildProcess], margin: int = 30, lead_s: float = 3.0,
               timeout: float = 60.0) -> list[dict]:
        """Stop every worker at the same step and return their ``done`` records.

        The target lies ``lead_s`` seconds of training ahead (at the rate measured now, and at
        least ``margin`` steps), so that every worker has read the command before any
        reaches it: a worker that read it late would try one more step alone after the
        others stopped. Each worker acknowledges with its step, and the acknowledgements
        prove that none had reached the target yet.
        """
        first, started = max(self.status(w) for w in workers), time.monotonic()
        time.sleep(0.5)
        now = max(self.status(w) for w in workers)
        rate = (now - first) / (time.monotonic() - started)
        target = now + max(margin, int(rate * lead_s))
        marks = [len(w.snapshot()) for w in workers]
        for w in workers:
            w.send(cmd="stop_at", step=target)
        acks = [w.wait_for(lambda e: e["ev"] == "ok" and e["cmd"] == "stop_at", timeout, "stop_at ack", m)
                for w, m in zip(workers, marks)]
        late = [a["step"] for a in acks if a["step"] >= target]
        assert not late, f"stop_at {target} reached workers at steps {late}: the machine is too slow for lead_s"
        return [w.wait_for(lambda e: e["ev"] == "done", timeout, "done") for w in workers]

    def close(self) -> None:
        for w in self.workers:
            w.close(timeout=10)  # resumes a stopped worker first


def stalls(worker: ChildProcess) -> list[float]:
    """How late (seconds) the worker's gossip timer fired each time its whole process was
    stopped or starved past what the detector tolerates (the runtime logs each one over
    0.25 s): a loaded machine, which a peer cannot tell from a stopped process."""
    marker = "gossip timer fired "
    return [float(line.split(marker)[1].split()[0]) for line in worker.stderr_tail if marker in line]


def views_by_id(workers: list[ChildProcess]) -> dict[int, list[dict]]:
    """Every worker's view events grouped by view id."""
    grouped: dict[int, list[dict]] = {}
    for w in workers:
        for e in w.snapshot():
            if e["ev"] == "view":
                grouped.setdefault(e["view_id"], []).append(e)
    return grouped


def assert_invariants(workers: list[ChildProcess], done: list[dict], abort_bound: float = 2.0) -> None:
    """DESIGN §2: equal digests after every re-formation and at the end; aborts noticed.

    The abort bound only tells a waiting collective that the signal woke (well under a
    second) from one that missed it and ran into a timeout (many seconds): a loaded
    machine deschedules the waiting thread for a while. The 100 ms target is measured
    by benchmarks/group_recovery.py, and the wake-up itself by tests/test_backends.py."""
    assert len({d["digest"] for d in done}) == 1, f"final digests differ: {done}"
    assert len({d["step"] for d in done}) == 1
    for view_id, events in views_by_id(workers).items():
        if len(events) < 2:
            continue
        assert len({tuple(e["members"]) for e in events}) == 1, f"view {view_id} has two member lists"
        assert all(e["state_digest"] is not None for e in events), f"view {view_id}: not reconciled {events}"
        assert len({(e["step"], e["state_digest"]) for e in events}) == 1, f"view {view_id}: state differs {events}"
        for e in events:
            if e.get("abort_latency_s") is not None:
                assert e["abort_latency_s"] <= abort_bound, f"abort took {e['abort_latency_s']} s"
    assert_clean_exits(workers)


def assert_clean_exits(workers: list[ChildProcess], timeout: float = 60.0) -> None:
    """Every worker that finished exits by itself with status 0: a launcher or Kubernetes
    counts any other status (SIGABRT from a backend thread at exit, say) as a failure."""
    for w in workers:
        try:
            code = w.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker {w.process.pid} did not exit within {timeout:g} s of finishing") from None
        assert code == 0, f"worker {w.process.pid} exited with {code} after finishing: {''.join(w.stderr_tail)[-2000:]}"
