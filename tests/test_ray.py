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
import ftcomm.ray as ftcomm_ray
from ftcomm.ray import ElasticRayJob, cache, fetch
from tests.ray_training import train

pytestmark = pytest.mark.timeout(300)
ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
STEPS = 160
SAMPLES = 512


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="ERROR",
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


def wait_for_steps(log_dir, steps: int, world: int = 1, timeout: float = 120) -> None:
    """Until a step >= ``steps`` was committed by a view of at least ``world`` workers."""
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= steps and r["world"] >= world for log in logged(log_dir) for r in log):
        assert time.monotonic() < deadline, f"no step {steps} in a world of {world} within {timeout} s"
        time.sleep(0.2)


def assert_one_state_and_exactly_once(results: list[dict], log_dir, steps: int = STEPS) -> None:
    assert len({r["digest"] for r in results}) == 1 and {r["step"] for r in results} == {steps}
    once = check_exactly_once(logged(log_dir), steps, samples=SAMPLES, seed=1)
    assert once["ok"], once["problems"]
    assert sum(once["samples_per_epoch"].values()) == steps * 64


def test_the_object_store_cache_round_trips(cluster):
    x, y = dataset()
    fx, fy = fetch(cache(x, y))
    assert torch.equal(fx, x) and torch.equal(fy, y)


def test_a_killed_actor_is_restarted_by_ray_and_rejoins(cluster, tmp_path):
    steps = 3 * STEPS  # the restarted worker must start (import torch) before the others end
    config = {"data": cache(*dataset()), "global_batch": 64, "steps": steps, "log_dir": str(tmp_path),
              "step_time": 0.03}
    job = ElasticRayJob(train, num_workers=3, config=config, max_restarts=2)
    thread, out = run_in_background(job)
    wait_for_steps(tmp_path, 30, world=3)  # every worker is in the group
    pids = {ray.get(slot.actor.pid.remote()) for slot in job.slots}
    victim = job.slots[1]
    old_pid = ray.get(victim.actor.pid.remote())
    ray.kill(victim.actor, no_restart=False)
    thread.join(240)
    assert "error" not in out, out.get("error")
    results = out["results"]
    assert job.restarts == 1 and job.failed == 0 and len(results) == 3, job.errors
    assert old_pid not in {r["pid"] for r in results}  # a new process took its place
    pids.discard(old_pid)
    restarted = [r for r in results if r["pid"] not in pids]
    survivors = [r for r in results if r["pid"] in pids]
    assert len(restarted) == 1 and len(survivors) == 2, results
    # The survivors' group lost the killed member (whatever the re-formation was named: the
    # restarted worker may already be in the view that drops it) and ends with the three
    # processes that finished.
    finishers = {r["id"] for r in results}
    killed = {m for r in survivors for _, members, _ in r["views"] for m in members} - finishers
    assert len(killed) == 1, results  # the member the killed process was
    for r in results:
        assert not killed & set(r["views"][-1][1]), r
    assert any(restarted[0]["id"] in members for r in survivors for _, members, _ in r["views"]), results
    assert_one_state_and_exactly_once(results, tmp_path, steps)


def test_actors_are_added_when_resources_appear(cluster, tmp_path):
    @ray.remote(num_cpus=1)
    class Placeholder:
        def ready(self) -> bool:
            return True
    placeholder = Placeholder.remote()
    ray.get(placeholder.ready.remote())  # holds one of the 3 CPUs: the job starts with 2 workers
    config = {"data": cache(*dataset()), "global_batch": 64, "steps": STEPS, "log_dir": str(tmp_path),
              "step_time": 0.03}
    config["steps"] = steps = 3 * STEPS  # the added worker must start (import torch) before the end
    seen = []
    job = ElasticRayJob(train, num_workers=(2, 3), config=config, scale_interval=0.5, on_report=seen.append)
    thread, out = run_in_background(job)
    wait_for_steps(tmp_path, 30, world=2)
    assert len(job.slots) == 2
    ray.kill(placeholder)  # a CPU appears
    wait_for_steps(tmp_path, 1, world=3)
    thread.join(240)
    assert "error" not in out, out.get("error")
    results = out["results"]
    assert len(job.slots) == 3 and len(results) == 3
    assert any(reason == "join" and len(members) == 3 for r in results for _, members, reason in r["views"])
    assert_one_state_and_exactly_once(results, tmp_path, steps)
    # Every worker's reports reached the driver, each step once per worker, in step order.
    assert seen == job.reports and {r.worker for r in job.reports} == {0, 1, 2}
    for worker in range(3):
        steps_reported = [r.step for r in job.reports if r.worker == worker]
        assert steps_reported == sorted(set(steps_reported)) and all(s % 20 == 0 for s in steps_reported)
    # Reports carry the world of a view that formed: both sizes the job ran at, and any other
    # only where such a view formed (a worker starved of CPU for longer than the hang
    # tolerance on a loaded machine is excluded and rejoins; that is not an error).
    worlds = {r.metrics["world"] for r in job.reports}
    formed = {len(members) for r in results for _, members, _ in r["views"]}
    assert {2, 3} <= worlds <= formed and steps in {r.step for r in job.reports}
    # The job's Result: the values, the newest report's metrics (nothing checkpointed here).
    result = job.result
    assert result.values == results and result.reports == job.reports and result.errors == []
    assert result.metrics == [r for r in job.reports if r.step == steps][-1].metrics and result.checkpoint is None


def _nap(config: dict) -> int:
    time.sleep(config["seconds"])
    return 1


