"""Gradients through DDP's C++ reducer, reduced over ftcomm's abortable communicators.

``ft.wrap(model)`` returns a :class:`DistributedDataParallel`: torch's DDP, whose reducer
(C++ autograd hooks, gradients accumulated straight into flat buckets) does every
per-parameter step of the gradient path, and whose communication hook hands each bucket,
once complete, to the current view's communicator. Nothing runs in Python per parameter;
per bucket, one hook call.

Three things make DDP's reducer fit an elastic group:

- *Its process group is a placeholder* (:class:`_Placeholder`): DDP never communicates
  through it (the comm hook reduces, ``init_sync`` and ``broadcast_buffers`` are off),
  except when it settles its bucket layout, and there the placeholder answers with
  ftcomm's layout.
- *One bucket layout on every member, from the first step.* DDP rebuilds its buckets
  after the first backward, in the order this process saw gradients arrive, and makes
  every rank adopt rank 0's by a broadcast. An elastic group has no fixed rank 0, and a
  member that joins later runs its first step when the others run their thousandth: its
  buckets must already match theirs. So the reducer is asked to rebuild at its first
  forward, and the placeholder's "broadcast" supplies :func:`bucket_layout` (reversed
  registration order, DDP's own size rule: 1 MB first, then ``bucket_mb``), which depends
  only on the parameters.
- *Fresh buckets after a failed step*: an abandoned collective may still write into the
  buffers it was given, so after a step that fails the reducer is reset and rebuilds
  (new buffers) at the next forward, and the gradients are detached from the old ones.

The step's counters (``[valid, join, aside_0 .. aside_{W-1}]``, see
:mod:`ftcomm.training.buckets`) are reduced in a small tensor of their own right after
the last bucket, on the same communicator.

Each bucket is divided by the world size before its allreduce (as DDP's default hook
does); :meth:`ReducerBuckets.hand_back` corrects the average when fewer members
contributed.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..backends.base import Handle
from ..errors import FtcommError
from .buckets import FIRST_BUCKET_MB, counter_values


def bucket_layout(params: list[torch.Tensor], bucket_mb: float) -> list[list[int]]:
    """The buckets, as indices into ``params``, in the order they are reduced: parameters
    in reversed registration order (the order backward produces their gradients), one
    dtype per bucket, the first up to FIRST_BUCKET_MB and the others up to ``bucket_mb``."""
    reverse = list(reversed(params))
    limits = [int(min(FIRST_BUCKET_MB, bucket_mb) * (1 << 20)), int(bucket_mb * (1 << 20))]
    groups, _ = dist._compute_bucket_assignment_by_size(reverse, limits, [False] * len(reverse))
    last = len(params) - 1
    return [[last - i for i in group] for group in groups]


def _completed_work(result: Any) -> Any:
    future = torch.futures.Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)


class _Placeholder(dist.ProcessGroup):
    """The process group DDP is built over: nothing goes through it but the reducer's one
    bucket-layout broadcast (answered with ``layout``) and the parameter-shape check at
    construction (every member builds the same model; ftcomm checks that when joining).
    It calls itself rank 1 so that the reducer reads the layout back from the broadcast."""

    def __init__(self, layout: list[list[int]]) -> None:
        super().__init__(1, 2)
        self.layout = layout
        self._sizes_next = False

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "ftcomm-placeholder"

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for out, tensor in zip(outputs, inputs):
            for o in out:
                o.copy_(tensor)
        return _completed_work(outputs)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        tensor = tensors[0]
        flat = [i for group in self.layout for i in group]
        if not self._sizes_next and tensor.dim() == 1 and tensor.numel() == len(flat) + 1:
            values = flat + [len(self.layout)]  # the parameters' indices, then the number of buckets
        elif self._sizes_next and tensor.dim() == 1 and tensor.numel() == len(self.layout):
            values = [len(group) for group in self.layout]  # parameters per bucket
        else:
            raise FtcommError(f"DDP's reducer in torch {torch.__version__} settles its buckets in a way ftcomm "
                              f"does not know (a broadcast of {list(tensor.shape)}); use wait_gradients_ready "
                              "on the unwrapped model")
        tensor.copy_(torch.tensor(values, dtype=tensor.dtype))
        self._sizes_next = not self._sizes_next
        return _completed_work(tensors)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        raise FtcommError("a DDP wrapped by ftcomm reduces only through ftcomm's communicator "
                          "(find_unused_parameters and SyncBatchNorm are not supported)")


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch's DistributedDataParallel whose gradients ftcomm averages over its view: made
    by :meth:`ftcomm.FaultTolerantGroup.wrap`. Use it as DDP (``module``, ``no_sync``,
    state dicts with ``module.`` in their keys) and call ``ft.wait_gradients_ready`` with
    it after backward. Every parameter that requires a gradient must get one in every step
    (as DDP with ``find_unused_parameters=False``)."""

    def __init__(self, module: torch.nn.Module, bucket_mb: float) -> None:
        if not any(p.requires_grad for p in module.parameters()):
            raise FtcommError("wrap needs a module with a parameter that requires a gradient")
        placeholder = _Placeholder([])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            super().__init__(module, process_group=placeholder, bucket_cap_mb=bucket_mb, broadcast_buffers=False,
                             init_sync=False, gradient_as_bucket_view=True)
        parameters, sparse = self._build_params_for_reducer()
        if any(sparse):
            raise FtcommError("wrap does not take parameters with sparse gradients (an Embedding with sparse=True): "
                              "use wait_gradients_ready on the unwrapped model")
        placeholder.layout = bucket_layout(parameters, bucket_mb)
        self.reducer._push_all_rebuilt_params()  # the layout is settled at the first forward
        self._ftcomm_params = parameters
        self._ftcomm_layout = placeholder.layout
        self._ftcomm_route = _Route()
        self._ftcomm_forwarded = False  # a forward pass ran through this wrapper since the last step
        self._ftcomm_retired = False
        self.register_comm_hook(self._ftcomm_route, _route)
        earlier = _WRAPPERS.get(module)
        if earlier is not None and earlier() is not None:
            earlier()._ftcomm_retire()  # two reducers would fight over the gradients
        _WRAPPERS[module] = weakref.ref(self)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._ftcomm_retired:
            raise FtcommError("this wrapper was replaced by a later ft.wrap of the same module: use that one")
        self._ftcomm_forwarded = True
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as exc:
            if "finished reduction in the prior iteration" not in str(exc):
                raise
            self._ftcomm_rebuild()  # the next forward starts afresh
            raise FtcommError("the last backward through the wrapped model left some parameters without a "
                              "gradient and no wait_gradients_ready followed: every parameter that requires a "
                              "gradient must get one in every step (freeze the others, requires_grad=False, or "
                              "call wait_gradients_ready on the unwrapped model)") from None

    def _ftcomm_rebuild(self) -> None:
        """Forget the step in progress; new buckets (new buffers) at the next forward."""
        self.reducer._reset_state()
        self.reducer._push_all_rebuilt_params()

    def _ftcomm_retire(self) -> None:
        """A later wrapper of the same module takes over: this one's reducer goes (and with
        it the hooks on the parameters); its forward refuses from now on."""
        self._ftcomm_retired = True
        self._ftcomm_route.target = None
        self.reducer = self.logger = None


