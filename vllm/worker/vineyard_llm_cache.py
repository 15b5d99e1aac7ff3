# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A KV cache for vLLM in vineyard.

After each forward pass the KV of newly completed chunks is copied into a
staging buffer from :class:`_PinnedTensorPool` and written to vineyard by
:class:`_AsyncUpdater`, strictly in issue order. A later request (on this or
another instance) that starts with a cached prefix loads that KV instead of
recomputing it. :class:`VineyardLLMCache` is what vLLM's KV connector calls.

The vineyard calls themselves run in backend processes
(:mod:`vllm.worker.vineyard_backend`): one for writes, one for reads, so the
GIL that vineyard holds never stalls the engine, and a read never waits
behind a write.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import mmap
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger

from vllm.worker.vineyard_backend import BackendError, BackendProcess, BackendSpec
from vllm.worker.vineyard_plugin import BOOL_ALLOWED, parse_bool

logger = init_logger(__name__)

# --------------------------------------------------------------------------
# Configuration: one table of environment variables, parsed once.
# --------------------------------------------------------------------------


def _number_parser(
    kind: type, low: float | None, low_inclusive: bool, high: float | None
) -> tuple[Callable[[str, str], Any], str]:
    """A parser, and what it allows, for a number in [low, high] or (low, high]."""
    opening = "[" if low_inclusive else "("
    allowed = (
        f"{'an integer' if kind is int else 'a number'} in "
        f"{opening}{'-inf' if low is None else low}, "
        f"{'inf' if high is None else high}]"
    )

    def parse(name: str, raw: str) -> Any:
        try:
            value = kind(raw.strip())
        except ValueError:
            raise ValueError(
                f"{name}={raw!r} is not valid; allowed: {allowed}"
            ) from None
        if (
            (isinstance(value, float) and not math.isfinite(value))
            or (
                low is not None
                and (value < low or (value == low and not low_inclusive))
            )
            or (high is not None and value > high)
        ):
            raise ValueError(f"{name}={raw!r} is out of range; allowed: {allowed}")
        return value

    return parse, allowed


def _parse_path(name: str, raw: str) -> str:
    if not raw.strip():
        raise ValueError(f"{name} is empty; allowed: a directory path")
    return os.path.abspath(os.path.expanduser(raw.strip()))


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    allowed: str
    help: str
    parse: Callable[[str, str], Any]


def _env_var(
    name: str,
    default: str,
    help: str,
    parse: Callable[[str, str], Any],
    allowed: str,
) -> EnvVar:
    return EnvVar(name, default, allowed, help, parse)


_positive_int = _number_parser(int, 1, True, None)

#: Every environment variable of the cache. The docs' table is checked
#: against this one by a test.
ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in [
        _env_var(
            "VLLM_USE_VINEYARD_CACHE",
            "0",
            "1 turns the vineyard cache on for `vllm serve` and "
            "`LLM(...)` with no other flag.",
            parse_bool,
            BOOL_ALLOWED,
        ),
        _env_var(
            "VINEYARD_CACHE_CPU_MEM_LIMIT_GB",
            "8",
            "CPU memory budget (GiB) of the cache's staging buffers on each worker.",
            *_number_parser(float, 0, False, None),
        ),
        _env_var(
            "VINEYARD_CACHE_ENABLE_ASYNC_UPDATE",
            "1",
            "1: updates are written in the background; 0: the forward "
            "thread waits for every write.",
            parse_bool,
            BOOL_ALLOWED,
        ),
        _env_var(
            "VINEYARD_CACHE_ASYNC_UPDATE_CPU_MEM_UTIL",
            "0.5",
            "Share of the memory limit given to the update buffer pool.",
            *_number_parser(float, 0, True, 1),
        ),
        _env_var(
            "VINEYARD_CACHE_MIN_INFLIGHT_TASKS",
            "1",
            "Fewest update buffers (allocated at startup).",
            *_positive_int,
        ),
        _env_var(
            "VINEYARD_CACHE_MAX_INFLIGHT_TASKS",
            "4",
            "Most update buffers, i.e. updates in flight; when all are "
            "busy an update is skipped (and resumed later).",
            *_positive_int,
        ),
        _env_var(
            "VINEYARD_CACHE_METRICS_ENABLED",
            "0",
            "1: also collect timing histograms (counters are always on).",
            parse_bool,
            BOOL_ALLOWED,
        ),
        _env_var(
            "VINEYARD_CACHE_ROOT",
            "/tmp/vineyard/llm_cache",
            "Directory of the file backend (local disk, or a shared "
            "filesystem for several instances).",
            _parse_path,
            "a directory path",
        ),
        _env_var(
            "VINEYARD_CACHE_CHUNK_SIZE",
            "256",
            "Tokens per cached chunk.",
            _positive_int[0],
            "a positive multiple of vLLM's block size",
        ),
        _env_var(
            "VINEYARD_CACHE_TTL_S",
            "1800",
            "Seconds after which a process deletes the chunks it wrote.",
            *_positive_int,
        ),
        _env_var(
            "VINEYARD_CACHE_BACKEND_TIMEOUT_S",
            "30",
            "Longest wait for one backend call before the backend is "
            "restarted and the call counted as failed.",
            *_number_parser(float, 0, False, None),
        ),
        _env_var(
            "VINEYARD_CACHE_DRAIN_TIMEOUT_S",
            "5",
            "At shutdown, how long pending updates may still be "
            "written before they are dropped.",
            *_number_parser(float, 0, True, None),
        ),
    ]
}


