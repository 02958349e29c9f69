"""Checkpoint benchmark: the training pause of a flash checkpoint against torch.save, and restore
against torch.load, for a state of about 1 GB.

    python benchmarks/checkpoint.py [--gb 1.0] [--rounds 3] [--dir /tmp/ftcomm-bench]

One worker (a group of one) registers an MLP and its SGD momentum (half the state
each). In the same process, ``--rounds`` times each, alternating:

- ``flash_save``: the pause of ``FlashCheckpointer.save()`` (the copy into a shared-memory
  buffer; checksums and the persist to ``--dir`` run in the background, and the next
  round starts after they finished, as training would between checkpoints);
- ``torch_save``: ``torch.save(state_dict, path)`` to ``--dir`` (local disk), the whole
  call being the pause;
- ``flash_restore``: ``restore()`` from shared memory: agreement, checksum
  verification, and loading into the model and optimizer;
- ``torch_restore``: ``torch.load`` of that file plus ``load_state_dict``.

The first flash save also allocates its buffer; it is reported separately. Medians of
the rest, seconds per GB, and the ratios are printed and written to
benchmarks/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import ftcomm  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state size in GB (1e9 bytes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/ftcomm-checkpoint-bench", help="local-disk directory")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "checkpoint.json"))
    args = parser.parse_args()

    floats = int(args.gb * 1e9 / 4 / 2)  # parameters; momentum doubles the state
    width = 4096
    layers = max(1, floats // (width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    state_bytes = sum(p.numel() * 4 for p in model.parameters()) * 2
    gb = state_bytes / 1e9

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    ft = ftcomm.init(bind="127.0.0.1:0", handle_signals=False)
    ft.register_state(model=model, optimizer=optimizer)
    checkpoints = ftcomm.FlashCheckpointer(ft, os.path.join(args.dir, "flash"), keep=2, name=name, sync=False)
    torch_path = os.path.join(args.dir, "state.pt")
    results: dict[str, list[float]] = {"flash_save": [], "torch_save": [], "flash_restore": [], "torch_restore": []}
    try:
        ft.step = 1
        first = checkpoints.save()
        checkpoints.wait()
        for round_ in range(args.rounds):
            ft.step = 2 + round_
            results["flash_save"].append(checkpoints.save())
            checkpoints.wait()
            started = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, torch_path)
            results["torch_save"].append(time.perf_counter() - started)

            started = time.perf_counter()
            restored = checkpoints.restore()
            results["flash_restore"].append(time.perf_counter() - started)
            assert restored == ft.step
            started = time.perf_counter()
            loaded = torch.load(torch_path, weights_only=True)
            model.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])
            results["torch_restore"].append(time.perf_counter() - started)
            del loaded
            print(f"round {round_}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in results.items()), flush=True)
    finally:
        checkpoints.close()
        ft.shutdown()
        shutil.rmtree(checkpoints.shm, ignore_errors=True)
        shutil.rmtree(args.dir, ignore_errors=True)

    medians = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "benchmark": "checkpoint", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "state_gb": round(gb, 3), "rounds": args.rounds,
        "first_flash_save_s": round(first, 4),
        "seconds": {k: [round(x, 4) for x in v] for k, v in results.items()},
        "median_s": {k: round(v, 4) for k, v in medians.items()},
        "s_per_gb": {k: round(v / gb, 4) for k, v in medians.items()},
        "save_pause_ratio": round(medians["torch_save"] / medians["flash_save"], 2),
        "restore_ratio": round(medians["torch_restore"] / medians["flash_restore"], 2),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
