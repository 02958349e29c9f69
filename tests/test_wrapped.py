"""``ft.wrap(model)``: gradients through DDP's C++ reducer, reduced over ftcomm's view.

:class:`ReducerBuckets` driven by a fake communicator (an allreduce over ``world``
identical workers multiplies by ``world``). Wrapped groups training in threads are in
``tests/test_group_threads.py`` (exact averages, a re-formation inside a step), and every
process test trains through the wrapped demo.
"""

from __future__ import annotations

import pytest
import torch

from ftcomm.backends.base import AbortSignal, Handle
from ftcomm.errors import FtcommError
from ftcomm.training.reducer import DistributedDataParallel, ReducerBuckets, bucket_layout
from tests.test_buckets import model, reduce

pytestmark = pytest.mark.timeout(120)


class FakeWorld:
    def __init__(self, world: int = 2, overlap_allowed: bool = True) -> None:
        self.world, self.overlap_allowed = world, overlap_allowed
        self.launched: list[tuple[int, bool]] = []  # (size, launched during backward)
        self.in_backward = False

    def launch(self, flat: torch.Tensor) -> Handle:
        self.launched.append((flat.numel(), self.in_backward))
        flat.mul_(self.world)
        return Handle("fake allreduce", lambda: True, lambda: flat)

    def wrap(self, module: torch.nn.Module, bucket_mb: float = 0.0002) -> tuple[DistributedDataParallel,
                                                                                ReducerBuckets]:
        net = DistributedDataParallel(module, bucket_mb)
        return net, ReducerBuckets(net, self.launch, lambda: self.overlap_allowed, lambda: self.world)

    def backward(self, net, seed: int) -> None:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
        self.in_backward = True
        net(x).pow(2).sum().backward()
        self.in_backward = False


class Partial(torch.nn.Module):
    """A model whose second layer never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.used(x)


def local_gradients(seed: int) -> dict[str, torch.Tensor]:
    m = model()
    FakeWorld().backward(m, seed)
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def test_buckets_go_out_during_backward_in_order_and_no_python_runs_per_parameter():
    world, m = FakeWorld(), model()
    net, buckets = world.wrap(m)
    calls = []
    take = buckets._take
    buckets._take = lambda index, buffer: calls.append(index) or take(index, buffer)
    for step in range(3):
        world.launched.clear()
        calls.clear()
        world.backward(net, step)
        counters = reduce(buckets)
        assert counters.tolist() == [2.0, 0.0, 0.0, 0.0] + [0.0] * 6  # both (identical) workers valid, no joiner
        buckets.hand_back(float(counters[0]))
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.grad, local_gradients(step)[n])  # the mean of identical workers
        assert calls == list(range(buckets.bucket_count)), "one call per bucket, in order"
        assert all(during for _, during in world.launched), "every bucket started during backward"
        m.zero_grad(set_to_none=step % 2 == 0)
    assert buckets.bucket_count == 3
    params = list(m.parameters())
    # the first bucket holds the last layer (backward produces it first); then the counters
    assert [size for size, _ in world.launched] == [params[5].numel() + params[4].numel(),
                                                    params[3].numel() + params[2].numel(),
                                                    params[1].numel() + params[0].numel(), 2 + 2 + 6]
    assert all(p._post_accumulate_grad_hooks is None and not p._backward_hooks for p in params), \
        "no Python hook on any parameter"


def test_every_member_has_the_same_buckets_from_its_first_step_whatever_order_gradients_arrive_in():
    """DDP's own rebuild would follow the order this process saw gradients arrive in, after
    its first step; a member joining later would run its first step with other buckets than
    the running members. ftcomm's layout depends on the parameters alone."""
    class Crossed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(16, 16) for _ in range(3))

        def forward(self, x):
            return self.b(self.a(self.c(x)))  # backward: b, a, then c (registration order: a, b, c)

    def sizes(steps: int) -> list[list[int]]:
        torch.manual_seed(0)
        world = FakeWorld()
        net, buckets = world.wrap(Crossed(), bucket_mb=0.001)
        seen = []
        for step in range(steps):
            world.launched.clear()
            net(torch.randn(2, 16)).sum().backward()
            counters = reduce(buckets)
            buckets.hand_back(float(counters[0]))
            seen.append([size for size, _ in world.launched])
        return seen
    running = sizes(4)
    assert len(running[0]) > 2 and running == [running[0]] * 4
    assert sizes(1) == running[:1]
    params = list(Crossed().parameters())
    assert bucket_layout(params, 0.001)[0] == [5, 4]  # c.bias, c.weight: the last registered go first


