"""Rendezvous without a shared service: each worker serves a TCPStore of its own.

A worker's store holds the member lists of the views it proposes (so a joiner can read
the proposal it is asked to agree to) and, when the worker is rank 0 of a view, the
keys the other ranks use to form that view's communicator (prefixed by view id and
digest). No shared filesystem, no external store.
"""

from __future__ import annotations

import datetime
import errno
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from . import netif
from .errors import CommunicatorError
from .view import View


def refused(host: str, port: int, timeout: float = 0.25) -> bool:
    """True when the host actively refuses a TCP connection: no process owns the port.

    A crashed process's port is refused by its host's kernel at once; a paused or
    partitioned process's port is not (the connect succeeds or times out).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect((host, port))
        except ConnectionRefusedError:
            return True
        except OSError as exc:
            return exc.errno == errno.ECONNREFUSED
    return False


def refused_many(addresses: list[tuple[str, int]], timeout: float = 0.25) -> list[bool]:
    """:func:`refused` for several addresses at once."""
    if not addresses:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        return list(pool.map(lambda a: refused(a[0], a[1], timeout), addresses))


def _listener(host: str) -> int:
    """A listening TCP socket on ``host`` alone (the store server would otherwise listen on
    every interface), handed over to the store as a file descriptor."""
    family = socket.AF_INET6 if ":" in netif.resolve(host) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((netif.resolve(host), 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


class Rendezvous:
    """This worker's store server and its clients to other workers' stores."""

    def __init__(self, host: str, timeout: float) -> None:
        self.host = host
        self.timeout = timeout
        self.store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout),
                                   wait_for_workers=False, master_listen_fd=_listener(host))
        self.port: int = self.store.port
        self._clients: dict[tuple[str, int], Any] = {}

    def publish_proposal(self, view_id: int, digest: str, members: tuple[str, ...]) -> None:
        self.store.set(f"proposal/{view_id}/{digest}", "\n".join(members))

    def fetch_proposal(self, host: str, port: int, view_id: int, digest: str) -> tuple[str, ...] | None:
        """The member list another worker proposed, or None if it cannot be read now."""
        key = f"proposal/{view_id}/{digest}"
        try:
            store = self._client(host, port)
            if not store.check([key]):
                return None
            return tuple(store.get(key).decode().split("\n"))
        except (CommunicatorError, RuntimeError):
            self._clients.pop((host, port), None)
            return None

    def view_store(self, view: View, host: str, port: int) -> Any:
        """The store the ranks of ``view`` form their communicator through (rank 0's).

        Always a new connection: a formation that is abandoned may keep its builder
        thread blocked on its store, and a TCPStore client serializes its requests.
        """
        return dist.PrefixStore(f"view/{view.id}/{view.digest}", self._connect(host, port))

    def close(self) -> None:
        """Stop serving (the store's listener closes) and drop the connections to other stores."""
        self.store = None
        self._clients.clear()

    def _client(self, host: str, port: int) -> Any:
        """A cached connection for short reads (proposals); never used by a formation."""
        if (host, port) == (self.host, self.port):
            if self.store is None:
                raise CommunicatorError("this worker's rendezvous store was closed")
            return self.store
        client = self._clients.get((host, port))
        if client is None:
            client = self._clients[(host, port)] = self._connect(host, port)
        return client

    def _connect(self, host: str, port: int) -> Any:
        if refused(host, port):
            raise CommunicatorError(f"the rendezvous store at {host}:{port} refused the connection")
        try:
            return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise CommunicatorError(f"cannot reach the rendezvous store at {host}:{port}: "
                                    f"{str(exc).splitlines()[0][:200]}") from None
