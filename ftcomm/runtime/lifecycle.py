"""One worker's view lifecycle: the driver over live ports, and the backend's communicators.

:class:`Lifecycle` runs the :class:`~ftcomm.runtime.driver.Driver` (which feeds the engine core,
:mod:`ftcomm.core.engine`, and performs its actions) over the live ports of
:mod:`ftcomm.runtime.live_ports`, and is itself the driver's communicators port: it forms and
verifies the backend's communicator of each view, and reconciles the state over it.
Whenever the current view can no longer be used, :meth:`Lifecycle.recover` advances the
driver until the new view runs::

    detect -> agree -> form (+ verify) -> reconcile -> run

*Detect* is the abort signal firing: gossip news judged on the waiting thread
(:mod:`ftcomm.runtime.news`), or the backend failing a collective (then the driver's crash fast
path probes the view's members and declares dead those whose host refuses a connection).
The whole-group simulation (:mod:`ftcomm.groupsim`) runs the same driver over simulated
ports.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

import torch

from .. import netif
from ..backends.base import AbortSignal, Communicator
from ..core import engine as core
from ..core.engine import Engine
from ..core.view import Status, View
from ..errors import CommunicatorError, FtcommError, FtcommTimeout, MembershipChanged, QuorumLost
from ..gossip import GossipNode
from ..options import GroupOptions, ViewChange
from .driver import Driver
from .live_ports import GossipMembership, StoreProposals, SystemClock, TcpProber
from .news import GossipNews
from .ports import Done, Failed, Formed, Pending, Ports, Reconciled
from .rendezvous import Rendezvous
from .stragglers import ComputeTimes

log = logging.getLogger(__name__)

WAIT_NOTICE_S = 5.0  # a re-formation still waiting this long says why (then every 30 s)

class Lifecycle:
    """The views, communicators and status record of one worker (see the module docstring).

    ``step``: the worker's committed step (published in its record); ``compute``: its
    recent compute times (published too).
    """

    def __init__(self, engine: Engine, backend: type, rendezvous: Rendezvous, options: GroupOptions,
                 compute: ComputeTimes, step: Callable[[], int]) -> None:
        self.engine = engine
        # The agreement loop waits on news; this member's own record counts as news, since
        # reading it back may complete the agreement (statuses come from gossip's table).
        self.membership = GossipMembership(engine, lambda: self.news.changed.set())
        self.options = options
        self._backend = backend
        self.rendezvous = rendezvous
        backend.retain(rendezvous.host)  # until close_listeners
        self._listeners_closed = False
        self.news = GossipNews(engine, lambda: [(m.id, m.state, m.metadata) for m in self.gossip.members()],
                               lambda: self.driver.ops, options.leave_grace, self._watch_stall)
        self.driver = Driver(engine, Ports(SystemClock(), self.membership, StoreProposals(rendezvous), TcpProber(),
                                           self), self.news, lambda: (step(), compute.median()))
        self.reconcile_state: Callable[[], Reconciled] = lambda: Reconciled(False, None, deferred=True)
        """Reconciles the registered state in a view just formed (set by the step protocol)."""
        self.comm: Communicator | None = None  # the backend's communicator of the current view
        self.replica = None  # a sharded replica's process (ftcomm.training.replica.Replica), or None
        self.shard_comm: Communicator | None = None  # with a replica: the view's shard-i processes' communicator
        self.events: list[ViewChange] = []
        self.op_began = time.monotonic()  # when the operation in flight began (the previous one ended)
        self.contributed_at = time.monotonic()  # when this worker's share of it was handed to the backend

    @property
    def gossip(self) -> GossipNode | None:
        """The gossip node, attached once started (it publishes this worker's first record)."""
        return self.membership.node

    @gossip.setter
    def gossip(self, node: GossipNode) -> None:
        self.membership.node = node

    @property
    def view(self) -> View | None:
        """The current view: formed and verified."""
        return self.engine.view

    @property
    def abort(self) -> AbortSignal:
        return self.news.abort

    @property
    def ops(self) -> int:
        """Group operations (collectives, gradient steps) completed in the current view."""
        return self.driver.ops

    # ------------------------------------------------------------------ the loop
    def recover(self, reason: str, detected_at: float, timeout: float | None) -> ViewChange:
        """Re-form: the driver advances (agree, form and verify, reconcile) until the new
        view runs, RUNNING or RECONCILE_DUE when no state is registered yet; the view
        change. Raises FtcommTimeout or QuorumLost when no view is agreed in time."""
        noticed = time.monotonic()
        fired_at, gave_up_at = self.abort.fired_at, self.abort.noticed_at
        abort_latency = round(gave_up_at - fired_at, 4) if fired_at is not None and gave_up_at is not None else None
        previous = self.view
        self.check_open()
        driver = self.driver
        driver.begin_recovery(reason)
        deadline = noticed + (timeout if timeout is not None else self.options.quorum_timeout)
        last_debug = 0.0
        said_at = noticed  # when this worker last said why it waits
        while driver.recovering:
            self.check_open()
            now = time.monotonic()
            if self.engine.agreeing and now > deadline:
                self.raise_stuck()
            self.news.changed.clear()
            self.news.judge()
            try:
                moved = driver.advance()
            except core.IllegalTransition:
                self.check_open()  # shut down from another thread meanwhile: FtcommError
                raise
            if moved:
                continue
            if self.engine.agreeing and now - said_at > (WAIT_NOTICE_S if said_at == noticed else 30.0):
                said_at = now
                log.warning("waiting for a view (%s for %.0f s): %s; %s in %.0f s", reason, now - noticed,
                            self._waiting_for(), "QuorumLost" if self.view is not None else "FtcommTimeout",
                            max(0.0, deadline - now))
            if log.isEnabledFor(logging.DEBUG) and now - last_debug > 1.0:
                last_debug = now
                log.debug("%s: proposals %s", self.engine.state.lower(),
                          {s.id: (s.alive, s.phase, s.current_view, s.proposal) for s in self.statuses()[0].values()})
            self.news.changed.wait(0.02)
        self.check_open()
        view = self.view
        done = time.monotonic()
        before = previous.members if previous else ()
        reason = ("rejoin" if self.engine.formed_from == core.REJOINING
                  else core.reason_for(driver.reason, before, view.members, self.gossip_states(), driver.replica_size))
        change = ViewChange(view.id, view.members, reason, tuple(m for m in view.members if m not in before),
                            tuple(m for m in before if m not in view.members), round(noticed - detected_at, 4),
                            round(driver.agreed_at - driver.agreeing_since, 4),
                            round(driver.formed_at - driver.agreed_at, 4), round(done - driver.formed_at, 4),
                            time.time(), abort_latency)
        self.events.append(change)
        self.engine.view_reason = reason  # published with the next record
        self.op_began = time.monotonic()
        log.info("view %d: %d members (%s), rank %d; detect %.3f agree %.3f form %.3f reconcile %.3f s",
                 view.id, view.size, reason, view.rank_of(self.engine.id), change.detect_s, change.agree_s,
                 change.form_s, change.reconcile_s)
        return change

    # ------------------------------------------------------------------ the communicators port
    def reconcile(self, view: View) -> Pending[Reconciled]:
        """Reconcile the registered state over the view just formed (ftcomm.runtime.ports.Communicators)."""
        try:
            outcome = self.reconcile_state()
        except MembershipChanged as exc:
            self.check_open()
            return Failed(exc)
        self.check_open()
        return Done(outcome)

    def form(self, view: View) -> Pending[Formed]:
        """Form and verify the communicator of ``view`` (ftcomm.runtime.ports.Communicators)."""
        try:
            formed = self._form(view)
        except (MembershipChanged, FtcommTimeout) as exc:
            self.check_open()
            return Failed(exc)
        self.check_open()
        return Done(formed)

    def _form(self, view: View) -> Formed:
        """Form the communicator through rank 0's store and verify it with a tiny allreduce,
        which also tells whether every member founds the group (this is their first view) and
        wants the network check, and whether no member has begun training (restorable)."""
        _, addresses = self.statuses()
        rank0 = view.members[0]
        if rank0 not in addresses:
            raise CommunicatorError(f"rank 0 ({rank0}) of view {view.id} is not reachable through gossip")
        timeout = self.options.formation_timeout
        self.comm = comm = self.form_communicator(self.rendezvous.view_store(view, *addresses[rank0]),
                                                  view.rank_of(self.engine.id), view.size, view.id, view.members)
        check = int(view.digest, 16) >> 1
        first = int(self.engine.view is None)  # this worker's first view
        rank, replica = view.rank_of(self.engine.id), self.replica
        misplaced = int(replica is not None and (view.size % replica.size or rank % replica.size != replica.shard_rank))
        probe = torch.tensor([check, -check, first, int(self.options.network_check), int(not self.engine.started),
                              -misplaced], dtype=torch.int64, device=comm.device)
        comm.allreduce([probe], "min").wait(self.abort, timeout)
        verified = probe.tolist()
        if verified[:2] != [check, -check]:
            raise CommunicatorError(f"view {view.id} failed verification: members disagree on its digest")
        if verified[5] < 0:
            raise CommunicatorError(f"view {view.id} failed verification: a sharded replica's processes are not "
                                    f"consecutive ranks in shard order")
        if replica is not None:
            self.shard_comm = self._form_shard(view, rank, replica.size, addresses)
        return Formed(verified[2] == 1 and verified[3] == 1, verified[4] == 1)

    def _form_shard(self, view: View, rank: int, size: int, addresses: dict) -> Communicator:
        """The communicator of this process's shard index in ``view``: ranks ``rank % size``,
        ``rank % size + size``, ... (one process of each replica), through the store of its
        first member."""
        first = view.members[rank % size]
        if first not in addresses:
            raise CommunicatorError(f"{first}, first of shard {rank % size} in view {view.id}, is not reachable "
                                    f"through gossip")
        store = self.rendezvous.shard_store(view, rank % size, *addresses[first])
        return self._backend.form(store, rank // size, view.size // size, view.id, self.abort,
                                  self.options.formation_timeout, host=self.rendezvous.host,
                                  sources=self.sources(view.members))

    def form_communicator(self, store, rank: int, size: int, view_id: int,
                          members: Iterable[str] = ()) -> Communicator:
        """The backend's communicator of ``size`` ranks through ``store``; while it forms,
        only ``members``' addresses may connect to this worker's listener."""
        return self._backend.form(store, rank, size, view_id, self.abort, self.options.formation_timeout,
                                  host=self.rendezvous.host, sources=self.sources(members))

    def sources(self, members: Iterable[str]) -> set[str] | None:
        """The addresses ``members`` connect from: their bind addresses (a member on this
        host connects from the address it connects to), and the loopback address when
        they use loopback addresses (a connection to 127.0.0.x comes from 127.0.0.1).
        None when ``GroupOptions.listener_admission`` is ``formation``."""
        if self.options.listener_admission == "formation":
            return None
        _, addresses = self.statuses()
        hosts = {addresses[m][0] for m in members if m in addresses} | {self.rendezvous.host}
        if any(netif.is_loopback(h) for h in hosts):
            hosts.add("127.0.0.1")
        return hosts

    def abandon(self) -> None:
        for comm in (self.comm, self.shard_comm):
            if comm is not None:
                comm.abandon()
        self.comm = self.shard_comm = None

    def leave(self) -> None:
        """Leave the group gracefully: the record says so, then the departure notice.

        The departure does not end the process at once: a member of the view may still be
        inside the operation this worker completed last (it lets it finish, ``leave_grace``),
        and this process's exit would close the connections it still reads from. Until
        every other member of the view moved on (left, died, or no longer proposes the
        view: it re-formed), at most until ``leave_grace`` seconds after that operation
        ended (by then every member that was in it finished it or gave up on it), the
        gossip node stays up and the communicator is not dropped."""
        view = self.view
        linger = max(0.0, self.options.leave_grace - (time.monotonic() - self.op_began))
        self.engine.leave()
        self.abort.fire("this worker is shutting down")
        try:
            self.publish()
            self.gossip.leave(until=lambda: self._others_moved_on(view), timeout=linger)
        except FtcommError as exc:  # its gossip is gone already
            log.debug("leaving: %s", exc)
        self.abandon()
        self.engine.closed()

    def close_listeners(self) -> None:
        """This worker forms nothing more: the backend may close what listens for its
        formations (once, at shutdown; communicators already formed keep working)."""
        if not self._listeners_closed:
            self._listeners_closed = True
            self._backend.release(self.rendezvous.host)

    def _others_moved_on(self, view: View | None) -> bool:
        """No other live member still runs ``view`` (asked directly: news about a member that
        left may no longer reach it by gossip)."""
        if view is None:
            return True
        key = (view.id, view.digest)
        statuses, _ = self.statuses()
        running = [m for m in view.members if m != self.engine.id and m in statuses
                   and statuses[m].alive and statuses[m].proposal == key]
        for member in running[:1]:
            self.gossip.exchange(member, timeout=0.1)
        return not running

    # ------------------------------------------------------------------ operations
    def contributed(self) -> float:
        """This worker handed its share of the operation in flight over: its compute time."""
        self.contributed_at = time.monotonic()
        return self.contributed_at - self.op_began

    def completed(self) -> None:
        """The operation in flight completed here."""
        self.op_began = time.monotonic()
        self.driver.operation_done(self.op_began - self.contributed_at)

    def operation_done(self) -> None:
        """The operation in flight completed, and aborts held for it fire now."""
        self.completed()
        self.news.operation_ended()

    def _watch_stall(self) -> None:
        """Hang detection on demand while a collective waits (see Driver.watch_stall)."""
        self.driver.watch_stall(self.contributed_at, self.op_began, self.options.stall_probe_after,
                                self.gossip.config.probe_interval)

    def confirm_after_stall(self) -> None:
        """Before the operation that completed counts: confirm the view is intact when this
        worker may have been cut off meanwhile (see Driver.confirmation); CollectiveAborted
        when it is not."""
        exchange = self.driver.confirmation(self.contributed_at, self.op_began, self.gossip.config.probe_interval)
        if exchange is not None:
            self.driver.confirmed(exchange.poll())

    # ------------------------------------------------------------------ shut down, or stuck
    def check_open(self) -> None:
        """The worker left the group (``shutdown`` from another thread, or the exit hook)
        while this thread recovers: nothing is left to recover."""
        if self.engine.state in (core.LEAVING, core.CLOSED):
            raise FtcommError("the group was shut down")

    def _waiting_for(self) -> str:
        """Why no view is agreed yet, in a few words, for the waiting notice."""
        live = len(self.gossip.live_members())
        needed = self.engine.min_workers
        if live < needed:
            return (f"{live} live member{'s' if live != 1 else ''} here, fewer than min_workers={needed}: "
                    f"waiting for more to join or come back")
        view = self.view
        if view is not None:
            return (f"{live} live members, waiting to agree on the next view with a majority of view {view.id} "
                    f"({view.size} members)")
        return f"{live} live members, agreeing on the first view"

    def raise_stuck(self) -> None:
        view = self.view
        if view is None and self.engine.holding:
            raise FtcommTimeout(
                "this worker saw a group but none of its members is live here, and not all of them are "
                "gone for sure (some do not answer: across a partition?); with partition_policy='quorum' "
                "it founds no second group")
        if view is None or self.engine.state == core.JOINING:
            raise FtcommTimeout(
                f"no view with at least min_workers={self.engine.min_workers} members could be agreed "
                f"(this worker sees {len(self.gossip.live_members())} live members; group full or "
                f"peers unreachable?)")
        raise QuorumLost(f"cannot reach a majority of view {view.id} ({view.size} members) "
                         f"within {self.options.quorum_timeout:g} s: this worker is on the minority side "
                         f"of a partition or the others are gone")

    # ------------------------------------------------------------------ status records
    def statuses(self) -> tuple[dict[str, Status], dict[str, tuple[str, int]]]:
        """Every member's status record, and rendezvous address (see ftcomm.runtime.ports.Membership)."""
        return self.driver.statuses()

    def gossip_states(self) -> dict[str, str]:
        """Each member's gossip state, ``benched`` for a straggler standing aside."""
        statuses, _ = self.statuses()
        return {m.id: "benched" if m.id in statuses and statuses[m.id].benched is not None else m.state
                for m in self.gossip.members()}

    def status_record(self) -> dict:
        return self.driver.record()

    def publish(self) -> None:
        self.driver.publish()

    def publish_step(self) -> bool:
        """Publish the record with the committed step, at most every ``step_publish_interval``."""
        if time.monotonic() - self.membership.published_at < self.options.step_publish_interval:
            return False
        self.publish()
        return True
