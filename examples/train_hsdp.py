"""Fault-tolerant HSDP: FSDP2 inside each replica, ftcomm across replicas.

Each replica is K processes that shard one MLP with FSDP2 over ``ft.shard_mesh``; the
replicas average their gradient shards through ftcomm. Run it under the launcher, which
makes each K consecutive local ranks one replica and restarts a replica as a whole when
one of its processes fails:

    ftcomm run --nproc-per-node 4 --replica-size 2 examples/train_hsdp.py --steps 200

Kill any process (``kill -9``): its replica leaves, the other replicas commit again, and
the launcher starts the replica again, which rejoins and receives every shard from a live
replica. Data comes from an ``ftcomm.ElasticSampler`` over all ``replicas x K`` processes:
every sample of an epoch is trained on exactly once across the failures. With
``--checkpoint-dir`` each process flash-checkpoints its own shards every
``--checkpoint-every`` steps, and a whole-job restart restores the newest step that some
process of every shard index can load.

Every line on stdout is a JSON object: ``init`` (``ftcomm.init`` is next), ``ready``, one ``view`` per view change, ``batch``
for every committed step with ``--log-indices``, a ``step`` every ``--report-every``
committed steps, ``restored`` after a checkpoint restore, ``corruption`` for each check
whose state fingerprints differed (``flipped`` where ``--flip-bit-at`` flipped a bit), and
``done`` with this process's shard digest. ``--plain-rank``/
``--plain-world``/``--plain-port`` run the same training as plain FSDP2 HSDP on a fixed
``("replicate", "shard")`` mesh instead (the baseline of benchmarks/hsdp.py).

``--sync-every H`` trains with ``ftcomm.DiLoCo`` instead (each replica alone for H inner
steps, then an outer step that averages each shard's pseudo-gradient across the replicas;
``--fragments``, ``--quantize``, ``--delay`` as its arguments): a committed step is then an outer step,
and its ``batch`` event lists this process's share of every inner batch of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import ftcomm
from train_elastic import make_task  # the same synthetic task (this directory is on the path when run)


def make_model(mesh, seed: int, hidden: int, features: int = 32, classes: int = 4) -> torch.nn.Module:
    """The MLP, each linear layer sharded over ``mesh`` (FSDP2), then the whole; without a
    mesh (a replica of one process) not sharded."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))
    if mesh is None:
        return model
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def emit(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="committed steps to train")
    parser.add_argument("--global-batch", type=int, default=256, help="samples per step over all processes")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width of the MLP")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0, help="seed of the task and the initial model")
    parser.add_argument("--min-workers", type=int, default=None,
                        help="replicas needed to train (default: $FTCOMM_MIN_WORKERS, else 1)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds of work per step")
    parser.add_argument("--report-every", type=int, default=50)
    parser.add_argument("--log-indices", action="store_true", help="emit each committed step's sample indices")
    parser.add_argument("--no-overlap", action="store_true",
                        help="reduce the gradient shards across replicas after backward, not during it")
    parser.add_argument("--checkpoint-dir", default=None, help="flash checkpoints persisted here (one per shard)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    parser.add_argument("--checkpoint-name", default="train-hsdp", help="the job's name in /dev/shm")
    parser.add_argument("--rebuild-time", type=float, default=0.0,
                        help="extra seconds a restarted process spends building its model after init "
                             "(stands in for a large model's load)")
    parser.add_argument("--flip-bit-at", type=int, default=None, metavar="STEP",
                        help="testing: at committed STEP, the process of rank --flip-rank flips one bit of its "
                             "shard of the first parameter (silent data corruption; see fingerprint_every)")
    parser.add_argument("--flip-rank", type=int, default=1)
    parser.add_argument("--sync-every", type=int, default=0,
                        help="train with DiLoCo: an outer step across the replicas every this many inner steps")
    parser.add_argument("--fragments", type=int, default=1, help="with --sync-every: Streaming DiLoCo's fragments")
    parser.add_argument("--quantize", choices=["bf16", "fp16", "int8"], default=None,
                        help="with --sync-every: the dtype the pseudo-gradients are summed in")
    parser.add_argument("--delay", type=int, default=0,
                        help="with --sync-every: each outer step's reduction overlaps this many inner steps")
    parser.add_argument("--log-level", default="WARNING", help="library log level, on stderr")
    parser.add_argument("--plain-rank", type=int, default=None, help="run as plain FSDP2 HSDP, this rank")
    parser.add_argument("--plain-world", type=int, default=None)
    parser.add_argument("--plain-shards", type=int, default=2, help="plain HSDP: processes per replica")
    parser.add_argument("--plain-port", type=int, default=None, help="plain HSDP: TCP port of the rendezvous")
    args = parser.parse_args(argv)
    if (args.fragments != 1 or args.quantize or args.delay) and not args.sync_every:
        parser.error("--fragments, --quantize and --delay are DiLoCo's: give --sync-every")
    if args.sync_every and args.plain_rank is not None:
        parser.error("--sync-every trains through ftcomm: not with --plain-rank")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    x, y = make_task(args.seed)
    if args.plain_rank is not None:
        return train_plain(args, x, y)

    emit(ev="init", pid=os.getpid(), t=time.time())
    ft = ftcomm.init(backend="gloo", min_workers=args.min_workers,  # the replica comes from `ftcomm run`
                     overlap=not args.no_overlap)
    restarts = int(os.environ.get("FTCOMM_RESTARTS", "0"))
    if restarts and args.rebuild_time:
        emit(ev="building", pid=os.getpid(), seconds=args.rebuild_time, t=time.time())
        time.sleep(args.rebuild_time)
    model = make_model(ft.shard_mesh, args.seed, args.hidden)  # (replicas of one process: not sharded)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sampler = ftcomm.ElasticSampler(len(x), global_batch=args.global_batch, seed=args.seed)
    diloco = None
    if args.sync_every:
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        diloco = ftcomm.DiLoCo(ft, model, optimizer, outer_optimizer=outer, sync_every=args.sync_every,
                               fragments=args.fragments, quantize=args.quantize, delay=args.delay)
        ft.register_state(diloco=diloco, sampler=sampler)
    else:
        ft.register_state(model=model, optimizer=optimizer, sampler=sampler)
    checkpoints = None
    if args.checkpoint_dir:  # a whole-job restart restores the newest step some process of every shard index can load
        checkpoints = ftcomm.FlashCheckpointer(ft, args.checkpoint_dir, name=args.checkpoint_name)
        emit(ev="restored", step=checkpoints.restore(), shard=ft.shard_rank, t=time.time())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    emit(ev="ready", id=ft.id, pid=os.getpid(), rank=ft.rank, world=ft.world_size, shard=ft.shard_rank,
         param_bytes=sum(t.numel() * t.element_size() for t in local),
         replica=ft.replica_rank, replicas=ft.num_replicas, restarts=restarts,
         t=time.time())
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_sampler=sampler)
    reported = found = 0
    flip = args.flip_bit_at if restarts == 0 else None
    loss = torch.zeros(())
    while ft.step < args.steps:
        for inputs, targets in sampler.steps(loader):
            if flip is not None and ft.step == flip and ft.rank == args.flip_rank:
                with torch.no_grad():  # what a faulty memory cell does to one value
                    local[0].view(-1).view(torch.int32)[0] ^= 1 << 20
                emit(ev="flipped", step=ft.step, id=ft.id, shard=ft.shard_rank, t=time.time())
                flip = None
            loss = F.cross_entropy(model(inputs), targets)
            loss.backward()
            if args.step_time:
                time.sleep(args.step_time)  # stands in for a heavier model's compute
            if diloco is not None:
                committed = diloco.step()  # the inner step; every --sync-every of them the outer step
            elif ft.wait_gradients_ready(model):
                optimizer.step()
                committed = True
            else:
                committed = False
            if committed:
                if args.log_indices:
                    share = sampler.committed
                    idx = [i for part in sampler.committed_parts if part.count for i in sampler.indices(part)]
                    emit(ev="batch", step=ft.step, epoch=share.epoch, start=share.start, size=share.size,
                         world=share.world, rank=share.rank, idx=idx)  # the rank it was planned for
                if checkpoints is not None and args.checkpoint_every and ft.step % args.checkpoint_every == 0:
                    checkpoints.save()
            optimizer.zero_grad()
            while found < len(ft.corruptions):
                emit(ev="corruption", t=time.time(), **dataclasses.asdict(ft.corruptions[found]))
                found += 1
            while reported < len(ft.events):
                emit(ev="view", shard=ft.shard_rank, t=time.time(), **dataclasses.asdict(ft.events[reported]))
                reported += 1
            if ft.step % args.report_every == 0 and (diloco is None or committed):
                emit(ev="step", step=ft.step, rank=ft.rank, world=ft.world_size, loss=round(loss.item(), 4),
                     t=time.time())
            if ft.step >= args.steps:
                break
    if checkpoints is not None:
        checkpoints.close()
    emit(ev="done", id=ft.id, step=ft.step, rank=ft.rank, world=ft.world_size, shard=ft.shard_rank,
         digest=ft.state.digest(ft.step), views=len(ft.events), loss=round(loss.item(), 5),
         corruptions=[dataclasses.asdict(c) for c in ft.corruptions], t=time.time())
    ft.shutdown()
    return 0


def train_plain(args, x, y) -> int:
    """The same training as plain FSDP2 HSDP on a fixed ("replicate", "shard") mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.plain_port}", rank=args.plain_rank,
                            world_size=args.plain_world)
    shards = args.plain_shards
    mesh = init_device_mesh("cpu", (args.plain_world // shards, shards), mesh_dim_names=("replicate", "shard"))
    model = make_model(mesh, args.seed, args.hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    sampler = ftcomm.ElasticSampler(len(x), global_batch=args.global_batch, seed=args.seed, rank=args.plain_rank,
                                    world_size=args.plain_world)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_sampler=sampler)
    step = 0
    while step < args.steps:
        for inputs, targets in sampler.steps(loader):
            F.cross_entropy(model(inputs), targets).backward()
            if args.step_time:
                time.sleep(args.step_time)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.report_every == 0:
                emit(ev="step", step=step, rank=args.plain_rank, world=args.plain_world, t=time.time())
            if step >= args.steps:
                break
    emit(ev="done", step=step, rank=args.plain_rank, world=args.plain_world, t=time.time())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
