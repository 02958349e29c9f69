"""Flash checkpoints: the registered state in host shared memory, persisted in the background.

A checkpoint of step ``S`` is two files, in shared memory and (optionally) in a
directory: ``step-S.data`` holds every tensor's raw bytes (64-byte aligned, no
pickling), ``step-S.meta`` a small record (msgpack): the tensors' offsets, dtypes and
shapes, the state's structure with tensors replaced by references (pickled; no tensor
data in it), and an XXH3-64 checksum per 64 MB piece of each tensor. The meta file is written last,
by write + rename, so a checkpoint without one is partial and invisible.

``save()`` pauses training only for the copy into a shared-memory buffer whose pages
are already allocated (buffers are reused, and a spare is allocated in the background
after each save). Checksums, the renames that publish the checkpoint, the copy to the
directory (write + fsync + rename) and pruning to the ``keep`` newest run in a
background thread. On each host only the member with the lowest rank writes; the
others read its copy.

``restore()`` after a whole-job restart: the members agree on the newest step every
one of them can load (its checksums verify, from shared memory when the host is the
same, else from the directory), load it and continue. A corrupted or partial
checkpoint is skipped with a warning. A copy is verified before any of it is loaded;
tensors then go straight into the registered objects' existing tensors where shape
and dtype match (no new memory), into new ones otherwise.
"""

from __future__ import annotations

import logging
import mmap
import os
import pathlib
import pickle
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack
import torch
import xxhash

from .errors import FtcommError
from .state import tensor_bytes

log = logging.getLogger(__name__)

FORMAT = 1
CHUNK = 64 << 20  # bytes per checksum piece
ALIGN = 64
MAX_CANDIDATES = 32  # newest steps each member offers when agreeing on one to restore
_NAME = re.compile(r"^step-(\d{12})\.meta$")
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # pages faulted in at mapping time


@dataclass
class _Ref:
    """Stands for tensor ``index`` in the pickled structure of a checkpoint."""

    index: int


@dataclass
class _Slot:
    """A shared-memory buffer owned by this process, mapped once and reused."""

    path: pathlib.Path
    size: int
    buffer: mmap.mmap
    busy: bool = False


