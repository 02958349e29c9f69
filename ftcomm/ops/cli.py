"""The ``ftcomm`` command: ``run`` (launcher), ``members`` (live member table) and ``demo``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from .. import __version__
from ..errors import FtcommError
from ..gossip.runtime import parse_address


def _members(args: argparse.Namespace) -> int:
    from ..errors import GossipError
    from ..gossip.runtime import query_members

    secret = args.secret
    if args.secret_file is not None:
        try:
            with open(args.secret_file, encoding="utf-8") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read --secret-file {args.secret_file}: {exc.strerror or exc}") from None
        if not secret:
            raise ValueError(f"--secret-file {args.secret_file} is empty")
    elif args.secret_given:
        print("ftcomm: warning: --secret on the command line is visible to every user of this host (ps); "
              "use --secret-file or $FTCOMM_SECRET", file=sys.stderr)

    peer, cluster = args.peer, args.cluster
    if peer is None:  # a job ftcomm run started on this host: its run file has the address and secret
        from . import runfile

        run = runfile.choose(runfile.running(), args.run_pid)
        peer = run.addresses[0]
        cluster = run.cluster if not args.cluster_given else cluster
        if not args.secret_given and args.secret_file is None:
            secret = run.secret  # the run's own, over $FTCOMM_SECRET (which may be another job's)

    def query():
        return query_members(peer, cluster=cluster, secret=secret, timeout=args.timeout)

    if args.json:
        print(json.dumps([m.__dict__ for m in query()]))
        return 0
    if args.watch is None:
        print(_member_table(query()))
        return 0
    previous: tuple[float, dict[str, int]] | None = None
    while True:  # until interrupted (exit status 130)
        try:
            members = query()
        except GossipError as exc:
            text, members = f"ftcomm: {exc} (retrying every {args.watch:g} s)", None
        now = time.monotonic()
        if members is not None:
            text = _member_table(members, previous, now)
            previous = (now, {m.id: m.metadata.get("st") for m in members if type(m.metadata.get("st")) is int})
        if sys.stdout.isatty():
            print("\x1b[H\x1b[2J", end="")  # redraw in place
        print(f"{time.strftime('%H:%M:%S')}  {peer}\n{text}", flush=True)
        time.sleep(args.watch)



def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (escape sequences, control
    characters, line breaks) written as its code instead."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _member_table(members: list, previous: tuple[float, dict[str, int]] | None = None,
                  now: float | None = None) -> str:
    """One row per member: id, address, state, incarnation, step, compute time per step
    (``*``: a straggler by the default ``straggler_factor``), steps per second since
    ``previous`` (a reading at another time), and the other metadata fields."""
    from ..options import GroupOptions
    from ..runtime.stragglers import slow_members

    compute = {m.id: m.metadata["ct"] / 1000 for m in members
               if m.state == "alive" and type(m.metadata.get("ct")) is int}
    slow = slow_members(compute, GroupOptions.straggler_factor)
    header = ["ID", "ADDRESS", "STATE", "INC", "STEP", "COMPUTE"] + (["STEPS/S"] if previous else []) + ["METADATA"]
    rows = [header]
    named = repairing = 0
    for m in sorted(members, key=lambda m: m.id):
        meta = dict(m.metadata)
        diverged = meta.pop("sd", None)  # its state fingerprint was named: (times, last step)
        if isinstance(diverged, list) and len(diverged) == 2 and all(type(v) is int for v in diverged):
            meta["state_diverged"] = f"{diverged[0]}x!(step {diverged[1]})"
            named += 1
        if meta.pop("rr", None) is True:  # its sharded replica lost a process and forms again in place
            meta["replica"] = "repairing"
            repairing += 1
        step = meta.pop("st", None)  # a training worker's committed step
        step = meta.pop("step", "-") if step is None else step
        ct = meta.pop("ct", None)
        cells = [m.id, m.address, m.state, str(m.incarnation), str(step),
                 f"{ct}ms" + ("*" if m.id in slow else "") if type(ct) is int else "-"]
        if previous:
            before = previous[1].get(m.id)
            rate = (step - before) / (now - previous[0]) if type(step) is int and before is not None and \
                now > previous[0] else None
            cells.append(f"{rate:.1f}" if rate is not None else "-")
        cells.append(" ".join(f"{k}={v}" for k, v in sorted(meta.items(), key=lambda kv: str(kv[0]))) or "-")
        rows.append([printable(cell) for cell in cells])  # ids and metadata come from the network
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows]
    if slow:
        lines.append(f"* straggler: compute time per step above {GroupOptions.straggler_factor:g}x the others' median")
    if repairing:
        lines.append("replica=repairing: the member's sharded replica lost a process, which a new one replaces while "
                     "this one keeps its state (it rejoins with the replica)")
    if named:
        lines.append("! state_diverged: the member's state fingerprint differed from the other replicas' (silent "
                     "data corruption; see fingerprint_every): suspect its host's memory or GPU")
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    from .demo import gossip_demo, train_demo

    if args.which == "gossip":
        return gossip_demo(members=args.members)
    return train_demo(steps=args.steps)


def _run(args: argparse.Namespace) -> int:
    from .launcher import LaunchConfig, Launcher

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if command and command[0].endswith(".py"):
        command = [sys.executable, "-u", *command]
    bind = args.bind or (parse_address(os.environ["FTCOMM_BIND"])[0] if os.environ.get("FTCOMM_BIND")
                         else "127.0.0.1")
    peers = args.peers if args.peers is not None else os.environ.get("FTCOMM_PEERS", "")
    config = LaunchConfig(command=command, nproc=args.nproc_per_node, host=bind, port=args.port,
                          peers=tuple(p.strip() for p in peers.split(",") if p.strip()),
                          max_restarts=args.max_restarts, restart_backoff=args.restart_backoff,
                          stop_timeout=args.stop_timeout, status_interval=args.status_interval,
                          cluster=args.cluster, save_at_breakpoint=args.save_at_breakpoint,
                          checkpoint_name=args.checkpoint_name, checkpoint_dir=args.checkpoint_dir,
                          network_check=args.network_check, replica_size=args.replica_size,
                          log_dir=args.log_dir, local_ranks_filter=args.local_ranks_filter,
                          min_workers=args.min_workers, max_workers=args.max_workers,
                          metrics_port=args.metrics_port, straggler_policy=args.straggler_policy,
                          fingerprint_every=args.fingerprint_every, sdc_policy=args.sdc_policy,
                          standby=args.standby, standby_imports=tuple(args.standby_import),
                          kill_stopped_after=args.kill_stopped_after, fresh=args.fresh,
                          replica_restart=args.replica_restart)
    return Launcher(config).run()


def _address(text: str) -> str:
    """argparse type of ``--peer``: a well-formed ``HOST:PORT``."""
    try:
        parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _ranks(text: str) -> tuple[int, ...]:
    """argparse type of ``--local-ranks-filter``: comma-separated local ranks."""
    try:
        ranks = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        ranks = ()
    if not ranks or ranks[0] < 0:
        raise argparse.ArgumentTypeError(f"expected local ranks like 0 or 0,2, got {text!r}")
    return ranks


def _seconds(text: str) -> float:
    """argparse type of ``--timeout``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _stopped_after(text: str) -> float | None:
    """argparse type of ``--kill-stopped-after``: seconds >= 0, or off (None)."""
    return None if text.strip().lower() == "off" else _non_negative(text)


