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

Part ``engine`` runs whole vLLM engines (``LLM(...)``, V1, on the CPU) side by
side, each configuration in a fresh process of its own (the environment is set
before vLLM is imported) and all on the same prompts:

1. Throughput with no cache hits (unique random prompts, so every step saves):
   no cache / vineyard with synchronous updates / vineyard with async updates,
   on a KV-heavy toy model (many KV heads and layers relative to its compute),
   in interleaved rounds; target "async >= 97% of no cache". Also the cache's
   updates (skipped ones too) and the forward thread's time per update
   (``save_caller_s``) against a memcpy of the same bytes.
2. Time to first token of a fully cached 4k-token prompt, on a fresh engine
   whose cache root a previous engine filled (so the hit comes from vineyard,
   not vLLM's in-memory prefix cache), versus recomputing it on an engine
   without the cache; target "at least 10x faster". On the KV-heavy model and
   on the demo's default toy model, as the ratio depends on KV bytes per token
   versus compute per token.

Every engine runs its forward pass on one thread on core 0 (the cache's
backend processes move to the other cores), in one process by default
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``; see :func:`_engine_env`).

Every result is kept in one dict (``--json PATH`` dumps it), keyed by part;
``--plot PATH.png`` draws them (engine throughput, TTFT, the caller's time per
update and the skip rate against in-flight tasks). Parts register in
:data:`PARTS`.

Examples::

    python benchmarks/benchmark_vineyard_llm_cache.py                # core, ~2 min
    python benchmarks/benchmark_vineyard_llm_cache.py --part engine  # ~6 min
    python benchmarks/benchmark_vineyard_llm_cache.py --part all \\
        --json results.json --plot vineyard_llm_cache_benchmark.png  # ~7 min
    python benchmarks/benchmark_vineyard_llm_cache.py --part all --tiny \\
        --json tiny.json --plot tiny.png                             # CI, ~1 min
    python benchmarks/benchmark_vineyard_llm_cache.py \\
        --from-json results.json --plot again.png     # redraw, no rerun
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from vllm.worker.vineyard_llm_cache import (
    KVCacheLayout,
    SaveRequest,
    VineyardLLMCache,
    VineyardLLMCacheConfig,
)
from vllm.worker.vineyard_toy_model import ToyLlamaConfig, make_toy_llama

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

#: Defaults of the full run, and of ``--tiny`` (CI: the core part finishes in
#: < 30 s, the engine part in about a minute).
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
    "engine_model": "kv-heavy",
    "engine_ttft_models": ["kv-heavy", "toy"],
    "engine_prompts": 32,
    "engine_prompt_tokens": [1024, 2048],
    "engine_max_tokens": 4,
    "engine_rounds": 3,
    "engine_ttft_tokens": 4096,
    "engine_ttft_probes": 3,
    "engine_max_num_batched_tokens": 2048,
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
    "engine_model": "tiny",
    "engine_ttft_models": ["tiny"],
    "engine_prompts": 4,
    "engine_prompt_tokens": [256, 512],
    "engine_max_tokens": 2,
    "engine_rounds": 1,
    "engine_ttft_tokens": 512,
    "engine_ttft_probes": 2,
    "engine_max_num_batched_tokens": 512,
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
    engine_model: str
    engine_ttft_models: list[str]
    engine_prompts: int
    engine_prompt_tokens: list[int]
    engine_max_tokens: int
    engine_rounds: int
    engine_ttft_tokens: int
    engine_ttft_probes: int
    engine_max_num_batched_tokens: int
    engine_dtype: str
    engine_kvcache_space_gib: int
    engine_timeout_s: float
    engine_model_dir: str
    engine_multiprocessing: bool
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
        choices=[*sorted(PARTS), "all"],
        help="Which part(s) to run; repeat to run several (default: core; "
        "all: every part). core: caller time per update, backend throughput "
        "and skip rate, measured on VineyardLLMCache directly. engine: whole "
        "vLLM engines, no cache vs sync vs async updates (throughput with no "
        "hits) and time to first token of a cached prompt vs recompute.",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="Shrink every size and count for CI (core < 30 s, engine about "
        "a minute); options given explicitly still win.",
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
    engine = parser.add_argument_group("part engine")
    engine.add_argument(
        "--engine-model",
        choices=sorted(ENGINE_MODELS),
        help="Toy model of the throughput runs (seeded random weights, made "
        f"locally; see ENGINE_MODELS) {dflt('engine_model')}.",
    )
    engine.add_argument(
        "--engine-ttft-models",
        choices=sorted(ENGINE_MODELS),
        nargs="+",
        help="Toy models whose time to first token is measured "
        f"{dflt('engine_ttft_models')}.",
    )
    engine.add_argument(
        "--engine-prompts",
        type=_positive_int,
        help="Prompts of the throughput runs, all submitted at once "
        f"{dflt('engine_prompts')}.",
    )
    engine.add_argument(
        "--engine-prompt-tokens",
        type=_positive_int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="Prompt length range of the throughput runs (unique random token "
        f"ids, so nothing is ever a hit) {dflt('engine_prompt_tokens')}.",
    )
    engine.add_argument(
        "--engine-max-tokens",
        type=_positive_int,
        help=f"Tokens generated per throughput prompt {dflt('engine_max_tokens')}.",
    )
    engine.add_argument(
        "--engine-rounds",
        type=int,
        help="Rounds of the three throughput configurations, interleaved (the "
        "order rotates each round); the best round of each counts; 0: time "
        f"to first token only {dflt('engine_rounds')}.",
    )
    engine.add_argument(
        "--engine-ttft-tokens",
        type=_positive_int,
        help="Cached length of a TTFT prompt, rounded up to whole cache chunks; "
        "the prompt has one token more, which is computed "
        f"{dflt('engine_ttft_tokens')}.",
    )
    engine.add_argument(
        "--engine-ttft-probes",
        type=_positive_int,
        help="TTFT prompts per model, one at a time (the median counts) "
        f"{dflt('engine_ttft_probes')}.",
    )
    engine.add_argument(
        "--engine-max-num-batched-tokens",
        type=_positive_int,
        help="vLLM's token budget per step (also sizes the cache's buffers) "
        f"{dflt('engine_max_num_batched_tokens')}.",
    )
    engine.add_argument(
        "--engine-dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="Model and KV dtype of the engines (default: bfloat16).",
    )
    engine.add_argument(
        "--engine-kvcache-space-gib",
        type=_positive_int,
        default=4,
        help="VLLM_CPU_KVCACHE_SPACE of the engines (default: 4).",
    )
    engine.add_argument(
        "--engine-multiprocessing",
        action="store_true",
        help="Run vLLM's default process layout (frontend, EngineCore and a "
        "worker process bound to core 0 by VLLM_CPU_OMP_THREADS_BIND=0; about "
        "15 s more per engine start) instead of one engine process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0), which the benchmark pins to core "
        "0 with one OpenMP thread itself, as vLLM binds nothing in that mode.",
    )
    engine.add_argument(
        "--engine-model-dir",
        default=DEFAULT_ENGINE_MODEL_DIR,
        help="Where the toy checkpoints are written, or reused if they are "
        "already there (default: %(default)s).",
    )
    engine.add_argument(
        "--engine-timeout-s",
        type=_positive_float,
        default=900.0,
        help="Longest run of one engine process before it is killed (default: 900).",
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
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="Also draw the results as a PNG plot (matplotlib): engine "
        "throughput and time to first token, the caller's time per update and "
        "the skip rate against in-flight tasks, as far as the parts ran.",
    )
    parser.add_argument(
        "--from-json",
        metavar="PATH",
        help="Run nothing: read results written by --json and print (and, "
        "with --plot, draw) them again.",
    )
    # Internal: this script re-runs itself to host one engine.
    parser.add_argument("--run-engine", metavar="SPEC", help=argparse.SUPPRESS)
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
        engine_dtype=args.engine_dtype,
        engine_kvcache_space_gib=args.engine_kvcache_space_gib,
        engine_timeout_s=args.engine_timeout_s,
        engine_model_dir=args.engine_model_dir,
        engine_multiprocessing=args.engine_multiprocessing,
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
    if config.engine_rounds < 0:
        raise SystemExit("--engine-rounds must not be negative")
    low, high = config.engine_prompt_tokens
    if low > high:
        raise SystemExit(f"--engine-prompt-tokens {low} {high}: MIN > MAX")
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


