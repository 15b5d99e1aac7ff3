# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the disk lifecycle tests (sweeper, disk full): a small real
cache over random paged KV, prefixes written and loaded through it, real
size-limited filesystems (tmpfs) and the chunk files vineyard left."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.vineyard_testing import wait_for_writes
from tests.worker.vineyard_cache_testing import (
    BLOCK_SIZE,
    CHUNK_SIZE,
    HEAD_SIZE,
    MAX_NUM_BATCHED_TOKENS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    TestingCache,
    chunk_files,
    make_config,
    make_layout,
    open_llm_cache,
)
from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.digests import extend_digests, synthetic_ids
from vllm.worker.vineyard.transfer.saves import SaveRequest

# The small model of the cache tests (chunks of two blocks), more blocks.
NUM_BLOCKS = 256
#: Where loads go: above every block a prefix is written from.
LOAD_BLOCK = 128


@dataclass
class Harness:
    """A real cache (backend processes and all) over random paged KV in the
    CPU layout ``[num_blocks, heads, block_size, 2 * head_size]`` per layer,
    with every layer in one allocation as vLLM's CPU worker has it."""

    cache: TestingCache
    kv: torch.Tensor  # [num_layers, num_blocks, heads, block, 2 * head]
    _baseline: dict[str, int] = field(default_factory=dict)
    _next_req: int = 0

    @property
    def files(self) -> ChunkFiles:
        return self.cache.files

    @staticmethod
    def digests(tokens: Sequence[int]) -> list[bytes]:
        return extend_digests([], tokens, BLOCK_SIZE)

    def chunk_ids(self, tokens: Sequence[int], num_chunks: int) -> list[int]:
        """The vineyard ids up to the end of chunk ``num_chunks - 1``."""
        return synthetic_ids(self.digests(tokens))[: num_chunks * 2]

    def chunk_path(self, tokens: Sequence[int], chunk: int) -> str:
        return self.files.path(self.chunk_ids(tokens, chunk + 1))

    def write(self, tokens: Sequence[int], max_saves: int = 50) -> None:
        """Save every whole chunk of ``tokens`` (from blocks 0, 1, ...) and
        wait for the writes; a failed write is retried by the next save, up
        to ``max_saves`` saves in all."""
        self._next_req += 1
        req = SaveRequest(
            f"req-{self._next_req}",
            self.digests(tokens),
            len(tokens),
            list(range(-(-len(tokens) // BLOCK_SIZE))),
        )
        for _ in range(max_saves):
            if not self.cache.save([req]):
                break
            self.wait()
        self.cache.saves.release(req.req_id)

    def write_whole(self, tokens: Sequence[int], timeout_s: float = 30.0) -> None:
        """Write ``tokens`` until all their whole chunks load: chunks a
        write skipped for want of room are written again once the
        sweeper's background pass made it."""
        whole = len(tokens) // CHUNK_SIZE * CHUNK_SIZE
        deadline = time.monotonic() + timeout_s
        self.write(tokens)
        while self.load(tokens) < whole:
            assert time.monotonic() < deadline, "no room made for the write"
            time.sleep(0.05)
            self.write(tokens)

    def wait(self, timeout_s: float = 30.0) -> None:
        wait_for_writes(self.cache, timeout_s)

    def load(self, tokens: Sequence[int]) -> int:
        """Load the whole chunks of ``tokens`` into blocks from
        :data:`LOAD_BLOCK` on; returns the tokens loaded, after checking
        that every loaded block holds exactly the bytes it was written
        from."""
        end = len(tokens) // CHUNK_SIZE * CHUNK_SIZE
        num_blocks = end // BLOCK_SIZE
        dst = list(range(LOAD_BLOCK, LOAD_BLOCK + num_blocks))
        self.kv[:, dst] = 0
        loaded = self.cache.load(self.digests(tokens), 0, end, dst)
        n = loaded // BLOCK_SIZE
        got = self.kv[:, LOAD_BLOCK : LOAD_BLOCK + n].contiguous().view(torch.uint8)
        want = self.kv[:, :n].contiguous().view(torch.uint8)
        assert torch.equal(got, want), "loaded KV differs from what was written"
        return loaded

    def counters(self) -> dict[str, int]:
        """Counters since the last :meth:`reset_counters`."""
        totals = self.cache.metrics.snapshot()
        return {k: v - self._baseline.get(k, 0) for k, v in totals.items()}

    def reset_counters(self) -> None:
        self._baseline = self.cache.metrics.snapshot()

    def poll_stats(self) -> None:
        """Ask the writer for its (and its sweeper's) counts now."""
        self.cache.saves.poll_stats()


def open_cache(root: Path, seed: int = 0, **config_fields: Any) -> Harness:
    """A cache at ``root``; ``config_fields`` override config fields."""
    shape = (NUM_LAYERS, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape, generator=gen, dtype=torch.float32)
    config = make_config(
        root,
        **{
            "cpu_mem_limit_gb": 0.25,
            "backend_timeout_s": 20.0,
            "max_inflight_tasks": 1,
            **config_fields,
        },
    )
    layout = make_layout(kv, chunk_size=CHUNK_SIZE, model="lifecycle-test")
    cache = open_llm_cache(config, layout, kv, MAX_NUM_BATCHED_TOKENS)
    return Harness(cache, kv)


def chunk_file_bytes(files: ChunkFiles, num_chunks: int) -> int:
    """The size of a complete chunk file that ends at chunk ``num_chunks``."""
    return files.file_bytes(num_chunks * files.blocks_per_chunk)


def partial_chunk_files(files: ChunkFiles) -> list[str]:
    """Chunk files (not empty placeholders) whose size is not what their
    header says a complete chunk has: a write cut short. (Files a
    sweeper evicts during the walk are not.)"""
    bad = []
    for path in chunk_files(files.namespace_dir):
        try:
            size = os.path.getsize(path)
            if size == 0:
                continue
            with open(path, "rb") as f:
                head = f.read(4)
        except FileNotFoundError:
            continue
        n = int.from_bytes(head, "little") if len(head) == 4 else -1
        if size != files.file_bytes(n):
            bad.append(path)
    return bad


def dir_bytes(root: str | os.PathLike[str]) -> int:
    """Bytes of the chunk files under ``root`` (temp files excluded)."""
    total = 0
    for path in chunk_files(root):
        with contextlib.suppress(OSError):
            total += os.path.getsize(path)
    return total


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted at ``path`` (a real filesystem that
    returns ENOSPC when full); unmounted on exit. Needs root: raises
    ``PermissionError`` (with mount's message) when mounting is not
    permitted."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        raise PermissionError("no mount command")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs",
         str(path)],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise PermissionError(f"mount -t tmpfs failed: {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)
