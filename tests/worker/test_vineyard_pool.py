# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the staging pool and the ordered updater.

The pool runs over real shared memory; the updater's backend is replaced
by a small ``write`` callable, which is what these tests are about: the
order of the writes and where every buffer goes on success, failure and
shutdown. The same paths with the real backend are in
test_vineyard_updates.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from vllm.worker.vineyard_llm_cache import (
    VineyardCacheMetrics,
    _AsyncUpdater,
    _PinnedTensorPool,
    _StagingMemory,
    _UpdateTask,
)

NUM_LAYERS = 2
MAX_BLOCKS = 4
BLOCK_BYTES = 1024

Write = Callable[[int, list[Any]], list[int]]


@pytest.fixture
def memory() -> Iterator[_StagingMemory]:
    mem = _StagingMemory(8, NUM_LAYERS, MAX_BLOCKS, BLOCK_BYTES, torch.float32, "t")
    yield mem
    mem.close()


def make_pool(memory: _StagingMemory, low: int, high: int) -> _PinnedTensorPool:
    return _PinnedTensorPool(memory, low, high)


def make_task(pool: _PinnedTensorPool, tag: int) -> _UpdateTask:
    """A task on a free buffer whose only segment carries ``tag``."""
    buffer_id = pool.get()
    assert buffer_id is not None, "pool exhausted"
    return _UpdateTask(buffer_id, [(0, [], [tag])])


class Updater:
    """An updater over a fake write, stopped at teardown."""

    def __init__(
        self,
        pool: _PinnedTensorPool,
        write: Write,
        drain_timeout_s: float = 5.0,
    ):
        self.pool = pool
        self.metrics = VineyardCacheMetrics(histograms_enabled=True)
        self.updater = _AsyncUpdater(write, pool, self.metrics, drain_timeout_s)

    def counters(self) -> dict[str, int]:
        return self.metrics.snapshot()


@pytest.fixture
def updaters() -> Iterator[list[Updater]]:
    made: list[Updater] = []
    yield made
    for u in made:
        u.updater.shutdown()
        u.updater.join(5.0)


# --------------------------------------------------------------------------
# _PinnedTensorPool
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("low", "high"), [(1, 1), (1, 4), (2, 5), (3, 3), (1, 8)])
def test_pool_bounds(memory: _StagingMemory, low: int, high: int) -> None:
    pool = make_pool(memory, low, high)
    # MIN buffers exist from the start, nothing is in flight.
    assert pool.num_created == low
    assert pool.num_free == high
    assert pool.num_in_flight == 0
    ids = []
    for i in range(high):
        buffer_id = pool.get()
        assert buffer_id is not None
        ids.append(buffer_id)
        # Grows lazily: one more buffer only when the existing ones are used.
        assert pool.num_created == max(low, i + 1)
        assert pool.num_in_flight == i + 1
        assert pool.num_free == high - i - 1
    assert sorted(ids) == list(range(high))
    # Never beyond MAX, however often it is asked.
    for _ in range(3):
        assert pool.get() is None
    assert pool.num_created == high
    assert pool.num_free == 0
    for buffer_id in ids:
        pool.put(buffer_id)
    assert pool.num_in_flight == 0
    assert pool.num_free == high
    # Reuse, no growth.
    again = {pool.get() for _ in range(high)}
    assert again == set(ids)
    assert pool.num_created == high


def test_pool_get_does_not_block_when_exhausted(memory: _StagingMemory) -> None:
    pool = make_pool(memory, 2, 2)
    assert pool.get() is not None and pool.get() is not None
    # A thread hands a buffer back later; get() must not wait for it.
    t0 = time.perf_counter()
    results = [pool.get() for _ in range(100)]
    elapsed = time.perf_counter() - t0
    assert results == [None] * 100
    assert elapsed < 0.05, f"100 get() on an empty pool took {elapsed:.3f} s"


