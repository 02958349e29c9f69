"""Secure by default (DESIGN §1.6): protected mode, no code from the network, authenticated state.

Groups run in threads of this process (tests/test_group_threads.py); a "hostile" member
is an ordinary group whose outgoing state is replaced by what an attacker would send.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import msgpack
import numpy
import pytest
import torch

import ftcomm
from ftcomm import netif
from ftcomm.core.view import JOINING, StatusRecord
from ftcomm.errors import CollectiveAborted, ConfigMismatch, FtcommError, SecretRequired, StateError
from ftcomm.gossip import wire
from ftcomm.gossip.runtime import query_members
from ftcomm.runtime import transfer
from ftcomm.training.state import TrainingState

from .test_group_threads import in_threads, linear_models, run_steps, start_groups

pytestmark = pytest.mark.timeout(120)


def lan_address() -> str | None:
    """An address of this machine that is not loopback (where other hosts would reach it)."""
    for interface in netif.interfaces():
        if not interface.loopback and ":" not in interface.address:
            return interface.address
    return None


LAN = lan_address()
needs_lan = pytest.mark.skipif(LAN is None, reason="this machine has no non-loopback IPv4 address")


class Marker:
    """Unpickling this object creates a file: proof that code from a peer ran."""

    path = ""

    def __reduce__(self):
        return (open, (self.path, "w"))


# ---------------------------------------------------------------------- protected mode
@needs_lan
def test_a_reachable_worker_without_a_secret_refuses_to_start_and_says_how_to_fix_it():
    started = time.monotonic()
    with pytest.raises(SecretRequired, match="FTCOMM_SECRET.*insecure=True"):
        ftcomm.init(bind=f"{LAN}:0", handle_signals=False)
    assert time.monotonic() - started < 5


@needs_lan
def test_insecure_opt_out_starts_and_every_member_shows_it(monkeypatch, caplog):
    monkeypatch.setenv("FTCOMM_INSECURE", "1")
    monkeypatch.delenv("FTCOMM_CLUSTER", raising=False)  # the default cluster, which query_members asks for
    ft = ftcomm.init(bind=f"{LAN}:0", handle_signals=False)
    try:
        assert ft.insecure
        assert any("INSECURE" in r.getMessage() for r in caplog.records)
        members = query_members(ft.gossip.address, timeout=5)
        assert [m.metadata.get("insecure") for m in members] == [True]
    finally:
        ft.shutdown()


@needs_lan
def test_a_secret_lets_a_reachable_worker_start_and_the_default_bind_follows_it():
    ft = ftcomm.init(handle_signals=False, secret="k" * 32)
    try:
        assert not ft.insecure and not netif.is_loopback(ft.gossip.host)
    finally:
        ft.shutdown()


def test_without_secret_or_peers_the_default_bind_is_loopback(monkeypatch):
    monkeypatch.delenv("FTCOMM_BIND", raising=False)
    monkeypatch.delenv("FTCOMM_SECRET", raising=False)
    ft = ftcomm.init(handle_signals=False)
    try:
        assert netif.is_loopback(ft.gossip.host) and not ft.insecure
    finally:
        ft.shutdown()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_an_empty_secret_is_an_error_not_a_group_without_authentication(monkeypatch, how):
    kwargs = {"secret": ""} if how == "argument" else {}
    if how == "environment":
        monkeypatch.setenv("FTCOMM_SECRET", "")
    with pytest.raises(ValueError, match="secret is empty"):
        ftcomm.init(bind="127.0.0.1:0", handle_signals=False, **kwargs)


def test_a_bad_insecure_flag_is_refused(monkeypatch):
    monkeypatch.setenv("FTCOMM_INSECURE", "maybe")
    with pytest.raises(ValueError, match="FTCOMM_INSECURE"):
        ftcomm.init(bind="127.0.0.1:0", handle_signals=False)
    with pytest.raises(TypeError, match="insecure"):
        ftcomm.init(bind="127.0.0.1:0", handle_signals=False, insecure="yes")


# ---------------------------------------------------------------------- registered state
class Opaque:
    pass


@pytest.mark.parametrize("value, where", [
    ({"lr": numpy.float64(0.1)}, r"registered state 'extras'\['lr'\].*numpy.float64"),
    ([1, Opaque()], r"registered state 'extras'\[1\].*Opaque"),
    ({("a", 1): 2}, "dict key of type tuple"),
    ({"big": 1 << 70}, "does not fit in 64 bits"),
])
def test_state_that_is_not_tensors_and_plain_data_is_refused_at_registration(value, where):
    state = TrainingState()
    with pytest.raises(StateError, match=where):
        state.register(extras=value)
    assert not state.registered


def test_a_state_dict_holding_an_object_is_refused_naming_it():
    class Scheduler:
        def state_dict(self):
            return {"fn": lambda step: step}

        def load_state_dict(self, state):
            pass

    with pytest.raises(StateError, match=r"registered state 'scheduler'\['fn'\].*function"):
        TrainingState().register(scheduler=Scheduler())


def test_pack_and_unpack_round_trip_model_optimizer_and_values_exactly():
    source, target = TrainingState(), TrainingState()
    models = [torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3)) for _ in range(2)]
    optimizers = [torch.optim.Adam(m.parameters(), betas=(0.8, 0.9)) for m in models]
    models[0](torch.randn(4, 5)).sum().backward()
    optimizers[0].step()
    source.register(model=models[0], optimizer=optimizers[0], extras={"epoch": 3, "ids": (1, 2), "w": None})
    target.register(model=models[1], optimizer=optimizers[1], extras={})
    manifest, data = source.pack(7)
    assert target.unpack(manifest, data) == 7
    assert target.digest(7) == source.digest(7)
    assert optimizers[1].param_groups[0]["betas"] == (0.8, 0.9)
    for t in optimizers[1].state_dict()["state"][0].values():  # not views of the transfer buffer
        assert not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() != data.untyped_storage().data_ptr()


@pytest.mark.parametrize("manifest", [
    pickle.dumps({"step": 1}),
    b"\x85\xa4step\x01",  # truncated msgpack
    msgpack.packb({"step": 1, "skeleton": b"\xc7\x04\x01\x09\x00\x00\x00", "tensors": [], "size": 0}),
    msgpack.packb({"step": 1, "skeleton": b"\x80", "tensors": [[0, "float32", [4], 999]], "size": 0}),
    msgpack.packb({"step": -1, "skeleton": b"\x80", "tensors": [], "size": 0}),
    # a skeleton that is not a snapshot: before, AttributeError and TypeError escaped
    msgpack.packb({"step": 1, "skeleton": b"\x92\x01\x02", "tensors": [], "size": 0}),
    msgpack.packb({"step": 1, "skeleton": b"\x83\xa4step\x01\xa7objects\x05\xa6values\x80",
                                 "tensors": [], "size": 0}),
    # an empty tensor whose shape overflows: before, torch's RuntimeError escaped
    msgpack.packb({"step": 1, "skeleton": b"\x80", "tensors": [[0, "float32", [0, 1 << 40, 1 << 40], 0]],
                                 "size": 0}),
    # a dtype that is a list (found by tests/test_fuzz_decoders.py): before, TypeError escaped
    msgpack.packb({"step": 1, "skeleton": b"\x80", "tensors": [[0, ["float32"], [2], 8]], "size": 64}),
])
def test_a_malformed_manifest_is_refused(manifest):
    state = TrainingState()
    state.register(model=torch.nn.Linear(2, 2))
    with pytest.raises(StateError):
        state.unpack(manifest, torch.empty(0, dtype=torch.uint8))


def test_state_that_does_not_fit_the_model_is_refused_before_anything_is_loaded():
    """Before: the optimizer was loaded, then the model raised torch's RuntimeError (not StateError)."""
    source, target = TrainingState(), TrainingState()
    models = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m, lr in zip(models, (0.5, 0.1))]
    source.register(optimizer=optimizers[0], model=models[0])
    target.register(optimizer=optimizers[1], model=models[1])  # the optimizer is loaded first
    del models[0].bias  # the source's model lacks a tensor the target's has
    manifest, data = source.pack(3)
    before = target.digest(0)
    with pytest.raises(StateError, match="model"):
        target.unpack(manifest, data)
    assert target.digest(0) == before and optimizers[1].param_groups[0]["lr"] == 0.1


