#!/usr/bin/env bash
# Creates .venv and installs afdserve with its test dependencies. Idempotent: re-installs only when
# pyproject.toml (or the torch build wanted) changed. torch is pinned to 2.13.0 first, so no other
# requirement pulls another build: the CPU wheel, or on a machine with an NVIDIA GPU (nvidia-smi lists
# one) the CUDA build (with triton) from AFDSERVE_TORCH_INDEX (default PyPI, whose Linux wheels are
# CUDA builds), which then serves on the GPU by default (--device auto). AFDSERVE_TORCH=cpu keeps the
# CPU wheel on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "afdserve: creating the virtual environment .venv ($("$PY" --version 2>&1))..."
  "$PY" -m venv .venv
fi
stamp=.venv/.afdserve-installed
flavor=cpu
if [ "${AFDSERVE_TORCH:-auto}" != cpu ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  flavor=cuda
fi
have=$(cat "$stamp" 2>/dev/null || true)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "${have:-cpu}" != "$flavor" ]; then
  if [ -f "$stamp" ]; then
    echo "afdserve: pyproject.toml or the torch build wanted ($flavor) changed: updating the dependencies..."
  else
    echo "afdserve: installing (first run: torch CPU and dependencies, ~1 min)..."
  fi
  .venv/bin/python -m pip install -q --upgrade pip
  if [ "$flavor" = cuda ]; then
    echo "afdserve:   torch 2.13.0 (CUDA: an NVIDIA GPU is here; AFDSERVE_TORCH=cpu for the CPU wheel)..."
    .venv/bin/python -m pip install -q "torch==2.13.0" --index-url "${AFDSERVE_TORCH_INDEX:-https://pypi.org/simple}"
  else
    echo "afdserve:   torch 2.13.0 (CPU)..."
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
  echo "afdserve:   afdserve and its dependencies..."
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$flavor" > "$stamp"
  echo "afdserve: installed."
fi
# the C++ CPU kernels of this machine (built once into ~/.cache/afdserve/kernels; without a compiler
# afdserve runs its PyTorch paths)
.venv/bin/python -m afdserve.backends.cpu
