"""Sharded tensors (FSDP2's DTensors) as the rest of ftcomm sees them: this process's shard.

A model sharded with ``torch.distributed.fsdp.fully_shard`` holds its parameters, their
gradients and its optimizer's state as ``DTensor``\\ s over the replica's shard mesh; each
process keeps only its own shard (``to_local()``). ftcomm works on those local shards: a
member of the group of shard *i* averages its gradient shard with the shard-*i* processes
of the other replicas, sends and receives shard *i* when replicas reconcile, and checkpoints
it. Nothing here starts a collective.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def dtensor_class() -> type | None:
    """``DTensor``, once something imported ``torch.distributed.tensor`` (FSDP2 does); None
    before. Not imported here: it pulls in sympy and costs a worker that shards nothing
    about a second of its start. No tensor can be a DTensor before the module exists."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a parameter, gradient or state tensor of a sharded model)."""
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: the local shard of a DTensor (sharing its memory), else ``t``."""
    return t._local_tensor if is_sharded(t) else t


def to_local(value: Any) -> Any:
    """``value`` (a state dict, nested dicts, lists and tuples) with every DTensor replaced by
    its local shard."""
    if is_sharded(value):
        return value.to_local()
    if isinstance(value, dict):
        return {k: to_local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_local(v) for v in value)
    return value


def like(template: Any, received: Any) -> Any:
    """``received`` (a state made of local shards) with each tensor rebuilt as a DTensor
    wherever ``template`` (the live state it will be loaded into) holds one, on the same
    mesh and placements, so that ``load_state_dict`` accepts it. A received shard whose
    shape is not the template's local shape is left as it is: the object's own check names
    the mismatch."""
    if is_sharded(template) and isinstance(received, torch.Tensor) and not is_sharded(received):
        if received.shape != template.to_local().shape:
            return received
        return dtensor_class().from_local(received, template.device_mesh, template.placements, run_check=False,
                                  shape=template.shape, stride=template.stride())
    if isinstance(template, dict) and isinstance(received, dict):
        return {k: like(template[k], v) if k in template else v for k, v in received.items()}
    if isinstance(template, (list, tuple)) and isinstance(received, (list, tuple)) and len(template) == len(received):
        return type(received)(like(t, r) for t, r in zip(template, received))
    return received


def template(obj: Any) -> Any:
    """The live state of ``obj`` to rebuild a received state on (see :func:`like`). An
    optimizer that has not stepped yet holds no state for its parameters (a replica that
    joins has not): each state tensor received with the local shape of its sharded
    parameter is rebuilt like that parameter."""
    state = obj.state_dict()
    if not isinstance(obj, torch.optim.Optimizer):
        return state
    params = [p for group in obj.param_groups for p in group["params"]]
    per_param = dict(state.get("state", {}))
    for index, param in enumerate(params):
        if index not in per_param and is_sharded(param):
            per_param[index] = _ParamLike(param)
    return {**state, "state": per_param}


class _ParamLike(dict):
    """The template of a sharded parameter's optimizer state not created yet: every entry
    is the parameter (see :func:`like`, which keeps entries of another shape as they are)."""

    def __init__(self, param: torch.Tensor) -> None:
        super().__init__()
        self.param = param

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: object) -> torch.Tensor:
        return self.param
