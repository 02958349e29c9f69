"""Ports: what the group driver needs from the world, as interfaces it calls.

The driver (:mod:`ftcomm.runtime.driver`) performs the engine's actions and touches the world only
through these. Production implements them with the gossip node, the rendezvous store, TCP
connection probes (:mod:`ftcomm.runtime.live_ports`) and the backend's communicators
(:class:`ftcomm.runtime.lifecycle.Lifecycle`); the whole-group simulation (:mod:`ftcomm.groupsim`)
implements them over its virtual cluster, so that it runs the driver that ships. Each
method says what it does when a peer is gone; a peer's failure is reported only by a
:class:`Pending` operation (the view it belongs to is broken). Starting one may still
raise for this worker's own reasons (it was shut down, its backend failed).
"""

from __future__ import annotations

from typing import Generic, Iterable, NamedTuple, Protocol, Sequence, TypeVar

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


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds (all deadlines)."""

    def wall(self) -> float:
        """Seconds since the epoch (a worker's join time, which its peers compare)."""


class Membership(Protocol):
    """The gossip layer. Nothing here blocks: messages go out in the background."""

    def statuses(self, view: View | None) -> tuple[dict[str, Status], dict[str, Address]]:
        """Every member's status record, and rendezvous address, as the local table shows
        them. A member that never answered this worker directly is left out unless it is in
        ``view``: an alive record alone may be forged, and a phantom in a candidate view
        would hold up agreement."""

    def records(self) -> Iterable[MemberRecord]:
        """Every member of the local table, answered or not."""

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

    def exchange(self, members: Sequence[str]) -> "Pending[bool]":
        """Exchange full state with the first of ``members`` that answers (tried in order,
        each for a probe timeout); whether any answered. What the exchange brought is posted
        as news."""

    def stalled_at(self) -> float:
        """When this member's process was last found stalled (its gossip fell behind)."""

    def refuted_at(self) -> float:
        """When this member last refuted a suspicion of itself."""


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


class Pending(Protocol, Generic[T]):
    """An operation under way on the view's communicator."""

    def poll(self) -> T | None:
        """Its result once it completed, None while it is under way. Raises
        MembershipChanged when the view broke meanwhile (a member failed, or gossip news
        fired the view's abort signal), FtcommTimeout when it did not complete in time."""


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


class Communicators(Protocol):
    """The view's communicator, from forming it to abandoning it."""

    def form(self, view: View) -> Pending[Formed]:
        """Form and verify the communicator of ``view`` (this member entered its formation)."""

    def reconcile(self, view: View) -> Pending[Reconciled]:
        """Make every member's registered state identical over the formed communicator."""

    def abandon(self) -> None:
        """Drop the current communicator, if any (a member still inside it gets an error)."""


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
