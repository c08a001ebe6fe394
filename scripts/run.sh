#!/usr/bin/env bash
# Installs everything, then runs the main job: generation from the built-in demo model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/afdserve generate "$@"