def test_without_overlap_or_when_the_view_must_change_first_the_step_launches_everything_at_wait():
    world, m = FakeWorld(overlap_allowed=False), model()
    net, buckets = world.wrap(m)
    world.backward(net, 0)
    assert not buckets.touched and not world.launched
    counters = reduce(buckets)
    assert counters.tolist() == [2.0, 0.0, 0.0, 0.0] + [0.0] * 6
    assert len(world.launched) == buckets.bucket_count + 1 and not any(d for _, d in world.launched)
    buckets.hand_back(2.0)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, local_gradients(0)[n])


def test_fewer_contributors_than_members_average_over_the_contributors():
    world, m = FakeWorld(world=4), model()
    net, buckets = world.wrap(m)
    world.backward(net, 0)
    reduce(buckets)
    buckets.hand_back(3.0)  # as if one of the four contributed nothing: the sum is over three
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, local_gradients(0)[n] * 4 / 3)


def test_no_sync_accumulates_locally_and_the_next_backward_reduces_the_total():
    world, m = FakeWorld(), model()
    net, buckets = world.wrap(m)
    with buckets.no_sync():
        world.backward(net, 0)
    assert not world.launched
    world.backward(net, 1)
    counters = reduce(buckets)
    buckets.hand_back(float(counters[0]))
    first, second = local_gradients(0), local_gradients(1)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, first[n] + second[n])


def test_without_overlap_two_backward_passes_before_the_step_reduce_their_total():
    world, m = FakeWorld(overlap_allowed=False), model()
    net, buckets = world.wrap(m)
    world.backward(net, 0)
    world.backward(net, 1)
    buckets.hand_back(float(reduce(buckets)[0]))
    first, second = local_gradients(0), local_gradients(1)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, first[n] + second[n])


def test_two_backward_passes_before_the_step_are_refused_and_the_next_step_works():
    world, m = FakeWorld(), model()
    net, buckets = world.wrap(m)
    world.backward(net, 0)
    world.backward(net, 1)
    with pytest.raises(FtcommError, match="more than one backward"):
        buckets.finish(True)
    m.zero_grad()
    world.backward(net, 2)
    buckets.hand_back(float(reduce(buckets)[0]))
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, local_gradients(2)[n])


def test_a_parameter_without_a_gradient_is_named_instead_of_a_hang():
    world = FakeWorld()
    net, buckets = world.wrap(Partial(), bucket_mb=0.00001)
    world.backward(net, 0)
    with pytest.raises(FtcommError, match="got no gradient.*unused"):
        buckets.finish(True)


def test_a_forward_pass_around_the_wrapper_is_explained():
    world, m = FakeWorld(), model()
    net, buckets = world.wrap(m)
    world.backward(m, 0)  # the inner module: DDP's reducer never prepared for this backward
    with pytest.raises(FtcommError, match="through the object ft.wrap returned"):
        buckets.finish(True)


