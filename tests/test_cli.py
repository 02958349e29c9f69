"""The ftcomm command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ftcomm.gossip import GossipConfig, GossipNode
from ftcomm.ops.cli import main


@pytest.fixture(autouse=True)
def _default_cluster(monkeypatch):
    """The commands here take their cluster from ``$FTCOMM_CLUSTER`` (the test processes
    each set their own) and the nodes they query have GossipConfig's default: the same
    name, ``ftcomm``, as for a user who sets neither."""
    monkeypatch.delenv("FTCOMM_CLUSTER", raising=False)


@pytest.fixture
def member():
    node = GossipNode(config=GossipConfig(), secret="topsecret", metadata={"step": 7, "status": "active"}).start()
    yield node
    node.stop()


def test_members_prints_a_table(member, capsys):
    assert main(["members", "--peer", member.address, "--secret", "topsecret"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:5] == ["ID", "ADDRESS", "STATE", "INC", "STEP"]
    row = out[1].split()
    assert row[:5] == [member.id, member.address, "alive", "0", "7"] and "status=active" in out[1]


def test_members_shows_a_training_workers_committed_step(capsys):
    node = GossipNode(config=GossipConfig(), secret="topsecret", metadata={"st": 42, "ph": "active"}).start()
    try:
        assert main(["members", "--peer", node.address, "--secret", "topsecret"]) == 0
    finally:
        node.stop()
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[4] == "42" and "ph=active" in row[5:]


def test_members_prints_forged_metadata_without_the_terminal_acting_on_it(capsys):
    """Metadata comes from the network: an escape sequence in it (clear the screen, move the
    cursor, set the title) is shown as its code, not sent to the terminal."""
    forged = {"st": 1, "ph": "\x1b[2J\x1b]0;owned\x07", "x\x1b[1A": "line\nbreak"}
    node = GossipNode(config=GossipConfig(), secret="topsecret", metadata=forged).start()
    try:
        assert main(["members", "--peer", node.address, "--secret", "topsecret"]) == 0
    finally:
        node.stop()
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and len(out.splitlines()) == 2
    assert "ph=\\x1b[2J\\x1b]0;owned\\x07" in out and "x\\x1b[1A=line\\nbreak" in out


def test_members_reads_the_secret_from_a_file_and_warns_about_one_on_the_command_line(member, capsys, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("topsecret\n")
    assert main(["members", "--peer", member.address, "--secret-file", str(secret)]) == 0
    out, err = capsys.readouterr()
    assert member.id in out and "visible" not in err
    assert main(["members", "--peer", member.address, "--secret", "topsecret"]) == 0
    assert "visible to every user of this host" in capsys.readouterr().err
    assert main(["members", "--peer", member.address, "--secret-file", str(tmp_path / "missing")]) == 2


def test_members_json(member, capsys):
    assert main(["members", "--peer", member.address, "--secret", "topsecret", "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["id"] == member.id and record["metadata"] == {"step": 7, "status": "active"}


@pytest.mark.parametrize("secret", [None, "wrong"])
def test_wrong_or_missing_secret_is_one_clear_line(member, secret):
    args = [sys.executable, "-m", "ftcomm", "members", "--peer", member.address]
    env = {"PATH": "", **({"FTCOMM_SECRET": secret} if secret else {})}
    result = subprocess.run(args, capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert "authentication failed" in result.stderr


def test_no_answer_is_one_clear_line(capsys):
    assert main(["members", "--peer", "127.0.0.1:9", "--timeout", "0.3"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no answer from 127.0.0.1:9" in err


def test_bad_address_is_refused(capsys):
    assert main(["members", "--peer", "nonsense"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_the_gossip_layer_and_members_command_run_without_torch():
    """The layers below the training API (gossip, its simulator, view agreement, the
    ``members`` command) never import torch."""
    code = ("import sys, ftcomm, ftcomm.gossip, ftcomm.gossip.sim, ftcomm.gossip.agent, ftcomm.core.view, ftcomm.ops.cli\n"
            "from ftcomm.ops.cli import main\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_members_watch_redraws_with_steps_per_second_until_interrupted(member):
    import signal
    import threading
    import time

    watch = subprocess.Popen([sys.executable, "-m", "ftcomm", "members", "--peer", member.address, "--secret",
                              "topsecret", "--watch", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True,  # SIGINT as at a terminal, even where this runs with it ignored
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(watch.stdout), daemon=True).start()
    deadline = time.monotonic() + 30
    while sum("STEPS/S" in line for line in list(lines)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    watch.send_signal(signal.SIGINT)
    assert watch.wait(10) == 130
    assert sum("STEPS/S" in line for line in lines) >= 2 and any(member.id in line for line in lines)


def test_the_demo_finds_its_training_script():
    """``ftcomm demo`` runs the repository's example (installed with ``pip install -e .``)."""
    from ftcomm.ops import demo
    assert demo.EXAMPLE.is_file() and demo.EXAMPLE.name == "train_elastic.py"


