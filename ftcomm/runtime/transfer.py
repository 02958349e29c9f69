"""Moving the registered training state to the members of a newly formed view.

The worker loop decides (:meth:`ftcomm.runtime.worker.WorkerLoop._transfer`: every member
shows its step, state digest and model signature; the newest state wins, its rank picked
by :func:`ftcomm.core.engine.shard_sources`); this module moves it over a real
communicator: the state is broadcast as raw tensor bytes with a msgpack manifest, never a
pickle. With a secret the source signs view, manifest and bytes (keyed BLAKE2b) and the
others verify before loading anything. Members that registered different models raise
ConfigMismatch naming the first tensor that differs.
"""

from __future__ import annotations

import hashlib
import logging
import hmac
import msgpack
import torch

from ..backends.base import AbortSignal, Communicator
from ..core.view import View
from ..errors import CollectiveAborted, CommunicatorError, ConfigMismatch, FtcommTimeout, StateError
from ..training.state import TrainingState, tensor_bytes

log = logging.getLogger(__name__)

STATE_TAG_BYTES = 32
MAX_MANIFEST_BYTES = 256 << 20


def raise_shard_mismatch(comm: Communicator, abort: AbortSignal, state: TrainingState, view: View,
                         gathered: list[tuple[int, int, int]], shards: int) -> None:
    """When the processes of some shard index registered different models: every process
    takes part in exchanging their descriptions over the whole view, then every one raises
    ConfigMismatch naming the shard and the first tensor that differs."""
    if not any(len({g[2] for g in gathered[i::shards]}) > 1 for i in range(shards)):
        return
    models = describe_or_none(comm, abort, state)
    for i in range(shards):
        other = next((r for r in range(i, len(gathered), shards) if gathered[r][2] != gathered[i][2]), None)
        if other is not None:
            raise ConfigMismatch(
                f"the registered model of shard {i} differs between the replicas of view {view.id}: "
                f"{difference(models, i, other)} on member {view.members[i]} (rank {i}) and "
                f"member {view.members[other]} (rank {other}); start every replica with the same model, "
                f"sharded the same way")


def broadcast_state(comm: Communicator, abort: AbortSignal, state: TrainingState, step: int, view: View,
                    secret: bytes | None, source: int, load: bool) -> int | None:
    """Broadcast rank ``source``'s state to every member (each takes part); a member with
    ``load`` replaces its state with it and gets the step it holds (None otherwise)."""
    if comm.rank == source:
        manifest, data = state.pack(step, comm.device)
        header = state_tag(secret, view, manifest, data) + manifest
        sizes = torch.tensor([len(header), data.numel()], dtype=torch.int64, device=comm.device)
    else:
        sizes = torch.zeros(2, dtype=torch.int64, device=comm.device)
    comm.broadcast(sizes, source).wait(abort)
    header_len, data_len = (int(x) for x in sizes.tolist())
    if comm.rank != source and not (STATE_TAG_BYTES < header_len <= MAX_MANIFEST_BYTES
                                    and 0 <= data_len <= state.transfer_limit()):
        raise CommunicatorError(f"rank {source} announced a state of {header_len} + {data_len} bytes, beyond "
                                f"what this worker's model can hold; discarded")
    if comm.rank == source:
        head = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(comm.device)
    else:
        head = torch.empty(header_len, dtype=torch.uint8, device=comm.device)
        data = torch.empty(data_len, dtype=torch.uint8, device=comm.device)
    comm.broadcast(head, source).wait(abort)
    comm.broadcast(data, source).wait(abort)
    if not load:
        return None
    header = head.cpu().numpy().tobytes()
    tag, manifest = header[:STATE_TAG_BYTES], header[STATE_TAG_BYTES:]
    if not hmac.compare_digest(tag, state_tag(secret, view, manifest, data)):
        raise CommunicatorError(f"the state sent by rank {source} in view {view.id} failed authentication; "
                                f"discarded")
    try:
        return state.unpack(manifest, data)
    except StateError as exc:
        raise CommunicatorError(f"the state sent by rank {source} in view {view.id} is malformed ({exc}); "
                                f"discarded") from None


def state_tag(secret: bytes | None, view: View, manifest: bytes, data: torch.Tensor) -> bytes:
    """Keyed BLAKE2b of a state transfer in ``view`` with the group's secret (zeros without
    one); the view is covered, so a transfer replayed in a later view fails."""
    if secret is None:
        return bytes(STATE_TAG_BYTES)
    mac = hashlib.blake2b(key=hashlib.sha256(b"ftcomm-state\0" + secret).digest(), digest_size=STATE_TAG_BYTES)
    mac.update(f"{view.id}/{view.digest}\0".encode())
    mac.update(len(manifest).to_bytes(8, "little"))
    mac.update(manifest)
    mac.update(tensor_bytes(data.cpu()))
    return mac.digest()


def describe_all(comm: Communicator, abort: AbortSignal, state: TrainingState) -> list[list]:
    """Every member's :meth:`TrainingState.describe`, in rank order (two allgathers)."""
    mine = msgpack.packb(state.describe())
    lengths = comm.allgather(torch.tensor([len(mine)], dtype=torch.int64, device=comm.device)).wait(abort)
    longest = max(int(t.item()) for t in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=comm.device)
    padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    theirs = comm.allgather(padded).wait(abort)
    return [msgpack.unpackb(blob.cpu().numpy().tobytes()[:int(length.item())], raw=False)
            for blob, length in zip(theirs, lengths)]


def describe_or_none(comm: Communicator, abort: AbortSignal, state: TrainingState) -> list[list] | None:
    """:func:`describe_all`, or None when a member that already knows the models differ
    raised and left before the exchange completed here. The signatures every member
    gathered show the difference either way, so every member refuses the group; only the
    words naming the first differing tensor can be missing."""
    try:
        return describe_all(comm, abort, state)
    except (CollectiveAborted, CommunicatorError, FtcommTimeout) as exc:
        log.info("the models' descriptions could not be exchanged (%s); refusing without them", exc)
        return None


def difference(models: list[list] | None, mine: int, other: int) -> str:
    """How the models of ranks ``mine`` and ``other`` differ, in words."""
    if models is None:
        return "the model signatures differ (which tensor differs is not known here: a member left first)"
    return first_difference(models[mine], models[other])


def raise_model_mismatch(comm: Communicator, abort: AbortSignal, state: TrainingState, view: View,
                         gathered: list[tuple[int, int, int]]) -> None:
    """Every member raises ConfigMismatch saying how the models differ (one more allgather;
    without the words when another member left before it completed)."""
    models = describe_or_none(comm, abort, state)
    for rank in range(len(gathered)):
        if gathered[rank][2] == gathered[comm.rank][2]:
            continue
        raise ConfigMismatch(f"the registered model of member {view.members[rank]} (rank {rank}) differs from "
                             f"this worker's: {difference(models, comm.rank, rank)}; start every worker "
                             f"with the same model")


def first_difference(mine: list, theirs: list) -> str:
    """How two :meth:`TrainingState.describe` lists differ, in words."""
    for a, b in zip(mine, theirs):
        if a != b:
            if a[0] == b[0]:
                return f"{a[0]} is {a[1]}{a[2]} here but {b[1]}{b[2]} there"
            return f"{a[0]} ({a[1]}{a[2]}) here is {b[0]} ({b[1]}{b[2]}) there"
    if len(mine) != len(theirs):
        extra = (mine if len(mine) > len(theirs) else theirs)[min(len(mine), len(theirs))]
        return f"{len(mine)} tensors here and {len(theirs)} there (first unmatched: {extra[0]})"
    return "their parameter lists differ"

