"""View agreement: from eventually-consistent membership to one agreed, ordered view.

Pure functions over what gossip shows (no I/O). Each member publishes a small status
record in its gossip metadata (:class:`Status`); every member runs the same rule on the
same records, so once gossip has converged they compute the same candidate, and the
view is agreed when every member of the candidate publishes the same proposal.

The rule (see docs/ARCHITECTURE.md):

1. Candidate: the previous view's members that are alive, not leaving and not standing
   aside as stragglers, in their previous order, then joiners ordered by (join time,
   id), up to ``max_workers``.
   With no previous view (a fresh group) the candidate is the joiners alone.
2. Quorum: the candidate holds a strict majority of the previous view's members that
   are not confirmed gone (left gracefully, from that view or an older one); a tie goes
   to the side holding the previous view's lowest-ranked member that is not confirmed
   gone (rank 0 unless it left). A member that lost its view (it was left out of a newer
   one) and rejoins founds no group of its own: it only adopts the existing group's
   proposals, unless that group is gone (see ftcomm.core.engine).
3. Agreement: every candidate member publishes the same ``(view id, digest)``; the
   view id is one more than the highest current view id among the candidate, raised
   to the highest floor a candidate member publishes. A member whose formation of
   view N failed withdraws its proposal and raises its floor to N + 1, so a retry
   never reuses the rendezvous keys of an abandoned attempt (members retrying out of
   step would otherwise meet each other's stale addresses).
4. Sharded replicas (``replica_size`` K > 1): each member is one process of a replica.
   Only whole replicas are usable: a member whose replica misses a process among the
   usable members is left out with it. A view therefore holds whole replicas, each as K
   consecutive members in shard order (rank ``r`` is shard ``r % K`` of replica ``r // K``):
   the survivors keep their order and joiners come replica by replica.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

JOINING, ACTIVE, LEAVING = "joining", "active", "leaving"
MAX_VIEW_ID = 2**31  # far beyond any group's lifetime; larger ids in a record are refused
# The group protocol's version: this record, the view verification probe and the step rounds.
# Workers that speak different versions never form a group (it is one of the settings that
# must match); a record from before the version was carried reads as version 1.
PROTOCOL = 7  # 5: the verification probe carries rank 0's reason for the view; 6: acks may say how late
# their member runs (a member of version 5 drops them); 7: a gradient step's counters and a reconcile's
# state summaries carry state fingerprints; sdc_policy and fingerprint_every are settings


@dataclass(frozen=True)
class View:
    """An agreed, ordered member list; a member's rank is its index."""

    id: int
    members: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.members)

    @cached_property
    def digest(self) -> str:
        return view_digest(self.id, self.members)

    @cached_property
    def member_set(self) -> frozenset[str]:
        """The members, for membership tests (a view may hold a thousand)."""
        return frozenset(self.members)

    def rank_of(self, member_id: str) -> int:
        return self.members.index(member_id)


