"""The backend interface: handles completed by polling watchers, on real Gloo groups."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from ftcomm.backends.base import AbortSignal, Watcher
from ftcomm.backends.gloo import GlooCommunicator
from ftcomm.errors import CommunicatorError

from .polling import wait_until

pytestmark = pytest.mark.timeout(60)


def pair() -> list[GlooCommunicator]:
    """A two-rank Gloo group, both ranks in this process."""
    store, comms = dist.HashStore(), [None, None]

    def form(rank: int) -> None:
        comms[rank] = GlooCommunicator.form(store, rank, 2, 1, AbortSignal(), 30.0, host="127.0.0.1")
    threads = [threading.Thread(target=form, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(comms)
    return comms


def test_gloo_collectives_complete_through_the_watcher():
    comms = pair()
    tensors = [torch.full((5,), float(r + 1)) for r in range(2)]
    handles = [c.allreduce([t], "sum") for c, t in zip(comms, tensors)]
    for h in handles:
        assert h.wait(AbortSignal(), 10.0)[0].tolist() == [3.0] * 5
    for c in comms:
        c.close()


def test_an_abandoned_gloo_collective_reads_as_failed_at_once_instead_of_blocking():
    comms = pair()
    pending = comms[0].allreduce([torch.ones(4)], "sum")  # rank 1 never takes part
    comms[0].abandon()
    with pytest.raises(CommunicatorError, match="abandoned"):
        pending.wait(AbortSignal(), 10.0)
    comms[1].abandon()


def test_the_watcher_calls_check_only_while_something_is_pending_and_fails_everything_on_an_error():
    calls = []
    verdict: list[str | None] = [None]

    def check():
        calls.append(1)
        return verdict[0]
    watcher = Watcher("test-watch", check)
    completed = threading.Event()
    watcher.add(lambda: False, completed.set)
    wait_until(lambda: len(calls) >= 3, 2.0, "checks while a collective is pending")
    verdict[0] = "peer 2 reset the connection"
    assert completed.wait(2.0) and watcher.error == "peer 2 reset the connection"
    seen = len(calls)
    watcher.add(lambda: True, lambda: None)  # nothing pending for long: no more checks needed
    wait_until(lambda: watcher._pending == [], 2.0, "the finished entry to be dropped")
    assert len(calls) <= seen + 1
    watcher.stop()


def test_a_poll_that_raises_fails_the_pending_handles_instead_of_stopping_the_watcher():
    def broken() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    watcher = Watcher("test-watch")
    completed = [threading.Event() for _ in range(2)]
    watcher.add(lambda: False, completed[0].set)
    watcher.add(broken, completed[1].set)
    assert all(c.wait(2.0) for c in completed)
    assert "illegal memory access" in watcher.error
    later = threading.Event()
    watcher.add(lambda: False, later.set)  # the watcher still runs: this one completes too (as failed)
    assert later.wait(2.0)
    watcher.stop()


def test_a_handle_added_after_stop_completes_at_once_as_failed():
    watcher = Watcher("test-watch")
    watcher.stop()
    completed = threading.Event()
    watcher.add(lambda: True, completed.set)
    assert completed.is_set() and watcher.error == "the communicator was abandoned"


def test_gloo_reduces_each_tensor_of_a_call_on_its_own_and_averages_integers_as_nccl():
    comms = pair()
    handles = [c.allreduce([torch.full((3,), r + 1.0), torch.full((2,), 10.0 * (r + 1))], "sum")
               for r, c in enumerate(comms)]
    for h in handles:
        a, b = h.wait(AbortSignal(), 10.0)
        assert a.tolist() == [3.0] * 3 and b.tolist() == [30.0] * 2
    ints = [torch.tensor([1, -4, 7]), torch.tensor([2, -3, 0])]
    handles = [c.allreduce([t], "mean") for c, t in zip(comms, ints)]
    for h in handles:
        assert h.wait(AbortSignal(), 10.0)[0].tolist() == [1, -3, 3]  # (3, -7, 7) / 2, truncated
    for c in comms:
        with pytest.raises(ValueError, match="root 2 is not a rank"):
            c.broadcast(torch.zeros(1), 2)
        c.close()
