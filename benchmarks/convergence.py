"""Convergence parity: training through churn reaches the same model as training without it.

    python benchmarks/convergence.py [--epochs 4] [--step-time 0.06]

The same seed, data (examples/train_elastic.py's synthetic task, 8192 samples) and
constant global batch (256), trained for ``--epochs`` epochs, three ways in one run:

- ``ddp``: 4 processes under torch DistributedDataParallel (the reference curve);
- ``fixed``: 4 ftcomm workers, no failures;
- ``churn``: 4 ftcomm workers going 4 -> 3 (kill -9) -> 5 (two joins) -> 4 (a graceful
  leave, SIGTERM) during training.

Every committed step's sample indices are logged by every worker, and the logs are
checked for exactly-once consumption per epoch (``check_exactly_once``). Reported:
final loss and accuracy on the whole data set of each run, their relative differences
against ``fixed`` (target: within 1%), the loss curves, and the view changes. JSON in
benchmarks/results/convergence.json.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import signal
import socket
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftcomm.localproc import ChildProcess  # noqa: E402
from ftcomm.training.data import epoch_permutation  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_elastic.py"
SAMPLES, GLOBAL_BATCH, SEED = 8192, 256, 3


def _command(args: list[str], steps: int, step_time: float) -> list[str]:
    return [sys.executable, "-u", str(EXAMPLE), "--steps", str(steps), "--step-time", str(step_time),
            "--global-batch", str(GLOBAL_BATCH), "--seed", str(SEED), "--report-every", "8", "--log-level", "INFO",
            *args]


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _curve(workers: list[ChildProcess]) -> list[list[float]]:
    """(step, loss) of the lowest-ranked reporter per step."""
    points: dict[int, float] = {}
    for w in workers:
        for e in w.snapshot():
            if e["ev"] == "step" and e.get("rank") == 0:
                points.setdefault(e["step"], e["loss"])
    return [[s, points[s]] for s in sorted(points)]


def run_ddp(steps: int, step_time: float, world: int = 4, timeout: float = 300) -> dict:
    port = _free_port()
    workers = [ChildProcess(_command(["--ddp-rank", str(r), "--ddp-world", str(world), "--ddp-port", str(port)],
                                     steps, step_time), ready_timeout=None, env=_env()) for r in range(world)]
    try:
        done = [w.wait_for(lambda e: e["ev"] == "done", timeout, "done") for w in workers]
        return {"loss": done[0]["loss"], "accuracy": done[0]["accuracy"], "steps": done[0]["step"],
                "curve": _curve(workers)}
    finally:
        for w in workers:
            w.close()


def _start(n: int, steps: int, step_time: float, seed_address: str | None, extra: list[str]) -> list[ChildProcess]:
    """``n`` workers launched at once; without ``seed_address`` the first is the group's seed."""
    started = []
    own_seed = seed_address is None
    if own_seed:
        seed_address = f"127.0.0.1:{_free_port()}"
    for i in range(n):
        args = ["--log-indices", "--control", *extra]
        args += ["--bind", seed_address] if own_seed and i == 0 else ["--bind", "127.0.0.1:0", "--peers", seed_address]
        started.append(ChildProcess(_command(args, steps, step_time), ready_timeout=None, env=_env()))
    for w in started:
        w.wait_ready(90)
    return started


def _step_of(workers: list[ChildProcess]) -> int:
    return max((e["step"] for w in workers for e in w.snapshot() if e["ev"] == "step"), default=0)


def _wait_step(workers: list[ChildProcess], step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _step_of(workers) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"training did not reach step {step} within {timeout:g} s")
        time.sleep(0.01)


def _wait_view(workers: list[ChildProcess], size: int, timeout: float = 60) -> list[dict]:
    return [w.wait_for(lambda e: e["ev"] == "view" and len(e["members"]) == size, timeout, f"a view of {size}")
            for w in workers]


