"""The group engine's core: one member's lifecycle as a state machine, with no I/O.

Inputs are what the member observed (membership snapshots with ``now``, the outcome of
forming or reconciling a view, faults in the view, a leave request); outputs are the
actions the driver performs (publish the status record, publish a proposal on the
rendezvous store, fetch one from a peer, sync with a lagging peer, form a view, rejoin,
probe whether a group is gone, ask the seeds to let it in again). No sockets, clocks or
torch, and it starts no thread; its transitions are atomic, since a worker's shutdown may
come from another thread than the one that trains: :mod:`ftcomm.group` drives it with real gossip and
communicators, :mod:`ftcomm.groupsim` with simulated ones, unchanged.

States and transitions are the table :data:`TRANSITIONS` (anything else raises
:class:`IllegalTransition`); docs/ARCHITECTURE.md draws it (:func:`state_diagram`)::

    JOINING ------agreed-----> FORMING ---formed---> RECONCILING ---reconciled---> RUNNING
    JOINING <----release/hold----> HOLDING_BACK     (saw a group, none of it in sight)
    AGREEING | REJOINING ---agreed---> FORMING
    FORMING ---form failed---> AGREEING (had a view) | JOINING (never had one) | REJOINING (lost it)
    RECONCILING ---deferred---> RECONCILE_DUE ---reconciled---> RUNNING ---restored---> RECONCILE_DUE
    RUNNING | RECONCILE_DUE ---failed---> BROKEN    (a collective failed)
    RUNNING ---admit---> JOIN_DUE                  (the last step admitted a joiner)
    RUNNING ---chosen---> ASIDE_DUE ---bench---> STANDING_ASIDE ---rested---> REJOINING
    RECONCILING | RUNNING | RECONCILE_DUE | BROKEN | JOIN_DUE ---broken---> AGREEING (re-form)
    RECONCILING | RECONCILE_DUE | BROKEN ---broken unreconciled (re)joiner---> JOINING | REJOINING
                                                   (it joined the view and never held the state)
    AGREEING ---superseded---> REJOINING           (a newer view exists without it)
    AGREEING ---replica silent | replica repair---> REJOINING   (its sharded replica is not whole)
    any state but LEAVING and CLOSED ---leave---> LEAVING ---closed---> CLOSED

The published phase (``joining`` / ``active`` / ``leaving``) follows from the state and
whether the member has formed a view: peers see a member that lost its view as a joiner.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

from .view import (ACTIVE, JOINING as PHASE_JOINING, LEAVING as PHASE_LEAVING, Candidate, Status, StatusRecord, View,
                   agreed, candidate, gone_from, has_quorum, superseded, whole_replicas)

JOINING, HOLDING_BACK, STANDING_ASIDE, REJOINING = "JOINING", "HOLDING_BACK", "STANDING_ASIDE", "REJOINING"
AGREEING, FORMING, RECONCILING, RUNNING, LEAVING, CLOSED = (
    "AGREEING", "FORMING", "RECONCILING", "RUNNING", "LEAVING", "CLOSED")
RECONCILE_DUE, BROKEN, JOIN_DUE, ASIDE_DUE = "RECONCILE_DUE", "BROKEN", "JOIN_DUE", "ASIDE_DUE"

JOINERS = (JOINING, HOLDING_BACK, STANDING_ASIDE, REJOINING)
"""The states of a member without a view: a fresh worker, one holding back (it saw a group
none of whose members it can see now, see :meth:`Engine._may_found`), a straggler standing
aside, and a member that lost its view (left out of a newer one, or back from standing
aside: :attr:`Engine.lost` is that view)."""

JOINED_WITHOUT_STATE = (JOINING, REJOINING)
# The states of a view a member is in before its state was reconciled in it.
UNRECONCILED = (RECONCILING, RECONCILE_DUE, BROKEN)
"""States a member may agree from that hold none of the group's state (or a stale one): a
view it formed from them is its own to go on from only once it reconciled in it."""

IN_VIEW = (RUNNING, RECONCILE_DUE, BROKEN, JOIN_DUE, ASIDE_DUE)
"""The states of a member in a formed view, between two collectives: RUNNING (collectives
may run), RECONCILE_DUE (the registered state is reconciled before the next one: it was
registered after the view formed, or restored from a checkpoint), BROKEN (a collective
failed, :attr:`Engine.fault` says why: re-form before the next one), JOIN_DUE (the last
step admitted a joiner: re-form at this step boundary) and ASIDE_DUE (the last step chose
this member to stand aside as a straggler: it does so at this boundary)."""

TRANSITIONS: dict[tuple[str, str], str] = {
    (JOINING, "agreed"): FORMING,
    (REJOINING, "agreed"): FORMING,
    (AGREEING, "agreed"): FORMING,
    (JOINING, "hold"): HOLDING_BACK,
    (HOLDING_BACK, "release"): JOINING,
    (FORMING, "formed"): RECONCILING,
    (RECONCILING, "deferred"): RECONCILE_DUE,  # no state registered yet: before the first collective
    (RECONCILE_DUE, "reconciled"): RUNNING,
    (RUNNING, "failed"): BROKEN,
    (RECONCILE_DUE, "failed"): BROKEN,
    # a collective between steps, in the view a joiner or a straggler's standing aside waits on (BETWEEN)
    (JOIN_DUE, "failed"): BROKEN,
    (ASIDE_DUE, "failed"): BROKEN,
    (RUNNING, "admit"): JOIN_DUE,
    (RUNNING, "chosen"): ASIDE_DUE,
    (ASIDE_DUE, "bench"): STANDING_ASIDE,
    (RUNNING, "restored"): RECONCILE_DUE,
    # elsewhere the next formation reconciles anyway
    **{(state, "restored"): state for state in (*JOINERS, AGREEING, FORMING, RECONCILING, RECONCILE_DUE, BROKEN,
                                                JOIN_DUE, ASIDE_DUE)},
    (FORMING, "form failed"): AGREEING,  # it had a view before
    (FORMING, "form failed joiner"): JOINING,  # it never had one
    (FORMING, "form failed rejoiner"): REJOINING,  # it lost its view before
    (RECONCILING, "reconciled"): RUNNING,
    # (a straggler whose view broke before it stood aside re-forms with the others: judged again later)
    **{(state, "broken"): AGREEING for state in (RECONCILING, RUNNING, RECONCILE_DUE, BROKEN, JOIN_DUE, ASIDE_DUE)},
    # it never held the group's state: reconciling, or its reconcile deferred (and failed)
    **{(state, "broken unreconciled joiner"): JOINING for state in UNRECONCILED},
    **{(state, "broken unreconciled rejoiner"): REJOINING for state in UNRECONCILED},
    (AGREEING, "superseded"): REJOINING,
    (AGREEING, "replica silent"): REJOINING,  # stands aside with its replica, whose other process is silent
    (AGREEING, "replica repair"): REJOINING,  # its replica lost a process and forms again with a replacement
    (STANDING_ASIDE, "rested"): REJOINING,
    (LEAVING, "closed"): CLOSED,
    **{(state, "leave"): LEAVING for state in (*JOINERS, AGREEING, FORMING, RECONCILING, *IN_VIEW)},
}


BOUNDARY: dict[str, str | None] = {RUNNING: None, RECONCILE_DUE: "reconcile", BROKEN: "recover",
                                   JOIN_DUE: "join", ASIDE_DUE: "aside"}
"""What a member in a view does at a step boundary (see :meth:`Engine.due`); any other
state resumes a re-formation that raised."""

BETWEEN: dict[str, str | None] = {**BOUNDARY, JOIN_DUE: None, ASIDE_DUE: None}
"""The same before a collective that is not a gradient step (one the user runs between two
steps, a metric averaged for the log): a join or a straggler's standing aside waits for the
step boundary, and the collective runs in the view every member is still in. A joiner's
first collective is a gradient step: were the others to admit it here, they would run
this collective while it runs its step."""


def state_diagram() -> str:
    """The transition table as a Mermaid state diagram (docs/ARCHITECTURE.md holds its output).
    Self-loops are left out; ``leave``, accepted in every state but LEAVING and CLOSED, is
    drawn once."""
    lines = ["stateDiagram-v2", f"    [*] --> {JOINING}"]
    lines += [f"    {source} --> {target}: {event}" for (source, event), target in TRANSITIONS.items()
              if source != target and event != "leave"]
    leaving = [source for (source, event) in TRANSITIONS if event == "leave"]
    lines += [f'    state "any state but {LEAVING} and {CLOSED}" as ANY', f"    ANY --> {LEAVING}: leave",
              f"    {CLOSED} --> [*]"]
    assert set(leaving) == {state for state, _ in TRANSITIONS} - {LEAVING}, "leave is accepted in every open state"
    return "\n".join(lines)


class IllegalTransition(RuntimeError):
    """An input the current state does not accept: a bug in the driver, never ignored."""


# ---------------------------------------------------------------------- actions
@dataclass(frozen=True)
class Publish:
    """Publish this member's status record (gossip metadata)."""


@dataclass(frozen=True)
class PublishProposal:
    """Store the member list of proposal ``(view_id, digest)`` on this member's rendezvous
    store, where joiners fetch it (a status record holds only the key)."""
    view_id: int
    digest: str
    members: tuple[str, ...]


