"""Several hosts on one machine: Linux network namespaces on one or two bridges.

Each host is a network namespace with one address on a bridge (a veth pair: one end in
the namespace, the other on the bridge). With two bridges, the bridges are joined by one
more veth pair, so taking that link down cuts the hosts into two sides, as a switch
failure would. Taking a host's own link down loses the node: its packets vanish and
nothing refuses a connection, as when a machine dies.

Every name carries a random run id; what a run creates is listed in a state file under
``/tmp/ftcomm-netns`` until it is removed, and a later run removes what a run whose
process is gone left behind (a test killed outright). Traffic only ever goes to the
addresses of the namespaces made here: the bridges have no address and no route leads
out of the namespaces.

Needs root and iproute2's ``ip``; :func:`unavailable` says why a machine cannot.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import random
import re
import secrets
import shutil
import stat
import subprocess
import sys
from typing import Any

STATE = pathlib.Path("/tmp/ftcomm-netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _limit_tcp(dev: str, mbit: int) -> None:
    """TCP leaving through ``dev`` at most ``mbit`` Mbit/s; UDP at full speed."""
    for args in (["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
                 ["class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "10gbit"],
                 ["class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", f"{mbit}mbit",
                  "ceil", f"{mbit}mbit"],
                 ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match",
                  "ip", "protocol", "17", "0xff", "flowid", "1:10"]):
        subprocess.run(["tc", *args], check=True, capture_output=True, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's ip command"
    probe = f"ftprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _remove(names: dict[str, list[str]]) -> None:
    for ns in names.get("netns", []):
        _ip("netns", "del", ns, check=False)  # its end of every veth pair goes with it
    for link in names.get("links", []):
        _ip("link", "del", link, check=False)


def _state_dir() -> pathlib.Path:
    """The state directory, made private to root; refused when anyone else could have
    planted a state file in it (its files name what a sweep deletes)."""
    try:
        STATE.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = STATE.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise RuntimeError(f"{STATE} must be a directory owned by uid {os.geteuid()} with mode 0700")
    return STATE


def sweep() -> None:
    """Remove what earlier runs left behind when their process died before cleaning up: only
    names of that run's own pattern, whatever its state file lists."""
    for path in _state_dir().glob("*.json"):
        run = path.stem
        try:
            state = json.loads(path.read_text())
            os.kill(int(state["pid"]), 0)
            continue  # its run is still going
        except ProcessLookupError:
            pass
        except Exception:  # noqa: BLE001 - unreadable: not ours to act on
            continue
        own = re.compile(rf"ft{re.escape(run)}[hbvxe]\d+")
        _remove({kind: [n for n in state.get(kind, []) if isinstance(n, str) and own.fullmatch(n)]
                 for kind in ("netns", "links")})
        path.unlink(missing_ok=True)


