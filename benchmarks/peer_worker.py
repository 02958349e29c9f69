"""One worker of ``benchmarks/peer_torchft.py`` and ``peer_hivemind.py``: the same training loop
under ftcomm, torchft or hivemind.

    python benchmarks/peer_worker.py ftcomm [--peers HOST:PORT] [--diloco H [--local-sgd]]
    python benchmarks/peer_worker.py torchft --lighthouse http://127.0.0.1:PORT --replica-id replica_3 [--tuned]
    python benchmarks/peer_worker.py lighthouse [--tuned]
    python benchmarks/peer_worker.py hivemind [--peers MULTIADDR] [--diloco H]

Both systems run the identical step on one torch thread: ``--step-time`` seconds of sleep
(standing in for a heavier model's compute), the forward and backward pass of a small MLP
(32-128-128-4, batch 64), the gradient average, and an SGD step when the step commits.
Only the gradient average and the commit decision differ:

- ftcomm: ``ftcomm.init`` (Gloo, on 127.0.0.1), ``wait_gradients_ready``;
- torchft 0.2.0: a replica group of one process: ``torchft.Manager`` (its own TCPStore),
  ``torchft.ProcessGroupGloo``, one ``Manager.allreduce`` of the gradients in a flat buffer,
  and ``torchft.Optimizer`` (``zero_grad`` starts the step's quorum, ``step`` asks
  ``should_commit``), against a lighthouse started by this script's ``lighthouse`` role.
  ``--ddp`` averages through ``torchft.DistributedDataParallel`` instead; its communication
  hook in 0.2.0 raises ``AssertionError`` when the allreduce fails (``_ManagedWork.wait``
  returns False before the future chain is set, and the hook asserts on it), so a crashed
  or stopped peer ends every survivor's training loop with that error.

``--diloco H`` trains with DiLoCo instead, the same inner step (the SGD step on each
worker's own gradient) and an outer step every H inner steps: ``ftcomm.DiLoCo`` or
``torchft.local_sgd.DiLoCo`` (one fragment, outer SGD at 0.7 with Nesterov momentum 0.9);
a commit is then an outer step. ``--fragments P`` is Streaming DiLoCo (ftcomm: the model
cut in P fragments of about equal size; torchft: the Sequential's layers cut into P
consecutive modules), an outer step every H/P inner steps; ``--delay D`` overlaps each
outer step's reduction with D inner steps (ftcomm ``delay``, torchft
``fragment_sync_delay``; torchft replaces the fragment with the new global values, ftcomm
keeps the D steps' change on top).
``--local-sgd`` (ftcomm) averages the parameters at each outer step instead
(``ftcomm.LocalSGD``).

hivemind 1.1.12 (``--peers``: the multiaddr of a running worker's DHT; every peer on
127.0.0.1), with the settings its own documents give:

- per step, ``hivemind.averaging.DecentralizedAverager`` over the gradients with the
  settings of hivemind's averaging benchmark (``target_group_size=4``,
  ``min_matchmaking_time=5``, ``request_timeout=1``, ``step(timeout=15)``), or with
  ``--tuned`` 1 s, 0.5 s and 5 s (:data:`HIVEMIND_AVERAGER_SETTINGS`); a step whose
  averaging fails (``None`` or an error) applies the worker's own gradient (a commit in
  a world of 1); the world of a commit is the size of the group that averaged;
- ``--diloco H``: ``hivemind.Optimizer`` with the quickstart's settings
  (``use_local_updates=True``, ``matchmaking_time=3.0``, ``averaging_timeout=10.0``) and
  ``target_batch_size`` = 4 workers x 64 x H (an epoch when the swarm has trained H
  steps each: parameter averaging every H steps, as ``--local-sgd``); a commit is a new
  epoch, its world the size of the last averaging round that finished (1 when it
  failed), read from hivemind's own log record of the round.

Each commit also carries ``digest``, the first 16 hex digits of a SHA-1 of the
parameters' bytes after the step, to tell whether the replicas are bit-equal.

Every line on stdout is a JSON object: ``started`` (model built; ``init_t`` is the wall
clock just before ``ftcomm.init`` or the torchft store, process group and Manager are
created), ``ready``, one ``commit`` per committed step with its wall-clock time ``t``, the
step and the world size it committed in (ftcomm: the view's size; torchft: the quorum's
participants), and ``error`` when training raised. The worker stops at the next step
boundary when stdin closes. The ``lighthouse`` role prints ``ready`` with its address
and serves until stdin closes.

The torchft settings, ``--tuned`` or not, are in :data:`TORCHFT_SETTINGS`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback

# torchft 0.2.0: its defaults, and every timeout at 1 s. The tuned quorum timeout is 2 s, not
# 1 s: a quorum that follows a failure waits for the lighthouse to drop the failed replica
# (its heartbeat_timeout, 1 s), and a quorum RPC that times out leaves the Manager broken for
# good (every later start_quorum re-raises it), so it must exceed heartbeat_timeout.
TORCHFT_SETTINGS = {
    "default": {
        "manager": {"timeout_s": 60, "quorum_timeout_s": 60, "connect_timeout_s": 60},
        "process_group_gloo": {"timeout_s": 60},
        "lighthouse": {"join_timeout_ms": 60000, "quorum_tick_ms": 100, "heartbeat_timeout_ms": 5000},
    },
    "tuned": {
        "manager": {"timeout_s": 1, "quorum_timeout_s": 2, "connect_timeout_s": 1},
        "process_group_gloo": {"timeout_s": 1},
        "lighthouse": {"join_timeout_ms": 1000, "quorum_tick_ms": 10, "heartbeat_timeout_ms": 1000},
    },
}


# hivemind 1.1.12's DecentralizedAverager: the settings of hivemind's own averaging benchmark
# (benchmarks/benchmark_averaging.py), and every wait at 1 s or less ("tuned").
HIVEMIND_AVERAGER_SETTINGS = {
    "default": {"target_group_size": 4, "min_matchmaking_time": 5.0, "request_timeout": 1.0, "step_timeout": 15.0},
    "tuned": {"target_group_size": 4, "min_matchmaking_time": 1.0, "request_timeout": 0.5, "step_timeout": 5.0},
}


def emit(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def watch_stdin() -> threading.Event:
    """An event set when stdin closes (the benchmark is done with this process). Read from the
    descriptor, not ``sys.stdin``: a process forked while a thread holds ``sys.stdin``'s lock
    (hivemind forks its DHT and averagers) would deadlock closing it in the child."""
    closed = threading.Event()

    def read() -> None:
        while os.read(0, 4096):
            pass
        closed.set()

    threading.Thread(target=read, daemon=True).start()
    return closed


def run_lighthouse(tuned: bool) -> int:
    from torchft.coordination import LighthouseServer

    options = TORCHFT_SETTINGS["tuned" if tuned else "default"]["lighthouse"]
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, **options)
    port = server.address().rsplit(":", 1)[1]
    closed = watch_stdin()
    emit(ev="ready", id="lighthouse", address=f"http://127.0.0.1:{port}", pid=os.getpid(), t=time.time())
    closed.wait()
    server.shutdown()
    return 0


def make_workload(seed: int = 0):
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(4096, 32, generator=generator)
    labels = torch.randint(0, 4, (4096,), generator=generator)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 4))
    return inputs, labels, model


def batch(inputs, labels, step: int, size: int = 64):
    start = (step * size) % len(inputs)
    return inputs[start:start + size], labels[start:start + size]


def run_ftcomm(args, closed: threading.Event) -> None:
    import torch
    import torch.nn.functional as F

    import ftcomm

    inputs, labels, model = make_workload()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    init_t = time.time()
    emit(ev="started", pid=os.getpid(), init_t=init_t, t=init_t)
    ft = ftcomm.init(backend="gloo", peers=args.peers, bind="127.0.0.1:0", min_workers=1)
    if args.diloco:
        if args.local_sgd:
            diloco = ftcomm.LocalSGD(ft, model, optimizer, sync_every=args.diloco)
        else:
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            diloco = ftcomm.DiLoCo(ft, model, optimizer, outer_optimizer=outer, sync_every=args.diloco,
                                   fragments=args.fragments, delay=args.delay)
        ft.register_state(diloco=diloco)
    else:
        ft.register_state(model=model, optimizer=optimizer)
    emit(ev="ready", id=ft.id, address=ft.gossip.address, pid=os.getpid(), t=time.time())
    try:
        inner = 0
        while args.diloco and not closed.is_set():
            time.sleep(args.step_time)
            x, y = batch(inputs, labels, inner)
            F.cross_entropy(model(x), y).backward()
            inner += 1
            if diloco.step():  # the inner step; every --diloco of them the outer step
                emit(ev="commit", step=ft.step, world=ft.world_size, view=ft.view.id, t=time.time(),
                     digest=digest(model))
        while not closed.is_set():
            optimizer.zero_grad()
            time.sleep(args.step_time)
            x, y = batch(inputs, labels, ft.step)
            F.cross_entropy(model(x), y).backward()
            if ft.wait_gradients_ready(model):
                optimizer.step()
                emit(ev="commit", step=ft.step, world=ft.world_size, view=ft.view.id, t=time.time(),
                     digest=digest(model))
    finally:
        ft.shutdown()


def run_torchft(args, closed: threading.Event) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torchft

    settings = TORCHFT_SETTINGS["tuned" if args.tuned else "default"]
    inputs, labels, model = make_workload()
    init_t = time.time()
    emit(ev="started", pid=os.getpid(), init_t=init_t, t=init_t)
    # The replica group's store (a group of one process): the Manager connects to it as a
    # client, and the quorum hands its address to the other replicas as the rendezvous of
    # the cross-replica Gloo group when this replica has replica rank 0.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    process_group = torchft.ProcessGroupGloo(timeout=timedelta(seconds=settings["process_group_gloo"]["timeout_s"]))
    inner_optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def state_dict():
        return {"model": model.state_dict(), "optimizer": inner_optimizer.state_dict()}

    def load_state_dict(state) -> None:
        model.load_state_dict(state["model"])
        inner_optimizer.load_state_dict(state["optimizer"])

    manager = torchft.Manager(
        pg=process_group, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
        use_async_quorum=not args.diloco,  # (its DiLoCo needs the synchronous quorum)
        timeout=timedelta(seconds=settings["manager"]["timeout_s"]),
        quorum_timeout=timedelta(seconds=settings["manager"]["quorum_timeout_s"]),
        connect_timeout=timedelta(seconds=settings["manager"]["connect_timeout_s"]),
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
        replica_id=args.replica_id, hostname="127.0.0.1")
    emit(ev="ready", id=args.replica_id, address=args.lighthouse, pid=os.getpid(), t=time.time())
    if args.diloco:
        try:
            train_torchft_diloco(args, closed, manager, model, inner_optimizer, inputs, labels)
        finally:
            manager.shutdown(wait=False)
        return
    forward = torchft.DistributedDataParallel(manager, model) if args.ddp else model
    optimizer = torchft.Optimizer(manager, inner_optimizer)
    try:
        while not closed.is_set():
            optimizer.zero_grad()  # starts this step's quorum (asynchronous)
            time.sleep(args.step_time)
            x, y = batch(inputs, labels, manager.current_step())
            F.cross_entropy(forward(x), y).backward()  # with --ddp, the allreduce runs in here
            if not args.ddp:
                average_gradients(manager, model)
            manager.wait_quorum()  # a healing replica's step is set by its quorum: read it after
            before = manager.current_step()
            optimizer.step()  # should_commit, then the SGD step when it commits
            if manager.current_step() > before:
                emit(ev="commit", step=manager.current_step(), world=manager.num_participants(), t=time.time())
    finally:
        manager.shutdown(wait=False)


def train_torchft_diloco(args, closed: threading.Event, manager, model, inner_optimizer, inputs, labels) -> None:
    """torchft's DiLoCo (``torchft.local_sgd.DiLoCo``, one fragment): the inner optimizer's
    step hook runs the outer step every ``--diloco`` inner steps (its quorum, the
    pseudo-gradients' allreduce, ``should_commit``); a commit is a step of the Manager."""
    import torch
    import torch.nn.functional as F
    from torchft.local_sgd import DiLoCo

    fragments = [torch.nn.Sequential(*part) for part in layer_fragments(model, args.fragments)]
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]
    inner = 0
    with DiLoCo(manager, fragments, inner_optimizer, outer if len(outer) > 1 else outer[0], sync_every=args.diloco,
                fragment_sync_delay=args.delay):
        while not closed.is_set():
            inner_optimizer.zero_grad()
            time.sleep(args.step_time)
            x, y = batch(inputs, labels, inner)
            F.cross_entropy(model(x), y).backward()
            inner += 1
            before = manager.current_step()
            inner_optimizer.step()  # every --diloco steps its hook runs the outer step
            if manager.current_step() > before:
                emit(ev="commit", step=manager.current_step(), world=manager.num_participants(), t=time.time())


