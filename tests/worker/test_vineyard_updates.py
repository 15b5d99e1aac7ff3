# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Asynchronous updates through the real backend: issue order under a burst,
skipping (never blocking) when the pool is saturated and resuming later,
draining at shutdown, and a bounded shutdown that leaks nothing when the
backend is stalled."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass

import pytest
from vineyard_cache_testing import (
    CHUNK_SIZE,
    LARGE_CACHE,
    LARGE_STEP_TOKENS,
    MAX_NUM_BATCHED_TOKENS,
    CacheFactory,
    CacheHarness,
    chunk_files,
    make_tokens,
    pid_exists,
    stop_process,
    wait_until,
)

from vllm.worker.vineyard_backend import BackendError, BackendProcess
from vllm.worker.vineyard_llm_cache import SaveRequest, VineyardLLMCache


@dataclass
class Sequence:
    """A running request: its prompt, its blocks, its progress."""

    req_id: str
    tokens: list[int]
    blocks: list[int]
    computed: int = 0

    def request(self) -> SaveRequest:
        return SaveRequest(self.req_id, self.tokens, self.computed, self.blocks)


def make_sequences(
    h: CacheHarness, count: int, num_chunks: int, extra_tokens: int = 1
) -> list[Sequence]:
    """``count`` sequences of ``num_chunks`` whole chunks plus a few tokens,
    each in its own blocks."""
    length = num_chunks * h.chunk_size + extra_tokens
    blocks_each = -(-length // h.block_size)
    assert count * blocks_each <= h.kv.shape[1]
    return [
        Sequence(f"seq{i}", make_tokens(length), h.blocks_for(i * blocks_each, length))
        for i in range(count)
    ]


def cached_tokens(h: CacheHarness, seq: Sequence) -> int:
    return h.cache.lookup(seq.tokens, 0)[0]


def whole_chunks(seq: Sequence, chunk: int) -> int:
    return (len(seq.tokens) - 1) // chunk * chunk


def test_burst_from_several_sequences_keeps_issue_order(make_cache: CacheFactory):
    """Four sequences advance by uneven (chunked prefill) steps and save after
    every step; several tasks of each are queued at once. Vineyard refuses a
    chunk whose prefix is not cached yet, so any reordering shows up as
    rejected tokens and missing chunks."""
    h = make_cache(max_inflight_tasks=4)
    cache = h.cache
    assert cache.pool is not None
    rng = random.Random(0)
    seqs = make_sequences(h, 4, num_chunks=8, extra_tokens=5)
    max_in_flight = 0
    while any(s.computed < len(s.tokens) for s in seqs):
        for s in seqs:
            s.computed = min(len(s.tokens), s.computed + rng.choice([16, 24, 40, 64]))
        cache.save([s.request() for s in seqs])
        max_in_flight = max(max_in_flight, cache.pool.num_in_flight)
    h.wait()
    assert max_in_flight >= 2, "the burst never queued two tasks"

    # Every chunk that was submitted (not skipped) is cached, and no more.
    for s in seqs:
        assert cached_tokens(h, s) == cache._resume[s.req_id]
    # The skipped rest comes with the next save.
    h.save_all([s.request() for s in seqs])
    full = whole_chunks(seqs[0], CHUNK_SIZE)
    for s in seqs:
        assert cached_tokens(h, s) == full
    counters = h.counters()
    assert counters["tokens_rejected"] == 0
    assert counters["updates_failed"] == 0
    assert counters["tokens_written"] == 4 * full
    assert counters["updates_submitted"] == counters["updates_completed"]
    assert len(chunk_files(cache.root)) == 4 * full // CHUNK_SIZE


@pytest.mark.parametrize("slow", ["stalled-backend", "large-kv"])
def test_saturation_skips_without_blocking_and_resumes_later(
    make_cache: CacheFactory, slow: str
):
    """With one buffer and writes slower than the steps, save() skips (and
    counts) instead of waiting; the resume point saves the skipped chunks
    with a later save()."""
    pid: int | None = None  # of the stalled backend
    if slow == "large-kv":
        h = make_cache(
            **LARGE_CACHE,
            num_blocks=4 * LARGE_STEP_TOKENS // 16 + 8,
            max_inflight_tasks=1,
            metrics_enabled=True,
        )
        # Each step completes one chunk of each of four sequences: a full
        # buffer (32 MiB) per step.
        seqs = make_sequences(h, 4, num_chunks=4)
    else:
        h = make_cache(max_inflight_tasks=1, metrics_enabled=True)
        seqs = make_sequences(h, 4, num_chunks=6)
        assert h.cache._writer is not None
        pid = h.cache._writer.pid
        assert pid is not None
        stop_process(pid)
    cache = h.cache
    steps = len(seqs[0].tokens) // h.chunk_size
    save_s = []
    for _ in range(steps):
        for s in seqs:
            s.computed += h.chunk_size
        t0 = time.perf_counter()
        cache.save([s.request() for s in seqs])
        save_s.append(time.perf_counter() - t0)
    if pid is not None:
        time.sleep(0.5)  # the one write in flight takes at least this long
        os.kill(pid, signal.SIGCONT)
    h.wait()
    write_s = cache.metrics.take()["update_exec_s"]
    assert len(write_s) == 1
    counters = h.counters()
    assert counters["updates_submitted"] == 1
    assert counters["updates_skipped"] == steps - 1
    # No save waited for the write: the skipped ones return at once; the
    # first one only copies its KV into the buffer (32 MiB for large-kv).
    assert max(save_s[1:]) < min(0.01, write_s[0] / 20), (save_s, write_s)
    if slow == "stalled-backend":
        assert save_s[0] < 0.1 < 0.5 <= write_s[0], (save_s, write_s)

    # Only the first step's chunks are in; the rest resumes with later saves.
    for s in seqs:
        assert cached_tokens(h, s) == h.chunk_size
    h.save_all([s.request() for s in seqs])
    full = whole_chunks(seqs[0], h.chunk_size)
    for s in seqs:
        assert cached_tokens(h, s) == full
    counters = h.counters()
    assert counters["tokens_rejected"] == 0 and counters["updates_failed"] == 0
    assert counters["tokens_written"] == 4 * full


def test_sync_update_returns_after_the_write(make_cache: CacheFactory):
    h = make_cache(enable_async_update=False)
    cache = h.cache
    (seq,) = make_sequences(h, 1, num_chunks=3)
    seq.computed = 3 * CHUNK_SIZE
    assert cache.save([seq.request()])
    assert cache.pool is not None and cache.pool.num_in_flight == 0
    assert h.counters()["updates_completed"] == 1
    assert cached_tokens(h, seq) == 3 * CHUNK_SIZE


def test_close_writes_pending_updates(make_cache: CacheFactory):
    h = make_cache(max_inflight_tasks=4)
    seqs = make_sequences(h, 4, num_chunks=4)
    for s in seqs:
        s.computed = 4 * CHUNK_SIZE
        assert h.cache.save([s.request()])  # one task each
    h.cache.close()
    counters = h.counters()
    assert counters["updates_completed"] == counters["updates_submitted"] == 4
    assert counters["updates_dropped"] == 0
    # Another instance on the same root (here a lookup-only one, as the
    # scheduler has) finds all of it.
    lookups = VineyardLLMCache(h.config, h.layout, MAX_NUM_BATCHED_TOKENS)
    try:
        for s in seqs:
            assert lookups.lookup(s.tokens, 0) == (4 * CHUNK_SIZE, 4 * CHUNK_SIZE)
    finally:
        lookups.close()


@pytest.mark.parametrize("stall", ["sleep-request", "sigstop"])
def test_shutdown_with_a_stalled_backend_is_bounded_and_leaks_nothing(
    make_cache: CacheFactory, stall: str
):
    drain_s = 0.5
    h = make_cache(
        max_inflight_tasks=4, drain_timeout_s=drain_s, backend_timeout_s=30.0
    )
    cache = h.cache
    writer, pool, updater = cache._writer, cache.pool, cache._updater
    assert writer is not None and pool is not None and updater is not None
    procs = [p for p in (cache._reader._proc, writer._proc) if p is not None]
    assert len(procs) == 2

    sleeper_errors: list[Exception] = []
    sleeper = threading.Thread(
        target=lambda: _sleep_in_backend(writer, sleeper_errors), daemon=True
    )
    if stall == "sleep-request":
        # The writer is busy with a 30 s request: every write waits behind it.
        sleeper.start()
        assert wait_until(writer._lock.locked)
    else:
        assert writer.pid is not None
        stop_process(writer.pid)

    seqs = make_sequences(h, 4, num_chunks=3)
    for _ in range(3):
        for s in seqs:
            s.computed += CHUNK_SIZE
        for s in seqs:
            cache.save([s.request()])
    assert pool.num_in_flight == 4
    counters = h.counters()
    assert counters["updates_skipped"] == 12 - 4

    t0 = time.perf_counter()
    cache.close()
    elapsed = time.perf_counter() - t0
    assert elapsed < drain_s + 2.5, f"close() took {elapsed:.1f} s"

    # Nothing leaks: buffers, thread, processes.
    assert pool.num_in_flight == 0
    assert pool.num_free == pool.max_buffers
    assert not updater._thread.is_alive()
    for proc in procs:
        assert proc.poll() is not None
        assert not pid_exists(proc.pid)
    counters = h.counters()
    assert counters["updates_completed"] == 0
    assert counters["updates_submitted"] == 4
    assert counters["updates_failed"] + counters["updates_dropped"] == 4
    assert counters["updates_dropped"] >= 3
    if stall == "sleep-request":
        sleeper.join(5.0)
        assert not sleeper.is_alive()
        assert len(sleeper_errors) == 1
    # A lookup after close misses, without an exception.
    assert cache.lookup(seqs[0].tokens, 0) == (0, 0)


def _sleep_in_backend(writer: BackendProcess, errors: list[Exception]) -> None:
    """Keep the backend busy with a 30 s request (its "sleep" test hook)."""
    try:
        writer.call("sleep", 30.0, timeout_s=60.0)
    except BackendError as e:
        errors.append(e)


def test_failed_write_is_written_again_from_its_first_chunk(
    make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
):
    h = make_cache(max_inflight_tasks=4)
    cache = h.cache
    assert cache._writer is not None
    (seq,) = make_sequences(h, 1, num_chunks=4)
    real_call = cache._writer.call
    failures = iter([True])

    def fail_once(*request, **kwargs):
        if request[0] == "update" and next(failures, False):
            raise BackendError("injected write failure")
        return real_call(*request, **kwargs)

    monkeypatch.setattr(cache._writer, "call", fail_once)
    seq.computed = 2 * CHUNK_SIZE
    assert cache.save([seq.request()])  # chunks 0-1: the write fails
    h.wait()
    seq.computed = 4 * CHUNK_SIZE
    assert cache.save([seq.request()])  # rewound: chunks 0-3 in one task
    h.wait()
    counters = h.counters()
    assert counters["updates_failed"] == 1 and counters["updates_completed"] == 1
    assert counters["tokens_rejected"] == 0
    assert cached_tokens(h, seq) == 4 * CHUNK_SIZE


def test_no_staging_copy_once_the_writer_is_disabled(make_cache: CacheFactory):
    h = make_cache()
    assert h.cache._writer is not None
    h.cache._writer.disabled_reason = "disabled by the test"
    (seq,) = make_sequences(h, 1, num_chunks=2)
    seq.computed = 2 * CHUNK_SIZE
    assert not h.cache.save([seq.request()])
    assert h.counters()["updates_submitted"] == 0
    assert h.cache.pool is not None and h.cache.pool.num_in_flight == 0


def test_save_told_not_to_take_a_buffer_skips_and_resumes(make_cache: CacheFactory):
    """Tensor-parallel peers skip together: a rank with a free buffer still
    skips when told to, and saves the same chunks on a later call."""
    h = make_cache()
    (seq,) = make_sequences(h, 1, num_chunks=2)
    seq.computed = 2 * CHUNK_SIZE
    assert h.cache.can_save()
    assert not h.cache.save([seq.request()], may_take_buffer=False)
    assert h.counters()["updates_skipped"] == 1
    assert h.cache.pool is not None and h.cache.pool.num_in_flight == 0
    assert h.cache.save([seq.request()])
    h.wait()
    assert cached_tokens(h, seq) == 2 * CHUNK_SIZE
