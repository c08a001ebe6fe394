"""afdserve's OpenMP default: threads spin briefly after a parallel region (``GOMP_SPINCOUNT``), set
where afdserve is imported before torch; a value in the environment is kept."""

import os
import subprocess
import sys

import pytest

SCRIPT = "import afdserve, os, torch; print(os.environ.get('GOMP_SPINCOUNT'))"


@pytest.mark.parametrize("given, expected", [(None, "3000"), ("77", "77")])
def test_spin_count_default_and_kept(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