@dataclass(frozen=True)
class Announce:
    """Send the status record just published directly to ``members`` (they wait on it to
    agree; an epidemic would take a few gossip rounds)."""
    members: tuple[str, ...]


@dataclass(frozen=True)
class Fetch:
    """Read the member list of proposal ``key`` from ``member``'s rendezvous store and
    hand it back with :meth:`Engine.fetched`."""
    member: str
    key: tuple[int, str]


@dataclass(frozen=True)
class Sync:
    """Exchange full gossip state with ``member`` now: its news is late here. ``probe``: it
    is a member of the view being agreed that has not proposed it for a while: probe it too,
    its port (a refusal proves it gone, and it is declared dead) and through gossip at once
    (one that does not answer is suspected, and no candidate holds it): a process that
    crashed, or a node lost, while nobody exchanged anything with it is otherwise found
    only by gossip's regular probe round and suspicion, seconds later, and the view waits
    on it meanwhile."""
    member: str
    probe: bool = False


@dataclass(frozen=True)
class Form:
    """Form (and verify) the communicator of ``view``; report with formed / form_failed."""
    view: View


@dataclass(frozen=True)
class Rejoined:
    """This member lost its view and is a joiner again (log ``why``; state must be reconciled)."""
    why: str


@dataclass(frozen=True)
class ProbeGroup:
    """As a joiner that saw a group of which no member is live here any more: find out
    whether every worker that held a view of it and has not left is gone for sure (its
    port refuses connections: the process is gone, its host answers). ``members``: the
    members of the newest view of the group whose member list it read (some may not be in
    its gossip table at all: it heard of the group through one of them); the driver
    probes these and every worker in its table that held a view, and sends those that do
    not refuse a join request, since they may be alive and never told of this member.
    ``None``: it never read the list, and nothing can show the group gone. Either way the
    driver sends its seeds a join request again. It answers with
    :meth:`Engine.group_probed`."""
    members: tuple[str, ...] | None


@dataclass(frozen=True)
class ProbeMembers:
    """As a member that lost its view and would found a group again, or a member of a view
    without a quorum of it: find out which of ``members`` (the members it waits on, every
    one of them seemingly dead) are gone for sure: the driver probes each at its port (the
    rendezvous port its record names or the gossip port its id names) and answers with
    :meth:`Engine.members_probed` naming those that refused a connection (the process is
    gone, its host answers). One that does not answer may be across a partition: it is
    not proven gone."""
    members: tuple[str, ...]


@dataclass(frozen=True)
class Recontact:
    """A member that cannot reach a quorum of its view: send its seeds a join request again.
    Cut off long enough, it may have been forgotten by the group and have forgotten the
    group's members in turn (those that joined meanwhile it never heard of): two gossip
    clusters that would never meet again."""


@dataclass(frozen=True)
class ProbeSeeds:
    """A fresh worker cannot found a group yet: a majority of its job is not in sight (see
    Engine._may_found_with), or fewer workers than ``min_workers``. Probe the seed
    ``addresses`` no live member answers from: a refused connection proves that worker gone
    (it no longer counts in the job; answer with :meth:`Engine.seeds_probed`); send the
    seeds a join request again."""
    addresses: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class AwaitState:
    """A fresh worker whose training state is not registered yet found a running group: it
    holds back (no candidate view includes it) and asks to be admitted once its state is
    registered (see :attr:`Engine.state_pending`), so that the group never waits in a
    reconcile for this worker to build its model."""


Action = (Publish | PublishProposal | Announce | Fetch | Sync | Form | Rejoined | ProbeGroup | ProbeMembers | Recontact
          | ProbeSeeds | AwaitState)

RECONTACT_MAX_S = 2.0
"""A member without a quorum asks its seeds again after a chase interval, then twice as
long each time, up to this: after a partition heals, a side that knows nobody on the other
side (every member both knew died or left meanwhile) finds it within this long. Each time
it asks a few seeds only (ftcomm.gossip.config.RECONTACT_FANOUT), so a large group cut in
two does not flood the network."""

ANNOUNCE_LIMIT = 64
"""Views up to this size announce a new proposal to every member (one datagram per pair of
members); above it, each member announces to the view's rank 0 only, and rank 0 announces
to every member once it saw them all propose it (see Engine._published)."""

FETCH_TIMEOUT_S = 0.5
"""How long the driver waits for the answer to one :class:`Fetch`. The driver waits on
nothing else meanwhile, and a member that died or was cut off since it proposed answers
nothing: a short bound and a retry from another proposer (see Engine._adopt) keep a
joiner from sitting out an agreement the others wait on it for."""

PROBE_TIMEOUT_S = 0.25
"""How long the driver waits for each connection of a :class:`ProbeGroup` (a refusal
comes back within a round trip; a host that is lost or cut off never answers)."""

PROOF_FRESH = 4
"""A member of the view a member agrees over counts as proven gone by a refused connection
only if it was seen alive within this many chase intervals (see Engine._probe_absent)."""

PROOF_FIRST = 8
"""The first probes of the members a member misses come a chase interval divided by this
apart, each interval twice the one before, up to the chase interval: a process found
silent but not refusing may be killed a moment later (a launcher kills a stopped worker),
and its refusal then counts at once, while a lost node is not probed more than once per
chase interval for long (see Engine._probe_absent)."""


