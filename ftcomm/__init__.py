"""ftcomm: coordinator-free fault-tolerant collectives for elastic data-parallel PyTorch training.

    import ftcomm
    ft = ftcomm.init(backend="gloo", peers=["10.0.0.4:7946"], min_workers=2)  # secret: $FTCOMM_SECRET
    ft.register_state(model=model, optimizer=optimizer)
    for batch in data:
        loss_fn(model(batch)).backward()
        if ft.wait_gradients_ready(model):
            optimizer.step()
        optimizer.zero_grad()
    ft.shutdown()
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import TYPE_CHECKING, Any, Iterable

import importlib

from . import netif
from .backends import BACKENDS
from .core.view import View
from .errors import (AddressError, CollectiveAborted, CommunicatorError, ConfigMismatch, FtcommError, FtcommTimeout,
                     GroupEnded, MembershipChanged, NcclUnavailable, NotInView, QuorumLost, ReplicaLost, RetryLimitExceeded,
                     OtherModel, OutOfStep, SecretRequired, StateDiverged, StateError,
                     StateLost)
from .gossip import GossipConfig
from .gossip.addresses import parse_address, parse_seed

if TYPE_CHECKING:
    from .group import FaultTolerantGroup

# The training API needs torch; it is imported on first use, so that the gossip layer, the
# simulator and ``ftcomm members`` (which import this package) start without it.
_LAZY = {"FlashCheckpointer": "training.checkpoint", "ElasticSampler": "training.data", "FaultTolerantGroup": "group",
         "GroupOptions": "options", "ViewChange": "options", "LinearLRScaling": "training.scaling",
         "check_worker_counts": "options",
         "DistributedDataParallel": "training.reducer", "DiLoCo": "training.diloco", "LocalSGD": "training.diloco"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ftcomm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__version__ = "0.1.0"
__all__ = [
    "AddressError", "CollectiveAborted", "CommunicatorError", "ConfigMismatch", "DiLoCo", "DistributedDataParallel",
    "ElasticSampler", "FaultTolerantGroup",
    "FlashCheckpointer", "FtcommError", "FtcommTimeout", "GroupEnded", "GroupOptions", "LinearLRScaling", "LocalSGD", "MembershipChanged",
    "NcclUnavailable", "NotInView", "OtherModel", "QuorumLost", "ReplicaLost", "RetryLimitExceeded", "StateLost", "StateDiverged", "SecretRequired", "OutOfStep", "StateError", "View", "ViewChange", "init",
]


def _default_bind() -> str:
    """The host's address as other hosts see it (no packet is sent), with an automatic port."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            host = s.getsockname()[0]
        except OSError:
            host = "127.0.0.1"
    return f"{host}:0"


_UNSET: Any = object()


