"""Low-communication training with ftcomm.DiLoCo: a character-level transformer on Python's own sources.

Each worker trains alone for ``--sync-every`` inner steps (AdamW), then the group takes one
outer step (Nesterov SGD on the averaged pseudo-gradients): ``--sync-every`` times fewer
bytes between workers than averaging gradients every step, for links between regions.
Start several on one machine or many; kill, stop or add any of them while they train:

    ftcomm run --nproc-per-node 4 examples/train_diloco.py --sync-every 50
    python examples/train_diloco.py --bind 127.0.0.1:7000 --sync-every 50
    python examples/train_diloco.py --bind 127.0.0.1:7001 --peers 127.0.0.1:7000 --sync-every 50

``--sync-every 0`` averages gradients every step instead (ftcomm's gradient path, DDP's
algorithm: the reference); ``--local-sgd`` averages parameters at each outer step instead
of DiLoCo's outer optimizer; ``--fragments P`` is Streaming DiLoCo (the model in P fragments,
one outer step every ``--sync-every``/P inner steps, each P times smaller) and ``--quantize
bf16`` sums the pseudo-gradients in bfloat16 (half the bytes), ``--quantize int8`` in 8-bit
integers with a scale per 256 (a quarter); ``--delay D`` sends each outer step's
pseudo-gradients D inner steps early and trains on while they travel. The corpus is the ``.py`` files of the standard library of
the Python that runs this (sorted by path, the first ``--corpus-mb`` MB), cut into windows
of ``--context`` + 1 bytes; the last 5% of the windows are held out. An
:class:`ftcomm.ElasticSampler` hands out the training windows, each exactly once per
epoch across failures. ``--checkpoint-dir`` keeps flash checkpoints of the global model,
the outer optimizer and the data position (a whole-job restart resumes at the last outer
step).

Every line on stdout is a JSON object: ``ready``; ``commit`` at every committed step with
``--report-commits``; ``eval`` at every ``--eval-every``
committed steps (outer steps with DiLoCo): the held-out loss, the samples trained so far by
the group, the seconds since ``ready``; ``done`` with the final held-out loss, the
digest of the state every worker holds equal, the steps this worker saw discarded and
the reasons of its view changes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

import ftcomm


def corpus(megabytes: float) -> torch.Tensor:
    """The first ``megabytes`` MB of the standard library's sources, as bytes."""
    root = pathlib.Path(os.__file__).parent
    chunks, size, limit = [], 0, int(megabytes * 2**20)
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data[:limit - size])
        size += len(chunks[-1])
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


class CharTransformer(torch.nn.Module):
    """A small causal transformer over bytes."""

    def __init__(self, context: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.position = torch.nn.Parameter(torch.zeros(context, width))
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        return self.head(self.norm(self.blocks(x, mask=self.mask[:n, :n], is_causal=True)))


def loss_of(model: Callable[[torch.Tensor], torch.Tensor], windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1))