@dataclass
class Engine:
    """One member's lifecycle. ``config`` is the digest of the settings that must match."""

    id: str
    config: str
    min_workers: int = 1  # replicas (a plain worker is a replica of one process): see replica_size
    max_workers: int | None = None  # replicas, or None
    partition_policy: str = "quorum"
    settle_interval: float = 0.05
    chase_interval: float = 0.6  # a member whose status lags this long gets a Sync, at most this often
    refetch_interval: float = 0.05  # a proposal a peer's store did not have yet is asked for again after this
    joined_at: float = 0.0
    announce_limit: int = ANNOUNCE_LIMIT
    state: str = JOINING
    view: View | None = None  # formed and verified
    forming: View | None = None  # agreed, being formed
    proposal: tuple[int, str] | None = None
    floor: int = 0  # lowest view id to propose or adopt: views below it failed to form here
    lost: View | None = None  # the view it had when it learned it was left out of a newer one
    entered_view: View | None = None  # the newest view it entered (formed or tried to form)
    seen_view: int = 0  # the newest view of this group shown by a member not known to be gone (as of the last look)
    saw_group: int = 0  # as a joiner that never had a view: the newest view of a group it saw (see _may_found)
    group_gone: bool = False  # the driver's answer to the last ProbeGroup
    _probed_list: tuple | None = None  # the member list of the last ProbeGroup (see _group_members)
    proven_gone: frozenset = frozenset()  # the dead a ProbeMembers found refusing (see _probe_absent, _probe_gone)
    short_of: View | None = None  # as of the last look: the view whose quorum its candidate lacks (None: none lacked)
    _probing: frozenset = frozenset()  # the members of the ProbeMembers in flight
    _alive_at: dict = field(default_factory=dict)  # member of the previous view -> when last seen alive (_probe_absent)
    _alive_for: tuple | None = None  # the view (id, digest) _alive_at is about
    _probed_at: float = float("-inf")
    _absent_probes: int = 0  # ProbeMembers of the view _alive_at is about (their pace, see PROOF_FIRST)
    fetched: dict = field(default_factory=dict)  # proposal key -> member list (joiners)
    witnessed: tuple[int, str] | None = None  # as rank 0 of a large view: its proposal, seen made by every member
    vouched: frozenset = frozenset()  # members of the view entered whose own proposal of it was not seen here
    _last: Candidate | None = None
    _settled_since: float = 0.0
    _admitting: bool = False  # agreeing because the last step admitted joiners (see joins_only)
    _lagging: dict = field(default_factory=dict)  # member -> (key, lagging since, last sync)
    _fetching: dict = field(default_factory=dict)  # (member, key) -> when asked
    _final_sync: float = float("-inf")  # see _fetch_final_records
    benched: int | None = None  # the view it stood aside from as a straggler, until it forms a newer one (see bench)
    aside_until: float = 0.0  # STANDING_ASIDE: when it asks to join again
    fault: str | None = None  # BROKEN: why (crash, hang, leave, partition, superseded, backend)
    formed_from: str | None = None  # the state it agreed from on entering FORMING (REJOINING: a rejoin)
    joined_unreconciled: bool = False  # it joined its view (or the one forming) and was not reconciled in it yet
    started: bool = False  # this worker began training (ran a step or restored a checkpoint): see began
    founding: bool = False  # the current view is the group's first and every member wants the network check
    restorable: bool = False  # no member of the current view had begun training when it formed
    settings: tuple = ()  # the settings that must match (SETTING_NAMES), named in a peer's mismatch error
    rendezvous_port: int = 0  # where its rendezvous store serves (proposals, formation)
    insecure: bool = False  # started without a secret on a reachable address
    replica: tuple[str, int, int] | None = None  # a sharded replica's process: (replica key, shard rank, size)
    view_reason: str | None = None  # why the current view formed (init, crash, join, ...): published, for operators
    diverged: tuple[int, int] | None = None  # times this member's state was named wrong, the last step: published
    repairing: bool = False  # its sharded replica lost a process and forms again in place, until it is in a view
    _announced_at: float = float("-inf")  # see _announce_waiting
    _announce_after: float = 0.0
    _recontacted_at: float = float("-inf")
    _recontact_after: float = 0.0  # the wait before the next Recontact (doubles; see RECONTACT_MAX_S)
    max_retries: int = 5  # operations failed in a row before the caller gives up (see count_failure)
    seeds_gone: dict = field(default_factory=dict)  # seed address -> when its latest probe was refused (founding)
    group_ran: bool = False  # started again into a job whose group its launcher saw run (see _may_found_with)
    silent_seeds: tuple = ()  # with group_ran: the seeds that held back its founding at the last look
    state_pending: bool = False  # a fresh worker that has no training state registered yet (see AwaitState)
    _awaiting_since: float | None = None  # when it first found a running group while state_pending
    _seeds_probed: float = float("-inf")
    failures: int = 0  # gradient steps failed in a row (see count_failure)
    call_failures: int = 0  # attempts of execute failed in a row (see count_call_failure)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    # ------------------------------------------------------------------ transitions
    def _move(self, what: str) -> str:
        with self._lock:
            self.state = self._target(what)
            return self.state

    def _target(self, what: str) -> str:
        """Where ``what`` leads from the current state (the lock held); IllegalTransition
        for a pair not in the table."""
        target = TRANSITIONS.get((self.state, what))
        if target is None:
            raise IllegalTransition(f"{self.id}: {what!r} in state {self.state}")
        return target

    @property
    def replica_size(self) -> int:
        """Processes per sharded replica, the unit members come and go in (1: none)."""
        return self.replica[2] if self.replica is not None else 1

    @property
    def max_processes(self) -> int | None:
        """``max_workers`` in processes (a view holds whole replicas)."""
        return self.max_workers * self.replica_size if self.max_workers is not None else None

    def due(self, boundary: bool = True) -> str | None:
        """What this member does before its next collective, by state: at a step
        ``boundary`` (:data:`BOUNDARY`; else :data:`BETWEEN`) re-form after a failed
        collective (``recover``), for a joiner (``join``), stand aside (``aside``),
        reconcile (``reconcile``), resume a re-formation that raised (``resume``: it is in
        no view), or nothing (None)."""
        return (BOUNDARY if boundary else BETWEEN).get(self.state, "resume")

    def count_failure(self) -> bool:
        """A gradient step failed and re-forms: whether that makes more than ``max_retries``
        in a row (the caller gives up, raising RetryLimitExceeded; a caller that goes on
        gets ``max_retries`` more). Calls that complete between the steps (a metric before
        each step, say) do not break the row: every step is still discarded."""
        self.failures, exhausted = self._one_more(self.failures)
        return exhausted

    def _one_more(self, failures: int) -> tuple[int, bool]:
        """One more failure in a row: the new count (none again once over ``max_retries``)
        and whether it went over."""
        return (0, True) if failures + 1 > self.max_retries else (failures + 1, False)

    def count_success(self) -> None:
        """A gradient step completed: the failures in a row start again from none."""
        self.failures = self.call_failures = 0

    def count_call_failure(self) -> bool:
        """An attempt of a call outside the steps (``execute``) failed and re-forms: whether
        that makes more than ``max_retries`` in a row, as :meth:`count_failure`."""
        self.call_failures, exhausted = self._one_more(self.call_failures)
        return exhausted

    def count_call_success(self) -> None:
        """A call outside the steps completed: its attempts' failures start again from none."""
        self.call_failures = 0

    @property
    def holding(self) -> bool:
        """HOLDING_BACK: it founds nothing now (see _may_found); its record says so, and no
        candidate view includes it."""
        return self.state == HOLDING_BACK

    @property
    def aside(self) -> bool:
        """STANDING_ASIDE as a straggler: it proposes and adopts nothing until ``aside_until``."""
        return self.state == STANDING_ASIDE

    @property
    def agreeing(self) -> bool:
        """In a state that looks for a view to agree on (see :meth:`agree`)."""
        return self.state in JOINERS or self.state == AGREEING

    @property
    def phase(self) -> str:
        """The phase peers see in the status record."""
        if self.state in (LEAVING, CLOSED):
            return PHASE_LEAVING
        return ACTIVE if self.view is not None else PHASE_JOINING

    @property
    def current_view(self) -> int:
        return self.view.id if self.view is not None and self.phase == ACTIVE else 0

    def published_view(self) -> View | None:
        """The view its record names: the current one (leaving: the one it leaves). Not a
        view it only entered: one that formed nowhere would read as a newer view to the
        others and make them rejoin a group that does not exist."""
        if self.state in (LEAVING, CLOSED) or self.phase == ACTIVE:
            return self.view
        return None

    def record(self, step: int = 0, ops: int = 0, compute_s: float | None = None) -> StatusRecord:
        """The status record this member publishes: ``step``, its committed steps; ``ops``, the
        group operations it completed in its current view (a leaving member names them, see
        :meth:`damage`); ``compute_s``, its median compute time (see ftcomm.runtime.stragglers)."""
        named = self.published_view()
        return StatusRecord(self.phase, self.current_view, self.proposal, self.joined_at, self.config, step,
                            self.rendezvous_port, self.floor, self.settings,
                            (named.id, ops) if named is not None and self.state == LEAVING else None,
                            self.insecure, named.digest if named is not None else None, compute_s, self.benched,
                            self.aside, self.witnessed, self.holding, self.replica, self.view_reason, self.diverged,
                            self.repairing)

    def broken(self) -> list[Action]:
        """Re-agree: the view (the one being reconciled, or run) can no longer be used, or is
        to be re-formed for a joiner. The proposal is withdrawn at once: a member of the view
        still finishing an operation of it learns that the view moved on."""
        # A deferred reconcile (the state not registered yet) in a view where nobody has begun
        # training loses nothing: the member stays, as the others, to restore with them.
        unreconciled = self.joined_unreconciled and (
            self.state == RECONCILING or (self.state in UNRECONCILED and not self.restorable))
        if unreconciled:
            # It joined this view but never received the group's state: the view is not one
            # it can go on from (a majority of joiners would carry on from their own, older
            # state, committing the group's steps again). It is a joiner again, as before.
            self._move("broken unreconciled joiner" if self.formed_from == JOINING else "broken unreconciled rejoiner")
            self.floor = max(self.floor, self.view.id + 1)
            self.view = None
        else:
            self._admitting = self.state == JOIN_DUE
            self._move("broken")
        self.fault, self._last = None, None
        return [Publish()] if self._withdraw() or unreconciled else []

    def failed(self, fault: str) -> list[Action]:
        """A collective of the view failed (``fault``: why, see :func:`classify`) outside a
        gradient step: BROKEN, re-formed before the next collective. The proposal is
        withdrawn now, so the others stop waiting on this member at once."""
        self._move("failed")
        self.fault = fault
        return [Publish()] if self._withdraw() else []

    def _withdraw(self) -> bool:
        """Withdraw this member's proposal (and rank 0's word on it); whether there was one,
        so that its record changed."""
        withdrawn = self.proposal is not None or self.witnessed is not None
        self.proposal, self.witnessed, self.vouched = None, None, frozenset()
        return withdrawn

    def step_reduced(self, admit: bool, aside: bool) -> None:
        """The verdict of a reduced gradient step, the same on every member of the view: it
        admits a joiner at this step boundary (JOIN_DUE), or this member was chosen to stand
        aside as a straggler (ASIDE_DUE; the others re-form without it, joiners included)."""
        if aside:
            self._move("chosen")
        elif admit:
            self._move("admit")

    def began(self) -> None:
        """This worker began training (ran a step, or restored a checkpoint): a view it forms
        from now on is not restorable. Accepted in every state."""
        self.started = True

    def deferred(self) -> None:
        """The view formed before any state was registered: reconcile before the first collective."""
        self._move("deferred")

    def restored(self) -> None:
        """The registered state was loaded (from a checkpoint) on this member only: reconcile
        before the next collective (in a view that is to be re-formed anyway, nothing changes)."""
        self._move("restored")

    def formed(self, founding: bool = False, restorable: bool = False) -> list[Action]:
        """Every member formed and verified the communicator of the view being formed; the
        verification tells whether it is the group's first view, every member wanting the
        network check (``founding``), and whether no member had begun training
        (``restorable``: the members start the group together and may restore a checkpoint)."""
        self._move("formed")
        self.founding, self.restorable = founding, restorable
        self.view, self.forming = self.forming, None
        self.benched = None
        self.repairing = False
        self._lagging.clear()
        self._recontact_after = self._announce_after = 0.0
        return [Publish()]

    def form_failed(self) -> list[Action]:
        """Forming failed: withdraw the proposal (aborting the others' attempts) and never
        reuse its view id, so a retry cannot meet a stale attempt's rendezvous keys."""
        self._move("form failed" if self.view is not None else "form failed rejoiner" if self.lost is not None
                   else "form failed joiner")
        self.floor = max(self.floor, self.forming.id + 1)
        # The members that entered on its word learn at once that it gave up.
        actions = [Publish()] + ([Announce(self.forming.members)] if self.witnessed else [])
        self.forming, self.proposal, self._last, self.witnessed, self.vouched = None, None, None, None, frozenset()
        return actions

    def reconciled(self) -> list[Action]:
        """Every member of the view holds the same registered state: collectives may run."""
        self._move("reconciled")
        self.joined_unreconciled = False
        return []

    def leave(self) -> list[Action]:
        """Leave gracefully (from any thread; a second call, or one after closing, does
        nothing): publish the record that says so."""
        with self._lock:
            if self.state in (LEAVING, CLOSED):
                return []
            self.state = self._target("leave")
        return [Publish()]

    def closed(self) -> None:
        self._move("closed")

    def _rejoin(self, why: str, transition: str = "superseded") -> list[Action]:
        self._move(transition)
        self.lost = self.view
        # Never that view again (a peer that has not yet seen it leave may still propose it).
        self.floor = max(self.floor, self.view.id + 1)
        self.view, self.proposal, self._last, self.witnessed, self.vouched = None, None, None, None, frozenset()
        self.proven_gone = frozenset()
        return [Rejoined(why), Publish()]

    def repair_replica(self, why: str) -> list[Action]:
        """A process of this member's sharded replica is lost, and the replica is formed
        again with a process that replaces it (``why``; see ftcomm.training.replica_repair):
        an agreeing member leaves the view it holds, its record saying from which (the
        others count it as gone for the quorum at once, as a straggler standing aside: the
        record is sent to each of them directly, as they may wait on it to agree), and
        joins again with its replica once that is whole under its new key
        (:meth:`replica_formed`). A member without a view (a joiner) stays as it is."""
        self.repairing = True
        if self.state != AGREEING or self.view is None:
            return [Publish()]
        view = self.view
        actions = self._rejoin(why, "replica repair")
        self.benched = view.id
        return actions + [Announce(tuple(m for m in view.members if m != self.id))]

    def replica_formed(self, key: str) -> list[Action]:
        """This member's sharded replica formed again, under ``key``: its record says so, and
        views take the replica once each of its processes shows the key."""
        if self.replica is None:
            raise IllegalTransition(f"{self.id}: replica_formed without a replica")
        self.replica = (key, *self.replica[1:])
        return [Publish()]

    def bench(self, now: float, seconds: float) -> list[Action]:
        """This member, chosen by the last step (ASIDE_DUE), is a straggler and stands aside
        (``straggler_policy="exclude"``): it leaves its view (its record says from which one, so the others re-form without it
        and count it as gone for the quorum), proposes and adopts nothing for ``seconds``,
        then asks to join again like any member that lost its view."""
        view = self.view
        actions = self._rejoin(f"standing aside as a straggler for {seconds:g} s", "bench")
        self.benched, self.aside_until = view.id, now + seconds
        return actions

    # ------------------------------------------------------------------ agreement
    def agree(self, now: float, statuses: dict[str, Status], unconfirmed: tuple[Status, ...] = (),
              seeds: dict[tuple[str, int], str | None] | None = None) -> list[Action]:
        """One look at the membership while :attr:`agreeing`; see :mod:`ftcomm.core.view`.
        ``unconfirmed``: the records of live members of the local table that have not
        answered this member directly yet (no view is made of them, see
        ftcomm.runtime.ports.readable; a fresh worker holds back for them, below).
        ``seeds``: while founding, the addresses of the seeds this worker was started with,
        each with the live member there (None: none answers from it).

        Returns what to do now; the driver calls again when the membership changes (or
        after a short wait). Entering FORMING is signalled by a :class:`Form` action.
        """
        if not self.agreeing:
            raise IllegalTransition(f"{self.id}: agree in state {self.state}")
        if self.state == STANDING_ASIDE:
            if now < self.aside_until:
                return []
            self._move("rested")  # back: a joiner that lost its view (its record still names the view it left)
            return [Publish()]
        own = statuses.get(self.id)
        if own is None:
            return []
        if self.state == AGREEING and self.view is not None and superseded(own, statuses, self.entered_view):
            return self._rejoin("a newer view exists without this worker")
        if self.state != AGREEING:
            # A record not confirmed yet counts here: holding back for a forged one costs time
            # (until the probe of its port answers), founding beside a live group would cost
            # the group's steps.
            self.seen_view = max([s.last_view for s in (*statuses.values(), *unconfirmed)
                                  if s.id != self.id and s.config == self.config and not (s.left or s.dead)], default=0)
            if self.seen_view > 0 and self.state != REJOINING:
                self.saw_group, self.group_gone = max(self.saw_group, self.seen_view), False
            # Admitted to a running group, a worker whose state is not registered yet would
            # hold the group in its reconcile while it builds its model: it holds back until
            # then (a group still founding waits for every founder's state anyway).
            awaiting = self.state_pending and self.state != REJOINING and self._group_exists(statuses)
            holding = awaiting or not (self._group_exists(statuses) or self._group_seen() or self._may_found())
            if holding != self.holding:
                # Holding back, it reads as standing aside: a fresh worker beside it would
                # otherwise propose a view with it, and wait for it to agree.
                self._move("hold" if holding else "release")
                return [Publish()]
            if awaiting:
                # It reads the member list of the group's view first (for a chase interval at
                # most): should the group vanish out of sight before this worker is let in,
                # only that list can show it gone for sure (see ProbeGroup).
                self._last = None
                if self._awaiting_since is None:
                    self._awaiting_since = now
                _, reads = self._read_proposals(now, statuses, self._newest(statuses))
                if reads and now - self._awaiting_since < self.chase_interval:
                    return reads
                return reads + [AwaitState()]
            if self._group_exists(statuses):
                return self._adopt(now, statuses)
            if self._group_seen():
                self._last = None
                return []
            if holding:
                self._last = None
                if now - self._probed_at < self.chase_interval:
                    return []
                self._probed_at = now
                # Without the group's member list nothing can show the group gone: the probe
                # only contacts its seeds again.
                self._probed_list = self._group_members(statuses)
                return [ProbeGroup(self._probed_list)]
        previous = self.view if self.state == AGREEING else None
        entered = self.entered_view
        if previous is not None and entered is not None and entered.id > previous.id and any(
                s.current_view == entered.id and s.view_digest == entered.digest and s.config == self.config
                for s in statuses.values()):
            # A view it entered formed on other members although its own formation failed:
            # that view, not the older one, is what the group goes on from.
            previous = entered
        proven = frozenset()
        short_of = previous  # the view whose quorum a candidate lacks, when it lacks one
        unsure = previous is not None and entered is not None and entered.id > previous.id
        if previous is not None:
            # (with a view entered and failed here, the members of both are watched and probed)
            watched = View(entered.id, tuple(dict.fromkeys((*previous.members, *entered.members)))) if unsure \
                else previous
            self._saw_alive(now, watched, statuses)
            proven = self.proven_gone
        cand = candidate(self.id, previous, statuses, self.config, self.max_processes, proven)
        if unsure and cand.quorum and not self._quorum_of_entered(entered, cand, statuses, proven):
            cand, short_of = dataclasses.replace(cand, quorum=False), entered
        self.short_of = None if cand.quorum else short_of
        if self.state == REJOINING:
            if not self._may_refound(cand, statuses):
                self._last = None
                return self._probe_gone(now, cand, statuses) + self._recontact(now)
            # above every view of a newer group that ended (its records outlive it)
            self.floor = max([self.floor] + [s.last_view + 1 for s in self._newer(statuses)])
        if cand.view_id < self.floor:  # its own floor counts before gossip echoes its record
            cand = dataclasses.replace(cand, view_id=self.floor)
        if not self.usable(cand):
            self._last = None
            if previous is None and seeds:
                # Below min_workers, a fresh worker asks its seeds that no live member answers
                # from to let it in again: started while they were cut off or hung, it may
                # have joined a gossip cluster of other newcomers only, which alone never
                # reaches min_workers.
                return self._probe_seeds(now, seeds)
            if previous is None or cand.quorum:  # (below min_workers: waiting for workers, not cut off)
                return self._fetch_final_records(previous, statuses, now)
            silent = self._silent_partner(now, previous, cand, statuses)
            if silent is not None:
                self.benched = previous.id
                return self._rejoin(f"{silent}, a process of this sharded replica, has not answered for "
                                    f"{now - self._alive_at[silent]:.1f} s: the replica stands aside so that the "
                                    f"others have a quorum without it", "replica silent")
            return (self._fetch_final_records(previous, statuses, now)
                    or self._probe_absent(now, short_of, cand, statuses) + self._recontact(now))
        if previous is None and unconfirmed:
            # A group is founded with every live worker its founders know of: a worker whose
            # record is not read yet may be founding too (it knows of this one, or of nobody
            # else), and two groups would train side by side. It answers a confirmation ping
            # within a round trip; a forged record is suspected and dropped within seconds.
            self._last = None
            return []
        if previous is None and seeds and not self._may_found_with(cand, seeds, now):
            self._last = None
            return self._probe_seeds(now, seeds)
        if cand != self._last:
            self._last, self._settled_since = cand, now
        settled = certain(cand, previous, statuses) or (joins_only(cand, previous, statuses) and (
            self._admitting or proposed_by_another(cand, previous, statuses, self.id)))
        if now - self._settled_since < (0.0 if settled else self.settle_interval):
            return []
        actions: list[Action] = []
        key = (cand.view_id, cand.digest)
        if self.proposal != key:
            self.proposal = key
            actions += [PublishProposal(cand.view_id, cand.digest, cand.members), *self._published(cand.members)]
        if agreed(cand, statuses) or self._witnessed(key, cand.members, statuses):
            return actions + self._enter(View(cand.view_id, cand.members), statuses)
        return actions + self._chase(key, cand.members, statuses, now)

    @staticmethod
    def _quorum_of_entered(entered: View, cand: Candidate, statuses: dict[str, Status],
                           proven: frozenset[str]) -> bool:
        """A view this member entered whose formation failed here, with no sign of it having
        formed elsewhere: it may have formed on the others all the same (their verification
        completed and this member's did not, the network cut just then), and they go on from
        it. A candidate must then be a quorum of that view too, or the two sides of a cut
        would each form one: this member from the view before, the others from that one."""
        gone = gone_from(entered, statuses)
        return has_quorum(entered, cand.members, gone) or (
            bool(proven) and has_quorum(entered, cand.members, gone | proven, tie=False))

    def _published(self, members: tuple[str, ...]) -> list[Action]:
        """A new proposal: publish the record, and send it straight to the members waiting on
        it: to every member of a view up to ``announce_limit``; above, to the view's rank 0
        only, which announces to every member once it saw them all propose it (two datagrams
        per member instead of one per pair; see :meth:`_witnessed`)."""
        if len(members) <= self.announce_limit:
            return [Publish(), Announce(members)]
        return [Publish()] + ([Announce(members[:1])] if members[0] != self.id else [])

    def _witnessed(self, key: tuple[int, str], members: tuple[str, ...], statuses: dict[str, Status]) -> bool:
        """A view above ``announce_limit`` is agreed when its rank 0 publishes that it saw every
        member propose it (``Status.agreed``) while proposing it itself: every member still
        enters only a view all its members proposed, without each waiting for all the others'
        records to reach it by gossip (rounds of ``gossip_interval``, and N records each)."""
        if len(members) <= self.announce_limit:
            return False
        rank0 = statuses.get(members[0])
        return rank0 is not None and rank0.alive and rank0.proposal == key and rank0.agreed == key

    def _fetch_final_records(self, previous: View | None, statuses: dict[str, Status], now: float) -> list[Action]:
        """A member of the previous view left, but its final record (which says from which
        view it left, and so whether it counts as gone for the quorum) has not arrived here:
        sync with another live member, who may have it (at most once per chase interval)."""
        if previous is None:
            return []
        stale = [m for m in previous.members if m in statuses and statuses[m].left and statuses[m].phase != PHASE_LEAVING]
        if not stale or now - self._final_sync < self.chase_interval:
            return []
        others = sorted(s.id for s in statuses.values() if s.alive and s.id != self.id)
        if not others:
            return []
        self._final_sync = now
        return [Sync(others[int(now / self.chase_interval) % len(others)])]

    def _recontact(self, now: float) -> list[Action]:
        """A member cut off from a quorum of the view it had (or of the view it lost) asks
        its seeds to let it in again: after a chase interval, then twice as long each time up
        to RECONTACT_MAX_S, until it forms a view."""
        if now - self._recontacted_at < self._recontact_after:
            return []
        self._recontacted_at = now
        self._recontact_after = min(RECONTACT_MAX_S, max(self.chase_interval, 2 * self._recontact_after))
        return [Recontact()]

    def _group_seen(self) -> bool:
        """A joiner that never had a view, while no member of the group is live and reachable
        from here, but a member not known to be gone shows a view of it (the member it joined
        through is suspect, across a partition; the others are not confirmed yet): it waits to
        be admitted. A group whose members all died or left no longer holds it back (a job
        restarted from scratch); one that lives on would see a second group commit its steps
        again from step 0."""
        return self.state != REJOINING and self.seen_view > 0

    def _may_found(self) -> bool:
        """A joiner that never had a view and saw a group, none of whose members it sees live
        now, founds a group of its own (with the quorum policy) only when every worker that
        held a view of that group and has not left is gone for sure. Gossip's verdicts do
        not tell: a member it joined through may have been cut off from the others and
        declared them dead, then left or died itself; the joiner, which never reached them,
        would train alone from step 0 beside them (a minority side committing). A worker
        that does not answer may be across a partition: it waits (until its timeout),
        standing aside. A job restarted from scratch is not held back: new workers that know
        nothing of the old group found one without it, and it joins theirs. (A member that
        lost its view follows :meth:`_may_refound` instead.)"""
        return (self.state == REJOINING or not self.saw_group or self.group_gone
                or self.partition_policy == "availability")

    def _group_members(self, statuses: dict[str, Status]) -> tuple[str, ...] | None:
        """The members of the newest view of the group it saw whose list it read, or that it
        entered itself (a group founded with it whose state it never received: its members
        may all be joiners again), if any.

        A view it entered and never received the state of committed nothing its members had
        not committed before: a member of the view they came from, left out of this one (it
        hung, or was cut off), may hold the group's newest state as they did. With that
        view's list read too the two are probed; without it (the view the records of the
        entered view's members show before it) nothing can show the group gone (seed 5415
        of plain workers: the member left out, hung, was in no table of this worker)."""
        known = [(key[0], members) for key, members in self.fetched.items() if key[0] >= self.saw_group]
        entered = self.entered_view
        if entered is not None and entered.id >= self.saw_group:
            known.append((entered.id, entered.members))
        if not known:
            return None
        newest_id, members = max(known)
        if entered is not None and newest_id == entered.id and self.view is None:
            before = max([statuses[m].last_view for m in entered.members
                          if m in statuses and m != self.id and statuses[m].last_view < entered.id], default=0)
            if before > 0:
                lists = [m for key, m in self.fetched.items() if key[0] == before]
                if not lists:
                    return None
                members = tuple(dict.fromkeys((*members, *lists[-1])))
        return members

    def _may_found_with(self, cand: Candidate, seeds: dict[tuple[str, int], str | None], now: float) -> bool:
        """A fresh group is founded only by a majority of its job as this worker knows it:
        itself and the seeds it was started with (every other worker of the job, as ``ftcomm
        run`` gives them), less those proven gone (their port refused a connection). A seed
        that does not answer may run the job's group across a partition, or be a worker that
        founds one with the others, and a minority founding beside it would train a second
        group. With ``partition_policy="availability"`` any worker founds.

        A worker its launcher started again after it saw the job's group run
        (``group_ran``) comes back to a group that it may see no member of: the group may
        run on in a seed that does not answer, across a partition, kept alive by a quorum
        that counts the crashed as proven gone. It founds only once every seed answers or
        is proven gone; a majority of the seeds would not do, since the group may be one
        member and the restarted workers the rest."""
        if self.partition_policy == "availability":
            return True
        # A refusal proves a seed gone while it is fresh, and while no member answers from
        # there: a launcher may start a worker there again, which may run the group out of
        # sight (a seed is probed again once its refusal is stale).
        fresh = now - PROOF_FRESH * self.chase_interval
        gone = {a for a, member in seeds.items() if member is None and self.seeds_gone.get(a, float("-inf")) >= fresh}
        self.silent_seeds = tuple(a for a, member in seeds.items() if member is None and a not in gone) \
            if self.group_ran else ()
        if self.silent_seeds:
            return False
        job = [member for address, member in seeds.items() if address not in gone]
        present = sum(1 for member in job if member is not None and member in cand.members)
        return 2 * (1 + present) > 1 + len(job)

    def _probe_seeds(self, now: float, seeds: dict[tuple[str, int], str | None]) -> list[Action]:
        """A :class:`ProbeSeeds` of the seeds no live member answers from, at most once per
        chase interval. Those found gone before are probed again: a launcher may have started
        a worker there since, which may run the group out of sight, and an old refusal proves
        nothing of it."""
        missing = tuple(a for a, member in seeds.items() if member is None)
        if not missing or now - self._seeds_probed < self.chase_interval:
            return []
        self._seeds_probed = now
        return [ProbeSeeds(missing)]

    def seeds_probed(self, probed: Iterable[tuple[str, int]], refused: Iterable[tuple[str, int]]) -> None:
        """The answer to a :class:`ProbeSeeds` of ``probed``: these seeds' ports refused a
        connection (gone, as of the probe); the others did not (no longer known gone)."""
        refused = set(refused)
        for address in probed:
            if address in refused:
                self.seeds_gone[address] = self._seeds_probed
            else:
                self.seeds_gone.pop(address, None)

    def group_probed(self, gone: bool) -> None:
        """The answer to a :class:`ProbeGroup` (one without a member list never shows the
        group gone)."""
        self.group_gone = gone and self._probed_list is not None

    def members_probed(self, refused: Iterable[str]) -> None:
        """The answer to a :class:`ProbeMembers`: these members refused a connection. Only
        the members it asked about count, and only while it still agrees (a member of a
        view: they add up, since a process proven gone never comes back under its id) or
        lost its view."""
        if self.state == REJOINING:
            self.proven_gone = frozenset(refused) & self._probing
        elif self.state == AGREEING:  # (one answer per probe: a proof is fresh, see _probe_absent)
            self.proven_gone |= frozenset(refused) & self._probing
            self._probing = frozenset()

    def _saw_alive(self, now: float, previous: View, statuses: dict[str, Status]) -> None:
        """When each member of ``previous`` was last seen alive: every one of them when this
        member began to agree over that view (it ran in it with them until then), and since,
        each time gossip shows it alive."""
        key = (previous.id, previous.digest)
        if self._alive_for != key:
            self._alive_for, self._alive_at = key, dict.fromkeys(previous.members, now)
            self._absent_probes = 0
        for m in previous.members:
            status = statuses.get(m)
            if status is not None and status.alive:
                self._alive_at[m] = now

    def _probe_absent(self, now: float, previous: View, cand: Candidate, statuses: dict[str, Status]) -> list[Action]:
        """A member of ``previous`` without a quorum of it: the members it is missing are
        probed while none of them is alive in gossip (suspect, dead or forgotten), every
        chase interval (the first ones sooner: see ``PROOF_FIRST``). Those whose port
        refuses are proven gone and count no more (see
        :func:`candidate`): the survivors of a view of two go on when the other one's process
        died, instead of waiting out the quorum timeout for a member that can never come
        back. One that does not answer (a lost node, a partition) is not proven gone: it
        still counts, and the survivors wait.

        Only a member seen alive within ``PROOF_FRESH`` chase intervals is probed: a member
        it lost sight of longer ago (this member was cut off, or hung) may have gone on
        without it in a newer view, with members it does not know of, before it died; its
        death proves nothing about that view."""
        gone = gone_from(previous, statuses) | self.proven_gone
        absent = frozenset(m for m in previous.members if m not in cand.members and m not in gone)
        fresh = now - PROOF_FRESH * self.chase_interval
        pace = min(self.chase_interval, self.chase_interval / PROOF_FIRST * 2 ** self._absent_probes)
        if (not absent or any(m in statuses and statuses[m].alive for m in absent)
                or now - self._probed_at < pace):
            return []
        absent = frozenset(m for m in absent if self._alive_at.get(m, float("-inf")) >= fresh)
        if not absent:
            return []
        self._probed_at, self._probing = now, absent
        self._absent_probes += 1
        return [ProbeMembers(tuple(sorted(absent)))]

    def _silent_partner(self, now: float, previous: View, cand: Candidate, statuses: dict[str, Status]) -> str | None:
        """A process of this member's sharded replica that no gossip has shown alive for a
        chase interval (suspect, not yet dead), while the others lack a quorum of
        ``previous`` only because this member counts in it: the replica cannot train (it is
        not whole), and as it holds the tie, the other replicas would wait until that
        process is declared dead and this one leaves (seconds). Standing aside (its record
        says from which view, so it counts as gone for the quorum, as a straggler's does)
        lets them go on now; this member joins again with its replica when the process
        answers, or leaves with ReplicaLost when it is declared dead. Returns that
        process, or None.

        Only over the view it holds (``previous`` is not a newer one it entered that formed
        elsewhere): the view it stands aside from is then the one it loses, which
        :meth:`_would_vote_twice` reads."""
        if self.replica is None or previous != self.view or not cand.members or self.id in cand.members:
            return None
        key = self.replica[0]
        quiet = [m for m in previous.members if m != self.id and m in statuses and statuses[m].replica is not None
                 and statuses[m].replica[0] == key and not statuses[m].alive
                 and now - self._alive_at.get(m, now) >= self.chase_interval]
        if not quiet or not self._quorum_without_self(previous, cand.members, statuses):
            return None
        return quiet[0]

    def _quorum_without_self(self, view: View, members: tuple[str, ...], statuses: dict[str, Status]) -> bool:
        """``members`` are a quorum of ``view`` with this member counted gone (as its record
        says once it stood aside from ``view``)."""
        return has_quorum(view, members, gone_from(view, statuses) | {self.id})

    def _may_refound(self, cand: Candidate, statuses: dict[str, Status]) -> bool:
        """A member left out of a newer view sees no live group to join. It founds one only
        if the quorum of the view it lost is with it and nothing shows a view newer than
        that one (the newer group is then merely out of its sight: founding another would
        split the job), unless the newer group ended (see :meth:`_ended_newer`). Members of
        the lost view that are gone for sure do not count: those whose final record arrived,
        and those dead that refused a connection (a :class:`ProbeMembers`' answer)."""
        newer = self._newer(statuses)
        gone = gone_from(self.lost, statuses)
        if newer:
            if not self._ended_newer(newer, statuses):
                return False
            gone |= {s.id for s in newer}  # the group's past: none holds a newer state
            # The newer view's members are not known here (a record shows a view's id, not
            # its members): any member of the lost view not gone for sure may be one of them,
            # its record of that view still on its way. No majority, no tie, will do: every
            # member of the lost view that is not here left or is proven dead.
            return self._absent(cand, gone) <= self.proven_gone
        if has_quorum(self.lost, cand.members, gone):
            return True
        absent = self._absent(cand, gone)
        return bool(absent) and absent <= self.proven_gone

    def _newer(self, statuses: dict[str, Status]) -> list[Status]:
        """The records that show a view newer than the one this member lost."""
        return [s for s in statuses.values()
                if s.id != self.id and s.config == self.config and s.last_view > self.lost.id]

    def _absent(self, cand: Candidate, gone: set[str]) -> frozenset[str]:
        """The members of the lost view that are neither with this member nor known gone."""
        return frozenset(m for m in self.lost.members if m not in cand.members and m not in gone)

    def _ended_newer(self, newer: list[Status], statuses: dict[str, Status]) -> bool:
        """The group that went on without this member ended without taking the training
        further than this member's state: every member that shows a newer view left (its
        final record arrived) or died and refused a connection (``proven_gone``; gossip's
        verdict alone may be a partition), and none committed a step this member did not.
        Its members are the group's past, not a group out of sight (two replicas, the one
        holding rank 0 dies while the other rejoins: the survivor trains on instead of
        waiting for ever)."""
        own = statuses.get(self.id)
        if own is None or any(s.step > own.step for s in newer):
            return False  # the newest state went with them: going on would train from an older one
        if any(not (s.final or s.dead) for s in newer):
            return False
        return {s.id for s in newer if not s.final} <= self.proven_gone

    def _probe_gone(self, now: float, cand: Candidate, statuses: dict[str, Status]) -> list[Action]:
        """While the members a refounding waits on (the dead that show a newer view, the
        absent of the lost view) all seem dead, but not all for sure: a :class:`ProbeMembers`
        of them, every chase interval (a member of the lost view of which no record is left
        here is as good as dead: gossip forgot it)."""
        newer = self._newer(statuses)
        own = statuses.get(self.id)
        if own is None or any(s.step > own.step or not (s.final or s.dead) for s in newer):
            return []
        gone = gone_from(self.lost, statuses) | {s.id for s in newer if s.final}
        suspects = self._absent(cand, gone) | {s.id for s in newer if not s.final}
        if (not suspects or any(m in statuses and not statuses[m].dead for m in suspects)
                or suspects <= self.proven_gone or now - self._probed_at < self.chase_interval):
            return []
        self._probed_at, self._probing = now, suspects
        return [ProbeMembers(tuple(sorted(suspects)))]

    def usable(self, cand: Candidate) -> bool:
        return (self.id in cand.members and len(cand.members) >= self.min_workers * self.replica_size
                and (cand.quorum or self.partition_policy == "availability"))

    def _adopt(self, now: float, statuses: dict[str, Status]) -> list[Action]:
        """As a joiner: agree to a proposal of the existing group that includes this member,
        made by a member that holds the newest view known here (a member left out of a newer
        view may still propose from its stale table: adopting that would lend it a vote).
        A member whose formation of that view failed entered it (its floor is above it) and
        is not left out of it: when the view formed only on members that have since died,
        its record outlives them, and the members that entered it are the group."""
        newest = self._newest(statuses)
        proposers, reads = self._read_proposals(now, statuses, newest)
        actions: list[Action] = list(reads)
        for status in proposers:
            key = status.proposal
            members = self.fetched.get(key)
            if members is None:
                continue
            if self.id not in members or self._would_vote_twice(status, members, statuses):
                continue
            if self.proposal != key:
                self.proposal = key
                actions += self._published(members)
            if agreed(Candidate(members, key[0], True, ()), statuses) or self._witnessed(key, members, statuses):
                return actions + self._enter(View(key[0], members), statuses)
            actions += self._chase(key, members, statuses, now)
        if not actions and self.proposal is None:
            actions = self._announce_waiting(newest, statuses, now)
        return actions

    def _would_vote_twice(self, proposer: Status, members: tuple[str, ...], statuses: dict[str, Status]) -> bool:
        """This member stood aside from the view it lost (its record says so, and the others
        may have formed a view counting it as gone), and ``members``, proposed by a member
        that holds no newer view, are a quorum of that view only with this member counted
        present (the proposer read a record of it from before it stood aside): adopting would
        lend the view it stood aside from a second vote."""
        lost = self.lost
        if lost is None or self.benched != lost.id or proposer.last_view > lost.id:
            return False
        return not self._quorum_without_self(lost, members, statuses)

    def _newest(self, statuses: dict[str, Status]) -> int:
        """The newest view of the group known here (the one this member lost included)."""
        return max([s.last_view for s in statuses.values() if s.config == self.config] +
                   [self.lost.id if self.lost is not None else 0])

    def _read_proposals(self, now: float, statuses: dict[str, Status],
                        newest: int) -> tuple[list[Status], list[Action]]:
        """The members that propose and hold the group's newest view, and a :class:`Fetch`
        of each of their proposals whose member list is not read yet: one read per proposal
        and look, from the proposer asked least recently (one that died since it proposed
        answers nothing, and must not be asked every time)."""
        if len(self._fetching) > 256:
            self._fetching.clear()
        proposers = [s for s in statuses.values()
                     if s.alive and s.phase == ACTIVE and s.proposal and s.config == self.config
                     and self._holds_newest(s, newest) and s.proposal[0] >= self.floor]
        # (a proposal below its floor failed to form here: it waits for the retry's proposal)
        reads: list[Action] = []
        for key in dict.fromkeys(s.proposal for s in proposers if s.proposal not in self.fetched):
            owners = [s.id for s in proposers if s.proposal == key and s.rendezvous_port is not None]
            asked = {m: self._fetching.get((m, key), float("-inf")) for m in owners}
            member = min(owners, key=lambda m: (asked[m], m), default=None)
            if member is not None and now - asked[member] >= self.refetch_interval:
                self._fetching[(member, key)] = now
                reads.append(Fetch(member, key))
        return proposers, reads

    def _announce_waiting(self, newest: int, statuses: dict[str, Status], now: float) -> list[Action]:
        """A joiner that the group runs without: send its record straight to the members of
        the group's newest view (its first ``announce_limit``), after a chase interval, then
        twice as long each time up to RECONTACT_MAX_S. A record changed while it was cut off
        (rejoining, say) may have been gossiped in vain, and the group, reading the old one,
        would not admit it until the next full exchange of state (push/pull, many seconds)."""
        if now - self._announced_at < self._announce_after:
            return []
        group = sorted(s.id for s in statuses.values()
                       if s.alive and s.phase == ACTIVE and s.current_view == newest and s.config == self.config
                       and s.id != self.id)[:self.announce_limit]
        if not group:
            return []
        self._announced_at = now
        self._announce_after = min(RECONTACT_MAX_S, max(self.chase_interval, 2 * self._announce_after))
        return [Announce(tuple(group))]

    @staticmethod
    def _holds_newest(status: Status, newest: int) -> bool:
        """The member holds view ``newest`` (or a newer one), or entered it and failed to
        form it (its floor is above it): either way it is not left out of that view."""
        return max(status.current_view, status.floor - 1) >= newest

    def fetched_proposal(self, key: tuple[int, str], members: tuple[str, ...] | None) -> None:
        """The answer to a :class:`Fetch` (None: the member does not have it, or is gone). A
        list that does not hash to the proposal's digest is dropped."""
        if members is not None and View(key[0], tuple(members)).digest == key[1]:
            self.fetched[key] = tuple(members)
            if len(self.fetched) > 64:  # only recent proposals matter
                self.fetched.pop(next(iter(self.fetched)))

    def _group_exists(self, statuses: dict[str, Status]) -> bool:
        return any(s.alive and s.phase == ACTIVE and s.current_view > 0 and s.config == self.config
                   for s in statuses.values() if s.id != self.id)

    def _enter(self, view: View, statuses: dict[str, Status]) -> list[Action]:
        self.formed_from = self.state
        self.joined_unreconciled = self.state in JOINED_WITHOUT_STATE
        self._admitting = False
        self._move("agreed")
        self.forming = view
        if self.entered_view is None or view.id > self.entered_view.id:
            self.entered_view = view
        self._lagging.clear()
        self._fetching.clear()
        key = (view.id, view.digest)
        self.vouched = frozenset(m for m in view.members
                                 if m != self.id and (m not in statuses or statuses[m].proposal != key))
        if view.size > self.announce_limit and view.members[0] == self.id and not self.vouched:
            self.witnessed = key  # as rank 0, it saw every member propose the view: it tells them
            return [Publish(), Announce(view.members), Form(view)]
        return [Form(view)]

    def _chase(self, key: tuple[int, str], members: tuple[str, ...], statuses: dict[str, Status],
               now: float) -> list[Action]:
        """Sync with members whose status has not shown proposal ``key`` for a while.

        Gossip delivers an update to every member with high probability, not certainty; a
        member that missed another's proposal would otherwise wait for the next periodic
        push/pull (many seconds) while that member sits in formation. At most three syncs
        per interval, each member at most once per interval.
        """
        interval = self.chase_interval
        lagging = [m for m in members if m != self.id and (m not in statuses or statuses[m].proposal != key)]
        self._lagging = {m: self._lagging[m] if self._lagging.get(m, (None,))[0] == key else (key, now, -interval)
                         for m in lagging}
        due = [m for m in lagging if now - self._lagging[m][1] >= interval and now - self._lagging[m][2] >= interval]
        for m in due[:3]:
            self._lagging[m] = (key, self._lagging[m][1], now)
        return [Sync(m, probe=True) for m in due[:3]]

    def admits_joiner(self, statuses: dict[str, Status]) -> bool:
        """A live worker with these settings waits to join and the view has room for it: the
        step being reduced raises the join flag, and every member re-forms at its boundary."""
        view = self.view
        if view is None or (self.max_processes is not None and view.size >= self.max_processes):
            return False
        waiting = {s.id: s for s in statuses.values()
                   if s.alive and s.phase == PHASE_JOINING and not s.aside and s.config == self.config}
        return any(m not in view.member_set for m in whole_replicas(waiting))

    # ------------------------------------------------------------------ what breaks a view
    def entry_damage(self, view: View, statuses: dict[str, Status], ops_done: int = 0) -> list["Damage"]:
        """What already breaks ``view`` as this member enters its formation (empty: nothing):
        a member no longer alive, or no longer proposing it (unless rank 0 vouched for it,
        see :meth:`_witnessed`), and any member already in a newer view. News that arrived
        before the entry is not judged against the view (its records are read here instead)."""
        key = (view.id, view.digest)
        found = []
        for member in view.members:
            status = statuses.get(member)
            if member == self.id:
                continue
            if status is None or not status.alive:
                found.append(Damage(f"{member} is no longer alive", None, member=member))
            elif status.proposal != key and member not in self.vouched:
                found.append(Damage(f"{member} no longer proposes view {view.id}", None, member=member))
        for status in statuses.values():
            damage = self.damage("metadata", status.id, status, ops_done)
            if damage is not None and damage.fault == "superseded":
                found.append(damage)
        return found

    def damage(self, kind: str, member: str, status: Status | None, ops_done: int) -> "Damage | None":
        """Whether gossip news about ``member`` breaks the view being run or formed.

        ``kind``: a gossip event (suspect, dead, left, metadata, ...); ``status``: the
        member's decoded record; ``ops_done``: group operations this member completed in
        its current view. None: the view is not affected.
        """
        view = self.forming or self.view
        if view is None or member == self.id or self.state in (*JOINERS, LEAVING, CLOSED):
            return None
        if member in view.member_set and kind in ("suspect", "dead", "left"):
            if (kind == "left" and status is not None and status.done_ops is not None and self.forming is None
                    and self.state in IN_VIEW and status.done_ops[0] == view.id and status.done_ops[1] > ops_done):
                return Damage(f"{member} left after completing the operation in flight", kind, True, member)
            return Damage(f"{member} is {kind}", kind, member=member)
        if status is None or status.config != self.config or not status.alive:
            return None
        if member in view.member_set:
            if status.proposal != (view.id, view.digest):  # it saw a change, or gave up forming
                if member in self.vouched and status.floor <= view.id and status.current_view < view.id:
                    return None  # maybe older than its proposal, which rank 0 saw (see _witnessed)
                what = f"proposes view {status.proposal[0]}" if status.proposal else "withdrew its proposal"
                return Damage(f"{member} {what}", None, member=member)
        elif status.phase == ACTIVE and (status.current_view > view.id or (
                status.current_view == view.id and status.view_digest is not None and status.view_digest > view.digest)):
            return Damage(f"view {status.current_view} exists without this worker", "superseded", member=member)
        return None


