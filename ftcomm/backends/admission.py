"""Who may connect to a data-plane listener: a socket filter on the listening socket.

Gloo's TCP listener (torch's bundled Gloo) never closes an accepted connection that sends
nothing, and aborts the process once ``accept`` fails for want of file descriptors: anyone
who can reach the port can kill the worker with about as many connect-and-close as its
descriptor limit, secret or not. Gloo needs its listener only while a communicator forms
(its pairs are connected before the group's constructor returns), so each listener gets a
classic BPF socket filter (``SO_ATTACH_FILTER``), which the kernel runs on every packet that
reaches the listening socket, before a connection exists:

- while communicators form, only the members' addresses are let through (a packet from
  any other source is dropped, so its connection never completes: no descriptor, no
  queue entry);
- between formations nothing is let through at all.

Connections already accepted (the pairs of the communicators) are sockets of their own and
keep working. A listener is found by the kernel's inode of a listening TCP socket that
appeared while the Gloo device was created (``/proc/self/fd`` and ``/proc/net/tcp``).

Linux only; elsewhere, or when the filter cannot be attached, a warning says the listener
stays open to every host that reaches it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import sys
import threading
import time
from typing import Callable, Iterable

log = logging.getLogger(__name__)

SO_ATTACH_FILTER = 26
SKF_NET_OFF = -0x100000  # classic BPF: offsets from the network header (the TCP layer's data starts past it)
LOAD_WORD_ABSOLUTE, JUMP_IF_EQUAL, RETURN = 0x20, 0x15, 0x06
KEEP_PACKET, DROP_PACKET = 0xFFFFFFFF, 0
MAX_ADMITTED = 500
"""Sources one filter names (two instructions each). A filter's memory counts against the
socket's ``net.core.optmem_max`` (20 kB by default before Linux 6.9, where about 850
sources fit); beyond this, the listener admits any source while a communicator forms."""


def _instruction(code: int, jump_true: int, jump_false: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jump_true, jump_false, k & 0xFFFFFFFF)


def program(sources: Iterable[str] | None) -> list[bytes]:
    """The filter: keep packets whose IPv4 source is one of ``sources``; None keeps every
    packet, an empty set drops every packet."""
    if sources is None:
        return [_instruction(RETURN, 0, 0, KEEP_PACKET)]
    code = [_instruction(LOAD_WORD_ABSOLUTE, 0, 0, SKF_NET_OFF + 12)]  # the IPv4 header's source address
    for source in sorted(set(sources)):
        code.append(_instruction(JUMP_IF_EQUAL, 0, 1, int.from_bytes(socket.inet_aton(source), "big")))
        code.append(_instruction(RETURN, 0, 0, KEEP_PACKET))
    code.append(_instruction(RETURN, 0, 0, DROP_PACKET))
    return code


def attach(fd: int, code: list[bytes]) -> None:
    """Replace the socket filter of descriptor ``fd`` (OSError when the kernel refuses it)."""
    buffer = ctypes.create_string_buffer(b"".join(code))
    fprog = struct.pack("HL", len(code), ctypes.addressof(buffer))  # struct sock_fprog
    sock = socket.socket(fileno=os.dup(fd))  # the same socket; closing the copy leaves fd open
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
    finally:
        sock.close()


def _listening_inodes() -> dict[int, tuple[int, str, int, int]]:
    """Inode -> (address family, local address, port, accept queue) of every listening TCP
    socket of this network namespace."""
    found = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as table:
                lines = table.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            if sys.byteorder == "little":  # the kernel prints each 32-bit word in host byte order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            queue = int(fields[4].split(":")[1], 16)
            found[int(fields[9])] = (family, socket.inet_ntop(family, raw), int(port, 16), queue)
    return found


def socket_descriptors() -> dict[int, int]:
    """Descriptor -> inode of every socket this process holds."""
    held = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return held
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            held[int(name)] = int(link[8:-1])
    return held


def shut_connection(fd: int, inode: int) -> bool:
    """Shut both directions of the socket ``fd`` if it still is the socket ``inode`` (a
    descriptor closed since may name another file now); whether it was. A thread blocked
    on it, or waiting for it in poll, sees the connection end (a listener stops accepting)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(dup).st_ino != inode:
            return False
        with socket.socket(fileno=dup) as sock:
            dup = -1  # the socket object closes it
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # never connected, or reset already
                return False
        return True
    finally:
        if dup >= 0:
            os.close(dup)


