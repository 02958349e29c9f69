"""The simulated world: workers running the shipped loop over simulated ports, and the faults.

:class:`GroupSimulation` builds, for each worker, the engine and the
:class:`~ftcomm.runtime.worker.WorkerLoop` that ship, over the ports of :mod:`ftcomm.sim.ports`,
and runs a training script on it: ``init`` (the first re-formation), then steps
(boundary, compute, ``wait_gradients_ready``; now and then a collective through
``execute``), and at the end or on SIGTERM the loop's own ``leave``. Everything else here is
the world: who runs, hangs, is cut off or crashed (the fault schedule), how long compute
takes, the gossip simulator underneath, a collective completing once every member
contributed, a launcher starting failed workers again, and the invariant checks after
every commit (:mod:`ftcomm.sim.checks`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, NamedTuple

from ..core import engine as core
from ..core.engine import ANNOUNCE_LIMIT, Engine
from ..core.view import PROTOCOL, Status, View, state_elsewhere
from ..errors import (CollectiveAborted, CommunicatorError, ConfigMismatch, FtcommError, FtcommTimeout, GroupEnded,
                      JoinError, QuorumLost, ReplicaLost, RetryLimitExceeded, OutOfStep, StateDiverged, StateLost)
from ..gossip.config import GossipConfig
from ..gossip.runtime import decode_metadata, encode_metadata
from ..gossip.sim import Simulation
from ..options import GroupOptions
from ..runtime.news import decode_record
from ..runtime.ports import UNDER_WAY, Pause, Ports, readable
from ..runtime.stragglers import Stragglers
from ..runtime.worker import WorkerLoop
from . import checks
from .ports import (FORM_LATENCY, OP_LATENCY, TICK, SimClock, SimCollective, SimCommunicators, SimMembership,
                    SimOperation, SimProber, SimProposals, SimState, member_host)

CONFIG = "simcfg"
FOREIGN_CONFIG = "simcfg/other"  # the settings' digest of a worker started with other settings
REPLICA_RESTART_S = 3.0  # a launcher starting a sharded replica's processes again, until they join
REPLICA_HALT_S = 5.0  # ftcomm.ops.launcher's: a process of a replica that lost one, SIGTERM to SIGKILL
REPLICA_KILLED_HALT_S = 0.5  # the same, when the process the replica lost died by a signal
RESTART_S = (0.2, 2.5)  # a launcher starting a failed worker again: a warm standby .. a cold start
KILL_STOPPED_S = (0.25, 0.30)
REPAIR_BOOT_S = (0.05, 2.5)  # the replacement of a replica's lost process: a warm standby .. a cold start
REPAIR_SETTLE_S = 60.0  # ftcomm.ops.launcher's: a process failing this soon after a repair restarts the replica whole
"""ftcomm run's ``--kill-stopped-after`` (0.25 s, seen on two looks 50 ms apart): a worker
whose process is stopped (SIGSTOP) is killed this long after, which proves it gone (its
ports refuse), and started again. Half the hangs drawn under a launcher are such stops
(``stop_kills``); the rest answer nothing without being stopped (a process stuck in the
kernel, a frozen node), which no launcher sees."""
CRASH_ERROR_DELAY = 0.005  # a crashed member's connections reset this long after its death
COLLECTIVE_EVERY = 7  # the script averages a metric over the group (execute) after every this many commits
INFANT_S = 1.5  # an infant fault strikes a worker this soon after its start, at most
TRANSFER_S = (0.02, 0.3)  # a state transfer's time, for seeds whose model's state takes time to send
STEP_S = (0.02, 0.05)  # a step's compute
COLLECTION_S = (0.05, 0.1, 0.2, 0.4, 0.7)
"""How long a worker's full garbage collections last (``collect``): all within the pause an
announcement covers (``GossipConfig.pause_grace``, 1 s), with room for the notice's way."""
OUTER_STEP_S = (0.3, 2.0)  # a DiLoCo outer step's compute: tens to a hundred inner steps alone
SETTLED_RUN_S = 3.0
"""Once every live worker runs one view of all of them and commits, and no worker is on its
way (a launcher's restart), the run goes on this long, then ends."""
STEPS_PER_TICK = 500  # more phase steps than this in one tick: the loop spins without virtual time passing
EXPECTED_ERRORS = (GroupEnded, ReplicaLost, StateLost, QuorumLost, FtcommTimeout, RetryLimitExceeded, ConfigMismatch, JoinError)
"""What a worker's script may end on in the users' world (the process then exits 1)."""
_UNDECODED = object()


class InvariantViolation(AssertionError):
    """An invariant of the group did not hold; the message names it and the seed."""


class Sleep(NamedTuple):
    """The script computes until ``until`` (forward, backward, data)."""

    until: float


@dataclass
class Worker:
    """One worker process of the simulated world."""

    node: int  # index in the gossip simulation
    loop: WorkerLoop
    state: SimState
    step_time: float
    replica: tuple[str, int] | None = None  # a sharded replica's process: (replica key, shard rank)
    started_at: float = 0.0  # when its process started
    slow: float = 1.0
    crashed: bool = False
    crashed_at: float = float("inf")
    exited_at: float = float("inf")
    hung: bool = False
    repairing: str | None = None  # the key of its replica, while it waits to form it again with a replacement
    resumed_at: float = float("-inf")  # when it last came back from a hang
    gone: bool = False  # leaving (gracefully) or exited: no longer counted among the live
    exited: bool = False  # the process ended (its script returned or raised)
    script: Generator | None = None
    waiting: Any = None  # what the script waits on (a Pending, a Pause, a Sleep)
    waiting_at: float = 0.0  # since when
    busy_until: float = 0.0  # a blocking port call (a read from a store that does not answer) holds it until then
    joined: bool = False  # its gossip join completed (ftcomm.init agrees only after that)
    seeds: tuple[int, ...] = ()  # the nodes of the peers it was given (ftcomm.init's join)
    comms: list = field(default_factory=list)  # every communicator formed: [key, closed]
    committed: list = field(default_factory=list)  # (time, step, view id)
    last_view: tuple | None = None  # (view id, digest) of its last commit
    failed_in_a_row: int = 0  # gradient steps that failed and re-formed in a row (see checks.step_ended)
    aside: bool = False  # it stood aside as a straggler (as last seen)
    foreign: bool = False  # started with other settings than the job's (see ``misconfigured``)
    ended_on: str | None = None  # the error its script ended on (the process exited 1), if any
    step_with: frozenset = frozenset()  # the others training when its current gradient step began (checks)
    chosen_with: frozenset | None = None  # the others training when the step that chose it to stand aside began
    leave_after_commit: bool = False
    register_at: float = 0.0  # its script registers the training state then (a model built after init)
    statuses: dict | None = None  # the status records as last read (see GroupSimulation.statuses)
    news: dict | None = None  # member -> its news began with its joining, since the last read (None: read all)
    table_size: int = 0  # members in the gossip table at the last read
    read_view: View | None = None  # its view at the last read (whose members count although unconfirmed)
    starved: float = 0.0  # while its CPU is starved: how late (up to) its loop and its gossip run
    starved_windows: list = field(default_factory=list)  # (lag, until) of each of its CPU starvations
    late_until: float = 0.0  # starved: its loop runs again from then
    collecting_until: float = 0.0  # a full garbage collection pauses its loop and its gossip until then
    collections: list = field(default_factory=list)  # (length, until, members told) of its announced collections
    views_seen: int = 0  # its loop's view changes checked so far (checks.view_changed)
    hooked: bool = False  # its first wait_gradients_ready installed the buckets' hooks (overlap from then on)

    @property
    def id(self) -> str:
        return self.loop.engine.id

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
    recovery: dict  # fault kind -> [seconds from when the world allowed it to the next commit of every survivor]
    recovery_overlapping: dict  # the same, for faults that struck while another fault was active
    settle_s: float | None  # from the last fault to one view of everyone, committing
    quorum_survived: bool  # a quorum of the newest view, and the group's state, outlived the faults (else no liveness is owed)
    rolled_back: int  # commits of a step whose contents differ from its first commit (see invariant 1)
    wall_s: float
    min_workers: int = 1
    exits: dict = field(default_factory=dict)  # error a worker's script ended on -> count
    recoveries: list = field(default_factory=list)  # (kind, fault time, allowed from, seconds, isolated)
    started_over: list = field(default_factory=list)  # (kind, fault time): the survivors lacked the newest state
    first_alone: bool = False  # the workers started in turn, the first alone (GroupSimulation.first_alone)
    starvations: list = field(default_factory=list)  # (start, length, lag) of each CPU starvation drawn
    starved_excluded: list = field(default_factory=list)  # (member, lag, reason): starved ones left out of a view
    corruptions: int = 0  # states that went wrong (``corrupt``)
    wrong_commits: int = 0  # steps committed on a state that went wrong (invariant 12 bounds them)
    repairs: tuple[int, int] = (0, 0)  # sharded replicas repaired in place: started, formed again
    collections: tuple[int, int] = (0, 0)  # announced garbage collections struck; probe verdicts they held


