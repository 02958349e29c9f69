"""Gradient buckets without a communicator: order, overlap, accumulation, discarded steps.

``FakeWorld`` stands in for the communicator: an allreduce(sum) over ``world``
identical workers multiplies the bucket by ``world`` and completes at once.
"""

from __future__ import annotations

import pytest
import torch

from ftcomm.backends.base import AbortSignal, Handle
from ftcomm.errors import FtcommError
from ftcomm.training.buckets import GradientBuckets


class FakeWorld:
    def __init__(self, world: int = 2, overlap_allowed: bool = True) -> None:
        self.world = world
        self.overlap_allowed = overlap_allowed
        self.launched: list[tuple[int, bool]] = []  # (bucket size, launched during backward)
        self.in_backward = False

    def launch(self, flat: torch.Tensor) -> Handle:
        self.launched.append((flat.numel(), self.in_backward))
        flat.mul_(self.world)
        return Handle("fake allreduce", lambda: True, lambda: flat)

    def buckets(self, params, bucket_mb: float = 0.0002, overlap: bool = True) -> GradientBuckets:
        return GradientBuckets(params, bucket_mb, overlap, self.launch, lambda: self.overlap_allowed,
                               lambda: self.world)

    def backward(self, model, seed: int) -> dict[str, torch.Tensor]:
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
        self.in_backward = True
        model(x).pow(2).sum().backward()
        self.in_backward = False
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def reduce(buckets: GradientBuckets, valid: bool = True) -> torch.Tensor:
    handles, tail = buckets.finish(valid)
    for h in handles:
        h.wait(AbortSignal(), 1.0)
    return tail


def test_buckets_go_out_during_backward_in_order_and_average_exactly():
    world, m = FakeWorld(), model()
    params = list(m.parameters())
    buckets = world.buckets(params)
    assert buckets.bucket_count > 2
    for step in range(3):
        world.launched.clear()
        local = world.backward(m, step)
        tail = reduce(buckets)
        assert tail.tolist() == [2.0, 0.0, 0.0, 0.0] + [0.0] * 6  # both (identical) workers valid, no joiner,
        # no fingerprint (three slots per rank)
        buckets.hand_back(float(tail[0]))
        assert all(during for _, during in world.launched), "every bucket started during backward"
        assert len(world.launched) == buckets.bucket_count
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.grad, local[n])  # the average over identical workers
        m.zero_grad(set_to_none=step % 2 == 0)  # both styles: freed grads, and grads kept as bucket views
    # the first bucket holds the last layer (backward produces it first); the last one ends with the tail
    assert world.launched[0][0] == params[-1].numel() + params[-2].numel()
    assert world.launched[-1][0] == params[0].numel() + params[1].numel() + 2 + 4 * world.world  # a flag and
    # three fingerprint slots per rank


def test_launch_order_is_bucket_order_whatever_order_the_hooks_fire_in():
    world, m = FakeWorld(), model()
    params = list(m.parameters())
    buckets = world.buckets(params)
    for p in params:
        p.grad = torch.ones_like(p)
    for p in params:  # registration order: the reverse of the bucket order
        buckets._on_grad(p)
    assert [size for size, _ in world.launched] == [len(f) for f in buckets._buffers()]


def test_no_sync_accumulates_and_the_last_backward_reduces_the_total():
    world, m = FakeWorld(world=1), model()
    buckets = world.buckets(list(m.parameters()))
    with buckets.no_sync():
        first = world.backward(m, 1)
    assert world.launched == []
    total = world.backward(m, 2)
    assert not torch.equal(first["0.weight"], total["0.weight"])
    tail = reduce(buckets)
    buckets.hand_back(float(tail[0]))
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, total[n])


def test_accumulating_without_no_sync_is_a_clear_error():
    world, m = FakeWorld(world=1), model()
    buckets = world.buckets(list(m.parameters()))
    world.backward(m, 1)
    world.backward(m, 2)
    with pytest.raises(FtcommError, match="no_sync"):
        buckets.finish(True)
    world.backward(m, 3)  # the next step starts clean
    tail = reduce(buckets)
    assert tail[:2].tolist() == [1.0, 0.0]


def test_unused_parameters_are_reduced_as_zeros_in_finish():
    world, m = FakeWorld(), model()
    extra = torch.nn.Parameter(torch.ones(3))
    params = list(m.parameters()) + [extra]  # last registered: first bucket, never gets a gradient
    buckets = world.buckets(params)
    world.backward(m, 0)
    assert world.launched == []  # bucket 0 waits for the unused parameter, and the rest wait in order
    tail = reduce(buckets)
    buckets.hand_back(float(tail[0]))
    assert torch.equal(extra.grad, torch.zeros(3))
    assert len(world.launched) == buckets.bucket_count


