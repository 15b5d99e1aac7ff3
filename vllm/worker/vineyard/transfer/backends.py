# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The cache's backend processes (its readers and its writer) as the cache
sees them: their specs and their start (:func:`start_backends`), and the
books that every call to them keeps (:class:`BackendCalls`): restarts,
the counters each reply carries, and the chunk files the backends
removed."""

from __future__ import annotations

import collections
import threading
from typing import Any, TypeVar

from vllm.worker.vineyard.backend.client import BackendProcess
from vllm.worker.vineyard.backend.protocol import (
    BackendSettings,
    BackendSpec,
    QueryReply,
    RemoveReply,
    Request,
    StatsReply,
    UpdateReply,
)
from vllm.worker.vineyard.backend.runs import BackendRun
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.metrics import VineyardCacheMetrics
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.transfer.staging import StagingMemory

#: The replies of a cache backend: each carries what it counted since.
CacheReplyT = TypeVar(
    "CacheReplyT", bound=UpdateReply | QueryReply | StatsReply | RemoveReply
)


class BackendCalls:
    """Calls to the cache's backends, booking what comes with them."""

    def __init__(self, metrics: VineyardCacheMetrics):
        self._metrics = metrics
        self._restarts_counted: dict[str, int] = {}
        # Chunk files the backends removed (reported by the worker).
        self._removed_paths: collections.deque[str] = collections.deque()
        # Chunk files the readers could not read (see BackendStats).
        self._unreadable: collections.deque[tuple[str, int, int]] = collections.deque()
        # A call is a send and its receive: callers on two threads (the
        # updater and a stats poll) must not interleave them.
        self._call_lock = threading.Lock()

    def send(self, backend: BackendProcess, request: Request[Any]) -> BackendRun:
        """Send ``request``; the run of the process it went to."""
        try:
            return backend.send(request)
        finally:
            # Restarts (maybe on a thread of the backend's) not counted yet.
            new = backend.restarts - self._restarts_counted.get(backend.name, 0)
            if new:
                self._restarts_counted[backend.name] = backend.restarts
                self._metrics.add("backend_restarts", new)

    def receive(
        self,
        backend: BackendProcess,
        reply_type: type[CacheReplyT],
        timeout_s: float | None = None,
    ) -> CacheReplyT:
        reply = backend.receive(reply_type, timeout_s)
        self._removed_paths.extend(reply.stats.removed_paths)
        self._unreadable.extend(reply.stats.unreadable)
        self._metrics.record(reply.stats.counters)
        return reply

    def take_unreadable(self) -> list[tuple[str, int, int]]:
        """Chunk files the backends could not read since the last call."""
        unreadable = []
        while self._unreadable:
            unreadable.append(self._unreadable.popleft())
        return unreadable

    def take_removed_paths(self) -> list[str]:
        """Chunk files the backends removed since the last call."""
        removed = []
        while self._removed_paths:
            removed.append(self._removed_paths.popleft())
        return removed

    def call(
        self, backend: BackendProcess, request: Request[CacheReplyT]
    ) -> CacheReplyT:
        """Send one request and wait for its answer."""
        with self._call_lock:
            self.send(backend, request)
            reply: CacheReplyT = self.receive(backend, request.reply_type)
        return reply


def _spec(
    config: VineyardLLMCacheConfig,
    layout: KVCacheLayout,
    namespace: str,
    cache_root: str,
    memory: StagingMemory,
    writer: bool,
) -> BackendSpec:
    return BackendSpec(
        settings=BackendSettings.from_config(config),
        namespace_dir=namespace,
        blocks_per_chunk=layout.blocks_per_chunk,
        entry_bytes=layout.entry_bytes,
        max_blocks=memory.max_blocks,
        num_buffers=memory.count,
        sweep=writer,
        cache_root=cache_root,
        flat_paths=layout.flat_paths,
    )


def start_backends(
    config: VineyardLLMCacheConfig,
    layout: KVCacheLayout,
    namespace: str,
    cache_root: str,
    num_readers: int,
    read_memory: StagingMemory,
    write_memory: StagingMemory,
) -> tuple[list[BackendProcess], BackendProcess]:
    """The readers (over ``read_memory``) and the writer (over
    ``write_memory``, sweeping ``cache_root``) of ``namespace``, ready; if
    any cannot start, none is left running."""
    started: list[BackendProcess] = []
    try:
        # All start at once (each spends a few tenths of a second
        # importing vineyard's KV cache).
        readers = []
        for i in range(num_readers):
            reader = BackendProcess(
                "read" if i == 0 else f"read{i}",
                _spec(config, layout, namespace, cache_root, read_memory, False),
                read_memory.fd,
                config.backend_timeout_s,
                wait=False,
                # Loads are driven from the forward thread: it never waits
                # for a reader to restart (e.g. on a root that hangs).
                restart_in_background=True,
                disk_progress=True,
                waited_for=True,  # a request waits for its load
            )
            started.append(reader)
            readers.append(reader)
        writer = BackendProcess(
            "write",
            _spec(config, layout, namespace, cache_root, write_memory, True),
            write_memory.fd,
            config.backend_timeout_s,
            # Writes are background work: when the backend shares a core
            # with the forward pass (an unpinned engine), the pass wins.
            nice=10,
            wait=False,
            disk_progress=True,
        )
        started.append(writer)
        for backend in started:
            backend.wait_ready()
    except BaseException:
        for backend in reversed(started):
            backend.close()
        raise
    return readers, writer
