"""A sharded replica that loses a process is formed again with a replacement, in place:
the survivors keep their interpreters, FSDP2 models and optimizers (ftcomm.training.replica)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import free_port

REPAIRED_PROCESS = """
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from ftcomm.training.replica import Replica
role, first, second = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
shard = 0 if role == "survivor" else 1
replica = Replica(2, shard, f"127.0.0.1:{second if role == 'replacement' else first}", "gloo", 30)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
for layer in (model[0], model[2], model):
    fully_shard(layer, mesh=replica.mesh)
replica.check_sharded({"model": model})
x = torch.randn(4, 8)
out = {"key": replica.key, "pid": os.getpid()}
def step():
    model(x).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # (DTensor's own collective over the mesh)
    grad = model[0].weight.grad.full_tensor().sum().item()
    model.zero_grad()
    return grad
if role == "lost":
    step()
    os._exit(9)  # dies between two steps of its partner
if role == "survivor":
    out["before"] = step()
    model(x).sum().backward()  # its partner is gone: the collectives fail inside FSDP2
    out["lost"] = replica.lost is not None
    model.zero_grad()
    replica.reform(f"127.0.0.1:{second}")
out["after"] = [step() for _ in range(2)]
t = torch.full((2,), float(shard + 1))
dist.all_reduce(t)
out["sum"] = t.tolist()
out["full"] = model[0].weight.full_tensor().sum().item()
out["key2"] = replica.key
out["formations"] = replica.formations
print(json.dumps(out), flush=True)
# Not through the interpreter's exit: a Gloo worker thread may still be releasing the last
# collective's tensors a few microseconds after it completed, and a release that needs the
# interpreter while it finalizes aborts the process (torch's, for any script that exits
# right after a collective; a script under ftcomm leaves its group first, which takes longer).
os._exit(0)
"""


def test_a_survivor_keeps_its_fsdp2_model_and_forms_its_replica_again_with_a_replacement(tmp_path):
    """Two processes of a real Gloo replica train FSDP2; one dies (``os._exit``). The
    survivor's forward and backward complete without raising (the replica's collectives
    complete empty and it is marked lost); it then forms the replica again at a fresh address
    with a third process that takes the lost shard. Both train on: FSDP2's all-gather and
    reduce-scatter, DTensor's own collective (``clip_grad_norm_``, ``full_tensor``) and a plain
    ``all_reduce`` all run on the new group, the same on both, under a new key."""
    script = tmp_path / "repaired.py"
    script.write_text(REPAIRED_PROCESS)
    first, second = free_port(), free_port()
    run = lambda role: subprocess.Popen([sys.executable, str(script), role, str(first), str(second)],  # noqa: E731
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    survivor, lost = run("survivor"), run("lost")
    try:
        lost.wait(60)
        assert lost.returncode == 9, lost.stderr.read()
        replacement = run("replacement")
        out, err = survivor.communicate(timeout=90)
        assert survivor.returncode == 0, err
        new_out, new_err = replacement.communicate(timeout=60)
        assert replacement.returncode == 0, new_err
    finally:
        for p in (survivor, lost):
            if p.poll() is None:
                p.kill()
    kept, new = json.loads(out), json.loads(new_out)
    assert kept["lost"] and kept["formations"] == 2 and new["formations"] == 1
    assert kept["key2"] == new["key2"] != kept["key"]
    assert kept["after"] == new["after"] and kept["full"] == new["full"]
    assert kept["sum"] == new["sum"] == [3.0, 3.0]
    assert "sharded replica is lost" in err


def test_the_repair_channel_takes_the_newest_formation_once_and_reads_nothing_else():
    """The lines from the launcher are parsed strictly; the newest formation announced is
    taken, and never one older than a formation already tried; a closed launcher is no
    formation."""
    import socket

    from ftcomm.training import replica_repair
    from ftcomm.training.replica_repair import RepairChannel, parse_lost, parse_meet

    assert parse_meet("meet 3 127.0.0.1:4000") == (3, "127.0.0.1:4000")
    for line in ("meet -1 127.0.0.1:4000", "meet 3 127.0.0.1", "meet 3 127.0.0.1:4000 x", "MEET 3 127.0.0.1:4000",
                 "meet 3 127.0.0.1:99999", "lost 1 2"):
        assert parse_meet(line) is None, line
    assert parse_lost("lost 1 4242") == (1, 4242)
    assert parse_lost("lost -1 4242") is None and parse_lost("lost 1 42 x") is None and parse_lost("meet 1 2") is None
    launcher, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = RepairChannel(worker)
    try:
        assert channel.meeting(0.05) is None
        launcher.sendall(b"meet 2 127.0.0.1:4002\nmeet 1 127.0.0.1:4001\n")
        assert channel.meeting(1.0) == "127.0.0.1:4002"
        assert channel.meeting(0.05) is None  # (2 was tried: 1 is older)
        launcher.sendall(b"x" * (replica_repair.MAX_LINE + 10) + b" meet 9 127.0.0.1:4009\n"  # too long: dropped
                         + "meet 5 127.0.0.1:4005\u00e9\n".encode() + b"garbage\nmeet 3 127.0.0.1:4003\n")
        assert channel.meeting(1.0) == "127.0.0.1:4003"
        channel.report(1, 4242)
        channel.report(0, None)  # (not known on this host: nothing asked)
        assert launcher.recv(100) == b"lost 1 4242\n"
        launcher.close()
        assert channel.meeting(1.0) is None and channel.closed
    finally:
        channel.close()


def test_the_channel_is_taken_only_from_a_unix_stream_socket(monkeypatch):
    import os
    import socket

    from ftcomm.training.replica_repair import REPAIR_FD_ENV, RepairChannel

    monkeypatch.delenv(REPAIR_FD_ENV, raising=False)
    assert RepairChannel.from_env() is None
    monkeypatch.setenv(REPAIR_FD_ENV, "not a number")
    assert RepairChannel.from_env() is None
    read, write = os.pipe()
    try:
        monkeypatch.setenv(REPAIR_FD_ENV, str(read))
        assert RepairChannel.from_env() is None  # a pipe: not a socket
    finally:
        os.close(read)
        os.close(write)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        monkeypatch.setenv(REPAIR_FD_ENV, str(tcp.fileno()))
        assert RepairChannel.from_env() is None  # a TCP socket: not the launcher's pair
        assert tcp.fileno() >= 0  # (left open: not its descriptor to close)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    monkeypatch.setenv(REPAIR_FD_ENV, str(b.fileno()))
    channel = RepairChannel.from_env()
    assert channel is not None and not os.get_inheritable(b.fileno())
    b.detach()
    channel.close()
    a.close()


def test_fsdp2_collectives_over_the_whole_replica_take_its_current_group_and_a_sub_group_its_own():
    """ReplicaComms runs a collective FSDP2 asks for over the whole replica (the group it
    was built with, torn down since) on the replica's current group; one over a sub-group
    (reshard_after_forward=N) on that sub-group, and the replica is then no longer
    repairable in place (a repair could not form the sub-group again)."""
    from ftcomm.training.replica import ReplicaComms

    class Group:
        def __init__(self, size):
            self._size = size

        def size(self):
            return self._size

    current = Group(4)

    class Replica:
        size, lost, group = 4, None, current

    comms = ReplicaComms(Replica())
    assert comms.group_for(Group(4)) is current and comms.whole
    sub = Group(2)
    assert comms.group_for(sub) is sub and not comms.whole


def test_ftcomm_members_and_the_record_show_a_process_whose_replica_is_under_repair():
    """A process repairing its replica publishes it (``rr``): ftcomm members marks it and
    says what it means; the engine's record carries it from repair_replica until the
    process is in a view again."""
    from ftcomm.core.engine import Engine
    from ftcomm.core.view import StatusRecord
    from ftcomm.gossip.runtime import Member
    from ftcomm.ops.cli import _member_table

    record = StatusRecord("joining", 0, None, 1.0, "cf", 40, 5000, repairing=True).encode()
    assert record["rr"] is True and "rr" not in StatusRecord("active", 3, None, 1.0, "cf", 40, 5000).encode()
    table = _member_table([Member("a:1/x", "a", 1, "alive", 0, record),
                           Member("b:1/x", "b", 1, "alive", 0, {**record, "rr": "\x1b[2J"})])
    rows = {line.split()[0]: line for line in table.splitlines()[1:3]}
    assert "replica=repairing" in rows["a:1/x"] and "replica=repairing" not in rows["b:1/x"]
    assert table.splitlines()[-1].startswith("replica=repairing") and "\x1b" not in table
    engine = Engine("a", "cf", replica=("K", 0, 2))
    assert not engine.record().repairing
    engine.repair_replica("a partner died")  # (a joiner: no view to leave)
    assert engine.record().repairing and engine.state == "JOINING"
    engine.replica_formed("K2")
    assert engine.replica == ("K2", 0, 2) and engine.record().replica == ("K2", 0, 2)


MESH_PROCESS = """
import sys
import torch, torch.distributed as dist
torch.cuda.is_available = lambda: True  # (a host with GPUs: torch's mesh would make a group of its own)
from ftcomm.training.replica import Replica
shard, first, second = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
replica = Replica(2, shard, f"127.0.0.1:{first}", "gloo", 30)
print(replica.mesh.get_group() is replica.group, len(dist.distributed_c10d._world.pg_map), flush=True)
replica.tear_down("the test")
replica.reform(f"127.0.0.1:{second}")
print(replica.mesh.get_group() is replica.group, flush=True)
t = torch.full((2,), float(shard + 1))
dist.all_reduce(t, group=replica.mesh.get_group())
print(t.tolist(), flush=True)
"""


def test_the_shard_mesh_is_the_replica_s_own_group_where_cuda_is_available(tmp_path):
    """Where CUDA is available, torch's device mesh over a Gloo default group makes a group
    of its own, which no tear-down would shut and no repair form again. The replica's mesh
    is made over its own group instead, and resolves to the group of the newest formation."""
    script = tmp_path / "mesh.py"
    script.write_text(MESH_PROCESS)
    first, second = free_port(), free_port()
    runs = [subprocess.Popen([sys.executable, str(script), str(shard), str(first), str(second)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for shard in (0, 1)]
    try:
        outs = [p.communicate(timeout=90) for p in runs]
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(runs, outs):
        assert p.returncode == 0, err
        assert out.split("\n")[:3] == ["True 1", "True", "[3.0, 3.0]"], (out, err)
