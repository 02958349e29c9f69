"""Several NCCL ranks on one GPU, for the GPU tests and the benchmark.

NCCL refuses two ranks of one communicator on the same GPU of the same host. Each rank
here claims a host of its own (``NCCL_HOSTID``), so NCCL connects them through its
socket transport over loopback, as it would connect ranks on different machines. The
collectives, their errors and their aborts are then NCCL's real ones; only the
bandwidth is that of loopback sockets, not of NVLink or InfiniBand.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import socket
import time
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_own_host(rank: int, tag: str) -> None:
    """Make this process a host of its own in NCCL's eyes; call before NCCL initialises."""
    os.environ["NCCL_HOSTID"] = f"ftcomm-{tag}-rank{rank}"
    os.environ.setdefault("NCCL_IB_DISABLE", "1")


def _rank_main(rank: int, size: int, port: int, scenario: Callable[..., Any], args: tuple, results: Any) -> None:
    as_own_host(rank, str(port))
    import torch
    import torch.distributed as dist

    from ftcomm.backends import nccl
    from ftcomm.backends.base import AbortSignal

    try:
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=60))
        comm = nccl.NcclCommunicator.form(dist.PrefixStore("view/1", store), rank, size, 1, AbortSignal(), 60.0,
                                          host="127.0.0.1")
        results.put((rank, scenario(comm, store, *args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, {"exception": f"{type(exc).__name__}: {exc}"}))
        raise


def run_ranks(size: int, scenario: Callable[..., Any], *args: Any, timeout: float = 120.0,
              exit_codes: list | None = None) -> dict[int, Any]:
    """Run ``scenario(comm, store, *args)`` in ``size`` spawned ranks; each rank's return value.

    A rank that returns nothing within ``timeout`` is missing from the result; every
    process is killed before this returns. ``exit_codes``, when given, receives each
    rank's exit code (negative: the signal that ended it; None: it had to be killed).
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main, args=(rank, size, port, scenario, args, results), daemon=True)
                 for rank in range(size)]
    for p in processes:
        p.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < size and time.monotonic() < deadline:
            try:
                rank, value = results.get(timeout=0.2)
            except queue.Empty:
                if not any(p.is_alive() for p in processes) and results.empty():
                    break
                continue
            collected[rank] = value
    finally:
        for p in processes:
            p.join(timeout=15)
            if exit_codes is not None:
                exit_codes.append(p.exitcode)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return collected


# ---------------------------------------------------------------------- scenarios (run in every rank)
def _inputs(dtype: Any, rank: int, count: int = 4099) -> Any:
    """This rank's input: small values, so that no integer sum overflows and float sums of two are exact."""
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        values = torch.randn(count, generator=g)
    else:
        low = 0 if dtype == torch.uint8 else -20
        values = torch.randint(low, 21, (count,), generator=g)
    return values.to(dtype).cuda()


def _local_reduction(tensors: list, op: str) -> Any:
    import functools

    import torch

    if op == "max":
        return functools.reduce(torch.maximum, tensors)
    if op == "min":
        return functools.reduce(torch.minimum, tensors)
    return functools.reduce(torch.add, tensors)  # sum in the tensors' own dtype, as NCCL adds


def reductions(comm: Any, store: Any) -> dict:
    """Every dtype x op of ftcomm's allreduce against torch.distributed's NCCL allreduce of the
    same inputs (bit for bit) and, for sum/max/min, against torch's own arithmetic; allgather,
    broadcast and reduce_scatter against the inputs."""
    import torch
    import torch.distributed as dist

    from ftcomm.backends import nccl
    from ftcomm.backends.base import AbortSignal

    dist.init_process_group("nccl", store=dist.PrefixStore("torch", store), rank=comm.rank,
                            world_size=comm.size, device_id=torch.device("cuda", 0))
    torch_ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
                 "min": dist.ReduceOp.MIN}
    wait = AbortSignal()
    mismatches, torch_refused, checked = [], [], 0
    for dtype in nccl.DATATYPES:
        inputs = [_inputs(dtype, r) for r in range(comm.size)]
        for op in ("sum", "mean", "max", "min"):
            ours = inputs[comm.rank].clone()
            comm.allreduce([ours], op).wait(wait, 60.0)
            theirs = inputs[comm.rank].clone()
            try:
                dist.all_reduce(theirs, torch_ops[op])
                torch.cuda.synchronize()
                if not torch.equal(ours, theirs):
                    mismatches.append(f"{dtype} {op}: differs from torch.distributed")
            except (RuntimeError, ValueError) as exc:
                torch_refused.append(f"{dtype} {op}: {str(exc).splitlines()[0][:120]}")
            if op != "mean" and not torch.equal(ours, _local_reduction(inputs, op)):
                mismatches.append(f"{dtype} {op}: differs from torch's arithmetic")
            checked += 1
        gathered = comm.allgather(inputs[comm.rank]).wait(wait, 60.0)
        if not all(torch.equal(g, i) for g, i in zip(gathered, inputs)):
            mismatches.append(f"{dtype} allgather")
        root = comm.size - 1
        received = inputs[comm.rank].clone()
        comm.broadcast(received, root).wait(wait, 60.0)
        if not torch.equal(received, inputs[root]):
            mismatches.append(f"{dtype} broadcast")
        whole = torch.cat([i[:1000] for i in inputs])  # size x 1000: the same on every rank, times size after the sum
        mine = torch.empty(1000, dtype=dtype, device="cuda")
        comm.reduce_scatter(mine, whole, "sum").wait(wait, 60.0)
        expected = _local_reduction([inputs[comm.rank][:1000]] * comm.size, "sum")
        if not torch.equal(mine, expected):
            mismatches.append(f"{dtype} reduce_scatter")
    dist.destroy_process_group()
    comm.abandon()
    return {"mismatches": mismatches, "torch_refused": torch_refused, "checked": checked}


