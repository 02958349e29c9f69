"""docs/RAY.md's example, run as written (its own ray.init) on this machine: it must fit
any machine Ray runs on, train to its last step and print what the workers reported."""

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


def test_the_example_of_the_ray_page_runs_as_written(tmp_path):
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
