"""The invariants the whole-group simulation checks, after every commit and at the end.

(1) no two members of a view commit different contents for the same step (a step can
still commit on some members only, when the others abort it and carry on without them;
such a commit is overwritten when its member is reconciled, and the summary counts them:
without a second commit round nothing can prevent it); (2) each member's committed steps
strictly increase; (3) the members of a view hold equal state before their first commit
in it (per shard with sharded replicas, and every shard at one step); (4) with the quorum policy no side of a partition that lacks a majority of the
view before it commits, and no two disjoint groups commit the same step (a view that
descends from the first commit's view overwrites a partial commit: a rollback; a group
started over after every worker of the old one's line was gone is no second group); (5) the
committed steps of the group are contiguous (every sample of an epoch consumed once: the
sampler's share of a step is a function of the step); (6) liveness: once faults stop,
every live member is in one view with all live members and commits within
``liveness_bound`` seconds, when a quorum of the newest view and ``min_workers`` survived;
(7) every communicator a member formed is closed or abandoned, except the current one;
(8) a worker whose gradient steps fail and re-form more than ``max_retries`` times in a
row is told so (RetryLimitExceeded); (9) a straggler stands aside only where the others
still make ``min_workers``; (10) with CPU starvation drawn, no view leaves out a member
that was merely starved by at most ``STARVED_TOLERATED``; (11) a worker started with other
settings than the group's never enters a view with its members, and is told so (it ends
on ConfigMismatch); (12) with silent corruption drawn, a member whose state went wrong
(``GroupSimulation.taint``) commits no step more than ``fingerprint_every`` steps after the
corruption struck while most of its view (its shard index's processes) hold a state that
did not, and a script ends on StateDiverged only after some state went wrong. A corrupted
state is exempt from invariants 1 and 3: its commits differ from the others' by
definition, which is what 12 bounds.
Invariant 0 is the simulation's own: a worker's script raised what no user's script
should see, or its loop spun without virtual time passing.
"""

from __future__ import annotations

import collections
import hashlib
from typing import TYPE_CHECKING

from ..core import engine as core
from ..core.view import View, gone_from, has_quorum

if TYPE_CHECKING:
    from .world import GroupSimulation, Worker


def committed(world: "GroupSimulation", w: "Worker", view: View) -> None:
    """``w``'s loop committed its step ``w.loop.step`` in ``view``: the optimizer steps (the
    state's digest advances), and invariants 1 to 4 are checked."""
    now, step = world.sim.now, w.loop.step
    key = (view.id, view.digest)
    origin = world.taint.get(w.state.value)
    if origin is not None:
        _committed_wrong(world, w, view, origin)
        return
    if w.last_view != key:  # its first commit in this view
        w.last_view = key
        first = world.view_digest.setdefault((*key, w.shard), (step - 1, w.state.value))
        if first != (step - 1, w.state.value):
            world.violation(3, f"{w.id} starts view {view.id} at {(step - 1, w.state.value)}, another member at "
                               f"{first}")
        steps = world.view_digest.setdefault(key, step - 1)  # every shard of every replica: one step
        if steps != step - 1:
            world.violation(3, f"{w.id} (shard {w.shard}) starts view {view.id} at step {step - 1}, another "
                               f"member at step {steps}: a replica's shards are a step apart")
    digest = int.from_bytes(hashlib.blake2b(f"{w.state.value}/{step}/{view.id}".encode(), digest_size=8).digest(),
                            "big")
    world.whole.setdefault(step, collections.defaultdict(set))[w.replica[0] if w.replica is not None else w.id].add(
        w.shard)
    if w.committed and step <= w.committed[-1][1]:
        world.violation(2, f"{w.id} commits step {step} after step {w.committed[-1][1]}")
    known = world.contents.setdefault((step, *key, w.shard), digest)
    if known != digest:
        world.violation(1, f"step {step} committed with two contents in view {view.id} (by {w.id})")
    first, first_members, first_view = world.history.setdefault((step, w.shard),
                                                                (digest, frozenset(view.members), key))
    if first != digest:
        line = _line_of(world, first_view) if not first_members & set(view.members) else None
        if line is not None and key not in line:
            newest = max(s for s, _ in world.history)
            if any(x.loop.step >= newest - 1 and not line.isdisjoint(_views_run(x))
                   for x in world.live() if x.id not in view.member_set):
                world.violation(4, f"step {step} committed by two disjoint groups: view {view.id} "
                                   f"({len(view.members)} members) and an earlier view of {len(first_members)}, "
                                   f"while a worker outside it holds the group's newest state")
            # Every worker that held the group's newest state died or left: the state was lost
            # with them (the simulation keeps no checkpoint), and a new group trains from an
            # older one.
            world.lost_state += 1
        else:
            # Committed on some members only, then the others carried on without them: this
            # commit (or the earlier one) is discarded when its member is reconciled.
            world.rolled_back += 1
    if world.partition is not None and world.partition[2] is not None:
        side_a, side_b, before = world.partition
        side = side_a if w.id in side_a else side_b
        # members that had left gracefully, or stood aside, before the cut do not count, as in
        # the quorum rule; nor do those of the other side dead by now (that side holds none
        # of them: the survivors may count them out once their ports refuse)
        dead = {x.id for x in world.workers.values() if (x.crashed or x.exited) and x.id not in side}
        if set(view.members) <= side and not has_quorum(before, [m for m in before.members if m in side],
                                                        world.partition_left | dead):
            world.violation(4, f"{w.id} commits step {step} in view {view.id} on the minority side of a partition "
                               f"of view {before.id}")
    w.state.value = digest
    w.committed.append((now, step, view.id))


