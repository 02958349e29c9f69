"""A group's options and the checks that run before a worker joins anyone: settings,
worker counts, the secret, the bind address (no torch, no sockets beyond name lookup)."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field
from typing import Any

from . import netif
from .errors import AddressError, SecretRequired
from .gossip import FaultFilter, GossipConfig
from .gossip.addresses import parse_seed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupOptions:
    """Options of a fault-tolerant group (``ftcomm.init(**options)``); see docs/CONFIGURATION.md."""

    settle_interval: float = 0.05
    """A candidate view must stay unchanged this long before it is proposed. Longer batches
    simultaneous changes into one re-formation; shorter re-forms sooner. Not waited for a
    candidate that only drops members known gone, nor for one that only adds fresh joiners
    a step admitted to an intact view (the step boundary batches those)."""

    init_timeout: float = 120.0
    """``init`` raises FtcommTimeout when no view with ``min_workers`` members forms in time."""

    formation_timeout: float = 10.0
    """Bound on forming one communicator (rendezvous and Gloo connect); a formation that
    times out is abandoned and the view agreed again."""

    quorum_timeout: float = 300.0
    """How long a worker cut off from the majority waits for the partition to heal before
    ``QuorumLost``. Long enough to ride out a switch reboot; short enough to free the node."""

    max_retries: int = 5
    """Consecutive re-formations ``execute``, or failed steps of ``wait_gradients_ready``,
    tolerated before ``RetryLimitExceeded``."""

    bucket_mb: float = 25.0
    """Size of the flat gradient buckets of ``wait_gradients_ready`` (one allreduce each;
    the first bucket is at most 1 MB so communication starts early, as in DDP). Larger
    buckets mean fewer collectives; smaller ones start overlapping sooner."""

    overlap: bool = True
    """Reduce each bucket during backward as soon as its gradients are ready (hooks on the
    parameters, installed at the first ``wait_gradients_ready``). Gradient accumulation
    then needs ``with ft.no_sync():`` around all but the last backward. False: reduce
    everything inside ``wait_gradients_ready``."""

    partition_policy: str = "quorum"
    """``quorum`` (safe): only a side holding a majority of the previous view (ties: its
    oldest member) continues. ``availability``: every side continues; when the sides meet
    again, the one whose view is older (at equal ids: whose view digest is lower) rejoins
    the other and takes its state, losing the steps it committed meanwhile."""

    leave_grace: float = 2.0
    """A member that leaves gracefully after completing the group operation (gradient step
    or collective) this worker is still in has already sent its share of it: the operation
    is let finish (up to this many seconds) before the view is re-formed, instead of being
    aborted. Crashes and hangs abort at once. A leaving worker, for its part, stays
    reachable until the others moved on, at most this long after its last operation (a
    suspect member whose port still accepts connections has not moved on)."""

    stall_probe_after: float = 0.05
    """A collective still waiting this long after this worker handed over its share, and 4
    times longer than the median wait of its recent collectives, probes the view's other
    members at once (directly and through helpers) instead of waiting for the regular probe
    round: a stopped process or a lost node is suspected ``urgent_probe_timeout`` (gossip,
    0.1 s) later and the wait aborted. Lower finds hangs sooner at the price of probes during long waits; a
    member whose process answers probes is never suspected by it (slow compute is a
    straggler, not a hang). 0 turns it off."""

    step_publish_interval: float = 2.0
    """Minimum seconds between gossip updates of the committed step (shown by ``ftcomm
    members``); every update is a broadcast to the whole group."""

    straggler_factor: float = 2.0
    """A member whose median compute time (forward, backward, data: from the end of its
    previous gradient step until it hands over its gradients) is more than this many
    times the median of the other members' is reported as a straggler: a warning in the
    log and a :class:`~ftcomm.runtime.stragglers.StragglerReport` in ``group.stragglers``. Every
    member judges the figures published in gossip, each time it publishes its step (every
    ``step_publish_interval``), and reports a change after 3 judgments in a row. 0 turns
    it off. What follows is ``straggler_policy``'s."""

    straggler_policy: str = "warn"
    """``warn``: a straggler is reported and stays in the group (every step waits for it).
    ``exclude``: a member that judges itself a straggler stands aside at its next step
    boundary: the others re-form without it at once (one step is discarded, no sample is
    lost) and go on at their own pace; after ``straggler_cooldown`` seconds it asks to
    join again, is admitted at a step boundary, receives the state and is judged afresh.
    It never stands aside when that would leave fewer than ``min_workers``."""

    straggler_cooldown: float = 30.0
    """How long an excluded straggler stands aside before it rejoins; doubled each time the
    same worker is excluded again, up to 8 times this."""

    straggler_window: int = 20
    """Gradient steps over which a member's median compute time is taken."""

    fingerprint_every: int = 10
    """Every this many committed steps the members compare fingerprints of their training
    state (a 48-bit hash of a wrap-around integer sum over each parameter of the registered
    modules and each tensor of the optimizers' state, taken on the tensors' device; buffers
    are left out: they may differ by rank), carried in the gradient step's
    counters: no collective of its own. Replicas hold bit-identical state, so a member whose
    fingerprint differs from the majority's computes wrong without crashing (a flipped bit
    in memory or in a reduction: silent data corruption) and is named; ``sdc_policy`` says
    what follows. 0 turns it off. See docs/ARCHITECTURE.md for what a fingerprint can and
    cannot catch."""

    sdc_policy: str = "exclude"
    """What a fingerprint that differs from the majority's leads to. ``exclude``: the step is
    discarded on every member, and before the next one the named members' state is
    replaced by a majority member's (they contribute nothing until then); a member named
    again within ``SDC_REPEAT_CHECKS`` checks of its repair leaves the group, then raises
    ``StateDiverged``, its hardware not to be trusted. ``warn``: named only, the step
    commits. ``stop``: every member raises ``StateDiverged``. When no fingerprint has a
    majority (two members that disagree) nobody can tell which is right: every member
    raises ``StateDiverged`` naming the last step where all agreed, under ``exclude`` and
    ``stop`` alike. Must be equal on every member, as ``fingerprint_every``."""

    network_check: bool = False
    """When a group is founded (its first view's members all start together), measure the
    latency and bandwidth of every pair of members over the backend before ``init``
    returns, and name slow members and links (see :mod:`ftcomm.ops.netcheck`): the report is
    ``group.network_report``, logged (WARNING when something is slow) and written as JSON
    to ``$FTCOMM_NETWORK_REPORT`` when set. Costs ``members - 1`` rounds of a pair
    formation and a few allreduces each. Default ``$FTCOMM_NETWORK_CHECK`` (``ftcomm run
    --network-check`` sets it). A worker that joins a running group never runs it."""

    network_check_mb: float = 8.0
    """Size of the bandwidth probe of the network check (three allreduces of it per pair,
    the fastest counts)."""

    network_check_factor: float = 2.0
    """A member whose links are this many times worse (bandwidth or latency) than the
    others', or a link this many times worse than the median, is named slow."""

    listener_admission: str = "members"
    """Who may connect to the listening socket of this worker's data plane (Gloo) while a
    communicator forms: ``members``, only the addresses of the view's members (and
    127.0.0.1 in a group on loopback addresses); ``formation``, any address. Between
    formations nobody may, in both cases: a socket filter in the kernel drops every
    packet from elsewhere before a connection exists (Linux; see docs/SECURITY.md).
    ``formation`` is for hosts whose connections to the others do not leave from the
    address they bind (a multi-homed host whose route to a peer goes through another
    interface): there, ``members`` would keep communicators from forming."""

    metrics_port: int | None = None
    """Serve Prometheus metrics on this TCP port of the bind address (0: a free port, see
    ``group.metrics_port``); None: no endpoint. Needs ``pip install 'ftcomm[metrics]'``.
    The endpoint is read-only and not authenticated; see :mod:`ftcomm.ops.metrics`."""

    gossip: GossipConfig = field(default_factory=GossipConfig)
    """The membership protocol's configuration (a GossipConfig, or a dict of its fields)."""

    fault_filter: FaultFilter | None = None
    """Testing API: drop, delay or partition this worker's gossip traffic."""

    handle_signals: bool = True
    """Install a SIGTERM handler and an excepthook that leave the group gracefully (main
    thread only); ``shutdown`` also runs at interpreter exit. On SIGTERM a handler installed
    before runs first, then the worker exits with status 143 and leaves on the way out."""

    def __post_init__(self) -> None:
        """Refuse a value no worker could run with, naming the option and what it accepts:
        TypeError for a wrong type, ValueError for a value out of range."""
        def number(name: str, zero_allowed: bool, unit: str = "seconds") -> None:
            value = getattr(self, name)
            accepted = f"{'>= 0' if zero_allowed else '> 0'} and finite ({unit})"
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number {accepted}, got {value!r}")
            if not ((0 <= value if zero_allowed else 0 < value) and value < float("inf")):
                raise ValueError(f"{name} must be {accepted}, got {value!r}")

        for name in ("init_timeout", "formation_timeout", "quorum_timeout", "straggler_cooldown"):
            number(name, zero_allowed=False)
        for name in ("settle_interval", "leave_grace", "step_publish_interval", "stall_probe_after"):
            number(name, zero_allowed=True)
        number("bucket_mb", zero_allowed=False, unit="MB")
        number("network_check_mb", zero_allowed=False, unit="MB")
        number("network_check_factor", zero_allowed=False, unit="a ratio")
        if self.network_check_factor <= 1:
            raise ValueError(f"network_check_factor must be > 1 (at 1 or less every link would be slow), "
                             f"got {self.network_check_factor!r}")
        number("straggler_factor", zero_allowed=True, unit="a ratio; 0 turns reports off")
        port = self.metrics_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise (TypeError if not isinstance(port, int) or isinstance(port, bool) else ValueError)(
                f"metrics_port must be None or an int with 0 <= port <= 65535, got {port!r}")
        if isinstance(self.straggler_window, bool) or not isinstance(self.straggler_window, int):
            raise TypeError(f"straggler_window must be an int >= 1, got {self.straggler_window!r}")
        if self.straggler_window < 1:
            raise ValueError(f"straggler_window must be an int >= 1, got {self.straggler_window}")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int):
            raise TypeError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {self.max_retries}")
        for name in ("overlap", "handle_signals", "network_check"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.fingerprint_every, bool) or not isinstance(self.fingerprint_every, int):
            raise TypeError(f"fingerprint_every must be an int >= 0 (0: off), got {self.fingerprint_every!r}")
        if self.fingerprint_every < 0:
            raise ValueError(f"fingerprint_every must be an int >= 0 (0: off), got {self.fingerprint_every}")
        if self.sdc_policy not in ("exclude", "warn", "stop"):
            raise ValueError(f"sdc_policy must be 'exclude', 'warn' or 'stop', got {self.sdc_policy!r}")
        if self.straggler_policy not in ("warn", "exclude"):
            raise ValueError(f"straggler_policy must be 'warn' or 'exclude', got {self.straggler_policy!r}")
        if self.listener_admission not in ("members", "formation"):
            raise ValueError(f"listener_admission must be 'members' or 'formation', got {self.listener_admission!r}")
        if self.partition_policy not in ("quorum", "availability"):
            raise ValueError(f"partition_policy must be 'quorum' or 'availability', got {self.partition_policy!r}")
        if not isinstance(self.gossip, GossipConfig):
            raise TypeError(f"gossip must be a GossipConfig (ftcomm.init also takes a dict of its fields), "
                            f"got {type(self.gossip).__name__}")
        if self.fault_filter is not None and not isinstance(self.fault_filter, FaultFilter):
            raise TypeError(f"fault_filter must be None or a FaultFilter, got {type(self.fault_filter).__name__}")


