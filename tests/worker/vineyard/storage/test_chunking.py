# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""With no chunk size set, a root's chunks hold as many tokens as its round
trip asks for, in whole blocks, chosen once and recorded in the root so every
instance on it agrees (the chunk size is part of the namespace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.script_testing import mount_slow_fs
from vllm.worker.vineyard.storage import chunking
from vllm.worker.vineyard.storage.chunking import blocks_per_chunk_of
from vllm.worker.vineyard.storage.root_files import CHUNKING


@pytest.mark.parametrize(
    "round_trip_ms,block_size,blocks",
    [
        (0.02, 16, 1), (0.9, 16, 1), (1.0, 16, 2), (3.0, 16, 2), (5.0, 16, 4),
        (20.0, 16, 8),
        # vLLM's CPU backend: blocks of 128 tokens already hold the most
        # tokens a chunk takes (8 would cache nothing of shorter prompts).
        (0.02, 128, 1), (5.0, 128, 1), (20.0, 128, 1), (20.0, 32, 4),
    ],
)  # fmt: skip
def test_blocks_for_round_trip(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    round_trip_ms: float,
    block_size: int,
    blocks: int,
) -> None:
    monkeypatch.setattr(
        chunking, "measure_round_trip", lambda root: round_trip_ms / 1e3
    )
    assert blocks_per_chunk_of(str(tmp_path), block_size) == blocks


def test_the_record_is_in_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root chosen by an instance with 16-token blocks: one with
    128-token blocks takes the same tokens per chunk, not the same blocks."""
    monkeypatch.setattr(chunking, "measure_round_trip", lambda root: 0.010)
    assert blocks_per_chunk_of(str(tmp_path), 16) == 4
    assert blocks_per_chunk_of(str(tmp_path), 128) == 1
    assert blocks_per_chunk_of(str(tmp_path), 32) == 2


def test_an_earlier_versions_record_in_blocks_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways: an earlier version's record (blocks only) is honoured, and
    a record made now says its blocks too, for an earlier version."""
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / CHUNKING).write_text('{"blocks_per_chunk": 2}')
    assert blocks_per_chunk_of(str(tmp_path / "old"), 16) == 2
    monkeypatch.setattr(chunking, "measure_round_trip", lambda root: 0.010)
    blocks_per_chunk_of(str(tmp_path), 16)
    record = json.loads((tmp_path / CHUNKING).read_text())
    assert (record["chunk_tokens"], record["blocks_per_chunk"]) == (64, 4)


def test_a_local_root_keeps_one_block_and_records_it(tmp_path: Path) -> None:
    assert blocks_per_chunk_of(str(tmp_path), 16) == 1
    assert (tmp_path / CHUNKING).exists()


def test_the_first_choice_recorded_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunking, "measure_round_trip", lambda root: 0.010)
    assert blocks_per_chunk_of(str(tmp_path), 16) == 4
    # Another instance, nearer: it takes the recorded choice.
    monkeypatch.setattr(chunking, "measure_round_trip", lambda root: 0.0001)
    assert blocks_per_chunk_of(str(tmp_path), 16) == 4


def test_a_planted_record_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / CHUNKING).write_text('{"chunk_tokens": 100000000}')
    monkeypatch.setattr(chunking, "measure_round_trip", lambda root: 0.002)
    assert blocks_per_chunk_of(str(tmp_path), 16) == 2


def test_a_root_a_network_away_is_measured_as_such(tmp_path: Path) -> None:
    """A FUSE root that adds 3 ms to every stat and open (an open through
    it is two or three such calls): chunks of four blocks."""
    fs = mount_slow_fs(tmp_path / "fs", latency_ms=3.0)
    try:
        root = fs.mount / "root"
        root.mkdir()
        assert blocks_per_chunk_of(str(root), 16) == 4
    finally:
        fs.close()