def test_a_pickled_manifest_never_runs(tmp_path):
    Marker.path = str(tmp_path / "ran")
    state = TrainingState()
    state.register(model=torch.nn.Linear(2, 2))
    with pytest.raises(StateError):
        state.unpack(pickle.dumps({"step": 1, "objects": Marker()}), torch.empty(0, dtype=torch.uint8))
    assert not os.path.exists(Marker.path)


# ---------------------------------------------------------------------- groups
def one_collective(i: int, g: ftcomm.FaultTolerantGroup) -> FtcommError | None:
    """Run one allreduce through ``execute``; the error it ended with, if any."""
    try:
        g.execute(lambda: g.allreduce(torch.ones(1)))
        return None
    except FtcommError as exc:
        return exc


def hostile(group: ftcomm.FaultTolerantGroup, manifest: bytes, step: int) -> None:
    """Make ``group`` claim the newest state and send ``manifest`` as that state."""
    group.state.pack = lambda step, device="cpu": (manifest, torch.zeros(64, dtype=torch.uint8))
    group.state_restored(step)


def compare_states(groups) -> None:
    """Make every member compare state digests before its next collective (as after a restore)."""
    for g in groups:
        g.state_restored(None)


def test_a_member_claiming_the_newest_state_cannot_run_code_on_the_others(tmp_path):
    """Before: the reconcile payload was loaded with torch.load(weights_only=False)."""
    Marker.path = str(tmp_path / "ran")
    groups = start_groups(2, quorum_timeout=8, max_retries=1)
    try:
        models, optimizers = linear_models(groups)
        run_steps(groups, models, optimizers, 2)
        honest_digest = groups[0].state.digest(groups[0].step)
        honest_step = groups[0].step
        compare_states(groups)
        hostile(groups[1], pickle.dumps({"step": 99, "objects": Marker()}), 99)

        outcomes = in_threads(groups, one_collective)
        assert isinstance(outcomes[0], FtcommError)
        assert not os.path.exists(Marker.path)
        assert (groups[0].step, groups[0].state.digest(groups[0].step)) == (honest_step, honest_digest)
    finally:
        for g in groups:
            g.shutdown()


