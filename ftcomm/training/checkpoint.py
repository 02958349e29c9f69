"""Flash checkpoints: the registered state in host shared memory, persisted in the background.

A checkpoint of step ``S`` is two files, in shared memory and (optionally) in a
directory: ``step-S.data`` holds every tensor's raw bytes (64-byte aligned),
``step-S.meta`` a small msgpack record: the tensors' offsets, dtypes and shapes, the
state's structure as a :mod:`ftcomm.training.plain` skeleton (plain values with tensors replaced
by indices; nothing is pickled, so no checkpoint file can run code), and an XXH3-64
checksum per 64 MB piece of each tensor. The meta file is written last, by write +
rename, so a checkpoint without one is partial and invisible.

``save()`` pauses training only for the copy into a shared-memory buffer whose pages
are already allocated (buffers are reused, and a spare is allocated in the background
after each save). Checksums, the renames that publish the checkpoint, the copy to the
directory (write + fsync + rename) and pruning to the ``keep`` newest run in a
background thread. On each host only the member with the lowest rank writes; the
others read its copy. Every wait is bounded by ``write_timeout``.

``restore()`` after a whole-job restart: the members agree on the newest step some
member can load (its checksums verify, from shared memory when the host is the same, else
from the directory; with sharded replicas, some process of every shard index), those
that can load it do, and the group's reconciliation gives it to the others: a step one
member's copy holds is never given up for an older one every member holds. Every field of a record is
type- and range-checked; a malformed, corrupted or partial checkpoint is skipped with
a warning. A copy is verified before any of it is loaded; tensors then go straight
into the registered objects' existing tensors where shape and dtype match (no new
memory), into new ones otherwise.

Local files: the shared-memory directory is created with mode 0700 and refused when it
is a symlink, another user's, or writable by others; every file written is 0600. A
process holds a shared ``flock`` on each unpublished file it owns (spare buffers,
temporary files): ``close()`` deletes its own, and a new checkpointer deletes those no
live process holds.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import pathlib
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import torch
import xxhash

from ..errors import FtcommError, FtcommTimeout, OtherModel, StateError
from . import checkpoint_files as files
from . import plain, sharded
from .state import tensor_bytes

log = logging.getLogger(__name__)

MAX_CANDIDATES = 32  # newest steps each member offers when agreeing on one to restore


LEAVING_WAIT_S = 60.0
"""The longest a member that lost the quorum waits for its state's shared-memory copy
before the QuorumLost reaches the script (see FlashCheckpointer.keep_before_leaving)."""


LEFT_SUFFIX = ".left"
"""Appended to the cluster's name for the job under which a member that lost the quorum
keeps its state when no FlashCheckpointer of its own does (see :func:`left_places`)."""


def left_places(cluster: str, shards: int = 1, shm_root: str | os.PathLike = "/dev/shm") -> list[pathlib.Path]:
    """The shared-memory directories where the members of ``cluster`` that lost the quorum
    without a FlashCheckpointer keep their state (one per shard index with sharded
    replicas): ``FaultTolerantGroup`` writes there on ``QuorumLost`` and loads from there
    when the whole job starts again; ``ftcomm run --fresh`` removes them."""
    job = cluster + LEFT_SUFFIX
    if shards == 1:
        return [pathlib.Path(shm_root, f"ftcomm-{job}")]
    return [pathlib.Path(shm_root, f"ftcomm-{job}-{files.shard_suffix(i)}") for i in range(shards)]


def left_step(cluster: str, shards: int = 1, shm_root: str | os.PathLike = "/dev/shm") -> int | None:
    """The newest step kept by a member that lost the quorum (:func:`left_places`) held
    here for every shard index; None when there is none. Only names the files: nothing is
    read or verified."""
    common: set[int] | None = None
    for place in left_places(cluster, shards, shm_root):
        steps = set(files.steps_in(place))
        common = steps if common is None else common & steps
    return max(common) if common else None


@dataclass
class _Slot:
    """A shared-memory buffer owned by this process, mapped once and reused. ``fd`` stays
    open with a shared flock on the file: the mark that a live process holds it."""

    path: pathlib.Path
    size: int
    buffer: mmap.mmap
    fd: int
    busy: bool = False


class FlashCheckpointer:
    """Flash checkpoints of ``group``'s registered state.

    ``directory``: where checkpoints are persisted (a shared filesystem lets members on
    other hosts restore; None keeps them in shared memory only). ``name``: the job's
    name, which keys the shared-memory directory ``{shm_root}/ftcomm-{name}`` (default:
    the group's cluster name). ``keep``: newest checkpoints kept in each place (shared
    memory holds one more buffer for the save in progress). ``sync``: fsync persisted
    files before they are renamed into place. ``write_timeout``: the longest
    ``save()``, ``wait()`` and ``close()`` wait for the background writes to make
    progress (one checkpoint written) before raising FtcommTimeout.

    Raises FtcommError when the shared-memory directory is not private to this user.
    """

    def __init__(self, group: Any, directory: str | os.PathLike | None = None, *, keep: int = 2,
                 name: str | None = None, shm_root: str | os.PathLike = "/dev/shm", sync: bool = True,
                 write_timeout: float = 600.0) -> None:
        if not all(hasattr(group, a) for a in ("state", "view", "gossip", "execute")):
            raise TypeError(f"FlashCheckpointer needs the group ftcomm.init returned, got {type(group).__name__}")
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"name must be a non-empty string, got {name!r:.40}")
        job = name or group.gossip.cluster
        if keep < 1 or write_timeout <= 0 or "/" in job or "\0" in job:
            raise ValueError("keep must be at least 1, write_timeout positive, and name free of '/' and NUL")
        self.group, self.keep, self.sync, self.write_timeout = group, keep, sync, write_timeout
        self.job = job
        self.directory = pathlib.Path(directory) if directory is not None else None
        self.shards = getattr(group, "replica_size", 1)
        # Signed with the group's secret, for this job and shard (one the launcher drew for a
        # single run is not kept across runs, so its checkpoints stay unsigned: a new run
        # could not read them).
        self.key = files.checkpoint_key(getattr(group, "checkpoint_secret", None), job,
                                        group.shard_rank if self.shards > 1 else None)
        if self.shards > 1:  # a sharded replica's processes each hold one shard: one copy per shard index
            job = f"{job}-{files.shard_suffix(group.shard_rank)}"
            if self.directory is not None:
                self.directory = self.directory / files.shard_suffix(group.shard_rank)
        if self.directory is not None:  # before shared memory is taken: a bad directory leaves nothing held
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                raise FtcommError(f"cannot use the checkpoint directory {self.directory}: "
                                  f"{exc.strerror or exc}") from None
        self.shm = files.private_directory(pathlib.Path(shm_root) / f"ftcomm-{job}")
        try:
            self._occupied = files.occupy(self.shm, self.directory)
        except FileNotFoundError:  # reclaimed by another job's checkpointer this instant: make it again
            self.shm = files.private_directory(self.shm)
            self._occupied = files.occupy(self.shm, self.directory)
        files.remove_abandoned(self.shm)
        _, left = files.reclaim_dead(pathlib.Path(shm_root), self.shm)
        if left:
            log.info("shared memory also holds %s: unused, kept because %s", ", ".join(
                f"{path} ({size / 2**20:.0f} MB)" for path, size in left),
                "a launcher that may restart their workers still runs, or their newest checkpoint is there alone")
        self.last_pause_s: float | None = None
        self._slots: list[_Slot] = []
        self._cond = threading.Condition()
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0  # saves not yet published and persisted
        self._finished = 0  # background jobs done: progress, for the bounded waits
        self._error: BaseException | None = None
        self._closed = False
        self._corrupt: set[tuple[pathlib.Path, int]] = set()  # copies restore() found corrupt
        self._other_model: StateError | None = None  # why a copy of another model was skipped (see restore)
        self._loaded_from: pathlib.Path | None = None  # where the restored step was read (see restore)
        self._queued: set[int] = set()  # steps saved and not yet written
        self._leaving = False  # the group is lost (keep_before_leaving): no spare buffers any more
        self._worker = threading.Thread(target=self._background, name="ftcomm-checkpoint", daemon=True)
        self._worker.start()
        keepers = getattr(group, "_keepers", None)
        if keepers is not None:  # called when the group is lost (see keep_before_leaving)
            keepers.add(self)

    # ------------------------------------------------------------------ save
    def is_writer(self) -> bool:
        """The member with the lowest rank on this host writes the host's copy (with sharded
        replicas: of its shard index, among the host's processes of that shard)."""
        return self._host_writer() in (None, self.group.id)

    def _host_writer(self) -> str | None:
        group = self.group
        hosts = {m.id: m.host for m in group.gossip.members()}
        mine = hosts.get(group.id, group.gossip.address.rsplit(":", 1)[0])
        members = group.view.members[group.view.rank_of(group.id) % self.shards::self.shards]
        local = [m for m in members if hosts.get(m, mine if m == group.id else None) == mine]
        return local[0] if local else None

    def save(self) -> float:
        """Checkpoint the registered state at the group's committed step; returns the pause in seconds.

        Call it between steps on every member (only one per host writes). Raises
        FtcommError for an earlier background write that failed (naming the path; that
        checkpoint may still be published in shared memory) or when shared memory cannot
        hold this one's buffer, StateError when the state holds something other than
        tensors and plain data, FtcommTimeout when every buffer is held by writes that
        made no progress for ``write_timeout`` seconds. Never blocks longer than that.
        """
        return self._save(self.is_writer())

    @property
    def closed(self) -> bool:
        return self._closed

    def keep_before_leaving(self, timeout: float = LEAVING_WAIT_S) -> str:
        """The group is lost (QuorumLost): make sure this host's shared memory holds the
        state of the committed step, and say where it is. Written by this member when it
        is its host's writer, or when the writer is not alive in gossip (gone: someone must
        write it), unless a copy of that step is published or on its way; the others of the
        host leave it to the writer, which loses the quorum with them (one buffer per host,
        not one per process). An earlier write's failure is logged, not raised (it is not
        this one's), and the wait is for the shared-memory copy alone, at most ``timeout``
        seconds: a persistent directory on a filesystem cut off with the rest cannot hold
        up the error. FtcommError when the copy was not published in that time. No spare
        buffer is prepared from now on."""
        self._leaving = True
        step = self.group.step
        if self._error is not None:
            log.warning("keeping step %d before leaving; an earlier write failed: %s", step, self._error)
            self._error = None
        writer = self._host_writer()
        states = {m.id: m.state for m in self.group.gossip.members()}
        if writer in (None, self.group.id) or states.get(writer) != "alive":
            if step not in files.steps_in(self.shm) and step not in self._queued:
                self._save(True)
            deadline = time.monotonic() + timeout
            with self._cond:
                while step not in files.steps_in(self.shm):
                    if self._error is not None or time.monotonic() >= deadline:
                        raise FtcommError(f"the checkpoint of step {step} was not published in {self.shm} within "
                                          f"{timeout:g} s" + (f": {self._error}" if self._error else ""))
                    self._cond.wait(0.05)
            return str(self.shm) + (f", then {self.directory}" if self.directory is not None else "")
        return f"{self.shm}, written by this host's writer {writer}"

    def _save(self, writer: bool) -> float:
        self._raise_failure()
        if self._closed:
            raise FtcommError("save() after close(): create a new FlashCheckpointer")
        if not writer:
            return 0.0
        started = time.perf_counter()
        step = self.group.step
        skeleton, tensors = plain.split(self.group.state.snapshot(step), "state")
        entries, size = plain.layout(tensors)
        slot = self._take_slot(size, step)
        try:
            for t, (offset, dtype, shape, nbytes) in zip(tensors, entries):
                if nbytes:
                    plain.view(slot.buffer, offset, dtype, shape, nbytes).copy_(t)
        except BaseException:
            with self._cond:
                slot.busy = False
            raise
        self.last_pause_s = time.perf_counter() - started
        self._queued.add(step)
        record = {"format": files.FORMAT, "step": step, "time": time.time(), "size": size, "chunk": files.CHUNK,
                  "tensors": entries, "structure": skeleton}
        with self._cond:
            self._pending += 1
        self._jobs.put((slot, record))
        return self.last_pause_s

    def wait(self) -> None:
        """Block until every checkpoint saved so far is published and persisted.

        Raises FtcommTimeout when no background write finishes for ``write_timeout``
        seconds (a hung filesystem), FtcommError naming the path when a write failed.
        """
        with self._cond:
            self._wait_for(lambda: self._pending == 0, "the checkpoints saved so far")
        self._raise_failure()

    def close(self, discard: bool = False) -> None:
        """Wait for the background writes, stop the thread and free this process's buffers:
        spare ones are deleted, those holding published checkpoints stay as checkpoints.

        ``discard``: the job is over; remove this host's shared-memory copies too, once no
        other checkpointer on the host uses them (the last process to close with
        ``discard`` removes them; the persistent directory is left as it is).

        Raises what wait() raises, after freeing everything no write still uses.
        """
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._jobs.put(None)
            self._worker.join(timeout=self.write_timeout if self._pending == 0 else 1.0)
            with self._cond:
                for slot in [s for s in self._slots if not s.busy]:
                    self._release(slot, delete=slot.path.name.startswith(".slot-"))
            os.close(self._occupied)
            if discard and not any(s.busy for s in self._slots) and files.discard_if_unused(self.shm):
                log.info("removed the shared-memory checkpoints in %s", self.shm)

    def discard_after(self, step: int) -> list[int]:
        """The state of the steps after ``step`` may have gone wrong unnoticed (fingerprints
        that differed: see ``GroupOptions.fingerprint_every``): when this member is its
        host's writer, delete its checkpoints of those steps, in shared memory and in the
        directory, so that no restore loads them (a restore then takes ``step`` or older).
        Waits for the writes under way first (at most ``write_timeout``); the checkpointer
        stays open. The steps deleted, newest first; none on a member that does not write
        (its host's copies are the writer's, whose state may be right)."""
        if not self.is_writer():
            return []
        try:
            self.wait()
        except FtcommError as exc:  # an earlier write's failure: what was published is checked all the same
            log.warning("deleting the checkpoints after step %d: %s", step, exc)
        dropped: set[int] = set()
        for place in (self.shm, self.directory):
            later = [s for s in files.steps_in(place) if s > step]
            with self._cond:
                own = {s.path.name: s for s in self._slots if not s.busy} if place == self.shm else {}
            for s in later:
                self._delete(place, s, own.get(files.file_name(s, "data")))
                dropped.add(s)
        if dropped:
            log.error("deleted the checkpoints of steps %s of job %r: their state may have gone wrong (the last step "
                      "whose fingerprints agreed is %d)", sorted(dropped, reverse=True), self.job, step)
        return sorted(dropped, reverse=True)

    def _raise_failure(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise FtcommError(f"an earlier checkpoint failed: {error}") from error

    def _wait_for(self, ready: Callable[[], Any], what: str) -> Any:
        """``ready()``'s first true value, waiting on ``self._cond`` (held by the caller).

        Raises FtcommTimeout after ``write_timeout`` seconds in which no background write
        finished, FtcommError when the background thread is gone.
        """
        finished, deadline = self._finished, time.monotonic() + self.write_timeout
        while not (value := ready()):
            if not self._worker.is_alive():
                raise FtcommError(f"the checkpoint writer has stopped while waiting for {what}: "
                                  f"create a new FlashCheckpointer")
            if self._finished != finished:
                finished, deadline = self._finished, time.monotonic() + self.write_timeout
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FtcommTimeout(
                    f"no checkpoint write finished in {self.write_timeout:g} s while waiting for {what}: writing "
                    f"to {self.directory or self.shm} is stuck; check that filesystem, or raise write_timeout")
            self._cond.wait(min(remaining, 1.0))
        return value

    def _take_slot(self, size: int, step: int) -> _Slot:
        """A spare buffer of ``size`` bytes (one that holds no published checkpoint), marked busy.

        Waits, bounded as in wait(), while every buffer holds a checkpoint still being
        written; raises FtcommError when shared memory cannot hold a new one.
        """
        with self._cond:
            slot = self._wait_for(lambda: self._free_slot(size, f"the checkpoint of step {step}"),
                                  f"a buffer for the checkpoint of step {step}")
            slot.busy = True
            return slot

    def _free_slot(self, size: int, purpose: str) -> _Slot | None:
        """A spare buffer of ``size`` bytes, a new one when there is room, else None (lock held)."""
        for s in [s for s in self._slots if not s.busy and not s.path.exists()]:
            self._release(s, delete=False)  # another writer pruned the checkpoint it held
        spare = [s for s in self._slots if not s.busy and s.path.name.startswith(".slot-")]
        fits = [s for s in spare if s.size == size]
        if fits:
            return fits[0]
        for s in spare:  # the state changed size: drop buffers that no longer fit
            self._release(s, delete=True)
        return self._new_slot(size, purpose) if len(self._slots) <= self.keep else None

    def _new_slot(self, size: int, purpose: str) -> _Slot:
        """A new buffer of ``size`` bytes with all its pages allocated (lock held).

        Raises FtcommError naming ``purpose`` and the directory when shared memory is
        full; nothing of the attempt is left behind.
        """
        path = self._spare_path()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise FtcommError(f"cannot create a buffer for {purpose} in {self.shm}: {exc}") from exc
        try:
            files.hold_shared(fd)
            os.ftruncate(fd, max(size, 1))
            os.posix_fallocate(fd, 0, max(size, 1))
            buffer = mmap.mmap(fd, max(size, 1), flags=files.MAP_FLAGS)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise FtcommError(f"cannot allocate {size} bytes of shared memory in {self.shm} for {purpose}: "
                              f"{exc.strerror or exc}; free shared memory (df -h {self.shm.parent}), lower "
                              f"keep, or enlarge {self.shm.parent}") from exc
        slot = _Slot(path, size, buffer, fd)
        self._slots.append(slot)
        return slot

    def _spare_path(self) -> pathlib.Path:
        """A new name for a buffer that holds no published checkpoint."""
        return self.shm / f".slot-{os.getpid()}-{time.monotonic_ns()}.data"

    def _release(self, slot: _Slot, delete: bool) -> None:
        """Forget ``slot``: unmap it, drop its lock, and delete its file if ``delete`` (lock held)."""
        self._slots.remove(slot)
        if delete:
            with contextlib.suppress(OSError):
                slot.path.unlink(missing_ok=True)
        with contextlib.suppress(BufferError):  # a tensor still views it: the mapping goes with it
            slot.buffer.close()
        os.close(slot.fd)

    def _demote(self, slot: _Slot) -> None:
        """Rename ``slot``'s file back to a spare for reuse; delete it if that fails (lock held)."""
        if slot not in self._slots:
            return
        spare = self._spare_path()
        try:
            os.replace(slot.path, spare)
            slot.path = spare
        except OSError:
            self._release(slot, delete=True)

    # ------------------------------------------------------------------ background
    def _background(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            slot, record = job
            try:
                self._publish(slot, record)
            except Exception as exc:  # noqa: BLE001 - reported by the next save() or wait()
                error = exc if isinstance(exc, FtcommError) else \
                    FtcommError(f"checkpoint of step {record['step']} failed: {exc!r}")
                log.error("%s", error)
                self._error = error
            finally:
                with self._cond:
                    slot.busy = False
                    self._pending -= 1
                    self._finished += 1
                    self._queued.discard(record["step"])
                    self._cond.notify_all()
            if not self._leaving:
                self._prepare_spare(record["size"], record["step"])

    def _publish(self, slot: _Slot, record: dict) -> None:
        """Publish the checkpoint in ``slot`` in shared memory and prune there, then persist
        it to the directory and prune there.

        Raises FtcommError naming the place that failed: when publishing failed the slot
        is a spare again; when only persisting failed the shared-memory copy stays.
        """
        step = record["step"]
        record["checksums"] = files.checksums_of(slot.buffer, record["tensors"], self.key)
        meta = files.meta_bytes(record, self.key)
        self._publish_shm(slot, step, meta)
        self._prune(self.shm, step)
        if self.directory is not None:
            self._persist(slot, step, record["size"], meta)
            self._prune(self.directory, step)

    def _publish_shm(self, slot: _Slot, step: int, meta: bytes) -> None:
        data, record = self.shm / files.file_name(step, "data"), self.shm / files.file_name(step, "meta")
        try:
            record.unlink(missing_ok=True)
            with self._cond:
                for other in [s for s in self._slots if s is not slot and s.path == data]:
                    self._release(other, delete=False)  # the same step saved again: its file is replaced
                os.replace(slot.path, data)
                slot.path = data
            files.write_atomic(record, meta, sync=False)
        except OSError as exc:
            with self._cond:
                if slot.path == data:
                    self._demote(slot)
            raise FtcommError(f"checkpoint of step {step} could not be published in {self.shm}: "
                              f"{exc}; free shared memory (df -h {self.shm.parent}) or lower keep") from exc
        self._corrupt.discard((self.shm, step))

    def _persist(self, slot: _Slot, step: int, size: int, meta: bytes) -> None:
        directory = self.directory
        data, record = directory / files.file_name(step, "data"), directory / files.file_name(step, "meta")
        path = record
        try:
            record.unlink(missing_ok=True)  # the same step saved again: invisible until rewritten
            path = data
            with memoryview(slot.buffer) as view:
                files.write_atomic(data, view[:size], self.sync)
            path = record
            files.write_atomic(record, meta, self.sync)
        except OSError as exc:
            raise FtcommError(f"checkpoint of step {step} is published in shared memory ({self.shm}) but could "
                              f"not be written to {path}: {exc.strerror or exc}; make {directory} a writable "
                              f"directory with free space, or pass directory=None") from exc
        self._corrupt.discard((directory, step))

    def _prune(self, place: pathlib.Path, newest: int) -> None:
        """Delete from ``place`` the checkpoints not among the ``keep`` newest up to ``newest``
        (the one just written), the copies restore() found corrupt, and data files without
        a record older than every kept checkpoint (a write cut short).

        Other checkpoints newer than ``newest`` (an earlier run's) are neither deleted nor
        counted, so the one just written is always kept. This process's buffers are
        renamed back to spares rather than deleted. Failures are logged, not raised.
        """
        corrupt = {step for where, step in list(self._corrupt) if where == place}
        steps = files.steps_in(place)
        kept = [s for s in steps if s <= newest and s not in corrupt][:self.keep]
        with self._cond:
            own = {s.path.name: s for s in self._slots if not s.busy} if place == self.shm else {}
        for step in steps:
            if step in kept or (step > newest and step not in corrupt and files.file_name(step, "data") not in own):
                continue
            self._delete(place, step, own.get(files.file_name(step, "data")))
        for step in set(files.steps_in(place, files.DATA_NAME)) - set(steps):
            if len(kept) == self.keep and step < kept[-1]:  # would be pruned with its record too
                self._delete(place, step, own.get(files.file_name(step, "data")))

    def _delete(self, place: pathlib.Path, step: int, slot: _Slot | None) -> None:
        try:
            (place / files.file_name(step, "meta")).unlink(missing_ok=True)  # invisible first
            if slot is not None:
                with self._cond:
                    self._demote(slot)
            else:
                (place / files.file_name(step, "data")).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not delete the checkpoint of step %d in %s: %s", step, place, exc)
        self._corrupt.discard((place, step))

    def _prepare_spare(self, size: int, step: int) -> None:
        """Allocate the next save's buffer now, so that save() only copies. A failure (shared
        memory full) is logged; the next save() tries again and raises it, naming its step."""
        with self._cond:
            spare = [s for s in self._slots if not s.busy and s.size == size and s.path.name.startswith(".slot-")]
            if self._closed or spare or len(self._slots) > self.keep:
                return
            try:
                self._new_slot(size, f"the checkpoint after step {step}")
            except FtcommError as exc:
                log.warning("%s; the next save() tries again", exc)

    # ------------------------------------------------------------------ restore
    def available(self) -> list[int]:
        """Steps with a checkpoint record here (shared memory or directory), newest first."""
        return sorted(set(files.steps_in(self.shm)) | set(files.steps_in(self.directory)), reverse=True)

    def restore(self) -> int | None:
        """Agree with the other members on the newest step some member can load, and load it.

        Call it on every member after ``init`` and ``register_state`` (a collective among
        the members that started the group together). Returns the restored step, or None
        when no member has a loadable checkpoint. The members that can load the newest
        loadable step do, and the group's reconciliation gives it to the others (with
        sharded replicas: the newest step some process of every shard index can load, each
        shard reconciled on its own): a newer step held by one member is never given up for
        an older one every member holds. A state this member already resumed (the step kept
        when a member lost the quorum, see ``FaultTolerantGroup.register_state``) counts as
        a copy of its step. Unloadable copies are skipped with a warning; corrupt ones
        are deleted by the next save's pruning.

        Only in a view whose members have not begun training (``FaultTolerantGroup.restorable``:
        the group starts, or the whole job restarted): a worker restarted into a running group
        restores nothing and returns None at once, without a collective (the members are
        training, not restoring); it receives their state by reconciling.

        Raises :class:`OtherModel` (a StateError) when every copy here holds other parameters
        than the registered modules (restore with the model the checkpoints were saved from);
        a newer copy that does not fit is skipped for an older one that does.
        """
        if not self.group.restorable:
            return None  # the others train: this worker receives their state at its first step
        rejected: set[int] = set()
        self._other_model = None
        while True:
            agreed = self.group.execute(self._agree, rejected)
            if agreed is None:
                if self._other_model is not None:
                    raise self._other_model  # no copy here fits the registered model: another model?
                return None
            step, everywhere, loaded, outcome = agreed
            ok = [o[0] for o in outcome]
            if (everywhere and not all(ok)) or not all(any(ok[i::self.shards]) for i in range(self.shards)):
                if loaded is not None:
                    loaded[1].close()
                continue  # someone could not load it after all: agree again without that copy
            if loaded is not None:
                self._apply(*loaded)
            self.group.state_restored(step if loaded is not None else None,
                                      same_everywhere=all(ok) and len({o[1] for o in outcome}) == 1)
            log.info("restored step %d%s", step, "" if everywhere else " (on some members; reconciled to the rest)")
            if loaded is not None:
                self._say_resumed(step)
            return step

    def load_here(self, step: int) -> bool:
        """Load ``step`` from this process's copies, with no collective (each member loads
        what it holds, and the group's reconciliation makes the newest state everyone's):
        True when a copy verified and was loaded, False when none did (skipped with a
        warning, as in :meth:`restore`)."""
        loaded = self._load_verified(step)
        if loaded is None:
            return False
        self._apply(*loaded)
        return True

    def _say_resumed(self, step: int) -> None:
        """Say where the job resumes from (a run that meant to start fresh sees why it did
        not: shared memory outlives a job, and a job's name is its cluster's by default)."""
        place = self._loaded_from
        missing = (f"; the directory {self.directory} does not hold it (removed, or not written yet)"
                   if place == self.shm and self.directory is not None
                   and step not in files.steps_in(self.directory) else "")
        log.warning("resuming job %r from step %d, the checkpoint in %s%s; to start fresh, remove it "
                    "(ftcomm run --fresh removes the shared-memory copies) or give the job another name",
                    self.job, step, place, missing)

    def _agree(self, rejected: set[int]) -> tuple[int, bool, tuple | None, list[list[int]]] | None:
        """One whole round of agreement: offers, then who loaded the chosen step. Run by
        ``execute``, so a retry in a re-formed view starts the round again on every member,
        a worker let in meanwhile included. None: nothing to restore."""
        if not self.group.restorable:
            log.info("the group is already training: its state comes from the members, not from a checkpoint")
            return None
        held = self.group.resumed_step  # a kept state this member loaded already
        mine = sorted({s for s in self.available() if s not in rejected} | ({held} if held else set()),
                      reverse=True)[:MAX_CANDIDATES]
        offers = self._gather(mine)
        common = set.intersection(*(set(o) for o in offers)) if offers else set()
        # The newest step some member can load, of every shard index with sharded replicas
        # (rank r holds shard r % shards): reconciling hands each shard's copy on.
        by_shard = [set().union(*(set(o) for o in offers[i::self.shards])) for i in range(self.shards)]
        pool = set.intersection(*by_shard) if offers else set()
        if not pool:
            self.group.state_restored(None, same_everywhere=True)  # nothing to load, anywhere
            return None
        step = max(pool)
        resumed = step == held  # this member holds the step already: nothing to load
        loaded = self._load_verified(step) if step in mine and not resumed else None
        if loaded is None and not resumed:
            rejected.add(step)
        # the copies' fingerprint: equal checksums everywhere mean equal state everywhere
        # (a state resumed in memory has none: its digest is compared with the others')
        fingerprint = (self.group.rank + 1 if resumed else
                       xxhash.xxh3_64_intdigest(msgpack.packb(loaded[0].checksums)) >> 2 if loaded else 0)
        try:
            outcome = self._gather([1 if loaded is not None or resumed else 0, fingerprint])
        except BaseException:
            if loaded is not None:
                loaded[1].close()
            raise
        return step, step in common, loaded, outcome

    def _gather(self, values: list[int]) -> list[list[int]]:
        row = torch.full((MAX_CANDIDATES,), -1, dtype=torch.int64)
        row[:len(values)] = torch.tensor(values, dtype=torch.int64)
        return [[int(v) for v in t.tolist() if v >= 0] for t in self.group.allgather(row)]

    def _load_verified(self, step: int) -> tuple[files.Meta, mmap.mmap] | None:
        """The step's validated record and a verified mapping of its data, from the first
        copy (shared memory, then the directory) that verifies; None when none does.

        Never raises: a copy that fails is skipped with a warning, and one that is
        malformed or corrupt is remembered so that the next save's pruning deletes it. A copy
        whose optimizer or sampler state has another shape than the live one (a string where
        the live state holds a number, a missing field) is malformed too: loading it would
        fail, or train on nonsense. A copy whose parameters do not fit a registered module
        (another model's, or planted) is skipped but kept: restore() raises only when no
        step fits.
        """
        for place in (self.shm, self.directory):
            if place is None or not (place / files.file_name(step, "meta")).exists():
                continue
            try:
                opened = self._open_verified(place, step)
                self._loaded_from = place
                return opened
            except OtherModel as exc:  # planted, or the model changed: kept, and an older step tried
                self._other_model = exc
                reason = exc
            except StateError as exc:
                self._corrupt.add((place, step))
                reason: Exception = exc
            except Exception as exc:  # noqa: BLE001 - unreadable here (I/O, another format or registration)
                reason = exc
            log.warning("skipping checkpoint of step %d in %s: %s", step, place, reason)
        return None

    def _open_verified(self, place: pathlib.Path, step: int) -> tuple[files.Meta, mmap.mmap]:
        meta = files.read_meta(place / files.file_name(step, "meta"), step, self.key)
        missing = sorted(set(self.group.state.objects) - set(meta.tree["objects"]), key=str)
        if missing:
            raise ValueError(f"it holds no state for {', '.join(missing)} (registered now)")
        self._check_modules_fit(meta)
        for name, obj in self.group.state.objects.items():  # an optimizer's, a sampler's: what it would load
            if not isinstance(obj, torch.nn.Module):
                files.check_like(sharded.to_local(obj.state_dict()), meta.tree["objects"][name], name)
        buffer = files.map_data(place / files.file_name(step, "data"), meta.size)
        if files.checksums_of(buffer, meta.tensors, self.key) != meta.checksums:
            buffer.close()
            raise StateError("data checksum mismatch")
        return meta, buffer

    def _check_modules_fit(self, meta: files.Meta) -> None:
        saved_objects = meta.tree["objects"]
        for name, obj in self.group.state.objects.items():
            if not isinstance(obj, torch.nn.Module):
                continue
            saved, mine = saved_objects.get(name), sharded.to_local(obj.state_dict())
            if type(saved) is not dict or set(saved) != set(mine):
                raise OtherModel(f"the checkpoint of step {meta.step} holds other parameters for module {name!r} "
                                 f"than it has: restore with the model the checkpoint was saved from")
            for key, leaf in saved.items():
                tensor = mine[key]
                if not isinstance(leaf, files.TensorIndex) or not isinstance(tensor, torch.Tensor):
                    continue
                _, dtype, shape, _ = meta.tensors[leaf.index]
                if plain.DTYPES[dtype] != tensor.dtype or list(shape) != list(tensor.shape):
                    raise OtherModel(f"the checkpoint of step {meta.step} holds {name}.{key} as {dtype}{list(shape)}, "
                                     f"the module has {str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}: "
                                     f"restore with the model the checkpoint was saved from")

    def _apply(self, meta: files.Meta, buffer: mmap.mmap) -> None:
        """Copy a verified checkpoint into the registered state (in place where possible).

        Raises StateError, before anything is copied, when a registered module's parameters
        and buffers differ from the checkpoint's (names, dtypes or shapes: another model);
        otherwise what the objects' ``load_state_dict`` raise.
        """
        self._check_modules_fit(meta)
        live = {path: t.detach() for path, t in files.leaves(self.group.state.snapshot(self.group.step))
                if isinstance(t, torch.Tensor)}
        targets = {leaf.index: live[path] for path, leaf in files.leaves(meta.tree)
                   if isinstance(leaf, files.TensorIndex) and path in live}
        source = memoryview(buffer)
        try:
            tensors, in_place = [], True
            for index, (offset, dtype, shape, nbytes) in enumerate(meta.tensors):
                target = targets.get(index)
                if target is None or target.dtype != plain.DTYPES[dtype] or list(target.shape) != shape or \
                        target.device.type != "cpu" or not target.is_contiguous():
                    target = torch.empty(shape, dtype=plain.DTYPES[dtype])
                    in_place = False
                if nbytes:
                    tensor_bytes(target)[:] = source[offset:offset + nbytes]
                tensors.append(target)
        finally:
            source.release()
            buffer.close()
        snapshot = plain.join(meta.structure, tensors)
        state = self.group.state
        for name, obj in state.objects.items():
            module_state = snapshot["objects"][name]
            if in_place and isinstance(obj, torch.nn.Module) and all(
                    isinstance(v, torch.Tensor) for v in module_state.values()):
                continue  # every tensor of its state dict was read into the module's own tensors
            obj.load_state_dict(sharded.like(sharded.template(obj), module_state))
        state.values.update(snapshot["values"])
