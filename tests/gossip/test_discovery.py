"""Seeds found in DNS (``dns://NAME:PORT``, a Kubernetes headless Service): parsing,
resolution, joining through them, and finding members again while running."""

from __future__ import annotations

import random
import socket
import threading

import pytest

from ftcomm.errors import JoinError
from ftcomm.gossip import GossipConfig, GossipNode
from ftcomm.gossip.addresses import parse_seed, resolve, system_resolver
from ftcomm.gossip.config import RECONTACT_FANOUT

from ..polling import wait_until

pytestmark = pytest.mark.timeout(60)

FAST = GossipConfig(probe_interval=0.2, probe_timeout=0.08, gossip_interval=0.05, suspicion_mult=3,
                    join_timeout=5.0, join_retry_interval=0.05)
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]  # one loopback address per "pod", one port for all


def common_port() -> int:
    """A port free for TCP and UDP on every address of HOSTS, as every pod of a job uses one."""
    for _ in range(200):
        port = random.randint(20000, 60000)
        sockets = []
        try:
            for host in HOSTS:
                for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                    s = socket.socket(socket.AF_INET, kind)
                    sockets.append(s)
                    s.bind((host, port))
            return port
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no common free port")


class FakeDns:
    """A resolver whose records the test changes, as pods come and go."""

    def __init__(self, records: dict[str, list[str]]) -> None:
        self.records = records
        self.lookups = 0

    def __call__(self, name: str) -> list[str]:
        self.lookups += 1
        return list(self.records.get(name, []))


@pytest.mark.parametrize("seed, parsed", [
    ("dns://workers.default.svc:7946", ("workers.default.svc", 7946, True)),
    ("DNS://workers:7946", ("workers", 7946, True)),
    ("10.0.0.4:7946", ("10.0.0.4", 7946, False)),
])
def test_seeds_parse(seed, parsed):
    assert parse_seed(seed) == parsed


@pytest.mark.parametrize("seed, message", [
    ("dns://workers", "no port"),
    ("dns://workers:0", "gossip port"),
    ("dns://:7946", "empty host"),
    ("dns://workers:x", "not a number"),
])
def test_malformed_dns_seeds_are_refused_with_the_reason(seed, message):
    with pytest.raises(ValueError, match=message):
        parse_seed(seed)


