"""Checkpoint files: the record format and its validation, private directories, atomic writes.

A checkpoint of step ``S`` is ``step-S.data`` (every tensor's raw bytes, 64-byte
aligned) and ``step-S.meta``: ``b"FTCK"``, an XXH3-64 of the body, and a msgpack record
of plain values (in a group with a secret: ``b"FTCS"`` and a keyed BLAKE2b-256 of the
body, and keyed BLAKE2b data checksums; the key is bound to the job and shard) (format, step, time, sizes, the tensor table, a checksum per
``CHUNK`` piece of each tensor, and the state's structure as a :mod:`ftcomm.training.plain`
skeleton). Nothing is pickled; :func:`check_record` checks every field of a record read
back, so a malformed or planted file is refused, never run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import logging
import mmap
import os
import pathlib
import re
import secrets
import stat
import time
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack
import xxhash

from ..errors import FtcommError, StateError
from ..localproc import process_start
from . import plain

log = logging.getLogger(__name__)

FORMAT = 2  # 2: the structure is a plain msgpack skeleton (format 1 pickled it and is not read)
CHUNK = 64 << 20  # bytes per checksum piece
MAX_META_BYTES = plain.MAX_SKELETON_BYTES + (64 << 20)  # the skeleton plus tensor table and checksums
MAX_SIZE = 1 << 56  # bytes of tensor data a record may claim
SETTLE_S = 10.0  # an unheld private file younger than this may be being created: left alone
META_NAME = re.compile(r"^step-(\d{12})\.meta$")
DATA_NAME = re.compile(r"^step-(\d{12})\.data$")
PRIVATE_NAME = re.compile(r"^\.(slot-.+\.data|.+\.tmp)$")  # unpublished files: spare buffers, temporaries
RECORD_FIELDS = {"format": int, "step": int, "time": float, "size": int, "chunk": int, "tensors": list,
           "checksums": list, "structure": bytes}
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # pages faulted in at mapping time


@dataclass(frozen=True)
class TensorIndex:
    """Stands for tensor ``index`` of a checkpoint in its decoded structure."""

    index: int


@dataclass
class Meta:
    """A checkpoint record read back and validated."""

    step: int
    size: int
    tensors: list[list]  # [offset, dtype, shape, nbytes] each, inside ``size``
    checksums: list[list[int]]
    structure: bytes  # the plain skeleton
    tree: dict  # the skeleton decoded with a TensorIndex in place of each tensor


def shard_suffix(shard_rank: int) -> str:
    """Where a sharded replica's shard ``shard_rank`` keeps its checkpoints (a name beside
    the job's in shared memory, a subdirectory of the persistent directory)."""
    return f"shard{shard_rank}"


def _kind(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (list, tuple)):
        return "sequence"
    if isinstance(value, TensorIndex) or type(value).__name__ in ("Tensor", "Parameter"):
        return "tensor"
    return type(value).__name__


def check_like(live: Any, saved: Any, path: str) -> None:
    """StateError unless ``saved`` (a checkpoint's structure, tensors as TensorIndex) has the
    shape of ``live`` (the state dict it would be loaded over): the same kinds of values
    (numbers where numbers are, a string nowhere a number is), the same keys and lengths.
    An empty live dict (an optimizer that has not stepped yet) takes any entries, and None
    on either side stands for an optional value. A tensor and a number may stand for each
    other (an optimizer's step count is either)."""
    kinds = {_kind(live), _kind(saved)}
    if "none" in kinds or kinds <= {"tensor", "number"}:
        return
    if len(kinds) > 1:
        raise StateError(f"{path} is a {_kind(saved)} where the registered state holds a {_kind(live)}")
    if isinstance(live, dict):
        if not live:
            return
        if set(live) != set(saved):
            raise StateError(f"{path} has the keys {sorted(map(str, saved))[:8]} where the registered state has "
                             f"{sorted(map(str, live))[:8]}")
        for key in live:
            check_like(live[key], saved[key], f"{path}.{key}")
    elif isinstance(live, (list, tuple)):
        if len(live) != len(saved):
            raise StateError(f"{path} holds {len(saved)} entries where the registered state holds {len(live)}")
        for i, (a, b) in enumerate(zip(live, saved)):
            check_like(a, b, f"{path}[{i}]")


