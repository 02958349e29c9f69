"""The ftcomm command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ftcomm.gossip import GossipConfig, GossipNode
from ftcomm.ops.cli import main


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