# --------------------------------------------------------------------------
# Part engine: whole vLLM engines side by side, each in its own process.
# --------------------------------------------------------------------------

METRIC_PREFIX = "vllm:vineyard_cache_"
TARGET_ASYNC_THROUGHPUT = 0.97  # design.md: async >= 97% of no cache
TARGET_TTFT_SPEEDUP = 10.0  # design.md: cached 4k prompt >= 10x faster
#: The three configurations of the throughput runs, and whether (and how)
#: each one runs the cache: VINEYARD_CACHE_ENABLE_ASYNC_UPDATE or None (off).
ENGINE_CONFIGS: dict[str, str | None] = {
    "no cache": None,
    "sync": "0",
    "async": "1",
}
#: Toy Llama checkpoints with seeded random weights, written locally (no
#: download). "kv-heavy" has many KV heads and layers for little compute
#: (8 KV heads of 128 on a hidden size of 256), so the cost of writing KV
#: is visible; "toy" is the demo's default model (2 KV heads of 64 on 512);
#: "tiny" is for CI.
ENGINE_MODELS: dict[str, ToyLlamaConfig] = {
    "kv-heavy": ToyLlamaConfig(
        num_layers=16,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=512,
    ),
    "toy": ToyLlamaConfig(),
    "tiny": ToyLlamaConfig(
        num_layers=2,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=256,
        vocab_size=4096,
        max_position_embeddings=4096,
    ),
}
DEFAULT_ENGINE_MODEL_DIR = os.path.join(
    os.path.expanduser("~"), ".cache", "vineyard-llm-cache-bench"
)
#: Variables the benchmark sets for every engine; the caller's values are
#: not passed through (other VINEYARD_CACHE_* settings are, and recorded).
_ENGINE_ENV_OWNED = (
    "VLLM_USE_VINEYARD_CACHE",
    "VINEYARD_CACHE_ROOT",
    "VINEYARD_CACHE_ENABLE_ASYNC_UPDATE",
    "VINEYARD_CACHE_METRICS_ENABLED",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
    "POD_NAME",
)
_FLUSH_PROMPT = [7]  # shorter than a chunk: no lookup, no save


def kv_bytes_per_token(model: ToyLlamaConfig, dtype: str) -> int:
    element = 4 if dtype == "float32" else 2
    return model.num_layers * 2 * model.num_kv_heads * model.head_dim * element


def _model_desc(name: str, dtype: str) -> str:
    m = ENGINE_MODELS[name]
    return (
        f"{name} ({m.num_layers} layers, hidden {m.hidden_size}, "
        f"{m.num_heads} heads, {m.num_kv_heads} KV heads x {m.head_dim}, "
        f"{dtype}: {kv_bytes_per_token(m, dtype) // 1024} KiB of KV per token)"
    )


def _engine_chunk_size() -> int:
    """The engines' VINEYARD_CACHE_CHUNK_SIZE (passed through if set)."""
    from vllm.worker.vineyard_llm_cache import ENV_VARS

    var = ENV_VARS["VINEYARD_CACHE_CHUNK_SIZE"]
    raw = os.environ.get(var.name, var.default)
    return int(var.parse(var.name, raw))


# ---- engine side: this script run with --run-engine SPEC --------------------


def _read_counters(llm: Any) -> dict[str, int]:
    from vllm.v1.metrics.reader import Counter

    out: dict[str, int] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name.startswith(METRIC_PREFIX):
            name = metric.name.removeprefix(METRIC_PREFIX)
            out[name] = out.get(name, 0) + int(metric.value)
    return out


def _read_histograms(llm: Any) -> dict[str, list[float]]:
    """``[count, sum]`` of every vineyard cache histogram, by short name."""
    from vllm.v1.metrics.reader import Histogram

    out: dict[str, list[float]] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Histogram) and metric.name.startswith(METRIC_PREFIX):
            name = metric.name.removeprefix(METRIC_PREFIX).removesuffix("_seconds")
            count, total = out.get(name, [0, 0.0])
            out[name] = [count + metric.count, total + metric.sum]
    return out


def _pending_updates(counters: Mapping[str, int]) -> int:
    done = sum(
        counters.get(k, 0)
        for k in ("updates_completed", "updates_failed", "updates_dropped")
    )
    return counters.get("updates_submitted", 0) - done


