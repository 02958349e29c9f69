"""Child processes that speak JSON lines: the gossip agents and training workers of the
demos, tests and benchmarks. Every wait polls with a deadline; nothing here can hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable


class ChildProcess:
    """A child that prints JSON lines (first ``{"ev": "ready", "id", "address", "pid"}``) and
    reads JSON commands on stdin; it must exit when stdin closes."""

    def __init__(self, command: list[str], ready_timeout: float | None = 30.0, env: dict | None = None) -> None:
        self.command = command
        # Its own process group: close() also stops what it started (data-loader workers,
        # a fork server), which would otherwise outlive a kill -9 and hold its pipes open.
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, bufsize=1, env=env,
                                        start_new_session=True)
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self.stderr_tail: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_reader.start()
        if ready_timeout is not None:
            self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait for the process to be ready; learn its id, address and pid."""
        ready = self.wait_for(lambda e: e["ev"] in ("ready", "error"), timeout, "ready")
        if ready["ev"] == "error":
            self.close()
            raise RuntimeError(f"process failed to start: {ready['message']}")
        self.id: str = ready["id"]
        self.address: str = ready["address"]
        self.pid: int = ready["pid"]

    def _read_stderr(self) -> None:
        for line in self.process.stderr:
            self.stderr_tail.append(line)
            del self.stderr_tail[:-200]

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
                tail = "".join(self.stderr_tail[-12:])
                raise TimeoutError(f"process {getattr(self, 'address', self.process.pid)}: no {what} within "
                                   f"{timeout:g} s; its stderr ends with:\n{tail}")
            if self.process.poll() is not None and not self._reader.is_alive():
                raise RuntimeError(f"process exited with {self.process.returncode} while waiting for {what}: "
                                   f"{''.join(self.stderr_tail)[-3000:]}")
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

    def signal(self, sig: int, whole_group: bool = False) -> None:
        """Send ``sig`` to the process, or (``whole_group``) to every process of its group: the
        processes it forked too, as a machine that fails takes them all."""
        if whole_group:
            os.killpg(self.process.pid, sig)
        else:
            os.kill(self.process.pid, sig)

    def descendants(self) -> list[int]:
        """Pids of live processes it started (its process group, itself excluded; Linux)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.process.pid:
                continue
            fields = stat_fields(entry)
            if fields is None:
                continue
            if int(fields[2]) == self.process.pid and fields[0] != "Z":  # process group, not a zombie
                pids.append(int(entry))
        return pids

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the process (politely, then by force) and reap it, then whatever it started."""
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
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the group outlives its leader
        except (ProcessLookupError, PermissionError):
            pass
        for reader in (self._reader, self._stderr_reader):
            reader.join(timeout)
        for stream in (self.process.stdout, self.process.stderr):
            try:
                stream.close()
            except (OSError, ValueError):
                pass


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command (state first, then the parent,
    the process group, ...; the command may itself hold parentheses and spaces), None when
    the process does not run (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def process_start(pid: int, fields: list[str] | None = None) -> int | None:
    """Process ``pid``'s start time (clock ticks since boot; from its ``fields`` when they
    were read already), None when it does not run: with the pid, it names one process,
    never a later one that reuses the pid."""
    try:
        return int((stat_fields(pid) if fields is None else fields)[19])
    except (TypeError, ValueError, IndexError):
        return None
