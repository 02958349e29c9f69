"""Sharded models (FSDP2) under ftcomm: each replica shards the model over its own K
processes (torch's process group); every process is a member of the group, whose views
hold whole replicas, and the shard-i processes of a view average shard i's gradients and
reconcile shard i's state over a communicator of their own. Without faults this must train
exactly as plain HSDP on a ("replicate", "shard") mesh."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from ftcomm.training import sharded
from tests.conftest import free_port

dist = pytest.importorskip("torch.distributed")
fsdp = pytest.importorskip("torch.distributed.fsdp")

pytestmark = pytest.mark.timeout(300)

REPLICAS, SHARDS, STEPS = 2, 2, 3


def _model(seed: int = 0, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 6))


def _shard(model: torch.nn.Module, mesh) -> None:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)


def _batch(step: int, replica: int, shard: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + 10 * replica + shard))


def _local_state(model, optimizer) -> dict:
    state = {f"param.{n}": p.to_local().clone() for n, p in model.named_parameters()}
    for index, entry in optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            state[f"optim.{index}.{key}"] = sharded.local(value).clone()
    return state


def _plain_hsdp(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=REPLICAS * SHARDS)
    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    replica, shard = divmod(rank, SHARDS)
    model = _model()
    _shard(model, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(STEPS):
        model(_batch(step, replica, shard)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save(_local_state(model, optimizer), os.path.join(out, f"plain_{replica}_{shard}.pt"))
    dist.destroy_process_group()


def _replica_group(rank: int, ports: list[int], cluster: str):
    """Process ``rank`` of REPLICAS x SHARDS in the group ``cluster``: its replica's store on
    ``ports[replica]``, gossip on ``ports[REPLICAS + rank]``."""
    import ftcomm
    replica, shard = divmod(rank, SHARDS)
    gossip = ports[REPLICAS:]
    return ftcomm.init(backend="gloo", bind=f"127.0.0.1:{gossip[rank]}",
                       peers=[f"127.0.0.1:{gossip[0]}"] if rank else [], min_workers=REPLICAS, cluster=cluster,
                       handle_signals=False, settle_interval=0.3, init_timeout=60, replica_size=SHARDS,
                       shard_rank=shard, replica_addr=f"127.0.0.1:{ports[replica]}")


def _with_ftcomm(rank: int, ports: list[int], out: str, apart: bool) -> None:
    import ftcomm
    replica, shard = divmod(rank, SHARDS)
    group = _replica_group(rank, ports, "sharded-test")
    assert (group.replica_size, group.shard_rank, group.num_replicas) == (SHARDS, shard, REPLICAS)
    assert group.world_size == REPLICAS * SHARDS and group.rank % SHARDS == shard  # whole replicas, in shard order
    assert group.shard_mesh.size() == SHARDS and dist.get_world_size() == SHARDS  # torch's group: the replica's
    with pytest.raises(ftcomm.StateError, match=r"model\.0\.weight is not sharded over ft.shard_mesh"):
        group.register_state(model=_model())  # not sharded: refused before anything is registered
    assert not group.state.registered
    model = _model(seed=replica if apart else 0)
    _shard(model, group.shard_mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    group.register_state(model=model, optimizer=optimizer)
    committed = []
    for step in range(STEPS):
        group.step_boundary()  # the first: apart, shard i of the group's rank 0 reaches the other replica
        model(_batch(step, replica, shard)).pow(2).mean().backward()
        commit = group.wait_gradients_ready(model)  # the replica's shards commit as one
        if commit:
            optimizer.step()
        committed.append(commit)
        optimizer.zero_grad()
    torch.save({"state": _local_state(model, optimizer), "committed": committed, "step": group.step,
                "world": group.world_size}, os.path.join(out, f"ft_{replica}_{shard}.pt"))
    group.shutdown()
    dist.destroy_process_group()


def test_fsdp2_shards_averaged_across_replicas_train_exactly_as_plain_hsdp(tmp_path):
    """2 replicas x 2 shards train 3 steps with Adam: every parameter and optimizer shard
    ends as plain HSDP's."""
    mp = torch.multiprocessing
    mp.spawn(_plain_hsdp, args=(free_port(), str(tmp_path)), nprocs=REPLICAS * SHARDS)
    ports = [free_port() for _ in range(REPLICAS + REPLICAS * SHARDS)]
    mp.spawn(_with_ftcomm, args=(ports, str(tmp_path), False), nprocs=REPLICAS * SHARDS)
    for replica in range(REPLICAS):
        for shard in range(SHARDS):
            plain = torch.load(tmp_path / f"plain_{replica}_{shard}.pt")
            ours = torch.load(tmp_path / f"ft_{replica}_{shard}.pt")
            assert ours["committed"] == [True] * STEPS and ours["step"] == STEPS and ours["world"] == REPLICAS * SHARDS
            assert set(ours["state"]) == set(plain) and len(plain) > 4  # parameters and Adam's state
            for name, expected in plain.items():
                torch.testing.assert_close(ours["state"][name], expected, rtol=1e-6, atol=1e-7, msg=name)


