"""The worker loop's ports in the whole-group simulation.

Each class implements a port of :mod:`ftcomm.runtime.ports` for one simulated worker over
the simulated world (:class:`ftcomm.sim.world.GroupSimulation`: the gossip simulator, the
proposals stored, the collectives in flight, who crashed, hangs or is cut off), so that
the simulation runs the shipped :class:`~ftcomm.runtime.worker.WorkerLoop`. They model;
they decide nothing a worker decides. What they model is described in :mod:`ftcomm.sim`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from ..core.engine import FETCH_TIMEOUT_S, FINGERPRINT_MASK
from ..core.view import Status, View
from ..errors import FtcommError
from ..gossip.config import recontact_targets
from ..gossip.runtime import encode_metadata
from ..runtime.ports import UNDER_WAY, Address, Contribution, Counters, MemberRecord, StateSummary

if TYPE_CHECKING:
    from .world import GroupSimulation, Worker

TICK = 0.02  # the simulation resumes every worker this often (a waiting worker wakes every 20 ms)
EXCHANGE_TICKS = 4  # a state exchange takes this many ticks
FORM_LATENCY = 0.01  # a communicator forms this long after its last member entered
OP_LATENCY = 0.002  # a member observes a collective this long after its last member contributed


class SimOperation:
    """A pending operation in the simulated world (see ftcomm.runtime.ports.Pending)."""

    def __init__(self, poll: Callable[[], Any]) -> None:
        self.poll = poll


class SimClock:
    """Virtual time; the wall clock (join times) reads the same."""

    def __init__(self, world: "GroupSimulation") -> None:
        self.world = world

    def now(self) -> float:
        return self.world.sim.now

    def wall(self) -> float:
        return self.world.sim.now


class SimMembership:
    """One worker's gossip member in the gossip simulation."""

    def __init__(self, world: "GroupSimulation", w: "Worker") -> None:
        self.world, self.w = world, w

    @property
    def _protocol(self):
        """This worker's gossip core."""
        return self.world.sim.nodes[self.w.node].protocol

    def statuses(self, view: View | None) -> tuple[dict[str, Status], dict[str, Address]]:
        # Members are found by id (see SimProposals.fetch): no addresses are needed.
        return self.world.statuses(self.w), {}

    def records(self) -> list[MemberRecord]:
        host = self._protocol.address
        return [MemberRecord(member_id, state, *member_host(member_id, host), self.world.status(member_id, state, meta),
                             confirmed) for member_id, state, meta, confirmed in self._protocol.member_states()]

    def table(self) -> Iterable[tuple[str, str, Any]]:
        return [(m, state, meta) for m, state, meta, _ in self._protocol.member_states()]

    def decode(self, member_id: str, state: str, metadata: Any) -> Status | None:
        return self.world.status(member_id, state, metadata)

    def probe_interval(self) -> float:
        return self.world.config.probe_interval

    def seeds(self) -> list[Address]:
        return [member_host(self.world.sim.member_id(node), ("", 0)) for node in self.w.seeds]

    def _send(self, call, *args) -> None:
        """``protocol.call(*args, now)`` on this worker's gossip core, its datagrams sent at once."""
        call(*args, self.world.sim.now)
        self.world.sim.flush(self.w.node)

    def publish(self, record: dict) -> None:
        w = self.w
        self._send(self._protocol.set_metadata, encode_metadata(record))
        if w.news is not None:
            w.news.setdefault(w.id, False)

    def announce(self, members) -> None:
        self._send(self._protocol.announce, list(members))

    def sync(self, member: str) -> None:
        self._send(self._protocol.sync_with, member)

    def recontact_seeds(self) -> None:
        """A join request to a few workers (RECONTACT_FANOUT, at random; the workers are its
        seeds: those a joiner may join through) that are not live members in this worker's
        table, as the gossip node's recontact_seeds does."""
        world, w = self.world, self.w
        live = {member_id for member_id, state, _, _ in self._protocol.member_states()
                if state in ("alive", "suspect")}
        unknown = [x for x in world.live() if x is not w and x.id not in live]
        for x in recontact_targets(unknown, world.recontact_rng):
            world.sim.join_through(w.node, x.node)

    def contact(self, address: Address) -> None:
        other = self.world.by_host.get(address[0])
        if other is not None:
            self.world.sim.join_through(self.w.node, other.node)

    def probe_now(self, members) -> None:
        self._send(self._protocol.probe_now, list(members))

    def declare_dead(self, member: str) -> None:
        self._send(self._protocol.declare_dead, member)

    def exchange(self, members, timeout: float | None = None) -> SimOperation:
        """A state exchange with the first of ``members``, over after a few ticks; answered
        when one of them runs and is reachable."""
        world, w = self.world, self.w
        self.sync(members[0])
        until = world.sim.now + EXCHANGE_TICKS * TICK
        answers = [world.by_id[m] for m in members if m in world.by_id]
        return SimOperation(lambda: UNDER_WAY if world.sim.now < until else any(
            not (x.crashed or x.hung or x.exited or world.cut_off(w, x)) for x in answers))

    def stalled_at(self) -> float:
        return self.w.resumed_at

    def refuted_at(self) -> float:
        return self._protocol.last_refuted

    def leave(self) -> None:
        self._send(self._protocol.leave)

    def propagate_time(self) -> float:
        return self.world.config.leave_propagate_time

    def stop(self) -> None:
        self.world.sim.nodes[self.w.node].crashed = True  # its gossip thread ends: nothing more is sent


