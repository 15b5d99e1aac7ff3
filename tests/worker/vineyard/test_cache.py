# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Round trips through the real vineyard file backend: paged KV gathered,
written, looked up and loaded into other blocks, bit for bit; prefix rules,
local hits, short loads and namespaces."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tests.vineyard_testing import wait_until
from tests.worker.vineyard_cache_testing import (
    BLOCK_SIZE,
    CHUNK_SIZE,
    MAX_NUM_BATCHED_TOKENS,
    CacheFactory,
    CacheHarness,
    chunk_files,
    kill_process,
    make_tokens,
    same_bits,
    stop_process,
)

# A sequence of five whole chunks and a partial one.
SEQ_CHUNKS = 5
SEQ_LEN = SEQ_CHUNKS * CHUNK_SIZE + 7
CACHED = SEQ_CHUNKS * CHUNK_SIZE
SRC_BLOCK = 0  # the request's own blocks start here
DST_BLOCK = 40  # another request's blocks, loaded into


@pytest.mark.parametrize("cache", ["small_cache", "small_cache_bf16"])
def test_round_trip_is_bit_identical(request: pytest.FixtureRequest, cache: str):
    h: CacheHarness = request.getfixturevalue(cache)
    tokens = make_tokens(SEQ_LEN)
    files_before = len(chunk_files(h.namespace_dir))
    src = h.save_tokens(tokens, SRC_BLOCK)
    counters = h.counters()
    assert counters["tokens_written"] == CACHED  # the partial chunk is not saved
    assert counters["tokens_rejected"] == counters["updates_failed"] == 0
    # The buffer holds 4 chunks: two tasks.
    assert counters["updates_completed"] == 2
    assert len(chunk_files(h.namespace_dir)) - files_before == SEQ_CHUNKS

    assert h.lookup(tokens, 0) == (CACHED, CACHED)
    dst = h.blocks_for(DST_BLOCK, SEQ_LEN)
    n = CACHED // h.block_size
    before = h.kv.clone()
    assert not same_bits(before[:, dst[:n]], before[:, src[:n]])  # can fail
    assert h.load(tokens, 0, CACHED, dst) == CACHED
    h.check_loaded(before, src[:n], dst[:n])
    counters = h.counters()
    assert counters["loaded_tokens"] == CACHED
    assert counters["load_errors"] == 0


@pytest.mark.parametrize("start", [16, CHUNK_SIZE, 48, 2 * CHUNK_SIZE, 144])
def test_load_from_a_block_boundary(small_cache_bf16: CacheHarness, start: int):
    """A request with a local hit (whole blocks, maybe mid-chunk) loads only
    the blocks after it, and never writes the blocks of the local hit
    (maybe shared with other requests)."""
    h = small_cache_bf16
    tokens = make_tokens(SEQ_LEN)
    src = h.save_tokens(tokens, SRC_BLOCK)
    dst = h.blocks_for(DST_BLOCK, SEQ_LEN)
    first, n = start // h.block_size, CACHED // h.block_size
    before = h.kv.clone()
    assert h.load(tokens, start, CACHED, dst) == CACHED
    h.check_loaded(before, src[first:n], dst[first:n])
    counters = h.counters()
    assert counters["loaded_tokens"] == CACHED - start
    assert counters["load_errors"] == 0


@pytest.mark.parametrize(
    "diverge_at",
    [0, 5, CHUNK_SIZE, 2 * CHUNK_SIZE + 10, 3 * CHUNK_SIZE - 1, 4 * CHUNK_SIZE],
)
def test_lookup_stops_where_the_prefix_diverges(
    small_cache: CacheHarness, diverge_at: int
):
    h = small_cache
    tokens = make_tokens(SEQ_LEN)
    src = h.save_tokens(tokens, SRC_BLOCK)
    other = list(tokens)
    other[diverge_at] = (other[diverge_at] + 1) % 32000
    common = diverge_at // CHUNK_SIZE * CHUNK_SIZE  # whole common chunks
    assert h.lookup(other, 0) == (common, common)
    assert h.counters()["hit_tokens"] == common
    # Loading it gives exactly the common chunks, nothing of the rest.
    dst = h.blocks_for(DST_BLOCK, SEQ_LEN)
    before = h.kv.clone()
    n = common // h.block_size
    assert h.load(other, 0, common, dst) == common
    h.check_loaded(before, src[:n], dst[:n])
    assert h.counters()["load_errors"] == 0


