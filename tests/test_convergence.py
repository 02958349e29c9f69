"""Convergence parity: 4 workers without failures vs 4 -> 3 (crash) -> 5 (joins) -> 4 (leave), and DDP."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.timeout(600)

_spec = importlib.util.spec_from_file_location(
    "convergence", pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "convergence.py")
convergence = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convergence)

STEPS = 4 * convergence.SAMPLES // convergence.GLOBAL_BATCH  # four epochs


def test_training_through_churn_matches_training_without_it():
    fixed = convergence.run_ftcomm(STEPS, 0.06, churn=False)
    churn = convergence.run_ftcomm(STEPS, 0.06, churn=True)
    ddp = convergence.run_ddp(STEPS, 0.0)

    for run in (fixed, churn):
        assert run["exactly_once"]["ok"], run["exactly_once"]["problems"]
        assert run["exactly_once"]["samples_per_epoch"] == {e: convergence.SAMPLES for e in range(4)}
        assert run["digests_equal"] and run["steps"] == STEPS
    assert fixed["initial_world"] == 4 and [v["size"] for v in fixed["views"]] == [4]
    # With min_workers=3 a worker that starts late on a loaded machine joins the first view
    # of 3 at a step boundary: the churn begins once all four train together.
    whole = next(i for i, v in enumerate(churn["views"]) if v["size"] == 4)
    changes = [(v["size"], v["reason"]) for v in churn["views"][whole + 1:]]
    assert changes[0] == (3, "crash") and changes[-1] == (4, "leave") and (5, "join") in changes, changes
    for view in churn["views"]:  # the constant-global-batch policy at every world size
        assert view["policy"]["global_batch"] == convergence.GLOBAL_BATCH
        assert view["policy"]["worker_batch"] in (convergence.GLOBAL_BATCH // view["size"],
                                                  -(-convergence.GLOBAL_BATCH // view["size"]))
    for a, b in ((churn, fixed), (fixed, ddp)):
        assert convergence.relative(a["loss"], b["loss"]) < 0.01
        assert convergence.relative(a["accuracy"], b["accuracy"]) < 0.01
    assert fixed["accuracy"] > 0.6  # it learned something: the comparison is not between untrained models


def test_fixed_worker_batch_with_dataloader_worker_processes_through_churn():
    """The other policy, with batches prefetched by DataLoader worker processes: exactly once
    still holds, every view's learning rate follows the world size, and the killed worker's
    loader processes did not outlive it."""
    churn = convergence.run_ftcomm(STEPS, 0.06, churn=True,
                                   extra=["--worker-batch", "64", "--loader-workers", "1", "--lr-warmup", "4"])
    assert churn["leftover_processes"] == 0
    once = churn["exactly_once"]
    assert once["ok"], once["problems"]
    finished = sorted(once["samples_per_epoch"])[:-1]  # the last epoch may be in progress
    assert finished and all(once["samples_per_epoch"][e] == convergence.SAMPLES for e in finished)
    assert churn["digests_equal"]
    for view in churn["views"]:
        policy = view["policy"]
        assert policy["policy"] == "fixed_worker_batch" and policy["lr_scale"] == view["size"] / 4
        assert policy["global_batch"] == 64 * view["size"] or policy["offset"] + policy["global_batch"] == 8192
