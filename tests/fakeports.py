"""Ports answered by hand: the world of one worker as a test sets it up (see
ftcomm.runtime.ports). Each operation a port starts is an :class:`Op` the test completes
(``done``) or fails (``fail``); :class:`Phase` steps a phase of the worker loop and hands
the test what it waits on."""

from __future__ import annotations

import dataclasses
from typing import Any

from ftcomm.core.engine import Engine
from ftcomm.core.view import Status
from ftcomm.options import GroupOptions
from ftcomm.runtime.ports import UNDER_WAY, Contribution, Counters, MemberRecord, Pause, Ports
from ftcomm.runtime.stragglers import Stragglers
from ftcomm.runtime.worker import WorkerLoop
from tests.conftest import CFG


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        return 1_000_000.0 + self.t


class FakeMembership:
    def __init__(self, statuses: dict[str, Status], own: str = "") -> None:
        self.shown = statuses  # what its gossip table shows of each member (answered directly)
        self.own = own
        self.unconfirmed: dict[str, Status] = {}  # in the table, not answered directly yet
        self.published: list[dict] = []
        self.announced: list[tuple] = []
        self.synced: list[str] = []
        self.recontacts = 0
        self.contacted: list[tuple] = []
        self.declared: list[str] = []
        self.probed: list[list] = []
        self.exchanged: list[tuple] = []
        self.answers_exchange = True
        self.seed_addresses: list[tuple[str, int]] = []
        self.left = self.stopped = False

    def statuses(self, view):
        return dict(self.shown), {m: ("10.0.0.1", 4000 + i) for i, m in enumerate(self.shown)}

    def records(self):
        rows = [MemberRecord(m, "alive" if s.alive else "dead" if s.dead else "suspect", "10.0.0.1", 7000 + i, s)
                for i, (m, s) in enumerate(self.shown.items())]
        return rows + [MemberRecord(m, "alive", "10.0.0.9", 7000 + i, s, False)
                       for i, (m, s) in enumerate(self.unconfirmed.items())]

    def table(self):
        return []  # (news is posted with its record in these tests: nothing is dropped)

    def decode(self, member_id, state, metadata):
        return Status.from_metadata(member_id, state, metadata)

    def probe_interval(self) -> float:
        return 0.5

    def seeds(self):
        return list(self.seed_addresses)

    def publish(self, record):
        self.published.append(record)
        self.shown[self.own] = Status.from_metadata(self.own, "alive", record)

    def announce(self, members):
        self.announced.append(tuple(members))

    def sync(self, member):
        self.synced.append(member)

    def recontact_seeds(self):
        self.recontacts += 1

    def contact(self, address):
        self.contacted.append(address)

    def probe_now(self, members):
        self.probed.append(list(members))

    def declare_dead(self, member):
        self.declared.append(member)
        self.shown[member] = dataclasses.replace(self.shown[member], alive=False, dead=True)

    def exchange(self, members, timeout=None):
        self.exchanged.append(tuple(members))
        return Op(self.answers_exchange)

    def stalled_at(self) -> float:
        return float("-inf")

    def refuted_at(self) -> float:
        return float("-inf")

    def leave(self):
        self.left = True

    def propagate_time(self) -> float:
        return 0.1

    def stop(self):
        self.stopped = True


class FakeProposals:
    def __init__(self) -> None:
        self.stored: dict = {}
        self.answers: dict = {}  # member -> list it answers (None: no answer)
        self.asked: list = []

    def publish(self, view_id, digest, members):
        self.stored[(view_id, digest)] = members

    def fetch(self, member, address, key):
        self.asked.append((member, address, key))
        return self.answers.get(member)


class FakeProber:
    def __init__(self, answers: dict | None = None) -> None:
        self.answers = answers or {}
        self.probed: list = []

    def refused(self, addresses, timeout, settle=0.0):
        self.probed.append((list(addresses), settle))
        return [self.answers.get(a, False) for a in addresses]


class Op:
    """An operation the test completes or fails by hand (or one done when started)."""

    def __init__(self, *result: Any, kind: str = "", args: tuple = ()) -> None:
        self.kind, self.args = kind, args
        self.result = result[0] if result else UNDER_WAY
        self.error: BaseException | None = None

    def done(self, value: Any = None) -> None:
        self.result = value

    def fail(self, error: BaseException) -> None:
        self.error = error

    def poll(self):
        if self.error is not None:
            raise self.error
        return self.result

    def __repr__(self) -> str:
        return f"Op({self.kind})"


class FakeCommunicators:
    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.abandoned = 0

    def _op(self, kind: str, *args: Any) -> Op:
        self.ops.append(Op(kind=kind, args=args))
        return self.ops[-1]

    def attach(self, abort):
        self.abort = abort

    def form(self, view):
        return self._op("form", view)

    def verify(self, probe):
        return self._op("verify", probe)

    def form_shard(self, view):
        return self._op("form_shard", view)

    def gather_states(self, mine):
        return self._op("gather_states", mine)

    def mismatch(self, gathered, shards):
        return self._op("mismatch", gathered, shards)

    def transfer(self, view, source, load, step):
        return self._op("transfer", view, source, load, step)

    def abandon(self):
        self.abandoned += 1