@dataclass(frozen=True)
class ViewChange:
    """One re-formation: why, who changed, and how long each phase took (seconds)."""

    view_id: int
    members: tuple[str, ...]
    reason: str  # init | crash | hang | leave | join | partition | rejoin | straggler | backend
    added: tuple[str, ...]
    removed: tuple[str, ...]
    detect_s: float  # how long the failed collective was blocked before the fault was noticed
    agree_s: float
    form_s: float
    reconcile_s: float
    time: float  # time.time() when the group was ready again
    abort_latency_s: float | None = None  # from the abort signal firing to the training thread noticing
    step: int | None = None  # committed step once the state was reconciled in this view
    state_digest: int | None = None  # digest of the registered state then (equal on every member)
    policy: dict | None = None  # what the batch-size / learning-rate policies set for this view

    @property
    def total_s(self) -> float:
        return self.detect_s + self.agree_s + self.form_s + self.reconcile_s


def check_worker_counts(min_workers: int, max_workers: int | None) -> None:
    """TypeError or ValueError, naming the argument, unless ``min_workers`` is an int >= 1
    and ``max_workers`` is None or an int >= ``min_workers`` (bools are not counts)."""
    if isinstance(min_workers, bool) or not isinstance(min_workers, int):
        raise TypeError(f"min_workers must be an int >= 1, got {min_workers!r}")
    if min_workers < 1:
        raise ValueError(f"min_workers must be an int >= 1, got {min_workers}")
    if max_workers is None:
        return
    if isinstance(max_workers, bool) or not isinstance(max_workers, int):
        raise TypeError(f"max_workers must be None or an int >= min_workers ({min_workers}), got {max_workers!r}")
    if max_workers < min_workers:
        raise ValueError(f"max_workers must be None or an int >= min_workers ({min_workers}), got {max_workers}")


