# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the in-process connector tests (helpers are in
``vineyard_connector_testing``): a cache root and a real TP-1 worker on it,
each made once per test module (starting backends is the slow part)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.v1.kv_connector.unit.vineyard_connector_testing import (
    WorkerHarness,
    make_config,
    make_layout,
    make_worker,
)
from vllm.worker.vineyard.config import VineyardLLMCacheConfig


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> VineyardLLMCacheConfig:
    """The settings of a module's caches, on a root of its own."""
    return make_config(tmp_path_factory.mktemp("connector-root"))


@pytest.fixture(scope="module")
def worker(config: VineyardLLMCacheConfig) -> Iterator[WorkerHarness]:
    """A TP-1 worker with a real cache on :func:`config`'s root: it writes
    the chunks that lookups find and loads them back."""
    harness = make_worker(config, make_layout())
    yield harness
    harness.close()