def _abort_finished(view_id: int, timeout: float) -> float | None:
    """Seconds until the background ncclCommAbort of ``view_id`` returned; None if it did not."""
    import threading

    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if not any(t.name == f"ftcomm-nccl-abort-{view_id}" for t in threading.enumerate()):
            return time.monotonic() - started
        time.sleep(0.005)
    return None


def _healthy_after() -> bool:
    """A new communicator of one rank forms and reduces on this device (nothing is left stuck)."""
    import torch
    import torch.distributed as dist

    from ftcomm.backends import nccl
    from ftcomm.backends.base import AbortSignal

    comm = nccl.NcclCommunicator.form(dist.HashStore(), 0, 1, 99, AbortSignal(), 60.0)
    t = torch.arange(5, dtype=torch.float32, device="cuda")
    comm.allreduce([t], "sum").wait(AbortSignal(), 60.0)
    healthy = t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    comm.abandon()
    return healthy


def exit_rank(comm: Any, store: Any, leaver: int) -> None:
    """Rank ``leaver`` exits at once (no clean-up); the others return once it is gone."""
    import torch

    if comm.rank == leaver:
        store.set("exiting", "1")
        torch.cuda.synchronize()
        os._exit(3)
    store.wait(["exiting"], datetime.timedelta(seconds=60))
    time.sleep(0.3)  # the process is gone by now: its sockets are closed


def peer_exits(comm: Any, store: Any) -> dict:
    """Rank 1 exits after one collective; rank 0's next collective must fail, not hang."""
    import torch

    from ftcomm.backends.base import AbortSignal
    from ftcomm.errors import CommunicatorError

    t = torch.ones(1 << 20, device="cuda")
    comm.allreduce([t], "sum").wait(AbortSignal(), 60.0)
    exit_rank(comm, store, 1)
    started = time.monotonic()
    outcome = {}
    try:
        comm.allreduce([t], "sum").wait(AbortSignal(), 60.0)
        outcome["error"] = None
    except CommunicatorError as exc:
        outcome["error"] = str(exc)
    outcome["failed_after_s"] = time.monotonic() - started
    comm.abandon()
    outcome["abort_s"] = _abort_finished(comm.view_id, 60.0)
    outcome["healthy_after"] = _healthy_after()
    return outcome


def peer_hangs(comm: Any, store: Any) -> dict:
    """Rank 1 stays alive but never enters rank 0's collective: rank 0's wait is abandoned when
    the abort signal fires, and ncclCommAbort stops the kernel that waits for rank 1."""
    import threading

    import torch

    from ftcomm.backends.base import AbortSignal
    from ftcomm.errors import CollectiveAborted

    t = torch.ones(1 << 22, device="cuda")
    comm.allreduce([t], "sum").wait(AbortSignal(), 60.0)
    if comm.rank == 1:
        store.wait(["released"], datetime.timedelta(seconds=120))
        return {}
    abort = AbortSignal()
    handle = comm.allreduce([t], "sum")
    threading.Timer(0.3, abort.fire, args=("rank 1 is suspect",)).start()
    outcome = {"aborted": False}
    try:
        handle.wait(abort, 60.0)
    except CollectiveAborted:
        outcome["aborted"] = True
    outcome["abort_latency_s"] = time.monotonic() - abort.fired_at if abort.fired_at else None
    comm.abandon()
    outcome["abort_s"] = _abort_finished(comm.view_id, 60.0)
    outcome["healthy_after"] = _healthy_after()
    store.set("released", "1")
    return outcome


def abandon_and_exit(comm: Any, store: Any) -> dict:
    """One collective, then abandon the communicator and let the process exit at once."""
    import torch

    from ftcomm.backends.base import AbortSignal

    t = torch.ones(1 << 20, device="cuda")
    comm.allreduce([t], "sum").wait(AbortSignal(), 60.0)
    comm.abandon()
    return {"sum_ok": bool(torch.all(t == comm.size))}
