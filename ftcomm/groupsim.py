"""``python -m ftcomm.groupsim``: the whole-group simulation's command line (see :mod:`ftcomm.sim`)."""

from __future__ import annotations

import sys

from .sim import GroupSimulation, InvariantViolation, Outcome, Worker, main, run_seed, run_seeds, summarize

__all__ = ["GroupSimulation", "InvariantViolation", "Outcome", "Worker", "main", "run_seed", "run_seeds",
           "summarize"]

if __name__ == "__main__":
    sys.exit(main())
