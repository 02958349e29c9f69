"""Learning-rate scaling with the world size: the fixed-per-worker-batch policy.

With a fixed per-worker batch the global batch is ``worker_batch * world``; the linear
scaling rule keeps the update per sample constant by scaling the learning rate with
it. After a view change the rate moves to its new value linearly over
``warmup_steps`` committed steps (0: at once), which avoids a jump when the world
grows. The object is registered state, so every worker holds the same schedule.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class LinearLRScaling:
    """``lr = base_lr * world / reference_world`` for each parameter group of ``optimizer``.

    ``base_lr`` is each group's learning rate when this object is created, tuned for
    ``reference_world`` workers. Register it with the group
    (``ft.register_state(..., lr_scaling=LinearLRScaling(optimizer, 4))``); the group
    calls :meth:`view_changed` after each re-formation and :meth:`step_ended` after
    each step, before ``wait_gradients_ready`` returns, so ``optimizer.step()`` uses
    the new rate.
    """

    def __init__(self, optimizer: Any, reference_world: int, warmup_steps: int = 0) -> None:
        if reference_world < 1 or warmup_steps < 0:
            raise ValueError("reference_world must be >= 1 and warmup_steps >= 0")
        self.optimizer = optimizer
        self.reference_world, self.warmup_steps = reference_world, warmup_steps
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.world = reference_world
        self.ramp: tuple[list[float], list[float], int] | None = None  # (from, to, steps done)

    def target(self, world: int) -> list[float]:
        return [lr * world / self.reference_world for lr in self.base_lrs]

    def view_changed(self, rank: int, world: int, step: int) -> dict:
        current = [float(g["lr"]) for g in self.optimizer.param_groups]
        goal = self.target(world)
        if world != self.world:
            self.world = world
            if self.warmup_steps and current != goal:
                self.ramp = (current, goal, 0)
            else:
                self.ramp = None
                self._set(goal)
        return {"lr_policy": "linear_scaling", "lr_scale": world / self.reference_world,
                "lr": [float(g["lr"]) for g in self.optimizer.param_groups], "lr_target": goal,
                "warmup_steps": self.warmup_steps if self.ramp else 0}

    def step_ended(self, committed: bool) -> None:
        if not committed or self.ramp is None:
            return
        start, goal, done = self.ramp
        done += 1
        fraction = min(done / self.warmup_steps, 1.0)
        self._set([a + (b - a) * fraction for a, b in zip(start, goal)])
        self.ramp = None if fraction >= 1.0 else (start, goal, done)

    def _set(self, lrs: list[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"base_lrs": list(self.base_lrs), "reference_world": self.reference_world,
                "warmup_steps": self.warmup_steps, "world": self.world,
                "ramp": None if self.ramp is None else [list(self.ramp[0]), list(self.ramp[1]), self.ramp[2]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base_lrs = [float(x) for x in state["base_lrs"]]
        self.reference_world, self.warmup_steps = int(state["reference_world"]), int(state["warmup_steps"])
        self.world = int(state["world"])
        ramp = state["ramp"]
        self.ramp = None if ramp is None else (list(ramp[0]), list(ramp[1]), int(ramp[2]))
