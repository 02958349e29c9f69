"""Gossip configuration: every knob of the membership protocol, its default and its trade-off.

Defaults are chosen for a training cluster: a LAN with sub-millisecond round trips,
tens to thousands of members, and processes whose Python threads share the GIL with a
training loop (so a probe timeout must tolerate pauses of tens of milliseconds).
Values that depend on the cluster size are computed by the named functions below,
each with its formula in the docstring.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields

from . import wire

RECONTACT_FANOUT = 3
"""How many seeds (picked at random among those not known live) a member cut off from the
others sends a join request to each time it asks again (see
ftcomm.core.engine.RECONTACT_MAX_S): enough that two sides of a healed partition find each
other within a round or two, few enough that a large group cut in two does not flood."""


def recontact_targets(unknown: list, rng: random.Random) -> list:
    """The seeds a cut-off member asks this time: RECONTACT_FANOUT of ``unknown`` (those not
    live here) at random, or all of them when they are fewer."""
    return rng.sample(unknown, min(RECONTACT_FANOUT, len(unknown)))


def suspicion_timeout(suspicion_mult: float, n: int, probe_interval: float) -> float:
    """Minimum suspicion timeout: ``suspicion_mult * max(1, log10(n)) * probe_interval``.

    A suspected member has this long (at least) to refute before it is declared dead.
    Grows with log N because a refutation needs O(log N) gossip rounds to reach everyone.
    """
    scale = max(1.0, math.log10(max(1, n)))
    return suspicion_mult * scale * probe_interval


def retransmit_limit(retransmit_mult: int, n: int) -> int:
    """How many times each member forwards one broadcast: ``retransmit_mult * ceil(log10(n + 1))``.

    Infection-style dissemination reaches every member with probability
    ``1 - N**-O(retransmit_mult)`` when each member forwards O(log N) times.
    """
    return retransmit_mult * max(1, math.ceil(math.log10(n + 1)))


def suspicion_confirmations(suspicion_mult: float, n: int) -> int:
    """Independent confirmations (Lifeguard's K) that shrink a suspicion timeout to its minimum.

    ``K = suspicion_mult - 2``, or 0 when fewer than ``K + 2`` members exist (nobody
    else could confirm, so the timeout starts at the minimum).
    """
    k = max(0, int(suspicion_mult) - 2)
    return 0 if n - 2 < k else k


def push_pull_interval(base_interval: float, n: int) -> float:
    """Anti-entropy period, stretched above 32 members: ``base * (1 + ceil(log2(n) - log2(32)))``.

    Keeps the cluster-wide rate of full-state TCP exchanges (each O(N) bytes) from
    growing linearly with N.
    """
    if n <= 32:
        return base_interval
    return base_interval * (1 + math.ceil(math.log2(n) - math.log2(32)))


def parse_assignments(items: list[str]) -> dict[str, float | int]:
    """``["probe_interval=0.2", "indirect_checks=4"]`` to a dict of overrides (CLI helper)."""
    overrides: dict[str, float | int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected NAME=VALUE, got {item!r}")
        overrides[name.strip()] = float(value) if any(c in value for c in ".eE") else int(value)
    return overrides


MAX_PAUSE_GRACE_S = 10.0
"""The longest ``GossipConfig.pause_grace`` accepted (1000 would be milliseconds meant)."""


@dataclass(frozen=True)
class GossipConfig:
    """All parameters of the membership protocol. Times are in seconds."""

    probe_interval: float = 0.5
    """Period of the failure detector: each member probes one other member per period.
    Shorter detects faster and costs proportionally more datagrams."""

    probe_timeout: float = 0.2
    """How long a direct ping waits for its ack before indirect probes are sent. Must be
    well above the round trip plus a GIL pause of the training process; too short
    turns pauses into suspicions (Lifeguard then stretches it, see awareness)."""

    urgent_probe_timeout: float = 0.1
    """How long a probe started on demand (:meth:`Protocol.probe_now`, when a collective
    waits far longer than usual) waits for an ack, direct or relayed by the helpers asked
    in the same moment, before the member is suspected. Shorter than ``probe_timeout``
    because the collective already waits on it; an ack needs only that the member's
    gossip thread runs, which it does while the member computes (awareness stretches it
    on a member that finds itself slow, and to four times the member's slowest recent
    direct answer, which halves every 5 s, up to ``probe_timeout``, on a loaded host).
    The gossip thread needs the GIL: a full garbage collection announces itself
    (``pause_grace``), but a training thread that holds it in one C call (a long numpy operation, pickling a large object)
    for longer than about ``stall_probe_after`` plus this (0.15 s) while the others wait
    on it is taken for hung and the view re-forms (it stays a member and loses a step);
    raise this (0.2: hangs found in about 0.4 s instead of 0.25 s) for such scripts."""

    pause_grace: float = 1.0
    """A member announces each full collection of Python's garbage collector to the members
    it knows, as it starts (one signed datagram each): a full collection holds the GIL, so
    its gossip thread answers no probe until it ends (0.07-0.23 s measured in a worker that
    imports torch, on a loaded 2-core host; seconds with a large heap).
    Probes it leaves unanswered are judged only this many seconds after the notice, when
    an answer is still missing. Bounds how much longer a process stopped or lost right
    after such a notice goes undetected (0 to 10 s); 0 neither sends nor honours notices.
    Only full collections are announced; young ones are short, but a script that raises the
    collector's thresholds or allocates millions of objects at once may make them long too."""

    indirect_checks: int = 5
    """Members asked to ping the target on our behalf (SWIM's k) when the direct ping
    fails. More rescue more lossy paths at the cost of more datagrams per failed direct
    ping. Each false suspicion is broadcast to the whole cluster, so under loss a larger
    k also keeps per-member traffic flat as N grows (measured: k=3 -> 2.1x more
    messages per member from N=100 to N=1000 at 5% loss, k=5 -> 1.0x)."""

    suspicion_mult: float = 5.0
    """Scales the minimum suspicion timeout (see :func:`suspicion_timeout`). Larger
    gives a suspected member longer to refute: fewer false positives, slower detection."""

    suspicion_max_timeout_mult: float = 3.0
    """Lifeguard: a new suspicion starts at ``this * suspicion_mult * max(1, log10(n)) *
    probe_interval`` and shrinks to the minimum as independent confirmations arrive. A
    lone (possibly mistaken) suspecter therefore waits longer than a crowd of them."""

    confirmed_suspicion_mult: float = 5.0
    """A suspicion confirmed by all of Lifeguard's K independent suspecters runs out after
    ``this * probe_interval``, whatever the group's size (at most the size-scaled minimum
    of :func:`suspicion_timeout`, which small groups keep). K members that each failed to
    reach the member, directly and through helpers, are evidence that does not weaken as
    the group grows, and a refutation is sent straight to each suspecter (their timers run
    out first) besides being gossiped. 0: memberlist's rule, where the minimum grows with
    ``log10(n)`` (7.5 s at 1000 members instead of 2.5 s)."""

    retransmit_mult: int = 4
    """Scales how often each broadcast is forwarded (see :func:`retransmit_limit`).
    Larger makes dissemination more certain under loss and costs bandwidth."""

    gossip_interval: float = 0.2
    """Period of the dedicated gossip sends (on top of piggybacking on probes). Shorter
    spreads metadata and deaths faster and sends more datagrams while there is news."""

    gossip_nodes: int = 3
    """Random members each gossip round is sent to (the fan-out)."""

    gossip_to_the_dead_time: float = 5.0
    """For this long after a member is declared dead it still receives gossip, so a
    member that was only paused learns quickly that it must refute."""

    push_pull_interval: float = 15.0
    """Base period of full-state anti-entropy over TCP with one random member
    (stretched for large clusters by :func:`push_pull_interval`). Repairs anything
    gossip missed; 0 disables it (joins still use it)."""

    reconnect_interval: float = 2.0
    """Period of attempts to exchange state with one random dead (not left) member, so
    that the two sides of a healed partition become one cluster again. 0 disables."""

    dead_member_retention: float = 300.0
    """Dead members stay in the table (and are retried for reconnection) this long
    before being forgotten. Bounds how long a partition can last and still heal."""

    left_member_retention: float = 30.0
    """Members that left gracefully are kept this long so late gossip cannot revive them."""

    awareness_max_multiplier: int = 8
    """Lifeguard local health: probe interval and timeout are multiplied by up to this
    when this member itself appears slow (missed acks and nacks). Protects healthy
    members from a struggling one."""

    nack_timeout_fraction: float = 0.8
    """An intermediary of an indirect probe answers with a nack after this fraction of
    the probe timeout, telling the requester that the intermediary itself is healthy."""

    max_datagram_bytes: int = 1400
    """Upper bound of every UDP datagram (below a 1500-byte Ethernet MTU with headers)."""

    max_metadata_bytes: int = 256
    """Upper bound of one member's encoded metadata record."""

    max_stream_bytes: int = 4 * 1024 * 1024
    """Upper bound of one TCP request or response: a push/pull carries the whole member
    table (about 350 bytes a member at the default metadata size: 4 MB holds some 11,000).
    A larger frame is refused before it is read; each connection queues at most one."""

    join_timeout: float = 10.0
    """How long start() keeps retrying the seeds before it gives up with an error."""

    join_retry_interval: float = 0.25
    """Pause between rounds of join attempts while no seed has answered."""

    dns_refresh_interval: float = 30.0
    """Period of looking ``dns://`` seeds up again while the member runs, and of sending a
    join request to each address found that is not a known live member (so that members
    cut off from each other when they started find each other). 0 disables it."""

    request_timeout: float = 2.0
    """Deadline of one TCP request (push/pull, members query)."""

    leave_propagate_time: float = 0.5
    """How long leave() keeps the member running after announcing the departure, so
    the announcement is forwarded."""

    freshness_window: float = 30.0
    """With a secret, a packet is accepted only while its sender's timestamp is within
    this many seconds of the receiver's wall clock, and only once (a bounded cache of
    the packets seen inside the window refuses copies). The hosts' clocks must agree to
    well within it (run NTP). Shorter narrows the time a captured packet can be replayed to a
    member that has not seen it; too short drops packets delayed by a paused process."""

    replay_cache_entries: int = 16384
    """Packets remembered per member for replay detection (about 200 bytes each). When
    more than this many arrive within one freshness window, the window shrinks rather
    than a packet being forgotten; enough for ~500 packets/s per member at the default."""

    max_members: int = 1024
    """Largest member table (this member, and dead and left members, included). A record
    of a new member beyond it is refused (counted in ``rejected.member_table_full``)
    unless a dead or left member, or a live one that never answered its confirmation
    pings, can be forgotten to make room. Bounds the memory and probe traffic a flood of
    forged members can cost; keep it above the largest group."""

    join_rate: float = 50.0
    """New member ids admitted per second, from a bucket that holds ``max_members``: a
    whole cluster can be learned at once (a join, a healed partition), but sustained
    churn beyond this rate is refused (counted in ``rejected.join_rate``)."""

    confirmation_pings: int = 8
    """Extra pings per probe interval to members learned through gossip that have not yet
    answered this member directly, so that a real newcomer is *confirmed* (``confirmed``
    on the member info) within a probe interval or two and a forged one never is. Each
    unconfirmed member gets up to three; more confirm a large batch of newcomers sooner
    at the cost of a burst of datagrams."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and value < 0:
                raise ValueError(f"GossipConfig.{f.name} must be >= 0, got {value}")
        if self.probe_timeout >= self.probe_interval:
            raise ValueError(
                f"GossipConfig.probe_timeout ({self.probe_timeout}) must be shorter than "
                f"probe_interval ({self.probe_interval}): indirect probes need the rest of the period"
            )
        if not 0 < self.urgent_probe_timeout < self.probe_interval:
            raise ValueError(f"GossipConfig.urgent_probe_timeout ({self.urgent_probe_timeout}) must be positive "
                             f"and shorter than probe_interval ({self.probe_interval})")
        if not 0 <= self.pause_grace <= MAX_PAUSE_GRACE_S:
            raise ValueError(f"GossipConfig.pause_grace must be between 0 and {MAX_PAUSE_GRACE_S:g} seconds, got "
                             f"{self.pause_grace}: it delays finding a member stopped right after a collection")
        if self.max_datagram_bytes < 512:
            raise ValueError("GossipConfig.max_datagram_bytes must be at least 512")
        for name in ("freshness_window", "replay_cache_entries", "max_members"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GossipConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_metadata_bytes > wire.MAX_METADATA_BYTES:
            raise ValueError(f"GossipConfig.max_metadata_bytes must be at most {wire.MAX_METADATA_BYTES}")
        if self.max_members > wire.MAX_RECORDS:
            raise ValueError(f"GossipConfig.max_members must be at most {wire.MAX_RECORDS}")

    def with_overrides(self, **overrides: object) -> GossipConfig:
        """A copy with some fields replaced; unknown names raise a clear error."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown GossipConfig option(s): {', '.join(unknown)}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(overrides)
        return GossipConfig(**values)

    # Size-dependent values for a cluster of n members.
    def min_suspicion_timeout(self, n: int) -> float:
        """The shortest suspicion: one confirmed by every expected independent suspecter."""
        scaled = suspicion_timeout(self.suspicion_mult, n, self.probe_interval)
        if self.confirmed_suspicion_mult > 0:
            return min(scaled, self.confirmed_suspicion_mult * self.probe_interval)
        return scaled

    def max_suspicion_timeout(self, n: int) -> float:
        """The longest suspicion: a lone suspecter's."""
        return self.suspicion_max_timeout_mult * suspicion_timeout(self.suspicion_mult, n, self.probe_interval)

    def retransmit_limit(self, n: int) -> int:
        return retransmit_limit(self.retransmit_mult, n)

    def detection_bound(self, n: int) -> float:
        """A bound on the time until every live member marks a crashed member dead.

        Three probe periods for some member to probe it and give up, the longest
        (unconfirmed) suspicion timeout, and one full retransmission schedule of the
        death notice. Tests of real processes assert against this bound.
        """
        dissemination = self.gossip_interval * self.retransmit_limit(n) / max(1, self.gossip_nodes)
        return 3 * self.probe_interval + self.max_suspicion_timeout(n) + dissemination + self.gossip_interval