class FakeCollective:
    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.touched = self.lost = False
        self.handed_back: list[float] = []
        self.discarded = 0

    def attach(self, contribution, may_overlap):
        self.contribution, self.may_overlap = contribution, may_overlap

    def no_sync(self):
        raise AssertionError

    def reduce(self, valid):
        self.ops.append(Op(kind="reduce", args=(self.contribution(valid),)))
        return self.ops[-1]

    def view_sum(self, values):
        self.ops.append(Op(kind="view_sum", args=(values,)))
        return self.ops[-1]

    def replica_decide(self, key, vote):
        self.ops.append(Op(kind="replica_decide", args=(key, vote)))
        return self.ops[-1]

    def hand_back(self, contributors):
        self.handed_back.append(contributors)

    def discard(self):
        self.discarded += 1
        self.touched = self.lost = False

    def drop(self):
        self.touched, self.lost = False, True

    def run(self, operation):
        self.ops.append(Op(kind="run", args=(operation,)))
        return self.ops[-1]


class FakeState:
    def __init__(self, registered: bool = True) -> None:
        self.registered = registered
        self.value = 11

    def digest(self, step: int) -> int:
        return self.value + step

    def signature(self) -> int:
        return 5

    def fingerprint(self) -> int:
        return self.value

    def tensor_fingerprints(self) -> dict[str, int]:
        return {"state": self.value}

    def participants(self, hook):
        return []


@dataclasses.dataclass
class World:
    loop: WorkerLoop
    membership: FakeMembership
    proposals: FakeProposals
    prober: FakeProber
    clock: FakeClock
    comms: FakeCommunicators
    collective: FakeCollective
    state: FakeState

    @property
    def engine(self) -> Engine:
        return self.loop.engine

    @property
    def driver(self):
        return self.loop.driver


def world_for(member: str, statuses: dict, options: GroupOptions | None = None, registered: bool = True,
              facts=None, **engine_fields) -> World:
    """One worker ``member`` among ``statuses`` (as its gossip table shows them)."""
    options = options or GroupOptions(leave_grace=0.5)
    engine = Engine(member, CFG, settle_interval=0.05, chase_interval=0.6, rendezvous_port=4000,
                    max_retries=options.max_retries, **engine_fields)
    membership, proposals, prober, clock = FakeMembership(statuses, member), FakeProposals(), FakeProber(), FakeClock()
    comms, collective, state = FakeCommunicators(), FakeCollective(), FakeState(registered)
    stragglers = Stragglers(options.straggler_factor, options.straggler_window, options.straggler_policy,
                            options.straggler_cooldown)
    loop = WorkerLoop(engine, Ports(clock, membership, proposals, prober, comms, collective, state), options,
                      stragglers)
    if facts is not None:
        loop.driver.facts = facts
    return World(loop, membership, proposals, prober, clock, comms, collective, state)


class Phase:
    """A phase of the worker loop stepped by hand: :attr:`waiting` is what it waits on."""

    def __init__(self, phase) -> None:
        self.phase = phase
        self._done = False
        self._result: Any = None
        self.waiting: Any = None
        self._send(None, None)

    @property
    def done(self) -> bool:
        """The phase ended (operations answered meanwhile are handed back first)."""
        self.settle()
        return self._done

    @property
    def result(self) -> Any:
        self.settle()
        return self._result

    def settle(self) -> None:
        """Hand back every operation answered (done or failed) until it waits on one that is not."""
        while isinstance(self.waiting, Op) and (self.waiting.error is not None or self.waiting.result is not UNDER_WAY):
            self.step()

    def _send(self, value: Any, error: BaseException | None) -> None:
        try:
            self.waiting = self.phase.throw(error) if error is not None else self.phase.send(value)
        except StopIteration as stop:
            self._done, self._result, self.waiting = True, stop.value, None

    def step(self) -> Any:
        """Hand back what it waits on once it is ready (a Pause is over at once); what it
        waits on next."""
        item = self.waiting
        if isinstance(item, Pause):
            self._send(None, None)
            return self.waiting
        try:
            value = item.poll()
        except BaseException as exc:  # noqa: BLE001 - thrown into the phase, as a runner does
            self._send(None, exc)
            return self.waiting
        if value is not UNDER_WAY:
            self._send(value, None)
        return self.waiting

    def until(self, kind: str, steps: int = 200, clock: FakeClock | None = None) -> Op:
        """Step (advancing ``clock`` 10 ms per step) until it waits on an operation of ``kind``."""
        for _ in range(steps):
            if isinstance(self.waiting, Op) and self.waiting.kind == kind:
                return self.waiting
            if self._done:
                raise AssertionError(f"the phase ended ({self._result!r}) before waiting on {kind}")
            if clock is not None:
                clock.t += 0.01
            self.step()
        raise AssertionError(f"never waited on {kind}; waits on {self.waiting!r}")


__all__ = ["FakeClock", "FakeMembership", "FakeProposals", "FakeProber", "FakeCommunicators", "FakeCollective",
           "FakeState", "Op", "Phase", "World", "world_for", "Contribution", "Counters"]
