# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Chunked prefill, with synchronous and asynchronous updates.

A 2500-token prompt with ``max_num_batched_tokens=512`` is computed in five
steps; every whole chunk must still be saved, and the same prompts asked
again (vLLM's own prefix cache off, so only vineyard can serve them) must
load all of them. ``VINEYARD_CACHE_ENABLE_ASYNC_UPDATE`` must change neither
the outputs nor what is found.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.vineyard_engine_testing import (
    EngineRun,
    ReferenceRunner,
    cacheable_prefix,
    engine_env,
    run_engine,
    saved_tokens,
)
from tests.vineyard_testing import random_tokens

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MAX_TOKENS = 8
LLM_KWARGS = {"max_num_batched_tokens": 512, "enable_prefix_caching": False}
MODES = {"sync": "0", "async": "1"}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(2)
    return [random_tokens(rng, 2500), random_tokens(rng, 1700)]


@pytest.fixture(scope="module")
def runs(
    toy_model: str, prompts: list[list[int]], module_dir: Path
) -> dict[str, EngineRun]:
    """Per mode, on its own cache root, one engine: round 0 computes and
    saves (the harness waits until every write is reported), round 1 asks
    again and loads."""
    result = {}
    for mode, flag in MODES.items():
        env = engine_env(
            module_dir / mode / "cache",
            extra={"VINEYARD_CACHE_ENABLE_ASYNC_UPDATE": flag},
        )
        round_ = {"prompts": prompts, "max_tokens": MAX_TOKENS}
        result[mode] = run_engine(
            toy_model, [round_, round_], env, module_dir / mode, llm_kwargs=LLM_KWARGS
        )
    return result


@pytest.fixture(scope="module")
def no_cache(
    toy_model: str, prompts: list[list[int]], reference: ReferenceRunner
) -> list[list[int]]:
    return reference(toy_model, prompts, max_tokens=MAX_TOKENS).last.outputs


@pytest.mark.parametrize("mode", MODES)
def test_every_chunk_saved(
    mode: str, runs: dict[str, EngineRun], prompts: list[list[int]]
) -> None:
    written = runs[mode].rounds[0]
    assert written.settled
    assert all(len(p) > LLM_KWARGS["max_num_batched_tokens"] for p in prompts)
    assert written.counter("tokens_written") == sum(
        saved_tokens(len(p), MAX_TOKENS) for p in prompts
    )
    assert written.counter("tokens_rejected") == 0
    assert written.counter("updates_skipped") == 0
    assert written.counter("updates_failed") == 0


@pytest.mark.parametrize("mode", MODES)
def test_every_chunk_loaded(
    mode: str,
    runs: dict[str, EngineRun],
    prompts: list[list[int]],
    no_cache: list[list[int]],
) -> None:
    run = runs[mode]
    expected = [cacheable_prefix(len(p)) for p in prompts]
    assert run.rounds[0].num_cached_tokens == [0] * len(prompts)
    assert run.rounds[1].num_cached_tokens == expected
    assert run.delta(1, "hit_tokens") == sum(expected)
    assert run.delta(1, "loaded_tokens") == sum(expected)
    assert run.last.counter("load_errors") == 0
    assert run.rounds[0].outputs == no_cache
    assert run.rounds[1].outputs == no_cache


def test_sync_and_async_agree(runs: dict[str, EngineRun]) -> None:
    sync, async_ = runs["sync"], runs["async"]
    for i in (0, 1):
        assert sync.rounds[i].outputs == async_.rounds[i].outputs
        assert sync.rounds[i].num_cached_tokens == async_.rounds[i].num_cached_tokens
    for name in ("hit_tokens", "loaded_tokens", "query_tokens"):
        assert sync.delta(1, name) == async_.delta(1, name)
    for name in ("tokens_written", "updates_completed"):
        assert sync.delta(0, name) == async_.delta(0, name)
