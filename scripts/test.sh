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
"${PYTEST[@]}" --durations=30  # the slowest tests: where the suite's time goes
echo "afdserve: the torch_backend tests again on the torch backends (AFDSERVE_KERNELS=0)"
AFDSERVE_KERNELS=0 "${PYTEST[@]}" -m torch_backend