def test_with_a_secret_state_that_fails_authentication_is_discarded():
    groups = start_groups(2, quorum_timeout=8, max_retries=1, secret="s" * 32)
    try:
        models, optimizers = linear_models(groups)
        run_steps(groups, models, optimizers, 2)
        honest = (groups[0].step, groups[0].state.digest(groups[0].step))
        compare_states(groups)
        groups[1].state_restored(groups[1].step + 5)
        groups[1]._comms.secret = b"t" * 32  # its state's tag (only) is keyed wrong: as if altered on the way

        outcomes = in_threads(groups, one_collective)
        assert isinstance(outcomes[0], FtcommError)
        assert (groups[0].step, groups[0].state.digest(groups[0].step)) == honest
    finally:
        for g in groups:
            g.shutdown()


def test_a_signed_state_transfer_is_bound_to_its_view():
    """Before: the tag covered manifest and bytes only, so a transfer captured on the data
    plane in one view (an older state) verified when replayed in any later view."""
    manifest, data = b"manifest", torch.zeros(64, dtype=torch.uint8)

    def tag(view: ftcomm.View) -> bytes:
        return transfer.state_tag(b"s" * 32, view, manifest, data)

    assert tag(ftcomm.View(3, ("a", "b"))) == tag(ftcomm.View(3, ("a", "b")))
    assert tag(ftcomm.View(3, ("a", "b"))) != tag(ftcomm.View(4, ("a", "b")))


def test_members_whose_models_differ_raise_config_mismatch_on_every_worker():
    groups = start_groups(2)
    try:
        models = [torch.nn.Linear(4, 2), torch.nn.Linear(4, 3)]
        for g, m in zip(groups, models):
            g.register_state(model=m)
        started = time.monotonic()

        outcomes = in_threads(groups, one_collective)
        assert all(isinstance(o, ConfigMismatch) for o in outcomes), outcomes
        assert "model.weight is float32[2, 4] here but float32[3, 4] there" in str(outcomes[0])
        assert "model.weight is float32[3, 4] here but float32[2, 4] there" in str(outcomes[1])
        assert time.monotonic() - started < 30
    finally:
        for g in groups:
            g.shutdown()


