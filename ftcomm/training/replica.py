"""A replica of K processes that shards the model among themselves (FSDP2 over ``shard_mesh``).

The K processes share torch's default process group, which FSDP2's own collectives use
(all-gather, reduce-scatter); it is not fault-tolerant. Each process is a member of the
ftcomm group; views hold whole replicas (:func:`ftcomm.core.view.whole_replicas`), and
the shard-*i* processes of a view reduce their gradient shards over a communicator of
their own (see :mod:`ftcomm.training.sharded`). The replica's key, drawn by shard 0 when
the replica starts, tells its processes from those of an earlier start of the same replica.
Every process of a replica commits a gradient step or none does (:meth:`Replica.decide`).

With Gloo the replica's process group is one ftcomm builds and can build again: FSDP2's
all-gathers and reduce-scatters go through :class:`ReplicaComms` (FSDP2's custom
collectives) to the replica's current group, and a failed one completes empty instead of
raising into the script's forward or backward (the step is then discarded). When a process
of the replica is lost, the others keep their interpreters, models and optimizers, and
:meth:`Replica.reform` meets the process that replaces it at a fresh address; the device
mesh keeps its name, which now names the new group (see ``ftcomm.training.replica_repair``).
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed.distributed_c10d  # noqa: F401 - _Settled subclasses its Work

from ..errors import FtcommError, ReplicaLost, StateError
from ..gossip.addresses import parse_address
from ..localproc import process_start, stat_fields
from ..backends import admission
from .. import netif
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


def _pair_connections(before: set[int], store: str | None, serves: bool) -> dict[int, int]:
    """Descriptor -> inode of the connected TCP sockets made since ``before``, less those the
    ``store`` (``HOST:PORT``) accepted on its port when this process ``serves`` it (its own
    threads serve them): Gloo's pairs, and this process's connection to the store, whose
    operations (a decision) would otherwise wait for a host that vanished until the store's
    timeout. A listener has no peer: it is not among them."""
    store_port = parse_address(store)[1] if store and serves else None
    found = {}
    for fd, inode in admission.socket_descriptors().items():
        if fd in before:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                    continue
                sock.getpeername()  # (raises for a listener)
                local = sock.getsockname()[1]
        except OSError:  # not connected (a listener), or closed meanwhile
            continue
        if local != store_port:
            found[fd] = inode
    return found


def rebuildable() -> bool:
    """This torch lets ftcomm build the replica's Gloo group itself and route FSDP2's
    collectives (what a repair in place needs); older ones get torch's own group, and a
    lost process restarts the whole replica."""
    import torch.distributed.distributed_c10d as c10d
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return all(hasattr(c10d, name) for name in ("_register_pg_in_world", "_unregister_process_group",
                                                 "_update_default_pg", "_process_group_name")) \
        and hasattr(FSDPModule, "set_custom_all_gather") and hasattr(FSDPModule, "set_custom_reduce_scatter")


def _install_gloo_group(store: Any, rank: int, size: int, timeout: datetime.timedelta, name: str,
                        host: str | None) -> Any:
    """A Gloo process group of ``size`` ranks (this one ``rank``) meeting in ``store``, made
    torch's default group under ``name`` (the name a device mesh made over an earlier group
    of this replica resolves): torch's own bookkeeping, as ``init_process_group`` does it.
    Its pairs listen on ``host``, the address this process's group is bound to (without it
    Gloo takes the address of the host name, loopback on many hosts: a replica split across
    hosts could not form)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    prefix = dist.PrefixStore("ftcomm/replica", store)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device() if host is None or netif.is_wildcard(host)
                        else dist.ProcessGroupGloo.create_device(hostname=netif.resolve(host))]
    backend = dist.ProcessGroupGloo(prefix, rank, size, options)  # (connects every pair, or raises)
    backend._set_sequence_number_for_group()
    group = dist.ProcessGroup(prefix, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_group_name(name)
    group._set_group_desc("ftcomm sharded replica")
    if c10d._world.default_pg is not None:  # the group this one replaces keeps its entries (FSDP2 holds it)
        c10d._unregister_process_group(name)
    c10d._register_pg_in_world(group, backend_name="gloo", store=prefix, group_name=name, backend_config="cpu:gloo",
                               rank_mapping={i: i for i in range(size)}, add_to_default_tag=True)
    c10d._update_default_pg(group)
    return group


class Replica:
    """This process's replica: ``size`` processes, this one shard ``shard_rank``, meeting at
    ``address`` (``HOST:PORT``, shard 0's; torch's TCP store). An already initialized default
    process group is used as it is when it has ``size`` ranks and this is rank
    ``shard_rank`` (such a replica is never formed again). ``timeout``: how long its
    collectives wait for a process; ``host``: the address this process's group is bound to,
    where the replica's Gloo pairs listen too (None: the host name's)."""

    def __init__(self, size: int, shard_rank: int, address: str | None, backend: str, timeout: float,
                 host: str | None = None) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        self.size, self.shard_rank = size, shard_rank
        self._backend, self._timeout, self._host = backend, timeout, host
        self._owned = False
        self._lock = threading.Lock()  # tear_down (the watch's thread, a failed collective) against reform
        self.lost: str | None = None  # why tear_down failed the replica's collectives
        self.lost_shards: set[int] = set()  # the shard ranks whose processes tear_down named
        self.formations = 0  # how often the replica's group formed in this process (1: never repaired)
        self._doors: list[admission.Door] = []
        self._group_name: str | None = None
        if dist.is_initialized():
            if (dist.get_world_size(), dist.get_rank()) != (size, shard_rank):
                raise FtcommError(f"torch.distributed is initialized with rank {dist.get_rank()} of "
                                  f"{dist.get_world_size()}, not shard {shard_rank} of a replica of {size}")
            self._links: dict[int, int] = {}
        else:
            if not address:
                raise ValueError("replica_size > 1 needs the replica's address (replica_addr='HOST:PORT' of its "
                                 "shard 0, or $FTCOMM_REPLICA_ADDR)")
            self._form(address)
        device = "cuda" if backend == "nccl" else "cpu"
        self.device = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        if self._group_name is not None:
            # Over the group ftcomm made, by its name, which every formation keeps: DTensor's
            # collectives (clip_grad_norm_, full_tensor) then follow it. (init_device_mesh makes
            # a group of its own over a Gloo default group wherever CUDA is available: one
            # that no tear-down shuts and no repair forms again.)
            self.mesh = DeviceMesh.from_group(self.group, device, mesh_dim_names=("shard",))
        else:
            self.mesh = init_device_mesh(device, (size,), mesh_dim_names=("shard",))
        self._meet()
        self.comms = ReplicaComms(self) if self._owned and backend != "nccl" and rebuildable() else None

    @property
    def repairable(self) -> bool:
        """The replica's group is one ftcomm made with Gloo: it can be formed again with a
        process that replaces a lost one (:meth:`reform`)."""
        return self._owned and self._backend != "nccl" and self.comms is not None and self.comms.whole

    @property
    def group(self) -> Any:
        """The replica's current process group (torch's default group)."""
        import torch.distributed as dist
        return dist.distributed_c10d._get_default_group()

    def _form(self, address: str) -> None:
        """Meet the replica's other processes at ``address`` and make its process group
        (torch's default group; with Gloo one ftcomm builds, under the same name at every
        formation, so that the device mesh and FSDP2 find the new one)."""
        import torch.distributed as dist

        sockets_before = set(admission.socket_descriptors())  # (the listeners among them too)
        wait = datetime.timedelta(seconds=self._timeout)
        store = _store(address, self.shard_rank, self.size, wait)
        if self._backend == "nccl" or not rebuildable():
            dist.init_process_group(self._backend, store=store, rank=self.shard_rank, world_size=self.size,
                                    timeout=wait)
        else:
            if self._group_name is None:
                import torch.distributed.distributed_c10d as c10d
                self._group_name = c10d._process_group_name([], use_hashed_name=False)
            _install_gloo_group(store, self.shard_rank, self.size, wait, self._group_name, self._host)
        self._owned = True
        self.formations += 1
        from ..backends.gloo import quiesce_at_exit
        quiesce_at_exit()
        # Every pair of the replica's Gloo group is connected now (Gloo connects all of them
        # when the group is made): the connections tear_down shuts, with this process's
        # connection to the store. Not the listeners (a listener shut under Gloo's or the
        # store's accept loop aborts the process) and not the connections the store accepted
        # (its own threads serve them).
        self._links = _pair_connections(sockets_before, address, self.shard_rank == 0) \
            if self._backend != "nccl" else {}
        if self._backend != "nccl":
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

    def _meet(self) -> None:
        """Once the group formed: shard 0 draws the replica's key, and each process learns
        where the others run."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        drawn = torch.tensor(list(os.urandom(8)) if self.shard_rank == 0 else [0] * 8, dtype=torch.uint8,
                             device=self.device)
        store = _get_default_store()
        store.set(f"ftcomm/process/{self.shard_rank}", local_identity())  # (before the broadcast: see below)
        dist.broadcast(drawn, 0)  # raw bytes: nothing from another process is unpickled
        # Where each other process of the replica runs (the watch looks at a partner on this
        # host in /proc): each wrote it before the broadcast; get waits for a late writer.
        self._processes = {i: parse_identity(store.get(f"ftcomm/process/{i}")) for i in range(self.size)
                           if i != self.shard_rank}
        self.key = bytes(drawn.cpu().tolist()).hex()
        self._store = dist.PrefixStore(f"ftcomm/decide/{self.key}", store)
        self._written: collections.deque[str] = collections.deque()  # slots written here, oldest first

    def reform(self, address: str) -> None:
        """Form the replica's group again at ``address`` with the processes that are its
        shards now (this one kept its interpreter, model and optimizer; a lost one was
        replaced): a fresh store and Gloo group under the group's name, a fresh key. The
        torn-down group is kept, never destroyed (its threads may still wait on the lost
        process). FtcommError, or torch's error, when the others do not come within the
        replica's timeout."""
        if not self.repairable:
            raise FtcommError("this replica's process group was not made by ftcomm with Gloo: it cannot be formed "
                              "again")
        self._form(address)
        self._meet()
        with self._lock:
            self.lost, self.lost_shards = None, set()

    def check_sharded(self, entries: dict[str, Any]) -> None:
        """StateError naming the first parameter of a module in ``entries`` that is not a
        DTensor on this replica's mesh (sharded with ``fully_shard(..., mesh=ft.shard_mesh)``).
        A registered object that trains a module of its own (``DiLoCo``, ``LocalSGD``: its
        ``model``) counts as that module."""
        entries = {name: _module_of(entry) for name, entry in entries.items()}
        for name, entry in entries.items():
            if not isinstance(entry, torch.nn.Module):
                continue
            for path, param in entry.named_parameters():
                if not sharded.is_sharded(param) or param.device_mesh != self.mesh:
                    raise StateError(f"{name}.{path} is not sharded over ft.shard_mesh: with replica_size="
                                     f"{self.size}, shard the model with fully_shard(module, mesh=ft.shard_mesh) "
                                     f"before registering it")
        if self.comms is None:
            return
        for name, entry in entries.items():
            if isinstance(entry, torch.nn.Module):
                try:
                    self.comms.install(entry)
                except ValueError as exc:  # (FSDP2 takes no custom collectives for several parameter groups)
                    log.warning("%s keeps FSDP2's own collectives (%s): a lost process of this replica restarts "
                                "the whole replica", name, exc)
                    self.comms = None
                    return

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
        except RuntimeError as exc:  # the store's process died (its connections reset), or a tear-down shut ours
            with self._lock:
                lost, shard = self.lost, min(self.lost_shards, default=None)
            what = lost or f"a process of this worker's sharded replica is gone ({str(exc).splitlines()[0][:200]})"
            raise ReplicaLost(f"{what}: exit, and start the whole replica again (ftcomm run --replica-size does)",
                              shard, reason=what) from None
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

    def tear_down(self, why: str, shard: int | None = None) -> bool:
        """Fail every collective of this replica that is in flight or to come, now: a
        process of the replica (shard ``shard`` where known) is gone or hung (``why``), and
        torch's collectives inside the replica would wait for it until their timeout
        (``init_timeout``). With NCCL the process group is aborted; with Gloo, whose abort
        does not wake a waiting collective (DESIGN, the facts about Gloo), the connections
        between the group's pairs (and this process's connection to the replica's store, for a
        decision waiting on it) are shut, so that a collective waiting on one fails at
        once, as when a peer crashes. Only a group this replica created, once per
        formation; whether it was torn down here."""
        with self._lock:
            if shard is not None:
                self.lost_shards.add(shard)
            if not self._owned or self.lost is not None:
                return False
            self.lost = why
        log.error("this process's sharded replica is lost: %s; its collectives are torn down", why)
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
        from torch.distributed.distributed_c10d import _get_default_store

        from ..backends.gloo import bury
        group = self.group
        bury((group, group._get_backend(torch.device("cpu")), _get_default_store()))
        return True

    def process_id(self, shard: int) -> int | None:
        """The pid of shard ``shard``'s process when it runs in this process's pid namespace
        (as it wrote it when the group formed), else None."""
        where = self._processes.get(shard)
        return where[1] if where is not None and where[0] == _LOCAL[0] else None

    def close(self) -> None:
        """Destroy the process group this replica created (not one the caller initialized,
        nor one that was torn down or formed again: their threads may wait on a lost process)."""
        import torch.distributed as dist
        if self._owned and dist.is_initialized() and self.lost is None and self.formations == 1:
            dist.destroy_process_group()
            self._owned = False


def _module_of(entry: Any) -> Any:
    """``entry``, or the module it trains (a registered DiLoCo or LocalSGD's ``model``)."""
    model = getattr(entry, "model", None)
    return model if not isinstance(entry, torch.nn.Module) and isinstance(model, torch.nn.Module) else entry


def _fsdp_api() -> tuple[type, type]:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    return AllGather, ReduceScatter


class _Settled(torch.distributed.distributed_c10d.Work):
    """The work of a collective of the replica that FSDP2 waits for: waiting never raises.
    A collective that fails (its replica torn down, or a process of it gone) tears the
    replica down and leaves its output zeroed; the step it belongs to is then discarded."""

    def __init__(self, work: Any, comms: ReplicaComms, output: torch.Tensor, what: str) -> None:
        super().__init__()
        self._work, self._comms, self._output, self._what = work, comms, output, what

    def wait(self, timeout: Any = None) -> bool:
        work, self._work = self._work, None
        if work is not None:
            try:
                work.wait()
            except RuntimeError as exc:
                self._comms.failed(self._what, exc, self._output)
        return True


class ReplicaComms:
    """FSDP2's all-gather and reduce-scatter for the modules of a repairable replica
    (installed with ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` when the state
    is registered): each runs on the replica's current process group, whatever group FSDP2
    was built with, and one that fails, or is asked for while the replica is lost, leaves
    its output zeroed instead of raising into the script's forward or backward. ftcomm's
    next call at the step then finds the replica lost (:attr:`Replica.lost`) and discards
    the step."""

    def __init__(self, replica: Replica) -> None:
        import torch.distributed as dist

        self.replica = replica
        AllGather, ReduceScatter = _fsdp_api()
        comms = self
        # (torch's names for the same collectives, newest first: the older ones warn now)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        class Gather(AllGather):
            def allocate(self, size, *, dtype, device):
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                return comms.run("all-gather", output_tensor, lambda: gather(
                    output_tensor, input_tensor, group=comms.group_for(group), async_op=True), async_op)

        class Scatter(ReduceScatter):
            def allocate(self, size, *, dtype, device):
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                return comms.run("reduce-scatter", output_tensor, lambda: scatter(
                    output_tensor, input_tensor, op=op, group=comms.group_for(group), async_op=True), async_op)

        self.gather, self.scatter = Gather(), Scatter()
        self.whole = True  # every collective spans the whole replica (see group_for)

    def group_for(self, group: Any) -> Any:
        """The group a collective FSDP2 asks for on ``group`` runs on: the replica's current
        one when ``group`` spans the replica (the group FSDP2 was built with, or a later one),
        else ``group`` itself (a sub-group, as ``reshard_after_forward=N`` makes), which a
        repair could not form again: the replica is then repaired no more (:attr:`whole`)."""
        if group.size() == self.replica.size:
            return self.replica.group
        if self.whole:
            self.whole = False
            log.warning("an FSDP2 module gathers over a part of the replica (reshard_after_forward=N?): a lost "
                        "process of this replica restarts the whole replica")
        return group

    def install(self, module: torch.nn.Module) -> int:
        """Route the collectives of every FSDP2 module in ``module`` through the replica;
        how many modules."""
        from torch.distributed.fsdp import FSDPModule

        installed = 0
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_custom_all_gather(self.gather)
                sub.set_custom_reduce_scatter(self.scatter)
                installed += 1
        return installed

    def run(self, what: str, output: torch.Tensor, start: Callable[[], Any], async_op: bool) -> Any:
        if self.replica.lost is not None:
            output.zero_()
            return None
        try:
            work = start()
        except RuntimeError as exc:
            self.failed(what, exc, output)
            return None
        settled = _Settled(work, self, output, what)
        if async_op:
            return settled
        settled.wait()
        return None

    def failed(self, what: str, exc: BaseException, output: torch.Tensor) -> None:
        self.replica.tear_down(f"its {what} failed ({str(exc).splitlines()[0][:200]})")
        output.zero_()


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
