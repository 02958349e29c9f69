"""Flash checkpoints: round trip, pruning, checksums, and agreement on the step to restore."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import sys
import uuid

import pytest
import torch

from ftcomm.checkpoint import FlashCheckpointer, _steps
from ftcomm.localproc import ChildProcess
from tests.polling import wait_until
from tests.test_group_threads import free_port, in_threads, start_groups
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


def flip(path: pathlib.Path, position: int, mask: int) -> None:
    """Corrupt one byte of a file in place."""
    raw = bytearray(path.read_bytes())
    raw[position] ^= mask
    path.write_bytes(bytes(raw))


@pytest.fixture
def name():
    job = f"test-{uuid.uuid4().hex[:8]}"
    yield job
    shutil.rmtree(f"/dev/shm/ftcomm-{job}", ignore_errors=True)


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
    assert _steps(checkpoints.shm) == [9, 5] and _steps(tmp_path) == [9, 5]
    # buffers are reused: shared memory holds the kept checkpoints plus one spare
    assert len(os.listdir(checkpoints.shm)) <= 2 * 2 + 1
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    group.state.values["note"] = "changed"
    assert checkpoints.restore() == 9
    assert group.step == 9 and group.state.digest(9) == digests[9]
    assert group.state.values["note"] == "hello"
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


def test_members_agree_on_the_newest_step_every_one_can_load(tmp_path, name):
    groups = start_groups(2)
    try:
        models = [trained_state(g, 2)[0] for g in groups]
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
        expected = groups[0].state.digest(8)
        groups[0].step = 12
        checkpoints[0].save()  # only member 0 has step 12
        for c in checkpoints:
            c.wait()
        for m in models:
            with torch.no_grad():
                m[2].bias.fill_(7.0)
        restored = in_threads(groups, lambda i, g: checkpoints[i].restore())
        assert restored == [8, 8]
        assert [g.step for g in groups] == [8, 8]
        assert [g.state.digest(8) for g in groups] == [expected, expected]
        for c in checkpoints:
            c.close()
    finally:
        for g in groups:
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
    assert _steps(checkpoints.shm) == [8, 7]
    for step in (8, 7):
        loaded = checkpoints._load_verified(step)
        assert loaded is not None
        checkpoints._apply(*loaded)
        assert group.state.digest(step) == digests[step]
    checkpoints.close()


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
                       "--checkpoint-every", "8", "--checkpoint-name", name, "--report-every", "1000000"]
            command += ["--bind", seed] if i == 0 else ["--bind", "127.0.0.1:0", "--peers", seed]
            workers.append(ChildProcess(command, ready_timeout=None, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        for w in workers:
            w.wait_ready(90)
        return workers

    first = start(1_000_000)
    try:
        assert all(w.wait_for(lambda e: e["ev"] == "restored", 5, "restored")["step"] is None for w in first)
        wait_until(lambda: len(_steps(tmp_path)) >= 2 and _steps(tmp_path)[0] >= 24, 120, "three checkpoints")
        for w in first:
            w.signal(signal.SIGKILL)
        logs = [e for w in first for e in w.snapshot() if e["ev"] == "batch"]
    finally:
        for w in first:
            w.close()
    shm = pathlib.Path(f"/dev/shm/ftcomm-{name}")
    newest, previous = _steps(tmp_path)[:2]
    assert _steps(shm)[:2] == [newest, previous]
    for place in (shm, tmp_path):
        flip(place / f"step-{newest:012d}.data", -100, 0x40)
    (tmp_path / f"step-{newest + 8:012d}.data").write_bytes(b"partial")  # no record: invisible

    second = start(previous + 16)
    try:
        restored = [w.wait_for(lambda e: e["ev"] == "restored", 60, "restored")["step"] for w in second]
        assert restored == [previous] * 3
        done = [w.wait_for(lambda e: e["ev"] == "done", 120, "done") for w in second]
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
