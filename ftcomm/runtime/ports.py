"""Ports: everything one worker does to the world, as interfaces the worker loop calls.

The worker loop (:mod:`ftcomm.runtime.worker`) and the driver under it
(:mod:`ftcomm.runtime.driver`) touch the world only through these. A real worker implements
them with the gossip node, the rendezvous stores, TCP probes, the backend's communicators
and the registered training state (:mod:`ftcomm.runtime.live_ports`); the whole-group
simulation (:mod:`ftcomm.sim`) implements them over its virtual cluster, so that every seed
runs the loop that ships.

The loop is a set of coroutines (generators): where it has to wait it yields a
:class:`Pending` operation, or a :class:`Pause`, and gets the result back (or the
operation's exception thrown in). A worker process runs them with
:func:`ftcomm.runtime.live_ports.run`, which blocks on each; the simulation resumes them
tick by tick in virtual time. Each method says what it does when a peer is gone; a peer's
failure is reported only by a :class:`Pending` operation (the view it belongs to is
broken). Starting one may still raise for this worker's own reasons (it was shut down, its
backend failed).
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterable, NamedTuple, Protocol, Sequence, TypeVar

from ..core.view import Status, View

Address = tuple[str, int]
T = TypeVar("T", covariant=True)


class MemberRecord(NamedTuple):
    """One member as the local gossip table holds it."""

    id: str
    state: str  # alive | suspect | dead | left
    host: str
    port: int  # its gossip port
    status: Status | None  # its decoded status record (None: not an ftcomm worker's, or malformed)
    confirmed: bool = True  # it answered this member directly (see readable)


class Pause(NamedTuple):
    """Yielded by the worker loop when nothing is due until news arrives or ``seconds``
    pass (0: let the world move first); ``news`` False: news does not end it. It may end
    early; the loop looks again."""

    seconds: float
    news: bool = True


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds (all deadlines)."""

    def wall(self) -> float:
        """Seconds since the epoch (a worker's join time, which its peers compare)."""


class _UnderWay:
    def __repr__(self) -> str:
        return "UNDER_WAY"


UNDER_WAY: Any = _UnderWay()
"""What :meth:`Pending.poll` returns while the operation is under way (a result may be None)."""


class Pending(Protocol, Generic[T]):
    """An operation under way (on the view's communicator, or a state exchange)."""

    def poll(self) -> T:
        """Its result once it completed, :data:`UNDER_WAY` while it is under way. Raises
        MembershipChanged when the view broke meanwhile (a member failed, or gossip news
        fired the view's abort signal), FtcommTimeout when it did not complete in time."""


class Membership(Protocol):
    """The gossip layer. Nothing here blocks but :meth:`exchange`'s result: messages go
    out in the background."""

    def statuses(self, view: View | None) -> tuple[dict[str, Status], dict[str, Address]]:
        """Every member's status record, and rendezvous address, as the local table shows
        them. A member that never answered this worker directly is left out unless it is in
        ``view``: an alive record alone may be forged, and a phantom in a candidate view
        would hold up agreement (see :func:`readable`)."""

    def records(self) -> Iterable[MemberRecord]:
        """Every member of the local table, answered or not."""

    def table(self) -> Iterable[tuple[str, str, Any]]:
        """Every member's (id, gossip state, metadata) as the table holds it (read when news
        was dropped)."""

    def decode(self, member_id: str, state: str, metadata: Any) -> Status | None:
        """A member's status record from what the table holds."""

    def probe_interval(self) -> float:
        """The gossip layer's probe interval (seconds)."""

    def seeds(self) -> list[Address]:
        """The gossip addresses of the seeds this worker was started with (its own left out)."""

    def publish(self, record: dict) -> None:
        """Make ``record`` this member's status record (gossiped to every member)."""

    def announce(self, members: Sequence[str]) -> None:
        """Send this member's record directly to ``members`` (one datagram each; lost ones
        are repaired by gossip)."""

    def sync(self, member: str) -> None:
        """Exchange full state with ``member`` now (nothing happens if it does not answer)."""

    def recontact_seeds(self) -> None:
        """Send a join request to each seed that is not a live member of the local table."""

    def contact(self, address: Address) -> None:
        """Send a join request to the gossip port at ``address``."""

    def probe_now(self, members: Sequence[str]) -> None:
        """Probe ``members`` at once, directly and through helpers; one that does not answer
        is suspected a probe timeout later (the regular suspicion then spreads)."""

    def declare_dead(self, member: str) -> None:
        """Mark ``member`` dead now and tell the others (its process was found gone)."""

    def exchange(self, members: Sequence[str], timeout: float | None = None) -> "Pending[bool]":
        """Exchange full state with the first of ``members`` that answers (tried in order,
        each for ``timeout``, default a probe timeout); whether any answered. What the
        exchange brought is posted as news."""

    def stalled_at(self) -> float:
        """When this member's process was last found stalled (its gossip fell behind)."""

    def refuted_at(self) -> float:
        """When this member last refuted a suspicion of itself."""

    def leave(self) -> None:
        """Announce this member's graceful departure (the others see *left*)."""

    def propagate_time(self) -> float:
        """How long a departure notice takes to spread (the gossip layer stays up at least
        this long after :meth:`leave`)."""

    def stop(self) -> None:
        """Stop the gossip layer (after :meth:`leave`); nothing is announced."""


