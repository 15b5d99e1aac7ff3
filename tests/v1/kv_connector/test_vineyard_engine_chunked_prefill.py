# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Chunked prefill, with synchronous and asynchronous updates.

A 2500-token prompt with ``max_num_batched_tokens=512`` is computed in five
steps; every whole chunk must still be saved, and a fresh engine must load
all of them. ``VINEYARD_CACHE_ENABLE_ASYNC_UPDATE`` must change neither the
outputs nor what the next engine finds.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from vineyard_engine_testing import (
    EngineRun,
    ReferenceRunner,
    cacheable_prefix,
    engine_env,
    random_tokens,
    run_engine,
    saved_tokens,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MAX_TOKENS = 8
LLM_KWARGS = {"max_num_batched_tokens": 512}
MODES = {"sync": "0", "async": "1"}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(2)
    return [random_tokens(rng, 2500), random_tokens(rng, 1700)]


@pytest.fixture(scope="module")
def runs(
    toy_model: str, prompts: list[list[int]], module_dir: Path
) -> dict[str, tuple[EngineRun, EngineRun]]:
    """Per mode, on its own cache root: a writer engine, then a fresh
    reader engine."""
    result = {}
    for mode, flag in MODES.items():
        env = engine_env(
            module_dir / mode / "cache",
            extra={"VINEYARD_CACHE_ENABLE_ASYNC_UPDATE": flag},
        )
        round_ = {"prompts": prompts, "max_tokens": MAX_TOKENS}
        writer = run_engine(
            toy_model,
            [round_],
            env,
            module_dir / mode / "writer",
            llm_kwargs=LLM_KWARGS,
        )
        assert writer.last.settled  # the reader's exact hits need every write
        reader = run_engine(
            toy_model,
            [round_],
            env,
            module_dir / mode / "reader",
            llm_kwargs=LLM_KWARGS,
        )
        result[mode] = (writer, reader)
    return result


@pytest.fixture(scope="module")
def no_cache(
    toy_model: str, prompts: list[list[int]], reference: ReferenceRunner
) -> list[list[int]]:
    return reference(toy_model, prompts, max_tokens=MAX_TOKENS).last.outputs


@pytest.mark.parametrize("mode", MODES)
def test_every_chunk_saved(
    mode: str,
    runs: dict[str, tuple[EngineRun, EngineRun]],
    prompts: list[list[int]],
) -> None:
    writer, _ = runs[mode]
    assert writer.last.settled
    assert all(len(p) > LLM_KWARGS["max_num_batched_tokens"] for p in prompts)
    assert writer.last.counter("tokens_written") == sum(
        saved_tokens(len(p), MAX_TOKENS) for p in prompts
    )
    assert writer.last.counter("tokens_rejected") == 0
    assert writer.last.counter("updates_skipped") == 0
    assert writer.last.counter("updates_failed") == 0


@pytest.mark.parametrize("mode", MODES)
def test_fresh_engine_loads_every_chunk(
    mode: str,
    runs: dict[str, tuple[EngineRun, EngineRun]],
    prompts: list[list[int]],
    no_cache: list[list[int]],
) -> None:
    writer, reader = runs[mode]
    expected = [cacheable_prefix(len(p)) for p in prompts]
    assert reader.last.num_cached_tokens == expected
    assert reader.last.counter("hit_tokens") == sum(expected)
    assert reader.last.counter("loaded_tokens") == sum(expected)
    assert reader.last.counter("load_errors") == 0
    assert writer.last.outputs == no_cache
    assert reader.last.outputs == no_cache


def test_sync_and_async_agree(runs: dict[str, tuple[EngineRun, EngineRun]]) -> None:
    sync_writer, sync_reader = runs["sync"]
    async_writer, async_reader = runs["async"]
    assert sync_writer.last.outputs == async_writer.last.outputs
    assert sync_reader.last.outputs == async_reader.last.outputs
    assert sync_reader.last.num_cached_tokens == async_reader.last.num_cached_tokens
    for name in ("hit_tokens", "loaded_tokens", "query_tokens"):
        assert sync_reader.last.counter(name) == async_reader.last.counter(name)
    for name in ("tokens_written", "updates_completed"):
        assert sync_writer.last.counter(name) == async_writer.last.counter(name)
