"""Connections an outsider needs to kill a worker through its Gloo listener, with and without
ftcomm's admission filter.

    python benchmarks/port_flood.py [--nofile 1024] [--limit 20000] [--batch 250]

Each trial is a child process that opens the data plane's listener as a worker does
(``ftcomm.backends.gloo``: the Gloo device of 127.0.0.1 with its door) under a descriptor
limit of ``--nofile`` (1024 is Linux's usual default). *Unfiltered* opens the door to every
source, which is how Gloo's listener behaves on its own (the baseline, run first);
*filtered* leaves it as a worker leaves it between formations. The parent sends
connect-and-close in batches of ``--batch`` until the child dies or ``--limit`` connections
were tried, and reports for each: the connections tried, how many the kernel completed,
the child's descriptors at the end, and whether (and after how many) it died.

The zmq ports (gossip's and the rendezvous store's) are tried too, each in a child that
serves both as a worker does, with zmq's defaults (the baseline: no connection cap, 1,000
frames queued per connection, gossip frames up to 16 MB; run first) and with ftcomm's
settings: ``--connections`` held open from another loopback address to each port under
the same descriptor limit (the child's descriptors after, and whether it still serves a
member), then forged 4 MB and 16 MB frames from two connections for ``--seconds`` (the
growth of the child's resident memory).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import select
import socket
import subprocess
import sys
import time

CHILD = r"""
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from ftcomm.backends import gloo
device, door = gloo._device("127.0.0.1")
if sys.argv[1] == "unfiltered":
    door.open_for(None)
print(door.port, flush=True)
for line in sys.stdin:
    print(len(os.listdir("/proc/self/fd")), flush=True)
"""


ZMQ_CHILD = r"""
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from ftcomm.gossip import GossipConfig, GossipNode, connections, runtime
from ftcomm.runtime import rendezvous
config = GossipConfig()
if sys.argv[1] == "defaults":  # zmq's own: no cap, 1,000 frames a connection, 16 MB gossip frames
    rendezvous.RECEIVE_QUEUE = runtime.STREAM_QUEUE = 1000
    connections.caps = lambda limit=None: (1 << 30, 1 << 30)
    config = GossipConfig(max_stream_bytes=16 << 20)
node = GossipNode(config=config, secret="s").start()
store = rendezvous.StoreServer("127.0.0.1", b"s")
print(node.port, store.port, flush=True)
for line in sys.stdin:
    statm = open("/proc/self/statm").read().split()
    print(len(os.listdir("/proc/self/fd")), int(statm[1]) * os.sysconf("SC_PAGE_SIZE") >> 20, flush=True)