def _committed_wrong(world: "GroupSimulation", w: "Worker", view: View, origin: int) -> None:
    """``w`` commits step ``w.loop.step`` holding a state that descends from a corruption
    struck at step ``origin``: its next state descends from it too. Invariant 12."""
    step, every = w.loop.step, world.options.fingerprint_every
    shard = [m for m in view.members[w.shard::world.k] if m in world.by_id]
    healthy = sum(1 for m in shard if world.by_id[m].state.value not in world.taint)
    if every and step > origin + every and 2 * healthy > len(shard):
        world.violation(12, f"{w.id} commits step {step} in view {view.id} with a state that went wrong at step "
                            f"{origin}, more than fingerprint_every={every} steps later, while {healthy} of the "
                            f"{len(shard)} members hold a right one")
    digest = int.from_bytes(hashlib.blake2b(f"{w.state.value}/{step}/{view.id}".encode(), digest_size=8).digest(),
                            "big")
    world.taint[digest] = origin
    world.wrong_commits += 1
    world.wrong_steps.add(step)
    world.whole.setdefault(step, collections.defaultdict(set))[w.replica[0] if w.replica is not None else w.id].add(
        w.shard)  # a replica committed the step (see state_lost), whatever state one of its shards holds
    if w.committed and step <= w.committed[-1][1]:
        world.violation(2, f"{w.id} commits step {step} after step {w.committed[-1][1]}")
    w.last_view = (view.id, view.digest)
    w.state.value = digest
    w.committed.append((world.sim.now, step, view.id))


def diverged(world: "GroupSimulation", w: "Worker", exc: BaseException) -> None:
    """``w``'s script ended on StateDiverged: only where some state went wrong (12)."""
    if not world.corruptions:
        world.violation(12, f"{w.id} raised StateDiverged while no state went wrong: {exc}")


def state_lost(world: "GroupSimulation", w: "Worker") -> None:
    """``w`` raised StateLost: no member of its view holds every shard of the newest step
    (invariant 3). Legitimate only when a replica committed that step on every shard and
    is gone since; a step some replica committed on some of its processes only would be a
    replica's shards a step apart."""
    view = w.loop.engine.view
    members = set(view.members) if view is not None else {w.id}
    newest = max(x.loop.step for x in world.workers.values() if x.id in members)
    if not any(len(shards) == world.k for shards in world.whole.get(newest, {}).values()):
        world.violation(3, f"{w.id} raised StateLost in view {view.id if view else None}: step {newest} was never "
                           f"committed by every process of a replica (a replica committed it on some processes only)")