def _map_leaves(tree: Any, fn: Any) -> Any:
    """``tree`` (nested dicts, lists, tuples) with every leaf replaced by ``fn(leaf)``."""
    if isinstance(tree, dict):
        return {k: _map_leaves(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_map_leaves(v, fn) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return fn(tree)


def _flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor appended to ``tensors`` and replaced by its reference."""
    def ref(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        tensors.append(leaf.detach())
        return _Ref(len(tensors) - 1)
    return _map_leaves(value, ref)


def _unflatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    return _map_leaves(value, lambda leaf: tensors[leaf.index] if isinstance(leaf, _Ref) else leaf)


def _leaves(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Every leaf of a nested dict/list/tuple structure with its path of keys and indices."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, path + (i,))
    else:
        yield path, tree


def _layout(tensors: list[torch.Tensor]) -> tuple[list[list], int]:
    entries, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append([offset, str(t.dtype).removeprefix("torch."), list(t.shape), nbytes])
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def _view(buffer: Any, offset: int, dtype: str, shape: list[int], nbytes: int) -> torch.Tensor:
    kind = getattr(torch, dtype)
    if nbytes == 0:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset).view(kind).view(shape)


def _checksums(buffer: Any, entries: list[list]) -> list[list[int]]:
    """XXH3-64 of each ``CHUNK`` piece of each tensor's bytes in ``buffer``."""
    view = memoryview(buffer)
    try:
        return [[xxhash.xxh3_64_intdigest(view[lo:lo + min(CHUNK, offset + nbytes - lo)])
                 for lo in range(offset, offset + nbytes, CHUNK)] for offset, _, _, nbytes in entries]
    finally:
        view.release()


def _write_atomic(path: pathlib.Path, data: Any, sync: bool) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        view = memoryview(data)
        for lo in range(0, len(view), CHUNK):
            f.write(view[lo:lo + CHUNK])
        view.release()
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(temporary, path)


def _meta_bytes(record: dict) -> bytes:
    body = msgpack.packb(record, use_bin_type=True)
    return b"FTCK" + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little") + body


def _read_meta(path: pathlib.Path) -> dict:
    raw = path.read_bytes()
    if raw[:4] != b"FTCK" or int.from_bytes(raw[4:12], "little") != xxhash.xxh3_64_intdigest(raw[12:]):
        raise ValueError(f"{path}: bad header or metadata checksum")
    record = msgpack.unpackb(raw[12:], raw=False)
    if record.get("format") != FORMAT:
        raise ValueError(f"{path}: format {record.get('format')} (this version reads {FORMAT})")
    return record


def _steps(directory: pathlib.Path | None) -> list[int]:
    if directory is None or not directory.is_dir():
        return []
    return sorted((int(m.group(1)) for m in map(_NAME.match, os.listdir(directory)) if m), reverse=True)


def _name(step: int, suffix: str) -> str:
    return f"step-{step:012d}.{suffix}"


class FlashCheckpointer:
    """Flash checkpoints of ``group``'s registered state.

    ``directory``: where checkpoints are persisted (a shared filesystem lets members on
    other hosts restore; None keeps them in shared memory only). ``name``: the job's
    name, which keys the shared-memory directory ``{shm_root}/ftcomm-{name}`` (default:
    the group's cluster name). ``keep``: newest checkpoints kept in each place (shared
    memory holds one more buffer for the save in progress). ``sync``: fsync persisted
    files before they are renamed into place.
    """

    def __init__(self, group: Any, directory: str | os.PathLike | None = None, *, keep: int = 2,
                 name: str | None = None, shm_root: str | os.PathLike = "/dev/shm", sync: bool = True) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.group, self.keep, self.sync = group, keep, sync
        self.directory = pathlib.Path(directory) if directory is not None else None
        self.shm = pathlib.Path(shm_root) / f"ftcomm-{name or group.gossip.cluster}"
        self.shm.mkdir(parents=True, exist_ok=True)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.last_pause_s: float | None = None
        self._slots: list[_Slot] = []
        self._slot_lock = threading.Condition()
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._background, name="ftcomm-checkpoint", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ save
    def is_writer(self) -> bool:
        """The member with the lowest rank on this host writes the host's copy."""
        group = self.group
        hosts = {m.id: m.host for m in group.gossip.members()}
        mine = hosts.get(group.id, group.gossip.address.rsplit(":", 1)[0])
        local = [m for m in group.view.members if hosts.get(m, mine if m == group.id else None) == mine]
        return not local or local[0] == group.id

    def save(self) -> float:
        """Checkpoint the registered state at the group's committed step; returns the pause in seconds.

        Call it between steps on every member (only one per host writes). Raises the
        error of an earlier background write, if one failed.
        """
        if self._error is not None:
            error, self._error = self._error, None
            raise FtcommError(f"an earlier checkpoint failed to write: {error}") from error
        if not self.is_writer():
            return 0.0
        started = time.perf_counter()
        step = self.group.step
        tensors: list[torch.Tensor] = []
        skeleton = _flatten(self.group.state.snapshot(step), tensors)
        entries, size = _layout(tensors)
        slot = self._take_slot(size)
        for t, (offset, dtype, shape, nbytes) in zip(tensors, entries):
            if nbytes:
                _view(slot.buffer, offset, dtype, shape, nbytes).copy_(t)
        self.last_pause_s = time.perf_counter() - started
        record = {"format": FORMAT, "step": step, "time": time.time(), "size": size, "chunk": CHUNK,
                  "tensors": entries, "structure": pickle.dumps(skeleton)}
        self._jobs.put((slot, record))
        return self.last_pause_s

    def wait(self) -> None:
        """Block until every checkpoint saved so far is published and persisted."""
        self._jobs.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise FtcommError(f"a checkpoint failed to write: {error}") from error

    def close(self) -> None:
        self.wait()
        self._jobs.put(None)
        self._worker.join(timeout=30)

    def _take_slot(self, size: int) -> _Slot:
        """A spare buffer of ``size`` bytes (one that holds no published checkpoint)."""
        with self._slot_lock:
            while True:
                for s in [s for s in self._slots if not s.busy and not s.path.exists()]:
                    self._retire(s)  # another writer pruned the checkpoint it held
                spare = [s for s in self._slots if not s.busy and s.path.name.startswith(".slot-")]
                fits = [s for s in spare if s.size == size]
                if fits:
                    slot = fits[0]
                    break
                for s in spare:  # the state changed size: drop buffers that no longer fit
                    self._retire(s)
                if len(self._slots) <= self.keep:
                    slot = self._new_slot(size)
                    break
                self._slot_lock.wait()  # the previous save is still being published: wait for it
            slot.busy = True
            return slot

    def _new_slot(self, size: int) -> _Slot:
        path = self._spare_path()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            os.posix_fallocate(fd, 0, max(size, 1))
            buffer = mmap.mmap(fd, max(size, 1), flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        slot = _Slot(path, size, buffer)
        self._slots.append(slot)
        return slot

    def _spare_path(self) -> pathlib.Path:
        """A new name for a buffer that holds no published checkpoint."""
        return self.shm / f".slot-{os.getpid()}-{time.monotonic_ns()}.data"

    def _retire(self, slot: _Slot) -> None:
        self._slots.remove(slot)
        try:
            slot.path.unlink(missing_ok=True)
            slot.buffer.close()
        except (OSError, BufferError):
            pass  # a tensor still views it; the mapping goes with the last reference

    # ------------------------------------------------------------------ background
    def _background(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            slot, record = job
            try:
                self._publish(slot, record)
                self._prepare_spare(record["size"])
            except BaseException as exc:  # noqa: BLE001 - reported by the next save() or wait()
                log.error("checkpoint of step %d failed: %s", record["step"], exc)
                self._error = exc
            finally:
                with self._slot_lock:
                    slot.busy = False
                    self._slot_lock.notify_all()
                self._jobs.task_done()

    def _publish(self, slot: _Slot, record: dict) -> None:
        step, size = record["step"], record["size"]
        record["checksums"] = _checksums(slot.buffer, record["tensors"])
        meta = _meta_bytes(record)
        data_path = self.shm / _name(step, "data")
        (self.shm / _name(step, "meta")).unlink(missing_ok=True)
        os.replace(slot.path, data_path)
        slot.path = data_path
        _write_atomic(self.shm / _name(step, "meta"), meta, sync=False)
        if self.directory is not None:
            _write_atomic(self.directory / _name(step, "data"), memoryview(slot.buffer)[:size], self.sync)
            _write_atomic(self.directory / _name(step, "meta"), meta, self.sync)
        self._prune(step)

    def _prune(self, newest: int) -> None:
        """Keep the ``keep`` newest checkpoints; this process's own buffers are kept for reuse."""
        own = {s.path.name: s for s in self._slots}
        for place in (self.shm, self.directory):
            for step in _steps(place)[self.keep:]:
                (place / _name(step, "meta")).unlink(missing_ok=True)  # invisible first
                data = place / _name(step, "data")
                slot = own.get(data.name) if place == self.shm else None
                if slot is not None:
                    spare = self._spare_path()
                    os.replace(data, spare)
                    slot.path = spare
                else:
                    data.unlink(missing_ok=True)

    def _prepare_spare(self, size: int) -> None:
        """Allocate the next save's buffer now, so that save() only copies."""
        with self._slot_lock:
            spare = [s for s in self._slots if not s.busy and s.size == size and s.path.name.startswith(".slot-")]
            if not spare and len(self._slots) <= self.keep:
                self._new_slot(size)

    # ------------------------------------------------------------------ restore
    def available(self) -> list[int]:
        """Steps with a checkpoint record here (shared memory or directory), newest first."""
        return sorted(set(_steps(self.shm)) | set(_steps(self.directory)), reverse=True)

    def restore(self) -> int | None:
        """Agree with the other members on the newest step all of them can load, and load it.

        Call it on every member after ``init`` and ``register_state`` (a collective).
        Returns the restored step, or None when no member has a loadable checkpoint.
        When no step is loadable everywhere, the members that can load the newest
        loadable step do, and the group's reconciliation gives it to the others.
        """
        rejected: set[int] = set()
        while True:
            mine = [s for s in self.available() if s not in rejected][:MAX_CANDIDATES]
            offers = self.group.execute(self._gather, mine)
            common = set.intersection(*(set(o) for o in offers)) if offers else set()
            everywhere = bool(common)
            pool = common or set().union(*(set(o) for o in offers))
            if not pool:
                return None
            step = max(pool)
            loaded = self._load_verified(step) if step in mine else None
            if loaded is None:
                rejected.add(step)
            # the copies' fingerprint: equal checksums everywhere mean equal state everywhere
            fingerprint = xxhash.xxh3_64_intdigest(msgpack.packb(loaded[0]["checksums"])) >> 2 if loaded else 0
            outcome = self.group.execute(self._gather, [1 if loaded is not None else 0, fingerprint])
            ok = [o[0] for o in outcome]
            if (everywhere and not all(ok)) or not any(ok):
                continue  # someone could not load it after all: agree again without that copy
            if loaded is not None:
                self._apply(*loaded)
            self.group.state_restored(step if loaded is not None else None,
                                      same_everywhere=all(ok) and len({o[1] for o in outcome}) == 1)
            log.info("restored step %d%s", step, "" if everywhere else " (on some members; reconciled to the rest)")
            return step

    def _gather(self, values: list[int]) -> list[list[int]]:
        row = torch.full((MAX_CANDIDATES,), -1, dtype=torch.int64)
        row[:len(values)] = torch.tensor(values, dtype=torch.int64)
        return [[int(v) for v in t.tolist() if v >= 0] for t in self.group.allgather(row)]

    def _load_verified(self, step: int) -> tuple[dict, Any] | None:
        """The step's record and a verified mapping of its data, from the first copy that verifies."""
        for place in (self.shm, self.directory):
            if place is None or not (place / _name(step, "meta")).exists():
                continue
            try:
                record = _read_meta(place / _name(step, "meta"))
                size = record["size"]
                with open(place / _name(step, "data"), "rb") as f:
                    if os.fstat(f.fileno()).st_size < size:
                        raise ValueError("data file is shorter than its record (partial write)")
                    buffer = mmap.mmap(f.fileno(), max(size, 1), flags=_MAP_FLAGS, prot=mmap.PROT_READ)
                if _checksums(buffer, record["tensors"]) != record["checksums"]:
                    buffer.close()
                    raise ValueError("data checksum mismatch")
                return record, buffer
            except (OSError, ValueError, KeyError) as exc:
                log.warning("skipping checkpoint of step %d in %s: %s", step, place, exc)
        return None

    def _apply(self, record: dict, buffer: Any) -> None:
        """Copy a verified checkpoint into the registered state (in place where possible)."""
        structure = pickle.loads(record["structure"])
        live = {path: t.detach() for path, t in _leaves(self.group.state.snapshot(self.group.step))
                if isinstance(t, torch.Tensor)}
        targets = {ref.index: live[path] for path, ref in _leaves(structure) if isinstance(ref, _Ref) and path in live}
        source = memoryview(buffer)
        try:
            tensors, in_place = [], True
            for index, (offset, dtype, shape, nbytes) in enumerate(record["tensors"]):
                target = targets.get(index)
                if target is None or str(target.dtype).removeprefix("torch.") != dtype or \
                        list(target.shape) != list(shape) or target.device.type != "cpu" or \
                        not target.is_contiguous():
                    target = torch.empty(shape, dtype=getattr(torch, dtype))
                    in_place = False
                if nbytes:
                    tensor_bytes(target)[:] = source[offset:offset + nbytes]
                tensors.append(target)
        finally:
            source.release()
            buffer.close()
        snapshot = _unflatten(structure, tensors)
        state = self.group.state
        for name, obj in state.objects.items():
            module_state = snapshot["objects"][name]
            if in_place and isinstance(obj, torch.nn.Module) and all(
                    isinstance(v, torch.Tensor) for v in module_state.values()):
                continue  # every tensor of its state dict was read into the module's own tensors
            obj.load_state_dict(module_state)
        state.values.update(snapshot["values"])
