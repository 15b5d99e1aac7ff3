# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests of the staging pool and the ordered updater.

The pool runs over real shared memory; the updater's backend is replaced
by a small ``write`` callable, which is what these tests are about: the
order of the writes and where every buffer goes on success, failure and
shutdown. The same paths with the real backend are in
test_updates.py.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.vineyard_testing import wait_until
from tests.worker.vineyard_cache_testing import TestingPool
from vllm.worker.vineyard.metrics import VineyardCacheMetrics
from vllm.worker.vineyard.transfer.saves import Segment, UpdateResult, UpdateTask
from vllm.worker.vineyard.transfer.staging import BufferBacking, StagingMemory
from vllm.worker.vineyard_llm_cache import _AsyncUpdater, _PinnedTensorPool

MAX_BLOCKS = 4
ENTRY_BYTES = 1024  # one block of every layer plus its trailer
BLOCK_SIZE = 16  # tokens per block: the updater counts tokens

Write = Callable[[UpdateTask], UpdateResult]


@pytest.fixture
def memory() -> Iterator[StagingMemory]:
    mem = StagingMemory(8, MAX_BLOCKS, ENTRY_BYTES, torch.float32)
    yield mem
    mem.close()


def segment(tag: int, num_blocks: int = 1) -> Segment:
    """A segment of ``num_blocks`` blocks whose first id is ``tag``."""
    return Segment(
        first_slot=0,
        prefix_ids=[],
        ids=[tag] * num_blocks,
        digests=[bytes(16)] * num_blocks,
        req_id=f"req{tag}",
        first_token=0,
    )


def tag_of(task: UpdateTask) -> int:
    return task.segments[0].ids[0]


def written(task: UpdateTask) -> UpdateResult:
    """Every block of every segment written."""
    return UpdateResult(sum(len(s.ids) for s in task.segments), 0)


def make_pool(
    memory: StagingMemory, low: int, high: int, back_ahead: bool = False
) -> TestingPool:
    """A pool; without ``back_ahead`` it grows only on demand, which the
    tests of its bounds count."""
    return TestingPool(memory, low, high, back_ahead)


def make_task(pool: _PinnedTensorPool, tag: int) -> UpdateTask:
    """A task on a free buffer whose only segment carries ``tag``."""
    buffer_id = pool.get()
    assert buffer_id is not None, "pool exhausted"
    return UpdateTask(buffer_id, [segment(tag)])


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
        self.failed: list[UpdateTask] = []
        self.updater = _AsyncUpdater(
            write,
            pool,
            self.metrics,
            BLOCK_SIZE,
            drain_timeout_s,
            on_failed=self.failed.append,
        )

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
def test_pool_bounds(memory: StagingMemory, low: int, high: int) -> None:
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


def test_pool_get_does_not_block_when_exhausted(memory: StagingMemory) -> None:
    """get() on an exhausted pool returns None at once, even while the
    buffers in flight are held (nobody will put one back during the calls).
    Proved without timing: the calls run in a thread that must finish
    within a deadline far beyond any machine's slowness, while the only
    thing that could end a wait (a put) happens only after the deadline."""
    pool = make_pool(memory, 2, 2)
    held = [pool.get(), pool.get()]
    assert None not in held
    results: list[int | None] = []
    thread = threading.Thread(
        target=lambda: results.extend(pool.get() for _ in range(100)), daemon=True
    )
    thread.start()
    thread.join(30.0)
    blocked = thread.is_alive()
    for buffer_id in held:
        assert buffer_id is not None
        pool.put(buffer_id)  # frees a blocked get(), if any
    thread.join(5.0)
    assert not blocked, "get() blocked on an exhausted pool"
    assert results == [None] * 100