def _free_subnet() -> ipaddress.IPv4Network:
    routes = _ip("-4", "route", "show", "table", "all").stdout
    used = [ipaddress.ip_network(word, strict=False) for line in routes.splitlines()
            for word in line.split()[:1] if "/" in word]
    for _ in range(100):
        net = ipaddress.ip_network(f"10.{random.randrange(200, 250)}.{random.randrange(256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test hosts")


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (its main thread's children; none once it exited)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


class Lab:
    """``hosts`` namespaces; with ``split``, hosts ``0..split-1`` on bridge 0 and the rest on
    bridge 1, the bridges joined by one link. Use as a context manager."""

    def __init__(self, hosts: int, split: int | None = None) -> None:
        self.run = secrets.token_hex(3)
        self.subnet = _free_subnet()
        self.split = split
        self._names: dict[str, list[str]] = {"pid": os.getpid(), "netns": [], "links": []}  # type: ignore[dict-item]
        self._hosts = 0
        self._initial = hosts

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Lab":
        sweep()
        try:
            for b in range(2 if self.split is not None else 1):
                self._link(self.bridge(b), "type", "bridge")
                _ip("link", "set", self.bridge(b), "up")
            if self.split is not None:
                self._link(f"ft{self.run}x0", "type", "veth", "peer", "name", f"ft{self.run}x1")
                for b in (0, 1):
                    _ip("link", "set", f"ft{self.run}x{b}", "master", self.bridge(b))
                    _ip("link", "set", f"ft{self.run}x{b}", "up")
            for _ in range(self._initial):
                self.add_host()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        _remove(self._names)
        self._state_file().unlink(missing_ok=True)

    # ------------------------------------------------------------------ hosts
    def add_host(self, bridge: int | None = None) -> int:
        """A new namespace with its own address; returns its index."""
        i = self._hosts
        if bridge is None:
            bridge = 0 if self.split is None or i < self.split else 1
        ns, outside, inside = self.namespace(i), f"ft{self.run}v{i}", f"ft{self.run}e{i}"
        self._create("netns", ns, ["netns", "add", ns])  # recorded first: an interrupt leaves nothing unlisted
        self._link(outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("link", "set", outside, "master", self.bridge(bridge))
        _ip("link", "set", outside, "up")
        _ip("-n", ns, "addr", "add", f"{self.address(i)}/{self.subnet.prefixlen}", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self._hosts += 1
        return i

    def namespace(self, i: int) -> str:
        return f"ft{self.run}h{i}"

    def bridge(self, b: int) -> str:
        return f"ft{self.run}b{b}"

    def address(self, i: int) -> str:
        return str(self.subnet.network_address + 10 + i)

    def command(self, i: int, argv: list[str], own_pids: bool = False) -> list[str]:
        """``argv`` run on host ``i``; ``own_pids``: in a pid namespace of its own too, with
        its own /proc, so that neither it nor processes of other hosts can look each other
        up there, as on separate machines, where ``unshare`` exists. ``unshare`` waits for
        the process and exits with its status; it ignores SIGTERM (signal its child, see
        :func:`children`), and a SIGKILL of it kills the process too."""
        own = ["unshare", "--pid", "--mount-proc", "--kill-child"] if own_pids and shutil.which("unshare") else []
        return ["ip", "netns", "exec", self.namespace(i), *own, *argv]

    # ------------------------------------------------------------------ faults
    def set_host_link(self, i: int, up: bool) -> None:
        """Host ``i``'s cable: down, its packets vanish (a lost node); up, it is back."""
        _ip("link", "set", f"ft{self.run}v{i}", "up" if up else "down")

    def limit_host_link(self, i: int, mbit: int) -> None:
        """Host ``i``'s cable carries at most ``mbit`` Mbit/s towards it (a token bucket on
        the bridge's end: a slow or degraded link); gone with the host's link."""
        subprocess.run(["tc", "qdisc", "add", "dev", f"ft{self.run}v{i}", "root", "tbf", "rate", f"{mbit}mbit",
                        "burst", "64kb", "latency", "500ms"], check=True, capture_output=True, timeout=30)

    def limit_host_tcp(self, i: int, mbit: int) -> None:
        """TCP towards host ``i`` carries at most ``mbit`` Mbit/s, UDP (gossip's probes) goes at
        full speed: a slow data plane whose member gossip still finds alive. Gone with the
        host's link."""
        _limit_tcp(f"ft{self.run}v{i}", mbit)

    def limit_bridge_link_tcp(self, mbit: int) -> None:
        """With ``split``: TCP between the two bridges carries at most ``mbit`` Mbit/s each way
        (UDP at full speed): two regions joined by a slow link."""
        for b in (0, 1):
            _limit_tcp(f"ft{self.run}x{b}", mbit)

    def bridge_link_bytes(self) -> int:
        """Bytes the link between the two bridges carried, both ways."""
        return sum(int(pathlib.Path(f"/sys/class/net/ft{self.run}x{b}/statistics/tx_bytes").read_text())
                   for b in (0, 1))

    def set_bridge_link(self, up: bool) -> None:
        """The link between the two bridges: down, the two sides cannot reach each other."""
        _ip("link", "set", f"ft{self.run}x0", "up" if up else "down")

    def reachable(self, src: int, dst: int, timeout: float = 2.0) -> bool:
        """A TCP connect from host ``src`` to a closed port of host ``dst`` is answered
        (refused) by ``dst``'s kernel: the two hosts can talk."""
        probe = ("import socket,sys\ns=socket.socket(); s.settimeout(%r)\n"
                 "try: s.connect((%r, 9))\nexcept ConnectionRefusedError: sys.exit(0)\n"
                 "except OSError: sys.exit(1)\nsys.exit(0)\n") % (timeout, self.address(dst))
        done = subprocess.run(self.command(src, [sys.executable, "-c", probe]), capture_output=True,
                              timeout=timeout + 20)
        return done.returncode == 0

    # ------------------------------------------------------------------ bookkeeping
    def _link(self, name: str, *spec: str) -> None:
        self._create("links", name, ["link", "add", name, *spec])

    def _create(self, kind: str, name: str, command: list[str]) -> None:
        """Record ``name``, then create it; a name that could not be created (it may be
        someone else's) is forgotten again, so that nothing removes it."""
        self._names[kind].append(name)
        self._save()
        try:
            _ip(*command)
        except RuntimeError:
            self._names[kind].remove(name)
            self._save()
            raise

    def _state_file(self) -> pathlib.Path:
        return _state_dir() / f"{self.run}.json"

    def _save(self) -> None:
        self._state_file().write_text(json.dumps(self._names))
