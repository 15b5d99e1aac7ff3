# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the vineyard cache tests.

Every cache here runs on the real vineyard file backend (its backend
processes included) under a temporary root, over random paged KV tensors in
the CPU layout ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.vineyard_cache_testing import CacheFactory, CacheHarness, build_cache


@pytest.fixture
def make_cache(tmp_path: Path) -> Iterator[CacheFactory]:
    """Build caches (see :func:`build_cache`) on one root under
    ``tmp_path``; all are closed at teardown."""
    harnesses: list[CacheHarness] = []

    def factory(**kwargs: Any) -> CacheHarness:
        kwargs.setdefault("root", tmp_path / "cache")
        harness = build_cache(**kwargs)
        harnesses.append(harness)
        return harness

    yield factory
    for harness in harnesses:
        harness.close()
    shutil.rmtree(tmp_path, ignore_errors=True)  # chunk files can be large


@pytest.fixture(scope="module")
def _module_f32(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheHarness]:
    harness = build_cache(tmp_path_factory.mktemp("f32"))
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def _module_bf16(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheHarness]:
    harness = build_cache(tmp_path_factory.mktemp("bf16"), dtype=torch.bfloat16)
    yield harness
    harness.close()


def _fresh(harness: CacheHarness) -> CacheHarness:
    harness.wait()
    harness.reset_counters()
    return harness


@pytest.fixture
def small_cache(_module_f32: CacheHarness) -> CacheHarness:
    """A small float32 cache (2 layers, chunks of 2 blocks), shared by the
    tests of a module (starting backends is the slow part): use fresh
    tokens (:func:`make_tokens` without a seed); counters start at 0."""
    return _fresh(_module_f32)


@pytest.fixture
def small_cache_bf16(_module_bf16: CacheHarness) -> CacheHarness:
    """As :func:`small_cache`, in bfloat16."""
    return _fresh(_module_bf16)
