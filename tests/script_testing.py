# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the tests that run the project's scripts (the demo and the
benchmark) as a user would."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: Path, name: str) -> ModuleType:
    """Import a script by path (scripts are not packages)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def mount_slow_fs(
    work: Path,
    latency_ms: float = 0.0,
    io_latency_ms: float = 0.0,
    read_mbps: float = 0.0,
    direct_io: bool = False,
) -> Any:
    """The benchmark's FUSE filesystem (``benchmarks/vineyard/slow_fs.py``, a
    passthrough that can be slowed or frozen) mounted under ``work``; the
    test is skipped, with the reason, where FUSE cannot mount here."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "vineyard"))
    from slow_fs import SlowFs, fuse_unavailable

    why = fuse_unavailable()
    if why is not None:
        pytest.skip(f"no FUSE filesystem here: {why}")
    try:
        return SlowFs(work, latency_ms, io_latency_ms, read_mbps, direct_io)
    except RuntimeError as e:  # e.g. a container without FUSE permission
        log = (work / "fuse.log").read_text()[-2000:]
        pytest.skip(f"the FUSE filesystem did not mount here: {e}\n{log}")


def clean_env() -> dict[str, str]:
    """The caller's environment without settings that would change the run."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VINEYARD_", "VLLM_USE_VINEYARD"))
        and k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "POD_NAME")
    }
