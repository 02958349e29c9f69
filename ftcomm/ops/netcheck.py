"""Network check: latency and bandwidth of every link of a newly founded group, before training.

Opt-in (``GroupOptions.network_check``, ``ftcomm run --network-check``). When a group is
founded (every member of its first view starts together), the members measure every
pair of them over the backend itself, the way training traffic will flow: the pairs are
scheduled as a round-robin tournament (``len(members) - 1`` rounds; in each round every
member is in at most one pair, so a member's link is measured alone), each pair forms a
two-rank communicator through the rendezvous and times a few one-element allreduces
(latency: the fastest round trip of 20) and three allreduces of ``network_check_mb``
(bandwidth: the fastest). Fastest, for both: a process descheduled by a busy CPU only
ever adds time, and what the link itself costs shows in every round. The figures
are then gathered over the group's communicator, so every member judges the same
matrix (:func:`judge`) and holds the same :class:`NetworkReport`.

Judging needs comparisons, not absolute thresholds (a link's speed depends on the
fabric): a *member* is slow when the median of its own links is more than ``factor``
times worse (lower bandwidth or higher latency) than the median of the links it is not
part of; a *link* is slow when it is more than ``factor`` times worse than the median of
all links, and is reported on its own only when no slow member explains it (a bad cable
or switch port between two hosts). Two members have one link and nothing to compare it
with: their figures are reported, nothing is judged.

The schedule and the judgment are pure functions; :func:`measure` runs the rounds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import statistics
import tempfile
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

LATENCY_ROUNDS = 20
BANDWIDTH_ROUNDS = 3  # allreduces of the probe per pair; the fastest counts
MIN_LATENCY_EXCESS_S = 5e-4  # latency differences below this are scheduling noise, not a slow link


@dataclasses.dataclass(frozen=True)
class Link:
    """One pair's figures: round-trip latency of a one-element allreduce (fastest run) and
    bandwidth of the probe allreduce (bytes per second, fastest run)."""

    a: str
    b: str
    latency_s: float
    bandwidth: float


@dataclasses.dataclass(frozen=True)
class NetworkReport:
    members: tuple[str, ...]
    links: tuple[Link, ...]
    slow_members: tuple[str, ...]
    slow_links: tuple[Link, ...]  # slow links no slow member explains
    factor: float
    seconds: float  # how long the check took

    def summary(self) -> list[str]:
        """Lines for a log or a terminal."""
        if not self.links:
            return [f"network check of {len(self.members)} member{'s' if len(self.members) != 1 else ''}: "
                    f"no link to measure"]
        lat = statistics.median(l.latency_s for l in self.links) if self.links else math.nan
        bw = statistics.median(l.bandwidth for l in self.links) if self.links else math.nan
        lines = [f"network check of {len(self.members)} members, {len(self.links)} links in {self.seconds:.2f} s: "
                 f"median latency {lat * 1e3:.3f} ms, median bandwidth {bw / 1e9:.3f} GB/s"]
        for m in self.slow_members:
            own = [l for l in self.links if m in (l.a, l.b)]
            lines.append(f"slow member {m}: median of its links {statistics.median(l.latency_s for l in own) * 1e3:.3f}"
                         f" ms, {statistics.median(l.bandwidth for l in own) / 1e9:.3f} GB/s")
        for l in self.slow_links:
            lines.append(f"slow link {l.a} <-> {l.b}: {l.latency_s * 1e3:.3f} ms, {l.bandwidth / 1e9:.3f} GB/s")
        if not self.slow_members and not self.slow_links and len(self.members) > 2:
            lines.append(f"no slow member or link (factor {self.factor:g})")
        return lines

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "NetworkReport":
        """Raises TypeError, KeyError or ValueError for anything but :meth:`to_json`'s output."""
        return cls(tuple(str(m) for m in data["members"]), tuple(Link(**l) for l in data["links"]),
                   tuple(str(m) for m in data["slow_members"]), tuple(Link(**l) for l in data["slow_links"]),
                   float(data["factor"]), float(data["seconds"]))


def rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of ranks 0..n-1 exactly once, in rounds of disjoint pairs (the circle
    method: rank 0 stays, the others rotate; with n odd one rank sits out each round)."""
    ranks = list(range(n)) + ([None] if n % 2 else [])
    m = len(ranks)
    schedule = []
    for _ in range(m - 1):
        pairs = [(ranks[i], ranks[m - 1 - i]) for i in range(m // 2)]
        schedule.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    return schedule


def _worse(value: float, reference: float, factor: float, higher_is_worse: bool) -> bool:
    if higher_is_worse:
        return value > factor * reference and value - reference > MIN_LATENCY_EXCESS_S
    return value * factor < reference


def judge(members: tuple[str, ...], links: list[Link], factor: float, seconds: float = 0.0) -> NetworkReport:
    """The report every member computes from the same figures (see the module docstring)."""
    slow_members = []
    for m in members:
        own = [l for l in links if m in (l.a, l.b)]
        rest = [l for l in links if m not in (l.a, l.b)]
        if not own or not rest:
            continue
        if (_worse(statistics.median(l.bandwidth for l in own), statistics.median(l.bandwidth for l in rest),
                   factor, False)
                or _worse(statistics.median(l.latency_s for l in own), statistics.median(l.latency_s for l in rest),
                          factor, True)):
            slow_members.append(m)
    slow_links = []
    if len(links) > 1:
        bw, lat = statistics.median(l.bandwidth for l in links), statistics.median(l.latency_s for l in links)
        slow_links = [l for l in links if (_worse(l.bandwidth, bw, factor, False) or _worse(l.latency_s, lat, factor, True))
                      and l.a not in slow_members and l.b not in slow_members]
    return NetworkReport(tuple(members), tuple(links), tuple(slow_members), tuple(slow_links), factor, seconds)


def measure_pair(comm: Any, abort: Any, probe_bytes: int, timeout: float) -> tuple[float, float]:
    """(latency, bandwidth) over a two-rank communicator: both ranks call it together."""
    import torch

    tiny = torch.zeros(1, dtype=torch.float32, device=comm.device)
    comm.allreduce([tiny]).wait(abort, timeout)  # the connection's first use is not timed
    times = []
    for _ in range(LATENCY_ROUNDS):
        began = time.perf_counter()
        comm.allreduce([tiny]).wait(abort, timeout)
        times.append(time.perf_counter() - began)
    probe = torch.zeros(max(1, probe_bytes // 4), dtype=torch.float32, device=comm.device)
    best = math.inf
    for _ in range(BANDWIDTH_ROUNDS):  # a fixed count: both ranks must call as often
        began = time.perf_counter()
        comm.allreduce([probe]).wait(abort, timeout)
        best = min(best, time.perf_counter() - began)
    return min(times), probe.numel() * 4 / best


def round_bound(timeout: float) -> float:
    """The longest a round of the check can take when each of its operations is bounded by
    ``timeout``: forming the pair, the first use, the latency and the bandwidth rounds."""
    return timeout * (LATENCY_ROUNDS + BANDWIDTH_ROUNDS + 2)


def measure(view: Any, me: str, form_pair: Callable[[int, int], Any], gather: Callable[[Any], list],
            abort: Any, probe_bytes: int, timeout: float, factor: float,
            barrier: Callable[[float], None] | None = None) -> NetworkReport:
    """Run every round of the check as member ``me`` of ``view``.

    ``form_pair(lo, hi)``: a two-rank communicator of the view's ranks ``lo`` < ``hi``
    (this member is one of them); ``gather(tensor)``: an allgather over the view's
    communicator; ``barrier(wait)``: a collective over the view's communicator that may
    take up to ``wait`` seconds. With a barrier every member starts each round, and the
    gather, together: a member whose partner is still measuring a slow link in the
    previous round waits for it there (each operation of that round is bounded by
    ``timeout``, the round by :func:`round_bound`) instead of in the pair's formation,
    which gives up after ``timeout``. Raises what the backend raises (CollectiveAborted
    when the view breaks).
    """
    import torch

    started = time.monotonic()
    rank, n = view.rank_of(me), view.size
    mine = torch.full((n, 2), math.nan, dtype=torch.float64)  # (latency, bandwidth) to each rank
    for number, pairs in enumerate(rounds(n)):
        if number and barrier is not None:
            barrier(round_bound(timeout))
        pair = next((p for p in pairs if rank in p), None)
        if pair is None:
            continue  # sits out this round
        log.debug("network check: pair %s of round %s", pair, pairs)
        comm = form_pair(*pair)
        try:
            latency, bandwidth = measure_pair(comm, abort, probe_bytes, timeout)
        except BaseException:
            comm.abandon()
            raise
        comm.close()
        other = pair[1] if pair[0] == rank else pair[0]
        mine[other] = torch.tensor([latency, bandwidth], dtype=torch.float64)
    if barrier is not None:
        barrier(round_bound(timeout))  # the last round may be slow, too
    rows = gather(mine)
    links = []
    for lo, hi in (p for pairs in rounds(n) for p in pairs):
        # Both ends timed the same exchanges: the worse figure of the two stands for the link.
        latency = max(float(rows[lo][hi][0]), float(rows[hi][lo][0]))
        bandwidth = min(float(rows[lo][hi][1]), float(rows[hi][lo][1]))
        links.append(Link(view.members[lo], view.members[hi], latency, bandwidth))
    return judge(tuple(view.members), links, factor, time.monotonic() - started)


def run(loop: Any, comms: Any, probe_bytes: int, factor: float) -> NetworkReport:
    """The check over a worker loop's current view (:class:`~ftcomm.runtime.worker.WorkerLoop`,
    with its :class:`~ftcomm.runtime.live_ports.BackendCommunicators`): pairs form through
    the lower rank's rendezvous store; raises as :func:`measure` does."""
    view, comm, timeout = loop.view, comms.comm, loop.options.formation_timeout
    me = loop.engine.id

    def form_pair(lo: int, hi: int) -> Any:
        a, b = view.members[lo], view.members[hi]
        _, addresses = loop.driver.statuses()
        if a not in addresses:
            from ..errors import CommunicatorError
            raise CommunicatorError(f"{a} is not reachable through gossip")
        return comms.form_communicator(comms.rendezvous.pair_store(view, a, b, *addresses[a]),
                                       0 if me == a else 1, 2, view.id, (a, b))

    # The view-wide collectives count as the group's operations, as every member's do: a
    # member that leaves right after the last one completed it (its record says so), and
    # the others let theirs finish instead of abandoning the check.
    def gather(rows: Any) -> list:
        loop.contributed()
        gathered = [r.cpu() for r in comm.allgather(rows.to(comm.device)).wait(loop.news.abort, timeout)]
        loop.operation_done()
        return gathered

    def barrier(wait: float) -> None:
        import torch
        loop.contributed()
        comm.allreduce([torch.zeros(1, device=comm.device)]).wait(loop.news.abort, wait)
        loop.operation_done()
    return measure(view, me, form_pair, gather, loop.news.abort, probe_bytes, timeout, factor, barrier)


def publish(report: NetworkReport, path: str | None) -> None:
    """Log the report (WARNING when something is slow) and, with ``path``, write it there
    as JSON, atomically (``ftcomm run`` reads it)."""
    slow = report.slow_members or report.slow_links
    for line in report.summary():
        log.log(logging.WARNING if slow else logging.INFO, "%s", line)
    if not path:
        return
    directory, name = os.path.split(os.path.abspath(path))
    tmp = None
    try:  # a private temporary file: several members of one process may publish at once
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(report.to_json(), f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write the network report to %s: %s", path, exc)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
