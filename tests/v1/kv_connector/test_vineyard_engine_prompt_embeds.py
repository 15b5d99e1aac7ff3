# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prompt embeddings on the real engine: blocks are keyed by their
embedding bytes (the token ids of such a prompt are all placeholders), so
two different embeddings of one length never share KV and the same
embeddings asked again hit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vineyard_engine_testing import (
    EngineRun,
    cacheable_prefix,
    engine_env,
    run_engine,
)
from tests.vineyard_toy_model import ToyLlamaConfig

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

LLM_KWARGS = {"enable_prompt_embeds": True, "enable_prefix_caching": False}
NUM_TOKENS = 300
HIDDEN = ToyLlamaConfig().hidden_size
FIRST, SECOND = [[1, NUM_TOKENS, HIDDEN]], [[2, NUM_TOKENS, HIDDEN]]


def _round(embeds: list[list[int]]) -> dict[str, object]:
    return {"prompts": [[1]], "prompt_embeds": embeds, "max_tokens": 8}


@pytest.fixture(scope="module")
def runs(toy_model: str, module_dir: Path) -> tuple[EngineRun, EngineRun]:
    """One engine with the cache asked the first embeddings, the second,
    then the first again; one without the cache asked both."""
    cached = run_engine(
        toy_model,
        [_round(FIRST), _round(SECOND), _round(FIRST)],
        engine_env(module_dir / "cache"),
        module_dir / "cached",
        llm_kwargs=LLM_KWARGS,
    )
    no_cache = run_engine(
        toy_model,
        [_round(FIRST), _round(SECOND)],
        engine_env(module_dir / "unused", use_cache=False),
        module_dir / "no-cache",
        llm_kwargs=LLM_KWARGS,
    )
    return cached, no_cache


def test_embeddings_hit_only_themselves(runs: tuple[EngineRun, EngineRun]) -> None:
    cached, no_cache = runs
    first, second = no_cache.rounds[0].outputs, no_cache.rounds[1].outputs
    assert first != second  # else shared KV could not show
    assert [r.outputs for r in cached.rounds] == [first, second, first]
    full = cacheable_prefix(NUM_TOKENS)
    assert [r.num_cached_tokens for r in cached.rounds] == [[0], [0], [full]]
    assert cached.delta(0, "tokens_written") > 0
    assert cached.last.counter("load_errors") == 0
