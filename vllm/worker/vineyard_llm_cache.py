# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vineyard KV cache of one vLLM worker.

After each forward pass the KV of newly completed chunks is gathered into a
staging buffer from :class:`_PinnedTensorPool` (one copy, on the forward
thread) and written to vineyard by :class:`_AsyncUpdater`, strictly in issue
order, because vineyard refuses a chunk whose prefix is not cached yet. When
every buffer is in flight the update is skipped (and counted), never waited
for. A later request that starts with a cached prefix loads that KV
(:meth:`VineyardLLMCache.load`) instead of recomputing it.

The vineyard calls run in backend processes (:mod:`vineyard_backend`, driven
through :mod:`vineyard_backend_process`): one writer, one reader, so the GIL
that vineyard holds never stalls the engine, and a read never waits behind a
write. Buffers are shared memory; only block
ids cross the process boundary.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger

from vllm.worker.vineyard.backend.client import BackendProcess
from vllm.worker.vineyard.backend.protocol import BackendError, BackendSpec
from vllm.worker.vineyard.config import GiB, VineyardLLMCacheConfig
from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.metrics import VineyardCacheMetrics
from vllm.worker.vineyard.storage.chunks import synthetic_ids
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.storage.root import check_root, write_manifest
from vllm.worker.vineyard.transfer.kv_copy import KVBlockCopier

logger = init_logger(__name__)

#: Backends report the sweeper's figures with every write; when no write
#: comes for this long, the updater asks for them.
_STATS_POLL_S = 5.0


# --------------------------------------------------------------------------
# Staging memory and the pool.
# --------------------------------------------------------------------------


def _pin(tensor: torch.Tensor) -> bool:
    """Page-lock a CPU tensor in place so that device copies are async."""
    if not torch.cuda.is_available():
        return False
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)
    if int(err) != 0:
        logger.warning(
            "cudaHostRegister failed (%s); copies into the vineyard staging "
            "buffer will be synchronous",
            err,
        )
        return False
    return True


