"""Demonstrations that run on one machine: ``ftcomm demo train`` and ``ftcomm demo gossip``."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

from ..gossip.config import GossipConfig
from ..gossip.local import LocalCluster
from ..localproc import ChildProcess

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py"  # the repository's


def gossip_demo(members: int = 8, out=print) -> int:
    """Start ``members`` local gossip members, SIGKILL one, and show who noticed when."""
    config = GossipConfig()
    bound = config.detection_bound(members)
    out(f"starting {members} gossip members on 127.0.0.1 ...")
    with LocalCluster(members) as cluster:
        waited = cluster.wait_converged()
        out(f"all {members} members see each other ({waited * 1000:.0f} ms after the last one joined)")
        victim = cluster.agents[members // 2]
        out(f"\nkill -9 {victim.id} (pid {victim.pid})")
        killed_at = time.time()
        victim.signal(signal.SIGKILL)
        survivors = [a for a in cluster.agents if a is not victim]
        out(f"waiting for every survivor to mark it dead (bound {bound:.1f} s) ...\n")
        rows = []
        for agent in survivors:
            dead = agent.wait_for(lambda e: e.get("member") == victim.id and e.get("kind") == "dead",
                                  bound + 5, "death notice")
            suspect = agent.member_events(victim.id, "suspect")
            rows.append((agent.id, suspect[0]["t"] - killed_at if suspect else None, dead["t"] - killed_at,
                         dead["source"]))
        out(f"{'member':32s} {'suspected after':>16s} {'marked dead after':>18s}  declared by")
        for member_id, suspected, dead, source in sorted(rows, key=lambda r: r[2]):
            suspected_text = f"{suspected:.3f} s" if suspected is not None else "-"
            out(f"{member_id:32s} {suspected_text:>16s} {dead:>16.3f} s  {source}")
        first, last = min(r[2] for r in rows), max(r[2] for r in rows)
        out(f"\nfirst survivor marked it dead after {first:.3f} s, the last after {last:.3f} s "
            f"(min suspicion timeout {config.min_suspicion_timeout(members):.2f} s, "
            f"probe interval {config.probe_interval:.2f} s)")
    return 0


def _wait_saying(out, started: float, attempt, what: str, deadline: float = 120.0):
    """``attempt()`` (which waits a few seconds and raises TimeoutError when its event did
    not come) until it succeeds, saying ``what`` is going on after each miss, so that a
    slow machine shows progress instead of silence; TimeoutError after ``deadline`` s."""
    until = time.time() + deadline
    while True:
        try:
            return attempt()
        except TimeoutError:
            if time.time() > until:
                raise
            out(f"t={time.time() - started:5.1f}s  ... {what}")


def _trainer(seed_address: str | None, steps: int) -> ChildProcess:
    command = [sys.executable, "-u", str(EXAMPLE), "--bind", "127.0.0.1:0", "--steps", str(steps),
               "--step-time", "0.015", "--report-every", "100000"]
    if seed_address:
        command += ["--peers", seed_address]
    return ChildProcess(command, ready_timeout=None, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _exit_code(worker: ChildProcess, timeout: float = 60.0) -> int | str:
    """The status a finished worker exits with (it leaves the group and exits by itself)."""
    try:
        return worker.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return "still running"


def train_demo(steps: int = 450, out=print) -> int:
    """4 local workers train an MLP; one is killed, one is stopped, one joins; print the timeline."""
    started = time.time()
    out("starting 4 training workers on 127.0.0.1 (an MLP on a synthetic task) ...")
    out("t=  0.0s  worker0 starts: importing torch and ftcomm, then founding the group")
    workers = [_trainer(None, steps)]
    try:
        _wait_saying(out, started, lambda: workers[0].wait_ready(5), "worker0 is still starting")
        out(f"t={time.time() - started:5.1f}s  worker0 founded the group; starting worker1..3, which join it")
        workers += [_trainer(workers[0].address, steps) for _ in range(3)]
        for i, w in enumerate(workers[1:], 1):
            _wait_saying(out, started, lambda w=w: w.wait_ready(5), f"worker{i} is still starting")
        out(f"t={time.time() - started:5.1f}s  all 4 workers are training")
        for w in workers:
            w.wait_for(lambda e: e["ev"] == "view" and len(e["members"]) == 4, 60, "a 4-worker view")
        names = {w.id: f"worker{i}" for i, w in enumerate(workers)}
        time.sleep(1.5)
        out(f"t={time.time() - started:5.1f}s  kill -9 worker1")
        workers[1].signal(signal.SIGKILL)
        time.sleep(2.5)
        out(f"t={time.time() - started:5.1f}s  SIGSTOP worker2 (a hang)")
        workers[2].signal(signal.SIGSTOP)
        time.sleep(3.0)
        out(f"t={time.time() - started:5.1f}s  start worker4")
        newcomer = _trainer(workers[0].address, steps)
        workers.append(newcomer)
        newcomer.wait_ready(60)
        names[newcomer.id] = "worker4"
        time.sleep(1.0)
        out(f"t={time.time() - started:5.1f}s  SIGCONT worker2: it finds it was left out and rejoins")
        workers[2].signal(signal.SIGCONT)
        finishers = [w for i, w in enumerate(workers) if i != 1]
        # generous: on a loaded machine the 450 steps take minutes, not seconds
        out(f"t={time.time() - started:5.1f}s  training to step {steps} ...")
        done = []
        for w in finishers:
            done.append(_wait_saying(out, started, lambda w=w: w.wait_for(lambda e: e["ev"] == "done", 10,
                                                                          "the end of training"),
                                     "still training", deadline=600))
        out("\nview changes seen by worker0 (phase times in seconds):")
        out(f"  {'view':>4} {'reason':9} {'size':>4} {'detect':>7} {'agree':>6} {'form':>6} {'reconcile':>9}  change")
        for e in workers[0].snapshot():
            if e["ev"] != "view":
                continue
            change = " ".join([f"+{names.get(m, m)}" for m in e["added"]] + [f"-{names.get(m, m)}" for m in e["removed"]])
            out(f"  {e['view_id']:>4} {e['reason']:9} {len(e['members']):>4} {e['detect_s']:>7.3f} "
                f"{e['agree_s']:>6.3f} {e['form_s']:>6.3f} {e['reconcile_s']:>9.3f}  {change}")
        rejoin = [e for e in workers[2].snapshot() if e["ev"] == "view" and e["reason"] == "rejoin"]
        if rejoin:
            out(f"  worker2 rejoined in view {rejoin[0]['view_id']} and received the group's state")
        out("\nfinal state of every worker:")
        for w, d in zip(finishers, done):
            out(f"  {names[w.id]:8} step {d['step']:4d}  world {d['world']}  loss {d['loss']:.4f}  "
                f"accuracy {d['accuracy']:.4f}  digest {d['digest']:x}")
        same = len({d["digest"] for d in done}) == 1
        codes = [_exit_code(w) for w in finishers]
        clean = all(code == 0 for code in codes)
        out(f"\nall state digests equal: {'yes' if same else 'NO'}; every worker exited with status 0: "
            f"{'yes' if clean else 'NO ' + str(codes)}; finished in {time.time() - started:.1f} s")
        return 0 if same and clean else 1
    finally:
        for w in workers:
            w.close(timeout=10)  # resumes a stopped worker first
