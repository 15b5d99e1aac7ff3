#!/usr/bin/env bash
# Lint, format check and type check: the gate for every commit.
set -euo pipefail
cd "$(dirname "$0")"
BIN=${VENV:-.venv}/bin
[ -x "$BIN/ruff" ] || BIN=$(dirname "$(command -v ruff)")
"$BIN/ruff" check .
"$BIN/ruff" format --check .
"$BIN/mypy"
echo "format.sh: all clean"
