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
        assert figures[("ftcomm_gossip_events_total", (("counter", "datagrams_received"),))] > 0
    finally:
        for g in groups:
            g.shutdown()
    with pytest.raises(OSError):  # the endpoint closed with the group
        urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/metrics", timeout=2)


@pytest.mark.parametrize("port, error", [(-1, ValueError), (70000, ValueError), ("9100", TypeError), (True, TypeError)])
def test_a_bad_metrics_port_is_refused(port, error):
    with pytest.raises(error, match="metrics_port"):
        GroupOptions(metrics_port=port)
