"""NCCL backend: ``libnccl.so.2`` through ctypes, with collectives that can be abandoned.

Why not torch's ProcessGroupNCCL: ftcomm must abort a communicator whose peer died
without tearing down the process, re-form a new one for the next view within a second,
and never block a thread on a communicator it gave up on. Binding the few NCCL calls
that fault tolerance needs keeps every one of those steps under our control:

- communicators are created non-blocking (``ncclConfig_t.blocking = 0``) and their
  initialisation is polled with ``ncclCommGetAsyncError`` against a deadline and the
  group's abort signal;
- each communicator has a CUDA stream of its own: a collective waits (on the GPU) for
  the work the caller's current stream has queued, runs on the communication stream,
  so backward's next kernels overlap with it, and the caller's stream waits for it
  before the result is used. A collective stuck on a dead peer therefore never blocks
  the compute stream, nor the communicator of the next view;
- the thread that waits for a collective polls a CUDA event recorded after it, and the
  communicator's asynchronous error, racing both against the abort signal (as on Gloo);
- a communicator that is given up on is ``ncclCommAbort``-ed (from a helper thread, so
  even a stuck abort cannot block training); ``ncclCommDestroy`` is never called, since
  it may wait for peers that are dead.

The library is found, in order: the path in ``FTCOMM_NCCL_LIBRARY``; the
``nvidia-nccl-cu12`` or ``nvidia-nccl-cu13`` wheel (``pip install 'ftcomm[nccl]'``); a
``libnccl.so`` already loaded into the process (by torch); the dynamic loader's search
path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import logging
import os
import pathlib
import threading
import time
from typing import Any, Callable

import torch

from .. import netif
from ..errors import CollectiveAborted, CommunicatorError, FtcommTimeout, NcclUnavailable
from .base import AbortSignal, Completion, Handle, check_root, check_rows, start_lingering

log = logging.getLogger(__name__)

ENV_LIBRARY = "FTCOMM_NCCL_LIBRARY"
ENV_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
MIN_VERSION = (2, 18, 0)  # non-blocking config with splitShare; ncclGetLastError; ncclAvg
API_MAGIC = 0xCAFEBEEF
CONFIG_UNDEF_INT = -(2 ** 31)  # INT_MIN
CONFIG_VERSION = 21800  # the ncclConfig_t layout below is the one of NCCL 2.18

# ncclResult_t
SUCCESS, IN_PROGRESS = 0, 7
RESULT_NAMES = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
                8: "ncclTimeout"}
# ncclDataType_t
DATATYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
             torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
# ncclRedOp_t
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
UNIQUE_ID_BYTES = 128
WHEEL_SOURCE = "the nvidia-nccl wheel"  # nvidia-nccl-cu12 and -cu13 install the same module path


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class Config(ctypes.Structure):
    """``ncclConfig_t`` as of NCCL 2.18: a prefix of the struct of every later version.

    NCCL reads ``size`` and ``version`` and takes only the fields they cover, so this
    layout stays valid against newer libraries (checked against the installed header
    by the tests).
    """

    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p), ("splitShare", ctypes.c_int)]

    @classmethod
    def non_blocking(cls) -> "Config":
        undef = CONFIG_UNDEF_INT
        return cls(ctypes.sizeof(cls), API_MAGIC, CONFIG_VERSION, 0, undef, undef, undef, None, undef)


def decode_version(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s integer as (major, minor, patch); the encoding changed at 2.9."""
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def library_candidates() -> list[tuple[str, str]]:
    """Where libnccl.so.2 may be, as (source, path), in the order they are tried."""
    found: list[tuple[str, str]] = []
    explicit = os.environ.get(ENV_LIBRARY)
    if explicit:
        return [(f"${ENV_LIBRARY}", explicit)]  # an explicit choice is the only one tried
    wheel = _wheel_library()
    if wheel is not None:
        found.append((WHEEL_SOURCE, str(wheel)))
    for path in _loaded_libraries():
        found.append(("already loaded in this process", path))
    system = ctypes.util.find_library("nccl")
    found.append(("the dynamic loader's search path", system or "libnccl.so.2"))
    return found


def _wheel_library() -> pathlib.Path | None:
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = pathlib.Path(location) / "lib" / "libnccl.so.2"
        if candidate.is_file():
            return candidate
    return None


def _loaded_libraries() -> list[str]:
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = {line.split()[-1] for line in maps.splitlines() if "libnccl.so" in line and "/" in line}
    return sorted(paths)


