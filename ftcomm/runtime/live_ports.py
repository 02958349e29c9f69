"""The ports on a real worker, and the runner that blocks on the worker loop's phases.

See :mod:`ftcomm.runtime.ports` for what each port promises. Here: the system clock, the
gossip node, the rendezvous stores, TCP probes, the backend's communicators (Gloo or
NCCL, formed through the view's rank 0's store), the gradient buckets and the user's
collectives over them, and the registered training state. :func:`run` runs a phase of the
worker loop to its end in real time: it waits for each operation the phase yields (with
the view's abort signal) and hands the result back.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Generator, Iterable, Sequence, TypeVar

import torch

from .. import netif
from ..backends.base import AbortSignal, Communicator, Handle
from ..core.engine import FETCH_TIMEOUT_S, Engine
from ..core.view import Status, View
from ..errors import FtcommError, FtcommTimeout, MembershipChanged, ReplicaLost
from ..gossip import GossipNode
from ..options import GroupOptions
from ..training.buckets import GradientBuckets, read_counters
from ..training.quantized import quantized_sum
from ..training.shard_groups import ShardGroupBuckets, shard_groups
from ..training.reducer import DistributedDataParallel, ReducerBuckets
from ..training.state import TrainingState
from . import transfer
from .ports import (Address, Contribution, Counters, Done, Failed, MemberRecord, Pause, Pending, StateSummary,
                    readable)
from .rendezvous import Rendezvous, refused_many

log = logging.getLogger(__name__)

T = TypeVar("T")


def run(phase: Generator[Any, Any, T], news: threading.Event | None = None) -> T:
    """Run a phase of the worker loop to its end on this thread: each Pending it yields is
    waited for (its ``wait()`` when it has one, which gives up when the view's abort
    signal fires) and each Pause slept, ending early when ``news`` is set; results go back
    into the phase, and exceptions are thrown into it where it waited."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            item = phase.throw(error) if error is not None else phase.send(value)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            if isinstance(item, Pause):
                if item.seconds > 0:
                    if item.news and news is not None:
                        news.wait(item.seconds)
                    else:
                        time.sleep(item.seconds)
            elif hasattr(item, "wait"):
                value = item.wait()
            else:
                value = item.poll()  # a live port's operations complete when started (Done, Failed)
        except BaseException as exc:  # noqa: BLE001 - thrown into the phase, which decides
            error = exc


class Started:
    """A live operation under way: :func:`run` waits for it with ``wait()`` (``poll`` is
    for a caller that cannot block: it waits too)."""

    def __init__(self, wait: Callable[[], T]) -> None:
        self.wait = wait

    def poll(self) -> T:
        return self.wait()


def attempt(call: Callable[[], T]) -> Pending[T]:
    """``call()`` now, as a completed operation: its result (Done), or the view's failure it
    raised (Failed: MembershipChanged, FtcommTimeout, ReplicaLost)."""
    try:
        return Done(call())
    except (MembershipChanged, FtcommTimeout, ReplicaLost) as exc:
        return Failed(exc)


