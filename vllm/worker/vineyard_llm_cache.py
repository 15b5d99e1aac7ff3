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
writer and one or more readers, so the GIL that vineyard holds never stalls
the engine, and a read never waits behind a write. Buffers are shared
memory; only block ids cross the process boundary.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch
from vllm.logger import init_logger

from vllm.worker.vineyard.backend.client import BackendProcess
from vllm.worker.vineyard.backend.protocol import BackendError
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.cores import default_readers
from vllm.worker.vineyard.metrics import VineyardCacheMetrics
from vllm.worker.vineyard.storage.file_modes import file_modes
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.storage.namespaces import write_manifest
from vllm.worker.vineyard.storage.root import check_root
from vllm.worker.vineyard.transfer.backends import BackendCalls, start_backends
from vllm.worker.vineyard.transfer.kv_copy import KVBlockCopier
from vllm.worker.vineyard.transfer.loads import LoadPipeline
from vllm.worker.vineyard.transfer.read_ahead import read_ahead_buffers
from vllm.worker.vineyard.transfer.saves import (
    SavePipeline,
    UpdateResult,
    UpdateTask,
)
from vllm.worker.vineyard.transfer.staging import (
    BufferBacking,
    ReadBuffers,
    StagingMemory,
)

logger = init_logger(__name__)

#: Backends report the sweeper's figures with every write; when no write
#: comes for this long, the updater asks for them.
_STATS_POLL_S = 5.0