def test_without_permission_to_overlap_everything_waits_for_finish():
    world, m = FakeWorld(overlap_allowed=False), model()
    buckets = world.buckets(list(m.parameters()))
    local = world.backward(m, 0)
    assert world.launched == [] and not buckets.touched
    tail = reduce(buckets)
    buckets.hand_back(float(tail[0]))
    torch.testing.assert_close(m[0].weight.grad, local["0.weight"])


def test_an_invalid_step_contributes_zeros_and_is_averaged_over_the_valid_workers():
    world, m = FakeWorld(world=1, overlap_allowed=False), model()
    buckets = world.buckets(list(m.parameters()))
    world.backward(m, 0)
    tail = reduce(buckets, valid=False)
    assert tail[:2].tolist() == [0.0, 0.0]
    assert all(float(f[:-2].abs().sum()) == 0.0 for f in buckets._flats[-1:])


def test_partial_contributors_are_averaged_over_the_contributors_only():
    world, m = FakeWorld(world=4), model()
    buckets = world.buckets(list(m.parameters()))
    local = world.backward(m, 0)
    tail = reduce(buckets)
    assert tail.tolist()[0] == 4.0
    # pretend only two workers were valid: the sum holds g/4 from each of four copies, i.e. g,
    # and the average over two contributors of pre-scaled sums is g * 4 / 2
    buckets.hand_back(2.0)
    torch.testing.assert_close(m[0].weight.grad, local["0.weight"] * 2)


def test_discard_detaches_gradients_and_uses_new_buffers():
    world, m = FakeWorld(), model()
    buckets = world.buckets(list(m.parameters()))
    world.backward(m, 0)
    buckets.hand_back(float(reduce(buckets)[0]))
    old = list(buckets._flats)  # an abandoned collective would keep them alive (and may write)
    grad_before = m[0].weight.grad.clone()
    assert buckets._is_bucket_view(m[0].weight.grad)
    buckets.discard()
    assert not buckets._is_bucket_view(m[0].weight.grad)
    assert torch.equal(m[0].weight.grad, grad_before)
    assert not {f.data_ptr() for f in buckets._buffers()} & {f.data_ptr() for f in old}


def test_parameters_on_several_devices_are_refused():
    world = FakeWorld()
    a = torch.nn.Parameter(torch.ones(2))
    b = torch.nn.Parameter(torch.ones(2, device="meta"))
    with pytest.raises(FtcommError, match="one device"):
        world.buckets([a, b])


def test_the_tail_carries_a_flag_per_rank_for_stragglers_asking_to_stand_aside_sized_to_the_world():
    world, m = FakeWorld(world=3), model()
    asks = {"rank": 1, "aside": True}
    buckets = GradientBuckets(list(m.parameters()), 0.0002, True, world.launch, lambda: True, lambda: world.world,
                              lambda valid: (valid, False, asks["rank"] if asks["aside"] else None))
    world.backward(m, 0)
    tail = reduce(buckets)
    assert tail.tolist() == [3.0, 0.0, 0.0, 3.0, 0.0] + [0.0] * 9  # every (identical) worker: valid, rank 1 asks
    buckets.hand_back(3.0)
    world.world, asks["rank"] = 2, 0  # a new view of 2: the tail follows its size
    world.backward(m, 1)
    assert reduce(buckets).tolist() == [2.0, 0.0, 2.0, 0.0] + [0.0] * 6
    assert all(p.grad is not None for p in m.parameters())


def test_the_tail_carries_each_position_s_48_bit_fingerprint_exactly_through_a_float32_sum():
    from ftcomm.training.buckets import counter_values, read_counters

    prints = [(1 << 48) - 1, None, 0, 0x123456789ABC]
    shares = [counter_values((True, position == 1, None, f, position), 4) for position, f in enumerate(prints)]
    reduced = torch.tensor(shares, dtype=torch.float32).sum(dim=0)  # what the allreduce adds up
    assert read_counters(reduced.tolist()) == (4.0, 1.0, (), tuple(prints))


def test_a_step_whose_reductions_a_re_formation_dropped_is_lost_until_it_ends():
    world, m = FakeWorld(), model()
    buckets = world.buckets(list(m.parameters()))
    world.backward(m, 1)
    assert buckets.touched and not buckets.lost
    buckets.drop()  # the view re-formed inside the step (execute), after backward began reducing
    assert buckets.lost and not buckets.touched
    assert all(not buckets._is_bucket_view(p.grad) for p in m.parameters())  # the gradients are the model's own
    buckets.discard()  # the step goes on in the new view, this worker's share counted as none
    assert not buckets.lost and not buckets.touched
    tail = reduce(buckets, valid=False)
    assert tail.tolist()[0] == 0.0 and all(float(f.abs().sum()) == 0.0 for f in buckets._flats)
    buckets.hand_back(1.0)
    world.backward(m, 2)
    reduce(buckets)
    assert not buckets.lost  # the next step counts again


