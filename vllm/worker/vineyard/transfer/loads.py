# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The load pipeline of the cache: which chunks each request's load reads,
the reads the reader backend makes of them (one at a time, in turn into two
read buffers), and the copy of verified blocks into the request's KV blocks
on the caller's thread."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

from vllm.worker.vineyard.backend.client import BackendProcess
from vllm.worker.vineyard.backend.protocol import (
    BackendError,
    QueryReply,
    QueryRequest,
)
from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.metrics import VineyardCacheMetrics
from vllm.worker.vineyard.storage.chunks import synthetic_ids
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.transfer.backends import BackendCalls
from vllm.worker.vineyard.transfer.kv_copy import KVBlockCopier
from vllm.worker.vineyard.transfer.staging import ReadBuffers

logger = init_logger(__name__)


@dataclass
class LoadJob:
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
    read_s: float = 0.0  # the reader's time reading, verifying; ours copying
    verify_s: float = 0.0
    copy_s: float = 0.0


class LoadPipeline:
    """The loads of one cache (its ``loads``), moved on by the thread that
    calls it (the forward thread) and never waiting unless told to."""

    def __init__(
        self,
        reader: BackendProcess,
        calls: BackendCalls,
        buffers: ReadBuffers,
        kv: KVBlockCopier,
        layout: KVCacheLayout,
        metrics: VineyardCacheMetrics,
        timeout_s: float,
    ):
        self._reader, self._calls = reader, calls  # where reads go
        self._buffers = buffers
        self._kv = kv
        self._layout = layout
        self._metrics = metrics
        self._timeout_s = timeout_s  # a read not answered by then is given up
        self._log = LogLimiter(logger)
        self._events: list[torch.cuda.Event | None] = [None] * buffers.COUNT
        self._next_buffer = 0
        # Loads by request, in the order their reads go out; the one read in
        # flight: (load, segment, buffer, sent at).
        self._jobs: dict[str, LoadJob] = {}
        self._queue: collections.deque[LoadJob] = collections.deque()
        self._in_flight: tuple[LoadJob, int, int, float] | None = None
        self._finished: list[tuple[str, int, int]] = []
        bpc = layout.blocks_per_chunk
        max_blocks = buffers.memory.max_blocks
        self._segment_blocks = max(bpc, max_blocks // 4 // bpc * bpc)

    def start(
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
        ``end``); returns at once. :meth:`poll` moves it on and
        :meth:`take_finished` reports it.

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
        bs, bpc = self._layout.block_size, self._layout.blocks_per_chunk
        assert start % bs == 0 and end % bs == 0
        first, last = start // self._layout.chunk_size * bpc, end // bs
        read_end = min(-(-last // bpc), len(digests) // bpc) * bpc
        step = self._segment_blocks
        segments = [(b, min(b + step, read_end)) for b in range(first, read_end, step)]
        job = LoadJob(
            req_id=req_id,
            ids=synthetic_ids(digests[:read_end]),
            digests=list(digests[:read_end]),
            block_ids=list(block_ids),
            start=start // bs,
            last=last,
            segments=segments,
        )
        job.loaded = job.start
        self._jobs[req_id] = job
        if segments:
            self._queue.append(job)
        else:
            self._finish(job)  # nothing to read

    def cancel(self, req_id: str) -> None:
        """Stop a request's load (it was aborted): it is reported finished
        at once, since nothing is written into its blocks from now on (only
        this thread copies into KV blocks; a read still in flight lands in
        a read buffer and is dropped)."""
        job = self._jobs.get(req_id)
        if job is not None:
            job.cancelled = True
            self._finish(job)

    def loading(self, req_id: str) -> bool:
        return req_id in self._jobs

    def take_finished(self) -> list[tuple[str, int, int]]:
        """``(req_id, loaded_end, promised_end)`` of loads finished since
        the last call, in tokens; a load that was cancelled reports its
        promised end (nothing of it is used)."""
        done, self._finished = self._finished, []
        return done

    def poll(self, wait: bool = False) -> None:
        """Move loads on: collect the reader's answers that have arrived,
        copy their verified blocks into place and send the next reads.
        Never waits unless ``wait`` (then until every load is done)."""
        reader = self._reader
        while True:
            if self._in_flight is None and not self._send_next_read():
                return
            assert self._in_flight is not None
            job, k, buffer, sent_at = self._in_flight
            ready = wait or reader.ready()
            # Stuck: no progress for the timeout; a reader starved of CPU or
            # waiting for a busy disk is slow, and waited for, but a
            # request waits for its load at most twice the timeout.
            stuck = not ready and (
                reader.stalled(self._timeout_s) is not None
                or time.monotonic() - sent_at >= 2 * self._timeout_s
            )
            if not (ready or stuck):
                return
            self._in_flight = None
            try:
                # A stuck reader is given up on at once (and restarted).
                timeout_s = None if ready else 0.0
                reply = self._calls.receive(reader, QueryReply, timeout_s)
            except BackendError as e:
                logger.warning("vineyard cache read failed, recomputing: %s", e)
                self._finish(job)
                continue
            verified = reply.verified
            job.read_s += reply.read_s
            job.verify_s += reply.verify_s
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
                    copy_started = time.perf_counter()
                    self._copy_in(buffer, skip, use, job.block_ids[s + skip : s + use])
                    job.copy_s += time.perf_counter() - copy_started
                    job.loaded = s + use
            if not more:
                self._finish(job)

    def _send_next_read(self) -> bool:
        """Send the next segment's read of the first unfinished load into
        the next read buffer; whether one was sent."""
        while self._queue:
            job = self._queue[0]
            k = job.next_segment
            if job.cancelled or k >= len(job.segments):
                # Every read sent: its last answer finishes it.
                self._queue.popleft()
                continue
            s, e = job.segments[k]
            buffer = self._next_buffer
            event = self._events[buffer]
            if event is not None:
                event.synchronize()  # the buffer's last copy is done
            try:
                request = QueryRequest(
                    buffer,
                    job.ids[:s],
                    job.ids[s:e],
                    job.digests[s:e],
                    k == 0,  # the load's first read marks the prefix used too
                )
                self._calls.send(self._reader, request)
            except BackendError as e:
                logger.warning("vineyard cache read failed, recomputing: %s", e)
                self._queue.popleft()
                self._finish(job)
                continue
            job.next_segment = k + 1  # sent; the answer decides what follows
            self._next_buffer ^= 1
            self._in_flight = (job, k, buffer, time.monotonic())
            return True
        return False

    def _finish(self, job: LoadJob) -> None:
        """Report ``job`` finished (once), with what it loaded."""
        if self._jobs.pop(job.req_id, None) is None:
            return  # already reported
        with contextlib.suppress(ValueError):
            self._queue.remove(job)
        bs = self._layout.block_size
        loaded, end = job.loaded * bs, job.last * bs
        start = job.start * bs
        if job.cancelled:
            loaded = end
        else:
            self._metrics.add("loaded_tokens", max(0, loaded - start))
            if loaded < end:
                self._metrics.add("load_errors")
                self._log.warning(
                    "short-load",
                    "vineyard cache returned %d of %d promised tokens; the "
                    "rest is recomputed",
                    max(0, loaded - start),
                    end - start,
                )
        self._metrics.observe("load_s", time.perf_counter() - job.started_at)
        self._metrics.observe("load_read_s", job.read_s)
        self._metrics.observe("load_verify_s", job.verify_s)
        self._metrics.observe("load_copy_s", job.copy_s)
        self._finished.append((job.req_id, loaded, end))

    def _copy_in(
        self, buffer: int, first: int, end: int, block_ids: Sequence[int]
    ) -> None:
        """Copy entries ``[first, end)`` of a read buffer into KV blocks."""
        event = self._kv.scatter(
            self._buffers.memory.tensor[buffer, first:end], block_ids
        )
        if event is not None:
            self._events[buffer] = event  # the buffer's next read waits