@dataclass(frozen=True)
class Damage:
    """The view is broken (``reason``); ``fault``: what happened to a member (suspect, dead,
    left, superseded) or None for a peer that moved on; ``defer``: let the operation in
    flight finish first (the member left after completing it)."""
    reason: str
    fault: str | None
    defer: bool = False
    member: str | None = None  # whom the news is about


# ---------------------------------------------------------------------- pure decisions
def certain(cand: Candidate, previous: View | None, statuses: dict[str, Status]) -> bool:
    """The candidate only drops members of the previous view that are known gone for good
    (confirmed dead, as by a refused connection, or left): no further news can change it,
    so it is proposed without the settle interval (which batches changes still arriving,
    such as joiners or suspicions)."""
    if previous is None or not set(cand.members) <= set(previous.members):
        return False
    dropped = [m for m in previous.members if m not in cand.members]
    return bool(dropped) and all(m in statuses and (statuses[m].dead or statuses[m].left) for m in dropped)


def joins_only(cand: Candidate, previous: View | None, statuses: dict[str, Status]) -> bool:
    """The candidate is the previous view, every member of it active, and fresh workers
    asking to join, nothing else. After a
    step that admitted joiners (every member of the view re-forms at that boundary, and a
    joiner that comes later waits for the next one, a step away) such a candidate is
    proposed without the settle interval, which would only hold the group back."""
    if previous is None or not set(previous.members) < set(cand.members):
        return False
    if not all(m in statuses and statuses[m].alive and statuses[m].phase == ACTIVE for m in previous.members):
        return False  # a member of the view is going: the settle batches that change with the join
    added = [m for m in cand.members if m not in previous.member_set]
    # Fresh workers only (floor 0): one rejoining after a partition or a lost view is settled
    # as any other change.
    return all(m in statuses and statuses[m].alive and statuses[m].phase == PHASE_JOINING and statuses[m].floor == 0
               for m in added)