def test_parameters_unfrozen_before_a_step_reduce_nothing_during_its_backward():
    """Buckets made for the old trainable set (watching the module's every parameter) see
    the change at the step's first gradient and launch nothing; new buckets take the step."""
    world, m = FakeWorld(), model()
    m[0].weight.requires_grad_(False)
    every = list(m.parameters())
    trainable = [p for p in every if p.requires_grad]
    buckets = GradientBuckets(trainable, 0.0002, True, world.launch, lambda: True, lambda: world.world, watch=every)
    world.backward(m, 0)
    assert world.launched
    buckets.hand_back(float(reduce(buckets)[0]))
    m.zero_grad()
    m[0].weight.requires_grad_(True)
    world.launched.clear()
    world.backward(m, 1)
    assert not world.launched and not buckets.touched


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_a_half_precision_wire_sums_the_gradients_in_it_and_the_counters_in_float32_exactly(wire):
    """Gradients summed in bfloat16 or float16 (half the bytes), in the step's order, with
    overlap; the counters and a 48-bit fingerprint go in a float32 bucket of their own, where
    they stay exact; each parameter gets its gradient back in its own dtype, rounded as the
    wire rounds it."""
    world, m = FakeWorld(), model()
    params = list(m.parameters())
    buckets = GradientBuckets(params, 0.0002, True, world.launch, lambda: True, lambda: world.world,
                              contribution=lambda valid: (valid, True, 1, (1 << 48) - 3, 1), wire=wire)
    for step in range(2):
        world.launched.clear()
        local = world.backward(m, step)
        tail = reduce(buckets)
        flats = buckets._buffers()
        assert [f.dtype for f in flats] == [wire] * (len(flats) - 1) + [torch.float32]
        assert flats[-1].numel() == 2 + 4 * world.world  # the counters alone
        assert len(world.launched) == buckets.bucket_count == len(flats)
        assert all(during for _, during in world.launched[:-1]), "the gradients' buckets went out during backward"
        assert tail.tolist()[:4] == [2.0, 2.0, 0.0, 2.0]
        fingerprint = (1 << 48) - 3  # slots of 0xFFFF and 0xFFFD + 1: not exact in 8 or 11 bits of mantissa
        slots = [2.0 * (((fingerprint >> (16 * i)) & 0xFFFF) + 1) for i in range(3)]
        assert tail.tolist()[2 + world.world + 3:] == slots  # position 1's, from both (identical) workers
        buckets.hand_back(float(tail[0]))
        for n, p in m.named_parameters():
            assert p.grad.dtype == torch.float32
            expected = ((local[n] / 2).to(wire) * 2).to(wire).float()
            assert torch.equal(p.grad, expected)
            assert not torch.equal(p.grad, local[n])  # rounded: it did travel in half precision
        m.zero_grad(set_to_none=False)
    with pytest.raises(ValueError, match="travel in"):
        GradientBuckets(params, 0.0002, True, world.launch, lambda: True, lambda: world.world, wire=torch.float64)
    with pytest.raises(ValueError, match="launch_int8"):
        GradientBuckets(params, 0.0002, True, world.launch, lambda: True, lambda: world.world, wire=torch.int8)


def test_held_counters_go_out_only_at_the_call_and_the_gradients_during_backward():
    """``hold_counters`` (gradients handed over before the step's work is done): every
    gradient bucket goes out during backward, the counters in a float32 bucket of their own
    only at ``finish``, asked then (a worker whose work turned out invalid after backward
    counts as none); the sums are unchanged."""
    world, m = FakeWorld(), model()
    params = list(m.parameters())
    done = [True]
    held = GradientBuckets(params, 0.0002, True, world.launch, lambda: True, lambda: world.world,
                           contribution=lambda valid: (valid and done[0], False, None), hold_counters=True)
    plain = world.buckets(list(model().parameters()))
    assert held.bucket_count == plain.bucket_count + 1
    for step, valid in enumerate([True, False]):
        world.launched.clear()
        done[0] = True
        local = world.backward(m, step)
        assert len(world.launched) == held.bucket_count - 1 and all(during for _, during in world.launched)
        done[0] = valid  # known only after backward, before the call
        tail = reduce(held)
        assert len(world.launched) == held.bucket_count and world.launched[-1] == (2 + 4 * world.world, False)
        assert tail[0].item() == (2.0 if valid else 0.0)
        if valid:
            held.hand_back(float(tail[0]))
            for n, p in m.named_parameters():
                torch.testing.assert_close(p.grad, local[n])
        else:
            held.discard()
        m.zero_grad(set_to_none=True)
