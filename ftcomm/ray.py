"""Elastic training on Ray actors (extra ``[ray]``): Ray places, restarts and adds the
workers; ftcomm gives them their group and collectives. No Ray collective group, and
the driver is in no data path: it only starts actors and hands each one the gossip
addresses of the others.

    from ftcomm.ray import ElasticRayJob, cache

    def train(config):
        ft = ftcomm.init()                     # peers, bind address and secret come from the job
        x, y = ftcomm.ray.fetch(config["data"])  # the dataset, from Ray's object store
        ...
        return result

    job = ElasticRayJob(train, num_workers=(2, 4), config={"data": cache(x, y)})
    results = job.run()

Each worker is an actor of one process with ``cpus_per_worker`` CPUs (and
``gpus_per_worker`` GPUs). When its process dies (``ray.kill``, a crash), Ray restarts
the actor, up to ``max_restarts`` times; the job then runs the training function in it
again, and the new member joins the running group and receives the state. Every
``scale_interval`` seconds, while the group has fewer than the maximum number of
workers and the cluster has room for another, the job adds one. :meth:`ElasticRayJob.run`
returns once a worker's training function has returned and every other worker has
finished or failed for good: the values returned, one per worker that finished.

:func:`cache` puts a dataset's arrays into Ray's object store once; :func:`fetch` in a
worker maps them back as tensors without a copy from storage, so a worker that joins or
is restarted reads its data from memory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable

import numpy as np

try:
    import ray
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError("ftcomm.ray needs Ray: pip install 'ftcomm[ray]'") from exc

from .errors import GroupEnded, JoinError

log = logging.getLogger(__name__)


def cache(*arrays: Any) -> list:
    """Put each array (a numpy array or a CPU tensor) into Ray's object store once; the
    references go in the job's config, and workers :func:`fetch` them."""
    return [ray.put(np.asarray(a.numpy() if hasattr(a, "numpy") else a)) for a in arrays]


def fetch(refs: list) -> list:
    """The cached arrays as CPU tensors mapped from the object store, not copied (the
    memory is read-only: copy a tensor before writing to it)."""
    import warnings

    import torch

    tensors = []
    for array in ray.get(list(refs)):
        with warnings.catch_warnings():  # torch warns that writing to read-only memory is undefined
            warnings.simplefilter("ignore", UserWarning)
            tensors.append(torch.from_numpy(array))
    return tensors


def _free_port(host: str) -> int:
    """A port free for TCP and UDP on ``host`` (gossip binds both)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind((host, 0))
            port = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind((host, port))
                except OSError:
                    continue
                return port


@dataclasses.dataclass(frozen=True)
class Report:
    """What a worker's training function reported (:func:`report`), as the driver sees it."""

    worker: int  # the job's index of the worker (its slot; a restarted actor keeps it)
    rank: int | None  # its rank in the group's view then (None: no group in that process)
    step: int | None  # the group's committed step then
    time: float  # time.time() in the worker
    metrics: dict
    checkpoint: int | None = None  # the step a FlashCheckpointer saved with this report


@dataclasses.dataclass
class Result:
    """What a job came to (:attr:`ElasticRayJob.result`, once :meth:`ElasticRayJob.run`
    returned), as Ray Train's ``Result``: the values the training functions returned, the
    metrics of the newest report (the highest step, the latest among equals), the newest
    step a report named as checkpointed (its FlashCheckpointer holds it), every report, and
    why each worker given up on failed."""

    values: list
    metrics: dict | None
    checkpoint: int | None
    reports: list[Report]
    errors: list[str]


_REPORTS: list[dict] = []  # this actor process's reports not yet collected by the driver
_REPORTS_LOCK = threading.Lock()


def report(metrics: dict, checkpointer: Any = None) -> None:
    """From a training function running under :class:`ElasticRayJob`: hand ``metrics`` (a
    dict of plain values) to the driver, which collects them into ``job.reports`` and calls
    ``on_report`` with each. With ``checkpointer`` (a :class:`ftcomm.FlashCheckpointer`),
    save first and report the step saved, as Ray Train's ``train.report(checkpoint=...)``:
    call it on every worker at the same step (``save`` copies on one worker per host).
    Elsewhere (no job) it only saves."""
    from .group import running_groups

    group = next(iter(running_groups()), None)
    saved = None
    if checkpointer is not None:
        checkpointer.save()
        saved = checkpointer.group.step
    entry = {"rank": group.rank if group is not None else None, "step": group.step if group is not None else None,
             "time": time.time(), "metrics": dict(metrics), "checkpoint": saved}
    with _REPORTS_LOCK:
        _REPORTS.append(entry)
        del _REPORTS[:-MAX_PENDING_REPORTS]


