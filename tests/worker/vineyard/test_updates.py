# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Asynchronous updates through the real backend: issue order under a burst,
skipping (never blocking) when the pool is saturated and resuming later,
draining at shutdown, and a bounded shutdown that leaks nothing when the
backend is stalled (stopped by pid with SIGSTOP: the product has no test
hooks)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from tests.vineyard_testing import wait_until
from tests.worker.vineyard_cache_testing import (
    CHUNK_SIZE,
    LARGE_CACHE,
    LARGE_STEP_TOKENS,
    CacheFactory,
    CacheHarness,
    chunk_files,
    make_tokens,
    pid_exists,
    stop_process,
)
from vllm.worker.vineyard.backend.client import BackendProcess
from vllm.worker.vineyard.backend.protocol import (
    BackendError,
    Request,
    StatsRequest,
    UpdateRequest,
)
from vllm.worker.vineyard.connector.lookups import VineyardCacheLookup
from vllm.worker.vineyard.storage.digests import extend_digests
from vllm.worker.vineyard.transfer.backends import BackendCalls
from vllm.worker.vineyard.transfer.saves import SaveRequest

T = TypeVar("T")


@dataclass
class Sequence:
    """A running request: its prompt, its blocks, its progress."""

    req_id: str
    tokens: list[int]
    blocks: list[int]
    digests: list[bytes]
    computed: int = 0

    def request(self) -> SaveRequest:
        return SaveRequest(self.req_id, self.digests, self.computed, self.blocks)