@dataclass(frozen=True)
class VineyardLLMCacheConfig:
    """The parsed environment (see :data:`ENV_VARS`)."""

    enabled: bool = False
    cpu_mem_limit_gb: float = 8.0
    enable_async_update: bool = True
    async_update_cpu_mem_util: float = 0.5
    min_inflight_tasks: int = 1
    max_inflight_tasks: int = 4
    metrics_enabled: bool = False
    root: str = "/tmp/vineyard/llm_cache"
    chunk_size: int = 256
    ttl_s: int = 1800
    backend_timeout_s: float = 30.0
    drain_timeout_s: float = 5.0

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None
    ) -> VineyardLLMCacheConfig:
        """Parse and validate the environment; raises ``ValueError`` naming
        the variable, the value given and what is allowed."""
        environ = os.environ if environ is None else environ
        values = {
            name: var.parse(name, environ.get(name, var.default))
            for name, var in ENV_VARS.items()
        }
        config = cls(
            enabled=values["VLLM_USE_VINEYARD_CACHE"],
            cpu_mem_limit_gb=values["VINEYARD_CACHE_CPU_MEM_LIMIT_GB"],
            enable_async_update=values["VINEYARD_CACHE_ENABLE_ASYNC_UPDATE"],
            async_update_cpu_mem_util=values[
                "VINEYARD_CACHE_ASYNC_UPDATE_CPU_MEM_UTIL"
            ],
            min_inflight_tasks=values["VINEYARD_CACHE_MIN_INFLIGHT_TASKS"],
            max_inflight_tasks=values["VINEYARD_CACHE_MAX_INFLIGHT_TASKS"],
            metrics_enabled=values["VINEYARD_CACHE_METRICS_ENABLED"],
            root=values["VINEYARD_CACHE_ROOT"],
            chunk_size=values["VINEYARD_CACHE_CHUNK_SIZE"],
            ttl_s=values["VINEYARD_CACHE_TTL_S"],
            backend_timeout_s=values["VINEYARD_CACHE_BACKEND_TIMEOUT_S"],
            drain_timeout_s=values["VINEYARD_CACHE_DRAIN_TIMEOUT_S"],
        )
        if config.min_inflight_tasks > config.max_inflight_tasks:
            raise ValueError(
                "VINEYARD_CACHE_MIN_INFLIGHT_TASKS="
                f"{config.min_inflight_tasks} is greater than "
                "VINEYARD_CACHE_MAX_INFLIGHT_TASKS="
                f"{config.max_inflight_tasks}; allowed: MIN <= MAX"
            )
        return config

    def check_chunk_size(self, block_size: int) -> None:
        if self.chunk_size % block_size != 0:
            raise ValueError(
                f"VINEYARD_CACHE_CHUNK_SIZE={self.chunk_size} is not a "
                f"multiple of the KV block size {block_size}; allowed: a "
                f"positive multiple of {block_size}"
            )

    def num_update_buffers(self, buffer_bytes: int) -> int:
        """``floor(UTIL * LIMIT / buffer_bytes)`` clamped to [MIN, MAX];
        raises when even MIN buffers do not fit the budget."""
        budget = self.async_update_cpu_mem_util * self.cpu_mem_limit_gb * (1 << 30)
        fits = int(budget // buffer_bytes)
        if fits < self.min_inflight_tasks:
            need_gb = self.min_inflight_tasks * buffer_bytes / (1 << 30)
            raise ValueError(
                "VINEYARD_CACHE_ASYNC_UPDATE_CPU_MEM_UTIL="
                f"{self.async_update_cpu_mem_util} x "
                f"VINEYARD_CACHE_CPU_MEM_LIMIT_GB={self.cpu_mem_limit_gb} "
                f"gives {budget / (1 << 30):.3f} GiB, too small for "
                f"VINEYARD_CACHE_MIN_INFLIGHT_TASKS="
                f"{self.min_inflight_tasks} update buffer(s) of "
                f"{buffer_bytes / (1 << 20):.1f} MiB each (one step of KV); "
                f"allowed: UTIL x LIMIT >= {need_gb:.3f} GiB (or fewer "
                "max_num_batched_tokens)"
            )
        return min(fits, self.max_inflight_tasks)


# --------------------------------------------------------------------------
# What the cached bytes depend on.
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class KVCacheLayout:
    """The shape of the KV that the cache stores, and its namespace.

    Vineyard keys chunks by token ids alone, so everything that makes the
    bytes of a block differ goes into the namespace: two models (or dtypes,
    block sizes, kernel layouts, TP shards) sharing one root never see each
    other's KV.
    """

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    block_bytes: int  # one block of one layer
    kv_layout: str  # attention backend and per-layer tensor shape
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        if self.block_bytes % (2 * self.block_size) != 0:
            raise ValueError(
                f"KV block of {self.block_bytes} bytes cannot be split into "
                f"{self.block_size} token slices of K and V halves"
            )

    @property
    def namespace(self) -> str:
        ident = json.dumps(
            {k: getattr(self, k) for k in sorted(self.__dataclass_fields__)},
            sort_keys=True,
        )
        digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
        name = re.sub(
            r"[^A-Za-z0-9._-]+", "_", os.path.basename(self.model.rstrip("/"))
        )[:48]
        return f"{name}-{digest}-tp{self.tp_size}r{self.tp_rank}"


# --------------------------------------------------------------------------
# Metrics.
# --------------------------------------------------------------------------

COUNTERS = (
    "query_tokens",  # tokens looked up beyond vLLM's local prefix hit
    "hit_tokens",  # of those, tokens found in vineyard
    "loaded_tokens",  # tokens copied from vineyard into KV blocks
    "load_errors",  # loads that returned fewer tokens than promised
    "updates_submitted",
    "updates_completed",
    "updates_skipped",  # no free buffer (max in-flight tasks reached)
    "updates_failed",  # backend error, timeout or death
    "updates_dropped",  # still queued when the drain timeout ran out
    "tokens_written",
    "tokens_rejected",  # vineyard refused (prefix not cached)
    "backend_restarts",
    "backend_start_failures",  # the cache could not start: it is off
)
HISTOGRAMS = (
    "update_queue_delay_s",  # submit -> start of the write
    "update_exec_s",  # the write in the backend
    "save_caller_s",  # forward thread's time per save (copy + submit)
    "load_s",  # forward thread's time per load
)


class VineyardCacheMetrics:
    """Thread-safe counters (always) and timing observations (when enabled).

    :meth:`take` returns what was recorded since the last call (the shape
    vLLM's connector stats want); :attr:`totals` keeps the running counters.
    """

    def __init__(self, histograms_enabled: bool):
        self.histograms_enabled = histograms_enabled
        self._lock = threading.Lock()
        self.totals: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._delta: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._observations: dict[str, list[float]] = {h: [] for h in HISTOGRAMS}

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self.totals[name] += value
            self._delta[name] += value

    def observe(self, name: str, seconds: float) -> None:
        if self.histograms_enabled:
            with self._lock:
                self._observations[name].append(seconds)

    def take(self) -> dict[str, Any]:
        with self._lock:
            counters, self._delta = self._delta, dict.fromkeys(COUNTERS, 0)
            observations = self._observations
            self._observations = {h: [] for h in HISTOGRAMS}
        return {**counters, **observations}

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.totals)