def leaves(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Every leaf of a nested dict/list/tuple structure with its path of keys and indices."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, path + (i,))
    else:
        yield path, tree


def checkpoint_key(secret: bytes | None, job: str, shard: int | None = None) -> bytes | None:
    """The key that signs the checkpoints of ``job`` (a FlashCheckpointer's name) and, with
    sharded replicas, of shard index ``shard``, derived from the group's secret (None:
    unsigned). A checkpoint of another job or another shard, signed with the same secret,
    does not verify."""
    if secret is None:
        return None
    context = f"{job}\0{'' if shard is None else shard}".encode()
    return hashlib.blake2b(context, digest_size=32, key=hashlib.blake2b(secret, digest_size=32).digest(),
                           person=b"ftcomm-ckpt").digest()


def _chunk_sum(piece: Any, key: bytes | None) -> int:
    if key is None:
        return xxhash.xxh3_64_intdigest(piece)
    return int.from_bytes(hashlib.blake2b(piece, digest_size=8, key=key, person=b"ftcomm-ckpt-data").digest(),
                          "little")


def checksums_of(buffer: Any, entries: list[list], key: bytes | None = None) -> list[list[int]]:
    """A 64-bit checksum of each ``CHUNK`` piece of each tensor's bytes in ``buffer``: XXH3,
    or, when the checkpoint is signed, a keyed BLAKE2b (a MAC: without the key nobody can
    compute the sum an altered piece would need)."""
    with memoryview(buffer) as view:
        return [[_chunk_sum(view[lo:lo + min(CHUNK, offset + nbytes - lo)], key)
                 for lo in range(offset, offset + nbytes, CHUNK)] for offset, _, _, nbytes in entries]


# ---------------------------------------------------------------------- files
def private_directory(path: pathlib.Path) -> pathlib.Path:
    """``path``, created with mode 0700 if missing (its parents as usual).

    Raises FtcommError when it is a symlink, not a directory, owned by another user or
    writable by group or others: whoever can write there could plant or swap checkpoints.
    """
    advice = "remove it if it is yours, or pick another job name (name=...) or shm_root"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        info = os.lstat(path)
    except OSError as exc:
        raise FtcommError(f"cannot create the shared-memory directory {path}: {exc}; {advice}") from exc
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    elif info.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    else:
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.chmod(path, 0o700)  # ours and not writable by others: make it private too
        return path
    raise FtcommError(f"refusing the shared-memory directory {path}: it {problem}, so another user could "
                      f"read or plant checkpoints there; {advice}")


def hold_shared(fd: int) -> None:
    """Take a shared flock on ``fd``: its file is in use by this process (see remove_abandoned)."""
    with contextlib.suppress(OSError):  # a filesystem without flock: the file is merely never cleaned up
        fcntl.flock(fd, fcntl.LOCK_SH)


def remove_abandoned(directory: pathlib.Path) -> None:
    """Delete the unpublished files in ``directory`` that no live process holds.

    A file that can be locked exclusively and is older than ``SETTLE_S`` (so not being
    created this instant) was left by a process that ended. Failures are ignored.
    """
    for entry in os.scandir(directory):
        if not PRIVATE_NAME.match(entry.name):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode) and time.time() - info.st_mtime > SETTLE_S:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError: a live process holds it
                os.unlink(entry.path)
                log.info("removed %s, left behind by a process that ended", entry.path)
        except OSError:
            pass
        finally:
            os.close(fd)


# ---------------------------------------------------------------------- shared-memory hygiene
LOCK_NAME = ".lock"  # every open checkpointer of the directory holds it shared
OWNER_NAME = re.compile(r"^\.launcher-(\d+)-(\d+)$")  # a launcher (pid, start time) whose job it is
PERSISTED_NAME = ".persisted-to"  # the persistent directory the checkpoints are copied to


def bookkeeping(name: str) -> bool:
    """Whether ``name`` in a shared-memory checkpoint directory is one of these marks
    rather than a checkpoint or a buffer."""
    return name in (LOCK_NAME, PERSISTED_NAME) or OWNER_NAME.match(name) is not None


