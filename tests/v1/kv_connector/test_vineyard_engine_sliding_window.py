# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A sliding-window model on the real engine: every layer attends two
blocks back (a Mistral-7B-v0.1 style toy model), so vLLM frees a running
request's blocks once they leave the window and hands them to others.

Engine A computes a batch with chunked prefill, one update buffer and its
writer stopped through the prefill: every save but the first is skipped and
retried while the window moves on and freed blocks are reused (few blocks
in all). Engine B, fresh on the same root, first saves prompts of its own in
full, then is asked prefixes of both batches at many lengths. Every output
must equal a run without the cache; B must hit where the saves landed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.vineyard_engine_testing import (
    BLOCK_SIZE,
    EngineRun,
    ModelFactory,
    ReferenceRunner,
    cacheable_prefix,
    engine_env,
    run_engine,
)
from tests.vineyard_testing import random_tokens

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

WINDOW = 2 * BLOCK_SIZE
LLM_KWARGS = {
    "max_num_batched_tokens": 256,  # chunked prefill: 416-token prompts
    "enable_prefix_caching": False,  # only vineyard serves a prefix
    "num_gpu_blocks_override": 40,  # freed blocks are soon reused
}
MAX_TOKENS = 40
PREFIX_LENGTHS = [70, 130, 200, 260, 330, 416]


@pytest.fixture(scope="module")
def model(toy_model_factory: ModelFactory) -> str:
    return toy_model_factory(sliding_window=WINDOW, seed=5)


@pytest.fixture(scope="module")
def prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Engine A's batch (saved under a stopped writer) and B's own."""
    rng = random.Random(22)
    return (
        [random_tokens(rng, 416) for _ in range(6)],
        [random_tokens(rng, 416) for _ in range(2)],
    )


@pytest.fixture(scope="module")
def asked(prompts: tuple[list[list[int]], list[list[int]]]) -> list[list[int]]:
    """Prefixes of both batches at many lengths."""
    every = prompts[0] + prompts[1]
    return [
        every[i][: PREFIX_LENGTHS[(i + j) % len(PREFIX_LENGTHS)]]
        for i in range(len(every))
        for j in range(2)
    ]


@pytest.fixture(scope="module")
def runs(
    model: str,
    prompts: tuple[list[list[int]], list[list[int]]],
    asked: list[list[int]],
    module_dir: Path,
) -> tuple[EngineRun, EngineRun]:
    root = module_dir / "cache"
    one_buffer = {
        "VINEYARD_CACHE_MIN_INFLIGHT_TASKS": "1",
        "VINEYARD_CACHE_MAX_INFLIGHT_TASKS": "1",
    }
    first = run_engine(
        model,
        [
            {
                "prompts": prompts[0],
                "max_tokens": MAX_TOKENS,
                "stop_writer_during_prefill": True,
            }
        ],
        engine_env(root, extra=one_buffer),
        module_dir / "a",
        llm_kwargs=LLM_KWARGS,
    )
    second = run_engine(
        model,
        [
            {"prompts": prompts[1], "max_tokens": 1},
            {"prompts": asked, "max_tokens": 8},
        ],
        engine_env(root),
        module_dir / "b",
        llm_kwargs=LLM_KWARGS,
    )
    return first, second


def test_outputs_equal_no_cache(
    model: str,
    prompts: tuple[list[list[int]], list[list[int]]],
    asked: list[list[int]],
    runs: tuple[EngineRun, EngineRun],
    reference: ReferenceRunner,
) -> None:
    first, second = runs
    no_cache = reference(model, prompts[0], max_tokens=MAX_TOKENS, **LLM_KWARGS)
    assert first.last.outputs == no_cache.last.outputs
    assert (
        second.last.outputs
        == reference(model, asked, max_tokens=8, **LLM_KWARGS).last.outputs
    )


def test_retries_of_freed_blocks_are_dropped(
    runs: tuple[EngineRun, EngineRun],
) -> None:
    first, _ = runs
    written = first.last
    assert written.settled
    assert written.writer_stopped_s > 0
    assert written.counter("updates_skipped") > 0
    assert written.counter("saves_dropped_freed") > 0
    assert written.counter("updates_failed") == 0


def test_hits_where_the_saves_landed(
    prompts: tuple[list[list[int]], list[list[int]]],
    asked: list[list[int]],
    runs: tuple[EngineRun, EngineRun],
) -> None:
    """B's own prompts were saved whole: their prefixes hit all the way; A's
    hit at most what A saved, and some of them hit."""
    _, second = runs
    asking = second.last
    own = {tuple(p) for p in prompts[1]}
    hits_on_a = 0
    for prompt, cached in zip(asked, asking.num_cached_tokens, strict=True):
        if any(tuple(p[: len(prompt)]) == tuple(prompt) for p in own):
            assert cached == cacheable_prefix(len(prompt)), prompt
        else:
            hits_on_a += cached
    assert hits_on_a > 0
    hits = sum(asking.num_cached_tokens)
    assert second.delta(1, "hit_tokens") == hits
    # Only blocks inside the window are loaded: vLLM left the rest out.
    assert 0 < second.delta(1, "loaded_tokens") < hits
    assert asking.counter("load_errors") == 0
