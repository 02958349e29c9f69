"""Flash checkpoints: round trip, pruning, checksums, agreement on the step to restore, and
the local-file guarantees (no pickle, private directories, bounded waits, no leaks)."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import pathlib
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid

import msgpack
import pytest
import torch

import ftcomm
from ftcomm.errors import FtcommError, FtcommTimeout, StateError
from ftcomm.localproc import ChildProcess
from ftcomm.training import checkpoint_files
from ftcomm.training.checkpoint import FlashCheckpointer
from ftcomm.training.checkpoint_files import meta_bytes, steps_in
from tests.polling import wait_until
from tests.conftest import free_port
from tests.test_group_threads import in_threads, start_groups
from tests.train_cluster import EXAMPLE

pytestmark = pytest.mark.timeout(120)


def trained_state(group, seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    group.register_state(model=model, optimizer=optimizer, note="hello", counts=[1, 2])
    return model, optimizer


def files_in(shm: pathlib.Path) -> list[str]:
    """The checkpoints and buffers in a shared-memory directory (not its in-use marks)."""
    return [n for n in os.listdir(shm) if not checkpoint_files.bookkeeping(n)]


def flip(path: pathlib.Path, position: int, mask: int) -> None:
    """Corrupt one byte of a file in place."""
    raw = bytearray(path.read_bytes())
    raw[position] ^= mask
    path.write_bytes(bytes(raw))


@pytest.fixture
def group():
    """A group of one worker, shut down after the test."""
    (solo,) = start_groups(1)
    yield solo
    solo.shutdown()


def test_save_restore_round_trip_and_keep(tmp_path, name, group):
    model, optimizer = trained_state(group, 0)
    checkpoints = FlashCheckpointer(group, tmp_path, keep=2, name=name)
    digests = {}
    for step in (3, 5, 9):
        group.step = step
        with torch.no_grad():
            model[0].weight.add_(1.0)
        pause = checkpoints.save()
        assert 0 <= pause < 5
        digests[step] = group.state.digest(step)
    checkpoints.wait()
    assert steps_in(checkpoints.shm) == [9, 5] and steps_in(tmp_path) == [9, 5]
    # buffers are reused: shared memory holds the kept checkpoints plus one spare
    assert len(files_in(checkpoints.shm)) <= 2 * 2 + 1
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    group.state.values["note"] = "changed"
    assert checkpoints.restore() == 9
    assert group.step == 9 and group.state.digest(9) == digests[9]
    assert group.state.values["note"] == "hello"
    checkpoints.close()


def test_a_job_resuming_from_shared_memory_says_so_and_that_its_directory_lacks_the_step(tmp_path, name, group,
                                                                                            caplog):
    """Before: with its checkpoint directory deleted, a job resumed from the shared-memory
    copies an earlier run left, and said nothing above INFO."""
    trained_state(group, 0)
    first = FlashCheckpointer(group, tmp_path / "kept", name=name)
    group.step = 4
    first.save()
    first.wait()
    first.close()
    shutil.rmtree(tmp_path / "kept")  # the user's way of asking for a fresh start
    again = FlashCheckpointer(group, tmp_path / "kept", name=name)
    with caplog.at_level(logging.WARNING, logger="ftcomm"):
        assert again.restore() == 4
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"resuming job {name!r} from step 4" in m and f"/dev/shm/ftcomm-{name}" in m
               and "does not hold it" in m and "--fresh" in m for m in said), said
    again.close()


def test_a_restore_round_broken_halfway_starts_again_from_the_offers(tmp_path, name, group, monkeypatch):
    """A re-formation during the restore's second collective retries the whole round: a worker
    let in by that re-formation starts at the first collective, so everyone must."""
    from ftcomm.errors import MembershipChanged

    trained_state(group, 1)
    checkpoints = FlashCheckpointer(group, tmp_path, name=name)
    group.step = 5
    checkpoints.save()
    checkpoints.wait()
    expected = group.state.digest(5)
    rows: list[list[int]] = []
    allgather = group.allgather

    def breaks_once(row):
        rows.append([int(v) for v in row.tolist() if v >= 0])
        if len(rows) == 2:
            raise MembershipChanged("a peer died (as in a crash between the two collectives)")
        return allgather(row)
    monkeypatch.setattr(group, "allgather", breaks_once)
    assert checkpoints.restore() == 5 and group.state.digest(5) == expected
    assert rows[0] == [5] and rows[2] == [5], rows  # offers, (broken), offers again, outcome
    assert len(rows) == 4 and rows[1] == rows[3] and rows[1][0] == 1
    checkpoints.close()


def test_corrupted_and_partial_checkpoints_are_skipped(tmp_path, name, caplog, group):
    model, _ = trained_state(group, 1)
    checkpoints = FlashCheckpointer(group, tmp_path, keep=3, name=name)
    for step in (1, 2, 3):
        group.step = step
        checkpoints.save()
    checkpoints.wait()
    group.step = 1
    expected = group.state.digest(1)
    # step 3: flip a byte in both copies; step 2: only the record is gone from both (partial)
    for place in (checkpoints.shm, tmp_path):
        data = place / "step-000000000003.data"
        flip(data, data.stat().st_size // 2, 0xFF)
        (place / "step-000000000002.meta").unlink()
    # step 1: the shared-memory copy is corrupt, the directory's copy is good
    flip(checkpoints.shm / "step-000000000001.data", 0, 0x01)
    with torch.no_grad():
        model[0].weight.zero_()
    assert checkpoints.restore() == 1
    assert group.state.digest(1) == expected
    assert "skipping checkpoint of step 3" in caplog.text
    checkpoints.close()


def test_members_agree_on_the_newest_step_some_member_can_load_and_reconcile_it_to_the_others(tmp_path, name):
    """Both members hold steps 4 and 8; only member 0 holds step 12 (the job ended before
    member 1's copy was written). Step 12 is committed training: it is restored on member 0
    and reconciled to member 1, never given up for step 8."""
    groups = start_groups(2)
    try:
        models = [trained_state(g, 2)[0] for g in groups]
        # the group's first reconcile (due once the state is registered) runs now, at step 0,
        # not at the restore's first collective, where the steps set below would read as trained
        in_threads(groups, lambda i, g: g.allreduce(torch.zeros(1)))
        directories = [tmp_path / "a", tmp_path / "b"]
        # separate shared-memory roots stand for two hosts; each member writes its own copy
        checkpoints = [FlashCheckpointer(g, d, keep=3, name=name, shm_root=d / "shm")
                       for g, d in zip(groups, directories)]
        for c in checkpoints:
            c.is_writer = lambda: True
        for step in (4, 8):
            for g, c in zip(groups, checkpoints):
                g.step = step
                c.save()
        groups[0].step = 12
        with torch.no_grad():
            models[0][0].weight.add_(1.0)
        expected = groups[0].state.digest(12)
        checkpoints[0].save()  # only member 0 has step 12
        for c in checkpoints:
            c.wait()
        for m in models:
            with torch.no_grad():
                m[2].bias.fill_(7.0)
        restored = in_threads(groups, lambda i, g: checkpoints[i].restore())
        assert restored == [12, 12]
        assert [g.step for g in groups] == [12, 8]  # member 1 holds no copy of step 12: it receives it

        def step(i: int, g) -> bool:  # the first collective reconciles the newest state
            g.allreduce(torch.zeros(1))
            return g.state.digest(g.step)
        assert in_threads(groups, step) == [expected, expected]
        assert [g.step for g in groups] == [12, 12]
        for c in checkpoints:
            c.close()
    finally:
        for g in groups:
            g.shutdown()


def test_a_worker_joining_a_running_group_restores_nothing_and_takes_the_groups_state(tmp_path, name):
    """restore() is a collective of the members that start the group together. A worker
    restarted into a running group must not issue it while the others train (its allgathers
    would meet their gradient allreduces): it restores nothing, at once, and receives the
    group's state by reconciling. Every member then trains on with equal state."""
    groups = start_groups(2)  # min_workers=1
    joiner = None
    try:
        assert all(g.restorable for g in groups)
        pairs = [trained_state(g, 4) for g in groups]
        checkpoints = [FlashCheckpointer(g, tmp_path, name=name) for g in groups]
        assert in_threads(groups, lambda i, g: checkpoints[i].restore()) == [None, None]
        in_threads(groups, lambda i, g: g.execute(g.barrier))  # reconciled: the pair holds one state
        for c in checkpoints:  # the member with the lowest rank writes the host's copy
            c.save()
            c.wait()
        target = [10**9]  # the step every member trains to: set once the joiner is in

        def train(i: int, g) -> None:
            model, optimizer = pairs[i]
            while g.step < target[0]:
                model(torch.randn(4, 8)).sum().backward()
                if g.wait_gradients_ready(model):
                    optimizer.step()
                optimizer.zero_grad()
        threads = [threading.Thread(target=train, args=(i, g), daemon=True) for i, g in enumerate(groups)]
        for t in threads:
            t.start()
        joiner = ftcomm.init(peers=[groups[0].gossip.address], bind="127.0.0.1:0",
                             min_workers=1, handle_signals=False, init_timeout=30, settle_interval=0.5)
        assert not joiner.restorable
        pairs.append(trained_state(joiner, 9))  # other weights: reconciling replaces them
        late = FlashCheckpointer(joiner, tmp_path, name=name)
        assert late.available(), "the joiner sees the group's checkpoint and still must not restore it"
        assert late.restore() is None
        joiner.step_boundary()  # receives the group's state
        target[0] = joiner.step + 5  # the others wait for the joiner inside their next step
        train(2, joiner)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        members = [*groups, joiner]
        assert {g.step for g in members} == {target[0]}
        assert len({g.state.digest(g.step) for g in members}) == 1
        assert {g.world_size for g in members} == {3}
        late.close()
        for c in checkpoints:
            c.close()
    finally:
        for g in [*groups, joiner]:
            if g is not None:
                g.shutdown()


def test_a_worker_let_in_while_the_group_restores_restores_with_it(tmp_path, name):
    """A view that re-forms inside restore() (a member left) and lets in a worker waiting to
    join is still restorable: nobody in it has begun training. The newcomer must take part in
    the restore's collectives, or the others would wait for it there."""
    from .polling import wait_until

    groups = start_groups(3)  # min_workers=2
    late, leaver = None, groups[2]
    try:
        for g in groups:
            trained_state(g, 6)
        checkpoints = [FlashCheckpointer(g, tmp_path, name=name) for g in groups[:2]]
        holder: list = []

        def join() -> None:  # init, then register_state: admitted once its state is registered
            holder.append(ftcomm.init(peers=[groups[0].gossip.address], bind="127.0.0.1:0", min_workers=2,
                                      handle_signals=False, init_timeout=60, settle_interval=0.5))
            trained_state(holder[0], 7)
        joining = threading.Thread(target=join, daemon=True)
        joining.start()
        wait_until(lambda: holder and not holder[0]._loop.engine.state_pending, 30,
                   "the newcomer asking for admission, its state registered")
        leaver.shutdown()  # the restore's first collective re-forms, and the newcomer is let in
        restoring = threading.Thread(target=lambda: holder.append(in_threads(
            groups[:2], lambda i, g: checkpoints[i].restore())), daemon=True)
        restoring.start()
        joining.join(60)
        assert holder and isinstance(holder[0], ftcomm.FaultTolerantGroup)
        late = holder[0]
        assert late.restorable and late.world_size == 3
        mine = FlashCheckpointer(late, tmp_path, name=name)
        assert mine.restore() is None  # nothing saved yet: it took part in agreeing on that
        restoring.join(70)
        assert holder[1:] == [[None, None]]
        members = [*groups[:2], late]
        in_threads(members, lambda i, g: g.execute(g.barrier))
        assert len({g.state.digest(g.step) for g in members}) == 1
        mine.close()
        for c in checkpoints:
            c.close()
    finally:
        for g in [*groups, late]:
            if g is not None:
                g.shutdown()


def test_back_to_back_saves_never_overwrite_a_published_checkpoint(tmp_path, name, group):
    model, _ = trained_state(group, 3)
    checkpoints = FlashCheckpointer(group, None, keep=2, name=name)
    digests = {}
    for step in range(1, 9):  # no wait between saves: buffers are still being published
        group.step = step
        with torch.no_grad():
            model[0].bias.add_(1.0)
        checkpoints.save()
        digests[step] = group.state.digest(step)
    checkpoints.wait()
    assert steps_in(checkpoints.shm) == [8, 7]
    for step in (8, 7):
        loaded = checkpoints._load_verified(step)
        assert loaded is not None
        checkpoints._apply(*loaded)
        assert group.state.digest(step) == digests[step]
    checkpoints.close()


def wait_all(workers: list[ChildProcess], event: str, timeout: float) -> list[dict]:
    """Every worker's first ``event``; on a timeout, fail with every worker's stacks and log."""
    deadline = time.monotonic() + timeout
    try:
        return [w.wait_for(lambda e: e["ev"] == event, max(0.0, deadline - time.monotonic()), event)
                for w in workers]
    except TimeoutError:
        dumped = [w for w in workers if w.process.poll() is None]
        for w in dumped:
            w.signal(signal.SIGUSR1)  # faulthandler: every thread's stack on stderr
        until = time.monotonic() + 5.0  # until each dump has arrived (or give up and show what there is)
        while time.monotonic() < until and not all(any("File " in line for line in w.stderr_tail[-60:])
                                                     for w in dumped):
            time.sleep(0.05)
        logs = "\n".join(f"--- worker {i} (exit {w.process.poll()}):\n" + "".join(w.stderr_tail[-60:])
                         for i, w in enumerate(workers))
        pytest.fail(f"no {event} from every worker within {timeout:g} s\n{logs}")


@pytest.mark.timeout(300)
def test_whole_job_restart_resumes_from_the_newest_loadable_checkpoint(tmp_path, name):
    """Three workers checkpoint every 8 steps and are all killed; the newest checkpoint is then
    corrupted in both places and a partial one is left behind. Three new processes agree on the
    newest loadable step, load it, and continue from exactly where it left the data."""
    def start(steps: int) -> list[ChildProcess]:
        seed = f"127.0.0.1:{free_port()}"
        workers = []
        for i in range(3):
            command = [sys.executable, "-u", str(EXAMPLE), "--steps", str(steps), "--step-time", "0.02",
                       "--control", "--log-indices", "--min-workers", "3", "--checkpoint-dir", str(tmp_path),
                       "--checkpoint-every", "8", "--checkpoint-name", name, "--report-every", "1000000",
                       "--log-level", "INFO"]
            command += ["--bind", seed] if i == 0 else ["--bind", "127.0.0.1:0", "--peers", seed]
            workers.append(ChildProcess(command, ready_timeout=None, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        for w in workers:
            w.wait_ready(90)
        return workers

    first = start(1_000_000)
    try:
        assert all(w.wait_for(lambda e: e["ev"] == "restored", 5, "restored")["step"] is None for w in first)
        wait_until(lambda: len(steps_in(tmp_path)) >= 2 and steps_in(tmp_path)[0] >= 24, 120, "three checkpoints")
        for w in first:
            w.signal(signal.SIGKILL)
        logs = [e for w in first for e in w.snapshot() if e["ev"] == "batch"]
    finally:
        for w in first:
            w.close()
    shm = pathlib.Path(f"/dev/shm/ftcomm-{name}")
    newest, previous = steps_in(tmp_path)[:2]
    assert steps_in(shm)[:2] == [newest, previous]
    for place in (shm, tmp_path):
        flip(place / f"step-{newest:012d}.data", -100, 0x40)
    (tmp_path / f"step-{newest + 8:012d}.data").write_bytes(b"partial")  # no record: invisible

    second = start(previous + 16)
    try:
        restored = [w.wait_for(lambda e: e["ev"] == "restored", 60, "restored")["step"] for w in second]
        assert restored == [previous] * 3
        done = wait_all(second, "done", 60)
        assert {d["step"] for d in done} == {previous + 16} and len({d["digest"] for d in done}) == 1
        # the data continues exactly where the checkpointed step left it
        before = {e["step"]: (e["epoch"], e["start"], e["size"]) for e in logs}
        epoch, start, size = before[previous]
        after = sorted((e["step"], e["epoch"], e["start"]) for w in second for e in w.snapshot() if e["ev"] == "batch")
        expected = (epoch + 1, 0) if start + size >= 8192 else (epoch, start + size)
        assert after[0] == (previous + 1, *expected)
    finally:
        for w in second:
            w.close()


# ---------------------------------------------------------------------- local-file guarantees
class _Planted:
    """Unpickling it creates the directory ``marker``: proof that a pickle in a checkpoint ran."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def plant(place: pathlib.Path, step: int, change) -> None:
    """Copy step 1's checkpoint in ``place`` as ``step``, its record passed through ``change``
    (the record's header checksum stays valid: only its content is wrong)."""
    raw = (place / "step-000000000001.meta").read_bytes()
    record = msgpack.unpackb(raw[12:], raw=False)
    record["step"] = step
    (place / f"step-{step:012d}.meta").write_bytes(meta_bytes(change(record)))
    shutil.copy(place / "step-000000000001.data", place / f"step-{step:012d}.data")


def saved_once(group, name: str, seed: int) -> tuple[FlashCheckpointer, int]:
    """A checkpointer (shared memory only) holding step 1, and that step's digest."""
    trained_state(group, seed)
    checkpoints = FlashCheckpointer(group, None, keep=3, name=name)
    group.step = 1
    checkpoints.save()
    checkpoints.wait()
    return checkpoints, group.state.digest(1)


def test_a_pickle_planted_in_a_record_is_never_run(tmp_path, name, caplog, group):
    checkpoints, expected = saved_once(group, name, 11)
    marker = tmp_path / "pickle-ran"
    plant(checkpoints.shm, 2, lambda r: {**r, "format": checkpoint_files.FORMAT, "structure": pickle.dumps(_Planted(marker))})
    assert checkpoints.restore() == 1
    assert not marker.exists()
    assert group.state.digest(1) == expected
    assert "skipping checkpoint of step 2" in caplog.text
    checkpoints.close()


@pytest.mark.parametrize("change", [
    lambda r: {**r, "size": "big"},
    lambda r: {**r, "tensors": [[0, "float32", [1 << 40], 4 << 40]] + r["tensors"][1:]},
    lambda r: {**r, "tensors": [[0, "builtins.eval", [1], 4]] + r["tensors"][1:]},
    lambda r: {**r, "checksums": r["checksums"][:-1]},
    lambda r: {**r, "structure": b"\xc1"},
    lambda r: {**r, "chunk": 1},
    lambda r: {k: v for k, v in r.items() if k != "structure"},
    lambda r: [r],
], ids=["size", "huge-tensor", "dtype", "checksums", "structure", "chunk", "missing-field", "not-a-map"])
def test_a_malformed_record_is_skipped_with_a_warning(name, caplog, group, change):
    checkpoints, expected = saved_once(group, name, 12)
    plant(checkpoints.shm, 2, change)
    assert checkpoints.restore() == 1
    assert group.state.digest(1) == expected
    assert "skipping checkpoint of step 2" in caplog.text
    checkpoints.close()


def _lr_not_a_number(optimizer: dict) -> None:
    optimizer["param_groups"][0]["lr"] = "not-a-number"


def _param_groups_a_string(optimizer: dict) -> None:
    optimizer["param_groups"] = "param_groups"


def _a_group_missing(optimizer: dict) -> None:
    del optimizer["param_groups"][0]["betas"]


@pytest.mark.parametrize("change", [_lr_not_a_number, _param_groups_a_string, _a_group_missing])
def test_optimizer_state_of_another_shape_is_skipped_and_the_older_step_restored(name, caplog, group, change):
    """A record whose checksums are valid but whose optimizer state is not what the live
    optimizer holds (planted, or saved by other code): loading it would raise or train
    on nonsense. It is skipped like a corrupt copy, and the step before it restored."""
    from ftcomm.training import plain
    checkpoints, expected = saved_once(group, name, 14)
    snapshot = group.state.snapshot(2)  # planted as step 2
    change(snapshot["objects"]["optimizer"])
    skeleton, _ = plain.split(snapshot)
    plant(checkpoints.shm, 2, lambda r: {**r, "structure": skeleton})
    assert checkpoints.restore() == 1
    assert group.state.digest(1) == expected
    assert group.state.objects["optimizer"].param_groups[0]["lr"] == 0.01
    assert "skipping checkpoint of step 2" in caplog.text and "optimizer.param_groups" in caplog.text
    checkpoints.close()


def test_checkpoint_files_are_private(tmp_path, group):
    trained_state(group, 13)
    checkpoints = FlashCheckpointer(group, tmp_path / "persisted", name="job", shm_root=tmp_path)
    assert stat.S_IMODE(os.stat(checkpoints.shm).st_mode) == 0o700
    group.step = 1
    checkpoints.save()
    checkpoints.wait()
    files = [*checkpoints.shm.iterdir(), *(tmp_path / "persisted").iterdir()]
    assert len(files) >= 4 and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in files)
    checkpoints.close()


@pytest.mark.parametrize("kind", ["another user's", "group-writable", "symlink"])
def test_a_shared_memory_directory_not_private_to_this_user_is_refused(tmp_path, group, kind):
    path = tmp_path / "ftcomm-job"
    if kind == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.mkdir(mode=0o700)
    if kind == "another user's":
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(path, 65534, 65534)
    elif kind == "group-writable":
        os.chmod(path, 0o770)
    with pytest.raises(FtcommError) as refused:
        FlashCheckpointer(group, None, name="job", shm_root=tmp_path)
    assert f"refusing the shared-memory directory {path}" in str(refused.value)


def test_save_never_blocks_when_the_directory_cannot_be_written(tmp_path, name, group):
    trained_state(group, 14)
    directory = tmp_path / "persisted"
    checkpoints = FlashCheckpointer(group, directory, keep=2, name=name)
    shutil.rmtree(directory)
    directory.write_bytes(b"a file where the directory was: every write there fails, even as root")
    outcomes: list = []

    def save_eight_times() -> None:
        for step in range(1, 9):
            group.step = step
            try:
                outcomes.append(checkpoints.save())
            except FtcommError as exc:
                outcomes.append(exc)
        try:
            outcomes.append(checkpoints.wait())
        except FtcommError as exc:
            outcomes.append(exc)

    saving = threading.Thread(target=save_eight_times, daemon=True)
    saving.start()
    saving.join(60)
    assert not saving.is_alive(), "save() blocked"
    errors = [o for o in outcomes if isinstance(o, FtcommError)]
    assert errors and all(str(directory) in str(e) for e in errors)
    assert len(steps_in(checkpoints.shm)) == 2  # shared memory is still published and pruned
    checkpoints.close()


def test_waits_are_bounded_by_the_write_timeout(tmp_path, name, group, monkeypatch):
    trained_state(group, 15)
    release, fsync = threading.Event(), os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (release.wait(30), fsync(fd)))  # a hung filesystem
    checkpoints = FlashCheckpointer(group, tmp_path, keep=1, name=name, write_timeout=0.5)
    with pytest.raises(FtcommTimeout) as timed_out:
        for step in range(1, 5):  # keep=1: two buffers, both held by the hung write and the next save
            group.step = step
            checkpoints.save()
    assert str(tmp_path) in str(timed_out.value)
    with pytest.raises(FtcommTimeout):
        checkpoints.wait()
    release.set()
    checkpoints.wait()
    checkpoints.close()


def test_a_full_disk_names_the_path_and_leaves_no_temporary_file(tmp_path, name, group, monkeypatch):
    trained_state(group, 16)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    checkpoints = FlashCheckpointer(group, tmp_path, name=name)
    group.step = 1
    checkpoints.save()
    with pytest.raises(FtcommError) as failed:
        checkpoints.wait()
    assert str(tmp_path / "step-000000000001.data") in str(failed.value)
    assert os.strerror(errno.ENOSPC) in str(failed.value)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert steps_in(checkpoints.shm) == [1]  # the shared-memory copy is published all the same
    checkpoints.close()


def test_a_full_shared_memory_names_the_step_that_was_not_saved(name, group, monkeypatch):
    trained_state(group, 17)
    allocate, allocations = os.posix_fallocate, []

    def fill_up(fd: int, offset: int, length: int) -> None:
        allocations.append(length)
        if len(allocations) > 1:  # room for one buffer only
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        allocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fill_up)
    checkpoints = FlashCheckpointer(group, None, name=name)
    group.step = 1
    checkpoints.save()
    checkpoints.wait()  # step 1 was saved: the spare that did not fit is not its failure
    group.step = 2
    with pytest.raises(FtcommError) as failed:
        checkpoints.save()
    assert "step 2" in str(failed.value) and "step 1" not in str(failed.value)
    assert str(checkpoints.shm) in str(failed.value)
    assert sorted(files_in(checkpoints.shm)) == ["step-000000000001.data", "step-000000000001.meta"]
    checkpoints.close()


def test_buffers_do_not_leak_across_runs(name, group):
    trained_state(group, 18)
    counts = []
    for run in range(4):
        checkpoints = FlashCheckpointer(group, None, keep=2, name=name)
        for step in range(10 * run + 1, 10 * run + 4):
            group.step = step
            checkpoints.save()
        checkpoints.close()
        names = files_in(checkpoints.shm)
        assert not [n for n in names if n.startswith(".")], "a spare buffer outlived close()"
        counts.append(len(names))
    assert counts == [4] * 4  # the two kept checkpoints, nothing more


def test_files_abandoned_by_ended_processes_are_removed(name, group):
    shm = pathlib.Path(f"/dev/shm/ftcomm-{name}")
    shm.mkdir(mode=0o700)
    abandoned = [shm / ".slot-999999-1.data", shm / ".step-000000000001.meta.999999-0a.tmp"]
    held = shm / ".slot-999998-1.data"
    for path in [*abandoned, held]:
        path.write_bytes(bytes(4096))
        os.utime(path, (time.time() - 3600,) * 2)
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # as a live process holds its own files
        FlashCheckpointer(group, None, name=name).close()
        assert not [p for p in abandoned if p.exists()] and held.exists()
    finally:
        os.close(fd)


def test_a_new_checkpoint_is_kept_when_every_newer_one_is_corrupt(tmp_path, name, group):
    trained_state(group, 19)
    first = FlashCheckpointer(group, tmp_path, keep=2, name=name)
    for step in (100, 108):
        group.step = step
        first.save()
    first.close()
    for place in (first.shm, tmp_path):
        for step in (100, 108):
            flip(place / f"step-{step:012d}.data", 0, 0xFF)
    second = FlashCheckpointer(group, tmp_path, keep=2, name=name)
    assert second.restore() is None
    group.step = 8
    second.save()
    second.wait()
    assert steps_in(second.shm) == [8] and steps_in(tmp_path) == [8]  # the corrupt ones are gone, the new one kept
    loaded = second._load_verified(8)
    assert loaded is not None
    loaded[1].close()
    second.close()


def test_newer_checkpoints_of_an_earlier_run_are_neither_pruned_nor_counted(tmp_path, name, group):
    trained_state(group, 20)
    first = FlashCheckpointer(group, tmp_path, keep=1, name=name)
    group.step = 100
    first.save()
    first.close()
    second = FlashCheckpointer(group, tmp_path, keep=1, name=name)
    for step in (8, 16):
        group.step = step
        second.save()
    second.wait()
    assert steps_in(second.shm) == [100, 16] and steps_in(tmp_path) == [100, 16]
    second.close()


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_copied(name, group):
    model, optimizer = trained_state(group, 0)
    checkpoints = FlashCheckpointer(group, None, keep=2, name=name)
    checkpoints.save()
    checkpoints.wait()
    checkpoints.close()
    # The same names, one layer wider: the first layer would fit in place, the last not.
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    group.state.objects.clear()
    group.register_state(model=other)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    restorer = FlashCheckpointer(group, None, keep=2, name=name)
    with pytest.raises(StateError, match=r"holds model\.2\.weight as float32\[3, 16\], the module has float32\[4, 16\]"):
        restorer.restore()
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    restorer.close()


def test_a_newer_checkpoint_whose_tensor_shapes_do_not_fit_the_model_is_skipped_for_the_older_step(
        name, caplog, group):
    """Step 2 saved from a model one layer wider (valid checksums, the same names: planted,
    or left by another run): every start failed on it. The older step that fits is restored
    instead, and the copy that does not is kept (it may be the model that changed)."""
    model, optimizer = trained_state(group, 16)
    checkpoints = FlashCheckpointer(group, None, keep=3, name=name)
    group.step = 1
    checkpoints.save()
    checkpoints.wait()
    expected = group.state.digest(1)
    wider = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    group.state.objects.clear()
    adam = torch.optim.Adam(wider.parameters())
    wider(torch.randn(4, 8)).sum().backward()
    adam.step()
    group.register_state(model=wider, optimizer=adam, note="hello", counts=[1, 2])
    group.step = 2
    checkpoints.save()
    checkpoints.close()
    group.state.objects.clear()
    group.register_state(model=model, optimizer=optimizer, note="hello", counts=[1, 2])
    restorer = FlashCheckpointer(group, None, keep=3, name=name)
    assert restorer.restore() == 1
    assert group.state.digest(1) == expected
    assert "skipping checkpoint of step 2" in caplog.text and "holds model.2.weight as float32[4, 16]" in caplog.text
    assert (restorer.shm / "step-000000000002.meta").exists()
    restorer.close()


def test_the_newest_checkpoint_in_shared_memory_is_persisted_at_a_breakpoint(tmp_path, name, group):
    """What a launcher does when a worker dies: shared memory only, then persisted; a
    corrupt newest copy is passed over for the newest one that verifies."""
    model, _ = trained_state(group, 0)
    checkpoints = FlashCheckpointer(group, None, keep=3, name=name)
    digests = {}
    for step in (4, 6):
        group.step = step
        with torch.no_grad():
            model[0].weight.add_(1.0)
        checkpoints.save()
        digests[step] = group.state.digest(step)
    checkpoints.wait()
    flip(checkpoints.shm / checkpoint_files.file_name(6, "data"), 10, 0xFF)
    target = tmp_path / "persisted"
    assert checkpoint_files.persist_newest(checkpoints.shm, target) == 4
    assert steps_in(target) == [4]
    assert checkpoint_files.persist_newest(checkpoints.shm, target) is None  # already there
    assert not [p for p in os.listdir(target) if p.endswith(".tmp")]
    checkpoints.close()
    restorer = FlashCheckpointer(group, target, name=f"{name}-restore")
    try:
        assert restorer.restore() == 4 and group.state.digest(4) == digests[4]
    finally:
        restorer.close()
        shutil.rmtree(restorer.shm, ignore_errors=True)
    assert checkpoint_files.persist_newest(tmp_path / "no-such-shm", target) is None


def test_in_a_group_with_a_secret_a_checkpoint_planted_without_it_is_skipped(name, caplog):
    (group,) = start_groups(1, secret="the-group-secret")
    try:
        checkpoints, expected = saved_once(group, name, 12)
        group.step = 6
        checkpoints.save()
        checkpoints.wait()
        place = checkpoints.shm
        raw = (place / "step-000000000001.meta").read_bytes()
        assert raw[:4] == b"FTCS"  # signed
        record = msgpack.unpackb(raw[36:], raw=False)
        data = bytearray((place / "step-000000000001.data").read_bytes())
        data[record["tensors"][0][0]] ^= 0x40  # a planted tensor value
        for step, meta in ((2, meta_bytes({**record, "step": 2})),  # well formed, unsigned
                           (3, meta_bytes({**record, "step": 3}, checkpoint_files.checkpoint_key(b"another", name))),
                           # the group's own secret, but another job's checkpoint: the key is bound to the job
                           (7, meta_bytes({**record, "step": 7},
                                          checkpoint_files.checkpoint_key(b"the-group-secret", "another-job"))),
                           (4, meta_bytes({**record, "step": 4, "checksums": checkpoint_files.checksums_of(
                               data, record["tensors"])}, None)),
                           (5, raw[:4] + raw[4:36] + msgpack.packb({**record, "step": 5}))):  # tag of step 1
            (place / f"step-{step:012d}.meta").write_bytes(meta)
            (place / f"step-{step:012d}.data").write_bytes(bytes(data))
        # A genuine signed checkpoint whose tensor bytes were altered: the seeded checksums catch it.
        (place / "step-000000000006.data").write_bytes(bytes(data))
        group.step = 0
        assert checkpoints.restore() == 1
        assert group.state.digest(1) == expected
        for step, why in ((7, "written with another secret"), (6, "data checksum mismatch"),
                          (5, "does not verify"), (4, "not signed"), (3, "written with another secret"),
                          (2, "not signed")):
            said = [r.getMessage() for r in caplog.records if f"skipping checkpoint of step {step} " in r.getMessage()]
            assert said and why in said[0], (step, said)
        checkpoints.close()
    finally:
        group.shutdown()


def test_a_group_without_a_secret_skips_a_signed_checkpoint_and_says_why(name, caplog):
    (signed,) = start_groups(1, secret="s3")
    try:
        checkpoints, _ = saved_once(signed, name, 13)
        checkpoints.close()
    finally:
        signed.shutdown()
    (plain_group,) = start_groups(1)
    try:
        trained_state(plain_group, 13)
        reader = FlashCheckpointer(plain_group, None, keep=3, name=name)
        assert reader.restore() is None
        assert "signed with a group's secret and this group has none" in caplog.text
        reader.close()
    finally:
        plain_group.shutdown()


def test_a_secret_the_launcher_drew_for_one_run_does_not_sign_checkpoints(monkeypatch):
    monkeypatch.setenv("FTCOMM_SECRET", "drawn-for-this-run")
    monkeypatch.setenv("FTCOMM_SECRET_DRAWN", "1")
    (group,) = start_groups(1, secret="drawn-for-this-run")
    try:
        assert group.checkpoint_secret is None
    finally:
        group.shutdown()
    (group,) = start_groups(1, secret="the-users-own")
    try:
        assert group.checkpoint_secret == b"the-users-own"
    finally:
        group.shutdown()


# ---------------------------------------------------------------------- shared-memory hygiene
def test_the_last_checkpointer_to_close_with_discard_removes_the_shared_memory(name):
    (a, b) = start_groups(2)
    try:
        for g in (a, b):
            trained_state(g, 14)
        first, second = (FlashCheckpointer(g, None, name=name) for g in (a, b))
        for g, c in ((a, first), (b, second)):
            g.step = 3
            c.save()
            c.wait()
        first.close(discard=True)
        assert steps_in(second.shm) == [3]  # the other still uses it
        second.close(discard=True)
        assert not second.shm.exists()
    finally:
        for g in (a, b):
            g.shutdown()


def test_removing_a_checkpoint_directory_touches_nothing_a_link_or_another_user_planted(tmp_path, name):
    """What the launcher removes once a job completed (``remove_directory``, through
    ``discard_if_unused``): only a directory private to this user, emptied through its
    descriptor. A link in its place, a directory another user owns or can write, and links
    inside it to files elsewhere make nothing outside it go."""
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o700)
    (outside / "precious").write_text("keep me")
    shm = pathlib.Path(f"/dev/shm/ftcomm-{name}")
    try:
        shm.symlink_to(outside)  # planted in its place
        with pytest.raises(OSError):
            checkpoint_files.remove_directory(shm)
        assert not checkpoint_files.discard_if_unused(shm)
        shm.unlink()
        shm.mkdir(mode=0o700)
        (shm / "precious-link").symlink_to(outside / "precious")  # a link inside: the link goes, not its target
        (shm / "step-000000000001.meta").write_bytes(b"x")
        os.chmod(shm, 0o777)  # others could plant in it meanwhile
        with pytest.raises(PermissionError):
            checkpoint_files.remove_directory(shm)
        os.chmod(shm, 0o700)
        if os.geteuid() == 0:  # (only root can give a directory away)
            os.chown(shm, 65534, 65534)  # another user's
            with pytest.raises(PermissionError):
                checkpoint_files.remove_directory(shm)
            assert not checkpoint_files.discard_if_unused(shm)
            os.chown(shm, os.geteuid(), os.getegid())
        assert checkpoint_files.discard_if_unused(shm)
        assert not shm.exists() and (outside / "precious").read_text() == "keep me"
    finally:
        if shm.is_symlink():
            shm.unlink()
        shutil.rmtree(shm, ignore_errors=True)
    assert sorted(os.listdir(outside)) == ["precious"]


