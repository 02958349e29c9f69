"""Workers on separate hosts: each in a network namespace of its own (tests/netns.py).

Each test asserts DESIGN §2 (equal digests after every re-formation and at the end,
abort latency, clean exits) for a fault that only exists across hosts: a node whose
packets vanish (nothing refuses a connection), and a partition between two switches.
No environment variable but the group's secret (``FTCOMM_SECRET``) is set for any worker:
the data plane must follow ``bind``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess

import pytest

import ftcomm
from ftcomm.errors import AddressError

from . import netns
from .polling import wait_until
from .train_cluster import TrainCluster, assert_invariants

REASON = netns.unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")
pytestmark = pytest.mark.timeout(240)


@contextlib.contextmanager
def group_on_hosts(hosts: int, split: int | None = None):
    """``hosts`` workers, one per namespace, in one view: (lab, cluster, workers, view id)."""
    with netns.Lab(hosts, split=split) as lab:
        cluster = TrainCluster(lab)
        try:
            workers = cluster.start(hosts, ["--min-workers", "1"], hosts=list(range(hosts)))
            view_id = max(v["view_id"] for v in cluster.wait_view(workers, hosts, timeout=90))
            yield lab, cluster, workers, view_id
        finally:
            cluster.close()


def listening_addresses(lab: netns.Lab, host: int, pid: int) -> set[str]:
    """The local addresses of every socket process ``pid`` listens on (TCP) or is bound to (UDP)."""
    table = subprocess.run(lab.command(host, ["ss", "-Hlntup"]), capture_output=True, text=True, timeout=30).stdout
    return {line.split()[4].rsplit(":", 1)[0] for line in table.splitlines() if f"pid={pid}," in line}


def exits_cleanly(workers) -> None:
    for w in workers:
        assert w.process.wait(timeout=60) == 0, "".join(w.stderr_tail[-60:])


def leave_all(jobs) -> None:
    """SIGTERM (a graceful leave) to every job still running, then reap them all (a job
    started in a pid namespace of its own: to the process ``unshare`` waits for, since it
    ignores the signal)."""
    for job in jobs:
        if job.process.poll() is None:
            own_pids = "unshare" in job.process.args
            for pid in netns.children(job.process.pid) if own_pids else [job.process.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
    for job in jobs:
        job.finish(90)


def wait_logged(predicate, timeout: float, what: str, jobs) -> None:
    """:func:`wait_until`, failing with the end of each job's log."""
    try:
        wait_until(predicate, timeout, what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; logs:\n" + "\n".join("".join(line for line in job.log[-60:]
                                                                    if "DEBUG" not in line) for job in jobs)) from None


def three_replicas_together(jobs) -> int:
    """Once the six processes of three replicas of 2 all reported one view of all six: its id."""
    views = lambda: [e for job in jobs for e in job.of("view") if len(e["members"]) == 6]  # noqa: E731
    together = lambda: all(any(len(e["members"]) == 6 for e in job.of("view")) for job in jobs)  # noqa: E731
    wait_logged(together, 120, "view of the three replicas together", jobs)
    return max(e["view_id"] for e in views())


def assert_one_state_per_shard(views: list[dict]) -> None:
    """Every process of a view reported one member list, and those of one shard index one
    state (step and digest)."""
    seen: dict = {}
    for e in views:
        seen.setdefault((e["view_id"], e["shard"]), []).append(e)
    for (view_id, shard), events in seen.items():
        assert len({tuple(e["members"]) for e in events}) == 1, f"view {view_id} has two member lists"
        assert len({(e["step"], e["state_digest"]) for e in events}) == 1, f"view {view_id}, shard {shard}"


@needs_netns
def test_four_hosts_train_survive_a_crash_and_take_a_joiner_from_a_new_host():
    with group_on_hosts(4) as (lab, cluster, workers, view_id):
        for host, w in enumerate(workers):  # gossip, rendezvous and Gloo: on the bound address only
            assert listening_addresses(lab, host, w.pid) == {lab.address(host)}
        victim = workers[2]
        victim.signal(signal.SIGKILL)
        survivors = [w for w in workers if w is not victim]
        views = cluster.wait_view(survivors, 3, timeout=60, after=view_id)
        assert {v["reason"] for v in views} == {"crash"}
        joiner = cluster.start(1, ["--min-workers", "1"], hosts=[lab.add_host()])
        everyone = survivors + joiner
        views = cluster.wait_view(everyone, 4, timeout=90, after=max(v["view_id"] for v in views))
        assert len({(v["view_id"], v["step"], v["state_digest"]) for v in views}) == 1, views
        assert_invariants(everyone, cluster.finish(everyone, timeout=120))
        exits_cleanly(everyone)