@pytest.mark.parametrize("at_start", [False, True])
def test_a_worker_added_that_ray_cannot_place_does_not_fail_or_hold_up_the_job(cluster, at_start):
    """Room for another worker seemed to be there (when the job starts, or later), but its
    actor is never placed (another job took the CPU meanwhile): the job drops it after
    start_timeout and goes on."""
    class Lying(ElasticRayJob):
        started = False

        def _start_initial(self) -> None:
            self.started = at_start
            super()._start_initial()
            self.started = True

        def _fits(self) -> bool:
            return True if self.started else super()._fits()  # all 3 CPUs are taken by the job's workers

    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < 3:  # the actors of an earlier test are gone
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)
    job = Lying(_nap, num_workers=(3, 4), config={"seconds": 10}, scale_interval=0.2, start_timeout=20)  # actors start slowly on a loaded machine
    assert job.run(timeout=120) == [1, 1, 1]
    assert job.failed == 0 and len(job.slots) >= 3


def test_report_with_a_checkpointer_saves_and_names_the_step(tmp_path):
    """Outside a job too: the checkpoint is saved on this worker and the report says which step."""
    import ftcomm.ray
    from ftcomm.training.checkpoint import FlashCheckpointer
    from tests.test_group_threads import start_groups

    (group,) = start_groups(1)
    try:
        group.register_state(model=torch.nn.Linear(2, 2))
        checkpoints = FlashCheckpointer(group, tmp_path / "ckpt", name=f"ray-report-{tmp_path.name}")
        group.step = 40
        ftcomm.ray.report({"loss": 0.5}, checkpointer=checkpoints)
        checkpoints.wait()
        (entry,) = ftcomm.ray._worker_reports()
        assert entry["checkpoint"] == 40 and entry["step"] == 40 and entry["metrics"] == {"loss": 0.5}
        assert checkpoints.available() == [40]
        checkpoints.close(discard=True)
    finally:
        group.shutdown()


@pytest.mark.parametrize("others_returned", [False, True])
def test_a_worker_that_arrives_after_the_group_ended_is_not_run_again_nor_a_failure(monkeypatch, others_returned):
    """Its training function raised GroupEnded (the job's group had ended before letting it
    in): it is not run again, whether or not another worker's result is in yet; the job
    fails on it only when no worker's function returns (the error then names it)."""
    from ftcomm.errors import GroupEnded

    job = ElasticRayJob(_nap, num_workers=(1, 2))
    slot = ftcomm_ray._Slot(actor=None, address="10.0.0.1:7000", run="ref", starts=1)

    def raised(ref, timeout=None):
        raise ray.exceptions.RayTaskError("train", "Traceback ...", GroupEnded("the group of this job trained and ended"))
    monkeypatch.setattr(ftcomm_ray.ray, "get", raised)
    monkeypatch.setattr(job, "_launch", lambda s: pytest.fail("a worker whose group ended was run again"))
    results = [{"step": 200}] if others_returned else []
    job._finished(slot, results)
    assert job.failed == 0 and job.errors == [] and len(job.ended) == 1 and slot.run is None
    assert results == ([{"step": 200}] if others_returned else [])


def test_the_workers_get_the_jobs_worker_counts_unless_env_sets_them():
    job = ElasticRayJob(_nap, num_workers=(2, 4))
    assert (job.env["FTCOMM_MIN_WORKERS"], job.env["FTCOMM_MAX_WORKERS"]) == ("2", "4")
    mine = ElasticRayJob(_nap, num_workers=3, env={"FTCOMM_MIN_WORKERS": "1"})
    assert (mine.env["FTCOMM_MIN_WORKERS"], mine.env["FTCOMM_MAX_WORKERS"]) == ("1", "3")


def test_a_worker_run_again_after_the_jobs_group_formed_is_told_so(monkeypatch):
    """As ``ftcomm run`` does: a training function run again in a restarted actor once a
    worker's collect showed the group formed gets FTCOMM_GROUP_RAN=1 (it founds no group of
    its own while a peer is silent); before that 0; a first start is left as env says. Run
    again, its peers are the workers whose functions run (a failed worker's old address,
    which Ray does not start again, would stay silent)."""
    class Remote:
        def __init__(self, calls):
            self.calls = calls

        def remote(self, *args):
            self.calls.append(args)
            return args

    class Actor:
        def __init__(self):
            self.runs = []
            self.run, self.collect = Remote(self.runs), Remote([])

    job = ElasticRayJob(_nap, num_workers=(1, 2))
    first, second = ftcomm_ray._Slot(actor=Actor(), address="10.0.0.1:7000"), ftcomm_ray._Slot(
        actor=Actor(), address="10.0.0.2:7000")
    job.slots = [first, second]
    job._run_in(first)
    assert "FTCOMM_GROUP_RAN" not in first.actor.runs[-1][2] and first.actor.runs[-1][1] == ["10.0.0.2:7000"]
    second.run = "ref"  # its function runs
    job._run_in(first)  # run again before any worker's group formed
    assert first.actor.runs[-1][2]["FTCOMM_GROUP_RAN"] == "0"
    monkeypatch.setattr(ftcomm_ray.ray, "get", lambda ref, timeout=None: ref)
    job._take(1, ([], True), 0.0)  # the other worker's collect: its group formed
    job._run_in(first)
    assert first.actor.runs[-1][2]["FTCOMM_GROUP_RAN"] == "1" and first.actor.runs[-1][1] == ["10.0.0.2:7000"]
    assert job.group_ran
    second.run = None  # its function ended (failed, not started again yet): not a peer
    job._run_in(first)
    assert first.actor.runs[-1][1] == [] and first.actor.runs[-1][2]["FTCOMM_GROUP_RAN"] == "0"
