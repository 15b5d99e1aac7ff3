# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The root's own settings and the root's clock: the settings the first
sweeper records govern every sweeper until changed on purpose (unreadable
ones leave each its own), and a pass judges ages by the clock that stamps
the root's mtimes, so hosts whose clocks are off neither expire fresh
chunks nor run extra passes.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

import pytest

from tests.worker.vineyard.storage.sweeper_testing import (
    CHUNK_BYTES,
    chunk_path,
    clock_off_by,
    put_file,
    sweeper,
    write_now,
)
from tests.worker.vineyard_disk_testing import chunk_files
from vllm.worker.vineyard.storage import safe_io, sweep_passes
from vllm.worker.vineyard.storage.eviction import LOW_WATER
from vllm.worker.vineyard.storage.root_files import (
    CLOCK_PROBE,
    ROOT_SETTINGS,
    RootSettings,
    read_root_settings,
    record_root_settings,
)
from vllm.worker.vineyard.storage.sweeper import RootSweeper

PASSES_LOGGER = sweep_passes.__name__


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
    with caplog.at_level(logging.WARNING, logger=PASSES_LOGGER):
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
    with caplog.at_level(logging.WARNING, logger=PASSES_LOGGER):
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


def test_settings_replaced_through_another_client_are_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A network filesystem answers ESTALE once where another client
    replaced the file: the settings are read again, not given up on (a
    sweeper would sweep with its own meanwhile). Twice: an error."""
    settings = RootSettings(1 << 30, 60.0)
    record_root_settings(str(tmp_path), settings)
    read_small_file = safe_io._read_small_file
    stale_left = [1]  # reads answered ESTALE before the file is found

    def stale_first(path: str, max_bytes: int, dir_fd: int | None) -> bytes:
        if stale_left[0] > 0:
            stale_left[0] -= 1
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return read_small_file(path, max_bytes, dir_fd)

    monkeypatch.setattr(safe_io, "_read_small_file", stale_first)
    assert read_root_settings(str(tmp_path)) == settings
    stale_left[0] = 2
    with pytest.raises(OSError):
        read_root_settings(str(tmp_path))


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
