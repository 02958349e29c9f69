"""The driver's ports in the whole-group simulation (:mod:`ftcomm.groupsim`).

Each implements a port of :mod:`ftcomm.runtime.ports` for one simulated worker over the
simulation's virtual cluster (the gossip simulator, the proposals stored, who crashed,
hangs or is cut off), so that the simulation runs the shipped
:class:`~ftcomm.runtime.driver.Driver`. What they model is described in
:mod:`ftcomm.groupsim`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.engine import FETCH_TIMEOUT_S
from ..core.view import Status, View
from ..gossip.runtime import encode_metadata
from .ports import Address, MemberRecord

if TYPE_CHECKING:
    from ..groupsim import GroupSimulation, Worker

TICK = 0.02  # a simulated driver looks at the membership this often (a worker waits 20 ms)
EXCHANGE_TICKS = 4  # a state exchange takes this many ticks


class SimClock:
    """Virtual time; the wall clock (join times) reads the same."""

    def __init__(self, sim: "GroupSimulation") -> None:
        self.sim = sim

    def now(self) -> float:
        return self.sim.sim.now

    def wall(self) -> float:
        return self.sim.sim.now


class SimMembership:
    """One worker's gossip member in the gossip simulation."""

    def __init__(self, sim: "GroupSimulation", w: Worker) -> None:
        self.sim, self.w = sim, w

    def statuses(self, view: View | None) -> tuple[dict[str, Status], dict[str, Address]]:
        # Members are found by id (see SimProposals.fetch): no addresses are needed.
        return self.sim._statuses(self.w), {}

    @property
    def _protocol(self):
        """This worker's gossip core."""
        return self.sim.sim.nodes[self.w.node].protocol

    def records(self) -> list[MemberRecord]:
        host = self._protocol.address
        return [MemberRecord(member_id, state, *member_host(member_id, host), self.sim._status(member_id, state, meta))
                for member_id, state, meta, _ in self._protocol.member_states()]

    def _send(self, call, *args) -> None:
        """``protocol.call(*args, now)`` on this worker's gossip core, its datagrams sent at once."""
        call(*args, self.sim.sim.now)
        self.sim.sim.flush(self.w.node)

    def publish(self, record: dict) -> None:
        w = self.w
        self._send(self._protocol.set_metadata, encode_metadata(record))
        if w.news is not None:
            w.news.setdefault(w.engine.id, False)

    def announce(self, members) -> None:
        self._send(self._protocol.announce, list(members))

    def sync(self, member: str) -> None:
        self._send(self._protocol.sync_with, member)

    def recontact_seeds(self) -> None:
        """A join request to each worker (its seeds: the workers a joiner may join through)
        that is not a live member in this worker's table."""
        sim, w = self.sim, self.w
        live = {member_id for member_id, state, _, _ in self._protocol.member_states()
                if state in ("alive", "suspect")}
        for x in sim._live():
            if x is not w and x.engine.id not in live:
                sim.sim.join_through(w.node, x.node)

    def contact(self, address: Address) -> None:
        other = self.sim.by_host.get(address[0])
        if other is not None:
            self.sim.sim.join_through(self.w.node, other.node)

    def probe_now(self, members) -> None:
        self._send(self._protocol.probe_now, list(members))

    def declare_dead(self, member: str) -> None:
        self._send(self._protocol.declare_dead, member)

    def exchange(self, members) -> "SimOperation":
        """A state exchange with the first of ``members``, over after a few ticks; answered
        when one of them runs and is reachable."""
        sim, w = self.sim, self.w
        self.sync(members[0])
        until = sim.sim.now + EXCHANGE_TICKS * TICK
        answers = [sim.by_id[m] for m in members if m in sim.by_id]
        return SimOperation(lambda: None if sim.sim.now < until else any(
            not (x.crashed or x.hung or x.gone or sim._cut_off(w, x)) for x in answers))

    def stalled_at(self) -> float:
        return self.w.resumed_at

    def refuted_at(self) -> float:
        return self._protocol.last_refuted


class SimProposals:
    """The rendezvous stores: a proposal is readable while its owner runs and is reachable;
    a read from one that crashed, hangs or is cut off answers nothing, and the reader's
    driver waits ``FETCH_TIMEOUT_S`` for it (the worst case: a connection opened before the
    owner died does not notice its death)."""

    def __init__(self, sim: "GroupSimulation", w: Worker) -> None:
        self.sim, self.w = sim, w

    def publish(self, view_id: int, digest: str, members: tuple[str, ...]) -> None:
        self.sim.store[(self.w.node, (view_id, digest))] = members

    def fetch(self, member: str, address: Address | None, key: tuple[int, str]) -> tuple[str, ...] | None:
        sim, w = self.sim, self.w
        owner = sim.by_id.get(member)
        if owner is not None and not (owner.crashed or owner.hung or sim._cut_off(w, owner)):
            return sim.store.get((owner.node, key))
        w.busy_until = max(w.busy_until, sim.sim.now + FETCH_TIMEOUT_S)
        return None


class SimProber:
    """A connection to a worker's port is refused when its process is gone (crashed, or left
    and exited) and its node is reachable; a hung one, or one cut off, answers nothing, and
    the prober's driver waits ``timeout`` for it."""

    def __init__(self, sim: "GroupSimulation", w: Worker) -> None:
        self.sim, self.w = sim, w

    def refused(self, addresses: list[Address], timeout: float, settle: float = 0.0) -> list[bool]:
        sim, w = self.sim, self.w
        out, silent = [], False
        for host, _ in addresses:
            other = sim.by_host.get(host)
            reachable = other is not None and not sim._cut_off(w, other)
            out.append(reachable and (other.crashed or other.gone))
            silent = silent or not reachable or other.hung
        wait = timeout if silent else 0.0
        if settle > 0 and not any(out):
            wait += settle  # those that accepted are tried again
        w.busy_until = max(w.busy_until, sim.sim.now + wait)
        return out


class SimCommunicators:
    """A view's communicator: it forms once every member entered its formation and every
    pair of members can reach each other, within ``formation_timeout``; reconciling gathers
    every member's (step, state digest) and all adopt the most advanced. Either fails when
    the view's abort signal fires, or a member crashed (a connection error: the driver's
    crash fast path probes it), and forming when it times out."""

    def __init__(self, sim: "GroupSimulation", w: Worker) -> None:
        self.sim, self.w = sim, w

    def form(self, view: View) -> "SimOperation":
        sim, w = self.sim, self.w
        w.entered = sim.sim.now
        sim.formations.setdefault((view.id, view.digest), {})[w.engine.id] = sim.sim.now
        return SimOperation(lambda: sim._formed(w, view))

    def reconcile(self, view: View) -> "SimOperation":
        return SimOperation(lambda: self.sim._reconciled(self.w, view))

    def abandon(self) -> None:
        self.sim._abandon(self.w)


class SimOperation:
    """A pending operation of the simulated communicator (see ftcomm.runtime.ports.Pending)."""

    def __init__(self, poll) -> None:
        self.poll = poll


def member_host(member_id: str, fallback: tuple[str, int]) -> tuple[str, int]:
    """The gossip host and port a simulated member's id names (``HOST:PORT/nonce``)."""
    host, _, rest = member_id.partition(":")
    port = rest.partition("/")[0]
    return (host, int(port)) if port.isdigit() else fallback
