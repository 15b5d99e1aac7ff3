# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The root sweeper on real files: LRU eviction by last use, expiry by last
use, orphaned temp files and empty folders, several sweepers at once, and
what eviction does to a prefix that a real cache (real vineyard) wrote.

Sweeps are called directly with ``now`` (time passing is simulated by
ageing files with ``os.utime`` or by a later ``now``); the caches' own
background sweeps are kept out of the way (a long interval, a huge limit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from tests.worker.vineyard_disk_testing import (
    CHUNK_SIZE,
    Harness,
    chunk_files,
    open_cache,
    tmpfs,
)
from vllm.worker.vineyard.connector.lookups import VineyardCacheLookup
from vllm.worker.vineyard.storage import sweeper as sweeper_module
from vllm.worker.vineyard.storage import usage
from vllm.worker.vineyard.storage.chunks import MAGIC_PREFIX, TRAILER_BYTES, ChunkFiles
from vllm.worker.vineyard.storage.eviction import HIGH_WATER, LOW_WATER
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.storage.namespaces import MANIFEST, TEMP_DIR, write_manifest
from vllm.worker.vineyard.storage.root_files import (
    CLOCK_PROBE,
    ROOT_FILES,
    ROOT_SETTINGS,
    SWEEP_LOCK,
    USAGE_LEDGER,
    RootSettings,
    read_root_settings,
    record_root_settings,
)
from vllm.worker.vineyard.storage.scan import scan_root
from vllm.worker.vineyard.storage.sweeper import (
    EMPTY_DIR_MIN_AGE_S,
    TEMP_MAX_AGE_S,
    RootSweeper,
)

SWEEPER_LOGGER = sweeper_module.__name__
CHUNK_BYTES = 8192  # two filesystem blocks: size on disk == file size
LONG_AGO = 10_000.0


def namespace(k: int = 0) -> str:
    """A namespace directory's name (the sweeper touches nothing else)."""
    return f"v2-model{k}-0123456789abcdef-c32-tp1r0-nokey"


NS = namespace()


def sweeper(root: Path, limit_chunks: float = 1e6, ttl_s: float = 0.0) -> RootSweeper:
    return RootSweeper(str(root), int(limit_chunks * CHUNK_BYTES), ttl_s, 3600.0)


def sweep_now(s: RootSweeper, now: float | None = None) -> None:
    """A pass by ``s`` now, after any pass that holds the root's lock (a
    real cache's sweeper runs the passes its writer asks for)."""
    deadline = time.monotonic() + 30
    while not s.sweep(now):
        assert time.monotonic() < deadline, "the root's lock stayed held"
        time.sleep(0.02)


def set_root(root: str, limit_bytes: int, ttl_s: float = 0.0) -> RootSweeper:
    """A sweeper of a root whose settings are changed on purpose first (a
    real cache's own sweeper recorded its settings there already)."""
    record_root_settings(root, RootSettings(limit_bytes, ttl_s), replace=True)
    return RootSweeper(root, limit_bytes, ttl_s, 3600.0)


def chunk_bytes(size: int) -> bytes:
    """A file shaped as a chunk (no manifest: its header fits its size, it
    ends in a trailer), of ``size`` bytes."""
    if size == 0:
        return b""
    header = struct.pack("<ii", 1, 1)
    trailer = MAGIC_PREFIX.ljust(TRAILER_BYTES, b"\0")
    return header + b"\1" * (size - len(header) - len(trailer)) + trailer


def put_file(path: Path, mtime: float, size: int = CHUNK_BYTES) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(chunk_bytes(size))
    os.utime(path, (mtime, mtime))
    return path


def disk_bytes(path: Path | str) -> int:
    """The space a file takes (as the sweeper counts it)."""
    st = os.stat(path)
    return max(st.st_size, st.st_blocks * 512)


def age(path: Path | str, mtime: float) -> None:
    os.utime(path, (mtime, mtime))


def age_tree(root: Path | str, mtime: float) -> None:
    """Set the mtime of everything under ``root`` (deepest first)."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in [*filenames, *dirnames]:
            age(os.path.join(dirpath, name), mtime)


def chunk_path(root: Path, i: int, ns: str = NS) -> Path:
    name = f"{i:08x}"
    return root / ns / name[0:2] / name[2:4] / name[4:6] / name[6:8]


# --------------------------------------------------------------------------
# The sweeper alone, on files laid out as vineyard lays them out.
# --------------------------------------------------------------------------


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
    assert tmp_path.is_dir() and sorted(os.listdir(tmp_path)) == sorted(ROOT_FILES)


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
    time.sleep(0.2)
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
    assert write_manifest(files.root, layout)
    manifest = Path(files.root) / MANIFEST
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
    with caplog.at_level(logging.WARNING, logger=SWEEPER_LOGGER):
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


# --------------------------------------------------------------------------
# With chunks a real cache wrote (vineyard's own layout, real hits).
# --------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Harness]:
    """A real cache whose own sweeper stays out of the way."""
    h = open_cache(tmp_path / "root", sweep_interval_s=3600.0, disk_limit_gb=1000.0)
    yield h
    h.cache.close()


def prefixes(n: int, seed: int, num_chunks: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(1, 32000) for _ in range(num_chunks * CHUNK_SIZE + 1)]
        for _ in range(n)
    ]


def chunk_paths(h: Harness, tokens: list[int], num_chunks: int = 4) -> list[str]:
    return [h.chunk_path(tokens, c) for c in range(num_chunks)]


def test_hot_prefix_survives_while_cold_one_is_evicted(cache: Harness) -> None:
    """A budget of 12 chunks; a hot and a cold prefix (4 chunks each),
    written long ago; then 10 rounds each writing a new prefix (written
    later than the last; whole, once the writer's sweeper made room) and
    loading the hot one (a verified hit marks its chunks used), and a
    sweep. The hot prefix is loaded whole every time, however old its
    write; the cold one is evicted first."""
    h = cache
    root = Path(h.cache.config.root)
    hot, cold, *news = prefixes(12, seed=1)
    start = time.time() - LONG_AGO
    for tokens in (cold, hot):
        h.write(tokens)
        for p in chunk_paths(h, tokens):
            age(p, start)
    chunk_bytes = disk_bytes(chunk_paths(h, hot)[0])
    s = set_root(str(root), 12 * chunk_bytes + chunk_bytes // 2)
    assert h.load(hot) == 4 * CHUNK_SIZE  # in use before the writes begin
    for r, tokens in enumerate(news[:10]):
        h.write_whole(tokens)
        sweep_now(s)
        assert len(chunk_files(root)) <= 12
        # A later write than the last one: set back once the sweeper saw
        # it (a last use moved back is believed, see ObservedLastUse).
        for p in chunk_paths(h, tokens):
            age(p, start + 100 * (r + 1))
        assert h.load(hot) == 4 * CHUNK_SIZE  # verified and bit-exact
    assert all(os.path.exists(p) for p in chunk_paths(h, hot))
    assert not any(os.path.exists(p) for p in chunk_paths(h, cold))
    assert h.load(cold) == 0
    # The last prefixes written are cached as well.
    assert h.load(news[9]) == 4 * CHUNK_SIZE


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
    namespace_dir = h.files.root
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


# --------------------------------------------------------------------------
# The budget at every moment, and one pass per root at a time.
# --------------------------------------------------------------------------

BUDGET = 2 << 20  # about 100 chunks of the real cache (20 KiB on disk each)


def bytes_on_disk(root: Path | str) -> tuple[int, int]:
    """The chunk files under ``root``: their space on disk, and the largest
    one's."""
    sizes = []
    for path in chunk_files(root):
        with contextlib.suppress(FileNotFoundError):  # the sweeper's thread
            sizes.append(disk_bytes(path))
    return sum(sizes), max(sizes, default=0)


def settled(caches: list[Harness], root: Path) -> dict[str, int]:
    """The writers' counts (summed) and the chunks left, once a background
    pass that may be running has finished (the same twice, 0.2 s apart;
    the backends' CPU time grows with every poll, so it is left out)."""
    last: dict[str, int] = {}
    for _ in range(100):
        now = {"left": len(chunk_files(root))}
        for h in caches:
            h.poll_stats()
            for name, value in h.counters().items():
                if not name.endswith("_cpu_us"):
                    now[name] = now.get(name, 0) + value
        if now == last:
            return now
        last = now
        time.sleep(0.2)
    raise AssertionError("the writers' sweeps did not settle")


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


def test_writes_store_what_fits_and_ask_for_room(tmp_path: Path) -> None:
    """The writer's side on its own: writes that fit the estimate (the last
    pass's scan plus what was reserved since) go; of a write that would pass
    the limit only the chunks that fit go, and a pass is asked for (run on
    the sweeper's thread, never by the write) that evicts room for the
    rest, least recently used first; what a write did not store is given
    back. A root no pass measured yet takes writes by the ledger and asks
    for a pass at once."""
    now = time.time()
    for i in range(8):
        put_file(chunk_path(tmp_path, i), now - 1000 + i)
    s = sweeper(tmp_path, limit_chunks=10)
    assert s.make_room([CHUNK_BYTES]) == 1 and s.pass_asked  # never measured
    put_file(chunk_path(tmp_path, 8), now)
    s.wrote(CHUNK_BYTES)
    assert s.run_requested_pass() and not s.pass_asked  # 9: nothing to evict
    assert s.take_stats()["evicted_chunks"] == 0
    assert s.make_room([0, 0]) == 2 and not s.pass_asked  # on disk already
    # 10 chunks: exactly the limit, past the high-water mark: the write
    # goes, and a pass is asked for ahead of need.
    assert s.make_room([0, CHUNK_BYTES]) == 2 and s.pass_asked
    put_file(chunk_path(tmp_path, 9), now)
    s.wrote(CHUNK_BYTES)
    # Two more would pass the limit: neither goes; the pass makes room for
    # them below the high-water mark (9 chunks here, 7 left).
    assert s.make_room([CHUNK_BYTES, CHUNK_BYTES]) == 0 and s.pass_asked
    s.wrote(0)
    assert s.run_requested_pass()
    stats = s.take_stats()
    assert stats["root_chunks"] == 7 and stats["evicted_chunks"] == 3
    assert chunk_path(tmp_path, 9).exists() and not chunk_path(tmp_path, 2).exists()
    # Of four, three fit; the fourth asks for a pass.
    assert s.make_room([CHUNK_BYTES] * 4) == 3 and s.pass_asked
    assert s.requested_passes == 2


def test_a_write_the_full_filesystem_refused_gets_room(tmp_path: Path) -> None:
    """The free-space part of the budget is measured by the passes: a root
    whose filesystem is full below the high-water mark (room left for one
    chunk, a write of four needs more) takes no eviction from a periodic
    pass or from the disk limit, so the writer's report of a refused write
    asks for a pass that makes room for it (not more often than
    :data:`REFUSED_PASS_GAP_S`: a disk that stays full is not walked after
    every write)."""
    gap = mock.patch.object(sweeper_module, "REFUSED_PASS_GAP_S", 0.2)
    try:
        with tmpfs(tmp_path / "fs", 64 * CHUNK_BYTES) as root:
            now = time.time()
            for i in range(16):
                put_file(chunk_path(root, i), now - 1000 + i)
            st = os.statvfs(root)
            filler = st.f_bavail * st.f_frsize - 3 * CHUNK_BYTES
            (root / "filler").write_bytes(b"\0" * filler)  # not the cache's
            s = sweeper(root)  # a disk limit far above the filesystem
            sweep_now(s)
            assert s.take_stats()["evicted_chunks"] == 0  # below the mark
            with gap:
                s.write_failed(4 * CHUNK_BYTES)
                assert s.pass_asked
                assert s.run_requested_pass()
                s.write_failed(4 * CHUNK_BYTES)
                assert not s.pass_asked  # one asked for just now
                time.sleep(0.3)
                s.write_failed(4 * CHUNK_BYTES)
                assert s.pass_asked
            assert s.take_stats()["evicted_chunks"] >= 2
            st = os.statvfs(root)
            assert st.f_bavail * st.f_frsize >= 4 * CHUNK_BYTES
            assert not chunk_path(root, 0).exists() and chunk_path(root, 15).exists()
    except PermissionError as e:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {e}")


def test_writers_share_the_roots_usage(tmp_path: Path) -> None:
    """Two writers (two processes' sweepers) on one root count each
    other's reservations through the root's ledger: the second needs no
    scan of its own, and the one whose write would take the root past the
    limit, whoever reserved the rest, asks for room."""
    now = time.time()
    for i in range(6):
        put_file(chunk_path(tmp_path, i), now - 1000 + i)
    a, b = sweeper(tmp_path, limit_chunks=10), sweeper(tmp_path, limit_chunks=10)
    assert a.make_room([CHUNK_BYTES]) == 1
    put_file(chunk_path(tmp_path, 6), now)
    a.wrote(CHUNK_BYTES)
    assert a.run_requested_pass()  # measures the root: 7 chunks
    assert b.make_room([CHUNK_BYTES] * 2) == 2  # 9: by a's measure
    assert not (a.pass_asked or b.pass_asked) and b.passes == 0
    assert a.make_room([CHUNK_BYTES]) == 1 and a.pass_asked  # 10: high water
    assert b.make_room([CHUNK_BYTES]) == 0 and b.pass_asked  # 11
    assert b.run_requested_pass()
    assert b.passes == 1 and a.requested_passes == b.requested_passes == 1
    # The three reserved were never written: 7 on disk, room enough.
    assert b.take_stats()["evicted_chunks"] == 0
    assert b.make_room([CHUNK_BYTES]) == 1


def test_writers_needing_room_at_once_walk_the_root_once(tmp_path: Path) -> None:
    """Writers that need room at the same moment (the TP ranks of an
    instance crossing the limit together): one walks the root and evicts
    down to the low-water mark; the others wait for its lock, then find
    room by the ledger without a walk of their own."""
    now = time.time()
    for i in range(99):
        put_file(chunk_path(tmp_path, i), now - 1000 + i)
    first = sweeper(tmp_path, limit_chunks=100)
    assert first.sweep(now)  # 99: down to 85
    for i in range(14):
        put_file(chunk_path(tmp_path, 1000 + i), now)
    assert first.make_room([CHUNK_BYTES] * 14) == 14  # 99 again, by the ledger
    first.wrote(14 * CHUNK_BYTES)
    ranks = [sweeper(tmp_path, limit_chunks=100) for _ in range(4)]
    assert [s.make_room([CHUNK_BYTES] * 2) for s in ranks] == [1, 0, 0, 0]
    assert all(s.pass_asked for s in ranks)
    threads = [threading.Thread(target=s.run_requested_pass) for s in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(s.requested_passes for s in ranks) == sum(s.passes for s in ranks)
    assert sum(s.passes for s in ranks) == 1
    assert sum(s.take_stats()["evicted_chunks"] for s in ranks) == 99 - 85
    assert len(chunk_files(tmp_path)) == 85


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


HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def lock_held_elsewhere(root: Path, name: str = SWEEP_LOCK) -> Iterator[None]:
    """Another process holds the lock of the root's sweep lock file (as its
    sweep would) or ledger."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(root / name)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        yield
    finally:
        assert holder.stdin is not None
        holder.stdin.close()  # it exits: the lock goes with it
        holder.wait(10)


def test_one_pass_per_root_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another process holds the root's lock a sweep does nothing
    (counted), a write that needs room does not wait (it asks), and the
    pass it asked for waits for the lock, then makes room regardless; once
    the lock is free sweeps proceed. Two sweepers of one process take turns
    as well."""
    monkeypatch.setattr(sweeper_module, "LOCK_WAIT_S", 0.5)
    now = time.time()
    paths = [put_file(chunk_path(tmp_path, i), now - 1000 + i) for i in range(20)]
    a, b = sweeper(tmp_path, limit_chunks=10), sweeper(tmp_path, limit_chunks=10)
    with lock_held_elsewhere(tmp_path):
        assert not a.sweep(now) and not b.sweep(now)
        assert a.skipped_sweeps == b.skipped_sweeps == 1
        assert all(p.exists() for p in paths)
        assert a.take_stats()["evicted_chunks"] == 0
        start = time.monotonic()
        assert b.make_room([CHUNK_BYTES] * 11) == 10 and b.pass_asked
        assert time.monotonic() - start < 0.4  # the write did not wait
        b.wrote(0)
        start = time.monotonic()
        assert b.run_requested_pass()  # waited, then swept unlocked
        assert time.monotonic() - start >= 0.5
        assert b.take_stats()["evicted_chunks"] == 12
    old = [put_file(chunk_path(tmp_path, 100 + i), now - 2000) for i in (0, 1)]
    assert a.sweep(now) and a.skipped_sweeps == 1  # 10 chunks: over the mark
    assert a.take_stats()["evicted_chunks"] == 2
    assert not any(p.exists() for p in old)
    # In one process: a pass holds the lock, another sweeper's sweep
    # meanwhile is skipped.
    fd, held = a._lock_root(0.0)
    assert held and fd is not None
    try:
        assert not b.sweep(now) and b.skipped_sweeps == 2
    finally:
        os.close(fd)
    assert b.sweep(now)


def test_a_ledger_held_elsewhere_costs_one_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process holds the root's ledger (a hostile user, a stopped
    process): the writer waits for it once, then counts on its own for a
    while (logged once), so its writes are not slowed further, and the
    limit still holds by its own count."""
    monkeypatch.setattr(usage, "LEDGER_WAIT_S", 0.3)
    s = sweeper(tmp_path, limit_chunks=10)
    with (
        lock_held_elsewhere(tmp_path, USAGE_LEDGER),
        caplog.at_level(logging.WARNING, logger=SWEEPER_LOGGER),
    ):
        start = time.monotonic()
        assert s.make_room([CHUNK_BYTES]) == 1 and s.pass_asked  # not measured
        assert s.run_requested_pass()  # by its own count: nothing on disk
        for _ in range(9):
            assert s.make_room([CHUNK_BYTES]) == 1 and not s.pass_asked
            s.wrote(CHUNK_BYTES)
        assert 0.3 <= time.monotonic() - start < 1.5
        assert s.make_room([CHUNK_BYTES]) == 1 and s.pass_asked  # high water
        s.wrote(CHUNK_BYTES)
        assert s.make_room([CHUNK_BYTES]) == 0  # 11 chunks by its count
    (record,) = [r for r in caplog.records if "ledger" in r.getMessage()]
    assert "held by another" in record.getMessage()


def test_a_recent_sweep_elsewhere_is_not_repeated(tmp_path: Path) -> None:
    """A periodic sweep due within an interval of another process's sweep
    walks nothing: it takes that sweep's figures from the root's ledger.
    After :data:`MAX_SKIPPED_INTERVALS` of that it sweeps regardless (its
    own TTL and limit apply too)."""
    now = time.time()
    for i in range(5):
        put_file(chunk_path(tmp_path, i), now)
    a, b = sweeper(tmp_path), sweeper(tmp_path)
    assert a.sweep()
    assert b._swept_elsewhere() and b.skipped_sweeps == 1 and b.passes == 0
    stats = b.take_stats()
    assert (stats["root_chunks"], stats["root_bytes"]) == (5, 5 * CHUNK_BYTES)
    b._last_pass -= (sweeper_module.MAX_SKIPPED_INTERVALS + 1) * b.interval_s
    assert not b._swept_elsewhere()


@pytest.mark.parametrize("planted", ["symlink", "dangling", "fifo", "directory"])
@pytest.mark.parametrize("name", ROOT_FILES)
def test_planted_sweeper_files_are_never_followed(
    tmp_path: Path, planted: str, name: str
) -> None:
    """Something not a regular file at the path of the sweepers' lock or
    ledger (another user of a shared root): sweeps and writers go on
    without it, follow no link, create and touch nothing there, and the
    entry stays (reported, never removed). The real files are the cache's
    own: never reported, never removed."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    lock = root / name
    target = outside / "target"
    if planted == "symlink":
        target.write_bytes(b"theirs")
        lock.symlink_to(target)
    elif planted == "dangling":
        lock.symlink_to(target)
    elif planted == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    put_file(chunk_path(root, 1), time.time() - LONG_AGO)
    s = RootSweeper(str(root), 1, ttl_s=1.0, interval_s=3600.0)
    assert s.sweep() and s.sweep()
    assert s.take_stats()["expired_chunks"] == 1
    assert s.make_room([2]) == 0 and s.run_requested_pass()  # over 1 byte
    assert os.path.lexists(lock)
    assert lock.is_symlink() == (planted in ("symlink", "dangling"))
    assert target.exists() == (planted == "symlink")
    if planted == "symlink":
        assert target.read_bytes() == b"theirs"
    assert [f.path for f in scan_root(str(root)).foreign] == [str(lock)]

    # The cache's own lock file.
    own = tmp_path / "own"
    own.mkdir()
    s = RootSweeper(str(own), 1, ttl_s=1.0, interval_s=3600.0)
    assert s.sweep(time.time() + 10 * TEMP_MAX_AGE_S)
    assert s.make_room([2]) == 0 and s.run_requested_pass()
    assert all((own / f).is_file() for f in ROOT_FILES)
    assert scan_root(str(own)).foreign == []


# --------------------------------------------------------------------------
# The root's own settings, and last uses in the future.
# --------------------------------------------------------------------------


def test_the_root_settings_govern_every_sweeper(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first sweeper records its limit and TTL in the root; a later one
    with a smaller limit and a short TTL follows the root's (says so once)
    and evicts or expires nothing; once the root's are changed on purpose,
    every sweeper follows them from its next pass."""
    now = time.time()
    paths = [put_file(chunk_path(tmp_path, i), now - 100 + i) for i in range(10)]
    first = sweeper(tmp_path, limit_chunks=100)
    first.sweep(now)
    assert read_root_settings(str(tmp_path)) == RootSettings(100 * CHUNK_BYTES, 0.0)

    small = sweeper(tmp_path, limit_chunks=4, ttl_s=10.0)
    with caplog.at_level(logging.WARNING, logger=SWEEPER_LOGGER):
        small.sweep(now)
        small.sweep(now + 1)
    assert all(p.exists() for p in paths)
    assert small.take_stats()["root_chunks"] == 10
    (record,) = [r for r in caplog.records if "settings of its own" in r.getMessage()]
    assert "vineyard-llm-cache settings" in record.getMessage()

    record_root_settings(
        str(tmp_path), RootSettings(4 * CHUNK_BYTES, 0.0), replace=True
    )
    first.sweep(now + 2)
    # Down to the low-water mark of the root's new limit, oldest first.
    left = [p.exists() for p in paths]
    assert left == [False] * (10 - sum(left)) + [True] * sum(left)
    assert sum(left) * CHUNK_BYTES <= LOW_WATER * 4 * CHUNK_BYTES


def test_unreadable_root_settings_leave_each_sweeper_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A settings file that is not valid (or a link, never followed) is not
    trusted and not overwritten: each sweeper uses its own, and says so."""
    now = time.time()
    paths = [put_file(chunk_path(tmp_path, i), now - 100 + i) for i in range(10)]
    settings = tmp_path / ROOT_SETTINGS
    settings.write_text('{"disk_limit_bytes": -1, "ttl_s": 0}')
    with pytest.raises(ValueError, match="disk_limit_bytes"):
        read_root_settings(str(tmp_path))
    s = sweeper(tmp_path, limit_chunks=4)
    with caplog.at_level(logging.WARNING, logger=SWEEPER_LOGGER):
        s.sweep(now)
    assert sum(p.exists() for p in paths) <= 4
    assert "cannot use its settings" in caplog.text
    assert settings.read_text() == '{"disk_limit_bytes": -1, "ttl_s": 0}'

    target = tmp_path / "elsewhere.json"
    target.write_text('{"disk_limit_bytes": 1, "ttl_s": 0}')
    settings.unlink()
    settings.symlink_to(target)
    with pytest.raises(OSError):
        read_root_settings(str(tmp_path))
    s.sweep(now)
    assert settings.is_symlink() and target.read_text().startswith("{")


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
        # At least 40 sweeps, and on until one found the folder in place
        # (the racer swaps it most of the time).
        for k in range(400):
            if k >= 40 and evicted:
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


@contextlib.contextmanager
def clock_off_by(seconds: float) -> Iterator[None]:
    """Run as a host whose wall clock is ``seconds`` off."""
    real = time.time
    with mock.patch.object(sweeper_module.time, "time", lambda: real() + seconds):
        yield


@pytest.mark.parametrize("skew_s", [600.0, -600.0], ids=["ahead", "behind"])
def test_hosts_ten_minutes_apart_run_no_extra_passes(
    tmp_path: Path, skew_s: float
) -> None:
    """Two hosts whose clocks are 10 minutes apart share a root with a tight
    budget and 60 s sweeps: the ledger one host stamps is fresh to the other
    (freshness is watched on each host's own clock, never compared), so
    writes that fit ask for no pass on either host; a write that needs room
    asks for one (a write never runs a pass), which evicts, and the budget
    holds."""
    now = time.time()
    for i in range(6):
        put_file(chunk_path(tmp_path, i), now - 1000 + i)
    limit = 10 * CHUNK_BYTES
    here = RootSweeper(str(tmp_path), limit, 0.0, 60.0)
    there = RootSweeper(str(tmp_path), limit, 0.0, 60.0)
    with clock_off_by(skew_s):
        assert there.sweep()  # 6 chunks, stamped by the other clock
    for i in range(3):
        assert here.make_room([CHUNK_BYTES]) == 1 and not here.pass_asked
        put_file(chunk_path(tmp_path, 100 + i), now)
        here.wrote(CHUNK_BYTES)
    with clock_off_by(skew_s):
        # 10: the limit, past the high-water mark (a pass is asked for).
        assert there.make_room([CHUNK_BYTES]) == 1 and there.pass_asked
        put_file(chunk_path(tmp_path, 200), now)
        there.wrote(CHUNK_BYTES)
    # 12 would pass it: not written, and a pass asked for, which evicts.
    assert here.make_room([CHUNK_BYTES] * 2) == 0 and here.pass_asked
    assert here.run_requested_pass()
    assert here.take_stats()["evicted_chunks"] > 0
    assert len(chunk_files(tmp_path)) <= 10
    with clock_off_by(skew_s):
        assert there.make_room([CHUNK_BYTES]) == 1  # fits by the new ledger
        assert not there.run_requested_pass()  # here made the room
    assert here.requested_passes == 1 and there.requested_passes == 0


def test_a_host_whose_clock_lags_keeps_its_fresh_chunks(tmp_path: Path) -> None:
    """A host whose clock is 10 minutes behind writes chunks (their mtimes
    10 minutes old) to a root with a 5-minute TTL and a tight budget. The
    sweeping host saw them appear since its previous pass: they are not
    expired, and eviction takes the chunks nobody touched since (older by
    the sweeper's clock, yet with newer mtimes) first. A chunk the lagging
    host hits again (a new mtime, still in the past) counts as fresh too,
    and one left untouched ages from when it was seen."""
    now = time.time()
    old = [put_file(chunk_path(tmp_path, i), now - 150 + i) for i in range(6)]
    s = RootSweeper(str(tmp_path), 10 * CHUNK_BYTES, 300.0, 3600.0)
    assert s.sweep(now)  # sees the six
    later = now + 100
    lagging = [put_file(chunk_path(tmp_path, 100 + i), later - 600) for i in range(5)]
    assert s.sweep(later)  # 11 chunks: over the budget
    stats = s.take_stats()
    assert stats["expired_chunks"] == 0
    assert stats["evicted_chunks"] == 11 - 8  # down to the low-water mark
    assert all(p.exists() for p in lagging)
    assert sum(p.exists() for p in old) == 3
    # Untouched, they age from the pass that first saw them (at ``now``).
    hit = lagging[0]
    os.utime(hit, (later - 500, later - 500))  # hit by the lagging host
    assert s.sweep(now + 390)  # 390 s after ``now``: over the TTL
    assert s.take_stats()["expired_chunks"] == 4 + 3
    assert [p for p in (*old, *lagging) if p.exists()] == [hit]


def write_now(path: Path) -> Path:
    """A chunk file written now: its mtime stamped by the filesystem (on a
    network filesystem, by its server's clock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(chunk_bytes(CHUNK_BYTES))
    return path


@pytest.mark.parametrize("skew_s", [-600.0, 600.0], ids=["behind", "ahead"])
def test_a_pass_judges_last_uses_by_the_roots_clock(
    tmp_path: Path, skew_s: float
) -> None:
    """The sweeping host's clock is 10 minutes off the clock that stamps the
    root's mtimes (an NFS server's), the TTL 60 s: chunks written just now
    stay, pass after pass; chunks unused for longer than the TTL by the
    root's clock expire."""
    real_now = time.time()
    fresh = [write_now(chunk_path(tmp_path, i)) for i in range(4)]
    stale = [put_file(chunk_path(tmp_path, 100 + i), real_now - 120) for i in range(2)]
    s = RootSweeper(str(tmp_path), 1 << 40, 60.0, 3600.0)
    with clock_off_by(skew_s):
        assert s.sweep() and s.sweep()
    assert s.take_stats()["expired_chunks"] == len(stale)
    assert all(p.exists() for p in fresh)
    assert not any(p.exists() for p in stale)
    assert (tmp_path / CLOCK_PROBE).is_file()


def test_without_its_clock_probe_a_pass_keeps_the_last_offset(
    tmp_path: Path,
) -> None:
    """Where the root's clock cannot be read (the probe cannot be touched: a
    read-only root, something planted at its path), a pass takes this
    host's clock, corrected by the offset to the root's clock it measured
    last (none: the host's clock as it is)."""
    fresh = [write_now(chunk_path(tmp_path, i)) for i in range(4)]
    stale = put_file(chunk_path(tmp_path, 100), time.time() - 120)
    s = RootSweeper(str(tmp_path), 1 << 40, 60.0, 3600.0)
    with clock_off_by(-600.0):
        assert s.sweep()  # measures the offset
        probe = tmp_path / CLOCK_PROBE
        probe.unlink()
        probe.mkdir()
        assert s.sweep()
    assert all(p.exists() for p in fresh) and not stale.exists()
    assert s.take_stats()["expired_chunks"] == 1

    stale = put_file(chunk_path(tmp_path, 101), time.time() - 120)
    s = RootSweeper(str(tmp_path), 1 << 40, 60.0, 3600.0)
    assert s.sweep()  # never measured: this host's clock (in sync here)
    assert all(p.exists() for p in fresh) and not stale.exists()
    assert probe.is_dir()