def view_digest(view_id: int, members: tuple[str, ...] | list[str]) -> str:
    text = f"{view_id}\n" + "\n".join(members)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Status:
    """What one member publishes about itself in gossip metadata (a few dozen bytes).

    This module owns the record's encoding (:meth:`StatusRecord.encode`, :meth:`from_metadata`);
    nothing else reads its keys.
    """

    id: str
    alive: bool  # gossip state is alive (not suspect, dead or left)
    left: bool  # gossip state is left: confirmed gone
    phase: str  # joining | active | leaving
    current_view: int  # id of its current agreed view, 0 for none
    proposal: tuple[int, str] | None  # (view id, digest) it proposes, if any
    joined_at: float
    config: str  # digest of the settings that must match across the group
    floor: int = 0  # lowest view id it accepts: the views below failed to form there
    step: int = 0  # committed training steps
    rendezvous_port: int | None = None  # its rendezvous store's TCP port (same host as gossip)
    settings: tuple = ()  # backend, min_workers, max_workers, partition_policy, protocol, ...: named in a mismatch error
    done_ops: tuple[int, int] | None = None  # leaving: (view id, group operations it completed in that view)
    insecure: bool = False  # started without a secret on a reachable address (shown by ``ftcomm members``)
    view_digest: str | None = None  # digest of its current view (leaving: of the view it names)
    dead: bool = False  # gossip state is dead (confirmed failed; suspect is neither alive nor dead)
    compute_s: float | None = None  # median compute time of its recent gradient steps (see ftcomm.runtime.stragglers)
    benched: int | None = None  # a straggler (straggler_policy "exclude"): the view it stood aside from, until it forms a newer one
    aside: bool = False  # standing aside now (its cooldown is not over), or a joiner holding back (Engine._may_found)
    agreed: tuple[int, str] | None = None  # as rank 0 of this proposal, it saw every member make it (ftcomm.core.engine)
    replica: tuple[str, int, int] | None = None  # a sharded replica's process: (replica key, shard rank, replica size)

    @property
    def last_view(self) -> int:
        """The newest view this member is known to have formed (a leaving member names the
        view it leaves)."""
        if self.phase == ACTIVE:
            return self.current_view
        return self.done_ops[0] if self.done_ops is not None else 0

    @property
    def final(self) -> bool:
        """It left, and its final record arrived: it names the view it left (a ``left`` gossip
        state with an older record may hide a newer view it left)."""
        return self.left and self.phase == LEAVING and self.done_ops is not None

    @classmethod
    def from_metadata(cls, member_id: str, gossip_state: str, meta: dict) -> "Status | None":
        """Decode; None when the record is not an ftcomm worker's (or is malformed). An optional
        field that is malformed reads as absent."""
        try:
            proposal = (int(meta["pv"]), str(meta["pd"])) if meta.get("pv") else None
            status = cls(member_id, gossip_state == "alive", gossip_state == "left", str(meta["ph"]),
                         int(meta["cv"]), proposal, float(meta["jt"]), str(meta["cf"]), int(meta.get("fl", 0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        views = [status.current_view, status.floor] + ([status.proposal[0]] if status.proposal else [])
        if not all(0 <= v <= MAX_VIEW_ID for v in views):
            return None  # a view id no group reaches: a forged or corrupt record
        extra: dict = {}
        if _is_int(meta.get("st")):
            extra["step"] = meta["st"]
        if _is_int(meta.get("rz")) and 0 < meta["rz"] < 65536:
            extra["rendezvous_port"] = meta["rz"]
        if isinstance(meta.get("set"), (list, tuple)):
            extra["settings"] = tuple(meta["set"][:8]) + ((1,) if len(meta["set"]) == 4 else ())
        ops = meta.get("op")
        if isinstance(ops, (list, tuple)) and len(ops) == 2 and all(_is_int(x) and 0 <= x <= MAX_VIEW_ID for x in ops):
            extra["done_ops"] = (ops[0], ops[1])
        if meta.get("insecure") is True:
            extra["insecure"] = True
        if gossip_state == "dead":
            extra["dead"] = True
        if isinstance(meta.get("cd"), str) and len(meta["cd"]) <= 64:
            extra["view_digest"] = meta["cd"]
        if _is_int(meta.get("ct")) and 0 <= meta["ct"] <= MAX_COMPUTE_MS:
            extra["compute_s"] = meta["ct"] / 1000
        if _is_int(meta.get("bn")) and 0 < meta["bn"] <= MAX_VIEW_ID:
            extra["benched"] = meta["bn"]
            extra["aside"] = meta.get("ba") is True
        if meta.get("hd") is True:
            extra["aside"] = True  # a joiner holding back: no candidate view includes it
        replica = meta.get("rp")
        if (isinstance(replica, (list, tuple)) and len(replica) == 3 and isinstance(replica[0], str)
                and 0 < len(replica[0]) <= 64 and _is_int(replica[2]) and 1 < replica[2] <= MAX_REPLICA_SIZE
                and _is_int(replica[1]) and 0 <= replica[1] < replica[2]):
            extra["replica"] = (replica[0], replica[1], replica[2])
        agreed = meta.get("ag")
        if (isinstance(agreed, (list, tuple)) and len(agreed) == 2 and _is_int(agreed[0])
                and 0 < agreed[0] <= MAX_VIEW_ID and isinstance(agreed[1], str) and len(agreed[1]) <= 64):
            extra["agreed"] = (agreed[0], agreed[1])
        return dataclasses.replace(status, **extra) if extra else status


MAX_REPLICA_SIZE = 1024
"""Processes in one sharded replica: a record claiming more is malformed."""

MAX_COMPUTE_MS = 1 << 30
"""A published compute time above this (about 12 days) is not a figure any member measured."""


def _is_int(value: object) -> bool:
    return type(value) is int


@dataclass(frozen=True)
class StatusRecord:
    """What one member publishes about itself (:meth:`encode` gives the gossip metadata that
    :meth:`Status.from_metadata` decodes; its peers add the gossip state). Built in one
    place, :meth:`ftcomm.core.engine.Engine.record`."""

    phase: str
    current_view: int
    proposal: tuple[int, str] | None
    joined_at: float
    config: str
    step: int = 0
    rendezvous_port: int = 0
    floor: int = 0
    settings: tuple = ()
    done_ops: tuple[int, int] | None = None
    insecure: bool = False
    view_digest: str | None = None
    compute_s: float | None = None
    benched: int | None = None
    aside: bool = False  # a straggler standing aside now (with ``benched``)
    agreed: tuple[int, str] | None = None
    holding: bool = False  # a joiner that founds no group (Engine._may_found): reads as standing aside
    replica: tuple[str, int, int] | None = None  # see Status.replica
    view_reason: str | None = None  # why its current view formed (shown by ftcomm members and ftcomm run)
    diverged: tuple[int, int] | None = None  # times its state fingerprint was named, and the last step it was
    repairing: bool = False  # its sharded replica lost a process and forms again in place (ftcomm members shows it)

    def encode(self) -> dict:
        meta = {"ph": self.phase, "cv": self.current_view, "jt": self.joined_at, "cf": self.config, "st": self.step,
                "rz": self.rendezvous_port}
        if self.compute_s is not None:
            meta["ct"] = min(MAX_COMPUTE_MS, max(0, round(self.compute_s * 1000)))
        if self.floor:
            meta["fl"] = self.floor
        if self.proposal is not None:
            meta["pv"], meta["pd"] = self.proposal
        if self.settings:
            meta["set"] = list(self.settings)
        if self.done_ops is not None:
            meta["op"] = list(self.done_ops)
        if self.insecure:
            meta["insecure"] = True
        if self.view_digest is not None:
            meta["cd"] = self.view_digest
        if self.benched is not None:
            meta["bn"] = self.benched
            if self.aside:
                meta["ba"] = True
        if self.agreed is not None:
            meta["ag"] = list(self.agreed)
        if self.holding:
            meta["hd"] = True
        if self.replica is not None:
            meta["rp"] = list(self.replica)
        if self.view_reason is not None:
            meta["vr"] = self.view_reason[:16]
        if self.diverged is not None:
            meta["sd"] = list(self.diverged)
        if self.repairing:
            meta["rr"] = True
        return meta


def has_quorum(previous: View | None, members: list[str] | tuple[str, ...], gone: set[str], tie: bool = True) -> bool:
    """Strict majority of the previous view's members not confirmed gone; ties to the lowest
    such rank (unless ``tie`` is False)."""
    if previous is None:
        return True
    eligible = [m for m in previous.members if m not in gone]
    if not eligible:
        return True  # everybody else left gracefully: nobody can contest
    present = set(members)
    kept = sum(1 for m in eligible if m in present)
    if 2 * kept > len(eligible):
        return True
    # A tie goes to the side holding the oldest member not confirmed gone (rank 0 unless it left).
    return tie and 2 * kept == len(eligible) and eligible[0] in present


def gone_from(previous: View | None, statuses: dict[str, Status]) -> set[str]:
    """Members confirmed gone for the quorum over ``previous``: they left gracefully, their
    final record arrived, and they did not leave a newer view (a member that left a newer
    view proves that view exists; its departure says nothing about the majority of
    ``previous``). A straggler standing aside from ``previous`` (or an older view) counts
    as gone too: it proposes nothing while it stands aside, and comes back as a member
    that lost its view, which only joins the group it finds."""
    limit = previous.id if previous is not None else 0
    # Only a member whose final record arrived (phase leaving, naming the view it leaves)
    # counts: with an older record, or none naming a view (it had lost its view), it may
    # have left a newer view this member never saw.
    return {s.id for s in statuses.values()
            if (s.final and s.done_ops[0] <= limit)
            or (s.benched is not None and s.benched == limit)}


@dataclass(frozen=True)
class Candidate:
    members: tuple[str, ...]
    view_id: int
    quorum: bool
    standby: tuple[str, ...]  # eligible joiners beyond max_workers

    @cached_property
    def digest(self) -> str:
        return view_digest(self.view_id, self.members)


def candidate(own_id: str, previous: View | None, statuses: dict[str, Status], config: str,
              max_workers: int | None, proven_gone: frozenset[str] = frozenset()) -> Candidate:
    """The view this member proposes, computed only from ``previous`` and gossip.
    ``proven_gone``: members of ``previous`` whose process is gone for sure (their port
    refused a connection). None of them can be on the other side of a partition now, but
    before it died one may have helped the other side form a newer view that this member
    cannot see: without them, only a strict majority of the rest is a quorum (a tie would
    go to whichever member each side happens to have proven the others dead before)."""
    usable = {s.id: s for s in statuses.values()
              if s.alive and s.phase != LEAVING and not s.aside and s.config == config}
    own = statuses.get(own_id)
    if own is not None and own.replica is not None:  # a group of sharded replicas: replicas only
        usable = {m: s for m, s in usable.items() if s.replica is not None and s.replica[2] == own.replica[2]}
    if previous is not None:
        survivors = [m for m in previous.members if m in usable]
    else:
        survivors = []
    kept = set(survivors)
    joiners = [s for s in usable.values() if s.phase == JOINING and s.id not in kept]
    # Sharded replicas enter and stay whole: of a replica whose process neither survives
    # nor joins (it still shows an older view, say), none is a candidate.
    whole = whole_replicas({m: usable[m] for m in survivors} | {s.id: s for s in joiners})
    survivors, joiners = [m for m in survivors if m in whole], [s for s in joiners if s.id in whole]
    ordered = survivors + [s.id for s in sorted(joiners, key=joiner_order(joiners))]
    if own is not None and own.replica is not None:
        ordered = consecutive_replicas(ordered, usable)
    limit = len(ordered) if max_workers is None else max_workers
    if ordered and statuses[ordered[0]].replica is not None:
        limit -= limit % statuses[ordered[0]].replica[2]  # whole replicas only
    members, standby = tuple(ordered[:limit]), tuple(ordered[limit:])
    gone = gone_from(previous, statuses)
    quorum = has_quorum(previous, members, gone) or (
        bool(proven_gone) and has_quorum(previous, members, gone | proven_gone, tie=False))
    view_id = 1 + max([statuses[m].current_view for m in members if m in statuses] +
                      [previous.id if previous else 0])
    view_id = max([view_id] + [statuses[m].floor for m in members if m in statuses])
    return Candidate(members, view_id, quorum, standby)


def whole_replicas(usable: dict[str, Status]) -> dict[str, Status]:
    """``usable`` without the processes of sharded replicas that miss one of their processes
    (or hold two claiming one shard rank, or disagree on the replica's size): the same
    members whatever the order of ``usable``. A member of no replica is whole on its own
    (in a group of replicas its record is malformed: :func:`candidate` leaves it out)."""
    shards: dict[str, list[int]] = {}
    sizes: dict[str, set[int]] = {}
    for s in usable.values():
        if s.replica is not None:
            shards.setdefault(s.replica[0], []).append(s.replica[1])
            sizes.setdefault(s.replica[0], set()).add(s.replica[2])
    whole = {key for key, ranks in shards.items()
             if len(sizes[key]) == 1 and sorted(ranks) == list(range(next(iter(sizes[key]))))}
    return {m: s for m, s in usable.items() if s.replica is None or s.replica[0] in whole}


def consecutive_replicas(ordered: list[str], usable: dict[str, Status]) -> list[str]:
    """``ordered`` with each sharded replica's processes consecutive, in shard order, at the
    place of its first process: a replica of which one process survives a view and another
    joins (it stood aside, see Engine._silent_partner) gets ranks its mesh can use."""
    first: dict[str, int] = {}
    for position, m in enumerate(ordered):
        first.setdefault(usable[m].replica[0], position)
    return sorted(ordered, key=lambda m: (first[usable[m].replica[0]], usable[m].replica[1]))


def joiner_order(joiners: list[Status]):
    """The sort key of joiners: by join time, then id; a sharded replica's processes
    together, in shard order, at the time its first process joined."""
    first: dict[str, tuple[float, str]] = {}
    for s in joiners:
        if s.replica is not None:
            first[s.replica[0]] = min(first.get(s.replica[0], (s.joined_at, s.replica[0])), (s.joined_at, s.replica[0]))

    def key(s: Status) -> tuple:
        if s.replica is None:
            return (s.joined_at, s.id, 0)
        return (*first[s.replica[0]], s.replica[1])
    return key


def replica_broken(own: tuple[str, int, int] | None, statuses: dict[str, Status]) -> str | None:
    """A process of this member's sharded replica (``own``: its replica key, shard rank and
    size) is confirmed gone (dead, or left): the replica cannot train again, for torch's
    process group inside it is broken. The member that is gone, or None."""
    if own is None:
        return None
    for s in statuses.values():
        if s.replica is not None and s.replica[0] == own[0] and s.replica[1] != own[1] and (s.dead or s.left):
            return s.id
    return None


def state_elsewhere(key: str, config: str, statuses: dict[str, Status]) -> bool:
    """A live member of a sharded replica other than ``key`` runs a view of this group
    (``config``): it holds the group's state, which the processes of replica ``key`` receive
    when they join again (a replica repaired in place, see ftcomm.training.replica_repair)."""
    return any(s.alive and s.replica is not None and s.replica[0] != key and s.current_view > 0
               and s.config == config for s in statuses.values())


def group_ended(own: Status, records: Iterable[Status], saw_view: int) -> bool:
    """A joiner saw a group (its newest view ``saw_view``), and every member of it that held
    that view or a newer one has since left gracefully (none died: a crash of the rest is
    not an end). The group ended before admitting it. ``records``: every member of the
    local table, confirmed or not (one not confirmed yet that holds a newer view shows the
    group alive)."""
    members = [s for s in records if s.id != own.id and s.config == own.config and s.last_view >= saw_view]
    return saw_view > 0 and bool(members) and all(s.left for s in members)


def group_finished(own: Status, records: Iterable[Status]) -> bool:
    """A fresh worker that never saw its group live finds only the records of members that
    left it after training (their final records name a view and a committed step), and no
    member of the group that did not leave (one that holds a view or trained: a dead one
    may live on across a partition, a rejoining one is in no view for a moment): the group
    trained and ended before this worker arrived (its last member was still announcing its
    departure when this one joined). Founding a group now would train the job a second
    time, from scratch. ``records``: every member of the local table, confirmed or not,
    the dead and the departed included."""
    mine = [s for s in records if s.id != own.id and s.config == own.config]
    # A member that holds a view, or trained (one rejoining after it lost its view, a
    # straggler standing aside: in no view now), is the group unless it left.
    group = [s for s in mine if s.last_view > 0 or s.step > 0 or s.floor > 0 or s.benched is not None]
    return any(s.final and s.step > 0 for s in mine) and all(s.left for s in group)


def agreed(proposal: Candidate, statuses: dict[str, Status]) -> bool:
    """Every member of the proposal is alive and publishes exactly this proposal."""
    key = (proposal.view_id, proposal.digest)
    return all(m in statuses and statuses[m].alive and statuses[m].proposal == key for m in proposal.members)


def superseded(own: Status, statuses: dict[str, Status], entered: View | None = None) -> bool:
    """Some member of our group holds (or held) a newer view than this member's current one,
    and not the view this member itself entered (``entered``: the newest view it agreed on
    and tried to form; when that very view formed on the others, this member is one of its
    members, not left out of it).

    A view becomes a member's current view only once every member has formed it, so a
    member whose current view is older than another member's was left out of it (it hung,
    or sat on the minority side of a partition) and must rejoin as a joiner. The evidence
    counts whatever that member's state is now: a member that left a newer view (its final
    record names that view), or died in one, proves the view existed just as well; ignoring
    it let the losing side of a partition count the winner's departure as its own
    majority. Proposals do not count: a left-out member may well propose a newer view id
    from its stale table.
    """
    for s in statuses.values():
        if s.id == own.id or s.config != own.config:
            continue
        if s.last_view < own.current_view or (s.last_view == own.current_view and not outranks(s, own)):
            continue
        if entered is not None and s.last_view == entered.id and s.view_digest == entered.digest:
            continue
        return True
    return False


def outranks(other: Status, own: Status) -> bool:
    """Two groups founded apart (each of its first members saw only itself, or sides of a
    partition under the availability policy) can meet with views of the same id: the one
    whose digest is higher goes on, the other yields and rejoins it (its progress is not
    kept: reconciling takes the newest step), so that they do not both go on committing."""
    return (other.last_view == own.current_view and other.view_digest is not None and own.view_digest is not None
            and other.view_digest > own.view_digest)
