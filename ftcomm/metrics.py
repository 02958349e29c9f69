"""A Prometheus endpoint for one worker (``GroupOptions.metrics_port``; extra ``[metrics]``).

Nothing is counted on the training path: every figure is read from the group when the
endpoint is scraped (its view changes, committed step, compute time, stragglers, and its
gossip counters). The endpoint listens on the worker's bind address, serves only these
read-only figures, and is not authenticated.

Metrics (all with the prefix ``ftcomm_``):

- ``view_changes_total{reason}``: views formed since start, by reason (init, crash,
  hang, leave, join, partition, rejoin, straggler, backend);
- ``view_change_seconds{phase}``: a summary of the time of each phase (detect, agree,
  form, reconcile) over those view changes;
- ``view_id``, ``world_size``, ``rank``: the current view;
- ``committed_steps``: the committed training step;
- ``compute_seconds``: this worker's median compute time per gradient step;
- ``stragglers``: members judged stragglers now; ``straggler_reports_total{slow}``;
- ``gossip_events_total{counter}``: the membership layer's counters (datagrams and bytes
  sent and received, probes, refutations, and packets dropped or rejected by reason).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

log = logging.getLogger(__name__)

PHASES = ("detect", "agree", "form", "reconcile")


class GroupCollector:
    """A Prometheus collector reading ``group`` at scrape time."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        group = self.group
        events = list(group.events)
        changes = CounterMetricFamily("ftcomm_view_changes", "Views formed since start, by reason",
                                      labels=["reason"])
        for reason, count in sorted(collections.Counter(e.reason for e in events).items()):
            changes.add_metric([reason], count)
        yield changes
        phases = SummaryMetricFamily("ftcomm_view_change_seconds", "Time of each phase of the view changes",
                                     labels=["phase"])
        for phase in PHASES:
            phases.add_metric([phase], len(events), sum(getattr(e, f"{phase}_s") for e in events))
        yield phases
        view = group.view
        for name, value, text in (("ftcomm_view_id", view.id if view else 0, "The current view's id"),
                                  ("ftcomm_world_size", view.size if view else 0, "Members of the current view"),
                                  ("ftcomm_rank", group.rank if view else -1, "This worker's rank"),
                                  ("ftcomm_committed_steps", group.step, "The committed training step")):
            yield GaugeMetricFamily(name, text, value=value)
        compute = group._stragglers.compute.median()
        if compute is not None:
            yield GaugeMetricFamily("ftcomm_compute_seconds", "Median compute time per gradient step",
                                    value=compute)
        yield GaugeMetricFamily("ftcomm_stragglers", "Members judged stragglers now",
                                value=len(group._stragglers.watch.slow))
        reports = CounterMetricFamily("ftcomm_straggler_reports", "Straggler reports, by kind", labels=["slow"])
        kinds = collections.Counter(r.slow for r in list(group.stragglers))
        for slow in (True, False):
            reports.add_metric([str(slow).lower()], kinds[slow])
        yield reports
        try:
            stats = group.gossip.stats()
        except Exception:  # noqa: BLE001 - the node is stopping: no gossip figures in this scrape
            stats = {}
        gossip = CounterMetricFamily("ftcomm_gossip_events", "The membership layer's counters",
                                     labels=["counter"])
        for key, value in sorted(stats.items()):
            gossip.add_metric([key], value)
        yield gossip


class MetricsServer:
    """The HTTP endpoint; :meth:`close` stops it."""

    def __init__(self, group: Any, host: str, port: int) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise ImportError("metrics_port needs prometheus-client: pip install 'ftcomm[metrics]'") from None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(GroupCollector(group))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(exc.errno, f"metrics_port {port} on {host}: {exc.strerror or exc}") from None
        self.port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
