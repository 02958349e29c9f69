"""``ftcomm run``: start one node's workers, restart those that crash, stop them gracefully.

Each worker is the user's command with ftcomm's environment:

- ``FTCOMM_BIND``: its own gossip address, ``HOST:PORT``, kept across its restarts;
- ``FTCOMM_PEERS``: the node's other workers and ``--peers`` (workers on other nodes);
- ``FTCOMM_SECRET``: the launcher's own, or, for a run confined to loopback without one,
  a fresh random secret (nothing else on the machine can then join or disturb the group),
  marked by ``FTCOMM_SECRET_DRAWN=1`` (checkpoints are then not signed with it: the next
  run draws another);
- ``FTCOMM_LAUNCHER``: this launcher's pid and start time; the job's shared-memory
  checkpoints record it, and are not reclaimed by other jobs while it runs. When training
  completes, the launcher removes them once their newest is persisted (the workers'
  directory, or ``--checkpoint-dir``);
- ``LOCAL_RANK`` / ``FTCOMM_LOCAL_RANK`` (0..N-1, for device selection) and
  ``FTCOMM_RESTARTS`` (how often this worker was restarted);
- ``FTCOMM_GROUP_RAN=1`` for a worker started again once the launcher saw the job's group
  run (a view in its local workers' member table, read each second until then): such a
  worker founds no new group while one of its peers answers nothing (``ftcomm.init``'s
  ``group_ran``). Inside a Kubernetes pod the launcher also leaves a mark in the pod's
  ``/dev/shm`` once it saw the group run (:func:`pod_mark`): a launcher whose container
  restarted in place finds it and tells its first workers too;
- ``OMP_NUM_THREADS=1`` with several workers per node, unless set (as torchrun does:
  several processes each running one OpenMP thread per core slow each other down).

A worker that exits with status 0 has finished; once one has, the job is ending: no
worker is restarted any more (it would start the training over), and the others have
``stop_timeout`` seconds to finish too before they are stopped like on SIGTERM. Any
other exit (a crash, a kill, an exception) restarts the worker *process*, after
at once the first time, then after ``restart_backoff`` seconds doubled on each further
restart of the same worker (at most 60 s), up to ``max_restarts`` times; the new process rejoins through gossip and receives the
state from its peers, the others do not stop. A worker whose process stays stopped (SIGSTOP) for
``kill_stopped_after`` seconds is killed and restarted the same way: stopped, it answers
nothing, yet its ports accept connections, and the others could not tell it from a
partition; killed, its ports refuse and they go on without it. SIGTERM, SIGINT, SIGHUP or SIGQUIT to
the launcher is forwarded to every worker as SIGTERM (a graceful leave); whatever still
runs after ``stop_timeout`` seconds, or at a second signal, is killed with what it
started. A worker's leftover processes are killed when it exits (its pid is not signalled
again afterwards: it may belong to another process by then), and a worker receives
SIGTERM from the kernel if the launcher dies (Linux's parent-death signal; a worker whose
launcher died while it was being started does not start).

With ``replica_size`` K > 1 each K consecutive local ranks are one sharded replica
(``FTCOMM_REPLICA_SIZE``, ``FTCOMM_SHARD_RANK`` = local rank mod K, and
``FTCOMM_REPLICA_ADDR``: a fresh port for torch's process group inside the replica at each
start of it). When one of its processes exits other than finished, the replica is
repaired in place (see :mod:`ftcomm.training.replica_repair`): a process (a warm standby when
one is ready) replaces the failed one at a fresh address, which the others are told through
their socket pair with the launcher (``FTCOMM_REPAIR_FD``); they keep running. A process
that reports a partner hung (``lost SHARD PID``) gets that partner killed, to be replaced.
A replica whose process fails again within ``REPAIR_SETTLE_S`` of a repair, one whose
other processes then exit (they cannot be repaired: NCCL, no other replica holding the
state), or with ``replica_restart``, is the unit of failure: the others are stopped
(SIGTERM, then SIGKILL after ``REPLICA_HALT_S``, or ``REPLICA_KILLED_HALT_S`` when it died
by a signal: a process blocked in a collective with the dead one may never reach its
signal handler), and the whole replica starts again once all have exited, counted as one
restart of each.

With ``standby`` N > 0 the launcher keeps N warm standby interpreters (see
:mod:`ftcomm.ops.standby`): torch and ftcomm imported, waiting. A worker to be restarted
takes a standby's process instead of a new one, which saves the interpreter's start; the
standby is replaced a few seconds later, in the background (not at once: on a small
machine importing torch beside the joining worker would slow it). Standbys start once
the group first answers, are stopped when the job ends, and are given up after
``STANDBY_FAILURES`` of them in a row exit before they were needed.

Each worker's output is relayed line by line, tagged ``[w3]`` (``[w3.r1]`` after its first
restart), written to a file per start under ``log_dir``, and the last lines of each start
are kept for the summary printed at exit (every worker, its starts and last exit, the first
failure with its last lines).

Exit status: 0 when training completed (a worker finished; workers lost on the way are
named in the summary), 128 + N when stopped by signal N, 1 when no worker finished.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import ipaddress
import json
import os
import pathlib
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from typing import TextIO

from ..errors import AddressError, FtcommError
from ..gossip.addresses import parse_seed
from ..localproc import process_start, stat_fields
from ..options import check_addresses, check_protection
from ..training.replica_repair import REPAIR_FD_ENV, LineReader, parse_lost, receive
from . import runfile
from .standby import FD_ENV as STANDBY_FD_ENV, IMPORTS_ENV as STANDBY_IMPORTS_ENV, order, python_command, \
    standby_command
from .worker_output import Console, WorkerOutput, private_log_directory, tag

MAX_BACKOFF_S = 60.0
REPLICA_HALT_S = 5.0
"""How long the other processes of a sharded replica that lost one have to leave the group
after SIGTERM before they are killed."""
REPLICA_KILLED_HALT_S = 0.5
"""The same when the process that failed died by a signal (killed, crashed): its partners
are blocked in a collective with it, most likely, where no signal handler runs."""
POLL_S = 0.05
REPAIR_SETTLE_S = 60.0
"""A process of a sharded replica that fails this soon after its replica was repaired (or a
partner that fails while the repair is under way) restarts the whole replica instead."""
STANDBY_RESPAWN_S = 3.0
"""After a standby took over (or another was started), the next is started this much later."""
STANDBY_WAIT_S = 30.0
"""Standbys start once the group first answers, or this long after the launch at the latest."""
STANDBY_FAILURES = 3
"""Standbys that exit before they were needed, in a row, after which no more are started."""
STARTING_NOTICE_S = 5.0  # until the group first answers, the launcher says every this often that it starts
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
PR_SET_PDEATHSIG = 1


@dataclasses.dataclass
class LaunchConfig:
    """What ``ftcomm run`` was asked to do; see the module docstring."""

    command: list[str]
    nproc: int = 1
    host: str = "127.0.0.1"
    port: int = 0  # the first worker's gossip port (the others count up); 0: free ports
    peers: tuple[str, ...] = ()
    max_restarts: int = 3
    restart_backoff: float = 1.0
    stop_timeout: float = 30.0
    status_interval: float = 10.0  # seconds between status lines (on a terminal: the line is redrawn each second)
    cluster: str = "ftcomm"
    save_at_breakpoint: bool = False
    checkpoint_name: str | None = None  # FlashCheckpointer's name (default: the cluster name)
    checkpoint_dir: str | None = None
    network_check: bool = False  # the workers measure their links when they found the group; shown here
    replica_size: int = 1  # K > 1: each K consecutive local ranks are one sharded replica
    replica_restart: bool = False  # a failed process of a replica restarts the whole replica (no repair in place)
    log_dir: str | None = None  # one log file per worker start: w3.log, w3.r1.log, ...
    min_workers: int | None = None  # the group's, for every worker ($FTCOMM_MIN_WORKERS); None: the script's
    max_workers: int | None = None  # ($FTCOMM_MAX_WORKERS)
    metrics_port: int | None = None  # worker i serves Prometheus metrics on this port + i ($FTCOMM_METRICS_PORT)
    straggler_policy: str | None = None  # warn or exclude ($FTCOMM_STRAGGLER_POLICY)
    fingerprint_every: int | None = None  # ($FTCOMM_FINGERPRINT_EVERY)
    sdc_policy: str | None = None  # exclude, warn or stop ($FTCOMM_SDC_POLICY)
    local_ranks_filter: tuple[int, ...] | None = None  # only these workers' output on the console
    standby: int = 0  # warm standby interpreters kept ready to replace a worker
    standby_imports: tuple[str, ...] = ()  # modules a standby imports beyond torch and ftcomm
    kill_stopped_after: float | None = 0.25  # a worker stopped (SIGSTOP) this long is killed; None: left stopped
    fresh: bool = False  # remove this host's flash checkpoints of the job before starting (a fresh start)

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no command to run: give the training script (and its arguments) after the options")
        if self.nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {self.nproc}")
        if self.max_restarts < 0 or not 0 <= self.restart_backoff < float("inf"):
            raise ValueError("max_restarts and restart_backoff must be >= 0")
        if not 0 < self.stop_timeout < float("inf") or not 0 < self.status_interval < float("inf"):
            raise ValueError("stop_timeout and status_interval must be positive")
        if self.replica_size < 1 or self.nproc % self.replica_size:
            raise ValueError(f"--replica-size {self.replica_size} must divide --nproc-per-node {self.nproc}: each "
                             f"replica is that many consecutive local ranks")
        if not 0 <= self.port <= 65535 - self.nproc + 1:
            raise ValueError(f"port {self.port}: the ports {self.port}..{self.port + self.nproc - 1} must be valid")
        ipaddress.IPv4Address(self.host)  # ValueError names a bad address
        for peer in self.peers:
            parse_seed(peer)
        if self.checkpoint_dir is not None and not str(self.checkpoint_dir).strip():
            raise ValueError("--checkpoint-dir is empty: give a directory")
        if self.save_at_breakpoint and not self.checkpoint_dir:
            raise ValueError("--save-at-breakpoint needs --checkpoint-dir: where to persist the newest checkpoint")
        if self.min_workers is not None and self.min_workers < 1 or \
                self.max_workers is not None and self.max_workers < (self.min_workers or 1):
            raise ValueError(f"--min-workers {self.min_workers} and --max-workers {self.max_workers}: need "
                             f"1 <= min <= max")
        if self.min_workers is not None and not self.peers and not self.port and \
                self.min_workers * self.replica_size > self.nproc:
            unit = "replicas" if self.replica_size > 1 else "workers"
            raise ValueError(f"--min-workers {self.min_workers} cannot be met: this node runs "
                             f"{self.nproc // self.replica_size} {unit}, --peers names no other node, and no "
                             f"other node can name this one (no --port): give --peers or --port, or a "
                             f"--min-workers of at most {self.nproc // self.replica_size}")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535 - self.nproc + 1:
            raise ValueError(f"--metrics-port {self.metrics_port}: the ports {self.metrics_port}.."
                             f"{self.metrics_port + self.nproc - 1} must be valid")
        if self.sdc_policy not in (None, "exclude", "warn", "stop"):
            raise ValueError(f"--sdc-policy must be exclude, warn or stop, got {self.sdc_policy!r}")
        if self.fingerprint_every is not None and (isinstance(self.fingerprint_every, bool)
                                                   or not isinstance(self.fingerprint_every, int)
                                                   or self.fingerprint_every < 0):
            raise ValueError(f"--fingerprint-every must be an int >= 0, got {self.fingerprint_every!r}")
        if self.straggler_policy not in (None, "warn", "exclude"):
            raise ValueError(f"--straggler-policy must be warn or exclude, got {self.straggler_policy!r}")
        if self.straggler_policy == "exclude" and self.replica_size > 1:
            raise ValueError("--straggler-policy exclude stands one process aside, and a sharded replica "
                             "(--replica-size > 1) trains only whole: use warn")
        if self.standby < 0:
            raise ValueError(f"--standby must be >= 0, got {self.standby}")
        if self.kill_stopped_after is not None and not 0 <= self.kill_stopped_after < float("inf"):
            raise ValueError(f"--kill-stopped-after must be >= 0 seconds, got {self.kill_stopped_after}")
        if self.standby:
            why = python_command(self.command)
            if why is not None:
                raise ValueError(f"--standby: {why}")
        for name in self.standby_imports:
            if not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"--standby-import {name!r} is not a module name")
        if self.local_ranks_filter is not None and not set(self.local_ranks_filter) <= set(range(self.nproc)):
            raise ValueError(f"--local-ranks-filter {','.join(map(str, self.local_ranks_filter))}: local ranks "
                             f"are 0..{self.nproc - 1}")


@dataclasses.dataclass
class Worker:
    """One local worker slot: a process, restarted in place."""

    local_rank: int
    port: int
    process: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None  # a restart is due then
    saving: threading.Thread | None = None  # persisting a checkpoint at its breakpoint: the restart waits
    status: str = "starting"  # running, halting (its replica lost a process), waiting (for a restart), finished, failed, stopped
    halt_by: float = 0.0  # halting: killed if still running then
    halt_grace: float = 0.0  # halting: how long it was given to leave
    stopped_since: float | None = None  # when the launcher first saw its process stopped (SIGSTOP)
    replica_addr: str = ""  # a sharded replica's processes: where they meet (torch's store), per start
    channel: socket.socket | None = None  # the launcher's end of its socket pair with the process (repairs)
    reader: LineReader | None = None  # the lines the process sent on it
    repairs: int = 0  # starts that repaired its replica in place (counted among the restarts too)
    repaired_at: float | None = None  # when the last of them began
    repair_due: bool = False  # waiting to be started alone, to repair its replica
    repairable: bool = False  # its process said its replica can be repaired in place (its current start)
    unknown_lines: int = 0  # lines on its repair channel that were none of the protocol's (its current start)
    output: WorkerOutput | None = None  # the current start's output streams
    starts: list[dict] = dataclasses.field(default_factory=list)  # each start's end: exit, seconds, last lines


@dataclasses.dataclass
class Standby:
    """A warm interpreter waiting for a worker's orders on ``orders`` (a pipe's write end)."""

    process: subprocess.Popen
    orders: int
    ready: int  # a pipe's read end: one byte arrives once the standby is prepared
    started_at: float
    prepared: bool = False
    channel: socket.socket | None = None  # the launcher's end of the socket pair it will hand its worker
    channel_fd: int = -1  # the standby's end, by its descriptor's number in the standby


def free_ports(host: str, count: int) -> list[int]:
    """Ports free for both TCP and UDP on ``host`` (gossip uses both on one port), drawn below
    the kernel's ephemeral range where there is room: a port the kernel hands out itself may
    be taken, before the worker binds it, as the local end of some outgoing connection (a
    Gloo pair connecting), which no bind can wait out."""
    ports: list[int] = []
    low, high = _below_ephemeral()
    candidates = secrets.SystemRandom().sample(range(low, high), min(high - low, 64 * count)) if high > low else []
    for port in candidates:
        if len(ports) == count:
            return ports
        if port not in ports and _bindable(host, port):
            ports.append(port)
    held: list[socket.socket] = []
    try:
        while len(ports) < count:
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(tcp)
            try:
                tcp.bind((host, 0))
            except OSError as exc:
                raise AddressError(f"cannot bind {host}: {exc.strerror or exc}") from None
            port = tcp.getsockname()[1]
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            held.append(udp)
            try:
                udp.bind((host, port))
            except OSError:
                continue
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


def _below_ephemeral() -> tuple[int, int]:
    """Ports to draw from: up to 20000 below the start of the ephemeral range (Linux's
    ``ip_local_port_range``; 32768 where it cannot be read), not below 10000."""
    try:
        start = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = 32768
    return max(10000, start - 20000), start


def _bindable(host: str, port: int) -> bool:
    """``port`` can be bound on ``host`` for TCP (listening) and UDP alike, right now."""
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        tcp.bind((host, port))
        udp.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        tcp.close()
        udp.close()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


POD_MARK_ROOT = "/dev/shm"


def pod_mark(cluster: str, environ: dict, root: str = POD_MARK_ROOT) -> pathlib.Path | None:
    """Inside a Kubernetes pod (``$KUBERNETES_SERVICE_HOST`` set), where this launcher
    marks that the job's group ran: ``/dev/shm`` lives as long as the pod, across restarts
    of its containers, and is the pod's own; the pod's host name is in the name as well.
    None outside a pod: on a host, /dev/shm outlives the job, and a mark left by a
    finished job would hold a new one of the same name back from founding its group."""
    name = f"ftcomm-{cluster}.ran-{socket.gethostname()}"
    if not environ.get("KUBERNETES_SERVICE_HOST") or "/" in name or "\0" in name:
        return None  # (a name that is no single file name marks nothing)
    return pathlib.Path(root, name)


def read_pod_mark(mark: pathlib.Path | None) -> bool:
    """Whether ``mark`` is there as this user's own regular file (not a link, not another
    user's: a planted file holds nobody back)."""
    if mark is None:
        return False
    try:
        st = os.lstat(mark)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def write_pod_mark(mark: pathlib.Path | None) -> str | None:
    """Leave ``mark`` (an empty file, this user's only); an existing one stays as it is.
    Why it could not be written, if it could not."""
    if mark is None:
        return None
    try:
        os.close(os.open(mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        if not read_pod_mark(mark):
            return "something that is not this user's own file is in the way"
    except OSError as exc:
        return str(exc)
    return None


def remove_pod_mark(mark: pathlib.Path | None) -> None:
    """The job completed, or starts fresh: remove ``mark`` (unlink follows no link)."""
    if read_pod_mark(mark):
        try:
            os.unlink(mark)
        except OSError:
            pass


class Launcher:
    """Runs :class:`LaunchConfig`; :meth:`run` returns the exit status."""

    def __init__(self, config: LaunchConfig, environ: dict[str, str] | None = None,
                 out: TextIO | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        """``out``: the launcher's own lines (default stderr); ``stdout``/``stderr``: where the
        workers' streams are relayed, each line tagged with its worker (default the
        launcher's own streams)."""
        self.config = config
        self.environ = dict(os.environ if environ is None else environ)
        self.out = out if out is not None else sys.stderr
        self._tty = hasattr(self.out, "isatty") and self.out.isatty()
        self.console = Console(self.out, stdout if stdout is not None else sys.stdout,
                               stderr if stderr is not None else sys.stderr, self._tty)
        self.log_dir = None if config.log_dir is None else private_log_directory(pathlib.Path(config.log_dir))
        check_addresses(config.host, list(config.peers))  # AddressError: the workers could not start either
        port = config.port
        dns_ports = [parse_seed(p)[1] for p in config.peers if parse_seed(p)[2]]
        if not port and dns_ports:  # a worker can start the group only if the name lists its own address
            port = dns_ports[0]
            if port + config.nproc - 1 > 65535:
                raise ValueError(f"the dns:// peer's port {port} leaves no room for {config.nproc} workers' ports "
                                 f"({port}..{port + config.nproc - 1}): give --port")
        ports = list(range(port, port + config.nproc)) if port else free_ports(config.host, config.nproc)
        self.workers = [Worker(i, p) for i, p in enumerate(ports)]
        self.secret = self.environ.get("FTCOMM_SECRET")
        if self.secret == "":
            raise ValueError("$FTCOMM_SECRET is set but empty: set the group's secret, or unset it")
        loopback = ipaddress.ip_address(config.host).is_loopback
        self.secret_drawn = self.secret is None and loopback and not config.peers
        if self.secret_drawn:
            self.secret = secrets.token_hex(32)  # a run confined to this machine: its own secret
        elif self.secret is None and not loopback and \
                self.environ.get("FTCOMM_INSECURE", "").strip().lower() not in ("1", "true", "yes"):
            check_protection(config.host, None, False)  # SecretRequired, saying how to set one or opt out
        self._mark = f"{os.getpid()}:{process_start(os.getpid())}"
        self._stop_signal: int | None = None
        self._signals = 0  # stop signals received: a second one kills at once
        self._stop_deadline: float | None = None
        self._ending_at: float | None = None  # when a worker finished: no more restarts
        self._status = _StatusLine(self)
        self.console.clear_status = self._status.clear
        self._saving = threading.Lock()  # one breakpoint save at a time: the workers share the checkpoint
        self._report_dir: str | None = None  # where the workers write the network check's report
        self.standbys: list[Standby] = []
        # sharded replicas are repaired in place: each process gets a socket pair with this launcher
        self._repairs = config.replica_size > 1 and not config.replica_restart
        self._formations = 0  # replica formations announced to repairing processes (see _tell_replica)
        self._standby_after = time.monotonic() + STANDBY_WAIT_S  # the next standby starts then at the earliest
        self._standby_failures = 0  # standbys in a row that exited before they were needed
        self._group_answered = False
        self._exit_doors: dict[subprocess.Popen, int] = {}  # a running worker's process -> its pidfd (see _nap)
        self._answer_checked = 0.0
        self._pod_mark = pod_mark(config.cluster, self.environ)
        # This pod's launcher saw the group run before its container restarted in place.
        self._restarted_in_place = read_pod_mark(self._pod_mark) and not config.fresh
        if config.fresh:
            remove_pod_mark(self._pod_mark)
        # a local worker's member table showed a view of the job's group (_watch_group)
        self._group_ran = self._restarted_in_place
        self._group_checked = 0.0
        if config.network_check:
            import tempfile

            self._report_dir = tempfile.mkdtemp(prefix="ftcomm-run-")  # private (0700)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        run_file = None
        try:
            try:
                run_file = runfile.write(os.getpid(), self.config.cluster,
                                         [f"{self.config.host}:{w.port}" for w in self.workers], self.secret,
                                         list(self.config.command))
                others = [r for r in runfile.running() if r.pid != os.getpid()]
                self.say(f"watch it with: ftcomm members --watch{f' --run {os.getpid()}' if others else ''}")
            except (OSError, FtcommError) as exc:  # the job runs without: only the watch command is lost
                self.say(f"no run file ({exc}): watch it with ftcomm members --peer "
                         f"{self.config.host}:{self.workers[0].port} and the group's secret")
            self._announce_checkpoints()
            if self._restarted_in_place:
                self.say(f"this pod's launcher saw the group of cluster {self.config.cluster!r} run before its "
                         f"container restarted ({self._pod_mark}): its workers are told so and found no new group "
                         f"while a peer answers nothing (--fresh forgets it)")
            for worker in self.workers:
                self._start(worker)
            while any(w.status in ("running", "halting", "waiting", "starting") for w in self.workers):
                self._step(time.monotonic())
                self._nap(POLL_S)
        finally:
            for fd in self._exit_doors.values():
                os.close(fd)
            self._exit_doors.clear()
            self._release_standbys()
            for worker in self.workers:  # no worker outlives the launcher (its handlers still hold)
                # A worker that exited had its group killed then (see _exited); its pid may
                # since belong to an unrelated process group, which must not be signalled.
                if worker.process is not None and worker.process.poll() is None:
                    _kill_group(worker.process, signal.SIGKILL)  # what a worker started, too
                    worker.process.wait()
                    worker.status = "stopped"
                if worker.output is not None:
                    self._ended(worker, worker.process.returncode, time.monotonic())
                if worker.saving is not None:
                    worker.saving.join()
                self._close_channel(worker)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._status.finish()
            runfile.remove(run_file)
            self._summary()
            if self._report_dir is not None:
                shutil.rmtree(self._report_dir, ignore_errors=True)
            if self._exit_status() == 0:
                self._discard_flash_copies()
                remove_pod_mark(self._pod_mark)
        return self._exit_status()

    def _nap(self, seconds: float) -> None:
        """Wait ``seconds``, or less: until a running worker exits (each worker's pidfd
        becomes readable then) or sends on its repair channel, so that a replacement starts
        without a polling delay."""
        running = {w.process for w in self.workers
                   if w.status in ("running", "halting") and w.process.returncode is None}  # reaped by _step
        for process in [p for p in self._exit_doors if p not in running]:
            os.close(self._exit_doors.pop(process))
        for process in running - self._exit_doors.keys():
            try:  # an unreaped child: its pid cannot have been reused
                self._exit_doors[process] = os.pidfd_open(process.pid)
            except (AttributeError, OSError):  # no pidfd on this system: polling only
                break
        channels = [w.channel for w in self.workers if w.channel is not None and w.status == "running"]
        if not self._exit_doors and not channels:
            time.sleep(seconds)
            return
        doors = select.poll()
        for fd in list(self._exit_doors.values()) + [c.fileno() for c in channels]:
            doors.register(fd, select.POLLIN)  # (a repair channel: a hung partner reported)
        doors.poll(seconds * 1000)

    def _step(self, now: float) -> None:
        if self._ending_at is not None and now > self._ending_at + self.config.stop_timeout \
                and self._stop_deadline is None:
            self._stop_deadline = now + self.config.stop_timeout
            self.say(f"workers still run {self.config.stop_timeout:g} s after one finished: stopping them "
                     f"(graceful leave, up to {self.config.stop_timeout:g} s)")
            self._stop_all()
        if self._signals >= 2:  # asked twice: do not wait any longer
            self._stop_deadline = min(self._stop_deadline or now, now)
        if self._stop_signal is not None and self._stop_deadline is None:
            self._stop_deadline = now + self.config.stop_timeout
            self.say(f"{signal.Signals(self._stop_signal).name}: stopping every worker (graceful leave, "
                     f"up to {self.config.stop_timeout:g} s)")
            self._stop_all()
        if self._stop_deadline is not None and now >= self._stop_deadline:
            for worker in self.workers:
                if worker.process is not None and worker.process.poll() is None:
                    self.say(f"worker {worker.local_rank} (pid {worker.process.pid}) still runs: killed")
                    _kill_group(worker.process, signal.SIGKILL)
        self._read_channels()
        for worker in self.workers:
            if worker.status == "running" and worker.process.poll() is not None:
                self._exited(worker, worker.process.returncode, now)
            elif worker.status == "running" and self.config.kill_stopped_after is not None:
                self._watch_stopped(worker, now)
            elif worker.status == "halting":
                self._halting(worker, now)
        for worker in self.workers:  # after the exits: a first restart starts in the same step
            if worker.status == "waiting" and self._ending_at is not None:
                worker.status = "failed"
                self.say(f"worker {worker.local_rank} is not restarted: the job is ending")
            elif worker.status == "waiting" and worker.repair_due and now >= worker.restart_at and \
                    (worker.saving is None or not worker.saving.is_alive()):
                self._start(worker)  # it repairs its replica, whose other processes run
                if worker.status == "running":
                    self._tell_replica(worker)
            elif worker.status == "waiting" and worker.restart_at is not None and now >= worker.restart_at and \
                    (worker.saving is None or not worker.saving.is_alive()) and \
                    not any(w.status in ("running", "halting") for w in self.replica(worker)):
                for w in self.replica(worker):  # a sharded replica starts as a whole, shard 0 first
                    if w.status == "waiting":
                        self._start(w)
        if self._report_dir is not None:
            self._show_network_report()
        self._watch_group(now)
        if self.config.standby:
            self._tend_standbys(now)
        self._status.update(now)

    def _show_network_report(self) -> None:
        """Print the network check's report once a worker wrote it (every member holds the same)."""
        path = pathlib.Path(self._report_dir, "network.json")
        if not path.exists():
            return
        from .netcheck import NetworkReport

        try:
            report = NetworkReport.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            self.say(f"the network check's report is unreadable: {exc}")
        else:
            for line in report.summary():
                self.say(line)
        shutil.rmtree(self._report_dir, ignore_errors=True)
        self._report_dir = None

    def _stop_all(self) -> None:
        for worker in self.workers:
            if worker.status == "waiting":
                worker.status = "stopped"
            elif worker.process is not None and worker.process.poll() is None:
                worker.process.send_signal(signal.SIGTERM)  # the worker's own handler leaves the group

    def _ended(self, worker: Worker, code: int, now: float) -> None:
        """Record the end of ``worker``'s current start, with its output's last lines."""
        if worker.output is not None:
            worker.output.finish(1.0)
        output = worker.output
        worker.starts.append({"restarts": worker.restarts, "exit": describe_exit(code), "code": code,
                              "seconds": now - worker.started_at, "at": now,
                              "ending": self._ending_at is not None or self._stop_deadline is not None,
                              "lines": output.last_lines() if output is not None else [],
                              "log": str(output.log_path) if output is not None and output.log_path else None})
        worker.output = None

    def _exited(self, worker: Worker, code: int, now: float) -> None:
        ran = now - worker.started_at
        _kill_group(worker.process, signal.SIGKILL)  # whatever it started and left behind
        self._ended(worker, code, now)
        if code == 0:
            worker.status = "finished"
            if self._ending_at is None:
                self._ending_at = now
            self.say(f"worker {worker.local_rank} finished after {ran:.1f} s")
            return
        if self._stop_deadline is not None:
            worker.status = "stopped"
            self.say(f"worker {worker.local_rank} stopped ({describe_exit(code)})")
            return
        if self.config.save_at_breakpoint:  # in the background; the restart waits for it
            worker.saving = threading.Thread(target=self._save_at_breakpoint, name="ftcomm-run-save")
            worker.saving.start()
        if self._ending_at is not None:
            worker.status = "failed"
            self.say(f"worker {worker.local_rank} exited with {describe_exit(code)} after {ran:.1f} s; "
                     f"not restarted: the job is ending")
            return
        if worker.restarts >= self.config.max_restarts:
            worker.status = "failed"
            self.say(f"worker {worker.local_rank} exited with {describe_exit(code)} after {ran:.1f} s; "
                     f"no restarts left (--max-restarts {self.config.max_restarts})")
            self._halt_replica(worker, now, code)
            return
        if self._repairs_in_place(worker, now):
            worker.status, worker.restart_at, worker.repaired_at, worker.repair_due = "waiting", now, now, True
            worker.repairs += 1
            self.say(f"worker {worker.local_rank} exited with {describe_exit(code)} after {ran:.1f} s; its replica "
                     f"is repaired in place: a new process takes its shard (restart {worker.restarts + 1} of "
                     f"{self.config.max_restarts}), the others keep running")
            return
        delay = 0.0 if worker.restarts == 0 else \
            min(MAX_BACKOFF_S, self.config.restart_backoff * 2 ** min(worker.restarts - 1, 16))
        worker.status, worker.restart_at = "waiting", now + delay
        self.say(f"worker {worker.local_rank} exited with {describe_exit(code)} after {ran:.1f} s; "
                 f"restart {worker.restarts + 1} of {self.config.max_restarts} in {delay:g} s"
                 + (", with the rest of its replica" if self.config.replica_size > 1 else ""))
        self._halt_replica(worker, now, code)

    def _repairs_in_place(self, worker: Worker, now: float) -> bool:
        """Whether ``worker``'s replica, which it failed, is repaired in place (a process
        replaces it while the others keep running) rather than started again as a whole:
        sharded replicas, not ``replica_restart``, every other process of the replica
        running and saying it can be repaired (Gloo, ftcomm's FSDP2 collectives: a
        ``repairable`` line), and none of them (nor ``worker``) started by a repair that has
        not settled (``REPAIR_SETTLE_S``)."""
        if self.config.replica_size == 1 or self.config.replica_restart:
            return False
        replica = self.replica(worker)
        if any(w.repaired_at is not None and now - w.repaired_at < REPAIR_SETTLE_S for w in replica):
            return False
        return all(w.status == "running" and w.channel is not None and w.repairable for w in replica
                   if w is not worker)

    def _read_channels(self) -> None:
        """Read what the running processes of sharded replicas sent (see
        ftcomm.training.replica_repair): a partner reported hung or gone, still running with
        the pid reported, is killed, to be replaced when its exit is seen."""
        killed: set[int] = set()  # (a report from a process killed in this poll is not acted on)
        for worker in self.workers:
            if worker.channel is None or worker.status != "running" or worker.local_rank in killed:
                continue
            data = receive(worker.channel)
            if data is None:
                continue
            if not data:  # its process closed it (exited, or it is not a replica's)
                self._close_channel(worker)
                continue
            for line in worker.reader.feed(data):
                if line == "repairable":
                    worker.repairable = True
                    continue
                lost = parse_lost(line)
                replica = self.replica(worker)
                if lost is None or not 0 <= lost[0] < len(replica):
                    worker.unknown_lines += 1
                    if worker.unknown_lines == 1:  # (once per start: a flood says nothing more)
                        self.say(f"worker {worker.local_rank} sent an unknown line on its repair channel: dropped")
                    continue
                partner = replica[lost[0]]
                if partner is worker or partner.status != "running" or partner.process.pid != lost[1] \
                        or partner.process.poll() is not None or worker.local_rank in killed:
                    continue  # (gone already, or replaced since)
                if (stat_fields(lost[1]) or ["?"])[0] == "t":
                    continue  # stopped by a debugger: left alone (as _watch_stopped leaves it)
                self.say(f"worker {partner.local_rank} (pid {lost[1]}) is hung, its replica's worker "
                         f"{worker.local_rank} found: killed, to be replaced")
                _kill_group(partner.process, signal.SIGKILL)
                killed.add(partner.local_rank)

    def _close_channel(self, worker: Worker) -> None:
        if worker.channel is not None:
            worker.channel.close()
        worker.channel, worker.reader = None, None

    def _tell_replica(self, worker: Worker) -> None:
        """``worker`` was started to repair its replica: the replica's other processes are
        told where to meet it (a formation number of their own, so a stale line is never
        taken for a newer one)."""
        self._formations += 1
        line = f"meet {self._formations} {worker.replica_addr}\n".encode("ascii")
        for other in self.replica(worker):
            if other is worker or other.channel is None or other.status != "running":
                continue
            try:
                other.channel.sendall(line)
            except OSError as exc:  # (it exited meanwhile: its exit is seen at the next poll)
                self.say(f"could not tell worker {other.local_rank} where its replica meets: {exc}")

    def _watch_stopped(self, worker: Worker, now: float) -> None:
        """Kill a worker whose process, or one it started (the script under a wrapper,
        a data loader), stays stopped (SIGSTOP, SIGTSTP) for ``kill_stopped_after`` seconds,
        seen so twice by this launcher: a stopped process answers nothing, yet its node's
        kernel still accepts connections to its ports, so the others cannot tell it from a
        partition and a group of two would wait for it. Killed, its ports refuse: the others
        count it as proven gone and go on, and it is restarted like any crashed worker. A
        process stopped by a debugger (tracing stop) is left alone. (Each worker runs in a
        session of its own: a Ctrl-Z at the terminal stops the launcher only.)"""
        if not _stopped(worker.process.pid):
            worker.stopped_since = None
            return
        if worker.stopped_since is None:
            worker.stopped_since = now
        elif now - worker.stopped_since >= self.config.kill_stopped_after:
            worker.stopped_since = None
            self.say(f"worker {worker.local_rank} (pid {worker.process.pid}, or a process it started) is stopped: "
                     f"killed (a stopped worker stalls the group; see --kill-stopped-after)")
            _kill_group(worker.process, signal.SIGKILL)

    # ------------------------------------------------------------------ sharded replicas
    def replica(self, worker: Worker) -> list[Worker]:
        """The local workers of ``worker``'s sharded replica (itself alone without one)."""
        k = self.config.replica_size
        first = worker.local_rank - worker.local_rank % k
        return self.workers[first:first + k]

    def _halt_replica(self, worker: Worker, now: float, code: int) -> None:
        """``worker`` failed with exit ``code``: the other processes of its replica are
        stopped, and the replica restarts as a whole once every one of them exited (or
        fails with it)."""
        grace = REPLICA_KILLED_HALT_S if code < 0 else REPLICA_HALT_S
        for other in self.replica(worker):
            other.repair_due = False  # (a repair not started yet: the replica starts again as a whole)
            if other is worker:
                continue
            if other.status == "running" and other.process.poll() is None:  # (one that exited: see _exited)
                other.status, other.halt_by, other.halt_grace = "halting", now + grace, grace
                other.process.send_signal(signal.SIGTERM)  # its handler leaves the group
            elif other.status == "waiting" and worker.status == "failed":
                other.status = "stopped"
        if worker.status == "waiting":
            self._sync_restart(worker)

    def _halting(self, worker: Worker, now: float) -> None:
        code = worker.process.poll()
        if code is None:
            if now >= worker.halt_by:
                self.say(f"worker {worker.local_rank} (pid {worker.process.pid}) did not leave within "
                         f"{worker.halt_grace:g} s of its replica losing a process: killed")
                _kill_group(worker.process, signal.SIGKILL)
                worker.halt_by = float("inf")  # reaped at a later poll
            return
        if code == 0:  # it finished before the stop reached it: the job is ending
            worker.status = "running"
            self._exited(worker, code, now)
            return
        _kill_group(worker.process, signal.SIGKILL)
        self._ended(worker, code, now)
        failed = any(w.status == "failed" for w in self.replica(worker))
        worker.status = "stopped" if failed or self._ending_at is not None or self._stop_deadline is not None \
            else "waiting"
        self.say(f"worker {worker.local_rank} left with its replica ({describe_exit(code)})")
        if worker.status == "waiting":
            self._sync_restart(worker)

    def _sync_restart(self, worker: Worker) -> None:
        """Once no process of the replica runs, all restart together, when the last of them
        is due."""
        replica = self.replica(worker)
        if any(w.status in ("running", "halting") for w in replica):
            return  # (_step starts none of them meanwhile)
        due = [w.restart_at for w in replica if w.restart_at is not None]
        at = max(due) if due else time.monotonic()
        for w in replica:
            if w.status == "waiting":
                w.restart_at = at

    def _start(self, worker: Worker) -> None:
        if worker.status == "waiting":
            worker.restarts += 1
        worker.restart_at, worker.stopped_since = None, None
        if self.config.replica_size > 1 and (worker.local_rank % self.config.replica_size == 0 or worker.repair_due):
            address = f"{self.config.host}:{free_ports(self.config.host, 1)[0]}"  # torch's store: fresh each start
            for w in self.replica(worker):
                w.replica_addr = address
        self._close_channel(worker)
        standby = self._take_standby()
        child = None  # the process's end of its repair channel, here
        try:
            if standby is not None:
                worker.process = standby.process
                worker.channel, channel_fd = standby.channel, standby.channel_fd
                env = self.worker_env(worker)
                if worker.channel is not None:
                    env[REPAIR_FD_ENV] = str(channel_fd)
                threading.Thread(target=_send_order, args=(standby.orders, order(self.config.command, env)),
                                 daemon=True, name="ftcomm-run-standby").start()
            else:
                env = self.worker_env(worker)
                if self._repairs:
                    worker.channel, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                    env[REPAIR_FD_ENV] = str(child.fileno())
                worker.process = subprocess.Popen(self.config.command, env=env,
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                  start_new_session=True, pass_fds=(child.fileno(),) if child else (),
                                                  preexec_fn=functools.partial(_leave_with_parent, os.getpid()))
        except OSError as exc:  # no such program, not executable: restarting cannot help
            self._close_channel(worker)
            worker.status = "failed"
            worker.starts.append({"restarts": worker.restarts, "exit": f"not started: {exc.strerror or exc}",
                                  "code": None, "seconds": 0.0, "lines": [], "log": None})
            self.say(f"worker {worker.local_rank} cannot start {self.config.command[0]!r}: {exc.strerror or exc}")
            return
        finally:
            if child is not None:
                child.close()
        worker.repair_due, worker.repairable, worker.unknown_lines = False, False, 0
        if worker.channel is not None:
            worker.channel.setblocking(False)
            worker.reader = LineReader()
        shown = self.config.local_ranks_filter is None or worker.local_rank in self.config.local_ranks_filter
        try:
            worker.output = WorkerOutput(self.console, worker.local_rank, worker.restarts, worker.process.stdout,
                                         worker.process.stderr, shown, self.log_dir)
        except OSError as exc:  # its log file cannot be written (the directory went, a full disk): no log
            self.say(f"worker {worker.local_rank}: no log file in {self.log_dir} ({exc.strerror or exc}); its "
                     f"output goes to the console only")
            worker.output = WorkerOutput(self.console, worker.local_rank, worker.restarts, worker.process.stdout,
                                         worker.process.stderr, shown, None)
        worker.started_at = time.monotonic()
        worker.status = "running"
        self.say(f"worker {worker.local_rank} started: pid {worker.process.pid}, "
                 f"{self.config.host}:{worker.port}" + (f", restart {worker.restarts}" if worker.restarts else "")
                 + (" (a warm standby)" if standby is not None else ""))

    # ------------------------------------------------------------------ warm standbys
    def _take_standby(self) -> Standby | None:
        """A standby still alive, prepared ones first, taken out of the pool (the next one is
        started ``STANDBY_RESPAWN_S`` later); None when there is none. One still preparing
        is taken too: it is further along than a new process."""
        self.standbys.sort(key=lambda s: (not s.prepared, s.started_at))
        while self.standbys:
            standby = self.standbys.pop(0)
            os.close(standby.ready)
            if standby.process.poll() is None:
                self._standby_after = max(self._standby_after, time.monotonic() + STANDBY_RESPAWN_S)
                return standby
            standby.ready = -1
            self._standby_gone(standby)
        return None

    def _tend_standbys(self, now: float) -> None:
        """Keep ``config.standby`` standbys: notice those that exited, start one when due."""
        for standby in [s for s in self.standbys if s.process.poll() is not None]:
            self.standbys.remove(standby)
            self._standby_gone(standby)
        for standby in [s for s in self.standbys if not s.prepared]:
            try:
                standby.prepared = os.read(standby.ready, 1) == b"R"
            except BlockingIOError:
                continue
            except OSError:
                pass
            if standby.prepared:
                self._standby_failures = 0
                self.say(f"standby ready: pid {standby.process.pid}, prepared in {now - standby.started_at:.1f} s")
        if self._ending_at is not None or self._stop_deadline is not None:
            self._release_standbys()
            return
        if len(self.standbys) >= self.config.standby or self._standby_failures >= STANDBY_FAILURES:
            return
        if not self._group_answered and now >= self._answer_checked + 1.0:
            self._answer_checked = now
            self._group_answered = self._group_answers()
            if self._group_answered:
                self._standby_after = min(self._standby_after, now)
        if now >= self._standby_after:
            self._standby_after = now + STANDBY_RESPAWN_S
            self._spawn_standby(now)

    def _watch_group(self, now: float) -> None:
        """Once a second until it has: whether the job's group ran (a record in a local
        worker's member table shows a view). A worker started again after that gets
        ``FTCOMM_GROUP_RAN=1``: the group may run on in a peer that answers it nothing."""
        if self._group_ran or now < self._group_checked + 1.0:
            return
        self._group_checked = now
        members = self._local_members()
        self._group_ran = members is not None and any(
            isinstance(m.metadata, dict) and isinstance(m.metadata.get("cv"), int) and m.metadata["cv"] > 0
            for m in members)
        if self._group_ran:
            failed = write_pod_mark(self._pod_mark)
            if failed:
                self.say(f"could not mark in {self._pod_mark} that the group ran ({failed}): should this "
                         f"container restart in place, its workers start as new ones")

    def _group_answers(self) -> bool:
        return self._local_members() is not None

    def _local_members(self) -> list | None:
        """The member table of the first running local worker (None: it does not answer
        within 0.2 s, or none runs)."""
        from ..gossip.runtime import GossipError, query_members

        worker = next((w for w in self.workers if w.status == "running"), None)
        if worker is None:
            return None
        try:
            return query_members((self.config.host, worker.port), cluster=self.config.cluster, secret=self.secret,
                                 timeout=0.2)
        except GossipError:
            return None

    def _spawn_standby(self, now: float) -> None:
        env = dict(self.environ)
        env["PYTHONUNBUFFERED"] = env.get("PYTHONUNBUFFERED", "1")
        if self.config.nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")  # as the workers: torch reads it when imported
        for name in [n for n in env if n.startswith("FTCOMM_")]:
            del env[name]  # a standby is no member of anything until it takes a worker's orders
        imports = list(self.config.standby_imports)
        if self.config.replica_size > 1:  # sharded replicas' scripts build FSDP2 (DTensor, about a second)
            imports.append("torch.distributed.fsdp")
        env[STANDBY_IMPORTS_ENV] = ",".join(imports)
        orders_in, orders = os.pipe()
        ready, ready_out = os.pipe()
        os.set_blocking(ready, False)
        env[STANDBY_FD_ENV] = f"{orders_in},{ready_out}"
        channel, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) if self._repairs else (None, None)
        child_fd = child.fileno() if child is not None else -1  # (its number in the standby too)
        try:
            process = subprocess.Popen(standby_command(self.config.command), env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                       pass_fds=(orders_in, ready_out) + ((child_fd,) if child else ()),
                                       preexec_fn=functools.partial(_leave_with_parent, os.getpid()))
        except OSError as exc:
            os.close(orders)
            os.close(ready)
            if channel is not None:
                channel.close()
            self._standby_failures = STANDBY_FAILURES
            self.say(f"cannot start a standby ({exc.strerror or exc}): restarts start new processes")
            return
        finally:
            os.close(orders_in)
            os.close(ready_out)
            if child is not None:
                child.close()
        self.standbys.append(Standby(process, orders, ready, now, channel=channel, channel_fd=child_fd))

    def _standby_gone(self, dead: Standby) -> None:
        """A standby exited before it was needed: say why, with its last line of output."""
        os.close(dead.orders)
        if dead.channel is not None:
            dead.channel.close()
        if dead.ready >= 0:
            os.close(dead.ready)
        code = dead.process.wait()
        last = ""
        for stream in (dead.process.stderr, dead.process.stdout):
            text = _read_some(stream)
            if text.strip():
                last = text.strip().splitlines()[-1]
                break
        _kill_group(dead.process, signal.SIGKILL)
        self._standby_failures += 1
        gave_up = self._standby_failures >= STANDBY_FAILURES
        self.say(f"a standby exited with {describe_exit(code)} before it was needed" + (f": {last}" if last else "")
                 + (f"; no more standbys ({STANDBY_FAILURES} failed in a row), restarts start new processes"
                    if gave_up else ""))

    def _release_standbys(self) -> None:
        """The job ends: every standby is stopped."""
        for s in self.standbys:
            os.close(s.orders)
            os.close(s.ready)
            if s.channel is not None:
                s.channel.close()
            _kill_group(s.process, signal.SIGKILL)
            s.process.wait()
            for stream in (s.process.stdout, s.process.stderr):
                stream.close()
        self.standbys.clear()

    def worker_env(self, worker: Worker) -> dict[str, str]:
        host = self.config.host
        peers = [f"{host}:{w.port}" for w in self.workers if w is not worker] + list(self.config.peers)
        env = dict(self.environ)
        env.update({
            "FTCOMM_BIND": f"{host}:{worker.port}",
            "FTCOMM_PEERS": ",".join(peers),
            "FTCOMM_CLUSTER": self.config.cluster,
            "LOCAL_RANK": str(worker.local_rank),
            "FTCOMM_LOCAL_RANK": str(worker.local_rank),
            "LOCAL_WORLD_SIZE": str(self.config.nproc),
            "FTCOMM_RESTARTS": str(worker.restarts),
            "FTCOMM_GROUP_RAN": "1" if self._group_ran and (worker.restarts or self._restarted_in_place) else "0",
            "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1"),
        })
        if self.config.replica_size > 1:
            env.update({"FTCOMM_REPLICA_SIZE": str(self.config.replica_size),
                        "FTCOMM_SHARD_RANK": str(worker.local_rank % self.config.replica_size),
                        "FTCOMM_REPLICA_ADDR": worker.replica_addr})
        if self.config.nproc > 1:  # as torchrun: workers sharing a node's cores do not each spawn one per core
            env.setdefault("OMP_NUM_THREADS", "1")
        if self.secret is not None:
            env["FTCOMM_SECRET"] = self.secret
        if self.secret_drawn:  # this run's alone: checkpoints are not signed with it
            env["FTCOMM_SECRET_DRAWN"] = "1"
        env["FTCOMM_LAUNCHER"] = self._mark  # the job's shared-memory checkpoints are kept while it runs
        config = self.config
        for name, value in (("FTCOMM_MIN_WORKERS", config.min_workers), ("FTCOMM_MAX_WORKERS", config.max_workers),
                            ("FTCOMM_STRAGGLER_POLICY", config.straggler_policy),
                            ("FTCOMM_FINGERPRINT_EVERY", config.fingerprint_every),
                            ("FTCOMM_SDC_POLICY", config.sdc_policy),
                            ("FTCOMM_METRICS_PORT", None if config.metrics_port is None
                             else config.metrics_port + worker.local_rank)):
            if value is not None:
                env[name] = str(value)
        if self._report_dir is not None:
            env["FTCOMM_NETWORK_CHECK"] = "1"
            env["FTCOMM_NETWORK_REPORT"] = os.path.join(self._report_dir, "network.json")
        return env

    def _on_signal(self, signum: int, frame) -> None:
        self._signals += 1
        if self._stop_signal is None:
            self._stop_signal = signum

    def _exit_status(self) -> int:
        """128 + N when stopped by signal N; else 0 when training completed (a worker
        finished: the others finished too, or were lost on the way, as the summary says),
        1 when no worker finished."""
        if self._stop_signal is not None:
            return 128 + self._stop_signal
        return 0 if any(w.status == "finished" for w in self.workers) else 1

    def _summary(self) -> None:
        """At exit: every worker's starts, state and last exit, and the first failure with
        the last lines it wrote (as torchrun's root-cause report)."""
        status = self._exit_status()
        outcome = ("training completed" if status == 0 else
                   f"stopped by {signal.Signals(self._stop_signal).name}" if self._stop_signal is not None else
                   "no worker finished")
        lost = [w.local_rank for w in self.workers if w.status in ("failed", "stopped")]
        restarts = sum(w.restarts for w in self.workers)
        lost_text = f"lost worker{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}"
        self.say(f"summary: {outcome} (exit status {status}); {len(self.workers)} workers, {restarts} restarts"
                 + (f", {lost_text}" if lost and status == 0 else ""))
        self.say(f"  {'worker':<7} {'starts':>6}  {'state':<9} {'last exit':<18} {'ran':>8}")
        for worker in self.workers:
            last = worker.starts[-1] if worker.starts else None
            exit_text = last["exit"] if last else "-"
            ran = f"{last['seconds']:.1f} s" if last else "-"
            self.say(f"  {worker.local_rank:<7} {len(worker.starts):>6}  {worker.status:<9} {exit_text:<18} {ran:>8}")
        # A failure is an exit while training went on: not one once the job was ending (a
        # standby finding the group gone) or being stopped (the launcher's own SIGTERM).
        failures = [(start["at"], worker, start) for worker in self.workers for start in worker.starts
                    if start["code"] not in (0, None) and "at" in start and not start.get("ending")]
        if failures:
            _, worker, start = min(failures, key=lambda f: f[0])
            self.say(f"first failure: worker {worker.local_rank} "
                     f"({tag(worker.local_rank, start['restarts'])}) exited with {start['exit']} after "
                     f"{start['seconds']:.1f} s" + (f"; log {start['log']}" if start["log"] else "")
                     + ("; its last lines:" if start["lines"] else ""))
            for line in start["lines"][-12:]:
                self.say(f"  | {line}")
        if self.log_dir is not None:
            self.say(f"logs: {self.log_dir}")

    def _shm_places(self) -> list[tuple[pathlib.Path, pathlib.Path | None, bytes | None]]:
        """Each shared-memory checkpoint directory of this job with the directory
        ``--checkpoint-dir`` persists it to and the key its checkpoints are signed with (one
        per shard index with sharded replicas)."""
        from ..training.checkpoint_files import checkpoint_key, shard_suffix

        name = self.config.checkpoint_name or self.config.cluster
        persist = self.config.checkpoint_dir
        secret = None if self.secret_drawn or self.secret is None else self.secret.encode()
        if self.config.replica_size == 1:
            return [(pathlib.Path("/dev/shm", f"ftcomm-{name}"), persist and pathlib.Path(persist),
                     checkpoint_key(secret, name))]
        return [(pathlib.Path("/dev/shm", f"ftcomm-{name}-{shard_suffix(i)}"),
                 persist and pathlib.Path(persist, shard_suffix(i)), checkpoint_key(secret, name, i))
                for i in range(self.config.replica_size)]

    def _announce_checkpoints(self) -> None:
        """Before the workers start: say which flash checkpoints of this job are here (a
        script that restores resumes from the newest step some worker can load), or remove
        this host's shared-memory copies with ``fresh`` (only when no live checkpointer uses
        them; the persistent directory is the user's, and is only named)."""
        from ..training import checkpoint_files as files
        from ..training.checkpoint import left_places

        name = self.config.checkpoint_name or self.config.cluster
        for shm in left_places(self.config.cluster, self.config.replica_size):
            in_shm = files.steps_in(shm)
            if self.config.fresh and shm.is_dir():
                removed = files.discard_if_unused(shm)
                self.say(f"--fresh: {'removed' if removed else 'could not remove (in use, or not yours)'} the state "
                         f"a worker of cluster {self.config.cluster!r} kept in {shm} when it lost the quorum")
            elif in_shm:
                self.say(f"a worker of cluster {self.config.cluster!r} lost the quorum and kept the state of step "
                         f"{in_shm[0]} in {shm}: the workers resume from it (--fresh removes it)")
        for shm, persist, _ in self._shm_places():
            in_shm, kept = files.steps_in(shm), files.steps_in(persist)
            if self.config.fresh:
                if shm.is_dir():
                    removed = files.discard_if_unused(shm)
                    self.say(f"--fresh: {'removed' if removed else 'could not remove (in use, or not yours)'} "
                             f"the flash checkpoints of job {name!r} in {shm}"
                             + (f" (newest step {in_shm[0]})" if in_shm else ""))
                if kept:
                    self.say(f"--fresh: the checkpoints in {persist} (newest step {kept[0]}) are left alone: a "
                             f"script that restores from there resumes from them")
                continue
            if in_shm or kept:
                where = ", ".join(f"step {steps[0]} in {place}" for steps, place in ((in_shm, shm), (kept, persist))
                                  if steps)
                self.say(f"flash checkpoints of job {name!r} here: newest {where}; a script that restores "
                         f"(FlashCheckpointer.restore) resumes from the newest step some worker can load "
                         f"(--fresh removes the shared-memory copies)")

    def _discard_flash_copies(self) -> None:
        """Training completed: remove this host's shared-memory checkpoints of the job once
        their newest is persisted (the workers' own directory, or ``--checkpoint-dir``);
        without a copy elsewhere they stay, and the launcher says where."""
        from ..training import checkpoint_files as files
        from ..training.checkpoint import left_places

        for shm in left_places(self.config.cluster, self.config.replica_size):  # a state kept on a lost quorum
            if shm.is_dir() and files.discard_if_unused(shm):
                self.say(f"training completed: removed the state kept in {shm} when a worker lost the quorum")
        for shm, persist, key in self._shm_places():
            if not shm.is_dir():
                continue
            try:
                newest = files.steps_in(shm)
                if not files.persisted(shm) and persist is not None:
                    files.persist_newest(shm, persist, key=key)
                copied = persist is not None and (not newest or (persist / files.file_name(newest[0], "meta")).exists())
                if files.persisted(shm) or copied:
                    if files.discard_if_unused(shm):
                        self.say(f"training completed: removed its flash checkpoints from {shm}")
                    continue
            except (OSError, ValueError, FtcommError) as exc:
                self.say(f"could not persist or remove the flash checkpoints in {shm}: {exc}")
                continue
            self.say(f"training completed: its flash checkpoints stay in {shm} ({files.size_of(shm) / 2**20:.0f} MB), "
                     f"the only copy of the newest (no persistent directory); remove it when done")

    def _save_at_breakpoint(self) -> None:
        from ..training.checkpoint_files import persist_newest

        for shm, directory, key in self._shm_places():
            try:
                with self._saving:  # workers failing together: the later copies find it persisted
                    step = persist_newest(shm, directory, key=key)
            except (OSError, ValueError, FtcommError) as exc:  # the workers go on: only the copy is lost
                self.say(f"saving at the breakpoint failed: {exc}")
                continue
            if step is not None:
                self.say(f"saved the newest checkpoint (step {step}) to {directory}")

    def say(self, text: str) -> None:
        self.console.write(self.out, f"[ftcomm run] {text}\n")


class _StatusLine:
    """Members, committed step, steps/s, the current view and why it formed, and the
    restarts left, read from a local worker's member table: redrawn in place each second
    on a terminal, a log line every ``status_interval`` seconds otherwise.

    Members publish their step every ``step_publish_interval`` (2 s), so the rate is taken
    between the moments new steps were first seen, over the last ``RATE_WINDOW_S`` seconds:
    a reading between two publications neither halves nor doubles it. A new view starts a
    new window (a restore or a join may jump the step)."""

    RATE_WINDOW_S = 10.0

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self._next = time.monotonic() + (1.0 if launcher._tty else launcher.config.status_interval)
        self._seen: collections.deque[tuple[float, int]] = collections.deque()  # (first seen, step) per new step
        self._baseline: int | None = None  # the step of the window's first reading
        self._started_said = time.monotonic()
        self._view: tuple[int, float] | None = None  # (view id, first seen)
        self._members: frozenset[str] = frozenset()  # the live members seen in the current view
        self._drawn = False

    def update(self, now: float) -> None:
        if now < self._next:
            return
        interval = 1.0 if self.launcher._tty else self.launcher.config.status_interval
        self._next = now + interval
        line = self.read(now)
        if line is None:
            self._starting(now)
            return
        out = self.launcher.out
        with self.launcher.console.lock:
            try:
                if self.launcher._tty:
                    print(f"\r\x1b[K[ftcomm run] {line}", end="", file=out, flush=True)
                    self._drawn = True
                else:
                    print(f"[ftcomm run] {line}", file=out, flush=True)
            except (OSError, ValueError):
                pass

    def _starting(self, now: float) -> None:
        """Before the group first answers: say, every few seconds, that the workers are still
        starting (importing torch, forming the group), so that a slow start is not silence."""
        running = [w for w in self.launcher.workers if w.status == "running"]
        if self._view is not None or not running or now < self._started_said + STARTING_NOTICE_S:
            return
        self._started_said = now
        since = now - min(w.started_at for w in running)
        if since >= STARTING_NOTICE_S:
            self.launcher.say(f"{len(running)} worker{'s' if len(running) > 1 else ''} starting for {since:.0f} s "
                              f"(importing, joining the group); no member answers yet")

    def rate(self, now: float, step: int) -> float | None:
        """Steps per second over the window, between moments new steps appeared (the first
        reading of a window only sets the baseline: when its step was published is unknown)."""
        if self._baseline is None:
            self._baseline = step
        elif step != (self._seen[-1][1] if self._seen else self._baseline):
            self._seen.append((now, step))
        while len(self._seen) > 2 and self._seen[0][0] < now - self.RATE_WINDOW_S:
            self._seen.popleft()
        if len(self._seen) < 2:
            return None
        (t0, s0), (t1, s1) = self._seen[0], self._seen[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 >= s0 else None

    def read(self, now: float) -> str | None:
        from ..gossip.runtime import GossipError, query_members

        launcher = self.launcher
        running = [w for w in launcher.workers if w.status == "running"][:2]  # a bounded wait per update
        for worker in running:
            try:
                members = query_members((launcher.config.host, worker.port), cluster=launcher.config.cluster,
                                        secret=launcher.secret, timeout=0.3)
                break
            except GossipError:
                continue
        else:
            return None
        live = [m for m in members if m.state == "alive"]
        records = [m.metadata for m in live if isinstance(m.metadata.get("cv"), int)]
        view = max((int(r["cv"]) for r in records), default=0)
        newest = [r for r in records if r["cv"] == view]
        step = max((int(r["st"]) for r in newest if isinstance(r.get("st"), int)), default=0)
        reason = next((str(r["vr"]) for r in newest if isinstance(r.get("vr"), str)), None)
        in_newest = frozenset(m.id for m in live if m.metadata.get("cv") == view)
        if self._view is None or self._view[0] != view:
            if self._view is not None and view > self._view[0]:
                self._changed(view, reason, in_newest, {m.id for m in live})
            self._view = (view, now)
            self._members = in_newest
            self._seen.clear()
            self._baseline = None
        else:
            self._members |= in_newest
        rate = self.rate(now, step)
        local = sum(1 for w in launcher.workers if w.status == "running")
        in_view = sum(1 for r in newest if r.get("ph") == "active")
        left = sum(max(0, launcher.config.max_restarts - w.restarts) for w in launcher.workers
                   if w.status not in ("failed", "finished", "stopped"))
        diverged = [r["sd"] for r in records if isinstance(r.get("sd"), list) and len(r["sd"]) == 2
                    and all(type(v) is int for v in r["sd"])]
        repairing = sum(1 for m in live if m.metadata.get("rr") is True)
        repaired = sum(w.repairs for w in launcher.workers)
        return (f"{len(live)} members ({local} local, {in_view} in the view), step {step}"
                + (f", {rate:.1f} steps/s" if rate is not None else "")
                + f", view {view}" + (f" ({reason}, {now - self._view[1]:.0f} s ago)" if reason else
                                       f" (for {now - self._view[1]:.0f} s)")
                + f", restarts left {left}"
                + (f", {repaired} replica repair{'s' if repaired != 1 else ''} in place" if repaired else "")
                + (f" ({repairing} process{'es' if repairing != 1 else ''} repairing now)" if repairing else "")
                + (f", {len(diverged)} named for silent data corruption (last at step {max(s for _, s in diverged)})"
                   if diverged else ""))

    def _changed(self, view: int, reason: str | None, members: frozenset[str], live: set[str]) -> None:
        """One line per view change seen (views that came and went between two readings are
        not seen): its id, why it formed (the members' one reason), and who left and came
        as far as this reading shows (members of the last view no longer alive here; live
        members already in the new one)."""
        from .cli import printable

        gone = sorted(self._members - live)
        came = sorted(members - self._members)
        names = lambda ids: ", ".join(printable(i) for i in ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
        self.launcher.say(f"view {view} formed ({printable(reason or 'reason not yet published')})"
                          + (f": without {names(gone)}" if gone else "")
                          + (f"{'; with' if gone else ': with'} {names(came)}" if came else ""))

    def clear(self) -> None:
        """Erase the drawn line (the caller holds the console's lock)."""
        if self._drawn:
            try:
                print("\r\x1b[K", end="", file=self.launcher.out, flush=True)
            except (OSError, ValueError):
                pass
            self._drawn = False

    def finish(self) -> None:
        with self.launcher.console.lock:
            self.clear()


def _send_order(fd: int, data: bytes) -> None:
    """Write a standby's orders (it reads them once it has imported everything) and close."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:  # it died meanwhile: the launcher sees the worker's exit
        pass
    finally:
        os.close(fd)


def _read_some(stream, limit: int = 8192) -> str:
    """What an exited process left in its pipe (at most ``limit`` bytes)."""
    try:
        os.set_blocking(stream.fileno(), False)
        return (stream.read(limit) or b"").decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return ""
    finally:
        stream.close()


STOPPED_TREE_LIMIT = 64  # processes of a worker's tree looked at for a stopped one


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` or one its main thread started, and so on down (a script run
    through a wrapper, its data loaders), is stopped by a signal (state T; not t, a
    debugger's stop). Two reads per process, every poll: the children other threads
    started are not looked at."""
    pending, seen = [pid], set()
    while pending and len(seen) < STOPPED_TREE_LIMIT:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        fields = stat_fields(current)
        if fields is None:  # gone, or no /proc: not known to be stopped
            continue
        if fields[0] == "T":
            return True
        try:  # the children its main thread started (a wrapper's script, data loaders): one read per process
            with open(f"/proc/{current}/task/{current}/children", "rb") as children:
                pending.extend(int(child) for child in children.read().split())
        except (OSError, ValueError):  # gone meanwhile, or a kernel without the children files
            continue
    return False


def _kill_group(process: subprocess.Popen, sig: int) -> None:
    """Signal the worker and whatever it started (it runs in its own session)."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            process.send_signal(sig)
        except ProcessLookupError:
            pass


def _prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _prctl()  # looked up here: the child between fork and exec only calls it


def _leave_with_parent(launcher: int) -> None:
    """In the worker before exec: SIGTERM (a graceful leave) when the launcher (pid
    ``launcher``) dies, however it dies (kill -9 included), so that no worker outlives it.
    A launcher that died before the request was made sends nothing: the child, whose parent
    is then another process, exits instead of starting the worker."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != launcher:
            os._exit(128 + signal.SIGTERM)
