# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The link probe's timed reads: whole chunk files of a prefix, in order,
up to a byte budget, stopping at the first missing or empty (placeholder)
file (:func:`time_chunk_reads`); or, at an engine's start, whichever chunk
files the namespace lists, in either layout (:func:`time_any_chunk_reads`);
a few at a time, as a load's reads overlap; cut once sure to cost more than
the price they are to beat."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.script_testing import mount_slow_fs
from vllm.worker.vineyard.storage import timed_reads
from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.timed_reads import (
    time_any_chunk_reads,
    time_chunk_reads,
)

BPC = 2  # blocks per chunk
ENTRY = 1 << 16
IDS = list(range(1, 1 + 6 * BPC))  # six chunks' ids


def write_chunks(files: ChunkFiles, chunks: int) -> int:
    """Chunks ``0..chunks-1`` of :data:`IDS` on disk; their bytes."""
    os.makedirs(files.namespace_dir, exist_ok=True)
    size = 0
    for k in range(chunks):
        ids = IDS[: (k + 1) * BPC]
        data = b"\0" * files.file_bytes(len(ids))
        Path(files.path(ids)).write_bytes(data)
        size += len(data)
    return size


@pytest.fixture
def files(tmp_path: Path) -> ChunkFiles:
    files = ChunkFiles(str(tmp_path), BPC, ENTRY)
    write_chunks(files, 4)  # chunks 0-3 on disk, 4 an empty placeholder
    Path(files.path(IDS[: 5 * BPC])).write_bytes(b"")
    return files


@pytest.fixture(autouse=True)
def two_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two files at a time (and at least two read), so that a budget of
    fewer files than the fixture's four shows."""
    monkeypatch.setattr(timed_reads, "READS_AT_ONCE", 2)


@pytest.mark.parametrize(
    ("max_chunks", "budget_files", "blocks"),
    [
        (6, 100, 4 * BPC),  # stops at the placeholder
        (2, 100, 2 * BPC),  # at most max_chunks
        (6, 3, 3 * BPC),  # the budget, in whole files
        (6, 0, 2 * BPC),  # however small the budget: READS_AT_ONCE files
        (0, 100, 0),
    ],
)
def test_reads_whole_files_in_order(
    files: ChunkFiles, max_chunks: int, budget_files: int, blocks: int
) -> None:
    max_bytes = max(1, budget_files * files.file_bytes(BPC))
    read, seconds = time_chunk_reads(files, IDS, max_chunks, max_bytes)
    assert read == blocks
    assert seconds >= 0.0


def test_a_missing_first_chunk_reads_nothing(tmp_path: Path) -> None:
    files = ChunkFiles(str(tmp_path), BPC, ENTRY)
    assert time_chunk_reads(files, IDS, 6, 1 << 30)[0] == 0


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize(
    ("max_chunks", "max_bytes", "blocks"),
    [
        (16, 1 << 30, 4 * BPC),  # every chunk, not the placeholder
        (3, 1 << 30, 3 * BPC),
        (16, 1, 2 * BPC),  # READS_AT_ONCE files
    ],
)
def test_any_chunk_files_are_read(
    tmp_path: Path, flat: bool, max_chunks: int, max_bytes: int, blocks: int
) -> None:
    files = ChunkFiles(str(tmp_path / "ns"), BPC, ENTRY, flat=flat)
    for k in range(5):  # four chunks and a placeholder
        ids = IDS[: (k + 1) * BPC]
        path = Path(files.path(ids))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * files.file_bytes(len(ids)) if k < 4 else b"")
    # Not chunk files: skipped unread.
    (tmp_path / "ns" / "notes.txt").write_bytes(b"x" * 100)
    (tmp_path / "ns" / "abcdefgh").write_bytes(b"x" * 100)  # not hex
    read, seconds = time_any_chunk_reads(files, max_chunks, max_bytes)
    assert read == blocks
    assert seconds > 0.0


def test_a_namespace_without_chunks_reads_nothing(tmp_path: Path) -> None:
    missing = ChunkFiles(str(tmp_path / "missing"), BPC, ENTRY)
    assert time_any_chunk_reads(missing, 16, 1 << 30) == (0, 0.0)
    (tmp_path / "empty").mkdir()
    empty = ChunkFiles(str(tmp_path / "empty"), BPC, ENTRY, flat=False)
    assert time_any_chunk_reads(empty, 16, 1 << 30) == (0, 0.0)


def test_any_chunk_files_are_read_through_a_thin_link(tmp_path: Path) -> None:
    """On the benchmark's FUSE root behind a read link (as far-root tests
    and benchmarks run it), the namespace lists and the reads pay the link."""
    fs = mount_slow_fs(tmp_path / "fs", read_mbps=8.0, direct_io=True)
    try:
        files = ChunkFiles(str(fs.mount / "ns"), BPC, ENTRY)
        size = write_chunks(files, 4)
        read, seconds = time_any_chunk_reads(files, 16, 1 << 30)
        assert read == 4 * BPC
        assert seconds >= 0.8 * size / 8e6
    finally:
        fs.close()


@pytest.mark.parametrize("any_files", [False, True])
def test_reads_overlap_their_round_trips(
    tmp_path: Path, any_files: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a FUSE root with a round trip on every call that reaches a file,
    :data:`READS_AT_ONCE` files at a time pay each wave's round trips, not
    each file's: about what a load, whose reads overlap, pays."""
    fs = mount_slow_fs(tmp_path / "fs", latency_ms=40.0)
    try:
        files = ChunkFiles(str(fs.mount / "ns"), BPC, ENTRY)
        write_chunks(files, 6)

        def timed(at_once: int) -> float:
            monkeypatch.setattr(timed_reads, "READS_AT_ONCE", at_once)
            if any_files:
                read, seconds = time_any_chunk_reads(files, 16, 1 << 30)
            else:
                read, seconds = time_chunk_reads(files, IDS, 6, 1 << 30)
            assert read == 6 * BPC
            return seconds

        one_at_a_time = timed(1)
        # Six files: two waves of four and two, against six one at a time.
        assert timed(4) < 0.6 * one_at_a_time
    finally:
        fs.close()


@pytest.mark.parametrize("any_files", [False, True])
def test_a_probe_of_a_thin_link_stops_once_sure_to_lose(
    tmp_path: Path, any_files: bool
) -> None:
    """Behind 8 MB/s, a probe given a price an eighth of the link's stops
    soon after it is sure to be above it, and says so (a price at least
    that high); given one above the link's, it reads every file."""
    fs = mount_slow_fs(tmp_path / "fs", read_mbps=8.0, direct_io=True)
    try:
        files = ChunkFiles(str(fs.mount / "ns"), BPC, 1 << 20)  # 2 MiB files
        size = write_chunks(files, 4)
        link_s_per_block = size / 8e6 / (4 * BPC)

        def probe(cut_s_per_block: float) -> tuple[int, float]:
            if any_files:
                return time_any_chunk_reads(files, 4, 1 << 30, cut_s_per_block)
            return time_chunk_reads(files, IDS, 4, 1 << 30, cut_s_per_block)

        blocks, seconds = probe(link_s_per_block / 8)
        assert blocks == 4 * BPC
        assert seconds >= blocks * link_s_per_block / 8
        assert seconds < 0.5 * size / 8e6  # not the whole files' time
        blocks, seconds = probe(3 * link_s_per_block)
        assert blocks == 4 * BPC
        assert seconds >= 0.8 * size / 8e6  # every byte through the link
    finally:
        fs.close()
