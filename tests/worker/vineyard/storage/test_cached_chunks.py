# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The lookup's count of leading chunks on disk, one ``stat`` at a time on
a local disk and all at once on a root a round trip away
(:func:`count_complete_chunks`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.script_testing import mount_slow_fs
from vllm.worker.vineyard.storage import far_calls
from vllm.worker.vineyard.storage.cached_chunks import count_complete_chunks
from vllm.worker.vineyard.storage.chunks import ChunkFiles

BPC = 2  # blocks per chunk
ENTRY = 1 << 16
IDS = list(range(1, 1 + 6 * BPC))  # six chunks' ids


@pytest.fixture
def files(tmp_path: Path) -> ChunkFiles:
    files = ChunkFiles(str(tmp_path), BPC, ENTRY)
    for k in range(4):  # chunks 0-3 on disk, 4 an empty placeholder
        ids = IDS[: (k + 1) * BPC]
        Path(files.path(ids)).write_bytes(b"\0" * files.file_bytes(len(ids)))
    Path(files.path(IDS[: 5 * BPC])).write_bytes(b"")
    return files


def write_chunks(files: ChunkFiles, ids: list[int], chunks: Sequence[int]) -> None:
    os.makedirs(files.namespace_dir, exist_ok=True)
    for k in chunks:
        prefix = ids[: (k + 1) * BPC]
        Path(files.path(prefix)).write_bytes(b"\0" * files.file_bytes(len(prefix)))


@pytest.mark.parametrize(
    ("max_chunks", "found", "stats"),
    [(6, 4, 5), (3, 3, 3), (0, 0, 0)],  # the placeholder (chunk 4) is no chunk
)
def test_a_local_lookup_stats_up_to_the_first_missing_chunk(
    files: ChunkFiles,
    max_chunks: int,
    found: int,
    stats: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Quick stat calls (however long this busy machine makes the first).
    monkeypatch.setattr(far_calls, "FAR_CALL_S", 10.0)
    assert count_complete_chunks(files, IDS, max_chunks) == (found, stats)


#: 48 chunks' ids: three waves of stat calls after the first.
MANY_IDS = list(range(1, 1 + 48 * BPC))


@pytest.mark.parametrize(
    ("on_disk", "found", "stats"),
    [
        (range(48), 48, 48),  # every chunk, in waves of 16, 16 and 15
        (range(40), 40, 48),  # the last wave's misses are made in vain
        ([*range(20), *range(21, 48)], 20, 33),  # a hole ends the hit there
        (range(1, 48), 0, 1),  # no first chunk: one stat
    ],
)
def test_a_far_lookup_stats_at_once(
    tmp_path: Path, on_disk: Sequence[int], found: int, stats: int
) -> None:
    """On the benchmark's FUSE root with a round trip on every ``stat``:
    after the first, the calls go out at once, each wave up to the first
    missing chunk."""
    fs = mount_slow_fs(tmp_path / "fs", latency_ms=5.0)
    try:
        files = ChunkFiles(str(fs.mount / "ns"), BPC, ENTRY)
        write_chunks(files, MANY_IDS, on_disk)
        assert count_complete_chunks(files, MANY_IDS, 48) == (found, stats)
    finally:
        fs.close()