MIXED_STEPS = 5


def _mixed_steps(model, optimizer, replica: int, shard: int, reduce, no_sync, observe=lambda: None) -> None:
    """Steps that take each way of the sharded gradient path: the first (no hooks yet);
    plain ones (reduced in place during backward); two backward passes, the first inside
    ``no_sync`` (FSDP2 adds into the gradient shards); and in the last, one replica's
    gradients zeroed, not freed (it adds into existing ones and gathers them at the step)
    while the other's go out in place: the two layouts must agree, padding included."""
    for step in range(MIXED_STEPS):
        if step == 2:
            with no_sync():
                model(_batch(step, replica, shard + 5)).pow(2).mean().backward()
        model(_batch(step, replica, shard)).pow(2).mean().backward()
        observe()
        if reduce():
            optimizer.step()
        optimizer.zero_grad(set_to_none=not (step == MIXED_STEPS - 2 and replica == 0))


def _plain_hsdp_mixed(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=REPLICAS * SHARDS)
    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    replica, shard = divmod(rank, SHARDS)
    model = _model(hidden=15)  # 15 rows over 2 shards: padded
    _shard(model, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _mixed_steps(model, optimizer, replica, shard, reduce=lambda: True, no_sync=lambda: contextlib.nullcontext())
    torch.save(_local_state(model, optimizer), os.path.join(out, f"plain_{replica}_{shard}.pt"))
    dist.destroy_process_group()


def _ftcomm_mixed(rank: int, ports: list[int], out: str) -> None:
    from ftcomm.training.shard_groups import ShardGroupBuckets
    replica, shard = divmod(rank, SHARDS)
    group = _replica_group(rank, ports, "sharded-mixed")
    model = _model(hidden=15)
    _shard(model, group.shard_mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    group.register_state(model=model, optimizer=optimizer)
    group.step_boundary()
    seen = []

    def observe() -> None:  # after backward, before the step: what backward started
        buckets = group._collective.buckets
        seen.append((type(buckets).__name__ if buckets is not None else None,
                     buckets is not None and buckets.touched))

    committed = []
    _mixed_steps(model, optimizer, replica, shard, reduce=lambda: committed.append(
        group.wait_gradients_ready(model)) or committed[-1], no_sync=group.no_sync, observe=observe)
    hooks = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())
    assert isinstance(group._collective.buckets, ShardGroupBuckets)
    torch.save({"state": _local_state(model, optimizer), "committed": committed, "seen": seen, "hooks": hooks},
               os.path.join(out, f"ft_{replica}_{shard}.pt"))
    group.shutdown()
    dist.destroy_process_group()


def test_the_sharded_gradient_path_reduces_per_parameter_group_and_matches_plain_hsdp_on_every_way(tmp_path):
    """A sharded model is reduced across replicas one parameter group at a time, from
    FSDP2's all-reduce hook, with no hook on any parameter: steps reduced in place during
    backward, the first step (before the hooks), a step whose first backward ran inside
    ``no_sync`` (gathered at the step) and one where one replica gathers while the other
    reduces in place all end, with unevenly sharded (padded) parameters, exactly as plain
    HSDP."""
    mp = torch.multiprocessing
    mp.spawn(_plain_hsdp_mixed, args=(free_port(), str(tmp_path)), nprocs=REPLICAS * SHARDS)
    ports = [free_port() for _ in range(REPLICAS + REPLICAS * SHARDS)]
    mp.spawn(_ftcomm_mixed, args=(ports, str(tmp_path)), nprocs=REPLICAS * SHARDS)
    for replica in range(REPLICAS):
        for shard in range(SHARDS):
            plain = torch.load(tmp_path / f"plain_{replica}_{shard}.pt")
            ours = torch.load(tmp_path / f"ft_{replica}_{shard}.pt")
            assert ours["committed"] == [True] * MIXED_STEPS
            assert ours["hooks"] == 0  # nothing per parameter
            # Backward started the sums in steps 1 and 3 (in place); step 0 had no hooks yet,
            # step 2 (and replica 0's step 4) added into existing gradient shards: reduced at the step.
            assert ours["seen"] == [(None, False), ("ShardGroupBuckets", True), ("ShardGroupBuckets", False),
                                    ("ShardGroupBuckets", True), ("ShardGroupBuckets", replica == 1)]
            assert set(ours["state"]) == set(plain) and len(plain) > 4
            for name, expected in plain.items():
                torch.testing.assert_close(ours["state"][name], expected, rtol=1e-6, atol=1e-7, msg=name)


def test_replicas_started_apart_hold_equal_shards_once_reconciled(tmp_path):
    """Started from different weights, the shard-i processes take shard i from one replica
    before the first step: shard for shard, parameters and optimizer state end equal."""
    ports = [free_port() for _ in range(REPLICAS + REPLICAS * SHARDS)]
    torch.multiprocessing.spawn(_with_ftcomm, args=(ports, str(tmp_path), True), nprocs=REPLICAS * SHARDS)
    for shard in range(SHARDS):
        states = [torch.load(tmp_path / f"ft_{replica}_{shard}.pt")["state"] for replica in range(REPLICAS)]
        for name, value in states[0].items():
            for other in states[1:]:
                torch.testing.assert_close(other[name], value, rtol=0, atol=0, msg=name)


def _other_widths(rank: int, ports: list[int], out: str) -> None:
    import ftcomm
    replica, shard = divmod(rank, SHARDS)
    group = _replica_group(rank, ports, "sharded-mismatch")
    model = _model(hidden=16 if replica == 0 else 24)  # replica 1 runs a wider model
    _shard(model, group.shard_mesh)
    try:
        group.register_state(model=model)
        # The first reconcile compares every shard's model. A step boundary alone may not run
        # it: news that breaks the view there (a busy host's late gossip) leaves the view to be
        # formed again before the next collective, and the boundary returns. A collective run
        # through execute is reconciled before it, in whatever view forms.
        group.step_boundary()
        group.execute(group.barrier)
        error = "trained"
    except ftcomm.ConfigMismatch as exc:
        error = str(exc)
    with open(os.path.join(out, f"mismatch_{rank}.txt"), "w") as f:
        f.write(error)
    group.shutdown()
    dist.destroy_process_group()


def test_replicas_whose_shards_differ_are_refused_naming_the_shard(tmp_path):
    """Every process raises ConfigMismatch naming the shard; those that completed the
    exchange of descriptions name the first tensor that differs (the first to raise
    leaves, which may interrupt the exchange on another: it refuses all the same)."""
    ports = [free_port() for _ in range(REPLICAS + REPLICAS * SHARDS)]
    torch.multiprocessing.spawn(_other_widths, args=(ports, str(tmp_path)), nprocs=REPLICAS * SHARDS)
    errors = [(tmp_path / f"mismatch_{rank}.txt").read_text() for rank in range(REPLICAS * SHARDS)]
    assert all("shard 0 differs between the replicas" in e for e in errors), errors
    named = [e for e in errors if "model.0.weight is float32[" in e]
    assert named and all(e in named or "model signatures differ" in e for e in errors), errors


def _trained(mesh, seed: int, steps: int):
    """A model sharded over ``mesh`` and its Adam optimizer, after ``steps`` steps."""
    model = _model(seed)
    _shard(model, mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        model(_batch(step, 0, 0)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_sharded_state_is_this_process_shards_and_loads_back_into_dtensors(one_process_mesh):
    """One process, a mesh of one: the snapshot holds local tensors (plain data, no
    DTensor), and a state received from a peer is rebuilt as DTensors to load."""
    from ftcomm.training.state import TrainingState
    model, optimizer = _trained(one_process_mesh, 0, 1)
    state = TrainingState()
    state.register(model=model, optimizer=optimizer)
    snapshot = state.snapshot(5)
    tensors = [v for v in snapshot["objects"]["model"].values()]
    assert tensors and not any(sharded.is_sharded(t) for t in tensors)
    manifest, data = state.pack(5)
    other, other_optimizer = _trained(one_process_mesh, 1, 2)
    receiver = TrainingState()
    receiver.register(model=other, optimizer=other_optimizer)
    assert receiver.digest(5) != state.digest(5)
    assert receiver.unpack(manifest, data) == 5
    assert receiver.digest(5) == state.digest(5)
    assert all(sharded.is_sharded(p) for p in other.parameters())  # still sharded parameters


def test_an_optimizer_that_never_stepped_loads_sharded_state_and_steps_on(one_process_mesh):
    """A replica that joins has a fresh optimizer (no state yet): the Adam state it receives
    is rebuilt as DTensors like its parameters, and the next step runs."""
    from ftcomm.training.state import TrainingState
    model, optimizer = _trained(one_process_mesh, 0, 2)
    state = TrainingState()
    state.register(model=model, optimizer=optimizer)
    manifest, data = state.pack(2)
    fresh, fresh_optimizer = _trained(one_process_mesh, 1, 0)
    assert not fresh_optimizer.state
    receiver = TrainingState()
    receiver.register(model=fresh, optimizer=fresh_optimizer)
    assert receiver.unpack(manifest, data) == 2 and receiver.digest(2) == state.digest(2)
    assert all(sharded.is_sharded(v) for entry in fresh_optimizer.state.values() for k, v in entry.items()
               if k != "step")
    for m, o in ((model, optimizer), (fresh, fresh_optimizer)):
        m(_batch(9, 0, 0)).pow(2).mean().backward()
        o.step()
        o.zero_grad()
    assert receiver.digest(3) == state.digest(3)


@pytest.mark.parametrize("arguments, env, error", [
    ({"replica_size": 0}, {}, "replica_size must be >= 1"),
    ({"replica_size": 2, "shard_rank": 2}, {}, "shard_rank must be in 0..1"),
    ({"replica_size": "2"}, {}, "replica_size must be an int"),
    ({}, {"FTCOMM_REPLICA_SIZE": "two"}, "FTCOMM_REPLICA_SIZE must be an integer"),
    ({"replica_size": 2, "replica_addr": 5}, {}, "replica_addr must be"),
])
def test_replica_settings_are_checked_before_anything_starts(monkeypatch, arguments, env, error):
    from ftcomm.training.replica import replica_settings
    for name in ("FTCOMM_REPLICA_SIZE", "FTCOMM_SHARD_RANK", "FTCOMM_REPLICA_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises((TypeError, ValueError), match=error):
        replica_settings(arguments.get("replica_size"), arguments.get("shard_rank"), arguments.get("replica_addr"))


def test_replica_settings_come_from_the_launcher_environment(monkeypatch):
    from ftcomm.training.replica import replica_settings
    monkeypatch.setenv("FTCOMM_REPLICA_SIZE", "4")
    monkeypatch.setenv("FTCOMM_SHARD_RANK", "3")
    monkeypatch.setenv("FTCOMM_REPLICA_ADDR", "10.0.0.2:29500")
    assert replica_settings(None, None, None) == (4, 3, "10.0.0.2:29500")
    assert replica_settings(2, 1, "h:1") == (2, 1, "h:1")


def test_a_flash_checkpoint_of_sharded_state_restores_into_a_new_group(tmp_path, one_process_mesh):
    """One process, a mesh of one: a group saves its sharded model and Adam state; a new
    group (a restarted job) restores them into a freshly sharded model, as DTensors."""
    import ftcomm
    group = ftcomm.init(bind=f"127.0.0.1:{free_port()}", handle_signals=False, cluster="sharded-ckpt")
    model, optimizer = _trained(one_process_mesh, 0, 2)
    group.register_state(model=model, optimizer=optimizer)
    group.step = 2
    checkpointer = ftcomm.FlashCheckpointer(group, tmp_path / "ckpt", keep=1)
    checkpointer.save()
    checkpointer.close()
    saved = _local_state(model, optimizer)
    model(_batch(7, 0, 0)).pow(2).mean().backward()  # the step after the checkpoint, for reference
    optimizer.step()
    after = _local_state(model, optimizer)
    group.shutdown()

    group = ftcomm.init(bind=f"127.0.0.1:{free_port()}", handle_signals=False, cluster="sharded-ckpt")
    model, optimizer = _trained(one_process_mesh, 1, 1)  # other weights, and Adam state of another step
    group.register_state(model=model, optimizer=optimizer)
    restorer = ftcomm.FlashCheckpointer(group, tmp_path / "ckpt", keep=1)
    assert restorer.restore() == 2
    restorer.close(discard=True)  # (this host's shared-memory copies removed: the test's job is over)
    restored = _local_state(model, optimizer)
    assert set(restored) == set(saved)
    for name, value in saved.items():
        torch.testing.assert_close(restored[name], value, rtol=0, atol=0, msg=name)
    assert all(sharded.is_sharded(p) for p in model.parameters())
    optimizer.zero_grad()
    model(_batch(7, 0, 0)).pow(2).mean().backward()  # training goes on from the restored state
    optimizer.step()
    for name, value in _local_state(model, optimizer).items():
        torch.testing.assert_close(value, after[name], rtol=1e-6, atol=1e-7, msg=name)
    group.shutdown()


def _listening_on(port: int) -> set[str]:
    """The local addresses (hex, as the kernel lists them) of the TCP sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


def test_the_replica_store_listens_on_the_replica_address_only():
    """Shard 0 serves torch's store of the replica on the address it was given (torch's own
    server listens on every address of the host, where anyone could reach it)."""
    import datetime

    from ftcomm.training.replica import _store

    port = free_port()
    store = _store(f"127.0.0.1:{port}", 0, 1, datetime.timedelta(seconds=10))
    try:
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert _listening_on(port) == {"0100007F"}  # 127.0.0.1, and no wildcard
    finally:
        del store


DILOCO_OUTER, DILOCO_EVERY, DILOCO_FRAGMENTS = 4, 4, 2


def _diloco_inner(model, step: int, replica: int, shards: tuple[int, ...]) -> None:
    """One inner step's backward: the replica's gradient is the mean of its shard processes'
    (FSDP2's reduce-scatter averages them), so alone it is the mean of their losses."""
    sum(model(_batch(step, replica, shard)).pow(2).mean() for shard in shards).div(len(shards)).backward()


def _ftcomm_diloco(rank: int, ports: list[int], out: str) -> None:
    import ftcomm
    replica, shard = divmod(rank, SHARDS)
    group = _replica_group(rank, ports, "sharded-diloco")
    plain = _model()
    with pytest.raises(ftcomm.StateError, match=r"diloco\.0\.weight is not sharded over ft.shard_mesh"):
        group.register_state(diloco=ftcomm.DiLoCo(group, plain, torch.optim.SGD(plain.parameters(), lr=0.1),
                                                  outer_optimizer=torch.optim.SGD(plain.parameters(), lr=0.7),
                                                  sync_every=DILOCO_EVERY))
    model = _model()
    _shard(model, group.shard_mesh)
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    diloco = ftcomm.DiLoCo(group, model, inner, outer_optimizer=outer, sync_every=DILOCO_EVERY,
                           fragments=DILOCO_FRAGMENTS)
    group.register_state(diloco=diloco)
    group.step_boundary()
    committed, step = [], 0
    while group.step < DILOCO_OUTER:
        _diloco_inner(model, step, replica, (shard,))
        step += 1
        result = diloco.step()
        if result is not None:
            committed.append(result)
    # The state as a joiner receives it (local shards, rebuilt on the joiner's own objects),
    # loaded into a fresh DiLoCo whose outer optimizer has not stepped: its next outer step runs.
    from ftcomm.training import sharded
    fresh_model = _model(seed=1)
    _shard(fresh_model, group.shard_mesh)
    fresh_outer = torch.optim.SGD(fresh_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    fresh = ftcomm.DiLoCo(group, fresh_model, torch.optim.Adam(fresh_model.parameters(), lr=0.01),
                          outer_optimizer=fresh_outer, sync_every=DILOCO_EVERY, fragments=DILOCO_FRAGMENTS)
    sent = sharded.to_local(diloco.state_dict())
    fresh.load_state_dict(sharded.like(sharded.template(fresh), sent))
    digest = group.state.digest(group.step)
    diloco.load_state_dict(sharded.like(sharded.template(diloco), sent))  # (into one whose outer state exists)
    assert group.state.digest(group.step) == digest
    for g in fresh._global:
        g.grad = torch.zeros_like(g)
    fresh.outer_optimizer.step()
    torch.save({"global": {n: p.to_local().clone() for n, p in diloco.model_state().items()},
                "committed": committed, "digest": group.state.digest(group.step),
                "reloaded": {n: p.to_local().clone() for n, p in fresh.model_state().items()}},
               os.path.join(out, f"diloco_{replica}_{shard}.pt"))
    group.shutdown()
    dist.destroy_process_group()


def _diloco_alone() -> dict[str, torch.Tensor]:
    """The global model of Streaming DiLoCo over REPLICAS unsharded workers, computed alone."""
    from ftcomm.training.diloco import _split
    global_model = _model()
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    workers = [_model() for _ in range(REPLICAS)]
    inners = [torch.optim.Adam(w.parameters(), lr=0.01) for w in workers]
    params = list(global_model.parameters())
    parts = _split(params, DILOCO_FRAGMENTS)
    steps = [0] * REPLICAS
    for k in range(DILOCO_OUTER):
        part = parts[k % DILOCO_FRAGMENTS]
        deltas = []
        for replica, (worker, inner) in enumerate(zip(workers, inners)):
            for _ in range(DILOCO_EVERY // DILOCO_FRAGMENTS):
                _diloco_inner(worker, steps[replica], replica, tuple(range(SHARDS)))
                steps[replica] += 1
                inner.step()
                inner.zero_grad()
            local = list(worker.parameters())
            deltas.append({i: params[i].detach() - local[i].detach() for i in part})
        for i in part:
            params[i].grad = sum(d[i] for d in deltas) / REPLICAS
        outer.step()
        outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for worker in workers:
                for i in part:
                    list(worker.parameters())[i].copy_(params[i])
    return {n: p.detach() for n, p in global_model.named_parameters()}


def test_streaming_diloco_over_sharded_replicas_averages_each_shard_across_replicas_as_computed_alone(tmp_path):
    """2 replicas x 2 shards (FSDP2 inside each replica, its inner steps on Adam) train
    Streaming DiLoCo, two fragments taking turns: every outer step commits, the global
    model's shards are those of DiLoCo over two unsharded workers computed alone (each
    shard's pseudo-gradient averaged across the replicas over its own communicator), and
    every process of a shard index holds one digest. The state, as a joiner receives it,
    loads into a fresh DiLoCo whose outer optimizer has no state yet, which then steps."""
    ports = [free_port() for _ in range(REPLICAS + REPLICAS * SHARDS)]
    torch.multiprocessing.spawn(_ftcomm_diloco, args=(ports, str(tmp_path)), nprocs=REPLICAS * SHARDS)
    expected = _diloco_alone()
    for shard in range(SHARDS):
        results = [torch.load(tmp_path / f"diloco_{replica}_{shard}.pt") for replica in range(REPLICAS)]
        assert len({r["digest"] for r in results}) == 1
        for r in results:
            assert r["committed"] == [True] * DILOCO_OUTER
            for name, value in r["global"].items():  # a zero pseudo-gradient: momentum moves it alone
                assert r["reloaded"][name].shape == value.shape and torch.isfinite(r["reloaded"][name]).all()
            for name, whole in expected.items():
                torch.testing.assert_close(r["global"][name], whole.chunk(SHARDS, dim=0)[shard], rtol=1e-5,
                                           atol=1e-6, msg=name)
