# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The sweeper and a real cache (real vineyard, real backend processes):
what eviction does to a prefix the cache wrote and loads, LRU by real hits,
writes after the root was emptied, and the disk limit at every save, for
one writer and for two sharing the root's usage.

The caches' own periodic sweeps are kept out of the way (an interval of an
hour); the passes their writers ask for run in the background.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.worker.vineyard.storage.sweeper_testing import (
    BUDGET,
    LONG_AGO,
    age,
    bytes_on_disk,
    chunk_paths,
    disk_bytes,
    prefixes,
    set_root,
    settled,
    sweep_now,
)
from tests.worker.vineyard_disk_testing import (
    CHUNK_SIZE,
    Harness,
    chunk_files,
    open_cache,
)
from vllm.worker.vineyard.connector.lookups import VineyardCacheLookup
from vllm.worker.vineyard.storage.namespaces import MANIFEST
from vllm.worker.vineyard.storage.root_files import ROOT_FILES
from vllm.worker.vineyard.storage.sweep_passes import TEMP_MAX_AGE_S

#: Prefixes written while the hot one is in use (24 chunks, the budget 12).
ROUNDS = 6


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Harness]:
    """A real cache whose own sweeper stays out of the way."""
    h = open_cache(tmp_path / "root", sweep_interval_s=3600.0, disk_limit_gb=1000.0)
    yield h
    h.cache.close()


