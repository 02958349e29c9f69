"""Whole groups under deterministic simulation: the shipped driver over simulated ports.

N members, each the engine core (:mod:`ftcomm.core.engine`) fed and carried out by the driver
that ships (:class:`ftcomm.runtime.driver.Driver`, with its gossip news judged by
:class:`ftcomm.runtime.news.GossipNews`), over the gossip simulator (the real
:class:`~ftcomm.gossip.protocol.Protocol`, real packets, a virtual clock, loss and delay).
This module holds only the fault schedule, the ports' simulated implementations and the
invariant checks. The ports model the world:

* a proposal published by a member is readable by the others while its owner runs and
  is reachable; a read from one that crashed, hangs or is cut off answers nothing, and
  its reader's driver waits ``FETCH_TIMEOUT_S`` for it (the worst case: a connection
  opened before the owner died does not notice its death); a connection to a member's
  port is refused when its process is gone and its node reachable;
* a view forms once every member entered its formation (each after agreeing on its own)
  and every pair of members can reach each other, within ``formation_timeout``;
* reconciling gathers every member's (step, state digest) and all adopt the most
  advanced (lowest rank among equals), as ``ftcomm.runtime.transfer.reconcile`` does;
* a training step is one collective: it completes when every member contributed and
  each member observes it a little later (its own latency); a member that crashes,
  hangs or is cut off before another observed it leaves that one waiting (so a step may
  commit on some members only); a crashed process's peers get a connection error at
  once (their driver's crash fast path declares it dead), a lost node or a hung process
  gives none, only gossip tells; the step's reduced counters (a joiner waiting, the
  ranks asking to stand aside) go to the driver, which decides the verdict.

Each seed draws a group size, network conditions and a fault schedule (crash, hang and
resume, node loss and return, partition and heal, joins, graceful leaves, leaves right
after a collective, slow members, which with ``straggler_policy="exclude"`` stand aside).
After every commit and at the end it checks the invariants below; a violation names the seed and the command that reproduces it::

    python -m ftcomm.groupsim --seed 17            # one seed, its timeline
    python -m ftcomm.groupsim --seeds 500 --json   # many seeds, summary

Invariants: (1) no two members of a view commit different contents for the same step
(a step can still commit on some members only, when the others abort it and carry on
without them; such a commit is overwritten when its member is reconciled, and the
summary counts them: without a second commit round nothing can prevent it); (2) each
member's committed steps strictly increase; (3) the members of a view hold equal state
before their first commit in it; (4) with the quorum policy no side of a partition that
lacks a majority of the view before it commits; (5) the committed steps of the group are
contiguous (every sample of an epoch consumed once: the sampler's share of a step is a
function of the step); (6) liveness: once faults stop, every live member is in one view
with all live members and commits within ``liveness_bound`` seconds; (7) every
communicator a member formed is closed or abandoned, except the current one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from .core.engine import ANNOUNCE_LIMIT, ASIDE_DUE, JOIN_DUE, RUNNING, Engine, shard_sources
from .core.view import Status, View, gone_from, has_quorum
from .errors import CollectiveAborted, CommunicatorError, FtcommTimeout, GroupEnded, ReplicaLost
from .gossip.config import GossipConfig
from .gossip.runtime import decode_metadata, encode_metadata
from .gossip.sim import Simulation
from .options import GroupOptions
from .runtime.driver import Driver
from .runtime.news import GossipNews
from .runtime.ports import Formed, Ports, Reconciled
from .runtime.sim_ports import (TICK, SimClock, SimCommunicators, SimMembership, SimProber, SimProposals,
                                member_host)

CONFIG = "simcfg"
OPTIONS = GroupOptions()  # the defaults a worker runs with (stall_probe_after, leave_grace, ...)
FORM_LATENCY = 0.01
REPLICA_RESTART_S = 3.0  # a launcher starting a sharded replica's processes again, until they join
REPLICA_HALT_S = 5.0  # ftcomm.ops.launcher's: a process of a replica that lost one, SIGTERM to SIGKILL
CRASH_ERROR_DELAY = 0.005
_UNDECODED = object()
_NO_EXCHANGE = object()  # a completed step that counts without confirming


class InvariantViolation(AssertionError):
    """An invariant of the group did not hold; the message names it and the seed."""


@dataclass
class Worker:
    node: int  # index in the gossip simulation
    engine: Engine
    step_time: float
    slow: float = 1.0
    step: int = 0
    digest: int = 0
    crashed: bool = False
    crashed_at: float = float("inf")
    hung: bool = False
    gone: bool = False  # left gracefully (or crashed): no longer driven
    inbox: GossipNews | None = None  # its gossip news and the abort signal of the view it forms or runs
    entered: float = 0.0  # when it entered the formation in progress
    comm: tuple[int, str] | None = None
    comms: list = field(default_factory=list)  # every communicator formed: [key, closed]
    contributed: float | None = None  # when it contributed to the step in flight
    ready_at: float = 0.0  # when it may contribute next (its compute)
    fresh_view: bool = False  # no commit yet in the current view
    committed: list = field(default_factory=list)  # (time, step, view id)
    leave_after_commit: bool = False
    joined: bool = False  # its gossip join completed (ftcomm.init agrees only after that)
    op_began: float = 0.0  # when the operation in flight began
    resumed_at: float = float("-inf")  # when it last came back from a hang
    confirming: object = None  # the state exchange confirming a step that completed (see Driver.confirmation)
    asking: bool = False  # a straggler asking to stand aside (straggler_policy "exclude")
    statuses: dict | None = None  # the status records as last read (see GroupSimulation._statuses)
    news: dict | None = None  # member -> its news began with its joining, since the last read (None: read all)
    table_size: int = 0  # members in the gossip table at the last read
    read_view: View | None = None  # its view at the last read (whose members count although unconfirmed)
    busy_until: float = 0.0  # its driver waits for a read from a store that does not answer until then
    driver: Driver | None = None  # the driver that ships, over this simulation's ports
    replica: tuple[str, int] | None = None  # a sharded replica's process: (replica key, shard rank)
    agreeing: tuple | None = None  # (view key, op, join, asking): its step completed, the replica agrees (Replica.agree)

    @property
    def shard(self) -> int:
        return self.replica[1] if self.replica is not None else 0


@dataclass
class Outcome:
    seed: int
    n: int
    ok: bool
    violation: str | None
    faults: list
    commits: int
    views: int
    recovery: dict  # fault kind -> [seconds from the fault to the next commit of every survivor]
    recovery_overlapping: dict  # the same, for faults that struck while another fault was active
    settle_s: float | None  # from the last fault to one view of everyone, committing
    quorum_survived: bool  # a quorum of the newest view, and the group's state, outlived the faults (else no liveness is owed)
    rolled_back: int  # commits of a step whose contents differ from its first commit (see invariant 1)
    wall_s: float


class GroupSimulation:
    """One seeded run. ``faults``: list of (time, kind, args) or None to draw them;
    ``announce_limit``: the engines' (a small one makes small groups agree as large ones do);
    ``converged``: the workers start from a static host list, each knowing every other one
    and its first status record (the gossip cluster has converged; the first view is still
    to be agreed), instead of joining through the first worker; ``exclude_stragglers``: a
    slow member asks to stand aside (``straggler_policy="exclude"``) and, chosen, does so for
    ``straggler_cooldown`` seconds (None: drawn, for half the seeds); ``replica_size`` K > 1:
    the workers are sharded replicas of K processes (``n`` counts processes), faults strike
    a replica as they do on hosts (see :meth:`_fault`), and a launcher starts a replica
    whose process failed again as a whole."""

    def __init__(self, seed: int, n: int | None = None, faults: list | None = None, duration: float = 25.0,
                 loss: float | None = None, leave_grace: float = OPTIONS.leave_grace,
                 stall_probe_after: float = OPTIONS.stall_probe_after,
                 formation_timeout: float = 10.0, gossip: GossipConfig | None = None,
                 announce_limit: int = ANNOUNCE_LIMIT, converged: bool = False,
                 exclude_stragglers: bool | None = None, straggler_cooldown: float = 2.0,
                 replica_size: int = 1) -> None:
        self.seed = seed
        self.k = replica_size
        # (drawn apart, so the seeds' other draws do not depend on it)
        self.exclude_stragglers = (random.Random(f"{seed}/stragglers").random() < 0.5
                                   if exclude_stragglers is None else exclude_stragglers) and replica_size == 1
        self.straggler_cooldown = straggler_cooldown
        self.announce_limit = announce_limit
        self.rng = random.Random(seed)
        self.n = n if n is not None else self.rng.randint(3, 7) if self.k == 1 else self.k * self.rng.randint(2, 4)
        self.replica_of: dict[int, tuple[str, int]] = {i: (f"R{i // self.k}", i % self.k)
                                                      for i in range(self.n)} if self.k > 1 else {}
        self.replicas_started = self.n // self.k
        self.loss = loss if loss is not None else self.rng.choice([0.0, 0.0, 0.01, 0.03])
        delay = self.rng.choice([(0.0002, 0.002), (0.001, 0.01), (0.002, 0.03)])
        self.config = gossip or GossipConfig()
        # Workers start within a second of each other and join through the first (their peer).
        first = [encode_metadata(self._record(self._engine("", i, 0.0), 0, 0)) for i in range(self.n)] \
            if converged else None
        self.sim = Simulation(self.n, self.config, loss=self.loss, delay=delay, seed=self.rng.getrandbits(32),
                              bootstrap=converged, metadata=first)
        self.clock = SimClock(self)
        self.duration = duration
        self.liveness_bound = self.config.detection_bound(self.n + 4) + formation_timeout + 5.0
        """Seconds after the last fault within which every live member must run one view."""
        self.leave_grace, self.formation_timeout = leave_grace, formation_timeout
        self.stall_probe_after = stall_probe_after
        self.workers: dict[int, Worker] = {}
        self.by_id: dict[str, Worker] = {}
        self.by_host: dict[str, Worker] = {}
        self.store: dict[tuple[int, tuple[int, str]], tuple[str, ...]] = {}
        self.formations: dict[tuple[int, str], dict[str, float]] = {}
        self.reconciles: dict[tuple[int, str], dict[str, tuple[int, int]]] = {}
        self.steps: dict[tuple[tuple[int, str], int], dict[str, float]] = {}
        self.contents: dict[tuple, int] = {}  # (step, view) -> digest committed there (invariant 1)
        self.view_digest: dict[tuple[int, str], tuple[int, int]] = {}  # view -> (step, digest) at first commit
        self.partition: tuple[frozenset[str], frozenset[str], View | None] | None = None
        self.partition_left: set[str] = set()
        self.log: list[str] = []
        self.fault_log: list[tuple[float, str, str]] = []
        self.pending_recovery: list[tuple[float, str, set[str], bool]] = []  # (time, kind, survivors, isolated)
        self.recovery: dict[str, list[float]] = {}  # faults that struck a settled group (see _isolated)
        self.recovery_overlapping: dict[str, list[float]] = {}  # faults that struck while another was active
        self.disturbed_until = 0.0  # when the last hang, node loss or partition drawn so far ends
        self.sim.listeners.append(self._on_event)
        for i in range(self.n):
            self._start_worker(i, 0.0)
        self.scripted = faults is not None
        self.faults = faults if faults is not None else self._draw_faults()
        self.end_faults = max((t + a.get("length", 0.0) if k in ("hang", "node_loss", "partition")
                               else t + a["length"] + straggler_cooldown if k == "slow" and self.exclude_stragglers
                               else t for t, k, a in self.faults), default=0.0)
        self.settled_at: float | None = None
        self.history: dict[int, tuple] = {}  # step -> (first contents committed for it, by which view's members)
        self._healthy_cache: tuple = (None, float("inf"), False)
        self._decoded: dict[tuple[str, str, bytes], Status | None] = {}  # see _status
        self._view_workers: dict[tuple[int, str], list[Worker]] = {}  # see _members
        self._crashed_cache: tuple = (None, [])  # see _crash_error
        self._completed: dict[tuple, tuple[float, bool]] = {}  # see _completion
        self._down_cache: tuple = (None, False)  # see _connected
        self.rolled_back = 0
        self.restarting: set[str] = set()  # replicas the launcher stopped, to start again
        self.replica_votes: dict[tuple, dict[str, bool]] = {}  # (view key, op, replica) -> member -> committed
        self.newest: View | None = None  # the newest view formed by anyone
        self.quorum_survived = True
        for t, kind, args in self.faults:
            self.sim.at(t, lambda kind=kind, args=args: self._fault(kind, args))
        self.sim.at(0.0, self._tick)

    # ------------------------------------------------------------------ setup
    def _engine(self, member: str, node: int, now: float) -> Engine:
        replica = self.replica_of.get(node)
        return Engine(member, CONFIG, min_workers=self.k, settle_interval=0.05,
                      chase_interval=3 * self.config.gossip_interval, joined_at=now + node * 1e-6,
                      announce_limit=self.announce_limit, rendezvous_port=1,
                      replica=(*replica, self.k) if replica is not None else None)

    def _start_worker(self, node: int, now: float) -> Worker:
        member = self.sim.member_id(node)
        w = Worker(node, self._engine(member, node, now), step_time=self.rng.uniform(0.02, 0.05), joined=node == 0,
                   replica=self.replica_of.get(node))
        w.digest = w.shard  # the shards of a sharded replica hold different parts of the state
        protocol = self.sim.nodes[node].protocol
        w.inbox = GossipNews(w.engine, lambda: [(m, state, meta) for m, state, meta, _ in protocol.member_states()],
                             lambda: w.driver.ops, self.leave_grace, decode=self._status, clock=self.clock.now)
        w.driver = Driver(w.engine, Ports(self.clock, SimMembership(self, w), SimProposals(self, w), SimProber(self, w),
                                          SimCommunicators(self, w)), w.inbox, lambda: (w.step, None), self._noted(w))
        self.workers[node] = w
        self.by_id[member] = w
        self.by_host[member_host(member, ("", 0))[0]] = w
        if self.sim.nodes[node].protocol.metadata != encode_metadata(self._record(w.engine, w.step, 0)):
            w.driver.publish()  # (a converged start's members know this record already)
        return w

    def _draw_faults(self) -> list:
        rng, faults, t = self.rng, [], 2.0
        network_free_at = 0.0
        kinds = ["crash", "hang", "node_loss", "partition", "join", "leave", "leave_after_commit", "slow"]
        for _ in range(rng.randint(1, 5)):
            t += rng.uniform(0.5, 5.0)
            if t > self.duration:
                break
            kind = rng.choice(kinds)
            if kind in ("node_loss", "partition") and t < network_free_at:
                kind = "crash"
            if kind in ("hang", "node_loss", "partition"):
                length = rng.uniform(0.3, 8.0)
                faults.append((t, kind, {"length": length, "pick": rng.random(), "split": rng.random()}))
                if kind != "hang":
                    network_free_at = t + length + 0.5
            else:
                faults.append((t, kind, {"pick": rng.random(), "factor": rng.uniform(2, 5),
                                         "length": rng.uniform(1, 6)}))
        return faults

    # ------------------------------------------------------------------ faults
    def _live(self) -> list[Worker]:
        return [w for w in self.workers.values() if not w.crashed and not w.gone]

    def _pick(self, frac: float, exclude_last: bool = True) -> Worker | None:
        live = self._live()
        if self.k > 1:  # a process of a replica that is whole and not being started again
            live = [w for w in live if w.replica[0] not in self.restarting]
            if exclude_last and len({w.replica[0] for w in live}) <= 2:  # keep a group to recover
                return None
        if len(live) <= 2 and exclude_last:  # keep a group to recover
            return None
        return live[int(frac * len(live)) % len(live)]

    def _fault(self, kind: str, args: dict) -> None:
        """One fault of the schedule. With sharded replicas a fault strikes as it does where
        each replica is one host: a crash or hang strikes one process, a node loss and a
        partition whole replicas, a join and a leave (scaling) a whole replica."""
        now = self.sim.now
        if kind != "slow":  # a recovery still under way waits for this fault too: not isolated
            self.pending_recovery = [(t, k, survivors, False) for t, k, survivors, _ in self.pending_recovery]
        if self.k > 1 and kind in ("join", "partition", "node_loss", "leave", "leave_after_commit"):
            self._replica_fault(kind, args)
            return
        if kind == "join":
            node = self.sim.add_node(seed_index=self._live()[0].node)
            w = self._start_worker(node, now)
            self.fault_log.append((now, kind, w.engine.id))
            self.sim.at(now + 1.0, lambda: self._retry_join(w, 1))
            return
        if kind == "slow":
            w = self._pick(args["pick"], exclude_last=False)
            w.slow = args["factor"]
            w.asking = self.exclude_stragglers  # its peers' judgment: it asks to stand aside

            def recovered() -> None:
                w.slow, w.asking = 1.0, False
            self.sim.at(now + args["length"], recovered)
            self.fault_log.append((now, kind, w.engine.id))
            return
        if kind == "partition":
            live = self._live()
            if len(live) < 2:
                return
            cut = max(1, min(len(live) - 1, int(args["split"] * len(live)) or 1))
            side_a = {w.node for w in live[:cut]}
            side_b = set(range(len(self.sim.nodes))) - side_a
            self.disturbed_until = max(self.disturbed_until, now + args["length"])
            self._cut(now, side_a, side_b, args["length"], kind)
            return
        w = self._pick(args["pick"])
        if w is None:
            return
        self.fault_log.append((now, kind, w.engine.id))
        survivors = {x.engine.id for x in self._live() if x is not w}
        isolated = self._isolated(w)
        if kind in ("hang", "node_loss"):
            self.disturbed_until = max(self.disturbed_until, now + args["length"])
        if self.k > 1:  # the other replicas survive it
            survivors = {x.engine.id for x in self._live() if x.replica[0] != w.replica[0]}
        if kind == "crash":
            self._crash(w)
            self.pending_recovery.append((now, kind, survivors, isolated))
            if self.k > 1:
                self._replica_failed(w.replica[0])
        elif kind == "hang":
            w.hung = True
            self.sim.nodes[w.node].stalled = True
            self.pending_recovery.append((now, kind, survivors, isolated))
            self.sim.at(now + args["length"], lambda: self._resume(w))
        elif kind == "node_loss":
            others = set(range(len(self.sim.nodes))) - {w.node}
            self._cut(now, {w.node}, others, args["length"], kind, (survivors, isolated))
        elif kind in ("leave", "leave_after_commit"):
            if kind == "leave":
                self._leave(w)
            else:
                w.leave_after_commit = True
            self.pending_recovery.append((now, "leave", survivors, isolated))

    # ------------------------------------------------------------------ sharded replicas
    def _replicas(self) -> dict[str, list[Worker]]:
        """The live workers of each replica, by key, in start order."""
        out: dict[str, list[Worker]] = {}
        for w in self._live():
            out.setdefault(w.replica[0], []).append(w)
        return out

    def _replica_fault(self, kind: str, args: dict) -> None:
        now = self.sim.now
        if kind == "join":
            self._start_replica(now)
            return
        replicas = [r for key, r in self._replicas().items() if key not in self.restarting]
        if kind == "partition":
            if len(replicas) < 2:
                return
            cut = max(1, min(len(replicas) - 1, int(args["split"] * len(replicas)) or 1))
            side_a = {w.node for r in replicas[:cut] for w in r}
            self.disturbed_until = max(self.disturbed_until, now + args["length"])
            self._cut(now, side_a, set(range(len(self.sim.nodes))) - side_a, args["length"], kind)
            return
        if len(replicas) <= 2:  # keep a group to recover
            return
        victims = replicas[int(args["pick"] * len(replicas)) % len(replicas)]
        self.fault_log.append((now, kind, f"replica {victims[0].replica[0]}"))
        ids = {w.engine.id for w in victims}
        survivors = {x.engine.id for x in self._live() if x.engine.id not in ids}
        isolated = all(self._isolated(w) for w in victims)
        if kind == "node_loss":
            self.disturbed_until = max(self.disturbed_until, now + args["length"])
            nodes = {w.node for w in victims}
            self._cut(now, nodes, set(range(len(self.sim.nodes))) - nodes, args["length"], kind,
                      (survivors, isolated))
            return
        for w in victims:  # scaled down: the whole replica leaves
            if kind == "leave":
                self._leave(w)
            else:
                w.leave_after_commit = True
        self.pending_recovery.append((now, "leave", survivors, isolated))

    def _start_replica(self, now: float) -> list[Worker]:
        """A replica's K processes start (a new one, or a failed one started again): each
        joins through a live worker and retries as ``ftcomm.init`` does."""
        key = f"R{self.replicas_started}"
        self.replicas_started += 1
        seed = self._live()[0].node
        started = []
        for shard in range(self.k):
            node = self.sim.add_node(seed_index=seed)
            self.replica_of[node] = (key, shard)
            w = self._start_worker(node, now)
            self.sim.at(now + 1.0, lambda w=w: self._retry_join(w, 1))
            started.append(w)
        self.fault_log.append((now, "replica_start", key))
        return started

    def _replica_failed(self, key: str) -> None:
        """A process of replica ``key`` crashed, or exited on ReplicaLost: the launcher stops
        the others (SIGTERM: a graceful leave; one that is stopped cannot leave and is killed
        after REPLICA_HALT_S) and starts the replica again once none of them runs."""
        if key in self.restarting:
            return
        self.restarting.add(key)
        now = self.sim.now
        for w in self.workers.values():
            if w.replica is not None and w.replica[0] == key and not w.crashed and not w.gone:
                if w.hung:
                    self.sim.at(now + REPLICA_HALT_S, lambda w=w: None if w.crashed or w.gone else self._crash(w))
                else:
                    self.sim.at(now + 0.05, lambda w=w: self._leave(w))

        def restart() -> None:
            if any(w.replica is not None and w.replica[0] == key and not w.crashed and not w.gone
                   for w in self.workers.values()):
                self.sim.at(self.sim.now + 0.5, restart)
                return
            self.restarting.discard(key)
            if self._live():
                self._start_replica(self.sim.now)
        self.sim.at(now + REPLICA_RESTART_S, restart)

    def _isolated(self, victim: Worker) -> bool:
        """The fault strikes a settled group: every live member runs one view of all of them,
        the victim among them, and no other fault is active (a hang, node loss or partition,
        or a fault not yet recovered from); it stays isolated unless another fault (but a
        slow member) strikes before its recovery completes. A fault among others waits for
        them (a crash on one side of a partition, of a member already left out, a second
        crash that takes the quorum until a lost node returns), and its recovery is
        reported apart."""
        view = self._settled_view(self._live())
        return (view is not None and victim.engine.id in view.member_set and self.sim.now >= self.disturbed_until
                and not self.pending_recovery)

    def _retry_join(self, w: Worker, attempt: int) -> None:
        """ftcomm.init retries its join with every peer it was given until one answers."""
        node = self.sim.nodes[w.node]
        if w.crashed or w.gone or node.protocol.num_members() > 1 or attempt > 10:
            return
        seeds = [x for x in self._live() if x is not w and not x.hung]
        if seeds:
            seed = seeds[attempt % len(seeds)]
            self.sim.join_through(w.node, seed.node)
        self.sim.at(self.sim.now + 1.0, lambda: self._retry_join(w, attempt + 1))

    def _cut(self, now: float, side_a: set[int], side_b: set[int], length: float, kind: str,
             survivors: tuple[set[str], bool] | None = None) -> None:
        ids = {i: self.sim.member_id(i) for i in range(len(self.sim.nodes))}
        before = max((w.engine.view for w in self._live() if w.engine.view is not None),
                     key=lambda v: v.id, default=None)
        self.partition = (frozenset(ids[i] for i in side_a), frozenset(ids[i] for i in side_b), before)
        self.partition_left = {x.engine.id for x in self.workers.values() if x.gone and not x.crashed}
        self.sim.partition(side_a, side_b)
        self.fault_log.append((now, kind, f"{sorted(ids[i] for i in side_a)}"))
        if survivors is not None:
            self.pending_recovery.append((now, kind, *survivors))
        self.sim.at(now + length, self._heal)

    def _heal(self) -> None:
        self.partition = None
        self.sim.heal()

    def _crash(self, w: Worker) -> None:
        w.crashed = True
        w.crashed_at = self.sim.now
        self.sim.nodes[w.node].crashed = True
        for entry in w.comms:  # the process is gone: so are its communicators
            entry[1] = True

    def _resume(self, w: Worker) -> None:
        w.hung = False
        w.resumed_at = self.sim.now
        self.sim.resume(w.node)

    def _leave(self, w: Worker) -> None:
        if w.gone or w.crashed:
            return
        w.driver.perform(w.engine.leave())
        self.sim.nodes[w.node].protocol.leave(self.sim.now)
        self.sim.flush(w.node)
        self._abandon(w)
        w.gone = True
        # the process exits once the notice has spread
        self.sim.at(self.sim.now + self.config.leave_propagate_time, lambda: self._exit(w))

    def _exit(self, w: Worker) -> None:
        self.sim.nodes[w.node].crashed = True
        w.engine.closed()

    # ------------------------------------------------------------------ gossip side
    def _on_event(self, index: int, event) -> None:
        w = self.workers.get(index)
        if w is None or w.crashed or w.gone:
            return
        if w.news is not None:
            if event.kind == "joined":  # (again, if it was forgotten: it moved to the end of the table)
                w.news.pop(event.member.id, None)
                w.news[event.member.id] = True
            else:
                w.news.setdefault(event.member.id, False)
        # The gossip thread posts; the worker's waiting thread, woken at once, judges it.
        w.inbox.post(event)
        w.inbox.judge()

    def _statuses(self, w: Worker) -> dict[str, Status]:
        """What Lifecycle.statuses returns, read again only after a membership
        event at this member (or its own record changed): the members with news are read
        again, or the whole table when that cannot keep its order."""
        if w.statuses is not None and w.news is not None and not w.news:
            return w.statuses
        protocol = self.sim.nodes[w.node].protocol
        if w.statuses is None or w.news is None or not self._read_news(w, protocol):
            w.statuses = self._read_statuses(w)
        w.news, w.table_size, w.read_view = {}, protocol.table_size(), w.engine.view
        return w.statuses

    def _read_news(self, w: Worker, protocol) -> bool:
        """Update ``w.statuses`` for the members with news; False when only reading the whole
        table gives the same result: a member was forgotten (no event says so), or one enters
        the list anywhere but at its end (the table's order is the list's). A member's address
        never changes here, so neither does its confirmation without an event."""
        news = w.news
        if w.engine.view is not w.read_view or protocol.table_size() != w.table_size + sum(news.values()):
            return False
        statuses, own = w.statuses, w.engine.id
        known = w.engine.view.member_set if w.engine.view is not None else ()
        for member_id, joined in news.items():
            info = protocol.member(member_id)
            status = None
            if info.confirmed or member_id == own or member_id in known:
                status = self._status(member_id, info.state, info.metadata)
            if status is None:
                statuses.pop(member_id, None)
            elif member_id in statuses:
                if joined:  # forgotten and learned again: now at the end of the table
                    return False
                statuses[member_id] = status
            elif joined:  # new members come last, in the order they joined
                statuses[member_id] = status
            else:
                return False
        return True

    def _read_statuses(self, w: Worker) -> dict[str, Status]:
        protocol = self.sim.nodes[w.node].protocol
        own = w.engine.id
        known = w.engine.view.member_set if w.engine.view is not None else ()
        decoded = self._decoded
        out = {}
        for member_id, state, metadata, confirmed in protocol.member_states():
            if not confirmed and member_id != own and member_id not in known:
                continue
            status = decoded.get((member_id, state, metadata), _UNDECODED)
            if status is _UNDECODED:
                status = self._status(member_id, state, metadata)
            if status is not None:
                out[member_id] = status
        return out

    def _status(self, member_id: str, state: str, metadata: bytes) -> Status | None:
        """A member's decoded record: a pure function of what gossip holds, decoded once per
        simulation (every member decodes the same records)."""
        key = (member_id, state, metadata)
        status = self._decoded.get(key, _UNDECODED)
        if status is _UNDECODED:
            status = self._decoded[key] = Status.from_metadata(member_id, state, decode_metadata(metadata))
        return status

    @staticmethod
    def _record(e: Engine, step: int, ops: int) -> dict:
        return e.record(step, ops).encode()

    # ------------------------------------------------------------------ the driver
    def _tick(self) -> None:
        """Every live worker's driver looks once; the next look is due a tick later."""
        self.sim.at(round(self.sim.now + TICK, 6), self._tick)
        for w in list(self.workers.values()):
            if w.crashed or w.gone or w.hung or self.sim.now < w.busy_until:
                continue
            if not w.joined:
                if self.sim.nodes[w.node].protocol.num_members() < 2:
                    continue
                w.joined = True
            state = w.engine.state
            if w.driver.recovering:
                try:
                    w.driver.advance()
                except (ReplicaLost, GroupEnded) as exc:  # the script ends on it; its exit hook leaves the group
                    self.log.append(f"{self.sim.now:.3f} {w.engine.id}: {exc}")
                    self._leave(w)
                    if isinstance(exc, ReplicaLost):
                        self._replica_failed(w.replica[0])
            elif state == RUNNING:
                self._running(w)
            elif state == JOIN_DUE:
                w.driver.begin_recovery("join")  # the step boundary: re-form for the joiner
            elif state == ASIDE_DUE:  # chosen to stand aside: at the step boundary
                w.asking = False
                w.driver.stand_aside(self.straggler_cooldown)
        self._check_recoveries()
        if self.settled_at is None and self.sim.now >= self.end_faults and self._settled():
            self.settled_at = self.sim.now

    def _settled_view(self, live: list[Worker]) -> View | None:
        """The view every live member runs, when it holds exactly the live members."""
        views = {w.engine.view for w in live}
        if len(views) != 1 or None in views or any(w.engine.state != RUNNING for w in live):
            return None
        view = next(iter(views))
        return view if set(view.members) == {w.engine.id for w in live} else None

    def _settled(self) -> bool:
        """Every live member runs one view of exactly the live members and committed in it
        since the faults stopped."""
        live = self._live()
        view = self._settled_view(live)
        return view is not None and all(
            w.committed and w.committed[-1][2] == view.id and w.committed[-1][0] >= self.end_faults for w in live)

    def _noted(self, w: Worker):
        return lambda text: self.log.append(f"{self.sim.now:.3f} {text}")

    def _cut_off(self, a: Worker, b: Worker) -> bool:
        return self.sim.blocked(a.node, b.node)

    def _connected(self, w: Worker, view: View) -> bool:
        """Every member of ``view`` runs and ``w`` can reach it (as forming and reconciling need)."""
        key = (self.sim.now, view.id, view.digest)
        if self._down_cache[0] != key:  # once per tick and view: a member crashed or hung
            self._down_cache = (key, any(x.crashed or x.hung for x in self._members(view)))
        if self._down_cache[1]:
            return False
        return not self.sim.partitioned or not any(self._cut_off(w, x) for x in self._members(view))

    def _members(self, view: View) -> list[Worker]:
        key = (view.id, view.digest)
        members = self._view_workers.get(key)
        if members is None:
            members = self._view_workers[key] = [self.by_id[m] for m in view.members]
        return members

    def _crash_error(self, w: Worker, view: View) -> CommunicatorError | None:
        """The connection error a crashed member of ``view`` gives ``w``'s communicator."""
        key = (self.sim.now, view.id, view.digest)
        if self._crashed_cache[0] != key:  # once per tick and view
            self._crashed_cache = (key, [x for x in self._members(view)
                                         if x.crashed and self.sim.now - x.crashed_at >= CRASH_ERROR_DELAY])
        crashed = [x for x in self._crashed_cache[1] if not self._cut_off(w, x)]
        return CommunicatorError(f"{crashed[0].engine.id} refused a connection") if crashed else None

    def _formed(self, w: Worker, view: View) -> Formed | None:
        """Polls ``w``'s forming of ``view`` (see SimCommunicators)."""
        key = (view.id, view.digest)
        entered = self.formations.get(key, {})
        if w.inbox.abort.reason is None and self._connected(w, view) and all(m in entered for m in view.members):
            if self.sim.now >= max(entered.values()) + FORM_LATENCY:
                self.newest = max(self.newest, view, key=lambda v: v.id) if self.newest else view
                w.comm = key
                w.comms.append([key, False])
                self.reconciles.setdefault(key, {})
                return Formed(False, False)
        error = self._crash_error(w, view)
        if error is not None:
            raise error
        if w.inbox.abort.reason is not None:
            raise CollectiveAborted(w.inbox.abort.reason)
        if self.sim.now - w.entered >= self.formation_timeout:
            raise FtcommTimeout(f"view {view.id} did not form within {self.formation_timeout:g} s")
        return None

    def _reconciled(self, w: Worker, view: View) -> Reconciled | None:
        """Polls ``w``'s reconciling in ``view`` (see SimCommunicators)."""
        key = (view.id, view.digest)
        gathered = self.reconciles.setdefault(key, {})
        gathered.setdefault(w.engine.id, (w.step, w.digest))
        if w.inbox.abort.reason is None and self._connected(w, view) and all(m in gathered for m in view.members):
            pairs = [gathered[m] for m in view.members]
            # shard by shard with sharded replicas, as ftcomm.runtime.transfer.reconcile picks its source
            source = shard_sources(pairs, self.k)[1][view.rank_of(w.engine.id) % self.k]
            replaced = source is not None and pairs[source] != (w.step, w.digest)
            if source is not None:
                w.step, w.digest = pairs[source]
            w.contributed, w.fresh_view = None, True
            w.ready_at = w.op_began = self.sim.now
            return Reconciled(replaced, w.digest)
        error = self._crash_error(w, view)
        if error is not None:
            raise error
        if w.inbox.abort.reason is not None:
            raise CollectiveAborted(w.inbox.abort.reason)
        return None

    def _break(self, w: Worker, error: Exception | None = None) -> None:
        """The view broke under a step: what broke it is classified (a connection error, or
        the abort signal: the crash fast path probes the members behind it) and the driver
        re-agrees, as the step protocol does (a sharded replica's process first tells its
        replica that the step does not commit here)."""
        if self.k > 1 and w.engine.view is not None:
            view = w.engine.view
            self.replica_votes.setdefault(((view.id, view.digest), w.driver.ops + 1, w.replica[0]),
                                          {})[w.engine.id] = False
        error = error or CollectiveAborted(w.inbox.abort.reason or "the view moved on")
        w.driver.begin_recovery(w.driver.classify(error))

    def _abandon(self, w: Worker) -> None:
        for entry in w.comms:
            if entry[0] == w.comm:
                entry[1] = True
        w.comm = None
        w.contributed, w.confirming = None, None

    def _running(self, w: Worker) -> None:
        now = self.sim.now
        view = w.engine.view
        key = (view.id, view.digest)
        if w.agreeing is not None:  # blocked in the replica's agreement (torch's collective): nothing else
            self._replica_agreement(w)
            return
        if w.contributed is None:
            if w.inbox.abort.reason is not None:
                self._break(w)
                return
            if now >= w.ready_at:
                w.contributed = now
                self.steps.setdefault((key, w.driver.ops + 1), {})[w.engine.id] = (
                    now, w.engine.admits_joiner(self._statuses(w)), w.asking)
            return
        contributions = self.steps.get((key, w.driver.ops + 1), {})
        members = self._members(view)
        if len(contributions) == view.size:
            last, join, asking = self._completion((key, w.driver.ops + 1), contributions)
            done_at = last + 0.002 * w.slow
            # every member must stay up and reachable until this member has observed it
            healthy = self._healthy(w, view, members, done_at)
            if healthy and now >= done_at:
                if w.confirming is None:  # completed after a stall: confirmed by a state exchange first
                    w.confirming = w.driver.confirmation(w.contributed, w.op_began,
                                                         self.config.probe_interval) or _NO_EXCHANGE
                if w.confirming is not _NO_EXCHANGE:
                    answered = w.confirming.poll()
                    if answered is None:
                        return
                    try:
                        w.driver.confirmed(answered)
                    except CollectiveAborted:
                        self._break(w)  # discarded: the view moved on while it was stopped
                        return
                w.confirming = None
                if self.k > 1:  # every process of the replica commits it, or none (Replica.agree)
                    op = w.driver.ops + 1
                    self.replica_votes.setdefault((key, op, w.replica[0]), {})[w.engine.id] = True
                    w.agreeing = (key, op, join, asking)
                    self._replica_agreement(w)
                    return
                self._commit(w, view, join, asking)
                return
        w.inbox.judge()  # an abort held for a member that left after the step fires at its deadline
        error = self._crash_error(w, view)
        if error is not None or w.inbox.abort.reason is not None:
            self._break(w, error)
            return
        # still waiting on the step: hang detection on demand, as a waiting worker's thread does it
        w.driver.watch_stall(w.contributed, w.op_began, self.stall_probe_after, self.config.probe_interval)

    def _replica_agreement(self, w: Worker) -> None:
        """``w``'s step completed; it waits for the rest of its replica (Replica.agree): it
        commits when all did, discards the step when one did not, and gets ReplicaLost when
        one is gone (its connection resets). A hung one keeps it waiting."""
        key, op, join, asking = w.agreeing
        votes = self.replica_votes.get((key, op, w.replica[0]), {})
        partners = [x for x in self.workers.values() if x.replica is not None and x.replica[0] == w.replica[0]
                    and x is not w]
        view = w.engine.view
        if any(x.crashed or x.gone for x in partners):
            w.agreeing = None
            self.log.append(f"{self.sim.now:.3f} {w.engine.id}: ReplicaLost in the replica's agreement")
            self._leave(w)
            self._replica_failed(w.replica[0])
        elif any(votes.get(x.engine.id) is False for x in partners):
            self._discard(w, view, join, asking)
        elif all(votes.get(x.engine.id) for x in partners):
            self._commit(w, view, join, asking)

    def _discard(self, w: Worker, view: View, join: bool, asking: list[int]) -> None:
        """The step completed here, and not on another process of the replica: nobody in the
        replica commits it (the operation is over, its verdict read)."""
        now = self.sim.now
        w.agreeing = None
        w.driver.operation_done(now - w.contributed)
        w.contributed = None
        w.op_began = now
        w.ready_at = now + w.step_time * w.slow
        w.inbox.operation_ended()
        w.driver.step_reduced(view.size, float(join), asking, False, 1)

    def _completion(self, step: tuple, contributions: dict) -> tuple[float, bool, list[int]]:
        """When the last member contributed to a complete step, whether any saw a joiner
        waiting, and the ranks asking to stand aside (once per step: every member asks)."""
        done = self._completed.get(step)
        if done is None:
            view = self.by_id[next(iter(contributions))].engine.view
            done = self._completed[step] = (max(t for t, _, _ in contributions.values()),
                                            any(j for _, j, _ in contributions.values()),
                                            [view.rank_of(m) for m, (_, _, a) in contributions.items() if a])
        return done

    def _healthy(self, w: Worker, view: View, members: list[Worker], done_at: float) -> bool:
        """Every member stayed up and reachable until ``w`` observed the step's completion."""
        key = (self.sim.now, view.id, view.digest)
        if self._healthy_cache[0] != key:  # once per tick and view: the earliest crash, any hang
            first_crash = min((x.crashed_at for x in members), default=float("inf"))
            self._healthy_cache = (key, first_crash, any(x.hung for x in members))
        _, first_crash, hung = self._healthy_cache
        if hung or first_crash < done_at:
            return False
        return not self.sim.partitioned or not any(self._cut_off(w, x) for x in members)

    def _commit(self, w: Worker, view: View, join: bool, asking: list[int]) -> None:
        now = self.sim.now
        w.agreeing = None
        step = w.step + 1
        if w.fresh_view:
            first = self.view_digest.setdefault((view.id, view.digest, w.shard), (w.step, w.digest))
            if first != (w.step, w.digest):
                self._violation(3, f"{w.engine.id} starts view {view.id} at {(w.step, w.digest)}, another member "
                                   f"at {first}")
            w.fresh_view = False
        digest = int.from_bytes(hashlib.blake2b(f"{w.digest}/{step}/{view.id}".encode(), digest_size=8).digest(),
                                "big")
        if w.committed and step <= w.committed[-1][1]:
            self._violation(2, f"{w.engine.id} commits step {step} after step {w.committed[-1][1]}")
        known = self.contents.setdefault((step, view.id, view.digest, w.shard), digest)
        if known != digest:
            self._violation(1, f"step {step} committed with two contents in view {view.id} (by {w.engine.id})")
        first, first_members = self.history.setdefault((step, w.shard), (digest, frozenset(view.members)))
        if first != digest:
            if not first_members & set(view.members):
                self._violation(4, f"step {step} committed by two disjoint groups: view {view.id} "
                                   f"({len(view.members)} members) and an earlier view of {len(first_members)}")
            # Committed on some members only, then the others carried on without them: this
            # commit (or the earlier one) is discarded when its member is reconciled.
            self.rolled_back += 1
        if self.partition is not None and self.partition[2] is not None:
            side_a, side_b, before = self.partition
            side = side_a if w.engine.id in side_a else side_b
            # members that had left gracefully before the cut do not count, as in the quorum rule
            if set(view.members) <= side and not has_quorum(before, [m for m in before.members if m in side],
                                                            self.partition_left):
                self._violation(4, f"{w.engine.id} commits step {step} in view {view.id} on the minority side "
                                   f"of a partition of view {before.id}")
        w.step, w.digest = step, digest
        w.driver.operation_done(now - w.contributed)
        w.committed.append((now, step, view.id))
        w.contributed = None
        w.op_began = now
        w.ready_at = now + w.step_time * w.slow
        w.inbox.operation_ended()  # aborts held for a member that left after this step fire now
        # JOIN_DUE: every member re-forms at this boundary; ASIDE_DUE: the chosen stand aside
        w.driver.step_reduced(view.size, float(join), asking, False, 1)
        if w.leave_after_commit:
            self._leave(w)

    def _check_recoveries(self) -> None:
        now = self.sim.now
        still = []
        for t, kind, survivors, isolated in self.pending_recovery:
            live = {s for s in survivors if not self.by_id[s].crashed and not self.by_id[s].gone}
            done = all(any(c[0] > t and c[2] > self._view_at(s, t) for c in self.by_id[s].committed) for s in live)
            if done and live:
                last = max(min(c[0] for c in self.by_id[s].committed if c[0] > t and c[2] > self._view_at(s, t))
                           for s in live)
                (self.recovery if isolated else self.recovery_overlapping).setdefault(kind, []).append(round(last - t, 4))
            elif live and now - t < self.liveness_bound + self.duration:
                still.append((t, kind, survivors, isolated))
        self.pending_recovery = still

    def _view_at(self, member: str, t: float) -> int:
        commits = [c for c in self.by_id[member].committed if c[0] <= t]
        return commits[-1][2] if commits else 0

    def _violation(self, number: int, text: str) -> None:
        how = (f"GroupSimulation({self.seed}, n={self.n}, replica_size={self.k}, faults=<this run's scripted schedule>).run()"
               if self.scripted
               else f"python -m ftcomm.groupsim --seed {self.seed}" + (f" --replica-size {self.k}" if self.k > 1 else ""))
        raise InvariantViolation(f"invariant {number} violated at t={self.sim.now:.3f} (seed {self.seed}): {text}; "
                                 f"reproduce: {how}")

    # ------------------------------------------------------------------ run and final checks
    def run(self) -> Outcome:
        started = time.perf_counter()
        violation = None
        try:
            self.sim.run_until(self.end_faults + self.liveness_bound)
            self._check_end()
        except InvariantViolation as exc:
            violation = str(exc)
        commits = sum(len(w.committed) for w in self.workers.values())
        views = len({c[2] for w in self.workers.values() for c in w.committed})
        settle = round(self.settled_at - self.end_faults, 4) if self.settled_at is not None else None
        return Outcome(self.seed, self.n, violation is None, violation,
                       [(round(t, 3), k, m) for t, k, m in self.fault_log], commits, views,
                       self.recovery, self.recovery_overlapping, settle, self.quorum_survived, self.rolled_back,
                       round(time.perf_counter() - started, 3))

    def _check_end(self) -> None:
        steps = sorted({step for step, _ in self.history})
        if steps and steps != list(range(1, steps[-1] + 1)):
            missing = sorted(set(range(1, steps[-1] + 1)) - set(steps))[:5]
            self._violation(5, f"committed steps are not contiguous: missing {missing}")
        live_ids = {w.engine.id for w in self._live()}
        newest = self.newest
        # Members count as gone only when a live member holds their final record: one that
        # left while cut off from every survivor, and exited before the heal, is as good as
        # dead to them (nothing tells a departure from a death on the other side of a cut).
        left = set().union(*(gone_from(newest, self._read_statuses(w)) for w in self._live()))
        survivors = [m for m in newest.members if m in live_ids] if newest is not None else []
        self.quorum_survived = newest is None or (bool(survivors) and has_quorum(newest, survivors, left))
        # Nor when the group's state died with the members that held it (every live member
        # holds an older one, beyond a step that committed on some members only): going on
        # from an older state would commit its steps again.
        newest_step = max((step for step, _ in self.history), default=0)
        if self.quorum_survived and newest_step and not any(w.step >= newest_step - 1 for w in self._live()):
            self.quorum_survived = False
        # Without a quorum of the newest view alive the quorum policy must stop (and wait for
        # the lost members) rather than go on: liveness is owed only when a quorum survived.
        # When every member of the newest view left, the group ended with them: the members
        # left behind hold older states, and going on from one would commit those steps again.
        if self.settled_at is None and self.quorum_survived:
            states = {w.engine.id: (w.engine.state, w.engine.view.id if w.engine.view else None)
                      for w in self._live()}
            self._violation(6, f"within {self.liveness_bound:.1f} s of the last fault the live members never ran "
                               f"one view of all of them, committing: {states}")
        live = self._live()
        for w in self.workers.values():
            open_comms = [entry[0] for entry in w.comms if not entry[1]]
            allowed = [w.comm] if w in live else []
            if any(c not in allowed for c in open_comms):
                self._violation(7, f"{w.engine.id} still holds communicators {open_comms} (current {w.comm})")


