"""Addresses: ``HOST:PORT`` parsing, and seeds (the addresses a member joins through),
given as ``HOST:PORT`` or found in DNS.

``dns://NAME:PORT`` stands for every IPv4 address ``NAME`` resolves to, each with
``PORT``: the A records of a Kubernetes headless Service list the pods behind it, so a
job's workers can be given one peer string that finds all of them. The name is resolved
again on every join attempt and then every ``dns_refresh_interval`` seconds while the
member runs (see :class:`~ftcomm.gossip.runtime.GossipNode`).
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Callable, Iterable


DNS_SCHEME = "dns://"

def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"`` or ``(host, port)`` to ``(host, port)``, checking the form only (no lookup).

    The host must be non-empty and the port a decimal number with 0 <= port <= 65535 (0:
    an automatic port); a member id ``host:port/nonce`` gives its address. Raises
    ValueError naming the address and the accepted form for a malformed one, TypeError
    for something that is neither a string nor a ``(host, port)`` pair.
    """
    accepted = "expected HOST:PORT with a non-empty HOST and 0 <= PORT <= 65535"
    if isinstance(address, str):
        host, colon, port = address.split("/", 1)[0].strip().rpartition(":")
        if not colon:
            raise ValueError(f"bad address {address!r}: no port; {accepted}")
    elif isinstance(address, tuple) and len(address) == 2:
        host, port = address
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, (int, str)):
            raise TypeError(f"bad address {address!r}: expected a (host, port) pair of a str and an int")
    else:
        raise TypeError(f"bad address {address!r}: expected a 'HOST:PORT' string or a (host, port) pair, "
                        f"not {type(address).__name__}")
    host = host.strip()
    if not host:
        raise ValueError(f"bad address {address!r}: empty host; {accepted}")
    if isinstance(port, str):
        digits = port.strip()
        if not (digits.isascii() and digits.isdigit()):
            raise ValueError(f"bad address {address!r}: port {port!r} is not a number; {accepted}")
        port = int(digits)
    if not 0 <= port <= 65535:
        raise ValueError(f"bad address {address!r}: port {port} is out of range; {accepted}")
    return host, port


Resolver = Callable[[str], list[str]]
"""A name to its IPv4 addresses (empty when it does not resolve now)."""


def system_resolver(name: str) -> list[str]:
    """The IPv4 addresses of ``name`` from the system resolver, in its order; none when
    the lookup fails (a name not published yet is not an error: it is looked up again)."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return [info[4][0] for info in infos]


def is_dns(seed: object) -> bool:
    return isinstance(seed, str) and seed.strip().lower().startswith(DNS_SCHEME)


def parse_seed(seed: str | tuple[str, int]) -> tuple[str, int, bool]:
    """``(host, port, is_dns)`` of a seed; ValueError or TypeError naming a malformed one.
    A DNS seed needs a port: it is the members' gossip port."""
    if is_dns(seed):
        text = seed.strip()[len(DNS_SCHEME):]
        host, port = parse_address(text)
        if port == 0:
            raise ValueError(f"bad seed {seed!r}: a dns:// seed needs the members' gossip port (dns://NAME:PORT)")
        return host, port, True
    host, port = parse_address(seed)
    return host, port, False


def resolve(seeds: Iterable[str | tuple[str, int]], resolver: Resolver = system_resolver) -> list[tuple[str, int]]:
    """The addresses ``seeds`` stand for now: a ``HOST:PORT`` as given, a ``dns://`` seed
    as every IPv4 address its name resolves to (duplicates removed, order kept)."""
    out: list[tuple[str, int]] = []
    for seed in seeds:
        host, port, dns = parse_seed(seed)
        hosts = [a for a in resolver(host) if _ipv4(a)] if dns else [host]
        for address in ((h, port) for h in hosts):
            if address not in out:
                out.append(address)
    return out


def _ipv4(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 4
    except ValueError:
        return False