class SimProposals:
    """The rendezvous stores: a proposal is readable while its owner runs and is reachable;
    a read from one that crashed, hangs or is cut off answers nothing, and the reader waits
    ``FETCH_TIMEOUT_S`` for it (the worst case: a connection opened before the owner died
    does not notice its death)."""

    def __init__(self, world: "GroupSimulation", w: "Worker") -> None:
        self.world, self.w = world, w

    def publish(self, view_id: int, digest: str, members: tuple[str, ...]) -> None:
        self.world.store[(self.w.node, (view_id, digest))] = members

    def fetch(self, member: str, address: Address | None, key: tuple[int, str]) -> tuple[str, ...] | None:
        world, w = self.world, self.w
        owner = world.by_id.get(member)
        if owner is not None and not (owner.crashed or owner.exited or owner.hung or world.cut_off(w, owner)):
            return world.store.get((owner.node, key))
        w.busy_until = max(w.busy_until, world.sim.now + FETCH_TIMEOUT_S)
        return None


class SimProber:
    """A connection to a worker's port is refused when its process is gone (crashed, or
    exited) and its node is reachable; a hung one, or one cut off, answers nothing, and the
    prober waits ``timeout`` for it."""

    def __init__(self, world: "GroupSimulation", w: "Worker") -> None:
        self.world, self.w = world, w

    def refused(self, addresses: list[Address], timeout: float, settle: float = 0.0) -> list[bool]:
        world, w = self.world, self.w
        out, silent = [], False
        for host, _ in addresses:
            other = world.by_host.get(host)
            reachable = other is not None and not world.cut_off(w, other)
            out.append(reachable and (other.crashed or other.exited))
            silent = silent or not reachable or other.hung
        wait = timeout if silent else 0.0
        if settle > 0 and not any(out):
            wait += settle  # those that accepted are tried again
        w.busy_until = max(w.busy_until, world.sim.now + wait)
        return out


class SimState:
    """A simulated worker's registered training state: a digest that each commit advances
    (``value``), the same on members that hold the same state; ``registered`` once its
    script registered it (a joiner that builds its model after ``init`` registers late)."""

    def __init__(self, value: int, registered: bool = True) -> None:
        self.value = value
        self.registered = registered

    def digest(self, step: int) -> int:
        return self.value

    def signature(self) -> int:
        return 0  # every worker trains the same model

    def fingerprint(self) -> int:
        return self.value & FINGERPRINT_MASK

    def tensor_fingerprints(self) -> dict[str, int]:
        return {"state": self.value}

    def participants(self, hook: str) -> list[Any]:
        return []


