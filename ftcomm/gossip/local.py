"""Local clusters of gossip agent processes on loopback, for the demo, tests and benchmarks.

Each member is a real process (``python -m ftcomm.gossip.agent``) whose JSON-line
output is collected by a reader thread. Every wait polls with a deadline and raises
``TimeoutError`` naming what it waited for; nothing here can hang.
"""

from __future__ import annotations

import sys
import time

from ..localproc import ChildProcess


class AgentProcess(ChildProcess):
    """One gossip agent process (``python -m ftcomm.gossip.agent``)."""

    def __init__(self, peers: list[str] = (), *, bind: str = "127.0.0.1:0", args: list[str] = (),
                 ready_timeout: float | None = 30.0) -> None:
        command = [sys.executable, "-u", "-m", "ftcomm.gossip.agent", "--bind", bind]
        for peer in peers:
            command += ["--peer", peer]
        super().__init__(command + list(args), ready_timeout)

    def member_events(self, member_id: str, kind: str | None = None) -> list[dict]:
        return [e for e in self.snapshot()
                if e["ev"] == "member" and e["member"] == member_id and (kind is None or e["kind"] == kind)]


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