@pytest.mark.parametrize(
    ("num_local", "expected"),
    [
        (0, (CACHED, CACHED)),
        (CHUNK_SIZE, (CACHED - CHUNK_SIZE, CACHED)),
        (CHUNK_SIZE + 16, (CACHED - CHUNK_SIZE - 16, CACHED)),  # mid-chunk
        (3 * CHUNK_SIZE, (CACHED - 3 * CHUNK_SIZE, CACHED)),
        (CACHED, (0, CACHED)),  # vLLM has it all
        (SEQ_LEN - 1, (0, CACHED)),
    ],
)
def test_lookup_returns_only_tokens_beyond_the_local_hit(
    small_cache: CacheHarness, num_local: int, expected: tuple[int, int]
):
    h = small_cache
    tokens = make_tokens(SEQ_LEN)
    h.save_tokens(tokens, SRC_BLOCK)
    assert h.lookup(tokens, num_local) == expected
    counters = h.counters()
    assert counters["hit_tokens"] == expected[0]
    assert counters["query_tokens"] == max(0, CACHED - num_local)


def test_lookup_of_a_local_hit_that_vineyard_lacks_saves_from_its_end(
    small_cache: CacheHarness,
):
    """``save_from`` is the end of what vineyard holds, also when vLLM's
    local hit reaches further: the chunks vineyard lacks are saved."""
    h = small_cache
    tokens = make_tokens(SEQ_LEN)
    h.save_tokens(tokens, SRC_BLOCK, num_computed=2 * CHUNK_SIZE)  # two chunks only
    assert h.lookup(tokens, 2 * CHUNK_SIZE) == (0, 2 * CHUNK_SIZE)
    assert h.lookup(tokens, 3 * CHUNK_SIZE) == (0, 2 * CHUNK_SIZE)
    assert h.lookup(tokens, 0) == (2 * CHUNK_SIZE, 2 * CHUNK_SIZE)


def test_lookup_leaves_one_token_to_compute(small_cache: CacheHarness):
    """A prompt that ends at a chunk's end hits all but its last block: the
    last chunk is used in part (one block plus the required token is
    recomputed, not a whole chunk)."""
    h = small_cache
    assert h.block_size < CHUNK_SIZE  # the last chunk is split
    tokens = make_tokens(CACHED)  # exactly whole chunks
    h.save_tokens(tokens, SRC_BLOCK, num_computed=CACHED)
    assert h.counters()["tokens_written"] == CACHED
    assert h.lookup(tokens, 0) == (CACHED - h.block_size, CACHED)
    assert h.lookup(tokens + [7], 0) == (CACHED, CACHED)
    # A shorter prompt of the same prefix finds a chunk only if it holds
    # all of the chunk's blocks (a chunk is named by all their ids): with
    # chunks of several blocks (not the default) one that ends inside a
    # chunk hits to the chunk boundary before it.
    for length in range(h.block_size + 1, CACHED, 5):
        want = (length - 1) // h.block_size * h.block_size
        found = length // CHUNK_SIZE * CHUNK_SIZE
        assert h.lookup(tokens[:length], 0)[0] == min(want, found), length


def test_one_block_chunks_hit_every_length_to_the_block(make_cache: CacheFactory):
    """With the default chunk of one block, every prompt of a cached
    sequence, short ones included, hits all its complete blocks before
    the token vLLM must compute, and loads them."""
    h = make_cache(chunk_size=BLOCK_SIZE)
    bs = h.block_size
    tokens = make_tokens(SEQ_LEN)
    src = h.save_tokens(tokens, SRC_BLOCK)
    assert h.counters()["tokens_written"] == SEQ_LEN // bs * bs
    for length in range(1, SEQ_LEN + 1):
        want = (length - 1) // bs * bs
        assert h.lookup(tokens[:length], 0) == (want, want), length
    length = 3 * bs + 5  # shorter than some chunks of other designs
    dst = h.blocks_for(DST_BLOCK, length)
    before = h.kv.clone()
    assert h.load(tokens[:length], 0, 3 * bs, dst) == 3 * bs
    h.check_loaded(before, src[:3], dst[:3])