def _settle(llm: Any, timeout_s: float) -> dict[str, int]:
    """Wait until every update submitted so far is written. The worker reports
    its counters with each engine step, so keep stepping the engine with a
    one-token prompt (no lookup, no save)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    deadline = time.monotonic() + timeout_s
    counters = _read_counters(llm)
    while _pending_updates(counters) > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
        llm.generate([{"prompt_token_ids": _FLUSH_PROMPT}], params, use_tqdm=False)
        counters = _read_counters(llm)
    return counters


def _delta(after: Mapping[str, Any], before: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, list):
            prev = before.get(key, [0, 0.0])
            out[key] = [value[0] - prev[0], value[1] - prev[1]]
        else:
            out[key] = value - before.get(key, 0)
    return out


def _engine_child(spec_path: str) -> None:
    """Host one engine: run the spec's phases, write their results, exit."""
    with open(spec_path) as f:
        spec = json.load(f)
    result: dict[str, Any] = {"phases": [], "error": None}
    use_cache = spec["use_cache"]
    llm = None
    try:
        start = time.perf_counter()
        from vllm.inputs import TokensPrompt

        from vllm import LLM, SamplingParams

        llm = LLM(**spec["llm_kwargs"])
        result["startup_s"] = time.perf_counter() - start
        result["dtype"] = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
        result["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
        # Where the forward pass runs (VLLM_CPU_OMP_THREADS_BIND=0: core 0,
        # one OpenMP thread), the same for every configuration.
        result["affinity"] = sorted(os.sched_getaffinity(0))
        result["torch_threads"] = torch.get_num_threads()
        if use_cache:
            from vllm.worker.vineyard_llm_cache import VineyardLLMCacheConfig

            result["cache_config"] = asdict(VineyardLLMCacheConfig.from_env())
        counters, hists = _read_counters(llm), _read_histograms(llm)
        for phase in spec["phases"]:
            print(f"phase {phase['name']}: {len(phase['prompts'])} prompt(s)")
            sys.stdout.flush()
            params = SamplingParams(
                temperature=0, max_tokens=phase["max_tokens"], ignore_eos=True
            )
            items = [TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]]
            times: list[float] = []
            settle = phase["settle"] and use_cache
            begin = time.perf_counter()
            if phase["one_by_one"]:
                outs = []
                for item in items:
                    t0 = time.perf_counter()
                    outs += llm.generate([item], params, use_tqdm=False)
                    times.append(time.perf_counter() - t0)
                    if settle:
                        _settle(llm, spec["settle_s"])
            else:
                outs = llm.generate(items, params, use_tqdm=False)
            wall_s = time.perf_counter() - begin
            settle_s = 0.0
            if settle:
                t0 = time.perf_counter()
                _settle(llm, spec["settle_s"])
                settle_s = time.perf_counter() - t0
            after_c, after_h = _read_counters(llm), _read_histograms(llm)
            result["phases"].append(
                {
                    "name": phase["name"],
                    "prompts": len(items),
                    "prompt_tokens": sum(len(p) for p in phase["prompts"]),
                    "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                    "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs],
                    "wall_s": wall_s,
                    "request_s": times,
                    "settle_s": settle_s,
                    "pending_updates": _pending_updates(after_c),
                    "counters": _delta(after_c, counters),
                    "histograms": _delta(after_h, hists),
                }
            )
            counters, hists = after_c, after_h
            print(f"phase {phase['name']}: {wall_s:.2f} s (+{settle_s:.2f} s settle)")
            sys.stdout.flush()
    except Exception as e:  # reported to the parent
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    if llm is not None:
        # An orderly but bounded shutdown: the cache drains and stops its
        # backend processes.
        import threading

        stopper = threading.Thread(
            target=llm.llm_engine.engine_core.shutdown, daemon=True
        )
        stopper.start()
        stopper.join(30)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (engine threads and atexit hooks can hang).
    os._exit(0 if result["error"] is None else 1)


# ---- parent side: the plan, the processes, the report ----------------------


@dataclass
class EngineRun:
    """One engine process: a model, a configuration and what it runs."""

    label: str
    model: str
    config: str  # a key of ENGINE_CONFIGS
    round: int | None
    root: str | None
    phases: list[dict[str, Any]]
    data: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0

    def phase(self, name: str) -> dict[str, Any]:
        for p in self.data["phases"]:
            if p["name"] == name:
                return p
        raise KeyError(name)


def _phase(
    name: str,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    one_by_one: bool = False,
    settle: bool = False,
) -> dict[str, Any]:
    return {
        "name": name,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "one_by_one": one_by_one,
        "settle": settle,
    }


def _random_prompts(
    rng: random.Random, count: int, low: int, high: int, vocab: int
) -> list[list[int]]:
    """Unique random prompts (ids 3..vocab-1: no BOS/EOS), so no two share a
    prefix and nothing is a cache hit."""
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(low, high))]
        for _ in range(count)
    ]


