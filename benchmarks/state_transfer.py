"""State transfer benchmark: raw tensor bytes against the torch.save round trip it replaced.

    python benchmarks/state_transfer.py [--params 10,100] [--repeats 3]

Two processes on 127.0.0.1 form a Gloo group. The first holds a model of N million
parameters and its Adam state after one step (3 N floats in all); the second starts
with a fresh model and an empty optimizer and joins. Reported per size:

- ``join_first_step_s``: the joiner's first collective after joining, which includes
  comparing digests and receiving the whole state (ftcomm's reconcile);
- ``raw_s``: ftcomm's transfer alone (manifest + one flat buffer of tensor bytes
  broadcast, loaded into the registered objects), timed from a barrier;
- ``pickle_s`` (the baseline, in the same processes over the same communicator): what
  the transfer did before: ``torch.save`` of the state into bytes, two broadcasts,
  ``torch.load(weights_only=False)`` and ``load_state_dict``.

Medians of ``--repeats`` transfers; the ratio is pickle_s / raw_s. Gossip probes are
slowed (5 s) so that the baseline's ``torch.save``, which holds the interpreter for
seconds at 100M parameters, does not get a worker suspected mid-transfer.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def make_model(million: int):
    import torch
    width = 2048
    layers = max(1, round(million * 1e6 / (width * width)))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def worker(role: str, port: int, million: int, repeats: int) -> dict:
    import torch

    import ftcomm
    from ftcomm.runtime import transfer

    torch.manual_seed(0 if role == "seed" else 1)
    model = make_model(million)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if role == "seed":
        model(torch.randn(4, 2048)).sum().backward()
        optimizer.step()
    peers = [] if role == "seed" else [f"127.0.0.1:{port}"]
    bind = f"127.0.0.1:{port if role == 'seed' else 0}"
    # Slow probes: torch.save of a large state holds the interpreter for seconds, and a
    # worker that cannot answer probes meanwhile would be suspected (the baseline's problem).
    ft = ftcomm.init(peers=peers, bind=bind, min_workers=1, handle_signals=False, init_timeout=120,
                     gossip={"probe_interval": 5.0, "probe_timeout": 4.0})
    ft.register_state(model=model, optimizer=optimizer)
    probe = torch.zeros(1, requires_grad=True)  # a tiny gradient to step with: joins happen at steps

    def step() -> None:
        probe.grad = torch.zeros(1)
        ft.wait_gradients_ready([probe])
    if role == "seed":
        ft.state_restored(5, same_everywhere=True)  # the newest state: the joiner must take it
        while ft.world_size < 2:
            step()  # the joiner is admitted at a step boundary, and this step is its first
            time.sleep(0.01)
        first = None
    else:
        started = time.perf_counter()
        step()  # compares digests, receives the whole state, then steps
        first = time.perf_counter() - started
        assert ft.step >= 5, "the joiner did not receive the seed's state"
    source = int(ft.execute(lambda: ft.allreduce(torch.tensor([ft.rank if role == "seed" else 0])))[0])
    raw, pickled = [], []
    for _ in range(repeats):
        ft.barrier()
        started = time.perf_counter()
        transfer.broadcast_state(ft._comms.comm, ft._loop.news.abort, ft.state, ft.step, ft.view, ft._comms.secret, source,
                                 load=role != "seed")
        ft.barrier()
        raw.append(time.perf_counter() - started)
        ft.barrier()
        started = time.perf_counter()
        pickle_transfer(ft, source, role != "seed")
        ft.barrier()
        pickled.append(time.perf_counter() - started)
    digest = ft.state.digest(ft.step)
    ft.shutdown()
    return {"role": role, "join_first_step_s": first, "raw_s": statistics.median(raw),
            "pickle_s": statistics.median(pickled), "digest": digest,
            "state_mb": round(sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 2**20)}


def pickle_transfer(ft, source: int, load: bool) -> None:
    """The previous transfer: torch.save, broadcast of length and bytes, torch.load(weights_only=False)."""
    import torch
    if not load:
        buffer = io.BytesIO()
        torch.save(ft.state.snapshot(ft.step), buffer)
        payload = buffer.getvalue()
    length = torch.tensor([len(payload) if not load else 0])
    ft.broadcast(length, source)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if not load else \
        torch.empty(int(length.item()), dtype=torch.uint8)
    ft.broadcast(data, source)
    if load:
        snapshot = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
        for name, obj in ft.state.objects.items():
            obj.load_state_dict(snapshot["objects"][name])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(million: int, repeats: int) -> dict:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", role, str(port), str(million), str(repeats)],
                              stdout=subprocess.PIPE, text=True) for role in ("seed", "joiner")]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode:
            raise RuntimeError(f"worker exited {p.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    seed, joiner = results
    assert seed["digest"] == joiner["digest"], "the workers hold different state after the transfers"
    return {"million_params": million, "state_mb": seed["state_mb"],
            "join_first_step_s": round(joiner["join_first_step_s"], 4), "raw_s": round(joiner["raw_s"], 4),
            "pickle_s": round(joiner["pickle_s"], 4), "pickle_over_raw": round(joiner["pickle_s"] / joiner["raw_s"], 2)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        role, port, million, repeats = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(worker(role, port, million, repeats)), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="10,100", help="model sizes in millions of parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "state_transfer.json"))
    args = parser.parse_args()
    rows = []
    for million in (int(x) for x in args.params.split(",")):
        row = measure(million, args.repeats)
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "state_transfer", "machine": {"cpus": os.cpu_count(),
                   "python": platform.python_version()}, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