def test_a_failed_step_gives_the_next_one_new_buckets_and_keeps_the_gradients_apart_from_the_old():
    """An abandoned collective may still write into the buffers it was given: after a
    failed step the gradients no longer live there, and later steps use new ones."""
    world, m = FakeWorld(), model()
    net, buckets = world.wrap(m)
    world.backward(net, 0)
    handles, _ = buckets.finish(True)
    old = [p.grad for p in m.parameters()]
    buckets.discard()
    assert all(p.grad.data_ptr() != o.data_ptr() for p, o in zip(m.parameters(), old))
    for o in old:
        o.fill_(1e9)  # the abandoned collective writes late
    m.zero_grad()
    world.backward(net, 1)
    buckets.hand_back(float(reduce(buckets)[0]))
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, local_gradients(1)[n])
    assert all(p.grad.data_ptr() != o.data_ptr() for p, o in zip(m.parameters(), old))


def test_a_lost_step_contributes_zeros_in_new_buffers_and_gets_the_others_average():
    world, m = FakeWorld(), model()
    net, buckets = world.wrap(m)
    world.backward(net, 0)
    assert buckets.touched
    buckets.drop()  # the view re-formed (in a call before the step) after backward began reducing
    assert buckets.lost
    buckets.discard()  # as the step does on finding it lost
    world.launched.clear()
    handles, counters = buckets.finish(False)
    for h in handles:
        h.wait(AbortSignal(), 1.0)
    assert counters.tolist() == [0.0, 0.0, 0.0, 0.0] + [0.0] * 6
    assert len(world.launched) == buckets.bucket_count + 1
    buckets.hand_back(1.0)  # one other member contributed: here, zeros times two
    assert all(torch.count_nonzero(p.grad) == 0 for p in m.parameters())
    m.zero_grad()
    world.backward(net, 1)  # the next step reduces normally, in new buckets
    buckets.hand_back(float(reduce(buckets)[0]))
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, local_gradients(1)[n])


def test_wrap_refuses_what_its_reducer_cannot_do():
    with pytest.raises(FtcommError, match="requires a gradient"):
        DistributedDataParallel(torch.nn.Linear(4, 4).requires_grad_(False), 25.0)
    with pytest.raises(FtcommError, match="sparse gradients"):
        DistributedDataParallel(torch.nn.Embedding(10, 4, sparse=True), 25.0)


def test_wrapping_a_module_again_retires_the_earlier_wrapper_and_leaves_the_module_a_plain_module():
    """After unfreezing parameters a script wraps again (DDP's parameter list is fixed when
    it is built); two reducers would fight over the gradients, so the earlier one goes. The
    module itself carries nothing: it is copied and saved as before."""
    import copy
    import io

    world, m = FakeWorld(), model()
    net, buckets = world.wrap(m)
    world.backward(net, 0)
    buckets.hand_back(float(reduce(buckets)[0]))
    m.zero_grad()
    again, buckets = world.wrap(m)
    with pytest.raises(FtcommError, match="replaced by a later ft.wrap"):
        net(torch.randn(4, 16))
    world.launched.clear()
    world.backward(again, 1)
    buckets.hand_back(float(reduce(buckets)[0]))
    assert len(world.launched) == buckets.bucket_count + 1  # one reducer's buckets, not two
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, local_gradients(1)[n])
    copied = copy.deepcopy(m)
    world.wrap(copied)  # a copy (an EMA model, say) is a module of its own
    torch.save(m, io.BytesIO())


def test_a_second_backward_through_a_retained_graph_is_refused_not_added_to_the_reduction():
    """DDP's reducer calls no hook for a second backward in one iteration; the buckets it
    writes into are being reduced already."""
    world, m = FakeWorld(), model()
    net, buckets = world.wrap(m)
    loss = net(torch.randn(4, 16)).pow(2).sum()
    loss.backward(retain_graph=True)
    assert buckets.touched
    loss.backward()
    with pytest.raises(FtcommError, match="changed after backward began reducing"):
        buckets.finish(True)


