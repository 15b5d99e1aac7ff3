# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor parallelism in a real TP=2 engine (one spawned worker process per
rank): each rank stores its own shard under its own namespace, both ranks
load their shard of a hit, and the outputs equal a TP=2 engine without the
cache.

vLLM's local prefix cache is off, so the second round's hit can only come
from vineyard. That a fresh engine finds another engine's chunks is tested
in ``tests/v1/kv_connector/test_vineyard_engine_cross_instance.py``; the
scheduler's rule that a chunk counts only if every rank has it (the minimum
across ranks) in ``tests/v1/kv_connector/unit/test_vineyard_connector_scheduler.py``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from vineyard_engine_testing import (
    cacheable_prefix,
    engine_env,
    random_tokens,
    run_engine,
)
from vineyard_toy_model import make_toy_llama

PROMPT_LEN = 900
MAX_TOKENS = 10
TP_KWARGS = {"tensor_parallel_size": 2, "enable_prefix_caching": False}
# One core per rank (vLLM's NUMA auto-binding needs two nodes).
TP_BINDING = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_tp2_engine_saves_shards_and_loads_them(tmp_path: Path) -> None:
    model = make_toy_llama(str(tmp_path / "model"))
    prompt = random_tokens(random.Random(3), PROMPT_LEN)
    cached = cacheable_prefix(PROMPT_LEN)
    assert cached == 896  # every block before the last token (14 of 64)
    rounds = [{"prompts": [prompt], "max_tokens": MAX_TOKENS}]

    plain = run_engine(
        model,
        rounds,
        engine_env(tmp_path / "unused", use_cache=False, extra=TP_BINDING),
        tmp_path / "no-cache",
        llm_kwargs=TP_KWARGS,
    )
    assert plain.vineyard_metric_names() == []  # no cache, no vineyard metrics

    # Round 0 computes and saves (the harness waits until every write is
    # reported); round 1 asks again and loads.
    run = run_engine(
        model,
        rounds * 2,
        engine_env(tmp_path / "cache", extra=TP_BINDING),
        tmp_path / "cache-on",
        llm_kwargs=TP_KWARGS,
    )
    first, second = run.rounds
    assert first.num_cached_tokens == [0]
    assert first.outputs == plain.last.outputs
    assert first.settled and first.counter("updates_submitted") > 0
    assert first.counter("updates_failed") == 0
    shards = sorted(p.name.rsplit("-", 2)[1] for p in (tmp_path / "cache").iterdir())
    assert shards == ["tp2r0", "tp2r1"]

    assert second.num_cached_tokens == [cached]
    assert second.outputs == plain.last.outputs
    assert run.delta(1, "hit_tokens") == cached
    # Both ranks loaded their shard of every hit token.
    assert run.delta(1, "loaded_tokens") == 2 * cached
    assert run.last.counter("load_errors") == 0
