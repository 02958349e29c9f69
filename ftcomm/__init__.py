"""ftcomm: coordinator-free fault-tolerant collectives for elastic data-parallel PyTorch training.

    import ftcomm
    ft = ftcomm.init(backend="gloo", peers=["10.0.0.4:7946"], min_workers=2)
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
from typing import Any, Iterable

from .errors import (AddressError, CollectiveAborted, CommunicatorError, ConfigMismatch, FtcommError, FtcommTimeout,
                     MembershipChanged, NcclUnavailable, QuorumLost, RetryLimitExceeded)
from .gossip import GossipConfig
from .checkpoint import FlashCheckpointer
from .data import ElasticSampler
from .group import FaultTolerantGroup, GroupOptions, ViewChange
from .scaling import LinearLRScaling
from .view import View

__version__ = "0.1.0"
__all__ = [
    "AddressError", "CollectiveAborted", "CommunicatorError", "ConfigMismatch", "ElasticSampler", "FaultTolerantGroup", "FlashCheckpointer", "FtcommError",
    "FtcommTimeout", "GroupOptions", "LinearLRScaling", "MembershipChanged", "NcclUnavailable", "QuorumLost", "RetryLimitExceeded", "View",
    "ViewChange", "init",
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


def init(backend: str = "gloo", peers: Iterable[str] | str | None = None, bind: str | None = None,
         min_workers: int = 1, max_workers: int | None = None, cluster: str | None = None,
         secret: str | None = None, **options: Any) -> FaultTolerantGroup:
    """Join (or start) a fault-tolerant group and return once its first view is formed.

    ``peers``: gossip addresses (``"host:port"``) of any existing or starting members;
    default ``$FTCOMM_PEERS`` (comma-separated); empty starts a new group. ``bind``:
    default ``$FTCOMM_BIND`` or an automatic port on this host's address. ``cluster``
    and ``secret`` default to ``$FTCOMM_CLUSTER`` and ``$FTCOMM_SECRET``. ``options``
    are :class:`GroupOptions` fields (``init_timeout``, ``max_retries``, ...); a
    ``gossip`` entry may be a :class:`GossipConfig` or a dict of its fields.
    Raises :class:`FtcommTimeout` when no view with ``min_workers`` members forms within
    ``init_timeout`` and :class:`ConfigMismatch` when the group runs other settings.
    """
    if peers is None:
        peers = os.environ.get("FTCOMM_PEERS", "")
    if isinstance(peers, str):
        peers = [p.strip() for p in peers.split(",") if p.strip()]
    bind = bind or os.environ.get("FTCOMM_BIND") or _default_bind()
    cluster = cluster or os.environ.get("FTCOMM_CLUSTER", "ftcomm")
    secret = secret if secret is not None else os.environ.get("FTCOMM_SECRET")
    known = {f.name for f in dataclasses.fields(GroupOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if isinstance(options.get("gossip"), dict):
        options["gossip"] = GossipConfig().with_overrides(**options["gossip"])
    return FaultTolerantGroup(backend, list(peers), bind, min_workers, max_workers, cluster, secret,
                              GroupOptions(**options))
