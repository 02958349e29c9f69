"""Steady state against DDP in fresh processes, alternating rounds; per-step overhead on a small model.

    python benchmarks/ddp_parity.py [--rounds 5] [--world 2,4] [--batch 32,64] [--steps 30]
                                    [--models mlp,blocks]

*Parity.* For each model, world size and batch, rounds alternate DDP, ftcomm, DDP,
ftcomm, ... (``--rounds`` of each); every round starts W fresh processes on 127.0.0.1
that train the same model (one torch thread each, SGD, ``zero_grad()`` every step):
under ``torch.nn.parallel.DistributedDataParallel`` on Gloo (25 MB buckets, overlap),
or under ``ftcomm.init`` + ``ft.wrap(model)`` + ``wait_gradients_ready`` (defaults: 25 MB
buckets, overlap). Models:

- ``mlp``: a 10-layer 1024-wide MLP (10.5M parameters in 20 tensors), batch ``--batch``,
  ``--steps`` steps;
- ``blocks``: launch-bound, 64 blocks of ``Linear(64, 64)`` + ``LayerNorm(64)`` (256
  tensors, 0.27M parameters), batch 8, ten times ``--steps`` steps; here a third variant
  runs in each round, ``ftcomm_hooks``: ``wait_gradients_ready(model)`` on the unwrapped
  model (a Python hook per parameter).

Steps/s are timed after 5 of warm-up, on rank 0. Reported: the median of ftcomm/DDP
over the rounds, with the lowest and highest.

*Overhead.* W = 2 processes, in the same processes: the time inside
``wait_gradients_ready`` (overlap off, so it does all the work) against a raw flat-buffer
step (gradients concatenated, one ProcessGroupGloo allreduce, divided by W, copied back);
medians over 200 steps, 3 rounds interleaved; on a 100K-parameter MLP (12 tensors,
unwrapped) and on the ``blocks`` model (256 tensors, through ``ft.wrap``). The
difference is what ftcomm adds per step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.grad_path import make_model as make_blocks  # noqa: E402

WARMUP = 5


def make_model(width: int, layers: int):
    import torch
    torch.manual_seed(0)
    mods = []
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, width))


def parity_worker(variant: str, kind: str, rank: int, world: int, port: int, batch: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    width = 1024 if kind == "mlp" else 64
    model = make_model(width, 10) if kind == "mlp" else make_blocks(64)  # the grad_path benchmark's
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))
    y = torch.randn(batch, width, generator=torch.Generator().manual_seed(100 + rank))
    if variant == "ddp":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        trained = torch.nn.parallel.DistributedDataParallel(model)

        def average(m) -> bool:
            return True
    else:
        import ftcomm
        ft = ftcomm.init(peers=[] if rank == 0 else [f"127.0.0.1:{port}"], bind=f"127.0.0.1:{port + rank}",
                         min_workers=world, handle_signals=False, init_timeout=120)
        ft.register_state(model=model)
        trained, average = (model if variant == "ftcomm_hooks" else ft.wrap(model)), ft.wait_gradients_ready
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    for i in range(WARMUP + steps):
        if i == WARMUP:
            started = time.perf_counter()
        F.mse_loss(trained(x), y).backward()
        if average(trained):
            optimizer.step()
        optimizer.zero_grad()
    rate = steps / (time.perf_counter() - started)
    if variant == "ddp":
        dist.barrier()
        dist.destroy_process_group()
    else:
        ft.execute(ft.barrier)
        ft.shutdown()
    return {"steps_s": rate}


def overhead_worker(kind: str, rank: int, world: int, port: int, steps: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ftcomm

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    raw_group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, world, datetime.timedelta(seconds=120))
    ft = ftcomm.init(peers=[] if rank == 0 else [f"127.0.0.1:{port + 1}"], bind=f"127.0.0.1:{port + 1 + rank}",
                     min_workers=world, handle_signals=False, init_timeout=120, overlap=False)
    model = make_model(128, 6) if kind == "mlp" else make_blocks(64)  # 99K parameters; or 256 tensors
    ft.register_state(model=model)
    params = list(model.parameters())
    net = model if kind == "mlp" else ft.wrap(model)
    x = torch.randn(32 if kind == "mlp" else 8, 128 if kind == "mlp" else 64,
                    generator=torch.Generator().manual_seed(rank))

    def raw(_model) -> bool:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        raw_group.allreduce([flat]).wait()
        flat.div_(world)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return True
    times: dict[str, list[float]] = {"raw": [], "ftcomm": []}
    for _ in range(rounds):
        for name, average in (("raw", raw), ("ftcomm", ft.wait_gradients_ready)):
            for i in range(WARMUP + steps):
                F.mse_loss(net(x), x).backward()
                began = time.perf_counter()
                average(net)
                if i >= WARMUP:
                    times[name].append(time.perf_counter() - began)
                model.zero_grad()
    ft.execute(ft.barrier)
    ft.shutdown()
    return {"model": kind, "tensors": len(params), "parameters": sum(p.numel() for p in params),
            **{f"{name}_s": statistics.median(values) for name, values in times.items()}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], world: int) -> list[dict]:
    port = 20000 + free_port() % 20000
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", *args, str(r), str(world), str(port)],
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind = sys.argv[2]
        if kind == "parity":
            variant, model, batch, steps, rank, world, port = sys.argv[3], sys.argv[4], *map(int, sys.argv[5:10])
            print(json.dumps(parity_worker(variant, model, rank, world, port, batch, steps)), flush=True)
        else:
            model, (steps, rounds, rank, world, port) = sys.argv[3], map(int, sys.argv[4:9])
            print(json.dumps(overhead_worker(model, rank, world, port, steps, rounds)), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world", default="2,4")
    parser.add_argument("--batch", default="32,64")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--models", default="mlp,blocks")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ddp_parity.json"))
    args = parser.parse_args()
    configs = []
    for model in args.models.split(","):
        variants = ("ddp", "ftcomm") if model == "mlp" else ("ddp", "ftcomm", "ftcomm_hooks")
        batches = [int(b) for b in args.batch.split(",")] if model == "mlp" else [8]
        steps = args.steps if model == "mlp" else 10 * args.steps
        for world in (int(w) for w in args.world.split(",")):
            for batch in batches:
                rounds = []
                for _ in range(args.rounds):
                    rates = {variant: launch(["parity", variant, model, str(batch), str(steps)], world)[0]["steps_s"]
                             for variant in variants}
                    rounds.append({**rates, **{f"ratio_{v}": rates[v] / rates["ddp"] for v in variants[1:]}})
                config = {"model": model, "world": world, "batch": batch, "steps": steps, "rounds": rounds}
                for v in variants[1:]:
                    ratios = [r[f"ratio_{v}"] for r in rounds]
                    config[f"{v}_ratio_median"] = round(statistics.median(ratios), 3)
                    config[f"{v}_ratio_min"], config[f"{v}_ratio_max"] = round(min(ratios), 3), round(max(ratios), 3)
                for v in variants:
                    config[f"{v}_steps_s_median"] = round(statistics.median(r[v] for r in rounds), 3)
                configs.append(config)
                print(json.dumps({k: v for k, v in config.items() if k != "rounds"}), flush=True)
    overhead = []
    for model in ("mlp", "blocks"):
        measured = launch(["overhead", model, str(200), str(3)], 2)[0]
        measured["overhead_s"] = measured["ftcomm_s"] - measured["raw_s"]
        print(json.dumps(measured), flush=True)
        overhead.append(measured)
    report = {"benchmark": "ddp_parity", "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "steps": args.steps, "configs": configs, "overhead": overhead}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
