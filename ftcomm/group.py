"""The fault-tolerant group: the public training API over one worker's view lifecycle.

:class:`FaultTolerantGroup` runs the step protocol (gradient steps, collectives, joins at
step boundaries, straggler handling) and calls :meth:`~ftcomm.lifecycle.Lifecycle.recover`
whenever the view can no longer be used; the lifecycle performs the actions of the
engine core (:mod:`ftcomm.engine`). Every entry point only posts or waits: the gossip
thread posts news (:mod:`ftcomm.news`), the SIGTERM handler raises SystemExit, and the
training thread judges the news and performs everything.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable

import torch

from . import engine as core
from . import netcheck, transfer
from .backends import communicator_class
from .buckets import GradientBuckets
from .engine import Engine
from .errors import (CollectiveAborted, CommunicatorError, FtcommError, FtcommTimeout, MembershipChanged,
                     RetryLimitExceeded)
from .gossip import GossipNode
from .gossip.runtime import parse_address
from .lifecycle import Lifecycle
from .netcheck import NetworkReport
from .options import (GroupOptions, ViewChange, check_addresses, check_protection, check_secret,
                      check_worker_counts, member_cap)
from .rendezvous import Rendezvous
from .state import TrainingState
from .stragglers import StragglerReport, Stragglers
from .view import View

log = logging.getLogger(__name__)

_RUNNING: "weakref.WeakSet[FaultTolerantGroup]" = weakref.WeakSet()


def running_groups() -> list["FaultTolerantGroup"]:
    """The groups of this process that were formed and not shut down."""
    return [g for g in list(_RUNNING) if not g._closed]


class FaultTolerantGroup:
    """A data-parallel group that survives crashes, hangs, leaves, joins and partitions."""

    def __init__(self, backend: str = "gloo", peers: Iterable[str] = (), bind: str = "127.0.0.1:0",
                 min_workers: int = 1, max_workers: int | None = None, cluster: str = "ftcomm",
                 secret: str | bytes | None = None, options: GroupOptions | None = None,
                 insecure: bool = False) -> None:
        backend_class = communicator_class(backend)  # NcclUnavailable here, before joining anyone
        check_worker_counts(min_workers, max_workers)
        self.options = opts = options or GroupOptions()  # GroupOptions checks its own fields
        self.min_workers, self.max_workers = min_workers, max_workers
        self.settings = {"backend": backend, "min_workers": min_workers, "max_workers": max_workers,
                         "partition_policy": opts.partition_policy}
        self._config = hashlib.blake2b(json.dumps(self.settings, sort_keys=True).encode(), digest_size=4).hexdigest()
        self.state = TrainingState()
        self.step = 0
        self.network_report: NetworkReport | None = None  # GroupOptions.network_check
        self._stragglers = Stragglers(opts.straggler_factor, opts.straggler_window, opts.straggler_policy,
                                      opts.straggler_cooldown)
        self._buckets: GradientBuckets | None = None
        self._join_pending = False  # a joiner is admitted at the next step boundary
        self._state_replaced = False  # reconciling replaced this worker's state during the step
        self._step_lost = False  # a re-formation discarded the gradients backward was reducing
        self._reconciled_digest: int | None = None
        self._waiting_since = time.monotonic()
        self._closed = False
        self._owner = threading.get_ident()  # the thread that trains: only it acts at step boundaries
        peers = list(peers)
        host, port = parse_address(bind)
        host = check_addresses(host, peers)  # every plane uses this one IPv4 address
        self._secret = check_secret(secret)
        self.insecure = check_protection(host, self._secret, insecure)
        engine = Engine("", self._config, min_workers, max_workers, opts.partition_policy, opts.settle_interval,
                        3 * opts.gossip.gossip_interval, joined_at=time.time())
        self._life = life = Lifecycle(engine, backend_class, Rendezvous(host, opts.formation_timeout, self._secret),
                                      opts, tuple(self.settings[n] for n in core.SETTING_NAMES), self.insecure,
                                      self._stragglers.compute, lambda: self.step)
        self.id = ""
        self._metrics = None
        try:
            life.gossip = GossipNode((host, port), cluster=cluster, secret=self._secret,
                                     config=member_cap(opts.gossip, max_workers), metadata=life.status_record(),
                                     fault_filter=opts.fault_filter)
            life.gossip.subscribe(life.news.post)
            life.gossip.start(peers)
            self.id = engine.id = life.gossip.id
            if opts.metrics_port is not None:
                from .metrics import MetricsServer
                self._metrics = MetricsServer(self, host, opts.metrics_port)
            self._install_exit_hooks()
            self._recover("init", time.monotonic(), opts.init_timeout)
            if life.founding:
                self._check_network()
            _RUNNING.add(self)
        except BaseException:
            if life.gossip is not None:
                life.gossip.stop()
            if self._metrics is not None:
                self._metrics.close()
            life.rendezvous.close()
            raise

    # ------------------------------------------------------------------ public attributes
    @property
    def view(self) -> View:
        return self._life.view

    @property
    def rank(self) -> int:
        return self._life.view.rank_of(self.id)

    @property
    def world_size(self) -> int:
        return self._life.view.size

    @property
    def gossip(self) -> GossipNode:
        return self._life.gossip

    @property
    def events(self) -> list[ViewChange]:
        """Every view change of this worker, oldest first."""
        return self._life.events

    @property
    def stragglers(self) -> list[StragglerReport]:
        """Straggler reports as judged here (changes only: a few per minute at most)."""
        return self._stragglers.reports

    @property
    def metrics_port(self) -> int | None:
        """The port of the Prometheus endpoint (``GroupOptions.metrics_port``), or None."""
        return self._metrics.port if self._metrics is not None else None

    def register_state(self, model: Any = None, optimizer: Any = None, sampler: Any = None, **extras: Any) -> None:
        """Register what must be identical on every worker (``state_dict`` objects or plain values).

        Objects that follow the group's steps (an :class:`ftcomm.ElasticSampler`, a
        :class:`ftcomm.LinearLRScaling`) are bound to it here; see docs/API.md.
        """
        self.state.register(model=model, optimizer=optimizer, sampler=sampler, **extras)
        for obj in self.state.objects.values():
            if hasattr(obj, "bind_group"):
                obj.bind_group(self)

    def step_boundary(self) -> None:
        """Between two steps (after the optimizer stepped, before the next batch's compute):
        re-form if the last step failed or agreed to admit a joiner (or this worker is to
        stand aside), and receive the group's state if a transfer is due (a joiner's,
        deferred until its state was registered, while the members of its view wait in
        theirs). Done here rather than at the next collective, the next step is computed in
        the new view on the group's state, so it counts, and nobody waits through a step
        computed for nothing. The ElasticSampler calls this before drawing each batch;
        without one, call it at the top of each step (otherwise the next collective does
        it). Only the thread that trains acts (the last to run a step or a collective, else
        the one that created the group; a loader's thread does nothing here), and never
        inside a step. Raises what ``wait_gradients_ready`` raises for a
        re-formation (``QuorumLost``, ``FtcommTimeout``, ``ConfigMismatch``)."""
        life = self._life
        if (self._closed or threading.get_ident() != self._owner
                or (self._buckets is not None and self._buckets.touched)):
            return
        self._reform_if_due()
        if not life.needs_reconcile or life.comm is None or life.broken is not None:
            return
        try:
            self._reconcile_if_due()
        except MembershipChanged as exc:
            life.broken = life.classify(exc)

    def state_restored(self, step: int | None, same_everywhere: bool = False) -> None:
        """The registered state was loaded from a checkpoint of ``step`` (None: not on this member).
        Unless every member loaded identical data (``same_everywhere``), the members compare
        digests before the next collective and the newest state wins."""
        if step is not None:
            self.step = step
        if not same_everywhere:
            self._life.needs_reconcile = True

    # ------------------------------------------------------------------ training API
    def wait_gradients_ready(self, model_or_params: Any) -> bool:
        """Average gradients across the view in flat buckets.

        True: the gradients are averaged and the optimizer may step (the step is counted
        as committed). False: the view changed during the step; the step is discarded
        and the registered state was reconciled across the new view before returning.
        Never hangs on a failed peer: a fault aborts the wait within milliseconds of
        gossip reporting it. Raises QuorumLost when this worker is cut off from the
        majority for longer than ``quorum_timeout``.

        With ``overlap`` on, buckets are already being reduced during backward (hooks
        installed by the first call, so the first step is not overlapped) and this call
        waits only for what is still in flight.
        """
        life = self._life
        buckets = self._buckets_for(_parameters(model_or_params))
        life.news.judge()
        for obj in self._participants("check_step"):
            obj.check_step()
        if self._step_lost:  # the group re-formed (in execute) after backward began reducing
            self._step_lost = False
            self._end_step(False)
            return False
        self._state_replaced = False
        self._waiting_since = time.monotonic()
        try:
            if buckets.touched and (life.broken is not None or life.abort.reason is not None):
                # backward already reduced part of this step in a view that is now broken
                raise CollectiveAborted(life.abort.reason or f"the view broke ({life.broken})")
            self._prepare()
            # Gradients computed on state that was just replaced are not valid: contribute none.
            handles, tail = buckets.finish(valid=not self._state_replaced)
            self._stragglers.compute.add(life.contributed())
            self._waiting_since = life.contributed_at
            for h in handles:
                h.wait(life.abort)
            life.confirm_after_stall()
        except MembershipChanged as exc:
            buckets.discard()
            self._recover(life.broken or life.classify(exc), self._waiting_since)
            self._end_step(False)
            return False
        life.completed()
        contributors = float(tail[0])
        commit, admit = core.step_verdict(contributors, float(tail[1]), life.comm.size,
                                          bool(self._participants("batch_valid")))
        self._join_pending = self._join_pending or admit
        asking = [rank for rank, flag in enumerate(tail[2:].tolist()) if flag > 0.5]
        if asking:  # every member sees the same requests: the chosen stand aside at the next boundary
            self._stragglers.bench_due = self.rank in Stragglers.chosen(asking, life.comm.size, self.min_workers)
        if commit:
            buckets.hand_back(contributors)
        else:
            buckets.discard()
        self._end_step(commit)
        if commit:
            self._commit()
        return commit

    def no_sync(self):
        """Context manager: backward passes inside accumulate gradients locally and start
        no reduction (as DDP's ``no_sync``); the backward after it reduces the total."""
        if self._buckets is None:
            return contextlib.nullcontext()
        return self._buckets.no_sync()

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` (which calls this group's collectives); on a membership fault re-form,
        reconcile and retry, up to ``max_retries`` consecutive failures."""
        failures = 0
        while True:
            self._waiting_since = time.monotonic()
            try:
                self._prepare()
                return fn(*args, **kwargs)
            except MembershipChanged as exc:
                failures += 1
                if failures > self.options.max_retries:
                    raise RetryLimitExceeded(
                        f"execute failed {failures} times in a row because the membership kept changing "
                        f"(last: {exc}); raise max_retries or investigate the unstable workers") from exc
                self._recover(self._life.broken or self._life.classify(exc), self._waiting_since)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place across the view. Raises MembershipChanged (caught by ``execute``) on a fault."""
        return self._run(lambda: self._life.comm.allreduce([tensor], op))[0]

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self._run(lambda: self._life.comm.broadcast(tensor, src))

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._run(lambda: self._life.comm.allgather(tensor))

    def barrier(self) -> None:
        self._run(lambda: self._life.comm.barrier())

    def shutdown(self) -> None:
        """Leave gracefully: peers see *left* and re-form at once, without a suspicion wait."""
        if self._closed:
            return
        self._closed = True
        self._life.leave()
        self._life.rendezvous.close()
        if self._metrics is not None:
            self._metrics.close()

    # ------------------------------------------------------------------ the step protocol
    def _prepare(self) -> None:
        """Before a collective: recover if the last one failed, a join is due at this
        boundary or this worker stands aside; reconcile if due."""
        if self._closed:
            raise FtcommError("the group was shut down")
        self._owner = threading.get_ident()  # the thread that trains
        self._reform_if_due()
        self._reconcile_if_due()

    def _reconcile_if_due(self) -> None:
        """Reconcile if due, unless news already broke the view (MembershipChanged)."""
        life = self._life
        life.news.judge()
        if life.abort.reason is not None:
            raise MembershipChanged(life.abort.reason)
        if life.needs_reconcile:
            self._reconcile()

    def _reform_if_due(self) -> None:
        """Re-form if the last collective failed, a join is due at this boundary or this
        worker stands aside."""
        life = self._life
        if life.broken is not None:
            self._recover(life.broken, self._waiting_since)
        if self._join_pending:
            self._join_pending = False
            self._recover("join", time.monotonic())
        if self._stragglers.bench_due:
            seconds = self._stragglers.bench()
            log.warning("this worker is a straggler: standing aside for %g s (straggler_policy 'exclude')", seconds)
            life.stand_aside(seconds)
            self._recover("straggler", time.monotonic(), seconds + self.options.quorum_timeout)

    def _run(self, start: Callable[[], Any]) -> Any:
        life = self._life
        self._prepare()
        life.contributed()
        self._waiting_since = life.contributed_at
        try:
            result = start().wait(life.abort)  # starting can fail too (NCCL reports a dead peer at enqueue)
            life.confirm_after_stall()
        except MembershipChanged as exc:
            life.broken = life.classify(exc)
            raise
        life.operation_done()
        return result

    def _recover(self, reason: str, detected_at: float, timeout: float | None = None) -> None:
        if self._buckets is not None and self._buckets.touched:
            self._buckets.discard()
            self._step_lost = True
        self._life.recover(reason, detected_at, timeout, self._reconcile_formed)
        if not self._life.needs_reconcile:
            self._record_reconciled()

    def _reconcile_formed(self) -> None:
        """In a view just formed: reconcile now, or before the first collective once registered."""
        if self.state.registered:
            self._reconcile(stamp=False)
        else:
            self._life.needs_reconcile = True

    def _reconcile(self, stamp: bool = True) -> None:
        """Make every member's registered state identical. ``stamp``: record the reconciled
        state in the latest view change (a reconcile deferred until the state was registered
        belongs to the view formed before it)."""
        life = self._life
        life.needs_reconcile = True
        self.step, loaded, self._reconciled_digest = transfer.reconcile(
            life.comm, life.abort, self.state, self.step, life.view, self._secret)
        self._state_replaced = self._state_replaced or loaded
        life.needs_reconcile = False
        if stamp:
            self._record_reconciled()

    def _record_reconciled(self) -> None:
        """Stamp the latest view change with the state every member holds after reconciling, and
        let the batch-size / learning-rate policies adapt to the view (same state, same result)."""
        events = self._life.events
        if self.state.registered and events:
            policy: dict = {}
            for obj in self._participants("view_changed"):
                policy.update(obj.view_changed(self.rank, self.world_size, self.step) or {})
            events[-1] = dataclasses.replace(events[-1], step=self.step, state_digest=self._reconciled_digest,
                                             policy=policy or None)
            if policy:
                log.info("view %d: policy %s", self.view.id, policy)

    def _participants(self, hook: str) -> list[Any]:
        """Registered objects that follow the group's steps through ``hook``."""
        return [obj for obj in self.state.objects.values() if hasattr(obj, hook)]

    def _end_step(self, committed: bool) -> None:
        for obj in self._participants("step_ended"):
            obj.step_ended(committed)
        self._life.news.operation_ended()

    def _commit(self) -> None:
        self.step += 1
        if self._life.publish_step():
            try:
                self._judge_stragglers()
            except Exception:  # noqa: BLE001 - a report must never fail a committed step
                log.exception("judging stragglers failed")

    def _judge_stragglers(self) -> None:
        """Compare the view members' published compute times (see ftcomm.stragglers)."""
        statuses, _ = self._life.statuses()
        compute = {m: s.compute_s for m, s in statuses.items() if s.compute_s is not None}
        self._stragglers.judge(self.id, self.view.members, compute, time.time())

    def _check_network(self) -> None:
        """The founding members measure every link between them (``GroupOptions.network_check``).
        A fault during the check abandons it (logged); the view is re-formed before its first
        collective (members may have stopped at different calls of its communicator)."""
        try:
            self.network_report = netcheck.run(self._life, int(self.options.network_check_mb * 2**20),
                                               self.options.network_check_factor)
        except (MembershipChanged, FtcommTimeout, CommunicatorError) as exc:
            log.warning("network check abandoned: %s", exc)
            self._life.broken = "backend"
            self._life.perform(self._life.engine.broken())  # withdraw the proposal: the others stop waiting at once
            return
        netcheck.publish(self.network_report, os.environ.get("FTCOMM_NETWORK_REPORT"))

    def _buckets_for(self, params: list[torch.Tensor]) -> GradientBuckets:
        params = [p for p in params if p.requires_grad]
        buckets, life = self._buckets, self._life
        if buckets is None or len(buckets.params) != len(params) or any(
                a is not b for a, b in zip(buckets.params, params)):
            if buckets is not None:
                buckets.remove()
            buckets = self._buckets = GradientBuckets(
                params, self.options.bucket_mb, self.options.overlap,
                launch=lambda flat: life.comm.allreduce([flat], "sum"),
                may_overlap=self._may_overlap, world_size=lambda: life.comm.size,
                join=lambda: 1.0 if life.engine.admits_joiner(life.statuses()[0]) else 0.0,
                data_valid=lambda: all(obj.batch_valid() for obj in self._participants("batch_valid")),
                aside=lambda: (self.rank, self._stragglers.asking))
        return buckets

    def _may_overlap(self) -> bool:
        """Backward may start reducing: nothing has to happen before this step's collectives."""
        life = self._life
        life.news.judge()
        return (life.comm is not None and life.broken is None and not self._join_pending
                and not self._stragglers.bench_due and not life.needs_reconcile and life.abort.reason is None
                and not self._closed)

    def _install_exit_hooks(self) -> None:
        atexit.register(self.shutdown)
        if not self.options.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        previous_hook = sys.excepthook

        def excepthook(kind, value, tb):
            self.shutdown()
            previous_hook(kind, value, tb)
        sys.excepthook = excepthook
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            # The handler runs on the main thread between two bytecodes, possibly inside one
            # of this group's locks: it takes none. SystemExit unwinds the main thread (which
            # releases them) and the atexit hook leaves the group.
            if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
                previous(signum, frame)
            raise SystemExit(128 + signum)
        signal.signal(signal.SIGTERM, on_sigterm)


def _parameters(model_or_params: Any) -> list[torch.Tensor]:
    if hasattr(model_or_params, "parameters"):
        return list(model_or_params.parameters())
    return list(model_or_params)
