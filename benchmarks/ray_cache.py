"""The Ray object-store cache against reading the dataset from storage, on a local Ray
cluster: how long a worker takes to get its data, and how long a worker joining a
running group takes from the start of its training function to its first committed step.

- *storage*: the dataset is an .npy file; each read is preceded by dropping the file's
  pages from the page cache (``posix_fadvise(DONTNEED)`` after an fsync), so it comes
  from the disk;
- *cache*: the arrays were put into the object store once (``ftcomm.ray.cache``) and each
  worker maps them (``ftcomm.ray.fetch``) and touches every byte.

The join: a job of 2 workers trains while a placeholder actor holds the third CPU; the
placeholder is killed, the job adds a worker, whose training function records when it
started, when its data was ready, when ``ftcomm.init`` returned and its first commit.
Both ways run in the same invocation, alternately.

    python benchmarks/ray_cache.py --mb 256 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from ftcomm.ray import ElasticRayJob, cache, fetch  # noqa: E402


def drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load(source: dict):
    """The dataset as tensors, from storage or from the cache; every byte touched."""
    import torch

    if source["kind"] == "storage":
        drop_from_page_cache(source["path"])
        x = torch.from_numpy(np.load(source["path"]))
    else:
        (x,) = fetch(source["refs"])
    float(x[:, 0].sum())  # one value per 256-byte row: every page is read
    return x


@ray.remote(num_cpus=1)
def read_once(source: dict) -> float:
    started = time.perf_counter()
    x = load(source)
    assert x.numel() > 0
    return time.perf_counter() - started


def train(config: dict) -> dict:
    import torch

    import ftcomm

    marks = {"start": time.time()}
    x = load(config["source"])
    marks["data"] = time.time()
    ft = ftcomm.init(min_workers=1, handle_signals=False, settle_interval=0.2)
    marks["init"] = time.time()
    model = torch.nn.Linear(x.shape[1], 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ft.register_state(model=model, optimizer=optimizer)
    first = None
    while ft.step < config["steps"]:
        rows = torch.randint(0, x.shape[0], (32,))
        model(x[rows]).sum().backward()
        time.sleep(0.02)
        if ft.wait_gradients_ready(model):
            optimizer.step()
            first = first or time.time()
        optimizer.zero_grad()
    marks["first_commit"] = first
    ft.shutdown()
    return marks


def join_run(source: dict, steps: int) -> dict:
    @ray.remote(num_cpus=1)
    class Placeholder:
        def ready(self) -> bool:
            return True
    placeholder = Placeholder.remote()
    ray.get(placeholder.ready.remote())
    job = ElasticRayJob(train, num_workers=(2, 3), config={"source": source, "steps": steps}, scale_interval=0.5)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("results", job.run(timeout=600)))
    thread.start()
    while len(job.slots) < 2:
        time.sleep(0.1)
    time.sleep(8.0)  # the first two train
    ray.kill(placeholder)
    thread.join(600)
    joiner = max(out["results"], key=lambda m: m["start"])
    return {"data_s": round(joiner["data"] - joiner["start"], 3), "init_s": round(joiner["init"] - joiner["data"], 3),
            "first_commit_s": round(joiner["first_commit"] - joiner["init"], 3),
            "join_total_s": round(joiner["first_commit"] - joiner["start"], 3)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ray_cache.json"))
    args = parser.parse_args()
    ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    rows = args.mb * (1 << 20) // (4 * 64)
    data = np.random.default_rng(0).standard_normal((rows, 64), dtype=np.float32)
    with tempfile.TemporaryDirectory(dir=str(ROOT)) as directory:  # on the disk, not in tmpfs
        path = os.path.join(directory, "x.npy")
        np.save(path, data)
        sources = {"storage": {"kind": "storage", "path": path}, "cache": {"kind": "cache", "refs": cache(data)}}
        del data
        reads = {k: [] for k in sources}
        joins = {k: [] for k in sources}
        for _ in range(args.runs):
            for kind, source in sources.items():
                reads[kind].append(round(ray.get(read_once.remote(source)), 3))
        for _ in range(args.runs):
            for kind, source in sources.items():
                joins[kind].append(join_run(source, args.steps))
                print(json.dumps({"kind": kind, **joins[kind][-1]}), flush=True)
    result = {"benchmark": "ray_cache", "dataset_mb": args.mb, "reads_s": reads,
              "read_median_s": {k: statistics.median(v) for k, v in reads.items()},
              "joins": joins,
              "join_median_s": {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in joins.items()},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"read_median_s": result["read_median_s"], "join_median_s": result["join_median_s"]}))
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
