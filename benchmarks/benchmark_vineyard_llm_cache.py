# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Side-by-side benchmark of the vineyard KV cache (vllm/worker).

Part ``core`` drives :class:`VineyardLLMCache` directly with synthetic paged KV
caches of a realistic shape (default: an 8B-class model, 32 layers, 8 KV heads,
head size 128, bfloat16, CPU block size 128, chunk 256) and prints, in one run:

1. The caller's (forward thread's) time per update: async ``save()`` vs sync
   ``save()`` (waits for the write) vs one plain memcpy of the same bytes, with
   the target "async <= 1.5x memcpy" as PASS/FAIL.
2. The backend's write and read throughput (GB/s, 1 GB = 1e9 bytes).
3. The skip rate versus ``max_inflight_tasks`` under a fixed arrival rate of
   updates, with the caller's p50/p99 ``save()`` time (it never blocks).

Every result is kept in one dict (``--json PATH`` dumps it), keyed by part, so
that further parts (e.g. whole-engine runs, a plot) can be added to
:data:`PARTS` without changing the others.

Examples::

    python benchmarks/benchmark_vineyard_llm_cache.py            # full, ~2 min
    python benchmarks/benchmark_vineyard_llm_cache.py --tiny     # CI, < 30 s
    python benchmarks/benchmark_vineyard_llm_cache.py --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from vllm.worker.vineyard_llm_cache import (
    KVCacheLayout,
    SaveRequest,
    VineyardLLMCache,
    VineyardLLMCacheConfig,
)

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30
TARGET_CALLER_RATIO = 1.5  # design.md: caller time per update <= 1.5x memcpy

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

# --------------------------------------------------------------------------
# Options.
# --------------------------------------------------------------------------

#: Defaults of the full run, and of ``--tiny`` (CI: finishes in < 30 s).
FULL_DEFAULTS: dict[str, Any] = {
    "num_layers": 32,
    "num_kv_heads": 8,
    "head_size": 128,
    "block_size": 128,
    "chunk_size": 256,
    "num_tokens": [512, 2048],
    "iters": 7,
    "warmup": 1,
    "write_batch": 4,
    "read_iters": 3,
    "skip_inflight": [1, 2, 4, 8],
    "skip_tokens": 512,
    "skip_steps": 40,
}
TINY_DEFAULTS: dict[str, Any] = {
    "num_layers": 4,
    "num_kv_heads": 2,
    "head_size": 64,
    "block_size": 16,
    "chunk_size": 32,
    "num_tokens": [128],
    "iters": 3,
    "warmup": 1,
    "write_batch": 2,
    "read_iters": 2,
    "skip_inflight": [1, 8],
    "skip_tokens": 128,
    "skip_steps": 12,
}