class _LeftFirst:
    """A communicator whose collectives are aborted: another member raised and left."""
    rank, device = 0, torch.device("cpu")

    def allgather(self, tensor):
        return self

    def wait(self, abort):
        raise CollectiveAborted("a member left")


@pytest.mark.parametrize("shards", [1, 2])
def test_a_member_whose_exchange_of_descriptions_is_interrupted_refuses_all_the_same(shards):
    """Before: the first member to raise ConfigMismatch left, which aborted the exchange of
    descriptions on a member still in it; that member re-formed and went on training with
    its different model."""
    state = TrainingState()
    state.register(model=torch.nn.Linear(4, 2))
    view = ftcomm.View(1, ("a", "b", "c", "d"))
    gathered = [(0, 0, 7), (0, 0, 7), (0, 0, 9), (0, 0, 9)]
    with pytest.raises(ConfigMismatch, match="model signatures differ"):
        if shards == 1:
            transfer.raise_model_mismatch(_LeftFirst(), None, state, view, gathered)
        else:
            transfer.raise_shard_mismatch(_LeftFirst(), None, state, view, gathered, shards)


def test_a_worker_of_another_group_protocol_is_refused_naming_both_versions(monkeypatch):
    (group,) = start_groups(1)
    try:
        monkeypatch.setattr(ftcomm.group, "PROTOCOL", ftcomm.core.view.PROTOCOL + 1)
        with pytest.raises(ConfigMismatch, match=f"protocol {ftcomm.core.view.PROTOCOL + 1} but the group speaks "
                                                 f"protocol {ftcomm.core.view.PROTOCOL}"):
            ftcomm.init(peers=[group.gossip.address], bind="127.0.0.1:0", handle_signals=False,
                        init_timeout=30)
        assert group.world_size == 1
    finally:
        group.shutdown()


def test_forged_joiners_do_not_hold_up_a_group_without_a_secret():
    """Before: forty forged 'joining' alive records stalled a 2-worker group for ~112 s."""
    groups = start_groups(2)
    try:
        models, optimizers = linear_models(groups)
        run_steps(groups, models, optimizers, 2)
        target = groups[0].gossip
        real = set(groups[0].view.members)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

        def forge(count: int) -> None:
            for i in range(count):
                phantom = f"127.0.0.1:{40000 + i}/{i:08x}"
                meta = StatusRecord(JOINING, 0, None, time.time(), groups[0]._config, 0, 40000 + i).encode()
                sealer = wire.Sealer("ftcomm", phantom, None, 1400)
                packet = sealer.seal([wire.encode([wire.ALIVE, phantom, 0, "127.0.0.1", 40000 + i,
                                                   msgpack.packb(meta, use_bin_type=True)])], now=time.time())
                sock.sendto(packet, (target.host, target.port))
                time.sleep(0.02)

        forger = threading.Thread(target=forge, args=(40,), daemon=True)
        forger.start()
        run_steps(groups, models, optimizers, 30)  # bounded by in_threads: 60 s
        forger.join(10)
        run_steps(groups, models, optimizers, 5)
        sock.close()
        assert all(set(e.members) <= real for g in groups for e in g.events)
        assert {g.world_size for g in groups} == {2}
        assert len({g.state.digest(g.step) for g in groups}) == 1
    finally:
        for g in groups:
            g.shutdown()


def test_the_member_table_is_capped_from_max_workers_unless_set():
    from ftcomm.gossip import GossipConfig
    from ftcomm.options import member_cap

    assert member_cap(GossipConfig(), 4).max_members == 24
    assert member_cap(GossipConfig(), None).max_members == GossipConfig().max_members
    assert member_cap(GossipConfig(max_members=100), 4).max_members == 100
    assert member_cap(GossipConfig(), 10_000).max_members == GossipConfig().max_members


