# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Read-ahead of a queued request's hit, on real readers: read into read
buffers of its own budget while the request waits, copied at once when its
load starts, and every buffer free again when the request is aborted or
the cache reset."""

from __future__ import annotations

import time

import pytest

from tests.vineyard_testing import wait_until
from tests.worker.vineyard_cache_testing import (
    CHUNK_SIZE,
    CacheFactory,
    CacheHarness,
    make_tokens,
    same_bits,
)
from vllm.worker.vineyard.config import READ_AHEAD_BUFFERS_MAX
from vllm.worker.vineyard.transfer import read_ahead
from vllm.worker.vineyard.transfer.loads import LoadPipeline

pytestmark = pytest.mark.timeout(180)

DST_BLOCK = 80
BUDGET = 3  # read-ahead buffers: fewer than the hit's segments below


def read_ahead_held(loads: LoadPipeline) -> int:
    """Read buffers a read-ahead holds: answered, or read into now."""
    in_flight = sum(read.count for read in loads._in_flight if read.job.ahead)
    return in_flight + sum(len(j.answers) for j in loads._ahead.jobs.values())


def read_ahead_until_settled(
    h: CacheHarness, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, tuple[int, int]], list[int]]:
    """Poll as a worker does each step until no read is in flight: the
    read-ahead progress reported meanwhile (the last per request), and the
    segments each read ahead took, as sent."""
    loads, news, sizes = h.cache.loads, {}, []
    send = loads._send

    def recorded_send(job, idle, first=-1, count=1):
        if job.ahead:
            sizes.append(count)
        return send(job, idle, first, count)

    monkeypatch.setattr(loads, "_send", recorded_send)
    for _ in range(500):
        loads.poll()
        news.update(loads.take_read_ahead())
        assert read_ahead_held(loads) <= BUDGET
        if not loads._in_flight:
            return news, sizes
        time.sleep(0.01)
    raise AssertionError("read-ahead did not settle")


@pytest.fixture
def saved(
    make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> tuple[CacheHarness, list[int], list[int]]:
    """A cache whose segments are one chunk each, with a five-chunk
    sequence saved: the harness, its tokens, its source blocks. The budget
    is the setting's (no floor in bytes), fewer buffers than segments."""
    monkeypatch.setattr(read_ahead, "MIN_BYTES", 0)
    h = make_cache(readers=2, read_ahead_buffers=BUDGET)
    assert h.cache.loads._segment_blocks == CHUNK_SIZE // h.block_size
    tokens = make_tokens(5 * CHUNK_SIZE + 1)
    src = h.save_tokens(tokens, 0)
    h.reset_counters()
    return h, tokens, src


