# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vineyard KV cache of one vLLM worker: :class:`VineyardLLMCache`
drives its saves and loads.

After each forward pass the KV of newly completed chunks is gathered into a
staging buffer from :class:`_PinnedTensorPool` (one copy, on the forward
thread) and written to vineyard by :class:`_AsyncUpdater`, strictly in issue
order, because vineyard refuses a chunk whose prefix is not cached yet. When
every buffer is in flight the update is skipped (and counted), never waited
for. A later request that starts with a cached prefix loads that KV
(:mod:`~vllm.worker.vineyard.transfer.loads`) instead of recomputing it.

The vineyard calls run in backend processes (``vineyard/backend/``): one
writer and one or more readers (two where two cores are free for them: a
load's reads and verification then run at once), so the GIL that vineyard holds never
stalls the engine, and a read never waits behind a write. Buffers are
shared memory; only block ids cross the process boundary.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch
from vllm.logger import init_logger

from vllm.worker.vineyard.backend.client import BackendProcess
from vllm.worker.vineyard.backend.protocol import (
    BackendError,
    RemoveRequest,
    StatsRequest,
    UpdateRequest,
)
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.cores import default_readers, move_off_the_workers_cores
from vllm.worker.vineyard.metrics import VineyardCacheMetrics
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.storage.namespaces import write_manifest
from vllm.worker.vineyard.storage.root import check_root
from vllm.worker.vineyard.transfer.backends import BackendCalls, start_backends
from vllm.worker.vineyard.transfer.kv_copy import KVBlockCopier
from vllm.worker.vineyard.transfer.loads import LoadPipeline
from vllm.worker.vineyard.transfer.saves import (
    SaveLedger,
    SaveRequest,
    UpdateResult,
    UpdateTask,
)
from vllm.worker.vineyard.transfer.staging import (
    ReadBuffers,
    StagingMemory,
    pin,
    unpin,
)

logger = init_logger(__name__)

#: Backends report the sweeper's figures with every write; when no write
#: comes for this long, the updater asks for them.
_STATS_POLL_S = 5.0


class _PinnedTensorPool:
    """A bounded pool of staging buffers; :meth:`get` never blocks on the
    writer.

    ``min_buffers`` are backed (touched, and pinned on CUDA) up front; the
    rest, up to ``max_buffers``, by a background thread right after
    (``back_ahead``): backing a buffer's pages costs hundreds of ms for a
    large one, which a burst must not pay on the forward thread. That
    thread runs at the lowest priority, on the cores the forward thread
    does not use where there are any, and backs a slice at a time: on the
    engine's core at the engine's priority it took half of the forward
    thread's core for seconds after startup (a fresh engine's first hits
    ran their forward pass 2x slower). A :meth:`get` that comes
    before the thread got to a buffer backs what is left of one itself
    (waiting at most for the slice the thread is on), as a burst at startup
    needs the buffer (skipping it would lose a save that backing keeps).
    When every buffer is in flight ``get`` returns ``None`` and the caller
    skips its update.
    """

    #: Bytes backed per step of the background thread.
    SLICE_BYTES = 4 << 20

    def __init__(
        self,
        memory: StagingMemory,
        min_buffers: int,
        max_buffers: int,
        back_ahead: bool = True,
    ):
        assert 1 <= min_buffers <= max_buffers <= memory.tensor.shape[0]
        self._memory = memory
        self._lock = threading.Lock()
        self._backed = threading.Condition(self._lock)
        self._free: list[int] = []
        self._pinned: list[torch.Tensor] = []
        self.max_buffers = max_buffers
        nbytes = memory.tensor[0].numel() * memory.tensor.element_size()
        self._num_slices = max(1, -(-nbytes // self.SLICE_BYTES))
        # Buffers being backed: slices claimed and slices done; a get()
        # that took one over (``_taken``) receives it, not the free list.
        self._backing: dict[int, list[int]] = {}
        self._taken: set[int] = set()
        self._num_claimed = 0  # buffers being backed or backed
        self._num_created = 0  # buffers backed
        self._closing = False
        for _ in range(min_buffers):
            self._back_here(self._claim_buffer())
        self._backer: threading.Thread | None = None
        if back_ahead and max_buffers > min_buffers:
            self._backer = threading.Thread(
                target=self._back_the_rest, name="vineyard-pool-backer", daemon=True
            )
            self._backer.start()

    def _claim_buffer(self) -> int:
        buffer_id = self._num_claimed
        self._num_claimed += 1
        self._backing[buffer_id] = [0, 0]
        return buffer_id

    def _buffer_to_back(self) -> int | None:
        """(Lock held.) The buffer started and not taken by a get(), else a
        newly claimed one; ``None`` when every buffer is claimed."""
        for buffer_id in self._backing:
            if buffer_id not in self._taken:
                return buffer_id
        if self._num_claimed < self.max_buffers:
            return self._claim_buffer()
        return None

    def _claim_slice(self, buffer_id: int) -> int | None:
        progress = self._backing.get(buffer_id)
        if progress is None or progress[0] >= self._num_slices:
            return None
        progress[0] += 1
        return progress[0] - 1

    def _back_slice(self, buffer_id: int, index: int) -> None:
        """Touch one slice of a claimed buffer; whoever backs its last
        slice pins it and hands it on (to the free list or its taker)."""
        flat = self._memory.tensor[buffer_id].view(-1).view(torch.uint8)
        at = index * self.SLICE_BYTES
        flat[at : at + self.SLICE_BYTES].fill_(0)  # back the pages now
        with self._lock:
            self._backing[buffer_id][1] += 1
            if self._backing[buffer_id][1] < self._num_slices:
                return
        buffer = self._memory.tensor[buffer_id]
        pinned = pin(buffer)
        with self._lock:
            del self._backing[buffer_id]
            if pinned:
                self._pinned.append(buffer)
            self._num_created += 1
            if buffer_id in self._taken:
                self._taken.discard(buffer_id)
            else:
                self._free.append(buffer_id)
            self._backed.notify_all()

    def _back_here(self, buffer_id: int) -> int:
        """Back what is left of a claimed buffer on this thread and wait
        for any slice another thread is on (a buffer in ``_taken`` then
        goes to the caller, else to the pool)."""
        while True:
            with self._lock:
                index = self._claim_slice(buffer_id)
            if index is None:
                break
            self._back_slice(buffer_id, index)
        with self._lock:
            while buffer_id in self._backing:
                self._backed.wait()
        return buffer_id

    def _back_the_rest(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        # As the backends: the engine's startup keeps its own core busy, and
        # a first burst must find the buffers backed.
        move_off_the_workers_cores()
        while True:
            with self._lock:
                if self._closing:
                    return
                buffer_id = self._buffer_to_back()
                if buffer_id is None:
                    return
                index = self._claim_slice(buffer_id)
            # Not taken by a get(): no other thread backs its slices.
            assert index is not None
            self._back_slice(buffer_id, index)

    def get(self) -> int | None:
        """A free buffer's id, or ``None`` if all are in flight."""
        with self._lock:
            if self._free:
                return self._free.pop()
            # Take over a buffer the background thread started, else
            # claim a new one, and back it here.
            buffer_id = self._buffer_to_back()
            if buffer_id is None:
                return None
            self._taken.add(buffer_id)  # handed to this caller when backed
        return self._back_here(buffer_id)

    def put(self, buffer_id: int) -> None:
        with self._lock:
            assert buffer_id not in self._free, "buffer returned twice"
            self._free.append(buffer_id)
            self._backed.notify_all()

    def buffer(self, buffer_id: int) -> torch.Tensor:
        return self._memory.tensor[buffer_id]

    @property
    def num_free(self) -> int:
        with self._lock:
            started = sum(b not in self._taken for b in self._backing)
            return len(self._free) + started + self.max_buffers - self._num_claimed

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._backed.notify_all()
        if self._backer is not None:
            self._backer.join()  # at most one slice's backing
        for buffer in self._pinned:
            unpin(buffer)
        self._pinned.clear()


class _Fence:
    """Wakes the updater to remove what fenced tasks stored."""


class _AsyncUpdater:
    """Writes update tasks to vineyard one at a time, in issue order.

    Order matters: vineyard drops an update whose prefix chunks are not cached
    yet. Every task's buffer goes back to the pool whatever happens to it.

    A reset fences the tasks staged before it (:meth:`fence`): those still
    queued are dropped, and what the last ones written stored (the one in
    flight, and those that landed after the reset but before the worker
    learned of it: at most one per buffer) is removed with ``remove``.
    """

    def __init__(
        self,
        write: Callable[[UpdateTask], UpdateResult],
        pool: _PinnedTensorPool,
        metrics: VineyardCacheMetrics,
        block_size: int,
        drain_timeout_s: float,
        on_failed: Callable[[UpdateTask], None] | None = None,
        on_idle: Callable[[], None] | None = None,
        remove: Callable[[UpdateTask], None] | None = None,
    ):
        self._write = write
        self._pool = pool
        self._metrics = metrics
        # All are called on the updater's thread.
        self._on_failed, self._on_idle = on_failed, on_idle
        self._remove = remove
        self._block_size = block_size
        self._drain_timeout_s = drain_timeout_s
        self._deadline = 0.0
        self._fence = 0  # tasks of an older generation are not written
        self._written: collections.deque[UpdateTask] = collections.deque(
            maxlen=pool.max_buffers + 1
        )
        self._queue: queue.SimpleQueue[UpdateTask | _Fence | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._closed = False
        #: When each reason of a failed update was last logged.
        self._logged_write_errors: dict[str, float] = {}
        self._thread = threading.Thread(
            target=self._run, name="vineyard-cache-updater", daemon=True
        )
        self._thread.start()

    def submit(self, task: UpdateTask) -> None:
        """Queue a task; never blocks (the pool bounds the queue)."""
        if self._closed:
            self._finish(task, "dropped")
            return
        self._metrics.add("updates_submitted")
        self._queue.put(task)

    def fence(self, generation: int) -> None:
        """Tasks of a generation before ``generation`` are not written, and
        what the last ones written stored is removed. Never blocks."""
        self._fence = generation
        self._queue.put(_Fence())

    def _remove_fenced(self) -> None:
        """Remove what the tasks written before the fence stored."""
        fenced = [t for t in self._written if t.generation < self._fence]
        self._written = collections.deque(
            (t for t in self._written if t.generation >= self._fence),
            maxlen=self._written.maxlen,
        )
        for task in fenced:
            if self._remove is not None and any(task.stored):
                try:
                    self._remove(task)
                except Exception as e:  # noqa: BLE001 - the engine must go on
                    logger.warning(
                        "vineyard cache could not remove chunks written before "
                        "a reset (never loaded by this instance): %s",
                        e,
                    )
            self._metrics.add("updates_fenced")

    def _finish(self, task: UpdateTask, outcome: str) -> None:
        task.outcome = outcome
        self._metrics.add(f"updates_{outcome}")
        self._pool.put(task.buffer_id)
        task.done.set()

    def _fail(self, task: UpdateTask, why: str) -> None:
        # Each reason once a minute: a failing disk fails every write, and a
        # new reason (the mount lost, then the volume read-only) is news.
        now = time.monotonic()
        if now - self._logged_write_errors.get(why, -60.0) >= 60.0:
            if len(self._logged_write_errors) > 100:
                self._logged_write_errors.clear()
            self._logged_write_errors[why] = now
            logger.warning(
                "vineyard cache update failed (%d segment(s) not saved; "
                "they are retried while their requests run): %s",
                len(task.segments),
                why,
            )
        if self._on_failed is not None:
            self._on_failed(task)
        self._finish(task, "failed")

    def _execute(self, task: UpdateTask) -> None:
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
        self._written.append(task)
        if task.generation < self._fence:  # fenced while it was written
            self._remove_fenced()
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
            if isinstance(task, _Fence):
                self._remove_fenced()
            elif task.generation < self._fence:
                self._finish(task, "fenced")
            elif self._stopping.is_set() and time.monotonic() > self._deadline:
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


class VineyardLLMCache:
    """The vineyard KV cache of one vLLM worker (TP rank).

    Chunks of ``chunk_size`` tokens are the unit of caching; a chunk is saved
    once its KV is fully computed, and usable only if all chunks before it are
    cached. Blocks move as opaque bytes, one vineyard entry per block of all
    layers (see :mod:`vllm.worker.vineyard.storage.chunks`). Saves go through
    :meth:`save`, loads through :attr:`loads` (a
    :class:`~vllm.worker.vineyard.transfer.loads.LoadPipeline`).
    """

    def __init__(
        self,
        config: VineyardLLMCacheConfig,
        layout: KVCacheLayout,
        max_num_batched_tokens: int,
        kv_caches: Sequence[torch.Tensor],
        num_blocks: int,
    ):
        _check_shapes(config, layout, kv_caches)
        self.config = config
        self.layout = layout
        self.chunk_size = layout.chunk_size
        self.metrics = VineyardCacheMetrics(config.metrics_enabled)
        # Resolved and checked once: a root through a symlink works, one
        # that others could turn against this process is refused.
        try:
            root = check_root(config.root, config.group_access, config.setting("root"))
        except OSError as e:
            raise BackendError(f"cannot create the cache root: {e}") from e
        self.files = layout.files(root)
        # One buffer holds one step's tokens, rounded up to whole chunks.
        self.max_blocks = -(-max_num_batched_tokens // self.chunk_size) * (
            layout.blocks_per_chunk
        )
        self._kv = KVBlockCopier(kv_caches, num_blocks, layout.block_bytes)
        self.device = self._kv.device
        dtype = kv_caches[0].dtype
        num_buffers = config.num_update_buffers(self.max_blocks * layout.entry_bytes)
        self._saves = SaveLedger(layout, self.metrics)
        self._calls = BackendCalls(self.metrics)
        self._closed = False
        self.num_readers = config.readers or default_readers(self.device.type != "cpu")
        # A read buffer holds a segment of a load: a quarter of a step's
        # blocks (whole chunks), so that a long load's reads overlap.
        bpc = layout.blocks_per_chunk
        self._read_buffers = ReadBuffers(
            self.num_readers + 1,
            max(bpc, self.max_blocks // 4 // bpc * bpc),
            layout.entry_bytes,
            dtype,
            self.device,
        )
        self._write_memory = StagingMemory(
            num_buffers, self.max_blocks, layout.entry_bytes, dtype
        )
        self._pool = _PinnedTensorPool(
            self._write_memory, min(config.min_inflight_tasks, num_buffers), num_buffers
        )
        # The last staging copy (on a device, asynchronous): buffers are
        # unpinned only after it.
        self._last_copy: torch.cuda.Event | None = None
        self._readers: list[BackendProcess] = []
        self._writer: BackendProcess | None = None
        self._updater: _AsyncUpdater | None = None
        self.loads = self._start_backends(root)
        self._updater = self._start_updater()

    def _start_backends(self, root: str) -> LoadPipeline:
        """Start the readers and the writer (if any cannot start, close and
        raise :class:`BackendError`); returns the load pipeline, which the
        readers serve."""
        try:
            readers, writer = start_backends(
                self.config,
                self.layout,
                self.files.root,
                root,
                self.num_readers,
                self._read_buffers.memory,
                self._write_memory,
            )
        except BackendError:
            self.close()
            raise
        self._readers, self._writer = readers, writer
        return LoadPipeline(
            readers,
            self._calls,
            self._read_buffers,
            self._kv,
            self.layout,
            self.metrics,
            self.config.backend_timeout_s,
        )

    def _start_updater(self) -> _AsyncUpdater:
        """The ordered updater, started once the backends are up."""
        config = self.config
        # Tools (vineyard-llm-cache) read the layout from it; never raises.
        write_manifest(self.files.root, self.layout, config.group_access)
        updater = _AsyncUpdater(
            self._write_to_backend,
            self._pool,
            self.metrics,
            self.layout.block_size,
            config.drain_timeout_s,
            on_failed=self._saves.rewind,
            on_idle=self._poll_writer_stats,
            remove=self._remove_from_backend,
        )
        logger.info(
            "vineyard cache on at %s (chunk %d tokens, %s updates, %d update "
            "buffer(s) of %.1f MiB, %s)",
            self.files.root,
            self.chunk_size,
            "async" if config.enable_async_update else "sync",
            self._pool.max_buffers,
            self._write_memory.buffer_bytes / (1 << 20),
            "authenticated" if config.auth_key_file else "checksummed",
        )
        return updater

    def _write_to_backend(self, task: UpdateTask) -> UpdateResult:
        assert self._writer is not None
        segments = [s.request() for s in task.segments]
        reply = self._calls.call(self._writer, UpdateRequest(task.buffer_id, segments))
        return self._saves.book(task, reply.stored)

    def _remove_from_backend(self, task: UpdateTask) -> None:
        assert self._writer is not None
        chunks = task.stored_chunks(self.layout.blocks_per_chunk)
        self._calls.call(self._writer, RemoveRequest(chunks))

    def _poll_writer_stats(self) -> None:
        if self._writer is not None and self._writer.disabled_reason is None:
            self._calls.call(self._writer, StatsRequest())

    # ---- loads (moved on by ``loads``) -------------------------------------

    def can_load(self) -> bool:
        """Whether a reader can take a load now (not restarting, not
        disabled): the scheduler promises no hits while none can."""
        return not self._closed and any(r.available for r in self._readers)

    # ---- saves -------------------------------------------------------------

    def save(self, requests: Sequence[SaveRequest]) -> bool:
        """Stage the newly completed chunks of ``requests`` and submit them.

        Never waits for the backend when async update is on. With no free
        buffer the update is skipped (and counted); each request keeps its
        resume point, so the skipped chunks are saved by a later call while
        the request's blocks are alive. Returns whether a task was
        submitted.
        """
        if self._closed or self._writer is None or self._writer.disabled_reason:
            return False  # no backend: staging copies would be wasted
        t0 = time.perf_counter()
        pending = self._saves.pending(requests)
        if not pending:
            return False
        buffer_id = self._pool.get()
        if buffer_id is None:
            self.metrics.add("updates_skipped")
            return False
        segments, src_blocks = self._saves.take_segments(pending, self.max_blocks)
        staging = self._pool.buffer(buffer_id)[: len(src_blocks)]
        copy_done = self._last_copy = self._kv.gather(src_blocks, staging)
        # The updater waits for an asynchronous (CUDA) copy before writing.
        task = UpdateTask(buffer_id, segments, self._saves.generation, copy_done)
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
        return self._saves.take_stored()

    def fence(self) -> None:
        """The cache was reset: every request saves again from the
        scheduler's ``save_from``; writes staged before now are dropped, or
        what they stored is removed, and never reported; loads still going
        are recomputed."""
        self._saves.forget_saved()
        if self._updater is not None:
            self._updater.fence(self._saves.generation)
        self.loads.fence()

    def take_removed_paths(self) -> list[str]:
        """Chunk files removed from the root since the last call (by this
        rank's sweeps, or found corrupt by its reader)."""
        return self._calls.take_removed_paths()

    def take_unreadable(self) -> list[tuple[str, int, int]]:
        """Chunk files this rank's readers could not read since the last
        call (path below the namespace, inode, mtime in ns)."""
        return self._calls.take_unreadable()

    def release(self, req_id: str) -> None:
        """Forget a request's resume point (its blocks are being freed)."""
        self._saves.release(req_id)

    # ---- lifecycle ---------------------------------------------------------

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
        for reader in self._readers:
            reader.close()
        if self._last_copy is not None:
            self._last_copy.synchronize()  # copies of tasks dropped unwritten
        self._pool.close()
        self._write_memory.close()
        self._read_buffers.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # best effort at interpreter exit
            self.close()


def _check_shapes(
    config: VineyardLLMCacheConfig,
    layout: KVCacheLayout,
    kv_caches: Sequence[torch.Tensor],
) -> None:
    """Refuse a layout that disagrees with the config or the KV tensors."""
    if config.chunk_tokens(layout.block_size) != layout.chunk_size:
        raise ValueError(
            f"layout chunk of {layout.chunk_size} tokens, but "
            f"{config.setting('chunk_size')}={config.chunk_size}"
        )
    if len(kv_caches) != layout.num_layers:
        raise ValueError(
            f"got {len(kv_caches)} KV cache tensors for {layout.num_layers} layers"
        )