@dataclass(frozen=True)
class BenchConfig:
    """The resolved options of one run."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    chunk_size: int
    num_tokens: list[int]
    iters: int
    warmup: int
    write_batch: int
    read_iters: int
    skip_inflight: list[int]
    skip_tokens: int
    skip_steps: int
    skip_load: float
    skip_interval_ms: float | None
    buffers_budget: int
    root: str | None
    seed: int
    tiny: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """One KV block of one layer (CPU layout: heads x block x 2*head)."""
        return (
            self.num_kv_heads * self.block_size * 2 * self.head_size * self.element_size
        )

    def update_bytes(self, num_tokens: int) -> int:
        """KV bytes of ``num_tokens`` tokens across all layers."""
        return num_tokens // self.block_size * self.block_bytes * self.num_layers

    def layout(self) -> KVCacheLayout:
        return KVCacheLayout(
            model="benchmark-synthetic",
            dtype=self.dtype,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=self.block_size,
            block_bytes=self.block_bytes,
            kv_layout=(
                "synthetic CPU [num_blocks, num_kv_heads, block_size, 2*head_size]"
            ),
        )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def build_parser() -> argparse.ArgumentParser:
    full, tiny = FULL_DEFAULTS, TINY_DEFAULTS

    def dflt(name: str) -> str:
        return f"(default: {full[name]}; --tiny: {tiny[name]})"

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--part",
        action="append",
        choices=sorted(PARTS),
        help="Which part(s) to run; repeat to run several (default: core). "
        "core: caller time per update, backend throughput and skip rate, "
        "measured on VineyardLLMCache directly.",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="Shrink every size and count for CI (finishes in < 30 s); "
        "options given explicitly still win.",
    )
    shape = parser.add_argument_group("KV shape")
    shape.add_argument(
        "--num-layers", type=_positive_int, help=f"Model layers {dflt('num_layers')}."
    )
    shape.add_argument(
        "--num-kv-heads", type=_positive_int, help=f"KV heads {dflt('num_kv_heads')}."
    )
    shape.add_argument(
        "--head-size", type=_positive_int, help=f"Head size {dflt('head_size')}."
    )
    shape.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default="bfloat16",
        help="KV dtype (default: bfloat16).",
    )
    shape.add_argument(
        "--block-size",
        type=_positive_int,
        help=f"Tokens per KV block (vLLM's CPU block size) {dflt('block_size')}.",
    )
    shape.add_argument(
        "--chunk-size",
        type=_positive_int,
        help="Tokens per cached chunk, a multiple of the block size "
        f"{dflt('chunk_size')}.",
    )
    shape.add_argument(
        "--num-tokens",
        type=_positive_int,
        nargs="+",
        help="Tokens per update (one step's completed chunks; each a multiple "
        f"of the chunk size) for parts 1 and 2 {dflt('num_tokens')}.",
    )
    core = parser.add_argument_group("part core")
    core.add_argument(
        "--iters",
        type=_positive_int,
        help="Measured updates per mode and size in part 1 (medians are "
        f"reported) {dflt('iters')}.",
    )
    core.add_argument(
        "--warmup",
        type=int,
        help=f"Unmeasured updates before each part-1 series {dflt('warmup')}.",
    )
    core.add_argument(
        "--write-batch",
        type=_positive_int,
        help="Part 2: updates submitted back to back (each with its own "
        "buffer) to measure sustained write throughput "
        f"{dflt('write_batch')}.",
    )
    core.add_argument(
        "--read-iters",
        type=_positive_int,
        help=f"Part 2: loads and lookups measured per size {dflt('read_iters')}.",
    )
    core.add_argument(
        "--skip-inflight",
        type=_positive_int,
        nargs="+",
        help=f"Part 3: MAX_INFLIGHT_TASKS settings to compare {dflt('skip_inflight')}.",
    )
    core.add_argument(
        "--skip-tokens",
        type=_positive_int,
        help=f"Part 3: tokens per update {dflt('skip_tokens')}.",
    )
    core.add_argument(
        "--skip-steps",
        type=_positive_int,
        help="Part 3: save() calls (simulated forward steps) per setting "
        f"{dflt('skip_steps')}.",
    )
    core.add_argument(
        "--skip-load",
        type=_positive_float,
        default=0.9,
        help="Part 3: offered load, i.e. median backend write time of one "
        "update divided by the step interval (measured first). Below 1 the "
        "backend keeps up on average, so bigger pools absorb the jitter; "
        "one buffer skips whenever a write outlasts a step (default: 0.9).",
    )
    core.add_argument(
        "--skip-interval-ms",
        type=_positive_float,
        help="Part 3: a fixed step interval in ms instead of one derived "
        "from --skip-load.",
    )
    core.add_argument(
        "--buffers-budget",
        type=_positive_int,
        default=8,
        help="Size the cache's CPU memory limit so that this many update "
        "buffers fit (cpu_mem_limit_gb set in the config, not the "
        "environment; default: 8).",
    )
    parser.add_argument(
        "--root",
        help="Parent directory of the per-run cache root (a temporary "
        "directory, removed at the end; default: the system temp dir). "
        "Writes go to disk with fdatasync, so this decides what is measured.",
    )
    parser.add_argument(
        "--torch-threads",
        type=_positive_int,
        help="torch intra-op threads of this (the caller's) process, as the "
        "OMP threads of vLLM's CPU worker (default: torch's default). With "
        "more threads than idle cores, a parallel copy can stall for a "
        "scheduler time slice, e.g. while the backend writes.",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="Seed of KV data and token ids."
    )
    parser.add_argument(
        "--json", metavar="PATH", help="Also write every result to PATH as JSON."
    )
    return parser


def resolve_config(args: argparse.Namespace) -> BenchConfig:
    defaults = TINY_DEFAULTS if args.tiny else FULL_DEFAULTS
    values = {
        name: (getattr(args, name) if getattr(args, name) is not None else default)
        for name, default in defaults.items()
    }
    config = BenchConfig(
        **values,
        dtype=args.dtype,
        skip_load=args.skip_load,
        skip_interval_ms=args.skip_interval_ms,
        buffers_budget=args.buffers_budget,
        root=args.root,
        seed=args.seed,
        tiny=args.tiny,
    )
    if config.chunk_size % config.block_size:
        raise SystemExit(
            f"--chunk-size {config.chunk_size} is not a multiple of "
            f"--block-size {config.block_size}"
        )
    for n in [*config.num_tokens, config.skip_tokens]:
        if n % config.chunk_size:
            raise SystemExit(
                f"token count {n} is not a multiple of --chunk-size {config.chunk_size}"
            )
    return config


# --------------------------------------------------------------------------
# Fixtures: synthetic paged KV, fresh token ids, a cache per setting.
# --------------------------------------------------------------------------


class SyntheticKV:
    """Paged KV caches of all layers in one allocation, as vLLM's CPU worker
    has them (``[num_blocks, num_kv_heads, block_size, 2*head_size]`` per
    layer). Saves read the even blocks, loads write the odd ones, so blocks
    are scattered as in a real block table."""

    def __init__(self, config: BenchConfig, max_tokens: int, seed: int):
        self.config = config
        blocks = max_tokens // config.block_size
        self.num_blocks = 2 * blocks
        gen = torch.Generator().manual_seed(seed)
        self.all_layers = torch.randn(
            config.num_layers,
            self.num_blocks,
            config.num_kv_heads,
            config.block_size,
            2 * config.head_size,
            generator=gen,
        ).to(config.torch_dtype)
        self.layers = list(self.all_layers.unbind(0))

    def save_blocks(self, num_tokens: int) -> list[int]:
        return list(range(0, 2 * (num_tokens // self.config.block_size), 2))

    def load_blocks(self, num_tokens: int) -> list[int]:
        return list(range(1, 2 * (num_tokens // self.config.block_size), 2))


class TokenSource:
    """Fresh token ids for every update, so every update really writes
    (vineyard keeps the first write of an existing chunk, cheaply)."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)
        self._count = 0

    def request(
        self, kv: SyntheticKV, num_tokens: int, tag: str
    ) -> tuple[SaveRequest, list[int]]:
        self._count += 1
        tokens = [self._rng.randrange(1, 32000) for _ in range(num_tokens)]
        req = SaveRequest(
            req_id=f"{tag}-{self._count}",
            token_ids=tokens,
            num_computed_tokens=num_tokens,
            block_ids=kv.save_blocks(num_tokens),
        )
        return req, tokens


