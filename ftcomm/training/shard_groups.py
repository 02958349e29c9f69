"""The gradient step of a model sharded with FSDP2: one cross-replica sum per parameter
group, launched from FSDP2's all-reduce hook.

FSDP2 reduce-scatters a parameter group's gradients within the replica into one flat
tensor and hands it to the group's all-reduce hook (``FSDPModule.set_all_reduce_hook``)
before it cuts the gradient shards out of it as views. The hook here launches that
tensor's sum across the replicas, in place, on the shard communicator (divided by the
number of replicas first): the gradient shards receive the averages, and nothing runs in
Python per parameter, as with DDP's buckets for a plain model.

In place only while nothing reads the tensor before the sum lands. When FSDP2 would divide
it after the hook (a reduce dtype with overflow risk, or summed reductions), cast it
(mixed precision with a reduce dtype other than the parameters'), copy it to host memory
(CPU offload), or add it into gradients that already exist (a second backward pass:
``no_sync``, or ``zero_grad(set_to_none=False)``), the group is *gathered* instead: at the
step its gradient shards are copied into a flat tensor laid out as FSDP2's, reduced, and
copied back. So is a group whose hook did not run in the step (the first step, before the
hooks exist; parameters without gradients count as zeros).

Every member launches the same collectives in the same order whichever way each group
went: one per group, in a fixed order (the FSDP modules in reverse registration order,
the order backward reaches them), each of the group's padded shard size in the
parameters' dtype, then the step's counters (see :mod:`ftcomm.training.buckets`).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

from ..backends.base import Handle
from ..errors import FtcommError
from . import sharded
from .buckets import Suspendable, _hand_back_shard, counter_values

_IN_PLACE_DTYPES = (torch.float32, torch.bfloat16)  # FSDP2 divides neither after the hook


class _Group:
    """One FSDP parameter group: its trainable parameters, and the padded size of each
    one's shard in the group's flat reduce-scatter output."""

    __slots__ = ("fsdp", "params", "sizes", "numel", "dtype")

    def __init__(self, fsdp: Any) -> None:
        trainable = [fp for fp in fsdp.fsdp_params if fp.sharded_param.requires_grad]
        self.fsdp = fsdp
        self.params = [fp.sharded_param for fp in trainable]
        self.sizes = [fp.padded_sharded_param_size.numel() for fp in trainable]
        self.numel = sum(self.sizes)
        self.dtype = self.params[0].dtype


def shard_groups(module: torch.nn.Module, params: list[torch.Tensor]) -> list[_Group] | None:
    """The FSDP parameter groups of ``module`` that hold exactly ``params``, in the order
    backward reduces them; None when this path does not apply (the parameters are not all
    in FSDP groups of ``module``, a module has several groups or an all-reduce hook of its
    own, gradients are offloaded, or a parameter has a post-accumulate-grad hook that
    would read its gradient before the sum lands)."""
    if not params or not all(sharded.is_sharded(p) for p in params):
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - FSDP2 ships with every torch that makes DTensors
        return None
    groups: list[_Group] = []
    for m in reversed(list(module.modules())):
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        fsdp_groups = list(getattr(state, "_fsdp_param_groups", []))
        if len(fsdp_groups) > 1:
            return None
        for fsdp in fsdp_groups:
            if fsdp._all_reduce_hook is not None and not isinstance(fsdp._all_reduce_hook, _Hook):
                return None
            if any(fp.offload_to_cpu for fp in fsdp.fsdp_params):
                return None
            if any(fp.sharded_param.requires_grad for fp in fsdp.fsdp_params):
                groups.append(_Group(fsdp))
    held = [p for g in groups for p in g.params]
    if len(held) != len(params) or {id(p) for p in held} != {id(p) for p in params}:
        return None
    if any(getattr(p, "_post_accumulate_grad_hooks", None) for p in held):
        return None
    if len({sharded.local(p).device for p in held}) != 1:
        return None
    return groups


class _Hook(functools.partial):
    """The all-reduce hook installed on a group (a type of its own, so that a later
    :func:`shard_groups` recognises it as ftcomm's)."""


class ShardGroupBuckets(Suspendable):
    """The gradient step of a sharded model, one bucket per FSDP parameter group: the same
    interface as :class:`~ftcomm.training.buckets.GradientBuckets` (``launch``,
    ``may_overlap``, ``world_size``, ``contribution`` as there). Inside ``no_sync()``
    nothing goes across replicas (FSDP2 still reduce-scatters within the replica, and adds
    into the gradient shards)."""

    def __init__(self, groups: list[_Group], params: list[torch.Tensor], launch: Callable[[torch.Tensor], Handle],
                 may_overlap: Callable[[], bool], world_size: Callable[[], int],
                 contribution: Callable[[bool], tuple[bool, bool, int | None]] = lambda valid: (valid, False, None),
                 watch: list[torch.Tensor] | None = None) -> None:
        self.params = params
        self._groups = groups
        self._watch = watch if watch is not None else params
        self._mask = [p.requires_grad for p in self._watch]
        self.device = sharded.local(params[0]).device
        self._launch, self._may_overlap, self._world_size = launch, may_overlap, world_size
        self._contribution = contribution
        self._lock = threading.Lock()  # hooks may run on autograd's device threads
        for index, group in enumerate(groups):
            group.fsdp._all_reduce_hook = _Hook(self._on_output, index)
        self._new_step()

    def _new_step(self) -> None:
        self._lost = False
        self._started = False
        self._stale = False  # the parameters changed since these buckets were made: nothing in backward
        self._overlapping = False
        self._world = 1
        self._outputs: dict[int, torch.Tensor] = {}  # FSDP2's reduce outputs taken in place
        self._gathered: set[int] = set()  # groups whose shards are copied into their flat at the step
        self._flats: list[torch.Tensor] = []  # what was launched, in order
        self._versions: list[int] = []
        self._handles: list[Handle] = []
        self._counters: torch.Tensor | None = None
        self._fresh = False  # the flats are zeros reduced in the gradients' place
        self._accumulated = False
        self._error: BaseException | None = None

    @property
    def bucket_count(self) -> int:
        return len(self._groups)

    @property
    def touched(self) -> bool:
        return bool(self._handles)

    @property
    def lost(self) -> bool:
        return self._lost

    # ------------------------------------------------------------------ during backward
    def _on_output(self, index: int, output: torch.Tensor) -> None:
        with self._lock:
            try:
                self._take(index, output)
            except Exception as exc:  # noqa: BLE001 - never raise into autograd; finish reports it
                self._error, self._overlapping = exc, False

    def _take(self, index: int, output: torch.Tensor) -> None:
        group = self._groups[index]
        if index < len(self._flats):
            # Another backward pass into a group whose sum is under way (its shards are views
            # of it): FSDP2 is about to add into them. They become tensors of their own first,
            # so the sum the others receive stays this member's first pass; the step is refused.
            for p in group.params:
                if p.grad is not None:
                    p.grad = p.grad.detach().clone()
            self._accumulated, self._overlapping = True, False
            return
        if self._suspended:
            return
        if not self._started:
            self._started = True
            # Once a step (not per hook): parameters frozen or unfrozen, or a hook that would
            # read a gradient before its sum lands, since these buckets were made: nothing is
            # launched or taken in place in this backward (new buckets gather it at the step).
            self._stale = [p.requires_grad for p in self._watch] != self._mask or any(
                getattr(p, "_post_accumulate_grad_hooks", None) for p in self.params)
            self._overlapping = not self._stale and self._may_overlap()
            if self._overlapping:
                self._world = self._world_size()
        if self._stale or index in self._outputs or index in self._gathered:
            return  # (taken already: a second backward pass before anything was launched adds into the shards)
        # In place only when FSDP2 will only cut views out of it: same dtype, no division after
        # the hook, and no gradient shard of the group to add it into (one read per parameter).
        if (output.numel() == group.numel and output.dtype == group.dtype and output.dtype in _IN_PLACE_DTYPES
                and not group.fsdp.force_sum_reduction_for_comms and all(p.grad is None for p in group.params)):
            self._outputs[index] = output
        else:
            self._gathered.add(index)
        if self._overlapping:
            self._launch_ready(valid=True)

    def _launch_ready(self, valid: bool) -> None:
        """Launch, in group order, every group taken in place after the ones launched."""
        while len(self._flats) < len(self._groups) and len(self._flats) in self._outputs:
            self._start(self._outputs[len(self._flats)])
        if len(self._flats) == len(self._groups) and self._counters is None:
            self._counters = torch.tensor(counter_values(self._contribution(valid), self._world),
                                          dtype=torch.float32, device=self.device)
            self._handles.append(self._launch(self._counters))

    def _start(self, flat: torch.Tensor) -> None:
        flat.div_(self._world)
        self._flats.append(flat)
        self._handles.append(self._launch(flat))
        self._versions.append(flat._version)

    # ------------------------------------------------------------------ at the step
    def finish(self, valid: bool) -> tuple[list[Handle], torch.Tensor]:
        """Launch what backward did not; the handles of every group, and the counters.
        ``valid`` False: zeros are reduced in the gradients' place (see GradientBuckets)."""
        with self._lock:
            error, accumulated = self._error, self._accumulated
            accumulated = accumulated or any(f._version != v for f, v in zip(self._flats, self._versions))
            if error is not None or accumulated:
                self._renew()
            if error is not None:
                raise error
            if accumulated:
                raise FtcommError("gradients changed after backward began reducing them: more than one backward "
                                  "pass before wait_gradients_ready (run all but the last inside `with "
                                  "ft.no_sync():`, or start the group with overlap=False), or code that modified "
                                  ".grad before it")
            if not valid and self.touched:
                raise FtcommError("a step already being reduced cannot be marked invalid")
            if not self._handles:
                self._world = self._world_size()
            for index in range(len(self._flats), len(self._groups)):
                if not valid:
                    self._fresh = True
                    flat = torch.zeros(self._groups[index].numel, dtype=self._groups[index].dtype, device=self.device)
                elif index in self._outputs:
                    flat = self._outputs[index]
                else:
                    self._gathered.add(index)
                    flat = self._gather(self._groups[index])
                self._start(flat)
            self._launch_ready(valid)
            return list(self._handles), self._counters

    def _gather(self, group: _Group) -> torch.Tensor:
        """The group's gradient shards in a flat tensor laid out as FSDP2's reduce output."""
        flat = torch.zeros(group.numel, dtype=group.dtype, device=self.device)
        offset = 0
        for p, size in zip(group.params, group.sizes):
            if p.grad is not None:
                shard = sharded.local(p.grad).reshape(-1)
                flat[offset:offset + shard.numel()].copy_(shard)
            offset += size
        return flat

    def hand_back(self, contributors: float) -> None:
        """Turn the sums into averages over ``contributors``; give them to the gradient
        shards that are not already views of them."""
        correction = self._world / contributors
        for index, (group, flat) in enumerate(zip(self._groups, self._flats)):
            if abs(correction - 1.0) > 1e-9:
                flat.mul_(correction)
            if self._fresh or index in self._gathered or not self._is_view(group, flat):
                self._give(group, flat)
        self._new_step()

    @staticmethod
    def _is_view(group: _Group, flat: torch.Tensor) -> bool:
        """The group's gradient shards live in ``flat`` (else the sums are copied in). Taken
        in place only when no shard held a gradient, so FSDP2 made every one a view of it:
        the first tells whether they were replaced since (set to None, or assigned)."""
        grad = group.params[0].grad
        return grad is not None and sharded.local(grad).untyped_storage().data_ptr() == flat.untyped_storage(
        ).data_ptr()

    @staticmethod
    def _give(group: _Group, flat: torch.Tensor) -> None:
        offset = 0
        for p, size in zip(group.params, group.sizes):
            _hand_back_shard(p, flat[offset:offset + sharded.local(p).numel()])
            offset += size

    def discard(self) -> None:
        """After a failed step: gradients detached from what was being reduced."""
        with self._lock:
            self._renew()

    def drop(self) -> None:
        """The view re-formed after backward began reducing: as :meth:`discard`, and the
        step is :attr:`lost`."""
        with self._lock:
            self._renew()
            self._lost = True

    def _renew(self) -> None:
        """Gradient shards become tensors of their own (an abandoned collective may still
        write into FSDP2's reduce outputs); FSDP2 makes new ones at the next backward."""
        for p in self.params:
            if p.grad is not None:
                p.grad = p.grad.detach().clone()
        self._new_step()

    def remove(self) -> None:
        """This step path is no longer used: the groups' hooks go."""
        for group in self._groups:
            hook = group.fsdp._all_reduce_hook
            if isinstance(hook, _Hook) and hook.func == self._on_output:
                group.fsdp._all_reduce_hook = None
