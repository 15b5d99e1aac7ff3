# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the vineyard cache tests (the fixtures are in conftest.py).

A :class:`CacheHarness` is a real worker-side cache (a :class:`TestingCache`:
the product's :class:`VineyardLLMCache` plus what only tests drive or read,
with its backend processes) plus the scheduler-side lookup of the same
namespace (:class:`VineyardCacheLookup`), over random paged KV. Tests speak
in token ids; the harness turns them into the chained block digests that
the product uses.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from tests.vineyard_testing import (
    random_tokens,
    resume_processes,
    wait_for_writes,
    wait_until,
)
from vllm.worker.vineyard.backend.protocol import (
    BackendError,
    BackendSettings,
    StatsRequest,
)
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector.lookups import VineyardCacheLookup
from vllm.worker.vineyard.storage.digests import (
    extend_digests,
    key_id,
    load_auth_key,
    synthetic_ids,
)
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.storage.namespaces import MANIFEST, TEMP_DIR
from vllm.worker.vineyard.storage.root_files import is_root_file
from vllm.worker.vineyard.transfer.saves import SaveRequest
from vllm.worker.vineyard_llm_cache import VineyardLLMCache, _PinnedTensorPool

# A small model: fast to write, several chunks per sequence.
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 16
BLOCK_SIZE = 16
CHUNK_SIZE = 32
NUM_BLOCKS = 160
MAX_NUM_BATCHED_TOKENS = 128


def default_settings() -> BackendSettings:
    """A backend's settings as the config has them by default."""
    return BackendSettings.from_config(VineyardLLMCacheConfig())


class TestingPool(_PinnedTensorPool):
    """The staging pool with the counts its tests check."""

    __test__ = False  # not a test class, though named like one

    @property
    def num_created(self) -> int:
        return self._num_created

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return self._num_created - len(self._free)


class PoolCounts:
    """What tests read of a cache's staging pool (taken from its free
    count: a buffer not free is in flight)."""

    def __init__(self, pool: _PinnedTensorPool):
        self._pool = pool

    @property
    def max_buffers(self) -> int:
        return self._pool.max_buffers

    @property
    def num_free(self) -> int:
        return self._pool.num_free

    @property
    def num_in_flight(self) -> int:
        return self._pool.max_buffers - self._pool.num_free


class TestingCache(VineyardLLMCache):
    """The cache with what only tests (and the benchmarks) use: a blocking
    :meth:`load`, a save told not to take a buffer, and views of the pool,
    the backends and the resume points."""

    __test__ = False  # not a test class, though named like one

    _blocking_loads = itertools.count()

    def load(
        self,
        digests: Sequence[bytes],
        start: int,
        end: int,
        block_ids: Sequence[int],
    ) -> int:
        """Start a load and wait for it; returns the end of what was loaded
        (less than ``end``: the rest must be recomputed)."""
        req_id = f"__blocking_load_{next(self._blocking_loads)}"
        self.loads.start(req_id, digests, start, end, block_ids)
        self.loads.poll(wait=True)
        results = self.loads.take_finished()
        mine = [r for r in results if r[0] == req_id]
        # Other loads that finished meanwhile are reported as usual.
        self.loads._finished.extend(r for r in results if r[0] != req_id)
        assert mine, "a blocking load did not finish"
        # A reader marks a hit's chunks used once idle; it answers any
        # other request after that: the hit is marked when this returns.
        busy = {id(read.reader) for read in self.loads._in_flight}
        for reader in self.loads._readers:
            if id(reader) not in busy and reader.available:
                with contextlib.suppress(BackendError):  # dead: nothing to mark
                    self.loads._calls.call(reader, StatsRequest())
        return mine[0][1]

    def save(
        self, requests: Sequence[SaveRequest], may_take_buffer: bool = True
    ) -> bool:
        """``may_take_buffer=False`` skips as if the pool were empty (tensor
        parallel peers skipping together)."""
        if may_take_buffer:
            return self.saves.save(requests)
        with mock.patch.object(self._pool, "get", return_value=None):
            return self.saves.save(requests)

    def can_save(self) -> bool:
        """Whether :meth:`save` would find a free buffer and a backend."""
        return (
            not self._closed
            and self._pool.num_free > 0
            and self._writer is not None
            and self._writer.disabled_reason is None
        )

    @property
    def pool(self) -> PoolCounts:
        return PoolCounts(self._pool)

    def backend_pids(self) -> dict[str, int | None]:
        pids = {reader.name: reader.pid for reader in self._readers}
        return pids | {"write": self._writer.pid if self._writer else None}

    @property
    def _resume(self) -> dict[str, tuple[int, int]]:
        """Per request: (the scheduler's save_from, the next token to save)."""
        return self.saves.ledger._resume


