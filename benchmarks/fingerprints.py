"""Silent-corruption checks: the cost of fingerprints (``fingerprint_every``) against none in one run; a caught flip.

    python benchmarks/fingerprints.py [--rounds 3] [--steps 200] [--every 0,1,10,100]
                                      [--only plain,sharded,timeline]

*Plain*: 2 processes on 127.0.0.1 train a 10-layer 1024-wide MLP (10.5M parameters) with
Adam (so a fingerprint reads 31.5M float32 values: parameters and both moments), batch
32, one torch thread each, through ``ft.wrap``. In the same processes, segments of
``--steps`` steps run in turn with each ``fingerprint_every`` of ``--every`` (0: none),
``--rounds`` times (each round starting with the next setting), every member switching
at the same step; the steps/s of each segment is timed on rank 0. Reported per setting: the median steps/s and its change against
``0`` (none), and the time of one fingerprint (``TrainingState.fingerprint``) measured
apart in the same processes.

*Sharded*: 2 replicas of 2 processes (``examples/train_hsdp.py`` under ``ftcomm run
--nproc-per-node 4 --replica-size 2``, FSDP2 on Gloo, hidden 1024, Adam), one run per
setting in turn (``FTCOMM_FINGERPRINT_EVERY``), ``--rounds`` times: the median step time
of rank 0 over steps 10 to the end.

*Timeline*: 3 replicas of 2 processes (hidden 256, 0.03 s of extra work per step),
``fingerprint_every`` 10; at committed step 40 the process of rank 3 (replica 1, shard 1)
flips one bit of its shard of the first parameter. Reported: the step whose check named
it and the seconds from the flip to that check, from the check to the next committed
step, the tensors the repaired process found wrong, and whether every shard ends with
one state.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.ddp_parity import make_model  # noqa: E402
from benchmarks.hsdp import EXAMPLE, Job  # noqa: E402

WARMUP = 5


def plain_worker(rank: int, world: int, port: int, steps: int, rounds: int, every: list[int]) -> dict:
    import torch
    import torch.nn.functional as F

    import ftcomm

    torch.set_num_threads(1)
    model = make_model(1024, 10)
    ft = ftcomm.init(peers=[] if rank == 0 else [f"127.0.0.1:{port}"], bind=f"127.0.0.1:{port + rank}",
                     min_workers=world, handle_signals=False, init_timeout=120, fingerprint_every=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    ft.register_state(model=model, optimizer=optimizer)
    net = ft.wrap(model)
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(rank))
    checks = ft._loop.fingerprints  # the group's comparison; its interval is switched per segment

    def segment(n: int) -> float:
        began = time.perf_counter()
        for _ in range(n):
            ft.step_boundary()
            F.mse_loss(net(x), x).backward()
            if ft.wait_gradients_ready(net):
                optimizer.step()
            optimizer.zero_grad()
        return n / (time.perf_counter() - began)

    segment(WARMUP)
    rates: dict[int, list[float]] = {e: [] for e in every}
    for r in range(rounds):
        for e in every[r % len(every):] + every[:r % len(every)]:  # each setting first in turn: no order bias
            checks.every = e
            rates[e].append(segment(steps))
    checks.every = 0
    fingerprint_s = []
    for _ in range(5):
        began = time.perf_counter()
        ft.state.fingerprint()
        fingerprint_s.append(time.perf_counter() - began)
    found = len(ft.corruptions)
    ft.execute(ft.barrier)
    ft.shutdown()
    return {"rates": {str(e): r for e, r in rates.items()}, "fingerprint_s": statistics.median(fingerprint_s),
            "values": sum(p.numel() for p in model.parameters()) * 3, "corruptions": found}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain(args: argparse.Namespace, every: list[int]) -> dict:
    port = 20000 + free_port() % 20000
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "2", str(port), str(args.steps),
                               str(args.rounds), ",".join(map(str, every))], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    result = json.loads(outs[0].strip().splitlines()[-1])
    base = statistics.median(result["rates"]["0"])
    rows = []
    for e in every:
        rate = statistics.median(result["rates"][str(e)])
        rows.append({"fingerprint_every": e, "steps_s_median": round(rate, 3),
                     "steps_s": [round(r, 3) for r in result["rates"][str(e)]],
                     "change_vs_none": round(rate / base - 1, 4)})
    return {"model": "mlp 10x1024 + Adam", "parameters": result["values"] // 3, "world": 2,
            "fingerprint_ms": round(result["fingerprint_s"] * 1e3, 2), "values_fingerprinted": result["values"],
            "corruptions_found": result["corruptions"], "settings": rows}


def sharded(args: argparse.Namespace, every: list[int]) -> dict:
    times: dict[int, list[float]] = {e: [] for e in every}
    for _ in range(args.rounds):
        for e in every:  # one job at a time
            job = Job([sys.executable, "-m", "ftcomm", "run", "--nproc-per-node", "4", "--replica-size", "2",
                       EXAMPLE, "--hidden", "1024", "--report-every", "1", "--steps", str(args.steps),
                       "--min-workers", "2"], env={"FTCOMM_FINGERPRINT_EVERY": str(e)})
            job.process.wait(1800)
            job.stop()
            stamps = {ev["step"]: t for t, ev in job.of("step") if ev["rank"] == 0}
            times[e].append(statistics.median(stamps[s + 1] - stamps[s] for s in range(10, args.steps)
                                              if s in stamps and s + 1 in stamps))
    base = statistics.median(times[0])
    return {"model": "examples/train_hsdp.py, hidden 1024, Adam", "replicas": 2, "replica_size": 2,
            "settings": [{"fingerprint_every": e, "step_s_median": round(statistics.median(times[e]), 5),
                          "step_s": [round(t, 5) for t in times[e]],
                          "change_vs_none": round(statistics.median(times[e]) / base - 1, 4)} for e in every]}


def timeline(args: argparse.Namespace, every: list[int]) -> dict:
    job = Job([sys.executable, "-m", "ftcomm", "run", "--nproc-per-node", "6", "--replica-size", "2",
               "--fingerprint-every", "10", EXAMPLE, "--steps", "80", "--min-workers", "2", "--step-time", "0.03",
               "--report-every", "1", "--flip-bit-at", "40", "--flip-rank", "3"])
    job.process.wait(600)
    job.stop()
    (flipped_at, flipped), = job.of("flipped")
    named_at, named = min(job.of("corruption"), key=lambda te: te[0])
    after = min(t for t, e in job.of("step") if t > named_at and e["step"] > named["step"])
    done = [e for _, e in job.of("done")]
    victim = next(e for e in done if e["id"] == flipped["id"])
    return {"replicas": 3, "replica_size": 2, "fingerprint_every": 10, "flipped_at_step": flipped["step"],
            "named_at_step": named["step"], "named_members": named["named"], "shard": named["shard"],
            "flip_to_named_s": round(named_at - flipped_at, 3), "named_to_next_commit_s": round(after - named_at, 3),
            "tensors_found_wrong": victim["corruptions"][0]["tensors"] if victim["corruptions"] else None,
            "one_state_per_shard": all(len({e["digest"] for e in done if e["shard"] == s}) == 1 for s in (0, 1)),
            "finished": len(done)}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, port, steps, rounds = map(int, sys.argv[2:7])
        every = [int(e) for e in sys.argv[7].split(",")]
        print(json.dumps(plain_worker(rank, world, port, steps, rounds, every)), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", default="0,1,10,100")
    parser.add_argument("--only", default="plain,sharded,timeline")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "fingerprints.json"))
    args = parser.parse_args()
    every = sorted({int(e) for e in args.every.split(",")} | {0})
    report: dict = {}
    if os.path.exists(args.out):  # the parts not run this time are kept
        with open(args.out) as f:
            report = json.load(f)
    report.update({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()})
    for part, run in (("plain", plain), ("sharded", sharded), ("timeline", timeline)):
        if part in args.only:
            report[part] = {"date": time.strftime("%Y-%m-%d"), "rounds": args.rounds, "steps": args.steps,
                            **run(args, every)}
            print(json.dumps(report[part]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
