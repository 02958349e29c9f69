"""A sharded model's gradient step, one sum per FSDP2 parameter group, from FSDP2's
all-reduce hook (:mod:`ftcomm.training.shard_groups`).

One process, a shard mesh of one (FSDP2 still hands every group's reduce output to the
hook), and a fake cross-replica allreduce over ``world`` identical replicas (it multiplies
by ``world``). Replicas of two processes training against plain HSDP are in
``tests/test_sharded.py``.
"""

from __future__ import annotations

import pytest
import torch

from ftcomm.backends.base import Handle
from ftcomm.errors import FtcommError
from ftcomm.training import sharded
from ftcomm.training.shard_groups import ShardGroupBuckets, shard_groups
from tests.test_buckets import reduce

fsdp = pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.timeout(120)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 31), torch.nn.ReLU(), torch.nn.Linear(31, 8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 4))


def _sharded(mesh) -> torch.nn.Module:
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    return model


def _backward(model: torch.nn.Module, seed: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()


def _local_gradients(seed: int) -> dict[str, torch.Tensor]:
    model = _model()
    _backward(model, seed)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: sharded.local(p.grad) for n, p in model.named_parameters()}


def _first_step(model: torch.nn.Module, buckets: ShardGroupBuckets) -> None:
    """The buckets' first step (reduced at the step, since FSDP2 ran no hook of theirs yet):
    from here on the hooks are in place."""
    _backward(model, 0)
    buckets.hand_back(float(reduce(buckets)[0]))


class FakeReplicas:
    def __init__(self, world: int = 2, overlap_allowed: bool = True) -> None:
        self.world, self.overlap_allowed = world, overlap_allowed
        self.launched: list[tuple[int, bool]] = []  # (size, launched during backward)
        self.flats: list[torch.Tensor] = []
        self.in_backward = False

    def launch(self, flat: torch.Tensor) -> Handle:
        self.launched.append((flat.numel(), self.in_backward))
        self.flats.append(flat)
        flat.mul_(self.world)
        return Handle("fake allreduce", lambda: True, lambda: flat)

    def buckets(self, model: torch.nn.Module) -> ShardGroupBuckets:
        params = list(model.parameters())
        groups = shard_groups(model, params)
        assert groups is not None
        return ShardGroupBuckets(groups, params, self.launch, lambda: self.overlap_allowed, lambda: self.world)

    def backward(self, model: torch.nn.Module, seed: int) -> None:
        self.in_backward = True
        _backward(model, seed)
        self.in_backward = False


def test_each_group_goes_out_once_during_backward_in_order_and_its_shards_get_the_average(one_process_mesh):
    world, model = FakeReplicas(), _sharded(one_process_mesh)
    buckets = world.buckets(model)
    assert buckets.bucket_count == 3  # the three layers (the root holds none of its own)
    assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    calls = []
    take = buckets._take
    buckets._take = lambda index, output: calls.append(index) or take(index, output)
    for step in range(3):
        world.launched.clear()
        world.flats.clear()
        calls.clear()
        world.backward(model, step)
        assert buckets.touched
        counters = reduce(buckets)
        assert counters.tolist() == [2.0, 0.0, 0.0, 0.0] + [0.0] * 6  # both (identical) replicas valid, no joiner
        buckets.hand_back(float(counters[0]))
        expected = _local_gradients(step)
        for n, g in _grads(model).items():
            torch.testing.assert_close(g, expected[n])  # the mean of identical replicas
        assert calls == [0, 1, 2], "one call per group, last layer first"
        assert [during for _, during in world.launched] == [True] * 4, "groups and counters during backward"
        assert [n for n, _ in world.launched[:3]] == [36, 8 * 31 + 8, 31 * 16 + 31]
        for (n, p), flat in zip(reversed(list(model.named_parameters())[::2]), world.flats):
            assert sharded.local(p.grad).untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), \
                f"{n}: reduced in place, the gradient shard is a view of its group's sum"
        model.zero_grad()