def test_a_deeply_nested_skeleton_is_refused_not_a_crash():
    """Nested tuples (each its own msgpack buffer, decoded through a hook) and nested lists
    from a peer or a planted checkpoint: StateError, in a child process so that a crash of
    the interpreter fails this test instead of ending the run."""
    code = (
        "import msgpack\n"
        "from ftcomm.errors import StateError\n"
        "from ftcomm.training import plain\n"
        "data = plain._pack([])\n"
        "for _ in range(300):\n"
        "    data = plain._pack([msgpack.ExtType(plain._TUPLE, data)])\n"
        "for skeleton in (data, b'\\x91' * 900 + b'\\xc0', b'\\x81\\xa1k' * 500 + b'\\xc0'):\n"
        "    try:\n"
        "        plain.join(skeleton, [])\n"
        "    except StateError as exc:\n"
        "        print('refused:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.count("refused: skeleton nested more than 64 levels deep") == 3


def test_state_nested_deeper_than_the_limit_is_refused_when_registered():
    from ftcomm.training import plain
    value: list = []
    for _ in range(plain.MAX_DEPTH + 5):
        value = [value]
    with pytest.raises(StateError, match="nested more than 64 levels deep"):
        plain.split({"deep": value})
    shallow = {"a": [(1, 2.0, "x")], "b": {"c": {"d": [None]}}}
    skeleton, tensors = plain.split(shallow)
    assert plain.join(skeleton, tensors) == shallow


def test_bad_arguments_to_public_classes_are_clear_errors_not_attribute_errors(tmp_path):
    from ftcomm.errors import AddressError
    from ftcomm.group import FaultTolerantGroup
    from ftcomm.training.checkpoint import FlashCheckpointer

    with pytest.raises(TypeError, match="GroupOptions"):
        FaultTolerantGroup(options={"init_timeout": 1})
    with pytest.raises(TypeError, match="cluster"):
        FaultTolerantGroup(cluster=5)
    with pytest.raises(TypeError, match="the group ftcomm.init returned"):
        FlashCheckpointer(None)
    (group,) = start_groups(1)
    try:
        model = torch.nn.Linear(2, 2)
        group.register_state(model=model)
        model(torch.ones(1, 2)).sum().backward()
        assert group.wait_gradients_ready([model])  # a list of modules is a list of their parameters
        with pytest.raises(TypeError, match="got an item of type str"):
            group.wait_gradients_ready(["weights"])
        a_file = tmp_path / "a-file"
        a_file.write_text("x")
        for bad in (a_file, a_file / "below"):
            with pytest.raises(FtcommError, match="cannot use the checkpoint directory"):
                FlashCheckpointer(group, bad, name=f"bad-{uuid_hex()}")
    finally:
        group.shutdown()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        with pytest.raises(AddressError, match="metrics_port"):
            ftcomm.init(bind="127.0.0.1:0", handle_signals=False, metrics_port=taken.getsockname()[1])
    finally:
        taken.close()


def uuid_hex() -> str:
    import uuid
    return uuid.uuid4().hex[:8]


def _resident_mb() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


@pytest.mark.parametrize("megabytes", [4, 16])
@pytest.mark.parametrize("port", ["gossip", "store"])
def test_large_forged_frames_on_two_connections_cost_a_worker_little_memory(port, megabytes):
    """Frames of 4 MB and 16 MB with no valid signature, as fast as two connections carry
    them: each is refused before it is read (over the port's frame limit) or read and
    dropped, and the port queues at most a few per connection, so the worker's memory
    grows by at most 64 MB (zmq's queue of 1,000 frames a connection held gigabytes)."""
    from benchmarks.port_flood import FRAMES
    from ftcomm.gossip import GossipNode
    from ftcomm.runtime.rendezvous import StoreServer

    if port == "gossip":
        server = GossipNode(secret="s").start()
        address, close = f"tcp://{server.address}", server.stop
    else:
        server = StoreServer("127.0.0.1", b"s")
        address, close = f"tcp://127.0.0.1:{server.port}", server.close
    try:
        before = peak = _resident_mb()
        floods = [subprocess.Popen([sys.executable, "-c", FRAMES, address, str(megabytes << 20), "4"])
                  for _ in range(2)]
        while any(f.poll() is None for f in floods):
            peak = max(peak, _resident_mb())
            time.sleep(0.02)
        assert all(f.returncode == 0 for f in floods)
        assert peak - before <= 64, f"{peak - before} MB more"
    finally:
        close()


CONNECTION_FLOOD_TARGET = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from ftcomm.gossip import GossipNode
from ftcomm.runtime.rendezvous import StoreServer
node = GossipNode(secret="s").start()
store = StoreServer("127.0.0.1", b"s")
print(node.port, store.port, flush=True)
for line in sys.stdin:
    import os
    print(len(os.listdir("/proc/self/fd")), node.connections.refused, store.connections.refused, flush=True)
"""


MANY_HOSTS_TARGET = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from ftcomm.gossip import GossipNode
from ftcomm.runtime.rendezvous import StoreServer
node = GossipNode(secret="s").start()
store = StoreServer("127.0.0.1", b"s")
store.connections.trusted = node.is_member_host  # as the group sets it
print(node.port, store.port, node.connections.total, node.connections.per_host, flush=True)
for line in sys.stdin:
    import os
    print(len(os.listdir("/proc/self/fd")), node.connections.evicted, store.connections.evicted, flush=True)
"""


def test_connections_from_many_hosts_fill_a_port_and_a_members_host_still_gets_in():
    """Outsiders on many addresses (127.0.0.2 on) hold as many connections to each zmq port
    as it keeps in all; a connection from a member's host (here the node's own) then takes
    the place of one of theirs, and the member is served."""
    from ftcomm.gossip import query_members
    from ftcomm.runtime.rendezvous import StoreClient

    target = subprocess.Popen([sys.executable, "-c", MANY_HOSTS_TARGET], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        gossip_port, store_port, total, per_host = map(int, target.stdout.readline().split())
        for port in (gossip_port, store_port):
            for i in range(total + per_host):  # more than the total, from total / per_host + 1 hosts
                conn = socket.socket()
                conn.bind((f"127.0.0.{2 + i // per_host}", 0))
                conn.connect(("127.0.0.1", port))
                held.append(conn)
        time.sleep(1.0)  # (the ports read their connection events)
        assert [m.port for m in query_members(f"127.0.0.1:{gossip_port}", secret="s")] == [gossip_port]
        client = StoreClient("127.0.0.1", store_port, b"s", 5.0)
        client.set("key", b"value")
        assert client.get("key") == b"value"
        target.stdin.write("count\n")
        target.stdin.flush()
        descriptors, gossip_evicted, store_evicted = map(int, target.stdout.readline().split())
        assert target.poll() is None and descriptors < 700, descriptors
        assert gossip_evicted >= 1 and store_evicted >= 1, (gossip_evicted, store_evicted)
    finally:
        for conn in held:
            conn.close()
        target.kill()
        target.wait()


def test_thousands_of_connections_from_one_host_do_not_use_up_a_workers_descriptors():
    """3,000 connections from one address to each zmq port (gossip and the rendezvous store)
    of a worker whose descriptor limit is 1024, held open: each port keeps a few from that
    host and shuts down the rest as they come, so the worker keeps descriptors to spare and
    serves a member from another address (before, about 20,000 such connections killed a
    worker at its limit)."""
    from ftcomm.gossip import query_members
    from ftcomm.runtime.rendezvous import StoreClient

    target = subprocess.Popen([sys.executable, "-c", CONNECTION_FLOOD_TARGET], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        gossip_port, store_port = map(int, target.stdout.readline().split())
        for port in (gossip_port, store_port):
            for _ in range(3000):
                conn = socket.socket()
                conn.bind(("127.0.0.2", 0))  # the outsider's own address
                conn.connect(("127.0.0.1", port))
                held.append(conn)
        time.sleep(1.0)  # (the ports read their connection events)
        target.stdin.write("count\n")
        target.stdin.flush()
        descriptors, gossip_refused, store_refused = map(int, target.stdout.readline().split())
        assert target.poll() is None and descriptors < 512, descriptors
        assert gossip_refused >= 2900 and store_refused >= 2900, (gossip_refused, store_refused)
        assert [m.port for m in query_members(f"127.0.0.1:{gossip_port}", secret="s")] == [gossip_port]
        client = StoreClient("127.0.0.1", store_port, b"s", 5.0)
        client.set("key", b"value")
        assert client.get("key") == b"value"
    finally:
        for conn in held:
            conn.close()
        target.kill()
        target.wait()