class Library:
    """The loaded library with the prototypes ftcomm uses."""

    def __init__(self, path: str, source: str) -> None:
        self.path, self.source = path, source
        lib = self._lib = ctypes.CDLL(path)
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        self._bind("ncclGetVersion", [ctypes.POINTER(c_int)])
        self._bind("ncclGetUniqueId", [ctypes.POINTER(UniqueId)])
        lib.ncclGetErrorString.restype, lib.ncclGetErrorString.argtypes = ctypes.c_char_p, [c_int]
        self.version = self._version()
        if self.version < MIN_VERSION:
            raise NcclUnavailable(f"{path} ({source}) is NCCL {_dotted(self.version)}; ftcomm needs "
                                  f"{_dotted(MIN_VERSION)} or newer (pip install 'ftcomm[nccl]')")
        lib.ncclGetLastError.restype, lib.ncclGetLastError.argtypes = ctypes.c_char_p, [c_void_p]
        self._bind("ncclCommInitRankConfig", [ctypes.POINTER(c_void_p), c_int, UniqueId, c_int,
                                              ctypes.POINTER(Config)])
        self._bind("ncclCommGetAsyncError", [c_void_p, ctypes.POINTER(c_int)])
        self._bind("ncclCommAbort", [c_void_p])
        self._bind("ncclGroupStart", [])
        self._bind("ncclGroupEnd", [])
        stream = c_void_p
        self._bind("ncclAllReduce", [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, stream])
        self._bind("ncclBroadcast", [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, stream])
        self._bind("ncclAllGather", [c_void_p, c_void_p, c_size_t, c_int, c_void_p, stream])
        self._bind("ncclReduceScatter", [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, stream])
        self._bind("ncclSend", [c_void_p, c_size_t, c_int, c_int, c_void_p, stream])
        self._bind("ncclRecv", [c_void_p, c_size_t, c_int, c_int, c_void_p, stream])
        # Fault-tolerance calls of newer libraries, bound where present (see features()).
        if hasattr(lib, "ncclCommShrink"):  # 2.27
            self._bind("ncclCommShrink", [c_void_p, ctypes.POINTER(c_int), c_int, ctypes.POINTER(c_void_p),
                                          ctypes.POINTER(Config), c_int])
        if hasattr(lib, "ncclCommRevoke"):  # 2.28
            self._bind("ncclCommRevoke", [c_void_p, c_int])

    def features(self) -> dict[str, bool]:
        """Which of NCCL's calls for changing a communicator's ranks this library exports."""
        return {name: hasattr(self._lib, name) for name in ("ncclCommShrink", "ncclCommRevoke", "ncclCommGrow")}

    def _bind(self, name: str, argtypes: list) -> None:
        fn = getattr(self._lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
        setattr(self, name, fn)

    def _version(self) -> tuple[int, int, int]:
        code = ctypes.c_int()
        result = self.ncclGetVersion(ctypes.byref(code))
        if result != SUCCESS:
            raise NcclUnavailable(f"ncclGetVersion failed in {self.path}: {self.error_string(result)}")
        return decode_version(code.value)

    def error_string(self, result: int) -> str:
        text = self._lib.ncclGetErrorString(result)
        return text.decode(errors="replace") if text else f"unknown NCCL result {result}"

    def describe(self, result: int, comm: Any = None) -> str:
        """``ncclXxx (code): what NCCL says; last error: detail``."""
        text = f"{RESULT_NAMES.get(result, 'ncclResult')} ({result}): {self.error_string(result)}"
        last = self._lib.ncclGetLastError(comm)
        if last:
            text += f"; last error: {last.decode(errors='replace').strip()[:300]}"
        return text

    def check(self, result: int, what: str, comm: Any = None) -> int:
        """Raise CommunicatorError unless ``result`` is success or in-progress; return it."""
        if result not in (SUCCESS, IN_PROGRESS):
            raise CommunicatorError(f"{what} failed: {self.describe(result, comm)}")
        return result

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.check(self.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)  # may hold NUL bytes

    def async_error(self, comm: Any) -> int:
        state = ctypes.c_int()
        self.check(self.ncclCommGetAsyncError(comm, ctypes.byref(state)), "ncclCommGetAsyncError", comm)
        return state.value


@functools.lru_cache(maxsize=None)
def load() -> Library:
    """The NCCL library (found as the module says), loaded once; NcclUnavailable if none works."""
    tried = []
    for source, path in library_candidates():
        try:
            return Library(path, source)
        except (OSError, AttributeError) as exc:  # not loadable, or not a complete libnccl
            tried.append(f"{path} ({source}): {str(exc).splitlines()[0][:200]}")
    raise NcclUnavailable("libnccl.so.2 not found; tried " + "; ".join(tried) +
                          f". Install it with pip install 'ftcomm[nccl]' or set {ENV_LIBRARY}")


def version() -> tuple[int, int, int]:
    return load().version


def select_interface(host: str) -> str | None:
    """Point NCCL at the interface that holds ``host`` (``NCCL_SOCKET_IFNAME==<name>``), unless
    the user set ``NCCL_SOCKET_IFNAME``. NCCL reads it when it first initialises its network
    in this process, so it must be chosen before then. Returns what NCCL will be told, or
    None where NCCL keeps its own choice (a wildcard bind, an address no interface holds).
    """
    chosen = os.environ.get(ENV_SOCKET_IFNAME)
    if chosen:
        return chosen
    interface = netif.interface_of(host)
    if interface is None:
        return None
    os.environ[ENV_SOCKET_IFNAME] = f"={interface.name}"  # "=": this interface exactly, not a prefix
    log.info("NCCL uses interface %s (it holds %s)", interface.name, host)
    return os.environ[ENV_SOCKET_IFNAME]


def _dotted(v: tuple[int, int, int]) -> str:
    return ".".join(map(str, v))


def _completion(lib: Library, comm: ctypes.c_void_p) -> Completion:
    """How one communicator's collectives finish: their events, or an asynchronous error."""
    def check() -> str | None:
        try:
            state = lib.async_error(comm)
        except CommunicatorError as exc:
            return str(exc)
        return None if state in (SUCCESS, IN_PROGRESS) else lib.describe(state, comm)
    return Completion(check)


class NcclCommunicator:
    """Collectives over one view on CUDA tensors. Failure semantics of :mod:`ftcomm.backends.base`."""

    name = "nccl"

    def __init__(self, lib: Library, comm: ctypes.c_void_p, rank: int, size: int, view_id: int,
                 device: torch.device, abort: AbortSignal | None = None) -> None:
        self._lib, self._comm = lib, comm
        self.rank, self.size, self.view_id, self.device = rank, size, view_id, device
        self._abort = abort  # the view's signal: an enqueue still in progress gives up when it fires
        self.stream = torch.cuda.Stream(device=device)  # where this communicator's collectives run
        self._completion = _completion(lib, comm)
        self._pending: list[Handle] = []
        self._gone = False

    @staticmethod
    def retain(host: str | None) -> None:
        """Nothing to keep: NCCL's listeners belong to its communicators."""

    @staticmethod
    def release(host: str | None) -> None:
        """Nothing to close: each communicator's ``close``/``abandon`` ends its own sockets."""

    @staticmethod
    def prepare(host: str | None) -> None:
        """Nothing to make ahead: a communicator's resources are its own."""

    @classmethod
    def form(cls, store: Any, rank: int, size: int, view_id: int, abort: AbortSignal, timeout: float,
             host: str | None = None, sources: Any = None) -> "NcclCommunicator":
        """Rank 0 publishes a fresh unique id in its store; every rank initialises non-blocking.

        ``host``: the address the group is bound to; NCCL's bootstrap and socket transport
        use the interface that holds it (see :func:`select_interface`). ``sources`` is not
        used: NCCL opens its listening sockets in its own threads (docs/SECURITY.md says
        which ports to firewall).
        """
        lib = load()
        if not torch.cuda.is_available():
            raise NcclUnavailable("backend='nccl' needs a CUDA device; torch sees none")
        if host is not None:
            select_interface(host)
        device = torch.device("cuda", torch.cuda.current_device())
        deadline = time.monotonic() + timeout
        uid = UniqueId.from_buffer_copy(_exchange_unique_id(lib, store, rank, view_id, abort, timeout))
        comm = ctypes.c_void_p()
        config = Config.non_blocking()
        with torch.cuda.device(device):
            lib.check(lib.ncclCommInitRankConfig(ctypes.byref(comm), size, uid, rank, ctypes.byref(config)),
                      f"ncclCommInitRankConfig for view {view_id}")
        try:
            _poll_ready(lib, comm, abort, deadline, f"initialising the NCCL communicator of view {view_id}")
        except BaseException:
            _abort_in_background(lib, comm, view_id)
            raise
        return cls(lib, comm, rank, size, view_id, device, abort)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], op: str = "sum") -> Handle:
        """In-place reduction of each tensor (one NCCL group); ``mean`` is ncclAvg."""
        nccl_op = _reduction(op)
        for t in tensors:
            self._check_tensor(t)

        def enqueue(stream: int) -> None:
            for t in tensors:
                self._lib.check(self._lib.ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), DATATYPES[t.dtype],
                                                        nccl_op, self._comm, stream), "ncclAllReduce", self._comm)
        return self._launch(f"allreduce({op}) in view {self.view_id}", enqueue, lambda: tensors, grouped=True,
                            tensors=tuple(tensors))

    def broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        check_root(src, self.size)
        self._check_tensor(tensor)

        def enqueue(stream: int) -> None:
            self._lib.check(self._lib.ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                                    DATATYPES[tensor.dtype], src, self._comm, stream),
                            "ncclBroadcast", self._comm)
        return self._launch(f"broadcast from rank {src} in view {self.view_id}", enqueue, lambda: tensor,
                            tensors=(tensor,))

    def allgather(self, tensor: torch.Tensor) -> Handle:
        self._check_tensor(tensor)
        out = torch.empty((self.size,) + tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)

        def enqueue(stream: int) -> None:
            self._lib.check(self._lib.ncclAllGather(tensor.data_ptr(), out.data_ptr(), tensor.numel(),
                                                    DATATYPES[tensor.dtype], self._comm, stream),
                            "ncclAllGather", self._comm)
        return self._launch(f"allgather in view {self.view_id}", enqueue, lambda: list(out.unbind(0)),
                            tensors=(tensor, out))

    def reduce_scatter(self, output: torch.Tensor, source: torch.Tensor, op: str = "sum") -> Handle:
        """``output`` (n elements) receives this rank's n-element slice of the reduced ``source``."""
        nccl_op = _reduction(op)
        self._check_tensor(output)
        self._check_tensor(source)
        if source.numel() != output.numel() * self.size:
            raise ValueError(f"reduce_scatter: the source has {source.numel()} elements, expected "
                             f"{output.numel()} x {self.size}")

        def enqueue(stream: int) -> None:
            self._lib.check(self._lib.ncclReduceScatter(source.data_ptr(), output.data_ptr(), output.numel(),
                                                        DATATYPES[source.dtype], nccl_op,
                                                        self._comm, stream), "ncclReduceScatter", self._comm)
        return self._launch(f"reduce_scatter({op}) in view {self.view_id}", enqueue, lambda: output,
                            tensors=(output, source))

    def alltoall(self, tensor: torch.Tensor) -> Handle:
        """Row ``j`` to rank ``j``, row ``i`` of the result from rank ``i`` (one NCCL group of
        sends and receives)."""
        check_rows(tensor, self.size)
        self._check_tensor(tensor)
        out = torch.empty_like(tensor)
        count, dtype = tensor[0].numel(), DATATYPES[tensor.dtype]

        def enqueue(stream: int) -> None:
            for peer in range(self.size):
                self._lib.check(self._lib.ncclSend(tensor[peer].data_ptr(), count, dtype, peer, self._comm, stream),
                                "ncclSend", self._comm)
                self._lib.check(self._lib.ncclRecv(out[peer].data_ptr(), count, dtype, peer, self._comm, stream),
                                "ncclRecv", self._comm)
        return self._launch(f"alltoall in view {self.view_id}", enqueue, lambda: out, grouped=True,
                            tensors=(tensor, out))

    def barrier(self) -> Handle:
        token = torch.zeros(1, dtype=torch.float32, device=self.device)
        return self.allreduce([token], "sum")

    def abandon(self) -> None:
        """Give up on this communicator: ncclCommAbort in the background; nothing waits for it."""
        if not self._gone:
            self._gone = True
            self._completion.fail("the communicator was abandoned")  # no pending handle may read as a success
            _abort_in_background(self._lib, self._comm, self.view_id, keep=self._pending)
            self._pending = []

    def close(self) -> None:
        """Release the communicator (always by abort: destroy may wait for dead peers)."""
        self.abandon()

    # ------------------------------------------------------------------ helpers
    def _check_tensor(self, t: torch.Tensor) -> None:
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"the nccl backend needs contiguous CUDA tensors, got {t.device} "
                             f"{'contiguous' if t.is_contiguous() else 'non-contiguous'}")
        if t.dtype not in DATATYPES:
            raise ValueError(f"the nccl backend does not reduce {t.dtype}: use one of "
                             f"{sorted(str(d) for d in DATATYPES)}")

    def _launch(self, what: str, enqueue: Callable[[int], None], result: Callable[[], Any],
                grouped: bool = False, tensors: tuple[torch.Tensor, ...] = ()) -> Handle:
        """Enqueue on the communication stream, after what the current stream has queued."""
        if self._gone:
            raise CommunicatorError(f"{what}: the communicator of view {self.view_id} was abandoned")
        lib, stream = self._lib, self.stream
        producer = torch.cuda.current_stream(self.device)
        stream.wait_stream(producer)
        for t in tensors:  # the allocator must not reuse them before the collective is done
            t.record_stream(stream)
        if grouped:
            lib.check(lib.ncclGroupStart(), "ncclGroupStart", self._comm)
        try:
            enqueue(stream.cuda_stream)
        finally:
            if grouped:
                lib.check(lib.ncclGroupEnd(), "ncclGroupEnd", self._comm)
        # A non-blocking communicator may still be enqueueing (connecting to a peer, say):
        # the completion event must come after the collective, so wait for that first.
        _poll_ready(lib, self._comm, self._abort, time.monotonic() + 30.0, what)
        done = torch.cuda.Event()
        done.record(stream)
        completion = self._completion

        def finish() -> Any:
            if completion.error is not None:
                raise CommunicatorError(f"{what} failed: {completion.error}")
            torch.cuda.current_stream(self.device).wait_event(done)  # the consumer's stream is ordered after it
            return result()
        handle = Handle(what, lambda: completion.finished(done.query), finish)
        self._pending = [h for h in self._pending if not h.completed] + [handle]
        return handle


