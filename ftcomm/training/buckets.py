"""Gradient buckets: flat buffers reduced as soon as their gradients are ready.

Parameters are packed, in reverse registration order (the order backward produces
their gradients), into flat float32 buffers (or bfloat16 / float16 ones: ``wire``; int8 is summed from
float32 buffers by :mod:`ftcomm.training.quantized`) of about
``bucket_mb`` each; the first
bucket is kept small so communication starts early. With overlap on, a hook after
each gradient is accumulated copies it into its bucket, pre-scaled by ``1/world``, and
launches a bucket's allreduce the moment it is complete and every earlier bucket has
been launched — the same order on every worker, whatever order the hooks fire in.
``finish`` then fills and launches whatever backward did not (unused parameters,
a step where overlap was off) and returns the handles to wait on.

The last bucket ends with two counters and one flag per rank, ``[valid, join,
aside_0 .. aside_{W-1}]``: after the allreduce they hold the number of workers whose
gradients are valid, the number that saw a worker waiting to join (the pending-join
flag of DESIGN §1.4), and which ranks ask to stand aside as stragglers, the same on
every member. Then three slots per rank for its state fingerprint in a step that compares
them (``fingerprint_every``): 16 bits a slot plus one, so that every value is exact in
float32 and 0 means "none"; each rank writes only its own, so the sum holds them all.

After a successful reduction each float32 gradient is handed back as a view of its
bucket, so the next backward (when the optimizer zeroes instead of freeing) writes
straight into the bucket and no copy is needed. After a failed step the buffers are
replaced: an abandoned collective may still write into the old ones.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

from ..backends.base import Handle
from ..errors import FtcommError
from . import sharded

FIRST_BUCKET_MB = 1.0  # as DDP: the gradients of the last layers go out without waiting for 25 MB
_COUNTERS = 2  # [valid, join], then a flag per rank, then FINGERPRINT_SLOTS per rank
FINGERPRINT_SLOTS = 3  # 16 bits each: a 48-bit fingerprint
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)


def tail_size(world: int) -> int:
    """Length of the counters for ``world`` members."""
    return _COUNTERS + (1 + FINGERPRINT_SLOTS) * world


class Suspendable:
    """``no_sync()`` for a gradient path whose hooks check ``_suspended`` under ``_lock``."""

    _suspended = 0
    _lock: threading.Lock

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and start no reduction."""
        with self._lock:
            self._suspended += 1
        try:
            yield
        finally:
            with self._lock:
                self._suspended -= 1