def plan_engine_runs(config: BenchConfig, root: str) -> list[EngineRun]:
    """Throughput: ``engine_rounds`` rounds of the three configurations on
    the same prompts (the order rotates per round). TTFT, per model: recompute
    on an engine without the cache, a fill on a cache engine (its root is
    kept) and the hits on a fresh engine pointed at that root. On the
    throughput model, round 0's no-cache and async engines do the recompute
    and the fill after their throughput phase (saves two engine starts)."""
    rng = random.Random(config.seed)
    chunk = _engine_chunk_size()
    low, high = config.engine_prompt_tokens
    tput_model = config.engine_model
    vocab = ENGINE_MODELS[tput_model].vocab_size
    warmup = _random_prompts(rng, 2, low, high, vocab)
    prompts = _random_prompts(rng, config.engine_prompts, low, high, vocab)
    ttft_len = -(-config.engine_ttft_tokens // chunk) * chunk + 1
    ttft: dict[str, dict[str, Any]] = {}
    for name in config.engine_ttft_models:
        v = ENGINE_MODELS[name].vocab_size
        # Probe 0 only warms up (it is filled too, so on the cached engine
        # it warms up the load path).
        probes = _random_prompts(
            rng, config.engine_ttft_probes + 1, ttft_len, ttft_len, v
        )
        ttft[name] = {"warmup": probes[:1], "probes": probes[1:]}

    def ttft_phases(name: str, cached: bool) -> list[dict[str, Any]]:
        v = ENGINE_MODELS[name].vocab_size
        phases = [
            # A prefill without a hit first: vLLM 0.32's AMX attention kernel
            # (bfloat16) dies of SIGILL when the first attention of a fresh
            # engine has cached context and no GQA (q_heads_per_kv=1).
            _phase("cold warm-up", _random_prompts(rng, 1, low, low, v), 1),
            # Then the same length as the probes (a hit on the cached engine,
            # which warms up the load path too).
            _phase("ttft warm-up", ttft[name]["warmup"], 1, one_by_one=True),
            _phase("ttft", ttft[name]["probes"], 1, one_by_one=True),
        ]
        if not cached:
            # The same probes again: hits in vLLM's own prefix cache, the
            # floor of any cache (no reads at all).
            phases.append(
                _phase("ttft local hit", ttft[name]["probes"], 1, one_by_one=True)
            )
        return phases

    def fill_phase(name: str) -> dict[str, Any]:
        both = ttft[name]["warmup"] + ttft[name]["probes"]
        # One at a time, written before the next: nothing is skipped.
        return _phase("fill", both, 1, one_by_one=True, settle=True)

    def cache_root(label: str) -> str:
        return os.path.join(root, label.replace(" ", "-").replace(",", ""))

    runs: list[EngineRun] = []
    fill_roots: dict[str, str] = {}
    names = list(ENGINE_CONFIGS)
    for r in range(config.engine_rounds):
        for cfg in names[r % 3 :] + names[: r % 3]:
            label = f"{tput_model}, {cfg}, round {r + 1}"
            phases = [
                _phase("warm-up", warmup, config.engine_max_tokens, settle=True),
                _phase("throughput", prompts, config.engine_max_tokens, settle=True),
            ]
            if r == 0 and tput_model in ttft:
                if cfg == "no cache":
                    phases += ttft_phases(tput_model, cached=False)
                elif cfg == "async":
                    phases.append(fill_phase(tput_model))
            run_root = None if cfg == "no cache" else cache_root(label)
            if r == 0 and cfg == "async" and tput_model in ttft:
                fill_roots[tput_model] = run_root or ""
            runs.append(EngineRun(label, tput_model, cfg, r, run_root, phases))
    for name in ttft:
        if name not in fill_roots:
            runs.append(
                EngineRun(
                    f"{name}, no cache, recompute",
                    name,
                    "no cache",
                    None,
                    None,
                    ttft_phases(name, cached=False),
                )
            )
            label = f"{name}, async, fill"
            fill_roots[name] = cache_root(label)
            runs.append(
                EngineRun(
                    label, name, "async", None, fill_roots[name], [fill_phase(name)]
                )
            )
        runs.append(
            EngineRun(
                f"{name}, async, cached (fresh engine)",
                name,
                "async",
                None,
                fill_roots[name],
                ttft_phases(name, cached=True),
            )
        )
    return runs


#: The core of every engine's forward pass (VLLM_CPU_OMP_THREADS_BIND=0).
FORWARD_CORE = 0


def _engine_env(config: BenchConfig, cfg: str, root: str | None) -> dict[str, str]:
    """Set before vLLM is imported in the engine's process. Every
    configuration runs its forward pass on one thread on core 0; the cache's
    backend processes move themselves to the other cores.

    By default the engine is one process (VLLM_ENABLE_V1_MULTIPROCESSING=0:
    scheduler and worker together, a fast start). vLLM applies
    VLLM_CPU_OMP_THREADS_BIND only to the worker processes it spawns, so in
    that mode :func:`_pin_forward_core` and OMP_NUM_THREADS=1 do the same
    (left alone, the forward pass runs two threads over both cores and
    competes with the backends)."""
    env = {k: v for k, v in os.environ.items() if k not in _ENGINE_ENV_OWNED}
    env |= {
        "VLLM_CPU_OMP_THREADS_BIND": str(FORWARD_CORE),
        "VLLM_CPU_KVCACHE_SPACE": str(config.engine_kvcache_space_gib),
        "PYTHONUNBUFFERED": "1",
    }
    if not config.engine_multiprocessing:
        env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    async_update = ENGINE_CONFIGS[cfg]
    if async_update is None:
        env["VLLM_USE_VINEYARD_CACHE"] = "0"
    else:
        assert root is not None
        env |= {
            "VLLM_USE_VINEYARD_CACHE": "1",
            "VINEYARD_CACHE_ENABLE_ASYNC_UPDATE": async_update,
            "VINEYARD_CACHE_ROOT": root,
            "VINEYARD_CACHE_METRICS_ENABLED": "1",
        }
    return env


def _pin_forward_core() -> None:
    """In the engine's process before exec: the whole process on core 0."""
    if hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {FORWARD_CORE})