def step_started(world: "GroupSimulation", w: "Worker") -> None:
    """``w`` begins a gradient step: who else trains then (see stood_aside)."""
    w.step_with = _others_training(world, w)


def step_ended(world: "GroupSimulation", w: "Worker", committed: bool, reformed: bool) -> None:
    """``w``'s gradient step returned (``reformed``: a re-formation ran inside it). Invariant
    8: more than ``max_retries`` steps in a row that failed and re-formed end in
    RetryLimitExceeded (the user learns that the membership keeps changing)."""
    w.failed_in_a_row = w.failed_in_a_row + 1 if not committed and reformed else 0
    if w.loop.engine.state == "ASIDE_DUE" and w.chosen_with is None:  # this step chose it (see stood_aside)
        w.chosen_with = w.step_with
    if w.failed_in_a_row > world.options.max_retries + 1:
        world.violation(8, f"{w.id}'s gradient steps failed and re-formed {w.failed_in_a_row} times in a row "
                           f"(max_retries={world.options.max_retries}) without RetryLimitExceeded")


def _others_training(world: "GroupSimulation", w: "Worker") -> frozenset:
    """The replicas other than ``w``'s that live and do not stand aside."""
    return frozenset(x.replica[0] if x.replica is not None else x.id for x in world.live()
                     if x is not w and x.loop.engine.state != "STANDING_ASIDE")


def stood_aside(world: "GroupSimulation", w: "Worker") -> None:
    """Invariant 9: a straggler stands aside only where the others still make min_workers,
    as they were when the step that chose it began (a member that fails or leaves on its
    own while that step runs, after its share was reduced with it, is a fault of its own,
    which the choice cannot foresee: seed 7599)."""
    others = w.chosen_with if w.chosen_with is not None else _others_training(world, w)
    w.chosen_with = None
    if len(others) < world.min_workers:
        world.violation(9, f"{w.id} stands aside as a straggler, leaving {len(others)} worker(s) below "
                           f"min_workers={world.min_workers}")