@pytest.mark.parametrize("blocks", [1, 3, 9])
def test_load_of_part_of_a_chunk(small_cache: CacheHarness, blocks: int):
    """A load that ends inside a chunk reads the whole chunk but writes only
    the blocks asked for: the block after the hit is not the request's to
    fill yet (vLLM computes it)."""
    h = small_cache
    bs = h.block_size
    tokens = make_tokens(CACHED)
    src = h.save_tokens(tokens, SRC_BLOCK, num_computed=CACHED)
    assert blocks % h.layout.blocks_per_chunk  # ends inside a chunk
    dst = h.blocks_for(DST_BLOCK, CACHED)
    before = h.kv.clone()
    end = blocks * bs
    assert h.load(tokens, 0, end, dst) == end
    h.check_loaded(before, src[:blocks], dst[:blocks])
    assert h.counters()["loaded_tokens"] == end


def test_lookup_of_a_longer_sequence_than_one_buffer(small_cache: CacheHarness):
    """Lookups and loads longer than the read buffer go segment by segment."""
    h = small_cache
    length = 4 * MAX_NUM_BATCHED_TOKENS + 1
    tokens = make_tokens(length)
    src = h.blocks_for(0, length)
    h.save_all([h.request("long", tokens, length, src)])
    assert h.counters()["updates_completed"] == 4
    total = length - 1
    assert h.lookup(tokens, 0) == (total, total)
    dst = h.blocks_for(80, length)
    before = h.kv.clone()
    n = total // h.block_size
    assert h.load(tokens, 0, total, dst) == total
    h.check_loaded(before, src[:n], dst[:n])


def test_two_readers_read_a_loads_segments_at_once_and_copy_them_in_order(
    make_cache: CacheFactory,
):
    """With two readers a long load's first two segments are read at once;
    when the second one's answer comes first (the first reader stalled),
    nothing is copied until the first one's: blocks go into place in
    order, and the load is bit-exact. A dead reader's read goes to the
    other one: the next load is whole."""
    h = make_cache(readers=2)
    length = 4 * MAX_NUM_BATCHED_TOKENS + 1
    tokens = make_tokens(length)
    src = h.blocks_for(0, length)
    h.save_all([h.request("long", tokens, length, src)])
    total = length - 1
    n = total // h.block_size
    assert h.reads_at_once(0, total) == 2
    dst = h.blocks_for(80, length)
    before = h.kv.clone()
    loads = h.cache.loads
    # Both readers stopped while the reads are sent, so neither answers
    # before the check; then only the second one goes on.
    stop_process(h.pid("read"))
    stop_process(h.pid("read1"))
    try:
        loads.start("r", h.digests(tokens), 0, total, dst)
        loads.poll()
        first, second = loads._in_flight
        assert first.reader is not second.reader
        assert (first.segment, second.segment) == (0, 1)
        os.kill(h.pid("read1"), signal.SIGCONT)
        assert wait_until(second.reader.ready)  # the second read is answered
        loads.poll()
        assert loads._jobs["r"].loaded == 0  # waits for the first
        assert same_bits(h.kv, before)
    finally:
        os.kill(h.pid("read"), signal.SIGCONT)
        os.kill(h.pid("read1"), signal.SIGCONT)
    loads.poll(wait=True)
    assert loads.take_finished() == [("r", total, total)]
    h.check_loaded(before, src[:n], dst[:n])

    kill_process(h.pid("read"))
    before = h.kv.clone()
    assert h.load(tokens, 0, total, dst) == total
    h.check_loaded(before, src[:n], dst[:n])
    assert h.counters()["load_errors"] == 0