def layer_fragments(model, count: int) -> list[list]:
    """The Sequential's layers in ``count`` consecutive runs of about equal parameter counts
    (each with a parameter)."""
    layers = list(model)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    total, parts, done = sum(sizes), [[] for _ in range(count)], 0
    fragment = 0
    for layer, size in zip(layers, sizes):
        if size and parts[fragment] and any(p.numel() for l in parts[fragment] for p in l.parameters()) and \
                done >= total * (fragment + 1) / count and fragment < count - 1:
            fragment += 1
        parts[fragment].append(layer)
        done += size
    if not all(any(True for l in part for _ in l.parameters()) for part in parts):
        raise ValueError(f"the model's {len(layers)} layers cannot be cut into {count} fragments with parameters")
    return parts


def digest(model) -> str:
    """The first 16 hex digits of a SHA-1 of the parameters' bytes."""
    import hashlib

    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def run_hivemind(args, closed: threading.Event) -> None:
    import torch
    import torch.nn.functional as F
    import hivemind
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")  # (its records are read below, not printed)
    inputs, labels, model = make_workload()
    init_t = time.time()
    emit(ev="started", pid=os.getpid(), init_t=init_t, t=init_t)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                       initial_peers=[args.peers] if args.peers else [])
    address = str(next(a for a in dht.get_visible_maddrs() if "127.0.0.1" in str(a)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    try:
        if args.diloco:
            train_hivemind_optimizer(args, closed, dht, address, model, optimizer, inputs, labels)
            return
        grads = [torch.zeros_like(p) for p in model.parameters()]
        settings = dict(HIVEMIND_AVERAGER_SETTINGS["tuned" if args.tuned else "default"])
        step_timeout = settings.pop("step_timeout")
        averager = hivemind.averaging.DecentralizedAverager(grads, dht, prefix="peer_bench_grads", start=True,
                                                            **settings)
        emit(ev="ready", id=str(dht.peer_id), address=address, pid=os.getpid(), t=time.time())
        step = 0
        while not closed.is_set():
            optimizer.zero_grad()
            time.sleep(args.step_time)
            x, y = batch(inputs, labels, step)
            F.cross_entropy(model(x), y).backward()
            with averager.get_tensors() as tensors:
                for buffer, p in zip(tensors, model.parameters()):
                    buffer.copy_(p.grad)
            try:
                gathered = averager.step(timeout=step_timeout)
            except Exception:  # noqa: BLE001 - a failed round, as hivemind's own benchmark counts it
                gathered = None
            world = 1
            if gathered is not None:
                world = len(gathered)
                with averager.get_tensors() as tensors:
                    for buffer, p in zip(tensors, model.parameters()):
                        p.grad.copy_(buffer)
            optimizer.step()
            step += 1
            emit(ev="commit", step=step, world=world, t=time.time(), digest=digest(model))
        averager.shutdown()
    finally:
        dht.shutdown()


def train_hivemind_optimizer(args, closed: threading.Event, dht, address: str, model, optimizer, inputs,
                             labels) -> None:
    """``hivemind.Optimizer`` with its quickstart's settings (see the module)."""
    import logging
    import re

    import torch.nn.functional as F
    import hivemind

    rounds: list[int] = [1]  # the size of the last parameter-averaging round that finished

    class Rounds(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            found = re.match(r"Averaged parameters with (\d+) peers", message)
            if found:
                rounds[0] = int(found.group(1))
            elif message.startswith("Averaging failed"):
                rounds[0] = 1

    watched = logging.getLogger("hivemind.optim.state_averager")
    watched.setLevel(logging.INFO)
    watched.addHandler(Rounds())
    opt = hivemind.Optimizer(dht=dht, run_id="peer_bench", batch_size_per_step=64,
                             target_batch_size=4 * 64 * args.diloco, optimizer=optimizer, use_local_updates=True,
                             matchmaking_time=3.0, averaging_timeout=10.0, verbose=True)
    emit(ev="ready", id=str(dht.peer_id), address=address, pid=os.getpid(), t=time.time())
    step, epoch = 0, opt.local_epoch
    try:
        while not closed.is_set():
            opt.zero_grad()
            time.sleep(args.step_time)
            x, y = batch(inputs, labels, step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            if opt.local_epoch != epoch:
                epoch = opt.local_epoch
                emit(ev="commit", step=epoch, world=rounds[0], t=time.time(), digest=digest(model))
    finally:
        opt.shutdown()


def average_gradients(manager, model) -> None:
    """One ``Manager.allreduce`` (average over the quorum's participants) of all gradients in a
    flat buffer. ``wait()`` returns False on a failed collective and the Manager records the
    error, so that ``should_commit`` refuses the step."""
    import torch

    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if manager.allreduce(flat).wait():
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=["ftcomm", "torchft", "lighthouse", "hivemind"])
    parser.add_argument("--peers", default=None,
                        help="ftcomm: gossip address of a running worker; hivemind: its DHT's multiaddr")
    parser.add_argument("--lighthouse", default=None, help="torchft: the lighthouse's address")
    parser.add_argument("--replica-id", default="replica_0", help="torchft: this replica group's name")
    parser.add_argument("--tuned", action="store_true",
                        help="torchft: the 1 s timeouts of TORCHFT_SETTINGS; hivemind: HIVEMIND_AVERAGER_SETTINGS's tuned")
    parser.add_argument("--ddp", action="store_true",
                        help="torchft: average through torchft.DistributedDataParallel instead of Manager.allreduce")
    parser.add_argument("--step-time", type=float, default=0.005, help="extra seconds of work per step (sleep)")
    parser.add_argument("--diloco", type=int, default=0,
                        help="train with DiLoCo, an outer step every this many inner steps (ftcomm.DiLoCo, "
                             "torchft.local_sgd.DiLoCo; outer SGD 0.7, Nesterov 0.9; hivemind.Optimizer): a commit "
                             "is an outer step")
    parser.add_argument("--local-sgd", action="store_true",
                        help="ftcomm, with --diloco: ftcomm.LocalSGD (parameter averaging) instead of DiLoCo")
    parser.add_argument("--fragments", type=int, default=1, help="with --diloco: Streaming DiLoCo's fragments")
    parser.add_argument("--delay", type=int, default=0,
                        help="with --diloco: inner steps each outer step's reduction overlaps")
    args = parser.parse_args()
    if args.role == "lighthouse":
        return run_lighthouse(args.tuned)
    closed = watch_stdin()
    try:
        {"ftcomm": run_ftcomm, "torchft": run_torchft, "hivemind": run_hivemind}[args.role](args, closed)
    except Exception as exc:  # reported to the benchmark, which records the run as failed
        emit(ev="error", message=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:], t=time.time())
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # torchft's server threads and abandoned Gloo groups must not hold the exit


if __name__ == "__main__":
    sys.exit(main())
