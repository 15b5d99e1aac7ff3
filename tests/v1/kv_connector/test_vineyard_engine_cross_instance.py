# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Two engine instances, one cache: what the first computed, the second loads.

Both are turned on by ``VLLM_USE_VINEYARD_CACHE=1`` alone. They run the
engine in one process, as every engine test here; the plugin and the overlay
in vLLM's spawned processes are proven by ``vllm serve`` (its EngineCore,
``tests/entrypoints/test_vineyard_serve.py``) and by the TP=2 workers
(``tests/distributed/test_vineyard_tensor_parallel.py``).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.vineyard_engine_testing import (
    BLOCK_SIZE,
    EngineRun,
    ReferenceRunner,
    cacheable_prefix,
    common_prefix,
    engine_env,
    run_engine,
    saved_tokens,
    whole_chunks,
)
from tests.vineyard_testing import random_tokens

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(1)
    base = random_tokens(rng, 2000)
    return {
        "shared_a": base + random_tokens(rng, 1000),
        "shared_b": base + random_tokens(rng, 1100),
        "other": random_tokens(rng, 3000),
        # Shares 1400 tokens (21.9 blocks) with the others.
        "partial": base[:1400] + random_tokens(rng, 1700),
    }


FIRST = ("shared_a", "shared_b", "other")


@pytest.fixture(scope="module")
def instances(
    toy_model: str, prompts: dict[str, list[int]], module_dir: Path
) -> tuple[EngineRun, EngineRun]:
    """Engine A fills a fresh cache; then engine B, on the same root, gets
    the partial-prefix prompt first (nothing local yet), then A's prompts."""
    env = engine_env(module_dir / "cache")
    first = [prompts[name] for name in FIRST]
    a = run_engine(
        toy_model,
        [{"prompts": first, "max_tokens": MAX_TOKENS}],
        env,
        module_dir / "engine_a",
    )
    # B's exact hits need every write of A reported done (and A's shutdown
    # drained them: the harness fails a run whose shutdown hangs).
    assert a.last.settled
    b = run_engine(
        toy_model,
        [
            {"prompts": [prompts["partial"]], "max_tokens": MAX_TOKENS},
            {"prompts": first, "max_tokens": MAX_TOKENS},
        ],
        env,
        module_dir / "engine_b",
    )
    return a, b


@pytest.fixture(scope="module")
def no_cache(
    toy_model: str, prompts: dict[str, list[int]], reference: ReferenceRunner
) -> dict[str, list[int]]:
    names = [*FIRST, "partial"]
    run = reference(toy_model, [prompts[n] for n in names], max_tokens=MAX_TOKENS)
    return dict(zip(names, run.last.outputs, strict=True))


def test_first_instance_saves_every_whole_chunk(
    instances: tuple[EngineRun, EngineRun], prompts: dict[str, list[int]]
) -> None:
    a, _ = instances
    assert a.last.settled
    assert a.last.counter("hit_tokens") == 0  # a fresh root
    # Every whole chunk is written once; the chunks shared_b shares with
    # shared_a a second time, unless shared_a's were already in vineyard
    # when shared_b was scheduled (then it saves from there on only).
    everything = sum(saved_tokens(len(prompts[name]), MAX_TOKENS) for name in FIRST)
    shared = whole_chunks(common_prefix(prompts["shared_a"], prompts["shared_b"]))
    assert everything - shared <= a.last.counter("tokens_written") <= everything
    assert a.last.counter("tokens_rejected") == 0
    assert a.last.counter("updates_failed") == 0
    assert a.last.counter("updates_completed") == a.last.counter("updates_submitted")


def test_second_instance_loads_to_the_block(
    instances: tuple[EngineRun, EngineRun], prompts: dict[str, list[int]]
) -> None:
    _, b = instances
    # B's first request has no local prefix cache to hit: all it gets is
    # external: every complete block of the prefix it shares with what A
    # computed.
    common = common_prefix(prompts["partial"], prompts["shared_a"])
    expected = common // BLOCK_SIZE * BLOCK_SIZE
    assert 0 < expected < cacheable_prefix(len(prompts["partial"]))
    assert b.rounds[0].num_cached_tokens == [expected]
    assert b.delta(0, "hit_tokens") == expected
    assert b.delta(0, "loaded_tokens") == expected
    assert b.delta(0, "vllm:external_prefix_cache_hits") == expected

    # Then every prompt A computed is cached up to its last whole block
    # before the token vLLM must compute.
    assert b.rounds[1].num_cached_tokens == [
        cacheable_prefix(len(prompts[name])) for name in FIRST
    ]
    # "other" shares nothing with anything B computed: all of it external.
    assert b.delta(1, "hit_tokens") >= cacheable_prefix(len(prompts["other"]))
    # Every hit is loaded, but for a load stopped as slow (a starved reader
    # on a busy machine), whose rest was computed and counted.
    loaded = b.last.counter("loaded_tokens")
    assert loaded + b.last.counter("tokens_not_loaded_slow") == b.last.counter(
        "hit_tokens"
    )
    assert b.last.counter("load_errors") == 0


def test_outputs_identical_across_instances(
    instances: tuple[EngineRun, EngineRun],
    no_cache: dict[str, list[int]],
) -> None:
    a, b = instances
    expected = [no_cache[name] for name in FIRST]
    assert a.last.outputs == expected
    assert b.rounds[1].outputs == expected
    assert b.rounds[0].outputs == [no_cache["partial"]]


def test_metrics_in_get_metrics(instances: tuple[EngineRun, EngineRun]) -> None:
    a, b = instances
    for run in (a, b):
        names = run.vineyard_metric_names()
        for counter in ("query_tokens", "hit_tokens", "loaded_tokens"):
            assert f"vllm:vineyard_cache_{counter}" in names
        assert "vllm:vineyard_cache_tokens_written" in names
    assert a.last.counter("query_tokens") > 0
    assert b.last.counter("hit_tokens") > 0
    assert b.last.counter("loaded_tokens") > 0
    assert b.last.counter("hit_tokens") <= b.last.counter("query_tokens")
