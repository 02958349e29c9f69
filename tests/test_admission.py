"""Nobody on the network can kill a worker through its data plane's listener.

Gloo's listener never closes a connection that sends nothing, and aborts the process when
``accept`` runs out of descriptors; ftcomm puts a kernel socket filter on it (see
ftcomm.backends.admission): members only while a communicator forms, nobody in between.
"""

from __future__ import annotations

import errno
import pathlib
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from ftcomm.backends import admission

from .train_cluster import assert_invariants

pytestmark = pytest.mark.timeout(150)


def connects(port: int, host: str = "127.0.0.1", source: str | None = None, wait: float = 0.3) -> bool:
    """Whether a TCP connection to ``host:port`` (from ``source``) completes within ``wait``."""
    with socket.socket() as sock:
        if source is not None:
            sock.bind((source, 0))
        sock.setblocking(False)
        if sock.connect_ex((host, port)) not in (0, errno.EINPROGRESS):
            return False
        _, writable, _ = select.select([], [sock], [], wait)
        return bool(writable) and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0


@pytest.fixture
def door():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held = admission.listening_sockets()[listener.fileno()]
    yield admission.Door(listener.fileno(), *held), listener
    listener.close()


def test_a_door_admits_the_sources_of_a_formation_and_nobody_between_formations(door):
    door, listener = door
    port = listener.getsockname()[1]
    assert not connects(port)  # shut from the start
    close = door.open_for({"127.0.0.2"})
    assert connects(port, source="127.0.0.2")
    assert not connects(port, source="127.0.0.3")
    assert not connects(port)  # from 127.0.0.1
    other = door.open_for({"127.0.0.1"})  # overlapping formations: the union
    assert connects(port) and connects(port, source="127.0.0.2")
    close()
    assert connects(port) and not connects(port, source="127.0.0.2")
    other()
    other()  # closing twice changes nothing
    assert not connects(port) and not connects(port, source="127.0.0.2")
    anyone = door.open_for(None)
    assert connects(port, source="127.0.0.3")
    anyone()
    assert not connects(port, source="127.0.0.3")


def test_a_sealed_door_closes_the_listening_socket_and_keeps_its_number_harmless(door):
    door, listener = door
    port, fd = listener.getsockname()[1], listener.fileno()
    door.seal()
    assert os.readlink(f"/proc/self/fd/{fd}") == os.devnull
    assert fd not in admission.listening_sockets()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED
    door.open_for({"127.0.0.1"})()  # a late formation's bookkeeping does not touch the number again
    assert os.readlink(f"/proc/self/fd/{fd}") == os.devnull
    listener.detach()  # the number is /dev/null's now; the fixture must not close the socket object twice
    os.close(fd)


def test_the_filter_program_is_refused_past_its_bound_by_keeping_every_packet():
    assert len(admission.program(set())) == 2  # load, drop
    assert admission.program(None) == [admission._instruction(admission.RETURN, 0, 0, admission.KEEP_PACKET)]
    many = {f"10.0.{i // 250}.{i % 250}" for i in range(10)}
    assert len(admission.program(many)) == 2 * len(many) + 2


