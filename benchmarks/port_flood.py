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


if __name__ == "__main__":
    main()