class Workspace:
    """The per-run temporary root; every cache gets its own directory below
    it, deleted when the cache closes (keeps the disk footprint small)."""

    def __init__(self, parent: str | None):
        self.path = tempfile.mkdtemp(prefix="vineyard-bench-", dir=parent)
        self._count = 0

    @contextlib.contextmanager
    def cache(
        self,
        config: BenchConfig,
        kv: SyntheticKV,
        max_num_batched_tokens: int,
        *,
        enable_async_update: bool = True,
        max_inflight_tasks: int = 4,
        min_inflight_tasks: int = 1,
    ) -> Iterator[VineyardLLMCache]:
        self._count += 1
        root = os.path.join(self.path, f"cache-{self._count}")
        buffer_bytes = config.update_bytes(
            -(-max_num_batched_tokens // config.chunk_size) * config.chunk_size
        )
        util = 0.5
        budget_buffers = max(config.buffers_budget, max_inflight_tasks)
        cache_config = VineyardLLMCacheConfig(
            enabled=True,
            cpu_mem_limit_gb=budget_buffers * buffer_bytes / util / GiB * 1.001,
            enable_async_update=enable_async_update,
            async_update_cpu_mem_util=util,
            min_inflight_tasks=min(min_inflight_tasks, max_inflight_tasks),
            max_inflight_tasks=max_inflight_tasks,
            metrics_enabled=True,
            root=root,
            chunk_size=config.chunk_size,
            backend_timeout_s=120.0,
            drain_timeout_s=60.0,
        )
        cache = VineyardLLMCache(
            cache_config,
            config.layout(),
            max_num_batched_tokens,
            kv_caches=kv.layers,
            num_blocks=kv.num_blocks,
        )
        try:
            yield cache
        finally:
            cache.wait_for_updates(120.0)
            cache.close()
            shutil.rmtree(root, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


# --------------------------------------------------------------------------
# Part core 1: the caller's time per update.
# --------------------------------------------------------------------------


class MemcpyBaseline:
    """The physical floor: one copy of the same bytes into a preallocated,
    already touched buffer. :meth:`memcpy`: one contiguous ``copy_``;
    :meth:`gather`: one ``index_select`` of the same scattered paged blocks
    of all layers (what ``save()`` does into its staging buffer);
    :meth:`gather_per_layer`: one ``index_select`` per layer (one parallel
    region each, which stalls when the cores are oversubscribed)."""

    def __init__(self, config: BenchConfig, kv: SyntheticKV, num_tokens: int):
        self.nbytes = config.update_bytes(num_tokens)
        elems = self.nbytes // config.element_size
        self._src = torch.randn(elems).to(config.torch_dtype)
        self._dst = torch.zeros_like(self._src)
        self._kv = [layer.reshape(layer.shape[0], -1) for layer in kv.layers]
        self._all = kv.all_layers.view(config.num_layers, kv.num_blocks, -1)
        self._blocks = torch.tensor(kv.save_blocks(num_tokens))
        self._gathered = torch.zeros(
            config.num_layers,
            len(self._blocks),
            config.block_bytes // config.element_size,
            dtype=config.torch_dtype,
        )

    def memcpy(self) -> float:
        t0 = time.perf_counter()
        self._dst.copy_(self._src)
        return time.perf_counter() - t0

    def gather(self) -> float:
        t0 = time.perf_counter()
        torch.index_select(self._all, 1, self._blocks, out=self._gathered)
        return time.perf_counter() - t0

    def gather_per_layer(self) -> float:
        t0 = time.perf_counter()
        for layer, flat in enumerate(self._kv):
            torch.index_select(flat, 0, self._blocks, out=self._gathered[layer])
        return time.perf_counter() - t0


def _timed_save(cache: VineyardLLMCache, req: SaveRequest) -> float:
    """The caller's time of one ``save()``; then waits until the update is
    written, so the next one measures the caller's cost, not saturation."""
    t0 = time.perf_counter()
    ok = cache.save([req])
    elapsed = time.perf_counter() - t0
    cache.release(req.req_id)
    if not ok:
        raise RuntimeError("an update was skipped with an idle pool")
    if not cache.wait_for_updates(120.0):
        raise RuntimeError("vineyard updates did not finish in 120 s")
    return elapsed


def measure_caller(
    config: BenchConfig,
    ws: Workspace,
    kv: SyntheticKV,
    tokens: TokenSource,
    num_tokens: int,
) -> dict:
    """Per iteration, back to back: memcpy, gather, async ``save()``, sync
    ``save()`` (each with fresh token ids), so that noise from other work on
    the machine hits all four alike. Only the ``save()`` call is timed; the
    sync one includes the write, since it waits for it."""
    base = MemcpyBaseline(config, kv, num_tokens)
    times: dict[str, list[float]] = {
        "memcpy": [],
        "gather": [],
        "gather_per_layer": [],
        "async": [],
        "sync": [],
    }
    with (
        ws.cache(config, kv, num_tokens, enable_async_update=True) as async_cache,
        ws.cache(config, kv, num_tokens, enable_async_update=False) as sync_cache,
    ):
        for i in range(config.warmup + config.iters):
            sample = {
                "memcpy": base.memcpy(),
                "gather": base.gather(),
                "gather_per_layer": base.gather_per_layer(),
                "async": _timed_save(
                    async_cache, tokens.request(kv, num_tokens, "async")[0]
                ),
                "sync": _timed_save(
                    sync_cache, tokens.request(kv, num_tokens, "sync")[0]
                ),
            }
            if i >= config.warmup:
                for name, seconds in sample.items():
                    times[name].append(seconds)
        counters = {
            "async": async_cache.metrics.snapshot(),
            "sync": sync_cache.metrics.snapshot(),
        }
    for mode, totals in counters.items():
        expected = config.warmup + config.iters
        if totals["updates_completed"] != expected or totals["tokens_rejected"]:
            raise RuntimeError(f"not every {mode} update was written: {totals}")
    median = {name: statistics.median(values) for name, values in times.items()}
    ratio = median["async"] / median["memcpy"]
    return {
        "num_tokens": num_tokens,
        "bytes": base.nbytes,
        "samples_s": times,
        "median_s": median,
        "min_s": {name: min(values) for name, values in times.items()},
        "memcpy_gbps": base.nbytes / median["memcpy"] / GB,
        "async_over_memcpy": ratio,
        "async_over_gather": median["async"] / median["gather"],
        "sync_over_memcpy": median["sync"] / median["memcpy"],
        "target_ratio": TARGET_CALLER_RATIO,
        "pass": ratio <= TARGET_CALLER_RATIO,
        "counters": counters,
    }


def part_caller(
    config: BenchConfig, ws: Workspace, kv: SyntheticKV, tokens: TokenSource
) -> list[dict]:
    return [measure_caller(config, ws, kv, tokens, n) for n in config.num_tokens]


# --------------------------------------------------------------------------
# Part core 2: backend write and read throughput.
# --------------------------------------------------------------------------


def _stamp(kv: SyntheticKV, blocks: list[int], value: float) -> None:
    """Stamp a few elements per block per request, so that a load returning
    another request's KV is caught."""
    kv.all_layers[:, blocks, 0, 0, :4] = value


def part_throughput(
    config: BenchConfig, ws: Workspace, kv: SyntheticKV, tokens: TokenSource
) -> list[dict]:
    rows = []
    for num_tokens in config.num_tokens:
        nbytes = config.update_bytes(num_tokens)
        save_blocks = kv.save_blocks(num_tokens)
        load_blocks = kv.load_blocks(num_tokens)
        batch = config.write_batch
        with ws.cache(config, kv, num_tokens, max_inflight_tasks=batch) as cache:
            # Warm up the pool (every buffer touched) and the backend.
            for _ in range(batch):
                req, _ = tokens.request(kv, num_tokens, "warm")
                cache.save([req])
                cache.release(req.req_id)
            cache.wait_for_updates(120.0)
            cache.metrics.take()
            # Sustained writes: a batch of updates back to back, each with its
            # own buffer; from the first save() to the last write done.
            written: list[tuple[list[int], float]] = []
            t0 = time.perf_counter()
            for i in range(batch):
                stamp = float(i + 1)
                _stamp(kv, save_blocks, stamp)
                req, ids = tokens.request(kv, num_tokens, "write")
                if not cache.save([req]):
                    raise RuntimeError("a write-batch update was skipped")
                cache.release(req.req_id)
                written.append((ids, stamp))
            if not cache.wait_for_updates(300.0):
                raise RuntimeError("vineyard updates did not finish in 300 s")
            batch_s = time.perf_counter() - t0
            stats = cache.metrics.take()
            exec_s = stats["update_exec_s"]
            if stats["tokens_written"] != batch * num_tokens:
                raise RuntimeError(f"not every update was written: {stats}")
            # Reads: lookup (the scheduler's question, reads the data too)
            # and load into other paged blocks; checked bit for bit.
            load_s: list[float] = []
            lookup_s: list[float] = []
            hit_tokens: list[int] = []
            verified = True
            source = kv.all_layers[:, save_blocks].clone()
            for r in range(config.read_iters):
                ids, stamp = written[r % len(written)]
                t0 = time.perf_counter()
                hit, _ = cache.lookup(ids, 0)
                lookup_s.append(time.perf_counter() - t0)
                hit_tokens.append(hit)
                t0 = time.perf_counter()
                loaded = cache.load(ids, 0, num_tokens, load_blocks)
                load_s.append(time.perf_counter() - t0)
                expected = source.clone()
                expected[:, :, 0, 0, :4] = stamp
                verified &= loaded == num_tokens and torch.equal(
                    kv.all_layers[:, load_blocks], expected
                )
        write_update_s = statistics.median(exec_s)
        rows.append(
            {
                "num_tokens": num_tokens,
                "bytes": nbytes,
                "write_batch": batch,
                "write_batch_s": batch_s,
                "write_batch_gbps": batch * nbytes / batch_s / GB,
                "update_exec_s": exec_s,
                "update_exec_median_s": write_update_s,
                "write_update_gbps": nbytes / write_update_s / GB,
                "load_s": load_s,
                "load_median_s": statistics.median(load_s),
                "load_gbps": nbytes / statistics.median(load_s) / GB,
                "lookup_s": lookup_s,
                "lookup_median_s": statistics.median(lookup_s),
                "lookup_hit_tokens": hit_tokens,
                "load_verified": verified,
            }
        )
    return rows


# --------------------------------------------------------------------------
# Part core 3: skip rate versus MAX_INFLIGHT_TASKS at a fixed arrival rate.
# --------------------------------------------------------------------------


def _calibrate_write_s(
    config: BenchConfig,
    ws: Workspace,
    kv: SyntheticKV,
    tokens: TokenSource,
    num_tokens: int,
) -> float:
    """Median backend write time of one update of ``num_tokens`` tokens."""
    with ws.cache(config, kv, num_tokens, max_inflight_tasks=1) as cache:
        for _ in range(config.warmup + 5):
            req, _ = tokens.request(kv, num_tokens, "calib")
            cache.save([req])
            cache.release(req.req_id)
            cache.wait_for_updates(120.0)
        exec_s = cache.metrics.take()["update_exec_s"]
    return statistics.median(exec_s[config.warmup :] or exec_s)


def run_fixed_rate(
    config: BenchConfig,
    ws: Workspace,
    kv: SyntheticKV,
    tokens: TokenSource,
    max_inflight: int,
    interval_s: float,
) -> dict:
    """One ``save()`` with new chunks every ``interval_s`` (a simulated
    forward step), whatever the backend does."""
    n = config.skip_tokens
    save_s: list[float] = []
    late = 0
    with ws.cache(
        config,
        kv,
        n,
        max_inflight_tasks=max_inflight,
        min_inflight_tasks=max_inflight,
    ) as cache:
        requests = [tokens.request(kv, n, "rate")[0] for _ in range(config.skip_steps)]
        start = time.perf_counter()
        for step, req in enumerate(requests):
            delay = start + step * interval_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                late += 1
            t0 = time.perf_counter()
            cache.save([req])
            save_s.append(time.perf_counter() - t0)
            # A new request each step: its resume point is not needed.
            cache.release(req.req_id)
        run_s = time.perf_counter() - start
        cache.wait_for_updates(300.0)
        totals = cache.metrics.snapshot()
        stats = cache.metrics.take()
    calls = len(requests)
    return {
        "max_inflight_tasks": max_inflight,
        "calls": calls,
        "submitted": totals["updates_submitted"],
        "skipped": totals["updates_skipped"],
        "completed": totals["updates_completed"],
        "failed": totals["updates_failed"],
        "skip_rate": totals["updates_skipped"] / calls,
        "late_steps": late,
        "run_s": run_s,
        "save_s": save_s,
        "save_p50_s": _percentile(save_s, 50),
        "save_p99_s": _percentile(save_s, 99),
        "save_max_s": max(save_s),
        "queue_delay_max_s": max(stats["update_queue_delay_s"], default=0.0),
        "update_exec_s": stats["update_exec_s"],
        "update_exec_median_s": statistics.median(stats["update_exec_s"] or [0.0]),
    }


def part_skip(
    config: BenchConfig, ws: Workspace, kv: SyntheticKV, tokens: TokenSource
) -> dict:
    n = config.skip_tokens
    write_s = _calibrate_write_s(config, ws, kv, tokens, n)
    if config.skip_interval_ms is not None:
        interval_s = config.skip_interval_ms / 1e3
    else:
        interval_s = write_s / config.skip_load
    rows = [
        run_fixed_rate(config, ws, kv, tokens, m, interval_s)
        for m in config.skip_inflight
    ]
    return {
        "num_tokens": n,
        "bytes": config.update_bytes(n),
        "calibrated_write_s": write_s,
        "interval_s": interval_s,
        "offered_load": write_s / interval_s,
        "steps": config.skip_steps,
        "rows": rows,
    }


# --------------------------------------------------------------------------
# Part core: run and print.
# --------------------------------------------------------------------------


def run_core(config: BenchConfig, ws: Workspace) -> dict:
    max_tokens = max([*config.num_tokens, config.skip_tokens])
    kv = SyntheticKV(config, max_tokens, config.seed)
    tokens = TokenSource(config.seed)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "caller": part_caller(config, ws, kv, tokens),
        "throughput": part_throughput(config, ws, kv, tokens),
        "skip": part_skip(config, ws, kv, tokens),
    }
    result["elapsed_s"] = time.perf_counter() - t0
    return result


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
        for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows
    ]
    return "\n".join(lines)