def run_ftcomm(steps: int, step_time: float, churn: bool, extra: list[str] = (), timeout: float = 300) -> dict:
    """4 workers; with ``churn``: kill -9 one, two join, one leaves, at fixed fractions of training."""
    everyone: list[ChildProcess] = []
    # Without failures all four must be there from the start; with them, three may carry on.
    extra = [*extra, "--min-workers", "3" if churn else "4", "--settle-interval", "1.0"]
    try:
        workers = _start(4, steps, step_time, None, extra)
        everyone += workers
        timeline, victim = [], None
        if churn:
            _wait_view(workers, 4)
            _wait_step(workers, steps // 8, timeout)
            victim = workers.pop(3)
            victim.signal(signal.SIGKILL)
            timeline.append({"at_step": _step_of(workers), "event": "kill -9", "world": 3})
            _wait_view(workers, 3)
            _wait_step(workers, steps // 3, timeout)
            timeline.append({"at_step": _step_of(workers), "event": "2 joins", "world": 5})
            # Training slows down while the joiners start (a loaded machine may take many
            # seconds to import torch): the group must still be training when they arrive.
            for w in workers:
                w.send(cmd="step_time", seconds=max(step_time, 0.5))
            joiners = _start(2, steps, step_time, workers[0].address, extra)
            everyone += joiners
            workers += joiners
            _wait_view(workers, 5)
            for w in workers:
                w.send(cmd="step_time", seconds=step_time)
            _wait_step(workers, (2 * steps) // 3, timeout)
            leaver = workers.pop(1)
            timeline.append({"at_step": _step_of(workers), "event": "leave (SIGTERM)", "world": 4})
            leaver.signal(signal.SIGTERM)
            _wait_view(workers, 4)
        done = [w.wait_for(lambda e: e["ev"] == "done", timeout, "done") for w in workers]
        # processes the killed worker had started (data-loader workers) and that outlived it
        leftovers = len(victim.descendants()) if victim is not None else 0
        views = [e for e in workers[0].snapshot() if e["ev"] == "view"]
        logs = [[e for e in w.snapshot() if e["ev"] == "batch"] for w in everyone]
        return {"loss": done[0]["loss"], "accuracy": done[0]["accuracy"], "steps": done[0]["step"],
                "digests_equal": len({d["digest"] for d in done}) == 1, "final_world": len(workers),
                "curve": _curve(everyone), "timeline": timeline, "initial_world": len(views[0]["members"]),
                "views": [{"view_id": v["view_id"], "size": len(v["members"]), "reason": v["reason"],
                           "step": v["step"], "policy": v["policy"]} for v in views],
                "exactly_once": check_exactly_once(logs, steps), "leftover_processes": leftovers}
    finally:
        for w in everyone:
            w.close()


def check_exactly_once(logs: list[list[dict]], steps: int, samples: int = SAMPLES, seed: int = SEED) -> dict:
    """Prove from the workers' logs that each epoch's samples were consumed exactly once
    (a dataset of ``samples`` with the sampler's ``seed``).

    Each ``batch`` record is one worker's share of a committed step. Per step, all
    records agree on the step's place (epoch, start, size) in the epoch's permutation;
    the shares of the workers of one world are disjoint and inside that range, and
    cover it when every worker of that world logged. Across steps 1..``steps`` the
    ranges tile each epoch in order without gap or overlap. An orphan commit (a worker's
    last record, made just before it left or died, of a step the others then redid in a
    new view) is not part of the surviving state and is counted, not checked.
    """
    # A worker that committed a step and then left or died before the others completed it
    # leaves an orphan commit: the others discard that step and do it again in the next view.
    # Such a record (the last of its worker) yields to the others' record of the step.
    records = [(r, r is log[-1]) for log in logs if log for r in log]
    lineage = {r["step"]: (r["epoch"], r["start"], r["size"]) for r, last in records if not last}
    places: dict[int, set] = collections.defaultdict(set)
    shares: dict[tuple[int, int], list[list[int]]] = collections.defaultdict(list)
    orphans = 0
    for r, last in records:
        place = (r["epoch"], r["start"], r["size"])
        if last and r["step"] in lineage and lineage[r["step"]] != place:
            orphans += 1
            continue
        places[r["step"]].add(place)
        shares[(r["step"], r["world"])].append(r["idx"])
    problems = []
    missing = [s for s in range(1, steps + 1) if s not in places]
    if missing:
        problems.append(f"steps without a record: {missing[:10]}")
    for step, place in places.items():
        if len(place) != 1:
            problems.append(f"step {step}: workers disagree on its samples {sorted(place)}")
    complete = 0
    for (step, world), lists in shares.items():
        epoch, start, size = next(iter(places[step]))
        allowed = set(epoch_permutation(samples, seed, epoch)[start:start + size].tolist())
        seen = [i for idx in lists for i in idx]
        if len(seen) != len(set(seen)) or not set(seen) <= allowed:
            problems.append(f"step {step} (world {world}): shares overlap or leave the step's range")
        if len(lists) == world:
            complete += 1
            if set(seen) != allowed:
                problems.append(f"step {step} (world {world}): shares do not cover the step")
    expected = (0, 0)
    epochs_done = collections.Counter()
    for step in range(1, steps + 1):
        if step not in places or len(places[step]) != 1:
            break
        epoch, start, size = next(iter(places[step]))
        if (epoch, start) != expected:
            problems.append(f"step {step} starts at {(epoch, start)}, expected {expected}")
            break
        epochs_done[epoch] += size
        expected = (epoch + 1, 0) if start + size >= samples else (epoch, start + size)
    return {"ok": not problems, "problems": problems[:10], "steps_checked": steps, "orphan_commits": orphans,
            "complete_steps": complete, "samples_per_epoch": dict(epochs_done)}


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--step-time", type=float, default=0.06)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "convergence.json"))
    args = parser.parse_args()
    steps = args.epochs * SAMPLES // GLOBAL_BATCH
    started = time.time()
    ddp = run_ddp(steps, 0.0)
    fixed = run_ftcomm(steps, args.step_time, churn=False)
    churn = run_ftcomm(steps, args.step_time, churn=True)
    report = {
        "benchmark": "convergence", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "samples": SAMPLES, "global_batch": GLOBAL_BATCH, "epochs": args.epochs, "steps": steps,
        "ddp": ddp, "fixed": fixed, "churn": churn,
        "churn_vs_fixed": {"loss": relative(churn["loss"], fixed["loss"]),
                           "accuracy": relative(churn["accuracy"], fixed["accuracy"])},
        "fixed_vs_ddp": {"loss": relative(fixed["loss"], ddp["loss"]),
                         "accuracy": relative(fixed["accuracy"], ddp["accuracy"])},
        "wall_s": round(time.time() - started, 1),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for name in ("ddp", "fixed", "churn"):
        print(f"{name:6s} loss {report[name]['loss']:.5f} accuracy {report[name]['accuracy']:.5f}")
    print("churn timeline:", churn["timeline"])
    print("exactly once:", fixed["exactly_once"]["ok"], churn["exactly_once"])
    print("churn vs fixed:", report["churn_vs_fixed"], "fixed vs ddp:", report["fixed_vs_ddp"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
