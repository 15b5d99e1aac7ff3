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

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tests.script_testing import mount_slow_fs
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
    running,
)
from tests.vineyard_testing import resume_processes
from vllm.worker.vineyard.connector.removals import RESET_WAIT_S
from vllm.worker.vineyard.connector.request_keys import request_keys

pytestmark = pytest.mark.timeout(120)


class Published:
    """What the scheduler publishes (instead of a ZMQ socket)."""

    def __init__(self, engine: Engine, on_event: Callable[[Any], None] | None = None):
        self.events: list[Any] = []
        self._on_event = on_event
        # Stands in for the ZMQ publisher's method.
        setattr(engine.scheduler.kv_event_publisher, "publish", self._publish)  # noqa: B010

    def _publish(self, batch: KVEventBatch) -> None:
        self.events.extend(batch.events)
        for event in batch.events:
            if self._on_event is not None:
                self._on_event(event)

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
    # The worker's sweeper removes, every 0.2 s, what nobody used for 1 s.
    worker_config = create_vllm_config(
        model, tmp_path / "root", ttl_s=1.0, sweep_interval_s=0.2
    )
    config = create_vllm_config(model, tmp_path / "root")
    config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="null"
    )
    with running(config, worker_config) as rig:
        yield rig


def test_saved_blocks_are_announced_then_their_expiry(
    rig: tuple[Engine, FakeWorker],
) -> None:
    engine, worker = rig
    published = Published(engine)
    prompt = fresh_tokens(4 * BLOCK_SIZE + 5)
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

    # The sweeper expires the chunks; the next reports say so.
    engine.run_until(lambda _: published.removed() == set(hashes), pause_s=0.05)
    assert engine.counter("expired_chunks") >= 4


def test_no_block_stored_for_a_file_a_reset_removed(tmp_path: Path) -> None:
    """A write lands, then ``reset_cache`` removes its files before the
    worker reports it: the late report announces nothing (the files are
    gone). The request saves again; those blocks are announced once their
    files exist. Every announcement is checked against the root when it is
    published."""
    model = make_model_dir(tmp_path / "model")
    config = create_vllm_config(model, tmp_path / "root")
    config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="null"
    )
    worker = FakeWorker(config)
    engine = Engine(create_scheduler(config), worker)
    prompt = fresh_tokens(MAX_NUM_BATCHED_TOKENS + 2 * BLOCK_SIZE)
    request = create_request("reset", prompt, max_tokens=3 * BLOCK_SIZE)
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
    missing: list[int] = []

    def check(event: Any) -> None:
        if isinstance(event, BlockStored) and event.medium == MEDIUM_STORAGE:
            # Blocks of generated tokens too: the request as it is now,
            # named in the scheduler's epoch (a reset gives a new one).
            live = [maybe_convert_block_hash(h) for h in request.block_hashes]
            tokens = list(request.all_token_ids)
            seed = request_keys(request, BLOCK_SIZE, epoch=epoch_of(engine)).seed
            for h in event.block_hashes:
                path = worker.chunk_path(tokens, live.index(h), seed)
                if not os.path.exists(path):
                    missing.append(live.index(h))

    published = Published(engine, check)
    writer = worker.cache.backend_pids()["write"]
    assert writer is not None
    try:
        engine.add(request)
        # The first blocks' save is issued ...
        engine.run_until(lambda r: r.num_scheduled(request.request_id) > 0)
        worker.wait_for_writes()  # ... and lands, not yet reported
        first = MAX_NUM_BATCHED_TOKENS // BLOCK_SIZE
        assert all(os.path.exists(worker.chunk_path(prompt, b)) for b in range(first))
        # The saves issued from now on wait until the reset's aftermath is seen.
        os.kill(writer, signal.SIGSTOP)
        assert engine.scheduler.reset_connector_cache()
        assert not os.path.exists(worker.chunk_path(prompt, 0))
        for _ in range(4):
            engine.step()  # the late report of the landed write arrives
        assert published.stored() == []
    finally:
        resume_processes([writer])
    engine.drain()
    worker.wait_for_writes()
    engine.run_until(lambda _: len(published.stored()) > 0, pause_s=0.05)
    assert missing == []
    announced = [h for e in published.stored() for h in e.block_hashes]
    assert announced[:first] == hashes[:first]
    engine.close()
    worker.close()


def test_a_reset_on_a_hung_root_returns_at_once_and_says_so_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``reset_cache`` on a root that stops answering (a FUSE root frozen)
    returns within its wait, its fence in force, while the removal goes on
    in a lookup process (abandoned after the backend timeout): the engine
    keeps stepping, and the failed removal is logged and counted. Once the
    root answers again, a reset removes the instance's chunks."""
    fs = mount_slow_fs(tmp_path / "fs")
    try:
        model = make_model_dir(tmp_path / "model")
        config = create_vllm_config(
            model, fs.mount / "root", chunk_size=BLOCK_SIZE, backend_timeout_s=1.0
        )
        worker = FakeWorker(config)
        engine = Engine(create_scheduler(config), worker)
        try:
            prompt = fresh_tokens(2 * BLOCK_SIZE + 1)
            engine.add(create_request("saved", prompt, max_tokens=1))
            engine.drain()
            worker.wait_for_writes()
            assert os.path.exists(worker.chunk_path(prompt, 0))
            fs.freeze(True)
            start = time.monotonic()
            assert engine.scheduler.reset_connector_cache()
            assert time.monotonic() - start < RESET_WAIT_S + 1.0
            engine.add(create_request("during", fresh_tokens(BLOCK_SIZE), 2))
            engine.run_until(
                lambda _: any(
                    "did not finish" in r.getMessage() for r in caplog.records
                )
            )
            assert engine.counter("reset_failures") == 1
            fs.freeze(False)
            engine.drain()
            assert engine.scheduler.reset_connector_cache()
            assert not os.path.exists(worker.chunk_path(prompt, 0))
        finally:
            fs.freeze(False)
            engine.close()
            worker.close()
    finally:
        fs.close()