def make_sequences(
    h: CacheHarness, count: int, num_chunks: int, extra_tokens: int = 1
) -> list[Sequence]:
    """``count`` sequences of ``num_chunks`` whole chunks plus a few tokens,
    each in its own blocks."""
    length = num_chunks * h.chunk_size + extra_tokens
    blocks_each = -(-length // h.block_size)
    assert count * blocks_each <= h.kv.shape[1]
    seqs = []
    for i in range(count):
        tokens = make_tokens(length)
        blocks = h.blocks_for(i * blocks_each, length)
        seqs.append(Sequence(f"seq{i}", tokens, blocks, h.digests(tokens)))
    return seqs


def cached_tokens(h: CacheHarness, seq: Sequence) -> int:
    return h.lookup(seq.tokens)[0]


def whole_chunks(seq: Sequence, chunk: int) -> int:
    return (len(seq.tokens) - 1) // chunk * chunk


def test_burst_from_several_sequences_keeps_issue_order(make_cache: CacheFactory):
    """Four sequences advance by uneven (chunked prefill) steps and save after
    every step; several tasks of each are queued at once. Vineyard refuses a
    chunk whose prefix is not cached yet, so any reordering shows up as
    rejected tokens and missing chunks."""
    h = make_cache(max_inflight_tasks=4)
    cache = h.cache
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
        assert cached_tokens(h, s) == cache._resume[s.req_id][1]
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
    assert len(chunk_files(h.namespace_dir)) == 4 * full // CHUNK_SIZE


def call_with_deadline(fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn`` in a thread; fail if it has not returned within
    ``timeout_s`` (generous: this proves it does not block, not that it is
    fast)."""
    results: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"blocked for more than {timeout_s} s"
    if errors:
        raise errors[0]
    return results[0]


@pytest.mark.parametrize("slow", ["stalled-backend", "large-kv"])
def test_saturation_skips_without_blocking_and_resumes_later(
    make_cache: CacheFactory, slow: str
):
    """With one buffer and a write that does not finish (the writer is
    stopped, before the write or in the middle of a 32 MiB one), save()
    skips (and counts) instead of waiting; the resume point saves the
    skipped chunks with a later save().

    "Does not wait" is proved without timing: the saves run while the
    writer is stopped and the backend timeout is long, so a save that
    waited for the write would not return within the (generous) deadline.
    """
    timeout_s = 120.0  # the backend's: far beyond the deadline below
    if slow == "large-kv":
        h = make_cache(
            **LARGE_CACHE,
            num_blocks=4 * LARGE_STEP_TOKENS // 16 + 8,
            max_inflight_tasks=1,
            metrics_enabled=True,
            backend_timeout_s=timeout_s,
        )
        # Each step completes one chunk of each of four sequences: a full
        # buffer (32 MiB) per step.
        seqs = make_sequences(h, 4, num_chunks=4)
    else:
        h = make_cache(
            max_inflight_tasks=1, metrics_enabled=True, backend_timeout_s=timeout_s
        )
        seqs = make_sequences(h, 4, num_chunks=6)
    cache = h.cache
    writer = cache._writer
    assert writer is not None
    pid = h.pid("write")
    if slow == "stalled-backend":
        stop_process(pid)
    steps = len(seqs[0].tokens) // h.chunk_size

    def step() -> bool:
        for s in seqs:
            s.computed += h.chunk_size
        return cache.save([s.request() for s in seqs])

    assert call_with_deadline(step, 30.0)  # takes the only buffer
    if slow == "large-kv":
        # Stop the writer once it has the update (mid-write, or about to).
        assert wait_until(lambda: writer._in_flight == "update")
        stop_process(pid)
    for _ in range(steps - 1):
        assert not call_with_deadline(step, 30.0)
    assert cache.pool.num_in_flight == 1
    counters = h.counters()
    assert counters["updates_submitted"] == 1
    assert counters["updates_skipped"] == steps - 1
    assert counters["updates_completed"] == 0  # the write is still stuck
    os.kill(pid, signal.SIGCONT)
    h.wait()
    assert len(cache.metrics.take()["update_exec_s"]) == 1
    assert h.counters()["updates_completed"] == 1

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
    # Written when save() returns: no waiting here.
    assert cache.pool.num_in_flight == 0
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
    # Another instance's scheduler (a lookup of the same namespace) finds
    # all of it.
    lookups = VineyardCacheLookup(h.config, [h.layout])
    for s in seqs:
        digests = extend_digests([], s.tokens, h.block_size)
        assert lookups.lookup(digests, 0, len(s.tokens)) == (4 * CHUNK_SIZE,) * 2


@pytest.mark.parametrize("stall", ["stopped", "stopped-with-a-call-in-flight"])
def test_shutdown_with_a_stalled_backend_is_bounded_and_leaks_nothing(
    make_cache: CacheFactory, stall: str
):
    """close() with the writer stopped (SIGSTOP) and every buffer in
    flight: bounded by the drain timeout, not the (long) backend timeout;
    buffers, the updater thread and both processes are gone. With a call
    of another thread in flight (holding the backend's lock while it waits
    for the answer), close() must not wait for that call either."""
    drain_s = 0.5
    h = make_cache(
        max_inflight_tasks=4, drain_timeout_s=drain_s, backend_timeout_s=30.0
    )
    cache = h.cache
    reader, writer = cache._readers[0], cache._writer
    pool, updater = cache.pool, cache._updater
    assert reader is not None and writer is not None and updater is not None
    procs = [p for p in (reader._proc, writer._proc) if p is not None]
    assert len(procs) == 2
    stop_process(h.pid("write"))

    caller_errors: list[Exception] = []
    caller = threading.Thread(
        target=lambda: _call_stats(cache._calls, writer, caller_errors), daemon=True
    )
    if stall == "stopped-with-a-call-in-flight":
        caller.start()
        assert wait_until(lambda: writer._in_flight == "stats")

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
    # Far below the 30 s backend timeout that an unbounded close would wait.
    assert elapsed < drain_s + 10.0, f"close() took {elapsed:.1f} s"

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
    if stall == "stopped-with-a-call-in-flight":
        caller.join(5.0)
        assert not caller.is_alive()
        assert len(caller_errors) == 1
    # A load after close is a short load, without an exception.
    assert h.load(seqs[0].tokens, 0, CHUNK_SIZE, seqs[0].blocks) == 0


def _call_stats(
    calls: BackendCalls, writer: BackendProcess, errors: list[Exception]
) -> None:
    """A call that the stopped writer never answers (until it is killed),
    made as the cache makes its stats polls: through its calls, whose lock
    keeps the updater's writes from going out between its send and its
    receive (a direct call let one fail once in CI: "one request at a
    time")."""
    try:
        calls.call(writer, StatsRequest())
    except BackendError as e:
        errors.append(e)


def test_failed_write_is_written_again_from_its_first_chunk(
    make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
):
    h = make_cache(max_inflight_tasks=4)
    cache = h.cache
    assert cache._writer is not None
    (seq,) = make_sequences(h, 1, num_chunks=4)
    real_send = cache._writer.send
    failures = iter([True])

    def fail_once(request: Request[Any]) -> None:
        if isinstance(request, UpdateRequest) and next(failures, False):
            raise BackendError("injected write failure")
        real_send(request)

    monkeypatch.setattr(cache._writer, "send", fail_once)
    seq.computed = 2 * CHUNK_SIZE
    assert cache.save([seq.request()])  # chunks 0-1: the write fails
    h.wait()
    assert h.counters()["updates_failed"] == 1
    assert cached_tokens(h, seq) == 0
    seq.computed = 4 * CHUNK_SIZE
    assert cache.save([seq.request()])  # rewound: chunks 0-3 in one task
    h.wait()
    counters = h.counters()
    assert counters["updates_failed"] == 1 and counters["updates_completed"] == 1
    assert counters["tokens_rejected"] == 0
    assert counters["tokens_written"] == 4 * CHUNK_SIZE
    assert cached_tokens(h, seq) == 4 * CHUNK_SIZE


def test_no_staging_copy_once_the_writer_is_disabled(make_cache: CacheFactory):
    h = make_cache()
    assert h.cache._writer is not None
    h.cache._writer._disabled = ("disabled by the test", time.monotonic())
    assert not h.cache.can_save()
    (seq,) = make_sequences(h, 1, num_chunks=2)
    seq.computed = 2 * CHUNK_SIZE
    assert not h.cache.save([seq.request()])
    assert h.counters()["updates_submitted"] == 0
    assert h.cache.pool.num_in_flight == 0


def test_save_told_not_to_take_a_buffer_skips_and_resumes(make_cache: CacheFactory):
    """Tensor-parallel peers skip together: a rank with a free buffer still
    skips when told to, and saves the same chunks on a later call."""
    h = make_cache()
    (seq,) = make_sequences(h, 1, num_chunks=2)
    seq.computed = 2 * CHUNK_SIZE
    assert h.cache.can_save()
    assert not h.cache.save([seq.request()], may_take_buffer=False)
    assert h.counters()["updates_skipped"] == 1
    assert h.cache.pool.num_in_flight == 0
    assert h.cache.save([seq.request()])
    h.wait()
    assert cached_tokens(h, seq) == 2 * CHUNK_SIZE