def member_cap(config: GossipConfig, max_workers: int | None) -> GossipConfig:
    """``config`` with its member table capped at twice ``max_workers`` plus 16 (standbys,
    and dead or left members not yet forgotten), unless ``max_members`` was set."""
    default = GossipConfig().max_members
    if max_workers is None or config.max_members != default:
        return config
    return config.with_overrides(max_members=min(default, 2 * max_workers + 16))


def check_secret(secret: Any) -> bytes | None:
    """The secret as bytes (None: no secret); an empty or non-string secret is an error."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise TypeError(f"secret must be a string or bytes, not {type(secret).__name__}")
    if not secret:
        raise ValueError("secret is empty, which would leave the group unauthenticated: give every worker the "
                         "same non-empty secret (secret= or $FTCOMM_SECRET; e.g. from "
                         "`python -c 'import secrets; print(secrets.token_hex(16))'`), or leave it unset on a "
                         "loopback-only group")
    return secret


def check_protection(host: str, secret: bytes | None, insecure: bool) -> bool:
    """Protected mode: True when the group runs unauthenticated on a non-loopback address
    (only with ``insecure``); raise SecretRequired when that was not asked for."""
    if secret is not None or ipaddress.ip_address(host).is_loopback:
        return False
    if not insecure:
        raise SecretRequired(
            f"this worker binds {host}, which other hosts can reach, and has no secret: anyone who can reach it "
            f"could join the group, change its membership or feed it state. Give every worker the same secret "
            f"(secret=... or FTCOMM_SECRET=...), or, on a network you fully trust, opt out with insecure=True "
            f"(FTCOMM_INSECURE=1); see docs/SECURITY.md")
    log.warning("INSECURE: this group runs without a secret on %s; any host that can reach it can join it or "
                "disturb it (insecure=True). Set a secret; see docs/SECURITY.md", host)
    return True


def check_addresses(bind_host: str, peers: list[str]) -> str:
    """The IPv4 address to bind, or, before anything starts, AddressError for a bind address
    that cannot work: a name that does not resolve, IPv6, a wildcard, an address no
    interface of this machine holds, a loopback address with peers on other hosts."""
    try:
        address = netif.resolve(bind_host)
    except OSError:
        raise AddressError(f"bind host {bind_host!r} does not resolve to an IPv4 address") from None
    if ":" in address:
        raise AddressError(f"bind address {address} is IPv6: ftcomm's planes speak IPv4; bind to an IPv4 address "
                           f"of this host")
    if netif.is_wildcard(address):
        raise AddressError(f"bind address {address} is a wildcard: every worker tells the others to reach it "
                           f"at its bind address, so bind to an address of this host they can reach "
                           f"(bind='HOST:PORT' or FTCOMM_BIND), or leave bind unset to use this host's address")
    if not netif.is_loopback(address):
        if netif.interface_of(address) is None:
            raise AddressError(f"bind address {address} is not an address of this machine (no interface holds it)")
        return address
    for peer in peers:
        host = parse_seed(peer)[0]
        try:
            remote = not netif.is_loopback(host) and netif.interface_of(host) is None
        except OSError:  # a name that does not resolve now: gossip reports it when it tries
            continue
        if remote:
            raise AddressError(f"this worker is bound to the loopback address {address}, but peer {peer} is on "
                               f"another host: a loopback address is reachable from this machine only. Bind to an "
                               f"address of this host that {host} can reach (bind='HOST:PORT' or FTCOMM_BIND), or "
                               f"leave bind unset to use this host's address")
    return address
