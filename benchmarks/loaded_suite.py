"""The process test suite on a loaded machine: passes of the tests that run real worker
processes, while busy-loop processes compete for every core.

The tests assert behaviour (states, digests, exactly-once, exit codes), never durations,
so a machine whose cores are taken by other work must not turn them red. This runs
``--unloaded`` passes first (the baseline: the same tests with the machine to
themselves), then starts ``--busy`` processes that spin in ``while True: pass`` and runs
``--passes`` passes under them. Each pass is one pytest run; the figures per pass are
its outcome counts, the names of the tests that failed and its wall time.

    python benchmarks/loaded_suite.py --passes 5 --busy 2
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from xml.etree import ElementTree

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUITE = ("tests/test_group_processes.py", "tests/gossip/test_processes.py", "tests/test_stragglers.py",
         "tests/test_multihost.py", "tests/test_convergence.py", "tests/test_launcher.py")


def run_pass(tests: list[str], label: str) -> dict:
    """One pytest run of ``tests``; its counts from the JUnit report and its wall time."""
    with tempfile.TemporaryDirectory(prefix="ftcomm-loaded-") as scratch:
        report = pathlib.Path(scratch) / "report.xml"
        start = time.monotonic()
        finished = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   f"--junitxml={report}", *tests], check=False, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        wall = time.monotonic() - start
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        failed = []
        if report.exists():
            for suite in ElementTree.parse(report).getroot().iter("testsuite"):
                for key in counts:
                    counts[key] += int(suite.get(key, 0))
                for case in suite.iter("testcase"):
                    if case.find("failure") is not None or case.find("error") is not None:
                        failed.append(f"{case.get('classname')}::{case.get('name')}")
    outcome = {"label": label, "exit_status": finished.returncode, "wall_s": round(wall, 1), **counts,
               "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
               "failed": failed}
    if finished.returncode != 0:
        outcome["output_tail"] = finished.stdout[-6000:]
    print(f"{label}: exit {finished.returncode}, {outcome['passed']} passed, {len(failed)} failed, "
          f"{counts['skipped']} skipped, {wall:.0f} s" + "".join(f"\n  FAILED {name}" for name in failed), flush=True)
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=5, help="passes under load (default 5)")
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes during those passes (default 2)")
    parser.add_argument("--unloaded", type=int, default=1, help="baseline passes before the load starts (default 1)")
    parser.add_argument("--tests", nargs="+", default=list(SUITE), help="test files or node ids (default: the process suite)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "loaded_suite.json"))
    args = parser.parse_args()

    passes = [run_pass(args.tests, f"unloaded {i + 1}") for i in range(args.unloaded)]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        passes += [run_pass(args.tests, f"loaded {i + 1}") for i in range(args.passes)]
    finally:
        for process in busy:
            process.kill()
            process.wait()
    loaded = [p for p in passes if p["label"].startswith("loaded")]
    result = {
        "benchmark": "loaded_suite", "date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
        "cpus": os.cpu_count(), "busy_processes": args.busy, "tests": args.tests, "passes": passes,
        "loaded_passes_green": sum(p["exit_status"] == 0 for p in loaded), "loaded_passes": len(loaded),
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"under {args.busy} busy loops: {result['loaded_passes_green']} of {len(loaded)} passes green; "
          f"results in {args.out}")
    return 0 if all(p["exit_status"] == 0 for p in passes) else 1


if __name__ == "__main__":
    sys.exit(main())
