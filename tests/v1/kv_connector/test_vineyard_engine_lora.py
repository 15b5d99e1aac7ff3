# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapters on the real engine: KV is cached under the adapter's
identity (name, path and a fingerprint of its files).

Engine 1 asks the same prompts with the base model, adapter A, adapter B
and A again; engine 2, fresh on the same root, asks them with A retrained
in place (same name, path and id: vLLM's own block keys cannot tell) and
with the base model. Each answer must equal a run without the cache with
the same weights, and hits happen only within the same adapter weights.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.vineyard_engine_testing import (
    EngineRun,
    cacheable_prefix,
    engine_env,
    run_engine,
)
from tests.vineyard_testing import random_tokens
from tests.vineyard_toy_model import make_toy_lora

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

LLM_KWARGS = {
    "enable_lora": True,
    "max_lora_rank": 8,
    "max_loras": 2,
    "enable_prefix_caching": False,  # only vineyard serves a prefix
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(31)
    return [random_tokens(rng, 300), random_tokens(rng, 200)]


@pytest.fixture(scope="module")
def adapters(module_dir: Path) -> dict[str, str]:
    """Adapter directories: A and B, and A retrained (its later weights,
    also kept under a path of their own for the reference run)."""
    made = {
        "A": make_toy_lora(str(module_dir / "adapter-a"), seed=1),
        "B": make_toy_lora(str(module_dir / "adapter-b"), seed=2),
        "A-retrained": make_toy_lora(str(module_dir / "adapter-a2"), seed=3),
        "A-original": make_toy_lora(str(module_dir / "adapter-a-copy"), seed=1),
    }
    return made


def _round(prompts: list[list[int]], lora: list[Any] | None) -> dict[str, Any]:
    return {"prompts": prompts, "max_tokens": 8, "lora": lora}


@pytest.fixture(scope="module")
def runs(
    toy_model: str,
    prompts: list[list[int]],
    adapters: dict[str, str],
    module_dir: Path,
) -> tuple[EngineRun, EngineRun, EngineRun]:
    """Engine 1, engine 2 (after A is retrained in place), and one engine
    without the cache asked with each adapter's weights."""
    root = module_dir / "cache"
    a, b = ["A", 1, adapters["A"]], ["B", 2, adapters["B"]]
    first = run_engine(
        toy_model,
        [_round(prompts, r) for r in (None, a, b, a)],
        engine_env(root),
        module_dir / "engine1",
        llm_kwargs=LLM_KWARGS,
    )
    # Retrained in place: the same name, path and id as before.
    shutil.copytree(adapters["A-retrained"], adapters["A"], dirs_exist_ok=True)
    second = run_engine(
        toy_model,
        [_round(prompts, r) for r in (a, None)],
        engine_env(root),
        module_dir / "engine2",
        llm_kwargs=LLM_KWARGS,
    )
    weights = [
        None,
        ["A", 1, adapters["A-original"]],
        b,
        ["A", 3, adapters["A-retrained"]],
    ]
    no_cache = run_engine(
        toy_model,
        [_round(prompts, r) for r in weights],
        engine_env(module_dir / "unused", use_cache=False),
        module_dir / "no-cache",
        llm_kwargs=LLM_KWARGS,
    )
    return first, second, no_cache


def test_adapters_change_the_outputs(
    runs: tuple[EngineRun, EngineRun, EngineRun],
) -> None:
    """Else sharing KV across adapters could not show."""
    base, a, b, retrained = (r.outputs for r in runs[2].rounds)
    assert len({str(base), str(a), str(b), str(retrained)}) == 4


def test_each_answer_equals_no_cache(
    runs: tuple[EngineRun, EngineRun, EngineRun],
) -> None:
    first, second, no_cache = runs
    base, a, b, retrained = (r.outputs for r in no_cache.rounds)
    assert [r.outputs for r in first.rounds] == [base, a, b, a]
    assert [r.outputs for r in second.rounds] == [retrained, base]


def test_hits_only_within_the_same_adapter_weights(
    prompts: list[list[int]], runs: tuple[EngineRun, EngineRun, EngineRun]
) -> None:
    first, second, _ = runs
    full = [cacheable_prefix(len(p)) for p in prompts]
    none = [0] * len(prompts)
    # Base, A, B: each the first of its kind; then A again hits.
    assert [r.num_cached_tokens for r in first.rounds] == [none, none, none, full]
    # Retrained A misses A's chunks; the base model hits engine 1's.
    assert [r.num_cached_tokens for r in second.rounds] == [none, full]
    assert first.last.counter("load_errors") == 0
    assert second.last.counter("load_errors") == 0
