# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a sweeper's pass removes and what it leaves, on files laid out as
vineyard lays them out: LRU eviction by last use, expiry by last use,
orphaned temp files and empty folders, several sweepers at once, what is
not the cache's, old formats, last uses in the future, and a folder
swapped for a link while passes run.

Sweeps are called directly with ``now`` (time passing is simulated by
ageing files with ``os.utime`` or by a later ``now``).
"""

from __future__ import annotations

import logging
import os
import random
import struct
import threading
import time
from pathlib import Path

import pytest

from tests.vineyard_testing import wait_until
from tests.worker.vineyard.storage.sweeper_testing import (
    CHUNK_BYTES,
    LONG_AGO,
    NS,
    age,
    age_tree,
    chunk_path,
    namespace,
    put_file,
    sweeper,
)
from tests.worker.vineyard_disk_testing import chunk_files
from vllm.worker.vineyard.storage import sweep_passes
from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.eviction import HIGH_WATER, LOW_WATER
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.storage.namespaces import MANIFEST, TEMP_DIR, write_manifest
from vllm.worker.vineyard.storage.root_files import SWEEPER_FILES
from vllm.worker.vineyard.storage.sweep_passes import (
    EMPTY_DIR_MIN_AGE_S,
    TEMP_MAX_AGE_S,
)
from vllm.worker.vineyard.storage.sweeper import RootSweeper

PASSES_LOGGER = sweep_passes.__name__


def test_lru_evicts_least_recently_used_down_to_low_water(tmp_path: Path) -> None:
    """Over the high-water mark, the oldest chunks (by last use, across
    namespaces) go first until usage is at most the low-water mark; the
    gauges report what is left."""
    now = time.time()
    paths = [
        put_file(chunk_path(tmp_path, i, namespace(i % 3)), now - 1000 + 10 * i)
        for i in range(20)
    ]
    s = sweeper(tmp_path, limit_chunks=10)
    s.sweep(now)
    kept = [p.exists() for p in paths]
    # 20 chunks over a budget of 10: down to 8.5 -> the 12 oldest go.
    assert kept == [False] * 12 + [True] * 8
    stats = s.take_stats()
    assert stats["evicted_chunks"] == 12
    assert stats["root_chunks"] == 8
    assert stats["root_bytes"] == 8 * CHUNK_BYTES <= LOW_WATER * 10 * CHUNK_BYTES
    # Within the budget (even above the low-water mark): nothing goes.
    put_file(chunk_path(tmp_path, 100), now)
    s.sweep(now)
    assert s.take_stats()["evicted_chunks"] == 0
    assert len(chunk_files(tmp_path)) == 9


def test_same_use_evicts_the_tail_of_a_prefix_first(tmp_path: Path) -> None:
    """Chunks used in the same second (one write, one hit) go longest file
    first: in a namespace the later chunks of a prefix are the longer files
    (they hold more ids), so what is left is still a usable prefix."""
    now = time.time()
    on_disk = 7 * 4096  # every file below takes 7 blocks
    # Written in order within one second: the first chunk is the oldest.
    prefix = [
        put_file(chunk_path(tmp_path, i), int(now) - 5 + 0.1 * i, 24584 + 8 * i)
        for i in range(4)
    ]
    for i in range(20):  # used later
        put_file(chunk_path(tmp_path, 100 + i), now, 24600)
    # 24 chunks over a budget of 25: down to 21.25, three go.
    RootSweeper(str(tmp_path), 25 * on_disk, 0.0, 3600.0).sweep(now)
    assert [p.exists() for p in prefix] == [True, False, False, False]
    assert len(chunk_files(tmp_path)) == 21


def test_small_budget_keeps_room_for_a_chunk(tmp_path: Path) -> None:
    """When 5% of the budget is less than a chunk (a small filesystem, big
    chunks) the marks still leave room for one chunk (high) and two (low):
    otherwise a full disk could stay just too full for the next write."""
    now = time.time()
    for i in range(3):
        put_file(chunk_path(tmp_path, i), now - 10 + i)
    s = sweeper(tmp_path, limit_chunks=3.5)  # 3 chunks are 86%: no margin
    s.sweep(now)
    assert len(chunk_files(tmp_path)) == 1
    assert s.take_stats()["evicted_chunks"] == 2


@pytest.mark.parametrize("ttl_s", [0.0, 600.0])
def test_expiry_counts_from_last_use(tmp_path: Path, ttl_s: float) -> None:
    """A chunk expires ``ttl`` after its last use whoever wrote it; one used
    recently stays however old it is; ``ttl = 0`` never expires."""
    now = time.time()
    used = put_file(chunk_path(tmp_path, 1), now - LONG_AGO)
    unused = put_file(chunk_path(tmp_path, 2), now - LONG_AGO)
    age(used, now - 10)  # a hit, long after the write
    s = sweeper(tmp_path, ttl_s=ttl_s)
    s.sweep(now)
    assert used.exists()
    assert unused.exists() == (ttl_s == 0)
    assert s.take_stats()["expired_chunks"] == (0 if ttl_s == 0 else 1)
    s.sweep(now + 1e9)  # far in the future: with ttl 0 still nothing
    assert used.exists() == (ttl_s == 0)


def test_temp_leftovers_and_placeholders(tmp_path: Path) -> None:
    """Temp files older than the bound (a writer that died mid-write) and
    old empty placeholders at chunk paths are removed; young ones are live
    writes and stay. Nothing in ``__temp`` counts as a chunk."""
    now = time.time()
    temp = tmp_path / NS / TEMP_DIR / "pod-1"
    old_temp = put_file(temp / "11-1" / "aa" / "bb" / "cc", now - TEMP_MAX_AGE_S - 5)
    young_temp = put_file(temp / "11-2" / "aa" / "bb" / "dd", now - 5)
    old_empty = put_file(chunk_path(tmp_path, 1), now - TEMP_MAX_AGE_S - 5, 0)
    young_empty = put_file(chunk_path(tmp_path, 2), now - 5, 0)
    chunk = put_file(chunk_path(tmp_path, 3), now - LONG_AGO)
    s = sweeper(tmp_path, limit_chunks=10)  # the one chunk fits
    s.sweep(now)
    assert not old_temp.exists() and not old_empty.exists()
    assert young_temp.exists() and young_empty.exists() and chunk.exists()
    stats = s.take_stats()
    assert stats["orphans_removed"] >= 2
    assert stats["root_chunks"] == 1 and stats["evicted_chunks"] == 0


def test_empty_directories(tmp_path: Path) -> None:
    """Empty folder trees older than the bound go in one sweep (vineyard
    leaves one per write under ``__temp``); young ones and folders that
    hold anything stay; the root itself always stays."""
    now = time.time()
    old_tree = tmp_path / NS / TEMP_DIR / "pod-1" / "11-1" / "aa" / "bb"
    young_tree = tmp_path / NS / TEMP_DIR / "pod-1" / "11-2" / "aa" / "bb"
    other_ns = tmp_path / namespace(1) / "aa" / "bb" / "cc"
    for d in (old_tree, young_tree, other_ns):
        d.mkdir(parents=True)
    chunk = put_file(chunk_path(tmp_path, 7), now)
    age_tree(tmp_path, now - 2 * EMPTY_DIR_MIN_AGE_S)
    age(chunk, now)
    age(young_tree, now - 1)
    young_parent = young_tree.parent
    age(young_parent, now - 1)
    s = sweeper(tmp_path)
    s.sweep(now)
    assert not (tmp_path / NS / TEMP_DIR / "pod-1" / "11-1").exists()
    assert not (tmp_path / namespace(1)).exists()  # a whole empty namespace
    assert young_tree.exists() and chunk.exists()
    assert s.take_stats()["orphans_removed"] == 3 + 4  # 11-1/aa/bb, other/...
    # Everything gone and old: the root stays (the writers' mkdir target).
    chunk.unlink()
    s.sweep(now + 10 * TEMP_MAX_AGE_S)
    assert tmp_path.is_dir() and sorted(os.listdir(tmp_path)) == sorted(SWEEPER_FILES)


def test_two_sweepers_at_once_keep_live_data(tmp_path: Path) -> None:
    """Two sweepers (two instances) on one root, sweeping over and over
    while a writer adds chunks: neither fails, every removal is counted
    once, the recently used chunks (within the budget) all survive, and
    the root ends within budget."""
    now = time.time()
    old = [put_file(chunk_path(tmp_path, i), now - LONG_AGO + i) for i in range(150)]
    for i in range(0, 150, 3):  # empty leftovers to race on, too
        (tmp_path / NS / TEMP_DIR / f"p{i}" / "aa").mkdir(parents=True)
    age_tree(tmp_path / NS / TEMP_DIR, now - LONG_AGO)
    sweepers = [sweeper(tmp_path, limit_chunks=40) for _ in range(2)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def run(s: RootSweeper) -> None:
        try:
            while not stop.is_set():
                s.sweep()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in sweepers]
    for t in threads:
        t.start()
    new = []
    for i in range(30):  # live writes: the most recently used chunks
        new.append(put_file(chunk_path(tmp_path, 1000 + i), time.time()))
        time.sleep(0.005)
    # Two more passes (one at a time: the root's lock): the later one began
    # after the last write.
    passes = sum(s.passes for s in sweepers)
    assert wait_until(lambda: sum(s.passes for s in sweepers) >= passes + 2, 60.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors
    assert all(p.exists() for p in new)
    gone = sum(not p.exists() for p in old)
    stats = [s.take_stats() for s in sweepers]
    assert sum(st["evicted_chunks"] for st in stats) == gone
    left = len(chunk_files(tmp_path))
    assert left * CHUNK_BYTES <= HIGH_WATER * 40 * CHUNK_BYTES
    assert not (tmp_path / NS / TEMP_DIR / "p0").exists()


def test_what_is_not_the_caches_survives_every_sweep(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A budget of one byte and a TTL of 1 s: every chunk goes, but files
    outside namespaces, links (at the root, at chunk paths, in ``__temp``),
    files of other names or shapes inside a namespace, a foreign empty
    folder tree and the manifest all stay, old as they are. Each is logged
    once."""
    now = time.time()
    old = now - LONG_AGO
    chunks = [put_file(chunk_path(tmp_path, i), old) for i in range(3)]
    # A namespace with a manifest: its chunks are told by their size.
    layout = KVCacheLayout(
        "m", "float32", 2, 2, 16, 16, 4096, "CPU_ATTN", 32, key_id="nokey"
    )
    files = ChunkFiles(str(tmp_path / layout.namespace), 2, layout.entry_bytes)
    assert write_manifest(files.namespace_dir, layout)
    manifest = Path(files.namespace_dir) / MANIFEST
    sized = [
        put_file(Path(files.path([i, i + 1])), old, files.file_bytes(2)) for i in (1, 3)
    ]
    cut = put_file(Path(files.path([5, 6])), old, files.file_bytes(2) - 100)
    kept = [
        cut,
        put_file(tmp_path / "notes.txt", old),
        put_file(tmp_path / "other" / "dir" / "file", old),
        put_file(tmp_path / NS / "README", old),
        put_file(chunk_path(tmp_path, 9).with_name("zz"), old),  # not hex
    ]
    empty_foreign = tmp_path / "empty" / "aa" / "bb"
    empty_foreign.mkdir(parents=True)
    links = [tmp_path / "link", chunk_path(tmp_path, 7), tmp_path / NS / TEMP_DIR / "l"]
    for link in links:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(chunks[0])
    for path in [*kept, *links, manifest, empty_foreign, empty_foreign.parent]:
        os.utime(path, (old, old), follow_symlinks=False)

    s = RootSweeper(str(tmp_path), 1, ttl_s=1.0, interval_s=3600.0)
    with caplog.at_level(logging.WARNING, logger=PASSES_LOGGER):
        s.sweep(now + 10 * TEMP_MAX_AGE_S)
        s.sweep(now + 20 * TEMP_MAX_AGE_S)
    assert not any(p.exists() for p in chunks + sized)
    assert all(p.exists() for p in kept) and manifest.exists()
    assert all(p.is_symlink() for p in links) and empty_foreign.is_dir()
    assert layout.namespace in os.listdir(tmp_path)
    stats = s.take_stats()
    assert stats["expired_chunks"] == 5 and stats["root_chunks"] == 0
    # Logged in the first sweep only, every one of them.
    (record,) = [r for r in caplog.records if "leaves alone" in r.getMessage()]
    message = record.getMessage()
    assert "leaves alone 9 entries" in message and "verify" in message


