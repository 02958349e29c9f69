"""Releasing a sharded replica's processes when one of them is gone or hung.

FSDP2's collectives run on torch's process group inside the replica, which waits for a
silent process until its timeout (``init_timeout``, minutes). Gossip sees every process
of the replica: :class:`ReplicaWatch` watches this process's partners from a thread of
its own and tears the replica's collectives down (:meth:`Replica.tear_down`) when

- a partner is dead in gossip (with NCCL, a dead peer may leave a collective waiting for
  ever; with Gloo it fails at once by itself; one that left did so after its last
  collective, and the driver's ReplicaLost covers it), or
- this process's training has committed no step for far longer than its steps take
  (``STALL_FACTOR`` times the median of the recent ones, at least ``STALL_MIN_S``, counted
  from when it entered its view) while a partner has been suspected without refuting: the
  watch then probes the partners at once, as a stalled collective does (a partner that
  answers, however busy its host, is never suspected by that probe, and a suspect that
  runs refutes at once). A partner on this host is looked up in /proc: stopped (``T``) or
  gone after ``SILENT_S`` of suspicion; one that runs (a thread holding the GIL for
  seconds starves its gossip too) only once gossip declares it dead. A partner on another
  host, which cannot be looked at, after ``SILENT_REMOTE_S``.

Its training thread then raises from torch (or ftcomm raises ReplicaLost); the process
exits and ``ftcomm run`` starts the whole replica again, instead of after minutes.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

LOOK_S = 0.05
"""How often the watch looks at the partners and the step."""
STALL_MIN_S = 0.3
"""The least time without a committed step that counts as a stall."""
STALL_FACTOR = 4.0
"""A stall is this many times the median time between the recent committed steps."""
SILENT_S = 0.4
"""How long a stopped partner on this host stays suspected while the step stalls."""
SILENT_REMOTE_S = 1.0
"""How long a partner on another host stays suspected while the step stalls. The stall
has the partners probed at once, which tells a live partner it is suspected: it refutes
as soon as its gossip runs (a full garbage collection is announced, and holds the
verdicts on it for ``pause_grace``). This much silence on top of the stall is a lost
host: the replica is released within about 2 s of it going silent."""
STOPPED = ("T", "t", "gone")
"""States of a partner on this host that are a hang (or a death) for sure: stopped,
traced, or no longer running."""


class ReplicaWatch:
    """Watches the partners of this process (``replica``: the
    :class:`~ftcomm.training.replica.Replica`; ``node``: this process's
    :class:`~ftcomm.gossip.GossipNode`) while ``step()`` (the committed steps) and
    ``view()`` (the id of the view this process trains in; None while no step is owed: it
    holds back, re-forms, rejoins, or has not reconciled its first view) say how training
    goes; ``probe_interval``: at most one urgent probe of the partners per this many
    seconds."""

    def __init__(self, replica: Any, node: Any, step: Callable[[], int], view: Callable[[], int | None],
                 probe_interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.replica, self.node, self.step, self.view = replica, node, step, view
        self.probe_interval, self.clock = probe_interval, clock
        self.partners: dict[str, str] = {}  # partner id -> its gossip state at the last look
        self._last_step: int | None = None
        self._last_view: int | None = None  # the view of the last commit (None: none seen since a look out of one)
        self._step_at = clock()
        self._intervals: collections.deque[float] = collections.deque(maxlen=16)
        self._suspected: dict[str, float] = {}  # partner -> since when suspected, while stalled
        self._shards: dict[str, int] = {}  # partner -> its shard rank
        self._probed = float("-inf")
        self.culprit: int | None = None  # the shard rank of the partner the last reason names
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftcomm-replica-watch", daemon=True)

    def start(self) -> ReplicaWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(1.0)

    def _run(self) -> None:
        while not self._stop.wait(LOOK_S):
            try:
                why = self.look(self.clock())
            except Exception:  # the watch must never take the process down
                log.exception("the replica watch failed; it stops watching")
                return
            if why is not None:
                self.replica.tear_down(why, self.culprit)
                return

    def look(self, now: float) -> str | None:
        """One look: why the replica must be torn down now, or None."""
        key, shard = self.replica.key, self.replica.shard_rank
        seen, shards = {}, self._shards
        for m in self.node.snapshot():
            rp = m.metadata.get("rp") if isinstance(m.metadata, dict) else None
            if (isinstance(rp, list) and len(rp) == 3 and rp[0] == key and isinstance(rp[1], int) and rp[1] != shard
                    and m.id != self.node.id):
                seen[m.id], shards[m.id] = m.state, rp[1]
        for member, state in self.partners.items():
            seen.setdefault(member, "left" if state == "left" else "dead")  # removed from the table: gone
        self.partners = seen
        for member, state in seen.items():
            if state == "dead":
                self.culprit = shards[member]
                return f"{member}, a process of this replica, died"
        step, view = self.step(), self.view()
        in_view = view is not None
        if not in_view:  # holding back, standing aside, re-forming: no step is owed
            self._last_step, self._step_at, self._last_view = step, now, None
        elif step != self._last_step:
            # A typical step is the time between two commits of one view: not the wait for a
            # view to form, nor the first step after the watch began or the view was entered
            # (a model's build, a reconcile, joiners' waits: early in a job such waits made
            # the stall seconds long).
            if self._last_view is not None and view == self._last_view:
                self._intervals.append(now - self._step_at)
            self._last_view = view if self._last_step is not None else None
            self._last_step, self._step_at = step, now
        typical = STALL_FACTOR * statistics.median(self._intervals) if self._intervals else 0.0
        if not in_view:
            return self._stopped_while_out(now, seen, shards)
        if now - self._step_at < max(STALL_MIN_S, typical):
            self._suspected.clear()
            return None
        if now - self._probed >= self.probe_interval:
            self._probed = now
            self.node.probe_now(list(seen))
        for member, held, local in self._suspicions(now, seen, shards):
            if local is None and held >= SILENT_REMOTE_S or local in STOPPED and held >= SILENT_S:
                how = (f"has not answered for {held + LOOK_S:.1f} s" if local is None else
                       "is stopped" if local != "gone" else "is gone")
                self.culprit = shards[member]
                return (f"{member}, a process of this replica, {how} while this process's training waited "
                        f"{now - self._step_at:.1f} s for a step")
        return None

    def _stopped_while_out(self, now: float, seen: dict[str, str], shards: dict[str, int]) -> str | None:
        """Out of a view (holding back, re-forming, its replica left out of the others' view
        for the stopped partner): no step is owed, so nothing stalls; but a partner on this
        host that gossip suspects and /proc shows stopped or gone for ``SILENT_S`` keeps the
        replica out for good. A reason then (the replica is repaired, the partner replaced);
        a partner that runs, or one on another host, is waited for (with no step owed, no
        probe tells a live one it is suspected: gossip declares a lost one dead)."""
        for member, held, local in self._suspicions(now, seen, shards):
            if local in STOPPED and held >= SILENT_S:
                self.culprit = shards[member]
                return (f"{member}, a process of this replica, {'is stopped' if local != 'gone' else 'is gone'} "
                        f"and has not answered for {held + LOOK_S:.1f} s while this process is in no view")
        return None

    def _suspicions(self, now: float, seen: dict[str, str], shards: dict[str, int]):
        """Each partner gossip suspects now: (member, seconds its suspicion has held, its state
        in this host's /proc or None); one no longer suspected starts over."""
        for member, state in seen.items():
            if state != "suspect":
                self._suspected.pop(member, None)
                continue
            yield member, now - self._suspected.setdefault(member, now), self.replica.process_state(shards[member])