def proposed_by_another(cand: Candidate, previous: View, statuses: dict[str, Status], me: str) -> bool:
    """Another member of the previous view already proposes the candidate: it reached the
    step that admitted the joiners first (this member's view broke on its proposal before
    it read the step's verdict itself)."""
    key = (cand.view_id, cand.digest)
    return any(m != me and m in statuses and statuses[m].proposal == key for m in previous.members)


def must_confirm(now: float, contributed_at: float, op_began: float, stalled_at: float, refuted_at: float,
                 probe_interval: float) -> bool:
    """Whether an operation that just completed here may have completed here only: this
    process stalled (``stalled_at``) or refuted a suspicion of itself (``refuted_at``) since
    the operation began, or the operation took longer than a probe interval after this
    member's share was handed over. The others, seeing this member hang, may have abandoned
    the view meanwhile (their abandoned communicators still finish the exchange): the member
    learns what they did before it counts the operation."""
    return now - contributed_at > probe_interval or stalled_at >= op_began or refuted_at >= op_began


def view_lineage(view: "View") -> int:
    """A view as a state's lineage (see reconcile_source): 62 bits of its digest."""
    return int(view.digest, 16) >> 2


def reconcile_source(states: list[tuple]) -> int | None:
    """The rank whose state every member of a new view takes, from each rank's (step, state
    digest[, fingerprint[, lineage]]): a holder of the newest step. Of the lineage of the
    lowest-ranked holder (the view in which its state was committed; holders of one step
    from two lineages, such as two sides of a partition, differ by design, and the lowest
    rank's lineage wins as it always has), one of the fingerprint most of that lineage's
    holders share: within one lineage the states must be equal, so one that went wrong
    without failing (see ftcomm.runtime.fingerprints) never wins by its holder's rank; the
    digests cannot tell, for they cover buffers that differ by rank. The lowest rank among
    equals. A fingerprint or lineage below 0 is none. None when all hold the same state."""
    if len({state[:2] for state in states}) <= 1:
        return None
    top = max(state[0] for state in states)
    holders = [(rank, *(tuple(state[2:4]) + (-1, -1))[:2]) for rank, state in enumerate(states) if state[0] == top]
    lineage = holders[0][2]
    holders = [h for h in holders if h[2] == lineage]
    tally: dict[int, int] = {}
    for _, fingerprint, _ in holders:
        if fingerprint >= 0:
            tally[fingerprint] = tally.get(fingerprint, 0) + 1
    if not tally:
        return holders[0][0]
    most = max(tally.values())
    return min(rank for rank, fingerprint, _ in holders if tally.get(fingerprint) == most)