@pytest.mark.parametrize("local_chunks", [0, 1])
def test_a_load_read_ahead_has_its_blocks_when_it_starts(
    saved: tuple[CacheHarness, list[int], list[int]],
    local_chunks: int,
    monkeypatch: pytest.MonkeyPatch,
):
    """While queued, the first chunks of the hit are read within the
    budget and nothing is copied (once the first read is timed, a read
    fills several buffers back to back); once its load starts (from vLLM's
    local hit, maybe further on), they are copied at once, the rest is
    read as usual, and the blocks are bit-exact."""
    h, tokens, src = saved
    # However long the first read took on a busy machine, the rest of the
    # budget fits in one read's time.
    monkeypatch.setattr(read_ahead, "READ_S", 600.0)
    loads, total = h.cache.loads, 5 * CHUNK_SIZE
    digests = h.digests(tokens)
    dst = h.blocks_for(DST_BLOCK, total)
    before = h.kv.clone()
    loads.read_ahead("q", digests, 0, total)
    news, sizes = read_ahead_until_settled(h, monkeypatch)
    assert news == {"q": (0, BUDGET * CHUNK_SIZE)}  # the budget's worth
    assert sizes == [1, BUDGET - 1]  # the first read alone, then the rest at once
    assert same_bits(h.kv, before)  # nothing copied while queued
    assert len(loads._free_buffers) == h.cache.num_readers + 1

    start = local_chunks * CHUNK_SIZE
    loads.start("q", digests, start, total, dst)
    # Copied as the load starts, before any poll.
    assert loads._jobs["q"].loaded * h.block_size == BUDGET * CHUNK_SIZE
    loads.poll(wait=True)
    assert loads.take_finished() == [("q", total, total)]
    first = start // h.block_size
    h.check_loaded(before, src[first : total // h.block_size], dst[first:])
    counters = h.counters()
    assert counters["read_ahead_tokens"] == (BUDGET - local_chunks) * CHUNK_SIZE
    assert counters["read_ahead_unused_tokens"] == 0
    assert counters["load_errors"] == 0
    assert len(loads._free_buffers) == loads._buffers.memory.count
    assert loads.take_read_ahead() == {"q": (0, 0)}  # the scheduler forgets it


@pytest.mark.parametrize("end", ["abort", "scheduled without a load", "reset"])
def test_a_read_ahead_never_used_frees_every_buffer(
    saved: tuple[CacheHarness, list[int], list[int]], end: str
):
    """An aborted request, one scheduled without a load (computed) and a
    reset leave no read buffer held, and reads in flight land nowhere."""
    h, tokens, _ = saved
    loads = h.cache.loads
    loads.read_ahead("q", h.digests(tokens), 0, 5 * CHUNK_SIZE)

    def answered() -> bool:
        loads.poll()
        return any(job.answers for job in loads._ahead.jobs.values())

    assert wait_until(answered)
    before = h.kv.clone()
    if end == "abort":
        loads.cancel("q")
    elif end == "reset":
        loads.fence()
    else:
        loads.drop_read_ahead("q")

    def settled() -> bool:
        loads.poll()
        return not loads._in_flight

    assert wait_until(settled)
    assert len(loads._free_buffers) == loads._buffers.memory.count
    assert not loads._ahead.jobs
    assert same_bits(h.kv, before)
    assert loads.take_finished() == []  # no load was promised
    assert loads.take_read_ahead() in ({}, {"q": (0, 0)})
    if end != "reset":
        assert h.counters()["read_ahead_unused_tokens"] > 0


def test_a_read_ahead_of_other_chunks_is_dropped_and_the_load_is_whole(
    saved: tuple[CacheHarness, list[int], list[int]],
    monkeypatch: pytest.MonkeyPatch,
):
    """A load that starts before the read-ahead's first chunk (vLLM's
    local hit was evicted meanwhile) reads everything itself; and real
    loads go first: a load started while a read-ahead runs is whole."""
    h, tokens, src = saved
    loads, total = h.cache.loads, 5 * CHUNK_SIZE
    digests = h.digests(tokens)
    loads.read_ahead("q", digests, 2 * CHUNK_SIZE, total)
    loads.poll()
    dst = h.blocks_for(DST_BLOCK, total)
    before = h.kv.clone()
    assert h.load(tokens, 0, total, dst) == total
    h.check_loaded(before, src[: total // h.block_size], dst)

    read_ahead_until_settled(h, monkeypatch)
    before = h.kv.clone()
    loads.start("q", digests, 0, total, dst)
    loads.poll(wait=True)
    assert loads.take_finished() == [("q", total, total)]
    h.check_loaded(before, src[: total // h.block_size], dst)
    assert h.counters()["read_ahead_unused_tokens"] > 0
    assert len(loads._free_buffers) == loads._buffers.memory.count


@pytest.mark.parametrize(
    "setting,buffer_bytes,expected",
    [
        (0, 1 << 10, 0),  # off stays off
        (4, 1 << 20, 16),  # small buffers: as many as make the floor
        (4, 3 << 20, 6),  # rounded up
        (4, 8 << 20, 4),  # large buffers: the setting's count
        (20, 1 << 20, 20),  # never fewer than the setting
        (4, 1 << 10, READ_AHEAD_BUFFERS_MAX),  # never more than the most
    ],
)
def test_read_ahead_holds_at_least_the_floor_in_bytes(
    setting: int, buffer_bytes: int, expected: int
):
    assert read_ahead.MIN_BYTES == 16 << 20
    assert read_ahead.read_ahead_buffers(setting, buffer_bytes) == expected


def test_a_small_models_cache_reads_ahead_the_floor(make_cache: CacheFactory):
    """The default setting on a model whose quarter-step buffers are
    small: the cache has the floor's worth of read-ahead buffers."""
    h = make_cache(readers=1)
    memory, budget = h.cache._read_buffers.memory, h.cache.loads._ahead.budget
    assert memory.buffer_bytes * 4 < read_ahead.MIN_BYTES  # small, as assumed
    assert budget == read_ahead.read_ahead_buffers(4, memory.buffer_bytes) > 4
    assert memory.count == h.cache.num_readers + 1 + budget
