"""The worker loop: everything one worker does to its group, as coroutines over ports.

:class:`WorkerLoop` is the one program of a worker between the public API and the world.
It holds the committed step count and runs the phases of a re-formation and of a step::

    recover:   detect -> agree -> form (+ verify) -> reconcile -> run
    a step:    boundary (re-form, join, stand aside, reconcile as the engine says is due)
               -> contribute -> wait (abort on news) -> confirm after a stall
               -> verdict (commit or discard, a joiner admitted, a straggler chosen)
               -> commit (counted; the record published; stragglers judged)
    leave:     record and departure notice -> let the others finish -> closed

Every decision is the engine's (:mod:`ftcomm.core.engine`: the state table, the boundary
dispatch :meth:`~ftcomm.core.engine.Engine.due`, the retry counter, the verdict) or the
driver's, which performs the engine's actions (:mod:`ftcomm.runtime.driver`); everything
done to the world goes through the ports (:mod:`ftcomm.runtime.ports`). Control goes one
way: the API calls the loop, the loop calls the driver and the ports, and nothing calls
back up.

Each phase is a generator: where it waits it yields a :class:`~ftcomm.runtime.ports.Pending`
operation or a :class:`~ftcomm.runtime.ports.Pause` and receives the result. A worker process
runs them to completion with :func:`ftcomm.runtime.live_ports.run` (blocking, in real time);
the whole-group simulation (:mod:`ftcomm.sim`) resumes them tick by tick in virtual time, so
every seed runs this code.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Generator, TypeVar

from ..core import engine as core
from ..core.engine import Divergence, Engine, fingerprint_verdict, shard_sources, view_lineage
from ..core.view import View
from ..errors import (CollectiveAborted, CommunicatorError, FtcommError, FtcommTimeout, MembershipChanged,
                      OutOfStep, QuorumLost, ReplicaLost, RetryLimitExceeded, StateDiverged, StateLost)
from ..options import GroupOptions, ViewChange
from .driver import AwaitingState, Driver
from .fingerprints import ACTIONS, SDC_REPEAT_CHECKS, FingerprintCheck, step_action
from .news import GossipNews
from .ports import Contribution, Counters, Formed, Pause, Ports, Reconciled, StateSummary
from .stragglers import Stragglers

log = logging.getLogger(__name__)

T = TypeVar("T")
Step = Generator[Any, Any, T]
"""A phase of the loop: yields Pending operations and Pauses, returns ``T``."""

BEFORE_STEP, IN_STEP = 0, -1
"""Places in the training a worker tells in a view's verification (see WorkerLoop._place):
at a step boundary, or after a step that failed (its next collective follows a step's
compute: a call before the step, or the step's reduction), and in a gradient step whose
gradients are computed (the step's reduction is its next collective). Members whose next
collectives differ find the view not aligned, and calls outside the steps give way."""
LOOK_INTERVAL_S = 0.02
"""While agreeing, the membership is looked at again after news, or after this long."""
WAIT_NOTICE_S = 5.0
"""A re-formation still waiting this long says why (then every ``WAIT_REPEAT_S``)."""
WAIT_REPEAT_S = 30.0


def _names(items: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``items``, and how many more, for a notice."""
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


class WorkerLoop:
    """One worker's steps and views (see the module docstring).

    ``engine``: its lifecycle core; ``ports``: the world; ``options``: the group's;
    ``stragglers``: its compute times and judgments; ``notice(text)``: told what an
    operator wants to know (it rejoins the group), a warning in the log unless given.
    """

    def __init__(self, engine: Engine, ports: Ports, options: GroupOptions, stragglers: Stragglers,
                 notice: Callable[[str], None] | None = None) -> None:
        self.engine, self.ports, self.options, self.stragglers = engine, ports, options, stragglers
        self.state = ports.state
        membership = ports.membership
        self.news = GossipNews(engine, membership.table, lambda: self.driver.ops, options.leave_grace,
                               self.watch_stall, membership.decode, ports.clock.now)
        """Gossip news (posted by the gossip layer) and the abort signal of the view formed or run."""
        self.driver = Driver(engine, ports, self.news, lambda: (self.step, stragglers.compute.median()), notice)
        self.step = 0  # committed steps
        self.events: list[ViewChange] = []  # every view change, oldest first
        now = ports.clock.now()
        self.op_began = now  # when the operation in flight began (the previous one ended)
        self.contributed_at = now  # when this worker's share of it was handed over
        self.waiting_since = now  # when the operation that may fail began to wait (detection counts from there)
        # Where in the training this worker is (see _place): BEFORE_STEP at a step boundary or
        # after a step that failed (its next collective comes after computing a step),
        # IN_STEP in a gradient step whose gradients are computed (its reduction is next);
        # before its first call, where that call is if it is one outside a gradient step (a
        # restore, say).
        self.position = 2
        self._calls = 0  # calls outside gradient steps completed since the last gradient step
        self._in_call = False  # inside execute or a collective (a nested collective is part of it)
        self.formations = 0  # views formed (and verified) by this worker
        self._settled = 0  # views formed before this worker's last completed gradient reduction or call
        self._reductions = 0  # gradient reductions started in the current view (names a step's replica decision)
        # why this worker's sharded replica was torn down, and the lost shard where known (None: it was not)
        self.replica_lost: Callable[[], tuple[str, int | None] | None] = lambda: None
        self._reconciles = 0  # reconciles (after forming, after a restore) in the current view: names their decisions
        self.aligned = True  # every member of the last view formed was at the same position
        self._before: tuple[str, ...] = ()  # the members of the view a re-formation began in
        self.agreed_reason = "init"  # why the last view formed, one value on its members (see _form)
        self.fingerprints = FingerprintCheck(options.fingerprint_every)
        # The last state this worker received moved it to another step (it was behind), rather
        # than replacing a state of its own step that went wrong (a repair: see _check_in_step).
        self.moved_on = False
        self.lineage = -1  # the view in which this worker's state was committed or handed on (-1: unknown)
        self.on_diverged: Callable[[int], None] = lambda step: None
        """Called with the last step whose fingerprints agreed when this worker's state was
        named wrong, or nobody's could be told right: its checkpoints after it go."""
        ports.communicators.attach(lambda: self.news.abort)
        ports.collective.attach(self.contribution, self.may_overlap)

    # ------------------------------------------------------------------ reads
    @property
    def view(self) -> View | None:
        """The current view: formed and verified."""
        return self.engine.view

    @property
    def rank(self) -> int:
        return self.engine.view.rank_of(self.engine.id)

    @property
    def ops(self) -> int:
        """Group operations (collectives, gradient steps) completed in the current view."""
        return self.driver.ops

    @property
    def closed(self) -> bool:
        """The worker left the group (``shutdown``), or is leaving it."""
        return self.engine.state in (core.LEAVING, core.CLOSED)

    def check_open(self) -> None:
        """FtcommError once the worker left the group (``shutdown`` from another thread, or
        the exit hook, while this thread waits): nothing is left to do."""
        if self.closed:
            raise FtcommError("the group was shut down")

    # ------------------------------------------------------------------ re-forming
    def recover(self, reason: str, detected_at: float, timeout: float | None = None) -> Step[bool]:
        """Re-form (``reason``: what broke the view, or why this worker re-forms) until the
        new view runs, RUNNING or RECONCILE_DUE when no state is registered yet; whether this
        worker's state was replaced meanwhile. This worker's share of a step that backward began
        reducing is lost (the step then counts its gradients as none).
        Raises FtcommTimeout or QuorumLost when no view is agreed within ``timeout``
        (default ``quorum_timeout``), and what agreeing raises (GroupEnded, ReplicaLost,
        ConfigMismatch)."""
        if self.ports.collective.touched:
            self.ports.collective.drop()
        yield from self._reform(reason, detected_at, timeout)
        outcomes = self.driver.reconciled  # each formation's, this re-formation
        if self.engine.state == core.RUNNING:
            self.record_reconciled(outcomes[-1].digest)
        return any(outcome.replaced for outcome in outcomes)

    def _reform(self, reason: str, detected_at: float, timeout: float | None) -> Step[ViewChange]:
        """detect -> agree -> form (+ verify) -> reconcile, until a view runs; its change."""
        clock, engine, driver = self.ports.clock, self.engine, self.driver
        noticed = clock.now()
        abort = self.news.abort
        fired_at, gave_up_at = abort.fired_at, abort.noticed_at
        abort_latency = round(gave_up_at - fired_at, 4) if fired_at is not None and gave_up_at is not None else None
        previous = engine.view
        self._before = previous.members if previous else ()
        self.check_open()
        driver.begin_recovery(reason)
        deadline = noticed + (timeout if timeout is not None else self.options.quorum_timeout)
        while driver.recovering:
            view = yield from self._agree(reason, noticed, deadline)
            try:
                formed = yield from self._form(view)
            except (MembershipChanged, FtcommTimeout) as exc:
                self.check_open()
                driver.form_failed(view, exc)
                continue
            driver.formed(formed)
            try:
                outcome = yield from self._reconcile_formed()
            except (MembershipChanged, FtcommTimeout) as exc:
                self.check_open()
                driver.reconcile_failed(exc)
                continue
            self.check_open()
            driver.view_reconciled(outcome)
        view = engine.view
        done = clock.now()
        before = self._before
        why = self.agreed_reason  # the same on every member: rank 0's (see _form)
        change = ViewChange(view.id, view.members, why, tuple(m for m in view.members if m not in before),
                            tuple(m for m in before if m not in view.members), round(noticed - detected_at, 4),
                            round(driver.agreed_at - driver.agreeing_since, 4),
                            round(driver.formed_at - driver.agreed_at, 4), round(done - driver.formed_at, 4),
                            clock.wall(), abort_latency)
        self.events.append(change)
        engine.view_reason = why  # published with the next record
        self.op_began = clock.now()
        log.info("view %d: %d members (%s), rank %d; detect %.3f agree %.3f form %.3f reconcile %.3f s",
                 view.id, view.size, why, view.rank_of(engine.id), change.detect_s, change.agree_s,
                 change.form_s, change.reconcile_s)
        return change

    def _agree(self, reason: str, noticed: float, deadline: float) -> Step[View]:
        """Look at the membership (after news, or every LOOK_INTERVAL_S) until a view is
        agreed; it is entered (FORMING) and returned."""
        clock, engine, driver = self.ports.clock, self.engine, self.driver
        said_at = noticed  # when this worker last said why it waits
        while True:
            self.check_open()
            lost = self.replica_lost()
            if lost is not None:  # (torn down while this worker agrees: see ftcomm.training.replica_watch)
                raise ReplicaLost(lost[0], lost[1])
            now = clock.now()
            if now > deadline:
                self._raise_stuck()
            self.news.changed.clear()
            self.news.judge()
            try:
                look = driver.look()
            except core.IllegalTransition:
                self.check_open()  # shut down from another thread meanwhile: FtcommError
                raise
            if look.form is not None:
                driver.enter(look.form)
                return look.form
            if look.again:  # a fetched or published proposal is looked at at once
                yield Pause(0.0)
                continue
            if now - said_at > (WAIT_NOTICE_S if said_at == noticed else WAIT_REPEAT_S):
                said_at = now
                log.warning("waiting for a view (%s for %.0f s): %s; %s in %.0f s", reason, now - noticed,
                            self._waiting_for(), "QuorumLost" if engine.view is not None else "FtcommTimeout",
                            max(0.0, deadline - now))
            yield Pause(LOOK_INTERVAL_S)

    def _form(self, view: View) -> Step[Formed]:
        """Form the communicator of ``view`` and verify it with a tiny allreduce MIN, which
        also tells whether every member founds the group (this is their first view) and
        wants the network check, and whether no member has begun training (restorable)."""
        engine, comms = self.engine, self.ports.communicators
        # Waiting on the others from here: a formation that takes far longer than the usual
        # operation has its members probed at once (watch_stall), as a collective does.
        self.contributed_at = self.ports.clock.now()
        yield comms.form(view)
        check = int(view.digest, 16) >> 1
        rank, k = view.rank_of(engine.id), engine.replica_size
        misplaced = int(k > 1 and (view.size % k != 0 or rank % k != engine.replica[1]))
        # Why the view formed, as rank 0 sees it (the others put a value above every code,
        # so the minimum is rank 0's): one reason on every member, whatever each one saw.
        why = ("rejoin" if engine.formed_from == core.REJOINING
               else core.reason_for(self.driver.reason, self._before, view.members, self.gossip_states(), k))
        probe = [check, -check, int(engine.view is None), int(self.options.network_check), int(not engine.started),
                 -misplaced, self.position, -self.position,
                 core.reason_code(why) if rank == 0 else len(core.VIEW_REASONS)]
        verified = yield comms.verify(probe)
        if verified[:2] != [check, -check]:
            raise CommunicatorError(f"view {view.id} failed verification: members disagree on its digest")
        if verified[5] < 0:
            raise CommunicatorError(f"view {view.id} failed verification: a sharded replica's processes are not "
                                    f"consecutive ranks in shard order")
        if k > 1:
            yield comms.form_shard(view)
        self.aligned = verified[6] == -verified[7]  # the lowest position is the highest: all at one place
        self.agreed_reason = core.VIEW_REASONS[min(verified[8], len(core.VIEW_REASONS) - 1)]
        self.formations += 1
        self._reductions = self._reconciles = 0
        return Formed(verified[2] == 1 and verified[3] == 1, verified[4] == 1)

    def _reconcile_formed(self) -> Step[Reconciled]:
        """In a view just formed: reconcile now, or before the first collective once a
        state is registered (deferred: nothing loaded, no digest yet)."""
        if not self.state.registered:
            return Reconciled(False, None, deferred=True)
        loaded, digest = yield from self._transfer()
        return Reconciled(loaded, digest)

    def _transfer(self) -> Step[tuple[bool, int]]:
        """Make every member's registered state identical: every member shows its (step,
        digest, model signature); when they differ the newest state wins (the lowest rank
        among its holders; shard by shard with sharded replicas, see
        :func:`ftcomm.core.view.shard_sources`). Whether this worker loaded another's state,
        and the digest every member now holds. ConfigMismatch when the members registered
        different models."""
        comms, state, engine = self.ports.communicators, self.state, self.engine
        view, k = engine.view, engine.replica_size
        step = self.step
        checked = self.options.fingerprint_every > 0
        mine = StateSummary(step, state.digest(step), state.signature(),
                            state.fingerprint() if checked and step > 0 else -1, self.lineage)
        gathered = yield comms.gather_states(mine)
        if any(len({g.signature for g in gathered[i::k]}) > 1 for i in range(k)):
            yield comms.mismatch(gathered, k)  # raises ConfigMismatch on every member
        newest = [max(g.step for g in gathered[i::k]) for i in range(k)]
        if len(set(newest)) > 1:
            # A replica commits a step on every process or on none (Replica.decide), and takes
            # its shards of a state all or none (below): a shard newer than another means that
            # the last replica holding every shard of the newest state is gone.
            raise StateLost(f"no member of view {view.id} holds every shard of the group's newest state (the "
                            f"newest step of each shard: {newest}): the replicas that held it are gone; start "
                            f"the job again from its newest checkpoint")
        rank = view.rank_of(engine.id)
        if checked:
            self._judge_holders(gathered)
        source = shard_sources([(g.step, g.digest, g.fingerprint, g.lineage) for g in gathered], k)[1][rank % k]
        loaded, digest = False, mine.digest
        if source is not None:
            load = gathered[rank][:2] != gathered[source][:2]
            received = yield comms.transfer(view, source // k, load, step)
            if received is not None:
                self.step, self.moved_on, self.lineage = received, received != step, gathered[source].lineage
                loaded, digest = True, state.digest(received)
                if digest != gathered[source].digest:  # altered or damaged on the way: never trained on
                    text = f"the state received from rank {source} of view {view.id} does not match the digest it showed"
                    log.warning("%s: discarded, the view is agreed again", text)
                    raise CollectiveAborted(text)
                self.fingerprints.repaired(state)
        self._reconciles += 1  # (a restore reconciles again in the same view: a decision of its own)
        if k > 1 and not (yield from self._replica_decides(("reconcile", view.id, view.digest, self._reconciles),
                                                           True)):
            # Another process of this replica did not receive its shard (its source died):
            # the replica holds no whole state, and is a joiner again as a whole.
            raise CollectiveAborted(f"a process of this sharded replica did not receive its shard of view "
                                    f"{view.id}'s state")
        return loaded, digest

    def _named(self, step: int) -> None:
        """This worker's state was named wrong at ``step``: published with its next record
        (``ftcomm members`` and the launcher's status line show it)."""
        self.engine.diverged = ((self.engine.diverged or (0, 0))[0] + 1, step)

    def _judge_holders(self, gathered: list[StateSummary]) -> None:
        """A reconcile's fingerprints (see ftcomm.runtime.fingerprints), among each shard
        index's members that hold its newest step in the lineage whose state is handed on
        (see ftcomm.core.engine.reconcile_source: holders of one step in two lineages, two
        sides of a partition, differ by design): those that differ from the majority's are
        named and take a majority member's state (the reconcile's source rule); with no
        majority every member raises StateDiverged (but under ``sdc_policy='warn'``: the
        lowest rank's state wins, as without fingerprints), as under ``'stop'`` whenever
        they differ. The same on every member: it has every member's summary. Not for the
        divergence the last step's comparison found, whose repair this reconcile is."""
        engine, checks, k = self.engine, self.fingerprints, self.engine.replica_size
        view, rank = engine.view, engine.view.rank_of(engine.id)
        repairing, checks.repairing = checks.repairing, None
        stop: tuple[int, Divergence, tuple[str, ...]] | None = None
        groups = []  # each shard index's holders of its newest step, of the lineage whose state is handed on
        for shard in range(k):
            ranks = range(shard, len(gathered), k)
            newest = max(gathered[r].step for r in ranks)  # (at step 0 every founder holds its own init)
            lineage = gathered[min(r for r in ranks if gathered[r].step == newest)].lineage
            holders = [r for r in ranks if 0 < newest == gathered[r].step and gathered[r].fingerprint >= 0
                       and gathered[r].lineage == lineage >= 0]
            groups.append((shard, newest, holders))
        for shard, newest, holders in groups:
            divergence = fingerprint_verdict([gathered[r].fingerprint for r in holders])
            if divergence is None or (repairing == newest and divergence.majority):
                continue
            ids = tuple(view.members[holders[p]] for p in divergence.named)
            if shard == rank % k:
                checks.record(divergence, newest, ids, shard if k > 1 else None)
                if rank in {holders[p] for p in divergence.named}:
                    self._named(newest)
                    if self.options.sdc_policy != "warn":
                        self.on_diverged(checks.agreed_step)
                    if divergence.majority:  # repaired by this reconcile: name the tensors that were wrong
                        checks.named_again(self.state)
            if self.options.sdc_policy == "stop" or (self.options.sdc_policy == "exclude" and not divergence.majority):
                stop = stop or (newest, divergence, ids)
        if stop is not None:
            newest, divergence, ids = stop
            agreed = checks.agreed_step
            if not divergence.majority:
                self.on_diverged(agreed)
            why = "no fingerprint has a majority, so nobody can tell which state is right" \
                if not divergence.majority else "sdc_policy='stop'"
            raise StateDiverged(f"the members holding step {newest} hold different states ({', '.join(ids)}) as view "
                                f"{view.id} forms; {why}. The last step where every fingerprint agreed: {agreed}; its "
                                f"host writers deleted their checkpoints after it: restart from a checkpoint of that "
                                f"step or older", newest, ids)

    def _raise_stuck(self) -> None:
        engine = self.engine
        view = engine.view
        if view is None and engine.holding:
            raise FtcommTimeout(
                "this worker saw a group but none of its members is live here, and not all of them are "
                "gone for sure (some do not answer: across a partition?); with partition_policy='quorum' "
                "it founds no second group")
        if view is None and engine.silent_seeds:
            raise FtcommTimeout(self._silent_seeds_text())
        if view is None or engine.state == core.JOINING:
            raise FtcommTimeout(f"no view with at least {self._min_workers_text()} could be agreed "
                                f"(this worker sees {self._live()} live members; group full or peers unreachable?)")
        raise QuorumLost(f"cannot reach a majority of view {view.id} ({view.size} members) "
                         f"within {self.options.quorum_timeout:g} s: this worker is on the minority side "
                         f"of a partition or the others are gone")

    def _min_workers_text(self) -> str:
        """min_workers as the user set it, and what it means in processes."""
        engine = self.engine
        k = engine.replica_size
        if k == 1:
            return f"min_workers={engine.min_workers} members"
        return f"min_workers={engine.min_workers} replicas ({engine.min_workers * k} processes)"

    def _live(self) -> int:
        return sum(1 for r in self.ports.membership.records() if r.state in ("alive", "suspect"))

    def _waiting_for(self) -> str:
        """Why no view is agreed yet, in a few words, for the waiting notice."""
        engine = self.engine
        live, needed = self._live(), engine.min_workers * engine.replica_size
        if live < needed:
            return (f"{live} live member{'s' if live != 1 else ''} here, fewer than {self._min_workers_text()}: "
                    f"waiting for more to join or come back")
        if engine.view is not None:
            states = {r.id: r.state for r in self.ports.membership.records()}
            view = engine.short_of or engine.view
            silent = [m for m in view.members
                      if m != engine.id and states.get(m) != "alive" and m not in engine.proven_gone]
            text = (f"{live} live members, waiting to agree on the next view with a majority of view "
                    f"{view.id} ({view.size} members)")
            if view.id > engine.view.id:
                text += (f", which this worker entered and failed to form (it may have formed on the others, "
                         f"who would go on from it), as well as of view {engine.view.id}")
            if silent:
                text += (f"; {_names(silent)} answer{'s' if len(silent) == 1 else ''} nothing and "
                         f"{'is' if len(silent) == 1 else 'are'} not proven gone (a lost node, a partition or "
                         f"a stopped process refuses no connection, and a process that died long after this "
                         f"worker lost sight of it proves nothing): this worker goes on once they answer again; "
                         f"if they cannot come back, restart the job from its checkpoint")
            return text
        if engine.silent_seeds:
            return f"{live} live member{'s' if live != 1 else ''}; {self._silent_seeds_text()}"
        return f"{live} live members, agreeing on the first view"

    def _silent_seeds_text(self) -> str:
        """Why a worker started again into a job whose group ran founds no group yet."""
        seeds = self.engine.silent_seeds
        return (f"started again into a job whose group ran, this worker founds no new group while "
                f"{_names([f'{h}:{p}' for h, p in seeds])} answer{'s' if len(seeds) == 1 else ''} nothing (the "
                f"group may run on there, across a partition): it joins the group once they answer, or founds "
                f"one once their ports refuse connections; if a host is gone for good, start the job again "
                f"without it in its peers")

    def gossip_states(self) -> dict[str, str]:
        """Each member's gossip state, ``benched`` for a straggler standing aside."""
        return {r.id: "benched" if r.status is not None and r.status.benched is not None else r.state
                for r in self.ports.membership.records()}

    # ------------------------------------------------------------------ step boundaries
    def boundary(self) -> Step[None]:
        """Between two steps: re-form, stand aside or reconcile as the engine says is due
        (see ftcomm.FaultTolerantGroup.step_boundary). A reconcile that fails leaves the view
        BROKEN, re-formed before the next collective."""
        self.engine.began()
        self.position, self._calls = BEFORE_STEP, 0
        yield from self.reform_if_due()
        if self.engine.state != core.RECONCILE_DUE:
            return
        try:
            yield from self.reconcile_if_due()
        except MembershipChanged as exc:
            self.fail(exc)

    def prepare(self, boundary: bool = True) -> Step[bool]:
        """Before a collective (a gradient step's at a step ``boundary``): what is due;
        whether this worker's registered state was replaced meanwhile (by another member's)."""
        self.check_open()
        replaced = yield from self.reform_if_due(boundary)
        return (yield from self.reconcile_if_due()) or replaced

    def start(self, began: float, timeout: float) -> Step[bool]:
        """``init``: agree on the first view and form it, or, finding a running group, hold
        back from it until the training state is registered (nothing can be before init; see
        ftcomm.core.engine.AwaitState and :meth:`admit`); whether this worker is in a view.
        A process of a sharded replica holds back as well: the group admits whole replicas,
        so a shard that registered first waits in ``register_state`` until its partners ask
        to be admitted too."""
        self.engine.state_pending = True
        try:
            yield from self.recover("init", began, timeout)
        except AwaitingState:
            return False
        self.engine.state_pending = False
        return True

    @property
    def awaiting_state(self) -> bool:
        """A fresh worker holding back from a running group until its training state is
        registered (see ftcomm.core.engine.AwaitState): it is in no view yet."""
        return self.engine.state_pending and self.engine.view is None

    def admit(self) -> Step[bool]:
        """Ask the running group to admit this worker, which held back until now (its state
        is registered, or a collective is due without one); whether its state was replaced
        (by the group's). Raises what ``recover`` raises, FtcommTimeout after ``init_timeout``."""
        self.engine.state_pending = False
        return (yield from self.recover("join", self.ports.clock.now(), self.options.init_timeout))

    def reform_if_due(self, boundary: bool = True) -> Step[bool]:
        """Re-form when the engine says so (see Engine.due): a joiner is admitted, and a
        straggler stands aside, only at a step ``boundary``; whether the state was replaced."""
        clock, engine = self.ports.clock, self.engine
        if self.awaiting_state:
            return (yield from self.admit())
        due = engine.due(boundary)
        if due == "recover":
            return (yield from self.recover(engine.fault, self.waiting_since))
        if due == "resume":  # a re-formation that raised (a timeout, a mismatch) is resumed
            return (yield from self.recover("backend", clock.now()))
        if due == "join":
            return (yield from self.recover("join", clock.now()))
        if due == "aside":
            seconds = self.stragglers.bench()
            log.warning("this worker is a straggler: standing aside for %g s (straggler_policy 'exclude')", seconds)
            self.driver.stand_aside(seconds)
            return (yield from self.recover("straggler", clock.now(), seconds + self.options.quorum_timeout))
        return False

    def reconcile_if_due(self) -> Step[bool]:
        """Reconcile when due (RECONCILE_DUE), unless news already broke the view
        (MembershipChanged); whether the state was replaced."""
        self.news.judge()
        if self.news.abort.reason is not None:
            raise MembershipChanged(self.news.abort.reason)
        if self.engine.state != core.RECONCILE_DUE:
            return False
        began = self.ports.clock.now()
        loaded, digest = yield from self._transfer()
        self.check_open()
        self.engine.reconciled()
        self.record_reconciled(digest, self.ports.clock.now() - began)
        return loaded

    def record_reconciled(self, digest: int | None, deferred_s: float | None = None) -> None:
        """Stamp the latest view change with the state every member holds after reconciling
        (and, for a reconcile deferred until the state was registered, its duration), and let
        the batch-size / learning-rate policies adapt to the view (same state, same result)."""
        if not self.state.registered or not self.events:
            return
        self.fingerprints.agreed(self.step)  # every member holds this state now
        policy: dict = {}
        for obj in self.state.participants("view_changed"):
            policy.update(obj.view_changed(self.rank, self.engine.view.size, self.step) or {})
        timing = {"reconcile_s": round(deferred_s, 4)} if deferred_s is not None else {}
        self.events[-1] = dataclasses.replace(self.events[-1], step=self.step, state_digest=digest,
                                              policy=policy or None, **timing)
        if policy:
            log.info("view %d: policy %s", self.engine.view.id, policy)

    def fail(self, exc: MembershipChanged) -> None:
        """A collective of the view failed outside a gradient step: the view is BROKEN and
        re-formed before the next collective. Raises FtcommError when another thread shut
        the group down meanwhile (nothing is left to re-form)."""
        self.check_open()
        self.driver.perform(self.engine.failed(self.driver.classify(exc)))

    def repair_replica(self, why: str, where: str) -> None:
        """This worker's sharded replica lost a process and forms again with a replacement
        (``why``; see ftcomm.training.replica_repair), and this worker leaves its view
        (Driver.repair_replica). Seen in the gradient step (``where`` is ``step``), the step
        ends, discarded; seen in a call inside a step (``call``), the step's gradients, computed
        on a torn-down replica, count as none when it is reduced; seen between steps
        (``boundary``), no step is under way."""
        self.check_open()
        collective = self.ports.collective
        if where == "step":
            collective.discard()
        elif where == "call":
            collective.drop()
        self.position = BEFORE_STEP
        self.driver.repair_replica(why)
        if where == "step":
            self._end_step(False)

    # ------------------------------------------------------------------ gradient steps
    def contribution(self, valid: bool) -> Contribution:
        """This worker's share of a step's counters (asked when the step's last bucket
        launches): its gradients count (``valid`` and its batch is the planned one), it sees
        a joiner waiting, it asks to stand aside."""
        engine = self.engine
        # a fingerprint of the committed state, when due (not of a state just replaced)
        fingerprint = self.fingerprints.take(self.state, self.step) if valid and engine.view is not None else None
        valid = valid and all(obj.batch_valid() for obj in self.state.participants("batch_valid"))
        join = engine.admits_joiner(self.driver.statuses()[0])
        aside = self.rank if self.stragglers.asking and engine.view is not None else None
        position = self.rank // engine.replica_size if engine.view is not None else 0
        return Contribution(valid, join, aside, fingerprint, position)

    def may_overlap(self) -> bool:
        """Backward may start reducing: nothing has to happen before this step's collectives."""
        self.news.judge()
        return self.engine.state == core.RUNNING and self.news.abort.reason is None and not self.closed

    def gradient_step(self) -> Step[bool]:
        """One gradient step (see ftcomm.FaultTolerantGroup.wait_gradients_ready): whether it
        commits. A step that fails re-forms the view and returns False; more than
        ``max_retries`` in a row raise RetryLimitExceeded."""
        engine, collective, driver = self.engine, self.ports.collective, self.driver
        engine.began()
        self.position, self._calls = IN_STEP, 0
        self.news.judge()
        for obj in self.state.participants("check_step"):
            obj.check_step()
        # The group re-formed (in execute) after backward began reducing: this worker's share
        # went with the old view. It still takes part in the step (the others, whose backward
        # had not begun reducing, run it), contributing none, as after its state was replaced.
        lost = collective.lost
        if lost:
            collective.discard()
        decision = None  # the name of this step's decision in its replica, once it contributed
        self.waiting_since = self.ports.clock.now()
        try:
            if collective.touched and (engine.state == core.BROKEN or self.news.abort.reason is not None):
                # backward already reduced part of this step in a view that is now broken
                raise CollectiveAborted(self.news.abort.reason or f"the view broke ({engine.fault})")
            replaced = yield from self.prepare()
            # Gradients computed on state that was just replaced are not valid: contribute none.
            reduction = collective.reduce(valid=not (replaced or lost))
            self._reductions += 1
            decision = ("step", engine.view.id, engine.view.digest, self._reductions)
            self.stragglers.compute.add(self.contributed())
            self.waiting_since = self.contributed_at
            reduced = counters = yield reduction
            if engine.replica_size > 1:
                counters = yield from self._replica_verdict(reduced)
            yield from self.confirm_after_stall()
        except MembershipChanged as exc:
            collective.discard()
            # This worker computes the step again before its next collective: in the view it
            # re-forms into it stands with those at a step boundary, apart from those whose
            # gradients are computed and who reduce at once (and who may be in a call the
            # script makes before the step, which it would meet first).
            self.position = BEFORE_STEP
            self.check_open()  # shut down from another thread: FtcommError, nothing to re-form
            if decision is not None:
                yield from self._replica_decides(decision, False)
            fault = engine.fault or driver.classify(exc)
            if engine.count_failure():
                if engine.state in (core.RUNNING, core.RECONCILE_DUE):
                    driver.perform(engine.failed(fault))  # re-formed at the next call
                self._end_step(False)
                raise RetryLimitExceeded(
                    f"wait_gradients_ready failed {self.options.max_retries + 1} steps in a row because the "
                    f"membership kept changing (last: {exc}); raise max_retries or investigate the unstable "
                    f"workers") from exc
            yield from self.recover(fault, self.waiting_since)
            self._end_step(False)
            return False
        engine.count_success()
        verdict = driver.step_reduced(counters, bool(self.state.participants("batch_valid")))
        repair = False
        if verdict and (reduced.fingerprints or any(counters.actions)):
            try:
                judged = self._judge_fingerprints(reduced, counters)
            except StateDiverged:
                collective.discard()
                self._end_step(False, reduced=True)
                raise
            repair, verdict = judged == "repair", judged == "commit"
        commit = yield from self._replica_decides(decision, verdict)
        # Completed only now: a member that leaves after deciding this step counts it done,
        # and the departure is held while this worker's replica still decides it (counted
        # before the decision, the news aborted the decision, and this replica alone
        # discarded the step every other replica committed).
        self.completed()
        if verdict and not commit:
            self._partner_failed()
        if commit:
            collective.hand_back(reduced.contributors)  # the sum is over the gradient communicator's members
        else:
            collective.discard()
        self._end_step(commit, reduced=True)
        if commit:
            self._commit()
        elif repair and engine.state == core.RUNNING:
            engine.restored()  # the named members take a majority member's state before the next collective
        return commit

    def _local_action(self, reduced: Counters) -> tuple[str, Divergence | None]:
        """What the fingerprints of this worker's reduction ask for (with sharded replicas,
        its shard index's), and how they differ (None: they agree)."""
        divergence = fingerprint_verdict(reduced.fingerprints)
        complete = divergence is None or divergence.voters == len(reduced.fingerprints)
        return step_action(divergence, self.options.sdc_policy, complete,
                           self.fingerprints.again_at == self.step), divergence

    def _judge_fingerprints(self, reduced: Counters, counters: Counters) -> str:
        """The step's fingerprints (see ftcomm.runtime.fingerprints): ``commit`` when they
        agree or the policy only warns, ``repair`` when the step is discarded everywhere and
        the members whose state differs take a majority member's (at the next reconcile),
        ``again`` when it is discarded to compare every member's. With sharded replicas the
        most severe action any shard index asks for is every process's. Raises
        StateDiverged (``stop``) on every member, or on a member named again soon after a
        repair (``leaves``: it leaves the group). ``reduced``: the counters of this worker's
        reduction; ``counters``: the step's, over the view."""
        k, view, checks = self.engine.replica_size, self.engine.view, self.fingerprints
        shard = self.rank % k
        local, divergence = self._local_action(reduced)
        action = ACTIONS[max([ACTIONS.index(local)] + [i + 1 for i, n in enumerate(counters.actions) if n])]
        if divergence is None and action == "commit":
            checks.agreed(self.step, reduced.fingerprints)
            return "commit"
        ids = tuple(view.members[p * k + shard] for p in divergence.named) if divergence is not None else ()
        mine = divergence is not None and self.rank // k in divergence.named
        if action == "again":
            checks.again_at = self.step
            log.warning("the state fingerprints of step %d differ without a majority among those given, and some "
                        "member gave none (its state was just replaced): the step is computed again to compare "
                        "every member's", self.step)
            return "again"
        if divergence is not None:
            checks.record(divergence, self.step, ids, shard if k > 1 else None)
        if mine:
            self._named(self.step)
        leaves = action == "repair" and mine and checks.named_again(self.state)
        agreed = checks.agreed_step
        if (mine and action != "commit") or (action == "stop" and divergence is not None and not divergence.majority):
            self.on_diverged(agreed)  # its checkpoints after the last step all agreed go
        if leaves:
            raise StateDiverged(f"the state of this worker differed from the majority's again at step {self.step}, "
                                f"within {SDC_REPEAT_CHECKS} checks of its repair: its hardware keeps computing "
                                f"wrong, so it leaves the group (the others go on)", self.step, ids, leaves=True)
        if action == "stop":
            if divergence is None:
                why = "between the replicas of another shard index (its processes name them)"
            elif divergence.majority:
                why = f"between members ({', '.join(ids)}); sdc_policy='stop'"
            else:
                why = (f"between members ({', '.join(ids)}) and no fingerprint has a majority, so nobody can tell "
                       f"which state is right")
            raise StateDiverged(f"the training state of step {self.step} differs {why}. The last step where every "
                                f"fingerprint agreed: {agreed}; its host writers deleted their checkpoints after "
                                f"it: restart from a checkpoint of that step or older", self.step, ids)
        if action == "repair":
            checks.repairing = self.step
        return action

    def _replica_verdict(self, counters: Counters) -> Step[Counters]:
        """With sharded replicas, each shard index reduced its gradient shards, and the
        step's counters with them, over its own communicator. The step commits for every
        process or for none: the counters of every shard are summed over the whole view (one
        tiny allreduce; each shard's sum arrives once from each of its processes), and so is
        what each shard index's fingerprints ask for (see _judge_fingerprints)."""
        replicas = self.engine.view.size // self.engine.replica_size
        local = self._local_action(counters)[0] if counters.fingerprints else "commit"
        flags = [1.0 / replicas if local == a else 0.0 for a in ACTIONS[1:]]
        summed = yield self.ports.collective.view_sum([counters.contributors / replicas, counters.joiners / replicas,
                                                       *flags])
        return Counters(round(summed[0]), round(summed[1]), counters.asking, counters.fingerprints,
                        tuple(round(v) for v in summed[2:5]))

    def _partner_failed(self) -> None:
        """The step completed here but not on another process of this sharded replica: its
        view broke there, and it re-forms at its next boundary. So does this one: were it to
        run a step in the old view, it would wait in the replica's agreement for a process
        that is agreeing on a new view."""
        engine, driver = self.engine, self.driver
        if engine.state in core.IN_VIEW:
            driver.perform(engine.failed(driver.classify(
                CollectiveAborted("a process of this sharded replica did not complete the step"))))

    def _replica_decides(self, decision: tuple, vote: bool) -> Step[bool]:
        """With a sharded replica, whether every process of it votes yes on ``decision`` (this
        step commits); ``vote`` without one. A process of the replica that left the view
        (its shard's transfer failed, or its step did) never votes: the others' wait ends
        when their view's abort signal fires, with a veto."""
        if self.engine.replica_size == 1:
            return vote
        return (yield self.ports.collective.replica_decide(decision, vote))

    def _end_step(self, committed: bool, reduced: bool = False) -> None:
        """The gradient step ends (``committed``); ``reduced``: its reduction completed in the
        view, so the views formed before it are settled (every member was at this step). A
        step that failed settles nothing: the view it re-formed into may have found the
        others elsewhere (in a call this worker has not made), and its next call checks."""
        if reduced:
            self._settled = self.formations
        for obj in self.state.participants("step_ended"):
            obj.step_ended(committed)
        self.news.operation_ended()

    def _commit(self) -> None:
        self.step += 1
        self.lineage = view_lineage(self.engine.view)
        if self.ports.clock.now() - self.driver.published_at < self.options.step_publish_interval:
            return
        self.driver.publish()  # the record with the committed step, at most every step_publish_interval
        try:
            self.judge_stragglers()
        except Exception:  # noqa: BLE001 - a report must never fail a committed step
            log.exception("judging stragglers failed")

    def judge_stragglers(self) -> None:
        """Compare the view members' published compute times (see ftcomm.runtime.stragglers)."""
        statuses, _ = self.driver.statuses()
        compute = {m: s.compute_s for m, s in statuses.items() if s.compute_s is not None}
        self.stragglers.judge(self.engine.id, self.engine.view.members, compute, self.ports.clock.wall())

    # ------------------------------------------------------------------ collectives
    def collective(self, operation: Any) -> Step[Any]:
        """One of the user's collectives (``operation`` starts it on the view's
        communicator); its result. MembershipChanged when the view breaks meanwhile: the
        view is re-formed before the next collective. A joiner admitted by the last step
        joins at the next step boundary, after it (see ftcomm.core.engine.BETWEEN).
        OutOfStep when re-forming to prepare it found the members of the new view at other
        places of the training (see :meth:`execute`)."""
        nested = self._in_call
        if not nested:
            self._place()
        self._in_call = True
        try:
            replaced = yield from self.prepare(boundary=False)
            if not nested:
                self._check_in_step(replaced, "the collective")
            self.contributed()
            self.waiting_since = self.contributed_at
            try:
                result = yield self.ports.collective.run(operation)
                yield from self.confirm_after_stall()
            except MembershipChanged as exc:
                self.fail(exc)
                raise
        finally:
            self._in_call = nested
        self.operation_done()
        if not nested:
            self._calls, self._settled = self._calls + 1, self.formations
        return result

    def execute(self, attempt: Callable[[], Step[T]]) -> Step[T]:
        """Run ``attempt`` (which runs collectives) and return its result; when the view
        breaks meanwhile (MembershipChanged), re-form and run it again from the start, as
        long as every member of the new view is at this same call. More than
        ``max_retries`` failures in a row raise RetryLimitExceeded.

        OutOfStep when a re-formation (after a failure, or to prepare the call) found the
        members of the new view at other places of the training: a joiner at its first
        gradient step, a member that had finished the call, or this worker itself behind
        (its state was replaced by the group's newer one). Every member tells its place
        (its committed step, and which call since the last gradient step) in the new view's
        verification, so all decide alike: nobody runs a collective that some members never
        join, and the group meets again at the next gradient step."""
        nested = self._in_call
        if not nested:
            self._place()
        self._in_call = True
        try:
            while True:
                self.waiting_since = self.ports.clock.now()
                try:
                    replaced = yield from self.prepare(boundary=False)
                    if not nested:
                        self._check_in_step(replaced, "execute")
                    result = yield from attempt()
                except MembershipChanged as exc:
                    if self.engine.count_call_failure():
                        raise RetryLimitExceeded(
                            f"execute failed {self.options.max_retries + 1} times in a row because the membership "
                            f"kept changing (last: {exc}); raise max_retries or investigate the unstable workers"
                        ) from exc
                    replaced = yield from self.recover(self.engine.fault or self.driver.classify(exc),
                                                       self.waiting_since)
                    if not nested:
                        self._check_in_step(replaced, "execute")
                    continue
                self.engine.count_call_success()
                if not nested:
                    self._calls, self._settled = self._calls + 1, self.formations
                return result
        finally:
            self._in_call = nested

    def _place(self) -> None:
        """A call outside a gradient step begins: this worker's position is its committed
        step and which such call it is since its last gradient step. Only completed calls
        count: a call that raised (QuorumLost, a timeout, a failed collective) and is called
        again is the same call, and a member that completed it is one call further."""
        self.position = 1 + self.step * 4096 + min(self._calls + 1, 4095)

    def _check_in_step(self, replaced: bool, what: str) -> None:
        """OutOfStep when preparing ``what`` replaced this worker's state, or when a view
        formed since this worker's last completed operation (in this call, or before its
        first) had members that were not all at this same call."""
        # In a restorable view nobody has begun training; a state replaced at this worker's own
        # step (its own went wrong: ftcomm.runtime.fingerprints) leaves it where the others are.
        behind = replaced and not self.engine.restorable and self.moved_on
        if behind or (self.formations > self._settled and not self.aligned):
            why = ("this worker's state was replaced by the group's newer one (it was cut off while the group went "
                   "on)" if behind else "the members of the new view are at other places of the training (a "
                   "joiner at its first gradient step, or a member that had finished it)")
            raise OutOfStep(f"{what} was abandoned: the group re-formed and {why}; running it would wait for members "
                            f"that never join it. Carry on with the training loop: the group meets again at the "
                            f"next gradient step (step {self.step + 1})")

    def contributed(self) -> float:
        """This worker handed its share of the operation in flight over: its compute time."""
        self.contributed_at = self.ports.clock.now()
        return self.contributed_at - self.op_began

    def completed(self) -> None:
        """The operation in flight completed here."""
        self.op_began = self.ports.clock.now()
        self.driver.operation_done(self.op_began - self.contributed_at)

    def operation_done(self) -> None:
        """The operation in flight completed, and aborts held for it fire now."""
        self.completed()
        self.news.operation_ended()

    def watch_stall(self) -> None:
        """Hang detection on demand while an operation waits (see Driver.watch_stall); run
        on each wake-up of a waiting operation."""
        self.driver.watch_stall(self.contributed_at, self.op_began, self.options.stall_probe_after,
                                self.ports.membership.probe_interval())

    def confirm_after_stall(self) -> Step[None]:
        """Before the operation that completed counts: confirm the view is intact when this
        worker may have been cut off meanwhile (see Driver.confirmation); CollectiveAborted
        when it is not."""
        exchange = self.driver.confirmation(self.contributed_at, self.op_began, self.ports.membership.probe_interval())
        if exchange is not None:
            self.driver.confirmed((yield exchange))

    # ------------------------------------------------------------------ leaving
    def leave(self) -> Step[None]:
        """Leave the group gracefully: the record says so, then the departure notice.

        The departure does not end the worker at once: a member of the view may still be
        inside the operation this worker completed last (it lets it finish, ``leave_grace``),
        and this worker's exit would close the connections it still reads from. Until every
        other member of the view moved on (left, died, or no longer proposes the view: it
        re-formed), at most until ``leave_grace`` seconds after that operation ended (by then
        every member that was in it finished it or gave up on it), and at least while the
        notice spreads, the gossip layer stays up and the communicator is not dropped. A
        second call does nothing."""
        engine, clock, membership = self.engine, self.ports.clock, self.ports.membership
        view = engine.view
        actions = engine.leave()
        if not actions:
            return
        now = clock.now()
        linger = max(0.0, self.options.leave_grace - (now - self.op_began))
        self.news.abort.fire("this worker is shutting down")
        try:
            self.driver.perform(actions)
            membership.leave()
            spread = now + membership.propagate_time()
            deadline = max(spread, now + linger)
            while clock.now() < spread:
                yield Pause(spread - clock.now(), news=False)
            while clock.now() < deadline and not (yield from self._others_moved_on(view)):
                yield Pause(LOOK_INTERVAL_S, news=False)
            membership.stop()
        except FtcommError as exc:  # its gossip is gone already
            log.debug("leaving: %s", exc)
        self.ports.communicators.abandon()
        engine.closed()

    def _others_moved_on(self, view: View | None) -> Step[bool]:
        """No other live member still runs ``view`` (asked directly: news about a member that
        left may no longer reach it by gossip)."""
        if view is None:
            return True
        key = (view.id, view.digest)
        statuses, _ = self.driver.statuses()
        # A suspect counts unless its port refuses a connection (the process is gone): a
        # member slow to answer on a busy host may be the one still reading the operation
        # this worker completed.
        running = [m for m in view.members if m != self.engine.id and m in statuses
                   and not (statuses[m].dead or statuses[m].left) and statuses[m].proposal == key]
        suspects = [m for m in running if not statuses[m].alive]
        if suspects:
            gone = set(self.driver.refusing(suspects))
            running = [m for m in running if m not in gone]
        if running:
            yield self.ports.membership.exchange(running[:1], timeout=0.1)
        return not running