MAX_PENDING_REPORTS = 10_000  # a driver that stopped collecting does not grow a worker's memory without bound


def _worker_reports() -> list[dict]:
    """The reports this process made since the last call (see :func:`report`)."""
    with _REPORTS_LOCK:
        taken = list(_REPORTS)
        _REPORTS.clear()
    return taken


class _Worker:
    """One training process (a Ray actor)."""

    def collect(self) -> tuple[list[dict], bool]:
        """The reports made since the last call, and whether this process's group formed."""
        from ftcomm.group import running_groups
        return _worker_reports(), bool(running_groups())

    def prepare(self) -> str:
        """Pick this worker's gossip address on its node; returns ``HOST:PORT``."""
        host = ray.util.get_node_ip_address()
        self.address = f"{host}:{_free_port(host)}"
        return self.address

    def pid(self) -> int:
        return os.getpid()

    def run(self, fn: Callable[[Any], Any], peers: list[str], env: dict[str, str], config: Any) -> Any:
        os.environ.update(env)
        os.environ["FTCOMM_BIND"] = self.address
        os.environ["FTCOMM_PEERS"] = ",".join(p for p in peers if p != self.address)
        from ftcomm.group import running_groups

        try:
            return fn(config)
        except BaseException:
            # The group the function formed would stay behind as a live member that never
            # steps again, holding the others up: leave it (the others re-form at once).
            for group in running_groups():
                group.shutdown()
            raise


@dataclasses.dataclass
class _Slot:
    actor: Any
    address: str | None = None
    run: Any = None  # the ObjectRef of its training function's result
    starts: int = 0
    placing: Any = None  # an added worker's first ``prepare`` call, not answered yet
    placing_since: float = 0.0