def test_pool_buffers_are_distinct_and_zeroed(memory: _StagingMemory) -> None:
    memory.tensor.view(torch.uint8).fill_(0xAB)  # dirty shared memory
    pool = make_pool(memory, 2, 4)
    ids = [pool.get() for _ in range(4)]
    assert None not in ids
    buffers = [pool.buffer(i) for i in ids if i is not None]
    for b in buffers:
        assert tuple(b.shape) == (NUM_LAYERS, MAX_BLOCKS, BLOCK_BYTES // 4)
        assert not b.view(torch.uint8).any(), "pool buffer not zeroed at creation"
    for value, b in enumerate(buffers):
        b.fill_(float(value + 1))
    for value, b in enumerate(buffers):
        assert torch.all(b == float(value + 1)), "pool buffers overlap"


def test_pool_rejects_double_put(memory: _StagingMemory) -> None:
    pool = make_pool(memory, 1, 2)
    buffer_id = pool.get()
    assert buffer_id is not None
    pool.put(buffer_id)
    with pytest.raises(AssertionError, match="returned twice"):
        pool.put(buffer_id)


def test_pool_is_thread_safe(memory: _StagingMemory) -> None:
    pool = make_pool(memory, 1, 4)
    errors: list[str] = []

    def churn() -> None:
        for _ in range(2000):
            buffer_id = pool.get()
            if buffer_id is not None:
                if not 0 <= buffer_id < 4:
                    errors.append(f"bad id {buffer_id}")
                pool.put(buffer_id)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.num_in_flight == 0 and pool.num_free == 4
    assert pool.num_created <= 4


# --------------------------------------------------------------------------
# _AsyncUpdater
# --------------------------------------------------------------------------


def test_updater_keeps_issue_order_under_a_burst(
    memory: _StagingMemory, updaters: list[Updater]
) -> None:
    pool = make_pool(memory, 1, 4)
    written: list[int] = []
    gate = threading.Event()

    def write(buffer_id: int, segments: list[Any]) -> list[int]:
        gate.wait(5.0)
        written.append(segments[0][2][0])
        time.sleep(0.001)
        return [len(tokens) for _, _, tokens in segments]

    u = Updater(pool, write)
    updaters.append(u)
    issued: list[int] = []
    # Four sequences, each submitting its steps while the writer is held:
    # every buffer is in flight at once.
    tag = 0
    for _ in range(5):
        tasks = []
        for seq in range(4):
            tag += 1
            tasks.append(make_task(pool, seq * 1000 + tag))
        assert pool.get() is None  # all four in flight
        for task in tasks:
            u.updater.submit(task)
            issued.append(task.segments[0][2][0])
        gate.set()
        for task in tasks:
            assert task.done.wait(5.0)
            assert task.outcome == "completed"
        gate.clear()
    assert written == issued
    counters = u.counters()
    assert counters["updates_submitted"] == counters["updates_completed"] == 20
    assert counters["tokens_written"] == 20
    assert counters["updates_failed"] == counters["tokens_rejected"] == 0
    assert pool.num_in_flight == 0


def test_updater_counts_rejected_tokens(
    memory: _StagingMemory, updaters: list[Updater]
) -> None:
    pool = make_pool(memory, 1, 1)

    def write(buffer_id: int, segments: list[Any]) -> list[int]:
        return [0, 32]  # vineyard refused the first segment

    u = Updater(pool, write)
    updaters.append(u)
    buffer_id = pool.get()
    assert buffer_id is not None
    task = _UpdateTask(buffer_id, [(0, [], [1] * 32), (32, [], [2] * 64)])
    u.updater.submit(task)
    assert task.done.wait(5.0)
    counters = u.counters()
    assert counters["tokens_written"] == 32
    assert counters["tokens_rejected"] == 64
    assert counters["updates_completed"] == 1
    assert pool.num_in_flight == 0


@pytest.mark.parametrize("failing", [0, 2, 5])
def test_updater_goes_on_after_a_failed_write(
    memory: _StagingMemory, updaters: list[Updater], failing: int
) -> None:
    pool = make_pool(memory, 2, 2)
    seen: list[int] = []

    def write(buffer_id: int, segments: list[Any]) -> list[int]:
        tag = segments[0][2][0]
        seen.append(tag)
        if tag == failing:
            raise RuntimeError("backend exploded")
        return [1]

    u = Updater(pool, write)
    updaters.append(u)
    tasks = []
    for tag in range(6):
        # Two buffers: wait for one to come back, failed or not.
        deadline = time.monotonic() + 5.0
        while pool.num_free == 0:
            assert time.monotonic() < deadline, "buffer not returned"
            time.sleep(0.001)
        task = make_task(pool, tag)
        u.updater.submit(task)
        tasks.append(task)
    for task in tasks:
        assert task.done.wait(5.0)
    assert seen == list(range(6))
    assert [t.outcome for t in tasks] == [
        "failed" if tag == failing else "completed" for tag in range(6)
    ]
    counters = u.counters()
    assert counters["updates_failed"] == 1
    assert counters["updates_completed"] == 5
    assert pool.num_in_flight == 0
    assert pool.num_free == 2
    assert u.updater.join(0.0) is False  # still serving


def test_updater_shutdown_drains_within_the_timeout_and_drops_the_rest(
    memory: _StagingMemory, updaters: list[Updater]
) -> None:
    pool = make_pool(memory, 1, 4)

    def slow_write(buffer_id: int, segments: list[Any]) -> list[int]:
        time.sleep(0.4)
        return [1]

    drain_s = 0.6
    u = Updater(pool, slow_write, drain_timeout_s=drain_s)
    updaters.append(u)
    tasks = [make_task(pool, tag) for tag in range(4)]
    for task in tasks:
        u.updater.submit(task)
    assert pool.num_in_flight == 4
    t0 = time.perf_counter()
    u.updater.shutdown()
    elapsed = time.perf_counter() - t0
    # Two writes fit the drain timeout (0.4 s each: the second starts
    # before the deadline, the third after it); the rest are dropped
    # without being written.
    assert elapsed < drain_s + 1.0
    assert u.updater.join(1.0)
    assert [t.outcome for t in tasks] == ["completed"] * 2 + ["dropped"] * 2
    counters = u.counters()
    assert counters["updates_completed"] == 2
    assert counters["updates_dropped"] == 2
    assert pool.num_in_flight == 0 and pool.num_free == 4
    # After shutdown a submit is dropped at once, its buffer returned.
    late = make_task(pool, 99)
    u.updater.submit(late)
    assert late.done.is_set() and late.outcome == "dropped"
    assert pool.num_in_flight == 0
    u.updater.shutdown()  # idempotent


def test_updater_shutdown_is_bounded_when_a_write_hangs(
    memory: _StagingMemory, updaters: list[Updater]
) -> None:
    pool = make_pool(memory, 1, 3)
    release = threading.Event()

    def hanging_write(buffer_id: int, segments: list[Any]) -> list[int]:
        release.wait(30.0)
        raise RuntimeError("backend closed")

    drain_s = 0.3
    u = Updater(pool, hanging_write, drain_timeout_s=drain_s)
    updaters.append(u)
    tasks = [make_task(pool, tag) for tag in range(3)]
    for task in tasks:
        u.updater.submit(task)
    t0 = time.perf_counter()
    u.updater.shutdown()
    elapsed = time.perf_counter() - t0
    # Gives up on the hung write after the drain timeout plus a second.
    assert drain_s + 0.9 < elapsed < drain_s + 2.0
    # Whoever owns the backend now closes it, failing the write.
    release.set()
    assert u.updater.join(5.0), "updater thread still alive"
    assert [t.outcome for t in tasks] == ["failed", "dropped", "dropped"]
    counters = u.counters()
    assert counters["updates_failed"] == 1 and counters["updates_dropped"] == 2
    assert pool.num_in_flight == 0 and pool.num_free == 3


def test_updater_records_timings(
    memory: _StagingMemory, updaters: list[Updater]
) -> None:
    pool = make_pool(memory, 1, 1)

    def write(buffer_id: int, segments: list[Any]) -> list[int]:
        time.sleep(0.05)
        return [1]

    u = Updater(pool, write)
    updaters.append(u)
    task = make_task(pool, 1)
    u.updater.submit(task)
    assert task.done.wait(5.0)
    taken = u.metrics.take()
    assert len(taken["update_exec_s"]) == 1 and taken["update_exec_s"][0] >= 0.05
    assert len(taken["update_queue_delay_s"]) == 1
    assert taken["updates_completed"] == 1
    # take() resets the deltas, not the totals.
    assert u.metrics.take()["updates_completed"] == 0
    assert u.counters()["updates_completed"] == 1