def init(backend: str = "gloo", peers: Iterable[str] | str | None = None, bind: str | None = None,
         min_workers: int | None = None, max_workers: Any = _UNSET, cluster: str | None = None,
         secret: str | None = None, insecure: bool | None = None, replica_size: int | None = None,
         shard_rank: int | None = None, replica_addr: str | None = None, group_ran: bool | None = None,
         **options: Any) -> FaultTolerantGroup:
    """Join (or start) a fault-tolerant group and return once its first view is formed.

    ``peers``: gossip addresses (``"host:port"``) of any existing or starting members, or
    ``"dns://NAME:PORT"`` for every IPv4 address NAME resolves to (a Kubernetes headless
    Service); default ``$FTCOMM_PEERS`` (comma-separated); empty starts a new group. ``bind``:
    default ``$FTCOMM_BIND``, else an automatic port on this host's address when a secret
    is set or ``insecure``, else on 127.0.0.1 (a local group). ``cluster`` and ``secret``
    default to ``$FTCOMM_CLUSTER`` and ``$FTCOMM_SECRET``. Protected mode: a worker bound
    to an address other hosts can reach needs a secret, or ``insecure=True`` (default
    ``$FTCOMM_INSECURE``: ``1`` opts out), else :class:`SecretRequired`; ``network_check``
    defaults to ``$FTCOMM_NETWORK_CHECK``. ``min_workers`` defaults to
    ``$FTCOMM_MIN_WORKERS``, else 1; ``max_workers`` to ``$FTCOMM_MAX_WORKERS``, else None
    (no bound); the options ``metrics_port``, ``straggler_policy``, ``fingerprint_every``
    and ``sdc_policy`` to ``$FTCOMM_METRICS_PORT``, ``$FTCOMM_STRAGGLER_POLICY``,
    ``$FTCOMM_FINGERPRINT_EVERY`` and ``$FTCOMM_SDC_POLICY`` (``ftcomm run`` sets these
    from its options). ``options``
    are :class:`GroupOptions` fields (``init_timeout``, ``max_retries``, ...); a
    ``gossip`` entry may be a :class:`GossipConfig` or a dict of its fields.
    ``replica_size`` (default ``$FTCOMM_REPLICA_SIZE``, else 1): with K > 1 this process is
    shard ``shard_rank`` (``$FTCOMM_SHARD_RANK``) of a replica of K processes that shards the
    model with FSDP2 over ``ft.shard_mesh``; they meet at ``replica_addr``
    (``$FTCOMM_REPLICA_ADDR``: shard 0's ``HOST:PORT``) in torch's default process group.
    Every process of every replica is a member of the group; views hold whole replicas only
    (``min_workers``/``max_workers`` count replicas) and a replica that loses a process
    leaves as a whole (:class:`ReplicaLost` on its other processes). See docs/API.md,
    "Sharded models". ``group_ran`` (default ``$FTCOMM_GROUP_RAN``, which ``ftcomm run``
    sets for a worker it starts again after it saw the job's group run): this worker
    comes back to a group that ran; it founds no new one while one of its peers neither
    answers nor refuses a connection (that peer may run the group on across a
    partition), and joins the group it finds.
    Raises :class:`FtcommTimeout` when no view with ``min_workers`` members forms within
    ``init_timeout`` and :class:`ConfigMismatch` when the group runs other settings.
    Before anything starts: TypeError or ValueError naming the argument or option and
    what it accepts (see docs/CONFIGURATION.md), :class:`AddressError` for a bind
    address that cannot work here.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {', '.join(BACKENDS)}; got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    from .group import FaultTolerantGroup
    from .options import GroupOptions, check_worker_counts

    if min_workers is None:
        min_workers = _env_int("FTCOMM_MIN_WORKERS", 1)
    if max_workers is _UNSET:
        max_workers = _env_int("FTCOMM_MAX_WORKERS", None)
    check_worker_counts(min_workers, max_workers)
    peers = _peer_list(peers if peers is not None else os.environ.get("FTCOMM_PEERS", ""),
                       "peers" if peers is not None else "$FTCOMM_PEERS")
    if bind is not None and not isinstance(bind, str):
        raise TypeError(f"bind must be a 'HOST:PORT' string, got {type(bind).__name__}")
    if bind:  # None or empty: as if unset
        _check_address(bind, "bind")
    elif os.environ.get("FTCOMM_BIND"):
        bind = os.environ["FTCOMM_BIND"]
        _check_address(bind, "bind (from $FTCOMM_BIND)")
    else:
        bind = None  # chosen below, once the secret is known
    if cluster is None:
        cluster = os.environ.get("FTCOMM_CLUSTER", "ftcomm")
        if not cluster:
            raise ValueError("$FTCOMM_CLUSTER is set but empty: set it to the group's cluster name, or unset it "
                             "to use 'ftcomm'")
    elif not isinstance(cluster, str):
        raise TypeError(f"cluster must be a non-empty string, got {type(cluster).__name__}")
    elif not cluster:
        raise ValueError("cluster must be a non-empty string (the group's name), got ''")
    secret = secret if secret is not None else os.environ.get("FTCOMM_SECRET")
    if insecure is None:
        insecure = _env_flag("FTCOMM_INSECURE")
    elif not isinstance(insecure, bool):
        raise TypeError(f"insecure must be True or False, got {insecure!r}")
    if bind is None:
        local = all(_loopback(parse_seed(p)[0]) for p in peers)
        bind = _default_bind() if secret is not None or insecure or not local else "127.0.0.1:0"
    known = {f.name for f in dataclasses.fields(GroupOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if "network_check" not in options and _env_flag("FTCOMM_NETWORK_CHECK"):
        options["network_check"] = True
    if "metrics_port" not in options and os.environ.get("FTCOMM_METRICS_PORT"):
        options["metrics_port"] = _env_int("FTCOMM_METRICS_PORT", None)
    if "straggler_policy" not in options and os.environ.get("FTCOMM_STRAGGLER_POLICY"):
        options["straggler_policy"] = os.environ["FTCOMM_STRAGGLER_POLICY"]
    if "fingerprint_every" not in options and os.environ.get("FTCOMM_FINGERPRINT_EVERY"):
        options["fingerprint_every"] = _env_int("FTCOMM_FINGERPRINT_EVERY", None)
    if "sdc_policy" not in options and os.environ.get("FTCOMM_SDC_POLICY"):
        options["sdc_policy"] = os.environ["FTCOMM_SDC_POLICY"]
    if isinstance(options.get("gossip"), dict):
        options["gossip"] = GossipConfig().with_overrides(**options["gossip"])
    group_options = GroupOptions(**options)  # checks every option before anything starts
    from .training.replica import replica_settings
    replica = replica_settings(replica_size, shard_rank, replica_addr)
    if replica[0] > 1 and group_options.straggler_policy == "exclude":
        raise ValueError("straggler_policy='exclude' stands one process aside, and a sharded replica "
                         "(replica_size > 1) trains only whole: use straggler_policy='warn'")
    if group_ran is None:
        group_ran = _env_flag("FTCOMM_GROUP_RAN")
    elif not isinstance(group_ran, bool):
        raise TypeError(f"group_ran must be True, False or None, got {group_ran!r:.40}")
    return FaultTolerantGroup(backend, peers, bind, min_workers, max_workers, cluster, secret, group_options,
                              insecure=insecure, replica=replica, group_ran=group_ran)


def _loopback(host: str) -> bool:
    try:
        return netif.is_loopback(host)
    except (OSError, ValueError):  # unresolvable: the group's address check says so later
        return False


def _env_int(name: str, default: int | None) -> int | None:
    """``$name`` as an int (``default`` when unset or empty); ValueError naming it otherwise."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {value!r}") from None


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise ValueError(f"${name} must be 1 or 0 (true/false, yes/no), got {os.environ[name]!r}")


def _check_address(address: str, name: str) -> None:
    """parse_address's check, with the argument (or environment variable) named in the error."""
    try:
        parse_address(address)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None


def _peer_list(peers: Any, name: str) -> list[str]:
    """``peers`` as a list of ``"HOST:PORT"`` or ``"dns://NAME:PORT"`` strings: a
    comma-separated string or an iterable of strings, each checked for its form;
    TypeError or ValueError naming it."""
    if isinstance(peers, str):
        peers = [p.strip() for p in peers.split(",") if p.strip()]
    elif isinstance(peers, (bytes, bytearray)) or not isinstance(peers, Iterable):
        raise TypeError(f"{name} must be a 'HOST:PORT' string (comma-separated for several) or an iterable of "
                        f"them, got {type(peers).__name__}")
    checked = []
    for peer in peers:
        if not isinstance(peer, str):
            raise TypeError(f"{name} must hold 'HOST:PORT' strings, got {peer!r} ({type(peer).__name__})")
        try:
            parse_seed(peer)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        checked.append(peer.strip())
    return checked
