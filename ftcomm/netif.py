"""Network interfaces: which one holds an address (the data plane follows the bound address)."""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
from dataclasses import dataclass

IFF_LOOPBACK = 0x8


@dataclass(frozen=True)
class Interface:
    name: str
    address: str
    loopback: bool


class _SockaddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16), ("addr", ctypes.c_uint8 * 4)]


class _SockaddrIn6(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16), ("flowinfo", ctypes.c_uint32),
                ("addr", ctypes.c_uint8 * 16)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [("next", ctypes.POINTER(_Ifaddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.c_void_p), ("netmask", ctypes.c_void_p), ("broadaddr", ctypes.c_void_p),
                     ("data", ctypes.c_void_p)]


def interfaces() -> list[Interface]:
    """Every address of every interface that is up (``getifaddrs``), IPv4 and IPv6."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    found = []
    try:
        entry = head
        while entry:
            item = entry.contents
            if item.addr:
                family = ctypes.cast(item.addr, ctypes.POINTER(ctypes.c_ushort)).contents.value
                address = None
                if family == socket.AF_INET:
                    raw = bytes(ctypes.cast(item.addr, ctypes.POINTER(_SockaddrIn)).contents.addr)
                    address = socket.inet_ntop(socket.AF_INET, raw)
                elif family == socket.AF_INET6:
                    raw = bytes(ctypes.cast(item.addr, ctypes.POINTER(_SockaddrIn6)).contents.addr)
                    address = socket.inet_ntop(socket.AF_INET6, raw)
                if address is not None:
                    found.append(Interface(item.name.decode(), address, bool(item.flags & IFF_LOOPBACK)))
            entry = item.next
    finally:
        libc.freeifaddrs(head)
    return found


def resolve(host: str) -> str:
    """The IP address of ``host``, as a string: an address as it is, a name by its IPv4
    address (ftcomm's planes speak IPv4; a name whose IPv6 address comes first, as
    ``localhost`` on many systems, must not end up half on each). Raises OSError
    (``socket.gaierror``) when the name has no IPv4 address."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)[0][4][0]


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(resolve(host)).is_loopback


def is_wildcard(host: str) -> bool:
    return ipaddress.ip_address(resolve(host)).is_unspecified


def interface_of(host: str) -> Interface | None:
    """The interface that holds ``host``'s address; for any loopback address (127.0.0.0/8,
    all of which the loopback interface answers), the loopback interface. None when no
    interface of this machine holds it, or for the wildcard address."""
    address = ipaddress.ip_address(resolve(host))
    if address.is_unspecified:
        return None
    every = interfaces()
    for interface in every:
        if ipaddress.ip_address(interface.address.split("%")[0]) == ipaddress.ip_address(str(address).split("%")[0]):
            return interface
    if address.is_loopback:
        return next((i for i in every if i.loopback and ipaddress.ip_address(i.address).version == address.version),
                    None)
    return None
