"""Polling with a deadline: the tests' only way to wait for a condition."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float, what: str, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s")
        time.sleep(interval)
