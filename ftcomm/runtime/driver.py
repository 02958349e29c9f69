"""The driver: one member's engine fed with what it observes, its actions performed through ports.

:class:`Driver` is the one place where the engine core's actions (:mod:`ftcomm.core.engine`)
are carried out. The worker loop (:mod:`ftcomm.runtime.worker`) calls it at each phase of a
re-formation and of a step, and it answers from the engine's decisions:

    begin_recovery   the view is given up, the member agrees again
    look             one look at the membership while agreeing: actions performed, the
                     view to form returned once agreed (enter)
    formed / form_failed / view_reconciled / reconcile_failed
                     the outcome of the loop's forming and reconciling, fed to the engine
    classify / probe_crashed      what broke a view (the crash fast path)
    step_reduced / confirmation / confirmed / watch_stall
                     a step's verdict; the checks around an operation that completed

It never waits on a peer: every action goes through the ports (:mod:`ftcomm.runtime.ports`);
a live port's call takes the time it takes (a proposal read at most ``FETCH_TIMEOUT_S``, a
probe its timeout). Nothing here calls back into the loop.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import statistics
from typing import Callable, Iterable, NamedTuple

from ..core import engine as core
from ..core.engine import (Action, Announce, AwaitState, Engine, Fetch, Form, ProbeGroup, ProbeMembers, ProbeSeeds,
                           Publish, PublishProposal, Recontact, Rejoined, Sync)
from ..core.view import Status, View, group_ended, group_finished, replica_broken
from ..errors import CollectiveAborted, CommunicatorError, ConfigMismatch, GroupEnded, ReplicaLost
from ..gossip.addresses import parse_address
from .news import GossipNews
from .ports import Address, Counters, Done, Formed, Pending, Ports, Reconciled
from .stragglers import Stragglers

log = logging.getLogger(__name__)

STALL_FACTOR = 4.0
"""A collective waiting this many times its recent median wait (and ``stall_probe_after``)
has the members it waits on probed at once."""
STALL_WINDOW = 20
CRASH_SETTLE_S = 0.15
"""After a broken connection, how long a member's port that still accepts is tried again
before the member is taken for alive (see :func:`ftcomm.runtime.rendezvous.refused`)."""
CONFIRM_AT_ONCE = 8
"""While agreeing, at most this many members that never answered this one are probed at once."""
PROBE_LAGGING_S = 0.05
"""How long a member of the view being agreed that has not proposed it is probed for a crash
(a refusal comes back within a round trip)."""
KNOWN_DEAD_SETTLE_S = 0.03
"""The same while a member of the view is known dead already (the broken connection was
most likely its): other processes killed with it may still be closing their ports."""


def member_address(member_id: str) -> Address | None:
    """The gossip address a member id names (``IPV4:PORT/nonce``), or None for anything else
    (a member list is authenticated and hashed, but its ids are still not trusted)."""
    if not isinstance(member_id, str) or member_id != member_id.strip():
        return None
    try:
        host, port = parse_address(member_id)
        address = ipaddress.IPv4Address(host)
    except (ValueError, TypeError):
        return None
    if address.is_multicast or address.is_unspecified or address == ipaddress.IPv4Address("255.255.255.255"):
        return None
    return (host, port) if 0 < port <= 65535 else None


def holders(records: Iterable) -> dict[Address, str | None]:
    """Which member answers at each gossip address: the one live record there that answered
    this worker directly (one port, one process), or None where two do (a process started
    again there while its predecessor's record is not suspected yet: which one is stale is
    not known, so neither proves the other gone)."""
    held: dict[Address, str | None] = {}
    for r in records:
        if r.confirmed and r.state == "alive":
            held[(r.host, r.port)] = r.id if (r.host, r.port) not in held else None
    return held


def probe_address(record) -> Address:
    """Where a member in the gossip table is probed for a refusal: the rendezvous port its
    status record names, else its gossip port."""
    status = record.status
    if status is not None and status.rendezvous_port is not None:
        return (record.host, status.rendezvous_port)
    return (record.host, record.port)


class Look(NamedTuple):
    """What one look at the membership came to: the view to form now (None: none yet), and
    whether a proposal was fetched or this member's own published (the next look is due at
    once: it may complete the agreement)."""

    form: View | None
    again: bool


class AwaitingState(Exception):
    """Raised out of a look by a fresh worker that holds back from a running group until its
    training state is registered (:class:`ftcomm.core.engine.AwaitState`): ``init``
    returns without a view, and registering the state (or the first collective) asks to be
    admitted."""


class Driver:
    """Performs one member's engine actions through ``ports``; ``news``: its gossip news and
    the abort signal of the view it forms or runs. ``facts()``: the member's committed step
    and its median compute time, which its status record carries. ``notice(text)``: told
    what the member does that an operator wants to know (it rejoins the group); a warning in
    the log unless given."""

    def __init__(self, engine: Engine, ports: Ports, news: GossipNews,
                 facts: Callable[[], tuple[int, float | None]] = lambda: (0, None),
                 notice: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.ports = ports
        self.news = news
        self.facts = facts
        self.notice = notice or (lambda text: log.warning("%s", text))
        self.ops = 0  # group operations (collectives, gradient steps) completed in the current view
        self.reason = "init"  # why the re-formation under way began (or its last view broke)
        self.reconciled: list[Reconciled] = []  # each formation's outcome in this re-formation
        self.agreeing_since = self.agreed_at = self.formed_at = 0.0  # the re-formation's last attempt
        self.published_at = float("-inf")  # when this member's record was last published
        self._confirmed_at = float("-inf")  # when members that never answered were last probed (see look)
        self._waits: collections.deque[float] = collections.deque(maxlen=STALL_WINDOW)  # recent operations' waits
        self._stall_probed = float("-inf")  # when the view's members were last probed on demand

    def statuses(self) -> tuple[dict[str, Status], dict[str, Address]]:
        return self.ports.membership.statuses(self.engine.view)

    def record(self) -> dict:
        """This member's status record, as gossip metadata."""
        step, compute_s = self.facts()
        return self.engine.record(step, self.ops, compute_s).encode()

    def publish(self) -> None:
        self.ports.membership.publish(self.record())
        self.published_at = self.ports.clock.now()

    def look(self) -> Look:
        """One look at the membership while the engine is agreeing: every action but
        forming is performed here; the view to form comes back. Raises GroupEnded when the
        group a joiner saw ended before admitting it (or had ended, trained, before a fresh
        worker arrived: see group_finished), ReplicaLost when a process of this
        sharded replica is gone, ConfigMismatch when a live member of the group was started
        with other settings, AwaitingState when a fresh worker without a registered state
        holds back from a running group."""
        engine = self.engine
        statuses, addresses = self.statuses()
        conflict = core.settings_conflict(engine, engine.settings, statuses)
        if conflict is not None:
            raise ConfigMismatch(conflict)
        own = statuses.get(engine.id)
        now = self.ports.clock.now()
        founding = engine.view is None and engine.state in (core.JOINING, core.HOLDING_BACK)
        table = list(self.ports.membership.records()) if founding or now - self._confirmed_at >= engine.chase_interval \
            else []
        if founding and own is not None:
            # Every record counts here, answered or not: a member not confirmed yet that holds
            # a newer view shows the group alive (this worker's contact was cut off from it).
            known = [r.status for r in table if r.status is not None]
            if engine.state == core.JOINING and group_ended(own, known, engine.saw_group):
                raise GroupEnded("every member of the group this worker joined left before it was admitted (the "
                                 "job finished, or was scaled to zero): there is no group to join, and founding "
                                 "one would train from scratch")
            if engine.entered_view is None and group_finished(own, known):
                raise GroupEnded("the group of this job trained and ended before this worker arrived (its members "
                                 "left after committing steps: the job finished, or was scaled to zero); founding "
                                 "another would train the job again from scratch")
        gone = replica_broken(engine.replica, statuses)
        if gone is not None:
            what = f"{gone}, a process of this worker's sharded replica, {'left' if statuses[gone].left else 'died'}"
            raise ReplicaLost(f"{what}: torch's process group inside the replica is broken, so this process cannot "
                              f"train on; exit, and start the whole replica again (ftcomm run --replica-size does) "
                              f"to rejoin", statuses[gone].replica[1], statuses[gone].left, reason=what)
        unconfirmed: tuple[Status, ...] = ()
        seeds = None
        if founding or now - self._confirmed_at >= engine.chase_interval:
            records = [r for r in table if r.state in ("alive", "suspect")]
            waiting = [r for r in records if not r.confirmed and r.id not in statuses and r.status is not None]
            suspects = [r for r in records if r.state == "suspect" and r.status is not None
                        and r.status.config == engine.config]
            if (waiting or suspects) and now - self._confirmed_at >= engine.chase_interval:
                # Members that never answered this one are in no view it agrees to, while
                # those they answered count them; a member suspected while it was cut off is in
                # none either until it refutes. Agreement would wait for a regular probe (whose
                # round may be slow after a partition) to reach them. Probed now, one that
                # answers is confirmed, and a suspect is told it is suspected and refutes.
                self._confirmed_at = now
                self.ports.membership.probe_now([r.id for r in (waiting + suspects)[:CONFIRM_AT_ONCE]])
            if founding:  # see Engine.agree
                unconfirmed = tuple(r.status for r in waiting)
                at = {(r.host, r.port): r.id for r in records if r.id != engine.id}
                seeds = {address: at.get(address) for address in self.ports.membership.seeds()}
        actions = engine.agree(now, statuses, unconfirmed, seeds)
        form = actions.pop().view if actions and isinstance(actions[-1], Form) else None
        if actions and isinstance(actions[-1], AwaitState):
            self.perform(actions[:-1], addresses)
            raise AwaitingState()
        self.perform(actions, addresses)
        return Look(form, any(isinstance(a, (Fetch, PublishProposal, ProbeSeeds)) for a in actions))

    def perform(self, actions: Iterable[Action], addresses: dict[str, Address] | None = None) -> None:
        """Carry out the engine's actions (all but Form: forming is the caller's)."""
        ports, engine = self.ports, self.engine
        for action in actions:
            if isinstance(action, Publish):
                self.publish()
            elif isinstance(action, PublishProposal):
                ports.proposals.publish(action.view_id, action.digest, action.members)
            elif isinstance(action, Fetch):
                address = (addresses if addresses is not None else self.statuses()[1]).get(action.member)
                engine.fetched_proposal(action.key, ports.proposals.fetch(action.member, address, action.key))
            elif isinstance(action, Announce):
                ports.membership.announce(action.members)
            elif isinstance(action, Sync):
                ports.membership.sync(action.member)
                if action.probe:  # a refusal proves it gone; silence makes it a suspect at once
                    self.probe_crashed([action.member], timeout=PROBE_LAGGING_S)
                    ports.membership.probe_now([action.member])
            elif isinstance(action, Recontact):
                ports.membership.recontact_seeds()
            elif isinstance(action, ProbeSeeds):
                ports.membership.recontact_seeds()
                refused = ports.prober.refused(list(action.addresses), core.PROBE_TIMEOUT_S)
                engine.seeds_probed(action.addresses, [a for a, gone in zip(action.addresses, refused) if gone])
            elif isinstance(action, ProbeGroup):
                ports.membership.recontact_seeds()
                engine.group_probed(action.members is not None and self.group_gone(action.members))
            elif isinstance(action, ProbeMembers):
                ports.membership.recontact_seeds()
                engine.members_probed(self.refusing(action.members))
            elif isinstance(action, Rejoined):
                self.notice(f"{engine.id} rejoins the group as a new member: {action.why}")
                engine.joined_at = ports.clock.wall()
            else:
                raise core.IllegalTransition(f"the driver cannot perform {action!r} here")

    # ------------------------------------------------------------------ re-forming
    def begin_recovery(self, reason: str) -> None:
        """The current view can no longer be used (``reason``: what broke it, or why this
        member re-forms: a joiner is due, it rejoins, it stands aside): its communicator is
        dropped and the member agrees again (a formation under way is given up)."""
        engine = self.engine
        self.reason, self.reconciled = reason, []
        if engine.state == core.FORMING:
            self.perform(engine.form_failed())
        elif engine.state in core.IN_VIEW or engine.state == core.RECONCILING:
            self.perform(engine.broken())
        self._again()

    @property
    def recovering(self) -> bool:
        """A re-formation is under way: agreeing, forming or reconciling."""
        return self.engine.agreeing or self.engine.state in (core.FORMING, core.RECONCILING)

    def enter(self, view: View) -> None:
        """The engine agreed on ``view`` (FORMING): its abort signal is fresh, and fired at
        once by what already breaks it."""
        self.agreed_at = self.ports.clock.now()
        self.news.enter(view, self.statuses()[0])

    def form_failed(self, view: View, exc: BaseException) -> None:
        """Forming ``view`` failed: this member stays in the view (or phase) it had.
        Withdrawing the proposal aborts the other members' attempts at once; the retry gets
        a new view id."""
        log.info("forming view %d failed (%s); agreeing again", view.id, exc)
        self.perform(self.engine.form_failed())
        self._again(probe=view.members)

    def formed(self, formed: Formed) -> None:
        """Every member formed and verified the view's communicator: RECONCILING."""
        self.perform(self.engine.formed(*formed))
        self.ops = 0
        self.formed_at = self.ports.clock.now()

    def reconcile_failed(self, exc: BaseException) -> None:
        """Reconciling the view just formed failed: what broke it is classified, and the
        member agrees again."""
        log.info("reconciling view %d failed (%s); agreeing again", self.engine.view.id, exc)
        self.reason = self.classify(exc)
        self.perform(self.engine.broken())
        self._again()

    def view_reconciled(self, outcome: Reconciled) -> None:
        """The view runs (RECONCILE_DUE: its state is reconciled before the first collective)."""
        self.reconciled.append(outcome)
        if outcome.deferred:
            self.engine.deferred()
        else:
            self.engine.reconciled()
        self.news.faults.clear()

    def _again(self, probe: Iterable[str] = ()) -> None:
        """Agree again: the communicator is dropped, ``probe``'s members are probed for a
        crash, and the next attempt's agreement starts now."""
        self.ports.communicators.abandon()
        self.probe_crashed(probe)
        self.agreeing_since = self.ports.clock.now()

    # ------------------------------------------------------------------ what broke
    def classify(self, exc: BaseException) -> str:
        """Why the view broke: crash, hang, leave, partition, superseded or backend."""
        self.news.judge()  # news posted after the abort was noticed still counts
        view = self.engine.view
        if isinstance(exc, CommunicatorError) and view is not None:
            # A connection of the view broke: the member behind it may still be closing its
            # other sockets (its gossip port can accept for a few milliseconds more).
            self.probe_crashed(view.members, settle=CRASH_SETTLE_S)
        elif view is not None:
            # Gossip may suspect a crashed member before any collective touched it (the
            # training thread was computing): a refused connection still names it a crash.
            suspects = {member for _, kind, member in self.news.faults if kind == "suspect"}
            if suspects:
                self.probe_crashed([m for m in view.members if m in suspects], timeout=0.05)
        if view is not None and self.engine.replica is not None:
            # A process of a sharded replica that leaves often does so because another process
            # of its replica crashed (the launcher stops the rest): that one is probed too.
            self.probe_crashed(self._partners_of_leavers(view), timeout=0.05)
        faults = [(kind, member) for _, kind, member in self.news.faults]
        reason = core.classify(faults, view.size if view is not None else None, self.replica_size)
        log.debug("view broke (%s: %s); faults %s: %s", type(exc).__name__, exc, faults, reason)
        return reason

    @property
    def replica_size(self) -> int:
        """Processes per sharded replica: the unit members come and go in (1: none)."""
        return self.engine.replica_size

    def _partners_of_leavers(self, view: View) -> list[str]:
        """The members of ``view`` in the same sharded replica as a member that left it."""
        statuses = self.statuses()[0]
        left = {member for _, kind, member in self.news.faults if kind == "left"}
        keys = {statuses[m].replica[0] for m in left if m in statuses and statuses[m].replica is not None}
        return [m for m in view.members if m not in left and m in statuses and statuses[m].replica is not None
                and statuses[m].replica[0] in keys]

    def probe_crashed(self, members: Iterable[str], timeout: float = 0.25, settle: float = 0.0) -> None:
        """Crash fast path: members whose host refuses a connection at their gossip port are
        declared dead now. A refusal comes back within a round trip; ``timeout`` bounds the
        wait for a host that does not answer at all (lost or partitioned); ``settle``: see
        :meth:`ftcomm.runtime.ports.Prober.refused`."""
        others = set(members) - {self.engine.id}
        if not others:
            return
        records = [r for r in self.ports.membership.records() if r.id in others]
        targets = [(r.id, (r.host, r.port)) for r in records if r.state != "dead"]
        if not targets:
            return
        if any(r.state == "dead" for r in records):
            settle = min(settle, KNOWN_DEAD_SETTLE_S)
        refused = self.ports.prober.refused([a for _, a in targets], timeout, settle)
        for (member, _), gone in zip(targets, refused):
            if gone:
                self.news.fault("crash", member)
                self.ports.membership.declare_dead(member)

    def stand_aside(self, seconds: float) -> None:
        """This member, chosen by the last step (ASIDE_DUE), stands aside as a straggler for
        ``seconds`` (see Engine.bench): its view is left and it agrees again afterwards."""
        self.ports.communicators.abandon()
        self.perform(self.engine.bench(self.ports.clock.now(), seconds))
        self.begin_recovery("straggler")

    def repair_replica(self, why: str) -> None:
        """A process of this member's sharded replica is lost and the replica forms again
        with its replacement (``why``): the view's communicator is given up, and a member
        that held a view leaves it (see Engine.repair_replica); it agrees again, as a
        joiner, once the replica formed (:meth:`replica_formed`)."""
        engine = self.engine
        self.ports.communicators.abandon()
        if engine.state == core.FORMING:
            self.perform(engine.form_failed())
        elif engine.state in core.IN_VIEW or engine.state == core.RECONCILING:
            self.perform(engine.broken())
        self.perform(engine.repair_replica(why))
        self.reason = "replica repair"
        self._again()

    def replica_formed(self, key: str) -> None:
        self.perform(self.engine.replica_formed(key))

    # ------------------------------------------------------------------ operations
    def confirmation(self, contributed_at: float, op_began: float, probe_interval: float) -> Pending[bool] | None:
        """An operation completed here after this member handed its share over at
        ``contributed_at``. It may have completed only here when this member was cut off
        meanwhile: the others, seeing it hang, may have abandoned the view and moved on
        (their abandoned communicators still finish the exchange). Whenever that is possible
        (see :func:`ftcomm.core.engine.must_confirm`) this returns a state exchange with a view
        member, whose answer goes to :meth:`confirmed` before the operation counts; None
        when the operation counts as it is."""
        membership, view = self.ports.membership, self.engine.view
        if view is None or not core.must_confirm(self.ports.clock.now(), contributed_at, op_began,
                                                 membership.stalled_at(), membership.refuted_at(), probe_interval):
            return None
        reachable = [r.id for r in membership.records() if r.id in view.member_set and r.id != self.engine.id
                     and r.state in ("alive", "suspect")]
        if not reachable:
            return Done(True)  # everyone else left or died: the abort signal alone decides
        return membership.exchange(reachable[:2])

    def confirmed(self, answered: bool) -> None:
        """The exchange :meth:`confirmation` asked for is over (``answered``: a member
        answered). Raises CollectiveAborted when the view moved on meanwhile (the others
        withdraw their proposal the moment they break it), or nothing shows it intact: the
        operation is then discarded like any aborted one, and reconciling brings this
        member up to date."""
        self.news.judge()  # what the exchange brought
        abort = self.news.abort
        if abort.reason is not None or not answered:
            raise CollectiveAborted(f"an operation completed after this worker may have been cut off, and "
                                    f"{abort.reason or 'no member of the view answered'}")

    def step_reduced(self, counters: Counters, batches_checked: bool) -> bool:
        """A gradient step's counters came back reduced (how many members contributed valid
        gradients, how many saw a joiner waiting, the ranks asking to stand aside): whether
        it commits. Every member sees the same: the joiner is admitted (JOIN_DUE), and the
        chosen stand aside (ASIDE_DUE), at the next step boundary."""
        engine = self.engine
        view = engine.view
        commit, admit = core.step_verdict(counters.contributors, counters.joiners, view.size, batches_checked)
        if engine.state == core.RUNNING:  # (not when another thread shut the group down meanwhile)
            chosen = Stragglers.chosen(list(counters.asking), view.size, engine.min_workers * engine.replica_size)
            engine.step_reduced(admit, view.rank_of(engine.id) in chosen)
        return commit

    def operation_done(self, waited: float) -> None:
        """An operation of the view completed ``waited`` seconds after this member handed
        its share over."""
        self.ops += 1
        self._waits.append(waited)

    def watch_stall(self, contributed_at: float, op_began: float, probe_after: float, probe_interval: float) -> None:
        """Hang detection on demand (``stall_probe_after``): while an operation waits far
        longer than usual (``STALL_FACTOR`` times the median of the recent waits, and at
        least ``probe_after`` seconds) since this member handed its share over at
        ``contributed_at``, probe the view's other members at once, at most once per probe
        interval; a member that does not answer is suspected a probe timeout later, which
        breaks the view. A member whose process answers is never suspected by it: slow
        compute is a straggler's, not a hang."""
        view = self.engine.view
        if probe_after <= 0 or contributed_at <= op_began or view is None:
            return  # off, or not waiting on an operation
        now = self.ports.clock.now()
        if now - contributed_at < probe_after:
            return  # (the usual case: looked at every millisecond of a wait)
        typical = STALL_FACTOR * statistics.median(self._waits) if self._waits else 0.0
        if now - contributed_at < max(probe_after, typical) or now - self._stall_probed < probe_interval:
            return
        self._stall_probed = now
        self.ports.membership.probe_now([m for m in view.members if m != self.engine.id])

    def refusing(self, members: Iterable[str]) -> list[str]:
        """Which of ``members`` refuse connections (the process is gone): each probed at the
        rendezvous port its record names, else at the port of its gossip record, else at the
        gossip port its id names. A member whose gossip address another live process answers
        from under another id is gone too, without a probe (its process was started again
        there: one port, one process). One that cannot be addressed, or does not answer, is
        not among them."""
        records = {record.id: record for record in self.ports.membership.records()}
        held = holders(records.values())
        targets: dict[str, tuple[str, int]] = {}
        replaced = []
        for member in dict.fromkeys(members):
            record = records.get(member)
            at = member_address(member) if record is None else (record.host, record.port)
            if at is not None and held.get(at) not in (None, member):
                replaced.append(member)
                continue
            address = at if record is None else probe_address(record)
            if address is not None:
                targets[member] = address
        refused = self.ports.prober.refused(list(targets.values()), core.PROBE_TIMEOUT_S) if targets else []
        return replaced + [member for member, gone in zip(targets, refused) if gone]

    def group_gone(self, members: Iterable[str]) -> bool:
        """Whether every worker of this job that held a view and has not left refuses
        connections: those in the gossip table (answered or not) at their rendezvous port,
        ``members`` it has no record of at the gossip port their id names (and those that do
        not refuse get a join request: they may be alive and never told of this worker).
        Refused: the process is gone. One that does not answer may be across a partition
        (see Engine._may_found). A worker whose record shows no view counts too unless it is
        alive here: one out of sight may have joined the group since (a worker that held
        back until its state was registered saw only the group's view of then). A worker
        whose gossip address another live process answers from under another id is gone
        without a probe (started again there, as in :meth:`refusing`)."""
        engine, membership = self.engine, self.ports.membership
        records = list(membership.records())
        held = holders(records)
        targets, listed = [], set()
        for record in records:
            listed.add(record.id)
            status = record.status
            if record.id == engine.id or status is None or status.left or status.config != engine.config \
                    or (status.last_view == 0 and record.state == "alive"):
                continue
            if held.get((record.host, record.port)) not in (None, record.id):
                continue  # its process was replaced: gone
            targets.append(probe_address(record))
        unlisted = list(dict.fromkeys(a for a in (member_address(m) for m in members if m not in listed)
                                      if a is not None and held.get(a) is None))
        refused = self.ports.prober.refused(targets + unlisted, core.PROBE_TIMEOUT_S)
        for address, gone in zip(unlisted, refused[len(targets):]):
            if not gone:
                membership.contact(address)  # it may be alive: gossip never told it about this worker
        return all(refused)