def _non_negative(text: str) -> float:
    """argparse type of a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value < math.inf):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _count(minimum: int):
    """argparse type of an int >= ``minimum``."""
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value
    return count


def _name(text: str) -> str:
    """argparse type of ``--cluster``: a non-empty name."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty cluster name (is $FTCOMM_CLUSTER set but empty?)")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftcomm", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"ftcomm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run", help="start this node's workers, restart crashed ones, stop them gracefully",
        description="Start --nproc-per-node workers of COMMAND (a .py file runs with this Python) with "
                    "FTCOMM_BIND, FTCOMM_PEERS, FTCOMM_SECRET and LOCAL_RANK set; relay their output tagged [w3]; "
                    "restart a worker whose process fails; forward SIGTERM/SIGINT as a graceful leave; print a "
                    "summary at exit. Exit status: 0 when training completed (a worker finished), 128+N when "
                    "stopped by signal N, 1 when no worker finished.")
    run.add_argument("--nproc-per-node", type=_count(1), default=1, help="workers on this node (>= 1)")
    run.add_argument("--replica-size", type=_count(1), default=1, metavar="K",
                     help="each K consecutive local ranks are one sharded replica (FSDP2 over ft.shard_mesh); a "
                          "failed process of a replica is replaced in place (a warm standby when one is ready) "
                          "while the others keep running; K divides --nproc-per-node")
    run.add_argument("--replica-restart", action="store_true",
                     help="a failed process of a sharded replica restarts the whole replica instead of being "
                          "replaced in place")
    run.add_argument("--bind", default=None, metavar="HOST",
                     help="IPv4 address the workers bind (default: the host of $FTCOMM_BIND, else 127.0.0.1)")
    run.add_argument("--port", type=_count(0), default=0,
                     help="gossip port of the first worker, the others count up (default: free ports)")
    run.add_argument("--peers", default=None, metavar="HOST:PORT,...",
                     help="gossip addresses of workers on other nodes, or dns://NAME:PORT (default: $FTCOMM_PEERS)")
    run.add_argument("--max-restarts", type=_count(0), default=3, help="restarts per worker (default 3)")
    run.add_argument("--restart-backoff", type=_non_negative, default=1.0,
                     help="a worker's first restart is immediate, its second waits this many seconds, doubled "
                          "for each later one, at most 60 (default 1)")
    run.add_argument("--standby", type=_count(0), default=0, metavar="N",
                     help="keep N warm standby interpreters (torch and ftcomm imported) that replace a failed "
                          "worker in about a second instead of a new process's start; each costs the memory of "
                          "an idle interpreter with torch (default 0)")
    run.add_argument("--standby-import", action="append", default=[], metavar="MODULE",
                     help="a module the standbys import ahead (repeatable), e.g. the script's own heavy imports")
    run.add_argument("--kill-stopped-after", type=_stopped_after, default=0.25, metavar="S",
                     help="kill a worker whose process stays stopped (SIGSTOP) this many seconds, so that the "
                          "others go on without it and it is restarted; 'off' leaves it stopped, and the group "
                          "waits for it (default 0.25)")
    run.add_argument("--stop-timeout", type=_seconds, default=30.0,
                     help="seconds workers get to leave after SIGTERM/SIGINT before they are killed (default 30)")
    run.add_argument("--status-interval", type=_seconds, default=10.0,
                     help="seconds between status lines when not on a terminal (default 10)")
    run.add_argument("--cluster", type=_name, default=os.environ.get("FTCOMM_CLUSTER", "ftcomm"),
                     help="cluster name (default: $FTCOMM_CLUSTER or ftcomm)")
    run.add_argument("--save-at-breakpoint", action="store_true",
                     help="when a worker dies, persist the newest flash checkpoint in shared memory to "
                          "--checkpoint-dir before restarting it")
    run.add_argument("--checkpoint-dir", default=None, help="where --save-at-breakpoint persists checkpoints")
    run.add_argument("--fresh", action="store_true",
                     help="start over: remove this host's shared-memory flash checkpoints of the job before the "
                          "workers start (the --checkpoint-dir copies are left alone)")
    run.add_argument("--checkpoint-name", default=None,
                     help="the FlashCheckpointer name of the job (default: the cluster name)")
    run.add_argument("--network-check", action="store_true",
                     help="before training, the workers that start the group measure the latency and bandwidth "
                          "between every pair of them and name slow members and links (printed here)")
    run.add_argument("--min-workers", type=_count(1), default=None, metavar="N",
                     help="the group's min_workers for every worker ($FTCOMM_MIN_WORKERS; a value the script "
                          "passes to ftcomm.init wins); with --replica-size, counted in replicas")
    run.add_argument("--max-workers", type=_count(1), default=None, metavar="N",
                     help="the group's max_workers ($FTCOMM_MAX_WORKERS; a value the script passes wins)")
    run.add_argument("--metrics-port", type=_count(1), default=None, metavar="BASE",
                     help="worker i serves Prometheus metrics on port BASE+i of its address "
                          "($FTCOMM_METRICS_PORT; needs ftcomm[metrics])")
    run.add_argument("--straggler-policy", choices=["warn", "exclude"], default=None,
                     help="the group's straggler_policy ($FTCOMM_STRAGGLER_POLICY; default warn)")
    run.add_argument("--fingerprint-every", type=_count(0), default=None, metavar="N",
                     help="the group's fingerprint_every: compare state fingerprints every N steps, 0 off "
                          "($FTCOMM_FINGERPRINT_EVERY; default 10)")
    run.add_argument("--sdc-policy", choices=["exclude", "warn", "stop"], default=None,
                     help="the group's sdc_policy when fingerprints differ ($FTCOMM_SDC_POLICY; default exclude)")
    run.add_argument("--log-dir", default=None, metavar="DIR",
                     help="write each worker start's output to its own file: DIR/w3.log, DIR/w3.r1.log after its "
                          "first restart, ... (created 0700; an existing DIR must be yours and not writable by "
                          "others; files 0600)")
    run.add_argument("--local-ranks-filter", type=_ranks, default=None, metavar="R,R,...",
                     help="show only these local ranks' output on the console (--log-dir still gets every one)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="the training script and its arguments")
    run.set_defaults(run=_run)

    members = commands.add_parser("members", help="print the member table of a running group")
    members.add_argument("--peer", default=None, type=_address, metavar="HOST:PORT",
                         help="gossip address of any member (0 <= PORT <= 65535); default: the job ftcomm run "
                              "started on this host (its run file holds the address and the secret)")
    members.add_argument("--run", dest="run_pid", type=_count(1), default=None, metavar="PID",
                         help="without --peer, when several ftcomm run jobs run here: the launcher's pid")
    members.add_argument("--secret", default=os.environ.get("FTCOMM_SECRET"), action=_SecretGiven,
                         help="shared secret of the group (default: $FTCOMM_SECRET); visible to other users in "
                              "ps: prefer $FTCOMM_SECRET or --secret-file")
    members.add_argument("--secret-file", default=None, metavar="PATH",
                         help="read the group's secret from this file (its first line)")
    members.add_argument("--cluster", type=_name, default=os.environ.get("FTCOMM_CLUSTER", "ftcomm"),
                         action=_ClusterGiven, help="cluster name (default: $FTCOMM_CLUSTER or ftcomm; without "
                                                    "--peer, the run's)")
    members.add_argument("--timeout", type=_seconds, default=2.0, help="seconds to wait for an answer (> 0)")
    members.add_argument("--json", action="store_true", help="print JSON instead of a table")
    members.add_argument("--watch", type=_seconds, nargs="?", const=2.0, default=None, metavar="SECONDS",
                         help="redraw the table every SECONDS (default 2) with steps/s, until interrupted")
    members.set_defaults(run=_members, secret_given=False, cluster_given="FTCOMM_CLUSTER" in os.environ)

    demo = commands.add_parser("demo", help="run a local demonstration")
    demo.add_argument("which", nargs="?", choices=["train", "gossip"], default="train",
                      help="train (default): 4 local workers train while one is killed, one hangs and one "
                           "joins; gossip: start local members, kill one, show who noticed when")
    demo.add_argument("--members", type=_count(2), default=8, help="gossip demo: number of local members (>= 2)")
    demo.add_argument("--steps", type=_count(1), default=450, help="train demo: committed steps to train (>= 1)")
    demo.set_defaults(run=_demo)
    return parser


class _ClusterGiven(argparse.Action):
    """Stores the value and notes that it was chosen (not taken from a run file)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.cluster_given = True


class _SecretGiven(argparse.Action):
    """Stores the value and notes that it came from the command line."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.secret_given = True


def main(argv: list[str] | None = None) -> int:
    """Run the command; the exit status: 0 done, 1 an ftcomm error (one line on stderr),
    2 a bad argument (argparse's usage and error), 130 interrupted."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad argument: the status, not an exception
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2
    try:
        return args.run(args)
    except FtcommError as exc:
        print(f"ftcomm: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"ftcomm: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
