"""The network check: its schedule, its judgment, and a real run over Gloo."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from ftcomm.ops.netcheck import Link, judge, rounds


@pytest.mark.parametrize("n", range(2, 10))
def test_every_pair_is_measured_once_and_nobody_is_in_two_pairs_of_a_round(n):
    schedule = rounds(n)
    pairs = [p for r in schedule for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(n), 2))
    assert len(schedule) == n - 1 + n % 2
    for r in schedule:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks))


def links(figures: dict[tuple[str, str], tuple[float, float]]) -> list[Link]:
    return [Link(a, b, lat, bw) for (a, b), (lat, bw) in figures.items()]


def matrix(members: str, slow: str = "", lat: float = 1e-4, bw: float = 1e9) -> list[Link]:
    return links({(a, b): ((lat * 10, bw / 10) if slow in (a, b) else (lat, bw))
                  for a, b in itertools.combinations(members, 2)})


def test_a_member_whose_links_are_all_slow_is_named_and_its_links_are_not_reported_twice():
    report = judge(tuple("abcd"), matrix("abcd", slow="c"), 2.0)
    assert report.slow_members == ("c",) and report.slow_links == ()
    report = judge(tuple("abc"), matrix("abc", slow="b"), 2.0)  # two of three links slow: still found
    assert report.slow_members == ("b",)
    assert any("slow member b" in line for line in report.summary())


def test_one_bad_link_between_healthy_members_is_named_alone():
    figures = {p: (1e-4, 1e9) for p in itertools.combinations("abcd", 2)}
    figures[("b", "d")] = (1e-4, 1e8)
    report = judge(tuple("abcd"), links(figures), 2.0)
    assert report.slow_members == () and [(l.a, l.b) for l in report.slow_links] == [("b", "d")]


def test_a_uniform_network_and_small_differences_name_nothing():
    figures = {p: (1e-4 * (1 + 0.3 * i % 1), 1e9 * (1 - 0.3 * (i % 2)))
               for i, p in enumerate(itertools.combinations("abcde", 2))}
    report = judge(tuple("abcde"), links(figures), 2.0)
    assert report.slow_members == () and report.slow_links == ()
    assert "no slow member or link" in report.summary()[-1]
    # 10 us against 30 us of latency is more than 2x but no slow link
    tiny = judge(tuple("abc"), links({("a", "b"): (1e-5, 1e9), ("a", "c"): (1e-5, 1e9), ("b", "c"): (3e-5, 1e9)}), 2.0)
    assert tiny.slow_links == () and tiny.slow_members == ()


def test_a_group_of_one_has_no_link_and_says_so():
    assert judge(("a",), [], 2.0).summary() == ["network check of 1 member: no link to measure"]


def test_two_members_are_measured_but_not_judged():
    report = judge(("a", "b"), [Link("a", "b", 1.0, 1.0)], 2.0)
    assert report.slow_members == () and report.slow_links == () and len(report.links) == 1
    assert json.loads(json.dumps(report.to_json()))["links"][0]["a"] == "a"
    assert not math.isnan(float(report.summary()[0].split("latency ")[1].split()[0]))


@pytest.mark.parametrize("n, rank", [(3, 0), (3, 2), (4, 1)])
def test_every_round_and_the_gather_start_together_behind_a_barrier_that_outlasts_a_round(n, rank):
    import torch

    from ftcomm.ops.netcheck import BANDWIDTH_ROUNDS, LATENCY_ROUNDS, measure
    from ftcomm.core.view import View

    events: list = []

    class Done:
        def wait(self, abort, timeout):
            return None

    class PairComm:
        device = "cpu"

        def allreduce(self, tensors):
            return Done()

        def close(self):
            pass

        def abandon(self):
            pass

    def form_pair(lo, hi):
        events.append(("pair", lo, hi))
        return PairComm()

    def gather(rows):
        events.append(("gather",))
        return [torch.ones(n, 2, dtype=torch.float64)] * n

    view = View(1, tuple(f"m{i}" for i in range(n)))
    report = measure(view, f"m{rank}", form_pair, gather, None, 64, 10.0, 2.0,
                     barrier=lambda wait: events.append(("barrier", wait)))
    assert len(report.links) == n * (n - 1) // 2
    expected = []
    for number, pairs in enumerate(rounds(n)):
        if number:
            expected.append(("barrier", 10.0 * (LATENCY_ROUNDS + BANDWIDTH_ROUNDS + 2)))
        expected += [("pair", *p) for p in pairs if rank in p]
    expected += [("barrier", 10.0 * (LATENCY_ROUNDS + BANDWIDTH_ROUNDS + 2)), ("gather",)]
    assert events == expected


def test_founding_members_check_their_links_and_a_joiner_does_not(tmp_path, monkeypatch):
    import ftcomm
    from .conftest import free_port
    from .test_group_threads import start_groups

    report_file = tmp_path / "network.json"
    monkeypatch.setenv("FTCOMM_NETWORK_REPORT", str(report_file))
    groups = start_groups(3, network_check=True, network_check_mb=1.0)
    joiner = None
    try:
        reports = [g.network_report for g in groups]
        assert all(r is not None for r in reports)
        assert len({(r.members, tuple((l.a, l.b) for l in r.links)) for r in reports}) == 1
        assert len(reports[0].links) == 3 and all(l.bandwidth > 0 and l.latency_s > 0 for l in reports[0].links)
        assert json.loads(report_file.read_text())["members"] == list(reports[0].members)
        # A worker joining a running group does not run it (the others are training).
        import threading

        import torch

        from .test_group_threads import linear_models

        models, optimizers = linear_models(groups)
        stop_at: list[int] = []

        def train(g, m, o) -> None:
            while not stop_at or g.step < stop_at[0]:
                m(torch.ones(8, 4)).pow(2).sum().backward()
                if g.wait_gradients_ready(m):
                    o.step()
                o.zero_grad()
        trainers = [threading.Thread(target=train, args=args, daemon=True) for args in zip(groups, models, optimizers)]
        for t in trainers:
            t.start()
        joiner = ftcomm.init(peers=[groups[0].gossip.address], bind=f"127.0.0.1:{free_port()}", handle_signals=False,
                             min_workers=2, network_check=True, settle_interval=0.5, init_timeout=30)
        assert joiner.network_report is None and joiner.world_size == 4
        # The others wait for it in the first step of the new view: none is more than a step ahead.
        stop_at.append(max(g.step for g in groups) + 3)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        joiner.register_state(model=model, optimizer=optimizer)
        train(joiner, model, optimizer)
        for t in trainers:
            t.join(30)
        assert len({g.state.digest(g.step) for g in groups + [joiner]}) == 1
    finally:
        for g in groups + ([joiner] if joiner else []):
            g.shutdown()


def test_a_member_that_crashes_during_the_check_is_named_a_crash_at_once(monkeypatch):
    # The check runs right after the founding view formed: a member killed then must be
    # probed and declared dead as after any collective, not left to its suspicion timeout
    # (the view after it would be named a hang).
    from ftcomm.errors import CommunicatorError
    from ftcomm.ops import netcheck

    from .test_group_threads import start_groups

    groups = start_groups(2)
    try:
        g, other = groups
        probed = []

        def refused(addresses, timeout, settle=0.0):
            probed.extend(addresses)
            return [True] * len(addresses)

        monkeypatch.setattr(g._loop.driver.ports.prober, "refused", refused)
        monkeypatch.setattr(netcheck, "run", lambda *a: (_ for _ in ()).throw(CommunicatorError("connection reset")))
        g._check_network()
        assert [f"{host}:{port}" for host, port in probed] == [other.gossip.address]
        assert g._loop.engine.fault == "crash"
    finally:
        for group in groups:
            group.shutdown()


def test_a_member_leaving_right_after_the_check_does_not_abandon_it_for_a_slower_one(monkeypatch, caplog):
    """The check's last collective (the gather of the results) completes everywhere; one
    member leaves at once, another sees its gather complete only later. Its leave record
    says it completed that collective, so the slower member lets it finish: the check is
    not abandoned (before, the check's collectives did not count as operations, and it
    was)."""
    import threading
    import time

    import ftcomm
    from ftcomm.backends.gloo import GlooCommunicator
    from ftcomm.errors import CollectiveAborted

    from .conftest import free_port

    real_allgather = GlooCommunicator.allgather

    class Late:
        """The gather, as seen by a member whose copy of it is still arriving when the
        leaver's news does: aborted if that news fires the abort signal."""

        def __init__(self, handle) -> None:
            self.handle = handle

        def wait(self, abort, timeout=None):
            deadline = time.monotonic() + 1.0  # within leave_grace (2 s)
            while abort.check() is None and time.monotonic() < deadline:  # the news is judged meanwhile
                time.sleep(0.01)
            if abort.reason is not None:
                raise CollectiveAborted(f"allgather abandoned: {abort.reason}")
            return self.handle.wait(abort, timeout)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def allgather(self, tensor):
        handle = real_allgather(self, tensor)
        return Late(handle) if threading.current_thread().name == "slow" else handle
    monkeypatch.setattr(GlooCommunicator, "allgather", allgather)
    ports = [free_port() for _ in range(3)]
    groups: list = [None] * 3

    def start(i: int) -> None:
        groups[i] = ftcomm.init(peers=[f"127.0.0.1:{ports[0]}"] if i else [], bind=f"127.0.0.1:{ports[i]}",
                                min_workers=3, handle_signals=False, init_timeout=30, settle_interval=0.5,
                                network_check=True, network_check_mb=0.25)
        if i == 0:
            groups[i].shutdown()  # leaves as soon as its check is done
    threads = [threading.Thread(target=start, args=(i,), name="slow" if i == 2 else f"g{i}", daemon=True)
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert all(g is not None for g in groups)
        assert groups[2].network_report is not None, caplog.text[-2000:]
        assert "network check abandoned" not in caplog.text
    finally:
        for g in groups:
            if g is not None:
                g.shutdown()