def _reduction(op: str) -> int:
    """The ncclRedOp_t of one of the group's reductions (``mean`` is ncclAvg)."""
    if op not in ("sum", "mean", "max", "min"):
        raise ValueError(f"unknown reduction {op!r}: use sum, mean, max or min")
    return OPS["avg" if op == "mean" else op]


def _exchange_unique_id(lib: Library, store: Any, rank: int, view_id: int, abort: AbortSignal,
                        timeout: float) -> bytes:
    """Rank 0 creates the id and publishes it; the others read it, raced against the abort signal."""
    key = "nccl/unique_id"
    if rank == 0:
        uid = lib.unique_id()
        store.set(key, uid)
        return uid
    outcome: dict[str, Any] = {}
    wake = threading.Event()

    def fetch() -> None:
        try:
            outcome["uid"] = bytes(store.get(key))
        except Exception as exc:  # noqa: BLE001 - reported to the waiting thread
            outcome["error"] = exc
        wake.set()

    what = f"reading the NCCL unique id of view {view_id}"
    cancel = getattr(store, "cancel", None)  # ftcomm's stores can end a blocked read at once
    start_lingering(fetch, f"ftcomm-nccl-uid-{view_id}",
                    cancel=None if cancel is None else lambda: cancel(f"{what} was given up"))
    try:
        abort.wait(wake, lambda: bool(outcome), timeout, what)
    except BaseException:
        if cancel is not None:
            cancel(f"{what} was given up")
        raise
    if "error" in outcome:
        raise CommunicatorError(f"reading the NCCL unique id of view {view_id} failed: "
                                f"{str(outcome['error']).splitlines()[0][:200]}")
    uid = outcome["uid"]
    if len(uid) != UNIQUE_ID_BYTES:
        raise CommunicatorError(f"the NCCL unique id of view {view_id} has {len(uid)} bytes, not {UNIQUE_ID_BYTES}")
    return uid