def test_only_unused_directories_of_ended_jobs_whose_newest_is_persisted_are_reclaimed(tmp_path):
    root, kept = tmp_path / "shm", tmp_path / "kept"
    root.mkdir()
    kept.mkdir()
    (kept / "step-000000000005.meta").touch()  # the newest of every job below, persisted
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    alive = f".launcher-{os.getpid()}-{checkpoint_files.process_start(os.getpid())}"
    dead = f".launcher-{ended.pid}-1"

    def job(name: str, owner: str | None, records_persisted: bool, mode: int = 0o700) -> pathlib.Path:
        place = root / f"ftcomm-{name}"
        place.mkdir()
        os.chmod(place, mode)
        (place / "step-000000000005.meta").write_bytes(b"x")
        (place / "step-000000000005.data").write_bytes(b"y" * 4096)
        if owner:
            (place / owner).touch()
        if records_persisted:
            (place / ".persisted-to").write_text(str(kept))
        return place
    gone_persisted = job("a", dead, True)
    no_launcher_persisted = job("b", None, True)
    gone_only_copy = job("c", dead, False)
    launcher_alive = job("d", alive, True)
    in_use = job("e", dead, True)
    not_private = job("f", dead, True, mode=0o755)
    holder = checkpoint_files.occupy(in_use, kept)
    try:
        removed, left = checkpoint_files.reclaim_dead(root, root / "ftcomm-mine")
    finally:
        os.close(holder)
    assert sorted(p.name for p, _ in removed) == ["ftcomm-a", "ftcomm-b"]
    assert not gone_persisted.exists() and not no_launcher_persisted.exists()
    assert sorted(p.name for p, _ in left) == ["ftcomm-c", "ftcomm-d"]
    assert all(p.exists() for p in (gone_only_copy, launcher_alive, in_use, not_private))
    assert all(size >= 4096 for _, size in left)


