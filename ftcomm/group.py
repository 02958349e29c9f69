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
import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import msgpack
import torch

from .backends.base import AbortSignal
from .backends import communicator_class
from .buckets import GradientBuckets
from . import netif
from .errors import (AddressError, CollectiveAborted, CommunicatorError, ConfigMismatch, FtcommError, FtcommTimeout,
                     MembershipChanged, QuorumLost, RetryLimitExceeded, SecretRequired, StateError)
from .gossip import FaultFilter, GossipConfig, GossipEvent, GossipNode
from .gossip.runtime import parse_address
from .rendezvous import Rendezvous, refused_many
from .state import TrainingState, tensor_bytes
from . import engine as core
from .engine import Announce, Engine, Fetch, Form, Publish, PublishProposal, Rejoined, Sync
from .view import ACTIVE, JOINING, Status, View, encode_status

log = logging.getLogger(__name__)

STATE_TAG_BYTES = 32
MAX_MANIFEST_BYTES = 256 << 20


@dataclass(frozen=True)
class GroupOptions:
    """Options of a fault-tolerant group (``ftcomm.init(**options)``); see docs/CONFIGURATION.md."""

    settle_interval: float = 0.05
    """A candidate view must stay unchanged this long before it is proposed. Longer batches
    simultaneous changes into one re-formation; shorter re-forms sooner."""

    init_timeout: float = 120.0
    """``init`` raises FtcommTimeout when no view with ``min_workers`` members forms in time."""

    formation_timeout: float = 10.0
    """Bound on forming one communicator (rendezvous and Gloo connect); a formation that
    times out is abandoned and the view agreed again."""

    quorum_timeout: float = 300.0
    """How long a worker cut off from the majority waits for the partition to heal before
    ``QuorumLost``. Long enough to ride out a switch reboot; short enough to free the node."""

    max_retries: int = 5
    """Consecutive re-formations ``execute`` tolerates before ``RetryLimitExceeded``."""

    bucket_mb: float = 25.0
    """Size of the flat gradient buckets of ``wait_gradients_ready`` (one allreduce each;
    the first bucket is at most 1 MB so communication starts early, as in DDP). Larger
    buckets mean fewer collectives; smaller ones start overlapping sooner."""

    overlap: bool = True
    """Reduce each bucket during backward as soon as its gradients are ready (hooks on the
    parameters, installed at the first ``wait_gradients_ready``). Gradient accumulation
    then needs ``with ft.no_sync():`` around all but the last backward. False: reduce
    everything inside ``wait_gradients_ready``."""

    partition_policy: str = "quorum"
    """``quorum`` (safe): only a side holding a majority of the previous view (ties: its
    oldest member) continues. ``availability``: every side continues; sides may diverge
    and are not merged back automatically."""

    leave_grace: float = 2.0
    """A member that leaves gracefully after completing the group operation (gradient step
    or collective) this worker is still in has already sent its share of it: the operation
    is let finish (up to this many seconds) before the view is re-formed, instead of being
    aborted. Crashes and hangs abort at once."""

    step_publish_interval: float = 2.0
    """Minimum seconds between gossip updates of the committed step (shown by ``ftcomm
    members``); every update is a broadcast to the whole group."""

    gossip: GossipConfig = field(default_factory=GossipConfig)
    """The membership protocol's configuration (a GossipConfig, or a dict of its fields)."""

    fault_filter: FaultFilter | None = None
    """Testing API: drop, delay or partition this worker's gossip traffic."""

    handle_signals: bool = True
    """Install a SIGTERM handler and an excepthook that leave the group gracefully (main
    thread only); ``shutdown`` also runs at interpreter exit. On SIGTERM a handler installed
    before runs first, then the worker exits with status 143 and leaves on the way out."""

    def __post_init__(self) -> None:
        """Refuse a value no worker could run with, naming the option and what it accepts:
        TypeError for a wrong type, ValueError for a value out of range."""
        def number(name: str, zero_allowed: bool, unit: str = "seconds") -> None:
            value = getattr(self, name)
            accepted = f"{'>= 0' if zero_allowed else '> 0'} and finite ({unit})"
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number {accepted}, got {value!r}")
            if not ((0 <= value if zero_allowed else 0 < value) and value < float("inf")):
                raise ValueError(f"{name} must be {accepted}, got {value!r}")

        for name in ("init_timeout", "formation_timeout", "quorum_timeout"):
            number(name, zero_allowed=False)
        for name in ("settle_interval", "leave_grace", "step_publish_interval"):
            number(name, zero_allowed=True)
        number("bucket_mb", zero_allowed=False, unit="MB")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int):
            raise TypeError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {self.max_retries}")
        for name in ("overlap", "handle_signals"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.partition_policy not in ("quorum", "availability"):
            raise ValueError(f"partition_policy must be 'quorum' or 'availability', got {self.partition_policy!r}")
        if not isinstance(self.gossip, GossipConfig):
            raise TypeError(f"gossip must be a GossipConfig (ftcomm.init also takes a dict of its fields), "
                            f"got {type(self.gossip).__name__}")
        if self.fault_filter is not None and not isinstance(self.fault_filter, FaultFilter):
            raise TypeError(f"fault_filter must be None or a FaultFilter, got {type(self.fault_filter).__name__}")


@dataclass(frozen=True)
class ViewChange:
    """One re-formation: why, who changed, and how long each phase took (seconds)."""

    view_id: int
    members: tuple[str, ...]
    reason: str  # init | crash | hang | leave | join | partition | rejoin | backend
    added: tuple[str, ...]
    removed: tuple[str, ...]
    detect_s: float  # how long the failed collective was blocked before the fault was noticed
    agree_s: float
    form_s: float
    reconcile_s: float
    time: float  # time.time() when the group was ready again
    abort_latency_s: float | None = None  # from the abort signal firing to the training thread noticing
    step: int | None = None  # committed step once the state was reconciled in this view
    state_digest: int | None = None  # digest of the registered state then (equal on every member)
    policy: dict | None = None  # what the batch-size / learning-rate policies set for this view

    @property
    def total_s(self) -> float:
        return self.detect_s + self.agree_s + self.form_s + self.reconcile_s


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
        self._config = hashlib.blake2b(json.dumps(self.settings, sort_keys=True).encode(), digest_size=4).hexdigest()
        self.state = TrainingState()
        self.step = 0
        self.events: list[ViewChange] = []
        self._comm: Any = None  # the backend's communicator of the current view
        self._abort = AbortSignal()
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
        self._deferred_aborts: list[tuple[AbortSignal, str]] = []  # see _defer_abort
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
        try:
            gossip = self._gossip = GossipNode((host, port), cluster=cluster, secret=self._secret,
                                               config=member_cap(opts.gossip, max_workers),
                                               metadata=self._status_record(), fault_filter=opts.fault_filter)
            self._gossip.subscribe(self._on_gossip)
            self._gossip.start(peers)
            self.id = self._engine.id = self._gossip.id
            self._install_exit_hooks()
            self._recover("init", time.monotonic(), opts.init_timeout)
        except BaseException:
            if gossip is not None:
                gossip.stop()
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
        contributors, joiners = float(tail[0]), float(tail[1])
        if joiners > 0:
            self._join_pending = True
        # Nobody's gradients are valid (every worker just received state), or a sampler is
        # registered and some batch did not match the plan: committing would lose its samples.
        if contributors < 1 or (self._participants("batch_valid") and contributors < self._comm.size - 0.5):
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
        reason = "rejoin" if self._rejoined else self._reason_for(reason, before, view)
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
            statuses, addresses = self._statuses()
            self._check_config(statuses)
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
        """Start forming ``view``: from now on gossip about its members fires the abort signal."""
        self._abort = AbortSignal()
        statuses, _ = self._statuses()
        for member in view.members:  # news that reached only the previous signal
            status = statuses.get(member)
            if member != self.id and (status is None or not status.alive):
                self._abort.fire(f"{member} is no longer alive")
            elif member != self.id and status.proposal != (view.id, view.digest):
                self._abort.fire(f"{member} no longer proposes view {view.id}")
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
        comm, abort = self._comm, self._abort
        mine = torch.tensor([self.step, self.state.digest(self.step), self.state.signature()], dtype=torch.int64,
                            device=comm.device)
        gathered = [tuple(t.tolist()) for t in comm.allgather(mine).wait(abort)]
        if len({g[2] for g in gathered}) > 1:
            self._raise_model_mismatch(gathered)
        pairs = [g[:2] for g in gathered]
        loaded = False
        if len(set(pairs)) > 1:
            top = max(p[0] for p in pairs)
            source = min(r for r, p in enumerate(pairs) if p[0] == top)
            loaded = self._transfer_state(source, load=pairs[comm.rank] != pairs[source])
            self._state_replaced = self._state_replaced or loaded
        self._needs_reconcile = False
        self._reconciled_digest = self.state.digest(self.step) if loaded else int(mine[1])
        if stamp:
            self._record_reconciled()
        return loaded

    def _transfer_state(self, source: int, load: bool) -> bool:
        """Broadcast rank ``source``'s state to every member (each takes part); members with
        ``load`` replace theirs with it. Returns ``load``.

        Raw tensor bytes and a msgpack manifest travel, never a pickle. With a secret the
        source signs step, manifest and bytes (keyed BLAKE2b) and members verify before
        loading anything; a transfer that fails verification raises CommunicatorError.
        """
        comm, abort = self._comm, self._abort
        if comm.rank == source:
            manifest, data = self.state.pack(self.step, comm.device)
            header = self._state_tag(manifest, data) + manifest
            sizes = torch.tensor([len(header), data.numel()], dtype=torch.int64, device=comm.device)
        else:
            sizes = torch.zeros(2, dtype=torch.int64, device=comm.device)
        comm.broadcast(sizes, source).wait(abort)
        header_len, data_len = (int(x) for x in sizes.tolist())
        if comm.rank != source and not (STATE_TAG_BYTES < header_len <= MAX_MANIFEST_BYTES
                                        and 0 <= data_len <= self.state.transfer_limit()):
            raise CommunicatorError(f"rank {source} announced a state of {header_len} + {data_len} bytes, beyond "
                                    f"what this worker's model can hold; discarded")
        if comm.rank == source:
            head = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(comm.device)
        else:
            head = torch.empty(header_len, dtype=torch.uint8, device=comm.device)
            data = torch.empty(data_len, dtype=torch.uint8, device=comm.device)
        comm.broadcast(head, source).wait(abort)
        comm.broadcast(data, source).wait(abort)
        if not load:
            return False
        header = head.cpu().numpy().tobytes()
        tag, manifest = header[:STATE_TAG_BYTES], header[STATE_TAG_BYTES:]
        if not hmac.compare_digest(tag, self._state_tag(manifest, data)):
            raise CommunicatorError(f"the state sent by rank {source} in view {self._view.id} failed "
                                    f"authentication; discarded")
        try:
            self.step = self.state.unpack(manifest, data)
        except StateError as exc:
            raise CommunicatorError(f"the state sent by rank {source} in view {self._view.id} is malformed ({exc}); "
                                    f"discarded") from None
        return True

    def _state_tag(self, manifest: bytes, data: torch.Tensor) -> bytes:
        """Keyed BLAKE2b of a state transfer in the current view with the group's secret (zeros
        without one); the view is covered, so a transfer replayed in a later view fails."""
        if self._secret is None:
            return bytes(STATE_TAG_BYTES)
        mac = hashlib.blake2b(key=hashlib.sha256(b"ftcomm-state\0" + self._secret).digest(),
                              digest_size=STATE_TAG_BYTES)
        mac.update(f"{self._view.id}/{self._view.digest}\0".encode())
        mac.update(len(manifest).to_bytes(8, "little"))
        mac.update(manifest)
        mac.update(tensor_bytes(data.cpu()))
        return mac.digest()

    def _raise_model_mismatch(self, gathered: list[tuple[int, int, int]]) -> None:
        """Every member raises ConfigMismatch saying how the models differ (one more allgather)."""
        comm = self._comm
        mine_list = self.state.describe()
        mine = msgpack.packb(mine_list)
        lengths = comm.allgather(torch.tensor([len(mine)], dtype=torch.int64, device=comm.device)).wait(self._abort)
        longest = max(int(t.item()) for t in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8, device=comm.device)
        padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        theirs = comm.allgather(padded).wait(self._abort)
        for rank, (blob, length) in enumerate(zip(theirs, lengths)):
            if gathered[rank][2] == gathered[comm.rank][2]:
                continue
            other = msgpack.unpackb(blob.cpu().numpy().tobytes()[:int(length.item())], raw=False)
            detail = _first_difference(mine_list, other)
            raise ConfigMismatch(f"the registered model of member {self._view.members[rank]} (rank {rank}) differs "
                                 f"from this worker's: {detail}; start every worker with the same model")

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
        while self._deferred_aborts:
            abort, reason = self._deferred_aborts.pop()
            abort.fire(reason)

    # ------------------------------------------------------------------ gossip side
    def _on_gossip(self, event: GossipEvent) -> None:
        """Runs on the gossip thread: fire the abort signal the moment the view is damaged."""
        self._changed.set()
        member = event.member
        status = Status.from_metadata(member.id, member.state, member.metadata)
        damage = self._engine.damage(event.kind, member.id, status, self._ops)
        if damage is None:
            return
        if damage.fault is not None and len(self._faults) < 4096:
            self._faults.append((time.monotonic(), damage.fault, member.id))
        if damage.defer:
            self._defer_abort(damage.reason)
        else:
            self._abort.fire(damage.reason)

    def _defer_abort(self, reason: str) -> None:
        """Let the step in flight finish before the view is re-formed: the abort fires when the
        step ends (committed or not) or after ``leave_grace`` seconds, whichever is first."""
        abort = self._abort
        self._deferred_aborts.append((abort, reason))
        timer = threading.Timer(self.options.leave_grace, abort.fire, args=(reason,))
        timer.daemon = True
        timer.start()

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
        settings = (self.settings["backend"], self.min_workers, self.max_workers, self.settings["partition_policy"])
        return encode_status(engine.phase, engine.current_view, engine.proposal, engine.joined_at, self._config,
                             self.step, self._rendezvous.port, engine.floor, settings, done_ops, self.insecure,
                             named.digest if named is not None else None)

    def _publish(self) -> None:
        self._last_step_publish = time.monotonic()
        self._gossip.set_metadata(self._status_record())

    def _admissible_joiner(self) -> bool:
        """A worker waits to join and the view has room for it (the pending-join flag)."""
        view = self._view
        if self.max_workers is not None and view.size >= self.max_workers:
            return False
        for m in self._gossip.live_members():
            if m.id in view.members or not m.confirmed:
                continue
            status = Status.from_metadata(m.id, m.state, m.metadata)
            if status is not None and status.phase == JOINING and status.config == self._config:
                return True
        return False

    def _check_config(self, statuses: dict[str, Status]) -> None:
        """Refuse to train with a group started with other settings (the newer worker raises)."""
        for m in self._gossip.live_members():
            status = statuses.get(m.id)
            if status is None or status.config == self._config or m.id == self.id:
                continue
            if status.phase == ACTIVE or status.joined_at < self._engine.joined_at:
                theirs = status.settings
                names = ["backend", "min_workers", "max_workers", "partition_policy"]
                mine = [self.settings[n] for n in names]
                diffs = [f"{n}={a!r} but the group uses {n}={b!r}" for n, a, b in zip(names, mine, theirs) if a != b]
                detail = "; ".join(diffs) or "settings differ"
                raise ConfigMismatch(f"this worker was started with {detail} (member {m.id}): "
                                     f"start all workers of a group with the same settings")

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
        if self._abort.reason is not None or not answered:
            # Without an answer nothing shows the view is intact: discarding is the safe side.
            raise CollectiveAborted(f"an operation completed after this worker may have been cut off, and "
                                    f"{self._abort.reason or 'no member of the view answered'}")

    def _classify(self, exc: BaseException) -> str:
        """Why the view broke: crash, hang, leave, partition, superseded or backend."""
        if isinstance(exc, CommunicatorError) and self._view is not None:
            self._probe_crashed(self._view.members)
        elif self._view is not None:
            # Gossip may suspect a crashed member before any collective touched it (the
            # training thread was computing): a refused connection still names it a crash.
            suspects = {member for _, kind, member in self._faults if kind == "suspect"}
            if suspects:
                self._probe_crashed([m for m in self._view.members if m in suspects], timeout=0.05)
        kinds = {kind for _, kind, _ in self._faults}
        lost = {member for _, kind, member in self._faults if kind != "superseded"}
        if "left" in kinds:
            return "leave"
        if "superseded" in kinds:
            return "superseded"
        if "crash" in kinds:
            return "crash"
        if len(lost) > 1 and self._view is not None and 2 * len(lost) >= self._view.size:
            return "partition"
        if "suspect" in kinds:
            return "hang"
        if "dead" in kinds:
            return "crash"
        return "backend"

    def _reason_for(self, noticed: str, before: tuple[str, ...], view: View) -> str:
        """Name a re-formation by what happened to the members it dropped."""
        removed = [m for m in before if m not in view.members]
        if not removed:
            return "join" if noticed not in ("init",) and len(view.members) > len(before) else noticed
        states = {m.id: m.state for m in self._gossip.members()}
        kinds = [states.get(m, "dead") for m in removed]
        if all(k == "left" for k in kinds):
            return "leave"
        if len(removed) > 1 and 2 * len(removed) >= len(before):
            return "partition"
        if any(k == "suspect" for k in kinds) or noticed == "hang":
            return "hang"
        return "crash" if any(k == "dead" for k in kinds) else noticed

    def _probe_crashed(self, members: Iterable[str], timeout: float = 0.25) -> None:
        """Crash fast path: members whose host refuses a connection are declared dead now.
        A refusal comes back within a round trip; ``timeout`` bounds the wait for a host
        that does not answer at all (lost or partitioned)."""
        others = [m for m in members if m != self.id]
        by_id = {m.id: m for m in self._gossip.members()}
        targets = [(m, (by_id[m].host, by_id[m].port)) for m in others if m in by_id and by_id[m].state != "dead"]
        for (member, _), gone in zip(targets, refused_many([a for _, a in targets], timeout)):
            if gone:
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
                join=lambda: 1.0 if self._admissible_joiner() else 0.0,
                data_valid=lambda: all(obj.batch_valid() for obj in self._participants("batch_valid")))
        return buckets

    def _may_overlap(self) -> bool:
        """Backward may start reducing: nothing has to happen before this step's collectives."""
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


