"""Lifeguard's two local mechanisms: the local health multiplier and the shrinking suspicion timer."""

from __future__ import annotations

import math


class Awareness:
    """Local health: a score in ``[0, max_multiplier - 1]`` that stretches this member's timeouts.

    Missed acks and missing nacks (evidence that *we* are slow, not our target) raise
    it; successful probes lower it. Every probe interval and timeout is multiplied by
    ``score + 1``, so a struggling member probes less aggressively and accuses less.
    """

    def __init__(self, max_multiplier: int) -> None:
        self.max_multiplier = max(1, max_multiplier)
        self.score = 0

    def apply(self, delta: int) -> None:
        self.score = min(self.max_multiplier - 1, max(0, self.score + delta))

    def scale(self, timeout: float) -> float:
        return timeout * (self.score + 1)


class Suspicion:
    """The timer of one suspected member, shortened by independent confirmations.

    Starts at ``max_timeout`` and falls towards ``min_timeout`` as
    ``max - (max - min) * log(c + 1) / log(k + 1)`` after ``c`` of the ``k`` expected
    confirmations (distinct members other than the first suspecter).
    """

    __slots__ = ("confirmers", "deadline", "incarnation", "k", "max_timeout", "min_timeout", "start")

    def __init__(self, incarnation: int, suspecter: str, start: float, k: int,
                 min_timeout: float, max_timeout: float) -> None:
        self.incarnation = incarnation
        self.start = start
        self.k = k
        self.min_timeout = min_timeout
        self.max_timeout = max_timeout if k > 0 else min_timeout
        self.confirmers = {suspecter}
        self.deadline = start + self.max_timeout

    @property
    def confirmations(self) -> int:
        return len(self.confirmers) - 1

    def confirm(self, suspecter: str) -> bool:
        """Count an independent confirmation; True when it was new (and so worth re-gossiping)."""
        if self.confirmations >= self.k or suspecter in self.confirmers:
            return False
        self.confirmers.add(suspecter)
        fraction = math.log(self.confirmations + 1) / math.log(self.k + 1)
        timeout = max(self.min_timeout, self.max_timeout - (self.max_timeout - self.min_timeout) * fraction)
        self.deadline = self.start + timeout
        return True