def test_old_format_namespaces_are_still_swept(tmp_path: Path) -> None:
    """Chunks of a format 1 namespace (no trailers) still expire and are
    evicted like any other; a file there that its header does not fit
    stays."""
    now = time.time()
    legacy = "test-model-0123456789abcdef-tp1r0"
    old = put_file(chunk_path(tmp_path, 1, legacy), now - LONG_AGO)
    old.write_bytes(struct.pack("<ii", 1, 7) + b"\1" * 100)  # no trailer
    age(old, now - LONG_AGO)
    bad = put_file(chunk_path(tmp_path, 2, legacy), now - LONG_AGO)
    bad.write_bytes(struct.pack("<i", 1000) + b"\1" * 100)  # n too large
    age(bad, now - LONG_AGO)
    s = sweeper(tmp_path, ttl_s=60.0)
    s.sweep(now)
    assert not old.exists() and bad.exists()
    assert s.take_stats()["expired_chunks"] == 1


def test_a_last_use_in_the_future_counts_as_the_oldest(tmp_path: Path) -> None:
    """A chunk whose mtime lies a day ahead (planted, or a clock far off)
    is evicted first and expires; one a few seconds ahead (clocks of
    hosts differ) is taken as recent."""
    now = time.time()
    planted = put_file(chunk_path(tmp_path, 0), now + 86400)
    skewed = put_file(chunk_path(tmp_path, 1), now + 5)
    paths = [put_file(chunk_path(tmp_path, i), now - 100 + i) for i in range(2, 12)]
    s = sweeper(tmp_path, limit_chunks=10)
    s.sweep(now)
    assert not planted.exists() and skewed.exists()
    assert not paths[0].exists()  # then the least recently used

    # With a TTL (another root: this one's settings are recorded).
    other = tmp_path / "other"
    late = put_file(chunk_path(other, 0), now + 86400)
    recent = put_file(chunk_path(other, 1), now - 10)
    sweeper(other, ttl_s=60.0).sweep(now)
    assert not late.exists() and recent.exists()