def shard_sources(states: list[tuple], shards: int) -> tuple[int, list[int | None]]:
    """Sharded replicas: rank ``r`` of a view holds shard ``r % shards``; ``states`` is each
    rank's (step, state digest[, fingerprint]). Returns the newest step, and for each shard the rank whose
    state that shard's processes take (None: they hold one state already): as
    :func:`reconcile_source` among the shard's processes, the newest state wins. Every
    process of a replica commits a step or none does (``Replica.decide``), so the replicas
    that hold the newest step hold it for every shard, and every process ends on it."""
    sources: list[int | None] = []
    for shard in range(shards):
        source = reconcile_source(states[shard::shards])
        sources.append(None if source is None else shard + source * shards)
    return max(state[0] for state in states), sources


FINGERPRINT_MASK = (1 << 48) - 1  # a state fingerprint's bits (see TrainingState.fingerprint)


class Divergence(NamedTuple):
    """Fingerprints of one step that differ: the positions whose state is not the
    majority's (``named``; every one that gave a fingerprint when no value has a majority),
    how many gave one, and whether a majority agreed (and so which state is right)."""

    named: tuple[int, ...]
    voters: int
    majority: bool


def fingerprint_verdict(fingerprints: Sequence[int | None]) -> Divergence | None:
    """The positions whose state fingerprint differs from the majority's, from each
    position's fingerprint (None: it gave none). None when every fingerprint given is the
    same (or fewer than two were given): nothing to compare, or nothing wrong."""
    votes = {position: f for position, f in enumerate(fingerprints) if f is not None}
    if len(set(votes.values())) <= 1:
        return None
    tally: dict[int, int] = {}
    for f in votes.values():
        tally[f] = tally.get(f, 0) + 1
    top = max(tally, key=lambda f: tally[f])
    if 2 * tally[top] > len(votes):
        return Divergence(tuple(p for p, f in votes.items() if f != top), len(votes), True)
    return Divergence(tuple(votes), len(votes), False)


