"""Stragglers: members whose compute is much slower than the others'.

In synchronous data-parallel training every member's step takes as long as the slowest
member's, so the step time says nothing about who is slow. What differs is the
*compute time*: from the end of a member's previous gradient step to the moment it hands
its gradients over (forward, backward, data loading, the user's code). Each member keeps
the median of its last ``window`` compute times and publishes it in its status record;
every member then judges the same published figures: a member is a straggler while its
compute time exceeds ``factor`` times the median of the other members' and that median
by at least ``MIN_EXCESS_S`` (so that noise in very short steps flags nobody), in
``PATIENCE`` judgments in a row; it stops being one after as many judgments without.
(Processes that share CPU cores slow each other down in bursts: on a 2-core machine a
fast member's compute time rose 3x for a few seconds while another member was slow.)

Pure functions and small objects: no threads, clocks, sockets or torch.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics

log = logging.getLogger(__name__)

MIN_EXCESS_S = 0.005
PATIENCE = 3


@dataclasses.dataclass(frozen=True)
class StragglerReport:
    """A member became a straggler (``slow``) or stopped being one, as judged here."""

    member: str
    slow: bool
    compute_s: float  # its published median compute time
    others_s: float  # the median of the other members' published compute times
    at: float  # time.time() of the judgment


class ComputeTimes:
    """This member's last ``window`` compute times and their median."""

    def __init__(self, window: int) -> None:
        self._times: collections.deque[float] = collections.deque(maxlen=window)

    def add(self, seconds: float) -> None:
        if seconds >= 0:
            self._times.append(seconds)

    def median(self) -> float | None:
        return statistics.median(self._times) if self._times else None

    def clear(self) -> None:
        self._times.clear()


def slow_members(times: dict[str, float], factor: float) -> dict[str, float]:
    """The members whose compute time is more than ``factor`` times the median of the
    others' (and more than that median plus ``MIN_EXCESS_S``), each with that median.
    Needs two members with a figure; ``factor`` 0 flags nobody."""
    if factor <= 0 or len(times) < 2:
        return {}
    slow = {}
    for member, seconds in times.items():
        others = statistics.median(t for m, t in times.items() if m != member)
        if seconds > factor * others and seconds - others > MIN_EXCESS_S:
            slow[member] = others
    return slow


class StragglerWatch:
    """Who is a straggler now; :meth:`judge` returns the changes since the last judgment."""

    def __init__(self, factor: float, patience: int = PATIENCE) -> None:
        self.factor = factor
        self.patience = patience
        self.slow: set[str] = set()
        self._streak: dict[str, int] = {}  # member -> judgments in a row that disagree with its state

    def judge(self, times: dict[str, float], at: float) -> list[StragglerReport]:
        flagged = slow_members(times, self.factor)
        reports = []
        for member in sorted(set(flagged) | self.slow | set(self._streak)):
            if member in self.slow and member not in times:  # it left the view or stopped publishing
                self.slow.discard(member)
                self._streak.pop(member, None)
                reports.append(StragglerReport(member, False, float("nan"), float("nan"), at))
                continue
            if (member in flagged) == (member in self.slow):
                self._streak.pop(member, None)
                continue
            self._streak[member] = self._streak.get(member, 0) + 1
            if self._streak[member] < self.patience:
                continue
            del self._streak[member]
            rest = [t for m, t in times.items() if m != member]
            others = statistics.median(rest) if rest else float("nan")  # it is the only one left with a figure
            if member in flagged:
                self.slow.add(member)
                reports.append(StragglerReport(member, True, times[member], others, at))
            else:
                self.slow.discard(member)
                reports.append(StragglerReport(member, False, times[member], others, at))
        return reports


class Stragglers:
    """One worker's straggler bookkeeping: its own compute times (published), its judgments
    of the view's members (``reports``: the changes), and, with ``policy="exclude"``,
    whether it asks to stand aside (``asking``: it judges itself a straggler; the steps'
    verdict, the same on every member, chooses who does, see ftcomm.core.engine's ASIDE_DUE)
    and for how long (:meth:`bench`)."""

    def __init__(self, factor: float, window: int, policy: str = "warn", cooldown: float = 30.0) -> None:
        self.compute = ComputeTimes(window)
        self.watch = StragglerWatch(factor)
        self.reports: list[StragglerReport] = []
        self.policy = policy
        self.cooldown = cooldown
        self.asking = False
        self._benches = 0

    def judge(self, me: str, members: tuple[str, ...], compute: dict[str, float], at: float) -> list[StragglerReport]:
        """Judge the view's ``members`` by their published ``compute`` times; the new reports."""
        if self.watch.factor <= 0:
            return []
        new = self.watch.judge({m: compute[m] for m in members if m in compute}, at)
        self.reports += new
        for report in new:
            if not report.slow:
                log.info("%s is no longer a straggler", report.member)
                continue
            log.warning("%s is a straggler: %.3f s of compute per step against %.3f s for the others "
                        "(straggler_factor %g)", report.member, report.compute_s, report.others_s, self.watch.factor)
        self.asking = self.policy == "exclude" and me in self.watch.slow
        return new

    @staticmethod
    def chosen(asking: list[int], world: int, min_workers: int) -> list[int]:
        """Of the ranks asking to stand aside (every member sees the same, reduced with a
        step), those that do: the highest ranks (the youngest members) first, as many as
        ``min_workers`` leaves room for."""
        return sorted(asking, reverse=True)[:max(0, world - min_workers)]

    def bench(self) -> float:
        """Stand aside now: for how long (the cooldown, doubled at each further time, at most
        8 times it). The judgments start afresh."""
        seconds = self.cooldown * 2 ** min(self._benches, 3)
        self._benches += 1
        self.asking = False
        self.compute.clear()
        self.watch = StragglerWatch(self.watch.factor, self.watch.patience)
        return seconds
