"""ElasticSampler: exactly-once consumption per epoch, in plain use and under simulated churn."""

from __future__ import annotations

import collections
import contextlib
import random
from typing import Iterator

import pytest
import torch

from ftcomm.errors import FtcommError
from ftcomm.training.data import ElasticSampler, epoch_permutation
from ftcomm.training.scaling import LinearLRScaling


class FakeGroup:
    """What the sampler uses of a group: its place in the view, no_sync and step_boundary
    (counted: no member joins here)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world
        self.boundaries = 0

    def no_sync(self):
        return contextlib.nullcontext()

    def step_boundary(self) -> None:
        self.boundaries += 1


class PrefetchingLoader:
    """Iterates a batch sampler ``depth`` batches ahead of its consumer, as DataLoader worker processes do."""

    def __init__(self, sampler: ElasticSampler, depth: int) -> None:
        self.sampler, self.depth = sampler, depth

    def __iter__(self):
        source = iter(self.sampler)
        queue = collections.deque()
        while True:
            while len(queue) <= self.depth:
                try:
                    queue.append(next(source))
                except StopIteration:
                    break
            if not queue:
                return
            yield queue.popleft()


@pytest.mark.parametrize("drop_last", [False, True])
def test_plain_use_splits_each_epoch_over_the_ranks_exactly_once(drop_last):
    size, batch, world = 103, 16, 3
    for epoch in range(2):
        seen = []
        for rank in range(world):
            sampler = ElasticSampler(size, global_batch=batch, seed=7, drop_last=drop_last, rank=rank, world_size=world)
            sampler.epoch = epoch
            for indices in sampler:
                seen.extend(indices if len(indices) > 0 else [])
        order = epoch_permutation(size, 7, epoch).tolist()
        expected = order[:size - size % batch] if drop_last else order
        assert sorted(seen) == sorted(expected)
        assert len(seen) == len(set(seen))


def test_a_short_last_step_with_fewer_samples_than_workers_gives_weightless_indices():
    group = FakeGroup(3, 4)
    sampler = ElasticSampler(10, global_batch=8, seed=1)
    sampler.bind_group(group)
    sampler.offset = 8  # two samples left for four workers
    it = iter(sampler)
    indices = next(it)
    batch = sampler._pending[0]
    assert batch.count == 0 and len(indices) == 1 and batch.weight(1) == 0.0
    group.rank = 0
    sampler._pending.clear()
    next(iter(sampler))
    assert sampler._pending[0].count == 1 and sampler._pending[0].weight(1) == pytest.approx(4 / 2)


def test_micro_batch_weights_give_the_global_mean():
    group = FakeGroup(0, 3)
    sampler = ElasticSampler(100, global_batch=40, micro_batch=5, seed=0)
    sampler.bind_group(group)
    indices = next(iter(sampler))
    x = torch.arange(len(indices), dtype=torch.float32)
    parts = list(sampler.micro_batches(x))
    assert len(parts) == -(-len(indices) // 5)
    # sum of weight * chunk mean, averaged over 3 workers, is the chunk's share of the global mean
    total = sum(w * p[0].mean().item() for p, w in parts) / 3
    assert total == pytest.approx(x.sum().item() / 40)


def test_loading_state_of_another_configuration_is_refused():
    a = ElasticSampler(100, global_batch=10)
    b = ElasticSampler(100, global_batch=12)
    with pytest.raises(FtcommError, match="same arguments"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError):
        ElasticSampler(100, global_batch=10, worker_batch=3)


def test_a_prefetching_loader_iterated_directly_is_a_clear_error():
    sampler = ElasticSampler(100, global_batch=10)
    sampler.bind_group(FakeGroup(0, 1))
    loader = PrefetchingLoader(sampler, depth=2)
    next(iter(loader))
    with pytest.raises(FtcommError, match="sampler.steps"):
        sampler.check_step()


def test_a_member_admitted_at_the_step_boundary_gets_the_next_batch_planned_for_the_new_world():
    # The group admits a joiner between two steps (in step_boundary, before the next batch's
    # compute): the batch the loader had planned for the old world is skipped, not trained on.
    class Joining(FakeGroup):
        join_now = False

        def step_boundary(self) -> None:
            super().step_boundary()
            if self.join_now:
                self.join_now, self.world_size = False, 3
                sampler.view_changed(self.rank, 3, 0)

    sampler = ElasticSampler(120, global_batch=12, seed=0)
    group = Joining(0, 2)
    sampler.bind_group(group)
    stream = sampler.steps(PrefetchingLoader(sampler, depth=0))
    next(stream)
    assert sampler._pending[0].world == 2 and sampler.batch_valid()
    sampler.step_ended(True)
    before = group.boundaries
    group.join_now = True
    next(stream)
    assert group.boundaries > before
    assert sampler._pending[0].world == 3 and sampler.batch_valid()  # drawn after the join
    assert sampler._pending[0].start == 12  # nothing skipped over


class Worker:
    def __init__(self, sampler: ElasticSampler, group: FakeGroup, depth: int) -> None:
        self.sampler, self.group = sampler, group
        self.loader = PrefetchingLoader(sampler, depth)
        self.stream = self._batches()

    def _batches(self):
        while True:
            yield from self.sampler.steps(self.loader)


def churn_worker(sampler: ElasticSampler, depth: int, inner_steps: int | None = None) -> Worker:
    """A worker of the churn tests: its sampler bound to a group of its own, a loader
    prefetching ``depth`` batches ahead."""
    group = FakeGroup(0, 1)
    sampler.bind_group(group)
    if inner_steps is not None:
        sampler.plan_inner_steps(inner_steps)
    return Worker(sampler, group, depth)


def churn_rounds(workers: list[Worker], epochs: int) -> Iterator[None]:
    """The rounds of a churn test, until the group's samplers finished ``epochs`` (at most 2000)."""
    for _ in range(2000):
        if workers[0].sampler.epoch >= epochs:
            return
        yield
    raise AssertionError(f"the churn did not finish {epochs} epochs in 2000 rounds")