def check_worker_counts(min_workers: int, max_workers: int | None) -> None:
    """TypeError or ValueError, naming the argument, unless ``min_workers`` is an int >= 1
    and ``max_workers`` is None or an int >= ``min_workers`` (bools are not counts)."""
    if isinstance(min_workers, bool) or not isinstance(min_workers, int):
        raise TypeError(f"min_workers must be an int >= 1, got {min_workers!r}")
    if min_workers < 1:
        raise ValueError(f"min_workers must be an int >= 1, got {min_workers}")
    if max_workers is None:
        return
    if isinstance(max_workers, bool) or not isinstance(max_workers, int):
        raise TypeError(f"max_workers must be None or an int >= min_workers ({min_workers}), got {max_workers!r}")
    if max_workers < min_workers:
        raise ValueError(f"max_workers must be None or an int >= min_workers ({min_workers}), got {max_workers}")


def member_cap(config: GossipConfig, max_workers: int | None) -> GossipConfig:
    """``config`` with its member table capped at twice ``max_workers`` plus 16 (standbys,
    and dead or left members not yet forgotten), unless ``max_members`` was set."""
    default = GossipConfig().max_members
    if max_workers is None or config.max_members != default:
        return config
    return config.with_overrides(max_members=min(default, 2 * max_workers + 16))


