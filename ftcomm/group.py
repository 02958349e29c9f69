"""The fault-tolerant group: the public training API of one worker.

:class:`FaultTolerantGroup` joins the gossip layer, builds the worker's ports over the
real world (:mod:`ftcomm.runtime.live_ports`: gossip, rendezvous stores, probes, the
backend's communicators, the gradient buckets, the registered state) and its
:class:`~ftcomm.runtime.worker.WorkerLoop` (re-formations, gradient steps, collectives,
joins at step boundaries, stragglers, leaving), and runs the loop's phases for every call
(:func:`ftcomm.runtime.live_ports.run`). Every entry point only posts or waits: the gossip
thread posts news (:mod:`ftcomm.runtime.news`), the SIGTERM handler raises SystemExit, and
the training thread judges the news and performs everything.
"""

from __future__ import annotations

import atexit
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

from .backends import communicator_class
from .core import engine as core
from .core.engine import Engine
from .core.view import PROTOCOL, View, state_elsewhere
from .errors import (CommunicatorError, FtcommError, FtcommTimeout, MembershipChanged, NotInView, QuorumLost,
                     ReplicaLost, StateDiverged)
from .gossip import GossipNode
from .gossip.runtime import parse_address
from .ops import netcheck
from .ops.netcheck import NetworkReport
from .options import (GroupOptions, ViewChange, check_addresses, check_protection, check_secret,
                      check_worker_counts, member_cap)
from .runtime.live_ports import (BackendCollective, BackendCommunicators, GossipMembership, RegisteredState,
                                  StoreProposals, SystemClock, TcpProber, run)
from .runtime.driver import AwaitingState
from .runtime.ports import Ports
from .runtime.rendezvous import Rendezvous
from .runtime.worker import WorkerLoop
from .runtime.stragglers import StragglerReport, Stragglers
from .training.buckets import WIRE_DTYPES
from .training.reducer import DistributedDataParallel
from .training.replica import Replica
from .training.replica_repair import RepairChannel
from .training.replica_watch import ReplicaWatch
from .training.state import TrainingState

log = logging.getLogger(__name__)

_RUNNING: "weakref.WeakSet[FaultTolerantGroup]" = weakref.WeakSet()


def running_groups() -> list["FaultTolerantGroup"]:
    """The groups of this process that were formed and not shut down."""
    return [g for g in list(_RUNNING) if not g._closed]


UNNAMED_REPAIR_WAIT_S = 10.0
"""How long a process whose replica was torn down waits for a replacement when no lost
partner is named (a collective of the replica failed): a process that died is announced by
the launcher within a poll."""


