"""docs/RAY.md's example, run as written (its own ray.init) on this machine, ten times: it
must fit any machine Ray runs on, train to its last step in one group and print what the
workers reported, and no error."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("run", range(int(os.environ.get("FTCOMM_RAY_DOCS_RUNS", "3"))))  # 10 to repeat the check
def test_the_example_of_the_ray_page_runs_as_written(tmp_path, run):
    page = (ROOT / "docs" / "RAY.md").read_text()
    example = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(example)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"worker 0 step 50: \{'loss': [\d.]+, 'world': [12]\}", done.stdout), done.stdout[-2000:]
    results = ast.literal_eval(done.stdout.strip().splitlines()[-1])  # the printed list of plain dicts
    assert results and all(r["step"] == 200 for r in results) and len({r["digest"] for r in results}) == 1
    # One group: two workers that report the same step at the same world size hold
    # different ranks of it. Two groups of one (each training the job alone, from step 0)
    # would both report rank 0's figures at world 1 with identical losses.
    reported = re.findall(r"worker (\d+) step (\d+): \{'loss': ([\d.]+), 'world': (\d)\}", done.stdout)
    by_step: dict[tuple, set] = {}
    for worker, step, _, world in reported:
        by_step.setdefault((step, world), set()).add(worker)
    assert all(len(workers) <= int(world) for (_, world), workers in by_step.items()), done.stdout[-2000:]
    # No error on stderr: no worker failed, no traceback (a straggler notice on a loaded
    # machine is a notice, not an error).
    errors = [line for line in done.stderr.splitlines()
              if re.search(r"Traceback|Error|[Ff]ailed|[Ee]xception|CRITICAL", line)]
    assert not errors, done.stderr[-3000:]