def at_end(world: "GroupSimulation") -> None:
    """Invariants 5, 6, 7 and 11 once the run is over."""
    steps = sorted({step for step, _ in world.history} | world.wrong_steps)
    if steps and steps != list(range(1, steps[-1] + 1)):
        missing = sorted(set(range(1, steps[-1] + 1)) - set(steps))[:5]
        world.violation(5, f"committed steps are not contiguous: missing {missing}")
    live = world.live()
    live_ids = {w.id for w in live}
    # The newest view formed (and verified) by anyone, dead or alive.
    newest = max((w.loop.engine.view for w in world.workers.values() if w.loop.engine.view is not None),
                 key=lambda v: v.id, default=None)
    # Members count as gone only when a live member holds their final record: one that
    # left while cut off from every survivor, and exited before the heal, is as good as
    # dead to them (nothing tells a departure from a death on the other side of a cut).
    left = set().union(*(gone_from(newest, world.read_statuses(w)) for w in live))
    survivors = [m for m in newest.members if m in live_ids] if newest is not None else []
    world.quorum_survived = newest is None or (bool(survivors) and has_quorum(newest, survivors, left))
    # A live member that entered a newer view, whose formation failed everywhere, cannot know
    # that: the view may have formed on the others (Engine._quorum_of_entered), so it goes on
    # only with a quorum of that view too (or with its missing members proven gone).
    for w in live:
        entered, short_of = w.loop.engine.entered_view, w.loop.engine.short_of
        if world.quorum_survived and entered is not None and newest is not None and entered.id > newest.id \
                and short_of is not None and short_of.id == entered.id:
            gone = set().union(*(gone_from(entered, world.read_statuses(x)) for x in live))
            world.quorum_survived = has_quorum(entered, [m for m in entered.members if m in live_ids], gone)
    # Nor when the group's state died with the members that held it (every live member
    # holds an older one, beyond a step that committed on some members only): going on
    # from an older state would commit its steps again.
    # With sharded replicas, the state survives in a replica whose every shard holds it (one
    # that received some of its shards only holds no model).
    # A worker one step behind holds it only when its view committed that step on others
    # and not on it; one that was not in any view that committed it never held it (seed
    # 7754 of replicas: a replica cut off before the step, whose view went on and was then
    # lost whole, is two states behind the group, not one commit).
    newest_step = max((step for step, _ in world.history), default=0)
    committing = {view for x in world.workers.values() for _, step, view in x.committed if step == newest_step}
    in_committing = {m for x in world.workers.values() for change in x.loop.events if change.view_id in committing
                     for m in change.members}
    holders: dict[str, set[int]] = collections.defaultdict(set)
    for w in live:
        if w.loop.step >= newest_step or (w.loop.step == newest_step - 1 and w.id in in_committing):
            holders[w.replica[0] if w.replica is not None else w.id].add(w.shard)
    if world.quorum_survived and newest_step and not any(len(shards) == world.k for shards in holders.values()):
        world.quorum_survived = False
    # Nor when fewer replicas live than min_workers: the group waits for more.
    replicas = {w.replica[0] if w.replica is not None else w.id for w in live}
    if len(replicas) < world.min_workers:
        world.quorum_survived = False
    # Without a quorum of the newest view alive the quorum policy must stop (and wait for
    # the lost members) rather than go on: liveness is owed only when a quorum survived.
    # When every member of the newest view left, the group ended with them: the members
    # left behind hold older states, and going on from one would commit those steps again.
    if world.settled_at is None and world.quorum_survived:
        states = {w.id: (w.loop.engine.state, w.loop.engine.view.id if w.loop.engine.view else None) for w in live}
        world.violation(6, f"within {world.liveness_bound:.1f} s of the last fault the live members never ran one view "
                           f"of all of them, committing: {states}")
    for w in world.workers.values():
        if w.foreign and not w.crashed and w.ended_on not in ("ConfigMismatch", "JoinError"):
            world.violation(11, f"{w.id}, started with other settings than the group's, was never told so (it "
                                f"{'ended on ' + w.ended_on if w.ended_on else 'waits in ' + w.loop.engine.state})")
    current = {w.id: w.loop.ports.communicators.comm for w in live}
    for w in world.workers.values():
        open_comms = [entry[0] for entry in w.comms if not entry[1]]
        allowed = [current[w.id]] if w.id in current else []
        leaving = w.loop.engine.view if w.loop.engine.state == core.LEAVING and not w.crashed else None
        if leaving is not None:  # it lingers in the view it leaves (leave_grace): its communicator with it
            allowed.append((leaving.id, leaving.digest))
        if any(c not in allowed for c in open_comms):
            world.violation(7, f"{w.id} still holds communicators {open_comms} (current {current.get(w.id)})")


def _views_run(x: "Worker") -> list[tuple]:
    """The views ``x``'s loop ran, oldest first, as (id, digest)."""
    return [(change.view_id, View(change.view_id, change.members).digest) for change in x.loop.events]


def _line_of(world: "GroupSimulation", ancestor: tuple) -> set[tuple]:
    """View ``ancestor`` and every view formed from it, through views each formed by a
    member of the one before (the views every worker ran, in order). A step committed on
    some members of ``ancestor`` only, whose other members went on (a tie holder with a
    joiner, say) and then left the view to the joiner alone, is overwritten by a commit in
    that line: a rollback, not two groups; and a worker that ran none of the line (one of
    a group started over after every holder of the old one was gone) holds none of its
    state."""
    children: dict[tuple, set] = collections.defaultdict(set)
    for x in world.workers.values():
        run = _views_run(x)
        for before, after in zip(run, run[1:]):
            children[before].add(after)
    line, todo = set(), [ancestor]
    while todo:
        current = todo.pop()
        if current not in line:
            line.add(current)
            todo.extend(children[current])
    return line