class SimCommunicators:
    """A worker's communicators in the simulated world: a view's communicator forms once
    every member entered its formation and every pair of members can reach each other
    (within ``formation_timeout``); its operations complete once every member contributed
    (see GroupSimulation.collective)."""

    def __init__(self, world: "GroupSimulation", w: "Worker") -> None:
        self.world, self.w = world, w
        self.comm: tuple | None = None  # (view id, digest): the view's communicator
        self.shard: tuple | None = None  # its shard communicator's key, with sharded replicas
        self._seq: dict[tuple, int] = {}  # communicator key -> operations started on it
        self._abort: Callable[[], Any] = lambda: None

    def attach(self, abort: Callable[[], Any]) -> None:
        self._abort = abort

    def abort(self) -> Any:
        """The abort signal of the view formed or run."""
        return self._abort()

    def operation(self, comm: tuple, members: tuple[str, ...], kind: str, payload: Any,
                  combine: Callable[[list], Any], timeout: float | None = None,
                  duration: Callable[[list], float] | None = None) -> SimOperation:
        """The next operation on communicator ``comm`` (its ``members`` in rank order): this
        member's ``payload`` goes in, ``combine`` of every member's comes out (members whose
        operations differ in ``kind`` never complete it); ``duration``: see
        GroupSimulation.collective."""
        seq = self._seq[comm] = self._seq.get(comm, 0) + 1
        return self.world.collective(self.w, (comm, seq), members, kind, payload, combine, self._abort(),
                                     None if timeout is None else self.world.sim.now + timeout, duration)

    def form(self, view: View) -> SimOperation:
        world, w = self.world, self.w
        key = (view.id, view.digest)
        world.formations.setdefault(key, {})[w.id] = world.sim.now
        entered = world.sim.now
        abort = self._abort()

        def poll() -> Any:
            formed = world.formed(w, view, abort, entered)
            if formed is not UNDER_WAY:
                self.comm, self._seq = key, {}
                w.comms.append([key, False])
            return formed
        return SimOperation(poll)

    def verify(self, probe: list[int]) -> SimOperation:
        view = self.w.loop.engine.forming
        return self.operation(self.comm, view.members, "verify", probe, lambda all_: [min(v) for v in zip(*all_)],
                              self.world.formation_timeout)

    def form_shard(self, view: View) -> SimOperation:
        k = self.w.loop.engine.replica_size
        shard = view.rank_of(self.w.id) % k
        self.shard = (*self.comm, shard)
        return self.operation(self.shard, view.members[shard::k], "form shard", None, lambda all_: view,
                              self.world.formation_timeout)

    def gather_states(self, mine: StateSummary) -> SimOperation:
        return self.operation(self.comm, self.w.loop.engine.view.members, "gather states", mine, list)

    def mismatch(self, gathered: list[StateSummary], shards: int) -> SimOperation:
        raise AssertionError("simulated workers train one model")

    def transfer(self, view: View, source: int, load: bool, step: int) -> SimOperation:
        w, k = self.w, self.w.loop.engine.replica_size
        comm, members = (self.comm, view.members) if k == 1 else (self.shard, view.members[self.shard[2]::k])
        # The state is sent when some member's differs (GroupSimulation.transfer_s: the model's size).
        cost = self.world.transfer_s
        inner = self.operation(comm, members, "transfer", (step, w.state.value), lambda all_: all_[source],
                               duration=lambda all_: cost if len(set(all_)) > 1 else 0.0)

        def poll() -> Any:
            sent = inner.poll()
            if sent is UNDER_WAY:
                return UNDER_WAY
            if not load:
                return None
            w.state.value = sent[1]
            return sent[0]
        return SimOperation(poll)

    def abandon(self) -> None:
        self.world.abandon(self.w)
        self.comm = self.shard = None


