# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A cache root that stops answering (a network filesystem whose server
hangs) does not stop the engine.

The root is a real FUSE filesystem (``benchmarks/vineyard/slow_fs.py``, a
passthrough that blocks every call while frozen). One engine fills the
cache, then generates new prompts while the root is frozen for the whole
round: their lookups give up after the lookup timeout (misses, counted) and
their writes are skipped, so they complete with outputs identical to no
cache instead of waiting for the filesystem. Once the root answers again
the first prompts hit, and the engine shuts down within its bound.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.script_testing import ROOT, mount_slow_fs
from tests.vineyard_engine_testing import (
    CHUNK_SIZE,
    EngineRun,
    ReferenceRunner,
    cacheable_prefix,
    engine_env,
    run_engine,
)
from tests.vineyard_testing import random_tokens

sys.path.insert(0, str(ROOT / "benchmarks" / "vineyard"))
from slow_fs import SlowFs  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

MAX_TOKENS = 8
LOOKUP_TIMEOUT_S = 1.0
#: Generous for three short prompts on a busy two-core machine; without
#: background lookups the frozen round never ends (the test times out).
FROZEN_ROUND_BOUND_S = 60.0


@pytest.fixture(scope="module")
def slow_fs(module_dir: Path) -> Iterator[SlowFs]:
    fs = mount_slow_fs(module_dir / "fs")
    yield fs
    fs.close()


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(31)
    return {
        "cached": [random_tokens(rng, 700) for _ in range(2)],
        "new": [random_tokens(rng, 500) for _ in range(3)],
    }


@pytest.fixture(scope="module")
def run(
    toy_model: str,
    slow_fs: SlowFs,
    prompts: dict[str, list[list[int]]],
    module_dir: Path,
) -> EngineRun:
    env = engine_env(
        slow_fs.mount / "root",
        extra={
            "VINEYARD_CACHE_LOOKUP_TIMEOUT_S": str(LOOKUP_TIMEOUT_S),
            "VINEYARD_CACHE_BACKEND_TIMEOUT_S": "5",
            # One block per chunk, whatever the FUSE root's round trip.
            "VINEYARD_CACHE_CHUNK_SIZE": str(CHUNK_SIZE),
        },
    )
    rounds: list[dict[str, Any]] = [
        {"prompts": prompts["cached"], "max_tokens": MAX_TOKENS},
        {
            "prompts": prompts["new"],
            "max_tokens": MAX_TOKENS,
            "freeze_file": str(slow_fs.freeze_file),
        },
        {"prompts": prompts["cached"], "max_tokens": MAX_TOKENS},
    ]
    return run_engine(
        toy_model,
        rounds,
        env,
        module_dir / "engine",
        llm_kwargs={"enable_prefix_caching": False},
        settle_s=60.0,
    )


def test_a_frozen_root_does_not_stop_requests(
    run: EngineRun,
    prompts: dict[str, list[list[int]]],
    toy_model: str,
    reference: ReferenceRunner,
) -> None:
    frozen = run.rounds[1]
    assert frozen.wall_s < FROZEN_ROUND_BOUND_S, frozen.wall_s
    assert frozen.outputs == reference(toy_model, prompts["new"]).last.outputs
    assert frozen.num_cached_tokens == [0] * len(prompts["new"])
    assert run.delta(1, "lookup_timeouts") >= 1


def test_the_cache_serves_again_after_the_freeze(
    run: EngineRun,
    prompts: dict[str, list[list[int]]],
    toy_model: str,
    reference: ReferenceRunner,
) -> None:
    assert run.rounds[0].settled  # the first prompts were saved
    expected = reference(toy_model, prompts["cached"]).last.outputs
    assert run.rounds[0].outputs == run.rounds[2].outputs == expected
    assert run.rounds[2].num_cached_tokens == [
        cacheable_prefix(len(p)) for p in prompts["cached"]
    ]
    # And the engine shut down in order within its bound (the harness fails
    # a run whose shutdown hangs).
    assert run.ok and run.shutdown_s is not None
