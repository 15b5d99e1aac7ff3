# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sliding-window models under vLLM's real ``Scheduler`` (see
:mod:`vineyard_scheduler_testing`): every layer windowed, as Mistral-7B-v0.1.

vLLM's ``SlidingWindowManager`` frees a running request's blocks once they
leave the window (its block table then holds the null block, id 0, there)
and hands them to other requests. The worker is never told by vLLM itself,
so the connector's scheduler tells it (``RequestDelta.held_from``): a save
retried after the window moved on must never gather a block that now holds
another request's KV, and a load must fill only the blocks vLLM allocated,
never the shared null block.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import RequestStatus

from tests.v1.kv_connector.unit.vineyard_connector_testing import fresh_tokens
from tests.v1.kv_connector.unit.vineyard_scheduler_testing import (
    BLOCK_SIZE,
    LAYER_NAMES,
    Engine,
    FakeWorker,
    create_request,
    create_scheduler,
    create_vllm_config,
    expected_blocks,
    make_kv_cache_config,
    make_model_dir,
)
from tests.vineyard_testing import resume_processes
from vllm.worker.vineyard.connector.request_state import NULL_BLOCK_ID
from vllm.worker.vineyard.connector.vineyard_connector import VineyardConnector
from vllm.worker.vineyard.storage.digests import extend_digests

pytestmark = pytest.mark.timeout(120)

WINDOW = 2 * BLOCK_SIZE
#: Few blocks, so that blocks a window freed are soon handed out again.
NUM_BLOCKS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("model"))


class WindowedRig:
    """A worker and engines of a windowed model on one cache root."""

    def __init__(self, model_dir: str, root: Path, **settings: Any):
        self.config = create_vllm_config(model_dir, root, **settings)
        self.worker = FakeWorker(self.config, NUM_BLOCKS, sliding_window=WINDOW)
        self.engines: list[Engine] = []

    def engine(self) -> Engine:
        scheduler = create_scheduler(self.config, NUM_BLOCKS, sliding_window=WINDOW)
        self.engines.append(Engine(scheduler, self.worker))
        return self.engines[-1]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.worker.close()


@pytest.fixture
def one_buffer(model_dir: str, tmp_path: Path) -> Iterator[WindowedRig]:
    """One update buffer: while the writer is stopped every save after
    the first is skipped, and retried later from the request's progress."""
    rig = WindowedRig(
        model_dir,
        tmp_path / "root",
        # Two blocks a step: the first save covers little, the rest retry.
        max_num_batched_tokens=2 * BLOCK_SIZE,
        min_inflight_tasks=1,
        max_inflight_tasks=1,
    )
    yield rig
    resume_processes(rig.worker.cache.backend_pids().values())
    rig.close()


@pytest.fixture
def default_rig(model_dir: str, tmp_path: Path) -> Iterator[WindowedRig]:
    rig = WindowedRig(model_dir, tmp_path / "root")
    yield rig
    rig.close()