class SimCollective:
    """A worker's gradient steps and collectives in the simulated world: a step's reduction
    sums every member's contribution over the gradient communicator (the shard's with
    sharded replicas) once all contributed. With overlap, backward starts the reduction
    when the loop allows it (``may_overlap``, asked at backward's first gradient) and its
    counters go out when its last bucket launches, at the end of backward, as
    :class:`~ftcomm.training.buckets.GradientBuckets` does; the step then reduces what
    backward started."""

    def __init__(self, world: "GroupSimulation", w: "Worker", comms: SimCommunicators) -> None:
        self.world, self.w, self.comms = world, w, comms
        self._contribution: Callable[[bool], Contribution] = lambda valid: Contribution(valid, False, None)
        self._may_overlap: Callable[[], bool] = lambda: False
        self.touched = False  # backward began reducing this step
        self.lost = False
        self._launched: Contribution | None = None  # the counters backward's last bucket carried

    def attach(self, contribution: Callable[[bool], Contribution], may_overlap: Callable[[], bool]) -> None:
        self._contribution, self._may_overlap = contribution, may_overlap

    def no_sync(self) -> Any:
        raise AssertionError("simulated workers do not accumulate")

    @property
    def gradient_comm(self) -> tuple | None:
        """The communicator gradients are averaged over: the view's, or with sharded replicas
        this shard index's."""
        return self.comms.comm if self.w.loop.engine.replica_size == 1 else self.comms.shard

    def backward_began(self) -> None:
        """Backward's first gradient of a step: reducing starts when the loop allows it."""
        if not self.touched and not self.lost and self.gradient_comm is not None and self._may_overlap():
            self.touched = True

    def backward_ended(self) -> None:
        """Backward's last gradient: a step it began reducing launches its last bucket, with
        this member's counters."""
        if self.touched and self._launched is None:
            self._launched = self._contribution(True)

    def reduce(self, valid: bool) -> SimOperation:
        comms, view = self.comms, self.w.loop.engine.view
        k = self.w.loop.engine.replica_size
        if self.touched and not valid:  # as GradientBuckets.finish
            raise FtcommError("a step already being reduced cannot be marked invalid")
        contribution = self._launched if self._launched is not None else self._contribution(valid)
        self.touched, self._launched = True, None  # every bucket launched (until hand_back or discard)
        members = view.members if k == 1 else view.members[comms.shard[2]::k]
        return comms.operation(self.gradient_comm, members, "gradients", contribution, _counters)

    def _new_step(self, lost: bool = False) -> None:
        self.touched, self.lost, self._launched = False, lost, None

    def view_sum(self, values: list[float]) -> SimOperation:
        return self.comms.operation(self.comms.comm, self.w.loop.engine.view.members, "view sum", values,
                                    lambda all_: [sum(v) for v in zip(*all_)])

    def replica_decide(self, key: tuple, vote: bool) -> SimOperation:
        return self.world.replica_decision(self.w, key, vote, self.comms.abort())

    def hand_back(self, contributors: float) -> None:
        self._new_step()

    def discard(self) -> None:
        self._new_step()

    def drop(self) -> None:
        self._new_step(lost=True)

    def run(self, operation: Any) -> SimOperation:
        return self.comms.operation(self.comms.comm, self.w.loop.engine.view.members, str(operation), None,
                                    lambda all_: True)


def _counters(contributions: list[Contribution]) -> Counters:
    fingerprints: list[int | None] = [None] * len(contributions)
    for c in contributions:
        if c.fingerprint is not None and 0 <= c.position < len(contributions):
            fingerprints[c.position] = c.fingerprint
    return Counters(sum(1.0 for c in contributions if c.valid), sum(1.0 for c in contributions if c.join),
                    tuple(sorted(c.aside for c in contributions if c.aside is not None)),
                    tuple(fingerprints) if any(f is not None for f in fingerprints) else ())


def member_host(member_id: str, fallback: tuple[str, int]) -> tuple[str, int]:
    """The gossip host and port a simulated member's id names (``HOST:PORT/nonce``)."""
    host, _, rest = member_id.partition(":")
    port = rest.partition("/")[0]
    return (host, int(port)) if port.isdigit() else fallback
