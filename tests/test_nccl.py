"""The NCCL backend. CPU side (always): finding the library, version, unique ids, error
strings, and the ctypes layouts against the installed header. GPU side (only where torch
sees a CUDA device): a world-size-1 communicator's init, collectives, abort and re-init;
several ranks on the one device (each a host of its own to NCCL, see tests/nccl_ranks.py):
every dtype and reduction against torch.distributed, a peer that exits, a peer that
hangs, and a group of training workers surviving a crash.
"""

from __future__ import annotations

import ctypes
import pathlib
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ftcomm
from ftcomm.backends import nccl
from ftcomm.backends.base import AbortSignal, Handle
from ftcomm.errors import CollectiveAborted, CommunicatorError, NcclUnavailable

from . import nccl_ranks
from .nccl_ranks import run_ranks
from .train_cluster import TrainCluster, assert_invariants


@pytest.fixture(autouse=True)
def fresh_load():
    nccl.load.cache_clear()
    yield
    nccl.load.cache_clear()


def wheel_dir() -> pathlib.Path:
    path = nccl._wheel_library()
    assert path is not None, "the test extra installs the nvidia-nccl wheel"
    return path.parent.parent


def header() -> str:
    return (wheel_dir() / "include" / "nccl.h").read_text()


def api_magic() -> int:
    """``NCCL_API_MAGIC``, or where a header has no such define (2.28), the magic of its
    ``NCCL_CONFIG_INITIALIZER``."""
    match = re.search(r"#define NCCL_API_MAGIC\s+(\S+)", header()) or re.search(
        r"(0x[0-9a-fA-F]+),\s*/\* magic \*/", header())
    assert match
    return int(match.group(1), 16)


def define(name: str) -> str:
    match = re.search(rf"#define {name}\s+(\S+)", header())
    assert match, name
    return match.group(1)


# ---------------------------------------------------------------------- finding the library
def test_the_wheel_is_found_first_and_reports_its_version():
    source, path = nccl.library_candidates()[0]
    assert source == nccl.WHEEL_SOURCE and pathlib.Path(path).is_file()
    lib = nccl.load()
    assert lib.path == path
    expected = tuple(int(define(f"NCCL_{part}")) for part in ("MAJOR", "MINOR", "PATCH"))
    assert lib.version == expected == nccl.version()
    assert lib.version >= nccl.MIN_VERSION


def test_an_explicit_path_is_the_only_one_tried(monkeypatch, tmp_path):
    real = nccl.library_candidates()[0][1]
    monkeypatch.setenv(nccl.ENV_LIBRARY, real)
    assert nccl.library_candidates() == [(f"${nccl.ENV_LIBRARY}", real)]
    assert nccl.load().source == f"${nccl.ENV_LIBRARY}"
    nccl.load.cache_clear()
    missing = tmp_path / "libnccl.so.2"
    monkeypatch.setenv(nccl.ENV_LIBRARY, str(missing))
    with pytest.raises(NcclUnavailable) as info:
        nccl.load()
    assert str(missing) in str(info.value) and nccl.ENV_LIBRARY in str(info.value)


def test_no_library_anywhere_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(nccl, "library_candidates", lambda: [("nowhere", "/nonexistent/libnccl.so.2")])
    with pytest.raises(NcclUnavailable, match=r"not found; tried /nonexistent/libnccl.so.2 \(nowhere\).*pip install"):
        nccl.load()


def test_a_library_older_than_needed_is_refused(monkeypatch):
    monkeypatch.setattr(nccl, "MIN_VERSION", (99, 0, 0))
    with pytest.raises(NcclUnavailable, match=r"is NCCL 2\.\d+\.\d+; ftcomm needs 99\.0\.0 or newer"):
        nccl.load()


def test_version_codes_decode_in_both_encodings():
    assert nccl.decode_version(2804) == (2, 8, 4)  # before 2.9: X*1000 + Y*100 + Z
    assert nccl.decode_version(21803) == (2, 18, 3)
    assert nccl.decode_version(int(define("NCCL_VERSION_CODE"))) == nccl.load().version


def test_a_cpu_only_torch_gets_a_clear_error_for_the_nccl_backend():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(NcclUnavailable, match="needs a CUDA device"):
        ftcomm.init(backend="nccl", handle_signals=False)


