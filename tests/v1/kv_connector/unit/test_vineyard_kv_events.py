# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV events for routers, through vLLM's real ``Scheduler`` (which publishes
what the connector's ``take_events`` gives it) and a real worker side.

A request's blocks are announced ``BlockStored`` (medium ``STORAGE``) once
its writes are in, with vLLM's block hashes and token ids; its chunks are
then evicted by the worker's sweeper (a budget of one byte) and announced
``BlockRemoved``. A later request that finds a prefix on the root (another
instance's saves) is announced too. That a router sees the same hashes as
vLLM's own events for the same prompt, over ZMQ, is tested with
``vllm serve`` in ``tests/entrypoints/test_vineyard_serve_operations.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vineyard_scheduler_testing import (
    BLOCK_SIZE,
    Engine,
    FakeWorker,
    create_request,
    create_scheduler,
    create_vllm_config,
    make_model_dir,
    random_tokens,
)
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

pytestmark = pytest.mark.timeout(120)


class Published:
    """What the scheduler publishes (instead of a ZMQ socket)."""

    def __init__(self, engine: Engine):
        self.events: list[Any] = []
        engine.scheduler.kv_event_publisher.publish = self._publish

    def _publish(self, batch: KVEventBatch) -> None:
        self.events.extend(batch.events)

    def stored(self) -> list[BlockStored]:
        return [
            e
            for e in self.events
            if isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE
        ]

    def removed(self) -> set[Any]:
        return {
            h
            for e in self.events
            if isinstance(e, BlockRemoved) and e.medium == MEDIUM_STORAGE
            for h in e.block_hashes
        }


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[Engine, FakeWorker]]:
    model = make_model_dir(tmp_path / "model")
    # The worker's sweeper evicts everything it finds, every 0.2 s.
    worker_config = create_vllm_config(
        model, tmp_path / "root", disk_limit_gb=1e-9, sweep_interval_s=0.2
    )
    worker = FakeWorker(worker_config)
    config = create_vllm_config(model, tmp_path / "root")
    config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="null"
    )
    engine = Engine(create_scheduler(config), worker)
    try:
        yield engine, worker
    finally:
        engine.close()
        worker.close()


def test_saved_blocks_are_announced_then_their_eviction(
    rig: tuple[Engine, FakeWorker],
) -> None:
    engine, worker = rig
    published = Published(engine)
    prompt = random_tokens(4 * BLOCK_SIZE + 5)
    request = engine.add(create_request("events", prompt, max_tokens=8))
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[:4]]
    engine.run_until(lambda _: len(published.stored()) > 0)

    stored = published.stored()
    announced = [h for e in stored for h in e.block_hashes]
    assert announced == hashes
    first = stored[0]
    assert first.parent_block_hash is None
    assert first.block_size == BLOCK_SIZE
    assert first.token_ids == prompt[: len(first.block_hashes) * BLOCK_SIZE]

    # The sweeper evicts the chunks; the next reports say so.
    engine.run_until(lambda _: published.removed() == set(hashes), pause_s=0.05)
    assert engine.counter("evicted_chunks") >= 4
