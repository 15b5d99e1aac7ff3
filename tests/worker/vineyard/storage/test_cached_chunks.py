# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The link probe's timed read (:func:`time_chunk_reads`): whole chunk
files of a prefix, in order, up to a byte budget, stopping at the first
missing or empty (placeholder) file."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm.worker.vineyard.storage.cached_chunks import time_chunk_reads
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


@pytest.mark.parametrize(
    ("max_chunks", "max_bytes", "blocks"),
    [
        (6, 1 << 30, 4 * BPC),  # stops at the placeholder
        (2, 1 << 30, 2 * BPC),  # at most max_chunks
        (6, 1, BPC),  # the budget: one whole file, then stop
        (0, 1 << 30, 0),
    ],
)
def test_reads_whole_files_in_order(
    files: ChunkFiles, max_chunks: int, max_bytes: int, blocks: int
) -> None:
    read, seconds = time_chunk_reads(files, IDS, max_chunks, max_bytes)
    assert read == blocks
    assert seconds >= 0.0


def test_a_missing_first_chunk_reads_nothing(tmp_path: Path) -> None:
    files = ChunkFiles(str(tmp_path), BPC, ENTRY)
    assert time_chunk_reads(files, IDS, 6, 1 << 30)[0] == 0