def _poll_ready(lib: Library, comm: ctypes.c_void_p, abort: AbortSignal | None, deadline: float, what: str) -> None:
    """Poll ncclCommGetAsyncError until the communicator is no longer in progress."""
    while True:
        state = lib.async_error(comm)
        if state == SUCCESS:
            return
        if state != IN_PROGRESS:
            raise CommunicatorError(f"{what} failed: {lib.describe(state, comm)}")
        if abort is not None and abort.check() is not None:
            raise CollectiveAborted(f"{what} abandoned: {abort.reason}")
        if time.monotonic() > deadline:
            raise FtcommTimeout(f"{what} did not complete in time")
        time.sleep(0.001)


_ABORTED: list[Any] = []  # what in-flight collectives may still touch, kept for the process lifetime


def _abort_in_background(lib: Library, comm: ctypes.c_void_p, view_id: int, keep: Any = None) -> None:
    _ABORTED.append((comm, keep))

    def run() -> None:
        result = lib.ncclCommAbort(comm)
        if result != SUCCESS:
            log.warning("ncclCommAbort of view %d: %s", view_id, lib.describe(result))
    try:
        start_lingering(run, f"ftcomm-nccl-abort-{view_id}")  # exiting under a running abort: SIGABRT
    except RuntimeError:  # the interpreter is exiting and starts no threads: abort here
        run()