def listening_sockets() -> dict[int, tuple[int, int, str, int]]:
    """Descriptor -> (inode, family, address, port) of every listening TCP socket this
    process holds."""
    inodes = _listening_inodes()
    return {fd: (inode, *inodes[inode][:3]) for fd, inode in socket_descriptors().items() if inode in inodes}


class Door:
    """The admission of one listening socket: who may connect, and for how long.

    ``open_for(sources)`` admits the sources while one formation runs; the door shuts when
    the last formation ends. Thread-safe; formations of several views may overlap (an
    abandoned one keeps connecting in the background until its bound)."""

    def __init__(self, fd: int, inode: int, family: int, address: str, port: int) -> None:
        self.fd, self.inode, self.family, self.address, self.port = fd, inode, family, address, port
        self._lock = threading.Lock()
        self._open: dict[int, frozenset[str] | None] = {}  # formation -> sources it admits (None: any)
        self._next = 0
        self.sealed = False
        self.shut_now()

    def open_for(self, sources: Iterable[str] | None) -> Callable[[], None]:
        """Admit ``sources`` (IPv4 addresses; None: any) until the returned function is called."""
        with self._lock:
            self._next += 1
            ticket = self._next
            self._open[ticket] = None if sources is None else frozenset(sources)
            self._apply()

        def close() -> None:
            with self._lock:
                if ticket in self._open:
                    del self._open[ticket]
                    self._apply()
        return close

    def accept_queue(self) -> int:
        """Connections the kernel completed that Gloo has not accepted yet."""
        return _listening_inodes().get(self.inode, (0, "", 0, 0))[3]

    def shut_now(self) -> None:
        with self._lock:
            self._open.clear()
            self._apply()

    def _apply(self) -> None:
        if self.sealed:
            return
        if not self._open:
            sources: set[str] | None = set()
        elif self.family != socket.AF_INET or None in self._open.values():
            sources = None  # an IPv6 listener is not filtered by source while a formation runs
        else:
            sources = set().union(*self._open.values())
            if len(sources) > MAX_ADMITTED:
                sources = None
        try:
            attach(self.fd, program(sources))
        except OSError as exc:  # the kernel refused this filter (its memory bound): a smaller one
            if sources is None:
                log.error("the listener on %s:%d keeps its previous filter: the kernel refused to replace it "
                          "(%s)", self.address, self.port, exc)
                return
            log.warning("the listener on %s:%d admits any source while communicators form: the kernel refused a "
                        "filter naming %d sources (%s)", self.address, self.port, len(sources), exc)
            attach(self.fd, program(None if sources else set()))

    def seal(self) -> None:
        """Close the listening socket for good (the process forms nothing on it again). Its
        descriptor number is taken over by /dev/null, so Gloo, which keeps the number, never
        closes or reads another file through it; the kernel drops the socket from Gloo's
        event loop as its last descriptor closes. A forked child that still holds the socket
        keeps it open, still behind the drop-everything filter."""
        with self._lock:
            if self.sealed:
                return
            self._open.clear()
            self._apply()
            # Connections completed before the filter was in place wait in the accept
            # queue; Gloo's event loop takes them within a tick (10 ms). Only then is the
            # number handed over, so that loop never calls accept on a file that is no socket.
            deadline = time.monotonic() + 1.0
            while self.accept_queue() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)
            placeholder = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.dup2(placeholder, self.fd)
            finally:
                os.close(placeholder)
            self.sealed = True


def guard(make: Callable[[], object], what: str, address: str | None = None) -> tuple[object, Door | None]:
    """Run ``make`` (which creates one listener, e.g. a Gloo device, bound to ``address``
    when given) and put a door on the listening socket it opened. None in place of the
    door, with a warning, when no single new listener is found or the kernel refuses the
    filter."""
    before = set(listening_sockets())
    made = make()
    new = {fd: place for fd, place in listening_sockets().items()
           if fd not in before and (address is None or place[2] == address)}
    if len(new) != 1:
        log.warning("%s: found %d new listening sockets instead of 1; its listener admits every host that "
                    "reaches it", what, len(new))
        return made, None
    (fd, (inode, family, address, port)), = new.items()
    try:
        return made, Door(fd, inode, family, address, port)
    except OSError as exc:
        log.warning("%s: the kernel refused a socket filter on %s:%d (%s); the listener admits every host "
                    "that reaches it", what, address, port, exc)
        return made, None
