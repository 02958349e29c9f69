"""Low-communication training: DiLoCo and LocalSGD over an elastic group.

Each worker trains its own copy of the model for ``sync_every`` inner steps with its inner
optimizer, without talking to anyone; then an *outer step* runs across the group: every
worker's pseudo-gradient (the global model minus its local model) is averaged over the
view, the outer optimizer applies it to the global model (DiLoCo: SGD with Nesterov
momentum; LocalSGD: SGD with a learning rate of 1, which is parameter averaging), and every
worker starts its next inner steps from the new global model. One averaging per
``sync_every`` steps instead of one per step: ``sync_every`` times fewer bytes.

The outer step is the group's committed step (``ft.step`` counts outer steps), so it has
the same fault semantics as a training step of the gradient path:

* the pseudo-gradients are averaged through ``wait_gradients_ready``: a crash, hang or
  leave during the averaging aborts it within milliseconds of the news, and the outer
  step commits on every member of the view or on none;
* what must be identical on every worker is the *global* model and the outer
  optimizer's state (registered: ``ft.register_state(diloco=diloco, sampler=sampler)``);
  each worker's drifting local model and its inner optimizer are its own. A joiner
  receives the global model and the outer state, never a member's local model, and is
  admitted at an outer boundary only;
* a discarded outer step (the view changed during it) is done again in the new view:
  every worker goes back to the global model and to its inner optimizer's state at the
  last outer step, and an :class:`ftcomm.ElasticSampler` plans that step's inner batches
  again over the new world, so every sample is consumed exactly once by committed outer
  steps. A worker that died took its pseudo-gradient with it; keeping the survivors'
  without its samples would lose those samples, so the inner steps are computed again:
  a failure costs up to ``sync_every`` inner steps of compute, never a sample or a model
  mixed from two outer steps;
* a partitioned minority goes on with its inner steps but commits no outer step (the
  quorum rule of every step).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import FtcommError
from . import sharded

log = logging.getLogger(__name__)


class DiLoCo:
    """DiLoCo over the group ``group``: ``model`` trained ``sync_every`` inner steps at a time
    with ``inner_optimizer``, then one outer step of ``outer_optimizer`` on the averaged
    pseudo-gradients.

    ``outer_optimizer`` is built over ``model.parameters()`` (as the DiLoCo paper's
    ``torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)``); it is
    moved onto the global model, a copy of the parameters this object keeps (one more
    copy of the parameters in memory, on their device, plus the outer optimizer's state).

    Register it instead of the model and the optimizers, with the sampler:
    ``ft.register_state(diloco=diloco, sampler=sampler)``. A registered
    :class:`ftcomm.ElasticSampler` then yields one batch per inner step and plans each
    outer step as ``sync_every`` global batches (fewer at the end of an epoch: the outer
    step comes after the epoch's last inner batch); without a sampler the outer step
    comes after every ``sync_every`` calls of :meth:`step`.

    The inner optimizer's state is saved (on the host) at each outer step and restored
    when an outer step is discarded. The model's buffers (batch-norm statistics) are each
    worker's own, as with ``DistributedDataParallel(broadcast_buffers=False)``.

    ``fragments`` > 1 is Streaming DiLoCo: the parameters are cut, in the model's order,
    into that many consecutive fragments of about equal size, and the outer steps take
    them in turn, one every ``sync_every / fragments`` inner steps, so that each fragment
    still has its outer step every ``sync_every`` inner steps while the bytes of one outer
    step (and the peak on the link) are ``fragments`` times smaller. Each outer step is a
    committed step of the group, between two inner steps (not overlapped with them). A
    discarded one goes back to the local model of the last outer step (one more copy of
    the parameters, kept on their device) and does its ``sync_every / fragments`` inner
    steps again. A worker that is lost takes with it what its inner steps since their
    fragments' last outer steps would have given the other fragments: their samples count
    in the fragments that had their outer steps since, not in those.

    ``quantize``: the dtype the pseudo-gradients are summed in across the group: None
    (float32), ``"bf16"`` or ``"fp16"`` (half the bytes; the sum in 8 or 11 bits of
    mantissa), ``"int8"`` (a quarter: 8-bit integers with a float32 scale per 256
    elements, summed in float32 by one member per chunk and exchanged again in int8; the
    same on every member; see ``wait_gradients_ready``'s ``wire_dtype``). The outer
    optimizer steps in the parameters' dtype.

    ``delay`` > 0 overlaps each outer step's reduction with the last ``delay`` inner steps
    of its interval (Streaming DiLoCo's overlapping communication; fewer than
    ``sync_every / fragments``): the fragment's pseudo-gradient is taken ``delay`` inner
    steps before the outer step is due and sent at once (with the group's ``overlap`` on,
    from the second outer step: the first builds the buckets), the inner steps go on
    while it travels, and the outer step waits for it and commits where it was due. The
    fragment's local parameters then become the new global ones *plus* what those
    ``delay`` inner steps changed in them since the pseudo-gradient was taken, so that
    their samples count in the fragment's next outer step (none is lost to the overlap).
    The step's counters go out only at the due step (``wait_gradients_ready``'s
    ``sent_early``): a worker lost before it never counts, and the outer step is then
    discarded as any other: every member goes back to its local model of the last outer
    step (kept, one more copy of the parameters, on their device) and does the step's
    inner steps again. With ``"int8"`` only the first of its two exchanges overlaps (the
    second starts at the wait). Every worker may use its own ``delay``.
    """

    def __init__(self, group: Any, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 outer_optimizer: torch.optim.Optimizer, sync_every: int, fragments: int = 1,
                 quantize: str | None = None, delay: int = 0) -> None:
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive number of inner steps, got {sync_every!r}")
        if not isinstance(fragments, int) or fragments < 1 or sync_every % fragments:
            raise ValueError(f"fragments must be a positive divisor of sync_every ({sync_every}), got {fragments!r}: "
                             f"each fragment's outer step comes every sync_every inner steps, one fragment every "
                             f"sync_every / fragments")
        if not isinstance(delay, int) or isinstance(delay, bool) or not 0 <= delay < sync_every // fragments:
            raise ValueError(f"delay must be a number of inner steps from 0 to sync_every / fragments - 1 "
                             f"({sync_every // fragments - 1}), got {delay!r}: the outer step's reduction overlaps "
                             f"that many of the inner steps before it is due")
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize is one of {', '.join(map(repr, QUANTIZE))}, got {quantize!r}")
        if outer_optimizer is inner_optimizer:
            raise ValueError("the outer optimizer must be another optimizer than the inner one")
        self.group, self.model = group, model
        self.inner_optimizer, self.outer_optimizer = inner_optimizer, outer_optimizer
        self.sync_every, self.fragments, self.quantize, self.delay = sync_every, fragments, quantize, delay
        self.syncs = 0  # outer steps committed since this object was made (not registered state)
        self._names = [name for name, _ in model.named_parameters()]
        self._local = [p for _, p in model.named_parameters()]
        if not self._local:
            raise ValueError("the model has no parameters")
        self._parts = _split(self._local, fragments)
        with torch.no_grad():
            self._global = [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in self._local]
        self._move_outer_optimizer()
        self._interval = sync_every // fragments  # inner steps between two outer steps (of two fragments)
        self._outer_steps = 0  # committed outer steps (registered: which fragment is next)
        self._inner_steps = 0  # inner steps since the last outer step (without a sampler)
        self._sampler: Any = None
        self._sent: tuple[list[int], list[torch.Tensor]] | None = None  # (fragment, its local values) sent early
        self._inner_saved = _to_host(self.inner_optimizer.state_dict())
        self._local_saved = self._snapshot()
        self._carrier = self._make_carrier()

    def _make_carrier(self) -> torch.Tensor | None:
        """With fragments, the one flat float32 tensor whose gradient carries any fragment's
        pseudo-gradients (the largest fragment's size, frozen parameters' places included):
        every outer step reduces the same layout, whichever fragment a member takes, so that a
        member whose state is replaced inside the step (its turn was another; it contributes
        nothing then) still meets the others' reduction. None for one fragment."""
        if self.fragments == 1:
            return None
        size = max(sum(sharded.local(self._local[i]).numel() for i in part) for part in self._parts)
        device = sharded.local(self._local[0]).device
        carrier = torch.zeros(size, dtype=torch.float32, device=device, requires_grad=True)
        carrier.grad = torch.zeros_like(carrier)
        return carrier

    def _move_outer_optimizer(self) -> None:
        """Point the outer optimizer's parameter groups at the global model."""
        if self.outer_optimizer.state:
            raise ValueError("the outer optimizer already holds state: build it fresh over model.parameters()")
        index = {id(p): g for p, g in zip(self._local, self._global)}
        for group in self.outer_optimizer.param_groups:
            try:
                group["params"] = [index[id(p)] for p in group["params"]]
            except KeyError:
                raise ValueError("the outer optimizer holds a tensor that is not a parameter of the model: build it "
                                 "over model.parameters()") from None

    # ------------------------------------------------------------------ training
    def step(self) -> bool | None:
        """An inner step: the inner optimizer steps (and its gradients are zeroed). When the
        outer step is due, it runs across the group: True when it committed (the model now
        holds the new global model), False when it was discarded (the model is back at the
        global model, to do the outer step's inner steps again in the new view; with a
        sampler their batches are planned again). None between outer steps."""
        share = None
        if self._sampler is not None:
            self._sampler.inner_step_done()  # (FtcommError when no batch of it was drawn for this step)
            share = self._sampler.current_share()
        if share is None or share.count:  # an empty share (an epoch's tiny last batch) moves nothing
            self.inner_optimizer.step()
        self.inner_optimizer.zero_grad(set_to_none=True)
        self._inner_steps += 1
        if self.delay and self._sent is None:
            left = self._sampler.inner_steps_left() if self._sampler is not None \
                else self._interval - self._inner_steps
            if 0 < left <= self.delay:
                self._send()
        due = self._sampler.step_drawn() if self._sampler is not None else self._inner_steps >= self._interval
        if not due:
            return None
        self._inner_steps = 0
        committed = self._outer_step()
        self.group.step_boundary()  # a joiner agreed by this outer step is admitted before the next inner step
        return committed

    @property
    def in_flight(self) -> bool:
        """An outer step's pseudo-gradients were handed to the group ahead of it (``delay``)
        and its inner steps go on: True until the outer step is due. They travel meanwhile
        when the group's ``overlap`` is on and its buckets exist (from the second outer
        step), else they go at the due step."""
        return self._sent is not None

    @property
    def next_fragment(self) -> int:
        """The fragment whose outer step comes next (0 when the model is one fragment)."""
        return self._outer_steps % self.fragments

    def _outer_step(self) -> bool:
        if self._sent is not None:  # taken and sent delay inner steps ago
            (part, kept), self._sent = self._sent, None
            reduced = self._reduced(part)
        else:
            part, kept = self._parts[self.next_fragment], None
            reduced = self._pseudo_gradients(part)
        # (counters apart whatever the delay: every member reduces the same buckets, and a
        # worker may choose its own delay)
        committed = self.group.wait_gradients_ready(reduced, wire_dtype=QUANTIZE[self.quantize], sent_early=True)
        if committed and self._carrier is not None:  # the turn of the state as it is now: another if it was
            turn = self._parts[self.next_fragment]  # replaced during the step
            if turn is not part:
                kept = None
            part = self._unpack(part, turn)
        if committed:
            self.outer_optimizer.step()  # (the other fragments' parameters have no gradient: untouched)
            self.syncs += 1
            self._outer_steps += 1
        self.outer_optimizer.zero_grad(set_to_none=True)
        if committed:
            self._inner_saved = _to_host(self.inner_optimizer.state_dict())
            self._to_global(part, kept)
            self._local_saved = self._snapshot()
        else:
            log.info("outer step discarded: the view changed during it; its inner steps run again from the model "
                     "of step %d", self.group.step)
            self._rewind()
        return committed

    def _pseudo_gradients(self, part: list[int]) -> list[torch.Tensor]:
        """The fragment's pseudo-gradients (the global model minus the local one) set as the
        gradients of what the outer step reduces (see :meth:`_reduced`)."""
        for i in part:
            self._global[i].requires_grad_(self._local[i].requires_grad)  # (a parameter frozen or unfrozen since)
        with torch.no_grad():
            for i in part:
                g = self._global[i]
                if g.requires_grad:
                    g.grad = g.detach() - self._local[i].detach()
        if self._carrier is not None:
            self._pack(part)
        return self._reduced(part)

    def _reduced(self, part: list[int]) -> list[torch.Tensor]:
        """What the outer step of ``part`` reduces: the fragment's trainable global parameters,
        or the carrier (with fragments)."""
        if self._carrier is not None:
            return [self._carrier]
        return [self._global[i] for i in part if self._global[i].requires_grad]

    def _send(self) -> None:
        """Take the next fragment's pseudo-gradients now and hand them to the group's gradient
        hooks, which start their reduction at once (see ``delay``); keep the fragment's local
        values, to add what the inner steps until the outer step change in them."""
        part = self._parts[self.next_fragment]
        reduced = self._pseudo_gradients(part)
        with torch.no_grad():
            kept = [self._local[i].detach().clone() for i in part]
        grads = [t.grad for t in reduced]
        for t in reduced:
            t.grad = None
        if reduced:
            torch.autograd.backward(reduced, grads)  # accumulated into .grad, and the hooks run
        self._sent = (part, kept)

    def _pack(self, part: list[int]) -> None:
        """The fragment's pseudo-gradients into the carrier's gradient, in order (zeros for a
        frozen parameter and after the fragment)."""
        flat, offset = self._carrier.grad, 0
        flat.zero_()
        with torch.no_grad():
            for i in part:
                g = self._global[i]
                n = sharded.local(g).numel()
                if g.grad is not None:
                    flat[offset:offset + n].copy_(sharded.local(g.grad).reshape(-1))
                offset += n

    def _unpack(self, sent: list[int], part: list[int]) -> list[int]:
        """The averaged carrier into the gradients of ``part``'s trainable parameters (none
        for the rest); returns ``part``."""
        for i in sent:
            self._global[i].grad = None
        flat, offset = self._carrier.grad, 0
        with torch.no_grad():
            for i in part:
                g = self._global[i]
                g.requires_grad_(self._local[i].requires_grad)
                n = sharded.local(g).numel()
                if g.requires_grad:
                    g.grad = torch.zeros_like(g)
                    local = sharded.local(g.grad)
                    local.copy_(flat[offset:offset + n].view_as(local))
                offset += n
        return part

    def _to_global(self, part: list[int] | None = None, kept: list[torch.Tensor] | None = None) -> None:
        """The local model's parameters of ``part`` (default all) set to the global model's;
        with ``kept`` (their values when the pseudo-gradients were taken, ``delay`` inner
        steps ago), to the global model's plus what the inner steps changed since."""
        with torch.no_grad():
            for n, i in enumerate(range(len(self._local)) if part is None else part):
                g, p = self._global[i], self._local[i]
                if p.requires_grad or not g.requires_grad:  # (a frozen parameter keeps its own value)
                    p.copy_(g if kept is None else g + (p - kept[n]))

    def _snapshot(self) -> list[torch.Tensor] | None:
        """The local model as it is (the model one fragment at a time holds the other fragments'
        inner steps since their outer steps, and with ``delay`` the inner steps the outer step
        overlapped: a discarded outer step goes back to it); None for one fragment without
        ``delay``, whose local model is the global one after every outer step."""
        if self.fragments == 1 and not self.delay:
            return None
        with torch.no_grad():
            return [p.detach().clone() for p in self._local]

    def _rewind(self) -> None:
        """Back to the last outer step: the local model then (the global model, with one
        fragment), the inner optimizer's state then (its hyperparameters as they are now: a
        learning rate set for the new view stays)."""
        if self._local_saved is None:
            self._to_global()
        else:
            with torch.no_grad():
                for p, saved in zip(self._local, self._local_saved):
                    p.copy_(saved)
        groups = self.inner_optimizer.state_dict()["param_groups"]
        # a copy: load_state_dict keeps a tensor already of the parameter's device and dtype as
        # it is, and the next inner steps would write into the saved state
        self.inner_optimizer.load_state_dict({"state": _to_host(self._inner_saved["state"]), "param_groups": groups})
        self.inner_optimizer.zero_grad(set_to_none=True)
        self._inner_steps = 0
        self._sent = None

    # ------------------------------------------------------------------ group protocol
    def bind_group(self, group: Any) -> None:
        """Called by ``register_state``: plan a registered sampler's steps as outer steps."""
        from .data import ElasticSampler
        if group is not self.group:
            raise FtcommError("a DiLoCo object is registered with the group it was made for")
        objects = list(group.state.objects.values())
        if any(o is self.model or o is self.inner_optimizer or o is self.outer_optimizer for o in objects):
            raise FtcommError("register the DiLoCo object, not its model or optimizers: between outer steps each "
                              "worker's model and inner optimizer are its own, and the DiLoCo object holds the "
                              "global model and the outer optimizer that must be identical everywhere")
        samplers = [o for o in objects if isinstance(o, ElasticSampler)]
        if len(samplers) > 1:
            raise FtcommError("DiLoCo plans its outer steps with one ElasticSampler; two are registered")
        if samplers:
            self._sampler = samplers[0]
            self._sampler.plan_inner_steps(self._interval)

    def state_dict(self) -> dict[str, Any]:
        """The global model, the outer optimizer's state, ``sync_every``, ``fragments`` and the
        number of outer steps committed (which fragment is next): identical on every worker
        after each outer step."""
        return {"global": self.model_state(), "outer": self.outer_optimizer.state_dict(),
                "sync_every": self.sync_every, "fragments": self.fragments, "outer_steps": self._outer_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a global model and outer state (a joiner's, a checkpoint's, the group's sent to
        a member whose state fell behind); the local model starts again from it, every
        fragment. ValueError, with nothing loaded, for a state that does not fit this object."""
        self._check(state)
        # Received as local shards (a joiner's outer optimizer has no state yet to rebuild them
        # on): each becomes a DTensor like its sharded parameter, as the optimizer needs.
        self.outer_optimizer.load_state_dict(sharded.like(sharded.template(self.outer_optimizer), state["outer"]))
        with torch.no_grad():
            for name, g in zip(self._names, self._global):
                sharded.local(g).copy_(sharded.local(state["global"][name]))
        self._outer_steps = state.get("outer_steps", 0)
        self._to_global()
        self._local_saved = self._snapshot()
        self._rewind()

    def _check(self, state: Any) -> None:
        """ValueError unless ``state`` is a state of this DiLoCo: its keys, the global model's
        names, dtypes and shapes, the outer optimizer's groups and the shape of each of its
        state's tensors."""
        keys = {"global", "outer", "sync_every"}
        if not isinstance(state, dict) or not keys <= set(state) <= keys | {"fragments", "outer_steps"}:
            raise ValueError("not a DiLoCo state (global, outer, sync_every, fragments, outer_steps)")
        for name, value in (("sync_every", state["sync_every"]), ("fragments", state.get("fragments", 1))):
            if type(value) is not int or value != getattr(self, name):
                raise ValueError(f"the state is of a DiLoCo with {name}={value!r}, this one has "
                                 f"{getattr(self, name)}: give every worker the same")
        steps = state.get("outer_steps", 0)
        if type(steps) is not int or steps < 0:
            raise ValueError(f"the state's count of outer steps is not a count: {steps!r:.50}")
        received = state["global"]
        if not isinstance(received, dict) or list(received) != self._names:
            raise ValueError("the global model received has other parameters than this model")
        for name, g in zip(self._names, self._global):
            t = received[name]
            if not isinstance(t, torch.Tensor) or sharded.local(t).shape != sharded.local(g).shape or \
                    t.dtype != g.dtype:
                raise ValueError(f"the global model's parameter {name!r} does not fit this model's")
        outer = state["outer"]
        groups = outer.get("param_groups") if isinstance(outer, dict) else None
        mine = self.outer_optimizer.param_groups
        if not isinstance(groups, list) or len(groups) != len(mine) or not isinstance(outer.get("state"), dict) or \
                any(not isinstance(a, dict) or not isinstance(a.get("params"), list) or
                    len(a["params"]) != len(b["params"]) for a, b in zip(groups, mine)):
            raise ValueError("the outer optimizer's state received does not fit this outer optimizer")
        params = {i: p for a, b in zip(groups, mine) for i, p in zip(a["params"], b["params"])}
        for index, entry in outer["state"].items():
            if index not in params or not isinstance(entry, dict) or any(
                    isinstance(t, torch.Tensor) and t.dim() > 0 and
                    sharded.local(t).shape != sharded.local(params[index]).shape
                    for t in entry.values()):
                raise ValueError(f"the outer optimizer's state for parameter {index!r} does not fit this model")

    def model_state(self) -> dict[str, torch.Tensor]:
        """The global model's parameters: their names, dtypes and shapes must be the same on
        every worker (the group's model signature; a joiner with another model is refused)."""
        return {n: g.detach() for n, g in zip(self._names, self._global)}

    def fingerprint_tensors(self) -> dict[str, Any]:
        """What the group's state fingerprints (``fingerprint_every``) compare: the global model
        and the outer optimizer's state."""
        return {"global": self.model_state(), "outer": self.outer_optimizer.state_dict()["state"]}


# what the pseudo-gradients travel in
QUANTIZE = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


def _split(params: list[torch.Tensor], count: int) -> list[list[int]]:
    """The indices of ``params`` in ``count`` consecutive fragments of about equal size (a
    fragment holds whole parameters: ValueError when there are fewer than ``count``)."""
    if count > len(params):
        raise ValueError(f"the model has {len(params)} parameters: it cannot be cut into {count} fragments")
    sizes = [max(1, p.numel()) for p in params]  # (a sharded parameter: its whole size, equal on every shard)
    total, parts, done = sum(sizes), [[] for _ in range(count)], 0
    fragment = 0
    for i, size in enumerate(sizes):
        left = len(params) - i  # parameters still to place, this one included (one at least per fragment)
        if parts[fragment] and (done >= total * (fragment + 1) / count or left == count - 1 - fragment) \
                and fragment < count - 1:
            fragment += 1
        parts[fragment].append(i)
        done += size
    return parts


class LocalSGD(DiLoCo):
    """LocalSGD: each worker trains ``sync_every`` steps alone with ``optimizer``, then the
    group averages the parameters (DiLoCo whose outer optimizer is SGD with a learning rate
    of 1). Register it as a DiLoCo: ``ft.register_state(local_sgd=local_sgd, sampler=sampler)``."""

    def __init__(self, group: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 sync_every: int) -> None:
        super().__init__(group, model, optimizer, outer_optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                         sync_every=sync_every)


def _to_host(value: Any) -> Any:
    """A copy of an optimizer's state dict with its tensors on the host."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value
