"""Elastic data-parallel training of a small MLP with ftcomm.

The task is a synthetic classification problem generated from a seed (a random teacher
network labels Gaussian inputs), so nothing is downloaded. Start several of these on
one machine or many; kill, stop, add or remove any of them while they train:

    python examples/train_elastic.py --bind 127.0.0.1:7000 --steps 300
    python examples/train_elastic.py --bind 127.0.0.1:7001 --peers 127.0.0.1:7000 --steps 300

Data comes through a ``DataLoader`` driven by an ``ftcomm.ElasticSampler``: every epoch
visits each sample exactly once across crashes, hangs, leaves and joins. The default
policy keeps the global batch constant (``--global-batch``; ``--micro-batch`` bounds
memory with gradient accumulation); ``--worker-batch`` fixes the per-worker batch and
scales the learning rate linearly with the world size instead. ``--checkpoint-dir``
adds flash checkpoints every ``--checkpoint-every`` steps, restored when the whole job
restarts (a worker restarted into a running group gets the group's state instead).
``--sync-every H`` trains with DiLoCo instead (each worker alone for H inner steps, then
an outer step across the group; ``--local-sgd`` averages parameters instead of DiLoCo's
outer Nesterov step; ``--fragments P`` is Streaming DiLoCo, the model's fragments taking
turns; ``--quantize bf16`` or ``int8`` sums the pseudo-gradients in bfloat16 or 8-bit integers;
``--delay D`` overlaps each outer step's reduction with the D inner steps before it): a committed step is then an
outer step. ``--ddp-rank``/``--ddp-world``/``--ddp-port`` run the same training under
``torch.nn.parallel.DistributedDataParallel`` instead (a fixed world, for comparison).

Every line on stdout is a JSON object: ``started`` (modules imported, model and
optimizer built: ``ftcomm.init`` is next), ``ready`` (in the group), ``first_step`` (the first committed step of each view), one ``view`` per view change, a
``step`` every ``--report-every`` committed steps, ``batch`` for every committed step
with ``--log-indices`` (this worker's sample indices), ``restored`` after a checkpoint
restore, ``straggler`` when a member becomes or stops being a straggler, and ``done`` with the final loss, accuracy and state digest. With ``--control``, JSON commands on stdin drive the fault
filter of the gossip layer (``partition``, ``heal``), stop training at a given step
(``stop_at``), change the extra seconds per step (``step_time``), report progress
(``status``), make the training loop raise an uncaught exception (``fail``) or run a full
garbage collection over a heap grown by ``objects``, ``after`` seconds (``collect``, reported
by a ``collected`` line), for tests and demos; the worker then also stops when stdin closes.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import json
import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ftcomm
from ftcomm.gossip import FaultFilter, GossipConfig


def make_task(seed: int, samples: int = 8192, features: int = 32, classes: int = 4):
    """Inputs and teacher labels, identical on every worker for a given seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    teacher = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.Tanh(), torch.nn.Linear(64, classes))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        y = teacher(x).argmax(dim=1)
    return x, y


def make_model(features: int = 32, classes: int = 4, hidden: int = 128) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))


