"""The step protocol: what one worker does around each gradient step and collective.

:class:`StepProtocol` sits between the public API (:class:`ftcomm.FaultTolerantGroup`)
and the view lifecycle (:class:`ftcomm.runtime.lifecycle.Lifecycle`). Before a collective it
re-forms when the last one failed, a joiner is due or this worker stands aside, and
reconciles the registered state when that is due; around a gradient step it reduces the
buckets, reads the step's verdict from the reduced tail (commit, admit a joiner, who
stands aside) and tells the objects that follow the steps (:meth:`participants`). It runs
only on the training thread; nothing here touches a socket except through the
communicator, and every re-formation goes through :meth:`recover`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import torch

from ..core import engine as core
from ..errors import CollectiveAborted, FtcommError, MembershipChanged, RetryLimitExceeded
from ..options import GroupOptions
from ..training.buckets import GradientBuckets
from ..training.state import TrainingState
from . import transfer
from .lifecycle import Lifecycle
from .ports import Reconciled
from .stragglers import Stragglers

log = logging.getLogger(__name__)


class StepProtocol:
    """One worker's steps: committed count, gradient buckets, and the re-formations due between steps."""

    def __init__(self, life: Lifecycle, state: TrainingState, options: GroupOptions, stragglers: Stragglers,
                 secret: bytes | None, min_workers: int) -> None:
        self.life, self.state, self.options, self.stragglers = life, state, options, stragglers
        self.secret, self.min_workers = secret, min_workers
        self.step = 0  # committed steps
        self.owner = threading.get_ident()  # the thread that trains: only it acts at step boundaries
        self.buckets: GradientBuckets | None = None
        self.failed_in_a_row = 0  # gradient steps that failed and re-formed since one completed
        self.waiting_since = time.monotonic()
        life.reconcile_state = self.reconcile_formed

    @property
    def rank(self) -> int:
        return self.life.view.rank_of(self.life.engine.id)

    @property
    def replica(self):
        """This process's sharded replica (ftcomm.training.replica.Replica), or None: its
        gradients go by shard, and its steps commit as one."""
        return self.life.replica

    @property
    def engine(self) -> core.Engine:
        return self.life.engine

    @property
    def closed(self) -> bool:
        """The worker left the group (``shutdown``), or is leaving it."""
        return self.engine.state in (core.LEAVING, core.CLOSED)

    # ------------------------------------------------------------------ entry points
    def boundary(self) -> None:
        """See :meth:`ftcomm.FaultTolerantGroup.step_boundary`."""
        life = self.life
        if self.engine.state == core.CLOSED and threading.get_ident() == self.owner:
            raise FtcommError("the group was shut down")
        if self.closed or threading.get_ident() != self.owner or (self.buckets is not None and self.buckets.touched):
            return
        self.engine.began()
        self.reform_if_due()
        if self.engine.state != core.RECONCILE_DUE or life.comm is None:
            return
        try:
            self.reconcile_if_due()
        except MembershipChanged as exc:
            self.fail(exc)

    def gradients(self, params: list[torch.Tensor]) -> bool:
        """See :meth:`ftcomm.FaultTolerantGroup.wait_gradients_ready`."""
        life = self.life
        self.engine.began()
        buckets = self.buckets_for(params)
        life.news.judge()
        for obj in self.participants("check_step"):
            obj.check_step()
        if buckets.lost:  # the group re-formed (in execute) after backward began reducing
            buckets.discard()
            self.replica_agrees(False)
            self.end_step(False)
            return False
        self.waiting_since = time.monotonic()
        try:
            if buckets.touched and (self.engine.state == core.BROKEN or life.abort.reason is not None):
                # backward already reduced part of this step in a view that is now broken
                raise CollectiveAborted(life.abort.reason or f"the view broke ({self.engine.fault})")
            replaced = self.prepare()
            # Gradients computed on state that was just replaced are not valid: contribute none.
            handles, tail = buckets.finish(valid=not replaced)
            self.stragglers.compute.add(life.contributed())
            self.waiting_since = life.contributed_at
            for h in handles:
                h.wait(life.abort)
            verdict = self.replica_verdict(tail) if self.replica is not None else None
            life.confirm_after_stall()
        except MembershipChanged as exc:
            buckets.discard()
            life.check_open()  # shut down from another thread: FtcommError, nothing to re-form
            self.replica_agrees(False)
            self.failed_in_a_row += 1
            fault = self.engine.fault or life.driver.classify(exc)
            if self.failed_in_a_row > self.options.max_retries:
                self.failed_in_a_row = 0  # a caller that goes on gets max_retries more
                if self.engine.state in (core.RUNNING, core.RECONCILE_DUE):
                    life.driver.perform(self.engine.failed(fault))  # re-formed at the next call
                self.end_step(False)
                raise RetryLimitExceeded(
                    f"wait_gradients_ready failed {self.options.max_retries + 1} steps in a row because the "
                    f"membership kept changing (last: {exc}); raise max_retries or investigate the unstable "
                    f"workers") from exc
            self.recover(fault, self.waiting_since)
            self.end_step(False)
            return False
        self.failed_in_a_row = 0
        life.completed()
        contributors = float(tail[0])
        asking = [rank for rank, flag in enumerate(tail[2:].tolist()) if flag > 0.5]
        counters = (contributors, float(tail[1])) if verdict is None else tuple(verdict)
        commit = life.driver.step_reduced(*counters, asking, bool(self.participants("batch_valid")), self.min_workers)
        commit = self.replica_agrees(commit)
        if commit:
            buckets.hand_back(contributors)
        else:
            buckets.discard()
        self.end_step(commit)
        if commit:
            self.commit()
        return commit

    def replica_agrees(self, committed: bool) -> bool:
        """With a sharded replica, whether all of its processes commit the step (every one of
        them asks once per gradient step, see Replica.agree); ``committed`` without one."""
        return self.replica.agree(committed) if self.replica is not None else committed

    def replica_verdict(self, tail: torch.Tensor) -> list[float]:
        """With sharded replicas, each shard index reduced its gradient shards, and the
        step's counters with them, over its own communicator. The step commits for every
        process or for none: the counters of every shard are summed over the whole view
        (one tiny allreduce; each shard's sum arrives once from each of its processes)."""
        life = self.life
        counters = (tail[:2].to(torch.float64) / life.shard_comm.size).to(life.comm.device)
        life.comm.allreduce([counters], "sum").wait(life.abort)
        return [round(x) for x in counters.tolist()]

    def no_sync(self):
        if self.engine.state == core.CLOSED:
            raise FtcommError("the group was shut down")
        if self.buckets is None:
            return contextlib.nullcontext()
        return self.buckets.no_sync()

    def execute(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """See :meth:`ftcomm.FaultTolerantGroup.execute`."""
        failures = 0
        while True:
            self.waiting_since = time.monotonic()
            try:
                self.prepare()
                return fn(*args, **kwargs)
            except MembershipChanged as exc:
                failures += 1
                if failures > self.options.max_retries:
                    raise RetryLimitExceeded(
                        f"execute failed {failures} times in a row because the membership kept changing "
                        f"(last: {exc}); raise max_retries or investigate the unstable workers") from exc
                self.recover(self.engine.fault or self.life.driver.classify(exc), self.waiting_since)

    def run(self, start: Callable[[], Any]) -> Any:
        """One collective: ``start`` enqueues it on the communicator; its handle is waited on here."""
        life = self.life
        self.prepare()
        life.contributed()
        self.waiting_since = life.contributed_at
        try:
            result = start().wait(life.abort)  # starting can fail too (NCCL reports a dead peer at enqueue)
            life.confirm_after_stall()
        except MembershipChanged as exc:
            self.fail(exc)
            raise
        life.operation_done()
        return result

    # ------------------------------------------------------------------ between steps
    def prepare(self) -> bool:
        """Before a collective: recover if the last one failed, a join is due at this
        boundary or this worker stands aside; reconcile if due. Returns whether this
        worker's registered state was replaced meanwhile (by another member's)."""
        if self.closed:
            raise FtcommError("the group was shut down")
        self.owner = threading.get_ident()  # the thread that trains
        replaced = self.reform_if_due()
        return self.reconcile_if_due() or replaced

    def reconcile_if_due(self) -> bool:
        """Reconcile if due, unless news already broke the view (MembershipChanged); whether
        the state was replaced."""
        life = self.life
        life.news.judge()
        if life.abort.reason is not None:
            raise MembershipChanged(life.abort.reason)
        return self.engine.state == core.RECONCILE_DUE and self.reconcile()[0]

    def reform_if_due(self) -> bool:
        """Re-form if the last collective failed, a join is due at this boundary or this
        worker stands aside; whether the state was replaced."""
        state = self.engine.state
        if state == core.BROKEN:
            return self.recover(self.engine.fault, self.waiting_since)
        if state not in core.IN_VIEW:  # a re-formation that raised (a timeout, a mismatch) is resumed
            return self.recover("backend", time.monotonic())
        if state == core.JOIN_DUE:
            return self.recover("join", time.monotonic())
        if state == core.ASIDE_DUE:
            seconds = self.stragglers.bench()
            log.warning("this worker is a straggler: standing aside for %g s (straggler_policy 'exclude')", seconds)
            self.life.driver.stand_aside(seconds)
            return self.recover("straggler", time.monotonic(), seconds + self.options.quorum_timeout)
        return False

    def recover(self, reason: str, detected_at: float, timeout: float | None = None) -> bool:
        """Re-form (see Lifecycle.recover); whether the state was replaced."""
        if self.buckets is not None and self.buckets.touched:
            self.buckets.drop()
        life = self.life
        life.recover(reason, detected_at, timeout)
        outcomes = life.driver.reconciled  # each formation's, this re-formation
        if self.engine.state == core.RUNNING:
            self.record_reconciled(outcomes[-1].digest)
        return any(outcome.replaced for outcome in outcomes)

    def reconcile_formed(self) -> Reconciled:
        """In a view just formed: reconcile now, or before the first collective once
        registered (deferred: nothing loaded, no digest yet)."""
        if not self.state.registered:
            return Reconciled(False, None, deferred=True)
        loaded, digest = self.transfer_state()
        return Reconciled(loaded, digest)

    def reconcile(self) -> tuple[bool, int]:
        """Make every member's registered state identical (RECONCILE_DUE: before the first
        collective once registered, or after a checkpoint was restored); whether this worker
        loaded another's, and the digest every member now holds."""
        began = time.monotonic()
        loaded, digest = self.transfer_state()
        self.life.check_open()
        self.engine.reconciled()
        self.record_reconciled(digest, time.monotonic() - began)
        return loaded, digest

    def transfer_state(self) -> tuple[bool, int]:
        """Whether this worker loaded another member's state, and the digest all now hold."""
        life = self.life
        self.step, loaded, digest = transfer.reconcile(life.comm, life.abort, self.state, self.step, life.view,
                                                       self.secret, life.shard_comm,
                                                       self.replica.size if self.replica is not None else 1)
        return loaded, digest

    def record_reconciled(self, digest: int | None, deferred_s: float | None = None) -> None:
        """Stamp the latest view change with the state every member holds after reconciling
        (and, for a reconcile deferred until the state was registered, its duration), and let
        the batch-size / learning-rate policies adapt to the view (same state, same result)."""
        events = self.life.events
        if self.state.registered and events:
            policy: dict = {}
            for obj in self.participants("view_changed"):
                policy.update(obj.view_changed(self.rank, self.life.view.size, self.step) or {})
            timing = {"reconcile_s": round(deferred_s, 4)} if deferred_s is not None else {}
            events[-1] = dataclasses.replace(events[-1], step=self.step, state_digest=digest,
                                             policy=policy or None, **timing)
            if policy:
                log.info("view %d: policy %s", self.life.view.id, policy)

    def fail(self, exc: MembershipChanged) -> None:
        """A collective of the view failed outside a gradient step: the view is BROKEN and
        re-formed before the next collective. Raises FtcommError when another thread shut
        the group down meanwhile (nothing is left to re-form)."""
        self.life.check_open()
        self.life.driver.perform(self.engine.failed(self.life.driver.classify(exc)))

    def participants(self, hook: str) -> list[Any]:
        """Registered objects that follow the group's steps through ``hook``."""
        return [obj for obj in self.state.objects.values() if hasattr(obj, hook)]

    def end_step(self, committed: bool) -> None:
        for obj in self.participants("step_ended"):
            obj.step_ended(committed)
        self.life.news.operation_ended()

    def commit(self) -> None:
        self.step += 1
        if self.life.publish_step():
            try:
                self.judge_stragglers()
            except Exception:  # noqa: BLE001 - a report must never fail a committed step
                log.exception("judging stragglers failed")

    def judge_stragglers(self) -> None:
        """Compare the view members' published compute times (see ftcomm.runtime.stragglers)."""
        statuses, _ = self.life.statuses()
        compute = {m: s.compute_s for m, s in statuses.items() if s.compute_s is not None}
        self.stragglers.judge(self.life.engine.id, self.life.view.members, compute, time.time())

    # ------------------------------------------------------------------ gradient buckets
    def buckets_for(self, params: list[torch.Tensor]) -> GradientBuckets:
        params = [p for p in params if p.requires_grad]
        buckets, life = self.buckets, self.life
        if buckets is None or len(buckets.params) != len(params) or any(
                a is not b for a, b in zip(buckets.params, params)):
            if buckets is not None:
                buckets.remove()
            buckets = self.buckets = GradientBuckets(
                params, self.options.bucket_mb, self.options.overlap,
                launch=lambda flat: self.gradient_comm.allreduce([flat], "sum"),
                may_overlap=self.may_overlap, world_size=lambda: self.gradient_comm.size,
                join=lambda: 1.0 if life.engine.admits_joiner(life.statuses()[0]) else 0.0,
                data_valid=lambda: all(obj.batch_valid() for obj in self.participants("batch_valid")),
                aside=lambda: (self.rank, self.stragglers.asking))
        return buckets

    @property
    def gradient_comm(self):
        """The communicator gradients are averaged over: the view's, or with sharded replicas
        this shard index's (the same shard of every replica)."""
        return self.life.comm if self.replica is None else self.life.shard_comm

    def may_overlap(self) -> bool:
        """Backward may start reducing: nothing has to happen before this step's collectives."""
        life = self.life
        life.news.judge()
        return (self.gradient_comm is not None and self.engine.state == core.RUNNING
                and life.abort.reason is None and not self.closed)
