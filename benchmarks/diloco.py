"""DiLoCo and LocalSGD against per-step gradient averaging: held-out loss and bytes per sample, same run.

    python benchmarks/diloco.py [--workers 4] [--steps 1000]
        [--configs per-step,diloco-50,diloco-100,localsgd-50,streaming-100-4,streaming-100-4-bf16,
                   streaming-100-4-int8]

Each configuration trains examples/train_diloco.py (a character-level transformer on the
standard library's sources, the same seed, data and global batch of 64 windows per inner
step, the first 25,600 windows: an epoch is a whole number of outer steps) with
``--workers`` processes for ``--steps`` inner steps, so every configuration sees the same
samples: ``per-step`` averages gradients every step through ftcomm's
gradient path (DDP's algorithm and its reducer), ``diloco-H`` takes an outer step
(Nesterov SGD, learning rate 0.7, momentum 0.9) every H inner steps, ``localsgd-H``
averages parameters every H steps, ``streaming-H-P`` is Streaming DiLoCo with P fragments
(one outer step every H/P inner steps, each fragment's every H), ``streaming-H-P-bf16`` its
pseudo-gradients summed in bfloat16, ``streaming-H-P-int8`` in 8-bit integers, and a suffix
``-dD`` (``streaming-100-4-int8-d10``) overlaps each outer step's reduction with the D inner
steps before it (``delay``).

The workers of a configuration run in a network namespace of their own (root needed), so
the namespace's loopback counters hold their traffic and nothing else's: *bytes per
sample* is the bytes the namespace's loopback carried during the run (every worker's
sends, gossip included), divided by the workers and by the samples trained. Reported per
configuration: the held-out loss after the last step and at every evaluation (rank 0, at
every outer step; every 50 steps for ``per-step``), its difference from ``per-step``, the
bytes per sample per worker and their ratio to ``per-step``, the bytes per committed step
(one outer step: of one fragment with Streaming DiLoCo, the burst the link carries at once)
per worker, the wall time and the time to
reach the loss every configuration reaches, and whether every worker ended with one
digest. JSON in benchmarks/results/diloco.json; with matplotlib installed, the curves in
docs/diloco.png (loss against samples; across regions, against seconds).

``--region-mbit M`` runs each configuration across two emulated regions instead: every
worker on a host (network namespace) of its own, half of them behind one bridge and half
behind another, the bridges joined by a link whose TCP carries ``M`` Mbit/s each way
(``tc`` htb; gossip's UDP at full speed). The bytes counted are then the region link's
(both ways, per worker and sample), and the wall times show what the link costs.
``--partition-after N`` (with ``--region-mbit``) cuts that link for ``--partition-s``
seconds once rank 0 committed N steps: a 2|2 partition. Reported: the seconds to rank 0's
side's next commit, from the heal to a commit of all the workers again, the commits of
the side without rank 0 while cut off (none under the quorum rule), and one digest at the
end. ``--kill-after N`` kills the worker of the highest rank instead (both in JSON of
their own, no plot).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import platform
import secrets
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ftcomm.localproc import ChildProcess  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_diloco.py"
PER_STEP_EVAL = 50  # steps between evaluations of the per-step configuration
TRAIN_WINDOWS = 25600  # an epoch of 4 outer steps of 100 inner batches of 64: no outer step is cut short


def _ns(name: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", name, *command], capture_output=True, text=True, check=check,
                          timeout=30)


def loopback_sent(proc_net_dev: str) -> int:
    """The bytes the loopback sent, from the text of a namespace's ``/proc/net/dev``."""
    for line in proc_net_dev.splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    raise RuntimeError("no loopback interface")


def loopback_bytes(ns: str) -> int:
    """Bytes the namespace's loopback sent."""
    return loopback_sent(_ns(ns, "cat", "/proc/net/dev").stdout)


