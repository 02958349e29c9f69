"""A standalone gossip member process, driven over stdin and reporting on stdout (JSON lines).

Used by the real-process tests, the gossip demo and the benchmarks::

    python -m ftcomm.gossip.agent --bind 127.0.0.1:7946 --peer 127.0.0.1:7000

Output lines: ``{"ev": "ready", "id", "address", "t"}``, one ``{"ev": "member", "kind",
"member", "incarnation", "state", "source", "t"}`` per membership event, and answers to
commands. Commands, one JSON object per line: ``{"cmd": "members"}``, ``{"cmd": "stats"}``,
``{"cmd": "metadata", "value": {...}}``, ``{"cmd": "partition", "a": [...], "b": [...]}``,
``{"cmd": "heal"}``, ``{"cmd": "drop", "rate": 0.1}``, ``{"cmd": "leave"}``, ``{"cmd": "stop"}``.
The process stops when stdin closes, so it never outlives the process that started it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time

from .config import GossipConfig, parse_assignments
from .faults import FaultFilter
from .runtime import GossipEvent, GossipNode


class _Output:
    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, **fields: object) -> None:
        line = json.dumps(fields, default=str)
        with self._lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftcomm.gossip.agent")
    parser.add_argument("--bind", default="127.0.0.1:0")
    parser.add_argument("--peer", action="append", default=[])
    parser.add_argument("--cluster", default="ftcomm")
    parser.add_argument("--secret", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--metadata", default="{}", help="initial metadata as JSON")
    args = parser.parse_args(argv)

    out = _Output()
    faults = FaultFilter()
    config = GossipConfig().with_overrides(**parse_assignments(args.set))
    node = GossipNode(args.bind, cluster=args.cluster, secret=args.secret, config=config,
                      metadata=json.loads(args.metadata), fault_filter=faults)

    def on_event(event: GossipEvent) -> None:
        out.write(ev="member", kind=event.kind, member=event.member.id, incarnation=event.member.incarnation,
                  state=event.member.state, metadata=event.member.metadata, source=event.source, t=event.time)

    node.subscribe(on_event)
    try:
        node.start(args.peer)
    except Exception as exc:
        out.write(ev="error", message=str(exc))
        return 1
    out.write(ev="ready", id=node.id, address=node.address, pid=os.getpid(), t=time.time())
    for line in sys.stdin:
        try:
            command = json.loads(line)
            name = command.get("cmd")
        except (ValueError, AttributeError):
            out.write(ev="error", message=f"bad command line: {line.strip()[:80]}")
            continue
        if name == "members":
            out.write(ev="members", t=time.time(),
                      members=[dict(id=m.id, state=m.state, incarnation=m.incarnation, metadata=m.metadata,
                                    confirmed=m.confirmed) for m in node.members()])
        elif name == "stats":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            out.write(ev="stats", stats=node.stats(), cpu_s=usage.ru_utime + usage.ru_stime, t=time.time())
        elif name == "metadata":
            node.set_metadata(command["value"])
            out.write(ev="ok", cmd=name, t=time.time())
        elif name == "partition":
            faults.partition(command["a"], command["b"])
            out.write(ev="ok", cmd=name, t=time.time())
        elif name == "heal":
            faults.heal()
            out.write(ev="ok", cmd=name, t=time.time())
        elif name == "drop":
            faults.drop_rate = float(command["rate"])
            out.write(ev="ok", cmd=name, t=time.time())
        elif name == "leave":
            out.write(ev="leaving", t=time.time())
            node.leave()
            out.write(ev="stopped", t=time.time())
            return 0
        elif name == "stop":
            break
        else:
            out.write(ev="error", message=f"unknown command {name!r}")
    node.stop()
    out.write(ev="stopped", t=time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main())
