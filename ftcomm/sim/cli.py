"""Running seeds of the whole-group simulation, and their summary (``python -m ftcomm.groupsim``)."""

from __future__ import annotations

import argparse
import collections
import json
import logging
import multiprocessing
import statistics
import sys

from .checks import STARVED_TOLERATED
from .world import GroupSimulation, Outcome


def run_seed(seed: int, **kwargs) -> Outcome:
    return GroupSimulation(seed, **kwargs).run()


def run_seeds(seeds: list[int], processes: int = 1, **kwargs) -> list[Outcome]:
    if processes <= 1:
        return [run_seed(s, **kwargs) for s in seeds]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return pool.map(_run_seed_kw, [(s, kwargs) for s in seeds], chunksize=8)


def _run_seed_kw(item: tuple[int, dict]) -> Outcome:
    return run_seed(item[0], **item[1])


def distribution(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {"count": 0}
    return {"count": len(values), "median_s": round(statistics.median(values), 3),
            "p99_s": round(values[min(len(values) - 1, int(0.99 * len(values)))], 3),
            "max_s": round(values[-1], 3)}


def summarize(outcomes: list[Outcome]) -> dict:
    recovery: dict[str, list[float]] = {}
    overlapping: dict[str, list[float]] = {}
    exits: dict[str, int] = {}
    for o in outcomes:
        for kind, values in o.recovery.items():
            recovery.setdefault(kind, []).extend(values)
        for kind, values in o.recovery_overlapping.items():
            overlapping.setdefault(kind, []).extend(values)
        for name, count in o.exits.items():
            exits[name] = exits.get(name, 0) + count
    settles = [o.settle_s for o in outcomes if o.settle_s is not None]
    return {"seeds": len(outcomes), "violations": sum(not o.ok for o in outcomes),
            "failing_seeds": [o.seed for o in outcomes if not o.ok][:20],
            "first_violation": next((o.violation for o in outcomes if not o.ok), None),
            "recovery_to_next_commit": {k: distribution(v) for k, v in sorted(recovery.items())},
            "recovery_with_another_fault_active": {k: distribution(v) for k, v in sorted(overlapping.items())},
            "settle_after_last_fault": distribution(settles),
            "quorum_lost_seeds": sum(not o.quorum_survived for o in outcomes),
            "seeds_with_rolled_back_commits": sum(o.rolled_back > 0 for o in outcomes),
            # faults after which the survivors went on from an older state (every worker that
            # held the newest one was gone): not recoveries, and not in the figures above
            "seeds_started_over": sum(bool(o.started_over) for o in outcomes),
            "seeds_by_min_workers": {str(m): sum(o.min_workers == m for o in outcomes)
                                     for m in sorted({o.min_workers for o in outcomes})},
            "seeds_started_in_turn": sum(o.first_alone for o in outcomes),
            **({"starvation": starvation(outcomes)} if any(o.starvations for o in outcomes) else {}),
            "scripts_ended_on": dict(sorted(exits.items())),
            **({"corruption": {"struck": sum(o.corruptions for o in outcomes),
                               "commits_on_a_wrong_state": sum(o.wrong_commits for o in outcomes)}}
               if any(o.corruptions for o in outcomes) else {}),
            **({"collections": {"struck": sum(o.collections[0] for o in outcomes),
                                "probe_verdicts_held": sum(o.collections[1] for o in outcomes)}}
               if any(o.collections[0] for o in outcomes) else {}),
            **({"replica_repairs": {"started": sum(o.repairs[0] for o in outcomes),
                                    "formed_again": sum(o.repairs[1] for o in outcomes)}}
               if any(o.repairs[0] for o in outcomes) else {}),
            "simulated_commits": sum(o.commits for o in outcomes),
            "wall_s_per_seed": round(statistics.mean(o.wall_s for o in outcomes), 4) if outcomes else 0.0}


def starvation(outcomes: list[Outcome]) -> dict:
    """CPU starvation windows drawn, and members left out of a view while starved, by lag."""
    windows = collections.Counter(lag for o in outcomes for _, _, lag in o.starvations)
    excluded = collections.Counter(lag for o in outcomes for _, lag, _ in o.starved_excluded)
    return {"windows_by_lag": {f"{lag:g}": windows[lag] for lag in sorted(windows)},
            "left_out_by_lag": {f"{lag:g}": excluded[lag] for lag in sorted(windows)},
            "tolerated_lag": STARVED_TOLERATED}


def main(argv: list[str] | None = None) -> int:
    from . import __doc__ as doc
    parser = argparse.ArgumentParser(prog="python -m ftcomm.groupsim", description=doc.split("\n\n")[0])
    parser.add_argument("--seed", type=int, help="run one seed and print its timeline")
    parser.add_argument("--seeds", type=int, default=100, help="run seeds 0..N-1 (without --seed)")
    parser.add_argument("--first", type=int, default=0, help="first seed of --seeds")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--replica-size", type=int, default=1, help="sharded replicas of this many processes")
    parser.add_argument("--starve", action="store_true",
                        help="draw CPU starvation too: members whose loop, timers and packets run late (invariant 10)")
    parser.add_argument("--collect", action="store_true",
                        help="draw full garbage collections too: a worker paused up to 0.7 s after announcing it "
                             "(invariant 10)")
    parser.add_argument("--corrupt", action="store_true",
                        help="draw silent data corruption too: a member's state goes wrong without a commit "
                             "(invariant 12)")
    parser.add_argument("--repair", action="store_true",
                        help="sharded replicas: a lost process is replaced in place, as ftcomm run does (else the "
                             "whole replica starts again, as with --replica-restart)")
    parser.add_argument("--outer-steps", action="store_true",
                        help="steps of 0.3-2 s of compute: DiLoCo's and LocalSGD's outer steps")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.seed is None:  # many seeds: the workers' own warnings (waits, stragglers) are noise here
        logging.getLogger("ftcomm").setLevel(logging.ERROR)
        logging.getLogger("ftcomm.runtime.fingerprints").setLevel(logging.CRITICAL)  # drawn corruption
    if args.seed is not None:
        sim = GroupSimulation(args.seed, replica_size=args.replica_size, starve=args.starve, corrupt=args.corrupt,
                              repair=args.repair, outer_steps=args.outer_steps, collect=args.collect)
        outcome = sim.run()
        if args.json:
            print(json.dumps(outcome.__dict__))
        else:
            print(f"seed {outcome.seed}: {outcome.n} workers, min_workers {sim.min_workers}, loss {sim.loss:g}, "
                  f"launcher {sim.launcher}, {'started in turn, ' if sim.first_alone else ''}"
                  f"{'dense' if sim.dense else 'sparse'} faults:")
            for t, kind, who in outcome.faults:
                print(f"  {t:8.3f} {kind:20s} {who}")
            for line in sim.log:
                print(" ", line)
            for w in sim.workers.values():
                engine = w.loop.engine
                print(f"  {w.id}: {engine.state} view {engine.view.id if engine.view else None} "
                      f"step {w.loop.step} commits {len(w.committed)}")
            print("recovery:", outcome.recovery, "with another fault active:", outcome.recovery_overlapping,
                  "settle:", outcome.settle_s)
            print("OK" if outcome.ok else outcome.violation)
        return 0 if outcome.ok else 1
    outcomes = run_seeds(list(range(args.first, args.first + args.seeds)), args.processes,
                         replica_size=args.replica_size, starve=args.starve, corrupt=args.corrupt,
                         repair=args.repair, outer_steps=args.outer_steps, collect=args.collect)
    summary = summarize(outcomes)
    print(json.dumps(summary, indent=None if args.json else 2))
    return 0 if summary["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
