# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The core benchmarks' harness: an 8B-class KV layout (:class:`Size`), a
``VineyardLLMCache`` over it with its real backends (:class:`Bench`), the
plain-file reference (:func:`plain_files`), one write-then-read pass
(:func:`write_then_read`), and the options and pinning that
``benchmark_core.py`` and ``benchmark_chunk_size.py`` share."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.storage.digests import extend_digests, key_id, load_auth_key
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.transfer.saves import SaveRequest

ROOT = Path(__file__).resolve().parents[2]
# The cache with a blocking load and the pool's counts is the tests' own.
sys.path.insert(0, str(ROOT))

from tests.worker.vineyard_cache_testing import TestingCache  # noqa: E402

GB = 1e9


@dataclass(frozen=True)
class Size:
    num_layers: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16
    chunk_size: int = 16  # the default: one block per chunk (file)
    num_tokens: int = 2048  # one prompt, written and read as a whole
    step_tokens: int = 1024  # max_num_batched_tokens: one save's tokens
    iters: int = 5
    run_saves: int = 300  # the long run of saves (c), one per step
    run_gap_s: float = 0.03  # between them: the rest of a forward pass
    #: From the cache's start to the run's first save: an engine's startup
    #: after it opens the cache (``vllm serve`` takes about 3 s here).
    run_startup_s: float = 1.0


TINY = Size(num_layers=4, num_kv_heads=2, head_size=64, chunk_size=16,
            num_tokens=512, step_tokens=256, iters=3, run_saves=30)  # fmt: skip


