"""NCCL backend on a GPU: formation, abort, re-formation, bandwidth, correctness, training, recovery.

    python benchmarks/nccl_gpu.py [--quick] [--out benchmarks/results/nccl_gpu.json]

Needs one CUDA device. Every figure is set against a baseline measured in the same run:
torch.distributed's own NCCL process group (same library, same device) for formation,
bandwidth, reductions and the training step (DDP), and the Gloo backend for the group's
recovery from a crash.

- *formation*: ``NcclCommunicator.form`` (non-blocking ``ncclCommInitRankConfig``,
  polled) until ready, world size 1; baseline: a new ``ProcessGroupNCCL`` until its
  first allreduce completed (it creates its communicator then).
- *re-formation cycle*: from abandoning a communicator (``ncclCommAbort`` in the
  background) to the first allreduce completed on a new one.
- *abort of a wait held back by a busy stream*: a collective queued behind a long kernel;
  the abort signal fires; the time until the waiting thread is released (DESIGN §2.3).
- *several ranks on one GPU*: each rank claims a host of its own (``NCCL_HOSTID``), so
  NCCL connects them through its socket transport over loopback (tests/nccl_ranks.py):
  every dtype x op against ``torch.distributed``; ``ncclCommAbort`` with a collective in
  flight that waits for a hung peer; re-formation of two ranks; ``ncclCommShrink`` after
  a peer exited against a fresh initialisation of the survivors; bandwidth of two ranks
  (loopback sockets, not NVLink).
- *bandwidth*: allreduce of 1 MB ... 1 GB, launch to completion seen by the caller;
  ``algbw`` = bytes / time (``busbw`` = algbw x 2(n-1)/n is 0 for one rank and equals
  algbw for two).
- *training step*: a ~110M-parameter transformer encoder, bf16 autocast, AdamW, world 1,
  ``ft.wrap(model)`` + ``wait_gradients_ready`` (overlap on), and an unwrapped model
  (overlap on, and off), against DDP on NCCL; fresh processes per variant, rounds
  alternating.
- *group recovery*: 4 training workers (examples/train_elastic.py) on this GPU, kill -9
  of one, until every survivor committed a step in the new view; NCCL against Gloo.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ftcomm.backends import nccl  # noqa: E402
from ftcomm.backends.base import AbortSignal  # noqa: E402
from ftcomm.errors import CollectiveAborted  # noqa: E402
from tests import nccl_ranks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import group_recovery  # noqa: E402
from group_recovery import save  # noqa: E402

MB = 1 << 20


def median(values) -> float:
    return round(statistics.median(values), 6)


def form(view_id: int, store=None, rank: int = 0, size: int = 1) -> nccl.NcclCommunicator:
    return nccl.NcclCommunicator.form(store or dist.HashStore(), rank, size, view_id, AbortSignal(), 60.0,
                                      host="127.0.0.1")


# ---------------------------------------------------------------------- one rank
def formation(reps: int) -> dict:
    ours, cycle = [], []
    comm = form(1)
    for i in range(reps):
        t = torch.ones(1024, device="cuda")
        started = time.perf_counter()
        comm.abandon()
        comm = form(2 + i)
        comm.allreduce([t], "sum").wait(AbortSignal(), 60.0)
        cycle.append(time.perf_counter() - started)
    comm.abandon()
    for i in range(reps):
        started = time.perf_counter()
        comm = form(100 + i)
        ours.append(time.perf_counter() - started)
        comm.abandon()
    theirs = []
    for i in range(reps):
        t = torch.ones(1024, device="cuda")
        started = time.perf_counter()
        group = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, dist.ProcessGroupNCCL.Options())
        group.allreduce([t]).wait()
        torch.cuda.synchronize()
        theirs.append(time.perf_counter() - started)
        group.shutdown()
    return {"ftcomm_form_s": median(ours), "ftcomm_form_runs_s": [round(x, 4) for x in ours],
            "baseline_torch_pg_first_allreduce_s": median(theirs),
            "reform_cycle_s": median(cycle), "reform_cycle_runs_s": [round(x, 4) for x in cycle]}


def busy_stream_abort(reps: int) -> dict:
    """A wait on a collective queued behind a ~0.5 s kernel; the signal fires after 50 ms."""
    latencies, abort_returned = [], []
    for i in range(reps):
        comm = form(200 + i)
        t = torch.ones(MB, device="cuda")
        torch.cuda._sleep(int(1e9))  # about 0.5 s at H100 clocks
        handle = comm.allreduce([t], "sum")
        abort = AbortSignal()
        threading.Timer(0.05, abort.fire, args=("a member is suspect",)).start()
        try:
            handle.wait(abort, 30.0)
            raise AssertionError("the wait was not abandoned")
        except CollectiveAborted:
            latencies.append(time.monotonic() - abort.fired_at)
        started = time.monotonic()
        comm.abandon()
        returned = nccl_ranks._abort_finished(comm.view_id, 30.0)
        abort_returned.append(returned if returned is not None else float("nan"))
        torch.cuda.synchronize()
        del started
    return {"wait_released_after_signal_s": median(latencies), "max_s": round(max(latencies), 6),
            "target_s": 0.1, "ncclCommAbort_returned_after_s": median(abort_returned),
            "note": "ncclCommAbort runs in a background thread; the training thread does not wait for it"}


def timed_pair(size_mb: int, reps: int, ours, theirs, between=lambda: None, bandwidth: str = "algbw") -> dict:
    """Median seconds of ``ours()`` and ``theirs()`` (each launch to completion), alternating,
    and the bandwidth they give (``algbw``: bytes / time; ``busbw`` for two ranks is the same)."""
    mine, torch_times = [], []
    for _ in range(reps):
        for run, times in ((ours, mine), (theirs, torch_times)):
            between()
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
    return {"mb": size_mb, "ftcomm_s": median(mine), "torch_s": median(torch_times),
            f"ftcomm_{bandwidth}_gbps": round(size_mb * MB / statistics.median(mine) / 1e9, 3),
            f"torch_{bandwidth}_gbps": round(size_mb * MB / statistics.median(torch_times) / 1e9, 3)}


def torch_allreduce(group, t) -> None:
    group.allreduce([t]).wait()
    torch.cuda.synchronize()


def bandwidth_one_rank(sizes_mb: list[int]) -> list[dict]:
    comm = form(300)
    group = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, dist.ProcessGroupNCCL.Options())
    rows = []
    for size in sizes_mb:
        t = torch.ones(size * MB // 4, device="cuda")
        ours = lambda: comm.allreduce([t], "sum").wait(AbortSignal(), 60.0)  # noqa: E731
        theirs = lambda: torch_allreduce(group, t)  # noqa: E731
        timed_pair(size, 3, ours, theirs)  # warm-up
        rows.append(timed_pair(size, 20 if size <= 256 else 8, ours, theirs))
    comm.abandon()
    group.shutdown()
    return rows


def library_features() -> dict:
    lib = nccl.load()
    return {"version": ".".join(map(str, lib.version)), "path": lib.path, **lib.features()}


# ---------------------------------------------------------------------- several ranks (spawned)
def bandwidth_ranks(comm, store, sizes_mb: list[int]) -> list[dict]:
    dist.init_process_group("nccl", store=dist.PrefixStore("torch", store), rank=comm.rank,
                            world_size=comm.size, device_id=torch.device("cuda", 0))
    group = dist.distributed_c10d._get_default_group()
    rows = []
    for size in sizes_mb:
        t = torch.ones(size * MB // 4, device="cuda")
        ours = lambda: comm.allreduce([t], "sum").wait(AbortSignal(), 120.0)  # noqa: E731
        theirs = lambda: torch_allreduce(group, t)  # noqa: E731
        timed_pair(size, 1, ours, theirs)  # warm-up
        rows.append(timed_pair(size, 10 if size <= 64 else 3, ours, theirs, between=dist.barrier, bandwidth="busbw"))
    dist.destroy_process_group()
    comm.abandon()
    return rows


def reform_two(comm, store, reps: int) -> list[float]:
    """Both ranks abandon their communicator and form a new one (new unique id)."""
    times = []
    t = torch.ones(1024, device="cuda")
    comm.allreduce([t], "sum").wait(AbortSignal(), 60.0)
    for i in range(reps):
        store.set(f"go{i}/{comm.rank}", "1")
        store.wait([f"go{i}/0", f"go{i}/1"], datetime.timedelta(seconds=60))
        started = time.perf_counter()
        comm.abandon()
        comm = nccl.NcclCommunicator.form(dist.PrefixStore(f"view/{10 + i}", store), comm.rank, 2, 10 + i,
                                          AbortSignal(), 60.0, host="127.0.0.1")
        comm.allreduce([t], "sum").wait(AbortSignal(), 60.0)
        times.append(time.perf_counter() - started)
    comm.abandon()
    return times


def shrink_after_exit(comm, store) -> dict:
    """Three ranks; rank 2 exits. Ranks 0 and 1 shrink the communicator (NCCL_SHRINK_ABORT),
    then, as the baseline, form a fresh two-rank communicator through the store."""
    lib = comm._lib
    t = torch.ones(1024, device="cuda")
    comm.allreduce([t], "sum").wait(AbortSignal(), 60.0)
    nccl_ranks.exit_rank(comm, store, 2)
    outcome: dict = {}
    if "ncclCommShrink" in lib.features() and lib.features()["ncclCommShrink"]:
        excluded = (ctypes.c_int * 1)(2)
        child = ctypes.c_void_p()
        config = nccl.Config.non_blocking()
        started = time.perf_counter()
        result = lib.ncclCommShrink(comm._comm, excluded, 1, ctypes.byref(child), ctypes.byref(config), 1)
        try:
            lib.check(result, "ncclCommShrink", comm._comm)
            deadline = time.monotonic() + 60.0
            while not child.value:  # a non-blocking shrink sets the new handle from NCCL's own thread
                lib.check(lib.async_error(comm._comm), "ncclCommShrink (parent)", comm._comm)
                if time.monotonic() > deadline:
                    raise TimeoutError("ncclCommShrink gave no communicator within 60 s")
                time.sleep(0.0005)
            nccl._poll_ready(lib, child, None, deadline, "ncclCommShrink")
            shrunk = nccl.NcclCommunicator(lib, child, comm.rank, 2, 20, comm.device, AbortSignal())
            shrunk.allreduce([t], "sum").wait(AbortSignal(), 60.0)
            outcome["shrink_s"] = time.perf_counter() - started
            outcome["shrink_sum_ok"] = bool(torch.all(t == 2.0 * 3.0))  # 3 after the first sum, then x2
            shrunk.abandon()
        except Exception as exc:  # noqa: BLE001 - a failure is a result
            outcome["shrink_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    comm.abandon()
    store.set(f"fresh/{comm.rank}", "1")
    store.wait(["fresh/0", "fresh/1"], datetime.timedelta(seconds=60))
    started = time.perf_counter()
    fresh = nccl.NcclCommunicator.form(dist.PrefixStore("view/30", store), comm.rank, 2, 30, AbortSignal(), 60.0,
                                       host="127.0.0.1")
    fresh.allreduce([t], "sum").wait(AbortSignal(), 60.0)
    outcome["fresh_init_s"] = time.perf_counter() - started
    fresh.abandon()
    return outcome


def several_ranks(quick: bool) -> dict:
    report: dict = {}
    codes: list = []
    out = nccl_ranks.run_ranks(2, nccl_ranks.reductions, exit_codes=codes)
    report["every_dtype_and_op_vs_torch_distributed"] = {
        "ranks": 2, "checked": out.get(0, {}).get("checked"), "exit_codes": codes,
        "mismatches": sorted({m for r in out.values() for m in r.get("mismatches", [])}),
        "torch_refused": sorted({m for r in out.values() for m in r.get("torch_refused", [])}),
        "errors": [r["exception"] for r in out.values() if "exception" in r]}
    print(json.dumps({"reductions": report["every_dtype_and_op_vs_torch_distributed"]}), flush=True)
    hangs = [nccl_ranks.run_ranks(2, nccl_ranks.peer_hangs)[0] for _ in range(2 if quick else 5)]
    report["abort_with_collective_in_flight"] = {
        "wait_released_after_signal_s": median(h["abort_latency_s"] for h in hangs),
        "ncclCommAbort_returned_after_s": median(h["abort_s"] for h in hangs),
        "device_healthy_after": all(h["healthy_after"] for h in hangs), "runs": hangs}
    print(json.dumps({"abort_in_flight": {k: v for k, v in report["abort_with_collective_in_flight"].items()
                                          if k != "runs"}}), flush=True)
    exits = nccl_ranks.run_ranks(2, nccl_ranks.peer_exits)[0]
    report["peer_exit"] = exits
    reform = nccl_ranks.run_ranks(2, reform_two, 3 if quick else 10)
    report["reform_cycle_two_ranks_s"] = median(reform[0] + reform[1])
    shrink = nccl_ranks.run_ranks(3, shrink_after_exit)
    report["shrink_after_peer_exit"] = {r: shrink[r] for r in sorted(shrink)}
    print(json.dumps({"reform2": report["reform_cycle_two_ranks_s"], "shrink": report["shrink_after_peer_exit"]}),
          flush=True)
    sizes = [1, 16, 256] if quick else [1, 4, 16, 64, 256, 1024]
    bw = nccl_ranks.run_ranks(2, bandwidth_ranks, sizes, timeout=600)
    report["bandwidth_two_ranks_loopback_sockets"] = bw.get(0)
    return report


# ---------------------------------------------------------------------- training step (subprocesses)
def make_model() -> torch.nn.Module:
    vocab, width, layers = 16384, 768, 12
    layer = torch.nn.TransformerEncoderLayer(width, 12, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.TransformerEncoder(layer, layers,
                               enable_nested_tensor=False), torch.nn.Linear(width, vocab))


def train_child(variant: str, steps: int, warmup: int) -> None:
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = make_model().cuda()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, 16384, (16, 256), device="cuda")
    if variant == "ddp":
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        net = torch.nn.parallel.DistributedDataParallel(model)

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(net(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    else:
        import ftcomm
        ft = ftcomm.init(backend="nccl", bind="127.0.0.1:0", overlap=(variant != "ftcomm_no_overlap"),
                         handle_signals=False)
        ft.register_state(model=model, optimizer=optimizer)
        trained = ft.wrap(model) if variant == "ftcomm_wrapped" else model

        def step() -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(trained(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            if ft.wait_gradients_ready(trained):
                optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    print(json.dumps({"variant": variant, "params": params, "step_s": (time.perf_counter() - started) / steps}),
          flush=True)
    if variant != "ddp":
        ft.shutdown()
    else:
        dist.destroy_process_group()


def training(rounds: int, steps: int, warmup: int) -> dict:
    variants = ["ftcomm_wrapped", "ddp", "ftcomm", "ftcomm_no_overlap"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    params = None
    for _ in range(rounds):
        for variant in variants:
            out = subprocess.run([sys.executable, __file__, "--train-child", variant, "--steps", str(steps),
                                  "--warmup", str(warmup)], capture_output=True, text=True, timeout=600)
            line = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
            if out.returncode != 0 or not line:
                raise RuntimeError(f"{variant} exited with {out.returncode}: {out.stdout[-500:]} {out.stderr[-2000:]}")
            times[variant].append(line[-1]["step_s"])
            params = line[-1]["params"]
    result = {"params": params, "batch": "16 x 256 tokens, bf16 autocast, AdamW", "rounds": rounds, "steps": steps,
              **{f"{v}_step_s": median(times[v]) for v in variants}, "runs_s": times}
    result["ftcomm_over_ddp"] = round(result["ftcomm_step_s"] / result["ddp_step_s"], 3)
    result["no_overlap_over_ddp"] = round(result["ftcomm_no_overlap_step_s"] / result["ddp_step_s"], 3)
    result["wrapped_over_ddp"] = round(result["ftcomm_wrapped_step_s"] / result["ddp_step_s"], 3)
    return result


# ---------------------------------------------------------------------- group recovery on this GPU
def recovery_by_backend(runs: int) -> dict:
    gr = group_recovery
    result = {}
    for backend in ("nccl", "gloo"):
        env = (lambda: {"NCCL_HOSTID": f"ftcomm-bench-{uuid.uuid4().hex[:8]}", "NCCL_IB_DISABLE": "1"}) \
            if backend == "nccl" else dict
        group = gr.Group(4, ["--backend", backend], env=env)
        crashes = []
        try:
            for _ in range(runs):
                crashes.append(gr.fault_run(group, signal.SIGKILL))
                group.grow(4)
        finally:
            group.close()
        result[backend] = gr.summarize(crashes)
        print(json.dumps({backend: {k: v for k, v in result[backend].items() if k != "runs"}}), flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "nccl_gpu.json"))
    parser.add_argument("--train-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    args = parser.parse_args()
    if args.train_child:
        train_child(args.train_child, args.steps, args.warmup)
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    os.environ.setdefault("NCCL_IB_DISABLE", "1")
    only = set(filter(None, args.only.split(",")))
    report: dict = {"benchmark": "nccl_gpu", "device": torch.cuda.get_device_name(),
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                "torch": torch.__version__, "cuda": torch.version.cuda},
                    "nccl": library_features()}
    reps = 3 if args.quick else 10
    sections = [
        ("formation", lambda: formation(reps)),
        ("busy_stream_abort", lambda: busy_stream_abort(reps)),
        ("bandwidth_one_rank", lambda: bandwidth_one_rank([1, 16, 256] if args.quick else [1, 4, 16, 64, 256, 1024])),
        ("several_ranks", lambda: several_ranks(args.quick)),
        ("training", lambda: training(1 if args.quick else 3, args.steps, args.warmup)),
        ("group_recovery", lambda: recovery_by_backend(2 if args.quick else 5)),
    ]
    for name, run in sections:
        if only and name not in only:
            continue
        started = time.perf_counter()
        try:
            report[name] = run()
        except Exception as exc:  # noqa: BLE001 - recorded: a failure is a result
            report[name] = {"failed": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        print(json.dumps({name: report[name], "section_s": round(time.perf_counter() - started, 1)}), flush=True)
        save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
