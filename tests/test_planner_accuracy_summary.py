"""benchmarks/planner_accuracy.py --summarize reprints the documented figures of a saved run
(docs/results/planner_accuracy.json, quoted in docs/planner.md) without measuring anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_summarize_reprints_both_statistics_of_the_saved_run():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner_accuracy.py"), "--summarize",
                          str(ROOT / "docs" / "results" / "planner_accuracy.json")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sum(line.startswith("  n_a=") for line in lines) == 11
    best = next(x for x in lines if "predicted   best of runs fit the cores" in x)
    median = next(x for x in lines if "predicted median of runs fit the cores" in x)
    assert "max 31.0%" in best and "4/4 of 8" in best
    assert "mean |error| 7.4%, max 17.5%" in median and "8/7/7/3 of 8" in median