def view_changed(world: "GroupSimulation", w: "Worker") -> None:
    """Invariants 10 and 11 for the views ``w``'s loop formed since the last look: none left
    out a member whose CPU was merely starved (no fault struck it) by less than the detector
    tolerates (STARVED_TOLERATED: it kept answering, late, and must not be named hung) or
    paused for a garbage collection it announced (``collect``: it answers once the
    collection ends, within ``pause_grace``), and none holds workers started with different
    settings."""
    events = w.loop.events
    for change in events[w.views_seen:]:
        foreign = [m for m in change.members if (x := world.by_id.get(m)) is not None and x.foreign != w.foreign]
        if foreign:
            world.violation(11, f"{w.id} formed view {change.view_id} with {foreign}, started with other settings")
        for member in change.removed:
            x = world.by_id.get(member)
            lag = _merely_starved(world, x) if x is not None else None
            # (with sharded replicas, a partner's fault removes the whole replica, whichever
            # replica the repair put this process in since)
            partner_struck = world.k > 1 and any(
                (y := world.by_id.get(m)) is not None and (y.crashed or y.hung or y.gone or y.exited)
                for m in change.removed if m != member)
            paused = _merely_collecting(world, x, change.members) if x is not None and not partner_struck else None
            if paused is not None and (lag is None or lag <= STARVED_TOLERATED):
                world.violation(10, f"view {change.view_id} ({change.reason}) left out {member}, whose process "
                                    f"only paused for a garbage collection of {paused:g} s it announced")
            if lag is None:
                continue
            world.starved_excluded.append((member, lag, change.reason))
            if lag <= STARVED_TOLERATED:
                world.violation(10, f"view {change.view_id} ({change.reason}) left out {member}, whose CPU was "
                                    f"starved by up to {lag:g} s only: it kept answering")
    w.views_seen = len(events)


def _merely_starved(world: "GroupSimulation", x: "Worker") -> float | None:
    """The lag of ``x``'s recent starvations (the worst) when nothing else struck it (a sharded replica
    leaves as a whole: nothing else struck any of its processes, and the lag is the
    largest of theirs); None when it was not starved lately or something else struck."""
    processes = _struck_by_nothing(world, x)
    lags = [lag for p in processes or () for lag, until in p.starved_windows if world.sim.now <= until + STARVED_GRACE_S]
    return max(lags) if lags else None


def _merely_collecting(world: "GroupSimulation", x: "Worker", members: tuple[str, ...]) -> float | None:
    """The longest of ``x``'s recent garbage collections (its replica's, for a sharded
    replica) that it announced to every one of ``members`` (the view that left it out: a
    worker that joined during the pause was not told), when nothing else struck it; None
    when it collected none such lately or something else struck (see :func:`_merely_starved`)."""
    processes = _struck_by_nothing(world, x)
    lengths = [length for p in processes or () for length, until, told in p.collections
               if world.sim.now <= until + STARVED_GRACE_S and set(members) - {p.id} <= told]
    return max(lengths) if lengths else None


def _struck_by_nothing(world: "GroupSimulation", x: "Worker") -> list | None:
    """``x``'s processes (its replica's, for a sharded replica: it leaves as a whole) when no
    fault struck any of them and no cut may explain a view that left them out; else None."""
    processes = ([p for p in world.workers.values() if p.replica is not None and p.replica[0] == x.replica[0]]
                 if x.replica is not None else [x])
    if _cut_lately(world) or any(p.crashed or p.hung or p.gone or p.exited or p.slow > 1.0 or p.aside
                                 for p in processes):
        return None
    return processes


def _cut_lately(world: "GroupSimulation") -> bool:
    """A cut is active (every member is on one side or the other), or healed within
    STARVED_GRACE_S: a view a member was left out of may be the cut's."""
    return world.partition is not None or world.sim.now <= world.healed_at + STARVED_GRACE_S


STARVED_TOLERATED = 0.05
"""A member whose loop, timers, sends and receptions each run up to this late (a round trip
up to twice as late, plus the network's) keeps answering well within the detector's
windows (``urgent_probe_timeout`` 0.1 s, stretched after slow answers, up to
``probe_timeout``): it is never to be left out. Starved longer, it may be, as a member
that is stopped for as long would be."""

STARVED_GRACE_S = 3.0
"""A view that formed this long after a member's starvation ended may still be about it: a
suspicion raised while it was starved becomes a death up to Lifeguard's suspicion timeout
later (2.5 s for five members), and a fault elsewhere can hold the agreement that long. A
member starved twice in that time is judged by the worse of the two lags."""
