"""The driver: one member's engine fed with what it observes, its actions performed through ports.

:class:`Driver` is the one place where the engine core's actions (:mod:`ftcomm.engine`)
are carried out: a look at the membership (:meth:`Driver.look`), each action through the
ports (:mod:`ftcomm.ports`), and the probes that show a group gone. A worker runs it over
live ports (the gossip node, the rendezvous store, TCP probes: :mod:`ftcomm.lifecycle`);
the whole-group simulation runs the same driver over simulated ones
(:mod:`ftcomm.groupsim`), so the seeds exercise the code that ships.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import statistics
from typing import Callable, Iterable, NamedTuple

from . import engine as core
from .engine import Action, Announce, Engine, Fetch, Form, ProbeGroup, Publish, PublishProposal, Rejoined, Sync
from .errors import ConfigMismatch
from .gossip.addresses import parse_address
from .ports import Address, Ports
from .view import Status, View

log = logging.getLogger(__name__)

STALL_FACTOR = 4.0
"""A collective waiting this many times its recent median wait (and ``stall_probe_after``)
has the members it waits on probed at once."""
STALL_WINDOW = 20


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


class Look(NamedTuple):
    """What one look at the membership came to: the view to form now (None: none yet), and
    whether a proposal was fetched (the next look is due at once)."""

    form: View | None
    fetched: bool


class Driver:
    """Performs one member's engine actions through ``ports``. ``facts()``: the member's
    committed step, the group operations it completed in its current view and its median
    compute time, which its status record carries. ``notice(text)``: told what the member
    does that an operator wants to know (it rejoins the group); a warning in the log unless
    given."""

    def __init__(self, engine: Engine, ports: Ports,
                 facts: Callable[[], tuple[int, int, float | None]] = lambda: (0, 0, None),
                 notice: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.ports = ports
        self.facts = facts
        self.notice = notice or (lambda text: log.warning("%s", text))
        self._waits: collections.deque[float] = collections.deque(maxlen=STALL_WINDOW)  # recent operations' waits
        self._stall_probed = float("-inf")  # when the view's members were last probed on demand

    def statuses(self) -> tuple[dict[str, Status], dict[str, Address]]:
        return self.ports.membership.statuses(self.engine.view)

    def record(self) -> dict:
        """This member's status record, as gossip metadata."""
        return self.engine.record(*self.facts()).encode()

    def publish(self) -> None:
        self.ports.membership.publish(self.record())

    def look(self) -> Look:
        """One look at the membership while the engine is agreeing: every action but
        forming is performed here; the view to form comes back. Raises ConfigMismatch when
        a live member of the group was started with other settings."""
        engine = self.engine
        statuses, addresses = self.statuses()
        conflict = core.settings_conflict(engine, engine.settings, statuses)
        if conflict is not None:
            raise ConfigMismatch(conflict)
        actions = engine.agree(self.ports.clock.now(), statuses)
        form = actions.pop().view if actions and isinstance(actions[-1], Form) else None
        self.perform(actions, addresses)
        return Look(form, any(isinstance(a, Fetch) for a in actions))

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
            elif isinstance(action, ProbeGroup):
                ports.membership.recontact_seeds()
                engine.group_probed(action.members is not None and self.group_gone(action.members))
            elif isinstance(action, Rejoined):
                self.notice(f"{engine.id} rejoins the group as a new member: {action.why}")
                engine.joined_at = ports.clock.wall()
            else:
                raise core.IllegalTransition(f"the driver cannot perform {action!r} here")

    def operation_waited(self, seconds: float) -> None:
        """An operation completed ``seconds`` after this member handed its share over."""
        self._waits.append(seconds)

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
        typical = STALL_FACTOR * statistics.median(self._waits) if self._waits else 0.0
        if now - contributed_at < max(probe_after, typical) or now - self._stall_probed < probe_interval:
            return
        self._stall_probed = now
        self.ports.membership.probe_now([m for m in view.members if m != self.engine.id])

    def group_gone(self, members: Iterable[str]) -> bool:
        """Whether every worker of this job that held a view and has not left refuses
        connections: those in the gossip table (answered or not) at their rendezvous port,
        ``members`` it has no record of at the gossip port their id names (and those that do
        not refuse get a join request: they may be alive and never told of this worker).
        Refused: the process is gone. One that does not answer may be across a partition
        (see Engine._may_found)."""
        engine, membership = self.engine, self.ports.membership
        targets, listed = [], set()
        for record in membership.records():
            listed.add(record.id)
            status = record.status
            if record.id == engine.id or status is None or status.left or status.config != engine.config \
                    or status.last_view == 0:
                continue
            targets.append((record.host, status.rendezvous_port if status.rendezvous_port is not None
                            else record.port))
        unlisted = list(dict.fromkeys(a for a in (member_address(m) for m in members if m not in listed)
                                      if a is not None))
        refused = self.ports.prober.refused(targets + unlisted, core.PROBE_TIMEOUT_S)
        for address, gone in zip(unlisted, refused[len(targets):]):
            if not gone:
                membership.contact(address)  # it may be alive: gossip never told it about this worker
        return all(refused)
