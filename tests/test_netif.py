"""Interfaces of this machine, and the data plane following the bound address."""

from __future__ import annotations

import pytest

from ftcomm import netif
from ftcomm.backends import gloo, nccl


def test_every_loopback_address_is_held_by_the_loopback_interface():
    for host in ("127.0.0.1", "127.0.0.42", "localhost"):
        interface = netif.interface_of(host)
        assert interface is not None and interface.loopback, host
    assert netif.is_loopback("127.0.0.2") and not netif.is_loopback("10.1.2.3")


def test_an_address_of_this_machine_is_found_on_its_interface():
    for interface in netif.interfaces():
        if not interface.loopback and "%" not in interface.address:
            assert netif.interface_of(interface.address) == interface
            return
    pytest.skip("this machine has no non-loopback address")


def test_the_wildcard_and_foreign_addresses_name_no_interface():
    assert netif.interface_of("0.0.0.0") is None and netif.is_wildcard("0.0.0.0")
    assert netif.interface_of("203.0.113.77") is None  # TEST-NET-3: never an address of this machine


def test_nccl_is_pointed_at_the_interface_of_the_bind_address_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv(nccl.ENV_SOCKET_IFNAME, raising=False)
    lo = netif.interface_of("127.0.0.1").name
    assert nccl.select_interface("127.0.0.1") == f"={lo}"
    monkeypatch.setenv(nccl.ENV_SOCKET_IFNAME, "ib0")
    assert nccl.select_interface("127.0.0.1") == "ib0"
    monkeypatch.delenv(nccl.ENV_SOCKET_IFNAME)
    assert nccl.select_interface("0.0.0.0") is None
    assert nccl.ENV_SOCKET_IFNAME not in __import__("os").environ


def test_the_gloo_device_listens_on_the_bound_address():
    import datetime

    import torch
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=10)
    options._devices = [gloo.device("127.0.0.1")]
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, options)
    t = torch.ones(3)
    group.allreduce([t]).wait()
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_a_name_resolves_to_its_ipv4_address_even_when_ipv6_comes_first(monkeypatch):
    import socket

    real = socket.getaddrinfo

    def ipv6_first(host, port, family=0, *args, **kwargs):
        if host != "dual.test":
            return real(host, port, family, *args, **kwargs)
        v6 = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0))
        v4 = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))
        return [r for r in (v6, v4) if family in (0, r[0])]
    monkeypatch.setattr(socket, "getaddrinfo", ipv6_first)
    assert netif.resolve("dual.test") == "127.0.0.1"
