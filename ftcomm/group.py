"""The group engine: one worker's lifecycle of views, communicators and training state.

The lifecycle is one loop with named phases, run by :meth:`FaultTolerantGroup._recover`
whenever the current view can no longer be used:

    detect -> agree -> form (+ verify) -> reconcile -> run

*Detect* happens on the gossip thread (:meth:`_on_gossip` fires the abort signal the
moment a member of the view is suspect, dead or left, or the view is superseded) or in
the training thread when the backend fails a collective (then the crash fast path
probes the view's members and declares dead those whose host refuses a connection).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable

import torch

from .backends import communicator_class
from .backends.base import AbortSignal, Communicator
from .buckets import GradientBuckets
from .errors import (CollectiveAborted, CommunicatorError, ConfigMismatch, FtcommError, FtcommTimeout,
                     MembershipChanged, QuorumLost, RetryLimitExceeded)
from .gossip import GossipEvent, GossipNode
from .gossip.runtime import parse_address
from .options import (GroupOptions, ViewChange, check_addresses, check_protection, check_secret,
                      check_worker_counts, member_cap)
from .rendezvous import Rendezvous, refused_many
from .state import TrainingState
from .stragglers import ComputeTimes, StragglerReport, StragglerWatch
from . import engine as core
from . import transfer
from .engine import Announce, Engine, Fetch, Form, Publish, PublishProposal, Rejoined, Sync
from .view import Status, View, encode_status

log = logging.getLogger(__name__)

CRASH_SETTLE_S = 0.15
"""After a broken connection, how long a member's port that still accepts is tried again
before the member is taken for alive (see :func:`ftcomm.rendezvous.refused`)."""

INBOX_LIMIT = 4096
"""Gossip news held for the training thread; beyond it, the next look re-reads every record."""

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
        self._backend = communicator_class(backend)  # NcclUnavailable here, before joining anyone
        check_worker_counts(min_workers, max_workers)
        self.options = opts = options or GroupOptions()  # GroupOptions checks its own fields
        self.min_workers, self.max_workers = min_workers, max_workers
        self.settings = {"backend": backend, "min_workers": min_workers, "max_workers": max_workers,
                         "partition_policy": opts.partition_policy}
        self._settings_tuple = tuple(self.settings[n] for n in core.SETTING_NAMES)
        self._config = hashlib.blake2b(json.dumps(self.settings, sort_keys=True).encode(), digest_size=4).hexdigest()
        self.state = TrainingState()
        self.step = 0
        self.events: list[ViewChange] = []
        self.stragglers: list[StragglerReport] = []  # as judged here (changes only: a few per minute at most)
        self._compute = ComputeTimes(opts.straggler_window)
        self._straggler_watch = StragglerWatch(opts.straggler_factor)
        self._comm: Communicator | None = None  # the backend's communicator of the current view
        self._abort = AbortSignal(self._drain)
        self._changed = threading.Event()
        self._engine = Engine("", self._config, min_workers, max_workers, opts.partition_policy,
                              opts.settle_interval, 3 * opts.gossip.gossip_interval, joined_at=time.time())
        self._join_pending = False
        self._state_replaced = False
        self._rejoined = False
        self._reconciled_digest: int | None = None
        self._waiting_since = time.monotonic()
        self._buckets: GradientBuckets | None = None
        self._step_lost = False  # a re-formation discarded the gradients backward was reducing
        self._needs_reconcile = False
        self._broken: str | None = None
        self._faults: list[tuple[float, str, str]] = []  # (time, kind, member) since the last view
        self._deferred_aborts: list[tuple[AbortSignal, str, float]] = []  # (signal, reason, fire by); see _drain
        self._inbox: collections.deque = collections.deque()  # (time posted, GossipEvent) from the gossip thread
        self._draining = threading.Lock()
        self._news_since = 0.0  # news posted before this is not judged: see _enter
        self._inbox_overflowed = False
        self._ops = 0  # group operations (collectives, gradient steps) completed in the current view
        self._op_began = time.monotonic()  # when the operation in flight began (the previous one ended)
        self._contributed_at = time.monotonic()  # when this worker's share of it was handed to the backend
        self._last_step_publish = 0.0
        self._closed = False
        peers = list(peers)
        host, port = parse_address(bind)
        host = check_addresses(host, peers)  # every plane uses this one IPv4 address
        self._secret = check_secret(secret)
        self.insecure = check_protection(host, self._secret, insecure)
        self._rendezvous = Rendezvous(host, opts.formation_timeout, self._secret)
        self.id = ""
        gossip = None
        self._metrics = None
        try:
            gossip = self._gossip = GossipNode((host, port), cluster=cluster, secret=self._secret,
                                               config=member_cap(opts.gossip, max_workers),
                                               metadata=self._status_record(), fault_filter=opts.fault_filter)
            self._gossip.subscribe(self._on_gossip)
            self._gossip.start(peers)
            self.id = self._engine.id = self._gossip.id
            if opts.metrics_port is not None:
                from .metrics import MetricsServer
                self._metrics = MetricsServer(self, host, opts.metrics_port)
            self._install_exit_hooks()
            self._recover("init", time.monotonic(), opts.init_timeout)
            _RUNNING.add(self)
        except BaseException:
            if gossip is not None:
                gossip.stop()
            if self._metrics is not None:
                self._metrics.close()
            self._rendezvous.close()
            raise

    # ------------------------------------------------------------------ public attributes
    @property
    def view(self) -> View:
        return self._engine.view

    @property
    def _view(self) -> View | None:
        """The current view: formed and verified."""
        return self._engine.view

    @property
    def rank(self) -> int:
        return self._view.rank_of(self.id)

    @property
    def world_size(self) -> int:
        return self._view.size

    @property
    def gossip(self) -> GossipNode:
        return self._gossip

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

    def state_restored(self, step: int | None, same_everywhere: bool = False) -> None:
        """The registered state was loaded from a checkpoint of ``step`` (None: not on this member).
        Unless every member loaded identical data (``same_everywhere``), the members compare
        digests before the next collective and the newest state wins."""
        if step is not None:
            self.step = step
        if not same_everywhere:
            self._needs_reconcile = True

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
        buckets = self._buckets_for(_parameters(model_or_params))
        self._drain()
        for obj in self._participants("check_step"):
            obj.check_step()
        if self._step_lost:  # the group re-formed (in execute) after backward began reducing
            self._step_lost = False
            self._end_step(False)
            return False
        self._state_replaced = False
        self._waiting_since = time.monotonic()
        try:
            if buckets.touched and (self._broken is not None or self._abort.reason is not None):
                # backward already reduced part of this step in a view that is now broken
                raise CollectiveAborted(self._abort.reason or f"the view broke ({self._broken})")
            self._prepare()
            if self._needs_reconcile:
                self._reconcile()
            # Gradients computed on state that was just replaced are not valid: contribute none.
            handles, tail = buckets.finish(valid=not self._state_replaced)
            self._waiting_since = self._contributed_at = time.monotonic()
            self._compute.add(self._contributed_at - self._op_began)
            for h in handles:
                h.wait(self._abort)
            self._confirm_after_stall()
            self._ops += 1
            self._op_began = time.monotonic()
        except MembershipChanged as exc:
            buckets.discard()
            self._recover(self._classify(exc) if self._broken is None else self._broken, self._waiting_since)
            self._end_step(False)
            return False
        contributors = float(tail[0])
        commit, admit = core.step_verdict(contributors, float(tail[1]), self._comm.size,
                                          bool(self._participants("batch_valid")))
        self._join_pending = self._join_pending or admit
        if not commit:
            buckets.discard()
            self._end_step(False)
            return False
        buckets.hand_back(contributors)
        self._end_step(True)
        self._commit()
        return True

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
                if self._needs_reconcile:
                    self._reconcile()
                return fn(*args, **kwargs)
            except MembershipChanged as exc:
                failures += 1
                if failures > self.options.max_retries:
                    raise RetryLimitExceeded(
                        f"execute failed {failures} times in a row because the membership kept changing "
                        f"(last: {exc}); raise max_retries or investigate the unstable workers") from exc
                self._recover(self._classify(exc), self._waiting_since)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place across the view. Raises MembershipChanged (caught by ``execute``) on a fault."""
        return self._run(lambda: self._comm.allreduce([tensor], op))[0]

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self._run(lambda: self._comm.broadcast(tensor, src))

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._run(lambda: self._comm.allgather(tensor))

    def barrier(self) -> None:
        self._run(lambda: self._comm.barrier())

    def shutdown(self) -> None:
        """Leave gracefully: peers see *left* and re-form at once, without a suspicion wait."""
        if self._closed:
            return
        self._closed = True
        self._engine.leave()
        self._abort.fire("this worker is shutting down")
        try:
            self._publish()
            self._gossip.leave()
        except FtcommError:
            pass
        if self._comm is not None:
            self._comm.abandon()
            self._comm = None
        self._rendezvous.close()
        if self._metrics is not None:
            self._metrics.close()
        self._engine.closed()

    # ------------------------------------------------------------------ lifecycle phases
    def _recover(self, reason: str, detected_at: float, timeout: float | None = None) -> None:
        """Agree on a new view, form and verify its communicator, reconcile the state."""
        noticed = time.monotonic()
        fired_at, gave_up_at = self._abort.fired_at, self._abort.noticed_at
        abort_latency = round(gave_up_at - fired_at, 4) if fired_at is not None and gave_up_at is not None else None
        previous = self._view
        self._rejoined = False
        if self._buckets is not None and self._buckets.touched:
            self._buckets.discard()
            self._step_lost = True
        if self._comm is not None:
            self._comm.abandon()
            self._comm = None
        if self._engine.state in (core.RUNNING, core.RECONCILING):
            self._perform(self._engine.broken(), {})
        deadline = noticed + (timeout if timeout is not None else self.options.quorum_timeout)
        while True:
            started = time.monotonic()
            view = self._agree(deadline)
            agreed_at = time.monotonic()
            try:
                self._form(view)
            except (MembershipChanged, FtcommTimeout) as exc:
                log.info("forming view %d failed (%s); agreeing again", view.id, exc)
                # This worker stays in the view (or phase) it had. Withdrawing the proposal
                # aborts the other members' attempts at once; the retry gets a new view id.
                self._perform(self._engine.form_failed(), {})
                if self._comm is not None:
                    self._comm.abandon()
                    self._comm = None
                self._probe_crashed(view.members)
                continue
            self._perform(self._engine.formed(), {})
            self._ops = 0  # before anything can publish a leave naming this view
            formed_at = time.monotonic()
            try:
                if self.state.registered:
                    self._reconcile(stamp=False)
                else:
                    self._needs_reconcile = True
            except MembershipChanged as exc:
                log.info("reconciling view %d failed (%s); agreeing again", view.id, exc)
                reason = self._classify(exc)
                self._perform(self._engine.broken(), {})
                self._comm.abandon()
                self._comm = None
                continue
            self._engine.reconciled()
            break
        done = time.monotonic()
        before = previous.members if previous else ()
        reason = "rejoin" if self._rejoined else core.reason_for(
            reason, before, view.members, {m.id: m.state for m in self._gossip.members()})
        change = ViewChange(view.id, view.members, reason,
                            tuple(m for m in view.members if m not in before),
                            tuple(m for m in before if m not in view.members),
                            round(noticed - detected_at, 4), round(agreed_at - started, 4),
                            round(formed_at - agreed_at, 4), round(done - formed_at, 4), time.time(),
                            abort_latency)
        self.events.append(change)
        if not self._needs_reconcile:
            self._record_reconciled()
        self._faults.clear()
        self._broken = None
        self._op_began = time.monotonic()
        log.info("view %d: %d members (%s), rank %d; detect %.3f agree %.3f form %.3f reconcile %.3f s",
                 view.id, view.size, reason, self.rank, change.detect_s, change.agree_s, change.form_s,
                 change.reconcile_s)

    def _agree(self, deadline: float) -> View:
        """Wait until a view containing this worker is agreed (the engine decides; see ftcomm.engine)."""
        engine = self._engine
        last_debug = 0.0
        while True:
            now = time.monotonic()
            if now > deadline:
                self._raise_stuck()
            self._changed.clear()
            self._drain()
            statuses, addresses = self._statuses()
            conflict = core.settings_conflict(engine, self._settings_tuple, statuses)
            if conflict is not None:
                raise ConfigMismatch(conflict)
            actions = engine.agree(now, statuses)
            if actions and isinstance(actions[-1], Form):  # agreed: publish what comes before, then form
                self._perform(actions[:-1], addresses)
                return self._enter(actions[-1].view)
            self._perform(actions, addresses)
            if log.isEnabledFor(logging.DEBUG) and now - last_debug > 1.0:
                last_debug = now
                log.debug("%s: proposals %s", engine.state.lower(),
                          {s.id: (s.alive, s.phase, s.current_view, s.proposal) for s in statuses.values()})
            if not any(isinstance(a, Fetch) for a in actions):  # a fetched proposal is looked at at once
                self._changed.wait(0.02)

    def _perform(self, actions: list, addresses: dict[str, tuple[str, int]]) -> None:
        """Carry out the engine's actions (all but Form, which the caller performs)."""
        for action in actions:
            if isinstance(action, Publish):
                self._publish()
            elif isinstance(action, PublishProposal):
                self._rendezvous.publish_proposal(action.view_id, action.digest, action.members)
            elif isinstance(action, Fetch):
                members = None
                if action.member in addresses:
                    members = self._rendezvous.fetch_proposal(*addresses[action.member], *action.key)
                self._engine.fetched_proposal(action.key, members)
            elif isinstance(action, Announce):
                self._gossip.announce(action.members)
            elif isinstance(action, Sync):
                self._gossip.sync(action.member)
            elif isinstance(action, Rejoined):
                log.warning("rejoining the group as a new member: %s", action.why)
                self._rejoined = True
                self._engine.joined_at = time.time()
                self._needs_reconcile = True
            else:
                raise core.IllegalTransition(f"the driver cannot perform {action!r} here")

    def _enter(self, view: View) -> View:
        """Start forming ``view``: from now on gossip about its members fires the abort signal.
        News posted before is not judged against it: the members' records read here are
        at least as new."""
        self._news_since = time.monotonic()
        self._abort = AbortSignal(self._drain)
        statuses, _ = self._statuses()
        for member in view.members:
            status = statuses.get(member)
            if member != self.id and (status is None or not status.alive):
                self._abort.fire(f"{member} is no longer alive")
            elif member != self.id and status.proposal != (view.id, view.digest) and member not in self._engine.vouched:
                self._abort.fire(f"{member} no longer proposes view {view.id}")
        for status in statuses.values():
            damage = self._engine.damage("metadata", status.id, status, self._ops)
            if damage is not None and damage.fault == "superseded":
                self._faults.append((self._news_since, damage.fault, status.id))
                self._abort.fire(damage.reason)
        return view

    def _form(self, view: View) -> None:
        """Form the communicator through rank 0's store and verify it with a tiny allreduce."""
        _, addresses = self._statuses()
        rank0 = view.members[0]
        if rank0 not in addresses:
            raise CommunicatorError(f"rank 0 ({rank0}) of view {view.id} is not reachable through gossip")
        store = self._rendezvous.view_store(view, *addresses[rank0])
        timeout = self.options.formation_timeout
        comm = self._backend.form(store, view.rank_of(self.id), view.size, view.id, self._abort, timeout,
                                  host=self._rendezvous.host)
        self._comm = comm
        check = int(view.digest, 16) >> 1
        probe = torch.tensor([check, -check], dtype=torch.int64, device=comm.device)
        comm.allreduce([probe], "min").wait(self._abort, timeout)
        if probe.tolist() != [check, -check]:
            raise CommunicatorError(f"view {view.id} failed verification: members disagree on its digest")

    def _reconcile(self, stamp: bool = True) -> bool:
        """Make every member's registered state identical; True if this worker received state.

        ``stamp``: record the reconciled state in the latest view change (a reconcile
        deferred until the state was registered belongs to the view formed before it).
        """
        self._needs_reconcile = True
        self.step, loaded, self._reconciled_digest = transfer.reconcile(
            self._comm, self._abort, self.state, self.step, self._view, self._secret)
        self._state_replaced = self._state_replaced or loaded
        self._needs_reconcile = False
        if stamp:
            self._record_reconciled()
        return loaded

    def _record_reconciled(self) -> None:
        """Stamp the latest view change with the state every member holds after reconciling, and
        let the batch-size / learning-rate policies adapt to the view (same state, same result)."""
        if self.state.registered and self.events:
            policy: dict = {}
            for obj in self._participants("view_changed"):
                policy.update(obj.view_changed(self.rank, self.world_size, self.step) or {})
            self.events[-1] = dataclasses.replace(self.events[-1], step=self.step,
                                                  state_digest=self._reconciled_digest, policy=policy or None)
            if policy:
                log.info("view %d: policy %s", self._view.id, policy)

    def _participants(self, hook: str) -> list[Any]:
        """Registered objects that follow the group's steps through ``hook``."""
        return [obj for obj in self.state.objects.values() if hasattr(obj, hook)]

    def _end_step(self, committed: bool) -> None:
        for obj in self._participants("step_ended"):
            obj.step_ended(committed)
        self._fire_deferred_aborts()

    def _fire_deferred_aborts(self) -> None:
        """The operation in flight ended: aborts held for it fire now."""
        while self._deferred_aborts:
            abort, reason, _ = self._deferred_aborts.pop()
            abort.fire(reason)

    # ------------------------------------------------------------------ gossip side
    def _on_gossip(self, event: GossipEvent) -> None:
        """Runs on the gossip thread, and only posts: the thread that waits on the view's
        collectives (or agrees on the next view) is woken and judges the news itself."""
        if len(self._inbox) < INBOX_LIMIT:
            self._inbox.append((time.monotonic(), event))
        else:  # nobody has looked for a long while: the next look reads the members' records
            self._inbox_overflowed = True
        self._changed.set()
        self._abort.nudge()

    def _drain(self) -> None:
        """Judge the gossip news posted since the last look (see :meth:`Engine.damage`): fire
        the abort signal the moment the view is damaged, or hold the abort until the
        operation in flight ends when a member left after completing it (at most
        ``leave_grace`` seconds). Runs on the waiting thread, never on the gossip thread."""
        if not self._draining.acquire(blocking=False):
            return  # another thread of this worker is judging the same news
        try:
            if self._inbox_overflowed:  # news was dropped: judge every member's present record instead
                self._inbox_overflowed = False
                now = time.monotonic()
                self._inbox.extend((now, GossipEvent(m.state if m.state in ("suspect", "dead", "left") else "metadata",
                                                     m, time.time(), m.id)) for m in self._gossip.members())
            while self._inbox:
                posted, event = self._inbox.popleft()
                if posted < self._news_since:
                    continue  # about an earlier view; see _enter
                member = event.member
                status = Status.from_metadata(member.id, member.state, member.metadata)
                damage = self._engine.damage(event.kind, member.id, status, self._ops)
                if damage is None:
                    continue
                if damage.fault is not None and len(self._faults) < 4096:
                    self._faults.append((posted, damage.fault, member.id))
                if damage.defer:
                    self._deferred_aborts.append((self._abort, damage.reason, posted + self.options.leave_grace))
                else:
                    self._abort.fire(damage.reason, at=posted)
            now = time.monotonic()
            for abort, reason, deadline in self._deferred_aborts:
                if now >= deadline:
                    abort.fire(reason, at=deadline)
        finally:
            self._draining.release()

    def _statuses(self) -> tuple[dict[str, Status], dict[str, tuple[str, int]]]:
        """Every member's status record, from gossip. A member that has never answered this
        worker directly is left out (unless it is in the current view): an alive record
        alone may be forged, and a phantom in a candidate view would hold up agreement."""
        statuses, addresses = {}, {}
        known = set(self._view.members) if self._view is not None else set()
        for m in self._gossip.members():
            if not m.confirmed and m.id != self.id and m.id not in known:
                continue
            status = Status.from_metadata(m.id, m.state, m.metadata)
            if status is not None:
                statuses[m.id] = status
                if status.rendezvous_port is not None:
                    addresses[m.id] = (m.host, status.rendezvous_port)
        return statuses, addresses

    def _status_record(self) -> dict:
        engine = self._engine
        named = engine.published_view()
        done_ops = (named.id, self._ops) if named is not None and engine.state == core.LEAVING else None
        return encode_status(engine.phase, engine.current_view, engine.proposal, engine.joined_at, self._config,
                             self.step, self._rendezvous.port, engine.floor, self._settings_tuple, done_ops,
                             self.insecure,
                             named.digest if named is not None else None, self._compute.median(),
                             agreed=engine.witnessed)

    def _publish(self) -> None:
        self._last_step_publish = time.monotonic()
        self._gossip.set_metadata(self._status_record())

    # ------------------------------------------------------------------ helpers
    def _prepare(self) -> None:
        """Before a collective: recover if the last one failed or a join is due at this boundary."""
        if self._closed:
            raise FtcommError("the group was shut down")
        if self._broken is not None:
            self._recover(self._broken, self._waiting_since)
        if self._join_pending:
            self._join_pending = False
            self._recover("join", time.monotonic())
        self._drain()
        if self._abort.reason is not None:
            raise MembershipChanged(self._abort.reason)

    def _run(self, start: Callable[[], Any]) -> Any:
        self._prepare()
        if self._needs_reconcile:
            self._reconcile()
        self._waiting_since = self._contributed_at = time.monotonic()
        try:
            result = start().wait(self._abort)  # starting can fail too (NCCL reports a dead peer at enqueue)
            self._confirm_after_stall()
        except MembershipChanged as exc:
            self._broken = self._classify(exc)
            raise
        self._ops += 1
        self._op_began = time.monotonic()
        self._fire_deferred_aborts()
        return result

    def _commit(self) -> None:
        self.step += 1
        if time.monotonic() - self._last_step_publish >= self.options.step_publish_interval:
            self._publish()
            try:
                self._judge_stragglers()
            except Exception:  # noqa: BLE001 - a report must never fail a committed step
                log.exception("judging stragglers failed")

    def _judge_stragglers(self) -> None:
        """Compare the view members' published compute times (see ftcomm.stragglers)."""
        if self._straggler_watch.factor <= 0 or self._view is None:
            return
        statuses, _ = self._statuses()
        times = {m: s.compute_s for m in self._view.members
                 if (s := statuses.get(m)) is not None and s.compute_s is not None}
        for report in self._straggler_watch.judge(times, time.time()):
            self.stragglers.append(report)
            if report.slow:
                log.warning("%s is a straggler: %.3f s of compute per step against %.3f s for the others "
                            "(straggler_factor %g)", report.member, report.compute_s, report.others_s,
                            self._straggler_watch.factor)
            else:
                log.info("%s is no longer a straggler", report.member)

    def _confirm_after_stall(self) -> None:
        """An operation that completed while (or after) this worker was cut off may have
        completed only here: the others, seeing this worker hang, may have abandoned the view
        and moved on (their abandoned communicators still finish the exchange). Whenever that
        is possible (this process was stalled, or it had to refute a suspicion, since the
        operation began; or the operation took longer than a probe interval after this
        worker's share was handed over), it learns what the others did meanwhile (a direct
        state exchange with a view member) before counting the operation; if the view moved
        on (the others withdraw their proposal the moment they break it), the operation is
        discarded like any aborted one and reconciling brings this worker up to date."""
        gossip = self._gossip
        late = time.monotonic() - self._contributed_at > gossip.config.probe_interval
        if not (late or gossip.last_stall >= self._op_began or gossip.last_refuted >= self._op_began) \
                or self._view is None:
            return
        reachable = [m for m in self._view.members if m != self.id and
                     (info := gossip.member(m)) is not None and info.state in ("alive", "suspect")]
        answered = not reachable  # everyone else left or died: the abort signal alone decides
        for member in reachable[:2]:
            if gossip.exchange(member):
                answered = True
                break
        self._drain()  # what the exchange brought
        if self._abort.reason is not None or not answered:
            # Without an answer nothing shows the view is intact: discarding is the safe side.
            raise CollectiveAborted(f"an operation completed after this worker may have been cut off, and "
                                    f"{self._abort.reason or 'no member of the view answered'}")

    def _classify(self, exc: BaseException) -> str:
        """Why the view broke: crash, hang, leave, partition, superseded or backend."""
        self._drain()  # news posted after the abort was noticed still counts
        if isinstance(exc, CommunicatorError) and self._view is not None:
            # A connection of the view broke: the member behind it may still be closing its
            # other sockets (its gossip port can accept for a few milliseconds more).
            self._probe_crashed(self._view.members, settle=CRASH_SETTLE_S)
        elif self._view is not None:
            # Gossip may suspect a crashed member before any collective touched it (the
            # training thread was computing): a refused connection still names it a crash.
            suspects = {member for _, kind, member in self._faults if kind == "suspect"}
            if suspects:
                self._probe_crashed([m for m in self._view.members if m in suspects], timeout=0.05)
        reason = core.classify([(kind, member) for _, kind, member in self._faults],
                               self._view.size if self._view is not None else None)
        log.debug("view broke (%s: %s); faults %s: %s", type(exc).__name__, exc,
                  [(kind, member) for _, kind, member in self._faults], reason)
        return reason

    def _probe_crashed(self, members: Iterable[str], timeout: float = 0.25, settle: float = 0.0) -> None:
        """Crash fast path: members whose host refuses a connection are declared dead now.
        A refusal comes back within a round trip; ``timeout`` bounds the wait for a host
        that does not answer at all (lost or partitioned). ``settle``: when nobody refuses
        at first, the ports that accepted are tried again for this long."""
        others = [m for m in members if m != self.id]
        by_id = {m.id: m for m in self._gossip.members()}
        targets = [(m, (by_id[m].host, by_id[m].port)) for m in others if m in by_id and by_id[m].state != "dead"]
        gone = [m for (m, _), refused in zip(targets, refused_many([a for _, a in targets], timeout)) if refused]
        if not gone and settle > 0:
            gone = [m for (m, _), refused in zip(targets, refused_many([a for _, a in targets], timeout, settle))
                    if refused]
        for member in gone:
            self._faults.append((time.monotonic(), "crash", member))
            self._gossip.declare_dead(member)

    def _raise_stuck(self) -> None:
        if self._view is None or self._engine.state == core.JOINING:
            raise FtcommTimeout(
                f"no view with at least min_workers={self.min_workers} members could be agreed "
                f"(this worker sees {len(self._gossip.live_members())} live members; group full or "
                f"peers unreachable?)")
        raise QuorumLost(f"cannot reach a majority of view {self._view.id} ({self._view.size} members) "
                         f"within {self.options.quorum_timeout:g} s: this worker is on the minority side "
                         f"of a partition or the others are gone")

    def _buckets_for(self, params: list[torch.Tensor]) -> GradientBuckets:
        params = [p for p in params if p.requires_grad]
        buckets = self._buckets
        if buckets is None or len(buckets.params) != len(params) or any(
                a is not b for a, b in zip(buckets.params, params)):
            if buckets is not None:
                buckets.remove()
            buckets = self._buckets = GradientBuckets(
                params, self.options.bucket_mb, self.options.overlap,
                launch=lambda flat: self._comm.allreduce([flat], "sum"),
                may_overlap=self._may_overlap, world_size=lambda: self._comm.size,
                join=lambda: 1.0 if self._engine.admits_joiner(self._statuses()[0]) else 0.0,
                data_valid=lambda: all(obj.batch_valid() for obj in self._participants("batch_valid")))
        return buckets

    def _may_overlap(self) -> bool:
        """Backward may start reducing: nothing has to happen before this step's collectives."""
        self._drain()
        return (self._comm is not None and self._broken is None and not self._join_pending
                and not self._needs_reconcile and self._abort.reason is None and not self._closed)

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