def emit(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bind", default=None, help="gossip address HOST:PORT (default: automatic)")
    parser.add_argument("--peers", default=None, help="comma-separated gossip addresses of other workers")
    parser.add_argument("--min-workers", type=int, default=None, help="default: $FTCOMM_MIN_WORKERS, else 1")
    parser.add_argument("--sync-every", type=int, default=50, help="inner steps per outer step (0: every step)")
    parser.add_argument("--local-sgd", action="store_true", help="average parameters instead of DiLoCo's outer step")
    parser.add_argument("--fragments", type=int, default=1,
                        help="Streaming DiLoCo: the model in this many fragments, one outer step every "
                             "sync-every / fragments inner steps")
    parser.add_argument("--quantize", choices=["bf16", "fp16", "int8"], default=None,
                        help="DiLoCo: pseudo-gradients summed in this dtype (bf16, fp16: half the bytes; int8: a quarter)")
    parser.add_argument("--delay", type=int, default=0,
                        help="DiLoCo: each outer step's reduction overlaps this many inner steps before it")
    parser.add_argument("--steps", type=int, default=2000, help="inner steps to train (a multiple of --sync-every)")
    parser.add_argument("--global-batch", type=int, default=64, help="windows per inner step over all workers")
    parser.add_argument("--context", type=int, default=64, help="bytes a window predicts")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3, help="inner learning rate (AdamW)")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="outer learning rate (SGD, Nesterov momentum 0.9)")
    parser.add_argument("--corpus-mb", type=float, default=2.0)
    parser.add_argument("--train-windows", type=int, default=None,
                        help="train on the first N windows only (default: all but the held-out ones)")
    parser.add_argument("--eval-every", type=int, default=1, help="committed steps between held-out evaluations")
    parser.add_argument("--eval-windows", type=int, default=256, help="held-out windows per evaluation")
    parser.add_argument("--checkpoint-dir", default=None, help="flash checkpoints persisted here")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="committed steps between checkpoints")
    parser.add_argument("--report-commits", action="store_true", help="a commit line at every committed step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.sync_every and args.steps % args.sync_every:
        parser.error("--steps must be a multiple of --sync-every")
    if (args.fragments != 1 or args.quantize or args.delay) and (not args.sync_every or args.local_sgd):
        parser.error("--fragments, --quantize and --delay are DiLoCo's: give --sync-every, not --local-sgd")
    if args.fragments < 1 or (args.sync_every and args.sync_every % args.fragments):
        parser.error("--fragments must be a positive divisor of --sync-every")
    if args.sync_every and not 0 <= args.delay < args.sync_every // args.fragments:
        parser.error("--delay must be from 0 to --sync-every / --fragments - 1")

    torch.manual_seed(args.seed)
    text = corpus(args.corpus_mb)
    windows = text[:(len(text) - 1) // args.context * args.context + 1]
    count = (len(windows) - 1) // args.context
    index = torch.arange(count)[:, None] * args.context + torch.arange(args.context + 1)
    data = windows[index]  # (count, context + 1)
    held_out = data[int(count * 0.95):][:args.eval_windows]
    train = data[:int(count * 0.95)][:args.train_windows]

    model = CharTransformer(args.context, args.width, args.layers)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    ft = ftcomm.init(peers=args.peers, bind=args.bind, min_workers=args.min_workers)
    sampler = ftcomm.ElasticSampler(len(train), global_batch=args.global_batch, seed=args.seed)
    if args.sync_every:
        if args.local_sgd:
            algorithm = ftcomm.LocalSGD(ft, model, inner, sync_every=args.sync_every)
        else:
            outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=0.9, nesterov=True)
            algorithm = ftcomm.DiLoCo(ft, model, inner, outer_optimizer=outer, sync_every=args.sync_every,
                                      fragments=args.fragments, quantize=args.quantize, delay=args.delay)
        ft.register_state(diloco=algorithm, sampler=sampler)
        net = model
    else:
        algorithm = None
        ft.register_state(model=model, optimizer=inner, sampler=sampler)
        net = ft.wrap(model)
    checkpoints = ftcomm.FlashCheckpointer(ft, args.checkpoint_dir) if args.checkpoint_dir else None
    if checkpoints is not None:
        checkpoints.restore()
    emit(ev="ready", id=ft.id, rank=ft.rank, world=ft.world_size, step=ft.step, pid=os.getpid(), t=time.time())
    started = time.time()
    per_commit = args.sync_every // args.fragments or 1  # inner steps per committed step
    target = args.steps // per_commit  # committed steps to train

    def evaluate() -> float:
        """The held-out loss of the model the group holds: DiLoCo's global model (with
        fragments, the local model also holds inner steps not yet in it)."""
        with torch.no_grad():
            if algorithm is None:
                return loss_of(model, held_out).item()
            return loss_of(lambda x: torch.func.functional_call(model, algorithm.model_state(), (x,)), held_out).item()

    discarded = 0
    while ft.step < target:
        for indices in sampler:
            for (batch,), weight in sampler.micro_batches(train[torch.as_tensor(indices)]):
                (loss_of(net, batch) * weight).backward()
            if algorithm is not None:
                committed = algorithm.step()
            else:
                committed = ft.wait_gradients_ready(net)
                if committed:
                    inner.step()
                inner.zero_grad()
            discarded += committed is False
            if committed and args.report_commits:
                emit(ev="commit", step=ft.step, rank=ft.rank, world=ft.world_size, t=time.time())
            if committed:
                if ft.step % args.eval_every == 0 and ft.rank == 0:
                    emit(ev="eval", step=ft.step, samples=sampler.epoch * len(train) + sampler.offset,
                         loss=round(evaluate(), 5),
                         world=ft.world_size, seconds=round(time.time() - started, 3), t=time.time())
                if checkpoints is not None and args.checkpoint_every and ft.step % args.checkpoint_every == 0:
                    checkpoints.save()
            if ft.step >= target:
                break
    loss = evaluate()
    if checkpoints is not None:
        checkpoints.close()
    emit(ev="done", id=ft.id, rank=ft.rank, step=ft.step, loss=round(loss, 5), perplexity=round(math.exp(loss), 3),
         digest=ft.state.digest(ft.step), seconds=round(time.time() - started, 3), discarded=discarded,
         views=[e.reason for e in ft.events], t=time.time())
    ft.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
