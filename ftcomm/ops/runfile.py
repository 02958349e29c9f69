"""Run files: how ``ftcomm members`` finds the jobs ``ftcomm run`` started on this host.

While it runs, a launcher keeps a file in a directory private to its user (0700; the file
0600, like a local socket's permissions) with its pid and start time, the cluster name,
the workers' gossip addresses and the group's secret. ``ftcomm members`` with no
``--peer`` reads the run files of launchers that still run (a pid with the same start
time: a reused pid is not taken for the launcher) and asks one of their workers. The
launcher removes its file when it exits; the file of a launcher killed with -9 is ignored
and removed by the next reader.

The directory is ``$FTCOMM_RUN_DIR``, else ``$XDG_RUNTIME_DIR/ftcomm`` (a per-user tmpfs on
most Linux systems), else ``~/.cache/ftcomm/runs``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import stat
from dataclasses import dataclass

from ..errors import FtcommError
from ..localproc import process_start


def run_directory() -> pathlib.Path:
    if os.environ.get("FTCOMM_RUN_DIR"):
        return pathlib.Path(os.environ["FTCOMM_RUN_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return pathlib.Path(os.environ["XDG_RUNTIME_DIR"], "ftcomm")
    return pathlib.Path.home() / ".cache" / "ftcomm" / "runs"


@dataclass(frozen=True)
class Run:
    """A launcher's run file."""

    pid: int
    start: int
    cluster: str
    addresses: tuple[str, ...]  # the workers' gossip addresses, HOST:PORT
    secret: str | None
    command: tuple[str, ...]
    path: pathlib.Path

    def alive(self) -> bool:
        return process_start(self.pid) == self.start

    def watch_command(self, only: bool) -> str:
        return "ftcomm members --watch" + ("" if only else f" --run {self.pid}")


def _private(directory: pathlib.Path) -> pathlib.Path:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise FtcommError(f"refusing the run directory {directory}: it is a link, another user's, or open to "
                          f"others (it holds the groups' secrets); remove it or set $FTCOMM_RUN_DIR")
    return directory


def write(pid: int, cluster: str, addresses: list[str], secret: str | None, command: list[str]) -> pathlib.Path:
    """The launcher's run file (mode 0600, written whole before it appears)."""
    directory = _private(run_directory())
    path = directory / f"run-{pid}.json"
    temporary = directory / f".run-{pid}.tmp"
    shown = [arg[:200] for arg in command[:20]]  # to name the run, not to run it: bounded
    body = json.dumps({"pid": pid, "start": process_start(pid), "cluster": cluster, "addresses": addresses,
                       "secret": secret, "command": shown}, ensure_ascii=False).encode()
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, body)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    return path


def remove(path: pathlib.Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def _read(path: pathlib.Path) -> Run | None:
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size > 1 << 20:
            return None
        record = json.loads(path.read_text())
        return Run(int(record["pid"]), int(record["start"]), str(record["cluster"]),
                   tuple(str(a) for a in record["addresses"]),
                   None if record["secret"] is None else str(record["secret"]),
                   tuple(str(c) for c in record["command"]), path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def running() -> list[Run]:
    """The runs of this user's launchers that still run, oldest pid first; the files of
    launchers that ended without removing theirs are removed."""
    directory = run_directory()
    try:
        _private(directory) if directory.exists() else None
        names = sorted(os.listdir(directory))
    except (OSError, FtcommError):
        return []
    runs = []
    for name in names:
        if not (name.startswith("run-") and name.endswith(".json")):
            continue
        run = _read(directory / name)
        if run is None:
            continue
        if run.alive():
            runs.append(run)
        else:
            remove(run.path)
    return sorted(runs, key=lambda r: r.pid)


def choose(runs: list[Run], pid: int | None) -> Run:
    """The run ``ftcomm members`` asks: the one with ``pid``, or the only one; FtcommError
    saying what to do otherwise."""
    if pid is not None:
        for run in runs:
            if run.pid == pid:
                return run
        raise FtcommError(f"no ftcomm run with pid {pid} runs on this host as this user "
                          f"({len(runs)} do{'es' if len(runs) == 1 else ''})")
    if not runs:
        raise FtcommError(f"no ftcomm run of this user runs on this host (run files in {run_directory()}); "
                          f"give --peer HOST:PORT of a member")
    if len(runs) > 1:
        listed = "; ".join(f"--run {r.pid}: {' '.join(r.command)[:60]} ({r.cluster}, {len(r.addresses)} workers)"
                           for r in runs)
        raise FtcommError(f"{len(runs)} ftcomm runs on this host: choose one with {listed}")
    return runs[0]