def load_from_root(worker: FakeWorker, tokens: list[int]) -> int:
    """Load what the root holds of ``tokens`` (from token 0) into the
    worker's blocks 1.. (the engines have finished: every block is free)
    and check every loaded block's bytes; returns the loaded tokens."""
    num_blocks = min((len(tokens) - 1) // BLOCK_SIZE, NUM_BLOCKS - 1)
    digests = extend_digests([], tokens[: num_blocks * BLOCK_SIZE], BLOCK_SIZE)
    scratch = list(range(1, num_blocks + 1))
    loaded = worker.cache.load(digests, 0, num_blocks * BLOCK_SIZE, scratch)
    n = loaded // BLOCK_SIZE
    assert torch.equal(worker.blocks(scratch[:n]), expected_blocks(tokens, n)), (
        "the root holds KV that is not this prompt's"
    )
    return loaded


def test_null_block_id_is_vllms() -> None:
    """The connector's null block id is the one vLLM's block pool uses."""
    pool = BlockPool(num_gpu_blocks=4, enable_caching=True, hash_block_size=16)
    assert pool.null_block.block_id == NULL_BLOCK_ID


def test_retried_saves_never_gather_blocks_vllm_freed(
    one_buffer: WindowedRig,
) -> None:
    """Two requests run while the writer is stopped: the first save holds
    the only buffer, the rest are skipped. The window moves on and vLLM
    hands the first request's freed blocks to the second. When the writer
    runs again, the retries of the first request find its blocks freed:
    they are dropped (counted), never gathered, so the root holds only the
    requests' own KV; the null block is never written."""
    rig = one_buffer
    engine, worker = rig.engine(), rig.worker
    prompts = [fresh_tokens(6 * BLOCK_SIZE + 3) for _ in range(2)]
    reqs = [
        engine.add(create_request(f"sw-{i}", p, max_tokens=3 * BLOCK_SIZE))
        for i, p in enumerate(prompts)
    ]
    writer = worker.cache.backend_pids()["write"]
    assert writer is not None
    kv_manager = engine.scheduler.kv_cache_manager
    held: list[set[int]] = [set(), set()]  # every block each request held
    reused = False
    os.kill(writer, signal.SIGSTOP)
    try:
        # Until both run on with a block reused, or one of them finishes
        # (their lookups are answered in the background first: steps pause).
        while all(r.request_id in engine.scheduler.requests for r in reqs):
            engine.step()
            tables = [
                kv_manager.get_block_ids(r.request_id)[0]
                if r.request_id in engine.scheduler.requests
                else []
                for r in reqs
            ]
            for mine, table in zip(held, tables, strict=True):
                mine.update(b for b in table if b)
            # A block the first request held, the window freed while it
            # runs on, and now the second's.
            reused = reused or bool((held[0] - set(tables[0])) & set(tables[1]))
            if reused and all(r.num_output_tokens > 4 for r in reqs):
                break
            time.sleep(0.002)
    finally:
        resume_processes([writer])
    assert reused, "the window never handed a freed block to the other request"
    engine.drain()
    worker.wait_for_writes()
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    # Everything on the root is each request's own KV, and the first
    # update (staged before the writer stopped) did land.
    loaded = [load_from_root(worker, list(r.all_token_ids)) for r in reqs]
    assert max(loaded) >= BLOCK_SIZE
    assert not worker.kv[:, NULL_BLOCK_ID].any(), "the null block was written"
    totals = worker.cache.metrics.totals
    assert totals["updates_skipped"] > 0
    assert totals["saves_dropped_freed"] > 0


def test_a_load_fills_only_the_blocks_vllm_allocated(
    default_rig: WindowedRig,
) -> None:
    """A prompt saved whole, then asked again by a fresh scheduler: vLLM
    allocates blocks only for the last window of the hit (the rest are the
    null block), and the load fills exactly those, with the saved bytes."""
    rig = default_rig
    worker = rig.worker
    prompt = fresh_tokens(8 * BLOCK_SIZE + 5)
    first = rig.engine()
    first.add(create_request("sw-save", prompt, max_tokens=1))
    first.drain()
    worker.wait_for_writes()
    assert worker.cache.metrics.totals["saves_dropped_freed"] == 0

    engine = rig.engine()  # nothing in its own prefix cache
    req = engine.add(create_request("sw-load", prompt, max_tokens=2))
    record = engine.run_until(lambda r: req.request_id in r.loads())
    delta = record.loads()[req.request_id]
    hit = 8 * BLOCK_SIZE
    assert delta.load is not None and delta.load[1] == hit
    # vLLM left out every block before the last window of the hit.
    freed = (hit - WINDOW + 1) // BLOCK_SIZE
    assert delta.block_ids[:freed] == [NULL_BLOCK_ID] * freed
    if req.request_id not in (record.kv_output.finished_recving or ()):
        # (A load ready in time finishes in the step that starts it.)
        engine.run_until(
            lambda r: req.request_id in (r.kv_output.finished_recving or ())
        )
    assert not worker.kv[:, NULL_BLOCK_ID].any(), "the null block was written"
    loaded_blocks = delta.block_ids[freed : hit // BLOCK_SIZE]
    assert torch.equal(
        worker.blocks(loaded_blocks),
        expected_blocks(prompt, hit // BLOCK_SIZE)[:, freed:],
    )
    assert delta.held_from == freed
    assert delta.load[0] == freed * BLOCK_SIZE
    engine.drain()
    assert worker.cache.metrics.totals["load_errors"] == 0


def _two_groups() -> KVCacheConfig:
    full = make_kv_cache_config().kv_cache_groups[0]
    window = make_kv_cache_config(sliding_window=WINDOW).kv_cache_groups[0]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(LAYER_NAMES[:1], full.kv_cache_spec),
            KVCacheGroupSpec(LAYER_NAMES[1:], window.kv_cache_spec),
        ],
    )


def _chunked_local() -> KVCacheConfig:
    spec = ChunkedLocalAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=2,
        head_size=16,
        dtype=torch.float32,
        attention_chunk_size=4 * BLOCK_SIZE,
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)],
    )


@pytest.mark.parametrize(
    "kv_cache_config,why",
    [
        (_two_groups(), "2 KV cache groups"),
        (_chunked_local(), "ChunkedLocalAttentionSpec"),
    ],
)
def test_an_unsupported_kv_cache_runs_with_the_cache_off(
    model_dir: str,
    tmp_path: Path,
    kv_cache_config: KVCacheConfig,
    why: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Neither side starts the cache: no lookup, no backend, no root; the
    scheduler says why once and counts it once."""
    config = create_vllm_config(model_dir, tmp_path / "root")
    scheduler = VineyardConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker = VineyardConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    try:
        assert any(
            "vineyard cache off" in r.getMessage() and why in r.getMessage()
            for r in caplog.records
        )
        worker.register_kv_caches(
            {name: torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, 32) for name in LAYER_NAMES}
        )
        assert worker.get_handshake_metadata() is None
        scheduler.set_xfer_handshake_metadata({})
        request = create_request("off", fresh_tokens(4 * BLOCK_SIZE))
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        stats = scheduler.get_kv_connector_stats()
        assert stats is not None and stats.data["unsupported_models"] == 1
        again = scheduler.get_kv_connector_stats()
        assert again is None or not again.data.get("unsupported_models")
        assert not (tmp_path / "root").exists()
    finally:
        scheduler.shutdown()
        worker.shutdown()