def check_secret(secret: Any) -> bytes | None:
    """The secret as bytes (None: no secret); an empty or non-string secret is an error."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise TypeError(f"secret must be a string or bytes, not {type(secret).__name__}")
    if not secret:
        raise ValueError("secret is empty, which would leave the group unauthenticated: give every worker the "
                         "same non-empty secret (secret= or $FTCOMM_SECRET; e.g. from "
                         "`python -c 'import secrets; print(secrets.token_hex(16))'`), or leave it unset on a "
                         "loopback-only group")
    return secret


def check_protection(host: str, secret: bytes | None, insecure: bool) -> bool:
    """Protected mode: True when the group runs unauthenticated on a non-loopback address
    (only with ``insecure``); raise SecretRequired when that was not asked for."""
    if secret is not None or ipaddress.ip_address(host).is_loopback:
        return False
    if not insecure:
        raise SecretRequired(
            f"this worker binds {host}, which other hosts can reach, and has no secret: anyone who can reach it "
            f"could join the group, change its membership or feed it state. Give every worker the same secret "
            f"(secret=... or FTCOMM_SECRET=...), or, on a network you fully trust, opt out with insecure=True "
            f"(FTCOMM_INSECURE=1); see docs/SECURITY.md")
    log.warning("INSECURE: this group runs without a secret on %s; any host that can reach it can join it or "
                "disturb it (insecure=True). Set a secret; see docs/SECURITY.md", host)
    return True


def check_addresses(bind_host: str, peers: list[str]) -> str:
    """The IPv4 address to bind, or, before anything starts, AddressError for a bind address
    that cannot work: a name that does not resolve, IPv6, a wildcard, an address no
    interface of this machine holds, a loopback address with peers on other hosts."""
    try:
        address = netif.resolve(bind_host)
    except OSError:
        raise AddressError(f"bind host {bind_host!r} does not resolve to an IPv4 address") from None
    if ":" in address:
        raise AddressError(f"bind address {address} is IPv6: ftcomm's planes speak IPv4; bind to an IPv4 address "
                           f"of this host")
    if netif.is_wildcard(address):
        raise AddressError(f"bind address {address} is a wildcard: every worker tells the others to reach it "
                           f"at its bind address, so bind to an address of this host they can reach "
                           f"(bind='HOST:PORT' or FTCOMM_BIND), or leave bind unset to use this host's address")
    if not netif.is_loopback(address):
        if netif.interface_of(address) is None:
            raise AddressError(f"bind address {address} is not an address of this machine (no interface holds it)")
        return address
    for peer in peers:
        host = parse_address(peer)[0]
        try:
            remote = not netif.is_loopback(host) and netif.interface_of(host) is None
        except OSError:  # a name that does not resolve now: gossip reports it when it tries
            continue
        if remote:
            raise AddressError(f"this worker is bound to the loopback address {address}, but peer {peer} is on "
                               f"another host: a loopback address is reachable from this machine only. Bind to an "
                               f"address of this host that {host} can reach (bind='HOST:PORT' or FTCOMM_BIND), or "
                               f"leave bind unset to use this host's address")
    return address


def _first_difference(mine: list, theirs: list) -> str:
    """How two :meth:`TrainingState.describe` lists differ, in words."""
    for a, b in zip(mine, theirs):
        if a != b:
            if a[0] == b[0]:
                return f"{a[0]} is {a[1]}{a[2]} here but {b[1]}{b[2]} there"
            return f"{a[0]} ({a[1]}{a[2]}) here is {b[0]} ({b[1]}{b[2]}) there"
    if len(mine) != len(theirs):
        extra = (mine if len(mine) > len(theirs) else theirs)[min(len(mine), len(theirs))]
        return f"{len(mine)} tensors here and {len(theirs)} there (first unmatched: {extra[0]})"
    return "their parameter lists differ"


def _parameters(model_or_params: Any) -> list[torch.Tensor]:
    if hasattr(model_or_params, "parameters"):
        return list(model_or_params.parameters())
    return list(model_or_params)
