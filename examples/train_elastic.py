"""Elastic data-parallel training of a small MLP with ftcomm.

The task is a synthetic classification problem generated from a seed (a random teacher
network labels Gaussian inputs), so nothing is downloaded. Start several of these on
one machine or many; kill, stop, add or remove any of them while they train:

    python examples/train_elastic.py --bind 127.0.0.1:7000 --steps 300
    python examples/train_elastic.py --bind 127.0.0.1:7001 --peers 127.0.0.1:7000 --steps 300

Every line on stdout is a JSON object: ``ready``, one ``view`` per view change, a
``step`` every ``--report-every`` committed steps, and ``done`` with the final loss,
accuracy and state digest. With ``--control``, JSON commands on stdin drive the fault
filter of the gossip layer (``partition``, ``heal``), stop training at a given step
(``stop_at``), report progress (``status``) or make the training loop raise an uncaught
exception (``fail``), for tests and demos; the worker then also stops when stdin closes.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F

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
    """Commands on stdin (with --control): partition, heal, stop_at, status, fail."""

    def __init__(self, faults: FaultFilter) -> None:
        self.faults = faults
        self.stop_at: int | None = None
        self.fail = False
        self.closed = threading.Event()

    def loop(self, ft) -> None:
        for line in sys.stdin:
            command = json.loads(line)
            name = command["cmd"]
            if name == "partition":
                self.faults.partition(command["a"], command["b"])
            elif name == "heal":
                self.faults.heal()
            elif name == "fail":
                self.fail = True
            elif name == "stop_at":
                self.stop_at = int(command["step"])
            elif name == "status":
                emit(ev="status", step=ft.step, t=time.time())
                continue
            emit(ev="ok", cmd=name, t=time.time())
        self.closed.set()

    def should_stop(self, step: int) -> bool:
        return self.closed.is_set() or (self.stop_at is not None and step >= self.stop_at)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bind", default=None, help="gossip address HOST:PORT (default: automatic)")
    parser.add_argument("--peers", default=None, help="comma-separated gossip addresses of other workers")
    parser.add_argument("--steps", type=int, default=300, help="committed steps to train")
    parser.add_argument("--batch", type=int, default=64, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0, help="seed of the task and the initial model")
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=None)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds of work per step")
    parser.add_argument("--report-every", type=int, default=50)
    parser.add_argument("--control", action="store_true", help="read fault-injection commands on stdin")
    parser.add_argument("--gossip", default="{}", help="GossipConfig overrides as JSON")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width (3150: about 10M parameters)")
    parser.add_argument("--log-level", default="WARNING", help="library log level, on stderr")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid> prints every thread's stack

    torch.manual_seed(args.seed)
    x, y = make_task(args.seed)
    model = make_model(hidden=args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    faults = FaultFilter() if args.control else None
    gossip = GossipConfig().with_overrides(**json.loads(args.gossip))
    init_started = time.time()
    ft = ftcomm.init(backend="gloo", peers=args.peers, bind=args.bind, min_workers=args.min_workers,
                     max_workers=args.max_workers, gossip=gossip, fault_filter=faults)
    ft.register_state(model=model, optimizer=optimizer)
    emit(ev="ready", id=ft.id, address=ft.gossip.address, pid=__import__("os").getpid(), rank=ft.rank,
         world=ft.world_size, t=time.time())
    control = Control(faults) if args.control else None
    if control is not None:
        threading.Thread(target=control.loop, args=(ft,), daemon=True).start()

    reported = 0
    awaiting_commit = True  # report the first committed step after each view change
    generator = torch.Generator()
    while ft.step < args.steps and not (control and control.should_stop(ft.step)):
        # Each worker draws its own batch for this step; (step, rank) makes it reproducible.
        generator.manual_seed(args.seed * 1_000_003 + ft.step * 1009 + ft.rank)
        index = torch.randint(0, len(x), (args.batch,), generator=generator)
        loss = F.cross_entropy(model(x[index]), y[index])
        if control is not None and control.fail:
            raise RuntimeError("failure injected by the control command 'fail'")
        loss.backward()
        if args.step_time:
            time.sleep(args.step_time)  # stands in for a heavier model's compute
        if ft.wait_gradients_ready(model):
            optimizer.step()
            if awaiting_commit:
                awaiting_commit = False
                emit(ev="first_step", view_id=ft.view.id, step=ft.step, since_init_s=time.time() - init_started,
                     t=time.time())
        optimizer.zero_grad()
        while reported < len(ft.events):
            emit(ev="view", t=time.time(), **dataclasses.asdict(ft.events[reported]))
            reported += 1
            awaiting_commit = True
        if ft.step % args.report_every == 0:
            emit(ev="step", step=ft.step, rank=ft.rank, world=ft.world_size, loss=round(loss.item(), 4),
                 t=time.time())
    with torch.no_grad():
        logits = model(x)
        final_loss = F.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    emit(ev="done", id=ft.id, step=ft.step, rank=ft.rank, world=ft.world_size, loss=round(final_loss, 5),
         accuracy=round(accuracy, 5), digest=ft.state.digest(ft.step), views=len(ft.events), t=time.time())
    ft.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
