"""Local clusters of gossip agent processes on loopback, for the demo, tests and benchmarks.

Each member is a real process (``python -m ftcomm.gossip.agent``) whose JSON-line
output is collected by a reader thread. Every wait polls with a deadline and raises
``TimeoutError`` naming what it waited for; nothing here can hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable


class AgentProcess:
    """One agent process: send it commands, read its events, signal it."""

    def __init__(self, peers: list[str] = (), *, bind: str = "127.0.0.1:0", args: list[str] = (),
                 ready_timeout: float | None = 30.0) -> None:
        command = [sys.executable, "-u", "-m", "ftcomm.gossip.agent", "--bind", bind]
        for peer in peers:
            command += ["--peer", peer]
        command += list(args)
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, bufsize=1)
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if ready_timeout is not None:
            self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait for the agent to have joined; learn its id, address and pid."""
        ready = self.wait_for(lambda e: e["ev"] in ("ready", "error"), timeout, "ready")
        if ready["ev"] == "error":
            self.close()
            raise RuntimeError(f"agent failed to start: {ready['message']}")
        self.id: str = ready["id"]
        self.address: str = ready["address"]
        self.pid: int = ready["pid"]

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.events.append(event)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.events)

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float, what: str = "an event",
                 start: int = 0) -> dict:
        """The first event (from index ``start``) matching ``predicate``; polls until ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                for event in self.events[start:]:
                    if predicate(event):
                        return event
            if time.monotonic() >= deadline:
                raise TimeoutError(f"agent {getattr(self, 'address', '?')}: no {what} within {timeout:g} s")
            if self.process.poll() is not None and not self._reader.is_alive():
                raise RuntimeError(f"agent exited with {self.process.returncode} while waiting for {what}: "
                                   f"{self.process.stderr.read()[-2000:]}")
            time.sleep(0.01)

    def request(self, timeout: float = 10.0, **command: object) -> dict:
        """Send a command and wait for its answer (members, stats) or acknowledgement."""
        start = len(self.snapshot())
        self.send(**command)
        name = command["cmd"]
        return self.wait_for(lambda e: e["ev"] == name or (e["ev"] == "ok" and e.get("cmd") == name),
                             timeout, f"answer to {name}", start)

    def send(self, **command: object) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def member_events(self, member_id: str, kind: str | None = None) -> list[dict]:
        return [e for e in self.snapshot()
                if e["ev"] == "member" and e["member"] == member_id and (kind is None or e["kind"] == kind)]

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the process (politely, then by force) and reap it."""
        if self.process.poll() is None:
            try:
                self.signal(signal.SIGCONT)
                self.process.stdin.close()
            except (OSError, ValueError):
                pass
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        for stream in (self.process.stdout, self.process.stderr):
            try:
                stream.close()
            except (OSError, ValueError):
                pass


class LocalCluster:
    """``n`` agents joined through the first one; a context manager that always cleans up."""

    def __init__(self, n: int, args: list[str] = ()) -> None:
        self.agents: list[AgentProcess] = []
        try:
            self.agents.append(AgentProcess(args=args))
            seed = self.agents[0].address
            self.agents.extend(AgentProcess([seed], args=args, ready_timeout=None) for _ in range(n - 1))
            for agent in self.agents[1:]:
                agent.wait_ready()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for agent in self.agents:
            agent.close()

    def wait_converged(self, timeout: float = 20.0, agents: list[AgentProcess] | None = None) -> float:
        """Wait until each agent sees exactly the given agents alive; returns seconds waited."""
        agents = agents if agents is not None else self.agents
        expected = {a.id for a in agents}
        started = time.monotonic()
        deadline = started + timeout
        while True:
            views = [{m["id"] for m in a.request(cmd="members")["members"] if m["state"] == "alive"}
                     for a in agents]
            if all(view == expected for view in views):
                return time.monotonic() - started
            if time.monotonic() >= deadline:
                raise TimeoutError(f"cluster did not converge within {timeout:g} s: "
                                   f"view sizes {[len(v) for v in views]}, expected {len(expected)}")
            time.sleep(0.05)