def test_gradients_added_into_existing_shards_are_gathered_reduced_and_given_back(one_process_mesh):
    """Zeroed instead of freed, the shards receive FSDP2's output by addition (a copy): those
    groups are reduced at the step from the shards, in the same order and sizes."""
    world, model = FakeReplicas(), _sharded(one_process_mesh)
    buckets = world.buckets(model)
    _first_step(model, buckets)
    for step in (1, 2):
        model.zero_grad(set_to_none=False)
        world.launched.clear()
        world.backward(model, step)
        assert not buckets.touched  # nothing could go out in place
        buckets.hand_back(float(reduce(buckets)[0]))
        assert [n for n, during in world.launched] == [36, 8 * 31 + 8, 31 * 16 + 31, 4 + 6]
        assert not any(during for _, during in world.launched)
        expected = _local_gradients(step)
        for n, g in _grads(model).items():
            torch.testing.assert_close(g, expected[n])


def test_no_sync_then_a_last_backward_reduces_the_total(one_process_mesh):
    world, model = FakeReplicas(), _sharded(one_process_mesh)
    buckets = world.buckets(model)
    _first_step(model, buckets)
    model.zero_grad()
    with buckets.no_sync():
        world.backward(model, 1)
    assert not world.launched[4:]
    world.backward(model, 2)
    buckets.hand_back(float(reduce(buckets)[0]))
    one, two = _local_gradients(1), _local_gradients(2)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, one[n] + two[n])


def test_without_overlap_the_outputs_are_reduced_in_place_at_the_step_and_backward_passes_total(one_process_mesh):
    world, model = FakeReplicas(overlap_allowed=False), _sharded(one_process_mesh)
    buckets = world.buckets(model)
    _first_step(model, buckets)
    model.zero_grad()
    world.launched.clear()
    world.backward(model, 1)
    world.backward(model, 2)  # adds into the outputs not yet launched
    assert not world.launched
    buckets.hand_back(float(reduce(buckets)[0]))
    one, two = _local_gradients(1), _local_gradients(2)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, one[n] + two[n])


def test_a_second_backward_into_sums_already_under_way_is_refused_and_the_next_step_is_clean(one_process_mesh):
    world, model = FakeReplicas(), _sharded(one_process_mesh)
    buckets = world.buckets(model)
    _first_step(model, buckets)
    model.zero_grad()
    world.backward(model, 1)
    world.backward(model, 2)
    with pytest.raises(FtcommError, match="more than one backward"):
        buckets.finish(True)
    model.zero_grad()
    world.backward(model, 3)
    buckets.hand_back(float(reduce(buckets)[0]))
    expected = _local_gradients(3)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, expected[n])


def test_fewer_contributors_average_over_those_that_counted(one_process_mesh):
    world, model = FakeReplicas(world=4), _sharded(one_process_mesh)
    buckets = world.buckets(model)
    _first_step(model, buckets)
    model.zero_grad()
    world.backward(model, 1)
    reduce(buckets)
    buckets.hand_back(2.0)  # the sum holds four copies; two counted: twice the local gradient
    expected = _local_gradients(1)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, 2 * expected[n])


def test_a_failed_step_detaches_the_shards_from_what_an_abandoned_sum_may_still_write(one_process_mesh):
    world, model = FakeReplicas(), _sharded(one_process_mesh)
    buckets = world.buckets(model)
    _first_step(model, buckets)
    model.zero_grad()
    world.flats.clear()
    world.backward(model, 1)
    assert buckets.touched
    buckets.discard()
    for flat in world.flats:
        flat.fill_(1e9)  # the abandoned collective writes late
    assert all(g.abs().max() < 1e6 for g in _grads(model).values())
    model.zero_grad()
    world.backward(model, 2)
    buckets.hand_back(float(reduce(buckets)[0]))
    expected = _local_gradients(2)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, expected[n])


def test_a_lost_step_contributes_zeros_and_gets_the_others_average(one_process_mesh):
    world, model = FakeReplicas(), _sharded(one_process_mesh)
    buckets = world.buckets(model)
    _first_step(model, buckets)
    model.zero_grad()
    world.backward(model, 1)
    buckets.drop()  # the view re-formed after backward began reducing
    assert buckets.lost and not buckets.touched
    world.launched.clear()
    counters = reduce(buckets, valid=False)
    assert counters.tolist()[:2] == [0.0, 0.0]
    assert [n for n, _ in world.launched] == [36, 8 * 31 + 8, 31 * 16 + 31, 4 + 6]  # the same collectives
    buckets.hand_back(1.0)
    assert all(torch.count_nonzero(g) == 0 for g in _grads(model).values())  # the fake others sent zeros


