# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A real size-limited filesystem under the cache root (a tmpfs, which
returns ENOSPC when full, and read-only when remounted so): failed writes
are counted as write errors and never as completed updates, no partial
chunk is ever visible or loadable, reads go on, and once the sweeper has
made room writes resume by themselves."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vineyard_testing import wait_until
from tests.worker.vineyard_disk_testing import (
    CHUNK_SIZE,
    Harness,
    chunk_files,
    open_cache,
    partial_chunk_files,
    remount,
    tmpfs,
)
from vllm.worker.vineyard.backend.write_errors import (
    write_error_reason as _write_error_reason,
)
from vllm.worker.vineyard.connector.lookups import VineyardCacheLookup
from vllm.worker.vineyard.storage.namespaces import TEMP_DIR
from vllm.worker.vineyard.storage.sweeper import RootSweeper

FS_BYTES = 1 << 20  # about 50 chunks of 16.5 KB (20 KiB on disk each)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted at teardown (skipped where mounting is not
    permitted: it needs root)."""
    try:
        with tmpfs(tmp_path / "fs", FS_BYTES) as path:
            yield path
    except PermissionError as e:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {e}")


def prefixes(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(1, 32000) for _ in range(4 * CHUNK_SIZE + 1)] for _ in range(n)
    ]


def assert_consistent(h: Harness) -> None:
    """Every update ended as completed or failed, none is pending."""
    c = h.counters()
    assert c["updates_submitted"] == c["updates_completed"] + c["updates_failed"]


def test_full_disk_fails_cleanly_then_recovers(small_fs: Path) -> None:
    """Write prefixes until the filesystem is full: the failed writes are
    counted (``write_errors``, ``updates_failed``), never as completed; no
    partial chunk file is ever loaded; every load is verified (a prefix that
    did not fit loads only its leading whole chunks, bit-exact). Then the
    writer's own sweeper (its budget far above the filesystem, so only the
    free-space rule applies; the refused write asks it for a pass) evicts,
    and writes succeed again without anything else being done."""
    h = open_cache(small_fs, disk_limit_gb=100.0, sweep_interval_s=1.0)
    try:
        written: list[list[int]] = []
        # Fill: fast writes, while the sweeps come once a second. Up to the
        # first failed update (counted as its write ends; the writer's
        # ``write_errors`` reach the engine with its next stats).
        for tokens in prefixes(200, seed=10):
            h.write(tokens, max_saves=1)
            written.append(tokens)
            if h.counters()["updates_failed"]:
                break
        assert h.counters()["updates_failed"] >= 1, "the filesystem never filled"

        def write_error_counted() -> bool:
            h.poll_stats()
            return h.counters()["write_errors"] >= 1

        assert wait_until(write_error_counted, 30.0)
        c = h.counters()
        assert c["updates_failed"] >= c["write_errors"] >= 1
        assert c["updates_completed"] < c["updates_submitted"]
        assert c["tokens_rejected"] == 0  # a write error is no prefix refusal
        assert_consistent(h)
        # Where the filesystem filled mid-chunk, vineyard may leave chunks
        # cut short at their paths: never loaded, as the scheduler's lookup
        # (before every load) removes them and counts them as corrupt.
        failed = written[-1]
        partial = partial_chunk_files(h.files)
        # Several chunks of the failed prefix may be cut short: each is
        # removed by that one lookup (a chunk behind a removed one would
        # otherwise stay, as vineyard keeps a file it finds at its path).
        failed_paths = {h.chunk_path(failed, k) for k in range(4)}
        assert set(partial) <= failed_paths
        lookup = VineyardCacheLookup(h.cache.config, [h.cache.layout])
        lookup.lookup(h.digests(failed), 0, len(failed))
        assert lookup.metrics.snapshot()["corrupt_chunks"] == len(partial)
        assert partial_chunk_files(h.files) == []

        # Reads go on; what was cut short loads only whole verified chunks
        # (h.load checks the bytes).
        assert h.load(failed) < 4 * CHUNK_SIZE
        assert max(h.load(tokens) for tokens in written[:-1]) == 4 * CHUNK_SIZE
        assert h.counters()["corrupt_chunks"] == 0

        # The sweeper makes room by itself (about 15% of the filesystem a
        # sweep: down to the low-water mark); then writes work again, the
        # failed prefix's included. What is written next fits in the 12%
        # waited for (at most 4 + 2 chunk files of 20 KiB): a second fill
        # would be ENOSPC again before the next sweep, not a failed recovery.
        def room() -> bool:
            h.poll_stats()
            st = os.statvfs(small_fs)
            free = st.f_bavail * st.f_frsize
            return h.counters()["evicted_chunks"] > 0 and free > 0.12 * FS_BYTES

        # Generous: on a loaded machine a sweep can wait for the root's lock.
        assert wait_until(room, 90.0), "the sweeper never made room"
        h.reset_counters()
        fresh = prefixes(1, seed=11)[0][: 2 * CHUNK_SIZE + 1]
        for tokens in (failed, fresh):
            h.write(tokens, max_saves=1)
            whole = len(tokens) // CHUNK_SIZE * CHUNK_SIZE
            assert h.load(tokens) == whole, h.counters()
        c = h.counters()
        assert c["write_errors"] == 0 and c["updates_failed"] == 0
        assert c["updates_completed"] == c["updates_submitted"] > 0
        assert partial_chunk_files(h.files) == []
    finally:
        h.cache.close()


def test_a_write_error_on_every_write(small_fs: Path) -> None:
    """The filesystem turns read-only under the cache: every update fails
    and is counted as a write error, none as completed; what was cached
    before still loads (reads go on); the sweeper survives it; back to
    read-write, writes work again."""
    h = open_cache(small_fs, sweep_interval_s=3600.0)
    try:
        before, *during = prefixes(4, seed=20)
        h.write(before)
        assert h.load(before) == 4 * CHUNK_SIZE
        h.reset_counters()
        remount(small_fs, "ro")
        try:
            assert "not writable" in (
                _write_error_reason(h.files.namespace_dir, 1) or ""
            )
            for tokens in during:
                h.write(tokens, max_saves=2)
            c = h.counters()
            assert c["updates_submitted"] == 2 * len(during)
            assert c["write_errors"] == c["updates_failed"] == c["updates_submitted"]
            assert c["updates_completed"] == 0 and c["tokens_written"] == 0
            assert h.load(before) == 4 * CHUNK_SIZE
            assert all(h.load(tokens) == 0 for tokens in during)
            # Expire everything: nothing can be removed, nothing raises.
            s = RootSweeper(str(small_fs), 1, ttl_s=1.0, interval_s=3600.0)
            s.sweep(now=1e12)
            assert len(chunk_files(small_fs)) == 4
        finally:
            remount(small_fs, "rw")
        h.reset_counters()
        h.write(during[0])
        assert h.load(during[0]) == 4 * CHUNK_SIZE
        assert h.counters()["write_errors"] == 0
    finally:
        h.cache.close()
        assert os.path.ismount(small_fs)


def open_temp_files_under(pid: int, root: Path) -> list[str]:
    """The files in vineyard's temp folders under ``root`` that process
    ``pid`` holds open (a sweep's lock and the folders it walks are not
    leaks)."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        inside = target.removeprefix(str(root) + os.sep)
        if inside != target and TEMP_DIR in Path(inside).parts[:-1]:
            found.append(target)
    return found