def test_ftcomm_members_finds_the_job_ftcomm_run_started_here_without_address_or_secret(tmp_path, monkeypatch,
                                                                                       capsys):
    """The launcher's run file (0600, in a 0700 directory) holds the address and the secret
    it drew; ``ftcomm members`` with no --peer reads it. With two jobs it asks which, and
    the file goes when the launcher exits."""
    import os
    import signal
    import stat
    import subprocess
    import sys

    from ftcomm.ops import runfile

    monkeypatch.setenv("FTCOMM_RUN_DIR", str(tmp_path / "runs"))
    for name in ("FTCOMM_SECRET", "FTCOMM_PEERS", "FTCOMM_BIND", "FTCOMM_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "worker.py"
    script.write_text("import time, ftcomm\nft = ftcomm.init(settle_interval=0.3)\nprint('up', flush=True)\n"
                      "time.sleep(60)\n")
    jobs = [subprocess.Popen([sys.executable, "-m", "ftcomm", "run", "--nproc-per-node", "2", "--cluster", name,
                              str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name in ("first", "second")]
    try:
        for job in jobs:
            assert sorted(job.stdout.readline() for _ in range(2)) == ["[w0] up\n", "[w1] up\n"]
        runs = runfile.running()
        assert sorted(r.pid for r in runs) == sorted(j.pid for j in jobs)
        assert stat.S_IMODE(os.stat(tmp_path / "runs").st_mode) == 0o700
        assert all(stat.S_IMODE(os.stat(r.path).st_mode) == 0o600 and r.secret for r in runs)
        assert main(["members", "--json"]) == 1  # two jobs: which one?
        said = capsys.readouterr().err
        assert "2 ftcomm runs on this host" in said and all(f"--run {j.pid}" in said for j in jobs), said
        first = next(r for r in runs if r.cluster == "first")
        out = subprocess.run([sys.executable, "-m", "ftcomm", "members", "--json", "--run", str(first.pid)],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)) == 2
        jobs[1].send_signal(signal.SIGTERM)
        assert jobs[1].wait(60) == 128 + signal.SIGTERM
        assert "watch it with: ftcomm members --watch" in jobs[1].stderr.read()
        assert [r.pid for r in runfile.running()] == [jobs[0].pid]  # its file is gone
        out = subprocess.run([sys.executable, "-m", "ftcomm", "members", "--json"], capture_output=True, text=True,
                             timeout=30, env={**os.environ, "FTCOMM_SECRET": "another-jobs-secret"})
        # one job left: no need to say which; its own secret wins over another job's in the environment
        assert out.returncode == 0 and len(json.loads(out.stdout)) == 2, out.stderr
    finally:
        for job in jobs:
            if job.poll() is None:
                job.send_signal(signal.SIGTERM)
                job.wait(60)
