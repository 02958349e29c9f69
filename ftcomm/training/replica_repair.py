"""Repair in place: a sharded replica that lost a process is formed again with a replacement.

Under ``ftcomm run --replica-size K`` each process of a replica holds one end of a Unix
socket pair whose other end the launcher keeps (``$FTCOMM_REPAIR_FD`` names the
descriptor). When a process of a replica exits, the launcher starts a replacement for its
shard (a warm standby when one is ready) at a fresh address for the replica's store and
tells the other processes of the replica that address. They keep their interpreters,
models and optimizers: each leaves its view, meets the replacement there
(:meth:`ftcomm.training.replica.Replica.reform`), and the replica joins the group again as a
whole under a new key, receiving the newest state of each shard from another replica. A
process that finds a partner hung (stopped, silent) asks the launcher to replace it, which
kills it first.

The messages are lines of ASCII, each at most :data:`MAX_LINE` bytes:

- launcher to worker: ``meet GENERATION HOST:PORT`` (the replica's store for its formation
  number GENERATION, counted by the launcher);
- worker to launcher: ``lost SHARD PID`` (the process of shard SHARD, pid PID as the
  worker read it when the replica formed, is hung or gone), and ``repairable`` once its
  replica can be repaired in place (its state registered, its FSDP2 collectives ftcomm's);
  the launcher repairs a replica only when every other process of it said so.

Nothing else is read from the socket; a malformed line is dropped with a warning.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time

from ..gossip.addresses import parse_address

log = logging.getLogger(__name__)

REPAIR_FD_ENV = "FTCOMM_REPAIR_FD"
"""The environment variable naming the worker's end of its socket pair with the launcher."""
MAX_LINE = 128
"""The longest line either side sends (a longer one is dropped)."""


def receive(sock: socket.socket) -> bytes | None:
    """What the non-blocking ``sock`` holds now: None when nothing yet, ``b""`` when the
    other end closed it (or it failed)."""
    try:
        return sock.recv(4096)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def parse_meet(line: str) -> tuple[int, str] | None:
    """``(generation, "HOST:PORT")`` of a ``meet`` line, or None when it is not one."""
    parts = line.split(" ")
    if len(parts) != 3 or parts[0] != "meet" or not parts[1].isdigit():
        return None
    try:
        parse_address(parts[2])
    except ValueError:
        return None
    return int(parts[1]), parts[2]


def parse_lost(line: str) -> tuple[int, int] | None:
    """``(shard, pid)`` of a ``lost`` line, or None when it is not one."""
    parts = line.split(" ")
    if len(parts) != 3 or parts[0] != "lost" or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return int(parts[1]), int(parts[2])


class LineReader:
    """Whole lines from a non-blocking stream socket, each at most MAX_LINE bytes; a longer
    one is skipped to its end."""

    def __init__(self) -> None:
        self._buffer = b""
        self._skipping = False

    def feed(self, data: bytes) -> list[str]:
        lines = []
        self._buffer += data
        while b"\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n", 1)
            if self._skipping or len(raw) > MAX_LINE:
                self._skipping = False
                log.warning("a line longer than %d bytes on the repair channel: dropped", MAX_LINE)
                continue
            try:
                lines.append(raw.decode("ascii"))
            except UnicodeDecodeError:
                log.warning("a line that is not ASCII on the repair channel: dropped")
        if len(self._buffer) > MAX_LINE:  # (the rest of it is skipped as it comes)
            self._buffer, self._skipping = b"", True
        return lines


class RepairChannel:
    """This worker's end of its socket pair with the launcher that started it."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._sock.setblocking(False)
        self._reader = LineReader()
        self._meetings: list[tuple[int, str]] = []  # (generation, address) announced, newest last
        self._used = -1  # the newest generation this worker tried to meet at
        self.closed = False

    @classmethod
    def from_env(cls) -> RepairChannel | None:
        """The channel ``$FTCOMM_REPAIR_FD`` names, or None without one (not started by
        ``ftcomm run``, or its descriptor is not a Unix stream socket)."""
        raw = os.environ.get(REPAIR_FD_ENV, "")
        if not raw:
            return None
        try:
            fd = int(raw)
            os.set_inheritable(fd, False)  # (a program this worker runs does not hold it)
            sock = socket.socket(fileno=fd)
        except (ValueError, OSError) as exc:
            log.warning("$%s=%r names no socket (%s): a lost process of this replica restarts the whole replica",
                        REPAIR_FD_ENV, raw, exc)
            return None
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            sock.detach()
            log.warning("$%s=%r is not a Unix stream socket: a lost process of this replica restarts the whole "
                        "replica", REPAIR_FD_ENV, raw)
            return None
        return cls(sock)

    def report(self, shard: int, pid: int | None) -> None:
        """Ask the launcher to replace the process of shard ``shard`` (pid ``pid`` on this
        host; None: not known here, which asks nothing: the launcher sees its exit)."""
        if pid is not None:
            self._send(f"lost {shard} {pid}\n")

    def declare(self) -> None:
        """Tell the launcher this process's replica can be repaired in place (its process
        group is ftcomm's, its FSDP2 collectives ftcomm's): a lost partner is replaced, not
        the whole replica restarted."""
        self._send("repairable\n")

    def _send(self, line: str) -> None:
        if self.closed:
            return
        try:
            self._sock.send(line.encode("ascii"))
        except OSError as exc:  # (a full buffer: the launcher reads its end every poll)
            log.warning("could not tell the launcher %r: %s", line.strip(), exc)

    def _read(self, timeout: float) -> None:
        if self.closed:
            return
        ready, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        data = receive(self._sock) if ready else None
        if data is None:
            return
        if not data:
            self.closed = True  # the launcher is gone: nobody replaces anything
            return
        for line in self._reader.feed(data):
            meet = parse_meet(line)
            if meet is None:
                log.warning("an unknown line on the repair channel: dropped")
            elif not self._meetings or meet[0] > self._meetings[-1][0]:
                self._meetings.append(meet)

    def meeting(self, timeout: float) -> str | None:
        """The address of the newest formation the launcher announced that this worker has
        not tried yet, waiting up to ``timeout`` seconds for one; None when none came (or the
        launcher is gone)."""
        deadline = time.monotonic() + timeout
        while True:
            self._read(0.0)
            if self._meetings and self._meetings[-1][0] > self._used:
                self._used, address = self._meetings[-1]
                return address
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                return None
            self._read(min(left, 0.5))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.environ.pop(REPAIR_FD_ENV, None)  # (its descriptor number may name another file from now on)
        self._sock.close()