def test_failed_writes_release_their_files(small_fs: Path) -> None:
    """Vineyard leaves the temp file of a failed chunk write open (and so
    its partial bytes allocated, even once deleted): on a disk that stays
    full the writer would run out of descriptors. After many failed writes
    the writer holds no temp file open and no partial temp file takes
    space."""
    h = open_cache(small_fs, sweep_interval_s=3600.0)
    try:
        pid = h.cache.backend_pids()["write"]
        assert pid is not None
        for tokens in prefixes(60, seed=30):
            h.write(tokens, max_saves=1)
        assert h.counters()["write_errors"] >= 10
        assert open_temp_files_under(pid, small_fs) == []
        temp_bytes = 0
        for dirpath, _, filenames in os.walk(small_fs):
            if TEMP_DIR in Path(dirpath).parts:
                temp_bytes += sum(
                    os.path.getsize(os.path.join(dirpath, f)) for f in filenames
                )
        assert temp_bytes == 0
    finally:
        h.cache.close()


def test_only_filesystem_failures_are_write_errors(tmp_path: Path) -> None:
    """vineyard hides errno, so a failed write is classified by what the
    filesystem shows: a full or unwritable root, an unusable path, or the
    temp file vineyard leaves open when a write fails in the filesystem.
    Without any of these it was a race with another process on the root
    (no locking in vineyard), which is not the operator's to fix."""
    root = str(tmp_path)
    assert _write_error_reason(root, 1, leaked_files=0) is None
    assert "I/O error" in (_write_error_reason(root, 1, leaked_files=1) or "")
    assert "ENOSPC" in (_write_error_reason(root, 1 << 62, leaked_files=0) or "")
    missing = str(tmp_path / "gone")
    assert "unusable" in (_write_error_reason(missing, 1, leaked_files=0) or "")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    reason = _write_error_reason(str(a_file), 1, leaked_files=0)
    assert "not a directory" in (reason or "")