_WRAPPERS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


class _Route:
    """Where a wrapped model's comm hook sends each bucket: the step path of the group
    that wrapped it (none yet or any more: the bucket is left as it is). Held weakly: the
    reducer keeps this object from C++, where the garbage collector cannot see a cycle."""

    def __init__(self) -> None:
        self._target: weakref.WeakMethod | None = None

    @property
    def target(self) -> Callable[[Any], Any] | None:
        return None if self._target is None else self._target()

    @target.setter
    def target(self, method: Callable[[Any], Any] | None) -> None:
        self._target = None if method is None else weakref.WeakMethod(method)


def _route(state, bucket):  # no annotations: DDP compares them with its own types
    target = state.target
    if target is None:
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    return target(bucket)


class ReducerBuckets:
    """The gradient step of a :class:`DistributedDataParallel`: the same interface as
    :class:`~ftcomm.training.buckets.GradientBuckets` (``launch``, ``may_overlap``,
    ``world_size``, ``contribution`` as there), on DDP's buckets."""

    def __init__(self, net: DistributedDataParallel, launch: Callable[[torch.Tensor], Handle],
                 may_overlap: Callable[[], bool], world_size: Callable[[], int],
                 contribution: Callable[[bool], tuple[bool, bool, int | None]] = lambda valid: (valid, False, None)
                 ) -> None:
        self.net = net
        self.params = list(net._ftcomm_params)
        self._launch, self._may_overlap, self._world_size = launch, may_overlap, world_size
        self._contribution = contribution
        self._layout = net._ftcomm_layout
        self._lock = threading.Lock()
        net._ftcomm_route.target = self._on_bucket
        self._new_step()

    def _new_step(self) -> None:
        self.net._ftcomm_forwarded = False
        self._lost = False
        self._started = False
        self._overlapping = False
        self._world = 1
        self._buffers: list[torch.Tensor] = []  # this step's buckets, in order, as the reducer handed them
        self._versions: list[int] = []  # each launched bucket's version once launched: a later write changes it
        self._handles: list[Handle] = []
        self._counters: torch.Tensor | None = None
        self._fresh: list[torch.Tensor] | None = None  # zeros reduced in the buckets' place (valid=False)
        self._accumulated = False
        self._error: BaseException | None = None

    @property
    def bucket_count(self) -> int:
        return len(self._layout)

    @property
    def touched(self) -> bool:
        return bool(self._handles)

    @property
    def lost(self) -> bool:
        return self._lost

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.net.no_sync():
            yield

    # ------------------------------------------------------------------ during backward
    def _on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        with self._lock:
            try:
                self._take(bucket.index(), buffer)
            except Exception as exc:  # noqa: BLE001 - never raise into autograd; finish reports it
                self._error, self._overlapping = exc, False
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)  # the reduction runs on; wait_gradients_ready waits for it
        return done

    def _take(self, index: int, buffer: torch.Tensor) -> None:
        if not self._started:
            self._started = True
            self._overlapping = self._may_overlap()
            if self._overlapping:
                self._world = self._world_size()
        if index != len(self._buffers):  # a second backward before the step
            if self._handles:  # the first one's buckets are being reduced already
                self._accumulated, self._overlapping = True, False
            return  # else its buckets are the same buffers, accumulated in place: reduced at the step
        self._buffers.append(buffer)
        if self._overlapping:
            buffer.div_(self._world)
            self._handles.append(self._launch(buffer))
            self._versions.append(buffer._version)  # after the launch (which may count as a write)
            if len(self._buffers) == len(self._layout):
                self._launch_counters(valid=True)

    def _launch_counters(self, valid: bool) -> None:
        self._counters = torch.tensor(counter_values(self._contribution(valid), self._world), dtype=torch.float32,
                                      device=self.params[0].device)
        self._handles.append(self._launch(self._counters))

    # ------------------------------------------------------------------ at the step
    def finish(self, valid: bool) -> tuple[list[Handle], torch.Tensor]:
        """Launch what backward did not; the handles of every bucket, and the counters.

        ``valid`` False (this worker's gradients were computed on state just replaced, or
        went with the old view): zeros are reduced in the buckets' place, and
        :meth:`hand_back` gives the averages to the gradients.
        """
        with self._lock:
            error, accumulated = self._error, self._accumulated
            # A backward through a retained graph writes into buckets already launched, and
            # DDP's reducer, done for this iteration, calls no hook: their versions tell.
            accumulated = accumulated or any(b._version != v for b, v in zip(self._buffers, self._versions))
            if error is not None or accumulated:
                self._renew()
            if error is not None:
                raise error
            if accumulated:
                raise FtcommError("gradients changed after backward began reducing them: more than one backward "
                                  "pass before wait_gradients_ready (run all but the last inside `with "
                                  "model.no_sync():` or ft.no_sync()), or code that modified .grad before it")
            if not valid:
                if self.touched:
                    raise FtcommError("a step already being reduced cannot be marked invalid")
                self._world = self._world_size()
                self._fresh = self._zeros(self._layout)
                self._handles = [self._launch(buffer) for buffer in self._fresh]
                self._launch_counters(valid=False)
            elif len(self._buffers) != len(self._layout):
                # The members launch the same collectives all the same (zeros, counted as none),
                # so that the others' step completes; then the error.
                message = self._missing_message()
                if not self._handles:
                    self._world = self._world_size()
                for buffer in self._zeros(self._layout[len(self._handles):]):
                    self._handles.append(self._launch(buffer))
                self._launch_counters(valid=False)
                self._renew()
                raise FtcommError(message)
            elif not self._handles:  # backward did not reduce (overlap off, or the view had to change first)
                self._world = self._world_size()
                for buffer in self._buffers:
                    buffer.div_(self._world)
                    self._handles.append(self._launch(buffer))
                self._launch_counters(valid=True)
            return list(self._handles), self._counters

    def _zeros(self, groups: list[list[int]]) -> list[torch.Tensor]:
        """Zeros laid out as the buckets of ``groups``."""
        return [torch.zeros(sum(self.params[i].numel() for i in group), dtype=self.params[group[0]].dtype,
                            device=self.params[group[0]].device) for group in groups]

    def _missing_message(self) -> str:
        if not self.net._ftcomm_forwarded:
            return ("no gradient of the wrapped model reached wait_gradients_ready: run the forward pass through "
                    "the object ft.wrap returned (not its .module), then backward, before it")
        names = {id(p): n for n, p in self.net.module.named_parameters()}
        waiting = [self.params[i] for i in self._layout[len(self._buffers)]]  # the first bucket not complete
        without = [p for p in waiting if p.grad is None] or waiting
        named = [names.get(id(p), "?") for p in without]
        return ("some parameters of the wrapped model got no gradient in this step (among: "
                f"{', '.join(named[:8])}{' ...' if len(named) > 8 else ''}): every parameter that requires a "
                "gradient must get one in every step; freeze the others (requires_grad=False) or call "
                "wait_gradients_ready on the unwrapped model")

    def hand_back(self, contributors: float) -> None:
        """Turn the sums into averages over ``contributors`` (the gradients already are the
        buckets; after a lost step, the averages are copied into them)."""
        correction = self._world / contributors
        buffers = self._fresh if self._fresh is not None else self._buffers
        if abs(correction - 1.0) > 1e-9:
            for buffer in buffers:
                buffer.mul_(correction)
        if self._fresh is not None:
            self._give(self._fresh)
        self._new_step()

    def _give(self, buffers: list[torch.Tensor]) -> None:
        """Each parameter's gradient from ``buffers`` (laid out as the buckets); the reducer
        copies them into its new buckets at the next forward."""
        for group, buffer in zip(self._layout, buffers):
            offset = 0
            for i in group:
                p = self.params[i]
                n = p.numel()
                p.grad = buffer[offset:offset + n].view_as(p)
                offset += n

    def discard(self) -> None:
        """After a failed step (see :meth:`_renew`)."""
        with self._lock:
            self._renew()

    def drop(self) -> None:
        """The view re-formed after backward began reducing: as :meth:`discard`, and the
        step is :attr:`lost` (its gradients count as none)."""
        with self._lock:
            self._renew()
            self._lost = True

    def _renew(self) -> None:
        """After a failed step: gradients detached from the buckets (an abandoned collective
        may still write there), the reducer reset, new buckets from the next forward."""
        for p in self.params:
            if p.grad is not None:
                p.grad = p.grad.detach().clone()
        self.net._ftcomm_rebuild()
        self._new_step()

    def remove(self) -> None:
        """This step path is no longer used: the model's buckets route nowhere."""
        if self.net._ftcomm_route.target == self._on_bucket:
            self.net._ftcomm_route.target = None
