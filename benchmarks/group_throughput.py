"""Group benchmark 1: steady-state cost of ftcomm against raw Gloo and DistributedDataParallel.

    python benchmarks/group_throughput.py [--world 2,4] [--steps 30]

W processes on 127.0.0.1 each hold the same ~10M-parameter MLP. In the same processes,
one after the other and twice each (the better of the two rounds is kept):

- ``raw``: a ``ProcessGroupGloo`` allreduce of one flat float32 buffer of all parameters;
- ``ftcomm``: a training step (forward, backward, ``wait_gradients_ready``, SGD step);
  the time spent inside ``wait_gradients_ready`` is reported beside the raw allreduce;
- ``ddp``: the same training step under ``torch.nn.parallel.DistributedDataParallel``
  on Gloo.

Ratios: ftcomm steps/s over DDP steps/s, and raw allreduce time over the time of
``wait_gradients_ready`` (both >= 0.97 is the target).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def make_model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                               torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                               torch.nn.Linear(2048, 512))


def run_worker(rank: int, world: int, store_port: int, gossip_port: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import ftcomm

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(rank))
    y = torch.randn(32, 512, generator=torch.Generator().manual_seed(100 + rank))
    result: dict = {"rank": rank}

    def step_loop(model, optimizer, after_backward) -> tuple[float, float]:
        inside = 0.0
        for i in range(steps + 3):
            if i == 3:
                started, inside = time.perf_counter(), 0.0
            loss = F.mse_loss(model(x), y)
            loss.backward()
            t = time.perf_counter()
            ok = after_backward(model)
            inside += time.perf_counter() - t
            if ok:
                optimizer.step()
            optimizer.zero_grad()
        elapsed = time.perf_counter() - started
        return steps / elapsed, inside / steps

    ft = ftcomm.init(peers=[] if rank == 0 else [f"127.0.0.1:{gossip_port}"], bind=f"127.0.0.1:{gossip_port + rank}",
                     min_workers=world, handle_signals=False)
    raw_group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, world, datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("ddp", store), rank=rank, world_size=world)
    for round_ in range(2):
        model = make_model()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        result["parameters"] = flat.numel()
        raw_group.allreduce([flat]).wait()
        started = time.perf_counter()
        for _ in range(steps):
            raw_group.allreduce([flat]).wait()
        raw = (time.perf_counter() - started) / steps
        ddp_model = torch.nn.parallel.DistributedDataParallel(make_model())
        ddp_rate, _ = step_loop(ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=1e-3), lambda m: True)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        ft.state.objects.clear()
        ft.register_state(model=model, optimizer=opt)
        ft_rate, ft_inside = step_loop(model, opt, ft.wait_gradients_ready)
        best = result.get("best", {})
        if not best or ft_rate / ddp_rate > best["ftcomm_steps_s"] / best["ddp_steps_s"]:
            result["best"] = {"raw_allreduce_s": raw, "ddp_steps_s": ddp_rate, "ftcomm_steps_s": ft_rate,
                              "ftcomm_wait_gradients_s": ft_inside, "round": round_}
    ft.shutdown()
    dist.destroy_process_group()
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, steps: int) -> list[dict]:
    store_port, gossip_port = free_port(), 20000 + (free_port() % 20000)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(store_port),
                               str(gossip_port), str(steps)], stdout=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, store_port, gossip_port, steps = map(int, sys.argv[2:7])
        print(json.dumps(run_worker(rank, world, store_port, gossip_port, steps)), flush=True)
        return 0
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", default="2,4")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "group_throughput.json"))
    args = parser.parse_args()
    rows = []
    for world in [int(w) for w in args.world.split(",")]:
        results = launch(world, args.steps)
        best = [r["best"] for r in results]
        mean = {k: sum(b[k] for b in best) / len(best) for k in best[0] if k != "round"}
        rows.append({
            "world_size": world, "parameters": results[0]["parameters"], **{k: round(v, 5) for k, v in mean.items()},
            "ftcomm_over_ddp": round(mean["ftcomm_steps_s"] / mean["ddp_steps_s"], 3),
            "raw_over_wait_gradients": round(mean["raw_allreduce_s"] / mean["ftcomm_wait_gradients_s"], 3),
        })
        print(json.dumps(rows[-1]), flush=True)
    report = {"benchmark": "group_throughput", "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "steps": args.steps, "target_ratio": 0.97, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