def test_a_dns_seed_stands_for_every_ipv4_address_of_its_name():
    dns = FakeDns({"workers": ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fe80::1"], "empty": []})
    assert resolve(["dns://workers:7946", "10.0.0.9:7000", "dns://empty:7946", "10.0.0.1:7946"], dns) == [
        ("10.0.0.2", 7946), ("10.0.0.1", 7946), ("10.0.0.9", 7000)]


def test_the_system_resolver_answers_and_a_name_not_published_yet_is_no_error():
    assert "127.0.0.1" in system_resolver("localhost")
    assert system_resolver("no-such-name.invalid") == []


def test_workers_started_together_find_each_other_through_one_dns_name():
    port = common_port()
    dns = FakeDns({"workers": HOSTS})
    nodes: list[GossipNode] = []
    errors: list[BaseException] = []

    def start(host: str) -> None:
        node = GossipNode((host, port), config=FAST, secret="k", resolver=dns)
        nodes.append(node)
        try:
            node.start([f"dns://workers:{port}"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=start, args=(h,)) for h in HOSTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert not errors
        wait_until(lambda: all(len(n.live_members()) == 3 for n in nodes), 10, "one cluster of three")
    finally:
        for node in nodes:
            node.stop()


def test_the_first_worker_starts_the_cluster_once_the_name_lists_it_alone():
    port = common_port()
    dns = FakeDns({})
    first = GossipNode((HOSTS[0], port), config=FAST, resolver=dns)
    timer = threading.Timer(0.5, lambda: dns.records.update({"workers": [HOSTS[0]]}))  # its record appears
    timer.start()
    try:
        first.start([f"dns://workers:{port}"])
        assert dns.lookups > 1 and len(first.live_members()) == 1
        dns.records["workers"] = HOSTS[:2]
        second = GossipNode((HOSTS[1], port), config=FAST, resolver=dns).start([f"dns://workers:{port}"])
        try:
            wait_until(lambda: len(first.live_members()) == 2 == len(second.live_members()), 10, "the second joined")
        finally:
            second.stop()
    finally:
        timer.cancel()
        first.stop()


def test_a_name_that_lists_only_others_who_never_answer_is_a_join_error():
    port = common_port()
    dns = FakeDns({"workers": HOSTS[1:]})
    node = GossipNode((HOSTS[0], port), config=FAST.with_overrides(join_timeout=0.5), resolver=dns)
    with pytest.raises(JoinError, match=r"dns://workers"):
        node.start([f"dns://workers:{port}"])


def test_members_that_started_apart_find_each_other_when_the_name_is_looked_up_again():
    port = common_port()
    config = FAST.with_overrides(dns_refresh_interval=0.2)
    dns_a, dns_b = FakeDns({"workers": [HOSTS[0]]}), FakeDns({"workers": [HOSTS[1]]})  # each saw only itself
    a = GossipNode((HOSTS[0], port), config=config, resolver=dns_a).start([f"dns://workers:{port}"])
    b = GossipNode((HOSTS[1], port), config=config, resolver=dns_b).start([f"dns://workers:{port}"])
    try:
        assert len(a.live_members()) == len(b.live_members()) == 1
        dns_a.records["workers"] = HOSTS[:2]
        wait_until(lambda: len(a.live_members()) == 2 == len(b.live_members()), 10, "the two found each other")
        assert a.stats()["rediscovered"] >= 1
    finally:
        a.stop()
        b.stop()


def test_a_cut_off_member_asks_only_a_few_of_its_seeds_each_time():
    """recontact_seeds (a member that lost sight of the others asks again, every couple of
    seconds) sends a join request to RECONTACT_FANOUT seeds not live here, not to all: a
    large group cut in two must not flood the network."""
    port = common_port()
    silent = [f"127.0.1.{i}" for i in range(1, 11)]  # ten addresses nobody listens on
    dns = FakeDns({"workers": HOSTS[:1]})
    config = FAST.with_overrides(dns_refresh_interval=3600.0)
    node = GossipNode((HOSTS[0], port), config=config, resolver=dns).start([f"dns://workers:{port}"])
    try:
        dns.records["workers"] = HOSTS[:1] + silent
        before, lookups = node.stats().get("rediscovered", 0), dns.lookups
        node.recontact_seeds()
        wait_until(lambda: dns.lookups > lookups and node.stats().get("rediscovered", 0) > before, 10, "a recontact")
        assert node.stats()["rediscovered"] - before == RECONTACT_FANOUT < len(silent)
    finally:
        node.stop()


def test_a_group_joins_through_a_dns_name_resolved_by_the_system():
    """ftcomm.init with a dns:// peer: the founder is what localhost resolves to; a second
    worker, on another loopback address, finds it by the name."""
    import ftcomm
    from tests.test_group_threads import in_threads

    port = common_port()
    groups: list = [None, None]

    def start(i: int) -> None:
        groups[i] = ftcomm.init(peers=[f"dns://localhost:{port}"], bind=f"{HOSTS[i]}:{port}", min_workers=2,
                                handle_signals=False, init_timeout=30, settle_interval=0.3)
    threads = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    try:
        assert all(groups) and {g.world_size for g in groups} == {2}
        totals = in_threads(groups, lambda i, g: g.execute(g.allreduce, __import__("torch").ones(2)).tolist())
        assert totals == [[2.0, 2.0], [2.0, 2.0]]
    finally:
        for g in groups:
            if g is not None:
                g.shutdown()
