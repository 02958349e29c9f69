"""A Prometheus endpoint for one worker (``GroupOptions.metrics_port``; extra ``[metrics]``).

Nothing is counted on the training path: every figure is read from the group when the
endpoint is scraped (its view changes, committed step, compute time, stragglers, and its
gossip counters). The endpoint listens on the worker's bind address, serves only these
read-only figures, and is not authenticated: it serves at most ``MAX_CONNECTIONS``
connections at once (more are closed) and closes one idle for ``IDLE_TIMEOUT_S``.

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
import socketserver
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from ..errors import AddressError

log = logging.getLogger(__name__)

PHASES = ("detect", "agree", "form", "reconcile")

MAX_CONNECTIONS = 8
"""Connections served at once; more are closed at once (each one served holds a thread)."""

IDLE_TIMEOUT_S = 5.0
"""A connection that sends nothing for this long is closed."""


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
        view = group.view  # read once: the training thread may leave it meanwhile (a straggler standing aside)
        rank = view.rank_of(group.id) if view is not None and group.id in view.members else -1
        for name, value, text in (("ftcomm_view_id", view.id if view else 0, "The current view's id"),
                                  ("ftcomm_world_size", view.size if view else 0, "Members of the current view"),
                                  ("ftcomm_rank", rank, "This worker's rank"),
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
        corruptions = CounterMetricFamily("ftcomm_state_divergences",
                                          "Checks whose state fingerprints differed (silent data corruption), by "
                                          "whether this worker was named", labels=["named"])
        found = list(group.corruptions)
        named = sum(1 for c in found if group.id in c.named)
        corruptions.add_metric(["true"], named)
        corruptions.add_metric(["false"], len(found) - named)
        yield corruptions
        if group.replica_size > 1:
            repairs = list(group.repairs)
            yield CounterMetricFamily("ftcomm_replica_repairs", "Repairs in place of this process's sharded replica "
                                      "(a lost process replaced while this one kept its state)", value=len(repairs))
            seconds = SummaryMetricFamily("ftcomm_replica_repair_seconds", "From the loss to the repaired replica "
                                          "back in a view")
            seconds.add_metric([], len(repairs), sum(repairs))
            yield seconds
        yield GaugeMetricFamily("ftcomm_restarts", "Times the launcher started this worker again (ftcomm run: "
                                "$FTCOMM_RESTARTS; a process that replaced a replica's lost one counts one)",
                                value=group.restarts)
        try:
            stats = group.gossip.stats()
        except Exception:  # noqa: BLE001 - the node is stopping: no gossip figures in this scrape
            stats = {}
        gossip = CounterMetricFamily("ftcomm_gossip_events", "The membership layer's counters",
                                     labels=["counter"])
        for key, value in sorted(stats.items()):
            gossip.add_metric([key], value)
        yield gossip


class _Handler(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``MAX_CONNECTIONS`` of them: the endpoint is not
    authenticated, and connections that send nothing must not exhaust the worker."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int]) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # busy: closed at once
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics request from %s failed", client_address, exc_info=True)  # idle, reset: not news

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsServer:
    """The HTTP endpoint; :meth:`close` stops it."""

    def __init__(self, group: Any, host: str, port: int) -> None:
        try:
            from prometheus_client import CollectorRegistry, make_wsgi_app
        except ImportError:
            raise ImportError("metrics_port needs prometheus-client: pip install 'ftcomm[metrics]'") from None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(GroupCollector(group))
        try:
            self._server = _Server((host, port))
        except OSError as exc:
            raise AddressError(f"cannot serve metrics_port {port} on {host}: {exc.strerror or exc} (with several "
                               f"workers per host, give each its own port: ftcomm run --metrics-port BASE)") from None
        self._server.set_app(make_wsgi_app(self.registry))
        self._thread = threading.Thread(target=self._server.serve_forever, name="ftcomm-metrics", daemon=True)
        self._thread.start()
        self.port = self._server.server_port
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
