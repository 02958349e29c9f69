"""A cap on the connections a listening zmq socket keeps open, per remote host and in all.

zmq accepts every TCP connection to a bound socket and keeps it for as long as the peer
does; it has no option that limits how many. An outsider who opens tens of thousands of
idle connections to a worker's gossip or rendezvous port would use up the process's
descriptors, and the next ``socket()`` or ``open()`` anywhere in the worker fails. The
socket's monitor reports each accepted connection with its descriptor: one over the cap
is shut down at once (through a duplicate of the descriptor: zmq reads the end of the
stream and closes it as it closes any connection its peer ended).

Members first: an outsider with many addresses could fill the total cap, and the group's
own members could then no longer connect. A connection from a member's host (``trusted``:
a confirmed member of the gossip table) that arrives at the total cap takes the place of
one from a host that is not a member's, the one that holds the most: that one is shut
down instead.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
from typing import Callable, Iterator

import zmq

log = logging.getLogger(__name__)

EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
"""The monitor events a :class:`ConnectionCap` needs."""


def caps(limit: int | None = None) -> tuple[int, int]:
    """The connections one port keeps (per remote host, in all), from the process's
    descriptor limit: an eighth of it in all (a worker serves two such ports, besides its
    data plane and files), at most 4096, and a quarter of that per host (the workers of
    one host together open a few per member)."""
    if limit is None:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = 1 << 20 if limit == resource.RLIM_INFINITY else limit
    total = max(16, min(4096, limit // 8))
    return max(8, total // 4), total


class ConnectionCap:
    """Fed the monitor events of a zmq socket bound at ``port`` (see :data:`EVENTS`);
    keeps at most ``per_host`` of its connections from one remote address and ``total``
    in all, shutting down the rest as they are accepted. ``refused``: how many.
    ``trusted(host)``: whether ``host`` is a member's (asked at the total cap only; may be
    set later); ``evicted``: connections of other hosts shut down to make room for one."""

    def __init__(self, port: int, per_host: int, total: int, trusted: Callable[[str], bool] | None = None) -> None:
        self.port, self.per_host, self.total = port, per_host, total
        self.trusted: Callable[[str], bool] = trusted or (lambda host: False)
        self.refused = 0
        self.evicted = 0
        self._host_of: dict[int, str] = {}  # descriptor -> remote address, of the connections kept
        self._count: collections.Counter[str] = collections.Counter()

    def event(self, event: dict) -> None:
        """One event from the socket's monitor (``zmq.utils.monitor.parse_monitor_message``)."""
        fd = event["value"]
        if event["event"] == zmq.EVENT_ACCEPTED:
            self._accepted(fd)
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self._forget(fd)

    def _forget(self, fd: int) -> None:
        host = self._host_of.pop(fd, None)
        if host is not None:
            self._count[host] -= 1
            if not self._count[host]:
                del self._count[host]

    @contextlib.contextmanager
    def _connection(self, fd: int) -> Iterator[socket.socket | None]:
        """The connection to this port that ``fd`` is, through a duplicate of the descriptor
        (closed after); None when it was closed, or reused since the event by something that
        is not one of this port's connections."""
        conn = None
        try:
            copy = os.dup(fd)
        except OSError:  # closed already
            copy = None
        if copy is not None:
            try:
                conn = socket.socket(fileno=copy)
            except OSError:  # reused since, by something that is not a socket
                os.close(copy)
        try:
            try:
                ours = conn is not None and conn.getsockname()[1] == self.port
            except OSError:
                ours = False
            yield conn if ours else None
        finally:
            if conn is not None:
                conn.close()  # the duplicate only

    def _accepted(self, fd: int) -> None:
        with self._connection(fd) as conn:
            if conn is None:
                return
            try:
                host = conn.getpeername()[0]
                if self._count[host] >= self.per_host or (len(self._host_of) >= self.total and not (
                        self.trusted(host) and self._make_room())):
                    conn.shutdown(socket.SHUT_RDWR)
                    self.refused += 1
                    if self.refused in (1, 100, 10000):
                        log.warning("port %d: %d connections shut down over the cap (%d from one host, %d in "
                                    "all); the last from %s", self.port, self.refused, self.per_host, self.total,
                                    host)
                    return
                self._host_of[fd] = host
                self._count[host] += 1
            except OSError:  # the peer went away meanwhile
                return

    def _make_room(self) -> bool:
        """Shut down one kept connection of the host that is not a member's and holds the
        most; whether one was."""
        for host, _ in self._count.most_common():
            if self.trusted(host):
                continue
            for fd in [fd for fd, h in self._host_of.items() if h == host]:
                shut = self._shut(fd, host)
                # Gone either way from what is kept (a descriptor that is no longer that
                # connection was closed: its disconnection event finds nothing to forget).
                self._forget(fd)
                if shut:
                    self.evicted += 1
                    if self.evicted in (1, 100, 10000):
                        log.warning("port %d: %d connections of hosts that are not members' shut down to make "
                                    "room for members' (%d in all); the last from %s", self.port, self.evicted,
                                    self.total, host)
                    return True
        return False

    def _shut(self, fd: int, host: str) -> bool:
        """Shut down the connection from ``host`` to this port that ``fd`` is, if it still is."""
        with self._connection(fd) as conn:
            try:
                if conn is None or conn.getpeername()[0] != host:
                    return False
                conn.shutdown(socket.SHUT_RDWR)
                return True
            except OSError:
                return False
