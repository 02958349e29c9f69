"""Elastic data: a batch sampler whose samples are consumed exactly once per epoch across view changes.

Each epoch is a permutation of ``range(size)`` seeded by ``(seed, epoch)``. The
sampler's registered state is only ``(epoch, offset)``: the position in that
permutation up to which committed steps have consumed samples. A step takes the next
``S`` samples (``S`` is the global batch; the last step of an epoch may be shorter)
and splits them over the current world by rank, so whatever sequence of crashes,
hangs, leaves and joins happens:

* a committed step advances the offset by exactly the samples its workers trained on
  (the group commits a step only if *every* member's batch was planned at that offset
  for that world, see :meth:`ElasticSampler.batch_valid`);
* a discarded step advances nothing: its samples are planned again, split over the
  new world;
* joiners and restarted workers receive ``(epoch, offset)`` with the rest of the state.

Batches can be planned ahead of the step that uses them (``DataLoader`` worker
processes prefetch). A batch planned before a view change or a discarded step no
longer matches the plan; :meth:`ElasticSampler.steps` skips such batches before any
compute is spent on them.

With low-communication training (:class:`ftcomm.DiLoCo`, :class:`ftcomm.LocalSGD`) a
committed step is an *outer* step of ``H`` inner steps that each worker trains alone:
the step takes ``H`` global batches at once, each split over the world by rank, and
yields them one inner step at a time (:meth:`ElasticSampler.plan_inner_steps`). The
outer step commits as one, so every inner batch of it is consumed exactly once too; a
discarded outer step's inner batches are planned again over the new world.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sized

import torch

from ..errors import FtcommError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Batch:
    """One worker's share of one step: positions ``[lo, lo + count)`` of the epoch's permutation.

    ``start``/``size``: the whole step (all workers) in the permutation. ``count`` 0
    means this worker has no sample in the step (an epoch's short last step with fewer
    samples than workers): it is given one index of the step with weight 0.

    An outer step of inner steps (``local``: each worker trains its inner steps alone)
    holds ``parts`` inner batches; this is inner batch ``part`` of it, and ``lo``/``count``
    this worker's share of that inner batch.
    """

    epoch: int
    start: int
    size: int
    rank: int
    world: int
    lo: int
    count: int
    part: int = 0
    parts: int = 1
    local: bool = False

    def weight(self, samples: int) -> float:
        """The factor that turns the mean loss over ``samples`` of this share into its part of
        the step's global mean, once the group averages over ``world`` workers (of this
        worker's share, for an inner step trained alone)."""
        if not self.count:
            return 0.0
        return samples / self.count if self.local else samples * self.world / self.size


