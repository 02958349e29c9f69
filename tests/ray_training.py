"""The training function the Ray tests run in their actors (importable by the workers).

Each committed step's share is logged to a file of the worker's process, so that what a
killed worker committed survives it and exactly-once can be checked across all of them.
"""

from __future__ import annotations

import json
import os
import time


def train(config: dict) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import ftcomm
    import ftcomm.ray

    torch.manual_seed(0)
    x, y = ftcomm.ray.fetch(config["data"])
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ft = ftcomm.init(min_workers=1, handle_signals=False, settle_interval=0.2)
    sampler = ftcomm.ElasticSampler(len(x), global_batch=config["global_batch"], seed=1)
    ft.register_state(model=model, optimizer=optimizer, sampler=sampler)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=sampler)
    with open(os.path.join(config["log_dir"], f"{os.getpid()}.jsonl"), "a", buffering=1) as log:
        while ft.step < config["steps"]:
            for inputs, targets in sampler.steps(loader):
                for (xb, yb), weight in sampler.micro_batches(inputs, targets):
                    (torch.nn.functional.cross_entropy(model(xb), yb) * weight).backward()
                time.sleep(config.get("step_time", 0.0))
                if ft.wait_gradients_ready(model):
                    optimizer.step()
                    if ft.step % 20 == 0:  # to the driver's job.reports, as Ray Train's train.report
                        ftcomm.ray.report({"world": ft.world_size, "epoch": sampler.epoch})
                    share = sampler.committed
                    log.write(json.dumps({"step": ft.step, "epoch": share.epoch, "start": share.start,
                                          "size": share.size, "world": share.world,
                                          "idx": sampler.indices(share) if share.count else []}) + "\n")
                optimizer.zero_grad()
                if ft.step >= config["steps"]:
                    break
    result = {"id": ft.id, "pid": os.getpid(), "step": ft.step, "digest": ft.state.digest(ft.step),
              "views": [(e.view_id, list(e.members), e.reason) for e in ft.events]}
    ft.shutdown()
    return result