def emit(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class Control:
    """Commands on stdin (with --control): partition, heal, stop_at, status, fail, collect
    (the heap grown by ``objects`` now, a full garbage collection at the first step ``after``
    seconds later), and
    in_flight (``signal`` KILL or STOP: this process sends it to itself right after an
    inner step during which a DiLoCo outer step's reduction is under way, see --delay)."""

    def __init__(self, faults: FaultFilter) -> None:
        self.faults = faults
        self.stop_at: int | None = None
        self.fail = False
        self.step_time: float | None = None  # overrides --step-time once set
        self.in_flight: signal.Signals | None = None
        self.collect = False  # a full garbage collection at the start of the next step
        self.heap: list = []  # what makes it long (see grow)
        self.closed = threading.Event()

    def loop(self, ft) -> None:
        # A stream of its own rather than sys.stdin, whose lock this blocking read holds: a
        # child forked meanwhile (a DataLoader with the fork context) would wait on it forever.
        stream = open(os.dup(sys.stdin.fileno()), encoding="utf-8")
        for line in stream:
            command = json.loads(line)
            name = command["cmd"]
            if name == "partition":
                self.faults.partition(command["a"], command["b"])
            elif name == "heal":
                self.faults.heal()
            elif name == "step_time":
                self.step_time = float(command["seconds"])
            elif name == "fail":
                self.fail = True
            elif name == "collect":
                self.grow(int(command["objects"]))
                time.sleep(float(command.get("after", 3.0)))  # the group's waits back to usual
                self.collect = True
            elif name == "in_flight":
                self.in_flight = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}[command["signal"]]
            elif name == "stop_at":
                self.stop_at = int(command["step"])
            elif name == "status":
                emit(ev="status", step=ft.step, t=time.time())
                continue
            emit(ev="ok", cmd=name, step=ft.step, t=time.time())
        self.closed.set()

    def grow(self, objects: int) -> None:
        """A large heap: ``objects`` more objects, kept alive (freeing them would add a pause
        of its own). Automatic collections stay off until :meth:`full_collection`: a young
        one over the new objects would be a long pause of its own, and one started on
        another thread would make that call return at once."""
        gc.disable()
        self.heap += [[] for _ in range(objects)]

    def full_collection(self, step: int) -> None:
        """What a script with a large heap does now and then: a full garbage collection,
        which holds the GIL throughout; automatic collections on again after it."""
        self.collect = False
        try:
            started = time.perf_counter()
            gc.collect()
            took = time.perf_counter() - started
        finally:
            gc.enable()
        emit(ev="collected", seconds=took, step=step, t=time.time())

    def should_stop(self, step: int) -> bool:
        return self.closed.is_set() or (self.stop_at is not None and step >= self.stop_at)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"],
                        help="communicator backend; nccl trains on the current CUDA device")
    parser.add_argument("--bind", default=None, help="gossip address HOST:PORT (default: automatic)")
    parser.add_argument("--peers", default=None, help="comma-separated gossip addresses of other workers")
    parser.add_argument("--steps", type=int, default=300, help="committed steps to train")
    parser.add_argument("--global-batch", type=int, default=256, help="samples per step (constant global batch)")
    parser.add_argument("--worker-batch", type=int, default=None,
                        help="fixed per-worker batch instead, with the learning rate scaled linearly by world size")
    parser.add_argument("--lr-reference-world", type=int, default=4, help="world size --lr is tuned for (--worker-batch)")
    parser.add_argument("--lr-warmup", type=int, default=0, help="steps to move to a new learning rate (--worker-batch)")
    parser.add_argument("--micro-batch", type=int, default=None, help="largest forward/backward (gradient accumulation)")
    parser.add_argument("--loader-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--log-indices", action="store_true", help="emit each committed step's sample indices")
    parser.add_argument("--checkpoint-dir", default=None, help="flash checkpoints persisted here")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    parser.add_argument("--checkpoint-name", default="train-elastic", help="the job's name in /dev/shm")
    parser.add_argument("--settle-interval", type=float, default=None, help="GroupOptions.settle_interval")
    parser.add_argument("--ddp-rank", type=int, default=None, help="run under torch DDP as this rank")
    parser.add_argument("--ddp-world", type=int, default=None)
    parser.add_argument("--ddp-port", type=int, default=None, help="TCP port of the DDP rendezvous on 127.0.0.1")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0, help="seed of the task and the initial model")
    parser.add_argument("--min-workers", type=int, default=None, help="default: $FTCOMM_MIN_WORKERS, else 1")
    parser.add_argument("--max-workers", type=int, default=None, help="default: $FTCOMM_MAX_WORKERS, else none")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds of work per step")
    parser.add_argument("--report-every", type=int, default=50)
    parser.add_argument("--control", action="store_true", help="read fault-injection commands on stdin")
    parser.add_argument("--gossip", default="{}", help="GossipConfig overrides as JSON")
    parser.add_argument("--options", default="{}",
                        help='other GroupOptions as JSON, e.g. \'{"straggler_policy": "exclude"}\'')
    parser.add_argument("--sync-every", type=int, default=0, help="DiLoCo: inner steps per outer step (0: off)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate (Nesterov, 0.9)")
    parser.add_argument("--local-sgd", action="store_true", help="with --sync-every: LocalSGD (parameter averaging)")
    parser.add_argument("--fragments", type=int, default=1,
                        help="with --sync-every: Streaming DiLoCo, the model in this many fragments taking turns")
    parser.add_argument("--quantize", choices=["bf16", "fp16", "int8"], default=None,
                        help="with --sync-every: DiLoCo's pseudo-gradients summed in this dtype")
    parser.add_argument("--delay", type=int, default=0,
                        help="with --sync-every: each outer step's reduction overlaps this many inner steps")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width (3150: about 10M parameters)")
    parser.add_argument("--log-level", default="WARNING", help="library log level, on stderr")
    args = parser.parse_args(argv)
    if (args.fragments != 1 or args.quantize or args.delay) and (not args.sync_every or args.local_sgd):
        parser.error("--fragments, --quantize and --delay are DiLoCo's: give --sync-every, not --local-sgd")
    if args.fragments < 1 or (args.sync_every and args.sync_every % args.fragments):
        parser.error("--fragments must be a positive divisor of --sync-every")
    if args.sync_every and not 0 <= args.delay < args.sync_every // args.fragments:
        parser.error("--delay must be from 0 to --sync-every / --fragments - 1")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints every thread's stack

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if args.backend == "nccl" else "cpu")
    x, y = (t.to(device) for t in make_task(args.seed))
    model = make_model(hidden=args.hidden).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.ddp_rank is not None:
        return train_ddp(args, x, y, model, optimizer)
    faults = FaultFilter() if args.control else None
    gossip = GossipConfig().with_overrides(**json.loads(args.gossip))
    emit(ev="started", pid=os.getpid(), restarts=int(os.environ.get("FTCOMM_RESTARTS", "0")), t=time.time())
    init_started = time.time()
    ft = ftcomm.init(backend=args.backend, peers=args.peers, bind=args.bind, min_workers=args.min_workers,
                     **({"max_workers": args.max_workers} if args.max_workers is not None else {}),
                     gossip=gossip, fault_filter=faults,
                     **({"settle_interval": args.settle_interval} if args.settle_interval is not None else {}),
                     **json.loads(args.options))
    sampler = make_sampler(args, len(x))
    extras = {}
    if args.worker_batch is not None:
        extras["lr_scaling"] = ftcomm.LinearLRScaling(optimizer, args.lr_reference_world, args.lr_warmup)
    diloco = None
    if args.sync_every:  # low-communication training: the model and its optimizer are each worker's own
        if args.local_sgd:
            diloco = ftcomm.LocalSGD(ft, model, optimizer, sync_every=args.sync_every)
        else:
            outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=0.9, nesterov=True)
            diloco = ftcomm.DiLoCo(ft, model, optimizer, outer_optimizer=outer, sync_every=args.sync_every,
                                   fragments=args.fragments, quantize=args.quantize, delay=args.delay)
        ft.register_state(diloco=diloco, sampler=sampler, **extras)
        net = model
    else:
        ft.register_state(model=model, optimizer=optimizer, sampler=sampler, **extras)
        net = ft.wrap(model)  # DDP's C++ reducer fills the gradient buckets; ftcomm reduces them over the view
    checkpoints = None
    if args.checkpoint_dir:
        checkpoints = ftcomm.FlashCheckpointer(ft, args.checkpoint_dir, name=args.checkpoint_name)
        restored = checkpoints.restore()
        emit(ev="restored", step=restored, t=time.time())
    emit(ev="ready", id=ft.id, address=ft.gossip.address, pid=os.getpid(), rank=ft.rank,
         world=ft.world_size, t=time.time())
    control = Control(faults) if args.control else None
    if control is not None:
        threading.Thread(target=control.loop, args=(ft,), daemon=True).start()

    loader = make_loader(args, x, y, sampler)
    reported = stragglers_seen = 0
    awaiting_commit = True  # report the first committed step after each view change
    loss = torch.zeros(())
    while ft.step < args.steps and not (control and control.should_stop(ft.step)):
        for inputs, targets in sampler.steps(loader):
            if control is not None and control.collect:
                control.full_collection(ft.step)
            for (xb, yb), weight in sampler.micro_batches(inputs, targets):
                loss = F.cross_entropy(net(xb), yb)
                (loss * weight).backward()
            if control is not None and control.fail:
                raise RuntimeError("failure injected by the control command 'fail'")
            step_time = control.step_time if control is not None and control.step_time is not None else args.step_time
            if step_time:
                time.sleep(step_time)  # stands in for a heavier model's compute
            if diloco is not None:
                committed = diloco.step()  # an inner step; at the end of the outer step, True or False
                if control is not None and control.in_flight is not None and diloco.in_flight:
                    emit(ev="in_flight", signal=control.in_flight.name, step=ft.step, t=time.time())
                    sig, control.in_flight = control.in_flight, None
                    os.kill(os.getpid(), sig)
            else:
                committed = ft.wait_gradients_ready(net)
                if committed:
                    optimizer.step()
            if committed:
                if args.log_indices:
                    share = sampler.committed
                    emit(ev="batch", step=ft.step, epoch=share.epoch, start=share.start, size=share.size,
                         world=share.world, pid=os.getpid(),
                         idx=[i for part in sampler.committed_parts if part.count for i in sampler.indices(part)])
                if awaiting_commit:
                    awaiting_commit = False
                    emit(ev="first_step", pid=os.getpid(), view_id=ft.view.id, step=ft.step, since_init_s=time.time() - init_started,
                         t=time.time())
                if checkpoints is not None and args.checkpoint_every and ft.step % args.checkpoint_every == 0:
                    emit(ev="checkpoint", step=ft.step, pause_s=checkpoints.save(), t=time.time())
            if diloco is None:
                optimizer.zero_grad()
            while reported < len(ft.events):
                emit(ev="view", t=time.time(), **dataclasses.asdict(ft.events[reported]))
                reported += 1
                awaiting_commit = True
            for report in ft.stragglers[stragglers_seen:]:
                emit(ev="straggler", **dataclasses.asdict(report))
            stragglers_seen = len(ft.stragglers)
            if ft.step % args.report_every == 0 and committed is not None:
                emit(ev="step", step=ft.step, rank=ft.rank, world=ft.world_size, epoch=sampler.epoch,
                     loss=round(loss.item(), 4), t=time.time())
            if ft.step >= args.steps or (control and control.should_stop(ft.step)):
                break
    final_loss, accuracy = evaluate(model, x, y)
    if checkpoints is not None:
        checkpoints.close()
    emit(ev="done", id=ft.id, step=ft.step, rank=ft.rank, world=ft.world_size, loss=round(final_loss, 5),
         accuracy=round(accuracy, 5), digest=ft.state.digest(ft.step), views=len(ft.events), epoch=sampler.epoch,
         t=time.time())
    ft.shutdown()
    return 0


