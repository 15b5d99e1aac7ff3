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

import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.vineyard_engine_testing import (
    BLOCK_SIZE,
    cacheable_prefix,
    engine_env,
    flip_a_payload_byte,
    open_gate,
    run_engine,
    wait_at_gate,
)
from tests.vineyard_testing import random_tokens
from tests.vineyard_toy_model import make_toy_llama
from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.digests import extend_digests, synthetic_ids

PROMPT_LEN = 900
LONGER_BY = 300
MAX_TOKENS = 10
TP_KWARGS = {"tensor_parallel_size": 2, "enable_prefix_caching": False}
COLLECTIVE_LOG_DIR = Path(__file__).parent / "collective_log"
# One core per rank (vLLM's NUMA auto-binding needs two nodes).
TP_BINDING = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_tp2_engine_saves_shards_and_loads_them(tmp_path: Path) -> None:
    model = make_toy_llama(str(tmp_path / "model"))
    prompt = random_tokens(random.Random(3), PROMPT_LEN)
    cached = cacheable_prefix(PROMPT_LEN)
    assert cached == 896  # every block before the last token (14 of 64)
    longer = prompt + random_tokens(random.Random(4), LONGER_BY)
    rounds = [{"prompts": [prompt], "max_tokens": MAX_TOKENS}]
    longer_rounds = [{"prompts": [longer], "max_tokens": MAX_TOKENS}]

    plain = run_engine(
        model,
        rounds + longer_rounds,
        engine_env(tmp_path / "unused", use_cache=False, extra=TP_BINDING),
        tmp_path / "no-cache",
        llm_kwargs=TP_KWARGS,
    )
    assert plain.vineyard_metric_names() == []  # no cache, no vineyard metrics

    # Round 0 computes and saves (the harness waits until every write is
    # reported); round 1 asks again and loads. Every process logs its
    # torch.distributed collectives (see collective_log/sitecustomize.py).
    # Rounds 2 and 3 wait at a gate for bit rot (below).
    log = tmp_path / "collectives.log"
    logging_env = {
        **TP_BINDING,
        "PYTHONPATH": os.pathsep.join(
            [str(COLLECTIVE_LOG_DIR), os.environ.get("PYTHONPATH", "")]
        ),
        "VINEYARD_TEST_COLLECTIVE_LOG": str(log),
    }
    gate = tmp_path / "bit-rot"
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            run_engine,
            model,
            rounds * 2 + [{**longer_rounds[0], "gate": str(gate)}] + longer_rounds,
            engine_env(tmp_path / "cache", extra=logging_env),
            tmp_path / "cache-on",
            llm_kwargs=TP_KWARGS,
        )
        wait_at_gate(gate, running=lambda: not running.done())
        # Rank 0's copy of block 5 rots on disk. The engine then asks for a
        # longer prompt: rank 0's load comes up short there, rank 1's does
        # not; vLLM recomputes from block 5 on both ranks, the outputs stay
        # those of no cache, and the scheduler has both ranks save from
        # there again, so the next ask loads the whole longer prefix.
        rank0 = next((tmp_path / "cache").glob("*-tp2r0-*"))
        ids = synthetic_ids(extend_digests([], prompt, BLOCK_SIZE))
        flip_a_payload_byte(ChunkFiles(str(rank0), 1, 0).path(ids[:6]))
        open_gate(gate)
        run = running.result()
    first, second, bitten, healed = run.rounds
    assert first.num_cached_tokens == [0]
    assert first.outputs == plain.rounds[0].outputs
    assert first.settled and first.counter("updates_submitted") > 0
    assert first.counter("updates_failed") == 0
    shards = sorted(
        p.name.rsplit("-", 2)[1] for p in (tmp_path / "cache").iterdir() if p.is_dir()
    )
    assert shards == ["tp2r0", "tp2r1"]

    assert second.outputs == plain.rounds[0].outputs
    assert run.delta(1, "hit_tokens") == cached
    # Both ranks loaded their shard of every hit token.
    assert run.delta(1, "load_errors") == 0
    assert second.num_cached_tokens == [cached]
    assert run.delta(1, "loaded_tokens") == 2 * cached

    assert bitten.outputs == healed.outputs == plain.rounds[1].outputs
    assert run.delta(2, "load_errors") >= 1
    assert run.delta(2, "corrupt_chunks") == 1
    # Healed: every rank saved again from the bad chunk.
    assert healed.num_cached_tokens == [cacheable_prefix(len(longer))]
    assert run.delta(3, "load_errors") == 0

    # The cache runs no collective in any step (the ranks report to the
    # scheduler instead); vLLM's own set-up collectives were logged, so
    # the logging worked in the workers' processes.
    lines = [line.split() for line in log.read_text().splitlines()]
    started = {pid for pid, what, *_ in lines if what == "started"}
    assert len(started) >= 3  # the engine and two workers
    assert sum(what == "other" for _, what, *_ in lines) > 0
    assert [line for line in lines if line[1] == "cache"] == []