def test_a_member_whose_parameter_got_no_gradient_still_launches_every_collective_then_raises():
    """Data-dependent control flow skips a layer on one member only: its collectives must
    still pair with the others' (zeros, counted as none), or the others would wait for a
    bucket that never comes, and its next collective would meet one of another size."""
    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

        def forward(self, x, skip: bool = False):
            return self.second(x if skip else self.first(x))
    sizes = {}
    for skip in (False, True):
        torch.manual_seed(0)
        world = FakeWorld()
        net, buckets = world.wrap(Branchy(), bucket_mb=0.0002)
        net(torch.randn(2, 16), skip=skip).sum().backward()
        if skip:
            with pytest.raises(FtcommError, match=r"got no gradient.*first\.(weight|bias)"):
                reduce(buckets)
        else:
            reduce(buckets)
        sizes[skip] = [size for size, _ in world.launched]
    assert sizes[True] == sizes[False] and len(sizes[True]) >= 3


def test_the_member_records_a_step_reads_are_decoded_once_per_change_of_the_table(monkeypatch):
    """Every gradient step asks for the members' records (a joiner waiting?); they are
    decoded again only when gossip's table or the view changed."""
    from collections import namedtuple
    from types import SimpleNamespace

    from ftcomm.core import view as view_module
    from ftcomm.runtime.live_ports import GossipMembership

    Member = namedtuple("Member", "id state metadata confirmed host port")
    decoded = []

    def decode(member_id, state, meta):
        decoded.append(member_id)
        return SimpleNamespace(rendezvous_port=meta.get("rz"))
    monkeypatch.setattr(view_module.Status, "from_metadata", staticmethod(decode))
    table = (Member("a", "alive", {"rz": 7}, True, "h", 1), Member("b", "alive", {}, True, "h", 2))
    node = SimpleNamespace(snapshot=lambda: table)
    membership = GossipMembership(SimpleNamespace(id="a"))
    membership.node = node
    first = membership.statuses(None)
    statuses, addresses = membership.statuses(None)
    assert decoded == ["a", "b"] and addresses == {"a": ("h", 7)} and set(statuses) == {"a", "b"}
    statuses.pop("a")  # a caller's copy: the next read is whole
    assert set(membership.statuses(None)[0]) == {"a", "b"} and decoded == ["a", "b"]
    table = table[:1]  # gossip's table changed
    assert set(membership.statuses(None)[0]) == {"a"} and decoded == ["a", "b", "a"]
    membership.statuses(SimpleNamespace(member_set=set()))  # another view: read again
    assert decoded == ["a", "b", "a", "a"]
    assert first[1] == {"a": ("h", 7)}


def test_a_forward_after_a_backward_that_left_a_parameter_without_a_gradient_says_why():
    world = FakeWorld()
    net, _ = world.wrap(Partial(), bucket_mb=0.00001)
    net(torch.randn(2, 16)).sum().backward()
    with pytest.raises(FtcommError, match="left some parameters without a gradient"):
        net(torch.randn(2, 16))  # no wait_gradients_ready in between: DDP's own error, explained
    net.module.unused.requires_grad_(False)
    with torch.no_grad():
        net(torch.randn(2, 16))  # the wrapper is usable again


@pytest.mark.parametrize("set_to_none", [True, False])
def test_after_a_step_whose_gradients_counted_as_none_the_reducer_takes_its_gradients_back(set_to_none):
    """A worker whose state was just replaced reduces zeros and is handed the averages as
    gradients of its own; the steps after it go through the buckets again, both ways of
    zeroing the gradients."""
    world, m = FakeWorld(overlap_allowed=False), model()
    net, buckets = world.wrap(m)
    world.backward(net, 0)
    handles, counters = buckets.finish(False)
    assert counters.tolist()[:2] == [0.0, 0.0]
    buckets.hand_back(1.0)
    for step in (1, 2):
        m.zero_grad(set_to_none=set_to_none)
        world.backward(net, step)
        buckets.hand_back(float(reduce(buckets)[0]))
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.grad, local_gradients(step)[n])