# ---------------------------------------------------------------------- real workers
def listening_ports(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on."""
    inodes = set()
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    ports = []
    with open(f"/proc/{pid}/net/tcp") as table:
        for line in table.read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[9]) in inodes:
                ports.append(int(fields[1].split(":")[1], 16))
    return ports


def flood(port: int, count: int) -> int:
    """``count`` connect-and-close to ``port``, as fast as they go; how many connected."""
    connected = 0
    for _ in range(count):
        with socket.socket() as sock:
            sock.setblocking(False)
            code = sock.connect_ex(("127.0.0.1", port))
            if code == 0 or (code == errno.EINPROGRESS and select.select([], [sock], [], 0.002)[1]
                             and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0):
                connected += 1
    return connected


def test_a_flood_of_empty_connections_to_every_port_of_a_worker_neither_kills_nor_stalls_it(cluster):
    workers = cluster.start(3, ["--min-workers", "1"])
    views = cluster.wait_view(workers, 3, timeout=60)
    victim = workers[1]
    limit = 256  # Gloo aborted a worker after about this many connections before the filter
    resource.prlimit(victim.pid, resource.RLIMIT_NOFILE, (limit, resource.prlimit(victim.pid,
                                                                                  resource.RLIMIT_NOFILE)[1]))
    descriptors = len(os.listdir(f"/proc/{victim.pid}/fd"))
    ports = listening_ports(victim.pid)
    assert ports, "the worker listens on no TCP port"
    for port in ports:
        flood(port, 4 * limit)
    time.sleep(0.5)
    assert victim.alive(), "".join(victim.stderr_tail[-20:])
    assert len(os.listdir(f"/proc/{victim.pid}/fd")) < descriptors + limit // 4  # nothing piled up
    # The group still re-forms through the victim's listener after the flood: a member leaves.
    workers[2].signal(signal.SIGKILL)
    survivors = workers[:2]
    cluster.wait_view(survivors, 2, timeout=30, after=max(v["view_id"] for v in views))
    assert_invariants(survivors, cluster.finish(survivors))


def test_a_gloo_listener_without_the_filter_is_killed_by_the_same_flood():
    """The attack is real: Gloo's own listener, with the door left open, dies of it."""
    child = r"""
import datetime, os, resource, sys, threading
import torch.distributed as dist
from ftcomm.backends import admission
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
device, door = admission.guard(lambda: dist.ProcessGroupGloo.create_device(hostname="127.0.0.1"), "test", "127.0.0.1")
if sys.argv[1] == "open":
    door.open_for(None)
print(door.port, flush=True)
sys.stdin.readline()
print("alive", flush=True)
"""
    for mode, survives in (("shut", True), ("open", False)):
        proc = subprocess.Popen([sys.executable, "-c", child, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline())
            flood(port, 1000)
            time.sleep(0.3)
            proc.stdin.write("\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=30)
        except BrokenPipeError:
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        if survives:
            assert proc.returncode == 0 and "alive" in out, err[-2000:]
        else:
            assert proc.returncode == -signal.SIGABRT and "Too many open files" in err, (proc.returncode, err[-2000:])


def test_shutdown_closes_every_socket_the_group_opened_and_later_calls_are_clear_errors():
    child = r"""
import os, time, torch, ftcomm
from ftcomm.backends import gloo
from ftcomm.errors import FtcommError

def sockets():
    held = set()
    for entry in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        if link.startswith("socket:["):
            held.add(link)
    return held

torch.ones(1)  # torch's own start-up first
before = sockets()
for cycle in range(2):
    g = ftcomm.init(bind="127.0.0.1:0", handle_signals=False)
    model = torch.nn.Linear(4, 2)
    g.register_state(model=model)
    model(torch.randn(3, 4)).sum().backward()
    assert g.wait_gradients_ready(model)
    assert g.allreduce(torch.ones(2)).tolist() == [1.0, 1.0]
    # the device was made while the group joined: its listener was found, and has its door
    assert gloo._DEVICES and all(door is not None for _, door in gloo._DEVICES.values()), gloo._DEVICES
    g.shutdown()
    # zmq closes a socket in its I/O thread once shutdown has closed it: on a loaded host the
    # client side of the worker's own rendezvous may sit in CLOSE_WAIT for a moment.
    deadline = time.monotonic() + 10
    while sockets() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sockets() - before
    assert not left, (cycle, left)
calls = {"wait_gradients_ready": lambda: g.wait_gradients_ready(model), "execute": lambda: g.execute(lambda: 1),
         "allreduce": lambda: g.allreduce(torch.ones(1)), "broadcast": lambda: g.broadcast(torch.ones(1), 0),
         "allgather": lambda: g.allgather(torch.ones(1)), "barrier": g.barrier, "step_boundary": g.step_boundary,
         "state_restored": lambda: g.state_restored(None), "register_state": lambda: g.register_state(model=model),
         "no_sync": g.no_sync}
for name, call in calls.items():
    try:
        call()
    except FtcommError as exc:
        assert "shut down" in str(exc), (name, exc)
    else:
        raise AssertionError(f"{name} after shutdown raised nothing")
g.shutdown()  # again: nothing to do
print("clean", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr[-3000:]


def test_a_filter_the_kernel_refuses_falls_back_to_admitting_any_source_while_forming(tmp_path):
    """A filter's memory counts against net.core.optmem_max (20 kB by default before Linux
    6.9): when the kernel refuses the list of sources, the formation still goes on, its
    listener open to any source until it ends, and nothing escapes as an OSError."""
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -n (root) for a network namespace of its own")
    child = r"""
import logging, socket, sys
sys.path.insert(0, sys.argv[1])
logging.basicConfig(level=logging.WARNING)
from ftcomm.backends import admission
from tests.test_admission import connects
with open("/proc/sys/net/core/optmem_max", "w") as f:
    f.write("1024")
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(16)
door = admission.Door(listener.fileno(), *admission.listening_sockets()[listener.fileno()])
port = listener.getsockname()[1]
assert not connects(port)
close = door.open_for({f"10.0.{i // 250}.{i % 250}" for i in range(300)} | {"127.0.0.1"})
assert connects(port), "the formation's window is not open"
close()
assert not connects(port), "the door did not shut again"
print("fell back", flush=True)
"""
    done = subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" -c "$1" "$2"',
                           sys.executable, child, str(pathlib.Path(__file__).resolve().parent.parent)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "fell back" in done.stdout, done.stderr[-2000:]
    assert "admits any source while communicators form" in done.stderr