def launcher_mark() -> str | None:
    """The owner file name of the launcher that started this process (``$FTCOMM_LAUNCHER``)."""
    value = os.environ.get("FTCOMM_LAUNCHER", "")
    pid, _, start = value.partition(":")
    return f".launcher-{pid}-{start}" if pid.isdigit() and start.isdigit() else None


def occupy(directory: pathlib.Path, persisted_to: pathlib.Path | None) -> int:
    """Mark ``directory`` as used by this process until the returned descriptor is closed:
    a shared lock on its lock file; the owner file of the launcher that started this
    process, if any; and where its checkpoints are persisted (``persisted_to``), if anywhere."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    mark = launcher_mark()
    with contextlib.suppress(OSError):
        if mark is not None:
            os.close(os.open(directory / mark, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        if persisted_to is not None:
            write_atomic(directory / PERSISTED_NAME, str(persisted_to.resolve()).encode(), sync=False)
    return fd


def open_private(directory: pathlib.Path, parent: int | None = None) -> int:
    """A descriptor of ``directory`` itself (its name in the directory ``parent`` is open
    on, if given), opened without following a link in its last component, that is a
    directory this user owns and no other user can enter or write. Removing through it
    (``dir_fd``) touches nothing elsewhere, whatever is renamed or linked meanwhile.
    OSError (PermissionError when another user could plant in it)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(directory, flags) if parent is None else os.open(directory.name, flags, dir_fd=parent)
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(errno.EPERM, "not private to this user (owner or mode)", str(directory))
    return fd