@needs_netns
def test_a_lost_node_is_excluded_and_rejoins_when_its_link_returns():
    with group_on_hosts(4) as (lab, cluster, workers, view_id):
        lost = workers[3]
        lab.set_host_link(3, False)  # its packets vanish: no refusal, only silence
        survivors = workers[:3]
        views = cluster.wait_view(survivors, 3, timeout=60, after=view_id)
        assert {v["reason"] for v in views} == {"hang"}  # found by probes and suspicion
        cut_at = max(cluster.status(w) for w in survivors)
        wait_until(lambda: min(cluster.status(w) for w in survivors) > cut_at + 20, 60, "progress without it")
        lab.set_host_link(3, True)
        back = lost.wait_for(lambda e: e["ev"] == "view" and len(e["members"]) == 4 and e["view_id"] > view_id,
                             90, "the lost node to rejoin")
        assert back["reason"] in ("join", "rejoin")  # rank 0's reason: a join, unless rank 0 came back
        cluster.wait_view(workers, 4, timeout=60, after=max(v["view_id"] for v in views))
        assert_invariants(workers, cluster.finish(workers, timeout=120))
        exits_cleanly(workers)


@needs_netns
def test_a_partition_three_to_two_stops_the_minority_and_heals_to_one_group():
    with group_on_hosts(5, split=3) as (lab, cluster, workers, view_id):
        majority, minority = workers[:3], workers[3:]
        lab.set_bridge_link(False)
        views = cluster.wait_view(majority, 3, timeout=60, after=view_id)
        cut_view = max(v["view_id"] for v in views)
        minority_steps = [cluster.status(w) for w in minority]
        majority_at = max(cluster.status(w) for w in majority)
        wait_until(lambda: min(cluster.status(w) for w in majority) > majority_at + 30, 60,
                   "the majority to go on")
        assert [cluster.status(w) for w in minority] == minority_steps, "the minority committed while cut off"
        # cut off, the minority forms no view of its own (its log may hold a view of all five that
        # formed just before the cut, when a re-formation was under way: that one had a quorum)
        assert not any(e["ev"] == "view" and e["view_id"] > view_id and len(e["members"]) < 3
                       for w in minority for e in w.snapshot())
        lab.set_bridge_link(True)
        healed = cluster.wait_view(workers, 5, timeout=120, after=cut_view)
        assert {v["reason"] for v in healed[3:]} <= {"rejoin", "join"}  # back in, state reconciled below
        assert_invariants(workers, cluster.finish(workers, timeout=120))
        exits_cleanly(workers)


@needs_netns
def test_the_network_check_names_the_host_behind_a_slow_link(tmp_path):
    """Four hosts start a group together with the network check on; host 2's link carries
    50 Mbit/s (the others' run at memory speed): every member names host 2, and nothing else."""
    with netns.Lab(4) as lab:
        lab.limit_host_link(2, 50)
        cluster = TrainCluster(lab)
        try:
            addresses = [f"{lab.address(i)}:{cluster.PORT}" for i in range(4)]
            options = '{"network_check": true, "network_check_mb": 1}'
            workers = []
            for i in range(4):
                env = {"FTCOMM_NETWORK_REPORT": str(tmp_path / f"report{i}.json")}
                cluster.seed_address = ",".join(a for a in addresses if a != addresses[i])
                workers += cluster.start(1, ["--min-workers", "4", "--options", options], wait=False,
                                         env=env, hosts=[i])
            for w in workers:
                w.wait_ready(120)
            reports = [json.loads((tmp_path / f"report{i}.json").read_text()) for i in range(4)]
            assert all(r["slow_members"] == [workers[2].id] for r in reports), reports[0]
            assert all(r["slow_links"] == [] and len(r["links"]) == 6 for r in reports), [
                (r["slow_links"], r["links"]) for r in reports]
            assert_invariants(workers, cluster.finish(workers, timeout=120))
        finally:
            cluster.close()