class FaultTolerantGroup:
    """A data-parallel group that survives crashes, hangs, leaves, joins and partitions."""

    def __init__(self, backend: str = "gloo", peers: Iterable[str] = (), bind: str = "127.0.0.1:0",
                 min_workers: int = 1, max_workers: int | None = None, cluster: str = "ftcomm",
                 secret: str | bytes | None = None, options: GroupOptions | None = None,
                 insecure: bool = False, replica: tuple[int, int, str | None] = (1, 0, None),
                 group_ran: bool = False) -> None:
        backend_class = communicator_class(backend)  # NcclUnavailable here, before joining anyone
        check_worker_counts(min_workers, max_workers)
        if options is not None and not isinstance(options, GroupOptions):
            raise TypeError(f"options must be a GroupOptions (ftcomm.init takes its fields as keywords), got "
                            f"{type(options).__name__}")
        if not isinstance(cluster, str) or not cluster:
            raise TypeError(f"cluster must be a non-empty string, got {cluster!r:.40}")
        self.options = opts = options or GroupOptions()  # GroupOptions checks its own fields
        self.min_workers, self.max_workers = min_workers, max_workers
        size = replica[0]
        self.settings = {"backend": backend, "min_workers": min_workers, "max_workers": max_workers,
                         "partition_policy": opts.partition_policy, "protocol": PROTOCOL, "replica_size": size,
                         "sdc_policy": opts.sdc_policy, "fingerprint_every": opts.fingerprint_every}
        self._config = hashlib.blake2b(json.dumps(self.settings, sort_keys=True).encode(), digest_size=4).hexdigest()
        self.state = TrainingState()
        self.network_report: NetworkReport | None = None  # GroupOptions.network_check
        self._stragglers = Stragglers(opts.straggler_factor, opts.straggler_window, opts.straggler_policy,
                                      opts.straggler_cooldown)
        peers = list(peers)
        host, port = parse_address(bind)
        host = check_addresses(host, peers)  # every plane uses this one IPv4 address
        secret = check_secret(secret)
        drawn = os.environ.get("FTCOMM_SECRET_DRAWN") == "1" and secret is not None and \
            secret == os.environ.get("FTCOMM_SECRET", "").encode()
        self.checkpoint_secret = None if drawn else secret
        """What signs this worker's checkpoints (FlashCheckpointer): the group's secret, but
        for one ``ftcomm run`` drew for a single run on loopback."""
        self.insecure = check_protection(host, secret, insecure)
        raise_descriptor_limit()
        rendezvous = Rendezvous(host, opts.formation_timeout, secret)
        # min_workers and max_workers count replicas (a plain worker is a replica of one).
        engine = Engine("", self._config, min_workers, max_workers, opts.partition_policy, opts.settle_interval,
                        3 * opts.gossip.gossip_interval, joined_at=time.time(), max_retries=opts.max_retries,
                        settings=tuple(self.settings[n] for n in core.SETTING_NAMES),
                        rendezvous_port=rendezvous.port, insecure=self.insecure, group_ran=group_ran)
        self._membership = membership = GossipMembership(engine)
        self._comms = comms = BackendCommunicators(engine, backend_class, rendezvous, opts, membership, self.state,
                                                   secret)
        self._collective = collective = BackendCollective(comms, opts)
        ports = Ports(SystemClock(), membership, StoreProposals(rendezvous), TcpProber(), comms, collective,
                      RegisteredState(self.state))
        self._loop = loop = WorkerLoop(engine, ports, opts, self._stragglers)
        loop.on_diverged = self._discard_after
        # The agreement waits on news; this worker's own record counts as news, since reading
        # it back may complete the agreement (statuses come from gossip's table).
        membership.on_published = loop.news.changed.set
        self._secret = secret
        self.id = ""
        self._metrics = None
        self._replica: Replica | None = None
        self._watch: ReplicaWatch | None = None  # releases this process when a process of its replica is lost
        self._repair_channel: RepairChannel | None = None  # to the launcher that replaces a lost process
        self.repairs: list[float] = []  # seconds each repair of this process's replica took, in place
        self.restarts = _restarts()  # times the launcher started this worker again ($FTCOMM_RESTARTS)
        self.replica_size, self.shard_rank = replica[0], replica[1]
        self._owner = threading.get_ident()  # the thread that trains: only it acts at step boundaries
        self._keepers: weakref.WeakSet = weakref.WeakSet()  # FlashCheckpointers of this group (see _leave_with_state)
        self._left_checked = False  # a state kept by a member that lost the quorum was looked for
        self._left_keeper: Any = None  # where it was loaded from, until the next committed step
        self._left_step: int | None = None  # the step loaded from it
        try:
            if self.replica_size > 1:  # first: the replica's K processes meet (torch's process group)
                self._replica = collective.replica = Replica(*replica, backend, opts.init_timeout, host)
                engine.replica = (self._replica.key, self.shard_rank, self.replica_size)
            membership.node = GossipNode((host, port), cluster=cluster, secret=secret,
                                         config=member_cap(opts.gossip, max_workers and max_workers * size),
                                         metadata=loop.driver.record(), fault_filter=opts.fault_filter)
            membership.node.subscribe(loop.news.post)
            rendezvous.trust(membership.node.is_member_host)
            membership.node.start(peers)
            self.id = engine.id = membership.node.id
            if opts.metrics_port is not None:
                from .ops.metrics import MetricsServer
                self._metrics = MetricsServer(self, host, opts.metrics_port)
            backend_class.prepare(host)  # after the group's own listeners: see GlooCommunicator.prepare
            self._install_exit_hooks()
            if not self._run(loop.start(time.monotonic(), opts.init_timeout)):
                log.info("a group is training: this worker asks it for admission once its state is registered "
                         "(register_state), so that the group does not wait for this worker meanwhile")
            if engine.founding:
                self._check_network()
            if self._replica is not None:
                self._start_watch()
                self._repair_channel = RepairChannel.from_env()
                replica = self._replica
                loop.replica_lost = lambda: (replica.lost, min(replica.lost_shards, default=None)) \
                    if replica.lost is not None else None
            _RUNNING.add(self)
        except BaseException:
            if membership.node is not None:
                membership.node.stop()
            if self._metrics is not None:
                self._metrics.close()
            if self._replica is not None:
                self._replica.close()
            comms.close_listeners()
            rendezvous.close()
            raise

    def _start_watch(self) -> None:
        loop = self._loop

        def view() -> int | None:  # no step is owed while it re-forms, rejoins or has yet to reconcile
            engine = loop.engine
            current = engine.view
            owed = engine.state in core.IN_VIEW and engine.state != core.RECONCILE_DUE
            return current.id if current is not None and owed else None
        self._watch = ReplicaWatch(self._replica, self._membership.node, lambda: loop.step, view,
                                   self.options.gossip.probe_interval).start()

    def _check_open(self, where: str = "boundary") -> bool:
        """FtcommError after shutdown. Once the replica's collectives were torn down (a
        process of it died or hung: see ftcomm.training.replica_watch), the replica is
        repaired in place, or ReplicaLost when it cannot be (see :meth:`_repair`; ``where``
        the loss is seen). Whether it was repaired."""
        self._loop.check_open()
        if self._replica is not None and self._replica.lost is not None:
            self._repair(self._replica.lost, where)
            return True
        return False

    def _repairs(self, lost: ReplicaLost) -> bool:
        """Whether ``lost`` is repaired in place (see :meth:`_repair`) rather than raised: a
        partner was lost, not left gracefully, and the replica can be formed again."""
        return self._replica is not None and not lost.left and self._may_repair() is None

    def _may_repair(self) -> str | None:
        """Why this process's replica cannot be formed again with a replacement for its lost
        process, or None when it can: ``ftcomm run`` started it (and replaces the lost
        process), its group is one ftcomm made with Gloo, and either another replica holds
        the group's state or this process holds none worth keeping (with none elsewhere, the
        whole replica starts again from its checkpoints instead)."""
        replica, channel, loop = self._replica, self._repair_channel, self._loop
        if channel is None or channel.closed:
            return "no launcher replaces a lost process (ftcomm run --replica-size does)"
        if not replica.repairable:
            return "its process group is not one ftcomm can form again (NCCL, or torch.distributed initialized " \
                   "by the script, or a module with FSDP2's own collectives)"
        if loop.step == 0 and self.resumed_step is None:
            return None
        if not state_elsewhere(replica.key, loop.engine.config, loop.driver.statuses()[0]):
            return "no other replica holds the group's state, which a replacement would receive"
        return None

    def _repair(self, why: str, where: str, shard: int | None = None) -> None:
        """This process's replica lost a process (``why``; shard ``shard`` where known): it
        is formed again in place with a process ``ftcomm run`` starts to replace the lost
        one (see ftcomm.training.replica_repair). This process leaves its view, asks the
        launcher to replace a partner found hung or gone, meets the replacement at the
        address the launcher gives, and asks to join the group again with its replica,
        returning once the group took the replica whole (at a step boundary of the others)
        and each of its processes received the newest state of its shard from another
        replica. It keeps its interpreter, model and optimizer, and what agreeing raises may
        come from here too. ``where`` the loss was seen: ``step`` (in wait_gradients_ready:
        the step ends, discarded), ``call`` (a collective or ``execute`` inside a step: the
        step's gradients, computed on a torn-down replica, count as none), ``boundary``
        (between steps, or registering the state). ReplicaLost when it cannot be repaired
        (:meth:`_may_repair`), when no replacement came within ``init_timeout`` (10 s when
        no partner is known to be lost: then no launcher replaces anything), or when no
        other replica still holds the state once it formed again: exit, and the launcher
        starts the whole replica again."""
        replica, channel = self._replica, self._repair_channel
        replica.tear_down(why, shard)  # (when it was not yet: its collectives fail from now on)
        cannot = self._may_repair()
        if cannot is not None:
            raise ReplicaLost(f"this process's sharded replica is lost ({why}) and cannot be repaired in place: "
                              f"{cannot}; exit, and start the whole replica again (ftcomm run --replica-size "
                              f"does) to rejoin", shard)
        began = time.monotonic()
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        log.warning("this process's sharded replica is lost (%s): repairing it in place (this process leaves its "
                    "view and meets the process that replaces the lost one)", why)
        self._loop.repair_replica("its sharded replica lost a process", where)
        for lost in sorted(replica.lost_shards):
            channel.report(lost, replica.process_id(lost))
        # A lost process the launcher saw exit is announced within a poll; with none named,
        # the tear-down may have had another cause (a collective's error), and no launcher
        # replaces anything: the whole replica starts again soon instead of after init_timeout.
        wait = self.options.init_timeout if replica.lost_shards else min(self.options.init_timeout,
                                                                           UNNAMED_REPAIR_WAIT_S)
        deadline = began + wait
        while True:
            address = channel.meeting(deadline - time.monotonic())
            if address is None:
                raise ReplicaLost(f"this process's sharded replica is lost ({why}) and no process replaced the lost "
                                  f"one within {wait:g} s" + (" (the launcher is gone)" if channel.closed else "")
                                  + ": exit, and start the whole replica again to rejoin", shard)
            try:
                replica.reform(address)
                break
            except (FtcommError, RuntimeError) as exc:  # (the replacement is gone: the launcher restarts the replica)
                log.warning("forming this replica again at %s failed (%s): waiting for another replacement",
                            address, str(exc).splitlines()[0][:200])
        if not state_elsewhere(replica.key, self._loop.engine.config, self._loop.driver.statuses()[0]) and \
                (self._loop.step > 0 or self.resumed_step is not None):
            raise ReplicaLost("this process's sharded replica formed again, but no other replica holds the group's "
                              "state now (lost meanwhile): exit, and start the whole replica again to restore its "
                              "checkpoints", shard)
        self._loop.driver.replica_formed(replica.key)
        self._start_watch()
        log.warning("this process's sharded replica formed again in %.2f s (in place, formation %d): it joins the "
                    "group again and receives the newest state", time.monotonic() - began, replica.formations)
        try:
            self._run(self._loop.recover("replica repair", began))
        except AwaitingState:  # (repaired while registering its state: register_state asks to be let in)
            pass
        self.repairs.append(round(time.monotonic() - began, 4))

    def _run(self, phase: Any) -> Any:
        """Run a phase of the worker loop on this thread (see ftcomm.runtime.live_ports.run)."""
        return run(phase, self._loop.news.changed)

    # ------------------------------------------------------------------ public attributes
    @property
    def view(self) -> View:
        self._admit_before_state("view")
        return self._loop.view

    @property
    def step(self) -> int:
        """Committed steps; every member of a view holds the same count once reconciled."""
        return self._loop.step

    @step.setter
    def step(self, value: int) -> None:
        self._loop.step = value

    @property
    def restorable(self) -> bool:
        """True when no member of the current view had begun training (restored a checkpoint,
        see :meth:`state_restored`, or run a step) when the view formed: the members are
        starting the group together (a new group, or a whole job restarted). False in a view
        that a worker joined while the group was running: its state comes from the members.
        ``FlashCheckpointer.restore`` restores only in a restorable view. The same on every
        member of a view."""
        return self._loop.engine.restorable

    @property
    def _closed(self) -> bool:
        return self._loop.closed

    @property
    def rank(self) -> int:
        """This worker's rank in the current view (after ``shutdown``: in the view it left).
        Raises NotInView while it is in none (a straggler standing aside, a worker that lost
        its view and rejoins)."""
        return self._in_view("rank").rank_of(self.id)

    @property
    def world_size(self) -> int:
        """Members of the current view. Raises NotInView while this worker is in none."""
        return self._in_view("world_size").size

    def _admit_before_state(self, what: str) -> None:
        """Read on the training thread of a worker that holds back from a running group until
        its state is registered (see register_state), ``what`` (its rank, world size or view)
        needs a view: it asks to be admitted now, and the group waits in its next reconcile
        until this worker registers its state."""
        loop = self._loop
        if not loop.awaiting_state or loop.closed or threading.get_ident() != self._owner:
            return
        log.warning("ft.%s was read before register_state: this worker asks the running group to admit it now, "
                    "and the group waits until its state is registered; register the state right after init "
                    "(see docs/API.md, 'Order of the calls')", what)
        self._at_boundary(loop.admit())

    def _in_view(self, what: str) -> View:
        self._admit_before_state(what)
        view = self._loop.view  # read once: the training thread may leave it meanwhile
        if view is None:
            state = self._loop.engine.state
            why = ("it stands aside as a straggler" if state == core.STANDING_ASIDE
                   else "it holds back from the running group until its state is registered (register_state)"
                   if self._loop.awaiting_state else "it is rejoining the group")
            raise NotInView(f"this worker is in no view now ({why}); rank and world_size have a value again once "
                            f"it joins one (its training thread does so inside its current call to the group)")
        return view

    @property
    def shard_mesh(self) -> Any:
        """The 1-D torch ``DeviceMesh`` over this replica's ``replica_size`` processes (hand it
        to ``fully_shard``); None without ``replica_size`` > 1."""
        return self._replica.mesh if self._replica is not None else None

    @property
    def replica_rank(self) -> int:
        """This replica's rank among the replicas of the current view (``rank // replica_size``:
        a view holds whole replicas, each as ``replica_size`` consecutive ranks in shard order)."""
        return self.rank // self.replica_size

    @property
    def num_replicas(self) -> int:
        """Replicas in the current view (``world_size // replica_size``)."""
        return self.world_size // self.replica_size

    @property
    def gossip(self) -> GossipNode:
        return self._membership.node

    @property
    def events(self) -> list[ViewChange]:
        """Every view change of this worker, oldest first."""
        return self._loop.events

    @property
    def stragglers(self) -> list[StragglerReport]:
        """Straggler reports as judged here (changes only: a few per minute at most)."""
        return self._stragglers.reports

    @property
    def corruptions(self) -> list:
        """Every check whose state fingerprints differed (``fingerprint_every``), oldest first,
        as :class:`ftcomm.runtime.fingerprints.Corruption`: the step, the members named, the
        shard index with sharded replicas, whether a majority agreed, and, on a named member
        once repaired, the tensors that differed."""
        return self._loop.fingerprints.found

    @property
    def metrics_port(self) -> int | None:
        """The port of the Prometheus endpoint (``GroupOptions.metrics_port``), or None."""
        return self._metrics.port if self._metrics is not None else None

    def register_state(self, model: Any = None, optimizer: Any = None, sampler: Any = None, **extras: Any) -> None:
        """Register what must be identical on every worker (``state_dict`` objects or plain values).

        Objects that follow the group's steps (an :class:`ftcomm.ElasticSampler`, a
        :class:`ftcomm.LinearLRScaling`) are bound to it here; see docs/API.md. With
        ``replica_size`` > 1, StateError for a module with a parameter not sharded over
        :attr:`shard_mesh` (its shards would not match the other replicas'). FtcommError after
        ``shutdown``.

        A worker that found a running group at ``init`` is admitted to it here: it held back
        until now, so that the group never waited while it built its model. The calling
        thread is then the one that trains (it acts at step boundaries), and this raises what
        joining raises (FtcommTimeout after ``init_timeout``, GroupEnded, ConfigMismatch),
        the registered objects already bound."""
        self._check_open()
        if self._replica is not None:
            self._replica.check_sharded({"model": model, **extras})
            if self._repair_channel is not None and self._replica.repairable:
                self._repair_channel.declare()  # the launcher may replace a lost process of this replica now
        self.state.register(model=model, optimizer=optimizer, sampler=sampler, **extras)
        for obj in self.state.objects.values():
            if hasattr(obj, "bind_group"):
                obj.bind_group(self)
        loop = self._loop
        if loop.awaiting_state:
            # The state is here: the running group lets this worker in. The thread that
            # registers it is the one that trains (the sampler reads the rank on it).
            self._owner = threading.get_ident()
            self._at_boundary(loop.admit())
        else:
            self._resume_left_state()

    def _resume_left_state(self) -> None:
        """The whole job starts again after a member lost the quorum holding the state of a
        step that no FlashCheckpointer kept (see _leave_with_state): at the first
        registration, in a view where nobody has begun training and whose reconcile is still
        due (every member registers after the view formed), load that step from this host's
        shared memory; the view's reconcile then makes the newest state every member's. With
        sharded replicas only a step kept for every shard index is loaded. The copy is
        removed once the group committed a step after it (_discard_left_state)."""
        if self._left_checked:
            return
        self._left_checked = True
        from .training.checkpoint import left_step
        step = left_step(self.gossip.cluster, self.replica_size)
        if step is None or not self.restorable or self._loop.engine.state != core.RECONCILE_DUE:
            return
        try:
            keeper = self._left_checkpointer()
        except FtcommError as exc:  # (its directory not private to this user): this worker starts as registered
            log.warning("not resuming from the state of step %d kept when a member lost the quorum: %s", step, exc)
            return
        if not keeper.load_here(step):  # (each copy that did not verify was named in a warning)
            keeper.close()
            return
        self.state_restored(step)
        self._left_keeper, self._left_step = keeper, step
        log.warning("resuming from step %d, the state a member of cluster %r kept in %s when it lost the quorum; "
                    "the group's reconcile gives the newest state to every member (to start fresh instead, remove "
                    "it: ftcomm run --fresh)", step, self.gossip.cluster, keeper.shm)

    @property
    def resumed_step(self) -> int | None:
        """The step of the state kept when a member lost the quorum that this worker loaded
        at ``register_state`` (see _resume_left_state), until a step commits after it; None
        otherwise. ``FlashCheckpointer.restore`` offers it as a copy of that step, so that
        an older checkpoint never replaces it."""
        held = self._left_keeper is not None and self.step == self._left_step
        return self.step if held else None

    def _discard_after(self, step: int) -> None:
        """This worker's state was named wrong, or nobody's could be told right (see
        ``fingerprint_every``): the checkpoints its host's writer made after ``step``, the
        last step whose fingerprints agreed, may hold a wrong state, and go."""
        for checkpointer in [c for c in list(self._keepers) if not c.closed]:
            try:
                checkpointer.discard_after(step)
            except Exception as failure:  # noqa: BLE001 - the verdict is what the caller must see
                log.warning("could not delete the checkpoints after step %d: %s", step, failure)

    def _left_checkpointer(self) -> Any:
        """A FlashCheckpointer of the job under which a member that lost the quorum keeps its
        state when no checkpointer of the script's does (``<cluster>.left``)."""
        from .training.checkpoint import LEFT_SUFFIX, FlashCheckpointer
        return FlashCheckpointer(self, name=self.gossip.cluster + LEFT_SUFFIX, keep=1)

    def _discard_left_state(self) -> None:
        """A step committed after the kept state was loaded: every member holds a newer one,
        so the copy goes (a later start of a job of this cluster must not resume from it)."""
        keeper, self._left_keeper = self._left_keeper, None
        try:
            keeper.close(discard=True)
        except Exception as failure:  # noqa: BLE001 - training goes on; the copy is named
            log.warning("could not remove the kept state in %s: %s", keeper.shm, failure)

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
        re-formation (``QuorumLost``, ``FtcommTimeout``, ``ConfigMismatch``), and
        FtcommError on the training thread after ``shutdown``."""
        loop = self._loop
        on_owner = threading.get_ident() == self._owner
        if loop.engine.state == core.CLOSED and on_owner:
            raise FtcommError("the group was shut down")
        if loop.closed or not on_owner or self._collective.touched:
            return
        if self._replica is not None and self._replica.lost is not None:  # (before a step on a torn-down replica)
            self._check_open()
        self._at_boundary(loop.boundary())

    def _at_boundary(self, phase: Any, where: str = "boundary") -> Any:
        """Run ``phase``, begun with the registered state at the committed step (between
        steps, or in the gradient path before the optimizer steps: ``where`` is ``step``), and keep that
        state in the checkpoints before a QuorumLost leaves the group (see _leave_with_state).
        A worker whose state was named wrong again soon after a repair leaves the group before
        its StateDiverged reaches the script (a script that carries on gets FtcommError). A
        process of this worker's sharded replica found gone meanwhile: the replica is
        repaired in place (the step discarded: False), or ReplicaLost (see :meth:`_repair`)."""
        try:
            return self._run(phase)
        except ReplicaLost as exc:
            if not self._repairs(exc):
                raise
            self._repair(exc.reason, where, exc.shard)
            return False
        except QuorumLost as exc:
            self._leave_with_state(exc)
            raise
        except StateDiverged as exc:
            if exc.leaves:
                self.shutdown()
            raise

    def _leave_with_state(self, exc: QuorumLost) -> None:
        """This worker is cut off and leaves the group holding the state of its committed
        step, which the members it lost may never have had (the survivor of two whose
        partner's node is lost): each open FlashCheckpointer of the group makes sure this
        host's shared memory holds it (see FlashCheckpointer.keep_before_leaving), so that
        a restart of the whole job resumes from it instead of from an older checkpoint.
        Without one, the state goes to shared memory all the same, under the job
        ``<cluster>.left`` (see _resume_left_state). What was kept, or why not, is added to
        the error's message. Nothing at step 0 (nothing trained: a joiner cut off before it
        received the group's state)."""
        if self.step == 0:
            return
        kept = []
        keepers = [c for c in list(self._keepers) if not c.closed and c is not self._left_keeper]
        implicit = not keepers and self.state.registered
        if implicit:  # none of the user's: kept for the job's restart all the same (see _resume_left_state)
            try:
                keepers = [self._left_keeper or self._left_checkpointer()]
            except Exception as failure:  # noqa: BLE001 - the QuorumLost is what the caller must see
                kept.append(f"could not keep the state of step {self.step} in shared memory: {failure}")
        for checkpointer in keepers:
            try:
                where = checkpointer.keep_before_leaving()
            except Exception as failure:  # the QuorumLost is what the caller must see
                log.warning("could not keep the state of step %d before leaving: %s", self.step, failure)
                kept.append(f"could not keep the state of step {self.step}: {failure}")
            else:
                kept.append(f"the state of step {self.step} is kept in shared memory ({where}): the job started "
                            f"again on this host resumes from it (no FlashCheckpointer; ftcomm run --fresh removes "
                            f"it)" if implicit else
                            f"the state of step {self.step} is in the flash checkpoints ({where}): a restart of "
                            f"the job resumes from it")
            finally:
                if implicit:
                    self._left_keeper = None
                    try:
                        checkpointer.close()  # its published copy stays
                    except Exception as failure:  # noqa: BLE001
                        log.warning("closing the shared-memory copy of step %d: %s", self.step, failure)
        if kept:
            exc.args = (f"{exc.args[0] if exc.args else exc}; {'; '.join(kept)}",) + exc.args[1:]

    def state_restored(self, step: int | None, same_everywhere: bool = False) -> None:
        """The registered state was loaded from a checkpoint of ``step`` (None: not on this member).
        Unless every member loaded identical data (``same_everywhere``), the members compare
        digests before the next collective and the newest state wins. From now on this worker
        has begun training: a view it forms later is not :attr:`restorable`. Raises
        FtcommError after ``shutdown``."""
        self._check_open()
        self._loop.engine.began()
        self._loop.lineage = -1  # loaded, not committed in a view: compared with nobody's until it is
        if step is not None:
            self.step = step
        if not same_everywhere:
            self._loop.engine.restored()

    # ------------------------------------------------------------------ training API
    def wait_gradients_ready(self, model_or_params: Any, *, wire_dtype: torch.dtype = torch.float32,
                             sent_early: bool = False) -> bool:
        """Average gradients across the view in flat buckets.

        True: the gradients are averaged and the optimizer may step (the step is counted
        as committed). False: the view changed during the step; the step is discarded
        and the registered state was reconciled across the new view before returning.
        Never hangs on a failed peer: a fault aborts the wait within milliseconds of
        gossip reporting it. Raises QuorumLost when this worker is cut off from the
        majority for longer than ``quorum_timeout``, FtcommTimeout when no view forms
        within it, ConfigMismatch when a worker joins with other settings or another model,
        and RetryLimitExceeded when more than ``max_retries`` steps in a row failed and
        re-formed (the membership keeps changing: every step is discarded).

        With ``overlap`` on, buckets are already being reduced during backward (hooks
        installed by the first call, so the first step is not overlapped) and this call
        waits only for what is still in flight. When the view re-forms after backward
        began reducing and before this call (in an ``execute`` between them), this
        worker's gradients of the step went with the old view: the step still runs, with
        them counted as none (as for a worker whose state was just replaced), so that
        every member of the new view runs it alike (with an ElasticSampler, whose steps
        must count every member's batch, it is then discarded on every member).

        ``wire_dtype``: the dtype the gradients are summed in. ``torch.bfloat16`` or
        ``torch.float16`` sends half the bytes of float32 (the default) for 8 or 11 bits of
        mantissa in the sum (as DDP's bf16 / fp16 compression hooks); each gradient is
        handed back in its parameter's dtype. ``torch.int8`` sends a quarter: each block of
        256 elements quantized with a scale of its own, summed in float32 by one member
        per chunk and quantized again (an alltoall and an allgather instead of an
        all-reduce; bit-equal on every member; see ``ftcomm.training.quantized``): for
        pseudo-gradients that cross a slow link, too coarse for most gradients of a
        per-step all-reduce. Not for a wrapped model or a module sharded
        with FSDP2 (FtcommError); ValueError for another dtype.

        ``sent_early``: the gradients may reach the overlap hooks before the step's work is
        done (:class:`ftcomm.DiLoCo`'s ``delay`` hands its pseudo-gradients to them ahead of
        the outer step and trains on): the step's counters, which say whether this worker's
        contribution counts, then go out only at this call, so that a worker lost before it
        is never counted in the step. It adds a bucket: give the same value on every member.
        """
        self._owner = threading.get_ident()
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype is one of {', '.join(map(str, WIRE_DTYPES))}, not {wire_dtype}")
        if self._check_open("step"):
            return False  # (repaired: the step is discarded, and the replica is in the group again)
        if isinstance(model_or_params, DistributedDataParallel):
            if wire_dtype != torch.float32:
                raise FtcommError("a wrapped model's gradients are summed in its reducer's buckets, in float32")
            self._collective.use_wrapped(model_or_params)
        else:
            module = model_or_params if isinstance(model_or_params, torch.nn.Module) else None
            self._collective.use(_parameters(model_or_params), module, wire_dtype, sent_early)
        committed = self._at_boundary(self._loop.gradient_step(), "step")
        if committed and self._left_keeper is not None:
            self._discard_left_state()
        return committed

    def wrap(self, module: torch.nn.Module, bucket_mb: float | None = None) -> DistributedDataParallel:
        """``module`` in a :class:`ftcomm.DistributedDataParallel`: torch's DDP, whose C++
        reducer puts gradients straight into flat buckets during backward (no Python per
        parameter), and whose buckets this group reduces over its view, abortably. Run the
        forward pass through what this returns, then backward, then
        ``wait_gradients_ready(wrapped)``; ``wrapped.no_sync()`` as DDP's. Every parameter
        that requires a gradient must get one in every step (as DDP without
        ``find_unused_parameters``): otherwise FtcommError at ``wait_gradients_ready``.
        ``bucket_mb``: default the group's. Wrapping a module again (after unfreezing
        parameters: DDP's parameter list is fixed when it is built) retires the earlier
        wrapper. Not for sharded replicas (call ``wait_gradients_ready(model)``: FtcommError)."""
        self._check_open()
        if self.replica_size > 1:
            raise FtcommError("wrap is for a model every worker holds whole; with sharded replicas call "
                              "wait_gradients_ready(model)")
        if self._collective.touched:
            raise FtcommError("wrap between steps: backward has begun reducing this step's gradients")
        net = DistributedDataParallel(module, self.options.bucket_mb if bucket_mb is None else bucket_mb)
        self._collective.use_wrapped(net)
        return net

    def no_sync(self):
        """Context manager: backward passes inside accumulate gradients locally and start
        no reduction (as DDP's ``no_sync``); the backward after it reduces the total.
        FtcommError after ``shutdown``."""
        if self._loop.engine.state == core.CLOSED:
            raise FtcommError("the group was shut down")
        return self._collective.no_sync()

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` (which calls this group's collectives) and return its result. When a
        collective inside fails because the membership changed (MembershipChanged), the
        view is re-formed, the registered state reconciled and ``fn`` run again from the
        start; after more than ``max_retries`` failures in a row it raises
        RetryLimitExceeded. Raises what a re-formation raises (QuorumLost, FtcommTimeout,
        ConfigMismatch) and whatever ``fn`` raises otherwise, unchanged."""
        self._owner = threading.get_ident()
        return self._repairing(lambda: self._loop.execute(lambda: _call(fn, args, kwargs)))

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place across the view (``op``: sum, mean, max or min) and
        return it. When a member of the view crashes, hangs or leaves meanwhile, the wait is
        abandoned within milliseconds of the news and MembershipChanged is raised (the
        tensor's contents are then undefined; ``execute`` catches it, re-forms and retries);
        the view is re-formed before the next collective. Never blocks past the fault."""
        return self._collective_op(lambda comm: comm.allreduce([tensor], op))[0]

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Copy rank ``src``'s ``tensor`` into every member's, in place, and return it.
        ValueError for a ``src`` that is not a rank of the view; on a fault as
        :meth:`allreduce` (MembershipChanged, contents undefined)."""
        return self._collective_op(lambda comm: comm.broadcast(tensor, src))

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``tensor`` (same shape and dtype everywhere), in rank order. On a
        fault as :meth:`allreduce` (MembershipChanged, nothing returned)."""
        return self._collective_op(lambda comm: comm.allgather(tensor))

    def barrier(self) -> None:
        """Return once every member of the view reached it. On a fault as :meth:`allreduce`
        (MembershipChanged): the members that passed it may be in a view without this one."""
        self._collective_op(lambda comm: comm.barrier())

    def _collective_op(self, operation: Callable[[Any], Any]) -> Any:
        self._owner = threading.get_ident()
        return self._repairing(lambda: self._loop.collective(operation))

    def _repairing(self, phase: Callable[[], Any]) -> Any:
        """Run the phase ``phase()`` makes (a collective, ``execute``); when this process's
        replica is lost before or while it runs, repair the replica (the step's gradients
        count as none: see :meth:`_repair`) and run it again, in the view the replica joined."""
        self._check_open("call")
        try:
            return self._run(phase())
        except ReplicaLost as exc:
            if not self._repairs(exc):
                raise
            self._repair(exc.reason, "call", exc.shard)
        return self._run(phase())

    def shutdown(self) -> None:
        """Leave gracefully: peers see *left* and re-form at once, without a suspicion wait."""
        if self._closed:
            return
        if self._watch is not None:
            self._watch.stop()
        if self._repair_channel is not None:
            self._repair_channel.close()
        self._run(self._loop.leave())
        if self._left_keeper is not None:  # nothing committed since it was loaded: the copy stays
            keeper, self._left_keeper = self._left_keeper, None
            keeper.close()
        self._comms.close_listeners()
        self._comms.rendezvous.close()
        if self._metrics is not None:
            self._metrics.close()

    # ------------------------------------------------------------------ start and exit
    def _check_network(self) -> None:
        """The founding members measure every link between them (``GroupOptions.network_check``).
        A fault during the check abandons it (logged); the view is re-formed before its first
        collective (members may have stopped at different calls of its communicator)."""
        try:
            self.network_report = netcheck.run(self._loop, self._comms, int(self.options.network_check_mb * 2**20),
                                               self.options.network_check_factor)
        except (MembershipChanged, FtcommTimeout, CommunicatorError) as exc:
            log.warning("network check abandoned: %s", exc)
            # What broke it is classified as for any collective (a crashed member is probed and
            # declared dead at once); the others stop waiting at once.
            driver = self._loop.driver
            driver.perform(self._loop.engine.failed(driver.classify(exc)))
            return
        netcheck.publish(self.network_report, os.environ.get("FTCOMM_NETWORK_REPORT"))

    def _install_exit_hooks(self) -> None:
        atexit.register(self.shutdown)
        if not self.options.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        previous_hook = sys.excepthook

        def excepthook(kind, value, tb):
            if self._replica is not None and self._replica.lost is not None and not isinstance(value, ReplicaLost):
                log.error("(what follows is torch's error from the replica's collectives, torn down because this "
                          "process's sharded replica is lost: %s)", self._replica.lost)
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


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` as a phase of the worker loop that waits for nothing itself
    (the collectives ``fn`` runs wait on their own)."""
    return fn(*args, **kwargs)
    yield  # noqa: unreachable - makes this a generator


def _restarts() -> int:
    raw = os.environ.get("FTCOMM_RESTARTS", "0")
    return int(raw) if raw.isdigit() else 0


def raise_descriptor_limit() -> None:
    """Raise this process's soft limit on open descriptors to its hard limit (as Ray and
    many servers do): a process on a member's host that connects to Gloo's listener while a
    communicator forms leaks descriptors in Gloo (docs/SECURITY.md), and reaching the limit
    aborts the process."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.debug("descriptor limit raised from %d to %d", soft, target)
    except (ImportError, ValueError, OSError) as exc:  # not POSIX, or not allowed: the limit stays
        log.debug("descriptor limit unchanged: %s", exc)


def _parameters(model_or_params: Any) -> list[torch.Tensor]:
    """The parameters of a module, or of an iterable of modules and tensors (TypeError
    naming anything else)."""
    if isinstance(model_or_params, torch.nn.Module):
        return list(model_or_params.parameters())
    if isinstance(model_or_params, torch.Tensor) or not hasattr(model_or_params, "__iter__"):
        raise TypeError(f"wait_gradients_ready takes a module or an iterable of parameters, got "
                        f"{type(model_or_params).__name__}")
    params: list[torch.Tensor] = []
    for item in model_or_params:
        if isinstance(item, torch.nn.Module):
            params.extend(item.parameters())
        elif isinstance(item, torch.Tensor):
            params.append(item)
        else:
            raise TypeError(f"wait_gradients_ready takes a module or an iterable of parameters (tensors or "
                            f"modules); got an item of type {type(item).__name__}")
    return params
