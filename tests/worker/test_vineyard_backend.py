# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The backend processes dying, stalling and coming back: the cache
degrades to recompute (counted), restarts them (counted) and works again."""

from __future__ import annotations

import os
import signal
import threading
import time

from vineyard_cache_testing import (
    CHUNK_SIZE,
    CacheFactory,
    CacheHarness,
    make_tokens,
    pid_exists,
    same_bits,
    stop_process,
    wait_until,
)

from vllm.worker.vineyard_llm_cache import SaveRequest

SEQ_LEN = 4 * CHUNK_SIZE + 3
CACHED = 4 * CHUNK_SIZE


def saved_sequence(h: CacheHarness, req_id: str = "req") -> tuple[list[int], list[int]]:
    """A sequence of four cached chunks: its tokens and source blocks."""
    tokens = make_tokens(SEQ_LEN)
    blocks = h.blocks_for(0, SEQ_LEN)
    h.save_all([SaveRequest(req_id, tokens, SEQ_LEN, blocks)])
    h.cache.release(req_id)
    assert h.counters()["tokens_written"] >= CACHED
    return tokens, blocks


def reader_pid(h: CacheHarness) -> int:
    pid = h.cache._reader.pid
    assert pid is not None
    return pid


def writer_pid(h: CacheHarness) -> int:
    assert h.cache._writer is not None
    pid = h.cache._writer.pid
    assert pid is not None
    return pid


def kill_later(pid: int, delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, os.kill, (pid, signal.SIGKILL))
    timer.start()
    return timer


def test_reader_dying_during_a_lookup_and_a_load(make_cache: CacheFactory):
    h = make_cache()
    tokens, src = saved_sequence(h)

    # Dies while the lookup waits for its answer: a miss, counted, fast.
    pid = reader_pid(h)
    stop_process(pid)
    timer = kill_later(pid, 0.3)
    t0 = time.perf_counter()
    assert h.cache.lookup(tokens, 0) == (0, 0)
    elapsed = time.perf_counter() - t0
    timer.join()
    assert 0.25 < elapsed < h.config.backend_timeout_s / 2
    counters = h.counters()
    assert counters["load_errors"] == 1
    assert counters["hit_tokens"] == 0
    assert not pid_exists(pid)

    # The next call restarts it and works again.
    assert h.cache.lookup(tokens, 0) == (CACHED, CACHED)
    assert h.counters()["backend_restarts"] == 1
    assert reader_pid(h) != pid

    # Dies during a load: nothing is written into the blocks, the load is
    # short (counted), and the next load works.
    pid = reader_pid(h)
    stop_process(pid)
    timer = kill_later(pid, 0.3)
    dst = h.blocks_for(40, SEQ_LEN)
    before = h.kv.clone()
    assert h.cache.load(tokens, 0, CACHED, dst) == 0
    timer.join()
    assert same_bits(h.kv, before)
    assert h.counters()["load_errors"] == 2  # one per failed call
    assert h.cache.load(tokens, 0, CACHED, dst) == CACHED
    n = CACHED // h.block_size
    assert same_bits(h.kv[:, dst[:n]], h.kv[:, src[:n]])
    assert h.counters()["backend_restarts"] == 2


def test_stalled_reader_times_out_and_is_replaced(make_cache: CacheFactory):
    h = make_cache(backend_timeout_s=1.0)
    tokens, _ = saved_sequence(h)
    pid = reader_pid(h)
    stop_process(pid)
    t0 = time.perf_counter()
    assert h.cache.lookup(tokens, 0) == (0, 0)
    elapsed = time.perf_counter() - t0
    assert 0.9 < elapsed < 4.0
    assert h.counters()["load_errors"] == 1
    # The stalled process was killed, not left behind.
    assert wait_until(lambda: not pid_exists(pid), 5.0)
    assert h.cache.lookup(tokens, 0) == (CACHED, CACHED)
    assert h.counters()["backend_restarts"] == 1


def test_backend_restarts_then_is_disabled_after_too_many(make_cache: CacheFactory):
    h = make_cache()
    tokens, _ = saved_sequence(h)
    reader = h.cache._reader
    for restart in range(1, 4):
        old = reader_pid(h)
        reader.kill()
        assert not pid_exists(old)
        # Found dead before the request is sent: restarted, nothing lost.
        assert h.cache.lookup(tokens, 0) == (CACHED, CACHED)
        assert reader_pid(h) != old
        counters = h.counters()
        assert counters["backend_restarts"] == restart
        assert counters["load_errors"] == 0
    reader.kill()
    # Degrades to recompute: a miss every time, fast, no exception.
    for _ in range(3):
        t0 = time.perf_counter()
        assert h.cache.lookup(tokens, 0) == (0, 0)
        assert time.perf_counter() - t0 < 0.5
    assert reader.disabled_reason is not None
    counters = h.counters()
    assert counters["load_errors"] == 3
    assert counters["backend_restarts"] == 3
    # Writes go on: the writer is another process.
    more_tokens, _ = saved_sequence(h, "other")
    assert h.counters()["updates_failed"] == 0


def test_writer_killed_between_writes_restarts_on_the_next_write(
    make_cache: CacheFactory,
):
    h = make_cache()
    saved_sequence(h, "a")
    assert h.cache._writer is not None
    old = writer_pid(h)
    h.cache._writer.kill()
    tokens, _ = saved_sequence(h, "b")
    assert h.cache.lookup(tokens, 0) == (CACHED, CACHED)
    assert writer_pid(h) != old
    counters = h.counters()
    assert counters["backend_restarts"] == 1
    assert counters["updates_failed"] == 0


def test_writer_dying_mid_write_fails_that_task_only(make_cache: CacheFactory):
    """A write in flight when the writer dies fails (counted); the tasks
    queued behind it are written by the restarted writer."""
    h = make_cache(max_inflight_tasks=4)
    cache = h.cache
    lost = make_tokens(SEQ_LEN)
    kept = [make_tokens(SEQ_LEN) for _ in range(2)]
    pid = writer_pid(h)
    stop_process(pid)
    # Each save takes one buffer; the first one's write is stuck in the
    # stopped backend, the others queue behind it.
    assert cache.save([SaveRequest("lost", lost, CACHED, h.blocks_for(0, SEQ_LEN))])
    for i, tokens in enumerate(kept):
        blocks = h.blocks_for(20 * (i + 1), SEQ_LEN)
        assert cache.save([SaveRequest(f"kept{i}", tokens, CACHED, blocks)])
    assert cache.pool is not None and cache.pool.num_in_flight == 3
    updater = cache._updater
    assert updater is not None
    # The first task has been taken and sent.
    assert wait_until(lambda: updater._queue.qsize() == 2)
    time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    h.wait()
    counters = h.counters()
    assert counters["updates_failed"] == 1
    assert counters["updates_completed"] == 2
    assert counters["backend_restarts"] == 1
    assert counters["tokens_written"] == 2 * CACHED
    assert cache.pool.num_in_flight == 0
    assert cache.lookup(lost, 0) == (0, 0)
    for tokens in kept:
        assert cache.lookup(tokens, 0) == (CACHED, CACHED)


def test_writes_run_at_lower_priority_than_reads(small_cache: CacheHarness):
    """The writer is background work; the reader serves the forward pass."""
    cache = small_cache.cache
    assert cache._writer is not None
    reader_pid, writer_pid = cache._reader.pid, cache._writer.pid
    assert reader_pid is not None and writer_pid is not None
    reader_nice = os.getpriority(os.PRIO_PROCESS, reader_pid)
    writer_nice = os.getpriority(os.PRIO_PROCESS, writer_pid)
    assert writer_nice == min(19, reader_nice + 10)