@contextlib.contextmanager
def testing_caches() -> Iterator[None]:
    """Connector workers registered within this block build their cache as a
    :class:`TestingCache`."""
    with mock.patch(
        "vllm.worker.vineyard.connector.worker.VineyardLLMCache", TestingCache
    ):
        yield


def random_kv(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    any_bits: bool = True,
) -> torch.Tensor:
    """Random paged KV of all layers in one allocation (as vLLM's CPU
    backend allocates it): ``[num_layers, num_blocks, heads, block_size,
    2 * head_size]``. Random bytes, so every bit pattern (NaNs included)
    must survive the round trip; ``any_bits=False``: normal values (for
    tests that compare with ``torch.equal``)."""
    shape = (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_size)
    gen = torch.Generator().manual_seed(seed)
    if not any_bits:
        return torch.randn(*shape, generator=gen, dtype=dtype)
    element = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.randint(0, 256, (numel * element,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def make_layout(
    kv: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    model: str = "test-model",
    kv_layout: str = "CPU_ATTN",
    key: str = "nokey",
    tp_size: int = 1,
    tp_rank: int = 0,
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
        chunk_size=chunk_size,
        tp_size=tp_size,
        tp_rank=tp_rank,
        key_id=key,
    )


def make_config(root: str | os.PathLike[str], **fields: Any) -> VineyardLLMCacheConfig:
    """The settings of a test cache at ``root``: small chunks, a small
    staging budget and short timeouts; ``fields`` override any field."""
    base: dict[str, Any] = {
        "chunk_size": CHUNK_SIZE,
        "cpu_mem_limit_gb": 1.0,
        "backend_timeout_s": 10.0,
        "drain_timeout_s": 5.0,
        # Every hit is loaded: the tests' fake forward passes cost nothing.
        "load_policy": "always",
    }
    return replace(VineyardLLMCacheConfig(), root=str(root), **{**base, **fields})


_seeds = itertools.count(1000)


def make_tokens(n: int, seed: int | random.Random | None = None) -> list[int]:
    """Random token ids from ``seed`` (a seed or a generator); without one,
    different on every call."""
    if not isinstance(seed, random.Random):
        seed = random.Random(next(_seeds) if seed is None else seed)
    return random_tokens(seed, n)


def whole_chunks(n: int, chunk: int = CHUNK_SIZE) -> int:
    return n // chunk * chunk


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (R, S, T, Z, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped: a stalled backend."""
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: process_state(pid) in ("T", "t")), "did not stop"


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, all its threads included (a killed
    process's main thread is a zombie while its other threads still exit),
    without reaping it (its owner does)."""
    try:
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, pid, flags) is not None
    except ChildProcessError:
        return True  # already reaped


def kill_process(pid: int) -> None:
    """SIGKILL the backend ``pid`` (a child of this process) and wait until
    it has exited: a crash between two calls."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: _exited(pid)), f"pid {pid} did not die"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN payloads included), whatever the dtype."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def chunk_files(root: str | os.PathLike[str]) -> list[str]:
    """The chunk files vineyard published under ``root`` (one per chunk):
    every file outside vineyard's temp folders but the namespace manifest
    and the sweepers' files."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != TEMP_DIR]
        found.extend(
            os.path.join(dirpath, f)
            for f in filenames
            if f != MANIFEST and not is_root_file(f)
        )
    return found


def read_header_ids(path: str) -> list[int]:
    """The ids in a chunk file's header (int32 count ``n``, ``n`` int32)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<i", f.read(4))
        return list(struct.unpack(f"<{n}i", f.read(4 * n)))


def write_header_ids(path: str, ids: Sequence[int]) -> None:
    """Overwrite a chunk file's header ids in place (same count)."""
    assert len(read_header_ids(path)) == len(ids)
    with open(path, "r+b") as f:
        f.seek(4)
        f.write(struct.pack(f"<{len(ids)}i", *ids))


@dataclass
class CacheHarness:
    """A cache, the scheduler lookup of its namespace, and the paged KV it
    reads from and writes to."""

    cache: TestingCache
    lookups: VineyardCacheLookup
    kv: torch.Tensor  # [num_layers, num_blocks, heads, block_size, 2 * head]
    layout: KVCacheLayout
    config: VineyardLLMCacheConfig
    salt: str | None = None
    _baseline: dict[str, int] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def chunk_size(self) -> int:
        return self.cache.layout.chunk_size

    @property
    def namespace_dir(self) -> str:
        return self.cache.files.namespace_dir

    def digests(self, tokens: Sequence[int]) -> list[bytes]:
        return extend_digests([], tokens, self.block_size, self.salt)

    def ids(self, tokens: Sequence[int]) -> list[int]:
        return synthetic_ids(self.digests(tokens))

    def chunk_path(self, tokens: Sequence[int], chunk: int) -> str:
        """The file of chunk ``chunk`` (0-based) of ``tokens``."""
        bpc = self.layout.blocks_per_chunk
        return self.cache.files.path(self.ids(tokens)[: (chunk + 1) * bpc])

    def blocks_for(self, first_block: int, num_tokens: int) -> list[int]:
        """Contiguous block ids covering ``num_tokens`` tokens."""
        count = -(-num_tokens // self.block_size)
        return list(range(first_block, first_block + count))

    def request(
        self,
        req_id: str,
        tokens: Sequence[int],
        num_computed: int,
        blocks: Sequence[int],
        save_from: int = 0,
    ) -> SaveRequest:
        return SaveRequest(
            req_id, self.digests(tokens), num_computed, list(blocks), save_from
        )

    def save_tokens(
        self,
        tokens: Sequence[int],
        first_block: int,
        req_id: str = "req",
        num_computed: int | None = None,
    ) -> list[int]:
        """Save a request whose KV sits in blocks from ``first_block`` (all of
        ``tokens`` computed unless ``num_computed`` says otherwise), to the
        end of its last whole chunk, and release it; returns the blocks."""
        blocks = self.blocks_for(first_block, len(tokens))
        if num_computed is None:
            num_computed = len(tokens)
        self.save_all([self.request(req_id, tokens, num_computed, blocks)])
        self.cache.saves.release(req_id)
        return blocks

    def check_loaded(
        self,
        before: torch.Tensor,
        src: Sequence[int],
        dst: Sequence[int],
        num_blocks: int | None = None,
    ) -> None:
        """The ``dst`` blocks (the first ``num_blocks`` of them, if given)
        now hold the bytes of as many ``src`` blocks in every layer; every
        other block is as it was in ``before``."""
        if num_blocks is not None:
            src, dst = src[:num_blocks], dst[:num_blocks]
        assert len(src) == len(dst)
        assert same_bits(self.kv[:, list(dst)], self.kv[:, list(src)]), (
            "loaded KV differs"
        )
        untouched = sorted(set(range(self.kv.shape[1])) - set(dst))
        assert same_bits(self.kv[:, untouched], before[:, untouched]), "stray write"

    def lookup(self, tokens: Sequence[int], num_local: int = 0) -> tuple[int, int]:
        """The scheduler's lookup: ``(num_hit_tokens, save_from)``."""
        return self.lookups.lookup(self.digests(tokens), num_local, len(tokens))

    def load(
        self, tokens: Sequence[int], start: int, end: int, blocks: Sequence[int]
    ) -> int:
        return self.cache.load(self.digests(tokens), start, end, blocks)

    def reads_at_once(self, start: int, end: int) -> int:
        """How many segments of a load of tokens ``[start, end)`` the
        readers read at once when it starts (each stops at its first bad
        chunk, so a load of bad chunks finds this many)."""
        blocks = -(-(end - start) // self.block_size)
        segments = -(-blocks // self.cache.loads._segment_blocks)
        return min(self.cache.num_readers, segments)

    def save_all(self, requests: Sequence[SaveRequest], timeout_s: float = 30.0) -> int:
        """Save until nothing is pending (a buffer holds one step's worth);
        returns how many tasks were submitted."""
        for submitted in range(1000):
            self.wait(timeout_s)
            if not self.cache.save(requests):
                self.wait(timeout_s)
                return submitted
        raise AssertionError("save() never ran out of pending chunks")

    def wait(self, timeout_s: float = 30.0) -> None:
        """Wait until no update is in flight (every buffer is back)."""
        wait_for_writes(self.cache, timeout_s)

    def pid(self, role: str) -> int:
        """The pid of the ``read`` or ``write`` backend."""
        pid = self.cache.backend_pids()[role]
        assert pid is not None, f"no {role} backend"
        return pid

    def reader_stats(self) -> None:
        """Collect the readers' counters now (they come with their
        replies)."""
        for reader in self.cache._readers:
            reply = reader.call(StatsRequest())
            self.cache.metrics.record(reply.stats.counters)

    def counters(self) -> dict[str, int]:
        """Counters of the cache and its lookup since the last
        :meth:`reset_counters`."""
        totals = self._totals()
        return {k: v - self._baseline.get(k, 0) for k, v in totals.items()}

    def _totals(self) -> dict[str, int]:
        totals = self.cache.metrics.snapshot()
        for k, v in self.lookups.metrics.snapshot().items():
            totals[k] += v
        return totals

    def reset_counters(self) -> None:
        self._baseline = self._totals()

    def close(self) -> None:
        # Let a backend that a test stopped (SIGSTOP) go before closing.
        resume_processes(self.cache.backend_pids().values())
        self.cache.close()


def open_llm_cache(
    config: VineyardLLMCacheConfig,
    layout: KVCacheLayout,
    kv: torch.Tensor,
    max_num_batched_tokens: int,
) -> TestingCache:
    """A worker-side cache (backend processes and all) over ``kv``, every
    layer in one allocation as vLLM's CPU worker has it: ``[num_layers,
    num_blocks, heads, block_size, 2 * head_size]``."""
    return TestingCache(
        config,
        layout,
        max_num_batched_tokens,
        kv_caches=[kv[i] for i in range(kv.shape[0])],
        num_blocks=kv.shape[1],
    )


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
    salt: str | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    **config_fields: Any,
) -> CacheHarness:
    """A CPU cache on the real file backend at ``root`` over random paged KV.

    ``config_fields`` override :class:`VineyardLLMCacheConfig` fields
    (``chunk_size``, ``max_inflight_tasks``, ``auth_key_file``, ...).
    """
    kv = random_kv(
        num_layers, num_blocks, num_kv_heads, block_size, head_size, dtype, seed
    )
    config = make_config(root, **config_fields)
    layout = make_layout(
        kv,
        chunk_size=config.chunk_size,
        model=model,
        kv_layout=kv_layout,
        key=key_id(load_auth_key(config.auth_key_file)),
        tp_size=tp_size,
        tp_rank=tp_rank,
    )
    cache = open_llm_cache(config, layout, kv, max_num_batched_tokens)
    return CacheHarness(
        cache, VineyardCacheLookup(config, [layout]), kv, layout, config, salt
    )


CacheFactory = Callable[..., CacheHarness]


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