# --------------------------------------------------------------------------
# The staging buffers and the ordered updater.
# --------------------------------------------------------------------------


def _shared_memory(nbytes: int, name: str) -> tuple[int, mmap.mmap]:
    """Anonymous shared memory that a child process can map through the fd.
    Pages are only backed once touched, so unused buffers cost nothing, and
    everything is freed when the last process closes it, crash or not."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd, mmap.mmap(fd, nbytes)


def _pin(tensor: torch.Tensor) -> bool:
    """Page-lock a CPU tensor in place so that device copies are async."""
    if not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
    if int(err) != 0:
        logger.warning(
            "cudaHostRegister failed (%s); copies into the "
            "vineyard staging buffer will be synchronous",
            err,
        )
        return False
    return True


def _unpin(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class _StagingMemory:
    """``count`` buffers of ``[num_layers, max_blocks, block_elems]`` in
    shared memory, viewed as one torch tensor (the backend maps the same
    fd)."""

    def __init__(
        self,
        count: int,
        num_layers: int,
        max_blocks: int,
        block_bytes: int,
        dtype: torch.dtype,
        name: str,
    ):
        element = torch.empty((), dtype=dtype).element_size()
        self.buffer_bytes = num_layers * max_blocks * block_bytes
        self.fd, self._mmap = _shared_memory(count * self.buffer_bytes, name)
        flat = torch.frombuffer(
            self._mmap, dtype=dtype, count=count * self.buffer_bytes // element
        )
        self.tensor = flat.view(count, num_layers, max_blocks, block_bytes // element)

    def close(self) -> None:
        del self.tensor
        # A view may still be alive; then the GC unmaps it later.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        os.close(self.fd)


class _PinnedTensorPool:
    """A bounded pool of staging buffers; :meth:`get` never blocks.

    ``min_buffers`` are allocated (touched and pinned) up front, more up to
    ``max_buffers`` on demand. When every buffer is in flight ``get`` returns
    ``None`` and the caller skips its update.
    """

    def __init__(self, memory: _StagingMemory, min_buffers: int, max_buffers: int):
        assert 1 <= min_buffers <= max_buffers <= memory.tensor.shape[0]
        self._memory = memory
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._pinned: list[torch.Tensor] = []
        self.max_buffers = max_buffers
        self._num_created = 0
        for _ in range(min_buffers):
            self._free.append(self._create())

    def _create(self) -> int:
        buffer_id = self._num_created
        buffer = self._memory.tensor[buffer_id]
        buffer.view(torch.uint8).fill_(0)  # back the pages now, not mid-step
        if _pin(buffer):
            self._pinned.append(buffer)
        self._num_created += 1
        return buffer_id

    def get(self) -> int | None:
        """A free buffer's id, or ``None`` if all are in flight."""
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._num_created < self.max_buffers:
                return self._create()
            return None

    def put(self, buffer_id: int) -> None:
        with self._lock:
            assert buffer_id not in self._free, "buffer returned twice"
            self._free.append(buffer_id)

    def buffer(self, buffer_id: int) -> torch.Tensor:
        return self._memory.tensor[buffer_id]

    @property
    def num_created(self) -> int:
        return self._num_created

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free) + self.max_buffers - self._num_created

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return self._num_created - len(self._free)

    def close(self) -> None:
        for buffer in self._pinned:
            _unpin(buffer)
        self._pinned.clear()