class Bench:
    """A cache over random paged KV laid out as vLLM's CPU backend lays it
    out: all layers in one allocation, ``[layers, blocks, heads, block,
    2 * head]``; the first half of the blocks are saved, loads go to the
    second half."""

    def __init__(
        self,
        size: Size,
        root: str,
        key_file: str = "",
        max_inflight_tasks: int = 2,
        readers: int = 0,
    ):
        self.size = size
        s = size
        self.blocks = s.num_tokens // s.block_size
        dtype = getattr(torch, s.dtype)
        shape = (s.num_layers, 2 * self.blocks, s.num_kv_heads, s.block_size,
                 2 * s.head_size)  # fmt: skip
        self.kv = torch.randn(shape).to(dtype)
        self.layout = KVCacheLayout(
            model="benchmark-8b-class",
            dtype=s.dtype,
            num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads,
            head_size=s.head_size,
            block_size=s.block_size,
            block_bytes=self.kv[0, 0].numel() * self.kv.element_size(),
            kv_layout="CPU_ATTN",
            chunk_size=s.chunk_size,
            key_id=key_id(load_auth_key(key_file)),
        )
        self.config = replace(
            VineyardLLMCacheConfig(),
            root=root,
            chunk_size=s.chunk_size,
            auth_key_file=key_file,
            cpu_mem_limit_gb=8.0,
            max_inflight_tasks=max_inflight_tasks,
            backend_timeout_s=120.0,
            readers=readers,
            metrics_enabled=True,  # the load's phases (read, verify, copy)
        )
        self.cache = TestingCache(
            self.config,
            self.layout,
            s.step_tokens,
            kv_caches=[self.kv[i] for i in range(s.num_layers)],
            num_blocks=2 * self.blocks,
        )
        self.prompt_bytes = self.blocks * self.layout.entry_bytes
        self._seed = 0
        #: The last load's phases (seconds): the reader's read and verify,
        #: the copy into the KV blocks, the whole load.
        self.load_phases: dict[str, float] = {}

    def new_prompt(self) -> list[bytes]:
        """Digests of a prompt no one has written yet."""
        self._seed += 1
        gen = torch.Generator().manual_seed(self._seed)
        tokens = torch.randint(3, 32000, (self.size.num_tokens,), generator=gen)
        return extend_digests([], tokens.tolist(), self.size.block_size)

    def wait_idle(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.cache.pool.num_in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError("background writes did not finish")
            time.sleep(0.0005)

    def save(self, digests: list[bytes], tag: str) -> float:
        """Write the prompt (one save per step's worth of tokens) and wait
        for the writes; returns the seconds from the first save on."""
        n = self.size.num_tokens
        req = SaveRequest(tag, digests, n, list(range(self.blocks)))
        written = self.cache.metrics.snapshot()["tokens_written"]
        start = time.perf_counter()
        for _ in range(-(-n // self.size.step_tokens)):
            while not self.cache.can_save():
                time.sleep(0.0005)
            self.cache.save([req])
        self.wait_idle()
        elapsed = time.perf_counter() - start
        self.cache.saves.release(tag)
        got = self.cache.metrics.snapshot()["tokens_written"] - written
        if got != n:
            raise RuntimeError(f"wrote {got} of {n} tokens")
        return elapsed

    def load(self, digests: list[bytes]) -> float:
        n = self.size.num_tokens
        dst = list(range(self.blocks, 2 * self.blocks))
        self.cache.metrics.take()
        start = time.perf_counter()
        loaded = self.cache.load(digests, 0, n, dst)
        elapsed = time.perf_counter() - start
        if loaded != n:
            raise RuntimeError(f"loaded {loaded} of {n} tokens")
        seen = self.cache.metrics.take()
        self.load_phases = {
            phase: sum(seen[f"load_{phase}_s"]) for phase in ("read", "verify", "copy")
        }
        self.load_phases["load"] = elapsed
        return elapsed

    def loaded_exact(self) -> bool:
        b = self.blocks
        src, dst = self.kv[:, :b], self.kv[:, b:]
        return torch.equal(src.view(torch.uint8), dst.view(torch.uint8))

    def close(self) -> None:
        self.cache.close()


def median_time(fn: Callable[[], float], iters: int) -> float:
    return statistics.median(fn() for _ in range(iters))


def plain_files(b: Bench, directory: str, iters: int) -> tuple[float, float]:
    """Seconds to ``writev`` + ``fdatasync`` the prompt's bytes (header,
    entries) to one new file per chunk, and to ``readv`` them back."""
    os.makedirs(directory, exist_ok=True)
    bpc = b.layout.blocks_per_chunk
    entry = b.layout.entry_bytes
    chunks = b.blocks // bpc
    payload = torch.empty(chunks, bpc * entry, dtype=torch.uint8)
    payload.view(-1)[:] = 1  # touched
    into = torch.zeros_like(payload)
    views = [payload[c].numpy().data for c in range(chunks)]
    into_views = [into[c].numpy().data for c in range(chunks)]
    counter = [0]

    def write() -> float:
        counter[0] += 1
        start = time.perf_counter()
        for c in range(chunks):
            header = bytes(4 + 4 * (c + 1) * bpc)
            path = os.path.join(directory, f"{counter[0]}-{c}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.writev(fd, [header, views[c]])
                os.fdatasync(fd)
            finally:
                os.close(fd)
        return time.perf_counter() - start

    def read() -> float:
        start = time.perf_counter()
        for c in range(chunks):
            header = bytearray(4 + 4 * (c + 1) * bpc)
            fd = os.open(os.path.join(directory, f"1-{c}"), os.O_RDONLY)
            try:
                os.readv(fd, [header, into_views[c]])
            finally:
                os.close(fd)
        return time.perf_counter() - start

    write_s = median_time(write, iters)
    read()  # the page cache holds file 1 now; warm the path once more
    return write_s, median_time(read, iters)


def write_then_read(
    b: Bench,
) -> tuple[list[list[bytes]], float, list[dict[str, float]]]:
    """Write ``iters`` new prompts, then load the first one ``iters`` times
    after a warm-up load (the page cache, the read path): the prompts, the
    median write's seconds, and each timed load's phases."""
    prompts = [b.new_prompt() for _ in range(b.size.iters)]
    write_s = statistics.median(b.save(p, f"w{i}") for i, p in enumerate(prompts))
    b.load(prompts[0])
    phases = []
    for _ in range(b.size.iters):
        b.load(prompts[0])
        phases.append(b.load_phases)
    return prompts, write_s, phases


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """The options this script shares with ``benchmark_chunk_size.py``."""
    parser.add_argument("--tiny", action="store_true", help="small sizes (CI)")
    parser.add_argument("--tokens", type=int, help="prompt tokens (default 2048)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--workdir", help="cache roots and files (default: temp)")


def size_of(args: argparse.Namespace) -> Size:
    size = TINY if args.tiny else Size()
    return replace(size, num_tokens=args.tokens) if args.tokens else size


def pin_like_a_forward_pass() -> None:
    """This process on one core and one thread, like a forward pass (the
    cache's backends move to the other cores)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