def view_change(workers: list[Worker]) -> None:
    """A view of ``workers`` in order: re-ranked, each loads the first's state (the reconcile)."""
    for rank, w in enumerate(workers):
        w.group.rank, w.group.world_size = rank, len(workers)
    leader = workers[0].sampler.state_dict()
    for w in workers:
        w.sampler.load_state_dict(leader)
        w.sampler.view_changed(w.group.rank, len(workers), 0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["global", "worker"])
def test_random_churn_consumes_every_index_exactly_once_per_epoch(seed, policy):
    """Group semantics simulated step by step: a step commits only when every member's batch is
    valid and no fault hit it; crashes, leaves and joins re-rank everyone, joiners get the state."""
    rng = random.Random(seed)
    size, epochs = 157, 4
    kwargs = {"global_batch": 12} if policy == "global" else {"worker_batch": 3}

    def new_worker():
        return churn_worker(ElasticSampler(size, seed=seed, **kwargs), rng.choice([0, 0, 1, 3]))

    workers = [new_worker() for _ in range(4)]
    view_change(workers)
    consumed: dict[int, list[int]] = collections.defaultdict(list)
    for _ in churn_rounds(workers, epochs):
        batches = [next(w.stream) for w in workers]
        for w in workers:
            w.sampler.check_step()
        event = rng.random()
        if event < 0.06 and len(workers) > 1:  # crash or leave during the step: discarded
            for w in workers:
                w.sampler.step_ended(False)
            workers.pop(rng.randrange(len(workers)))
            view_change(workers)
            continue
        if event < 0.12 and len(workers) < 6:  # a joiner admitted at this step boundary
            workers.append(new_worker())
            view_change(workers)
            joiner = workers[-1]
            next(joiner.stream)  # the joiner drew a batch before receiving the state
        valid = all(w.sampler.batch_valid() for w in workers)
        if valid:
            epoch = workers[0].sampler.epoch
            for w, indices in zip(workers, batches):
                if w.sampler._pending[0].count:
                    consumed[epoch].extend(indices)
        for w in workers:
            w.sampler.step_ended(valid)
        states = {tuple(sorted(w.sampler.state_dict().items())) for w in workers}
        assert len(states) == 1
    for epoch in range(epochs):
        assert sorted(consumed[epoch]) == list(range(size)), epoch