def run_seed(seed: int, **kwargs) -> Outcome:
    return GroupSimulation(seed, **kwargs).run()


def run_seeds(seeds: list[int], processes: int = 1, **kwargs) -> list[Outcome]:
    if processes <= 1:
        return [run_seed(s, **kwargs) for s in seeds]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return pool.map(_run_seed_kw, [(s, kwargs) for s in seeds], chunksize=8)


def _run_seed_kw(item: tuple[int, dict]) -> Outcome:
    return run_seed(item[0], **item[1])


def summarize(outcomes: list[Outcome]) -> dict:
    recovery: dict[str, list[float]] = {}
    overlapping: dict[str, list[float]] = {}
    for o in outcomes:
        for kind, values in o.recovery.items():
            recovery.setdefault(kind, []).extend(values)
        for kind, values in o.recovery_overlapping.items():
            overlapping.setdefault(kind, []).extend(values)

    def dist(values: list[float]) -> dict:
        values = sorted(values)
        if not values:
            return {"count": 0}
        return {"count": len(values), "median_s": round(statistics.median(values), 3),
                "p99_s": round(values[min(len(values) - 1, int(0.99 * len(values)))], 3),
                "max_s": round(values[-1], 3)}
    settles = [o.settle_s for o in outcomes if o.settle_s is not None]
    return {"seeds": len(outcomes), "violations": sum(not o.ok for o in outcomes),
            "failing_seeds": [o.seed for o in outcomes if not o.ok][:20],
            "first_violation": next((o.violation for o in outcomes if not o.ok), None),
            "recovery_to_next_commit": {k: dist(v) for k, v in sorted(recovery.items())},
            "recovery_with_another_fault_active": {k: dist(v) for k, v in sorted(overlapping.items())},
            "settle_after_last_fault": dist(settles),
            "quorum_lost_seeds": sum(not o.quorum_survived for o in outcomes),
            "seeds_with_rolled_back_commits": sum(o.rolled_back > 0 for o in outcomes),
            "simulated_commits": sum(o.commits for o in outcomes),
            "wall_s_per_seed": round(statistics.mean(o.wall_s for o in outcomes), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftcomm.groupsim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, help="run one seed and print its timeline")
    parser.add_argument("--seeds", type=int, default=100, help="run seeds 0..N-1 (without --seed)")
    parser.add_argument("--first", type=int, default=0, help="first seed of --seeds")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--replica-size", type=int, default=1, help="sharded replicas of this many processes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.seed is not None:
        sim = GroupSimulation(args.seed, replica_size=args.replica_size)
        outcome = sim.run()
        if args.json:
            print(json.dumps(outcome.__dict__))
        else:
            print(f"seed {outcome.seed}: {outcome.n} workers, loss {sim.loss:g}; faults:")
            for t, kind, who in outcome.faults:
                print(f"  {t:8.3f} {kind:20s} {who}")
            for line in sim.log:
                print(" ", line)
            for w in sim.workers.values():
                print(f"  {w.engine.id}: {w.engine.state} view {w.engine.view.id if w.engine.view else None} "
                      f"step {w.step} commits {len(w.committed)}")
            print("recovery:", outcome.recovery, "with another fault active:", outcome.recovery_overlapping,
                  "settle:", outcome.settle_s)
            print("OK" if outcome.ok else outcome.violation)
        return 0 if outcome.ok else 1
    outcomes = run_seeds(list(range(args.first, args.first + args.seeds)), args.processes,
                         replica_size=args.replica_size)
    summary = summarize(outcomes)
    print(json.dumps(summary, indent=None if args.json else 2))
    return 0 if summary["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
