"""A replica of K processes that shards the model among themselves (FSDP2 over ``shard_mesh``).

The K processes share torch's default process group, which FSDP2's own collectives use
(all-gather, reduce-scatter); it is not fault-tolerant. Each process is a member of the
ftcomm group; views hold whole replicas (:func:`ftcomm.core.view.whole_replicas`), and
the shard-*i* processes of a view reduce their gradient shards over a communicator of
their own (see :mod:`ftcomm.training.sharded`). The replica's key, drawn by shard 0 when
the replica starts, tells its processes from those of an earlier start of the same replica.
Every process of a replica commits a gradient step or none does (:meth:`Replica.decide`).
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import socket
import time
from typing import Any, Callable

import torch

from ..errors import FtcommError, ReplicaLost, StateError
from ..gossip.addresses import parse_address
from ..localproc import process_start, stat_fields
from ..backends import admission
from . import sharded

log = logging.getLogger(__name__)


def _store(address: str, shard_rank: int, size: int, timeout: datetime.timedelta):
    """Torch's TCP store of the replica at ``address`` (``HOST:PORT``), served by shard 0 on
    that address only (torch's own server listens on every address of the host)."""
    import socket

    import torch.distributed as dist

    host, port = parse_address(address)
    if shard_rank != 0:
        return dist.TCPStore(host, port, size, False, timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise FtcommError(f"cannot serve the replica's store on {address}: {exc.strerror or exc}") from None
    return dist.TCPStore(host, port, size, True, timeout, master_listen_fd=listener.detach())


def _namespace() -> str:
    """This host's boot and this process's pid namespace: two processes that show the same
    one see each other's pids in /proc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


_LOCAL = (_namespace(),)


def local_identity() -> str:
    """This process as another process of its replica may look it up: namespace, pid and
    start time (a later process with the pid is not it)."""
    return f"{_LOCAL[0]} {os.getpid()} {process_start(os.getpid())}"


def parse_identity(raw: bytes) -> tuple[str, int, int] | None:
    """What :func:`local_identity` wrote (read from the replica's store: checked, never
    evaluated), or None when it is malformed or names no namespace."""
    try:
        namespace, pid, start = raw.decode("ascii").split(" ")
        identity = namespace, int(pid), int(start)
    except (UnicodeDecodeError, ValueError):
        return None
    return identity if identity[0] and identity[1] > 0 else None


def _pair_connections(before: set[int], store: str | None) -> dict[int, int]:
    """Descriptor -> inode of the connected TCP sockets made since ``before``, less those to
    or from the ``store``'s port (``HOST:PORT``). A listener has no peer: it is not among them."""
    store_port = parse_address(store)[1] if store else None
    found = {}
    for fd, inode in admission.socket_descriptors().items():
        if fd in before:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                    continue
                ends = sock.getsockname()[1], sock.getpeername()[1]
        except OSError:  # not connected (a listener), or closed meanwhile
            continue
        if store_port not in ends:
            found[fd] = inode
    return found


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
            sockets_before = set(admission.socket_descriptors())  # (the listeners among them too)
            wait = datetime.timedelta(seconds=timeout)
            dist.init_process_group("nccl" if backend == "nccl" else "gloo", store=_store(address, shard_rank, size, wait),
                                    rank=shard_rank, world_size=size, timeout=wait)
            self._owned = True
        device = "cuda" if backend == "nccl" else "cpu"
        self.device = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.mesh = init_device_mesh(device, (size,), mesh_dim_names=("shard",))
        drawn = torch.tensor(list(os.urandom(8)) if shard_rank == 0 else [0] * 8, dtype=torch.uint8,
                             device=self.device)
        from torch.distributed.distributed_c10d import _get_default_store
        store = _get_default_store()
        store.set(f"ftcomm/process/{shard_rank}", local_identity())  # (before the broadcast: see below)
        dist.broadcast(drawn, 0)  # raw bytes: nothing from another process is unpickled
        # Where each other process of the replica runs (the watch looks at a partner on this
        # host in /proc): each wrote it before the broadcast; get waits for a late writer.
        self._processes = {i: parse_identity(store.get(f"ftcomm/process/{i}")) for i in range(size)
                           if i != shard_rank}
        # Every pair of the replica's Gloo group is connected now (Gloo connects all of them
        # when the group is made): the connections tear_down shuts. Not the listeners (a
        # listener shut under Gloo's or the store's accept loop aborts the process) and not
        # the store's connections (the store's own threads serve them).
        self._links = _pair_connections(sockets_before, address) if self._owned and backend != "nccl" else {}
        self._backend = backend
        self.lost: str | None = None  # why tear_down failed the replica's collectives
        self.key = bytes(drawn.cpu().tolist()).hex()
        self._store = dist.PrefixStore(f"ftcomm/decide/{self.key}", _get_default_store())
        self._written: collections.deque[str] = collections.deque()  # slots written here, oldest first
        self._doors: list[admission.Door] = []
        if self._owned and backend != "nccl":
            # Every process of the replica is connected now (torch's store, Gloo's pairs):
            # the listeners torch opened for them admit nobody from here on. (NCCL connects
            # lazily, through its listeners, at later collectives: those stay open.)
            for fd, place in admission.listening_sockets().items():
                if fd not in sockets_before:
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

    def decide(self, key: str, vote: bool, aborted: Callable[[], bool], timeout: float) -> bool:
        """Whether every process of this replica votes yes on decision ``key`` (a gradient
        step commits, a view formed was reconciled everywhere): the same answer on every
        process that asks. Each process writes its vote once into its own slot of the
        replica's store (torch's, which the replica's processes share), then reads every
        other process's slot. A slot a process gives up waiting for (``aborted()``: the view
        broke, or ``timeout`` seconds passed) gets a veto written into it instead, once: a
        slot is written once, so every process reads the same final slots and the same
        answer, and a process that comes late finds its slot vetoed. Keys name what is
        decided (the view, the step's place in it), so no decision is ever paired with
        another, whatever a process missed. ReplicaLost when the store is gone (the process
        that serves it, shard 0, died)."""
        store = self._store
        mine = b"1" if vote else b"0"
        try:
            decided = store.compare_set(f"{key}/{self.shard_rank}", "", mine) == mine and vote
            deadline = time.monotonic() + timeout
            for shard in range(self.size):
                if shard == self.shard_rank:
                    continue
                slot, delay = f"{key}/{shard}", 1e-4
                while not store.check([slot]) and not aborted() and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(2 * delay, 5e-3)
                decided = store.compare_set(slot, "", b"veto") == b"1" and decided  # (the final value)
                self._written.append(slot)
            self._written.append(f"{key}/{self.shard_rank}")
            while len(self._written) > 8 * self.size:  # slots of decisions long over
                store.delete_key(self._written.popleft())
        except RuntimeError as exc:  # the store's process died: its connections reset
            raise ReplicaLost(f"a process of this worker's sharded replica is gone ({str(exc).splitlines()[0][:200]}): "
                              f"exit, and start the whole replica again (ftcomm run --replica-size does)") from None
        return decided

    def process_state(self, shard: int) -> str | None:
        """The state of shard ``shard``'s process as this host's kernel shows it
        (``/proc/PID/stat``: ``R`` running, ``S`` sleeping, ``D``, ``T`` stopped, ...;
        ``gone`` once it exited), or None when it runs on another host or in another pid
        namespace (nothing to look at here)."""
        where = self._processes.get(shard)
        if where is None or where[0] != _LOCAL[0]:
            return None
        fields = stat_fields(where[1])
        if fields is None or process_start(where[1], fields) != where[2]:
            return "gone"
        return fields[0]

    def tear_down(self, why: str) -> bool:
        """Fail every collective of this replica that is in flight or to come, now: a
        process of the replica is gone or hung (``why``), and torch's collectives inside the
        replica would wait for it until their timeout (``init_timeout``). With NCCL the
        process group is aborted; with Gloo, whose abort does not wake a waiting collective
        (DESIGN, the facts about Gloo), the connections between the group's pairs are shut,
        so that a collective waiting on one fails at once, as when a peer crashes. Only a
        group this replica created, once; whether it was torn down here."""
        if not self._owned or self.lost is not None:
            return False
        self.lost = why
        log.error("this process's sharded replica is lost: %s; its collectives are torn down (torch's next or "
                  "current call inside the replica raises): exit, and start the whole replica again (ftcomm run "
                  "--replica-size does)", why)
        if self._backend == "nccl":
            import torch.distributed as dist

            try:
                dist.distributed_c10d._abort_process_group()  # (NCCL communicators abort as a group)
            except Exception as exc:  # an API torch calls experimental: say so rather than end the watch
                log.warning("aborting the replica's NCCL process group failed: %s", exc)
            return True
        for fd, inode in self._links.items():
            admission.shut_connection(fd, inode)
        # The group's threads still wait on its partner: never destroyed, not even at exit,
        # where destroying it with a waiting thread aborts the process (as Gloo's own
        # communicators are kept, see ftcomm.backends.gloo).
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        from ..backends.gloo import bury
        group = dist.distributed_c10d._get_default_group()
        bury((group, group._get_backend(torch.device("cpu")), _get_default_store()))
        return True

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