def step_verdict(contributors: float, joiners: float, world: int, batches_checked: bool) -> tuple[bool, bool]:
    """What a reduced gradient step means, from the two counters reduced with it: how many
    members contributed valid gradients and how many saw a joiner waiting. Returns (commit,
    admit the joiner at this boundary). Nobody's gradients are valid (every member just
    received state), or, with a sampler checking batches (``batches_checked``), some batch
    did not match the plan: committing would lose its samples."""
    commit = contributors >= 1 and not (batches_checked and contributors < world - 0.5)
    return commit, joiners > 0


def classify(faults: list[tuple[str, str]], view_size: int | None, replica_size: int = 1) -> str:
    """Why a view broke, from the faults seen in it, as (kind, member) pairs: leave,
    superseded, crash (a refused connection or a death), partition (half the view or more
    lost at once, more than one member, or sharded replica of ``replica_size`` processes),
    hang (suspected only) or backend (the communicator failed alone)."""
    kinds = {kind for kind, _ in faults}
    lost = {member for kind, member in faults if kind != "superseded"}
    if "left" in kinds:
        return "leave"
    if "superseded" in kinds:
        return "superseded"
    if "crash" in kinds:
        return "crash"
    if len(lost) > replica_size and view_size is not None and 2 * len(lost) >= view_size:
        return "partition"
    if "suspect" in kinds:
        return "hang"
    return "crash" if "dead" in kinds else "backend"


