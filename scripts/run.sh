#!/usr/bin/env bash
# Installs everything, then runs the main job: the OpenAI-compatible server on the built-in demo
# model, disaggregated on this machine (extra arguments go to `afdserve serve`, e.g. --model FOLDER).
# Every stage says what it does: installing (first run), building the demo model (first run),
# starting the workers, and the URL it listens at.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "afdserve: starting the server (.venv/bin/afdserve serve $*)..."
exec .venv/bin/afdserve serve "$@"