class GroupSimulation:
    """One seeded run. ``faults``: list of (time, kind, args) or None to draw them;
    ``announce_limit``: the engines' (a small one makes small groups agree as large ones do);
    ``converged``: the workers start from a static host list, each knowing every other one
    and its first status record (the gossip cluster has converged; the first view is still
    to be agreed), instead of joining through the first worker; ``exclude_stragglers``: a
    slow member judges itself a straggler and asks to stand aside
    (``straggler_policy="exclude"``) for ``straggler_cooldown`` seconds (None: drawn, for
    half the seeds); ``replica_size`` K > 1: the workers are sharded replicas of K processes
    (``n`` counts processes), faults strike a replica as they do on hosts (see
    :meth:`_fault`), and a launcher starts a replica whose process failed again as a whole;
    ``min_workers``: the users' (in replicas; None: drawn; ``max_retries`` is drawn too);
    ``launcher``: a launcher starts
    a worker whose process ended on a failure again (None: drawn); ``stop_kills``: the
    share of hangs that are stops a launcher sees and kills (KILL_STOPPED_S; None: half with
    a launcher, and with sharded replicas, which always have one; none without a launcher
    or in a scripted schedule); ``dense``: many faults
    close together instead of a few apart (None: drawn); ``outer_steps``: each step computes
    for 0.3 to 2 s, as a DiLoCo or LocalSGD outer step does (its inner steps, alone), so that
    faults, joins and stragglers land mostly between a step's boundaries rather than in its
    reduction, and the reduction starts (with overlap) anywhere in that compute, as DiLoCo's
    ``delay`` sends it while the last inner steps train; ``collect``: now and then a
    worker runs a full garbage collection (its loop and its gossip paused for up to 0.7 s,
    announced to the others as it starts: see ``GossipConfig.pause_grace``), and no view may
    leave it out for that (checks.view_changed)."""

    def __init__(self, seed: int, n: int | None = None, faults: list | None = None, duration: float = 25.0,
                 loss: float | None = None, leave_grace: float = GroupOptions.leave_grace,
                 stall_probe_after: float = GroupOptions.stall_probe_after,
                 formation_timeout: float = 10.0, gossip: GossipConfig | None = None,
                 announce_limit: int = ANNOUNCE_LIMIT, converged: bool = False,
                 exclude_stragglers: bool | None = None, straggler_cooldown: float = 2.0,
                 replica_size: int = 1, min_workers: int | None = None, launcher: bool | None = None,
                 repair: bool = False,
                 dense: bool | None = None, late_registration: bool | None = None,
                 max_retries: int | None = None, keep_live: int | None = None,
                 first_alone: bool | None = None, starve: bool = False, stop_kills: float | None = None,
                 overlap: bool | None = None, log_in_step: bool | None = None,
                 transfer_s: float | None = None, observe_jitter: float | None = None,
                 first_step_overlaps: bool = False, metric_read: bool = True,
                 infant: bool | None = None, in_place: bool | None = None,
                 misconfigured: bool | None = None, model_after_init: bool | None = None,
                 corrupt: bool = False, outer_steps: bool = False, collect: bool = False) -> None:
        self.seed = seed
        self.step_s = OUTER_STEP_S if outer_steps else STEP_S
        # Faults strike while more than this many workers (replicas) live: 1 for drawn
        # schedules (down to one of two: the survivor goes on once the other is proven dead,
        # and waits while it may live); 2 for a scripted one, as in the world it was found in.
        self.keep_live = keep_live if keep_live is not None else 1 if faults is None else 2
        self.k = replica_size
        if faults is not None:  # a scripted schedule replays its race in the world it was found in
            min_workers = 1 if min_workers is None else min_workers
            launcher = False if launcher is None else launcher
            late_registration = False if late_registration is None else late_registration
            stop_kills = 0.0 if stop_kills is None else stop_kills
            overlap = False if overlap is None else overlap
            log_in_step = False if log_in_step is None else log_in_step
            transfer_s = 0.0 if transfer_s is None else transfer_s
            observe_jitter = 0.0 if observe_jitter is None else observe_jitter
            infant = False if infant is None else infant
            in_place = False if in_place is None else in_place
            misconfigured = False if misconfigured is None else misconfigured
            model_after_init = False if model_after_init is None else model_after_init
        # Drawn apart, so that one draw does not move the others.
        self.exclude_stragglers = (random.Random(f"{seed}/stragglers").random() < 0.5
                                   if exclude_stragglers is None else exclude_stragglers) and replica_size == 1
        self.launcher = random.Random(f"{seed}/launcher").random() < 0.5 if launcher is None else launcher
        self.dense = random.Random(f"{seed}/dense").random() < 0.25 if dense is None else dense
        self.late_registration = (random.Random(f"{seed}/late").random() < 0.3 if late_registration is None
                                  else late_registration)
        # The workers started at t = 0 build their model after init too (the order of the
        # tutorials ftcomm's guide migrates, three seeds in ten): each registers its state
        # 0.2 to 3 s after its start, so the first view's reconcile is deferred until then
        # (RECONCILE_DUE), on each member apart.
        self.model_after_init = (random.Random(f"{seed}/late/first").random() < 0.3 if model_after_init is None
                                 else model_after_init)
        self.first_registration_rng = random.Random(f"{seed}/late/first/at")
        # The processes of a sharded replica finish building together (fully_shard), but each
        # calls register_state on its own a moment apart.
        self.shard_skew_rng = random.Random(f"{seed}/late/shard")
        # The script as users write it: backward reduces as it goes (overlap, the default) or
        # leaves the whole reduction to wait_gradients_ready; the metric it averages for the
        # log (execute) is taken after the step commits, or between backward and the step.
        script = random.Random(f"{seed}/script")
        drawn_overlap, drawn_in_step = script.random() < 0.75, script.random() < 0.3
        self.overlap = drawn_overlap if overlap is None else overlap
        self.log_in_step = drawn_in_step if log_in_step is None else log_in_step
        # (``first_step_overlaps``, ``metric_read``: the worlds that seeds found before the
        # first call installed the hooks and before the script read the metric's value)
        self.first_step_overlaps, self.metric_read = first_step_overlaps, metric_read
        # Where in the step's compute backward's first gradient may start the reduction: half
        # way, or with outer steps anywhere (DiLoCo's ``delay`` sends an outer step's
        # pseudo-gradients that many inner steps before the step is due, and trains on).
        self.reduce_from = random.Random(f"{seed}/delay").uniform(0.05, 0.95) if outer_steps else 0.5
        # How long sending the state to a member that lacks it takes (the model's size): none
        # worth counting, or up to TRANSFER_S (a model of a few million parameters on loopback).
        state = random.Random(f"{seed}/state")
        drawn_transfer = state.uniform(*TRANSFER_S) if state.random() < 0.5 else 0.0
        self.transfer_s = drawn_transfer if transfer_s is None else transfer_s
        # Members observe a collective's completion up to this much apart (a ring's last
        # chunks, a busy host's thread): one may have completed an operation, and said so,
        # while another still waits for it.
        self.observe_rng = random.Random(f"{seed}/observe")
        drawn_jitter = self.observe_rng.choice([0.0, 0.005, 0.02])
        self.observe_jitter = drawn_jitter if observe_jitter is None else observe_jitter
        # New nodes fail early (bad hardware, a misconfigured host, a spot node taken back at
        # once): in a seed of ``infant`` faults every worker started after t = 0 (a join, a
        # restart, one started in turn) is struck within INFANT_S of its start by a
        # crash, hang, node loss or partition of its own, while it may still be joining,
        # holding back for its state, or in its first reconcile.
        self.infant = random.Random(f"{seed}/infant").random() < 0.3 if infant is None else infant
        self.infant_rng = random.Random(f"{seed}/infant/faults")
        # How the job starts: as ftcomm run starts it (every worker at once, each given all the
        # others as peers), or as a job that hands each worker the workers started before it
        # (ElasticRayJob, scripts given the first worker's address): the first starts a gossip
        # cluster alone, the others start within a second, in turn.
        if first_alone is None:
            first_alone = faults is None and random.Random(f"{seed}/start").random() < 0.25
        self.first_alone = first_alone and replica_size == 1 and not converged
        # A launcher starts a failed worker (replica) again where it ran, at its address, as
        # ftcomm run and a pod's restart do (a probe of the old member's port then finds the
        # new one there), or elsewhere (a new pod, a job that starts its workers in turn).
        self.in_place = (random.Random(f"{seed}/in_place").random() < 0.5 if in_place is None
                         else in_place) and not self.first_alone
        # An operator scales up by hand with a flag that differs (``misconfigured``, two seeds
        # in ten of plain workers): the first worker a join starts has another min_workers.
        # It must end on ConfigMismatch without ever entering a view of the group's members
        # (checks, invariant 11); it is not started again, and no fault strikes it.
        self.misconfigured = (random.Random(f"{seed}/misconfigured").random() < 0.2 if misconfigured is None
                              else misconfigured) and replica_size == 1
        # CPU starvation (``starve``: a host whose cores busy processes take): a member's loop,
        # timers and packets run late by up to a drawn lag, for seconds at a time, on any
        # member, the prober included. Not a fault: a member that keeps answering within the
        # detector's windows is never to be named hung (checks.view_changed).
        self.starve_rng = random.Random(f"{seed}/starve/lag")
        self.starvations: list[tuple[float, float, float, float]] = []  # (start, length, lag, pick)
        self.starved_excluded: list[tuple[str, float, str]] = []  # (member, lag, reason): see checks.view_changed
        self.collect_draws: list[tuple[float, float, float]] = []  # (start, length, pick)
        if collect:
            when = random.Random(f"{seed}/collect")
            self.collect_draws = [(when.uniform(0.0, duration * 0.8), when.choice(COLLECTION_S), when.random())
                                  for _ in range(when.randint(1, 4))]
        if starve:
            when = random.Random(f"{seed}/starve/when")
            self.starvations = [(when.uniform(0.0, duration * 0.8), when.uniform(1.0, 6.0),
                                 when.choice([0.01, 0.02, 0.05, 0.1, 0.2, 0.4]), when.random())
                                for _ in range(when.randint(1, 3))]
        # Silent data corruption (``corrupt``): a live member's state changes without a commit
        # (a flipped bit), once to three times a run, now and then the same member again
        # soon after (hardware that keeps computing wrong). Its fingerprint then differs from
        # the others' (checks: invariant 12).
        self.corrupt_rng = random.Random(f"{seed}/corrupt")
        self.corruptions: list[tuple[float, str]] = []  # (time, member)
        self.taint: dict[int, int] = {}  # a state value that descends from a corruption -> the step it struck at
        self.corrupt_schedule: list[tuple[float, float, float]] = []  # (time, pick, again after; 0: not again)
        if corrupt:
            self.corrupt_schedule = [(self.corrupt_rng.uniform(1.0, duration * 0.8), self.corrupt_rng.random(),
                                      self.corrupt_rng.uniform(0.3, 2.0) if self.corrupt_rng.random() < 0.3 else 0.0)
                                     for _ in range(self.corrupt_rng.randint(1, 3))]
        self.rng = random.Random(seed)
        self.recontact_rng = random.Random(f"{seed}/recontact")  # which seeds a cut-off worker asks
        self.stop_rng = random.Random(f"{seed}/stopped")  # which hangs a launcher sees as stops (KILL_STOPPED_S)
        self.stop_kills = (0.5 if self.launcher or self.k > 1 else 0.0) if stop_kills is None else stop_kills
        self.n = n if n is not None else self.rng.randint(3, 7) if self.k == 1 else self.k * self.rng.randint(2, 4)
        replicas = self.n // self.k
        if min_workers is None:
            drawn = random.Random(f"{seed}/min_workers")
            min_workers = 1 if drawn.random() < 0.5 else drawn.randint(1, replicas)
        self.min_workers = min_workers
        if max_retries is None:
            max_retries = (GroupOptions.max_retries if faults is not None
                           else random.Random(f"{seed}/max_retries").choice([1, 2, 5, 5]))
        self.options = GroupOptions(settle_interval=0.05, leave_grace=leave_grace, max_retries=max_retries,
                                    stall_probe_after=stall_probe_after, formation_timeout=formation_timeout,
                                    straggler_policy="exclude" if self.exclude_stragglers else "warn",
                                    straggler_cooldown=straggler_cooldown,
                                    # (judged on fewer, more frequent figures, so that a slow
                                    # member of a short schedule is found while it is slow)
                                    straggler_window=5 if self.exclude_stragglers else GroupOptions.straggler_window,
                                    step_publish_interval=0.5 if self.exclude_stragglers
                                    else GroupOptions.step_publish_interval)
        self.formation_timeout = formation_timeout
        self.announce_limit = announce_limit
        self.replica_of: dict[int, tuple[str, int]] = {i: (f"R{i // self.k}", i % self.k)
                                                      for i in range(self.n)} if self.k > 1 else {}
        self.replicas_started = replicas
        self.loss = loss if loss is not None else self.rng.choice([0.0, 0.0, 0.01, 0.03])
        delay = self.rng.choice([(0.0002, 0.002), (0.001, 0.01), (0.002, 0.03)])
        self.config = gossip or GossipConfig()
        # Workers start within a second of each other and join through the first (their peer).
        first = [encode_metadata(self._engine("", i, 0.0).record().encode()) for i in range(self.n)] \
            if converged else None
        self.sim = Simulation(self.n, self.config, loss=self.loss, delay=delay, seed=self.rng.getrandbits(32),
                              bootstrap=converged, metadata=first)
        self.clock = SimClock(self)
        self.duration = duration
        self.liveness_bound = self.config.detection_bound(self.n + 4) + formation_timeout + 5.0
        """Seconds after the last fault within which every live member must run one view."""
        self.workers: dict[int, Worker] = {}
        self.successor: dict[int, int] = {}  # node -> the node a launcher started its worker again on
        self.by_id: dict[str, Worker] = {}
        self.by_host: dict[str, Worker] = {}
        self.store: dict[tuple[int, tuple[int, str]], tuple[str, ...]] = {}
        self.formations: dict[tuple[int, str], dict[str, float]] = {}
        self.operations: dict[tuple, dict[str, tuple]] = {}  # (communicator, seq) -> member -> (t, kind, payload, late)
        self.registration: dict[str, float] = {}  # replica key (or member) -> when its script registers its state
        self.slots: dict[tuple, str] = {}  # (replica, decision, shard) -> vote or veto (Replica.decide's store)
        self.contents: dict[tuple, int] = {}  # (step, view) -> digest committed there (invariant 1)
        self.view_digest: dict[tuple, tuple[int, int]] = {}  # (view, shard) -> (step, digest) at first commit
        self.partition: tuple[frozenset[str], frozenset[str], View | None] | None = None
        self.partition_left: set[str] = set()
        self.log: list[str] = []
        self.fault_log: list[tuple[float, str, str]] = []
        self.fault_times: list[float] = []  # every moment the world changed: a fault struck or ended, a worker started (see _check_recoveries)
        self.pending_recovery: list[tuple[float, str, set[str], bool]] = []  # (time, kind, survivors, isolated)
        self.recovery: dict[str, list[float]] = {}  # faults that struck a settled group (see _isolated)
        self.recovery_overlapping: dict[str, list[float]] = {}  # faults that struck while another was active
        self.started_over: list[tuple[str, float]] = []  # faults after which the survivors lacked the newest state
        self.recoveries: list[tuple] = []  # (kind, fault time, allowed from, seconds, isolated)
        self.disturbed_until = 0.0  # when the last hang, node loss or partition drawn so far ends
        self.exits: dict[str, int] = {}
        self.last_start = 0.0  # when a worker last started (a join, or a launcher's restart)
        self.starting = 0  # restarts a launcher has scheduled and not made yet
        # Sharded replicas repaired in place (ftcomm run's default; see _replica_repair): the
        # launcher's repairs under way, by the key of the replica repaired, and when each
        # replica formed again (by its new key: a process that fails within REPAIR_SETTLE_S
        # restarts it whole).
        self.repair = repair and self.k > 1
        self.repair_rng = random.Random(f"{seed}/repair")
        self.repairs: dict[str, dict] = {}
        self.repaired_at: dict[str, float] = {}
        self.settled_at: float | None = None  # when every live worker ran one view of all, committing
        self.sim.listeners.append(self._on_event)
        starts = random.Random(f"{seed}/start/times")
        for i in range(self.n):
            if self.first_alone and i:
                self.sim.at(starts.uniform(0.0, 1.0), lambda i=i: self._start_in_turn(i))
                continue
            # As ftcomm run starts them: each is given every other worker as a peer, and joins
            # through them (the gossip simulation sends the first request through worker 0).
            w = self._start_worker(i, 0.0, joined=converged)
            if self.first_alone:
                w.seeds, w.joined = (), True  # the first worker starts a gossip cluster of its own
                continue
            if not w.joined:
                self.sim.at(self.config.join_retry_interval * (i == 0), lambda w=w: self._retry_join(w, 1))
        self.scripted = faults is not None
        self.faults = faults if faults is not None else self._draw_faults()
        self.end_faults = max((t + a.get("length", 0.0) if k in ("hang", "node_loss", "partition")
                               else t + a["length"] + 4 * straggler_cooldown if k == "slow" and self.exclude_stragglers
                               else t for t, k, a in self.faults), default=0.0)
        for t, length, lag, pick in self.starvations:
            self.sim.at(t, lambda length=length, lag=lag, pick=pick: self._starve(length, lag, pick))
            self.end_faults = max(self.end_faults, t + length)
        for t, length, pick in self.collect_draws:
            self.sim.at(t, lambda length=length, pick=pick: self._collect(length, pick))
            self.end_faults = max(self.end_faults, t + length)
        self.history: dict[tuple[int, int], tuple] = {}  # (step, shard) -> (first contents, by which view's members, its key)
        self.whole: dict[int, dict] = {}  # step -> replica -> the shards that committed it (see checks.state_lost)
        self._healthy_cache: tuple = (None, float("inf"), False)
        self._decoded: dict[tuple[str, str, bytes], Status | None] = {}  # see status
        self._crashed_cache: tuple = (None, [])  # see _crash_error
        self._down_cache: tuple = (None, False)  # see _connected
        self.rolled_back = 0
        self.wrong_commits = 0  # steps committed by a member whose state went wrong (see corrupt)
        self.wrong_steps: set[int] = set()  # the steps they committed
        self.lost_state = 0  # steps committed again after every member that held them died or left
        self.restarting: set[str] = set()  # replicas the launcher stopped, to start again
        self.quorum_survived = True
        self.healed_at = float("-inf")  # when the latest partition or node loss healed
        for t, kind, args in self.faults:
            self.sim.at(t, lambda kind=kind, args=args: self._fault(kind, args))
        for t, pick, again in self.corrupt_schedule:
            self.sim.at(t, lambda pick=pick, again=again: self._corrupt(pick, again))
        self.end_faults = max([self.end_faults] + [t + again for t, _, again in self.corrupt_schedule])
        self.sim.at(0.0, self._tick)

    # ------------------------------------------------------------------ workers
    def _engine(self, member: str, node: int, now: float, foreign: bool = False) -> Engine:
        replica = self.replica_of.get(node)
        min_workers = self.min_workers + foreign
        settings = ("gloo", min_workers, None, self.options.partition_policy, PROTOCOL, self.k, self.options.sdc_policy,
                    self.options.fingerprint_every)
        return Engine(member, FOREIGN_CONFIG if foreign else CONFIG, min_workers=min_workers, settings=settings,
                      settle_interval=self.options.settle_interval,
                      chase_interval=3 * self.config.gossip_interval, joined_at=now + node * 1e-6,
                      announce_limit=self.announce_limit, rendezvous_port=1, max_retries=self.options.max_retries,
                      replica=(*replica, self.k) if replica is not None else None)

    def _start_worker(self, node: int, now: float, joined: bool = False, foreign: bool = False) -> Worker:
        member = self.sim.member_id(node)
        replica = self.replica_of.get(node)
        # A joiner that builds its model after init registers its state late; the processes of
        # a sharded replica build theirs together (fully_shard is a collective among them).
        group = replica[0] if replica is not None else member
        if group not in self.registration and now == 0 and self.model_after_init:
            self.registration[group] = self.first_registration_rng.uniform(0.2, 3.0)
        elif group not in self.registration:
            late = self.late_registration and now > 0 and self.rng.random() < 0.5
            self.registration[group] = now + self.rng.uniform(0.2, 3.0) if late else 0.0
        register_at = self.registration[group]
        if register_at and replica is not None:
            register_at += self.shard_skew_rng.uniform(0.0, 0.3)
        state = SimState(replica[1] if replica is not None else 0, registered=not register_at)
        engine = self._engine(member, node, now, foreign)
        w = Worker(node, None, state, step_time=self.rng.uniform(*self.step_s), replica=replica, joined=joined,
                   register_at=register_at, started_at=now, foreign=foreign)
        comms = SimCommunicators(self, w)
        ports = Ports(self.clock, SimMembership(self, w), SimProposals(self, w), SimProber(self, w), comms,
                      SimCollective(self, w, comms), state)
        options = self.options
        stragglers = Stragglers(options.straggler_factor, options.straggler_window, options.straggler_policy,
                                options.straggler_cooldown)
        w.loop = WorkerLoop(engine, ports, options, stragglers, notice=self._noted)
        w.script = self._script(w)
        w.waiting, w.waiting_at = Pause(0.0), now
        if self.settled_at is not None and now > self.settled_at:
            self.settled_at = None  # it has to settle again, with this worker
        w.seeds = tuple(x.node for x in self.live() if x is not w) if now > 0 else tuple(i for i in range(self.n) if i != node)
        w.joined = w.joined or not w.seeds  # given no peer, ftcomm.init starts a new gossip cluster at once
        if now > 0 and not foreign:  # (one started with other settings is due in no view)
            self.last_start = max(self.last_start, now)
            self.fault_times.append(now)  # a worker started: a view may be due (min_workers, a join)
        self.workers[node] = w
        self.by_id[member] = w
        if self.infant and now > 0 and (replica is None or replica[1] == 0) and not foreign:
            kind = self.infant_rng.choice(["crash", "hang", "node_loss", "partition"])
            args = {"length": self.infant_rng.uniform(0.3, 8.0), "pick": 0.0, "split": 0.0}
            self.sim.at(now + self.infant_rng.uniform(0.0, INFANT_S), lambda: self._infant_fault(kind, args, w))
        self.by_host[member_host(member, ("", 0))[0]] = w
        if self.sim.nodes[node].protocol.metadata != encode_metadata(w.loop.driver.record()):
            w.loop.driver.publish()  # (a converged start's members know this record already)
        return w

    def _starve(self, length: float, lag: float, pick: float) -> None:
        """A live worker's CPU is starved for ``length`` seconds: its loop, its gossip timers,
        what it sends and what it receives run up to ``lag`` seconds late."""
        w = self._pick(pick, exclude_last=False)
        if w is None or w.starved:
            return
        now = self.sim.now
        self.fault_times += [now, now + length]
        self.fault_log.append((now, "starve", f"{w.id} lag {lag:g} s for {length:.2f} s"))
        w.starved = lag
        w.starved_windows.append((lag, now + length))
        self.sim.starved[w.node] = lag

        def fed() -> None:
            w.starved = 0.0
            self.sim.starved.pop(w.node, None)
        self.sim.at(now + length, fed)

    def _collect(self, length: float, pick: float) -> None:
        """A live worker runs a full garbage collection of ``length`` seconds: it announces
        it to the members it knows, then neither its loop nor its gossip runs until it ends
        (datagrams wait for it, as in a socket buffer). Not a fault: the others must not
        take it for hung (checks.view_changed)."""
        w = self._pick(pick, exclude_last=False)
        if w is None or w.hung or self.sim.nodes[w.node].stalled or w.collecting_until > self.sim.now:
            return
        now = self.sim.now
        self.fault_log.append((now, "collect", f"{w.id} for {length:g} s"))
        self.sim.announce_pause(w.node)
        told = frozenset(m.id for m in self.sim.nodes[w.node].protocol.members() if m.state in ("alive", "suspect"))
        w.collecting_until = now + length
        w.collections.append((length, now + length, told))
        self.sim.nodes[w.node].stalled = True

        def ended() -> None:
            if not (w.crashed or w.hung):  # (a hang that struck meanwhile keeps it stopped)
                self.sim.resume(w.node)
        self.sim.at(now + length, ended)

    def _start_in_turn(self, node: int) -> None:
        """A job that starts its workers in turn (:attr:`first_alone`): the worker on ``node``
        is given the workers started before it as peers (those still running, each where its
        latest start runs) and joins through them."""
        started = sorted(x.node for x in self.live())
        w = self._start_worker(node, self.sim.now)
        w.seeds, w.joined = tuple(x for x in started if x != node), not started
        if not w.joined:
            self._retry_join(w, 1)

    def _script(self, w: Worker) -> Generator:
        """What a user's training script does with the group (see the module docstring)."""
        loop = w.loop
        yield from loop.start(self.sim.now, self.options.init_timeout)
        if self.repair:  # (the replica's watch starts once init returned: FaultTolerantGroup.__init__)
            loop.replica_lost = lambda: self._watch(w)
        if not w.state.registered:  # the model is built after init
            yield Sleep(w.register_at)
            w.state.registered = True
            self.fault_times.append(self.sim.now)  # a joiner asks for admission now; founders wait for it
        if loop.awaiting_state:  # found a running group: register_state asks to be admitted
            try:
                yield from loop.admit()
            except ReplicaLost as exc:
                yield from self._repair(w, exc, "boundary")
        collective = loop.ports.collective
        while True:
            try:
                yield from loop.boundary()
            except ReplicaLost as exc:  # (FaultTolerantGroup._at_boundary)
                yield from self._repair(w, exc, "boundary")
                continue
            checks.view_changed(self, w)
            checks.step_started(self, w)
            compute = w.step_time * w.slow
            # Backward begins halfway through the compute (with outer steps, where the seed drew):
            # its first gradient may start reducing.
            if self.overlap and (w.hooked or self.first_step_overlaps):
                self.sim.at(self.sim.now + compute * self.reduce_from, lambda: self._backward(w))
            yield Sleep(self.sim.now + compute)
            collective.backward_ended()
            if self.log_in_step and (loop.step + 1) % COLLECTIVE_EVERY == 0:
                yield from self._log_metric(w)
                if self.metric_read:  # the script reads the metric's value (until the next tick)
                    yield Sleep(self.sim.now + 0.001)
            w.hooked = True  # (the first call installs the hooks: the first step is not overlapped)
            views = len(loop.events)  # (a re-formation in the metric is the call's, not the step's)
            try:
                committed = yield from loop.gradient_step()
            except ReplicaLost as exc:
                yield from self._repair(w, exc, "step")
                committed = False
            checks.view_changed(self, w)
            checks.step_ended(self, w, committed, len(loop.events) > views)
            if not committed:
                continue
            checks.committed(self, w, loop.engine.view)  # the optimizer steps: the commit's contents
            if w.leave_after_commit:  # the script ends: the exit hook leaves the group
                w.gone = True
                yield from loop.leave()
                return
            if not self.log_in_step and loop.step % COLLECTIVE_EVERY == 0:
                yield from self._log_metric(w)

    def _log_metric(self, w: Worker) -> Generator:
        """The script averages a metric over the group for its log, inside ``execute``."""
        loop = w.loop
        try:
            try:
                yield from loop.execute(lambda: loop.collective("the mean loss"))
            except ReplicaLost as exc:  # (FaultTolerantGroup._repairing: repaired, and run again)
                yield from self._repair(w, exc, "call")
                yield from loop.execute(lambda: loop.collective("the mean loss"))
        except OutOfStep:  # the group re-formed and is elsewhere: nothing to log (docs/GUIDE.md)
            self.exits["OutOfStep (tolerated)"] = self.exits.get("OutOfStep (tolerated)", 0) + 1

    def _backward(self, w: Worker) -> None:
        """``w``'s backward pass begins (on autograd's thread, while its script computes): its
        first gradient asks whether reducing may start now. A process that is gone, stopped
        or hung runs no backward then; its step is then reduced whole at the step."""
        if not (w.crashed or w.exited or w.gone or w.hung):
            w.loop.ports.collective.backward_began()

    def _foreign_waiting(self, t: float) -> bool:
        """A worker started with other settings runs, not told so yet, within the liveness
        bound of its start (the run goes on until it is; see checks.at_end)."""
        return any(w.foreign and not (w.exited or w.crashed) and t < w.started_at + self.liveness_bound
                   for w in self.workers.values())

    def live(self) -> list[Worker]:
        """The job's workers that run (a worker started with other settings is none of them)."""
        return [w for w in self.workers.values() if not w.crashed and not w.gone and not w.foreign]

    # ------------------------------------------------------------------ running the scripts
    def _tick(self) -> None:
        """Every worker that runs resumes its script; the next tick is due a TICK later."""
        now = self.sim.now
        self.sim.at(round(now + TICK, 6), self._tick)
        for w in list(self.workers.values()):
            if w.crashed or w.exited or w.hung or now < w.busy_until or now < w.collecting_until:
                continue
            if w.starved:  # its loop runs late: once per drawn lag at most
                if now < w.late_until:
                    continue
                w.late_until = now + self.starve_rng.uniform(0.0, w.starved)
            if not w.joined:
                if self.sim.nodes[w.node].protocol.num_members() < 2:
                    continue
                w.joined = True
            self._resume(w)
            aside = w.loop.engine.state == core.STANDING_ASIDE
            if aside and not w.aside:
                checks.stood_aside(self, w)
            w.aside = aside
        self._check_recoveries()
        if self.settled_at is None and now >= max(self.end_faults, self.last_start) and self._settled():
            self.settled_at = now

    def _resume(self, w: Worker) -> None:
        """Run ``w``'s script until it waits on something not ready yet."""
        now = self.sim.now
        for _ in range(STEPS_PER_TICK):
            value, error = self._ready(w, w.waiting)
            if value is UNDER_WAY:
                return
            try:
                w.waiting = w.script.throw(error) if error is not None else w.script.send(value)
                w.waiting_at = now
            except StopIteration:
                self._exit(w)
                return
            except EXPECTED_ERRORS as exc:  # the script ends on it; the process exits 1
                self._failed(w, exc)
                return
            except StateDiverged as exc:  # the script ends on it, where a state went wrong (checks, 12)
                checks.diverged(self, w, exc)
                self._failed(w, exc)
                return
            except InvariantViolation:
                raise
            except FtcommError as exc:
                if w.gone:  # "the group was shut down": its leave began meanwhile
                    self._exit(w)
                    return
                self.violation(0, f"{w.id}'s script raised {type(exc).__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001 - a bug in the loop: the seed reproduces it
                import traceback
                where = traceback.extract_tb(exc.__traceback__)[-1]
                self.violation(0, f"{w.id}'s loop raised {type(exc).__name__}: {exc} "
                                  f"({where.filename}:{where.lineno})")
            if self.sim.now < w.busy_until or w.crashed or w.exited:
                return
        self.violation(0, f"{w.id}'s loop made {STEPS_PER_TICK} steps without virtual time passing "
                          f"(waiting on {w.waiting!r})")

    def _ready(self, w: Worker, item: Any) -> tuple[Any, BaseException | None]:
        """What ``w`` waits on, once ready: (its result, or the exception it raised)."""
        now = self.sim.now
        if isinstance(item, Pause):
            if now > w.waiting_at and (now >= w.waiting_at + item.seconds - 1e-9
                                       or (item.news and w.loop.news.changed.is_set())):
                return None, None
            return UNDER_WAY, None
        if isinstance(item, Sleep):
            return (None, None) if now >= item.until else (UNDER_WAY, None)
        try:
            return item.poll(), None
        except (CollectiveAborted, CommunicatorError, FtcommTimeout, ReplicaLost) as exc:
            return None, exc

    def _leave(self, w: Worker) -> None:
        """``w`` leaves gracefully (SIGTERM, the job scaled down, or the script ended): its
        exit hook runs the loop's leave; a hung process does so once it runs again."""
        if w.gone or w.crashed or w.exited:
            return
        w.gone = True
        w.repairing = None
        if w.script is not None:
            w.script.close()
        w.script, w.waiting = self._leaving(w), Pause(0.0)

    def _leaving(self, w: Worker) -> Generator:
        yield from w.loop.leave()

    def _exit(self, w: Worker) -> None:
        """The process ends: its sockets close."""
        w.gone = w.exited = True
        w.exited_at = self.sim.now
        w.script = None
        self.sim.nodes[w.node].crashed = True
        for entry in w.comms:
            entry[1] = True
        engine = w.loop.engine
        engine.leave()  # (nothing when it left already)
        if engine.state == core.LEAVING:
            engine.closed()

    def _failed(self, w: Worker, exc: BaseException) -> None:
        """``w``'s script ended on ``exc``: the exit hook leaves the group, the process exits
        1, and a launcher starts it again (a sharded replica as a whole)."""
        name = type(exc).__name__ + (" (no answer)" if isinstance(exc, ReplicaLost) and "answer" in str(exc) else "")
        self.exits[name] = self.exits.get(name, 0) + 1
        w.ended_on = name
        self.log.append(f"{self.sim.now:.3f} {w.id}: {name}: {exc}")
        if isinstance(exc, StateLost):
            checks.state_lost(self, w)
        self._leave(w)
        if w.foreign:  # its operator reads the error and fixes the flag
            return
        if w.replica is not None:
            self._replica_lost(w)
        elif self.launcher:
            self._restart_later(w)

    def _restart_later(self, w: Worker) -> None:
        """A launcher starts the worker again once its process ended (a new member)."""
        delay = self.rng.uniform(*RESTART_S)
        self.starting += 1

        def restart() -> None:
            if not (w.exited or w.crashed):
                self.sim.at(self.sim.now + 0.5, restart)
                return
            self.starting -= 1
            live = self.live()
            if live:
                node = self._add_node(live[0].node, in_place_of=w.node if self.in_place else None)
                x = self._start_worker(node, self.sim.now)
                # ftcomm run and ElasticRayJob tell a worker they start again once they saw
                # the group run (FTCOMM_GROUP_RAN).
                x.loop.engine.group_ran = self._group_ran()
                # The launcher gives it the peers its predecessor had: ftcomm run starts a worker
                # again at its address, so each is where that peer's latest start runs now. A
                # job that starts its workers in turn (first_alone: ElasticRayJob) gives it every
                # other worker running now (what _start_worker gave it).
                self.successor[w.node] = node
                if not self.first_alone:
                    x.seeds = tuple(dict.fromkeys(self._latest(seed) for seed in w.seeds
                                                  if self._latest(seed) != node))
                self.fault_log.append((self.sim.now, "restart", x.id))
                self.sim.at(self.sim.now + self.config.join_retry_interval, lambda: self._retry_join(x, 1))
        self.sim.at(self.sim.now + delay, restart)

    def _group_ran(self) -> bool:
        """Whether a view of the job's group formed (its launcher saw the group run)."""
        return any(x.loop.engine.entered_view is not None for x in self.workers.values())

    def _latest(self, node: int) -> int:
        """The node of the latest start of the worker first started on ``node``."""
        while node in self.successor:
            node = self.successor[node]
        return node

    # ------------------------------------------------------------------ the collectives' world
    def collective(self, w: Worker, key: tuple, members: tuple[str, ...], kind: str, payload: Any,
                   combine: Callable[[list], Any], abort: Any, deadline: float | None,
                   duration: Callable[[list], float] | None = None) -> SimOperation:
        """``w`` contributes ``payload`` to operation ``key`` among ``members``. It completes
        once every member contributed, and each member observes it a little later (its own
        latency); a member that crashes, hangs or is cut off before another observed it
        leaves that one waiting (so a step may commit on some members only). A crashed
        member's peers get a connection error at once (their crash fast path declares it
        dead); a lost node or a hung process gives none, only gossip tells. It fails when
        the view's abort signal fires first (gossip news judged on each look, as a waiting
        thread does), and after ``deadline``. ``duration``: the seconds it takes once every
        member contributed, from their payloads (beyond the latency)."""
        contributions = self.operations.setdefault(key, {})
        late = self.observe_rng.uniform(0.0, self.observe_jitter) if self.observe_jitter else 0.0
        contributions[w.id] = (self.sim.now, kind, payload, late)
        workers = [self.by_id[m] for m in members]

        def poll() -> Any:
            now = self.sim.now
            # (members that run different operations at once, as after a step that committed
            # on some of them only, never complete it: their view breaks first)
            if len(contributions) == len(members) and all(c[1] == kind for c in contributions.values()):
                last = max(c[0] for c in contributions.values())
                done_at = last + OP_LATENCY * w.slow + contributions[w.id][3]
                if duration is not None:
                    done_at += duration([c[2] for c in contributions.values()])
                if now >= done_at and self._healthy(w, workers, done_at, key):
                    return combine([contributions[m][2] for m in members])
            if abort.check() is not None:  # the news judged, and the stall watched, as a waiting thread does
                raise CollectiveAborted(abort.reason)
            error = self._crash_error(w, workers, key)
            if error is not None:
                raise error
            if deadline is not None and now >= deadline:
                raise FtcommTimeout(f"operation {key} did not complete in time")
            return UNDER_WAY
        return SimOperation(poll)

    def formed(self, w: Worker, view: View, abort: Any, entered: float) -> Any:
        """Polls ``w``'s forming of ``view``: formed once every member entered its formation
        and every pair of members can reach each other."""
        key = (view.id, view.digest)
        members = [self.by_id[m] for m in view.members]
        arrivals = self.formations.get(key, {})
        if abort.check() is None and self._connected(w, members, key) and all(m in arrivals for m in view.members):
            if self.sim.now >= max(arrivals.values()) + FORM_LATENCY:
                return None
            return UNDER_WAY
        error = self._crash_error(w, members, key)
        if error is not None:
            raise error
        if abort.reason is not None:
            raise CollectiveAborted(abort.reason)
        if self.sim.now - entered >= self.formation_timeout:
            raise FtcommTimeout(f"view {view.id} did not form within {self.formation_timeout:g} s")
        return UNDER_WAY

    def replica_decision(self, w: Worker, key: tuple, vote: bool, abort: Any) -> SimOperation:
        """Replica.decide: a write-once slot per process of ``w``'s replica in the replica's
        store (its shard 0 serves it: ReplicaLost once that process is gone); ``w`` writes
        its vote, then reads each partner's slot, writing a veto into one it gives up on
        (the view's abort signal fired, or ``formation_timeout`` passed)."""
        replica = w.replica[0]
        slots = self.slots
        own = (replica, key, w.shard)
        slots.setdefault(own, "1" if vote else "0")
        deadline = self.sim.now + self.options.formation_timeout
        partners = [(replica, key, shard) for shard in range(self.k) if shard != w.shard]

        def poll() -> Any:
            if any(x.replica == (replica, 0) and (x.crashed or x.exited) for x in self.workers.values()):
                raise ReplicaLost(f"the store of replica {replica} is gone")
            if any(slot not in slots for slot in partners):
                if abort.check() is None and self.sim.now < deadline:
                    return UNDER_WAY
                for slot in partners:
                    slots.setdefault(slot, "veto")
            return slots[own] == "1" and all(slots[slot] == "1" for slot in partners)
        return SimOperation(poll)

    def abandon(self, w: Worker) -> None:
        for entry in w.comms:
            if entry[0] == w.loop.ports.communicators.comm:
                entry[1] = True

    def _healthy(self, w: Worker, members: list[Worker], done_at: float, key: Any) -> bool:
        """Every member stayed up and reachable until ``w`` observed the completion."""
        cache = (self.sim.now, key)
        if self._healthy_cache[0] != cache:  # once per tick and operation: the earliest crash, any hang
            first_crash = min((x.crashed_at for x in members), default=float("inf"))
            self._healthy_cache = (cache, first_crash, any(x.hung for x in members))
        _, first_crash, hung = self._healthy_cache
        if hung or first_crash < done_at:
            return False
        return not self.sim.partitioned or not any(self.cut_off(w, x) for x in members)

    def _connected(self, w: Worker, members: list[Worker], key: Any) -> bool:
        """Every member runs and ``w`` can reach it (as forming needs)."""
        cache = (self.sim.now, key)
        if self._down_cache[0] != cache:  # once per tick: a member crashed, exited or hung
            self._down_cache = (cache, any(x.crashed or x.exited or x.hung for x in members))
        if self._down_cache[1]:
            return False
        return not self.sim.partitioned or not any(self.cut_off(w, x) for x in members)

    def _crash_error(self, w: Worker, members: list[Worker], key: Any) -> CommunicatorError | None:
        """The connection error a crashed member gives ``w``'s communicator."""
        cache = (self.sim.now, key)
        if self._crashed_cache[0] != cache:  # once per tick
            self._crashed_cache = (cache, [x for x in members if (x.crashed or x.exited)
                                           and self.sim.now - min(x.crashed_at, x.exited_at) >= CRASH_ERROR_DELAY])
        crashed = [x for x in self._crashed_cache[1] if not self.cut_off(w, x)]
        return CommunicatorError(f"{crashed[0].id} refused a connection") if crashed else None

    def cut_off(self, a: Worker, b: Worker) -> bool:
        return self.sim.blocked(a.node, b.node)

    def _noted(self, text: str) -> None:
        self.log.append(f"{self.sim.now:.3f} {text}")

    def violation(self, number: int, text: str) -> None:
        how = (f"GroupSimulation({self.seed}, n={self.n}, replica_size={self.k}, faults=<this run's scripted "
               f"schedule>).run()" if self.scripted
               else f"python -m ftcomm.groupsim --seed {self.seed}" + (f" --replica-size {self.k}" if self.k > 1 else "")
               + (" --starve" if self.starvations else "") + (" --collect" if self.collect_draws else "")
               + (" --repair" if self.repair else ""))
        raise InvariantViolation(f"invariant {number} violated at t={self.sim.now:.3f} (seed {self.seed}): {text}; "
                                 f"reproduce: {how}")

    # ------------------------------------------------------------------ faults
    def _draw_faults(self) -> list:
        """Sparse schedules (one to five faults, seconds apart) or dense ones (up to fifteen,
        overlapping); the first may strike from t = 0, before the first view formed."""
        rng, faults = self.rng, []
        t = rng.uniform(0.0, 3.0)
        network_free_at = 0.0
        kinds = ["crash", "hang", "node_loss", "partition", "join", "leave", "leave_after_commit", "slow"]
        count, gaps = (rng.randint(5, 15), (0.05, 1.0)) if self.dense else (rng.randint(1, 5), (0.5, 5.0))
        for i in range(count):
            if i:
                t += rng.uniform(*gaps)
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
                faults.append((t, kind, {"pick": rng.random(), "factor": rng.uniform(3, 10),
                                         "length": rng.uniform(2, 12)}))
        return faults

    def _pick(self, frac: float, exclude_last: bool = True) -> Worker | None:
        live = self.live()
        if self.k > 1:  # a process of a replica that is whole and not being started again
            live = [w for w in live if w.replica[0] not in self.restarting]
            if exclude_last and len({w.replica[0] for w in live}) <= self.keep_live:  # keep a group to recover
                return None
        if not live or (len(live) <= self.keep_live and exclude_last):  # keep a group to recover
            return None
        return live[int(frac * len(live)) % len(live)]

    def _infant_fault(self, kind: str, args: dict, w: Worker) -> None:
        """A fault of its own strikes ``w`` soon after its start (see ``infant``). One cut at
        a time: a node loss or partition that would overlap another cut (one active, or one
        the schedule starts before this one would heal) strikes as a crash instead."""
        now = self.sim.now
        if w not in self.live():
            return
        if kind in ("node_loss", "partition"):
            later = [t for t, k, _ in self.faults if k in ("node_loss", "partition") and t > now]
            room = min(later, default=float("inf")) - now - 0.5
            if self.partition is not None or room < 0.3:
                kind = "crash"
            else:
                args = {**args, "length": min(args["length"], room)}
        self.end_faults = max(self.end_faults, now + (args["length"] if kind != "crash" else 0.0))
        self._fault(kind, args, target=w)

    def _fault(self, kind: str, args: dict, target: Worker | None = None) -> None:
        """One fault of the schedule. With sharded replicas a fault strikes as it does where
        each replica is one host: a crash or hang strikes one process, a node loss and a
        partition whole replicas, a join and a leave (scaling) a whole replica. ``target``:
        the worker a crash, hang or node loss strikes, or that a partition cuts off alone
        (with its replica), instead of one drawn (live: see _infant_fault)."""
        now = self.sim.now
        self.fault_times.append(now)
        if kind in ("hang", "node_loss", "partition"):
            self.fault_times.append(now + args["length"])
        if kind != "slow":  # a recovery still under way waits for this fault too: not isolated
            self.pending_recovery = [(t, k, survivors, False) for t, k, survivors, _ in self.pending_recovery]
        if self.k > 1 and kind in ("join", "partition", "node_loss", "leave", "leave_after_commit"):
            self._replica_fault(kind, args, target)
            return
        if kind == "join":
            live = self.live()
            if not live:
                return
            node = self._add_node(live[0].node)
            foreign = self.misconfigured and not any(x.foreign for x in self.workers.values())
            w = self._start_worker(node, now, foreign=foreign)
            self.fault_log.append((now, "join with other settings" if foreign else kind, w.id))
            self.sim.at(now + self.config.join_retry_interval, lambda: self._retry_join(w, 1))
            return
        if kind == "slow":
            w = self._pick(args["pick"], exclude_last=False)
            if w is None:
                return
            w.slow = args["factor"]

            def recovered() -> None:
                w.slow = 1.0
            self.sim.at(now + args["length"], recovered)
            self.fault_log.append((now, kind, w.id))
            return
        if kind == "partition":
            live = self.live()
            if len(live) < 2:
                return
            cut = max(1, min(len(live) - 1, int(args["split"] * len(live)) or 1))
            side_a = {w.node for w in live[:cut]}
            if target is not None:  # its link fails: it alone on one side
                side_a = {w.node for w in live if w is not target}
            side_b = set(range(len(self.sim.nodes))) - side_a
            self.disturbed_until = max(self.disturbed_until, now + args["length"])
            self._cut(now, side_a, side_b, args["length"], kind)
            return
        w = self._pick(args["pick"])
        if w is None:
            return
        w = target or w
        self.fault_log.append((now, kind, w.id))
        survivors = self._survivors({w.id})
        isolated = self._isolated(w)
        if not self._in_a_view(w):  # already out of every survivor's view: nothing to recover from
            survivors = set()
        if kind in ("hang", "node_loss"):
            self.disturbed_until = max(self.disturbed_until, now + args["length"])
        if self.k > 1:  # the other replicas survive it
            survivors = self._survivors({x.id for x in self.live() if x.replica[0] == w.replica[0]})
        if kind == "crash":
            self.pending_recovery.append((now, kind, survivors, isolated))
            self._killed(w)
        elif kind == "hang":
            w.hung = True
            self.sim.nodes[w.node].stalled = True
            self.pending_recovery.append((now, kind, survivors, isolated))
            self.sim.at(now + args["length"], lambda: self._unhang(w))
            if self.stop_kills and self.stop_rng.random() < self.stop_kills:
                self.sim.at(now + self.stop_rng.uniform(*KILL_STOPPED_S), lambda: self._kill_stopped(w))
        elif kind == "node_loss":
            others = set(range(len(self.sim.nodes))) - {w.node}
            self._cut(now, {w.node}, others, args["length"], kind, (survivors, isolated))
        elif kind in ("leave", "leave_after_commit"):
            if kind == "leave":
                self._leave(w)
            else:
                w.leave_after_commit = True
            self.pending_recovery.append((now, "leave", survivors, isolated))

    def _corrupt(self, pick: float, again: float, w: Worker | None = None) -> None:
        """A member's state goes wrong without a commit (see ``corrupt``): a live member in a
        view, with its state registered, drawn by ``pick`` (or ``w`` again); ``again``: the
        same member's state goes wrong once more this many seconds later (0: not again)."""
        now = self.sim.now
        if w is None:
            held = [x for x in self.live() if x.loop.engine.view is not None and x.state.registered and not x.hung]
            if not held:
                return
            w = held[int(pick * len(held)) % len(held)]
        elif w.crashed or w.exited or w.loop.engine.view is None:
            return
        value = self.corrupt_rng.getrandbits(62)
        self.taint[value] = w.loop.step
        w.state.value = value
        self.corruptions.append((now, w.id))
        self.fault_log.append((now, "corrupt", w.id))
        self.fault_times.append(now)
        if again:
            self.sim.at(now + again, lambda: self._corrupt(0.0, 0.0, w))

    def _survivors(self, struck: set[str]) -> set[str]:
        """The live workers a fault on ``struck`` leaves, whose next commit in a newer view
        ends its recovery; a straggler standing aside is not among them: it comes back when
        its own time aside ends, as a join does, whatever struck the others. (Where every
        one left stands aside, they are the group: their return is its recovery.)"""
        left = {x.id for x in self.live() if x.id not in struck}
        return {m for m in left if not self.by_id[m].loop.engine.aside} or left

    # ------------------------------------------------------------------ sharded replicas
    def _replicas(self) -> dict[str, list[Worker]]:
        """The live workers of each replica, by key, in start order."""
        out: dict[str, list[Worker]] = {}
        for w in self.live():
            out.setdefault(w.replica[0], []).append(w)
        return out

    def _replica_fault(self, kind: str, args: dict, target: Worker | None = None) -> None:
        now = self.sim.now
        if kind == "join":
            if self.live():
                self._start_replica(now)
            return
        replicas = [r for key, r in self._replicas().items() if key not in self.restarting]
        if kind == "partition":
            if len(replicas) < 2:
                return
            cut = max(1, min(len(replicas) - 1, int(args["split"] * len(replicas)) or 1))
            side_a = {w.node for r in replicas[:cut] for w in r}
            if target is not None:  # the replica's hosts are cut off together
                side_a = {w.node for r in replicas if r[0].replica[0] != target.replica[0] for w in r}
            self.disturbed_until = max(self.disturbed_until, now + args["length"])
            self._cut(now, side_a, set(range(len(self.sim.nodes))) - side_a, args["length"], kind)
            return
        if len(replicas) <= 2:  # keep a group to recover
            return
        victims = replicas[int(args["pick"] * len(replicas)) % len(replicas)]
        if target is not None:
            victims = next((r for r in replicas if r[0].replica[0] == target.replica[0]), None)
            if victims is None:  # its replica is being started again
                return
        self.fault_log.append((now, kind, f"replica {victims[0].replica[0]}"))
        ids = {w.id for w in victims}
        survivors = self._survivors(ids)
        isolated = all(self._isolated(w) for w in victims)
        if not any(self._in_a_view(w) for w in victims):  # already out of every survivor's view
            survivors = set()
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

    def _start_replica(self, now: float, in_place_of: list[int] | None = None) -> list[Worker]:
        """A replica's K processes start (a new one, or a failed one started again, on the
        nodes ``in_place_of`` by shard): each joins through a live worker and retries as
        ``ftcomm.init`` does."""
        key = f"R{self.replicas_started}"
        self.replicas_started += 1
        seed = self.live()[0].node
        started = []
        for shard in range(self.k):
            node = self._add_node(seed, in_place_of[shard] if in_place_of else None)
            self.replica_of[node] = (key, shard)
            w = self._start_worker(node, now)
            self.sim.at(now + self.config.join_retry_interval, lambda w=w: self._retry_join(w, 1))
            started.append(w)
        self.fault_log.append((now, "replica_start", key))
        return started

    def _replica_lost(self, w: Worker, grace: float = REPLICA_HALT_S) -> None:
        """``w``, a process of a sharded replica, ended other than finished: the launcher
        repairs the replica in place where it can (ftcomm.ops.launcher._repairs_in_place),
        else starts it again as a whole."""
        key = w.replica[0]
        others = [x for x in self.workers.values() if x.replica is not None and x.replica[0] == key and x is not w]
        if (self.repair and key not in self.restarting and key not in self.repairs
                and self.sim.now - self.repaired_at.get(key, -REPAIR_SETTLE_S) >= REPAIR_SETTLE_S
                and others and all(not (x.crashed or x.exited or x.gone) and x.state.registered for x in others)):
            # (each of the others said it can be repaired: its state registered, see RepairChannel.declare)
            self._replica_repair(w)
            return
        job = self.repairs.get(key)
        if job is not None and not job["formed"]:
            job["failed"] = True  # (its replacement, never formed, exits at its timeout)
        self._replica_failed(key, grace)

    def _replica_repair(self, w: Worker) -> None:
        """ftcomm run repairs ``w``'s replica in place: a process for its shard starts (after
        a warm standby's or a cold start's delay) under the replica's next key, and forms the
        replica with the others once each of them waits for it (:meth:`_repair`)."""
        key, shard = w.replica
        new = f"R{self.replicas_started}"
        self.replicas_started += 1
        now = self.sim.now
        job = {"new": new, "shard": shard, "node": w.node, "ready_at": now + self.repair_rng.uniform(*REPAIR_BOOT_S),
               "formed": False, "failed": False, "began": now}
        self.repairs[key] = job
        self.starting += 1
        self.fault_log.append((now, "replica_repair", f"{key} shard {shard} -> {new}"))
        self.sim.at(job["ready_at"], lambda: self._form_repaired(key))

    def _form_repaired(self, key: str) -> None:
        """The replacement of ``key``'s lost process meets the others (Replica.reform): once
        every one of them waits for it; never when one of them ended meanwhile (the
        launcher then starts the replica again as a whole), nor after the replacement's
        timeout (``init_timeout``: it exits, and so does the replica)."""
        job = self.repairs[key]
        if job["formed"] or job["failed"]:
            self.starting -= job["failed"] and not job.get("counted", False)
            job["counted"] = True
            return
        survivors = [x for x in self.workers.values() if x.replica is not None and x.replica[0] == key
                     and x.node != job["node"]]
        now = self.sim.now
        if any(x.gone and not (x.crashed or x.exited) for x in survivors):
            # one of them leaves (the job scaled the replica down): the replacement is stopped
            # with it, and nothing starts again
            job["failed"], job["counted"] = True, True
            self.starting -= 1
            return
        if any(x.crashed or x.exited for x in survivors) or now > job["ready_at"] + self.options.init_timeout:
            job["failed"], job["counted"] = True, True
            self.starting -= 1
            self._replica_failed(key, REPLICA_HALT_S)
            return
        if not all(x.repairing == key and not x.hung for x in survivors):  # (a stopped one cannot meet it)
            self.sim.at(now + 0.02, lambda: self._form_repaired(key))
            return
        for y in survivors:  # formed: each process holds the replica's new key now (Replica.reform)
            y.replica = (job["new"], y.replica[1])
            self.replica_of[y.node] = y.replica
        seed = next((x.node for x in self.live() if x.replica is None or x.replica[0] != key), survivors[0].node)
        node = self._add_node(seed, job["node"] if self.in_place else None)
        self.replica_of[node] = (job["new"], job["shard"])
        x = self._start_worker(node, now)
        x.loop.engine.group_ran = self._group_ran()
        x.seeds = tuple(dict.fromkeys([y.node for y in survivors] + [seed]))
        self.sim.at(now + self.config.join_retry_interval, lambda: self._retry_join(x, 1))
        job["formed"], job["counted"] = True, True
        self.starting -= 1
        self.repaired_at[job["new"]] = job["began"]  # (the launcher times the settling from the failure)
        self.fault_log.append((now, "replica_formed", f"{job['new']}: {', '.join(y.id for y in survivors)}, {x.id}"))

    def _watch(self, w: Worker) -> tuple[str, int] | None:
        """ReplicaWatch's first rule, as ``w``'s agreement loop reads it (WorkerLoop.replica_lost):
        a process of its replica that its gossip table shows dead, or no longer holds
        (removed after it was declared dead), tears the replica down."""
        key = w.replica[0]
        states = {r.id: r.state for r in w.loop.ports.membership.records()}
        for x in self.workers.values():
            if x is not w and x.replica is not None and x.replica[0] == key and x.crashed \
                    and states.get(x.id, "dead") == "dead":
                return f"{x.id}, a process of this replica, died", x.replica[1]
        return None

    def _repair(self, w: Worker, exc: ReplicaLost, where: str) -> Generator:
        """What FaultTolerantGroup._repair does with the launcher's repair: ``w`` leaves its
        view, asks the launcher to kill a partner that is hung, waits (up to
        ``init_timeout``) for the replacement to form the replica again, takes the replica's
        new key and joins the group again with it. ``exc`` again when it cannot be repaired
        (a partner that left gracefully, no repair, no other replica holding the state)."""
        loop, key = w.loop, w.replica[0]
        if not self.repair or exc.left or (loop.step > 0 and not state_elsewhere(key, loop.engine.config,
                                                                                 loop.driver.statuses()[0])):
            raise exc
        began = self.sim.now
        loop.repair_replica("its sharded replica lost a process", where)
        for x in list(self.workers.values()):
            # its `lost SHARD PID` report (the shard the error names, a partner its watch found
            # stopped): the launcher kills that process if it still runs, to replace it
            if x.replica is not None and x.replica[0] == key and x is not w and not (x.crashed or x.exited) \
                    and (x.hung or x.replica[1] == exc.shard):
                self.fault_log.append((began, "reported_lost", x.id))
                x.hung = False
                self._killed(x)
        w.repairing = key
        while True:
            job = self.repairs.get(key)
            if job is not None and job["formed"]:
                break
            if self.sim.now - began > self.options.init_timeout or job is not None and job["failed"]:
                w.repairing = None
                raise ReplicaLost(f"no process replaced the lost one of replica {key} "
                                  f"({'its repair failed' if job is not None else 'none started'})")
            yield Sleep(self.sim.now + 0.02)
        w.repairing = None
        loop.driver.replica_formed(job["new"])
        yield from loop.recover("replica repair", began)

    def _replica_failed(self, key: str, grace: float = REPLICA_HALT_S) -> None:
        """A process of replica ``key`` crashed, or exited on an error: the launcher stops
        the others (SIGTERM: a graceful leave; one that is stopped cannot leave and is
        killed after ``grace``, REPLICA_KILLED_HALT_S after a crash) and starts the replica
        again once none of them runs."""
        if key in self.restarting:
            return
        self.restarting.add(key)
        now = self.sim.now
        shards = {w.replica[1]: w.node for w in self.workers.values() if w.replica is not None and w.replica[0] == key}
        hosts = [shards[i] for i in range(self.k)] if len(shards) == self.k else None
        for w in self.workers.values():
            if w.replica is not None and w.replica[0] == key and not w.crashed and not w.exited:
                self.sim.at(now + 0.05, lambda w=w: self._leave(w))
                self.sim.at(now + grace, lambda w=w: None if w.crashed or w.exited else self._crash(w))

        self.starting += 1

        def restart() -> None:
            if any(w.replica is not None and w.replica[0] == key and not w.crashed and not w.exited
                   for w in self.workers.values()):
                self.sim.at(self.sim.now + 0.5, restart)
                return
            self.starting -= 1
            self.restarting.discard(key)
            if self.live():
                group_ran = self._group_ran()
                for x in self._start_replica(self.sim.now, hosts if self.in_place else None):
                    x.loop.engine.group_ran = group_ran
        self.sim.at(now + REPLICA_RESTART_S, restart)

    def _in_a_view(self, victim: Worker) -> bool:
        """A live worker other than ``victim`` runs or forms a view with it."""
        return any(victim.id in (x.loop.engine.forming or x.loop.engine.view).member_set
                   for x in self.live() if x is not victim and (x.loop.engine.forming or x.loop.engine.view))

    def _isolated(self, victim: Worker) -> bool:
        """The fault strikes a settled group: every live member runs one view of all of them,
        the victim among them, and no other fault is active (a hang, node loss or partition,
        or a fault not yet recovered from); it stays isolated unless another fault (but a
        slow member) strikes before its recovery completes."""
        view = self._settled_view(self.live())
        return (view is not None and victim.id in view.member_set and self.sim.now >= self.disturbed_until
                and not self.pending_recovery)

    def _retry_join(self, w: Worker, attempt: int) -> None:
        """ftcomm.init sends a join request to every peer it was given (``w.seeds``: the
        workers that ran when it started), again every ``join_retry_interval`` until one
        answers; after ``join_timeout`` it fails with JoinError."""
        node = self.sim.nodes[w.node]
        if w.crashed or w.gone or node.protocol.num_members() > 1:
            return
        if attempt * self.config.join_retry_interval > self.config.join_timeout:
            self._failed(w, JoinError("no seed answered within the join timeout"))
            return
        for seed in w.seeds:
            self.sim.join_through(w.node, seed)
        self.sim.at(self.sim.now + self.config.join_retry_interval, lambda: self._retry_join(w, attempt + 1))

    def _cut(self, now: float, side_a: set[int], side_b: set[int], length: float, kind: str,
             survivors: tuple[set[str], bool] | None = None) -> None:
        ids = {i: self.sim.member_id(i) for i in range(len(self.sim.nodes))}
        before = max((w.loop.engine.view for w in self.live() if w.loop.engine.view is not None),
                     key=lambda v: v.id, default=None)
        self.partition = (frozenset(ids[i] for i in side_a), frozenset(ids[i] for i in side_b), before)
        # Members that left gracefully, or stood aside from that view (a straggler, a process
        # whose partner was silent), before the cut: gone for the quorum, as in the engine's
        # rule (ftcomm.core.view.gone_from).
        self.partition_left = {x.id for x in self.workers.values() if not x.crashed and (
            x.gone or (before is not None and x.loop.engine.benched == before.id))}
        self.sim.partition(side_a, side_b)
        self.fault_log.append((now, kind, f"{sorted(ids[i] for i in side_a)}"))
        if survivors is not None:
            self.pending_recovery.append((now, kind, *survivors))
        self.sim.at(now + length, self._heal)

    def _add_node(self, seed: int, in_place_of: int | None = None) -> int:
        """A new node that joins through node ``seed``; during a cut it is on ``seed``'s side.
        ``in_place_of``: a node whose process is gone, on whose host (its address, its side
        of a cut) the new process starts, as a launcher starts a worker again where it ran."""
        node = self.sim.add_node(seed_index=seed, in_place_of=in_place_of)
        seed = seed if in_place_of is None else in_place_of
        if self.partition is not None:
            side_a, side_b, before = self.partition
            new, seed_id = self.sim.member_id(node), self.sim.member_id(seed)
            self.partition = ((side_a | {new}, side_b, before) if seed_id in side_a
                              else (side_a, side_b | {new}, before))
        return node

    def _heal(self) -> None:
        self.partition = None
        self.healed_at = self.sim.now
        self.sim.heal()

    def _crash(self, w: Worker) -> None:
        w.crashed = True
        w.crashed_at = self.sim.now
        if w.script is not None:
            w.script.close()
            w.script = None
        self.sim.nodes[w.node].crashed = True
        for entry in w.comms:  # the process is gone: so are its communicators
            entry[1] = True

    def _kill_stopped(self, w: Worker) -> None:
        """The launcher kills ``w``, stopped since its hang began (see KILL_STOPPED_S): gone
        like a crashed process, and started again (a sharded replica as a whole)."""
        if not w.hung or w.crashed or w.exited:
            return
        self.fault_log.append((self.sim.now, "stopped_killed", w.id))
        w.hung = False
        self._killed(w)

    def _killed(self, w: Worker) -> None:
        """``w``'s process died by a signal: the launcher stops the rest of a sharded replica
        and starts it again, or starts a plain worker again."""
        self._crash(w)
        if self.k > 1:
            self._replica_lost(w, REPLICA_KILLED_HALT_S)
        elif self.launcher:
            self._restart_later(w)

    def _unhang(self, w: Worker) -> None:
        if w.crashed:  # killed by its launcher meanwhile
            return
        w.hung = False
        w.resumed_at = self.sim.now
        self.sim.resume(w.node)

    # ------------------------------------------------------------------ gossip side
    def _on_event(self, index: int, event) -> None:
        w = self.workers.get(index)
        if w is None or w.crashed or w.exited:
            return
        if w.news is not None:
            if event.kind == "joined":  # (again, if it was forgotten: it moved to the end of the table)
                w.news.pop(event.member.id, None)
                w.news[event.member.id] = True
            else:
                w.news.setdefault(event.member.id, False)
        # The gossip thread posts; the worker's waiting thread, woken at once, judges it.
        w.loop.news.post(event)
        w.loop.news.judge()

    def statuses(self, w: Worker) -> dict[str, Status]:
        """What the membership port's statuses returns, read again only after a membership
        event at this member (or its own record changed): the members with news are read
        again, or the whole table when that cannot keep its order. (A performance measure:
        a test checks it reads what a read of the whole table gives.)"""
        if w.statuses is not None and w.news is not None and not w.news:
            return w.statuses
        protocol = self.sim.nodes[w.node].protocol
        if w.statuses is None or w.news is None or not self._read_news(w, protocol):
            w.statuses = self.read_statuses(w)
        w.news, w.table_size, w.read_view = {}, protocol.table_size(), w.loop.engine.view
        return w.statuses

    def _read_news(self, w: Worker, protocol) -> bool:
        """Update ``w.statuses`` for the members with news; False when only reading the whole
        table gives the same result: a member was forgotten (no event says so), or one enters
        the list anywhere but at its end (the table's order is the list's). A member's address
        never changes here, so neither does its confirmation without an event."""
        news = w.news
        view = w.loop.engine.view
        if view is not w.read_view or protocol.table_size() != w.table_size + sum(news.values()):
            return False
        statuses, own = w.statuses, w.id
        for member_id, joined in news.items():
            info = protocol.member(member_id)
            status = None
            if readable(member_id, info.confirmed, own, view):
                status = self.status(member_id, info.state, info.metadata)
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

    def read_statuses(self, w: Worker) -> dict[str, Status]:
        protocol = self.sim.nodes[w.node].protocol
        own, view = w.id, w.loop.engine.view
        decoded = self._decoded
        out = {}
        for member_id, state, metadata, confirmed in protocol.member_states():
            if not readable(member_id, confirmed, own, view):
                continue
            status = decoded.get((member_id, state, metadata), _UNDECODED)
            if status is _UNDECODED:
                status = self.status(member_id, state, metadata)
            if status is not None:
                out[member_id] = status
        return out

    def status(self, member_id: str, state: str, metadata: bytes) -> Status | None:
        """A member's decoded record: a pure function of what gossip holds, decoded once per
        simulation (every member decodes the same records)."""
        key = (member_id, state, metadata)
        status = self._decoded.get(key, _UNDECODED)
        if status is _UNDECODED:
            status = self._decoded[key] = decode_record(member_id, state, decode_metadata(metadata))
        return status

    # ------------------------------------------------------------------ recoveries and the end
    def _check_recoveries(self) -> None:
        """A fault is recovered from once every survivor committed in a newer view; the time
        counts from when the world allowed it: the fault, or the last change of the world
        before the recovery completed (a fault struck or healed, a worker started, a joiner
        registered its state: overlapping faults hold a recovery up, and so do a
        ``min_workers`` that waits for a restarted worker and a joiner that builds its model
        after ``init``)."""
        now = self.sim.now
        still = []
        for t, kind, survivors, isolated in self.pending_recovery:
            live = {s for s in survivors if not self.by_id[s].crashed and not self.by_id[s].gone}
            done = all(any(c[0] > t and c[2] > self._view_at(s, t) for c in self.by_id[s].committed) for s in live)
            if done and live:
                first = [min((c for c in self.by_id[s].committed if c[0] > t and c[2] > self._view_at(s, t)))
                         for s in live]
                last = max(c[0] for c in first)
                newest = max((c[1] for w in self.workers.values() for c in w.committed if c[0] <= t), default=0)
                if min(c[1] for c in first) < newest:
                    # The survivors went on from an older state than the group's newest (every
                    # worker that held it is gone): the group started over, it did not recover.
                    self.started_over.append((kind, round(t, 3)))
                    continue
                allowed = max([t] + [x for x in self.fault_times if t < x <= last])
                (self.recovery if isolated else self.recovery_overlapping).setdefault(kind, []).append(
                    round(last - allowed, 4))
                self.recoveries.append((kind, round(t, 3), round(allowed, 3), round(last - allowed, 4), isolated))
            elif live and now - t < self.liveness_bound + self.duration:
                still.append((t, kind, survivors, isolated))
        self.pending_recovery = still

    def _view_at(self, member: str, t: float) -> int:
        commits = [c for c in self.by_id[member].committed if c[0] <= t]
        return commits[-1][2] if commits else 0

    def _settled_view(self, live: list[Worker]) -> View | None:
        """The view every live member runs, when it holds exactly the live members."""
        views = {w.loop.engine.view for w in live}
        if len(views) != 1 or None in views or any(w.loop.engine.state != core.RUNNING for w in live):
            return None
        view = next(iter(views))
        return view if set(view.members) == {w.id for w in live} else None

    def _settled(self) -> bool:
        """Every live member runs one view of exactly the live members and committed in it
        since the faults stopped."""
        live = self.live()
        view = self._settled_view(live)
        return view is not None and all(
            w.committed and w.committed[-1][2] == view.id and w.committed[-1][0] >= max(self.end_faults, self.last_start)
            for w in live)

    def run(self) -> Outcome:
        import time
        started = time.perf_counter()
        violation = None
        try:
            end, t = self.end_faults + self.liveness_bound, 0.0
            while True:
                t = min(end, t + 1.0)
                self.sim.run_until(t)
                if (self.settled_at is not None and not self.starting and not self._foreign_waiting(t)
                        and t >= max(self.end_faults, self.settled_at + SETTLED_RUN_S)):
                    break  # every live worker runs one view and commits, and nobody is on the way
                if t < end:
                    continue
                # A worker started late (a launcher's restart after the last fault) gets the same bound.
                if self.last_start + self.liveness_bound <= end or end >= self.end_faults + 4 * self.liveness_bound:
                    break
                end = self.last_start + self.liveness_bound
            checks.at_end(self)
        except InvariantViolation as exc:
            violation = str(exc)
        commits = sum(len(w.committed) for w in self.workers.values())
        views = len({c[2] for w in self.workers.values() for c in w.committed})
        settle = round(self.settled_at - self.end_faults, 4) if self.settled_at is not None else None
        return Outcome(self.seed, self.n, violation is None, violation,
                       [(round(t, 3), k, m) for t, k, m in self.fault_log], commits, views,
                       self.recovery, self.recovery_overlapping, settle, self.quorum_survived, self.rolled_back,
                       round(time.perf_counter() - started, 3), self.min_workers, dict(self.exits), self.recoveries,
                       self.started_over, self.first_alone, [w[:3] for w in self.starvations],
                       self.starved_excluded, len(self.corruptions), self.wrong_commits,
                       (len(self.repairs), sum(job["formed"] for job in self.repairs.values())),
                       (sum(len(w.collections) for w in self.workers.values()),
                        sum(node.protocol.stats.get("pause_holds", 0) for node in self.sim.nodes)))
