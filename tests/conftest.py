"""Helpers shared by the tests: free ports for groups on loopback, and status records built
as a member publishes them (through :meth:`ftcomm.core.engine.Engine.record`) or as a test needs
them."""

from __future__ import annotations

import glob
import os
import random
import shutil
import socket
import tempfile
import uuid

import pytest

from ftcomm.core.engine import Engine
from ftcomm.core.view import ACTIVE, Status

CFG = "cfg"

# The launchers the tests start keep their run files (address and secret of each job) here,
# not in the user's own directory.
os.environ.setdefault("FTCOMM_RUN_DIR", tempfile.mkdtemp(prefix="ftcomm-test-runs-"))


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_FLOOR = _ephemeral_floor()
_HANDED_OUT: set[int] = set()


def _port_range() -> tuple[int, int]:
    """The ports this test process hands out: below the ephemeral range, and, when pytest-xdist
    runs the tests in several processes, a slice of its own (two processes must never hand
    out the same port between one's check and the other's bind)."""
    low, high = max(1024, _EPHEMERAL_FLOOR - 12000), _EPHEMERAL_FLOOR
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        width = (high - low) // int(count)
        low += width * int(worker[2:])
        high = low + width
    return low, high


def free_port() -> int:
    """A port free for both UDP and TCP (gossip binds both), chosen below the kernel's
    ephemeral range: a port from that range can be taken, between this check and the
    group's bind, as the local end of any outgoing connection (a Gloo pair, a store
    client), which once failed a group's start with "Address already in use"."""
    rng = random.Random()
    low, high = _port_range()
    while True:
        port = rng.randrange(low, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, \
                socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            try:
                udp.bind(("127.0.0.1", port))
                tcp.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


def status(member: str, phase: str = ACTIVE, cv: int = 0, proposal=None, joined_at: float = 0.0, alive: bool = True,
           port: int | None = 4000, done_ops=None, config: str = CFG, **fields) -> Status:
    """A member's decoded record, as gossip shows it to a peer."""
    return Status(member, alive, False, phase, cv, proposal, joined_at, config, rendezvous_port=port,
                  done_ops=done_ops, **fields)


def published(e: Engine, alive: bool = True, step: int = 0) -> Status:
    """The record engine ``e`` publishes, as its peers decode it."""
    return Status.from_metadata(e.id, "alive" if alive else "dead", e.record(step).encode())


@pytest.fixture
def cluster():
    """A local cluster of training workers (examples/train_elastic.py), every one reaped after
    the test."""
    from tests.train_cluster import TrainCluster
    c = TrainCluster()
    yield c
    c.close()


@pytest.fixture
def name():
    """A job name for flash checkpoints; its shared-memory directory is removed after the test."""
    job = f"test-{uuid.uuid4().hex[:8]}"
    yield job
    shutil.rmtree(f"/dev/shm/ftcomm-{job}", ignore_errors=True)


@pytest.fixture
def one_process_mesh():
    """torch's default process group over this process alone, and its mesh of one (FSDP2
    over it still runs every hook of a sharded model)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


KEPT_STATES = "/dev/shm/ftcomm-*.left*"
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST_WORKER.startswith("gw"):
    # pytest-xdist runs the tests in several processes at once: the process tests of each
    # form their groups under a default cluster name of its own, so that a state one kept
    # when it lost the quorum is never another's starting point
    os.environ["FTCOMM_CLUSTER"] = f"ftcomm-{_XDIST_WORKER}"


@pytest.fixture(autouse=True)
def _no_kept_state_outlives_its_test():
    """A worker that loses the quorum keeps its state in ``/dev/shm/ftcomm-<cluster>.left``
    for its job's restart, and a job of that cluster started later resumes from it: one
    test's must not become another's starting point (the process tests share the default
    cluster name). With several test processes, only the default cluster's of this one:
    another's test may be using its own (the session's end removes the rest)."""
    pattern = f"/dev/shm/ftcomm-{os.environ['FTCOMM_CLUSTER']}.left*" if _XDIST_WORKER else KEPT_STATES
    before = set(glob.glob(pattern))
    yield
    for path in set(glob.glob(pattern)) - before:
        shutil.rmtree(path, ignore_errors=True)


def pytest_sessionstart(session) -> None:
    session.config.kept_states_before = set(glob.glob(KEPT_STATES))


def pytest_sessionfinish(session) -> None:
    """Kept states the tests left behind, once every test process is done (in the process
    that started them, or the only one)."""
    if hasattr(session.config, "workerinput"):
        return
    for path in set(glob.glob(KEPT_STATES)) - session.config.kept_states_before:
        shutil.rmtree(path, ignore_errors=True)
