"""``ftcomm run``: environment, restarts, graceful stop, exit status; and a real training
job whose worker is killed, restarted, and rejoins with the same state."""

from __future__ import annotations

import io
import json
import os
import shutil
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from ftcomm.errors import SecretRequired
from ftcomm.ops import cli
from ftcomm.ops.launcher import LaunchConfig, Launcher
from ftcomm.ops.worker_output import untagged
from tests.polling import wait_until
from tests.train_cluster import EXAMPLE

pytestmark = pytest.mark.timeout(240)


def launch(tmp_path, body: str, nproc: int = 1, **options) -> tuple[int, str]:
    """Run a small Python worker ``body`` under the launcher; the exit status and its log."""
    script = tmp_path / "worker.py"
    script.write_text("import os, sys, time\n" + body)
    out = io.StringIO()
    config = LaunchConfig(command=[sys.executable, str(script)], nproc=nproc, **options)
    return Launcher(config, environ={k: v for k, v in os.environ.items() if not k.startswith("FTCOMM_")},
                    out=out).run(), out.getvalue()


class Launched:
    """``ftcomm run`` with ``arguments`` in a subprocess: the JSON lines its workers print,
    each with its arrival time, and the launcher's log."""

    def __init__(self, arguments: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTCOMM_")}
        self.process = subprocess.Popen([sys.executable, "-m", "ftcomm", "run", *arguments], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env)
        self.timed: list[tuple[float, dict]] = []
        self.log: list[str] = []
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read(self) -> None:
        self.timed.extend((time.monotonic(), json.loads(untagged(line))) for line in self.process.stdout
                          if untagged(line).startswith("{"))

    def of(self, kind: str) -> list[dict]:
        return [e for _, e in list(self.timed) if e["ev"] == kind]

    def finish(self, timeout: float) -> int | None:
        """The launcher's exit status once its output is read; None when it outlived ``timeout``
        (then it is killed)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            for reader in self._readers:
                reader.join(10)


def test_each_worker_gets_its_address_the_others_a_secret_and_a_local_rank():
    launcher = Launcher(LaunchConfig(command=["true"], nproc=3, peers=("127.0.0.1:7000",)), environ={},
                        out=io.StringIO())
    envs = [launcher.worker_env(w) for w in launcher.workers]
    binds = [e["FTCOMM_BIND"] for e in envs]
    assert len(set(binds)) == 3 and all(b.startswith("127.0.0.1:") for b in binds)
    for i, env in enumerate(envs):
        peers = env["FTCOMM_PEERS"].split(",")
        assert env["FTCOMM_BIND"] not in peers and set(peers) == set(binds) - {env["FTCOMM_BIND"]} | {"127.0.0.1:7000"}
        assert env["LOCAL_RANK"] == env["FTCOMM_LOCAL_RANK"] == str(i) and env["LOCAL_WORLD_SIZE"] == "3"
    assert all(env["OMP_NUM_THREADS"] == "1" for env in envs)
    single = Launcher(LaunchConfig(command=["true"]), environ={}, out=io.StringIO())
    assert "OMP_NUM_THREADS" not in single.worker_env(single.workers[0])
    chosen = Launcher(LaunchConfig(command=["true"], nproc=2), environ={"OMP_NUM_THREADS": "4"}, out=io.StringIO())
    assert chosen.worker_env(chosen.workers[0])["OMP_NUM_THREADS"] == "4"
    # peers given (other launchers): no secret is made up (the workers must share one)
    assert "FTCOMM_SECRET" not in envs[0]
    alone = Launcher(LaunchConfig(command=["true"], nproc=2), environ={}, out=io.StringIO())
    made = {alone.worker_env(w)["FTCOMM_SECRET"] for w in alone.workers}
    assert len(made) == 1 and len(next(iter(made))) == 64  # one fresh secret for a run confined to loopback
    given = Launcher(LaunchConfig(command=["true"], nproc=2), environ={"FTCOMM_SECRET": "s3"}, out=io.StringIO())
    assert given.worker_env(given.workers[0])["FTCOMM_SECRET"] == "s3"
    fixed = Launcher(LaunchConfig(command=["true"], nproc=2, port=41000), environ={}, out=io.StringIO())
    assert [w.port for w in fixed.workers] == [41000, 41001]
    # with DNS peers, worker 0 binds the name's port: the first pod must find itself listed
    named = Launcher(LaunchConfig(command=["true"], nproc=2, peers=("dns://localhost:41500",)),
                     environ={"FTCOMM_SECRET": "s"}, out=io.StringIO())
    assert [w.port for w in named.workers] == [41500, 41501]
    with pytest.raises(ValueError, match="65535..65536"):
        Launcher(LaunchConfig(command=["true"], nproc=2, peers=("dns://localhost:65535",)),
                 environ={"FTCOMM_SECRET": "s"}, out=io.StringIO())


@pytest.mark.parametrize("options, message", [
    ({"command": []}, "no command"),
    ({"nproc": 0}, "nproc"),
    ({"host": "not-an-address"}, "not-an-address"),
    ({"peers": ("nohost",)}, "nohost"),
    ({"save_at_breakpoint": True}, "checkpoint-dir"),
    ({"port": 65535, "nproc": 2}, "ports"),
    ({"restart_backoff": -1.0}, ">= 0"),
    ({"nproc": 6, "replica_size": 4}, "must divide --nproc-per-node 6"),
    ({"kill_stopped_after": -1.0}, "kill-stopped-after"),
    ({"nproc": 2, "min_workers": 3}, "--min-workers 3 cannot be met: this node runs 2 workers"),
    ({"checkpoint_dir": " "}, "--checkpoint-dir is empty"),
    ({"nproc": 4, "replica_size": 2, "min_workers": 3}, "this node runs 2 replicas"),
])
def test_bad_options_are_refused_with_a_clear_error(options, message):
    with pytest.raises(ValueError, match=message):
        LaunchConfig(**{"command": ["true"], **options})


def test_a_non_loopback_node_without_a_secret_is_refused_unless_insecure_is_asked_for():
    from ftcomm import _default_bind

    host = _default_bind().rsplit(":", 1)[0]
    if host == "127.0.0.1":
        pytest.fail("this machine has no non-loopback IPv4 address to test protected mode with")
    config = LaunchConfig(command=["true"], host=host, port=7000)
    with pytest.raises(SecretRequired, match="FTCOMM_SECRET"):
        Launcher(config, environ={}, out=io.StringIO())
    Launcher(config, environ={"FTCOMM_INSECURE": "1"}, out=io.StringIO())
    with pytest.raises(ValueError, match="empty"):
        Launcher(LaunchConfig(command=["true"]), environ={"FTCOMM_SECRET": ""}, out=io.StringIO())


def test_sharded_replicas_get_their_shard_rank_and_one_store_address_each():
    launcher = Launcher(LaunchConfig(command=["true"], nproc=4, replica_size=2), environ={}, out=io.StringIO())
    for worker in launcher.workers:  # what starting shard 0 of each replica draws
        worker.replica_addr = f"127.0.0.1:{29500 + worker.local_rank - worker.local_rank % 2}"
    envs = [launcher.worker_env(w) for w in launcher.workers]
    assert [e["FTCOMM_SHARD_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert {e["FTCOMM_REPLICA_SIZE"] for e in envs} == {"2"}
    assert [e["FTCOMM_REPLICA_ADDR"] for e in envs] == ["127.0.0.1:29500"] * 2 + ["127.0.0.1:29502"] * 2
    plain = Launcher(LaunchConfig(command=["true"], nproc=2), environ={}, out=io.StringIO())
    assert "FTCOMM_REPLICA_SIZE" not in plain.worker_env(plain.workers[0])


def test_a_replica_whose_process_fails_is_stopped_and_restarted_as_a_whole(tmp_path):
    # Replica 1's shard 1 fails on its first start; shard 0 of that replica must be stopped
    # and both must start again together, on a new store address; replica 0 is untouched.
    log_dir = tmp_path / "starts"
    log_dir.mkdir()
    body = ("import signal\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
            "rank, restarts = os.environ['LOCAL_RANK'], os.environ['FTCOMM_RESTARTS']\n"
            f"open(os.path.join({str(log_dir)!r}, rank + '-' + restarts), 'w').write(os.environ['FTCOMM_REPLICA_ADDR'])\n"
            "if rank == '3' and restarts == '0': time.sleep(0.5); sys.exit(7)\n"
            "time.sleep(2.0)\n")
    code, log = launch(tmp_path, body, nproc=4, replica_size=2, restart_backoff=0.0)
    assert code == 0, log
    assert "worker 3 exited with status 7" in log and "with the rest of its replica" in log
    assert "worker 2 left with its replica" in log
    starts = {p.name: p.read_text() for p in log_dir.iterdir()}
    assert set(starts) == {"0-0", "1-0", "2-0", "3-0", "2-1", "3-1"}  # replica 0 never restarted
    assert starts["0-0"] == starts["1-0"] != starts["2-0"] == starts["3-0"] != starts["2-1"] == starts["3-1"]


REPAIR_CHANNEL = ("import socket\n"
                  "rank, restarts = os.environ['LOCAL_RANK'], os.environ['FTCOMM_RESTARTS']\n"
                  "channel = socket.socket(fileno=int(os.environ['FTCOMM_REPAIR_FD']))\n")
"""A fake replica process's start: its local rank, its start's number and its repair channel."""


def test_a_replica_whose_partner_said_it_can_be_repaired_gets_a_replacement_and_keeps_the_partner(tmp_path):
    """Replica 0's shard 1 fails once; shard 0 had said `repairable` on its repair channel:
    only shard 1 starts again, at a fresh store address, which shard 0 (the same process)
    is told in a `meet` line; a `lost` report names a hung partner, which is killed. Lines
    that are none of the protocol's are dropped, said once."""
    log_dir = tmp_path / "starts"
    log_dir.mkdir()
    body = (REPAIR_CHANNEL +
            f"open(os.path.join({str(log_dir)!r}, rank + '-' + restarts), 'w').write(os.environ['FTCOMM_REPLICA_ADDR'])\n"
            "if rank == '1' and restarts == '0': time.sleep(1.0); sys.exit(7)\n"
            "if rank == '0':\n"
            "    channel.sendall(b'repairable\\n' + b'nonsense\\n' * 50)\n"
            "    line = channel.makefile().readline().strip()\n"
            f"    open(os.path.join({str(log_dir)!r}, 'told'), 'w').write(line + ' ' + str(os.getpid()))\n"
            "time.sleep(1.0)\n")
    code, log = launch(tmp_path, body, nproc=2, replica_size=2, restart_backoff=0.0)
    assert code == 0, log
    assert "worker 1 exited with status 7" in log and "its replica is repaired in place" in log, log
    assert "with the rest of its replica" not in log and "left with its replica" not in log
    assert log.count("sent an unknown line on its repair channel") == 1
    starts = {p.name: p.read_text() for p in log_dir.iterdir()}
    assert set(starts) == {"0-0", "1-0", "1-1", "told"}  # shard 0 started once
    told = starts["told"].split()
    assert told[0] == "meet" and told[2] == starts["1-1"] != starts["1-0"]


def test_a_replica_partner_reported_hung_is_killed_and_replaced(tmp_path):
    """Shard 0, repairable, reports shard 1 (stopped) lost with its pid: the launcher kills
    it at once (not after --kill-stopped-after) and starts a replacement."""
    body = (REPAIR_CHANNEL + "import signal\n"
            "if rank == '1' and restarts == '0':\n"
            f"    open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n"
            "    os.kill(os.getpid(), signal.SIGSTOP)\n"
            "if rank == '0':\n"
            "    channel.sendall(b'repairable\\n')\n"
            f"    path = {str(tmp_path / 'pid')!r}\n"
            "    deadline = time.monotonic() + 60\n"
            "    while not os.path.exists(path) or not open(path).read():\n"
            "        assert time.monotonic() < deadline, 'shard 1 never wrote its pid'\n"
            "        time.sleep(0.05)\n"
            "    time.sleep(0.3)\n"
            "    channel.sendall(f'lost 1 {open(path).read()}\\n'.encode())\n"
            "    channel.makefile().readline()\n"
            "time.sleep(0.5)\n")
    # (stopped workers left alone otherwise: the report alone has it killed, never the
    # launcher's own watch, which a loaded machine could let act first)
    code, log = launch(tmp_path, body, nproc=2, replica_size=2, restart_backoff=0.0, kill_stopped_after=None)
    assert code == 0, log
    assert "is hung, its replica's worker 0 found: killed, to be replaced" in log, log
    assert "worker 1 exited with signal SIGKILL" in log and "its replica is repaired in place" in log, log


def test_a_replica_partner_of_a_killed_process_is_killed_after_a_short_grace(tmp_path):
    """Shard 0 dies by a signal; shard 1 (in a collective with it, where no handler runs:
    here it ignores SIGTERM) is killed after REPLICA_KILLED_HALT_S, not REPLICA_HALT_S, and the
    replica starts again as a whole."""
    body = ("import signal\n"
            "if os.environ['FTCOMM_RESTARTS'] != '0': sys.exit(0)\n"
            "if os.environ['FTCOMM_SHARD_RANK'] == '0': time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "time.sleep(30)\n")
    code, log = launch(tmp_path, body, nproc=2, replica_size=2, restart_backoff=0.0)
    assert code == 0, log
    assert "worker 0 exited with signal SIGKILL" in log and "did not leave within 0.5 s" in log, log
    assert "worker 1 left with its replica (signal SIGKILL)" in log, log


def test_a_replica_partner_that_finishes_as_it_is_stopped_is_finished_not_restarted(tmp_path):
    # Shard 0 fails; shard 1 takes the stop as the end of its work and exits 0: it finished,
    # the job is ending, and nobody is started again.
    body = ("import signal\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
            "if os.environ['FTCOMM_SHARD_RANK'] == '0': time.sleep(0.5); sys.exit(3)\n"
            "time.sleep(30)\n")
    code, log = launch(tmp_path, body, nproc=2, replica_size=2, restart_backoff=0.0)
    assert "worker 1 finished" in log and "worker 0 is not restarted: the job is ending" in log, log
    assert len(re.findall(r"worker \d started", log)) == 2, log  # nobody started again
    # Training completed (a worker finished): exit 0, the lost worker named in the summary.
    assert code == 0 and "training completed (exit status 0)" in log and "lost worker 0" in log, log


def test_a_failing_worker_is_restarted_with_backoff_until_it_finishes(tmp_path):
    code, log = launch(tmp_path, "sys.exit(0 if int(os.environ['FTCOMM_RESTARTS']) >= 2 else 3)\n",
                       restart_backoff=0.05)
    assert code == 0, log
    assert "restart 1 of 3 in 0 s" in log and "restart 2 of 3 in 0.05 s" in log and "finished" in log


def test_a_stopped_worker_is_killed_and_restarted(tmp_path):
    """A process stopped by SIGSTOP answers nothing while its kernel still accepts
    connections: the launcher kills it (its ports then refuse) and restarts it."""
    body = "import signal\nif os.environ['FTCOMM_RESTARTS'] == '0':\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
    code, log = launch(tmp_path, body, kill_stopped_after=0.1)
    assert code == 0, log
    assert "is stopped: killed" in log and "signal SIGKILL" in log and "restart 1 of 3" in log


def test_a_stopped_process_that_a_worker_started_gets_the_worker_killed_and_restarted(tmp_path):
    """The script under a wrapper, or a data loader: a stopped child stalls the worker too."""
    body = ("import signal, subprocess\n"
            "if os.environ['FTCOMM_RESTARTS'] == '0':\n"
            "    child = subprocess.Popen([sys.executable, '-c', 'import os, signal; os.kill(os.getpid(), "
            "signal.SIGSTOP)'])\n"
            "    child.wait()\n")
    code, log = launch(tmp_path, body, kill_stopped_after=0.1)
    assert code == 0, log
    assert "is stopped: killed" in log and "restart 1 of 3" in log


def test_a_min_workers_another_node_can_meet_is_accepted():
    LaunchConfig(command=["true"], nproc=2, min_workers=4, port=41000)  # other nodes may list this one
    LaunchConfig(command=["true"], nproc=2, min_workers=4, peers=("127.0.0.1:41000",))


def test_a_stopped_worker_is_left_alone_when_asked_and_goes_on_once_continued(tmp_path):
    marker = tmp_path / "pid"
    body = f"import signal\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\nos.kill(os.getpid(), signal.SIGSTOP)\n"

    def continue_it() -> None:
        wait_until(lambda: marker.exists() and marker.read_text(), 60, "the worker's pid")
        time.sleep(1.0)  # stopped meanwhile, far longer than the default grace
        os.kill(int(marker.read_text()), signal.SIGCONT)

    helper = threading.Thread(target=continue_it)
    helper.start()
    code, log = launch(tmp_path, body, kill_stopped_after=None)
    helper.join()
    assert code == 0, log
    assert "is stopped: killed" not in log and "0 restarts" in log, log


def test_a_worker_out_of_restarts_fails_the_job(tmp_path):
    code, log = launch(tmp_path, "os.kill(os.getpid(), 9)\n", max_restarts=1, restart_backoff=0.0)
    assert code == 1
    assert len(re.findall(r"worker \d started", log)) == 2 and "signal SIGKILL" in log and "no restarts left" in log


def test_once_a_worker_finished_no_worker_is_restarted_and_stragglers_are_stopped(tmp_path):
    body = ("import signal\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
            f"marker = {str(tmp_path / 'finished')!r}\n"
            "if os.environ['LOCAL_RANK'] == '0': open(marker, 'w').close(); sys.exit(0)\n"
            "if os.environ['LOCAL_RANK'] == '1':\n"
            "    while not os.path.exists(marker): time.sleep(0.01)\n"
            "    time.sleep(0.3); sys.exit(5)\n"
            "time.sleep(60)\n")
    started = time.monotonic()
    code, log = launch(tmp_path, body, nproc=3, restart_backoff=0.0, stop_timeout=1.0)
    assert code == 0 and time.monotonic() - started < 30 and "lost workers 1, 2" in log, log
    assert "not restarted: the job is ending" in log and "stopping them" in log
    assert len(re.findall(r"worker \d started", log)) == 3


def test_a_program_that_cannot_start_fails_at_once(tmp_path):
    out = io.StringIO()
    code = Launcher(LaunchConfig(command=[str(tmp_path / "missing")]), environ={}, out=out).run()
    assert code == 1 and "cannot start" in out.getvalue()


def test_sigterm_to_the_launcher_is_a_graceful_leave_for_every_worker(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import os, signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *a: (os.write(1, f'left {os.environ[\"LOCAL_RANK\"]}\\n'.encode()),"
                      " sys.exit(0)))\n"
                      "os.write(1, b'up\\n')\n"
                      "time.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "ftcomm", "run", "--nproc-per-node", "2", str(script)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    wait_until(lambda: sorted(lines) == ["[w0] up\n", "[w1] up\n"], 60, "both workers up")
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 128 + signal.SIGTERM
    reader.join(10)
    assert sorted(lines) == ["[w0] left 0\n", "[w0] up\n", "[w1] left 1\n", "[w1] up\n"]  # tagged
    assert "SIGTERM: stopping every worker" in launcher.stderr.read()


def test_the_command_line_refuses_bad_arguments_with_status_2(capsys):
    assert cli.main(["run", "--nproc-per-node", "0", "x.py"]) == 2
    assert cli.main(["run", "--restart-backoff", "-1", "x.py"]) == 2
    assert cli.main(["run"]) == 2
    assert "no command" in capsys.readouterr().err


@pytest.mark.parametrize("standby", [False, True], ids=["new-process", "standby"])
def test_a_killed_worker_is_restarted_rejoins_and_ends_with_the_others_state(tmp_path, standby):
    """A real job through the launcher: kill -9 one of three workers mid-training; it is
    restarted (a new process, or a warm standby taking its place), receives the state from
    its peers, and every worker ends with one digest."""
    job = Launched(["--nproc-per-node", "3", "--restart-backoff", "0.2", "--stop-timeout", "120",
                    *(["--standby", "1"] if standby else []), str(EXAMPLE), "--steps", "600",
                    "--step-time", "0.03", "--report-every", "1000000"])
    try:
        wait_until(lambda: len(job.of("first_step")) >= 3, 120, "three workers training")
        if standby:
            wait_until(lambda: "standby ready" in "".join(job.log), 120, "a standby ready")
        victim = job.of("ready")[0]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_until(lambda: len(job.of("ready")) >= 4 or job.process.poll() is not None,
                   120, "the restarted worker in the group")
        code = job.finish(300)
    finally:
        job.finish(0)
    text = "".join(job.log)
    assert code == 0, text[-3000:]
    assert "restart 1 of 3" in text and "signal SIGKILL" in text
    assert ("restart 1 (a warm standby)" in text) == standby, text[-3000:]
    done = job.of("done")
    assert len(done) == 3, text[-3000:]
    assert len({e["digest"] for e in done}) == 1 and len({e["step"] for e in done}) == 1
    assert victim["id"] not in {e["id"] for e in done}  # the restarted process is a new member


def test_a_worker_started_again_is_told_the_group_ran_once_the_launcher_saw_a_view():
    """The launcher reads a running worker's member table each second until a record shows
    a view; a worker it starts after that gets FTCOMM_GROUP_RAN=1 (it founds no group while
    a peer is silent: the group may run on there), a first start never does."""
    from ftcomm.gossip.runtime import GossipNode

    launcher = Launcher(LaunchConfig(command=["true"], nproc=2), environ={}, out=io.StringIO())
    worker = launcher.workers[0]
    node = GossipNode(("127.0.0.1", worker.port), cluster=launcher.config.cluster, secret=launcher.secret,
                      metadata={"ph": "joining", "cv": 0}).start()
    try:
        worker.status = "running"
        launcher._watch_group(time.monotonic())
        assert not launcher._group_ran  # no view yet
        node.set_metadata({"ph": "active", "cv": 3})
        wait_until(lambda: launcher._watch_group(time.monotonic() + 2.0) or launcher._group_ran, 10,
                   "the launcher sees the view")
    finally:
        node.stop()
    other = launcher.workers[1]
    assert launcher.worker_env(other)["FTCOMM_GROUP_RAN"] == "0"  # a first start
    other.restarts = 1
    assert launcher.worker_env(other)["FTCOMM_GROUP_RAN"] == "1"



def test_a_launcher_whose_pod_container_restarted_in_place_tells_its_first_workers_the_group_ran(tmp_path):
    """Inside a Kubernetes pod the launcher marks in the pod's /dev/shm that it saw the
    group run; a launcher started again in that pod (its container restarted in place,
    restartPolicy OnFailure) finds the mark and tells even its first workers
    FTCOMM_GROUP_RAN=1. The job completing, or --fresh, removes the mark; outside a pod
    nothing is marked, and a link or another user's file is no mark."""
    from ftcomm.gossip.runtime import GossipNode
    from ftcomm.ops import launcher as launcher_module

    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    cluster = f"podmark-{os.getpid()}"
    mark = launcher_module.pod_mark(cluster, pod)
    assert mark is not None and launcher_module.pod_mark(cluster, {}) is None  # only in a pod
    try:
        first = Launcher(LaunchConfig(command=["true"], nproc=2, cluster=cluster), environ=pod, out=io.StringIO())
        assert first.worker_env(first.workers[1])["FTCOMM_GROUP_RAN"] == "0" and not mark.exists()
        node = GossipNode(("127.0.0.1", first.workers[0].port), cluster=cluster, secret=first.secret,
                          metadata={"ph": "active", "cv": 2}).start()
        try:
            first.workers[0].status = "running"
            wait_until(lambda: first._watch_group(time.monotonic() + 2.0) or first._group_ran, 10,
                       "the launcher sees the view")
        finally:
            node.stop()
        assert mark.is_file() and (mark.stat().st_mode & 0o777) == 0o600
        again = Launcher(LaunchConfig(command=["true"], nproc=2, cluster=cluster), environ=pod, out=io.StringIO())
        assert again.worker_env(again.workers[1])["FTCOMM_GROUP_RAN"] == "1"  # a first start, in a pod that ran
        fresh = Launcher(LaunchConfig(command=["true"], nproc=2, cluster=cluster, fresh=True), environ=pod,
                         out=io.StringIO())
        assert fresh.worker_env(fresh.workers[1])["FTCOMM_GROUP_RAN"] == "0" and not mark.exists()
        mark.symlink_to(tmp_path / "elsewhere")  # a link is no mark, and it is in the way: said so
        assert not launcher_module.read_pod_mark(mark)
        assert "in the way" in launcher_module.write_pod_mark(mark) and not (tmp_path / "elsewhere").exists()
        mark.unlink()
        assert launcher_module.pod_mark("a/../../elsewhere", pod) is None  # no single file name: nothing marked
        launcher_module.write_pod_mark(mark)
        out = io.StringIO()
        environ = {**{k: v for k, v in os.environ.items() if not k.startswith("FTCOMM_")}, **pod}
        completed = Launcher(LaunchConfig(command=["true"], nproc=1, cluster=cluster), environ=environ, out=out)
        assert completed.run() == 0, out.getvalue()
        assert "before its container restarted" in out.getvalue()
        assert not mark.exists() and not os.path.lexists(mark)  # the job completed
    finally:
        if os.path.lexists(mark):
            os.unlink(mark)

@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_rank_0_of_two_lost_the_survivor_trains_on_alone_and_nothing_committed_is_lost(sig):
    """Two workers: kill -9 of rank 0, or SIGSTOP (then the launcher kills it: a stopped
    process looks like a lost node). The survivor alone is no majority of their view (a tie
    goes to rank 0), but rank 0's port refuses a connection: the process is gone, and the
    survivor goes on alone instead of waiting out the quorum timeout; the restarted rank 0
    joins it and receives its state. No step is committed twice (nothing starts over), every
    step of the job is committed, and both end with one state."""
    steps = 300
    job = Launched(["--nproc-per-node", "2", "--restart-backoff", "0.2", "--min-workers", "1", str(EXAMPLE),
                    "--steps", str(steps), "--step-time", "0.03", "--report-every", "1000000", "--log-indices"])
    try:
        wait_until(lambda: len(job.of("first_step")) >= 2 and max(e["step"] for e in job.of("batch")) >= 30, 120,
                   lambda: f"two workers training: {''.join(job.log[-20:])}")
        victim = next(e for e in job.of("ready") if e["rank"] == 0)
        killed_at = time.monotonic()
        os.kill(victim["pid"], sig)
        code = job.finish(300)
    finally:
        job.finish(0)
    text = "".join(job.log)
    assert code == 0, text[-3000:]
    assert "signal SIGKILL" in text and "QuorumLost" not in text and "GroupEnded" not in text, text[-3000:]
    assert ("is stopped: killed" in text) == (sig == signal.SIGSTOP), text[-3000:]
    done = job.of("done")
    assert len(done) == 2 and {e["step"] for e in done} == {steps}, text[-3000:]
    assert len({e["digest"] for e in done}) == 1
    survivor = next(e for e in job.of("ready") if e["rank"] == 1)
    alone = [t for t, e in job.timed if e["ev"] == "batch" and e["pid"] == survivor["pid"] and e["world"] == 1]
    assert alone, "the survivor never committed a step alone"
    print(f"the survivor committed alone {alone[0] - killed_at:.2f} s after the {signal.Signals(sig).name}")
    # nothing committed twice: once past a step, no process commits it again (a start over
    # from step 0 would), and every step of the job was committed
    batches = [(t, e["step"], e["pid"]) for t, e in job.timed if e["ev"] == "batch"]
    before = max(step for t, step, _ in batches if t < killed_at)
    assert not [b for b in batches if b[0] > killed_at + 2.0 and b[1] < before - 1], "steps committed again"
    for pid in {b[2] for b in batches}:
        own = [step for _, step, p in batches if p == pid]
        assert own == sorted(set(own)), f"process {pid} committed a step twice"
    assert {step for _, step, _ in batches} == set(range(1, steps + 1))


def _rank_0_lost_after(step: int, arguments: list[str]) -> "Launched":
    """Two workers under ``ftcomm run --max-restarts 0``; past ``step``, rank 0 stopped and
    left stopped (as a lost node: nothing proves it gone) until the survivor raised
    QuorumLost and its launcher gave up; then killed. The ended launch."""
    first = Launched(["--max-restarts", "0", *arguments])
    try:
        wait_until(lambda: max([e["step"] for e in first.of("batch")] + [0]) >= step, 120,
                   lambda: f"training past step {step}: {''.join(first.log[-20:])}")
        victim = next(e for e in first.of("ready") if e["rank"] == 0)
        os.kill(victim["pid"], signal.SIGSTOP)
        wait_until(lambda: "QuorumLost" in "".join(first.log), 120, "the survivor's QuorumLost")
        wait_until(lambda: "no restarts left" in "".join(first.log), 60, "the survivor's exit")
        os.kill(victim["pid"], signal.SIGKILL)  # the lost node's worker, gone for good
        assert first.finish(60) == 1
    finally:
        first.finish(0)
    return first


def _survivors_step(first: "Launched") -> int:
    """The last step rank 1 (the survivor of :func:`_rank_0_lost_after`) committed."""
    survivor = next(e for e in first.of("ready") if e["rank"] == 1)
    return max(e["step"] for e in first.of("batch") if e["pid"] == survivor["pid"])


def _resumed(arguments: list[str], first: "Launched", held: int, steps: int) -> "Launched":
    """The job launched again after ``first``: it completes at ``steps`` with one state on
    both workers, the survivor having committed every step up to ``held`` and the new run
    every step after it, once. The ended launch."""
    second = Launched(arguments)
    try:
        code = second.finish(300)
    finally:
        second.finish(0)
    assert code == 0, "".join(second.log)[-3000:]
    done = second.of("done")
    assert len(done) == 2 and {e["step"] for e in done} == {steps} and len({e["digest"] for e in done}) == 1
    survivor = next(e for e in first.of("ready") if e["rank"] == 1)
    before = {e["step"] for e in first.of("batch") if e["pid"] == survivor["pid"]}
    after = sorted({e["step"] for e in second.of("batch")})
    assert before == set(range(1, held + 1)) and after == list(range(held + 1, steps + 1)), \
        f"resumed at {after[:1]}, kept {held}: {''.join(second.log)[-3000:]}"
    return second


def test_the_survivor_that_loses_quorum_keeps_its_state_and_the_job_restart_resumes_from_it(tmp_path):
    """Two workers, rank 0 stopped and left stopped (as a lost node: nothing proves it gone):
    the survivor waits out its quorum timeout and raises QuorumLost, but first writes the
    state of its committed step to the flash checkpoints, though the periodic save is many
    steps older. The job started again resumes from that step: no committed step is trained
    again, every step of the job is committed once, and both end with one state."""
    import uuid

    steps, every = 200, 40
    name = f"test-{uuid.uuid4().hex[:8]}"
    arguments = ["--nproc-per-node", "2", "--restart-backoff", "0.2", "--min-workers", "1",
                 "--kill-stopped-after", "off", str(EXAMPLE), "--steps", str(steps), "--step-time", "0.03",
                 "--report-every", "1000000", "--log-indices", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--checkpoint-every", str(every), "--checkpoint-name", name, "--options", '{"quorum_timeout": 3}']
    try:
        first = _rank_0_lost_after(every + 15, arguments)
        held = _survivors_step(first)
        text = "".join(first.log)
        assert held % every and f"the state of step {held} is in the flash checkpoints" in text, text[-3000:]
        second = _resumed(arguments, first, held, steps)
        assert {e["step"] for e in second.of("restored")} == {held}, second.of("restored")
    finally:
        shutil.rmtree(f"/dev/shm/ftcomm-{name}", ignore_errors=True)


def test_without_a_checkpointer_the_survivor_that_loses_quorum_keeps_its_state_and_the_restart_resumes(tmp_path):
    """As above, with no FlashCheckpointer at all (the quickstart's script): the survivor's
    QuorumLost still leaves the state of its committed step in this host's shared memory,
    and the job started again resumes from it through the first reconcile (every step of
    the job committed once, one state at the end); the kept copy is gone after that."""
    import uuid

    from ftcomm.training.checkpoint import left_places
    from ftcomm.training.checkpoint_files import steps_in

    steps = 160
    cluster = f"test-{uuid.uuid4().hex[:8]}"
    arguments = ["--nproc-per-node", "2", "--restart-backoff", "0.2", "--min-workers", "1", "--cluster", cluster,
                 "--kill-stopped-after", "off", str(EXAMPLE), "--steps", str(steps), "--step-time", "0.03",
                 "--report-every", "1000000", "--log-indices", "--options", '{"quorum_timeout": 3}']
    (kept_at,) = left_places(cluster)
    try:
        first = _rank_0_lost_after(40, arguments)
        held = _survivors_step(first)
        assert f"the state of step {held} is kept in shared memory" in "".join(first.log), "".join(first.log)[-3000:]
        assert steps_in(kept_at) == [held]
        text = "".join(_resumed(arguments, first, held, steps).log)
        assert f"kept the state of step {held}" in text and f"resuming from step {held}" in text, text[-3000:]
        assert not steps_in(kept_at)  # removed once the group committed past it
    finally:
        shutil.rmtree(kept_at, ignore_errors=True)


def test_save_at_breakpoint_persists_shared_memory_when_a_worker_dies(tmp_path):
    import shutil
    import uuid

    import torch

    from ftcomm.training.checkpoint import FlashCheckpointer
    from ftcomm.training.checkpoint_files import steps_in
    from tests.test_group_threads import start_groups

    name = f"test-{uuid.uuid4().hex[:8]}"
    (solo,) = start_groups(1)
    try:
        solo.register_state(model=torch.nn.Linear(4, 2))
        checkpoints = FlashCheckpointer(solo, None, name=name)  # shared memory only
        solo.step = 12
        checkpoints.save()
        checkpoints.wait()
        out = io.StringIO()
        config = LaunchConfig(command=[sys.executable, "-c", "raise SystemExit(3)"], max_restarts=0,
                              save_at_breakpoint=True, checkpoint_name=name, checkpoint_dir=str(tmp_path / "kept"))
        assert Launcher(config, environ={}, out=out).run() == 1
        assert "saved the newest checkpoint (step 12)" in out.getvalue()
        assert steps_in(tmp_path / "kept") == [12]
        checkpoints.close()
    finally:
        solo.shutdown()
        shutil.rmtree(f"/dev/shm/ftcomm-{name}", ignore_errors=True)


SAVES_STEP_7 = (
    "import torch, ftcomm\n"
    "from ftcomm.training.checkpoint import FlashCheckpointer\n"
    "g = ftcomm.init()\n"
    "g.register_state(model=torch.nn.Linear(4, 2))\n"
    "c = FlashCheckpointer(g, None)\n"
    "g.step = 7\n"
    "c.save()\n"
    "c.close()\n"
    "g.shutdown()\n")
"""A worker that saves a flash checkpoint of step 7 to shared memory alone."""


def test_a_completed_run_removes_its_flash_checkpoints_once_persisted_and_keeps_the_only_copy(tmp_path):
    """A worker saves to shared memory (alone: no persistent directory); when training
    completes, the launcher persists the newest to --checkpoint-dir and removes the shared
    memory; without --checkpoint-dir it keeps them and says where."""
    import pathlib
    import uuid

    from ftcomm.training.checkpoint_files import steps_in

    script = tmp_path / "train.py"
    script.write_text(SAVES_STEP_7)
    for persist in (True, False):
        name = f"test-{uuid.uuid4().hex[:8]}"
        shm = pathlib.Path(f"/dev/shm/ftcomm-{name}")
        out = io.StringIO()
        config = LaunchConfig(command=[sys.executable, str(script)], cluster=name,
                              checkpoint_dir=str(tmp_path / name) if persist else None)
        try:
            assert Launcher(config, environ=dict(os.environ), out=out).run() == 0, out.getvalue()
            if persist:
                assert steps_in(tmp_path / name) == [7] and not shm.exists(), out.getvalue()
                assert f"removed its flash checkpoints from {shm}" in out.getvalue()
            else:
                assert steps_in(shm) == [7], out.getvalue()
                assert f"its flash checkpoints stay in {shm}" in out.getvalue()
        finally:
            shutil.rmtree(shm, ignore_errors=True)


def test_the_launcher_names_the_checkpoints_a_start_resumes_from_and_fresh_removes_them(tmp_path):
    import pathlib
    import uuid

    from ftcomm.training.checkpoint_files import steps_in

    script = tmp_path / "train.py"
    script.write_text(SAVES_STEP_7)
    name = f"test-{uuid.uuid4().hex[:8]}"
    shm = pathlib.Path(f"/dev/shm/ftcomm-{name}")
    try:
        first = io.StringIO()
        assert Launcher(LaunchConfig(command=[sys.executable, str(script)], cluster=name),
                        environ=dict(os.environ), out=first).run() == 0, first.getvalue()
        assert steps_in(shm) == [7] and "flash checkpoints of job" not in first.getvalue()
        again = io.StringIO()
        assert Launcher(LaunchConfig(command=["true"], cluster=name), environ={}, out=again).run() == 0
        assert f"flash checkpoints of job {name!r} here: newest step 7 in {shm}" in again.getvalue()
        fresh = io.StringIO()
        assert Launcher(LaunchConfig(command=["true"], cluster=name, fresh=True), environ={}, out=fresh).run() == 0
        assert f"--fresh: removed the flash checkpoints of job {name!r} in {shm} (newest step 7)" in fresh.getvalue()
        assert not shm.exists()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_state_kept_on_a_lost_quorum_is_named_at_start_and_removed_by_fresh_and_by_a_completed_job():
    import uuid

    from ftcomm.training import checkpoint_files as files
    from ftcomm.training.checkpoint import left_places

    name = f"test-{uuid.uuid4().hex[:8]}"
    (kept,) = left_places(name)

    def plant() -> None:  # what a worker that lost the quorum leaves (only the names count here)
        files.private_directory(kept)
        (kept / files.file_name(9, "meta")).write_bytes(b"")
    try:
        plant()
        failed = io.StringIO()
        assert Launcher(LaunchConfig(command=["false"], cluster=name, max_restarts=0), environ={},
                        out=failed).run() != 0
        assert f"kept the state of step 9 in {kept}: the workers resume from it" in failed.getvalue()
        assert files.steps_in(kept) == [9]  # a job that did not complete leaves it for the next start
        fresh = io.StringIO()
        assert Launcher(LaunchConfig(command=["true"], cluster=name, fresh=True), environ={}, out=fresh).run() == 0
        assert f"--fresh: removed the state a worker of cluster {name!r} kept in {kept}" in fresh.getvalue()
        assert not kept.exists()
        plant()
        done = io.StringIO()
        assert Launcher(LaunchConfig(command=["true"], cluster=name), environ={}, out=done).run() == 0
        assert f"training completed: removed the state kept in {kept}" in done.getvalue() and not kept.exists()
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_a_worker_waiting_for_its_restart_is_not_restarted_once_another_finished(tmp_path):
    body = ("if os.environ['LOCAL_RANK'] == '0': sys.exit(7)\n"
            "time.sleep(0.5); sys.exit(0)\n")
    code, log = launch(tmp_path, body, nproc=2, restart_backoff=5.0)
    assert code == 0 and "worker 0 is not restarted: the job is ending" in log and "lost worker 0" in log
    # worker 0's first restart is immediate, its second would wait 5 s: 3 starts in all
    assert len(re.findall(r"worker \d started", log)) == 3


def test_the_restart_backoff_stops_growing(tmp_path):
    launcher = Launcher(LaunchConfig(command=["true"], max_restarts=10_000, restart_backoff=1.0), environ={},
                        out=io.StringIO())
    worker = launcher.workers[0]
    worker.restarts, worker.process = 1024, subprocess.Popen(["true"])
    worker.process.wait()
    launcher._exited(worker, 1, time.monotonic())  # 2**1024 seconds would overflow a float
    assert worker.status == "waiting" and worker.restart_at - time.monotonic() <= 60


def test_what_a_worker_started_does_not_outlive_it(tmp_path):
    marker = tmp_path / "child.pid"
    body = (f"import subprocess\n"
            f"if os.environ['FTCOMM_RESTARTS'] == '0':\n"
            f"    child = subprocess.Popen(['sleep', '1000'])\n"
            f"    open({str(marker)!r}, 'w').write(str(child.pid))\n"
            f"    sys.exit(3)\n")
    code, log = launch(tmp_path, body, restart_backoff=0.0)
    assert code == 0, log
    child = int(marker.read_text())
    wait_until(lambda: not os.path.exists(f"/proc/{child}") or
               open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", 10, "the orphan gone")


def test_a_second_sigterm_kills_workers_that_ignore_the_first(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "os.write(1, b'up\\n')\ntime.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "ftcomm", "run", "--stop-timeout", "60", str(script)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert launcher.stdout.readline() == "[w0] up\n"
    launcher.send_signal(signal.SIGTERM)
    while "stopping every worker" not in launcher.stderr.readline():  # the first one was seen
        pass
    launcher.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert launcher.wait(30) == 128 + signal.SIGTERM
    assert time.monotonic() - started < 30  # not the 60 s stop timeout


def test_workers_leave_when_the_launcher_is_killed(tmp_path):
    """kill -9 of the launcher: its workers get SIGTERM (a graceful leave) and exit."""
    script = tmp_path / "worker.py"
    script.write_text("import os, signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                      "os.write(1, (str(os.getpid()) + '\\n').encode())\ntime.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "ftcomm", "run", "--nproc-per-node", "2", str(script)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    pids = [int(untagged(launcher.stdout.readline())) for _ in range(2)]
    launcher.kill()
    launcher.wait(10)

    def gone(pid: int) -> bool:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        return state == "Z"
    wait_until(lambda: all(gone(p) for p in pids), 15, "the workers gone")


def test_addresses_that_cannot_work_are_refused_before_anything_starts():
    from ftcomm.errors import AddressError

    with pytest.raises(AddressError, match="not an address of this machine"):
        Launcher(LaunchConfig(command=["true"], host="203.0.113.9", port=7000), environ={"FTCOMM_SECRET": "s"},
                 out=io.StringIO())
    with pytest.raises(AddressError, match="loopback"):
        Launcher(LaunchConfig(command=["true"], peers=("10.1.2.3:7000",)), environ={"FTCOMM_SECRET": "s"},
                 out=io.StringIO())


def test_a_shared_memory_directory_that_is_not_private_does_not_stop_the_job(tmp_path):
    import shutil
    import uuid

    name = f"test-{uuid.uuid4().hex[:8]}"
    planted = f"/dev/shm/ftcomm-{name}"
    os.mkdir(planted)
    os.chmod(planted, 0o777)  # writable by others: refused as a checkpoint source
    try:
        code, log = launch(tmp_path, "sys.exit(0 if os.environ['FTCOMM_RESTARTS'] == '1' else 3)\n",
                           restart_backoff=0.0, save_at_breakpoint=True, checkpoint_name=name,
                           checkpoint_dir=str(tmp_path / "kept"))
    finally:
        shutil.rmtree(planted, ignore_errors=True)
    assert code == 0, log
    assert "saving at the breakpoint failed" in log and "restart 1 of 3" in log


def test_network_check_runs_in_the_founding_workers_and_the_launcher_prints_the_report(tmp_path):
    body = ("import ftcomm\n"
            "ft = ftcomm.init(min_workers=3, settle_interval=0.5, network_check_mb=1)\n"
            "assert ft.network_report is not None and len(ft.network_report.links) == 3\n"
            "ft.shutdown()\n")
    code, out = launch(tmp_path, body, nproc=3, network_check=True)
    assert code == 0, out
    assert re.search(r"network check of 3 members, 3 links in [\d.]+ s: median latency", out), out
    assert out.count("network check of") == 1  # printed once, though every worker wrote it
    off = Launcher(LaunchConfig(command=["true"], nproc=2), environ={}, out=io.StringIO())
    assert "FTCOMM_NETWORK_CHECK" not in off.worker_env(off.workers[0])


def test_the_process_group_of_a_worker_that_exited_is_not_signalled_again(tmp_path, monkeypatch):
    """Once a worker exited and what it left behind was killed, its pid is free: the kernel
    may give it to an unrelated process group, which the launcher must never signal (at
    its end it kills the groups of the workers still running, only)."""
    signalled: list[tuple[int, int]] = []
    real = os.killpg

    def killpg(pgid: int, sig: int) -> None:
        signalled.append((pgid, sig))
        real(pgid, sig)
    monkeypatch.setattr(os, "killpg", killpg)
    pid_file = tmp_path / "pids"
    body = (f"open({str(pid_file)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
            "if os.environ['LOCAL_RANK'] == '1': time.sleep(0.5)\n")
    code, log = launch(tmp_path, body, nproc=2)
    assert code == 0, log
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2
    for pid in pids:  # once, right after it was seen to exit
        assert [s for s in signalled if s[0] == pid] == [(pid, signal.SIGKILL)], signalled


def test_a_worker_whose_launcher_died_before_it_asked_for_the_parent_death_signal_does_not_run(tmp_path):
    """The parent-death signal is asked for in the child between fork and exec: a launcher
    killed just before that moment would leave the worker running for good."""
    in_child, worker = tmp_path / "in_child", tmp_path / "worker.py"
    worker.write_text("import time\ntime.sleep(60)\n")
    launcher_code = (
        "import os, sys, time\n"
        "from ftcomm.ops import cli, launcher\n"
        "real = launcher._PRCTL\n"
        "def slow(*args):  # in the child: the launcher is killed meanwhile\n"
        f"    open({str(in_child)!r}, 'w').write(str(os.getpid()))\n"
        "    time.sleep(1.0)\n"
        "    return real(*args)\n"
        "launcher._PRCTL = slow\n"
        f"sys.exit(cli.main(['run', {str(worker)!r}]))\n")
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], stderr=subprocess.DEVNULL)
    child = None
    try:
        wait_until(lambda: in_child.exists() and in_child.read_text(), 30, "the worker's process forked")
        child = int(in_child.read_text())
        launcher.kill()
        launcher.wait(10)

        def gone() -> bool:
            try:
                return open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                return True
        wait_until(gone, 10, "the orphaned worker gone")
    finally:
        launcher.kill()
        if child is not None:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_workers_failing_together_persist_the_node_s_checkpoint_one_at_a_time(tmp_path, monkeypatch):
    """Every worker of a node failing at once (an out-of-memory kill, a driver error) must
    not copy the same shared-memory checkpoint to the same directory several times at once
    (gigabytes each): the copies run one after the other, and the later ones find it done."""
    from ftcomm.training import checkpoint_files

    lock, copying, overlaps = threading.Lock(), [0], []
    another = threading.Event()

    def persist_newest(shm, directory, sync=True, key=None):
        with lock:
            copying[0] += 1
            if copying[0] > 1:
                overlaps.append(copying[0])
                another.set()
        another.wait(2.0)  # long enough for a concurrent copy to start, bounded
        with lock:
            copying[0] -= 1
        return None
    monkeypatch.setattr(checkpoint_files, "persist_newest", persist_newest)
    code, log = launch(tmp_path, "sys.exit(3)\n", nproc=3, max_restarts=0, save_at_breakpoint=True,
                       checkpoint_dir=str(tmp_path / "kept"))
    assert code == 1 and log.count("no restarts left") == 3
    assert overlaps == []


def test_worker_output_is_tagged_logged_per_start_filtered_and_the_first_failure_summarised(tmp_path):
    """Worker 0 fails once with a traceback and finishes after its restart; worker 1
    finishes. The console shows only worker 0 (--local-ranks-filter 0), each line tagged
    with the start it came from; --log-dir holds one file per start, worker 1's included;
    the summary names the first failure and its last lines."""
    body = ("restarts = int(os.environ['FTCOMM_RESTARTS'])\n"
            "print(f'hello from {os.environ[\"LOCAL_RANK\"]} start {restarts}', flush=True)\n"
            "if os.environ['LOCAL_RANK'] == '0' and restarts == 0:\n"
            "    raise RuntimeError('the first start of worker 0 breaks')\n"
            "time.sleep(0.5)\n")
    script = tmp_path / "worker.py"
    script.write_text("import os, sys, time\n" + body)
    out, stdout, stderr = io.StringIO(), io.StringIO(), io.StringIO()
    logs = tmp_path / "logs"
    config = LaunchConfig(command=[sys.executable, str(script)], nproc=2, restart_backoff=0.0, log_dir=str(logs),
                          local_ranks_filter=(0,))
    code = Launcher(config, environ={k: v for k, v in os.environ.items() if not k.startswith("FTCOMM_")},
                    out=out, stdout=stdout, stderr=stderr).run()
    log = out.getvalue()
    assert code == 0, log
    assert stdout.getvalue().splitlines() == ["[w0] hello from 0 start 0", "[w0.r1] hello from 0 start 1"]
    assert "[w0] RuntimeError: the first start of worker 0 breaks" in stderr.getvalue()
    assert "[w1]" not in stdout.getvalue() + stderr.getvalue()  # filtered from the console ...
    assert sorted(p.name for p in logs.iterdir()) == ["w0.log", "w0.r1.log", "w1.log"]  # ... not from the logs
    assert "hello from 1 start 0" in (logs / "w1.log").read_text()
    assert "RuntimeError" in (logs / "w0.log").read_text() and "RuntimeError" not in (logs / "w0.r1.log").read_text()
    assert oct((logs / "w0.log").stat().st_mode & 0o777) == "0o600"
    assert "summary: training completed (exit status 0); 2 workers, 1 restarts" in log
    assert re.search(r"first failure: worker 0 \(w0\) exited with status 1 after [\d.]+ s; log \S+w0.log", log), log
    assert "  | RuntimeError: the first start of worker 0 breaks" in log
    assert re.search(r"\n\[ftcomm run\]   0 +2  finished  status 0", log), log


def test_group_options_of_the_command_line_reach_every_worker_and_init_reads_them(monkeypatch):
    import ftcomm
    from ftcomm.errors import FtcommTimeout

    config = LaunchConfig(command=["true"], nproc=3, min_workers=2, max_workers=4, metrics_port=9400,
                          straggler_policy="exclude")
    launcher = Launcher(config, environ={}, out=io.StringIO())
    envs = [launcher.worker_env(w) for w in launcher.workers]
    assert [e["FTCOMM_METRICS_PORT"] for e in envs] == ["9400", "9401", "9402"]  # BASE + local rank
    assert {(e["FTCOMM_MIN_WORKERS"], e["FTCOMM_MAX_WORKERS"], e["FTCOMM_STRAGGLER_POLICY"]) for e in envs} == {
        ("2", "4", "exclude")}
    unset = Launcher(LaunchConfig(command=["true"]), environ={}, out=io.StringIO())
    assert not {"FTCOMM_MIN_WORKERS", "FTCOMM_METRICS_PORT"} & set(unset.worker_env(unset.workers[0]))
    for bad in ({"min_workers": 3, "max_workers": 2}, {"metrics_port": 65535, "nproc": 2},
                {"straggler_policy": "drop"}):
        with pytest.raises(ValueError):
            LaunchConfig(command=["true"], **bad)
    # ftcomm.init takes them from the environment unless the script passes its own.
    monkeypatch.setenv("FTCOMM_MIN_WORKERS", "2")
    monkeypatch.setenv("FTCOMM_STRAGGLER_POLICY", "exclude")
    with pytest.raises(FtcommTimeout):  # waits for a second worker that never comes
        ftcomm.init(bind="127.0.0.1:0", handle_signals=False, init_timeout=1.0)
    solo = ftcomm.init(bind="127.0.0.1:0", handle_signals=False, min_workers=1)
    try:
        assert solo.options.straggler_policy == "exclude" and solo.max_workers is None
    finally:
        solo.shutdown()
    monkeypatch.setenv("FTCOMM_MAX_WORKERS", "many")
    with pytest.raises(ValueError, match="FTCOMM_MAX_WORKERS"):
        ftcomm.init(bind="127.0.0.1:0", handle_signals=False, min_workers=1)


def test_the_status_rate_is_steady_between_publications_and_restarts_with_each_view():
    """Members publish their step every 2 s; the line is redrawn every second. The rate is
    taken between the moments new steps appeared, so a reading between two publications
    shows the true 17 steps/s, not 34 then 0; after a new view (a restore jumps the step)
    no rate is shown until two publications of it were seen."""
    from ftcomm.ops.launcher import _StatusLine

    status = _StatusLine(Launcher(LaunchConfig(command=["true"]), environ={}, out=io.StringIO()))
    rates = []
    for second in range(30):
        published = 34 * (second // 2)  # 17 steps/s, published every 2 s
        rates.append(status.rate(100.0 + second, published))
    shown = [r for r in rates if r is not None]
    assert len(shown) >= 20 and all(abs(r - 17.0) < 1e-9 for r in shown), rates
    status._seen.clear()
    status._baseline = None  # what a new view does
    assert status.rate(200.0, 681) is None and status.rate(201.0, 700) is None  # no 681 steps/s after a restore
    assert status.rate(203.0, 734) == 17.0


def test_the_launcher_says_each_view_change_it_sees_with_its_reason_and_who(monkeypatch):
    import types

    from ftcomm.gossip import runtime
    from ftcomm.ops.launcher import _StatusLine

    out = io.StringIO()
    launcher = Launcher(LaunchConfig(command=["true"]), environ={}, out=out)
    launcher.workers[0].status = "running"
    table: list = []
    monkeypatch.setattr(runtime, "query_members", lambda *args, **kwargs: list(table))

    def member(name: str, view: int, reason: str, state: str = "alive"):
        return types.SimpleNamespace(id=name, state=state, metadata={"cv": view, "vr": reason, "st": 10, "ph": "active"})

    status = _StatusLine(launcher)
    table[:] = [member("a", 3, "init"), member("b", 3, "init"), member("c", 3, "init")]
    status.read(1.0)
    table[:] = [member("a", 4, "crash"), member("b", 4, "crash"), member("c", 3, "init", "dead")]
    status.read(2.0)
    table[:] = [member("a", 5, "join"), member("b", 5, "join"), member("d\x1b[2J", 5, "join")]
    status.read(3.0)
    lines = [line for line in out.getvalue().splitlines() if "formed" in line]
    assert lines == ["[ftcomm run] view 4 formed (crash): without c",
                     "[ftcomm run] view 5 formed (join): with d\\x1b[2J"], lines


def test_progress_bars_and_endless_lines_are_relayed_without_waiting_for_a_newline(tmp_path):
    """A progress bar redraws itself with carriage returns and never ends its line: its
    updates reach the console (at most one a second) and the log (every one) while it
    runs; a line of 200 kB is cut, not held in memory until it ends."""
    import pathlib

    from ftcomm.ops.worker_output import Console, WorkerOutput

    stdout, stderr = io.StringIO(), io.StringIO()
    console = Console(io.StringIO(), stdout, stderr)
    read_end, write_end = os.pipe()
    err_read, err_write = os.pipe()
    output = WorkerOutput(console, 2, 1, os.fdopen(read_end, "rb"), os.fdopen(err_read, "rb"), True,
                          pathlib.Path(tmp_path))
    for i in range(5):
        os.write(write_end, f"\r{i * 20}%".encode())
        time.sleep(0.3)
    os.write(write_end, b"\rdone\r\nnext line\n" + b"x" * 200_000)
    os.close(write_end)
    os.close(err_write)
    output.finish(5.0)
    shown = stdout.getvalue().splitlines()
    assert shown[0] == "[w2.r1] 0%" and "[w2.r1] done" in shown and "[w2.r1] next line" in shown, shown[:8]
    assert 2 <= sum(line.endswith("%") for line in shown) <= 3  # 5 redraws in 1.5 s: one a second on the console
    logged = (tmp_path / "w2.r1.log").read_text().splitlines()
    assert [line for line in logged if line.endswith("%")] == ["0%", "20%", "40%", "60%", "80%"]
    assert max(len(line) for line in logged) <= 70_000 and sum(len(line) for line in logged) >= 200_000


def test_a_log_directory_others_can_write_or_plant_links_in_is_refused_and_a_lost_one_costs_only_the_log(tmp_path):
    from ftcomm.errors import FtcommError

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(FtcommError, match="others can write"):
        Launcher(LaunchConfig(command=["true"], log_dir=str(shared)), environ={}, out=io.StringIO())
    # Its own, but under a directory another user could rename and replace with theirs.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    if os.geteuid() == 0:  # (only root can give a directory away)
        os.chown(theirs, 65534, 65534)
    else:
        os.chmod(theirs, 0o777)
    (theirs / "logs").mkdir(mode=0o700)
    with pytest.raises(FtcommError, match=f"{theirs} above it belongs to another user or others can write"):
        Launcher(LaunchConfig(command=["true"], log_dir=str(theirs / "logs")), environ={}, out=io.StringIO())
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(FtcommError, match="cannot use --log-dir"):
        Launcher(LaunchConfig(command=["true"], log_dir=str(a_file)), environ={}, out=io.StringIO())
    # A name left in the directory is replaced, never followed.
    logs, victim = tmp_path / "logs", tmp_path / "victim.txt"
    logs.mkdir(mode=0o700)
    victim.write_text("untouched")
    (logs / "w0.log").symlink_to(victim)
    # The directory vanishes before the restart: worker 0 restarts without a log file, the
    # launcher goes on and the job completes.
    body = (f"logs = {str(logs)!r}\n"
            "if os.environ['FTCOMM_RESTARTS'] == '0':\n"
            "    import shutil; print('first start', flush=True); shutil.rmtree(logs); sys.exit(3)\n"
            "print('second start', flush=True)\n")
    code, log = launch(tmp_path, body, restart_backoff=0.0, log_dir=str(logs))
    assert victim.read_text() == "untouched"
    assert code == 0 and "worker 0: no log file in" in log and "training completed" in log, log


def test_an_exit_once_the_job_is_ending_is_no_failure_and_exclude_with_replicas_is_refused(tmp_path):
    body = ("if os.environ['LOCAL_RANK'] == '0': sys.exit(0)\n"
            "time.sleep(0.5); raise SystemExit('the group ended')\n")
    code, log = launch(tmp_path, body, nproc=2)
    assert code == 0 and "lost worker 1" in log and "first failure" not in log, log
    with pytest.raises(ValueError, match="trains only whole"):
        LaunchConfig(command=["true"], nproc=2, replica_size=2, straggler_policy="exclude")


# ---------------------------------------------------------------------- warm standbys
STANDBY_SCRIPT = """\
import json
if os.environ["FTCOMM_RESTARTS"] == "0":
    while not os.path.exists(os.environ["READY_FLAG"]):  # until the launcher has a standby ready
        time.sleep(0.05)
    sys.exit(3)
print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0], "rank": os.environ["LOCAL_RANK"],
                  "file": __file__, "main_file": sys.modules["__main__"].__file__,
                  "restarts": os.environ["FTCOMM_RESTARTS"], "secret": os.environ.get("FTCOMM_SECRET"),
                  "fd": os.environ.get("FTCOMM_STANDBY_FD"), "torch": "torch" in sys.modules}))
"""


class _FlagOnReady(io.StringIO):
    """The launcher's output; touches ``flag`` when it reports a standby ready, and keeps
    the standbys' pids."""

    def __init__(self, flag) -> None:
        super().__init__()
        self.flag, self.pids = flag, []

    def write(self, text: str) -> int:
        if "standby ready: pid " in text:
            pid = int(text.split("standby ready: pid ")[1].split(",")[0])
            self.pids.append((pid, open(f"/proc/{pid}/environ", "rb").read()))
            self.flag.touch()
        return super().write(text)


def _run_with_standby(tmp_path, monkeypatch, command, **options):
    from ftcomm.ops import launcher as launcher_module

    monkeypatch.setattr(launcher_module, "STANDBY_WAIT_S", 0.2)  # these workers never answer gossip
    monkeypatch.setattr(launcher_module, "STANDBY_RESPAWN_S", 0.2)
    flag = tmp_path / "ready"
    out, stdout = _FlagOnReady(flag), io.StringIO()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FTCOMM_")}
    environ["READY_FLAG"] = str(flag)
    launcher = Launcher(LaunchConfig(command=command, restart_backoff=0.0, **options), environ=environ, out=out,
                        stdout=stdout)
    code = launcher.run()
    return code, out, stdout.getvalue(), launcher


def test_a_standby_takes_a_failed_workers_place_and_runs_the_script_as_python_would(tmp_path, monkeypatch):
    script = tmp_path / "worker.py"
    script.write_text("import os, sys, time\n" + STANDBY_SCRIPT)
    monkeypatch.chdir(tmp_path)  # a relative script path: __file__ is absolute all the same, as with python
    code, out, printed, launcher = _run_with_standby(tmp_path, monkeypatch, [sys.executable, "-u", "worker.py",
                                                                            "a", "--b"], standby=1)
    log = out.getvalue()
    assert code == 0, log
    assert "restart 1 (a warm standby)" in log and "exited with status 3" in log
    seen = json.loads(untagged(printed.strip().splitlines()[-1]))
    assert seen["argv"] == ["worker.py", "a", "--b"] and seen["name"] == "__main__"
    assert seen["file"] == seen["main_file"] == str(script)
    assert seen["path0"] == str(tmp_path) and seen["rank"] == "0" and seen["restarts"] == "1"
    assert seen["fd"] is None and seen["torch"]  # the standby's own variables are gone; torch was loaded
    assert seen["secret"] == launcher.secret  # the worker's environment arrived through the pipe ...
    taken, environ = out.pids[0]
    assert b"FTCOMM_SECRET" not in environ  # ... and was never in the standby's own
    # no standby outlives the launcher (the one started after the takeover included)
    for pid, _ in out.pids:
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    assert launcher.standbys == []


def test_a_standby_runs_a_module_as_python_m_would(tmp_path, monkeypatch):
    (tmp_path / "trainmod.py").write_text("import os, sys, time\n" + STANDBY_SCRIPT)
    monkeypatch.chdir(tmp_path)
    code, out, printed, _ = _run_with_standby(tmp_path, monkeypatch, [sys.executable, "-m", "trainmod", "x"],
                                              standby=1)
    assert code == 0, out.getvalue()
    seen = json.loads(untagged(printed.strip().splitlines()[-1]))
    assert seen["argv"] == [str(tmp_path / "trainmod.py"), "x"] and seen["name"] == "__main__"
    assert "(a warm standby)" in out.getvalue()


def test_standbys_that_fail_to_prepare_are_given_up_and_restarts_start_new_processes(tmp_path, monkeypatch):
    script = tmp_path / "worker.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['FTCOMM_RESTARTS'] == '0':\n"
                      "    time.sleep(60); sys.exit(3)\n")
    from ftcomm.ops import launcher as launcher_module

    failures = []
    original = launcher_module.Launcher._standby_gone

    def gone(self, dead):
        original(self, dead)
        failures.append(dead.process.pid)
        if len(failures) == launcher_module.STANDBY_FAILURES:
            os.kill(self.workers[0].process.pid, signal.SIGKILL)  # now a restart is due

    monkeypatch.setattr(launcher_module.Launcher, "_standby_gone", gone)
    code, out, _, _ = _run_with_standby(tmp_path, monkeypatch, [sys.executable, str(script)], standby=1,
                                        standby_imports=("no_such_module_for_a_standby",))
    log = out.getvalue()
    assert code == 0, log
    assert log.count("a standby exited with status 1 before it was needed") == 3, log
    assert "No module named 'no_such_module_for_a_standby'" in log
    assert "no more standbys (3 failed in a row)" in log
    assert "restart 1\n" in log and "(a warm standby)" not in log  # a new process instead


@pytest.mark.parametrize("command, message", [
    (["bash", "train.sh"], "not a Python interpreter"),
    ([sys.executable, "-X", "dev", "train.py"], "-X cannot be applied"),
    ([sys.executable, "-m"], "-m names no module"),
    ([sys.executable, "-u"], "names no script"),
])
def test_standby_needs_a_python_command_it_can_take_over(command, message):
    with pytest.raises(ValueError, match=message):
        LaunchConfig(command=command, standby=1)
    LaunchConfig(command=command)  # without standbys any command runs


def test_the_first_restart_is_immediate_and_later_ones_back_off():
    launcher = Launcher(LaunchConfig(command=["true"], max_restarts=10, restart_backoff=1.0), environ={},
                        out=io.StringIO())
    worker = launcher.workers[0]
    delays = []
    for restarts in range(4):
        worker.restarts, worker.status, worker.process = restarts, "running", subprocess.Popen(["true"])
        worker.process.wait()
        now = time.monotonic()
        launcher._exited(worker, 1, now)
        delays.append(round(worker.restart_at - now, 3))
    assert delays == [0.0, 1.0, 2.0, 4.0]


def test_the_ports_the_launcher_hands_its_workers_lie_below_the_ephemeral_range_and_are_free():
    """A port the kernel would hand out itself can become the local end of an outgoing
    connection (a Gloo pair) before the worker binds it; seen once as a worker that could
    not bind its gossip port and a replica that missed the rest of its job."""
    import socket

    from ftcomm.ops.launcher import _below_ephemeral, free_ports

    low, high = _below_ephemeral()
    ports = free_ports("127.0.0.1", 8)
    assert len(set(ports)) == 8 and all(low <= p < high for p in ports), (ports, low, high)
    for port in ports:
        with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            tcp.bind(("127.0.0.1", port))
            udp.bind(("127.0.0.1", port))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        for _ in range(20):
            assert ports[0] not in free_ports("127.0.0.1", 8)