def test_a_member_that_loses_the_quorum_keeps_its_step_in_shared_memory_despite_an_earlier_failure(
        tmp_path, name, group, monkeypatch):
    """keep_before_leaving (called when QuorumLost is about to reach the script): an earlier
    background write's failure (the persistent directory full) is logged, not raised, and
    the committed step is published in this host's shared memory; no spare buffer is
    prepared afterwards."""
    from ftcomm.errors import QuorumLost

    trained_state(group, 3)
    checkpoints = FlashCheckpointer(group, tmp_path / "kept", keep=2, name=name)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoints, "_persist", full)
    group.step = 40
    checkpoints.save()
    wait_until(lambda: checkpoints._error is not None, 30, "the failed persist")
    group.step = 47  # trained on; the cut-off worker is about to raise QuorumLost
    lost = QuorumLost("cannot reach a majority")
    group._leave_with_state(lost)
    shm = pathlib.Path(f"/dev/shm/ftcomm-{name}")
    assert steps_in(shm)[0] == 47
    assert "the state of step 47 is in the flash checkpoints" in str(lost) and str(shm) in str(lost)
    buffers = [n for n in files_in(shm) if n.startswith(".slot-")]
    assert not buffers, buffers  # no spare made for a next save
    with pytest.raises(FtcommError, match="No space left"):  # the directory's copy of step 47 failed too
        checkpoints.close()