# ---------------------------------------------------------------------- calls that need no GPU
def test_unique_ids_are_fresh_128_byte_ids():
    lib = nccl.load()
    first, second = lib.unique_id(), lib.unique_id()
    assert len(first) == len(second) == nccl.UNIQUE_ID_BYTES == int(define("NCCL_UNIQUE_ID_BYTES"))
    assert first != second
    # it survives the trip into the struct passed to ncclCommInitRankConfig, NUL bytes included
    assert ctypes.string_at(ctypes.addressof(nccl.UniqueId.from_buffer_copy(first)), 128) == first


def test_every_result_code_is_named_and_explained_in_errors():
    lib = nccl.load()
    for code, name in nccl.RESULT_NAMES.items():
        text = lib.describe(code)
        assert text.startswith(f"{name} ({code}): ") and lib.error_string(code) in text
        if code in (nccl.SUCCESS, nccl.IN_PROGRESS):
            assert lib.check(code, "x") == code
        else:
            with pytest.raises(CommunicatorError, match=rf"^ncclAllReduce failed: {name} \({code}\)"):
                lib.check(code, "ncclAllReduce")
    assert "remote process exited" in lib.describe(6)


# ---------------------------------------------------------------------- layouts against nccl.h
def enum_values(typedef: str) -> dict[str, int]:
    body = re.search(r"typedef enum \{([^}]*)\}\s*" + typedef + ";", header(), re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    values = {}
    for name, value in re.findall(r"(\w+)\s*=\s*([^,]+)", body):
        value = value.strip()
        if re.fullmatch(r"-?\d+", value):
            values[name] = int(value)
    return values


def test_result_datatype_and_op_codes_match_the_header():
    results = enum_values("ncclResult_t")
    del results["ncclNumResults"]
    # every result the header defines is named; a name newer than the header (ncclTimeout
    # came after 2.28) keeps its code
    assert {code: name for name, code in results.items()} == {
        code: name for code, name in nccl.RESULT_NAMES.items() if name in results}
    types = enum_values("ncclDataType_t")
    names = {torch.int8: "ncclInt8", torch.uint8: "ncclUint8", torch.int32: "ncclInt32", torch.int64: "ncclInt64",
             torch.float16: "ncclFloat16", torch.float32: "ncclFloat32", torch.float64: "ncclFloat64",
             torch.bfloat16: "ncclBfloat16"}
    assert {dtype: types[names[dtype]] for dtype in names} == nccl.DATATYPES
    ops = enum_values("ncclRedOp_t")
    assert {op: ops["ncclAvg" if op == "avg" else "nccl" + op.capitalize()] for op in nccl.OPS} == nccl.OPS


C_TYPES = {"size_t": ctypes.c_size_t, "unsigned int": ctypes.c_uint, "int": ctypes.c_int,
           "const char *": ctypes.c_char_p}


def header_config_fields() -> list[tuple[str, str]]:
    body = re.search(r"typedef struct ncclConfig_v\d+ \{(.*?)\} ncclConfig_t;", header(), re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields = []
    for line in body.split(";"):
        line = " ".join(line.split())
        if line:
            ctype, name = re.fullmatch(r"(.*?[\s*])(\w+)", line).groups()  # "const char *netName"
            fields.append((name, ctype.strip()))
    return fields


def test_config_struct_is_a_prefix_of_the_installed_headers_with_the_same_offsets():
    fields = header_config_fields()
    ours = nccl.Config._fields_
    assert len(fields) >= len(ours)
    offset = 0
    for (name, ctype), (our_name, our_type) in zip(fields, ours):
        assert (name, C_TYPES[ctype]) == (our_name, our_type)
        size = ctypes.sizeof(C_TYPES[ctype])
        offset = (offset + size - 1) // size * size  # natural alignment on x86-64
        assert getattr(nccl.Config, name).offset == offset, name
        offset += size
    config = nccl.Config.non_blocking()
    assert config.size == ctypes.sizeof(nccl.Config)
    assert config.magic == api_magic() and config.blocking == 0
    assert config.version == nccl.CONFIG_VERSION <= int(define("NCCL_VERSION_CODE"))
    assert define("NCCL_CONFIG_UNDEF_INT") == "INT_MIN" and config.minCTAs == nccl.CONFIG_UNDEF_INT


# ---------------------------------------------------------------------- GPU (skipped without CUDA)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL runs on GPUs only)")


def form_single(view_id: int, abort: AbortSignal | None = None) -> nccl.NcclCommunicator:
    return nccl.NcclCommunicator.form(dist.HashStore(), 0, 1, view_id, abort or AbortSignal(), 30.0)


@gpu
def test_gpu_single_rank_init_allreduce_abort_and_reinit_cycle():
    for view_id in range(1, 4):
        started = time.perf_counter()
        comm = form_single(view_id)
        init_s = time.perf_counter() - started
        t = torch.arange(8, dtype=torch.float32, device="cuda")
        comm.allreduce([t], "sum").wait(AbortSignal(), 10.0)
        assert t.tolist() == list(map(float, range(8)))
        started = time.perf_counter()
        comm.abandon()
        assert time.perf_counter() - started < 0.5 and init_s < 30.0
        with pytest.raises(CommunicatorError, match="abandoned"):
            comm.allreduce([t], "sum")


@gpu
@pytest.mark.parametrize("dtype", sorted(nccl.DATATYPES, key=str))
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_gpu_every_dtype_and_op_matches_torch(dtype, op):
    comm = form_single(100)
    try:
        source = (torch.arange(16, device="cuda") % 7).to(dtype)
        t = source.clone()
        comm.allreduce([t], op).wait(AbortSignal(), 10.0)
        assert torch.equal(t, source)  # one rank: every reduction is the identity
        gathered = comm.allgather(source).wait(AbortSignal(), 10.0)
        assert len(gathered) == 1 and torch.equal(gathered[0], source)
        b = source.clone()
        comm.broadcast(b, 0).wait(AbortSignal(), 10.0)
        assert torch.equal(b, source)
    finally:
        comm.abandon()


@gpu
def test_gpu_a_wait_is_abandoned_when_the_abort_signal_fires():
    comm = form_single(200)
    abort = AbortSignal()
    t = torch.ones(1 << 20, device="cuda")
    torch.cuda._sleep(int(2e9))  # keep the stream busy so the collective cannot finish at once
    handle = comm.allreduce([t], "sum")
    abort.fire("test")
    started = time.perf_counter()
    with pytest.raises(CollectiveAborted):
        handle.wait(abort, 10.0)
    assert time.perf_counter() - started < 0.1
    comm.abandon()


# ---------------------------------------------------------------------- completion, with fakes
class FakeEvent:
    def __init__(self) -> None:
        self.fired = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.fired


class FakeLib:
    """async_error answers from a script; describe as the real library formats it."""

    def __init__(self, states: list[int]) -> None:
        self.states = states
        self.real = nccl.load()

    def async_error(self, comm) -> int:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def describe(self, result: int, comm=None) -> str:
        return self.real.describe(result)


def watched(completion, event: FakeEvent) -> Handle:
    """A handle finished the way NcclCommunicator finishes its own."""
    def finish():
        if completion.error is not None:
            raise CommunicatorError(completion.error)
        return "done"
    return Handle("fake collective", lambda: completion.finished(event.query), finish)


def test_a_handle_completes_when_its_event_fires():
    event = FakeEvent()
    handle = watched(nccl._completion(FakeLib([nccl.SUCCESS]), None), event)
    assert not handle.completed
    threading.Timer(0.05, setattr, args=(event, "fired", True)).start()
    assert handle.wait(AbortSignal(), 2.0) == "done"


def test_nothing_polls_a_collective_that_nobody_waits_for():
    events = [FakeEvent() for _ in range(3)]
    completion = nccl._completion(FakeLib([nccl.SUCCESS]), None)
    handles = [watched(completion, e) for e in events]
    time.sleep(0.05)
    assert [e.queries for e in events] == [0, 0, 0]  # no thread spins over launched collectives
    events[1].fired = True
    assert handles[1].wait(AbortSignal(), 2.0) == "done" and events[0].queries == events[2].queries == 0


def test_pending_handles_fail_on_an_asynchronous_nccl_error():
    handle = watched(nccl._completion(FakeLib([nccl.SUCCESS, nccl.SUCCESS, 6]), None), FakeEvent())
    with pytest.raises(CommunicatorError, match=r"ncclRemoteError \(6\): remote process exited"):
        handle.wait(AbortSignal(), 2.0)  # its event never fires: a peer died mid-collective


def test_an_abandoned_communicators_pending_handles_never_read_as_success():
    completion = nccl._completion(FakeLib([nccl.IN_PROGRESS]), None)
    handle = watched(completion, FakeEvent())
    completion.fail("the communicator was abandoned")
    with pytest.raises(CommunicatorError, match="abandoned"):
        handle.wait(AbortSignal(), 2.0)


@gpu
def test_gpu_collectives_run_on_their_own_stream_ordered_after_the_callers_work():
    comm = form_single(300)
    try:
        assert comm.stream.cuda_stream != torch.cuda.current_stream().cuda_stream
        t = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(int(2e8))  # the caller's stream is busy ...
        t.fill_(2.0)  # ... and writes the input only after that
        comm.allreduce([t], "sum").wait(AbortSignal(), 30.0)
        assert torch.all(t == 2.0)  # the collective saw the caller's write, and the caller sees its result
    finally:
        comm.abandon()


# ---------------------------------------------------------------------- GPU, several ranks on one device
@gpu
def test_gpu_two_ranks_every_dtype_and_op_equals_torch():
    results = run_ranks(2, nccl_ranks.reductions)
    assert sorted(results) == [0, 1], results
    for rank, outcome in results.items():
        assert "exception" not in outcome, outcome
        assert outcome["mismatches"] == [], outcome
        assert outcome["checked"] == 4 * len(nccl.DATATYPES)


@gpu
def test_gpu_a_process_exits_cleanly_right_after_abandoning_its_communicator():
    codes: list = []
    results = run_ranks(2, nccl_ranks.abandon_and_exit, exit_codes=codes)
    assert all(r == {"sum_ok": True} for r in results.values()) and len(results) == 2, results
    assert codes == [0, 0]  # exit waits for the background ncclCommAbort (DESIGN §2.8)


@gpu
def test_gpu_a_peer_that_exits_fails_the_next_collective_instead_of_hanging():
    outcome = run_ranks(2, nccl_ranks.peer_exits)[0]
    assert "exception" not in outcome, outcome
    assert outcome["error"] is not None and "ncclRemoteError" in outcome["error"], outcome
    assert outcome["abort_s"] is not None and outcome["healthy_after"], outcome


@gpu
def test_gpu_a_hung_peers_collective_is_abandoned_and_aborted():
    outcome = run_ranks(2, nccl_ranks.peer_hangs)[0]
    assert "exception" not in outcome, outcome
    assert outcome["aborted"], outcome
    assert outcome["abort_latency_s"] <= 0.1, outcome  # DESIGN §2.3
    assert outcome["abort_s"] is not None and outcome["healthy_after"], outcome


@gpu
@pytest.mark.timeout(240)
def test_gpu_group_of_three_on_nccl_survives_a_crash_with_equal_digests():
    cluster = TrainCluster()
    try:
        workers = []
        for i in range(3):  # one GPU: each worker is a host of its own to NCCL
            workers += cluster.start(1, ["--backend", "nccl", "--min-workers", "1"], wait=False,
                                     env={"NCCL_HOSTID": f"ftcomm-group-test-{i}", "NCCL_IB_DISABLE": "1"})
        for w in workers:
            w.wait_ready(120)
        view_id = max(v["view_id"] for v in cluster.wait_view(workers, 3, timeout=120))
        victim = workers[2]
        victim.signal(signal.SIGKILL)
        survivors = workers[:2]
        views = cluster.wait_view(survivors, 2, timeout=60, after=view_id)
        assert {v["reason"] for v in views} == {"crash"}
        done = cluster.finish(survivors, timeout=120)
        assert_invariants(survivors, done)
        for w in survivors:
            assert w.process.wait(timeout=60) == 0
    finally:
        cluster.close()


def test_polling_a_forming_communicator_judges_gossip_news_at_once():
    """The gossip thread only posts news and nudges; a thread that polls NCCL itself (init,
    a lazy connect at enqueue) must judge that news, not wait for its deadline."""
    class InProgress:
        def async_error(self, comm) -> int:
            return nccl.IN_PROGRESS

    inbox: list[str] = []
    abort = AbortSignal(lambda: inbox and abort.fire(inbox.pop()))
    threading.Timer(0.05, lambda: (inbox.append("a peer is dead"), abort.nudge())).start()
    with pytest.raises(CollectiveAborted, match="a peer is dead"):
        nccl._poll_ready(InProgress(), None, abort, time.monotonic() + 30.0, "initialising the communicator")