def print_core(config: BenchConfig, result: dict) -> None:
    print(
        f"\n[core 1] Caller (forward thread) time per update, median of "
        f"{config.iters} (ms); async waits for the updater between updates"
    )
    rows = []
    for r in result["caller"]:
        med = r["median_s"]
        rows.append(
            [
                str(r["num_tokens"]),
                f"{r['bytes'] / MiB:.1f}",
                f"{_ms(med['memcpy']):.2f}",
                f"{_ms(med['gather']):.2f}",
                f"{_ms(med['gather_per_layer']):.2f}",
                f"{_ms(med['async']):.2f}",
                f"{_ms(med['sync']):.1f}",
                f"{r['async_over_memcpy']:.2f}x",
                f"{r['async_over_gather']:.2f}x",
                f"{r['sync_over_memcpy']:.1f}x",
                f"{'PASS' if r['pass'] else 'FAIL'} (<= {r['target_ratio']}x)",
            ]
        )
    print(
        _table(
            [
                "tokens",
                "MiB",
                "memcpy",
                "gather",
                "per layer",
                "async save",
                "sync save",
                "async/memcpy",
                "async/gather",
                "sync/memcpy",
                "target",
            ],
            rows,
        )
    )
    print(
        "  memcpy: one contiguous copy_ of the same bytes; gather: one "
        "index_select of the same paged blocks of all layers into a "
        "preallocated buffer; per layer: the same gather as one index_select "
        "per layer."
    )

    print("\n[core 2] Backend throughput (GB = 1e9 B; reads from a warm page cache)")
    rows = []
    for r in result["throughput"]:
        rows.append(
            [
                str(r["num_tokens"]),
                f"{r['bytes'] / MiB:.1f}",
                f"{_ms(r['update_exec_median_s']):.1f}",
                f"{r['write_update_gbps']:.2f}",
                f"{r['write_batch_gbps']:.2f} (x{r['write_batch']})",
                f"{_ms(r['load_median_s']):.1f}",
                f"{r['load_gbps']:.2f}",
                f"{_ms(r['lookup_median_s']):.1f}",
                "yes" if r["load_verified"] else "NO",
            ]
        )
    print(
        _table(
            [
                "tokens",
                "MiB",
                "write ms",
                "write GB/s",
                "sustained GB/s",
                "load ms",
                "load GB/s",
                "lookup ms",
                "bit-exact",
            ],
            rows,
        )
    )
    print(
        "  write: backend update time per update (update_exec_s median); "
        "sustained: a batch of updates back to back, first save() to last "
        "write done; load: load() into paged blocks; lookup: "
        "lookup(token_ids, 0)."
    )

    skip = result["skip"]
    print(
        f"\n[core 3] Skip rate vs MAX_INFLIGHT_TASKS: one save() of "
        f"{skip['num_tokens']} new tokens ({skip['bytes'] / MiB:.1f} MiB) every "
        f"{_ms(skip['interval_s']):.1f} ms for {skip['steps']} steps; median "
        f"write {_ms(skip['calibrated_write_s']):.1f} ms "
        f"(offered load {skip['offered_load']:.2f})"
    )
    rows = []
    for r in skip["rows"]:
        rows.append(
            [
                str(r["max_inflight_tasks"]),
                str(r["calls"]),
                str(r["submitted"]),
                str(r["skipped"]),
                f"{100 * r['skip_rate']:.0f}%",
                str(r["completed"]),
                f"{_ms(r['save_p50_s']):.2f}",
                f"{_ms(r['save_p99_s']):.2f}",
                f"{_ms(r['save_max_s']):.2f}",
                f"{_ms(r['update_exec_median_s']):.0f}",
                f"{r['update_exec_median_s'] / skip['interval_s']:.2f}",
                f"{_ms(r['queue_delay_max_s']):.0f}",
            ]
        )
    print(
        _table(
            [
                "max_inflight",
                "calls",
                "submitted",
                "skipped",
                "skip rate",
                "completed",
                "save p50 ms",
                "save p99 ms",
                "save max ms",
                "write p50 ms",
                "write/step",
                "max queue ms",
            ],
            rows,
        )
    )
    print(
        "  save() never waits for the backend: a skipped call returns at once; "
        "write p50: backend time per update during the run; write/step: write p50 / "
        "interval (above 1 the backend cannot keep up, whatever the pool "
        "size); max queue: longest submit-to-write delay."
    )