def epoch_permutation(size: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The order in which an epoch visits ``range(size)``: identical on every worker."""
    if not shuffle:
        return torch.arange(size)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (1 << 63))
    return torch.randperm(size, generator=generator)


def share(start: int, size: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s positions ``(lo, count)`` among ``size`` samples at ``start`` split over ``world``."""
    base, extra = divmod(size, world)
    return start + rank * base + min(rank, extra), base + (rank < extra)


class ElasticSampler:
    """A batch sampler (``DataLoader(dataset, batch_sampler=sampler)``) for elastic training.

    Exactly one of ``global_batch`` and ``worker_batch`` is given; it selects the
    batch-size policy:

    * ``global_batch`` (constant global batch, the default policy): every step consumes
      ``global_batch`` samples whatever the world size; each worker's share is
      ``global_batch / world`` (remainder to the lowest ranks). With ``micro_batch``,
      :meth:`micro_batches` splits a share larger than that into gradient-accumulation
      steps, so memory stays bounded when the world shrinks.
    * ``worker_batch``: each worker takes ``worker_batch`` samples, so a step consumes
      ``worker_batch * world``; pair it with :class:`ftcomm.LinearLRScaling`.

    ``dataset``: a sized dataset or the number of samples (an index range the caller
    maps to records). ``drop_last``: drop an epoch's last step when it has fewer samples
    than a full step; otherwise it is a short step. Either way no sample is repeated.
    ``rank``/``world_size`` are used only when the sampler is not registered with a
    group (plain, non-elastic use): then every yielded batch counts as consumed.

    Register it with the group (``ft.register_state(sampler=sampler)``) so its state is
    reconciled and saved and the group tells it which steps committed.
    """

    def __init__(self, dataset: Sized | int, global_batch: int | None = None, worker_batch: int | None = None, *,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, micro_batch: int | None = None,
                 rank: int = 0, world_size: int = 1) -> None:
        self.size = dataset if isinstance(dataset, int) else len(dataset)
        if (global_batch is None) == (worker_batch is None):
            raise ValueError("give exactly one of global_batch (constant global batch) and worker_batch "
                             "(fixed per-worker batch, with LinearLRScaling)")
        batch = global_batch if global_batch is not None else worker_batch
        if batch < 1 or self.size < 1 or (micro_batch is not None and micro_batch < 1):
            raise ValueError(f"need a dataset of at least one sample and positive batch sizes, got size={self.size}, "
                             f"batch={batch}, micro_batch={micro_batch}")
        self.global_batch, self.worker_batch = global_batch, worker_batch
        self.seed, self.shuffle, self.drop_last, self.micro_batch = seed, shuffle, drop_last, micro_batch
        self.epoch = 0
        self.offset = 0  # positions of this epoch's permutation consumed by committed steps
        self.committed: Batch | None = None  # this worker's share of the last committed step
        self.committed_parts: list[Batch] = []  # ... each of its inner batches (the share alone without inner steps)
        self._standalone = (rank, world_size)
        self._group: Any = None
        self._pending: collections.deque[Batch] = collections.deque()  # yielded, step not ended yet
        self._restart = False  # batches planned so far are stale: plan again from the offset
        self._skipping = False  # iterated through steps(), which skips stale batches
        self._permutation: tuple[int, torch.Tensor] | None = None
        self.inner_steps = 1  # inner batches per committed step (plan_inner_steps)
        self._local = False  # inner steps are trained alone (low-communication training)
        self._drawn = 0  # with inner steps: inner batches of the current step drawn by the training loop
        self._stepped = 0  # ... and inner steps taken on them (DiLoCo.step)

    # ------------------------------------------------------------------ plan
    @property
    def policy(self) -> str:
        return "constant_global_batch" if self.global_batch is not None else "fixed_worker_batch"

    def _place(self) -> tuple[int, int]:
        group = self._group
        if group is None:
            return self._standalone
        return group.rank, group.world_size

    def plan_inner_steps(self, inner_steps: int) -> None:
        """Each committed step from now on is an outer step of ``inner_steps`` inner steps
        that every worker trains alone (:class:`ftcomm.DiLoCo` calls this when registered):
        the step takes ``inner_steps`` global batches (the last step of an epoch may take
        fewer) and yields them one inner step at a time, each split over the world by rank."""
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {inner_steps}")
        if self._drawn:
            raise FtcommError("plan_inner_steps between steps, not while a step's batches are drawn")
        self.inner_steps, self._local, self._restart = inner_steps, True, True

    def full_step(self, world: int) -> int:
        """Samples of a full (inner) batch for ``world`` workers under this sampler's policy."""
        return self.global_batch if self.global_batch is not None else self.worker_batch * world

    def step_size(self, start: int, world: int) -> int:
        """Samples of the step at position ``start`` for ``world`` workers (all its inner
        batches); 0 when the epoch is over."""
        full, remaining = self.full_step(world), self.size - start
        if self._local:  # the epoch's last outer step is shorter; drop_last drops its incomplete inner batch
            if self.drop_last:
                remaining -= remaining % full
            return max(min(full * self.inner_steps, remaining), 0)
        if remaining <= 0 or (self.drop_last and remaining < full):
            return 0
        return min(full, remaining)

    def plan(self, epoch: int, start: int) -> Batch | None:
        """This worker's share of the step at ``start`` of ``epoch`` in the current world (its
        first inner batch, with inner steps)."""
        parts = self.plan_parts(epoch, start)
        return parts[0] if parts else None

    def plan_parts(self, epoch: int, start: int) -> list[Batch]:
        """This worker's share of each inner batch of the step at ``start`` of ``epoch`` in the
        current world (one, without inner steps); empty when the epoch is over."""
        rank, world = self._place()
        size = self.step_size(start, world)
        if size == 0:
            return []
        if not self._local:
            lo, count = share(start, size, rank, world)
            return [Batch(epoch, start, size, rank, world, lo, count)]
        inner = self.full_step(world)
        bounds = range(start, start + size, inner)
        batches = []
        for part, lo in enumerate(bounds):
            first, count = share(lo, min(inner, start + size - lo), rank, world)
            batches.append(Batch(epoch, start, size, rank, world, first, count, part, len(bounds), True))
        return batches

    def indices(self, batch: Batch) -> list[int]:
        """The dataset indices of a share (one index of the step, weight 0, for an empty share)."""
        if self._permutation is None or self._permutation[0] != batch.epoch:
            self._permutation = (batch.epoch, epoch_permutation(self.size, self.seed, batch.epoch, self.shuffle))
        order = self._permutation[1]
        if batch.count == 0:
            return [int(order[batch.start])]
        return order[batch.lo:batch.lo + batch.count].tolist()

    def __len__(self) -> int:
        """Steps left in the current epoch at the current world size."""
        _, world = self._place()
        steps, start = 0, self.offset
        while (size := self.step_size(start, world)) > 0:
            steps, start = steps + (-(-size // self.full_step(world)) if self._local else 1), start + size
        return steps

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[list[int]]:
        """This worker's index list for each remaining step of the current epoch.

        Plans ahead freely (a DataLoader prefetches); the plan restarts from the
        committed offset after a view change, a discarded step or a state load. With
        inner steps, one index list per inner step.
        """
        if self._drawn:
            raise FtcommError("a new pass over the ElasticSampler began while a step's inner batches were "
                              "being drawn: iterate it once per step, through sampler.steps(loader)")
        if self._group is not None:
            self._group.step_boundary()  # a joiner plans from the group's position
        self._pending.clear()  # a new pass: batches planned for an earlier iterator are never used
        epoch, cursor = self.epoch, self.offset
        while True:
            if epoch != self.epoch:
                return  # the epoch this pass planned for is over (or a loaded state moved it)
            if self._restart:
                self._restart = False
                cursor = self.offset
            parts = self.plan_parts(epoch, cursor)
            if not parts:
                return
            cursor += parts[0].size
            for batch in parts:
                if self._restart:
                    break  # the rest of this step was planned for a world or position now gone
                if self._group is None:
                    if batch.part == batch.parts - 1:
                        self._advance(batch, parts)
                else:
                    self._pending.append(batch)
                yield self.indices(batch)

    def steps(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``loader`` (built with ``batch_sampler=self``) over the rest of the epoch.

        Yields one item per training step; each must end in ``wait_gradients_ready``
        (with inner steps: one item per inner step, and the step's last ends in its outer
        sync: :meth:`ftcomm.DiLoCo.step`). Items planned before a view change (prefetched by
        loader worker processes) are
        skipped before any compute is spent on them, and when steps were discarded near
        the end of the epoch the loader is iterated again from the committed offset, so
        the loop ends exactly when the epoch is complete.
        """
        if self._group is not None:
            self._group.step_boundary()  # a joiner plans from the group's position
        epoch = self.epoch
        self._skipping = True
        try:
            while self.epoch == epoch:
                if self.plan(self.epoch, self.offset) is None:
                    self._finish_epoch()  # a world change left less than a full step (drop_last)
                    break
                items = iter(loader)
                while True:
                    if self._group is not None and not self._drawn:
                        self._group.step_boundary()  # a joiner admitted by the last step joins before the next draw
                    try:
                        item = next(items)
                    except StopIteration:
                        break
                    if self._group is None:
                        yield item
                        continue
                    if self._local:
                        if len(self._pending) <= self._drawn:
                            raise FtcommError("sampler.steps(loader) needs a loader built with batch_sampler=sampler")
                        batch = self._pending[self._drawn]
                        if not self._drawn and not self._fits(batch, 0):
                            self._pending.popleft()  # planned before a view change: skip it
                            continue
                        self._drawn += 1
                        yield item
                        if self._drawn >= batch.parts:
                            log.warning("a step's inner steps ended without its outer sync; its batches count as "
                                        "not consumed")
                            self._drop_drawn()
                            self._restart = True
                        if self.epoch != epoch:
                            break
                        continue
                    if not self._pending:
                        raise FtcommError("sampler.steps(loader) needs a loader built with batch_sampler=sampler")
                    if not self.batch_valid():
                        self._pending.popleft()  # planned before a view change: skip it
                        continue
                    head = self._pending[0]
                    yield item
                    if self._pending and self._pending[0] is head:
                        log.warning("a step ended without wait_gradients_ready; its batch counts as not consumed")
                        self._pending.popleft()
                        self._restart = True
                    if self.epoch != epoch:
                        break
        finally:
            self._skipping = False

    def check_step(self) -> None:
        """Called by the group before a step's collective: a batch must have been drawn."""
        if self._local:  # (a loader running ahead was refused at its first inner step: inner_step_done)
            if not self._drawn:
                raise FtcommError("an outer step began but no inner batch was drawn from the ElasticSampler "
                                  "registered with the group (iterate sampler.steps(loader))")
            return
        if not self._pending:
            raise FtcommError("a step began but no batch was drawn from the ElasticSampler registered with "
                              "the group: draw exactly one batch per step (iterate sampler.steps(loader))")
        if len(self._pending) > 1 and not self._skipping:
            raise FtcommError("the DataLoader runs ahead of the training loop (worker processes prefetch); "
                              "iterate `sampler.steps(loader)` so that batches planned before a view change "
                              "are skipped instead of trained on")

    def micro_batches(self, *tensors: torch.Tensor) -> Iterator[tuple[tuple[torch.Tensor, ...], float]]:
        """Split this step's share into gradient-accumulation steps of at most ``micro_batch``.

        Yields ``(tensors, weight)``: multiply the chunk's mean loss by ``weight`` before
        ``backward()`` and the averaged gradient is the gradient of the step's global
        mean loss, at any world size. All but the last chunk run inside ``no_sync``.
        """
        if self._local:  # the inner batch being trained: counted at its draw by steps(), else at its step
            index = self._drawn - 1 if self._skipping else self._drawn
            batch = self._pending[index] if 0 <= index < len(self._pending) else None
        else:
            batch = self._pending[0] if self._pending else self.committed
        total = len(tensors[0])
        chunk = self.micro_batch or total
        bounds = list(range(0, total, chunk)) or [0]
        for i, lo in enumerate(bounds):
            part = tuple(t[lo:lo + chunk] for t in tensors)
            weight = batch.weight(len(part[0])) if batch is not None else len(part[0]) / total
            last = i == len(bounds) - 1
            quiet = self._group.no_sync() if (self._group is not None and not last and not self._local) \
                else contextlib.nullcontext()  # (an inner step trained alone starts no reduction)
            with quiet:
                yield part, weight

    # ------------------------------------------------------------------ group protocol
    def bind_group(self, group: Any) -> None:
        """Called by ``register_state``: take rank and world from ``group`` and follow its steps."""
        self._group = group
        self._restart = True

    def batch_valid(self) -> bool:
        """The batch this worker is training on was planned at the committed position for the
        current world (with inner steps: every inner batch of the step, each drawn once)."""
        if self._local:
            drawn = [self._pending[i] for i in range(min(self._drawn, len(self._pending)))]
            return bool(drawn) and len(drawn) == drawn[0].parts and all(
                self._fits(b, i) for i, b in enumerate(drawn))
        if not self._pending:
            return self._group is None
        batch = self._pending[0]
        rank, world = self._place()
        return (batch.epoch, batch.start, batch.rank, batch.world) == (self.epoch, self.offset, rank, world)

    def inner_step_done(self) -> None:
        """With inner steps: the training loop took an inner step (:meth:`ftcomm.DiLoCo.step`
        says so) on the batch it drew last. FtcommError when no batch of this sampler was
        drawn for it, or when a loader iterated directly runs ahead of the training loop."""
        if not self._local:
            return
        self._stepped += 1
        if not self._skipping:  # iterated directly: the batch planned last is the one trained on
            self._drawn += 1
            if len(self._pending) > self._drawn:
                raise FtcommError("the DataLoader runs ahead of the training loop (worker processes prefetch); "
                                  "iterate `sampler.steps(loader)` so that each inner step trains on the batch "
                                  "planned for it")
        if self._stepped > self._drawn or self._drawn > len(self._pending):
            raise FtcommError("an inner step was taken without an inner batch drawn from the ElasticSampler "
                              "registered with the group: draw exactly one batch per inner step (iterate "
                              "sampler.steps(loader))")

    def current_share(self) -> Batch | None:
        """With inner steps: this worker's share of the inner batch drawn last."""
        return self._pending[self._drawn - 1] if self._local and 0 < self._drawn <= len(self._pending) else None

    def step_drawn(self) -> bool:
        """With inner steps: the training loop took its inner step on the current step's last
        inner batch (the outer step is due)."""
        return bool(self._drawn) and bool(self._pending) and self._stepped >= self._drawn >= self._pending[0].parts

    def inner_steps_left(self) -> int:
        """With inner steps: inner steps the current step has still to take (0: the outer step
        is due, or no batch of it was drawn)."""
        if not self._local or not self._drawn or not self._pending:
            return 0
        return max(self._pending[0].parts - self._stepped, 0)

    def _fits(self, batch: Batch, part: int) -> bool:
        """``batch`` is inner batch ``part`` of the step at the committed position in this world."""
        rank, world = self._place()
        return (batch.epoch, batch.start, batch.rank, batch.world, batch.part) == \
            (self.epoch, self.offset, rank, world, part)

    def _drop_drawn(self) -> list[Batch]:
        drawn = [self._pending.popleft() for _ in range(min(self._drawn, len(self._pending)))]
        self._drawn = self._stepped = 0
        return drawn

    def step_ended(self, committed: bool) -> None:
        """Called by the group after every step: advance past a committed step's samples."""
        if self._local:
            drawn = self._drop_drawn()
            if drawn and committed:
                self._advance(drawn[-1], drawn)
            elif drawn and (drawn[0].epoch, drawn[0].start) == (self.epoch, self.offset):
                self._restart = True  # the batches planned after these assumed the step would commit
            return
        if not self._pending:
            return
        batch = self._pending.popleft()
        valid = (batch.epoch, batch.start) == (self.epoch, self.offset)
        if committed:
            self._advance(batch)
        elif valid:
            self._restart = True  # the batches planned after this one assumed it would commit

    def view_changed(self, rank: int, world: int, step: int) -> dict:
        """Called after each re-formation once the state is reconciled; what the policy does now."""
        head = self._pending[0] if self._local and self._drawn and self._pending else None
        if head is None or (head.epoch, head.start, head.rank, head.world, head.part) != \
                (self.epoch, self.offset, rank, world, 0):
            self._restart = True  # (between inner steps, a plan the new view did not change goes on)
        if self._local:
            size = min(self.step_size(self.offset, world), self.full_step(world)) or self.full_step(world)
        else:
            size = self.step_size(self.offset, world) or self.full_step(world)
        _, count = share(self.offset, size, rank, world)
        accumulation = -(-count // self.micro_batch) if self.micro_batch else 1
        policy = {"policy": self.policy, "global_batch": size, "worker_batch": count,
                  "accumulation_steps": max(accumulation, 1), "epoch": self.epoch, "offset": self.offset}
        if self._local:
            policy["inner_steps"] = self.inner_steps
        return policy

    def _advance(self, batch: Batch, parts: list[Batch] | None = None) -> None:
        self.committed, self.committed_parts = batch, parts or [batch]
        self.offset = batch.start + batch.size
        if self.plan(self.epoch, self.offset) is None:
            self._finish_epoch()

    def _finish_epoch(self) -> None:
        self.epoch, self.offset = self.epoch + 1, 0
        self._restart = True

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "size": self.size, "seed": self.seed,
                "global_batch": self.global_batch, "worker_batch": self.worker_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = (self.size, self.seed, self.global_batch, self.worker_batch)
        theirs = (state["size"], state["seed"], state["global_batch"], state["worker_batch"])
        if mine != theirs:
            raise FtcommError(f"ElasticSampler state for (size, seed, global_batch, worker_batch)={theirs} "
                              f"cannot be loaded into a sampler built with {mine}: build every worker's "
                              f"sampler with the same arguments")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._restart = True
