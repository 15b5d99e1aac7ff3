# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""With no chunk size set, a root's chunks hold as many blocks as its round
trip asks for, chosen once and recorded in the root so every instance on it
agrees (the chunk size is part of the namespace)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.script_testing import mount_slow_fs
from vllm.worker.vineyard.storage import chunking
from vllm.worker.vineyard.storage.chunking import (
    blocks_for_round_trip,
    blocks_per_chunk_of,
)
from vllm.worker.vineyard.storage.root_files import CHUNKING


@pytest.mark.parametrize(
    "round_trip_ms,blocks",
    [(0.02, 1), (0.9, 1), (1.0, 2), (3.0, 2), (5.0, 4), (20.0, 8)],
)
def test_blocks_for_round_trip(round_trip_ms: float, blocks: int) -> None:
    assert blocks_for_round_trip(round_trip_ms / 1e3) == blocks


def test_a_local_root_keeps_one_block_and_records_it(tmp_path: Path) -> None:
    assert blocks_per_chunk_of(str(tmp_path)) == 1
    assert (tmp_path / CHUNKING).exists()


def test_the_first_choice_recorded_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunking, "measure_round_trip", lambda root: 0.010)
    assert blocks_per_chunk_of(str(tmp_path)) == 4
    # Another instance, nearer: it takes the recorded choice.
    monkeypatch.setattr(chunking, "measure_round_trip", lambda root: 0.0001)
    assert blocks_per_chunk_of(str(tmp_path)) == 4


def test_a_planted_record_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / CHUNKING).write_text('{"blocks_per_chunk": 100000}')
    monkeypatch.setattr(chunking, "measure_round_trip", lambda root: 0.002)
    assert blocks_per_chunk_of(str(tmp_path)) == 2


def test_a_root_a_network_away_is_measured_as_such(tmp_path: Path) -> None:
    """A FUSE root that adds 3 ms to every stat and open (an open through
    it is two or three such calls): chunks of four blocks."""
    fs = mount_slow_fs(tmp_path / "fs", latency_ms=3.0)
    try:
        root = fs.mount / "root"
        root.mkdir()
        assert blocks_per_chunk_of(str(root)) == 4
    finally:
        fs.close()
