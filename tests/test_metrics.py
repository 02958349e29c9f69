"""The Prometheus endpoint: scraped over HTTP, the figures match the group."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ftcomm.options import GroupOptions
from tests.test_group_threads import in_threads, start_groups

pytestmark = pytest.mark.timeout(120)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_endpoint_serves_the_groups_figures():
    groups = start_groups(2, metrics_port=0)
    try:
        model = [torch.nn.Linear(4, 2) for _ in groups]
        for g, m in zip(groups, model):
            g.register_state(model=m)

        def train(i, g):
            for _ in range(5):
                model[i](torch.randn(3, 4)).sum().backward()
                assert g.wait_gradients_ready(model[i])
        in_threads(groups, train)
        ports = [g.metrics_port for g in groups]
        assert all(ports) and len(set(ports)) == 2
        figures = scrape(ports[1])
        assert figures[("ftcomm_committed_steps", ())] == 5
        assert figures[("ftcomm_world_size", ())] == 2 and figures[("ftcomm_rank", ())] == groups[1].rank
        assert figures[("ftcomm_view_id", ())] == groups[1].view.id
        reasons = {labels[0][1]: v for (name, labels), v in figures.items() if name == "ftcomm_view_changes_total"}
        assert sum(reasons.values()) == len(groups[1].events) and "init" in reasons
        assert figures[("ftcomm_view_change_seconds_count", (("phase", "agree"),))] == len(groups[1].events)
        assert figures[("ftcomm_compute_seconds", ())] > 0
        assert figures[("ftcomm_stragglers", ())] == 0
        assert figures[("ftcomm_state_divergences_total", (("named", "false"),))] == 0
        assert figures[("ftcomm_gossip_events_total", (("counter", "datagrams_received"),))] > 0
        assert figures[("ftcomm_restarts", ())] == 0  # (FTCOMM_RESTARTS unset: started once)
        assert not any(name.startswith("ftcomm_replica_repair") for name, _ in figures)  # no sharded replica
    finally:
        for g in groups:
            g.shutdown()
    with pytest.raises(OSError):  # the endpoint closed with the group
        urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/metrics", timeout=2)


@pytest.mark.parametrize("port, error", [(-1, ValueError), (70000, ValueError), ("9100", TypeError), (True, TypeError)])
def test_a_bad_metrics_port_is_refused(port, error):
    with pytest.raises(error, match="metrics_port"):
        GroupOptions(metrics_port=port)


def test_idle_connections_to_the_endpoint_hold_a_bounded_number_of_threads():
    """The endpoint is unauthenticated: anyone who reaches it may open connections and send
    nothing. The worker must not start a thread for each of them (thousands would exhaust
    the process): the connections beyond what it serves are closed, and scrapes work again
    once the idle ones are gone."""
    import socket
    import threading

    from ftcomm.ops.metrics import MAX_CONNECTIONS
    from tests.polling import wait_until

    def serving() -> int:
        return sum("process_request_thread" in t.name for t in threading.enumerate())

    (group,) = start_groups(1, metrics_port=0)
    idle = []
    try:
        for _ in range(MAX_CONNECTIONS * 4):
            idle.append(socket.create_connection(("127.0.0.1", group.metrics_port), timeout=5))
        closed = set()

        def refused_beyond_the_limit() -> bool:
            assert serving() <= MAX_CONNECTIONS
            for s in idle:
                if s not in closed:
                    s.settimeout(0.01)
                    try:
                        if s.recv(1) == b"":
                            closed.add(s)
                    except (TimeoutError, OSError):
                        pass
            return len(closed) >= len(idle) - MAX_CONNECTIONS
        wait_until(refused_beyond_the_limit, 10, "the connections beyond the limit closed")
        assert serving() <= MAX_CONNECTIONS
        for s in idle:
            s.close()
        idle.clear()
        wait_until(lambda: _scrapes(group.metrics_port), 30, "a scrape after the idle connections closed")
    finally:
        for s in idle:
            s.close()
        group.shutdown()


def _scrapes(port: int) -> bool:
    try:
        return scrape(port)[("ftcomm_world_size", ())] == 1
    except OSError:
        return False


def test_a_scrape_reads_the_view_once_while_the_worker_leaves_it():
    """The training thread may leave the view (a straggler standing aside) between two reads
    of a scrape: the figures come from the view read first, and the scrape succeeds."""
    from ftcomm.ops.metrics import GroupCollector
    from ftcomm.runtime.stragglers import Stragglers
    from ftcomm.core.view import View

    class Leaving:
        id = "b"
        events: list = []
        step = 7
        stragglers: list = []
        corruptions: list = []
        replica_size, repairs, restarts = 2, [0.5, 0.75], 1
        _stragglers = Stragglers(2.0, 3)
        _views = [View(4, ("a", "b"))]

        @property
        def view(self):
            return self._views.pop() if self._views else None  # gone after the first read

        @property
        def rank(self):
            return self.view.rank_of(self.id)

        @property
        def gossip(self):
            raise RuntimeError("stopped")

    figures = {family.name: family.samples[0].value for family in GroupCollector(Leaving()).collect()
               if family.samples}
    assert (figures["ftcomm_view_id"], figures["ftcomm_world_size"], figures["ftcomm_rank"]) == (4, 2, 1)
    # a sharded replica's repairs in place, apart from the worker's own restarts
    assert figures["ftcomm_replica_repairs"] == 2 and figures["ftcomm_restarts"] == 1
    samples = {s.name: s.value for family in GroupCollector(Leaving()).collect()
               if family.name == "ftcomm_replica_repair_seconds" for s in family.samples}
    assert samples == {"ftcomm_replica_repair_seconds_count": 2, "ftcomm_replica_repair_seconds_sum": 1.25}