def test_the_path_applies_only_where_the_groups_hold_exactly_the_parameters(one_process_mesh):
    model = _sharded(one_process_mesh)
    params = list(model.parameters())
    assert shard_groups(model, params) is not None
    assert shard_groups(model, params[:-1]) is None  # a subset: the per-parameter path
    assert shard_groups(_model(), list(_model().parameters())) is None  # not sharded
    model[0].set_all_reduce_hook(lambda output: None)  # the user's own hook is kept
    assert shard_groups(model, params) is None


class LateReplicas(FakeReplicas):
    """The sum lands when waited for (after FSDP2's code that follows the hook, as a real
    allreduce in flight), and what each launch sent is recorded at the launch."""

    def __init__(self, world: int = 2, overlap_allowed: bool = True) -> None:
        super().__init__(world, overlap_allowed)
        self.sent: list[torch.Tensor] = []

    def launch(self, flat: torch.Tensor) -> Handle:
        self.launched.append((flat.numel(), self.in_backward))
        self.flats.append(flat)
        self.sent.append(flat.clone())
        return Handle("fake allreduce", lambda: True, lambda: flat.mul_(self.world))


def test_a_group_with_some_shards_holding_gradients_is_gathered_not_taken_in_place(one_process_mesh):
    """FSDP2 adds the output into the shards that hold a gradient, right after the hook:
    with any of them (not only the first), the group is reduced from its shards at the step."""
    world, model = LateReplicas(), _sharded(one_process_mesh)
    buckets = world.buckets(model)
    _first_step(model, buckets)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            layer.weight.grad = None  # the biases keep theirs (zeroed), the weights are freed
            layer.bias.grad.zero_()
    world.backward(model, 1)
    buckets.hand_back(float(reduce(buckets)[0]))
    expected = _local_gradients(1)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, expected[n])


def test_a_second_backward_into_sums_in_flight_leaves_what_was_sent_intact(one_process_mesh):
    """The others receive this member's first pass as it was launched: the second pass adds
    into shards of its own, and this member's step is refused."""
    world, model = LateReplicas(), _sharded(one_process_mesh)
    buckets = world.buckets(model)
    _first_step(model, buckets)
    model.zero_grad()
    world.flats.clear()
    world.sent.clear()
    world.backward(model, 1)
    world.backward(model, 2)
    for flat, sent in zip(world.flats, world.sent):
        assert torch.equal(flat, sent)
    with pytest.raises(FtcommError, match="more than one backward"):
        buckets.finish(True)


def test_parameters_unfrozen_before_a_step_reduce_nothing_during_its_backward(one_process_mesh):
    """Buckets made for the old trainable set see the change at the step's first hook and
    launch nothing; the step is reduced by new buckets at wait_gradients_ready, the same
    collectives as on a member that had no buckets yet (a joiner's first step)."""
    world, model = FakeReplicas(), _sharded(one_process_mesh)
    model[0].weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = ShardGroupBuckets(shard_groups(model, params), params, world.launch, lambda: True, lambda: 2,
                                watch=list(model.parameters()))
    _first_step(model, buckets)
    model.zero_grad()
    model[0].weight.requires_grad_(True)
    world.launched.clear()
    world.backward(model, 1)
    assert not world.launched and not buckets.touched
    buckets.remove()
    params = list(model.parameters())
    fresh = ShardGroupBuckets(shard_groups(model, params), params, world.launch, lambda: True, lambda: 2)
    fresh.hand_back(float(reduce(fresh)[0]))
    expected = _local_gradients(1)
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, expected[n])


def test_a_post_accumulate_grad_hook_added_later_sees_the_gradient_before_any_division(one_process_mesh):
    world, model = FakeReplicas(world=4), _sharded(one_process_mesh)
    buckets = world.buckets(model)
    _first_step(model, buckets)
    model.zero_grad()
    seen = {}
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.update(norm=sharded.local(p.grad).norm()))
    world.backward(model, 1)
    assert not buckets.touched
    buckets.hand_back(float(reduce(buckets)[0]))
    expected = _local_gradients(1)
    torch.testing.assert_close(seen["norm"], expected["0.weight"].norm())  # not divided by 4, not in flight
    for n, g in _grads(model).items():
        torch.testing.assert_close(g, expected[n])