class _PinnedTensorPool:
    """A bounded pool of staging buffers; :meth:`get` never blocks on the
    writer.

    ``min_buffers`` are backed (touched, and pinned on CUDA) up front; the
    rest, up to ``max_buffers``, in the background right after
    (:class:`~vllm.worker.vineyard.transfer.staging.BufferBacking`). A
    :meth:`get` that comes before the background got to a buffer backs it
    itself: a burst at startup needs the buffer (skipping it would lose a
    save that backing keeps). When every buffer is in flight ``get``
    returns ``None`` and the caller skips its update.
    """

    backing_type = BufferBacking

    def __init__(
        self,
        memory: StagingMemory,
        min_buffers: int,
        max_buffers: int,
        back_ahead: bool = True,
    ):
        self._memory = memory
        self._lock = threading.Lock()
        self._free: list[int] = []
        self.max_buffers = max_buffers
        self._backing = self.backing_type(
            memory, max_buffers, min_buffers, self.put, back_ahead
        )
        self._free.extend(self._backing.first)

    @property
    def _num_created(self) -> int:
        return self._backing.num_backed

    def get(self) -> int | None:
        """A free buffer's id, or ``None`` if all are in flight."""
        with self._lock:
            if self._free:
                return self._free.pop()
        buffer_id = self._backing.take()
        if buffer_id is not None:
            return buffer_id
        with self._lock:  # one the background finished meanwhile
            return self._free.pop() if self._free else None

    def put(self, buffer_id: int) -> None:
        with self._lock:
            assert buffer_id not in self._free, "buffer returned twice"
            self._free.append(buffer_id)

    def buffer(self, buffer_id: int) -> torch.Tensor:
        return self._memory.tensor[buffer_id]

    @property
    def num_free(self) -> int:
        with self._lock:
            free = len(self._free)
        return free + self._backing.num_not_handed_out

    def close(self) -> None:
        self._backing.close()


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
    layers. One door per direction: :attr:`saves` (a
    :class:`~vllm.worker.vineyard.transfer.saves.SavePipeline` over the pool
    and the updater) and :attr:`loads` (a
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
        self.modes = file_modes(config.group_access)
        self.metrics = VineyardCacheMetrics(config.metrics_enabled)
        # Resolved and checked once: a root through a symlink works, one
        # that others could turn against this process is refused.
        try:
            root = check_root(config.root, self.modes, config.setting("root"))
        except OSError as e:
            raise BackendError(f"cannot create the cache root: {e}") from e
        self.files = layout.files(root)
        # One buffer holds one step's tokens, rounded up to whole chunks.
        bpc = layout.blocks_per_chunk
        max_blocks = -(-max_num_batched_tokens // layout.chunk_size) * bpc
        kv = KVBlockCopier(kv_caches, num_blocks, layout.block_bytes)
        self.device = kv.device
        dtype = kv_caches[0].dtype
        num_buffers = config.num_update_buffers(max_blocks * layout.entry_bytes)
        self._calls = BackendCalls(self.metrics)
        self._closed = False
        self.num_readers = config.readers or default_readers(self.device.type != "cpu")
        # A read buffer holds a segment of a load: a quarter of a step's
        # blocks (whole chunks), so that a long load's reads overlap.
        segment_blocks = max(bpc, max_blocks // 4 // bpc * bpc)
        ahead = read_ahead_buffers(
            config.read_ahead_buffers, segment_blocks * layout.entry_bytes
        )
        self._read_buffers = ReadBuffers(
            self.num_readers + 1 + ahead,
            segment_blocks,
            layout.entry_bytes,
            dtype,
            self.device,
        )
        self._write_memory = StagingMemory(
            num_buffers, max_blocks, layout.entry_bytes, dtype
        )
        self._pool = _PinnedTensorPool(
            self._write_memory, min(config.min_inflight_tasks, num_buffers), num_buffers
        )
        self._readers: list[BackendProcess] = []
        self._writer: BackendProcess | None = None
        self._updater: _AsyncUpdater | None = None
        self._saves: SavePipeline | None = None
        try:
            self._readers, self._writer = start_backends(
                config,
                layout,
                self.files.namespace_dir,
                root,
                self.num_readers,
                self._read_buffers.memory,
                self._write_memory,
            )
        except BackendError:
            self.close()
            raise
        self.loads = LoadPipeline(
            self._readers,
            self._calls,
            self._read_buffers,
            kv,
            layout,
            self.metrics,
            config.backend_timeout_s,
            ahead,
        )
        sync_s = None if config.enable_async_update else config.backend_timeout_s + 5
        self._saves = SavePipeline(
            layout,
            self.metrics,
            kv,
            self._pool,
            max_blocks,
            self._writer,
            self._calls,
            sync_s,
        )
        self._updater = self._saves.updater = self._start_updater(self._saves)

    @property
    def saves(self) -> SavePipeline:
        assert self._saves is not None, "the cache did not start"
        return self._saves

    def _start_updater(self, saves: SavePipeline) -> _AsyncUpdater:
        """The ordered updater, started once the backends are up."""
        config = self.config
        # Tools (vineyard-llm-cache) read the layout from it; never raises.
        write_manifest(self.files.namespace_dir, self.layout, self.modes)
        updater = _AsyncUpdater(
            saves.write,
            self._pool,
            self.metrics,
            self.layout.block_size,
            config.drain_timeout_s,
            on_failed=saves.ledger.rewind,
            on_idle=saves.poll_stats,
            remove=saves.remove,
        )
        logger.info(
            "vineyard cache on at %s (chunk %d tokens, %s updates, %d update "
            "buffer(s) of %.1f MiB, %s)",
            self.files.namespace_dir,
            self.layout.chunk_size,
            "async" if config.enable_async_update else "sync",
            self._pool.max_buffers,
            self._write_memory.buffer_bytes / (1 << 20),
            "authenticated" if config.auth_key_file else "checksummed",
        )
        return updater

    def can_load(self) -> bool:
        """Whether a reader can take a load now (not restarting, not
        disabled): the scheduler promises no hits while none can."""
        return not self._closed and any(r.available for r in self._readers)

    def fence(self) -> None:
        """The cache was reset: saves start over (writes staged before now
        are dropped, or what they stored is removed) and loads still going
        are recomputed."""
        self.saves.fence()
        self.loads.fence()

    def take_removed_paths(self) -> list[str]:
        """Chunk files removed from the root since the last call (by this
        rank's sweeps, or found corrupt by its reader)."""
        return self._calls.take_removed_paths()

    def take_unreadable(self) -> list[tuple[str, int, int]]:
        """Chunk files this rank's readers could not read since the last
        call (path below the namespace, inode, mtime in ns)."""
        return self._calls.take_unreadable()

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
        if self._saves is not None and self._saves.last_copy is not None:
            self._saves.last_copy.synchronize()  # of tasks dropped unwritten
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
    if (
        config.chunk_size
        and config.chunk_tokens(layout.block_size) != layout.chunk_size
    ):
        raise ValueError(
            f"layout chunk of {layout.chunk_size} tokens, but "
            f"{config.setting('chunk_size')}={config.chunk_size}"
        )
    if len(kv_caches) != layout.num_layers:
        raise ValueError(
            f"got {len(kv_caches)} KV cache tensors for {layout.num_layers} layers"
        )