def unused(directory: pathlib.Path) -> int | None:
    """An exclusive lock on ``directory``'s lock file when no process holds it (None when
    one does, or it cannot be opened, or is not private to this user): the caller removes
    the directory, then closes it."""
    try:
        where = open_private(directory)
    except OSError:
        return None
    try:
        fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=where)
    except OSError:
        return None
    finally:
        os.close(where)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def size_of(directory: pathlib.Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def remove_directory(directory: pathlib.Path) -> None:
    """Remove a checkpoint directory: records first (no reader takes a half-removed
    checkpoint), then every other file, then the directory. Files that vanish meanwhile
    are fine; other errors are raised (OSError). Only a directory private to this user is
    emptied, through its descriptor: a link planted in its place, or swapped in meanwhile,
    makes nothing elsewhere go."""
    parent = os.open(directory.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_private(directory, parent)
        try:
            names = sorted(os.listdir(fd), key=lambda n: (not META_NAME.match(n), n == LOCK_NAME))
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(directory.name, dir_fd=parent)
    finally:
        os.close(parent)


def discard_if_unused(directory: pathlib.Path) -> bool:
    """Remove ``directory`` (a job's shared-memory checkpoints) unless a live checkpointer
    still uses it; whether it was removed."""
    held = unused(directory)
    if held is None:
        return False
    try:
        remove_directory(directory)
        return True
    except OSError as exc:
        log.warning("could not remove %s: %s", directory, exc)
        return False
    finally:
        os.close(held)


def persisted(directory: pathlib.Path) -> bool:
    """Whether the newest checkpoint in ``directory`` (shared memory) is also in the
    persistent directory its checkpointers recorded."""
    try:
        target = pathlib.Path((directory / PERSISTED_NAME).read_text()[:4096])
    except (OSError, UnicodeDecodeError):
        return False
    newest = steps_in(directory)
    return not newest or (target / file_name(newest[0], "meta")).exists()


def reclaim_dead(root: pathlib.Path, keep: pathlib.Path) -> tuple[list[tuple[pathlib.Path, int]],
                                                                    list[tuple[pathlib.Path, int]]]:
    """Remove the shared-memory checkpoint directories under ``root`` (``ftcomm-*`` other
    than ``keep``, private to this user) of jobs that provably ended and whose copies
    exist elsewhere: no live checkpointer uses the directory, every ``ftcomm run`` launcher
    that owned it has stopped (while one runs it may restart the job's workers), and its
    newest checkpoint is in the persistent directory it was copied to. Returns the
    directories removed and those left (unused, but holding the only copy of their newest
    checkpoint, or owned by a live launcher), each with its size in bytes."""
    removed: list[tuple[pathlib.Path, int]] = []
    left: list[tuple[pathlib.Path, int]] = []
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith("ftcomm-") and root / e.name != keep]
    except OSError:
        return removed, left
    for entry in entries:
        directory = pathlib.Path(entry.path)
        try:
            info = os.lstat(directory)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                continue
            owners = [m for m in map(OWNER_NAME.match, os.listdir(directory)) if m]
        except OSError:
            continue
        held = unused(directory)
        if held is None:
            continue  # a live process uses it
        try:
            size = size_of(directory)
            launcher_runs = any(process_start(int(m.group(1))) == int(m.group(2)) for m in owners)
            if launcher_runs or not persisted(directory):
                left.append((directory, size))
                continue
            try:
                remove_directory(directory)
            except OSError as exc:
                log.warning("could not remove %s: %s", directory, exc)
                continue
            log.info("reclaimed %s (%.0f MB): no process uses it and its newest checkpoint is persisted",
                     directory, size / 2**20)
            removed.append((directory, size))
        finally:
            os.close(held)
    return removed, left


def write_atomic(path: pathlib.Path, data: Any, sync: bool) -> None:
    """Write ``data`` to ``path`` through a private (0600) temporary file: write, fsync if
    ``sync``, rename. Raises OSError on failure, with the temporary file removed and
    ``path`` untouched."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        hold_shared(fd)
        with memoryview(data) as view:
            for lo in range(0, len(view), CHUNK):
                piece = view[lo:lo + CHUNK]
                while piece:
                    piece = piece[os.write(fd, piece):]
        if sync:
            os.fsync(fd)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def open_regular(path: pathlib.Path) -> int:
    """A read-only descriptor of ``path``; StateError if it is not a regular file (opening
    never blocks, even on a FIFO)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StateError(f"{path.name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def meta_bytes(record: dict, key: bytes | None = None) -> bytes:
    """The meta file: ``FTCK`` and an XXH3-64 of the record, or, signed with ``key``,
    ``FTCS`` and a keyed BLAKE2b-256 of it."""
    body = msgpack.packb(record, use_bin_type=True)
    if key is None:
        return b"FTCK" + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") + body
    return b"FTCS" + _tag(key, body) + body


def _tag(key: bytes, body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=32, key=key, person=b"ftcomm-ckpt-meta").digest()


def read_meta(path: pathlib.Path, step: int, key: bytes | None = None) -> Meta:
    """The validated record in ``path``, the checkpoint of ``step`` (signed with ``key``
    when given, unsigned otherwise).

    Raises OSError when it cannot be read, ValueError when it is another version's
    format, StateError when it is malformed, corrupt, or not signed as expected. Nothing
    in it is executed.
    """
    return decode_meta(read_raw_meta(path), step, key)


def read_raw_meta(path: pathlib.Path) -> bytes:
    with open(open_regular(path), "rb") as f:
        return f.read(MAX_META_BYTES + 1)


def decode_meta(raw: bytes, step: int, key: bytes | None = None) -> Meta:
    """The validated record in the bytes of a meta file; errors as :func:`read_meta`."""
    if len(raw) > MAX_META_BYTES:
        raise StateError(f"record larger than {MAX_META_BYTES} bytes")
    if key is None and raw[:4] == b"FTCS":
        raise StateError("it is signed with a group's secret and this group has none")
    if key is not None and raw[:4] == b"FTCK":
        raise StateError("it is not signed, and this group has a secret (written by a group without one)")
    if key is None:
        if len(raw) < 12 or raw[:4] != b"FTCK" or \
                int.from_bytes(raw[4:12], "little") != xxhash.xxh3_64_intdigest(raw[12:]):
            raise StateError("bad header or record checksum")
        body = raw[12:]
    else:
        if len(raw) < 36 or raw[:4] != b"FTCS":
            raise StateError("bad header")
        body = raw[36:]
        if not hmac.compare_digest(raw[4:36], _tag(key, body)):
            raise StateError("its signature does not verify: written with another secret (or for another job or "
                             "shard), or altered")
    try:
        record = msgpack.unpackb(body, raw=False)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise StateError(f"malformed record ({type(exc).__name__})") from None
    return check_record(record, step)


def check_record(record: Any, step: int) -> Meta:
    """``record`` as a Meta if every field has its type and range; StateError otherwise
    (ValueError for another format)."""
    if type(record) is not dict:
        raise StateError("record is not a map")
    if record.get("format") != FORMAT:
        raise ValueError(f"format {record.get('format')!r:.20} (this version reads {FORMAT}); "
                         f"restore it with the ftcomm version that wrote it")
    for key, kind in RECORD_FIELDS.items():
        if type(record.get(key)) is not kind:
            raise StateError(f"field {key!r} is missing or not of type {kind.__name__}")
    size = record["size"]
    if record["step"] != step or record["chunk"] != CHUNK or not 0 <= size <= MAX_SIZE:
        raise StateError(f"step {record['step']}, chunk {record['chunk']} or size {size} is out of range")
    entries = plain.check_layout(record["tensors"], size)
    checksums = record["checksums"]
    if len(checksums) != len(entries) or any(
            type(sums) is not list or len(sums) != -(-entry[3] // CHUNK) or
            any(type(x) is not int or not 0 <= x < 1 << 64 for x in sums) for sums, entry in zip(checksums, entries)):
        raise StateError("the checksum table does not match the tensor table")
    tree = plain.join(record["structure"], [TensorIndex(i) for i in range(len(entries))])  # type: ignore[misc]
    if type(tree) is not dict or tree.get("step") != step or type(tree.get("values")) is not dict or \
            type(tree.get("objects")) is not dict or any(type(v) is not dict for v in tree["objects"].values()):
        raise StateError("the structure is not a snapshot of registered state")
    return Meta(step, size, entries, checksums, record["structure"], tree)


def map_data(path: pathlib.Path, size: int) -> mmap.mmap:
    """A read-only mapping of the first ``size`` bytes of ``path``; StateError if it is shorter."""
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size < size:
            raise StateError("data file is shorter than its record (partial write)")
        return mmap.mmap(fd, size, flags=MAP_FLAGS, prot=mmap.PROT_READ) if size else mmap.mmap(-1, 1)
    finally:
        os.close(fd)


def steps_in(directory: pathlib.Path | None, pattern: re.Pattern = META_NAME) -> list[int]:
    """Steps with a record (or, with ``DATA_NAME``, a data file) in ``directory``, newest first."""
    try:
        names = os.listdir(directory) if directory is not None else []
    except OSError:
        return []
    return sorted((int(m.group(1)) for m in map(pattern.match, names) if m), reverse=True)


def file_name(step: int, suffix: str) -> str:
    return f"step-{step:012d}.{suffix}"


def persist_newest(shm: pathlib.Path, directory: pathlib.Path, sync: bool = True,
                   key: bytes | None = None) -> int | None:
    """Copy the newest checkpoint in ``shm`` whose record validates and whose copied data
    verifies to ``directory``, unless it is there already. For a launcher whose worker
    died: what shared memory holds is persisted before anything else can lose it. The
    data is written first and verified where it was written (a live writer may reuse the
    shared-memory buffer meanwhile), then the record. Returns the step copied, or None.

    ``key``: the group's checkpoint key (:func:`checkpoint_key`) when its checkpoints are
    signed. ``shm`` must be private to this user (see :func:`private_directory`); raises
    FtcommError when it is not, OSError when ``directory`` cannot be written.
    """
    if not shm.exists():
        return None
    private_directory(shm)
    for step in steps_in(shm):
        if (directory / file_name(step, "meta")).exists():
            return None  # the newest good one is persisted already
        data = directory / file_name(step, "data")
        try:
            raw = read_raw_meta(shm / file_name(step, "meta"))
            meta = decode_meta(raw, step, key)
            source = map_data(shm / file_name(step, "data"), meta.size)
        except (OSError, ValueError, StateError) as exc:
            log.warning("not persisting the checkpoint of step %d in %s: %s", step, shm, exc)
            continue
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            with memoryview(source) as view:
                write_atomic(data, view[:meta.size], sync)
        finally:
            source.close()
        copy = map_data(data, meta.size)
        try:
            intact = checksums_of(copy, meta.tensors, key) == meta.checksums
        finally:
            copy.close()
        if not intact:
            data.unlink(missing_ok=True)
            log.warning("not persisting the checkpoint of step %d in %s: data checksum mismatch", step, shm)
            continue
        write_atomic(directory / file_name(step, "meta"), raw, sync)
        return step
    return None
