"""Host time of the gradient path per step and per parameter tensor, with no wire.

    python benchmarks/grad_path.py [--rounds 5] [--steps 300] [--blocks 64]

One process, one torch thread, a launch-bound model: ``--blocks`` blocks of
``Linear(64, 64)`` + ``LayerNorm(64)`` (4 tensors each: 256 at the default), batch 8,
``zero_grad`` to None every step. Each variant runs forward, backward and what it does
with the gradients; the reduction itself is replaced by one that completes at once, so
what is timed is the host work around it (hooks, copies into buckets, launches, handing
the gradients back), not a network:

- ``backward``: forward and backward only (the baseline);
- ``ftcomm``: ftcomm's gradient buckets as ``wait_gradients_ready`` uses them (overlap on:
  a post-accumulate-grad hook per parameter copies its gradient into a flat bucket and
  launches a bucket once complete; then ``finish`` and ``hand_back``);
- ``wrapped``: ``ft.wrap(model)``'s path: DDP's C++ reducer over a placeholder process
  group, each bucket handed once to ftcomm (``ReducerBuckets``: the launch, the counters,
  ``finish`` and ``hand_back``);
- ``ddp_hook``: ``torch.nn.parallel.DistributedDataParallel``'s C++ reducer (gradients as
  bucket views) with a Python comm hook per bucket that returns at once, over a fake
  process group of 2 (what a DDP comm hook over ftcomm's communicator would cost on the
  host, before any wire).

Rounds alternate the variants; reported: the median step time of each (steps after 50 of
warm-up, median over rounds), and the extra host time over ``backward``, per step and per
parameter tensor.

    python benchmarks/grad_path.py --sharded [--rounds 5] [--steps 300] [--blocks 64]

*Sharded.* The same blocks, each block (its ``Linear`` and ``LayerNorm``) a parameter
group of FSDP2 (``fully_shard`` over a mesh of this one process; FSDP2 still
reduce-scatters and hands each group's output to its all-reduce hook), the root another:

- ``fsdp``: forward and backward only (the baseline);
- ``fsdp_hooks``: ftcomm's gradient buckets over the gradient shards (a post-accumulate-grad
  hook per parameter, as before the per-group path);
- ``fsdp_groups``: the per-group path ``wait_gradients_ready`` takes for a sharded model
  (``ShardGroupBuckets``: one call per group from FSDP2's all-reduce hook, the reduce
  output summed in place).

    python benchmarks/grad_path.py --profile [--steps 500]

*Profile.* Two processes train the same model over a real group (127.0.0.1, Gloo), through
``ft.wrap`` and through hooks on the unwrapped model in turn; rank 0 runs ``--steps``
steps (after 50) under cProfile and reports ftcomm's Python per step: how many calls, and
the functions by time (cumulative and own) and by calls.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.group_recovery import save  # noqa: E402

WARMUP = 50


class _Completed:
    """A reduction that is already done (the handle :class:`GradientBuckets` waits on)."""

    completed = True

    def wait(self, abort=None) -> None:
        return None


def make_model(blocks: int):
    import torch
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)]
    return torch.nn.Sequential(*layers)


def make_sharded_model(blocks: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import torch.distributed as dist
    if not dist.is_initialized():
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
                                  for _ in range(blocks)])
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def variant_step(name: str, blocks: int):
    """The model, and one training step's callable, for variant ``name``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    model = make_sharded_model(blocks) if name.startswith("fsdp") else make_model(blocks)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    net, after = model, (lambda: None)
    if name == "fsdp_groups":
        from ftcomm.training.shard_groups import ShardGroupBuckets, shard_groups
        buckets = ShardGroupBuckets(shard_groups(model, params), params, launch=lambda flat: _Completed(),
                                    may_overlap=lambda: True, world_size=lambda: 2)

        def after() -> None:
            buckets.finish(valid=True)
            buckets.hand_back(2.0)
    if name in ("ftcomm", "fsdp_hooks"):
        from ftcomm.training.buckets import GradientBuckets
        buckets = GradientBuckets(params, 25.0, True, launch=lambda flat: _Completed(), may_overlap=lambda: True,
                                  world_size=lambda: 2)

        def after() -> None:
            buckets.finish(valid=True)
            buckets.hand_back(2.0)
    elif name == "wrapped":
        from ftcomm.training.reducer import DistributedDataParallel, ReducerBuckets
        net = DistributedDataParallel(model, 25.0)
        buckets = ReducerBuckets(net, launch=lambda flat: _Completed(), may_overlap=lambda: True,
                                 world_size=lambda: 2)

        def after() -> None:
            buckets.finish(valid=True)
            buckets.hand_back(2.0)
    elif name == "ddp_hook":
        if not dist.is_initialized():
            from torch.testing._internal.distributed.fake_pg import FakeStore
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        net = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, init_sync=False,
                                                        gradient_as_bucket_view=True)
        calls = [0]

        def hook(state, bucket):
            calls[0] += 1
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        net.register_comm_hook(None, hook)

        def after() -> None:
            if not calls[0]:
                raise RuntimeError("DDP's comm hook never ran")

    def step() -> None:
        F.mse_loss(net(x), x).backward()
        after()
        for p in params:
            p.grad = None
    return step


