# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The saves of a cache: what of each running request is saved, what a
save stages next, and the writer's side of each update
(:class:`SavePipeline`).

A request's chunks are saved in order from its resume point: a save stages
the chunks completed since (as :class:`Segment`\\ s of an
:class:`UpdateTask`), a write that fails rewinds the request to its failed
segment, and every write reports the runs of blocks it stored
(:class:`SaveLedger`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from vllm.worker.vineyard.backend.client import BackendProcess
from vllm.worker.vineyard.backend.protocol import (
    RemoveRequest,
    StatsRequest,
    UpdateRequest,
    WriteSegment,
)
from vllm.worker.vineyard.metrics import VineyardCacheMetrics
from vllm.worker.vineyard.storage.digests import synthetic_ids
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.transfer.backends import BackendCalls
from vllm.worker.vineyard.transfer.kv_copy import KVBlockCopier

#: The resume point of a request whose saves ended (its blocks were freed).
SAVES_ENDED = 1 << 62


@dataclass
class SaveRequest:
    """One running request as the connector sees it after a forward pass."""

    req_id: str
    block_digests: Sequence[bytes]  # chained digests of its complete blocks
    num_computed_tokens: int  # tokens whose KV is in blocks after this step
    block_ids: Sequence[int]  # the request's KV blocks, in order
    save_from: int = 0  # first token not known to be in vineyard
    held_from: int = 0  # blocks before it vLLM has freed (sliding window)


@dataclass
class Segment:
    """Consecutive chunks of one request, staged in one buffer."""

    first_slot: int  # the entry slot of its first block in the buffer
    prefix_ids: list[int]  # vineyard ids of the request's earlier blocks
    ids: list[int]  # vineyard ids of its blocks
    digests: list[bytes]  # their chained digests (sealed into trailers)
    req_id: str
    first_token: int  # to rewind the request if the write fails

    def request(self) -> WriteSegment:
        return WriteSegment(self.first_slot, self.prefix_ids, self.ids, self.digests)


@dataclass
class UpdateResult:
    """What became of one task's segments."""

    blocks_written: int
    blocks_rejected: int  # refused for want of their prefix
    write_error: str | None = None  # the filesystem failed a write


@dataclass
class UpdateTask:
    """One step's completed chunks, staged in one pool buffer."""

    buffer_id: int
    segments: list[Segment]
    generation: int = 0  # of the cache's reports when it was issued
    copy_done: torch.cuda.Event | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    outcome: str = "pending"  # completed / failed / dropped / fenced
    stored: list[int] = field(default_factory=list)  # blocks, per segment

    def stored_chunks(self, blocks_per_chunk: int) -> list[list[int]]:
        """The ids (from token 0) of each chunk its write stored."""
        return [
            segment.prefix_ids + segment.ids[:end]
            for segment, stored in zip(self.segments, self.stored, strict=False)
            for end in range(blocks_per_chunk, stored + 1, blocks_per_chunk)
        ]


#: ``(first token, end of the completed chunks, request)`` of a request
#: with chunks to save.
Pending = tuple[int, int, SaveRequest]


class SaveLedger:
    """Per running request, how far its saves got; and the runs of blocks
    that writes stored, for the worker's reports."""

    def __init__(self, layout: KVCacheLayout, metrics: VineyardCacheMetrics):
        self._layout = layout
        self._metrics = metrics
        # Per request: (the scheduler's save_from, the next token to save).
        self._resume: dict[str, tuple[int, int]] = {}
        # (generation, request id, first token, end) of what each write
        # stored (filled by the updater thread, reported by the worker);
        # writes issued before the last forget_saved go unreported.
        self._stored: collections.deque[tuple[int, str, int, int]] = collections.deque()
        self.generation = 0
        # (request id, first token) of segments whose write failed: their
        # requests resume from there (filled by the updater thread).
        self._failed_origins: collections.deque[tuple[str, int]] = collections.deque()

    def pending(self, requests: Sequence[SaveRequest]) -> list[Pending]:
        """The requests with completed chunks not saved yet, from where."""
        bs, chunk = self._layout.block_size, self._layout.chunk_size
        while self._failed_origins:
            # Later chunks of these requests were refused for want of their
            # prefix: write again from the failed segment on.
            req_id, begin = self._failed_origins.popleft()
            if req_id in self._resume:
                origin, resume = self._resume[req_id]
                self._resume[req_id] = (origin, min(resume, begin))
        pending: list[Pending] = []
        for req in requests:
            origin, begin = self._resume.get(req.req_id, (req.save_from, req.save_from))
            if req.save_from < origin:
                # The scheduler moved the start back (a load of this request
                # came up short on some rank): save again from there.
                origin, begin = req.save_from, min(begin, req.save_from)
            elif req.save_from > origin:
                # ... or on (its lookup came in late): those chunks are cached.
                origin, begin = req.save_from, max(begin, req.save_from)
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
                self._resume[req.req_id] = (origin, SAVES_ENDED)
                self._metrics.add("saves_dropped_freed")
                continue
            pending.append((begin, finished, req))
        return pending

    def take_segments(
        self, pending: list[Pending], max_blocks: int
    ) -> tuple[list[Segment], list[int]]:
        """The segments of ``pending`` that fit in a buffer of
        ``max_blocks`` entries, and the KV blocks to stage for them, in
        order; their requests resume after them."""
        bs, chunk = self._layout.block_size, self._layout.chunk_size
        segments: list[Segment] = []
        src_blocks: list[int] = []
        for begin, finished, req in pending:
            free = max_blocks - len(src_blocks)
            end = min(finished, begin + free // self._layout.blocks_per_chunk * chunk)
            if end <= begin:
                break  # buffer full; the rest resumes next step
            b0, b1 = begin // bs, end // bs
            ids = synthetic_ids(req.block_digests[:b1])
            segments.append(
                Segment(
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
        return segments, src_blocks

    def book(
        self, task: UpdateTask, stored_per_segment: list[tuple[int, str | None]]
    ) -> UpdateResult:
        """What the write of ``task`` stored (per segment: the entries
        vineyard holds, and a write error): its runs are kept for
        :meth:`take_stored`."""
        result = UpdateResult(0, 0)
        bs = self._layout.block_size
        for segment, (stored, error) in zip(
            task.segments, stored_per_segment, strict=True
        ):
            stored = min(stored, len(segment.ids))
            task.stored.append(stored)
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

    def rewind(self, task: UpdateTask) -> None:
        """The write of ``task`` failed: its requests save again from it."""
        self._failed_origins.extend((s.req_id, s.first_token) for s in task.segments)

    def take_stored(self) -> list[tuple[str, int, int]]:
        """``(req_id, first token, end)`` of each run of blocks that writes
        stored since the last call, in write order."""
        stored = []
        while self._stored:
            generation, req_id, begin, end = self._stored.popleft()
            if generation == self.generation:
                stored.append((req_id, begin, end))
        return stored

    def forget_saved(self) -> None:
        """Every request saves again from the scheduler's ``save_from``,
        and what writes issued before now store is never reported."""
        self.generation += 1
        self._resume.clear()

    def release(self, req_id: str) -> None:
        """Forget a request's resume point."""
        self._resume.pop(req_id, None)


class StagingPool(Protocol):
    """The cache's bounded pool of staging buffers (``_PinnedTensorPool``)."""

    def get(self) -> int | None: ...

    def buffer(self, buffer_id: int) -> torch.Tensor: ...


class Updater(Protocol):
    """The cache's ordered background writer (``_AsyncUpdater``)."""

    def submit(self, task: UpdateTask) -> None: ...

    def fence(self, generation: int) -> None: ...


class SavePipeline:
    """The saves of one cache (its ``saves``): what the forward thread
    stages after each step (:meth:`save`), and the writer backend's side of
    the updater's tasks (:meth:`write`, :meth:`remove`, :meth:`poll_stats`,
    called on the updater's thread). The updater is attached once started
    (:attr:`updater`)."""

    def __init__(
        self,
        layout: KVCacheLayout,
        metrics: VineyardCacheMetrics,
        kv: KVBlockCopier,
        pool: StagingPool,
        max_blocks: int,
        writer: BackendProcess,
        calls: BackendCalls,
        sync_timeout_s: float | None,
    ):
        self._layout = layout
        self._metrics = metrics
        self._kv = kv
        self._pool = pool
        self._max_blocks = max_blocks
        self._writer = writer
        self._calls = calls
        self._sync_timeout_s = sync_timeout_s  # None: asynchronous updates
        self.ledger = SaveLedger(layout, metrics)
        self.updater: Updater | None = None
        # The last staging copy (on a device, asynchronous): buffers are
        # unpinned only after it.
        self.last_copy: torch.cuda.Event | None = None

    def save(self, requests: Sequence[SaveRequest]) -> bool:
        """Stage the newly completed chunks of ``requests`` and submit them.

        Never waits for the backend when updates are asynchronous. With no
        free buffer the update is skipped (and counted); each request keeps
        its resume point, so the skipped chunks are saved by a later call
        while the request's blocks are alive. Returns whether a task was
        submitted."""
        if self.updater is None or self._writer.disabled_reason:
            return False  # no backend: staging copies would be wasted
        t0 = time.perf_counter()
        pending = self.ledger.pending(requests)
        if not pending:
            return False
        buffer_id = self._pool.get()
        if buffer_id is None:
            self._metrics.add("updates_skipped")
            return False
        segments, src_blocks = self.ledger.take_segments(pending, self._max_blocks)
        staging = self._pool.buffer(buffer_id)[: len(src_blocks)]
        copy_done = self.last_copy = self._kv.gather(src_blocks, staging)
        # The updater waits for an asynchronous (CUDA) copy before writing.
        task = UpdateTask(buffer_id, segments, self.ledger.generation, copy_done)
        self.updater.submit(task)
        self._metrics.observe("save_caller_s", time.perf_counter() - t0)
        if self._sync_timeout_s is not None:
            task.done.wait(self._sync_timeout_s)
        return True

    def take_stored(self) -> list[tuple[str, int, int]]:
        """``(req_id, first token, end)`` of each run of blocks that writes
        stored since the last call, in write order."""
        return self.ledger.take_stored()

    def release(self, req_id: str) -> None:
        """Forget a request's resume point (its blocks are being freed)."""
        self.ledger.release(req_id)

    def fence(self) -> None:
        """A reset: every request saves again from the scheduler's
        ``save_from``; tasks staged before now are dropped, or what they
        stored is removed, and never reported."""
        self.ledger.forget_saved()
        if self.updater is not None:
            self.updater.fence(self.ledger.generation)

    # ---- the writer's side (on the updater's thread) --------------------

    def write(self, task: UpdateTask) -> UpdateResult:
        segments = [s.request() for s in task.segments]
        reply = self._calls.call(self._writer, UpdateRequest(task.buffer_id, segments))
        return self.ledger.book(task, reply.stored)

    def remove(self, task: UpdateTask) -> None:
        chunks = task.stored_chunks(self._layout.blocks_per_chunk)
        self._calls.call(self._writer, RemoveRequest(chunks))

    def poll_stats(self) -> None:
        if self._writer.disabled_reason is None:
            self._calls.call(self._writer, StatsRequest())
