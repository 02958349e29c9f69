"""The ``ftcomm`` command: ``members`` (live member table) and ``demo``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from . import __version__
from .errors import FtcommError
from .gossip.runtime import parse_address


def _members(args: argparse.Namespace) -> int:
    from .gossip.runtime import query_members

    members = query_members(args.peer, cluster=args.cluster, secret=args.secret, timeout=args.timeout)
    if args.json:
        print(json.dumps([m.__dict__ for m in members]))
        return 0
    rows = [("ID", "ADDRESS", "STATE", "INC", "STEP", "METADATA")]
    for m in sorted(members, key=lambda m: m.id):
        meta = dict(m.metadata)
        step = meta.pop("st", None)  # a training worker's committed step
        step = meta.pop("step", "-") if step is None else step
        rest = " ".join(f"{k}={v}" for k, v in sorted(meta.items(), key=lambda kv: str(kv[0]))) or "-"
        rows.append((m.id, m.address, m.state, str(m.incarnation), str(step), rest))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[5])
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import gossip_demo, train_demo

    if args.which == "gossip":
        return gossip_demo(members=args.members)
    return train_demo(steps=args.steps)


def _address(text: str) -> str:
    """argparse type of ``--peer``: a well-formed ``HOST:PORT``."""
    try:
        parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _seconds(text: str) -> float:
    """argparse type of ``--timeout``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
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

    members = commands.add_parser("members", help="print the member table of a running group")
    members.add_argument("--peer", required=True, type=_address, metavar="HOST:PORT",
                         help="gossip address of any member (0 <= PORT <= 65535)")
    members.add_argument("--secret", default=os.environ.get("FTCOMM_SECRET"),
                         help="shared secret of the group (default: $FTCOMM_SECRET)")
    members.add_argument("--cluster", type=_name, default=os.environ.get("FTCOMM_CLUSTER", "ftcomm"),
                         help="cluster name (default: $FTCOMM_CLUSTER or ftcomm)")
    members.add_argument("--timeout", type=_seconds, default=2.0, help="seconds to wait for an answer (> 0)")
    members.add_argument("--json", action="store_true", help="print JSON instead of a table")
    members.set_defaults(run=_members)

    demo = commands.add_parser("demo", help="run a local demonstration")
    demo.add_argument("which", nargs="?", choices=["train", "gossip"], default="train",
                      help="train (default): 4 local workers train while one is killed, one hangs and one "
                           "joins; gossip: start local members, kill one, show who noticed when")
    demo.add_argument("--members", type=_count(2), default=8, help="gossip demo: number of local members (>= 2)")
    demo.add_argument("--steps", type=_count(1), default=450, help="train demo: committed steps to train (>= 1)")
    demo.set_defaults(run=_demo)
    return parser


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