def run_round(name: str, blocks: int, steps: int) -> float:
    step = variant_step(name, blocks)
    times = []
    for i in range(WARMUP + steps):
        began = time.perf_counter()
        step()
        if i >= WARMUP:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def profile_worker(mode: str, rank: int, port: int, steps: int) -> dict:
    import cProfile
    import pstats

    import torch
    import torch.nn.functional as F

    import ftcomm
    torch.set_num_threads(1)
    model = make_model(64)
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    ft = ftcomm.init(peers=[] if rank == 0 else [f"127.0.0.1:{port}"], bind=f"127.0.0.1:{port + rank}",
                     min_workers=2, handle_signals=False, init_timeout=120)
    ft.register_state(model=model)
    net = ft.wrap(model) if mode == "wrapped" else model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def run(n: int) -> None:
        for _ in range(n):
            F.mse_loss(net(x), y).backward()
            if ft.wait_gradients_ready(net):
                optimizer.step()
            optimizer.zero_grad()
    run(WARMUP)
    profiler = cProfile.Profile()
    if rank == 0:
        profiler.enable()
    run(steps)
    profiler.disable()
    ft.execute(ft.barrier)
    ft.shutdown()
    if rank:
        return {}
    rows = [{"function": f"{path.split('/ftcomm/')[1]}:{name}", "calls": round(calls / steps, 1),
             "cum_us": round(cum / steps * 1e6, 1), "own_us": round(own / steps * 1e6, 1)}
            for (path, _, name), (_, calls, own, cum, _) in pstats.Stats(profiler).stats.items()
            if "/ftcomm/" in path]
    return {"mode": mode, "calls_per_step": round(sum(r["calls"] for r in rows), 1),
            "by_time": sorted(rows, key=lambda r: -r["cum_us"])[:12],
            "by_calls": sorted(rows, key=lambda r: -r["calls"])[:6]}


def profile(steps: int, out: str) -> int:
    import socket
    import subprocess
    report = {"benchmark": "grad_path_profile", "steps": steps, "modes": []}
    for mode in ("wrapped", "hooks"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = 20000 + s.getsockname()[1] % 20000
        procs = [subprocess.Popen([sys.executable, __file__, "--profile-worker", mode, str(rank), str(port),
                                   str(steps)], stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        result = json.loads(outs[0].strip().splitlines()[-1])
        report["modes"].append(result)
        print(json.dumps({"mode": mode, "calls_per_step": result["calls_per_step"],
                          "most_called": result["by_calls"][0]}), flush=True)
        for row in result["by_time"]:
            print(f"  {row['cum_us']:9.1f} us cum {row['own_us']:8.1f} us own {row['calls']:7.1f} calls  "
                  f"{row['function']}", flush=True)
    save(report, out)
    return 0


def main() -> int:
    import torch
    if len(sys.argv) > 1 and sys.argv[1] == "--profile-worker":
        mode, rank, port, steps = sys.argv[2], *map(int, sys.argv[3:6])
        print(json.dumps(profile_worker(mode, rank, port, steps)), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="profile ftcomm's Python per step instead")
    parser.add_argument("--sharded", action="store_true", help="the sharded (FSDP2) gradient paths instead")
    args = parser.parse_args()
    results = os.path.join(os.path.dirname(__file__), "results")
    if args.profile:
        return profile(args.steps if args.steps != 300 else 500, args.out or os.path.join(results,
                                                                                           "grad_path_profile.json"))
    args.out = args.out or os.path.join(results, "grad_path_sharded.json" if args.sharded else "grad_path.json")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # DDP's note on broadcast_buffers
    tensors = 4 * args.blocks
    variants = ("fsdp", "fsdp_hooks", "fsdp_groups") if args.sharded else ("backward", "ftcomm", "wrapped",
                                                                           "ddp_hook")
    rounds: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for name in variants:
            rounds[name].append(run_round(name, args.blocks, args.steps))
    base = statistics.median(rounds[variants[0]])
    report = {"benchmark": "grad_path_sharded" if args.sharded else "grad_path", "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                    "torch": torch.__version__},
              "tensors": tensors, "batch": 8, "steps": args.steps, "rounds": rounds, "variants": {}}
    for name in variants:
        median = statistics.median(rounds[name])
        extra = median - base
        report["variants"][name] = {"step_ms": round(median * 1e3, 3), "extra_us_per_step": round(extra * 1e6, 1),
                                    "extra_us_per_tensor": round(extra * 1e6 / tensors, 2)}
        print(json.dumps({"variant": name, **report["variants"][name]}), flush=True)
    save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