def wait_listening(ns: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while f":{port} " not in _ns(ns, "ss", "-Hltn").stdout:
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on port {port} in namespace {ns}")
        time.sleep(0.1)


def configuration(name: str) -> list[str]:
    """The example's arguments for ``per-step``, ``diloco-H``, ``localsgd-H`` or
    ``streaming-H-P[-bf16|-fp16|-int8][-dD]`` (Streaming DiLoCo: P fragments, pseudo-gradients in
    that dtype, each outer step's reduction overlapping the D inner steps before it)."""
    if name == "per-step":
        return ["--sync-every", "0", "--eval-every", str(PER_STEP_EVAL)]
    base, _, delay = name.rpartition("-d")
    if name.startswith("streaming-") and delay.isdigit():
        return [*configuration(base), "--delay", delay]
    kind, _, rest = name.partition("-")
    every, _, rest = rest.partition("-")
    fragments, _, quantize = rest.partition("-")
    if not every.isdigit() or (kind in ("diloco", "localsgd") and rest) or \
            (kind == "streaming" and (not fragments.isdigit() or quantize not in ("", "bf16", "fp16", "int8"))) or \
            kind not in ("diloco", "localsgd", "streaming"):
        raise ValueError(f"unknown configuration {name!r}: per-step, diloco-H, localsgd-H or "
                         f"streaming-H-P[-bf16|-fp16|-int8][-dD]")
    if kind == "streaming":
        eval_every = str(int(fragments))  # one evaluation per sync_every inner steps, as DiLoCo's
        return ["--sync-every", every, "--fragments", fragments, "--eval-every", eval_every,
                *(["--quantize", quantize] if quantize else [])]
    return ["--sync-every", every, *(["--local-sgd"] if kind == "localsgd" else [])]


def run(name: str, workers: int, steps: int, deadline: float, region_mbit: int = 0, kill_after: int = 0,
        cut: tuple[int, float] = (0, 0.0)) -> dict:
    """One configuration: on the loopback of a namespace of its own, or (``region_mbit``) on
    hosts of their own in two regions whose link carries ``region_mbit`` Mbit/s of TCP; the
    bytes counted are the loopback's, or the region link's. ``kill_after``: kill -9 the
    worker of the highest rank once rank 0 committed that many steps, and measure how long
    the survivors take to commit again (the fault's whole cost: detection, the new view,
    and a discarded outer step's inner steps done again). ``cut`` (with ``region_mbit``):
    ``(after, seconds)``, the link between the regions down for that long once rank 0
    committed ``after`` steps (see :func:`partition`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("FTCOMM_SECRET", None)
    started: list[ChildProcess] = []
    with contextlib.ExitStack() as stack:
        if region_mbit:
            from tests import netns
            lab = stack.enter_context(netns.Lab(workers, split=workers // 2))
            lab.limit_bridge_link_tcp(region_mbit)
            env["FTCOMM_SECRET"] = secrets.token_hex(16)  # hosts apart: the protected mode needs one
            place = [(lab.command(i, []), f"{lab.address(i)}:7946") for i in range(workers)]
            counter, namespace = lab.bridge_link_bytes, lab.namespace(0)
        else:
            namespace = f"ftdl{os.getpid()}"
            subprocess.run(["ip", "netns", "add", namespace], check=True, timeout=30)
            stack.callback(subprocess.run, ["ip", "netns", "delete", namespace], timeout=30)
            _ns(namespace, "ip", "link", "set", "lo", "up")
            place = [(["ip", "netns", "exec", namespace], f"127.0.0.1:{7400 + i}") for i in range(workers)]
            counter = lambda: loopback_bytes(namespace)  # noqa: E731
        stack.callback(lambda: [w.close(timeout=10) for w in started])
        before = counter()
        began = time.monotonic()
        fault: dict = {}
        for i, (prefix, bind) in enumerate(place):
            command = [*prefix, sys.executable, "-u", str(EXAMPLE), "--bind", bind,
                       "--min-workers", str(workers // 2 if cut[0] else workers - 1 if kill_after else workers),
                       "--steps", str(steps), "--train-windows", str(TRAIN_WINDOWS), *configuration(name),
                       *(["--report-commits"] if kill_after or cut[0] else [])]
            if i:
                command += ["--peers", place[0][1]]
            started.append(ChildProcess(command, ready_timeout=None, env=env))
            if not i or region_mbit:  # the others join through the first: once it listens; across regions
                # each in turn, so that the view ranks them in their regions' order (Gloo's ring crosses
                # the region link twice, not four times: ranks do not know the topology)
                wait_listening(lab.namespace(i) if region_mbit else namespace, int(bind.rpartition(":")[2]),
                               deadline)
        if kill_after:
            fault = kill_one(started, kill_after, deadline, name)
            started.remove(fault.pop("worker"))
        if cut[0]:
            fault = partition(lab, started, *cut, deadline, name)
        done = [w.wait_for(lambda e: e["ev"] == "done", deadline, f"{name}: done") for w in started]
        seconds = time.monotonic() - began
        for w in started:
            w.process.wait(timeout=60)
        sent = counter() - before
    curve = [(e["samples"], e["loss"], e["seconds"]) for w in started for e in w.snapshot() if e["ev"] == "eval"]
    samples = max(s for s, _, _ in curve)
    return {"name": name, "final_loss": done[0]["loss"], "curve": sorted(curve), "samples": samples,
            "bytes_per_sample": sent / workers / samples, "seconds": round(seconds, 2),
            "bytes_per_commit": round(sent / workers / done[0]["step"]),
            "one_digest": len({d["digest"] for d in done}) == 1, "link_bytes": sent,
            "discarded": max(d["discarded"] for d in done), "views": max((d["views"] for d in done), key=len),
            "hosts_by_rank": [d["id"].rpartition(":")[0] for d in sorted(done, key=lambda d: d["rank"])], **fault}


def all_committed(started: list[ChildProcess], after: int, deadline: float, name: str) -> dict:
    """Each worker's first commit of step ``after`` or later with every worker in the view."""
    every = len(started)
    return {w: w.wait_for(lambda e: e["ev"] == "commit" and e["world"] == every and e["step"] >= after,
                          deadline, f"{name}: {after} steps with every worker") for w in started}


def kill_one(started: list[ChildProcess], after: int, deadline: float, name: str) -> dict:
    """kill -9 of the worker of the highest rank once rank 0 committed ``after`` steps with
    every worker in the view; the seconds from the kill to the survivors' next commit, and
    the worker killed (its ``worker``)."""
    every = len(started)
    latest = all_committed(started, after, deadline, name)
    first = min(started, key=lambda w: latest[w]["rank"])
    victim = max(started, key=lambda w: latest[w]["rank"])
    killed_at = time.time()
    victim.signal(signal.SIGKILL)
    victim.process.wait(timeout=30)
    again = first.wait_for(lambda e: e["ev"] == "commit" and e["t"] > killed_at and e["world"] < every,
                           deadline, f"{name}: a commit after the kill")
    return {"worker": victim, "killed_at_step": latest[first]["step"], "recovery_s": round(again["t"] - killed_at, 3)}


def partition(lab, started: list[ChildProcess], after: int, seconds: float, deadline: float, name: str) -> dict:
    """The link between the two regions down for ``seconds`` once rank 0 committed ``after``
    steps with every worker, then up: a 2|2 cut, whose side with rank 0 goes on (ties go to
    rank 0) and whose other side commits nothing until it is back. The seconds from the cut
    to rank 0's next commit, from the heal to a commit with every worker again, and the
    commits the other side made while cut off (none, if the quorum holds)."""
    every = len(started)
    latest = all_committed(started, after, deadline, name)
    first = min(started, key=lambda w: latest[w]["rank"])
    region = {w: started.index(w) < every // 2 for w in started}  # the first half: region 0
    cut_at = time.time()
    lab.set_bridge_link(False)
    try:
        going = first.wait_for(lambda e: e["ev"] == "commit" and e["t"] > cut_at and e["world"] < every,
                               deadline, f"{name}: rank 0's side committing after the cut")
        time.sleep(max(0.0, cut_at + seconds - time.time()))
    finally:
        lab.set_bridge_link(True)
    healed_at = time.time()
    back = first.wait_for(lambda e: e["ev"] == "commit" and e["t"] > healed_at and e["world"] == every,
                          deadline, f"{name}: every worker committing after the heal")
    other_side = [w for w in started if region[w] != region[first]]
    cut_off_commits = sum(1 for w in other_side for e in w.snapshot()
                          if e["ev"] == "commit" and cut_at < e["t"] < healed_at)
    return {"cut_at_step": latest[first]["step"], "cut_s": round(healed_at - cut_at, 2),
            "majority_next_commit_s": round(going["t"] - cut_at, 3), "whole_again_s": round(back["t"] - healed_at, 3),
            "cut_off_side_commits": cut_off_commits}


def plot(results: list[dict], path: pathlib.Path, title: str, by_time: bool) -> bool:
    """Held-out loss against samples trained, or (``by_time``) against seconds of training."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axis = plt.subplots(figsize=(7, 4.2))
    for r in results:
        axis.plot([t if by_time else s for s, _, t in r["curve"]], [l for _, l, _ in r["curve"]], label=r["name"],
                  marker=".")
    axis.set_xlabel("seconds of training" if by_time else "samples trained (windows of 65 bytes)")
    axis.set_ylabel("held-out loss (nats per byte)")
    axis.set_title(title, fontsize=9)
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000, help="inner steps (a multiple of every H)")
    parser.add_argument("--configs", default="per-step,diloco-50,diloco-100,localsgd-50,streaming-100-4,"
                                              "streaming-100-4-bf16,streaming-100-4-int8")
    parser.add_argument("--deadline", type=float, default=900, help="seconds one configuration may take")
    parser.add_argument("--region-mbit", type=int, default=0,
                        help="run the workers on hosts of their own in two regions joined by a link of this many "
                             "Mbit/s of TCP (0: every worker on one loopback); bytes are then the region link's")
    parser.add_argument("--kill-after", type=int, default=0,
                        help="kill -9 the worker of the highest rank after this many committed steps and measure "
                             "the survivors' recovery (0: no fault); results then in diloco_kill.json, no plot")
    parser.add_argument("--partition-after", type=int, default=0,
                        help="with --region-mbit: cut the link between the regions (a 2|2 partition) once rank 0 "
                             "committed this many steps, for --partition-s seconds; results in diloco_partition.json")
    parser.add_argument("--partition-s", type=float, default=10.0)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/diloco.json (diloco_kill.json)")
    parser.add_argument("--plot", default=None, help="default: docs/diloco.png (none with --kill-after)")
    args = parser.parse_args(argv)
    if args.partition_after and (not args.region_mbit or args.kill_after):
        parser.error("--partition-after cuts the link between two regions: give --region-mbit, not --kill-after")
    fault_run = "_kill" if args.kill_after else "_partition" if args.partition_after else ""
    args.out = args.out or str(ROOT / "benchmarks" / "results" / f"diloco{fault_run}.json")
    if args.plot is None and not fault_run:
        args.plot = str(ROOT / "docs" / "diloco.png")
    if os.geteuid() != 0:
        print("needs root: each configuration runs in a network namespace of its own", file=sys.stderr)
        return 2
    results = []
    for name in args.configs.split(","):
        result = run(name, args.workers, args.steps, args.deadline, args.region_mbit, args.kill_after,
                     (args.partition_after, args.partition_s))
        results.append(result)
        fault = (f"kill -9 at step {result['killed_at_step']}: next commit {result['recovery_s']:.2f} s after, "
                 if args.kill_after else "")
        if args.partition_after:
            fault = (f"2|2 cut at step {result['cut_at_step']} for {result['cut_s']} s: rank 0's side committed "
                     f"{result['majority_next_commit_s']:.2f} s after the cut, all {args.workers} "
                     f"{result['whole_again_s']:.2f} s after the heal, the other side {result['cut_off_side_commits']} "
                     f"commits while cut off, ")
        print(f"{name:>12}: held-out loss {result['final_loss']:.4f}, {result['bytes_per_sample']:,.0f} bytes per "
              f"sample per worker, {result['seconds']:.1f} s, {fault}one digest: {result['one_digest']}, steps "
              f"discarded: {result['discarded']}, view changes: {result['views']}", flush=True)
    target = max(r["final_loss"] for r in results)  # a loss every configuration reaches
    for r in results:
        r["target_loss"] = target
        r["seconds_to_target"] = next(t for _, loss, t in r["curve"] if loss <= target)
    reference = next((r for r in results if r["name"] == "per-step"), None)
    if reference is not None:
        for r in results:
            r["loss_vs_per_step"] = round(r["final_loss"] / reference["final_loss"] - 1, 4)
            r["bytes_vs_per_step"] = round(reference["bytes_per_sample"] / r["bytes_per_sample"], 1)
    print(f"\n| configuration | held-out loss | vs per-step | bytes/sample/worker | fewer bytes | "
          f"bytes/sync/worker | wall s | s to loss {target:.4f} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        versus = (f"{r['loss_vs_per_step']:+.1%} | {r['bytes_per_sample']:,.0f} | {r['bytes_vs_per_step']}x"
                  if reference is not None else f"- | {r['bytes_per_sample']:,.0f} | -")
        print(f"| {r['name']} | {r['final_loss']:.4f} | {versus} | {r['bytes_per_commit']:,} | "
              f"{r['seconds']:.1f} | {r['seconds_to_target']:.1f} |")
    machine = f"{os.cpu_count()} cores, {platform.machine()}"
    where = f"two regions joined by {args.region_mbit} Mbit/s" if args.region_mbit else "one loopback"
    title = f"{args.workers} workers ({where}), {args.steps} inner steps of 64 windows, {machine}"
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine, "workers": args.workers, "steps": args.steps, "region_mbit": args.region_mbit,
              "kill_after": args.kill_after, "partition": [args.partition_after, args.partition_s] if fault_run ==
              "_partition" else None, "results": results}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    if args.plot is None:
        pass
    elif plot(results, pathlib.Path(args.plot), title, by_time=bool(args.region_mbit)):
        print(f"curves: {args.plot}")
    else:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    return 0 if all(r["one_digest"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
