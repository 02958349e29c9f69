"""Sums in 8-bit integers: per-block quantization, and the two exchanges on real Gloo groups."""

from __future__ import annotations

import threading

import pytest
import torch

from ftcomm.backends.base import AbortSignal
from ftcomm.errors import CollectiveAborted
from ftcomm.training.quantized import BLOCK, chunk_size, pack, quantized_sum, reference_sum, unpack
from tests.test_backends import gloo_group


pytestmark = pytest.mark.timeout(60)


def test_each_block_is_quantized_with_its_own_scale_and_a_non_finite_block_comes_back_as_nans():
    """Blocks of very different magnitudes each keep 7 bits of their own range (an outlier
    does not flatten the block beside it); zeros stay exact; a block holding a NaN or an
    infinity comes back as NaNs and spoils no other block."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(2, 4 * BLOCK, generator=generator)
    values[0, :BLOCK] *= 1e-3
    values[0, BLOCK:2 * BLOCK] *= 1e3
    values[1, :BLOCK] = 0.0
    values[1, 2 * BLOCK + 5] = float("nan")
    values[1, 3 * BLOCK + 7] = float("inf")
    packed = pack(values)
    assert packed.dtype == torch.int8 and packed.shape == (2, 4 * BLOCK + 4 * 4)  # a float32 scale per block
    back = unpack(packed, 4 * BLOCK)
    for row in range(2):
        for b in range(4):
            block, got = values[row, b * BLOCK:(b + 1) * BLOCK], back[row, b * BLOCK:(b + 1) * BLOCK]
            if not torch.isfinite(block).all():
                assert torch.isnan(got).all()
                continue
            half_step = block.abs().max() / 127 / 2
            assert ((got - block).abs() <= half_step * (1 + 1e-5)).all()
    assert torch.equal(back[1, :BLOCK], torch.zeros(BLOCK))
    assert not torch.equal(back[0, :BLOCK], values[0, :BLOCK])  # it was rounded


def _sum_over_gloo(tensors) -> list[torch.Tensor]:
    """``tensors`` summed by quantized_sum over a Gloo group of one rank each, each rank
    waited for on a thread of its own (as each member's training thread does: the second
    exchange starts when its first is seen done); the group closed afterwards."""
    comms = gloo_group(len(tensors))
    results: list = [None] * len(comms)

    def run(rank: int) -> None:
        results[rank] = quantized_sum(comms[rank], tensors[rank]).wait(AbortSignal(), 30.0)[0]
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(comms))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
    finally:
        for c in comms:
            c.close()
    return results


@pytest.mark.parametrize("numel", [1, 1000, 3 * BLOCK])
def test_an_int8_sum_over_three_gloo_ranks_is_bit_equal_on_each_and_within_two_half_steps_of_the_sum(numel):
    """Three ranks, a tensor that fills the three chunks unevenly (or exactly): every rank
    ends with the same bits, those of the sum computed alone by the same algorithm, within
    half a step of each block going out and half a step of the summed block coming back."""
    generator = torch.Generator().manual_seed(numel)
    tensors = [torch.randn(numel, generator=generator) * (r + 1) for r in range(3)]
    originals = [t.clone() for t in tensors]
    results = _sum_over_gloo(tensors)
    expected = reference_sum(originals)
    for r in range(3):
        assert results[r] is tensors[r]  # summed in place
        assert torch.equal(results[r], expected)
    exact = sum(originals)
    size = chunk_size(numel, 3)
    bound = torch.zeros(3 * size)
    for t in originals + [exact]:  # per block: half a step of each rank's block, half of the sum's
        padded = torch.zeros(3 * size)
        padded[:numel] = t
        bound += padded.view(-1, BLOCK).abs().amax(dim=1).repeat_interleave(BLOCK) / 254
    assert ((expected - exact).abs() <= bound[:numel] * (1 + 1e-4) + 1e-6).all()
    if numel > 1:  # (one value is its block's largest: exact, up to float32's rounding of x / 127 * 127)
        assert not torch.equal(expected, exact)


def test_an_int8_sum_whose_peer_never_takes_part_ends_by_the_abort_signal():
    """Rank 1 never starts its exchanges: rank 0's wait ends when the signal fires (not by a
    timeout), as every collective's does."""
    comms = gloo_group(2)
    abort = AbortSignal()
    try:
        handle = quantized_sum(comms[0], torch.ones(10))
        threading.Timer(0.05, abort.fire, args=("rank 1 is suspect",)).start()
        with pytest.raises(CollectiveAborted, match="int8 sum in view 1 abandoned: rank 1 is suspect"):
            handle.wait(abort, None)
    finally:
        for c in comms:
            c.abandon()


def test_an_int8_sum_whose_first_exchange_is_done_starts_nothing_more_once_the_signal_fired():
    """Both ranks' alltoalls are done, nobody has polled: a wait whose signal already fired
    raises CollectiveAborted and issues no allgather on the communicator (about to be
    abandoned, where a collective could hold a Gloo thread until its op timeout)."""
    from tests.polling import wait_until

    comms = gloo_group(2)
    try:
        handles = [quantized_sum(c, torch.ones(10)) for c in comms]
        wait_until(lambda: all(h.completed for c in comms for h in c._pending), 10.0, "the alltoalls")
        abort = AbortSignal()
        abort.fire("the view broke")
        with pytest.raises(CollectiveAborted, match="the view broke"):
            handles[0].wait(abort)
        assert [h.what for h in comms[0]._pending] == ["alltoall in view 1"]
    finally:
        for c in comms:
            c.abandon()


def test_values_beyond_float32_s_range_saturate_instead_of_spoiling_their_block():
    """A block whose largest value is float32's largest (what ``nan_to_num`` makes of an
    infinity), and two ranks whose halves of it sum past it: their neighbours in the block
    keep their values, the sum saturates at float32's largest, nothing becomes NaN."""
    biggest = torch.finfo(torch.float32).max
    alone = torch.full((BLOCK,), 0.5)
    alone[3] = biggest
    back = unpack(pack(alone.view(1, -1)), BLOCK)[0]
    assert torch.isfinite(back).all() and back[3] == biggest
    tensors = [torch.full((2 * BLOCK,), 0.25) for _ in range(2)]
    for t in tensors:
        t[7] = biggest / 1.5  # each finite; their sum is not
    originals = [t.clone() for t in tensors]
    results = _sum_over_gloo(tensors)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], reference_sum(originals))
    assert torch.isfinite(results[0]).all() and results[0][7] == biggest
    torch.testing.assert_close(results[0][BLOCK:], torch.full((BLOCK,), 0.5))


def test_alltoall_needs_a_row_per_rank():
    comms = gloo_group(2)
    try:
        with pytest.raises(ValueError, match="first dimension is the view's size"):
            comms[0].alltoall(torch.zeros(3, 4, dtype=torch.int8))
        handles = [c.alltoall(torch.arange(4, dtype=torch.int8).view(2, 2) + 10 * r) for r, c in enumerate(comms)]
        received = [h.wait(AbortSignal(), 10.0) for h in handles]
        assert received[0].tolist() == [[0, 1], [10, 11]] and received[1].tolist() == [[2, 3], [12, 13]]
    finally:
        for c in comms:
            c.close()