def test_a_folder_swapped_for_a_link_while_sweeps_run(tmp_path: Path) -> None:
    """While sweeps that evict everything run, another thread keeps
    swapping a chunk folder for a link to a folder outside the root that
    holds chunk-shaped files: nothing outside is ever deleted, and the
    sweeps still evict the root's own chunks."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    now = time.time()
    victims = [
        put_file(outside / "00" / "00" / f"{i:02x}", now - LONG_AGO) for i in range(16)
    ]
    folder = root / NS / "00"
    parked = root / NS / "parked"
    swapping, stop = threading.Lock(), threading.Event()
    swaps = 0

    def race() -> None:
        nonlocal swaps
        while not stop.is_set():
            with swapping:
                folder.rename(parked)
                folder.symlink_to(outside, target_is_directory=True)
                time.sleep(random.uniform(0, 0.002))
                folder.unlink()
                parked.rename(folder)
                swaps += 1
            time.sleep(0.0005)

    for i in range(16):
        put_file(chunk_path(root, i), now - 1000)
    racer = threading.Thread(target=race, daemon=True)
    racer.start()
    s = sweeper(root, limit_chunks=1)
    evicted = 0
    try:
        # At least 40 sweeps and 40 swaps (a busy host may give the racer
        # the lock fewer times than there are sweeps), and on until one
        # found the folder in place (the racer swaps it most of the time).
        for k in range(400):
            if k >= 40 and swaps > 40 and evicted:
                break
            with swapping:  # the folder is in place
                for i in range(16):
                    put_file(chunk_path(root, i), now - 1000 + k)
            s.sweep(now)
            evicted += s.take_stats()["evicted_chunks"]
    finally:
        stop.set()
        racer.join(5)
    assert swaps > 40 and evicted > 0
    assert all(v.exists() for v in victims)