"""

FRAMES = r"""
import os, sys, time, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.SNDHWM, 100)
sock.connect(sys.argv[1])
frame, end = os.urandom(int(sys.argv[2])), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        time.sleep(0.001)
"""


def zmq_trial(mode: str, nofile: int, connections: int, seconds: float) -> dict:
    """One child serving both zmq ports (``mode``: defaults or ftcomm): held connections,
    then forged large frames; what it cost the child."""
    child = subprocess.Popen([sys.executable, "-c", ZMQ_CHILD, mode, str(nofile)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    gossip, store = map(int, child.stdout.readline().split())

    def ask() -> tuple[int, int] | None:
        try:
            child.stdin.write("\n")
            child.stdin.flush()
            line = child.stdout.readline()
        except BrokenPipeError:
            return None
        return tuple(map(int, line.split())) if line else None
    row: dict = {"mode": mode}
    row["descriptors_before"], rss = ask()
    held = []
    for port in (gossip, store):
        for _ in range(connections):
            conn = socket.socket()
            conn.bind(("127.0.0.2", 0))
            try:
                conn.connect(("127.0.0.1", port))
            except OSError:
                conn.close()
                break
            held.append(conn)
    time.sleep(1.0)
    answer = ask()
    row["descriptors_after"] = None if answer is None else answer[0]
    row["serves"] = answer is not None and _serves(gossip)
    for conn in held:
        conn.close()
    for megabytes in (4, 16):
        if child.poll() is not None:
            row[f"rss_growth_{megabytes}mb"] = None
            continue
        time.sleep(0.5)
        before = (ask() or (0, 0))[1]
        peak = before
        floods = [subprocess.Popen([sys.executable, "-c", FRAMES, f"tcp://127.0.0.1:{port}", str(megabytes << 20),
                                    str(seconds)]) for port in (gossip, store)]
        while any(f.poll() is None for f in floods):
            answer = ask()
            if answer is None:
                break
            peak = max(peak, answer[1])
            time.sleep(0.02)
        for f in floods:
            f.kill()
            f.wait()
        row[f"rss_growth_{megabytes}mb"] = None if child.poll() is not None else peak - before
    row["alive"] = child.poll() is None
    child.kill()
    child.wait()
    return row


def _serves(gossip_port: int) -> bool:
    from ftcomm.gossip import query_members

    try:
        return bool(query_members(f"127.0.0.1:{gossip_port}", secret="s", timeout=5.0))
    except Exception:  # noqa: BLE001 - it does not serve
        return False


def connect_and_close(port: int) -> bool:
    with socket.socket() as sock:
        sock.setblocking(False)
        code = sock.connect_ex(("127.0.0.1", port))
        if code == 0:
            return True
        return code == errno.EINPROGRESS and bool(select.select([], [sock], [], 0.002)[1]) and \
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0


def trial(mode: str, nofile: int, limit: int, batch: int) -> dict:
    child = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(nofile)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = int(child.stdout.readline())
    child.stdin.write("\n")
    child.stdin.flush()
    start_fds = int(child.stdout.readline())
    tried = completed = 0
    died_after, fds = None, start_fds
    started = time.monotonic()
    while tried < limit:
        for _ in range(batch):
            completed += connect_and_close(port)
        tried += batch
        time.sleep(0.05)  # Gloo's loop accepts within a tick
        try:
            child.stdin.write("\n")
            child.stdin.flush()
            line = child.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            died_after = tried
            break
        fds = int(line)
    elapsed = time.monotonic() - started
    child.kill()
    _, err = child.communicate(timeout=30)
    cause = next((ln.split("false. ")[-1].strip() for ln in err.splitlines() if "what()" in ln), None)
    return {"mode": mode, "tried": tried, "completed": completed, "descriptors_before": start_fds,
            "descriptors_after": fds if died_after is None else None, "died_after": died_after,
            "cause": cause, "seconds": round(elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nofile", type=int, default=1024)
    parser.add_argument("--limit", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=250)
    parser.add_argument("--connections", type=int, default=3000, help="held open to each zmq port")
    parser.add_argument("--seconds", type=float, default=4.0, help="of forged frames of each size")
    args = parser.parse_args()
    print(f"# {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, "
          f"descriptor limit {args.nofile}")
    rows = [trial(mode, args.nofile, args.limit, args.batch) for mode in ("unfiltered", "filtered")]
    print(f"{'listener':<11} {'tried':>7} {'completed':>9} {'fds before':>10} {'fds after':>9}  outcome")
    for r in rows:
        outcome = (f"killed after {r['died_after']} connections ({r['cause']})" if r["died_after"]
                   else f"alive after {r['tried']} connections")
        after = "-" if r["descriptors_after"] is None else r["descriptors_after"]
        print(f"{r['mode']:<11} {r['tried']:>7} {r['completed']:>9} {r['descriptors_before']:>10} {after:>9}  "
              f"{outcome}")
    print(json.dumps(rows))
    zmq_rows = [zmq_trial(mode, args.nofile, args.connections, args.seconds) for mode in ("defaults", "ftcomm")]
    print(f"zmq ports ({args.connections} connections held to each, then 4 MB and 16 MB forged frames on two "
          f"connections per port for {args.seconds:g} s)")
    print(f"{'settings':<9} {'fds before':>10} {'fds after':>9} {'serves':>6} {'RSS +4MB':>9} {'RSS +16MB':>9}  alive")
    for r in zmq_rows:
        cells = ["-" if r[k] is None else str(r[k]) for k in ("descriptors_after", "rss_growth_4mb", "rss_growth_16mb")]
        print(f"{r['mode']:<9} {r['descriptors_before']:>10} {cells[0]:>9} {str(r['serves']):>6} {cells[1]:>7}MB "
              f"{cells[2]:>7}MB  {r['alive']}")
    print(json.dumps(zmq_rows))


if __name__ == "__main__":
    main()
