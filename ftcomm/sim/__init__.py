"""Whole groups under deterministic simulation: the shipped worker loop over simulated ports.

N workers, each the engine core (:mod:`ftcomm.core.engine`) and the worker loop that ships
(:class:`ftcomm.runtime.worker.WorkerLoop`: re-formations, the step protocol, stragglers,
leaving, the retry limit, with the driver and the gossip news under it), run over the
gossip simulator (the real :class:`~ftcomm.gossip.protocol.Protocol`, real packets, a
virtual clock, loss and delay). This package holds only the world:

* :mod:`ftcomm.sim.ports`: the ports, modelled. A proposal published by a member is
  readable by the others while its owner runs and is reachable; a read from one that
  crashed, hangs or is cut off answers nothing, and its reader waits ``FETCH_TIMEOUT_S``
  for it. A connection to a member's port is refused when its process is gone and its
  node reachable. A view's communicator forms once every member entered its formation
  and every pair of members can reach each other, within ``formation_timeout``. Every
  operation on a communicator (the verification, the state gather and transfer, a
  step's reduction of its counters, the sum over the view of sharded replicas, a user's
  collective) completes once every member contributed, and each member observes it a
  little later (drawn apart by up to 0, 5 or 20 ms); a transfer that sends a state
  takes as long as the seed's model needs. With overlap, backward asks the loop at its
  first gradient whether it may start reducing, and the step's counters go out at its
  end, as the gradient buckets do. A member that crashes, hangs or is cut off before another observed it
  leaves that one waiting (so a step may commit on some members only). A crashed
  process's peers get a connection error at once; a lost node or a hung process gives
  none, only gossip tells. A sharded replica's decision is a set of write-once slots in
  its store (served by its shard 0: ReplicaLost once that process is gone).
* :mod:`ftcomm.sim.world`: the workers' training scripts (init, steps with compute time,
  now and then a collective inside ``execute``, after a commit or between backward and
  the step, leaving), the fault schedule, a launcher
  that starts failed workers again, and the gossip simulator underneath.
* :mod:`ftcomm.sim.checks`: the invariants, after every commit and at the end.
* :mod:`ftcomm.sim.cli`: seeds, their summary, the command line.

Each seed draws a group size, ``min_workers``, ``max_retries``, network conditions, whether
backward overlaps the reduction, where the script's collective sits, how long a state
transfer takes, how far apart members observe an operation, whether a launcher
restarts failed workers (at their addresses, or on new hosts), whether joiners (and the
first workers) register their state late, whether new workers fail early (a fault of their
own soon after they start), whether a joiner is started with another ``min_workers``
(it must end on ConfigMismatch), whether the workers
start at once (each given all the others as peers) or in turn (the first alone, each other
one given those started before it), and a fault schedule
(sparse, or dense and overlapping; from t = 0) of crashes, hangs and resumes, node losses
and returns, partitions and heals, joins, graceful leaves, leaves right after a commit and
slow members (which, with ``straggler_policy="exclude"``, judge themselves stragglers and
stand aside). A violation names the seed and the command that reproduces it::

    python -m ftcomm.groupsim --seed 17            # one seed, its timeline
    python -m ftcomm.groupsim --seeds 500 --json   # many seeds, summary

Production code never imports this package.
"""

from .cli import main, run_seed, run_seeds, summarize
from .world import GroupSimulation, InvariantViolation, Outcome, Worker

__all__ = ["GroupSimulation", "InvariantViolation", "Outcome", "Worker", "main", "run_seed", "run_seeds",
           "summarize"]