class Proposals(Protocol):
    """The rendezvous stores where members keep the member lists of their proposals."""

    def publish(self, view_id: int, digest: str, members: tuple[str, ...]) -> None:
        """Store this member's proposal on its own store."""

    def fetch(self, member: str, address: Address | None, key: tuple[int, str]) -> tuple[str, ...] | None:
        """The member list ``member`` stored for proposal ``key`` at ``address``; None when it
        is not stored there (yet), or the store does not answer within
        :data:`ftcomm.core.engine.FETCH_TIMEOUT_S` (its worker died or is cut off since)."""


class Prober(Protocol):
    def refused(self, addresses: list[Address], timeout: float, settle: float = 0.0) -> list[bool]:
        """For each address, whether a TCP connection to it is refused: its process is gone
        and its host answers. A host that is lost or cut off answers nothing: False after
        ``timeout``. ``settle``: when none is refused at first, those that accepted are tried
        again for this long (a crashed process closes its sockets one by one)."""


class Formed(NamedTuple):
    """A verified communicator: whether every member founds the group (its first view, and
    the network check is wanted), and whether no member has begun training."""

    founding: bool
    restorable: bool


class Reconciled(NamedTuple):
    """Reconciling a formed view: whether this member's state was replaced by another's,
    and the digest every member holds now; ``deferred``: no state is registered yet, so
    it is reconciled before the first collective instead."""

    replaced: bool
    digest: int | None
    deferred: bool = False


class StateSummary(NamedTuple):
    """What a member shows of its registered state when a view reconciles."""

    step: int
    digest: int
    signature: int  # the model's parameter names, shapes and dtypes
    fingerprint: int = -1  # its parameters' and optimizer state's (fingerprint_every; -1: none)
    lineage: int = -1  # the view in which the state was committed or handed on (view_lineage; -1: unknown)


class Communicators(Protocol):
    """The view's communicators, from forming them to abandoning them. Every operation runs
    on the communicator of the view being formed or run, and fails (MembershipChanged)
    when its abort signal fires or a member's connection breaks."""

    def form(self, view: View) -> Pending[None]:
        """Form the communicator of ``view`` (this member entered its formation), through
        its rank 0's rendezvous store; FtcommTimeout after ``formation_timeout``."""

    def verify(self, probe: list[int]) -> Pending[list[int]]:
        """The element-wise minimum of every member's ``probe`` (a few integers) over the
        communicator just formed; FtcommTimeout after ``formation_timeout``."""

    def form_shard(self, view: View) -> Pending[None]:
        """With sharded replicas of K processes: form the communicator of this process's
        shard index in ``view`` (ranks ``r % K``, one process of each replica)."""

    def gather_states(self, mine: StateSummary) -> Pending[list[StateSummary]]:
        """Every member's summary, in rank order."""

    def mismatch(self, gathered: list[StateSummary], shards: int) -> Pending[None]:
        """The members registered different models: every member exchanges their
        descriptions and raises ConfigMismatch naming the first tensor that differs."""

    def transfer(self, view: View, source: int, load: bool, step: int) -> Pending[int | None]:
        """Rank ``source``'s registered state (of the shard communicator with sharded
        replicas) to every member, each taking part; one with ``load`` replaces its state
        with it: the step it holds then, else None. CommunicatorError for a state that fails
        authentication or cannot be the model's."""

    def attach(self, abort: Callable[[], Any]) -> None:
        """The abort signal of the view formed or run (the loop's, renewed with each view)."""

    def abandon(self) -> None:
        """Drop the current communicators, if any (a member still inside one gets an error)."""


class Contribution(NamedTuple):
    """What one member adds to a gradient step's counters: its gradients count (``valid``),
    it sees a worker waiting to join (``join``), it asks to stand aside as a straggler
    (``aside``: its rank, or None), and, in a step that compares fingerprints, its state's
    (``fingerprint``, 48 bits; ``position`` its place among the members the counters are
    reduced over: its rank, or its replica's index with sharded replicas)."""

    valid: bool
    join: bool
    aside: int | None
    fingerprint: int | None = None
    position: int = 0