@pytest.mark.parametrize("saved_chunks", [0, 2, 4])
def test_short_load_returns_the_shorter_end_and_counts_an_error(
    small_cache: CacheHarness, saved_chunks: int
):
    h = small_cache
    tokens = make_tokens(SEQ_LEN)
    saved = saved_chunks * CHUNK_SIZE
    src = h.save_tokens(tokens, SRC_BLOCK, num_computed=saved)
    dst = h.blocks_for(DST_BLOCK, SEQ_LEN)
    before = h.kv.clone()
    # Promised (e.g. by a lookup that raced an eviction): all five chunks.
    assert h.load(tokens, 0, CACHED, dst) == saved
    n = saved // h.block_size
    h.check_loaded(before, src[:n], dst[:n])
    counters = h.counters()
    assert counters["load_errors"] == 1
    assert counters["loaded_tokens"] == saved


@pytest.mark.parametrize(
    "differs",
    [
        {"model": "another-model"},
        {"dtype": torch.bfloat16},
        {"block_size": 32, "num_blocks": 80},
        {"kv_layout": "FLASH_ATTN"},
        {"chunk_size": 2 * CHUNK_SIZE},
    ],
    ids=["model", "dtype", "block_size", "kv_layout", "chunk_size"],
)
def test_namespaces_do_not_see_each_other(
    small_cache: CacheHarness, make_cache: CacheFactory, differs: dict[str, object]
):
    """Two layouts on the same root never share chunks."""
    first = small_cache
    other = make_cache(root=Path(first.config.root), seed=2, **differs)
    assert first.namespace_dir != other.namespace_dir

    tokens = make_tokens(SEQ_LEN)
    src = first.save_tokens(tokens, SRC_BLOCK)
    assert other.lookup(tokens, 0) == (0, 0)

    assert other.load(tokens, 0, CACHED, other.blocks_for(0, SEQ_LEN)) == 0

    # The other namespace writes the same tokens; each reads its own bytes.
    other.save_tokens(tokens, SRC_BLOCK)
    other_cached = SEQ_LEN // other.chunk_size * other.chunk_size
    assert other.counters()["tokens_written"] == other_cached
    assert other.lookup(tokens, 0) == (other_cached, other_cached)
    n = CACHED // first.block_size
    dst = first.blocks_for(DST_BLOCK, SEQ_LEN)
    before = first.kv.clone()
    assert first.load(tokens, 0, CACHED, dst) == CACHED
    first.check_loaded(before, src[:n], dst[:n])
    assert first.counters()["tokens_rejected"] == 0


def test_same_layout_on_the_same_root_shares_chunks(
    small_cache: CacheHarness, make_cache: CacheFactory
):
    """Another instance of the same model (same layout, same root) loads what
    this one saved: the namespace is deterministic."""
    twin = make_cache(root=Path(small_cache.config.root), seed=5)
    assert twin.namespace_dir == small_cache.namespace_dir
    tokens = make_tokens(SEQ_LEN)
    src = small_cache.save_tokens(tokens, SRC_BLOCK)
    assert twin.lookup(tokens, 0) == (CACHED, CACHED)
    dst = twin.blocks_for(DST_BLOCK, SEQ_LEN)
    assert twin.load(tokens, 0, CACHED, dst) == CACHED
    n = CACHED // twin.block_size
    assert same_bits(twin.kv[:, dst[:n]], small_cache.kv[:, src[:n]])


def test_a_truncated_chunk_is_removed_by_the_lookup_and_written_again(
    make_cache: CacheFactory,
) -> None:
    """A chunk file cut short on disk is neither vineyard's placeholder nor
    a whole chunk: the lookup that stops there removes it (counted as a
    corrupt chunk), so the next save writes it again (vineyard keeps any
    file it finds at a chunk's path) and the prefix hits again."""
    h = make_cache()
    tokens = make_tokens(SEQ_LEN)
    h.save_tokens(tokens, SRC_BLOCK)
    assert h.lookup(tokens) == (CACHED, CACHED)
    by_size = sorted(chunk_files(h.namespace_dir), key=os.path.getsize)
    truncated = by_size[2]
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) // 2)

    assert h.lookup(tokens) == (2 * CHUNK_SIZE, 2 * CHUNK_SIZE)
    assert not os.path.exists(truncated)
    assert h.counters()["corrupt_chunks"] == 1
    h.save_tokens(tokens, SRC_BLOCK)
    assert os.path.exists(truncated)
    assert h.lookup(tokens) == (CACHED, CACHED)
    assert h.counters()["corrupt_chunks"] == 1
