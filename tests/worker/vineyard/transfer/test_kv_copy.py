# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Blocks of every layer into staging entries and back, for each way the
copier has: one indexed copy over all layers (vLLM's CPU allocation), one
copy per layer (layers apart), and the staged path CUDA takes (groups of
whole entries through a scratch; here on the CPU, without streams), with a
scratch smaller than the copy so that it runs in several groups."""

from __future__ import annotations

import pytest
import torch

from vllm.worker.vineyard.transfer.kv_copy import KVBlockCopier, block_runs

NUM_LAYERS = 3
NUM_BLOCKS = 16
BLOCK_SHAPE = (4, 2, 8)  # tokens, heads, head size (K and V below)
TRAILER = 5  # elements after an entry's payload, the backend's


def kv_caches(layout: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if layout == "one allocation":  # vLLM's CPU worker: [layers, blocks, ...]
        kv = torch.randn((NUM_LAYERS, NUM_BLOCKS, 2, *BLOCK_SHAPE), generator=gen)
        return list(kv.unbind(0))
    if layout == "layers apart":
        return [
            torch.randn((NUM_BLOCKS, 2, *BLOCK_SHAPE), generator=gen)
            for _ in range(NUM_LAYERS)
        ]
    # FlashAttention's [2, num_blocks, ...]: the block dimension second
    return [
        torch.randn((2, NUM_BLOCKS, *BLOCK_SHAPE), generator=gen)
        for _ in range(NUM_LAYERS)
    ]


def block_bytes() -> int:
    return 2 * BLOCK_SHAPE[0] * BLOCK_SHAPE[1] * BLOCK_SHAPE[2] * 4


def entry_of(kvs: list[torch.Tensor], block: int) -> torch.Tensor:
    """An entry's payload as the storage format has it: the block's bytes
    of each layer in turn."""
    parts = []
    for kv in kvs:
        view = kv if kv.shape[0] == NUM_BLOCKS else kv.transpose(0, 1)
        parts.append(view[block].reshape(-1))
    return torch.cat(parts)


@pytest.mark.parametrize("layout", ["one allocation", "layers apart", "block second"])
@pytest.mark.parametrize("staged, scratch_entries", [(False, 0), (True, 2), (True, 64)])
@pytest.mark.parametrize(
    "targets",
    [[1, 3, 4, 12, 14], [10, 11, 12, 13, 14], [6, 5, 4, 3, 2]],
    ids=["a run of two", "one run", "descending"],
)
def test_gather_then_scatter_round_trip(
    layout: str, staged: bool, scratch_entries: int, targets: list[int]
) -> None:
    kvs = kv_caches(layout)
    payload = NUM_LAYERS * block_bytes() // 4
    width = payload + TRAILER
    copier = KVBlockCopier(
        kvs,
        NUM_BLOCKS,
        block_bytes(),
        staged=staged,
        scratch_bytes=scratch_entries * width * 4,
    )
    blocks = [9, 2, 15, 0, 7] if targets[0] != 10 else [5, 6, 7, 8, 0]
    entries = torch.full((len(blocks), width), -1.0)
    assert copier.gather(blocks, entries) is None  # no event off CUDA
    for row, block in enumerate(blocks):
        assert torch.equal(entries[row, :payload], entry_of(kvs, block))

    # Back into other blocks of a cache that holds something else.
    before = [entry_of(kvs, b) for b in range(NUM_BLOCKS)]
    copier.scatter(entries, targets)
    for block in range(NUM_BLOCKS):
        if block in targets:
            expected = before[blocks[targets.index(block)]]
        else:
            expected = before[block]
        assert torch.equal(entry_of(kvs, block), expected), block


def test_the_staged_path_copies_whole_entries_in_groups() -> None:
    """With a scratch of two entries, five blocks go in three groups, and an
    empty copy does nothing."""
    kvs = kv_caches("layers apart")
    width = NUM_LAYERS * block_bytes() // 4 + TRAILER
    copier = KVBlockCopier(
        kvs, NUM_BLOCKS, block_bytes(), staged=True, scratch_bytes=2 * width * 4
    )
    entries = torch.zeros((5, width))
    index = torch.arange(5)
    groups = [rows for rows, _ in copier._groups(index, entries)]
    assert groups == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert copier.gather([], entries[:0]) is None
    assert copier.scatter(entries[:0], []) is None


def test_block_runs_split_ids_into_consecutive_runs() -> None:
    assert block_runs([]) == []
    assert block_runs([7]) == [(0, 7, 1)]
    assert block_runs([1, 3, 4, 5, 12, 13]) == [(0, 1, 1), (1, 3, 3), (4, 12, 2)]
    assert block_runs([6, 5, 4]) == [(0, 6, 1), (1, 5, 1), (2, 4, 1)]
