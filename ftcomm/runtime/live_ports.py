"""The driver's ports on a real worker: the gossip node, the rendezvous stores, TCP probes,
the system clock (see :mod:`ftcomm.runtime.ports` for what each promises; the communicators port is
:class:`ftcomm.runtime.lifecycle.Lifecycle`, which holds the backend's)."""

from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

from ..core.engine import FETCH_TIMEOUT_S, Engine
from ..core.view import Status, View
from ..gossip import GossipNode
from .ports import Address, Done, MemberRecord
from .rendezvous import Rendezvous, refused_many


class SystemClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class GossipMembership:
    """The membership port over a :class:`~ftcomm.gossip.GossipNode` (attached once started)."""

    def __init__(self, engine: Engine, on_published: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.node: GossipNode | None = None
        self.published_at = float("-inf")  # when this worker's record was last published
        self.on_published = on_published  # on the gossip thread, once the record reads back

    def statuses(self, view: View | None) -> tuple[dict[str, Status], dict[str, Address]]:
        statuses, addresses = {}, {}
        known = view.member_set if view is not None else frozenset()
        for m in self.node.members():
            if not m.confirmed and m.id != self.engine.id and m.id not in known:
                continue
            status = Status.from_metadata(m.id, m.state, m.metadata)
            if status is not None:
                statuses[m.id] = status
                if status.rendezvous_port is not None:
                    addresses[m.id] = (m.host, status.rendezvous_port)
        return statuses, addresses

    def records(self) -> Iterable[MemberRecord]:
        return [MemberRecord(m.id, m.state, m.host, m.port, Status.from_metadata(m.id, m.state, m.metadata))
                for m in self.node.members()]

    def publish(self, record: dict) -> None:
        self.node.set_metadata(record, self.on_published)
        self.published_at = time.monotonic()

    def announce(self, members: Sequence[str]) -> None:
        self.node.announce(list(members))

    def sync(self, member: str) -> None:
        self.node.sync(member)

    def recontact_seeds(self) -> None:
        self.node.recontact_seeds()

    def contact(self, address: Address) -> None:
        self.node.contact(address)

    def probe_now(self, members: Sequence[str]) -> None:
        self.node.probe_now(list(members))

    def declare_dead(self, member: str) -> None:
        self.node.declare_dead(member)

    def exchange(self, members: Sequence[str]) -> Done[bool]:
        return Done(any(self.node.exchange(member) for member in members))  # (stops at the first answer)

    def stalled_at(self) -> float:
        return self.node.last_stall

    def refuted_at(self) -> float:
        return self.node.last_refuted


class StoreProposals:
    """The proposals port over this worker's :class:`~ftcomm.runtime.rendezvous.Rendezvous`."""

    def __init__(self, rendezvous: Rendezvous) -> None:
        self.rendezvous = rendezvous

    def publish(self, view_id: int, digest: str, members: tuple[str, ...]) -> None:
        self.rendezvous.publish_proposal(view_id, digest, members)

    def fetch(self, member: str, address: Address | None, key: tuple[int, str]) -> tuple[str, ...] | None:
        if address is None:
            return None
        return self.rendezvous.fetch_proposal(*address, *key, timeout=FETCH_TIMEOUT_S)


class TcpProber:
    def refused(self, addresses: list[Address], timeout: float, settle: float = 0.0) -> list[bool]:
        out = refused_many(addresses, timeout)
        if settle > 0 and not any(out):
            out = refused_many(addresses, timeout, settle)
        return out
