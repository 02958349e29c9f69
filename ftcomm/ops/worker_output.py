"""What ``ftcomm run`` does with its workers' output: each line on the console with the
worker's tag (``[w3]``, ``[w3.r1]`` after its first restart), in a log file per worker
start (``--log-dir``), and the last lines of each start kept for the exit summary.

The console is shared with the launcher's own lines and its status line: every write
takes :attr:`Console.lock` and clears the status line first, so worker output never lands
on it. Lines are relayed as they arrive; a partial last line is relayed when the stream
ends.
"""

from __future__ import annotations

import collections
import os
import pathlib
import re
import threading
import time
from typing import Callable, TextIO

TAIL_LINES = 20
MAX_LINE = 64 << 10
LINE_END = re.compile(rb"(?<=\n)|(?<=\r)(?!\n)")  # split after each newline, and after a lone carriage return
TAG = re.compile(r"^\[w\d+(?:\.r\d+)?\] ")


def tag(local_rank: int, restarts: int) -> str:
    return f"w{local_rank}" + (f".r{restarts}" if restarts else "")


def untagged(line: str) -> str:
    """A console line without its worker tag (for programs that read a job's output)."""
    return TAG.sub("", line, count=1)


class Console:
    """Where the launcher writes: its own lines and the status line go to ``out``, the
    workers' lines to ``stdout``/``stderr``. On a terminal (``tty``) one lock orders them
    all and the status line is cleared before any other line; otherwise each stream has
    its own lock, so that a reader that stalls one stream does not hold up the others."""

    def __init__(self, out: TextIO, stdout: TextIO, stderr: TextIO, tty: bool = False) -> None:
        self.out, self.stdout, self.stderr, self.tty = out, stdout, stderr, tty
        self.lock = threading.Lock()  # ``out``'s (and, on a terminal, every stream's)
        self._locks = {id(stdout): threading.Lock(), id(stderr): threading.Lock()}
        self.clear_status: Callable[[], None] = lambda: None

    def write(self, stream: TextIO, text: str) -> None:
        lock = self.lock if self.tty or stream is self.out else self._locks.get(id(stream), self.lock)
        with lock:
            try:
                if lock is self.lock:
                    self.clear_status()
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: the workers go on
                pass


def private_log_directory(path: pathlib.Path) -> pathlib.Path:
    """``path`` for the workers' logs: created 0700, or an existing directory of this user
    that nobody else can write to (else another user could plant links or read the logs).
    FtcommError saying which and why."""
    from ..errors import FtcommError

    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(path)
    except OSError as exc:
        raise FtcommError(f"cannot use --log-dir {path}: {exc.strerror or exc}") from None
    import stat

    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise FtcommError(f"--log-dir {path} is not a directory (or is a symbolic link)")
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise FtcommError(f"--log-dir {path} belongs to another user or others can write to it: they could "
                          f"redirect or read the workers' logs; use a directory of your own")
    # Nor may another user rename a directory above it and put one of theirs in its place:
    # every directory on the way is root's or this user's, and only they can write to it
    # (or it is sticky, as /tmp, where nobody renames another user's entries).
    resolved = path.resolve()
    for above in reversed(resolved.parents):
        info = os.lstat(above)
        if info.st_uid not in (0, os.geteuid()) or (info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
            raise FtcommError(f"--log-dir {path}: {above} above it belongs to another user or others can write "
                              f"to it, and could put a directory of theirs in its place; use a directory of your "
                              f"own under directories only you (or root) can change")
    return resolved


class WorkerOutput:
    """The two output streams of one start of one worker."""

    def __init__(self, console: Console, local_rank: int, restarts: int, stdout, stderr,
                 show: bool, log_dir: pathlib.Path | None) -> None:
        self.tag = tag(local_rank, restarts)
        self.console, self.show = console, show
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)  # stderr's last lines
        self.out_tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.log_path: pathlib.Path | None = None
        self._log = None
        self._log_lock = threading.Lock()
        if log_dir is not None:
            self.log_path = log_dir / f"{self.tag}.log"
            # A name left by an earlier run is replaced, never followed (it could be a link).
            try:
                os.unlink(self.log_path)
            except FileNotFoundError:
                pass
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self._log = open(fd, "w", encoding="utf-8", errors="replace", buffering=1)
        self._threads = [threading.Thread(target=self._relay, args=(pipe, stream, tail), daemon=True,
                                          name=f"ftcomm-run-{self.tag}-{name}")
                         for pipe, stream, tail, name in ((stdout, console.stdout, self.out_tail, "out"),
                                                          (stderr, console.stderr, self.tail, "err"))]
        for thread in self._threads:
            thread.start()

    def _relay(self, pipe, stream: TextIO, tail: collections.deque[str]) -> None:
        """Relay ``pipe`` line by line. A line ends at a newline or a carriage return (a
        progress bar redrawing itself); on the console, lines that end with a carriage
        return are shown at most once a second per stream (the log file gets every one). A
        line longer than ``MAX_LINE`` bytes is cut there."""
        prefix = f"[{self.tag}] "
        pending, shown_at = b"", 0.0
        try:
            while True:
                chunk = pipe.read1(65536)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = LINE_END.split(pending)
                if not pending and lines and lines[-1].endswith(b"\r"):
                    pending = lines.pop()  # its \n may come with the next chunk (a \r\n cut in two)
                while len(pending) > MAX_LINE:
                    lines.append(pending[:MAX_LINE] + b"\n")
                    pending = pending[MAX_LINE:]
                for raw in lines:
                    redraw = raw.endswith(b"\r")
                    text = raw.rstrip(b"\r\n").decode("utf-8", errors="replace")
                    if redraw and not text:
                        continue  # a redraw that starts with its carriage return
                    tail.append(text)
                    self._write_log(text + "\n")
                    now = time.monotonic()
                    if self.show and (not redraw or now - shown_at >= 1.0):
                        shown_at = now if redraw else shown_at
                        self.console.write(stream, prefix + text + "\n")
            if pending:
                text = pending.rstrip(b"\r\n").decode("utf-8", errors="replace")
                tail.append(text)
                self._write_log(text + "\n")
                if self.show:
                    self.console.write(stream, prefix + text + "\n")
        except (OSError, ValueError):  # the pipe closed under the reader
            pass
        finally:
            pipe.close()

    def _write_log(self, text: str) -> None:
        if self._log is not None:
            with self._log_lock:
                try:
                    self._log.write(text)
                except (OSError, ValueError):
                    pass

    def finish(self, timeout: float = 2.0) -> None:
        """Wait (at most ``timeout``) for the streams to end, then close the log file. A
        stream still open then (a process the worker started holds it) is left to its reader."""
        for thread in self._threads:
            thread.join(timeout)
        if self._log is not None and not any(t.is_alive() for t in self._threads):
            with self._log_lock:
                self._log.close()

    def last_lines(self) -> list[str]:
        """The last lines of its stderr, else of its stdout."""
        return list(self.tail) or list(self.out_tail)
