"""The backend interface: handles polled by the thread that waits, on real Gloo groups."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from ftcomm.backends.base import AbortSignal, Completion, Handle
from ftcomm.backends.gloo import GlooCommunicator
from ftcomm.errors import CollectiveAborted, CommunicatorError


pytestmark = pytest.mark.timeout(60)


def pair() -> list[GlooCommunicator]:
    """A two-rank Gloo group, both ranks in this process."""
    return gloo_group(2)


def gloo_group(size: int) -> list[GlooCommunicator]:
    """A Gloo group of ``size`` ranks, all in this process."""
    store, comms = dist.HashStore(), [None] * size

    def form(rank: int) -> None:
        comms[rank] = GlooCommunicator.form(store, rank, size, 1, AbortSignal(), 30.0, host="127.0.0.1")
    threads = [threading.Thread(target=form, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(comms)
    return comms


def test_gloo_collectives_complete_when_waited_for():
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


def test_a_poll_that_raises_fails_the_collective_and_the_communicator():
    def broken() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    completion = Completion()
    handle = Handle("probe", lambda: completion.finished(broken), lambda: completion.error)
    assert "illegal memory access" in handle.wait(AbortSignal(), 2.0)
    other = Handle("other", lambda: completion.finished(lambda: False), lambda: completion.error)
    assert other.completed  # the communicator failed: nothing of it reads as still running


def test_a_check_reporting_a_failure_ends_the_wait_and_a_signal_ends_it_at_once():
    verdict: list[str | None] = [None]
    completion = Completion(lambda: verdict[0])
    handle = Handle("stuck", lambda: completion.finished(lambda: False), lambda: completion.error)
    threading.Timer(0.05, verdict.__setitem__, args=(0, "peer 2 reset the connection")).start()
    assert handle.wait(AbortSignal(), 5.0) == "peer 2 reset the connection"
    stuck = Handle("stuck", lambda: False, lambda: None)
    abort = AbortSignal()
    threading.Timer(0.05, abort.fire, args=("peer 3 is suspect",)).start()
    with pytest.raises(CollectiveAborted, match="peer 3 is suspect"):
        stuck.wait(abort, None)  # no timeout to fall back on: only the signal can end this wait
    assert abort.noticed_at >= abort.fired_at  # DESIGN §2.3: the signal wakes the waiter


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


def test_a_process_that_gave_up_a_formation_whose_peer_never_came_exits_0_at_once():
    """The builder of an abandoned formation blocks in a store read for the missing rank; at
    exit it is cancelled (the read fails at once) instead of running on into interpreter
    finalization, where it died with SIGABRT ('terminate called without an active exception')."""
    import subprocess
    import sys

    child = r"""
import threading
from ftcomm.backends.base import AbortSignal
from ftcomm.backends.gloo import GlooCommunicator
from ftcomm.core.view import View
from ftcomm.errors import CollectiveAborted
from ftcomm.runtime.rendezvous import Rendezvous
rendezvous = Rendezvous("127.0.0.1", 600.0)
store = rendezvous.view_store(View(1, ("a", "b")), "127.0.0.1", rendezvous.port)
abort = AbortSignal()
threading.Timer(0.5, abort.fire, args=("the peer is gone",)).start()
try:
    GlooCommunicator.form(store, 0, 2, 1, abort, 600.0, host="127.0.0.1")  # rank 1 never comes
except CollectiveAborted:
    print("abandoned", flush=True)
"""
    # Without the cancel, exit would wait out the builder's 600 s read: far past this bound.
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and "abandoned" in done.stdout, done.stderr[-2000:]
    assert "still run" not in done.stderr


RANK_EXITS_AFTER_ONE_ALLREDUCE = """
import datetime, sys
import torch, torch.distributed as dist
from ftcomm.backends.gloo import quiesce_at_exit
rank, port = int(sys.argv[1]), int(sys.argv[2])
if sys.argv[3] == "quiesce":
    quiesce_at_exit()
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=30))
options = dist.ProcessGroupGloo._Options()
options._timeout = datetime.timedelta(seconds=30)
options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
group = dist.ProcessGroupGloo(store, rank, 2, options)
group.allreduce([torch.ones(4)]).wait()  # the script ends here: Gloo's thread still holds the finished work
"""


def test_a_script_that_ends_right_after_a_gloo_collective_exits_0():
    """Gloo's thread drops a finished collective (freeing its tensors, which takes Python's
    lock) after the waiting thread returned; without quiesce_at_exit the interpreter may be
    exiting by then, and the process aborts (about 3 runs in 20 here)."""
    import subprocess
    import sys

    from .conftest import free_port

    for _ in range(8):
        port = free_port()
        ranks = [subprocess.Popen([sys.executable, "-c", RANK_EXITS_AFTER_ONE_ALLREDUCE, str(rank), str(port),
                                   "quiesce"], stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        try:
            ends = [(rank.wait(40), rank.stderr.read()) for rank in ranks]
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
        assert [code for code, _ in ends] == [0, 0], [err[-500:] for _, err in ends]


def test_the_exit_waits_while_a_gloo_thread_runs_and_no_longer():
    """``_quiesce`` lets Python's lock go while a thread named as Gloo's runs (it may want the
    lock to free a finished collective), and returns once none runs; at most its limit."""
    import ctypes
    import time

    from ftcomm.backends import gloo

    stop = threading.Event()
    spinning = threading.Event()
    before = len(gloo._runloops())  # (the groups of the tests before, idle)

    def runloop() -> None:
        ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)  # PR_SET_NAME
        while not stop.is_set():
            spinning.set()
            sum(range(1000))  # runnable all along
    thread = threading.Thread(target=runloop, daemon=True)
    thread.start()
    spinning.wait(10)
    assert len(gloo._runloops()) == before + 1  # (found by its name)
    began = time.monotonic()
    threading.Timer(0.3, stop.set).start()
    gloo._quiesce()
    waited = time.monotonic() - began
    thread.join(10)
    assert not thread.is_alive() and stop.is_set() and waited >= 0.25  # waited while it ran
    began = time.monotonic()
    gloo._quiesce()  # none left: returns at once
    assert time.monotonic() - began < gloo.QUIESCE_LIMIT_S