def test_pool_buffers_are_distinct_and_zeroed(memory: StagingMemory) -> None:
    memory.tensor.view(torch.uint8).fill_(0xAB)  # dirty shared memory
    pool = make_pool(memory, 2, 4)
    ids = [pool.get() for _ in range(4)]
    assert None not in ids
    buffers = [pool.buffer(i) for i in ids if i is not None]
    for b in buffers:
        assert tuple(b.shape) == (MAX_BLOCKS, ENTRY_BYTES // 4)
        assert not b.view(torch.uint8).any(), "pool buffer not zeroed at creation"
    for value, b in enumerate(buffers):
        b.fill_(float(value + 1))
    for value, b in enumerate(buffers):
        assert torch.all(b == float(value + 1)), "pool buffers overlap"


def test_pool_rejects_double_put(memory: StagingMemory) -> None:
    pool = make_pool(memory, 1, 2)
    buffer_id = pool.get()
    assert buffer_id is not None
    pool.put(buffer_id)
    with pytest.raises(AssertionError, match="returned twice"):
        pool.put(buffer_id)


def test_pool_is_thread_safe(memory: StagingMemory) -> None:
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


@pytest.mark.parametrize("back_ahead", [True, False])
def test_buffers_are_backed_ahead_of_need(back_ahead: bool) -> None:
    """Beyond the minimum, buffers are backed by a background thread, so
    a burst that takes every buffer faults in no staging pages on the
    forward thread (here the test's thread); the pool that grows on demand
    shows what that would cost (the contrast proves the count)."""
    pages = 256  # a 1 MiB buffer
    mem = StagingMemory(4, 1, pages * 4096, torch.float32)
    pool = make_pool(mem, 1, 4, back_ahead=back_ahead)
    try:
        if back_ahead:
            assert wait_until(lambda: pool.num_created == 4, 30.0)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        taken = [pool.get() for _ in range(4)]
        for buffer_id in taken:
            assert buffer_id is not None
            pool.buffer(buffer_id).fill_(1.0)  # the gather writes every page
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        if back_ahead:
            assert faults < pages // 8, f"{faults} page faults on the forward thread"
        else:
            assert faults >= pages
    finally:
        pool.close()
        mem.close()


def test_a_burst_at_startup_takes_every_buffer(memory: StagingMemory) -> None:
    """A burst that comes before the background thread is done still gets
    every buffer (backed on the spot or waited for), never a skip while a
    buffer is left; one more is refused."""
    for _ in range(20):  # races the background thread at different points
        pool = make_pool(memory, 1, 8, back_ahead=True)
        taken = [pool.get() for _ in range(8)]
        assert sorted(taken) == list(range(8))  # type: ignore[type-var]
        assert pool.get() is None
        pool.close()
        assert pool.num_created == 8


class SlicedBacking(BufferBacking):
    """Buffers of many slices, recording the priority (nice) and cores each
    thread backs them at."""

    SLICE_BYTES = 4096

    def __init__(self, *args: Any, **kwargs: Any):
        self.nice_by_thread: dict[str, int] = {}
        self.cores_by_thread: dict[str, set[int]] = {}
        super().__init__(*args, **kwargs)

    def _back_slice(self, buffer_id: int, index: int) -> None:
        name = threading.current_thread().name
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        self.nice_by_thread.setdefault(name, nice)
        self.cores_by_thread.setdefault(name, os.sched_getaffinity(0))
        super()._back_slice(buffer_id, index)


class SlicedPool(TestingPool):
    backing_type = SlicedBacking

    @property
    def nice_by_thread(self) -> dict[str, int]:
        assert isinstance(self._backing, SlicedBacking)
        return self._backing.nice_by_thread

    @property
    def cores_by_thread(self) -> dict[str, set[int]]:
        assert isinstance(self._backing, SlicedBacking)
        return self._backing.cores_by_thread


def test_a_burst_takes_over_buffers_half_backed() -> None:
    """Buffers of 16 slices, a burst racing the background thread at
    different points: every buffer is handed out once, wholly backed
    (every byte of dirty memory zeroed: no slice skipped), and the
    background thread backs at the lowest priority while the forward
    thread's own backing keeps its priority."""
    mem = StagingMemory(8, 16, 4096, torch.float32)  # 64 KiB buffers
    own_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    try:
        for _ in range(20):
            mem.tensor.view(torch.uint8).fill_(0xAB)
            pool = SlicedPool(mem, 1, 8, True)
            taken = [pool.get() for _ in range(8)]
            assert sorted(taken) == list(range(8))  # type: ignore[type-var]
            assert pool.get() is None
            for buffer_id in taken:
                assert buffer_id is not None
                assert not pool.buffer(buffer_id).view(torch.uint8).any()
            pool.close()
            assert pool.num_created == 8
            assert pool.nice_by_thread.get("vineyard-pool-backer", 19) == 19
            assert pool.nice_by_thread[threading.current_thread().name] == own_nice
    finally:
        mem.close()


@pytest.fixture
def on_one_core() -> Iterator[int]:
    """This thread bound to one core, as vLLM's CPU worker binds its
    forward thread (threads it starts inherit that); the core's number."""
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two cores")
    core = min(before)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, before)


def test_the_background_thread_backs_every_buffer_off_the_forward_core(
    on_one_core: int,
) -> None:
    """At the lowest priority, and on the cores the forward thread does
    not use: an engine's startup keeps its own core busy."""
    mem = StagingMemory(4, 16, 4096, torch.float32)
    pool = SlicedPool(mem, 1, 4, True)
    try:
        assert wait_until(lambda: pool.num_created == 4, 30.0)
        assert pool.nice_by_thread["vineyard-pool-backer"] == 19
        cores = pool.cores_by_thread["vineyard-pool-backer"]
        assert cores and on_one_core not in cores
        assert pool.num_free == 4
    finally:
        pool.close()
        mem.close()


# --------------------------------------------------------------------------
# _AsyncUpdater
# --------------------------------------------------------------------------