def make_sampler(args, size: int, **place) -> ftcomm.ElasticSampler:
    """``--worker-batch`` selects the fixed-per-worker-batch policy over ``--global-batch``."""
    global_batch = args.global_batch if args.worker_batch is None else None
    return ftcomm.ElasticSampler(size, global_batch=global_batch, worker_batch=args.worker_batch, seed=args.seed,
                                 micro_batch=args.micro_batch, **place)


def make_loader(args, x, y, sampler) -> DataLoader:
    """Loader worker processes are spawned, not forked: a fork would inherit this worker's
    sockets (a crashed worker's ports would stay open, hiding the crash from its peers' fast
    path) and whatever locks its threads hold. Not from a fork server either: its children
    keep it alive and watch it instead of this process, so they would outlive a kill -9 of
    this worker; spawned ones see their parent die and exit within seconds."""
    if not args.loader_workers:
        return DataLoader(TensorDataset(x, y), batch_sampler=sampler)
    return DataLoader(TensorDataset(x, y), batch_sampler=sampler, num_workers=args.loader_workers,
                      multiprocessing_context="spawn", persistent_workers=True)


def evaluate(model, x, y) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(x)
        return F.cross_entropy(logits, y).item(), (logits.argmax(dim=1) == y).float().mean().item()


def train_ddp(args, x, y, model, optimizer) -> int:
    """The same training on a fixed world under torch DDP: the reference curve."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.ddp_port}", rank=args.ddp_rank,
                            world_size=args.ddp_world)
    ddp = DistributedDataParallel(model)
    sampler = make_sampler(args, len(x), rank=args.ddp_rank, world_size=args.ddp_world)
    loader = make_loader(args, x, y, sampler)
    step = 0
    while step < args.steps:
        for inputs, targets in sampler.steps(loader):
            for (xb, yb), weight in sampler.micro_batches(inputs, targets):
                loss = F.cross_entropy(ddp(xb), yb)
                (loss * weight).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.report_every == 0:
                emit(ev="step", step=step, rank=args.ddp_rank, world=args.ddp_world, loss=round(loss.item(), 4),
                     t=time.time())
            if step >= args.steps:
                break
    final_loss, accuracy = evaluate(model, x, y)
    emit(ev="done", step=step, rank=args.ddp_rank, world=args.ddp_world, loss=round(final_loss, 5),
         accuracy=round(accuracy, 5), t=time.time())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