class Counters(NamedTuple):
    """A gradient step's counters, reduced: how many members' gradients count, how many saw
    a joiner waiting, the ranks asking to stand aside, and each position's state
    fingerprint (None: it gave none; the same on every member). ``actions``: with sharded
    replicas, how many shard indices' fingerprints ask for a repair, for the step to be
    computed again, and for every member to stop (summed over the view; see
    ftcomm.runtime.fingerprints.ACTIONS)."""

    contributors: float
    joiners: float
    asking: tuple[int, ...]
    fingerprints: tuple[int | None, ...] = ()
    actions: tuple[int, int, int] = (0, 0, 0)


class Collective(Protocol):
    """The view's collectives as the training loop runs them: gradient steps (whose
    reduction may begin during backward) and the user's own collectives.

    ``contribution`` and ``may_overlap`` are the loop's (:meth:`attach`): a reduction that
    starts early (overlap) asks for this member's counters when its last bucket launches."""

    def attach(self, contribution: Callable[[bool], Contribution], may_overlap: Callable[[], bool]) -> None:
        """The loop's counters (asked with whether the gradients are valid) and whether
        backward may start reducing now."""

    def no_sync(self) -> Any:
        """A context manager: backward passes inside start no reduction."""

    @property
    def touched(self) -> bool:
        """Backward already began reducing this step."""

    @property
    def lost(self) -> bool:
        """This step's reduction was dropped (:meth:`drop`) after backward began it: this
        member's gradients of the step are gone (until :meth:`discard` ends it; the loop
        then reduces the step with them counted as none)."""

    def reduce(self, valid: bool) -> Pending[Counters]:
        """Finish and wait for this step's reduction (over the shard communicator with
        sharded replicas); ``valid`` False: this member's gradients count as zero (computed
        on state that was just replaced)."""

    def view_sum(self, values: list[float]) -> Pending[list[float]]:
        """The sum of every member's ``values`` over the whole view's communicator."""

    def replica_decide(self, key: tuple, vote: bool) -> Pending[bool]:
        """Whether every process of this sharded replica votes yes on decision ``key`` (a
        step commits): the same answer on each process
        that asks (a write-once slot per process; a slot given up on, when the view's abort
        signal fires or after ``formation_timeout``, holds a veto). ReplicaLost when the
        replica's store is gone."""

    def hand_back(self, contributors: float) -> None:
        """The step commits: the averaged gradients go to the parameters."""

    def discard(self) -> None:
        """The step does not commit: the reduction's buffers are dropped."""

    def drop(self) -> None:
        """The view re-forms inside a step that backward began reducing: this member's
        share of the step is lost (:attr:`lost`)."""

    def run(self, operation: Any) -> Pending[Any]:
        """One of the user's collectives on the view's communicator (``operation`` starts it
        and returns its handle)."""


class TrainingState(Protocol):
    """The registered training state, as the loop needs it (see ftcomm.training.state)."""

    @property
    def registered(self) -> bool:
        """Anything is registered (until then a view's reconcile is deferred)."""

    def digest(self, step: int) -> int:
        """A digest of the state and ``step``, equal on members holding equal state."""

    def signature(self) -> int:
        """A digest of the model's parameter names, shapes and dtypes."""

    def fingerprint(self) -> int:
        """A 48-bit fingerprint of the state's tensors, equal on members holding equal ones."""

    def tensor_fingerprints(self) -> dict[str, int]:
        """Each tensor's share of the fingerprint, by path (to name the tensors that differ)."""

    def participants(self, hook: str) -> list[Any]:
        """Registered objects that follow the steps through ``hook`` (check_step,
        batch_valid, step_ended, view_changed)."""


class Done(Generic[T]):
    """An operation that completed when it was started (a blocking port's)."""

    def __init__(self, value: T) -> None:
        self.value = value

    def poll(self) -> T:
        return self.value


class Failed:
    """An operation that failed when it was started (a blocking port's)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def poll(self) -> None:
        raise self.error


class Ports(NamedTuple):
    clock: Clock
    membership: Membership
    proposals: Proposals
    prober: Prober
    communicators: Communicators
    collective: Collective
    state: TrainingState


def readable(member_id: str, confirmed: bool, own: str, view: View | None) -> bool:
    """Whether a member's record counts when a worker reads its table: it answered this
    worker directly (``confirmed``), or it is this worker, or a member of ``view``."""
    return confirmed or member_id == own or (view is not None and member_id in view.member_set)
