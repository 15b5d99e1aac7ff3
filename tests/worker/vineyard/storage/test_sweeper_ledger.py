# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How writers hold the disk limit between passes, and one pass per root at
a time: a write stores what fits by the usage the writers share in the
root's ledger and asks the sweeper's thread for room (never running a pass
itself); a write the full filesystem refused gets room; writers needing
room at once walk the root once; the root's lock and ledger held by
another process; and planted entries at the paths of the sweepers' files.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

from tests.vineyard_testing import wait_until
from tests.worker.vineyard.storage.sweeper_testing import (
    CHUNK_BYTES,
    LONG_AGO,
    chunk_path,
    lock_held_elsewhere,
    put_file,
    sweep_now,
    sweeper,
)
from tests.worker.vineyard_disk_testing import chunk_files, tmpfs
from vllm.worker.vineyard.storage import sweeper as sweeper_module
from vllm.worker.vineyard.storage import usage
from vllm.worker.vineyard.storage.root_files import (
    ROOT_FILES,
    SWEEPER_FILES,
    USAGE_LEDGER,
)
from vllm.worker.vineyard.storage.scan import scan_root
from vllm.worker.vineyard.storage.sweep_passes import TEMP_MAX_AGE_S
from vllm.worker.vineyard.storage.sweeper import RootSweeper


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
                first = time.monotonic()
                s.write_failed(4 * CHUNK_BYTES)
                assert s.pass_asked
                assert s.run_requested_pass()
                s.write_failed(4 * CHUNK_BYTES)
                assert not s.pass_asked  # one asked for just now

                def asks_again() -> bool:
                    s.write_failed(4 * CHUNK_BYTES)
                    return s.pass_asked

                assert wait_until(asks_again, 10.0)  # once the gap has passed
                assert time.monotonic() - first >= 0.2
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
    fd, held = a._root_lock.take(0.0)
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
        caplog.at_level(logging.WARNING, logger=usage.__name__),
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
    assert all((own / f).is_file() for f in SWEEPER_FILES)
    assert scan_root(str(own)).foreign == []