def test_linear_lr_scaling_follows_the_world_with_warmup():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaling = LinearLRScaling(optimizer, reference_world=4, warmup_steps=4)
    info = scaling.view_changed(0, 2, 0)
    assert info["lr_target"] == [pytest.approx(0.05)] and optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    for expected in (0.0875, 0.075, 0.0625, 0.05, 0.05):
        scaling.step_ended(True)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
    scaling.step_ended(False)
    copy = LinearLRScaling(torch.optim.SGD(model.parameters(), lr=0.1), reference_world=4)
    copy.load_state_dict(scaling.state_dict())
    assert copy.state_dict() == scaling.state_dict()
    instant = LinearLRScaling(optimizer, reference_world=2)
    instant.view_changed(0, 4, 0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize("drop_last", [False, True])
def test_with_inner_steps_each_outer_step_takes_h_global_batches_and_the_epoch_is_tiled_once(drop_last):
    """DiLoCo's plan: an outer step of 4 inner batches of 16 samples each split over 3 ranks
    (the epoch's last outer step shorter; drop_last drops its incomplete inner batch only);
    standalone samplers of every rank together visit each sample once, each inner batch a
    contiguous slice."""
    size, batch, inner, world = 150, 16, 4, 3
    order = epoch_permutation(size, 7, 0).tolist()
    seen: list[int] = []
    for rank in range(world):
        sampler = ElasticSampler(size, global_batch=batch, seed=7, drop_last=drop_last, rank=rank, world_size=world)
        sampler.plan_inner_steps(inner)
        assert len(sampler) == (9 if drop_last else 10)  # inner steps: two outer steps of 4, one of 2 (or 1)
        parts = sampler.plan_parts(0, 0)
        assert [p.part for p in parts] == [0, 1, 2, 3] and {(p.start, p.size, p.parts) for p in parts} == {(0, 64, 4)}
        for indices in sampler:
            seen.extend(indices)
        assert sampler.epoch == 1  # the last part of the last outer step advanced it
    expected = order[:144] if drop_last else order
    assert sorted(seen) == sorted(expected) and len(seen) == len(set(seen))
    short = ElasticSampler(size, global_batch=batch, seed=7, rank=0, world_size=world)
    short.plan_inner_steps(inner)
    tail = short.plan_parts(0, 128)  # 22 samples left: inner batches of 16 and 6
    assert [(p.part, p.parts, p.size) for p in tail] == [(0, 2, 22), (1, 2, 22)]
    assert [p.count for p in tail] == [6, 2] and tail[1].lo == 128 + 16


def test_inner_steps_are_weighted_by_the_worker_s_own_share_and_start_no_reduction():
    group = FakeGroup(1, 3)
    group.no_sync = lambda: pytest.fail("an inner step trained alone entered no_sync")
    sampler = ElasticSampler(300, global_batch=30, micro_batch=4, seed=0)
    sampler.bind_group(group)
    sampler.plan_inner_steps(5)
    it = iter(sampler)
    indices = next(it)
    assert len(indices) == 10 and sampler._pending[0].local
    x = torch.arange(10, dtype=torch.float32)
    parts = list(sampler.micro_batches(x))
    assert sum(w * p[0].mean().item() for p, w in parts) == pytest.approx(x.mean().item())  # this worker's mean
    sampler.inner_step_done()
    assert not sampler.step_drawn()
    for _ in range(4):
        next(it)
        sampler.inner_step_done()
    assert sampler.step_drawn() and sampler.batch_valid()
    with pytest.raises(FtcommError, match="inner batches were being drawn"):
        next(iter(sampler))  # a second pass in the middle of an outer step


@pytest.mark.parametrize("seed", range(6))
def test_with_inner_steps_random_churn_consumes_every_index_exactly_once_per_epoch(seed):
    """Outer steps of 3 inner steps under crashes during an outer step (discarded on every
    member, its inner batches planned again over the new world) and joiners admitted at
    outer boundaries, loaders prefetching: every sample once per epoch by committed steps."""
    rng = random.Random(seed)
    size, epochs, inner = 157, 3, 3

    def new_worker():
        return churn_worker(ElasticSampler(size, seed=seed, global_batch=12), rng.choice([0, 0, 2, 5]), inner)

    workers = [new_worker() for _ in range(4)]
    view_change(workers)
    consumed: dict[int, list[int]] = collections.defaultdict(list)
    for _ in churn_rounds(workers, epochs):
        drawn = []
        for w in workers:  # each worker's inner steps of the outer step, alone
            mine = []
            while not mine or not w.sampler.step_drawn():
                mine.append(next(w.stream))
                w.sampler.inner_step_done()
            drawn.append(mine)
            w.sampler.check_step()
        event = rng.random()
        if event < 0.1 and len(workers) > 1:  # a crash during the outer step: discarded everywhere
            for w in workers:
                w.sampler.step_ended(False)
            workers.pop(rng.randrange(len(workers)))
            view_change(workers)
            continue
        valid = all(w.sampler.batch_valid() for w in workers)
        assert valid
        epoch = workers[0].sampler.epoch
        for w, mine in zip(workers, drawn):
            consumed[epoch].extend(i for part, indices in zip(list(w.sampler._pending), mine) if part.count
                                   for i in indices)
        for w in workers:
            w.sampler.step_ended(True)
        if event < 0.2 and len(workers) < 6:  # a joiner admitted at this outer boundary
            workers.append(new_worker())
            view_change(workers)
        states = {tuple(sorted(w.sampler.state_dict().items())) for w in workers}
        assert len(states) == 1
    for epoch in range(epochs):
        assert sorted(consumed[epoch]) == list(range(size)), epoch


def test_with_inner_steps_a_loader_running_ahead_or_an_undrawn_inner_step_is_a_clear_error():
    ahead = ElasticSampler(100, global_batch=10)
    ahead.bind_group(FakeGroup(0, 1))
    ahead.plan_inner_steps(4)
    next(iter(PrefetchingLoader(ahead, depth=2)))  # a loader planning batches before they are trained on
    with pytest.raises(FtcommError, match="runs ahead"):
        ahead.inner_step_done()
    undrawn = ElasticSampler(100, global_batch=10)
    undrawn.bind_group(FakeGroup(0, 1))
    undrawn.plan_inner_steps(4)
    with pytest.raises(FtcommError, match="without an inner batch drawn"):
        undrawn.inner_step_done()  # trained on batches of a loader of its own


def test_a_re_formation_between_inner_steps_that_leaves_the_plan_as_it_was_keeps_the_step_s_batches():
    """A view formed again with the same world and rank (a reconcile deferred to a user's
    collective, a backend's re-formation) does not throw away the inner steps taken; one
    that changed the world does."""
    group = FakeGroup(1, 2)
    sampler = ElasticSampler(120, global_batch=12, seed=0)
    sampler.bind_group(group)
    sampler.plan_inner_steps(3)
    stream = sampler.steps(PrefetchingLoader(sampler, depth=1))
    next(stream)
    sampler.inner_step_done()
    sampler.view_changed(1, 2, 0)  # the same place
    for _ in range(2):
        next(stream)
        sampler.inner_step_done()
    assert sampler.step_drawn() and sampler.batch_valid()
    sampler.step_ended(True)
    assert sampler.offset == 36 and [p.part for p in sampler.committed_parts] == [0, 1, 2]
    next(stream)
    sampler.inner_step_done()
    group.world_size = 3
    sampler.view_changed(1, 3, 1)  # another world: the drawn batch is stale
    for _ in range(2):
        next(stream)
        sampler.inner_step_done()
    assert not sampler.batch_valid()
