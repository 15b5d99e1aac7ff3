# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The on-switch: ``VLLM_USE_VINEYARD_CACHE=1`` alone, or vLLM's explicit
``kv_transfer_config``; with neither, no vineyard code is even imported; and
a bad setting stops the engine at startup with an error naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vineyard_engine_testing import (
    VINEYARD_MODULES,
    EngineRun,
    ReferenceRunner,
    cacheable_prefix,
    engine_env,
    run_engine,
    standard_prompts,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

EXPLICIT = {"kv_connector": "VineyardConnector", "kv_role": "kv_both"}


@pytest.fixture(scope="module")
def no_cache(toy_model: str, reference: ReferenceRunner) -> EngineRun:
    # Single-process engine: the scheduler and the worker run in the
    # process that reports sys.modules.
    return reference(toy_model, standard_prompts())


def test_unset_imports_no_vineyard_code(no_cache: EngineRun) -> None:
    assert no_cache.modules == dict.fromkeys(VINEYARD_MODULES, False)
    assert no_cache.vineyard_metric_names() == []
    assert no_cache.last.counter("vllm:external_prefix_cache_queries") == 0


@pytest.mark.parametrize("switch", ["env", "explicit"])
def test_switch_turns_cache_on(
    switch: str, toy_model: str, module_dir: Path, no_cache: EngineRun
) -> None:
    prompts = standard_prompts()
    root = module_dir / switch / "cache"
    llm_kwargs: dict[str, Any]
    if switch == "env":
        env, llm_kwargs = engine_env(root), {}
    else:
        env = engine_env(root, use_cache=False)
        llm_kwargs = {"kv_transfer_config": EXPLICIT}
    assert ("VLLM_USE_VINEYARD_CACHE" in env) == (switch == "env")
    # Without the local prefix cache the repeat can only hit vineyard.
    llm_kwargs["enable_prefix_caching"] = False
    run = run_engine(
        toy_model,
        [{"prompts": prompts}, {"prompts": prompts}],
        env,
        module_dir / switch,
        llm_kwargs=llm_kwargs,
    )
    assert "vllm:vineyard_cache_hit_tokens" in run.vineyard_metric_names()
    assert run.rounds[0].settled  # round 1's hits need round 0's writes
    assert run.modules["vllm.worker.vineyard.connector.vineyard_connector"]
    assert run.rounds[1].num_cached_tokens == [
        cacheable_prefix(len(p)) for p in prompts
    ]
    assert run.delta(1, "loaded_tokens") == sum(run.rounds[1].num_cached_tokens)
    assert run.rounds[0].outputs == no_cache.last.outputs
    assert run.rounds[1].outputs == no_cache.last.outputs


@pytest.mark.parametrize(
    "name, value",
    [
        ("VINEYARD_CACHE_ASYNC_UPDATE_CPU_MEM_UTIL", "2"),
        ("VINEYARD_CACHE_CHUNK_SIZE", "100"),  # not a multiple of the blocks
    ],
)
def test_bad_setting_fails_startup(
    name: str, value: str, toy_model: str, module_dir: Path
) -> None:
    workdir = module_dir / f"bad-{name}"
    env = engine_env(workdir / "cache", extra={name: value})
    run = run_engine(
        toy_model,
        [{"prompts": [[5] * 300]}],
        env,
        workdir,
        timeout_s=120,
        expect_ok=False,
    )
    assert not run.ok and run.rounds == []
    assert run.error is not None
    assert f"{name}={value}" in run.error or f"{name}={value!r}" in run.error
    assert "allowed" in run.error