@dataclass(frozen=True)
class Part:
    """A benchmark part: ``run`` returns its results (stored under the part's
    name), ``show`` prints them."""

    run: Callable[[BenchConfig, Workspace], dict]
    show: Callable[[BenchConfig, dict], None]


#: Parts by name; later parts (e.g. engine-level runs) register here.
PARTS: dict[str, Part] = {"core": Part(run_core, print_core)}


def _environment() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    config = resolve_config(args)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    parts = list(dict.fromkeys(args.part or ["core"]))
    results: dict[str, Any] = {
        "config": asdict(replace(config)),
        "environment": _environment(),
    }
    print(
        f"vineyard LLM cache benchmark: {config.num_layers} layers, "
        f"{config.num_kv_heads} KV heads, head size {config.head_size}, "
        f"{config.dtype}, block {config.block_size}, chunk {config.chunk_size} "
        f"({config.update_bytes(config.block_size) // config.block_size} B of KV "
        f"per token); torch threads {torch.get_num_threads()}, "
        f"{os.cpu_count()} CPUs"
    )
    ws = Workspace(config.root)
    try:
        for name in parts:
            results[name] = PARTS[name].run(config, ws)
            PARTS[name].show(config, results[name])
    finally:
        ws.close()
    results["environment"]["load_average_end"] = os.getloadavg()
    print(
        "\nload average (1/5/15 min) at start "
        + "/".join(f"{x:.2f}" for x in results["environment"]["load_average"])
        + ", at end "
        + "/".join(f"{x:.2f}" for x in results["environment"]["load_average_end"])
        + f" on {os.cpu_count()} CPUs (other work on the machine skews timings)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nresults written to {args.json}")
    return results


if __name__ == "__main__":
    main()
