#!/usr/bin/env bash
# Creates .venv and installs afdserve with its test dependencies. Idempotent: re-installs only when
# pyproject.toml changed. torch is pinned to 2.13.0 first, so no other requirement pulls a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "afdserve: creating the virtual environment .venv ($("$PY" --version 2>&1))..."
  "$PY" -m venv .venv
fi
stamp=.venv/.afdserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  if [ -f "$stamp" ]; then
    echo "afdserve: pyproject.toml changed: updating the dependencies..."
  else
    echo "afdserve: installing (first run: torch CPU and dependencies, ~1 min)..."
  fi
  .venv/bin/python -m pip install -q --upgrade pip
  echo "afdserve:   torch 2.13.0 (CPU)..."
  .venv/bin/python -m pip install -q "torch==2.13.0"
  echo "afdserve:   afdserve and its dependencies..."
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
  echo "afdserve: installed."
fi
# the C++ CPU kernels of this machine (built once into ~/.cache/afdserve/kernels; without a compiler
# afdserve runs its PyTorch paths)
.venv/bin/python -m afdserve.backends.cpu
