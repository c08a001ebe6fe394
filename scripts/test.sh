#!/usr/bin/env bash
# Installs everything, then runs the test suite; with no arguments, then the equivalence, deployment
# and serving tests (marker `torch_backend`) a second time with the CPU kernels switched off, so that
# every model runs on the torch backends (what CUDA runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600)
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
# two pytest workers (pytest-xdist), one per core (each test process runs one OpenMP thread); a test
# file runs whole on one worker, so its module-scoped fixtures (servers, engines) start once
XDIST=(-n 2 --dist loadfile)
"${PYTEST[@]}" "${XDIST[@]}" --durations=30  # the slowest tests: where the suite's time goes
echo "afdserve: the torch_backend tests again on the torch backends (AFDSERVE_KERNELS=0)"
AFDSERVE_KERNELS=0 "${PYTEST[@]}" "${XDIST[@]}" -m torch_backend