def test_updater_keeps_issue_order_under_a_burst(
    memory: StagingMemory, updaters: list[Updater]
) -> None:
    pool = make_pool(memory, 1, 4)
    order: list[int] = []
    gate = threading.Event()

    def write(task: UpdateTask) -> UpdateResult:
        gate.wait(5.0)
        order.append(tag_of(task))
        time.sleep(0.001)
        return written(task)

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
            issued.append(tag_of(task))
        gate.set()
        for task in tasks:
            assert task.done.wait(5.0)
            assert task.outcome == "completed"
        gate.clear()
    assert order == issued
    counters = u.counters()
    assert counters["updates_submitted"] == counters["updates_completed"] == 20
    assert counters["tokens_written"] == 20 * BLOCK_SIZE
    assert counters["updates_failed"] == counters["tokens_rejected"] == 0
    assert pool.num_in_flight == 0


def test_updater_counts_rejected_tokens(
    memory: StagingMemory, updaters: list[Updater]
) -> None:
    pool = make_pool(memory, 1, 1)

    def write(task: UpdateTask) -> UpdateResult:
        return UpdateResult(2, 4)  # vineyard refused one segment (no prefix)

    u = Updater(pool, write)
    updaters.append(u)
    buffer_id = pool.get()
    assert buffer_id is not None
    task = UpdateTask(buffer_id, [segment(1, 2), segment(2, 4)])
    u.updater.submit(task)
    assert task.done.wait(5.0)
    counters = u.counters()
    assert counters["tokens_written"] == 2 * BLOCK_SIZE
    assert counters["tokens_rejected"] == 4 * BLOCK_SIZE
    # A refusal is not a failure: the request is not rewound.
    assert counters["updates_completed"] == 1
    assert counters["updates_failed"] == 0
    assert u.failed == []
    assert pool.num_in_flight == 0


@pytest.mark.parametrize("failing", [0, 2, 5])
def test_updater_goes_on_after_a_failed_write(
    memory: StagingMemory, updaters: list[Updater], failing: int
) -> None:
    pool = make_pool(memory, 2, 2)
    seen: list[int] = []

    def write(task: UpdateTask) -> UpdateResult:
        tag = tag_of(task)
        seen.append(tag)
        if tag == failing:
            raise RuntimeError("backend exploded")
        return written(task)

    u = Updater(pool, write)
    updaters.append(u)
    tasks = []
    for tag in range(6):
        # Two buffers: wait for one to come back, failed or not.
        assert wait_until(lambda: pool.num_free > 0, 5.0), "buffer not returned"
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
    # The failed task's requests are rewound (the cache's on_failed).
    assert [tag_of(t) for t in u.failed] == [failing]
    assert pool.num_in_flight == 0
    assert pool.num_free == 2
    assert u.updater.join(0.0) is False  # still serving


def test_updater_shutdown_drains_within_the_timeout_and_drops_the_rest(
    memory: StagingMemory, updaters: list[Updater]
) -> None:
    """Tasks that start before the drain deadline are written; those that
    would start after it are dropped unwritten. The timeline is set by
    conditions, not sleeps: the second write lasts until the deadline has
    passed, so the third and fourth can only start after it."""
    pool = make_pool(memory, 1, 4)
    drain_s = 0.5
    u: Updater

    def write(task: UpdateTask) -> UpdateResult:
        if tag_of(task) == 1:
            updater = u.updater
            assert wait_until(
                lambda: (
                    updater._stopping.is_set() and time.monotonic() > updater._deadline
                )
            )
        return written(task)

    u = Updater(pool, write, drain_timeout_s=drain_s)
    updaters.append(u)
    tasks = [make_task(pool, tag) for tag in range(4)]
    for task in tasks:
        u.updater.submit(task)
    assert pool.num_in_flight == 4
    t0 = time.perf_counter()
    u.updater.shutdown()
    elapsed = time.perf_counter() - t0
    # It drained until the deadline, and stopped soon after (the bound is
    # generous: it only proves that shutdown does not hang).
    assert drain_s <= elapsed < drain_s + 10.0
    assert u.updater.join(5.0)
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
    memory: StagingMemory, updaters: list[Updater]
) -> None:
    pool = make_pool(memory, 1, 3)
    release = threading.Event()

    def hanging_write(task: UpdateTask) -> UpdateResult:
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
    # Gives up on the hung write after the drain timeout plus a second
    # (the upper bound is generous: it only proves shutdown returns).
    assert drain_s + 0.9 < elapsed < drain_s + 10.0
    # Whoever owns the backend now closes it, failing the write.
    release.set()
    assert u.updater.join(5.0), "updater thread still alive"
    assert [t.outcome for t in tasks] == ["failed", "dropped", "dropped"]
    counters = u.counters()
    assert counters["updates_failed"] == 1 and counters["updates_dropped"] == 2
    assert pool.num_in_flight == 0 and pool.num_free == 3


def test_updater_records_timings(
    memory: StagingMemory, updaters: list[Updater]
) -> None:
    pool = make_pool(memory, 1, 1)

    def write(task: UpdateTask) -> UpdateResult:
        time.sleep(0.05)
        return written(task)

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