@dataclass
class _UpdateTask:
    """One step's completed chunks, staged in one pool buffer."""

    buffer_id: int
    # (first token slot in the buffer, prefix token ids, chunk token ids)
    segments: list[tuple[int, list[int], list[int]]]
    # (request id, first token) of each segment, to rewind on failure
    origins: list[tuple[str, int]] = field(default_factory=list)
    copy_done: torch.cuda.Event | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    outcome: str = "pending"  # completed / failed / dropped


class _AsyncUpdater:
    """Writes update tasks to vineyard one at a time, in issue order.

    Order matters: vineyard drops an update whose prefix chunks are not cached
    yet. Every task's buffer goes back to the pool whatever happens to it.
    """

    def __init__(
        self,
        write: Callable[[int, list[Any]], list[int]],
        pool: _PinnedTensorPool,
        metrics: VineyardCacheMetrics,
        drain_timeout_s: float,
        on_failed: Callable[[_UpdateTask], None] | None = None,
    ):
        self._write = write
        self._on_failed = on_failed
        self._pool = pool
        self._metrics = metrics
        self._drain_timeout_s = drain_timeout_s
        self._queue: queue.SimpleQueue[_UpdateTask | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="vineyard-cache-updater", daemon=True
        )
        self._thread.start()

    def submit(self, task: _UpdateTask) -> None:
        """Queue a task; never blocks (the pool bounds the queue)."""
        if self._closed:
            self._finish(task, "dropped")
            return
        self._metrics.add("updates_submitted")
        self._queue.put(task)

    def _finish(self, task: _UpdateTask, outcome: str) -> None:
        task.outcome = outcome
        self._metrics.add(f"updates_{outcome}")
        self._pool.put(task.buffer_id)
        task.done.set()

    def _execute(self, task: _UpdateTask) -> None:
        self._metrics.observe(
            "update_queue_delay_s", time.perf_counter() - task.submitted_at
        )
        try:
            if task.copy_done is not None:
                task.copy_done.synchronize()
            start = time.perf_counter()
            stored = self._write(task.buffer_id, task.segments)
            self._metrics.observe("update_exec_s", time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 - the engine must go on
            logger.warning(
                "vineyard cache update failed, %d chunk segment(s) not saved: %s",
                len(task.segments),
                e,
            )
            if self._on_failed is not None:
                self._on_failed(task)
            self._finish(task, "failed")
            return
        lengths = [len(tokens) for _, _, tokens in task.segments]
        written = sum(min(n, k) for n, k in zip(stored, lengths, strict=True))
        submitted = sum(lengths)
        self._metrics.add("tokens_written", written)
        if written < submitted:
            self._metrics.add("tokens_rejected", submitted - written)
        self._finish(task, "completed")

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            if self._stopping.is_set() and time.monotonic() > self._deadline:
                self._finish(task, "dropped")
            else:
                self._execute(task)

    def shutdown(self) -> None:
        """Write what is pending for at most the drain timeout, drop the rest
        (counted), and stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._deadline = time.monotonic() + self._drain_timeout_s
        self._stopping.set()
        self._queue.put(None)
        # One write in progress may outlast the deadline by at most the
        # backend timeout; whoever owns the backend closes it to cut that.
        self._thread.join(self._drain_timeout_s + 1.0)
        if self._thread.is_alive():
            logger.warning(
                "vineyard cache updater still busy after the "
                "drain timeout; abandoning its pending updates"
            )

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


# --------------------------------------------------------------------------
# The cache.
# --------------------------------------------------------------------------


@dataclass
class SaveRequest:
    """One running request as the connector sees it after a forward pass."""

    req_id: str
    token_ids: Sequence[int]  # all tokens known so far (prompt + output)
    num_computed_tokens: int  # tokens whose KV is in blocks after this step
    block_ids: Sequence[int]  # the request's KV blocks, in order
    save_from: int = 0  # first token not known to be in vineyard


def _block_view(kv: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """View a layer's KV tensor block-major: ``[num_blocks, ...]``."""
    if kv.shape[0] == num_blocks:
        return kv
    if kv.dim() > 1 and kv.shape[1] == num_blocks:
        # e.g. FlashAttention's [2, num_blocks, block_size, heads, head_size]
        return kv.transpose(0, 1)
    raise ValueError(
        f"cannot find the block dimension ({num_blocks}) in a "
        f"KV cache tensor of shape {tuple(kv.shape)}"
    )


def _layers_view(layers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """All layers' blocks as one ``[num_layers, num_blocks, block_elems]``
    view, when the layers lie equally spaced in one allocation (as vLLM's CPU
    worker allocates them); else ``None``.

    One gather over this view is one parallel region instead of one per
    layer: with more OpenMP threads than idle cores (the backend writing on
    a shared core, say), every region can wait a scheduler time slice for a
    descheduled thread, which made a per-layer staging copy 5-20x slower."""
    flats = []
    for kv in layers:
        try:
            flat = kv.view(kv.shape[0], -1)
        except RuntimeError:
            return None  # blocks not contiguous inside
        if flat.stride(1) != 1:
            return None
        flats.append(flat)
    first = flats[0]
    if len(flats) == 1:
        return first.unsqueeze(0)
    step, rest = divmod(flats[1].data_ptr() - first.data_ptr(), first.element_size())
    span = (first.shape[0] - 1) * first.stride(0) + first.shape[1]
    if rest or step < span:  # out of order, misaligned or overlapping
        return None
    storage = first.untyped_storage().data_ptr()
    for i, flat in enumerate(flats):
        if (
            flat.shape != first.shape
            or flat.stride() != first.stride()
            or flat.dtype != first.dtype
            or flat.untyped_storage().data_ptr() != storage
            or flat.data_ptr() != first.data_ptr() + i * step * first.element_size()
        ):
            return None
    try:
        return first.as_strided(
            (len(flats), *first.shape),
            (step, *first.stride()),
            first.storage_offset(),
        )
    except RuntimeError:
        return None


class VineyardLLMCache:
    """The vineyard KV cache of one vLLM worker (or of the scheduler, for
    :meth:`lookup` only: pass ``kv_caches=None``).

    Chunks of ``chunk_size`` tokens are the unit of caching; a chunk is saved
    once its KV is fully computed, and usable only if all chunks before it are
    cached. Blocks are moved as opaque bytes.
    """

    def __init__(
        self,
        config: VineyardLLMCacheConfig,
        layout: KVCacheLayout,
        max_num_batched_tokens: int,
        kv_caches: Sequence[torch.Tensor] | None = None,
        num_blocks: int | None = None,
    ):
        config.check_chunk_size(layout.block_size)
        self.config = config
        self.layout = layout
        self.chunk_size = config.chunk_size
        self.metrics = VineyardCacheMetrics(config.metrics_enabled)
        self.root = os.path.join(config.root, layout.namespace)
        # One buffer holds one step's tokens, rounded up to whole chunks.
        self.max_blocks = (
            -(-max_num_batched_tokens // self.chunk_size)
            * self.chunk_size
            // layout.block_size
        )
        dtype = kv_caches[0].dtype if kv_caches else torch.uint8
        element = torch.empty((), dtype=dtype).element_size()
        if layout.block_bytes % element:
            raise ValueError(
                f"block of {layout.block_bytes} bytes is not a "
                f"whole number of {dtype} elements"
            )
        buffer_bytes = layout.num_layers * self.max_blocks * layout.block_bytes
        num_buffers = config.num_update_buffers(buffer_bytes) if kv_caches else 0

        def spec(count: int) -> BackendSpec:
            return BackendSpec(
                root=self.root,
                chunk_size=self.chunk_size,
                ttl_s=config.ttl_s,
                num_layers=layout.num_layers,
                block_size=layout.block_size,
                block_bytes=layout.block_bytes,
                max_blocks=self.max_blocks,
                num_buffers=count,
            )

        self._resume: dict[str, int] = {}
        # (request id, first token) of segments whose write failed: their
        # requests resume from there (filled by the updater thread).
        self._failed_origins: collections.deque[tuple[str, int]] = collections.deque()
        self._closed = False
        # Reads: one buffer, used by lookups and loads.
        self._read_memory = _StagingMemory(
            1,
            layout.num_layers,
            self.max_blocks,
            layout.block_bytes,
            dtype,
            "vineyard-cache-read",
        )
        self._reader = BackendProcess(
            "read", spec(1), self._read_memory.fd, config.backend_timeout_s
        )
        self._kv_blocks: list[torch.Tensor] = []
        self._all_layers: torch.Tensor | None = None
        self._pinned_read = False
        self._pool: _PinnedTensorPool | None = None
        self._updater: _AsyncUpdater | None = None
        self._writer: BackendProcess | None = None
        if kv_caches is not None:
            if len(kv_caches) != layout.num_layers:
                raise ValueError(
                    f"got {len(kv_caches)} KV cache tensors for "
                    f"{layout.num_layers} layers"
                )
            assert num_blocks is not None, "num_blocks is needed with kv"
            self._kv_blocks = [_block_view(kv, num_blocks) for kv in kv_caches]
            for kv in self._kv_blocks:
                got = kv[0].numel() * kv.element_size()
                if got != layout.block_bytes:
                    raise ValueError(
                        f"KV block of {got} bytes, expected {layout.block_bytes}"
                    )
            self.device = kv_caches[0].device
            if self.device.type == "cpu":
                self._all_layers = _layers_view(self._kv_blocks)
            self._write_memory = _StagingMemory(
                num_buffers,
                layout.num_layers,
                self.max_blocks,
                layout.block_bytes,
                dtype,
                "vineyard-cache-write",
            )
            self._pool = _PinnedTensorPool(
                self._write_memory,
                min(config.min_inflight_tasks, num_buffers),
                num_buffers,
            )
            if self.device.type == "cuda" and _pin(self._read_memory.tensor[0]):
                self._pinned_read = True
            self._writer = BackendProcess(
                "write",
                spec(num_buffers),
                self._write_memory.fd,
                config.backend_timeout_s,
                # Writes are background work: when the backend shares a core
                # with the forward pass (an unpinned engine), the pass wins.
                nice=10,
            )
            self._updater = _AsyncUpdater(
                self._write_to_backend,
                self._pool,
                self.metrics,
                config.drain_timeout_s,
                on_failed=lambda task: self._failed_origins.extend(task.origins),
            )
        if kv_caches is None:
            logger.info("vineyard cache lookups at %s", self.root)
        else:
            logger.info(
                "vineyard cache on at %s (chunk %d tokens, %s updates, %d "
                "update buffer(s) of %.1f MiB)",
                self.root,
                self.chunk_size,
                "async" if config.enable_async_update else "sync",
                num_buffers,
                buffer_bytes / (1 << 20),
            )

    # ---- backend calls -----------------------------------------------------

    def _write_to_backend(self, buffer_id: int, segments: list[Any]) -> list[int]:
        assert self._writer is not None
        restarts = self._writer.restarts
        try:
            return self._writer.call("update", buffer_id, segments)
        finally:
            self._count_restarts(self._writer, restarts)

    def _query(
        self, prefix: Sequence[int], tokens: Sequence[int], count_error: bool = True
    ) -> int | None:
        """Read the cached leading chunks of ``tokens`` (which follow
        ``prefix``) into the read buffer; returns tokens read, None on error
        (counted in ``load_errors`` unless the caller counts it)."""
        restarts = self._reader.restarts
        try:
            return self._reader.call("query", 0, list(prefix), list(tokens))
        except BackendError as e:
            logger.warning("vineyard cache read failed, recomputing: %s", e)
            if count_error:
                self.metrics.add("load_errors")
            return None
        finally:
            self._count_restarts(self._reader, restarts)

    def _count_restarts(self, backend: BackendProcess, before: int) -> None:
        if backend.restarts != before:
            self.metrics.add("backend_restarts", backend.restarts - before)

    def _segments(self, start: int, end: int) -> list[tuple[int, int]]:
        """Split ``[start, end)`` into pieces that fit the read buffer."""
        step = self.max_blocks * self.layout.block_size
        return [(s, min(s + step, end)) for s in range(start, end, step)]

    # ---- scheduler side ----------------------------------------------------

    def lookup(
        self, token_ids: Sequence[int], num_local_tokens: int
    ) -> tuple[int, int]:
        """How many tokens beyond vLLM's local prefix hit are cached.

        Returns ``(num_hit_tokens, save_from)``: ``num_hit_tokens`` counts
        whole chunks after ``num_local_tokens`` (at least one token is always
        left to compute); ``save_from`` is the first token that is not known
        to be in vineyard, where the request's saves should start.

        Vineyard cannot tell whether a chunk exists without reading it, so
        this reads single chunks, not the prefix: the last one, then a binary
        search. Chunks are written in order, so a cached chunk implies that
        its prefix was cached; if expiry has since removed an earlier one,
        the worker's load comes up short and vLLM recomputes from there.
        """
        chunk = self.chunk_size
        start = num_local_tokens // chunk * chunk
        limit = (len(token_ids) - 1) // chunk * chunk

        def cached(end: int) -> bool:  # is the chunk ending at ``end`` cached?
            first = end - chunk
            found = self._query(token_ids[:first], token_ids[first:end])
            if found is None:
                raise BackendError("read failed")
            return found == chunk

        try:
            # The local hit's last whole chunk can only be in vineyard if all
            # before it are; if it is not, save the request from the start.
            if start > 0 and not cached(start):
                return 0, 0
            if limit <= start:
                return 0, start
            self.metrics.add("query_tokens", limit - num_local_tokens)
            # Find the last cached chunk end in (start, limit]: ``low`` is
            # known cached (or the local hit), ``high + chunk`` known missing.
            low, high = start, limit
            if not cached(high):
                high -= chunk
                while low < high:
                    mid = (low + high) // 2 // chunk * chunk + chunk
                    if cached(mid):
                        low = mid
                    else:
                        high = mid - chunk
        except BackendError:
            return 0, 0  # backend trouble: recompute (counted by _query)
        hit_end = high
        num_hit = max(0, hit_end - num_local_tokens)
        self.metrics.add("hit_tokens", num_hit)
        return num_hit, hit_end

    # ---- worker side: loads ------------------------------------------------

    def load(
        self, token_ids: Sequence[int], start: int, end: int, block_ids: Sequence[int]
    ) -> int:
        """Copy the cached KV of tokens ``[start, end)`` into the request's
        blocks (``block_ids`` covers the whole request from token 0).

        ``start`` and ``end`` are block-aligned; vineyard reads from the
        chunk boundary at or before ``start``, but blocks before ``start``
        (vLLM's own prefix-cache hit, maybe shared with running requests)
        are never written. Returns the end of what was loaded; less than
        ``end`` means the rest must be recomputed."""
        bs = self.layout.block_size
        assert start % bs == 0 and end % bs == 0
        t0 = time.perf_counter()
        read = self._read_memory.tensor[0]
        loaded = start
        read_from = start // self.chunk_size * self.chunk_size
        for seg_start, seg_end in self._segments(read_from, end):
            # A read error shows as a short load, counted once below.
            found = self._query(
                token_ids[:seg_start], token_ids[seg_start:seg_end], count_error=False
            )
            found = min(found or 0, seg_end - seg_start) // bs * bs
            # Blocks of this segment to write: those at or after ``start``.
            skip = max(0, start - seg_start) // bs
            n = found // bs - skip
            if n > 0:
                first = seg_start // bs + skip
                dst = torch.tensor(block_ids[first : first + n], device=self.device)
                if self._all_layers is not None:
                    self._all_layers.index_copy_(1, dst, read[:, skip : skip + n])
                else:
                    for layer, kv in enumerate(self._kv_blocks):
                        src = read[layer, skip : skip + n].view(n, *kv.shape[1:])
                        kv.index_copy_(0, dst, src.to(self.device, non_blocking=True))
                    if self.device.type == "cuda":
                        # The next read overwrites the buffer these
                        # asynchronous copies still read from.
                        torch.cuda.current_stream().synchronize()
            loaded = max(loaded, seg_start + found)
            if seg_start + found < seg_end:
                break
        self.metrics.add("loaded_tokens", loaded - start)
        if loaded < end:
            self.metrics.add("load_errors")
            logger.warning(
                "vineyard cache returned %d of %d promised tokens; the rest "
                "is recomputed",
                loaded - start,
                end - start,
            )
        self.metrics.observe("load_s", time.perf_counter() - t0)
        return loaded

    # ---- worker side: saves ------------------------------------------------

    def can_save(self) -> bool:
        """Whether :meth:`save` would find a free buffer and a backend."""
        return (
            not self._closed
            and self._pool is not None
            and self._pool.num_free > 0
            and self._writer is not None
            and self._writer.disabled_reason is None
        )

    def save(
        self, requests: Sequence[SaveRequest], may_take_buffer: bool = True
    ) -> bool:
        """Stage the newly completed chunks of ``requests`` and submit them.

        Never waits for the backend when async update is on. With no free
        buffer the update is skipped (and counted); each request keeps its
        resume point, so the skipped chunks are saved by a later call while
        the request's blocks are alive. ``may_take_buffer=False`` skips
        (tensor-parallel peers skip together). Returns whether a task was
        submitted.
        """
        assert self._pool is not None and self._updater is not None
        assert self._writer is not None
        if self._closed or self._writer.disabled_reason is not None:
            return False  # no backend: staging copies would be wasted
        t0 = time.perf_counter()
        bs = self.layout.block_size
        chunk = self.chunk_size
        while self._failed_origins:
            # Later chunks of these requests were refused for want of their
            # prefix: write again from the failed segment on.
            req_id, begin = self._failed_origins.popleft()
            if req_id in self._resume:
                self._resume[req_id] = min(self._resume[req_id], begin)
        pending: list[tuple[str, int, int, SaveRequest]] = []
        for req in requests:
            begin = self._resume.setdefault(req.req_id, req.save_from)
            finished = min(req.num_computed_tokens, len(req.token_ids)) // chunk * chunk
            if finished > begin:
                pending.append((req.req_id, begin, finished, req))
        if not pending:
            return False
        buffer_id = self._pool.get() if may_take_buffer else None
        if buffer_id is None:
            self.metrics.add("updates_skipped")
            return False

        segments: list[tuple[int, list[int], list[int]]] = []
        origins: list[tuple[str, int]] = []
        src_blocks: list[int] = []
        free_blocks = self.max_blocks
        for req_id, begin, finished, req in pending:
            end = min(finished, begin + free_blocks * bs // chunk * chunk)
            if end <= begin:
                break  # buffer full; the rest resumes next step
            segments.append(
                (
                    len(src_blocks) * bs,
                    list(req.token_ids[:begin]),
                    list(req.token_ids[begin:end]),
                )
            )
            origins.append((req_id, begin))
            src_blocks.extend(req.block_ids[begin // bs : end // bs])
            free_blocks -= (end - begin) // bs
            self._resume[req_id] = end

        n = len(src_blocks)
        staging = self._pool.buffer(buffer_id)
        index = torch.tensor(src_blocks, device=self.device)
        if self._all_layers is not None:
            # One gather for all layers, straight into the staging buffer.
            torch.index_select(self._all_layers, 1, index, out=staging[:, :n])
        else:
            for layer, kv in enumerate(self._kv_blocks):
                out = staging[layer, :n]
                if self.device.type == "cpu":
                    torch.index_select(kv.reshape(kv.shape[0], -1), 0, index, out=out)
                else:
                    out.copy_(
                        kv.index_select(0, index).reshape(n, -1), non_blocking=True
                    )
        # Created after the copy: its queue delay starts at the submit.
        task = _UpdateTask(buffer_id, segments, origins)
        if self.device.type == "cuda":
            # The copy runs on the compute stream, so the next forward pass
            # cannot overwrite these blocks before it is done.
            task.copy_done = torch.cuda.Event()
            task.copy_done.record()
        self._updater.submit(task)
        self.metrics.observe("save_caller_s", time.perf_counter() - t0)
        if not self.config.enable_async_update:
            # Bounded: a stalled backend is killed after its timeout.
            task.done.wait(self.config.backend_timeout_s + 5.0)
        return True

    def release(self, req_id: str) -> None:
        """Forget a request's resume point (its blocks are being freed)."""
        self._resume.pop(req_id, None)

    # ---- lifecycle ---------------------------------------------------------

    @property
    def pool(self) -> _PinnedTensorPool | None:
        return self._pool

    def wait_for_updates(self, timeout_s: float) -> bool:
        """Block until every submitted update is done (for tests, tools and
        benchmarks); True if the pool is idle again in time."""
        deadline = time.monotonic() + timeout_s
        while self._pool is not None and self._pool.num_in_flight:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Drain pending updates within the drain timeout, then stop the
        backend processes. Idempotent; never hangs."""
        if self._closed:
            return
        self._closed = True
        if self._updater is not None:
            self._updater.shutdown()
        if self._writer is not None:
            self._writer.close()
        if self._updater is not None and not self._updater.join(5.0):
            logger.warning("vineyard cache updater thread did not stop")
        self._reader.close()
        if self._pool is not None:
            self._pool.close()
            self._write_memory.close()
        if self._pinned_read:
            _unpin(self._read_memory.tensor[0])
        self._read_memory.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            self.close()