class GradientBuckets(Suspendable):
    """The buckets of one parameter list.

    ``launch(flat)``: start an allreduce(sum) of ``flat`` on the current communicator.
    ``may_overlap()``: asked at the first gradient of a step; False leaves the whole
    step to ``finish`` (a re-formation or a join is due first).
    ``world_size()``: the size gradients are pre-scaled by.
    ``watch``: the parameters whose ``requires_grad`` is compared, once a step at its first
    gradient, with what the buckets were made for (default ``params``; a module's every
    parameter, frozen ones included): when it changed, backward reduces nothing (new buckets
    take the step: see ``BackendCollective.use``).
    ``wire``: the dtype the gradients are summed in (float32, or bfloat16 / float16 for half
    the bytes: the counters then travel in a float32 bucket of their own, where they are
    exact; or int8, for a quarter: the buckets stay float32 here and ``launch_int8(flat)``
    starts their sum in 8-bit integers, see :mod:`~ftcomm.training.quantized`).
    ``hold_counters``: the gradients may reach the hooks before the step's work is done
    (DiLoCo's ``delay`` sends them early and trains on): the counters then travel in a
    float32 bucket of their own, launched only by :meth:`finish`, so that a worker lost
    before its call never counts as having contributed.
    ``contribution(valid)``: this worker's counters, asked when the last bucket launches
    with whether its gradients were computed on valid state: ``(valid, join, aside)`` —
    its gradients count (False also when its batch does not match the data plan), it sees
    a worker waiting to join, and its rank when it asks to stand aside as a straggler
    (None when it does not).
    """

    def __init__(self, params: list[torch.Tensor], bucket_mb: float, overlap: bool,
                 launch: Callable[[torch.Tensor], Handle], may_overlap: Callable[[], bool],
                 world_size: Callable[[], int],
                 contribution: Callable[[bool], tuple[bool, bool, int | None]] = lambda valid: (valid, False, None),
                 watch: list[torch.Tensor] | None = None, wire: torch.dtype = torch.float32,
                 launch_int8: Callable[[torch.Tensor], Handle] | None = None, hold_counters: bool = False) -> None:
        if wire not in WIRE_DTYPES:
            raise ValueError(f"gradients travel in one of {', '.join(map(str, WIRE_DTYPES))}, not {wire}")
        if wire == torch.int8 and launch_int8 is None:
            raise ValueError("int8 gradients need launch_int8, the sum that adds them across the group")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise FtcommError("wait_gradients_ready needs every parameter on one device, got "
                              f"{sorted(map(str, devices))}")
        self.params = params
        self._watch = watch if watch is not None else params
        self._mask = [p.requires_grad for p in self._watch]
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        self._launch, self._may_overlap, self._world_size = launch, may_overlap, world_size
        self._contribution = contribution
        self._launch_int8 = launch_int8
        self.wire = wire
        self._groups = _group(list(reversed(params)), bucket_mb, torch.tensor([], dtype=wire).element_size())
        self.hold_counters = hold_counters
        if wire != torch.float32 or hold_counters:
            self._groups.append([])  # the counters alone, in float32
        self._slot: dict[int, tuple[int, int, int]] = {}
        for b, group in enumerate(self._groups):
            offset = 0
            for p in group:
                n = sharded.local(p).numel()  # a sharded parameter: this process's shard
                self._slot[id(p)] = (b, offset, n)
                offset += n
        self._sizes = [sum(sharded.local(p).numel() for p in g) + (tail_size(0) if b == len(self._groups) - 1 else 0)
                       for b, g in enumerate(self._groups)]  # the last: plus a flag per rank
        self._world = 0  # the world size the buffers' tail was made for
        self._flats: list[torch.Tensor] = []
        self._lock = threading.Lock()  # hooks may run on autograd's device threads
        # A sharded model's gradient shards arrive from FSDP2's reduce-scatter of each of its
        # parameter groups, during backward: FSDP2 runs the parameters' post-accumulate-grad
        # hooks then, and the shards go into their buckets as plain gradients do.
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params] if overlap else []
        self._new_step()

    @property
    def bucket_count(self) -> int:
        return len(self._groups)

    @property
    def touched(self) -> bool:
        """Backward has copied gradients or started reductions in this step."""
        return bool(self._filled or self._handles)

    @property
    def lost(self) -> bool:
        """This step's reductions were dropped (:meth:`drop`) after backward began them:
        the gradients copied into them are gone. Until the step ends (:meth:`discard`)."""
        return self._lost

    # ------------------------------------------------------------------ per step
    def _new_step(self) -> None:
        self._lost = False
        self._started = False  # a gradient of this step has arrived
        self._overlapping = False
        self._scale = 1.0  # the factor gradients were copied with
        self._filled: set[int] = set()
        self._ready = [0] * len(self._groups)
        self._handles: list[Handle] = []
        self._accumulated = False
        self._error: BaseException | None = None

    def _on_grad(self, param: torch.Tensor) -> None:
        with self._lock:
            if self._suspended:
                return
            if not self._started:
                self._started = True
                changed = [p.requires_grad for p in self._watch] != self._mask  # once a step
                self._overlapping = not changed and self._may_overlap()
                if self._overlapping:
                    self._fit_world()
                self._scale = 1.0 / self._world_size() if self._overlapping else 1.0
            if not self._overlapping:
                return
            key = id(param)
            if key in self._filled:  # a second backward before the reduction
                self._accumulated, self._overlapping = True, False
                return
            self._filled.add(key)
            b, offset, n = self._slot[key]
            self._copy(param, self._buffers()[b][offset:offset + n])
            self._ready[b] += 1
            try:
                self._launch_ready(valid=True)
            except Exception as exc:  # noqa: BLE001 - never raise into autograd; finish reports it
                self._error, self._overlapping = exc, False

    def _launch_ready(self, valid: bool, final: bool = False) -> None:
        """Launch, in bucket order, every complete bucket after the ones already launched (the
        counters' with ``hold_counters`` only at the ``final`` call, :meth:`finish`)."""
        last = len(self._groups) - 1
        while len(self._handles) <= last:
            b = len(self._handles)
            if self._ready[b] < len(self._groups[b]) or (b == last and self.hold_counters and not final):
                return
            flat = self._buffers()[b]
            if b == last:
                flat[-tail_size(self._world):] = torch.tensor(counter_values(self._contribution(valid), self._world))
            quantized = self.wire == torch.int8 and b != last
            self._handles.append(self._launch_int8(flat) if quantized else self._launch(flat))

    def finish(self, valid: bool) -> tuple[list[Handle], torch.Tensor]:
        """Fill and launch what backward did not; the handles of every bucket, and the tail.

        ``valid`` False: this worker's gradients were computed on state that was just
        replaced and count as zero. Only an untouched step can be invalid: a step that
        backward started reducing is discarded instead when the view changes.
        """
        with self._lock:
            error, accumulated = self._error, self._accumulated
            if error is not None or accumulated:
                self._detach_and_renew()
            if error is not None:
                raise error
            if accumulated:
                raise FtcommError("gradients were accumulated by more than one backward pass before "
                                  "wait_gradients_ready: run all but the last inside `with ft.no_sync():`, "
                                  "or start the group with overlap=False")
            if not valid and self.touched:
                raise FtcommError("a step already being reduced cannot be marked invalid")
            if not self.touched:
                self._fit_world()
            if not self._overlapping:
                self._scale = 1.0 / self._world_size()
            flats = self._buffers()
            for p in self.params:
                if id(p) in self._filled:
                    continue
                b, offset, n = self._slot[id(p)]
                view = flats[b][offset:offset + n]
                if valid:
                    self._copy(p, view)
                else:
                    view.zero_()
                self._ready[b] += 1
            self._launch_ready(valid, final=True)
            return list(self._handles), flats[-1][-tail_size(self._world):]

    def hand_back(self, contributors: float) -> None:
        """Turn the sums into averages over ``contributors`` and give the gradients back."""
        correction = 1.0 / (contributors * self._scale)
        for flat in self._flats:
            if abs(correction - 1.0) > 1e-9:
                flat.mul_(correction)
        for p in self.params:
            b, offset, n = self._slot[id(p)]
            if sharded.is_sharded(p):
                _hand_back_shard(p, self._flats[b][offset:offset + n])
                continue
            view = self._flats[b][offset:offset + n].view_as(p)
            if p.dtype == view.dtype:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif p.grad is None:
                p.grad = view.to(p.dtype)
            else:
                p.grad.copy_(view)
        self._new_step()

    def discard(self) -> None:
        """After a failed step: detach gradients from the buffers and use new buffers from now on
        (an abandoned collective may still write into the old ones)."""
        with self._lock:
            self._detach_and_renew()

    def drop(self) -> None:
        """The view re-formed inside the step, after backward began reducing it: as
        :meth:`discard`, and the step is :attr:`lost`."""
        with self._lock:
            self._detach_and_renew()
            self._lost = True

    def _detach_and_renew(self) -> None:
        self._detach()
        self._new_step()

    def _detach(self) -> None:
        """Gradients that are views of the buffers become tensors of their own; new buffers next."""
        for p in self.params:
            if p.grad is not None and not sharded.is_sharded(p) and self._is_bucket_view(p.grad):
                p.grad = p.grad.detach().clone()
        self._flats = []

    def remove(self) -> None:
        """Unregister the hooks (the parameter list changed)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # ------------------------------------------------------------------ helpers
    def _fit_world(self) -> None:
        """Before the first gradient of a step is copied: buffers whose tail has a flag per
        rank of the current world (new buffers when it changed)."""
        world = self._world_size()
        if world != self._world:
            self._detach()
            self._world = world

    def _buffers(self) -> list[torch.Tensor]:
        if not self._flats:
            sizes = self._sizes[:-1] + [self._sizes[-1] + tail_size(self._world) - tail_size(0)]
            last = len(sizes) - 1
            dtype = torch.float32 if self.wire == torch.int8 else self.wire  # (int8: quantized in the sum)
            self._flats = [torch.zeros(n, dtype=torch.float32 if b == last else dtype, device=self.device)
                           for b, n in enumerate(sizes)]
        return self._flats

    def _copy(self, param: torch.Tensor, view: torch.Tensor) -> None:
        """The gradient into its slot, times the pre-scale (no copy when it already lives there)."""
        grad = param.grad if param.grad is None else sharded.local(param.grad)
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():  # accumulated in place into the bucket
            if self._scale != 1.0:
                view.mul_(self._scale)
        else:
            torch.mul(grad.reshape(-1), self._scale, out=view)

    def _is_bucket_view(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.data_ptr()
        return any(f.data_ptr() <= ptr < f.data_ptr() + f.numel() * f.element_size() for f in self._flats)


def counter_values(contribution: tuple, world: int) -> list[float]:
    """A worker's share of the step's counters, ``[valid, join, aside_0 .. aside_{W-1},
    fingerprint slots]``, from its ``(valid, join, aside[, fingerprint, position])`` (see
    :class:`GradientBuckets` and ``ftcomm.runtime.ports.Contribution``)."""
    counts, join, aside, *rest = contribution
    fingerprint, position = (rest + [None, 0])[:2]
    values = [1.0 if counts else 0.0, 1.0 if join else 0.0] + [0.0] * (tail_size(world) - _COUNTERS)
    if aside is not None and 0 <= aside < world:
        values[_COUNTERS + aside] = 1.0
    if fingerprint is not None and 0 <= position < world:
        first = _COUNTERS + world + FINGERPRINT_SLOTS * position
        for slot in range(FINGERPRINT_SLOTS):
            values[first + slot] = float(((fingerprint >> (16 * slot)) & 0xFFFF) + 1)
    return values


def read_counters(values: list[float]) -> tuple[float, float, tuple[int, ...], tuple[int | None, ...]]:
    """The reduced counters (see :func:`counter_values`): contributors, joiners, the ranks
    asking to stand aside, and each position's fingerprint (None where it gave none)."""
    world = (len(values) - _COUNTERS) // (1 + FINGERPRINT_SLOTS)
    asking = tuple(rank for rank, flag in enumerate(values[_COUNTERS:_COUNTERS + world]) if flag > 0.5)
    fingerprints: list[int | None] = []
    for position in range(world):
        first = _COUNTERS + world + FINGERPRINT_SLOTS * position
        slots = [round(v) for v in values[first:first + FINGERPRINT_SLOTS]]
        valid = all(1 <= v <= 0x10000 for v in slots)
        fingerprints.append(sum((v - 1) << (16 * i) for i, v in enumerate(slots)) if valid else None)
    return values[0], values[1], asking, tuple(fingerprints)


def _group(params: list[torch.Tensor], bucket_mb: float, itemsize: int = 4) -> list[list[torch.Tensor]]:
    """Consecutive parameters in buckets of ``itemsize`` bytes an element: the first up to
    FIRST_BUCKET_MB, the rest ``bucket_mb``."""
    groups: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in params:
        current.append(p)
        size += sharded.local(p).numel() * itemsize
        cap = min(FIRST_BUCKET_MB, bucket_mb) if not groups else bucket_mb
        if size >= cap * (1 << 20):
            groups.append(current)
            current, size = [], 0
    if current or not groups:
        groups.append(current)
    return groups


def _hand_back_shard(param: torch.Tensor, flat: torch.Tensor) -> None:
    """A sharded parameter's averaged gradient shard, copied into its gradient (a DTensor
    FSDP2 made; the buffers are renewed under it)."""
    shard = sharded.local(param)
    if param.grad is None:
        param.grad = sharded.dtensor_class().from_local(flat.view_as(shard).to(param.dtype).clone(), param.device_mesh,
                                                param.placements, run_check=False, shape=param.shape,
                                                stride=param.stride())
    else:
        sharded.local(param.grad).copy_(flat.view_as(shard))
