"""A replica of K processes that shards the model among themselves (FSDP2 over ``shard_mesh``).

The K processes share torch's default process group, which FSDP2's own collectives use
(all-gather, reduce-scatter); it is not fault-tolerant. Each process is a member of the
ftcomm group; views hold whole replicas (:func:`ftcomm.core.view.whole_replicas`), and
the shard-*i* processes of a view reduce their gradient shards over a communicator of
their own (see :mod:`ftcomm.training.sharded`). The replica's key, drawn by shard 0 when
the replica starts, tells its processes from those of an earlier start of the same replica.
Every process of a replica commits a gradient step or none does (:meth:`Replica.agree`).
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch

from ..errors import FtcommError, ReplicaLost, StateError
from ..backends import admission
from . import sharded

log = logging.getLogger(__name__)


class Replica:
    """This process's replica: ``size`` processes, this one shard ``shard_rank``, meeting at
    ``address`` (``HOST:PORT``, shard 0's; torch's TCP store). An already initialized default
    process group is used as it is when it has ``size`` ranks and this is rank
    ``shard_rank``. ``timeout``: how long its collectives wait for a process."""

    def __init__(self, size: int, shard_rank: int, address: str | None, backend: str, timeout: float) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.size, self.shard_rank = size, shard_rank
        self._owned = False
        if dist.is_initialized():
            if (dist.get_world_size(), dist.get_rank()) != (size, shard_rank):
                raise FtcommError(f"torch.distributed is initialized with rank {dist.get_rank()} of "
                                  f"{dist.get_world_size()}, not shard {shard_rank} of a replica of {size}")
        else:
            if not address:
                raise ValueError("replica_size > 1 needs the replica's address (replica_addr='HOST:PORT' of its "
                                 "shard 0, or $FTCOMM_REPLICA_ADDR)")
            listening = set(admission.listening_sockets())
            dist.init_process_group("nccl" if backend == "nccl" else "gloo", init_method=f"tcp://{address}",
                                    rank=shard_rank, world_size=size, timeout=datetime.timedelta(seconds=timeout))
            self._owned = True
        device = "cuda" if backend == "nccl" else "cpu"
        self.device = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.mesh = init_device_mesh(device, (size,), mesh_dim_names=("shard",))
        drawn = torch.tensor(list(os.urandom(8)) if shard_rank == 0 else [0] * 8, dtype=torch.uint8,
                             device=self.device)
        dist.broadcast(drawn, 0)  # raw bytes: nothing from another process is unpickled
        self.key = bytes(drawn.cpu().tolist()).hex()
        self._doors: list[admission.Door] = []
        if self._owned and backend != "nccl":
            # Every process of the replica is connected now (torch's store, Gloo's pairs):
            # the listeners torch opened for them admit nobody from here on. (NCCL connects
            # lazily, through its listeners, at later collectives: those stay open.)
            for fd, place in admission.listening_sockets().items():
                if fd not in listening:
                    try:
                        self._doors.append(admission.Door(fd, *place))
                    except OSError as exc:
                        log.warning("the replica's listener on %s:%d stays open to every host that reaches it: "
                                    "the kernel refused a socket filter (%s)", place[2], place[3], exc)

    def check_sharded(self, entries: dict[str, Any]) -> None:
        """StateError naming the first parameter of a module in ``entries`` that is not a
        DTensor on this replica's mesh (sharded with ``fully_shard(..., mesh=ft.shard_mesh)``)."""
        for name, entry in entries.items():
            if not isinstance(entry, torch.nn.Module):
                continue
            for path, param in entry.named_parameters():
                if not sharded.is_sharded(param) or param.device_mesh != self.mesh:
                    raise StateError(f"{name}.{path} is not sharded over ft.shard_mesh: with replica_size="
                                     f"{self.size}, shard the model with fully_shard(module, mesh=ft.shard_mesh) "
                                     f"before registering it")

    def agree(self, committed: bool, timeout: float) -> bool:
        """Whether every process of this replica commits (one tiny all-reduce MIN over the
        replica's process group, which every process of the replica runs at the same points:
        once per gradient step, whether its step completed or failed, and once per view it
        formed, after reconciling). A step that completed on some processes of the replica
        only (the view broke as it ended) is discarded by all of them: the replica never
        goes on with its shards a step apart. ReplicaLost when a process of the replica is
        gone (torch's collective fails at once: its connections reset), and when none
        answered within ``timeout`` seconds (a process that hangs, or one that left the
        view at another point: the replica's group cannot be trusted again)."""
        import torch.distributed as dist
        flag = torch.tensor([int(committed)], dtype=torch.int32, device=self.device)
        try:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, async_op=True)
            work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:  # a process of the replica died (its connections reset), or never answered
            raise ReplicaLost(f"a process of this worker's sharded replica is gone or does not answer "
                              f"({str(exc).splitlines()[0][:200]}): exit, and start the whole replica again "
                              f"(ftcomm run --replica-size does)") from None
        return bool(flag.item())

    def close(self) -> None:
        """Destroy the process group this replica created (not one the caller initialized)."""
        import torch.distributed as dist
        if self._owned and dist.is_initialized():
            dist.destroy_process_group()
            self._owned = False


def replica_settings(replica_size: Any, shard_rank: Any, replica_addr: Any) -> tuple[int, int, str | None]:
    """The replica size, this process's shard rank and the replica's address, from the
    arguments or else ``$FTCOMM_REPLICA_SIZE``, ``$FTCOMM_SHARD_RANK``, ``$FTCOMM_REPLICA_ADDR``;
    TypeError or ValueError naming what is wrong."""
    def number(value: Any, env: str, name: str, default: int) -> int:
        if value is None:
            raw = os.environ.get(env, "")
            if not raw:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"${env} must be an integer, got {raw!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        return value
    size = number(replica_size, "FTCOMM_REPLICA_SIZE", "replica_size", 1)
    if size < 1:
        raise ValueError(f"replica_size must be >= 1, got {size}")
    rank = number(shard_rank, "FTCOMM_SHARD_RANK", "shard_rank", 0)
    if not 0 <= rank < size:
        raise ValueError(f"shard_rank must be in 0..{size - 1} (replica_size={size}), got {rank}")
    address = replica_addr if replica_addr is not None else os.environ.get("FTCOMM_REPLICA_ADDR") or None
    if address is not None and not isinstance(address, str):
        raise TypeError(f"replica_addr must be a 'HOST:PORT' string, got {type(address).__name__}")
    return size, rank, address
