"""The network-namespace harness removes what it made, and only that."""

from __future__ import annotations

import json
import secrets
import subprocess

import pytest

from . import netns

pytestmark = [pytest.mark.skipif(netns.unavailable() is not None, reason=netns.unavailable() or ""),
              pytest.mark.timeout(60)]


def namespaces() -> set[str]:
    return {line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                       text=True).stdout.splitlines() if line.strip()}


def dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_lab_removes_everything_it_made():
    with netns.Lab(2, split=1) as lab:
        made = {lab.namespace(0), lab.namespace(1)}
        assert made <= namespaces() and lab.reachable(0, 1)
    assert not made & namespaces()
    assert not (netns.STATE / f"{lab.run}.json").exists()


def test_a_dead_runs_leftovers_are_swept_but_names_of_other_patterns_are_not():
    run, foreign = secrets.token_hex(3), f"ftforeign{secrets.token_hex(2)}"
    own, foreign_link = f"ft{run}h0", f"ftfl{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", own], check=True)
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    subprocess.run(["ip", "link", "add", foreign_link, "type", "veth", "peer", "name", foreign_link + "p"], check=True)
    state = netns.STATE / f"{run}.json"
    try:
        state.write_text(json.dumps({"pid": dead_pid(), "netns": [own, foreign], "links": [foreign_link]}))
        (netns.STATE / "broken.json").write_text('{"pid": null}')
        netns.sweep()
        left = namespaces()
        assert own not in left and foreign in left and not state.exists()
        assert subprocess.run(["ip", "link", "show", foreign_link], capture_output=True).returncode == 0
        assert (netns.STATE / "broken.json").exists()  # unreadable: not acted on
    finally:
        subprocess.run(["ip", "netns", "del", foreign])
        subprocess.run(["ip", "link", "del", foreign_link], capture_output=True)
        subprocess.run(["ip", "netns", "del", own])
        state.unlink(missing_ok=True)
        (netns.STATE / "broken.json").unlink(missing_ok=True)