def test_hot_prefix_survives_while_cold_one_is_evicted(cache: Harness) -> None:
    """A budget of 12 chunks; a hot and a cold prefix (4 chunks each),
    written long ago; then 6 rounds each writing a new prefix (written
    later than the last; whole, once the writer's sweeper made room) and
    loading the hot one (a verified hit marks its chunks used), and a
    sweep. The hot prefix is loaded whole every time, however old its
    write; the cold one is evicted first."""
    h = cache
    root = Path(h.cache.config.root)
    hot, cold, *news = prefixes(2 + ROUNDS, seed=1)
    start = time.time() - LONG_AGO
    for tokens in (cold, hot):
        h.write(tokens)
        for p in chunk_paths(h, tokens):
            age(p, start)
    chunk_bytes = disk_bytes(chunk_paths(h, hot)[0])
    s = set_root(str(root), 12 * chunk_bytes + chunk_bytes // 2)
    assert h.load(hot) == 4 * CHUNK_SIZE  # in use before the writes begin
    for r, tokens in enumerate(news[:ROUNDS]):
        h.write_whole(tokens)
        sweep_now(s)
        assert len(chunk_files(root)) <= 12
        # The writer's sweeper sees a chunk written after its last pass and
        # set back before its next as new, used no earlier than that last
        # pass began (see ObservedLastUse): that pass is over before the
        # hot prefix's use, which falls in a later second (LRU's unit).
        settled([h], root)
        time.sleep(1.01 - time.time() % 1)
        # A later write than the last one: set back once the test's
        # sweeper saw it (a last use moved back is believed).
        for p in chunk_paths(h, tokens):
            age(p, start + 100 * (r + 1))
        assert h.load(hot) == 4 * CHUNK_SIZE  # verified and bit-exact
    assert all(os.path.exists(p) for p in chunk_paths(h, hot))
    assert not any(os.path.exists(p) for p in chunk_paths(h, cold))
    assert h.load(cold) == 0
    # The last prefixes written are cached as well.
    assert h.load(news[ROUNDS - 1]) == 4 * CHUNK_SIZE


def test_evicted_early_chunk_cuts_the_prefix(cache: Harness) -> None:
    """Evicting chunk 1 of 4 leaves chunk 2 on disk but unreachable:
    the lookup stops at the gap, a load loads chunk 0 only (verified, and
    counted as a short load), nothing past the gap is read; writing the
    prefix again fills the gap and it loads whole again."""
    h = cache
    (tokens,) = prefixes(1, seed=2)
    h.write(tokens)
    paths = chunk_paths(h, tokens)
    now = time.time()
    for p in paths:
        age(p, now)
    age(paths[1], now - 100)  # the least recently used
    total = sum(disk_bytes(p) for p in paths)
    sweep_now(set_root(h.cache.config.root, total), now)
    # Chunk 1 first (least recently used), then chunk 3 (the tail of the
    # rest): chunk 2 stays on disk behind the gap.
    assert [os.path.exists(p) for p in paths] == [True, False, True, False]

    lookup = VineyardCacheLookup(h.cache.config, [h.cache.layout])
    assert lookup.lookup(h.digests(tokens), 0, len(tokens)) == (32, 32)
    h.reset_counters()
    assert h.load(tokens) == CHUNK_SIZE
    counters = h.counters()
    assert counters["loaded_tokens"] == CHUNK_SIZE
    assert counters["load_errors"] == 1 and counters["corrupt_chunks"] == 0

    set_root(h.cache.config.root, 1 << 40)  # room for the prefix again
    h.write_whole(tokens)


def test_cache_writes_after_the_sweeper_emptied_the_root(cache: Harness) -> None:
    """Everything expired and every empty folder removed, the namespace's
    included: the cache root stays, and vineyard writes into it again (it
    recreates the folders) and loads what it wrote."""
    h = cache
    root = h.cache.config.root
    first, second = prefixes(2, seed=3)
    h.write(first)
    later = time.time() + 10 * TEMP_MAX_AGE_S
    s = set_root(root, 1 << 40, ttl_s=60.0)
    sweep_now(s, later)  # the chunks expire ...
    assert chunk_files(root) == []
    sweep_now(s, later)  # ... and the folders they leave go the next pass
    # Only the namespace's manifest stays (never removed), if it has one,
    # and the sweepers' files.
    namespace_dir = h.files.namespace_dir
    assert os.path.isdir(root)
    left = set(os.listdir(root)) - set(ROOT_FILES)
    assert left in (set(), {os.path.basename(namespace_dir)})
    if os.path.exists(namespace_dir):
        assert os.listdir(namespace_dir) == [MANIFEST]
    h.reset_counters()
    h.write(second)
    counters = h.counters()
    assert counters["write_errors"] == 0 and counters["updates_failed"] == 0
    assert h.load(second) == 4 * CHUNK_SIZE
    assert h.load(first) == 0


def test_budget_holds_between_sweeps(tmp_path: Path) -> None:
    """A 2 MiB budget and periodic sweeps an hour apart: 60 prefixes of 4
    chunks (about 5 MB) written through a real cache. After every save the
    chunk files on disk take at most the budget plus one chunk: a write
    stores only the chunks that fit, and the writer's sweeper makes room in
    the background (asked for past the high-water mark, ahead of need).
    Every chunk written and gone was evicted and counted, every chunk not
    written was skipped for room and counted; nothing failed; a prefix
    written again once there is room loads whole (what goes is the least
    recently used)."""
    root = tmp_path / "root"
    h = open_cache(root, disk_limit_gb=BUDGET / 2**30, sweep_interval_s=3600.0)
    try:
        written = prefixes(60, seed=7)
        largest = peak = 0
        for tokens in written:
            h.write(tokens)
            total, big = bytes_on_disk(root)
            largest, peak = max(largest, big), max(peak, total)
            assert total <= BUDGET + largest, (total, BUDGET, largest)
        assert peak > 0.8 * BUDGET  # it did fill up
        c = settled([h], root)
        assert c["write_errors"] == 0 and c["updates_failed"] == 0
        skipped = c["chunks_skipped_for_room"]
        assert c["tokens_rejected"] == skipped * CHUNK_SIZE
        assert c["evicted_chunks"] == 4 * len(written) - skipped - c["left"] > 0
        h.write_whole(written[-1])
        assert bytes_on_disk(root)[0] <= BUDGET
    finally:
        h.cache.close()


def test_budget_holds_for_two_writers(tmp_path: Path) -> None:
    """Two real caches (two instances) writing in turns to one root under a
    2 MiB budget, with periodic sweeps an hour apart: they share the root's
    usage, so after every save the chunk files take at most the budget plus
    one write per writer, what a background pass's scan may miss (counting
    only its own writes, each would let the root grow to twice the
    budget). A write here is one prefix of 4 chunks (one save holds it)."""
    root = tmp_path / "root"
    caches = [
        open_cache(root, seed=k, disk_limit_gb=BUDGET / 2**30, sweep_interval_s=3600.0)
        for k in range(2)
    ]
    try:
        largest = peak = 0
        for i, tokens in enumerate(prefixes(60, seed=8)):
            caches[i % 2].write(tokens)
            total, big = bytes_on_disk(root)
            largest, peak = max(largest, big), max(peak, total)
            assert total <= BUDGET + 2 * 4 * largest, (total, BUDGET, largest)
        assert peak > 0.8 * BUDGET
        c = settled(caches, root)
        assert c["write_errors"] == 0 and c["updates_failed"] == 0
        skipped = c["chunks_skipped_for_room"]
        assert c["evicted_chunks"] == 4 * 60 - skipped - c["left"] > 0
    finally:
        for h in caches:
            h.cache.close()
