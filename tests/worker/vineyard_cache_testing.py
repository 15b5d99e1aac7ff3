# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the vineyard cache tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from vllm.worker.vineyard_llm_cache import (
    KVCacheLayout,
    SaveRequest,
    VineyardLLMCache,
    VineyardLLMCacheConfig,
)

# A small model: fast to write, several chunks per sequence.
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 16
BLOCK_SIZE = 16
CHUNK_SIZE = 32
NUM_BLOCKS = 160
MAX_NUM_BATCHED_TOKENS = 128


def random_kv(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> torch.Tensor:
    """Random paged KV of all layers in one allocation (as vLLM's CPU
    backend allocates it): ``[num_layers, num_blocks, heads, block_size,
    2 * head_size]``. Random bytes, so every bit pattern (NaNs included)
    must survive the round trip."""
    shape = (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_size)
    element = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for dim in shape:
        numel *= dim
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * element,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def make_layout(
    kv: torch.Tensor, model: str = "test-model", kv_layout: str = "CPU_ATTN"
) -> KVCacheLayout:
    """The layout of KV made by :func:`random_kv`."""
    num_layers, _, num_kv_heads, block_size, two_head = kv.shape
    return KVCacheLayout(
        model=model,
        dtype=str(kv.dtype).removeprefix("torch."),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=two_head // 2,
        block_size=block_size,
        block_bytes=kv[0, 0].numel() * kv.element_size(),
        kv_layout=kv_layout,
    )


_seeds = itertools.count(1000)


def make_tokens(n: int, seed: int | None = None) -> list[int]:
    """Random token ids; without a seed, different on every call."""
    rng = random.Random(next(_seeds) if seed is None else seed)
    return [rng.randrange(32000) for _ in range(n)]


def whole_chunks(n: int, chunk: int = CHUNK_SIZE) -> int:
    return n // chunk * chunk


@dataclass
class CacheHarness:
    """A cache plus the paged KV it reads from and writes to."""

    cache: VineyardLLMCache
    kv: torch.Tensor  # [num_layers, num_blocks, heads, block_size, 2 * head]
    layout: KVCacheLayout
    config: VineyardLLMCacheConfig
    _baseline: dict[str, int] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def chunk_size(self) -> int:
        return self.cache.chunk_size

    def blocks_for(self, first_block: int, num_tokens: int) -> list[int]:
        """Contiguous block ids covering ``num_tokens`` tokens."""
        count = -(-num_tokens // self.block_size)
        return list(range(first_block, first_block + count))

    def save_all(self, requests: Sequence[SaveRequest], timeout_s: float = 30.0) -> int:
        """Save until nothing is pending (a buffer holds one step's worth);
        returns how many tasks were submitted."""
        for submitted in range(1000):
            assert self.cache.wait_for_updates(timeout_s), "updates did not finish"
            if not self.cache.save(requests):
                return submitted
        raise AssertionError("save() never ran out of pending chunks")

    def wait(self, timeout_s: float = 30.0) -> None:
        assert self.cache.wait_for_updates(timeout_s), "updates did not finish"

    def counters(self) -> dict[str, int]:
        """Counters since the last :meth:`reset_counters`."""
        totals = self.cache.metrics.snapshot()
        return {k: v - self._baseline.get(k, 0) for k, v in totals.items()}

    def reset_counters(self) -> None:
        self._baseline = self.cache.metrics.snapshot()

    def close(self) -> None:
        # Let a backend that a test stopped (SIGSTOP) go before closing.
        for backend in (self.cache._reader, self.cache._writer):
            pid = backend.pid if backend is not None else None
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        self.cache.close()


def build_cache(
    root: Path,
    *,
    dtype: torch.dtype = torch.float32,
    num_layers: int = NUM_LAYERS,
    num_blocks: int = NUM_BLOCKS,
    block_size: int = BLOCK_SIZE,
    num_kv_heads: int = NUM_KV_HEADS,
    head_size: int = HEAD_SIZE,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    model: str = "test-model",
    kv_layout: str = "CPU_ATTN",
    seed: int = 0,
    **config_fields: Any,
) -> CacheHarness:
    """A CPU cache on the real file backend at ``root`` over random paged KV.

    ``config_fields`` override :class:`VineyardLLMCacheConfig` fields
    (``chunk_size``, ``max_inflight_tasks``, ...).
    """
    kv = random_kv(
        num_layers, num_blocks, num_kv_heads, block_size, head_size, dtype, seed
    )
    fields: dict[str, Any] = {
        "root": str(root),
        "chunk_size": CHUNK_SIZE,
        "cpu_mem_limit_gb": 1.0,
        "backend_timeout_s": 10.0,
        "drain_timeout_s": 5.0,
    }
    fields.update(config_fields)
    config = replace(VineyardLLMCacheConfig(), **fields)
    layout = make_layout(kv, model=model, kv_layout=kv_layout)
    cache = VineyardLLMCache(
        config,
        layout,
        max_num_batched_tokens,
        kv_caches=[kv[i] for i in range(num_layers)],
        num_blocks=num_blocks,
    )
    return CacheHarness(cache, kv, layout, config)


CacheFactory = Callable[..., CacheHarness]


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (R, S, T, Z, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: a stalled backend."""
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: process_state(pid) in ("T", "t")), "did not stop"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN payloads included), whatever the dtype."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def chunk_files(root: str) -> list[str]:
    """The chunk files vineyard published under ``root`` (one per chunk)."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__temp"]
        found.extend(os.path.join(dirpath, f) for f in filenames)
    return found


#: A cache whose writes are slow enough to see (32 layers, 32 KiB of KV per
#: token, 32 MiB per update buffer: a write takes ~100 ms or more here).
LARGE_CACHE: dict[str, Any] = {
    "num_layers": 32,
    "head_size": 64,
    "block_size": 16,
    "chunk_size": 256,
    "max_num_batched_tokens": 1024,
    "cpu_mem_limit_gb": 1.0,
}
LARGE_STEP_TOKENS = 1024
