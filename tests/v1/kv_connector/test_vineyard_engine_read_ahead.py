# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Read-ahead on the real engine: requests with hits queued behind a long
prompt (it takes every step's token budget for several steps) have their
hits read while they wait, and load them once scheduled; every answer
equals a run without the cache, with read-ahead and without it
(``VINEYARD_CACHE_READ_AHEAD_BUFFERS=0``)."""

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
)
from tests.vineyard_testing import random_tokens

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

LLM_KWARGS = {"max_num_batched_tokens": 512, "enable_prefix_caching": False}
MODES = {"read-ahead": "4", "none": "0"}


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(7)
    return {
        "hits": [random_tokens(rng, 700), random_tokens(rng, 600)],
        "long": [random_tokens(rng, 3000)],
    }


@pytest.fixture(scope="module")
def runs(
    toy_model: str, prompts: dict[str, list[list[int]]], module_dir: Path
) -> dict[str, EngineRun]:
    """Per mode: round 0 saves the hits' prompts; round 1 sends the long
    prompt first, then the hits, in one batch."""
    result = {}
    for mode, buffers in MODES.items():
        env = engine_env(
            module_dir / mode / "cache",
            extra={"VINEYARD_CACHE_READ_AHEAD_BUFFERS": buffers},
        )
        rounds = [
            {"prompts": prompts["hits"]},
            {"prompts": prompts["long"] + prompts["hits"]},
        ]
        result[mode] = run_engine(
            toy_model, rounds, env, module_dir / mode, llm_kwargs=LLM_KWARGS
        )
    return result


@pytest.mark.parametrize("mode", MODES)
def test_queued_hits_answer_as_without_the_cache(
    mode: str,
    runs: dict[str, EngineRun],
    prompts: dict[str, list[list[int]]],
    toy_model: str,
    reference: ReferenceRunner,
) -> None:
    batch = prompts["long"] + prompts["hits"]
    expected = reference(toy_model, batch, **LLM_KWARGS).last.outputs
    run = runs[mode]
    assert run.rounds[1].outputs == expected
    hit = sum(cacheable_prefix(len(p)) for p in prompts["hits"])
    assert run.delta(1, "loaded_tokens") == hit
    assert run.delta(1, "load_errors") == 0
    read_ahead = run.delta(1, "read_ahead_tokens")
    assert (read_ahead > 0) == (mode == "read-ahead")
    assert read_ahead <= hit
    assert run.delta(1, "read_ahead_unused_tokens") == 0