class ElasticRayJob:
    """Runs ``train_fn(config)`` on ``num_workers`` Ray actors; see the module docstring.

    ``num_workers``: ``(min, max)`` or a fixed number. ``min`` workers must fit in the
    cluster before training starts (waited for up to ``start_timeout`` seconds).
    ``secret``: the group's secret (default: a fresh one per job, given to every
    worker). ``env``: more environment variables for the workers. ``on_report``: called on
    the driver with each :class:`Report` a worker made with :func:`report` (they are also
    kept in :attr:`reports`).
    """

    def __init__(self, train_fn: Callable[[Any], Any], num_workers: int | tuple[int, int] = (1, 4), *,
                 config: Any = None, cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 max_restarts: int = 3, scale_interval: float = 5.0, start_timeout: float = 120.0,
                 secret: str | None = None, cluster: str = "ftcomm-ray", env: dict[str, str] | None = None,
                 on_report: Callable[[Report], None] | None = None) -> None:
        low, high = (num_workers, num_workers) if isinstance(num_workers, int) else num_workers
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise ValueError(f"num_workers must be an int >= 1 or (min, max) with 1 <= min <= max, got {num_workers!r}")
        if max_restarts < 0 or scale_interval <= 0 or start_timeout <= 0:
            raise ValueError("max_restarts must be >= 0, scale_interval and start_timeout > 0")
        self.train_fn, self.config = train_fn, config
        self.min_workers, self.max_workers = low, high
        self.cpus, self.gpus = cpus_per_worker, gpus_per_worker
        self.max_restarts, self.scale_interval, self.start_timeout = max_restarts, scale_interval, start_timeout
        # The group's worker counts are the job's, unless the training function passes its own
        # to ftcomm.init (or env sets them).
        self.env = {"FTCOMM_SECRET": secret or secrets.token_hex(32), "FTCOMM_CLUSTER": cluster,
                    "FTCOMM_MIN_WORKERS": str(low), "FTCOMM_MAX_WORKERS": str(high),
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self.slots: list[_Slot] = []
        self.restarts = 0  # training functions started again in a restarted actor
        self.failed = 0  # workers given up on (no restarts left, or the job was ending)
        self.errors: list[str] = []  # why each of them failed
        self.ended: list[str] = []  # workers that arrived after the group ended (GroupEnded): not run again
        self.reports: list[Report] = []  # what the training functions reported, in arrival order
        self.on_report = on_report
        self.result: Result | None = None  # set when run returns
        self.group_ran = False  # a worker's group formed (a worker run again is told so: FTCOMM_GROUP_RAN)
        self._collecting: dict[int, Any] = {}  # slot index -> its pending ``collect`` call
        # Three threads: ``pid``, ``prepare`` and ``collect`` answer while ``run`` trains.
        self._actor_class = ray.remote(max_restarts=max_restarts, max_task_retries=0, max_concurrency=3)(_Worker)

    # ------------------------------------------------------------------ running
    def run(self, timeout: float | None = None) -> list:
        """Train; the values returned by the workers whose training function returned (also
        in :attr:`result`, with the newest reported metrics and checkpoint). Raises
        RuntimeError when every worker failed."""
        if not ray.is_initialized():
            ray.init()
        self.slots, self.restarts, self.failed, self.errors, self.ended = [], 0, 0, [], []
        self.group_ran, self._collecting = False, {}
        deadline = None if timeout is None else time.monotonic() + timeout
        results: list = []
        try:
            self._start_initial()
            next_scale = time.monotonic() + self.scale_interval
            while any(s.run is not None for s in self.slots):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the job did not finish within {timeout:g} s")
                running = [s.run for s in self.slots if s.run is not None]
                done, _ = ray.wait(running, num_returns=1, timeout=0.5)
                self._collect()
                for ref in done:
                    slot = next(s for s in self.slots if s.run is ref)
                    self._collect(slot, final=True)  # what it reported before it returned
                    self._finished(slot, results)
                self._check_placing(ending=bool(results))
                if not results and time.monotonic() >= next_scale:
                    next_scale = time.monotonic() + self.scale_interval
                    self._scale_up()
        finally:
            if ray.is_initialized():
                for slot in self.slots:
                    ray.kill(slot.actor, no_restart=True)
        if not results:
            raise RuntimeError(f"every worker failed: "
                               f"{'; '.join(self.errors + self.ended) or 'no worker could be started'}")
        newest = max(self.reports, key=lambda r: (r.step if r.step is not None else -1, r.time), default=None)
        saved = [r.checkpoint for r in self.reports if r.checkpoint is not None]
        self.result = Result(results, newest.metrics if newest is not None else None, max(saved, default=None),
                             list(self.reports), list(self.errors))
        return results

    def _collect(self, only: "_Slot | None" = None, final: bool = False) -> None:
        """Gather the workers' reports: one ``collect`` call in flight per running worker,
        read once it answered. ``final`` (``only``'s training function ended): read its
        call in flight and one more, waiting for them (a few seconds at most)."""
        for index, slot in enumerate(self.slots):
            if only is not None and slot is not only:
                continue
            pending = self._collecting.pop(index, None)
            if final:
                for ref in [r for r in (pending, slot.actor.collect.remote()) if r is not None]:
                    self._take(index, ref, 5.0)
            elif pending is None or ray.wait([pending], timeout=0)[0]:
                if pending is not None:
                    self._take(index, pending, 0.0)
                if slot.run is not None:
                    self._collecting[index] = slot.actor.collect.remote()
            else:
                self._collecting[index] = pending

    def _take(self, index: int, ref: Any, timeout: float) -> None:
        try:
            entries, ran = ray.get(ref, timeout=timeout)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):  # its process died, or is slow
            return
        self.group_ran = self.group_ran or ran
        for entry in entries:
            made = Report(index, entry["rank"], entry["step"], entry["time"], entry["metrics"], entry["checkpoint"])
            self.reports.append(made)
            if self.on_report is not None:
                self.on_report(made)

    def _start_initial(self) -> None:
        waited_until = time.monotonic() + self.start_timeout
        while len(self.slots) < self.min_workers:
            if not self._fits():
                if time.monotonic() > waited_until:
                    raise TimeoutError(f"the cluster has no room for {self.min_workers} workers of "
                                       f"{self.cpus} CPU and {self.gpus} GPU within {self.start_timeout:g} s")
                time.sleep(0.5)
                continue
            self._add()
        while len(self.slots) < self.max_workers and self._fits():
            try:
                self._add()
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as exc:
                slot = self.slots.pop()  # the room seen was taken meanwhile: train with those placed
                ray.kill(slot.actor, no_restart=True)
                log.warning("a worker beyond the minimum could not be placed (%s): starting with %d",
                            type(exc).__name__, len(self.slots))
                break

    def _fits(self) -> bool:
        free = ray.available_resources()
        return free.get("CPU", 0) >= self.cpus and free.get("GPU", 0) >= self.gpus

    def _scale_up(self) -> None:
        """Add a worker without waiting for Ray to place it: the room seen may be gone by
        the time its actor is created (:meth:`_check_placing` follows it up)."""
        if any(s.placing is not None for s in self.slots):
            return  # one at a time
        if len(self.slots) < self.max_workers and self._fits():
            log.info("adding a worker (%d of at most %d)", len(self.slots) + 1, self.max_workers)
            slot = _Slot(self._new_actor())
            slot.placing, slot.placing_since = slot.actor.prepare.remote(), time.monotonic()
            self.slots.append(slot)

    def _check_placing(self, ending: bool) -> None:
        """Start the training function in an added worker once Ray placed it; drop it when
        it was not placed within ``start_timeout`` (or failed), or the job is ending."""
        for slot in [s for s in self.slots if s.placing is not None]:
            ready, _ = ray.wait([slot.placing], timeout=0)
            waited = time.monotonic() - slot.placing_since
            if not ready and waited <= self.start_timeout and not ending:
                continue
            ref, slot.placing = slot.placing, None
            why = "the job is ending" if ending else f"not placed by Ray within {self.start_timeout:g} s"
            if ready and not ending:
                try:
                    slot.address = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    why = f"it failed to start: {type(exc).__name__}"
                else:
                    self._run_in(slot)
                    continue
            log.warning("the worker added (%d of at most %d) is dropped: %s", len(self.slots), self.max_workers, why)
            ray.kill(slot.actor, no_restart=True)
            self.slots.remove(slot)

    def _new_actor(self) -> Any:
        options = {"num_cpus": self.cpus}
        if self.gpus:
            options["num_gpus"] = self.gpus
        return self._actor_class.options(**options).remote()

    def _add(self) -> None:
        slot = _Slot(self._new_actor())
        self.slots.append(slot)
        self._launch(slot)

    def _launch(self, slot: _Slot) -> None:
        """Start the training function in ``slot``'s actor, with every other worker as a peer.
        An actor that Ray is restarting is waited for (up to ``start_timeout``)."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                slot.address = ray.get(slot.actor.prepare.remote(), timeout=self.start_timeout)
                break
            except ray.exceptions.ActorUnavailableError:  # being restarted
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self._run_in(slot)

    def _run_in(self, slot: _Slot) -> None:
        """Start the training function in ``slot``'s prepared actor, with every other worker
        as a peer. A worker run again once the job's group formed is told so, as ``ftcomm
        run`` tells it (``FTCOMM_GROUP_RAN``): the group may run on in a peer that answers it
        nothing, and it founds no group of its own while one is silent."""
        peers = [s.address for s in self.slots if s is not slot and s.address and s.placing is None
                 and (not slot.starts or s.run is not None)]
        env = self.env
        if slot.starts and "FTCOMM_GROUP_RAN" not in self.env:
            # Its peers are the workers whose functions run now (Ray starts an actor again on
            # another port, or node: a failed worker's old address would stay silent for ever).
            env = {**self.env, "FTCOMM_GROUP_RAN": "1" if self.group_ran and peers else "0"}
        slot.run = slot.actor.run.remote(self.train_fn, peers, env, self.config)
        slot.starts += 1

    def _finished(self, slot: _Slot, results: list) -> None:
        ref, slot.run = slot.run, None
        try:
            results.append(ray.get(ref))
            return
        except ray.exceptions.RayActorError as exc:  # its process died
            reason: BaseException = exc
        except ray.exceptions.RayTaskError as exc:  # the training function raised (its group was left)
            reason = exc
        lines = [line for line in str(reason).splitlines() if line.strip()]
        why = lines[-1][:300] if lines else type(reason).__name__  # the exception, after Ray's traceback
        cause = getattr(reason, "cause", None)
        if isinstance(cause, GroupEnded) or (results and isinstance(cause, JoinError)):
            # Started as the others finished: the job's group ended before letting it in (or
            # nobody answered it any more). Nothing is left to train: it is not run again,
            # and it counts as a failure only if no worker's function returns.
            self.ended.append(why)
            log.info("worker at %s arrived after the job's group ended: %s", slot.address, type(cause).__name__)
            return
        if results or slot.starts > self.max_restarts:
            self.failed += 1
            self.errors.append(why)
            log.warning("worker at %s failed for good: %s", slot.address, why)
            return
        log.warning("worker at %s failed (%s); running it again", slot.address, type(reason).__name__)
        try:
            self._launch(slot)  # the actor was restarted by Ray
            self.restarts += 1
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            self.failed += 1
            self.errors.append(f"could not be restarted: {type(exc).__name__}")
            log.warning("worker at %s could not be restarted (%s)", slot.address, type(exc).__name__)
