"""ftcomm on Ray actors, on a real local Ray cluster: an actor killed with ray.kill is
restarted by Ray and rejoins; actors are added when resources appear; every epoch's
samples are consumed exactly once through both, and every worker ends with one state."""

from __future__ import annotations

import glob
import json
import pathlib
import threading
import time

import pytest
import ray
import torch

from benchmarks.convergence import check_exactly_once
from ftcomm.ray import ElasticRayJob, cache, fetch
from tests.ray_training import train

pytestmark = pytest.mark.timeout(300)
ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
STEPS = 160
SAMPLES = 512


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def dataset():
    torch.manual_seed(0)
    return torch.randn(SAMPLES, 8), torch.randint(0, 3, (SAMPLES,))


def logged(log_dir) -> list[list[dict]]:
    return [[json.loads(line) for line in open(path)] for path in sorted(glob.glob(f"{log_dir}/*.jsonl"))]


def run_in_background(job: ElasticRayJob) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["results"] = job.run(timeout=240)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def wait_for_steps(log_dir, steps: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while max((r["step"] for log in logged(log_dir) for r in log), default=0) < steps:
        assert time.monotonic() < deadline, f"no step {steps} within {timeout} s"
        time.sleep(0.2)


def assert_one_state_and_exactly_once(results: list[dict], log_dir) -> None:
    assert len({r["digest"] for r in results}) == 1 and {r["step"] for r in results} == {STEPS}
    once = check_exactly_once(logged(log_dir), STEPS, samples=SAMPLES, seed=1)
    assert once["ok"], once["problems"]
    assert sum(once["samples_per_epoch"].values()) == STEPS * 64


def test_the_object_store_cache_round_trips(cluster):
    x, y = dataset()
    fx, fy = fetch(cache(x, y))
    assert torch.equal(fx, x) and torch.equal(fy, y)


def test_a_killed_actor_is_restarted_by_ray_and_rejoins(cluster, tmp_path):
    config = {"data": cache(*dataset()), "global_batch": 64, "steps": STEPS, "log_dir": str(tmp_path),
              "step_time": 0.03}
    job = ElasticRayJob(train, num_workers=3, config=config, max_restarts=2)
    thread, out = run_in_background(job)
    wait_for_steps(tmp_path, 30)
    pids = {ray.get(slot.actor.pid.remote()) for slot in job.slots}
    victim = job.slots[1]
    old_pid = ray.get(victim.actor.pid.remote())
    ray.kill(victim.actor, no_restart=False)
    thread.join(240)
    assert "error" not in out, out.get("error")
    results = out["results"]
    assert job.restarts == 1 and job.failed == 0 and len(results) == 3
    assert old_pid not in {r["pid"] for r in results}  # a new process took its place
    pids.discard(old_pid)
    restarted = [r for r in results if r["pid"] not in pids]
    survivors = [r for r in results if r["pid"] in pids]
    assert len(restarted) == 1 and len(survivors) == 2, results
    # The survivors went on in a view of 2 (the killed process's connections broke), and
    # the restarted worker joined them in a view of 3.
    for r in survivors:
        assert any(size == 2 and reason in ("crash", "hang", "leave") for _, size, reason in r["views"]), r
        assert r["views"][-1][1:] == (3, "join"), r
    assert restarted[0]["views"][-1][1] == 3, restarted
    assert_one_state_and_exactly_once(results, tmp_path)


def test_actors_are_added_when_resources_appear(cluster, tmp_path):
    @ray.remote(num_cpus=1)
    class Placeholder:
        def ready(self) -> bool:
            return True
    placeholder = Placeholder.remote()
    ray.get(placeholder.ready.remote())  # holds one of the 3 CPUs: the job starts with 2 workers
    config = {"data": cache(*dataset()), "global_batch": 64, "steps": STEPS, "log_dir": str(tmp_path),
              "step_time": 0.03}
    job = ElasticRayJob(train, num_workers=(2, 3), config=config, scale_interval=0.5)
    thread, out = run_in_background(job)
    wait_for_steps(tmp_path, 30)
    assert len(job.slots) == 2
    ray.kill(placeholder)  # a CPU appears
    thread.join(240)
    assert "error" not in out, out.get("error")
    results = out["results"]
    assert len(job.slots) == 3 and len(results) == 3
    assert any(reason == "join" and size == 3 for r in results for _, size, reason in r["views"])
    assert_one_state_and_exactly_once(results, tmp_path)
