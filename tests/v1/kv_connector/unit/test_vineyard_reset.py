# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``reset_cache`` means reset, through vLLM's real ``Scheduler`` and a real
worker side: writes staged before it, queued or in flight behind a stopped
writer, never land for good (dropped, or their chunks removed once they
land), nothing written before it is looked up again, and no KV event names
a chunk that is not on the root."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tests.v1.kv_connector.unit.vineyard_connector_testing import fresh_tokens
from tests.v1.kv_connector.unit.vineyard_scheduler_testing import (
    BLOCK_SIZE,
    MAX_NUM_BATCHED_TOKENS,
    Engine,
    FakeWorker,
    create_request,
    create_scheduler,
    create_vllm_config,
    epoch_of,
    make_model_dir,
)
from tests.vineyard_testing import resume_processes, wait_until
from vllm.worker.vineyard.connector.removals import RESET_WAIT_S
from vllm.worker.vineyard.connector.request_keys import request_keys

pytestmark = pytest.mark.timeout(180)


def test_writes_staged_before_a_reset_never_land(tmp_path: Path) -> None:
    config = create_vllm_config(make_model_dir(tmp_path / "model"), tmp_path / "root")
    config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="null"
    )
    worker = FakeWorker(config)
    engine = Engine(create_scheduler(config), worker)
    prompt = fresh_tokens(4 * MAX_NUM_BATCHED_TOKENS + BLOCK_SIZE)
    request = create_request("long", prompt, max_tokens=2 * BLOCK_SIZE)
    num_blocks = len(prompt) // BLOCK_SIZE
    old_paths = [worker.chunk_path(prompt, b) for b in range(num_blocks)]
    announced_missing: list[str] = []

    def publish(batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium == MEDIUM_STORAGE:
                live = [maybe_convert_block_hash(h) for h in request.block_hashes]
                seed = request_keys(request, BLOCK_SIZE, epoch=epoch_of(engine)).seed
                for h in event.block_hashes:
                    path = worker.chunk_path(request.all_token_ids, live.index(h), seed)
                    if not os.path.exists(path):
                        announced_missing.append(path)

    setattr(engine.scheduler.kv_event_publisher, "publish", publish)  # noqa: B010
    writer = worker.cache.backend_pids()["write"]
    assert writer is not None
    os.kill(writer, signal.SIGSTOP)
    try:
        engine.add(request)
        # Three steps of the prompt staged: one write in flight (stopped),
        # the others queued behind it.
        engine.run_until(
            lambda r: request.num_computed_tokens >= 3 * MAX_NUM_BATCHED_TOKENS
        )
        submitted = engine.counter("updates_submitted")
        assert submitted >= 3
        start = time.monotonic()
        assert engine.scheduler.reset_connector_cache()
        assert time.monotonic() - start < RESET_WAIT_S + 1.0
        assert not any(os.path.exists(p) for p in old_paths)
        engine.step()  # the workers learn of the reset
    finally:
        resume_processes([writer])
    engine.drain()
    worker.wait_for_writes()
    # Dropped, or written and then removed: none stays.
    assert wait_until(lambda: not any(os.path.exists(p) for p in old_paths), 30.0)
    engine.run_until(lambda _: engine.counter("updates_fenced") >= submitted - 1)
    # The request saved again under the new epoch: a new request for the
    # same prompt hits that, and only that.
    new_seed = request_keys(request, BLOCK_SIZE, epoch=epoch_of(engine)).seed
    assert os.path.exists(worker.chunk_path(prompt, 0, new_seed))
    again = engine.add(create_request("again", prompt))
    record = engine.run_until(lambda r: r.num_scheduled(again.request_id) > 0)
    new = record.new_request(again.request_id)
    assert new is not None and new.num_computed_tokens > 0
    engine.drain()
    worker.wait_for_writes()
    assert not any(os.path.exists(p) for p in old_paths)
    assert announced_missing == []
    assert engine.counter("load_errors") == 0
    engine.close()
    worker.close()


def test_a_running_request_saves_again_from_its_first_chunk(tmp_path: Path) -> Any:
    """A reset while a request runs: its chunks are saved again under the
    new epoch, every one of them, and loaded by the next request."""
    config = create_vllm_config(make_model_dir(tmp_path / "model"), tmp_path / "root")
    worker = FakeWorker(config)
    engine = Engine(create_scheduler(config), worker)
    prompt = fresh_tokens(2 * MAX_NUM_BATCHED_TOKENS + BLOCK_SIZE)
    request = engine.add(create_request("running", prompt, max_tokens=4))
    engine.run_until(lambda r: request.num_computed_tokens >= MAX_NUM_BATCHED_TOKENS)
    assert engine.scheduler.reset_connector_cache()
    engine.drain()
    worker.wait_for_writes()
    seed = request_keys(request, BLOCK_SIZE, epoch=epoch_of(engine)).seed
    full = len(prompt) // BLOCK_SIZE
    assert all(os.path.exists(worker.chunk_path(prompt, b, seed)) for b in range(full))
    engine.close()
    worker.close()


def test_a_load_in_flight_at_a_reset_is_recomputed(tmp_path: Path) -> None:
    """A load that reads chunks written before the reset (its reader
    stopped, so the read is in flight) is not used: once the workers learn
    of the reset, its blocks are reported for recompute, and vLLM computes
    them (no token counts as loaded)."""
    config = create_vllm_config(
        make_model_dir(tmp_path / "model"),
        tmp_path / "root",
        enable_prefix_caching=False,
    )
    worker = FakeWorker(config)
    engine = Engine(create_scheduler(config), worker)
    prompt = fresh_tokens(3 * BLOCK_SIZE + 1)
    engine.add(create_request("first", prompt))
    engine.drain()
    worker.wait_for_writes()
    (reader,) = [
        pid for name, pid in worker.cache.backend_pids().items() if name != "write"
    ][:1]
    assert reader is not None
    os.kill(reader, signal.SIGSTOP)
    try:
        second = engine.add(create_request("second", prompt))
        engine.run_until(lambda r: second.request_id in r.loads())
        assert engine.scheduler.reset_connector_cache()
        record = engine.run_until(
            lambda r: second.request_id in (r.kv_output.finished_recving or ())
        )
        assert len(record.kv_output.invalid_block_ids) == 3
    finally:
        resume_processes([reader])
    engine.drain()
    assert engine.counter("loaded_tokens") == 0
    assert engine.counter("load_errors") == 0  # fenced, not failed
    engine.close()
    worker.close()