@needs_netns
def test_the_network_check_waits_for_a_round_that_outlasts_the_formation_timeout(tmp_path):
    """Three hosts (one sits out each round); TCP towards host 1 carries 2 Mbit/s (gossip's
    UDP probes go at full speed: nobody is suspected), so each of its pairs' three 0.5 MB
    allreduces takes about 2 s and its rounds outlast formation_timeout (5 s), while no
    single operation does. A member whose next partner is still in such a round must
    wait for it, not give up on the check."""
    with netns.Lab(3) as lab:
        lab.limit_host_tcp(1, 2)
        cluster = TrainCluster(lab)
        try:
            addresses = [f"{lab.address(i)}:{cluster.PORT}" for i in range(3)]
            options = json.dumps({"network_check": True, "network_check_mb": 0.5, "formation_timeout": 5})
            workers = []
            for i in range(3):
                env = {"FTCOMM_NETWORK_REPORT": str(tmp_path / f"report{i}.json")}
                cluster.seed_address = ",".join(a for a in addresses if a != addresses[i])
                workers += cluster.start(1, ["--min-workers", "3", "--options", options], wait=False,
                                         env=env, hosts=[i])
            for w in workers:
                w.wait_ready(150)
            missing = [i for i in range(3) if not (tmp_path / f"report{i}.json").exists()]
            assert not missing, f"no network report from hosts {missing}: " + "".join(
                line for w in workers for line in w.stderr_tail if "network check" in line)
            reports = [json.loads((tmp_path / f"report{i}.json").read_text()) for i in range(3)]
            for r in reports:
                assert len(r["links"]) == 3
                slowest = min(r["links"], key=lambda l: l["bandwidth"])
                assert workers[1].id in (slowest["a"], slowest["b"])
        finally:
            cluster.close()


def test_a_loopback_bind_with_peers_on_other_hosts_fails_fast_with_the_reason():
    with pytest.raises(AddressError, match=r"127\.0\.0\.1.*10\.9\.8\.7:7946.*other host"):
        ftcomm.init(bind="127.0.0.1:0", peers=["10.9.8.7:7946"], handle_signals=False)
    with pytest.raises(AddressError, match="0.0.0.0"):
        ftcomm.init(bind="0.0.0.0:0", handle_signals=False)


@pytest.mark.parametrize("bind, reason", [("[::1]:0", "IPv6"), ("nonexistent.invalid:0", "does not resolve"),
                                          ("203.0.113.9:0", "not an address of this machine")])
def test_a_bind_address_that_cannot_work_is_refused_with_the_reason(bind, reason):
    with pytest.raises(AddressError, match=reason):
        ftcomm.init(bind=bind, handle_signals=False)


def test_every_plane_binds_the_ipv4_address_a_name_resolves_to():
    ft = ftcomm.init(bind="localhost:0", handle_signals=False)  # IPv6 first on some systems
    try:
        assert ft.gossip.host == "127.0.0.1" and ft.id.startswith("127.0.0.1:")
    finally:
        ft.shutdown()


@needs_netns
def test_three_hosts_each_running_a_sharded_replica_lose_one_and_take_it_back_when_its_link_returns():
    """Each namespace runs one replica of 2 processes under its own ``ftcomm run
    --replica-size 2``. Host 2's link goes down: the other replicas go on without its
    replica (found by probes and suspicion), which waits, cut off from the quorum, and
    rejoins as a whole when the link returns; every view holds one state per shard."""
    import secrets
    import sys

    from .test_hsdp import EXAMPLE, Job

    with netns.Lab(3) as lab:
        env = {"FTCOMM_SECRET": secrets.token_hex(16)}
        jobs = []
        try:
            for host in range(3):
                command = [sys.executable, "-m", "ftcomm", "run", "--nproc-per-node", "2", "--replica-size", "2",
                           "--bind", lab.address(host), "--port", "7946",
                           *(["--peers", f"{lab.address(0)}:7946"] if host else []),
                           EXAMPLE, "--steps", "100000000", "--min-workers", "2", "--step-time", "0.03",
                           "--report-every", "1"]
                # (each host in a pid namespace and /proc of its own, as separate machines are)
                jobs.append(Job(0, command=lab.command(host, command, own_pids=True), env=env))
            everyone = lambda: [e for job in jobs for e in job.of("view")]  # noqa: E731
            whole = three_replicas_together(jobs)
            lab.set_host_link(2, False)
            cut = lambda: [e for job in jobs[:2] for e in job.of("view")  # noqa: E731
                           if len(e["members"]) == 4 and e["view_id"] > whole]
            wait_until(lambda: len(cut()) >= 4, 60, "the other replicas going on without the lost one")
            assert {e["reason"] for e in cut()} == {"hang"}
            at_cut = max(e["step"] for e in jobs[0].of("step"))
            wait_until(lambda: max(e["step"] for e in jobs[0].of("step")) > at_cut + 20, 60, "progress without it")
            cut_view = max(e["view_id"] for e in cut())
            lab.set_host_link(2, True)
            wait_until(lambda: sum(len(e["members"]) == 6 and e["view_id"] > cut_view for e in everyone()) >= 6, 120,
                       lambda: "the lost replica never came back: " + "".join(jobs[2].log[-30:]))
            wait_until(lambda: min(max([e["step"] for e in job.of("step")] + [0]) for job in jobs) > at_cut + 40,
                       60, "the replicas training together again")
        finally:
            leave_all(jobs)
        assert_one_state_per_shard(everyone())
        assert not any("Traceback" in line for job in jobs[:2] for line in job.log), "".join(jobs[0].log[-40:])