class SystemClock:
    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class GossipMembership:
    """The membership port over a :class:`~ftcomm.gossip.GossipNode` (attached once started).
    ``on_published``: run on the gossip thread once this worker's record reads back."""

    def __init__(self, engine: Engine, on_published: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.node: GossipNode | None = None
        self.on_published = on_published
        self._decoded: tuple | None = None  # (gossip snapshot, view, statuses, addresses) last decoded

    def statuses(self, view: View | None) -> tuple[dict[str, Status], dict[str, Address]]:
        """The records of the members this worker reads (see ``readable``), decoded once per
        change of the gossip table or of the view (every gradient step asks)."""
        snapshot = self.node.snapshot()
        cached = self._decoded
        if cached is not None and cached[0] is snapshot and cached[1] is view:
            return dict(cached[2]), dict(cached[3])
        statuses, addresses = {}, {}
        own = self.engine.id
        for m in snapshot:
            if not readable(m.id, m.confirmed, own, view):
                continue
            status = Status.from_metadata(m.id, m.state, m.metadata)
            if status is not None:
                statuses[m.id] = status
                if status.rendezvous_port is not None:
                    addresses[m.id] = (m.host, status.rendezvous_port)
        self._decoded = (snapshot, view, statuses, addresses)
        return dict(statuses), dict(addresses)

    def records(self) -> Iterable[MemberRecord]:
        return [MemberRecord(m.id, m.state, m.host, m.port, Status.from_metadata(m.id, m.state, m.metadata),
                             m.confirmed) for m in self.node.members()]

    def table(self) -> Iterable[tuple[str, str, Any]]:
        return [(m.id, m.state, m.metadata) for m in self.node.members()]

    def decode(self, member_id: str, state: str, metadata: Any) -> Status | None:
        return Status.from_metadata(member_id, state, metadata)

    def probe_interval(self) -> float:
        return self.node.config.probe_interval

    def seeds(self) -> list[Address]:
        return self.node.seed_addresses()

    def publish(self, record: dict) -> None:
        self.node.set_metadata(record, self.on_published)

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

    def exchange(self, members: Sequence[str], timeout: float | None = None) -> Done[bool]:
        return Done(any(self.node.exchange(member, timeout) for member in members))  # (stops at the first answer)

    def stalled_at(self) -> float:
        return self.node.last_stall

    def refuted_at(self) -> float:
        return self.node.last_refuted

    def leave(self) -> None:
        self.node.announce_leave()

    def propagate_time(self) -> float:
        return self.node.config.leave_propagate_time

    def stop(self) -> None:
        self.node.stop()


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


class RegisteredState:
    """The training-state port over :class:`~ftcomm.training.state.TrainingState`."""

    def __init__(self, state: TrainingState) -> None:
        self.training = state

    @property
    def registered(self) -> bool:
        return self.training.registered

    def digest(self, step: int) -> int:
        return self.training.digest(step)

    def signature(self) -> int:
        return self.training.signature()

    def fingerprint(self) -> int:
        return self.training.fingerprint()

    def tensor_fingerprints(self) -> dict[str, int]:
        return self.training.tensor_fingerprints()

    def participants(self, hook: str) -> list[Any]:
        return [obj for obj in self.training.objects.values() if hasattr(obj, hook)]


class BackendCommunicators:
    """The communicators port over the backend (``backend``: a Communicator class) and the
    rendezvous stores: the view's communicator (``comm``) and, with sharded replicas, the
    shard index's (``shard_comm``). ``secret`` signs state transfers."""

    def __init__(self, engine: Engine, backend: type, rendezvous: Rendezvous, options: GroupOptions,
                 membership: GossipMembership, state: TrainingState, secret: bytes | None) -> None:
        self.engine, self.backend, self.rendezvous, self.options = engine, backend, rendezvous, options
        self.membership, self.training, self.secret = membership, state, secret
        self.comm: Communicator | None = None
        self.shard_comm: Communicator | None = None
        self._abort: Callable[[], AbortSignal] = AbortSignal
        backend.retain(rendezvous.host)  # until close_listeners
        self._listeners_closed = False

    def attach(self, abort: Callable[[], AbortSignal]) -> None:
        """The abort signal of the view formed or run (the worker loop's, renewed per view)."""
        self._abort = abort

    @property
    def abort(self) -> AbortSignal:
        return self._abort()

    def _addresses(self) -> dict[str, Address]:
        return self.membership.statuses(self.engine.forming or self.engine.view)[1]

    def form(self, view: View) -> Pending[None]:
        def form() -> None:
            addresses = self._addresses()
            rank0 = view.members[0]
            if rank0 not in addresses:
                from ..errors import CommunicatorError
                raise CommunicatorError(f"rank 0 ({rank0}) of view {view.id} is not reachable through gossip")
            self.comm = self.form_communicator(self.rendezvous.view_store(view, *addresses[rank0]),
                                               view.rank_of(self.engine.id), view.size, view.id, view.members)
        return attempt(form)

    def verify(self, probe: list[int]) -> Pending[list[int]]:
        comm = self.comm

        def verify() -> list[int]:
            values = torch.tensor(probe, dtype=torch.int64, device=comm.device)
            comm.allreduce([values], "min").wait(self.abort, self.options.formation_timeout)
            return values.tolist()
        return attempt(verify)

    def form_shard(self, view: View) -> Pending[None]:
        def form() -> None:
            size = self.engine.replica_size
            rank = view.rank_of(self.engine.id)
            first = view.members[rank % size]
            addresses = self._addresses()
            if first not in addresses:
                from ..errors import CommunicatorError
                raise CommunicatorError(f"{first}, first of shard {rank % size} in view {view.id}, is not "
                                        f"reachable through gossip")
            store = self.rendezvous.shard_store(view, rank % size, *addresses[first])
            self.shard_comm = self.backend.form(store, rank // size, view.size // size, view.id, self.abort,
                                                self.options.formation_timeout, host=self.rendezvous.host,
                                                sources=self.sources(view.members))
        return attempt(form)

    def form_communicator(self, store: Any, rank: int, size: int, view_id: int,
                          members: Iterable[str] = ()) -> Communicator:
        """The backend's communicator of ``size`` ranks through ``store``; while it forms,
        only ``members``' addresses may connect to this worker's listener."""
        return self.backend.form(store, rank, size, view_id, self.abort, self.options.formation_timeout,
                                 host=self.rendezvous.host, sources=self.sources(members))

    def sources(self, members: Iterable[str]) -> set[str] | None:
        """The addresses ``members`` connect from: their bind addresses (a member on this
        host connects from the address it connects to), and the loopback address when
        they use loopback addresses (a connection to 127.0.0.x comes from 127.0.0.1).
        None when ``GroupOptions.listener_admission`` is ``formation``."""
        if self.options.listener_admission == "formation":
            return None
        addresses = self._addresses()
        hosts = {addresses[m][0] for m in members if m in addresses} | {self.rendezvous.host}
        if any(netif.is_loopback(h) for h in hosts):
            hosts.add("127.0.0.1")
        return hosts

    def gather_states(self, mine: StateSummary) -> Pending[list[StateSummary]]:
        comm = self.comm

        def gather() -> list[StateSummary]:
            values = torch.tensor(list(mine), dtype=torch.int64, device=comm.device)
            return [StateSummary(*t.tolist()) for t in comm.allgather(values).wait(self.abort)]
        return attempt(gather)

    def mismatch(self, gathered: list[StateSummary], shards: int) -> Pending[None]:
        view = self.engine.view

        def describe() -> None:
            rows = [tuple(g) for g in gathered]
            if shards > 1:
                transfer.raise_shard_mismatch(self.comm, self.abort, self.training, view, rows, shards)
            else:
                transfer.raise_model_mismatch(self.comm, self.abort, self.training, view, rows)
        return attempt(describe)

    def transfer(self, view: View, source: int, load: bool, step: int) -> Pending[int | None]:
        comm = self.shard_comm or self.comm
        return attempt(lambda: transfer.broadcast_state(comm, self.abort, self.training, step, view, self.secret,
                                                        source, load))

    def abandon(self) -> None:
        for comm in (self.comm, self.shard_comm):
            if comm is not None:
                comm.abandon()
        self.comm = self.shard_comm = None

    def close_listeners(self) -> None:
        """This worker forms nothing more: the backend may close what listens for its
        formations (once, at shutdown; communicators already formed keep working)."""
        if not self._listeners_closed:
            self._listeners_closed = True
            self.backend.release(self.rendezvous.host)


class BackendCollective:
    """The collective port over the view's communicators: gradient steps through
    :class:`~ftcomm.training.buckets.GradientBuckets` (reduced over the shard communicator
    with sharded replicas, during backward with ``overlap``), the sum over the whole view,
    the replica's agreement (``replica``: a :class:`~ftcomm.training.replica.Replica`), and
    the user's collectives."""

    def __init__(self, communicators: BackendCommunicators, options: GroupOptions, replica: Any = None) -> None:
        self.comms, self.options, self.replica = communicators, options, replica
        self.buckets: GradientBuckets | ReducerBuckets | ShardGroupBuckets | None = None
        self._contribution: Callable[[bool], Contribution] = lambda valid: Contribution(valid, False, None)
        self._may_overlap: Callable[[], bool] = lambda: False

    def attach(self, contribution: Callable[[bool], Contribution], may_overlap: Callable[[], bool]) -> None:
        self._contribution, self._may_overlap = contribution, may_overlap

    @property
    def gradient_comm(self) -> Communicator | None:
        """The communicator gradients are averaged over: the view's, or with sharded replicas
        this shard index's (the same shard of every replica)."""
        return self.comms.comm if self.replica is None else self.comms.shard_comm

    def use(self, params: list[torch.Tensor], module: torch.nn.Module | None = None,
            wire: torch.dtype = torch.float32, sent_early: bool = False) -> None:
        """The parameters of the coming gradient step, frozen ones included (``module``'s when
        given; new buckets when the trainable ones changed; those of a wrapped model go on
        through its reducer). A model sharded with FSDP2 is reduced per parameter group
        (:mod:`~ftcomm.training.shard_groups`) when its groups hold exactly these parameters.
        The buckets watch every parameter's ``requires_grad`` (see GradientBuckets); ``wire``
        is the dtype the gradients are summed in; ``sent_early``: the counters wait for the
        step's call (GradientBuckets' ``hold_counters``)."""
        watch, params = params, [p for p in params if p.requires_grad]
        buckets = self.buckets
        if buckets is not None and len(buckets.params) == len(params) and all(
                a is b for a, b in zip(buckets.params, params)):
            if getattr(buckets, "wire", torch.float32) == wire and \
                    getattr(buckets, "hold_counters", False) == sent_early:
                return
            if buckets.touched:  # backward began this step's reductions in the other dtype: the step ends in
                # it; without the hooks the next backward starts none, and the next call builds new buckets
                log.warning("wire_dtype (or sent_early) changed to %s after backward began reducing the step in %s: "
                            "this step is summed as it began, the next ones in %s", wire, buckets.wire, wire)
                buckets.remove()
                return
        if buckets is not None:
            if buckets.touched:  # its hooks already started this step's reductions for the old list
                buckets.drop()
                raise FtcommError("the parameters that require gradients changed after backward began reducing "
                                  "them: change requires_grad between steps, and pass the module (not a list of "
                                  "parameters) to wait_gradients_ready so that the change is seen before backward")
            buckets.remove()
        may_overlap = lambda: self.gradient_comm is not None and self._may_overlap()  # noqa: E731
        groups = shard_groups(module, params) if module is not None else None
        if groups is not None and wire != torch.float32:
            raise FtcommError("a model sharded with FSDP2 has its gradients summed in float32: pass its "
                              "parameters, not the module, to send them in another dtype")
        if groups is not None:
            self.buckets = ShardGroupBuckets(
                groups, params, launch=self._launch,
                may_overlap=lambda: self.options.overlap and may_overlap(),
                world_size=self._world_size, contribution=self._contribution, watch=watch)
            return
        self.buckets = GradientBuckets(
            params, self.options.bucket_mb, self.options.overlap, launch=self._launch,
            may_overlap=may_overlap, world_size=self._world_size, contribution=self._contribution, watch=watch,
            wire=wire, launch_int8=self._launch_int8, hold_counters=sent_early)

    def use_wrapped(self, net: DistributedDataParallel) -> None:
        """The coming gradient steps run through ``net``'s reducer."""
        if isinstance(self.buckets, ReducerBuckets) and self.buckets.net is net:
            return
        if self.buckets is not None:
            self.buckets.remove()
        self.buckets = ReducerBuckets(
            net, launch=self._launch,
            may_overlap=lambda: self.options.overlap and self.gradient_comm is not None and self._may_overlap(),
            world_size=self._world_size, contribution=self._contribution)

    def _launch(self, flat: torch.Tensor) -> Handle:
        """A bucket's sum over the gradient communicator."""
        return self.gradient_comm.allreduce([flat], "sum")

    def _launch_int8(self, flat: torch.Tensor) -> Handle:
        """A bucket's sum in 8-bit integers over the gradient communicator."""
        return quantized_sum(self.gradient_comm, flat)

    def _world_size(self) -> int:
        return self.gradient_comm.size

    @property
    def touched(self) -> bool:
        return self.buckets is not None and self.buckets.touched

    @property
    def lost(self) -> bool:
        return self.buckets is not None and self.buckets.lost

    def reduce(self, valid: bool) -> Pending[Counters]:
        handles, tail = self.buckets.finish(valid=valid)

        def wait() -> Counters:
            abort = self.comms.abort
            for handle in handles:
                handle.wait(abort)
            return Counters(*read_counters(tail.tolist()))
        return Started(wait)

    def view_sum(self, values: list[float]) -> Pending[list[float]]:
        comm = self.comms.comm

        def add() -> list[float]:
            tensor = torch.tensor(values, dtype=torch.float64, device=comm.device)
            comm.allreduce([tensor], "sum").wait(self.comms.abort)
            return tensor.tolist()
        return attempt(add)

    def replica_decide(self, key: tuple, vote: bool) -> Pending[bool]:
        abort = self.comms.abort
        return Started(lambda: self.replica.decide("/".join(map(str, key)), vote, lambda: abort.check() is not None,
                                                   self.options.formation_timeout))

    def hand_back(self, contributors: float) -> None:
        self.buckets.hand_back(contributors)

    def discard(self) -> None:
        if self.buckets is not None:
            self.buckets.discard()

    def drop(self) -> None:
        self.buckets.drop()

    def run(self, operation: Any) -> Pending[Any]:
        comm = self.comms.comm
        # Starting can fail too (NCCL reports a dead peer at enqueue): inside the wait.
        return Started(lambda: operation(comm).wait(self.comms.abort))

    def no_sync(self) -> Any:
        """See FaultTolerantGroup.no_sync."""
        import contextlib
        return contextlib.nullcontext() if self.buckets is None else self.buckets.no_sync()