VIEW_REASONS = ("init", "crash", "hang", "leave", "partition", "join", "straggler", "rejoin", "superseded", "backend")
"""Why a view formed, as :func:`reason_for` names it, in the order of their codes: the
members of a view agree on one (rank 0's), reduced with the view's verification."""


def reason_code(reason: str) -> int:
    """``reason``'s code in VIEW_REASONS (an unknown one reads as backend)."""
    return VIEW_REASONS.index(reason) if reason in VIEW_REASONS else VIEW_REASONS.index("backend")


def reason_for(noticed: str, before: tuple[str, ...], after: tuple[str, ...], gossip_states: dict[str, str],
               replica_size: int = 1) -> str:
    """Name a re-formation from ``before`` to ``after`` by what happened to the members it
    dropped (their gossip states, or ``benched`` for a straggler standing aside; one not
    known reads as dead). A partition drops more than one member (sharded replica of
    ``replica_size`` processes) and half the view or more."""
    removed = [m for m in before if m not in after]
    if not removed:
        return "join" if noticed != "init" and len(after) > len(before) else noticed
    kinds = [gossip_states.get(m, "dead") for m in removed]
    if all(k == "left" for k in kinds):
        return "leave"
    if all(k in ("benched", "left") for k in kinds):
        return "straggler"
    if len(removed) > replica_size and 2 * len(removed) >= len(before):
        return "partition"
    if "suspect" in kinds or noticed == "hang":
        return "hang"
    return "crash" if "dead" in kinds else noticed


SETTING_NAMES = ("backend", "min_workers", "max_workers", "partition_policy", "protocol", "replica_size", "sdc_policy",
                 "fingerprint_every")


def settings_conflict(engine: "Engine", settings: tuple, statuses: dict[str, Status]) -> str | None:
    """Why this member must not train with the group, or None: a live member whose settings
    (``SETTING_NAMES``) differ is already active or started first (the newer worker yields)."""
    for status in statuses.values():
        if status.id == engine.id or not status.alive or status.config == engine.config:
            continue
        if status.phase == ACTIVE or status.joined_at < engine.joined_at:
            diffs = [_difference(n, a, b) for n, a, b in zip(SETTING_NAMES, settings, status.settings) if a != b]
            return (f"this worker was started with {'; '.join(diffs) or 'settings differ'} (member {status.id}): "
                    f"start all workers of a group with the same settings")
    return None


def _difference(name: str, ours: object, theirs: object) -> str:
    if name == "protocol":
        return (f"ftcomm group protocol {ours} but the group speaks protocol {theirs} "
                f"(install the same ftcomm version on every worker)")
    return f"{name}={ours!r} but the group uses {name}={theirs!r}"
