"""Silent data corruption: the members compare fingerprints of their training state.

Replicas of a data-parallel group hold bit-identical parameters and optimizer state after
every committed step. Every ``fingerprint_every`` committed steps each member puts a 48-bit
fingerprint of them (:meth:`ftcomm.training.state.TrainingState.fingerprint`) into the next
gradient step's counters, which every member receives reduced: one fingerprint per position
(a rank; a replica's index with sharded replicas, whose processes of one shard index reduce
their counters together). A fingerprint that differs from the majority's names a member
whose state went wrong without anything failing: a flipped bit in a parameter, an optimizer
moment, or the gradient it stepped with. The reconcile of every view compares them too,
among the members that hold the newest step, so that a wrong state never becomes the
group's because its holder had the lowest rank.

What follows is ``sdc_policy``'s (see :class:`ftcomm.GroupOptions`); every member decides
alike, from the same counters (with sharded replicas, from each shard index's action summed
over the view: the most severe wins). The checks run in the step after the state they
fingerprint was committed: a corruption is caught within ``fingerprint_every`` + 1 steps of
the step that carried it in.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..core.engine import Divergence

log = logging.getLogger(__name__)

SDC_REPEAT_CHECKS = 10
"""A member named again within this many checks of a repair leaves the group (its
hardware keeps computing wrong)."""

ACTIONS = ("commit", "repair", "again", "stop")
"""What a step's fingerprints lead to, least severe first: the step commits; it is
discarded and the named members take a majority member's state; it is discarded and
computed again so that every member gives a fingerprint; every member stops."""


def step_action(divergence: Divergence | None, policy: str, complete: bool, again_before: bool) -> str:
    """The action of one comparison (see ACTIONS): ``complete``, every position gave a
    fingerprint; ``again_before``, this step was computed again for that already."""
    if divergence is None or policy == "warn":
        return "commit"
    if not divergence.majority:
        # Some member gave none (its state was just replaced): its vote may decide, once.
        return "again" if not complete and not again_before else "stop"
    return "stop" if policy == "stop" else "repair"


@dataclasses.dataclass(frozen=True)
class Corruption:
    """One comparison whose fingerprints differed: the step they were of, the members named
    (ids), the shard index with sharded replicas (None without), whether a majority agreed,
    and, on a named member once repaired, the tensors that differed from the state it
    received."""

    step: int
    named: tuple[str, ...]
    shard: int | None
    majority: bool
    tensors: tuple[str, ...] = ()


class FingerprintCheck:
    """One worker's side of the comparison: when to give a fingerprint, what it records of
    a divergence, and, on a named worker, which of its tensors were wrong."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.found: list[Corruption] = []  # every divergence seen, oldest first
        self.last_agreed: int | None = None  # the last step every member held one state at
        self.again_at: int | None = None  # the step last computed again to compare every member's
        self.repairing: int | None = None  # the step whose repair the next reconcile makes
        self._checks = 0  # comparisons with at least two fingerprints
        self._named_at: int | None = None  # the comparison at which this worker was last named
        self._before_repair: dict[str, int] | None = None  # its tensors' sums, until it is repaired

    @property
    def agreed_step(self) -> int:
        """The last step every member held one state at (0 before any)."""
        return self.last_agreed if self.last_agreed is not None else 0

    def due(self, step: int) -> bool:
        """Whether the step after committed ``step`` carries a fingerprint."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def take(self, state: Any, step: int) -> int | None:
        """This worker's fingerprint for the step after ``step``, or None when none is due."""
        if not self.due(step) or not state.registered:
            return None
        return state.fingerprint()

    def agreed(self, step: int, fingerprints: tuple[int | None, ...] | None = None) -> None:
        """A comparison whose fingerprints were all equal, or (``fingerprints`` None) a
        reconcile that left every member with one state at ``step``."""
        self._before_repair = None  # (a repair that never came: nothing to name)
        if fingerprints is None:
            self.last_agreed = step
        elif sum(f is not None for f in fingerprints) >= 2:
            self._checks += 1
            self.last_agreed = step

    def record(self, divergence: Divergence, step: int, ids: tuple[str, ...], shard: int | None) -> None:
        """A comparison whose fingerprints differed (``ids``: the members named): kept in
        :attr:`found` and logged."""
        self._checks += 1
        self.found.append(Corruption(step, ids, shard, divergence.majority))
        where = f" (shard {shard})" if shard is not None else ""
        if divergence.majority:
            log.error("silent data corruption: the state of step %d%s differs from the majority's (%d of %d "
                      "fingerprints) on %s", step, where, divergence.voters - len(ids), divergence.voters,
                      ", ".join(ids))
        else:
            log.error("silent data corruption: the states of step %d%s differ and no fingerprint has a majority "
                      "(%s); the last step where all agreed: %s", step, where, ", ".join(ids),
                      self.last_agreed if self.last_agreed is not None else "none")

    def named_again(self, state: Any) -> bool:
        """This worker was named with a majority against it and is to be repaired: whether
        it was named within SDC_REPEAT_CHECKS comparisons of its last repair (it leaves
        instead). Otherwise its tensors' sums are kept, to name the wrong ones once repaired."""
        repeated = self._named_at is not None and self._checks - self._named_at <= SDC_REPEAT_CHECKS
        self._named_at = self._checks
        if not repeated:
            self._before_repair = state.tensor_fingerprints()
        return repeated

    def repaired(self, state: Any) -> None:
        """This worker received a majority member's state after being named: say which of
        its tensors differed from it."""
        before, self._before_repair = self._before_repair, None
        if before is None:
            return
        after = state.tensor_fingerprints()
        wrong = tuple(path for path, value in before.items() if after.get(path) != value)
        if self.found:
            self.found[-1] = dataclasses.replace(self.found[-1], tensors=wrong)
        log.error("repaired from a majority member's state: %d tensors differed (%s)", len(wrong),
                  ", ".join(wrong[:8]) + (f" and {len(wrong) - 8} more" if len(wrong) > 8 else ""))