def test_a_state_kept_on_a_lost_quorum_without_a_checkpointer_is_loaded_when_the_job_starts_again():
    """No FlashCheckpointer: the member that loses the quorum keeps the state of its
    committed step in shared memory all the same (job ``<cluster>.left``). The whole job
    started again loads it at the first register_state, in place of the weights the
    workers built, and resumes at that step; once a step commits after it the copy is
    removed (a later start of the cluster begins afresh)."""
    from ftcomm.errors import QuorumLost
    from ftcomm.training.checkpoint import left_places

    cluster = f"test-{uuid.uuid4().hex[:8]}"
    (kept_at,) = left_places(cluster)
    try:
        (solo,) = start_groups(1, cluster=cluster)
        try:
            model, _ = trained_state(solo, 3)
            solo.step = 47
            lost = QuorumLost("cannot reach a majority")
            solo._leave_with_state(lost)
            assert f"the state of step 47 is kept in shared memory ({kept_at}" in str(lost), str(lost)
            assert steps_in(kept_at) == [47]
            expected = {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            solo.shutdown()
        groups = start_groups(2, cluster=cluster)
        try:
            models = in_threads(groups, lambda i, g: trained_state(g, 10 + i)[0])  # other weights, then loaded
            assert [g.step for g in groups] == [47, 47]
            for m in models:
                for key, value in m.state_dict().items():
                    torch.testing.assert_close(value, expected[key], rtol=0, atol=0)

            def step(i: int, g) -> bool:
                models[i](torch.randn(4, 8)).sum().backward()
                return g.wait_gradients_ready(models[i])
            assert in_threads(groups, step) == [True, True]
            assert [g.step for g in groups] == [48, 48]
            assert not steps_in(kept_at)
        finally:
            for g in groups:
                g.shutdown()
    finally:
        shutil.rmtree(kept_at, ignore_errors=True)


def test_a_kept_state_of_sharded_replicas_is_loaded_only_at_a_step_every_shard_index_holds(tmp_path):
    from ftcomm.training.checkpoint import left_places, left_step

    places = left_places("c", 2, tmp_path)
    assert [p.name for p in places] == ["ftcomm-c.left-shard0", "ftcomm-c.left-shard1"]
    assert left_step("c", 2, tmp_path) is None
    for place, steps in zip(places, ([5, 7], [5])):
        place.mkdir()
        for step in steps:
            (place / checkpoint_files.file_name(step, "meta")).write_bytes(b"")
    assert left_step("c", 2, tmp_path) == 5  # shard 1 never kept step 7
    assert left_step("c", 1, tmp_path) is None


def test_an_older_checkpoint_never_replaces_the_state_a_member_kept_when_it_lost_the_quorum(tmp_path):
    """The member that lost the quorum kept step 47 (no checkpointer then). The job's next
    start has FlashCheckpointers whose newest step is 20: restore() agrees on the kept step
    47 (the members resumed it at register_state), not on the checkpoint of step 20, and the
    first collective leaves every member on step 47's state."""
    from ftcomm.errors import QuorumLost
    from ftcomm.training.checkpoint import left_places

    cluster = f"test-{uuid.uuid4().hex[:8]}"
    (kept_at,) = left_places(cluster)
    try:
        (solo,) = start_groups(1, cluster=cluster)
        try:
            trained_state(solo, 3)
            solo.step = 47
            solo._leave_with_state(QuorumLost("cannot reach a majority"))
            kept = solo.state.digest(47)
        finally:
            solo.shutdown()
        older = tmp_path / "older"
        (writer,) = start_groups(1, cluster=f"test-{uuid.uuid4().hex[:8]}")
        try:
            trained_state(writer, 5)
            writer.step = 20
            saved = FlashCheckpointer(writer, older, keep=2, name=cluster + "-ckpt", shm_root=tmp_path / "shm0")
            saved.save()
            saved.close()
        finally:
            writer.shutdown()
        groups = start_groups(2, cluster=cluster)
        try:
            in_threads(groups, lambda i, g: trained_state(g, 10 + i))
            assert [g.step for g in groups] == [47, 47]
            checkpoints = [FlashCheckpointer(g, older, keep=2, name=cluster + "-ckpt", shm_root=tmp_path / f"shm{i + 1}")
                           for i, g in enumerate(groups)]
            assert [c.available() for c in checkpoints] == [[20], [20]]
            assert in_threads(groups, lambda i, g: checkpoints[i].restore()) == [47, 47]

            def step(i: int, g):
                g.allreduce(torch.zeros(1))
                return g.step, g.state.digest(g.step)
            assert in_threads(groups, step) == [(47, kept), (47, kept)]
            for c in checkpoints:
                c.close()
        finally:
            for g in groups:
                g.shutdown()
    finally:
        shutil.rmtree(kept_at, ignore_errors=True)