def _unpin(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class _StagingMemory:
    """``count`` buffers of ``[max_blocks, entry]`` in shared memory (a
    ``memfd`` the backend maps too), viewed as one tensor. An entry is one
    KV block of every layer, then a trailer the backend fills in. Pages are
    backed only once touched, and freed when the last process closes them,
    crash or not."""

    def __init__(
        self, count: int, max_blocks: int, entry_bytes: int, dtype: torch.dtype
    ):
        element = torch.empty((), dtype=dtype).element_size()
        self.buffer_bytes = max_blocks * entry_bytes
        self.fd = os.memfd_create("vineyard-cache", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, count * self.buffer_bytes)
        self._mmap = mmap.mmap(self.fd, count * self.buffer_bytes)
        flat = torch.frombuffer(
            self._mmap, dtype=dtype, count=count * self.buffer_bytes // element
        )
        self.tensor = flat.view(count, max_blocks, entry_bytes // element)

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


# --------------------------------------------------------------------------
# The ordered updater.
# --------------------------------------------------------------------------


@dataclass
class _Segment:
    """Consecutive chunks of one request, staged in one buffer."""

    first_slot: int  # the entry slot of its first block in the buffer
    prefix_ids: list[int]  # vineyard ids of the request's earlier blocks
    ids: list[int]  # vineyard ids of its blocks
    digests: list[bytes]  # their chained digests (sealed into trailers)
    req_id: str
    first_token: int  # to rewind the request if the write fails

    def request(self) -> tuple[int, list[int], list[int], list[bytes]]:
        return (self.first_slot, self.prefix_ids, self.ids, self.digests)


@dataclass
class UpdateResult:
    """What became of one task's segments."""

    blocks_written: int
    blocks_rejected: int  # refused for want of their prefix
    write_error: str | None = None  # the filesystem failed a write


@dataclass
class _UpdateTask:
    """One step's completed chunks, staged in one pool buffer."""

    buffer_id: int
    segments: list[_Segment]
    generation: int = 0  # of the cache's reports when it was issued
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
        write: Callable[[_UpdateTask], UpdateResult],
        pool: _PinnedTensorPool,
        metrics: VineyardCacheMetrics,
        block_size: int,
        drain_timeout_s: float,
        on_failed: Callable[[_UpdateTask], None] | None = None,
        on_idle: Callable[[], None] | None = None,
    ):
        self._write = write
        self._on_failed = on_failed
        self._on_idle = on_idle
        self._pool = pool
        self._metrics = metrics
        self._block_size = block_size
        self._drain_timeout_s = drain_timeout_s
        self._deadline = 0.0
        self._queue: queue.SimpleQueue[_UpdateTask | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._closed = False
        self._logged_write_error = 0.0
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

    def _fail(self, task: _UpdateTask, why: str) -> None:
        # Rate-limited: a failing disk fails every write.
        if time.monotonic() - self._logged_write_error > 60.0:
            self._logged_write_error = time.monotonic()
            logger.warning(
                "vineyard cache update failed (%d segment(s) not saved; "
                "they are retried while their requests run): %s",
                len(task.segments),
                why,
            )
        if self._on_failed is not None:
            self._on_failed(task)
        self._finish(task, "failed")

    def _execute(self, task: _UpdateTask) -> None:
        self._metrics.observe(
            "update_queue_delay_s", time.perf_counter() - task.submitted_at
        )
        try:
            if task.copy_done is not None:
                task.copy_done.synchronize()
            start = time.perf_counter()
            result = self._write(task)
            self._metrics.observe("update_exec_s", time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 - the engine must go on
            self._fail(task, str(e))
            return
        bs = self._block_size
        self._metrics.add("tokens_written", result.blocks_written * bs)
        self._metrics.add("tokens_rejected", result.blocks_rejected * bs)
        if result.write_error is not None:
            self._fail(task, result.write_error)
        else:
            self._finish(task, "completed")

    def _run(self) -> None:
        while True:
            try:
                task = self._queue.get(timeout=_STATS_POLL_S)
            except queue.Empty:
                if self._on_idle is not None and not self._stopping.is_set():
                    with contextlib.suppress(Exception):
                        self._on_idle()
                continue
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
                "vineyard cache updater still busy after the drain timeout; "
                "abandoning its pending updates"
            )

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


@dataclass
class _LoadJob:
    """One request's load: which blocks to read (in segments of whole
    chunks) and to fill, and how far it got."""

    req_id: str
    ids: list[int]  # vineyard ids of every block read
    digests: list[bytes]
    block_ids: list[int]  # the request's KV blocks from token 0
    start: int  # first block to fill
    last: int  # end of the blocks to fill
    segments: list[tuple[int, int]]  # block ranges read per query
    next_segment: int = 0
    loaded: int = 0  # end of the blocks filled so far
    cancelled: bool = False
    started_at: float = field(default_factory=time.perf_counter)


@dataclass
class SaveRequest:
    """One running request as the connector sees it after a forward pass."""

    req_id: str
    block_digests: Sequence[bytes]  # chained digests of its complete blocks
    num_computed_tokens: int  # tokens whose KV is in blocks after this step
    block_ids: Sequence[int]  # the request's KV blocks, in order
    save_from: int = 0  # first token not known to be in vineyard
    held_from: int = 0  # blocks before it vLLM has freed (sliding window)


# --------------------------------------------------------------------------
# The cache.
# --------------------------------------------------------------------------

#: The resume point of a request whose saves ended (its blocks were freed).
_SAVES_ENDED = 1 << 62


class VineyardLLMCache:
    """The vineyard KV cache of one vLLM worker (TP rank).

    Chunks of ``chunk_size`` tokens are the unit of caching; a chunk is saved
    once its KV is fully computed, and usable only if all chunks before it are
    cached. Blocks move as opaque bytes, one vineyard entry per block of all
    layers (see :mod:`vineyard_store`).
    """

    def __init__(
        self,
        config: VineyardLLMCacheConfig,
        layout: KVCacheLayout,
        max_num_batched_tokens: int,
        kv_caches: Sequence[torch.Tensor],
        num_blocks: int,
    ):
        if config.chunk_tokens(layout.block_size) != layout.chunk_size:
            raise ValueError(
                f"layout chunk of {layout.chunk_size} tokens, but "
                f"{config.setting('chunk_size')}={config.chunk_size}"
            )
        if len(kv_caches) != layout.num_layers:
            raise ValueError(
                f"got {len(kv_caches)} KV cache tensors for {layout.num_layers} layers"
            )
        self.config = config
        self.layout = layout
        self.chunk_size = layout.chunk_size
        self.metrics = VineyardCacheMetrics(config.metrics_enabled)
        self._log = LogLimiter(logger)
        # Resolved and checked once: a root through a symlink works, one
        # that others could turn against this process is refused.
        try:
            root = check_root(config.root, config.group_access, config.setting("root"))
        except OSError as e:
            raise BackendError(f"cannot create the cache root: {e}") from e
        self.files = layout.files(root)
        bs = layout.block_size
        # One buffer holds one step's tokens, rounded up to whole chunks.
        self.max_blocks = -(-max_num_batched_tokens // self.chunk_size) * (
            layout.blocks_per_chunk
        )
        self._kv = KVBlockCopier(kv_caches, num_blocks, layout.block_bytes)
        self.device = self._kv.device
        dtype = kv_caches[0].dtype
        buffer_bytes = self.max_blocks * layout.entry_bytes
        num_buffers = config.num_update_buffers(buffer_bytes)

        # Per request: (the scheduler's save_from, the next token to save).
        self._resume: dict[str, tuple[int, int]] = {}
        # (generation, request id, first token, end) of what each write
        # stored (filled by the updater thread, reported by the worker);
        # writes issued before the last forget_saved go unreported.
        self._stored: collections.deque[tuple[int, str, int, int]] = collections.deque()
        self._generation = 0
        # Chunk files the backends removed (reported by the worker).
        self._removed_paths: collections.deque[str] = collections.deque()
        # (request id, first token) of segments whose write failed: their
        # requests resume from there (filled by the updater thread).
        self._failed_origins: collections.deque[tuple[str, int]] = collections.deque()
        self._closed = False

        def spec(count: int, writer: bool) -> BackendSpec:
            return BackendSpec(
                root=self.files.root,
                blocks_per_chunk=layout.blocks_per_chunk,
                entry_bytes=layout.entry_bytes,
                max_blocks=self.max_blocks,
                num_buffers=count,
                auth_key_file=config.auth_key_file,
                group_access=config.group_access,
                sweep=writer,
                cache_root=root,
                disk_limit_bytes=int(config.disk_limit_gb * GiB),
                ttl_s=config.ttl_s,
                sweep_interval_s=config.sweep_interval_s,
            )

        # Reads: two buffers, so the read of one segment overlaps the copy
        # of the one before.
        self._read_memory = _StagingMemory(
            2, self.max_blocks, layout.entry_bytes, dtype
        )
        # Back the read buffers now: a first load that faults in hundreds
        # of MiB of pages measured 4x slower than the next ones.
        self._read_memory.tensor.view(torch.uint8).fill_(0)
        self._read_pinned = self.device.type == "cuda" and all(
            [_pin(self._read_memory.tensor[i]) for i in range(2)]
        )
        self._write_memory = _StagingMemory(
            num_buffers, self.max_blocks, layout.entry_bytes, dtype
        )
        self._pool = _PinnedTensorPool(
            self._write_memory, min(config.min_inflight_tasks, num_buffers), num_buffers
        )
        self._read_events: list[torch.cuda.Event | None] = [None, None]
        self._next_read_buffer = 0
        # Loads by request, in the order their reads go out; the one read in
        # flight: (load, segment, buffer, sent at).
        self._loads: dict[str, _LoadJob] = {}
        self._load_queue: collections.deque[_LoadJob] = collections.deque()
        self._in_flight: tuple[_LoadJob, int, int, float] | None = None
        self._finished_loads: list[tuple[str, int, int]] = []
        self._blocking_loads = itertools.count()
        self._restarts_counted: dict[str, int] = {}
        bpc = layout.blocks_per_chunk
        self._load_segment_blocks = max(bpc, self.max_blocks // 4 // bpc * bpc)
        self._reader: BackendProcess | None = None
        self._writer: BackendProcess | None = None
        self._updater: _AsyncUpdater | None = None
        try:
            # Both start at once (each spends a few tenths of a second
            # importing vineyard's KV cache).
            self._reader = BackendProcess(
                "read",
                spec(2, False),
                self._read_memory.fd,
                config.backend_timeout_s,
                wait=False,
                # Loads are driven from the forward thread: it never waits
                # for a reader to restart (e.g. on a root that hangs).
                restart_in_background=True,
            )
            self._writer = BackendProcess(
                "write",
                spec(num_buffers, True),
                self._write_memory.fd,
                config.backend_timeout_s,
                # Writes are background work: when the backend shares a core
                # with the forward pass (an unpinned engine), the pass wins.
                nice=10,
                wait=False,
            )
            self._reader.wait_ready()
            self._writer.wait_ready()
        except BackendError:
            self.close()
            raise
        # Tools (vineyard-llm-cache) read the layout from it; never raises.
        write_manifest(self.files.root, layout, config.group_access)
        self._updater = _AsyncUpdater(
            self._write_to_backend,
            self._pool,
            self.metrics,
            bs,
            config.drain_timeout_s,
            on_failed=self._rewind,
            on_idle=self._poll_writer_stats,
        )
        logger.info(
            "vineyard cache on at %s (chunk %d tokens, %s updates, %d update "
            "buffer(s) of %.1f MiB, %s)",
            self.files.root,
            self.chunk_size,
            "async" if config.enable_async_update else "sync",
            num_buffers,
            buffer_bytes / (1 << 20),
            "authenticated" if config.auth_key_file else "checksummed",
        )

    # ---- backend calls -----------------------------------------------------

    def _send(self, backend: BackendProcess, *request: Any) -> None:
        try:
            backend.send(*request)
        finally:
            # Restarts (maybe on a thread of the backend's) not counted yet.
            new = backend.restarts - self._restarts_counted.get(backend.name, 0)
            if new:
                self._restarts_counted[backend.name] = backend.restarts
                self.metrics.add("backend_restarts", new)

    def _receive(self, backend: BackendProcess, timeout_s: float | None = None) -> Any:
        reply = backend.receive(timeout_s)
        if isinstance(reply, dict):
            self._record(reply.pop("stats", {}))
        return reply

    def _record(self, stats: dict[str, Any]) -> None:
        self._removed_paths.extend(stats.pop("removed_paths", ()))
        self.metrics.record(stats)

    def _write_to_backend(self, task: _UpdateTask) -> UpdateResult:
        assert self._writer is not None
        segments = [s.request() for s in task.segments]
        self._send(self._writer, "update", task.buffer_id, segments)
        stored_per_segment = self._receive(self._writer)["stored"]
        result = UpdateResult(0, 0)
        bs = self.layout.block_size
        for segment, (stored, error) in zip(
            task.segments, stored_per_segment, strict=True
        ):
            stored = min(stored, len(segment.ids))
            result.blocks_written += stored
            if stored:
                end = segment.first_token + stored * bs
                self._stored.append(
                    (task.generation, segment.req_id, segment.first_token, end)
                )
            if error is not None:
                result.write_error = error
            else:
                result.blocks_rejected += len(segment.ids) - stored
        return result

    def _poll_writer_stats(self) -> None:
        if self._writer is not None and self._writer.disabled_reason is None:
            self._send(self._writer, "stats")
            self._record(self._receive(self._writer))

    def _rewind(self, task: _UpdateTask) -> None:
        self._failed_origins.extend((s.req_id, s.first_token) for s in task.segments)

    # ---- loads -------------------------------------------------------------

    def start_load(
        self,
        req_id: str,
        digests: Sequence[bytes],
        start: int,
        end: int,
        block_ids: Sequence[int],
    ) -> None:
        """Begin loading the cached KV of tokens ``[start, end)`` into the
        request's blocks (``digests`` and ``block_ids`` cover the request
        from token 0, ``digests`` up to the end of the chunk that holds
        ``end``); returns at once. :meth:`poll_loads` moves it on and
        :meth:`take_finished_loads` reports it.

        ``start`` and ``end`` are block-aligned. Vineyard reads whole chunks,
        from the chunk boundary at or before ``start`` to the one at or after
        ``end``, but only blocks in ``[start, end)`` are written: blocks
        before ``start`` (vLLM's own prefix-cache hit, maybe shared with
        running requests) and after ``end`` (not the request's to fill) are
        left alone. The reader verifies every entry before it is copied.

        The reader backend reads segments of a quarter buffer (whole chunks)
        in turn into two read buffers while the engine runs; the only work
        on the caller's thread is the copy of verified blocks into place.
        """
        bs, bpc = self.layout.block_size, self.layout.blocks_per_chunk
        assert start % bs == 0 and end % bs == 0
        first, last = start // self.chunk_size * bpc, end // bs
        read_end = min(-(-last // bpc), len(digests) // bpc) * bpc
        step = self._load_segment_blocks
        segments = [(b, min(b + step, read_end)) for b in range(first, read_end, step)]
        job = _LoadJob(
            req_id=req_id,
            ids=synthetic_ids(digests[:read_end]),
            digests=list(digests[:read_end]),
            block_ids=list(block_ids),
            start=start // bs,
            last=last,
            segments=segments,
        )
        job.loaded = job.start
        self._loads[req_id] = job
        if segments:
            self._load_queue.append(job)
        else:
            self._finish_load(job)  # nothing to read

    def cancel_load(self, req_id: str) -> None:
        """Stop a request's load (it was aborted): it is reported finished
        at once, since nothing is written into its blocks from now on (only
        this thread copies into KV blocks; a read still in flight lands in
        a read buffer and is dropped)."""
        job = self._loads.get(req_id)
        if job is not None:
            job.cancelled = True
            self._finish_load(job)

    def loading(self, req_id: str) -> bool:
        return req_id in self._loads

    def take_finished_loads(self) -> list[tuple[str, int, int]]:
        """``(req_id, loaded_end, promised_end)`` of loads finished since
        the last call, in tokens; a load that was cancelled reports its
        promised end (nothing of it is used)."""
        done, self._finished_loads = self._finished_loads, []
        return done

    def poll_loads(self, wait: bool = False) -> None:
        """Move loads on: collect the reader's answers that have arrived,
        copy their verified blocks into place and send the next reads.
        Never waits unless ``wait`` (then until every load is done)."""
        assert self._reader is not None
        reader = self._reader
        while True:
            if self._in_flight is None and not self._send_next_read():
                return
            assert self._in_flight is not None
            job, k, buffer, sent_at = self._in_flight
            ready = wait or reader.ready()
            stuck = time.monotonic() - sent_at >= self.config.backend_timeout_s
            if not (ready or stuck):
                return
            self._in_flight = None
            try:
                # A stuck reader is given up on at once (and restarted).
                verified = self._receive(reader, None if ready else 0.0)["verified"]
            except BackendError as e:
                logger.warning("vineyard cache read failed, recomputing: %s", e)
                self._finish_load(job)
                continue
            s, seg_end = job.segments[k]
            more = (
                s + verified == seg_end
                and k + 1 < len(job.segments)
                and not job.cancelled
            )
            if not more:
                job.next_segment = len(job.segments)  # no more reads
            # The next read (of this load or the next) overlaps this copy.
            self._send_next_read()
            if not job.cancelled:
                skip, use = max(0, job.loaded - s), min(verified, job.last - s)
                if use > skip:
                    self._copy_in(buffer, skip, use, job.block_ids[s + skip : s + use])
                    job.loaded = s + use
            if not more:
                self._finish_load(job)

    def _send_next_read(self) -> bool:
        """Send the next segment's read of the first unfinished load into
        the next read buffer; whether one was sent."""
        assert self._reader is not None
        while self._load_queue:
            job = self._load_queue[0]
            k = job.next_segment
            if job.cancelled or k >= len(job.segments):
                # Every read sent: its last answer finishes it.
                self._load_queue.popleft()
                continue
            s, e = job.segments[k]
            buffer = self._next_read_buffer
            event = self._read_events[buffer]
            if event is not None:
                event.synchronize()  # the buffer's last copy is done
            try:
                self._send(
                    self._reader,
                    "query",
                    buffer,
                    job.ids[:s],
                    job.ids[s:e],
                    job.digests[s:e],
                    k == 0,  # the load's first read marks the prefix used too
                )
            except BackendError as e:
                logger.warning("vineyard cache read failed, recomputing: %s", e)
                self._load_queue.popleft()
                self._finish_load(job)
                continue
            job.next_segment = k + 1  # sent; the answer decides what follows
            self._next_read_buffer ^= 1
            self._in_flight = (job, k, buffer, time.monotonic())
            return True
        return False

    def _finish_load(self, job: _LoadJob) -> None:
        if self._loads.pop(job.req_id, None) is None:
            return  # already reported
        with contextlib.suppress(ValueError):
            self._load_queue.remove(job)
        bs = self.layout.block_size
        loaded, end = job.loaded * bs, job.last * bs
        start = job.start * bs
        if job.cancelled:
            loaded = end
        else:
            self.metrics.add("loaded_tokens", max(0, loaded - start))
            if loaded < end:
                self.metrics.add("load_errors")
                self._log.warning(
                    "short-load",
                    "vineyard cache returned %d of %d promised tokens; the "
                    "rest is recomputed",
                    max(0, loaded - start),
                    end - start,
                )
        self.metrics.observe("load_s", time.perf_counter() - job.started_at)
        self._finished_loads.append((job.req_id, loaded, end))

    def load(
        self,
        digests: Sequence[bytes],
        start: int,
        end: int,
        block_ids: Sequence[int],
    ) -> int:
        """:meth:`start_load` and wait for it; returns the end of what was
        loaded (less than ``end``: the rest must be recomputed)."""
        req_id = f"__blocking_load_{next(self._blocking_loads)}"
        self.start_load(req_id, digests, start, end, block_ids)
        self.poll_loads(wait=True)
        results = self.take_finished_loads()
        mine = [r for r in results if r[0] == req_id]
        self._finished_loads.extend(r for r in results if r[0] != req_id)
        assert mine, "a blocking load did not finish"
        return mine[0][1]

    def _copy_in(
        self, buffer: int, first: int, end: int, block_ids: Sequence[int]
    ) -> None:
        """Copy entries ``[first, end)`` of a read buffer into KV blocks."""
        event = self._kv.scatter(self._read_memory.tensor[buffer, first:end], block_ids)
        if event is not None:
            self._read_events[buffer] = event  # the buffer's next read waits

    # ---- saves -------------------------------------------------------------

    def can_save(self) -> bool:
        """Whether :meth:`save` would find a free buffer and a backend."""
        return (
            not self._closed
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
        the request's blocks are alive. ``may_take_buffer=False`` skips as if
        the pool were empty (for tests and tools). Returns whether a task
        was submitted.
        """
        if self._closed or self._writer is None or self._writer.disabled_reason:
            return False  # no backend: staging copies would be wasted
        t0 = time.perf_counter()
        bs, chunk = self.layout.block_size, self.chunk_size
        while self._failed_origins:
            # Later chunks of these requests were refused for want of their
            # prefix: write again from the failed segment on.
            req_id, begin = self._failed_origins.popleft()
            if req_id in self._resume:
                origin, resume = self._resume[req_id]
                self._resume[req_id] = (origin, min(resume, begin))
        pending: list[tuple[int, int, SaveRequest]] = []
        for req in requests:
            origin, begin = self._resume.get(req.req_id, (req.save_from, req.save_from))
            if req.save_from < origin:
                # The scheduler moved the start back (a load of this request
                # came up short on some rank): save again from there.
                origin, begin = req.save_from, min(begin, req.save_from)
            self._resume[req.req_id] = (origin, begin)
            computed = min(req.num_computed_tokens, len(req.block_digests) * bs)
            finished = computed // chunk * chunk
            if finished <= begin:
                continue
            if begin < req.held_from * bs:
                # vLLM freed blocks of this chunk (a sliding window moved
                # past them before a skipped or failed save was retried)
                # and may have given them to another request: never
                # gathered. Later chunks would lack their prefix, so the
                # request saves no more.
                self._resume[req.req_id] = (origin, _SAVES_ENDED)
                self.metrics.add("saves_dropped_freed")
                continue
            pending.append((begin, finished, req))
        if not pending:
            return False
        buffer_id = self._pool.get() if may_take_buffer else None
        if buffer_id is None:
            self.metrics.add("updates_skipped")
            return False

        segments: list[_Segment] = []
        src_blocks: list[int] = []
        for begin, finished, req in pending:
            free = self.max_blocks - len(src_blocks)
            end = min(finished, begin + free // self.layout.blocks_per_chunk * chunk)
            if end <= begin:
                break  # buffer full; the rest resumes next step
            b0, b1 = begin // bs, end // bs
            ids = synthetic_ids(req.block_digests[:b1])
            segments.append(
                _Segment(
                    len(src_blocks),
                    ids[:b0],
                    ids[b0:],
                    list(req.block_digests[b0:b1]),
                    req.req_id,
                    begin,
                )
            )
            src_blocks.extend(req.block_ids[b0:b1])
            self._resume[req.req_id] = (self._resume[req.req_id][0], end)

        staging = self._pool.buffer(buffer_id)[: len(src_blocks)]
        copy_done = self._kv.gather(src_blocks, staging)
        # The updater waits for an asynchronous (CUDA) copy before writing.
        task = _UpdateTask(buffer_id, segments, self._generation, copy_done)
        assert self._updater is not None
        self._updater.submit(task)
        self.metrics.observe("save_caller_s", time.perf_counter() - t0)
        if not self.config.enable_async_update:
            # Bounded: a stalled backend is killed after its timeout.
            task.done.wait(self.config.backend_timeout_s + 5.0)
        return True

    def take_stored(self) -> list[tuple[str, int, int]]:
        """``(req_id, first token, end)`` of each run of blocks that writes
        stored since the last call, in write order."""
        stored = []
        while self._stored:
            generation, req_id, begin, end = self._stored.popleft()
            if generation == self._generation:
                stored.append((req_id, begin, end))
        return stored

    def forget_saved(self) -> None:
        """The root was reset (its chunk files removed): every request saves
        again from the scheduler's ``save_from``, and what writes issued
        before now store is never reported (a file that such a write
        published may have been removed after it), so nothing is announced
        for a file that is gone."""
        self._generation += 1
        self._resume.clear()

    def take_removed_paths(self) -> list[str]:
        """Chunk files removed from the root since the last call (by this
        rank's sweeps, or found corrupt by its reader)."""
        removed = []
        while self._removed_paths:
            removed.append(self._removed_paths.popleft())
        return removed

    def can_load(self) -> bool:
        """Whether the reader can take a load now (not restarting, not
        disabled): the scheduler promises no hits while it cannot."""
        return not self._closed and self._reader is not None and self._reader.available

    def release(self, req_id: str) -> None:
        """Forget a request's resume point (its blocks are being freed)."""
        self._resume.pop(req_id, None)

    # ---- lifecycle ---------------------------------------------------------

    @property
    def pool(self) -> _PinnedTensorPool:
        return self._pool

    def backend_pids(self) -> dict[str, int | None]:
        return {
            "read": self._reader.pid if self._reader else None,
            "write": self._writer.pid if self._writer else None,
        }

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
        if self._reader is not None:
            self._reader.close()
        self._pool.close()
        self._write_memory.close()
        if self._read_pinned:
            for i in range(2):
                _unpin(self._read_memory.tensor[i])
        self._read_memory.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            self.close()