@needs_netns
def test_a_replica_split_across_two_hosts_releases_its_partner_when_one_host_is_lost():
    """Three sharded replicas of 2 processes, each process on a host of its own (a replica
    split across two hosts, started without ``ftcomm run``). The link of shard 1's host of
    replica 0 goes down: its partner sees nothing refused, only silence; gossip suspects the
    lost process and the replica's collectives and store connection are torn down, so the
    partner is released with ReplicaLost (no launcher here replaces the lost process) long
    before ``init_timeout`` (120 s): once its step stalled, after ``SILENT_REMOTE_S`` of
    suspicion, as a rule before gossip declares the lost process dead (either releases
    it). The other two replicas go on. Once the link returns
    the lost process, whose partner is gone, exits too: nothing hangs. (A decision waiting on
    a store whose host went silent: tests/test_replica_watch.py.)"""
    import secrets
    import sys

    from .test_hsdp import EXAMPLE, Job

    with netns.Lab(6) as lab:
        secret = secrets.token_hex(16)
        jobs = []
        try:
            for host in range(6):
                replica, shard = divmod(host, 2)
                env = {"FTCOMM_SECRET": secret, "FTCOMM_BIND": f"{lab.address(host)}:7946",
                       "FTCOMM_REPLICA_SIZE": "2", "FTCOMM_SHARD_RANK": str(shard),
                       "FTCOMM_REPLICA_ADDR": f"{lab.address(2 * replica)}:7950",
                       **({"FTCOMM_PEERS": f"{lab.address(0)}:7946"} if host else {})}
                command = [sys.executable, EXAMPLE, "--steps", "100000000", "--min-workers", "2",
                           "--step-time", "0.03", "--report-every", "1", "--log-level", "INFO"]
                # (each in a pid namespace and /proc of its own: as on separate machines, the
                # partner cannot look the lost process up, and judges it by its silence)
                jobs.append(Job(0, command=lab.command(host, command, own_pids=True), env=env))
            everyone = lambda: [e for job in jobs for e in job.of("view")]  # noqa: E731
            whole = three_replicas_together(jobs)
            # in the middle of training: the steps of the view of six are what a step takes
            trained = lambda: min(max([e["step"] for e in job.of("step")] + [0]) for job in jobs)  # noqa: E731
            at_whole = trained()
            wait_logged(lambda: trained() >= at_whole + 10, 60, "ten steps of the three replicas", jobs)
            lab.set_host_link(1, False)
            partner, lost, others = jobs[0], jobs[1], jobs[2:]
            # (within 60 s: well before the replica's collectives would time out, 120 s)
            wait_logged(lambda: partner.process.poll() is not None, 60, "release of the partner", [partner])
            assert partner.process.returncode != 0 and any("ReplicaLost" in line for line in partner.log), \
                "".join(partner.log[-40:])
            cut = lambda: [e for job in others for e in job.of("view")  # noqa: E731
                           if len(e["members"]) == 4 and e["view_id"] > whole]
            wait_logged(lambda: len(cut()) >= 4, 60, "view of the other replicas without the split one", others)
            at_cut = max(e["step"] for e in others[0].of("step"))
            wait_logged(lambda: min(max(e["step"] for e in job.of("step")) for job in others) > at_cut + 20, 60,
                        "progress without it", others)
            lab.set_host_link(1, True)
            wait_logged(lambda: lost.process.poll() is not None, 120, "exit of the lost process (its partner gone)",
                        [lost])
        finally:
            leave_all(jobs)
        assert_one_state_per_shard(everyone())
        for job in others:
            assert not any("Traceback" in line for line in job.log), "".join(job.log[-60:])
