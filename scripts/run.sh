#!/usr/bin/env bash
# Installs everything, then runs the main job: the OpenAI-compatible server on the built-in demo
# model, disaggregated on this machine (extra arguments go to `afdserve serve`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/afdserve serve "$@"