def _run_engine_process(
    config: BenchConfig, run: EngineRun, model_path: str, workdir: str
) -> None:
    slug = run.label.replace(" ", "_").replace(",", "").replace("(", "")
    slug = slug.replace(")", "")
    spec_path = os.path.join(workdir, f"{slug}.spec.json")
    result_path = os.path.join(workdir, f"{slug}.result.json")
    log_path = os.path.join(workdir, f"{slug}.log")
    longest = max(len(p) for phase in run.phases for p in phase["prompts"])
    longest += max(phase["max_tokens"] for phase in run.phases)
    spec = {
        "use_cache": ENGINE_CONFIGS[run.config] is not None,
        "llm_kwargs": {
            "model": model_path,
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "dtype": config.engine_dtype,
            "max_model_len": -(-(longest + 1) // 256) * 256,
            "max_num_batched_tokens": config.engine_max_num_batched_tokens,
            "disable_log_stats": False,  # LLM.get_metrics() needs the stats
            "seed": 0,
        },
        "phases": run.phases,
        "settle_s": 300.0,
        "result": result_path,
    }
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if run.root:
        os.makedirs(run.root, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--run-engine", spec_path],
            env=_engine_env(config, run.config, run.root),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so a timeout kills its whole tree
            preexec_fn=None if config.engine_multiprocessing else _pin_forward_core,
        )
        try:
            proc.wait(timeout=config.engine_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    run.wall_s = time.perf_counter() - start
    data: dict[str, Any] = {}
    if os.path.exists(result_path):
        with open(result_path) as f:
            data = json.load(f)
    error = data.get("error") if data else "the engine wrote no result"
    if proc.returncode != 0 or error:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-6000:]
        raise RuntimeError(
            f"engine {run.label!r} failed (exit code {proc.returncode}): "
            f"{error}\n--- last lines of {log_path} ---\n{tail}"
        )
    run.data = data


def _hist_mean(phase: Mapping[str, Any], name: str) -> float | None:
    count, total = phase["histograms"].get(name, [0, 0.0])
    return total / count if count else None


def _hist_sum(phase: Mapping[str, Any], name: str) -> float:
    return float(phase["histograms"].get(name, [0, 0.0])[1])


def _throughput_row(run: EngineRun, kv_per_token: int) -> dict[str, Any]:
    p = run.phase("throughput")
    c = p["counters"]
    tokens = p["prompt_tokens"] + p["output_tokens"]
    completed = c.get("updates_completed", 0)
    written = c.get("tokens_written", 0)
    exec_sum = _hist_sum(p, "update_exec")
    row: dict[str, Any] = {
        "round": run.round,
        "tokens": tokens,
        "wall_s": p["wall_s"],
        "tokens_per_s": tokens / p["wall_s"],
        "drain_s": p["settle_s"],
        "startup_s": run.data.get("startup_s"),
        "counters": c,
        "save_caller_mean_s": _hist_mean(p, "save_caller"),
        "save_caller_sum_s": _hist_sum(p, "save_caller"),
        "update_exec_mean_s": _hist_mean(p, "update_exec"),
        "update_queue_delay_mean_s": _hist_mean(p, "update_queue_delay"),
        "bytes_per_update": written * kv_per_token / completed if completed else None,
        "write_gbps": written * kv_per_token / exec_sum / GB if exec_sum else None,
        "save_share": _hist_sum(p, "save_caller") / p["wall_s"],
    }
    if run.config == "sync":
        # The forward thread also waits for each write (queue + write).
        waited = exec_sum + _hist_sum(p, "update_queue_delay")
        row["save_share"] = (row["save_caller_sum_s"] + waited) / p["wall_s"]
    return row


def _memcpy_s(nbytes: int, iters: int = 7) -> float:
    """Median time of one copy of ``nbytes`` with one torch thread (the CPU
    worker's forward thread runs one OpenMP thread with THREADS_BIND=0)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(max(nbytes, 1), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        times = []
        for _ in range(iters + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(threads)


def summarize_engine(config: BenchConfig, runs: list[EngineRun]) -> dict[str, Any]:
    return {
        "throughput": _summarize_throughput(config, runs)
        if config.engine_rounds
        else None,
        "ttft": _summarize_ttft(config, runs),
    }


def _summarize_throughput(config: BenchConfig, runs: list[EngineRun]) -> dict[str, Any]:
    dtype = config.engine_dtype
    model = config.engine_model
    kvpt = kv_bytes_per_token(ENGINE_MODELS[model], dtype)
    rows: dict[str, Any] = {}
    for cfg in ENGINE_CONFIGS:
        rounds = [
            _throughput_row(r, kvpt)
            for r in runs
            if r.model == model and r.config == cfg and r.round is not None
        ]
        best = max(rounds, key=lambda x: x["tokens_per_s"])
        rows[cfg] = {"best": best, "rounds": rounds}
    base = rows["no cache"]["best"]["tokens_per_s"]
    # Per round, against the no-cache run of the same round.
    by_round = {x["round"]: x["tokens_per_s"] for x in rows["no cache"]["rounds"]}
    for row in rows.values():
        row["relative"] = row["best"]["tokens_per_s"] / base
        row["relative_per_round"] = [
            x["tokens_per_s"] / by_round[x["round"]] for x in row["rounds"]
        ]
    async_best = rows["async"]["best"]
    memcpy = None
    if async_best["bytes_per_update"]:
        nbytes = int(async_best["bytes_per_update"])
        memcpy = {"bytes": nbytes, "median_s": _memcpy_s(nbytes)}
        if async_best["save_caller_mean_s"]:
            memcpy["async_save_over_memcpy"] = (
                async_best["save_caller_mean_s"] / memcpy["median_s"]
            )
        # The physical floor of async updates: one copy of every update on
        # the forward thread, against the no-cache run's time.
        updates = async_best["counters"].get("updates_submitted", 0)
        no_cache_wall = rows["no cache"]["best"]["wall_s"]
        memcpy["floor_share"] = updates * memcpy["median_s"] / no_cache_wall
        memcpy["floor_relative"] = 1 / (1 + memcpy["floor_share"])
    return {
        "model": model,
        "model_config": asdict(ENGINE_MODELS[model]),
        "kv_bytes_per_token": kvpt,
        "prompts": config.engine_prompts,
        "prompt_tokens": config.engine_prompt_tokens,
        "max_tokens": config.engine_max_tokens,
        "rounds": config.engine_rounds,
        "configs": rows,
        "memcpy": memcpy,
        "target": TARGET_ASYNC_THROUGHPUT,
        "pass": rows["async"]["relative"] >= TARGET_ASYNC_THROUGHPUT,
    }


def _summarize_ttft(config: BenchConfig, runs: list[EngineRun]) -> list[dict]:
    dtype = config.engine_dtype
    ttft_rows = []
    for name in config.engine_ttft_models:
        recompute = next(
            r
            for r in runs
            if r.model == name
            and r.config == "no cache"
            and any(p["name"] == "ttft" for p in r.phases)
        )
        cached = next(r for r in runs if r.model == name and "cached" in r.label)
        rp, cp = recompute.phase("ttft"), cached.phase("ttft")
        probe_len = len(cached.phases[-1]["prompts"][0])
        rec_s = statistics.median(rp["request_s"])
        hit_s = statistics.median(cp["request_s"])
        local = recompute.phase("ttft local hit")
        ttft_rows.append(
            {
                "model": name,
                "model_config": asdict(ENGINE_MODELS[name]),
                "kv_bytes_per_token": kv_bytes_per_token(ENGINE_MODELS[name], dtype),
                "prompt_tokens": probe_len,
                "recompute_s": rp["request_s"],
                "cached_s": cp["request_s"],
                "recompute_median_s": rec_s,
                "cached_median_s": hit_s,
                "local_hit_s": local["request_s"],
                "local_hit_median_s": statistics.median(local["request_s"]),
                "speedup": rec_s / hit_s,
                "cached_tokens": cp["num_cached_tokens"],
                "fully_cached": all(
                    n >= probe_len - 1 for n in cp["num_cached_tokens"]
                ),
                "load_mean_s": _hist_mean(cp, "load"),
                "hit_tokens": cp["counters"].get("hit_tokens", 0),
                "query_tokens": cp["counters"].get("query_tokens", 0),
                "target": TARGET_TTFT_SPEEDUP,
                "pass": rec_s / hit_s >= TARGET_TTFT_SPEEDUP,
            }
        )
    return ttft_rows


def run_engine(config: BenchConfig, ws: Workspace) -> dict:
    t0 = time.perf_counter()
    model_dir = os.path.expanduser(config.engine_model_dir)
    names = dict.fromkeys([config.engine_model, *config.engine_ttft_models])
    paths = {
        name: make_toy_llama(os.path.join(model_dir, name), ENGINE_MODELS[name])
        for name in names
    }
    engine_root = os.path.join(ws.path, "engine")
    workdir = os.path.join(ws.path, "engine-logs")
    os.makedirs(workdir, exist_ok=True)
    runs = plan_engine_runs(config, engine_root)
    still_needed = {r.root for r in runs if "cached" in r.label}
    layout = (
        "vLLM's multi-process layout, worker bound by VLLM_CPU_OMP_THREADS_BIND=0"
        if config.engine_multiprocessing
        else "VLLM_ENABLE_V1_MULTIPROCESSING=0, the process pinned to core 0, "
        "OMP_NUM_THREADS=1"
    )
    print(
        f"\n[engine] {len(runs)} engine processes, one after the other "
        f"({layout}; "
        f"VLLM_CPU_KVCACHE_SPACE={config.engine_kvcache_space_gib}, "
        f"enforce_eager, {config.engine_dtype}); throughput model "
        + _model_desc(config.engine_model, config.engine_dtype)
    )
    for i, run in enumerate(runs, 1):
        print(f"  [{i}/{len(runs)}] {run.label} ...", end="", flush=True)
        try:
            _run_engine_process(config, run, paths[run.model], workdir)
        finally:
            if run.root and (run.root not in still_needed or "cached" in run.label):
                shutil.rmtree(run.root, ignore_errors=True)
        note = ""
        if any(p["name"] == "throughput" for p in run.phases):
            p = run.phase("throughput")
            tokens = p["prompt_tokens"] + p["output_tokens"]
            note = f", throughput {tokens / p['wall_s']:.0f} tok/s"
        print(
            f" {run.wall_s:.0f} s (startup {run.data.get('startup_s', 0):.0f} s"
            f"{note}; cores {run.data.get('affinity')}, "
            f"{run.data.get('torch_threads')} thread(s); load "
            f"{os.getloadavg()[0]:.2f})",
            flush=True,
        )
    result = summarize_engine(config, runs)
    result["dtype"] = config.engine_dtype
    result["chunk_size"] = _engine_chunk_size()
    result["max_num_batched_tokens"] = config.engine_max_num_batched_tokens
    result["passed_env"] = {
        k: v
        for k, v in os.environ.items()
        if k.startswith("VINEYARD_CACHE_") and k not in _ENGINE_ENV_OWNED
    }
    result["runs"] = [
        {
            "label": r.label,
            "model": r.model,
            "config": r.config,
            "round": r.round,
            "wall_s": r.wall_s,
            "startup_s": r.data.get("startup_s"),
            "affinity": r.data.get("affinity"),
            "torch_threads": r.data.get("torch_threads"),
            "cache_config": r.data.get("cache_config"),
            "phases": [
                {k: v for k, v in p.items() if k != "num_cached_tokens"}
                for p in r.data.get("phases", [])
            ],
        }
        for r in runs
    ]
    result["elapsed_s"] = time.perf_counter() - t0
    return result


def _opt_ms(seconds: float | None, digits: int = 1) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def print_engine(config: BenchConfig, result: dict) -> None:
    if result["throughput"]:
        _print_throughput(result)
    _print_ttft(result)


def _print_throughput(result: dict) -> None:
    tp = result["throughput"]
    low, high = tp["prompt_tokens"]
    print(
        f"\n[engine 1] Throughput with no cache hits, {tp['prompts']} unique "
        f"prompts of {low}-{high} tokens + {tp['max_tokens']} generated, "
        f"submitted at once; best of {tp['rounds']} round(s) per "
        f"configuration\n  model "
        + _model_desc(tp["model"], result["dtype"])
        + f", chunk {result['chunk_size']}, max_num_batched_tokens "
        f"{result['max_num_batched_tokens']}"
    )
    rows = []
    for cfg, row in tp["configs"].items():
        b = row["best"]
        c = b["counters"]
        cached = cfg != "no cache"
        rows.append(
            [
                cfg,
                f"{b['tokens_per_s']:.0f}",
                f"{100 * row['relative']:.1f}%",
                ", ".join(f"{x['tokens_per_s']:.0f}" for x in row["rounds"]),
                ", ".join(f"{100 * x:.0f}%" for x in row["relative_per_round"]),
                f"{b['wall_s']:.1f}",
                str(c.get("updates_submitted", 0)) if cached else "-",
                str(c.get("updates_skipped", 0)) if cached else "-",
                str(c.get("tokens_written", 0)) if cached else "-",
                _opt_ms(b["save_caller_mean_s"], 2) if cached else "-",
                _opt_ms(b["update_exec_mean_s"], 0) if cached else "-",
                f"{b['write_gbps']:.2f}" if b["write_gbps"] else "-",
                f"{100 * b['save_share']:.1f}%" if cached else "-",
                f"{b['drain_s']:.1f}" if cached else "-",
            ]
        )
    print(
        _table(
            [
                "config",
                "tok/s",
                "vs no cache",
                "rounds tok/s",
                "per round",
                "wall s",
                "updates",
                "skipped",
                "tokens written",
                "save ms/upd",
                "write ms/upd",
                "write GB/s",
                "fwd in save",
                "drain s",
            ],
            rows,
        )
    )
    verdict = "PASS" if tp["pass"] else "FAIL"
    print(
        f"  target: async >= {100 * tp['target']:.0f}% of no cache: {verdict} "
        f"({100 * tp['configs']['async']['relative']:.1f}%; sync "
        f"{100 * tp['configs']['sync']['relative']:.1f}%)"
    )
    memcpy = tp.get("memcpy")
    if memcpy:
        ratio = memcpy.get("async_save_over_memcpy")
        print(
            f"  forward thread per async update: "
            f"{_opt_ms(tp['configs']['async']['best']['save_caller_mean_s'], 2)} ms "
            f"vs {_opt_ms(memcpy['median_s'], 2)} ms for one memcpy of the same "
            f"{memcpy['bytes'] / MiB:.1f} MiB (1 thread, measured here)"
            + (
                f" = {ratio:.2f}x "
                f"({'PASS' if ratio <= TARGET_CALLER_RATIO else 'FAIL'}, "
                f"target <= {TARGET_CALLER_RATIO}x)"
                if ratio
                else ""
            )
        )
    if memcpy and "floor_share" in memcpy:
        print(
            f"  copy floor: {100 * memcpy['floor_share']:.1f}% of the no-cache "
            "run's time is one memcpy per async update, so even at the floor "
            f"async would reach about {100 * memcpy['floor_relative']:.1f}% of "
            "no cache at this KV rate"
        )
    print(
        "  tok/s: (prompt + generated tokens) / wall time of generate(), after a "
        "warm-up; per round: vs the no-cache run of the same round; "
        "updates/skipped/tokens written: vllm:vineyard_cache_* counters; save "
        "ms/upd: save_caller histogram (copy into a staging buffer + submit); "
        "write: the backend's time per update; fwd in save: share of the wall "
        "time the forward thread spent in save() (sync: plus waiting for the "
        "write); drain: after generate() returned, until every update was "
        "written (not in tok/s)."
    )


def _print_ttft(result: dict) -> None:
    print(
        "\n[engine 2] Time to first token of one prompt at a time (wall time "
        "of generate(max_tokens=1)); cached: a fresh engine whose cache root a "
        "previous engine filled (the hit comes from vineyard)"
    )
    rows = []
    for t in result["ttft"]:
        rows.append(
            [
                t["model"],
                f"{t['kv_bytes_per_token'] // 1024} KiB",
                str(t["prompt_tokens"]),
                f"{_opt_ms(t['recompute_median_s'], 0)}",
                f"{_opt_ms(t['cached_median_s'], 0)}",
                f"{_opt_ms(t['local_hit_median_s'], 0)}",
                f"{t['speedup']:.1f}x",
                ", ".join(str(n) for n in t["cached_tokens"]),
                _opt_ms(t["load_mean_s"], 0),
                f"{t['kv_bytes_per_token'] * (t['prompt_tokens'] - 1) / MiB:.0f}",
                f"{'PASS' if t['pass'] else 'FAIL'} (>= {t['target']:.0f}x)",
            ]
        )
    print(
        _table(
            [
                "model",
                "KV/token",
                "prompt",
                "recompute ms",
                "cached ms",
                "vLLM hit ms",
                "speedup",
                "cached tokens",
                "load ms",
                "KV MiB",
                "target",
            ],
            rows,
        )
    )
    print(
        "  medians of the probes; cached: a vineyard hit; vLLM hit: the same "
        "probes again on the no-cache engine, served by vLLM's own prefix "
        "cache (no reads: the floor of any cache); speedup: recompute / "
        "cached; load: the worker's load() of the cached KV (load histogram), "
        "besides which the scheduler's lookup reads the same chunks once "
        "more. Reads come from the page cache (the chunks were just written)."
    )
    for t in result["ttft"]:
        if not t["fully_cached"]:
            print(
                f"  WARNING: {t['model']}: not every probe was fully cached "
                f"({t['cached_tokens']})"
            )


# --------------------------------------------------------------------------
# The plot.
# --------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def draw_plot(results: dict[str, Any], path: str) -> None:
    """Draw the results of the parts that ran into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    engine = results.get("engine")
    core = results.get("core")
    panels: list[Callable[[Any], None]] = []
    colors = {"no cache": "#7f7f7f", "sync": "#d62728", "async": "#1f77b4"}

    def throughput(ax: Any) -> None:
        assert engine is not None
        tp = engine["throughput"]
        names = list(tp["configs"])
        values = [tp["configs"][n]["best"]["tokens_per_s"] for n in names]
        bars = ax.bar(names, values, color=[colors[n] for n in names])
        for bar, n in zip(bars, names, strict=True):
            rel = tp["configs"][n]["relative"]
            ax.annotate(
                f"{bar.get_height():.0f}\n({100 * rel:.1f}%)",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
            for x in tp["configs"][n]["rounds"]:
                ax.plot(
                    bar.get_x() + bar.get_width() / 2,
                    x["tokens_per_s"],
                    "k.",
                    markersize=4,
                )
        target = tp["target"] * values[0]
        ax.axhline(target, color="k", linestyle="--", linewidth=0.8)
        ax.text(
            1.0,
            target,
            f"target: async >= {100 * tp['target']:.0f}% of no cache",
            ha="center",
            va="bottom",
            fontsize=7,
        )
        ax.set_ylim(0, max(values) * 1.25)
        ax.set_ylabel("tokens/s (prompt + generated)")
        kib = tp["kv_bytes_per_token"] // 1024
        ax.set_title(
            f"Engine throughput, no cache hits\n{tp['model']} model "
            f"({kib} KiB KV/token), best of {tp['rounds']} (dots: rounds)",
            fontsize=9,
        )

    def ttft(ax: Any) -> None:
        assert engine is not None
        rows = engine["ttft"]
        x = list(range(len(rows)))
        w = 0.27
        rec = [r["recompute_median_s"] * 1e3 for r in rows]
        hit = [r["cached_median_s"] * 1e3 for r in rows]
        local = [r["local_hit_median_s"] * 1e3 for r in rows]
        ax.bar([i - w for i in x], rec, w, label="recompute", color="#7f7f7f")
        ax.bar(x, hit, w, label="vineyard hit (fresh engine)", color="#1f77b4")
        ax.bar(
            [i + w for i in x], local, w, label="vLLM prefix cache hit", color="#2ca02c"
        )
        for i, r in enumerate(rows):
            verdict = "PASS" if r["pass"] else "FAIL"
            ax.annotate(
                f"{r['speedup']:.1f}x\n{verdict}",
                (i, hit[i]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_ylim(min(rec + hit + local) / 3, max(rec + hit + local) * 6)
        ax.set_xticks(
            x,
            [
                f"{r['model']}\n{r['kv_bytes_per_token'] // 1024} KiB KV/token"
                for r in rows
            ],
            fontsize=8,
        )
        ax.set_ylabel("time to first token (ms, log)")
        ax.legend(fontsize=8, loc="upper right")
        tokens = rows[0]["prompt_tokens"] if rows else 0
        ax.set_title(
            f"TTFT of a {tokens}-token prompt, median\n(target: cached >= "
            f"{TARGET_TTFT_SPEEDUP:.0f}x faster)",
            fontsize=9,
        )

    def caller(ax: Any) -> None:
        assert core is not None
        rows = core["caller"]
        x = list(range(len(rows)))
        series = [("memcpy", "memcpy"), ("async", "async save"), ("sync", "sync save")]
        w = 0.8 / len(series)
        for k, (key, label) in enumerate(series):
            ax.bar(
                [i + (k - 1) * w for i in x],
                [r["median_s"][key] * 1e3 for r in rows],
                w,
                label=label,
                color=["#7f7f7f", "#1f77b4", "#d62728"][k],
            )
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(
            x,
            [f"{r['num_tokens']} tok\n{r['bytes'] / MiB:.1f} MiB" for r in rows],
            fontsize=8,
        )
        ax.set_ylabel("caller time per update (ms, log)")
        ax.legend(fontsize=8)
        ax.set_title(
            "Core: forward thread's time per update\n(target: async <= "
            f"{TARGET_CALLER_RATIO}x memcpy)",
            fontsize=9,
        )

    def skip(ax: Any) -> None:
        assert core is not None
        sk = core["skip"]
        rows = sk["rows"]
        m = [r["max_inflight_tasks"] for r in rows]
        ax.plot(m, [100 * r["skip_rate"] for r in rows], "o-", color="#1f77b4")
        for r in rows:
            ax.annotate(
                f"{100 * r['skip_rate']:.0f}%",
                (r["max_inflight_tasks"], 100 * r["skip_rate"]),
                textcoords="offset points",
                xytext=(0, 5),
                ha="center",
                fontsize=8,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(m, [str(v) for v in m])
        ax.set_ylim(-5, 105)
        ax.set_xlabel("VINEYARD_CACHE_MAX_INFLIGHT_TASKS")
        ax.set_ylabel("updates skipped (%)")
        ax.set_title(
            f"Core: skip rate vs in-flight tasks\n{sk['bytes'] / MiB:.1f} MiB "
            f"per update, offered load {sk['offered_load']:.2f}",
            fontsize=9,
        )

    if engine and engine["throughput"]:
        panels.append(throughput)
    if engine and engine["ttft"]:
        panels.append(ttft)
    if core:
        panels += [caller, skip]
    if not panels:
        raise SystemExit("--plot: no results to draw")
    cols = 2 if len(panels) > 1 else 1
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.2 * cols, 3.9 * rows_n))
    flat = list(axes.flat) if hasattr(axes, "flat") else [axes]
    for ax, panel in zip(flat, panels, strict=False):
        panel(ax)
        ax.grid(axis="y", alpha=0.3)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    env = results.get("environment", {})
    load = env.get("load_average_end") or env.get("load_average") or []
    fig.suptitle(
        f"vineyard LLM cache benchmark: {env.get('cpu_count')} CPUs, "
        f"{env.get('cpu_model') or _cpu_model()}, {str(env.get('time', ''))[:10]}"
        + (f", load avg {load[0]:.1f}" if load else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


@dataclass(frozen=True)
class Part:
    """A benchmark part: ``run`` returns its results (stored under the part's
    name), ``show`` prints them."""

    run: Callable[[BenchConfig, Workspace], dict]
    show: Callable[[BenchConfig, dict], None]


#: Parts by name, in the order ``--part all`` runs them.
PARTS: dict[str, Part] = {
    "core": Part(run_core, print_core),
    "engine": Part(run_engine, print_engine),
}


def _environment() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "load_average": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _load_line(values: Sequence[float]) -> str:
    return "/".join(f"{x:.2f}" for x in values)


def show_results(config: BenchConfig, results: dict[str, Any]) -> None:
    """Print the load average of the run (the figures are only as good as
    the machine was quiet)."""
    env = results["environment"]
    print(
        "\nload average (1/5/15 min) at start "
        + _load_line(env["load_average"])
        + ", at end "
        + _load_line(env.get("load_average_end") or env["load_average"])
        + f" on {env['cpu_count']} CPUs ({env.get('cpu_model')}); other work "
        "on the machine skews timings"
    )
    if "elapsed_s" in results:
        print(f"total time {results['elapsed_s']:.0f} s")


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.run_engine:
        _engine_child(args.run_engine)  # does not return
    if args.from_json:
        with open(args.from_json) as f:
            loaded: dict[str, Any] = json.load(f)
        config = BenchConfig(**loaded["config"])
        for name in PARTS:
            if name in loaded:
                PARTS[name].show(config, loaded[name])
        show_results(config, loaded)
        if args.plot:
            draw_plot(loaded, args.plot)
            print(f"plot written to {args.plot}")
        return loaded
    config = resolve_config(args)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    chosen = args.part or ["core"]
    parts = list(PARTS) if "all" in chosen else list(dict.fromkeys(chosen))
    start = time.perf_counter()
    results: dict[str, Any] = {
        "command": " ".join(
            ["python", "benchmarks/benchmark_vineyard_llm_cache.py"]
            + list(sys.argv[1:] if argv is None else argv)
        ),
        "config": asdict(replace(config)),
        "environment": _environment(),
    }
    print(
        f"vineyard LLM cache benchmark, parts {', '.join(parts)}; "
        f"{os.cpu_count()} CPUs ({_cpu_model()}), torch threads "
        f"{torch.get_num_threads()}, load average "
        f"{_load_line(results['environment']['load_average'])}"
    )
    if "core" in parts:
        print(
            f"core: {config.num_layers} layers, {config.num_kv_heads} KV heads, "
            f"head size {config.head_size}, {config.dtype}, block "
            f"{config.block_size}, chunk {config.chunk_size} "
            f"({config.update_bytes(config.block_size) // config.block_size} B "
            "of KV per token)"
        )
    ws = Workspace(config.root)
    try:
        for name in parts:
            results[name] = PARTS[name].run(config, ws)
            PARTS[name].show(config, results[name])
    finally:
        ws.close()
    results["environment"]["load_average_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - start
    show_results(config, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"results written to {args.json}")
    if args.plot:
        draw_plot(results, args.plot)
        print(f"plot written to {args.plot}")
    return results


if __name__ == "__main__":
    main()
