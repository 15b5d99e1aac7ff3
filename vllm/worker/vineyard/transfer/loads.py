# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The load pipeline of the cache: which chunks each request's load reads,
the reads the reader backends make of them (one segment per reader at a
time, each into a read buffer of its own), and the copy of verified blocks
into the request's KV blocks on the caller's thread, in segment order."""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Sequence

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
from vllm.worker.vineyard.storage.digests import synthetic_ids
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.transfer.backends import BackendCalls
from vllm.worker.vineyard.transfer.kv_copy import KVBlockCopier
from vllm.worker.vineyard.transfer.load_jobs import (
    HeldBuffers,
    LoadJob,
    SegmentRead,
    segments_of,
    slow_loads,
)
from vllm.worker.vineyard.transfer.read_ahead import ReadAheadJobs, free_run
from vllm.worker.vineyard.transfer.staging import ReadBuffers

logger = init_logger(__name__)


class LoadPipeline:
    """The loads of one cache (its ``loads``), moved on by the thread that
    calls it (the forward thread) and never waiting unless told to.

    Several readers read (and verify) segments at once, the next ones of
    a load included, each into a free read buffer; a load's answers are
    copied in the order its reads went out, so blocks go into place in
    order and a segment that comes back short ends its load there (the
    answers to the reads after it are dropped).

    A request still queued can be read ahead (:meth:`read_ahead`): its
    segments are read into at most ``read_ahead_buffers`` buffers of their
    own while real loads have the rest, on one reader fewer than there
    are; the answers wait in their buffers, and the request's load, once
    it starts, copies them at once. Dropped when the request is scheduled
    without a load, aborted or the cache reset.

    A reader given up on (stuck, or dead) is killed without waiting; its
    buffer is held until its process is gone (:class:`HeldBuffers`). Loads
    go on with the other buffers; while every buffer is held, a load stops
    where it is (the rest is recomputed)."""

    def __init__(
        self,
        readers: Sequence[BackendProcess],
        calls: BackendCalls,
        buffers: ReadBuffers,
        kv: KVBlockCopier,
        layout: KVCacheLayout,
        metrics: VineyardCacheMetrics,
        timeout_s: float,
        read_ahead_buffers: int = 0,
    ):
        assert buffers.memory.count > len(readers) + read_ahead_buffers
        assert len(readers) > 0
        self._readers, self._calls = list(readers), calls  # where reads go
        self._buffers = buffers
        self._kv = kv
        self._layout = layout
        self._metrics = metrics
        self._timeout_s = timeout_s  # a read not answered by then is given up
        self._log = LogLimiter(logger)
        # A buffer's last copy into KV blocks (on a device, asynchronous).
        self._events: list[torch.cuda.Event | None] = [None] * buffers.memory.count
        self._free_buffers = collections.deque(range(buffers.memory.count))
        self._held = HeldBuffers(timeout_s)
        # Loads by request, in the order their reads go out; the reads in
        # flight, oldest first.
        self._jobs: dict[str, LoadJob] = {}
        self._queue: collections.deque[LoadJob] = collections.deque()
        self._in_flight: collections.deque[SegmentRead] = collections.deque()
        self._finished: list[tuple[str, int, int]] = []
        # (blocks, seconds) of finished loads: what loading costs now.
        self._load_times: list[tuple[int, float]] = []
        self._segment_blocks = buffers.memory.max_blocks
        self._ahead = ReadAheadJobs(
            read_ahead_buffers, self._segment_blocks, layout.block_size
        )

    def start(
        self,
        req_id: str,
        digests: Sequence[bytes],
        start: int,
        end: int,
        block_ids: Sequence[int],
        compute_s_per_token: float | None = None,
        load_s_per_block: float | None = None,
        stop_at: float | None = None,
    ) -> None:
        """Begin loading the cached KV of tokens ``[start, end)`` into the
        request's blocks (``digests`` and ``block_ids`` cover the request
        from token 0, ``digests`` up to the end of the chunk that holds
        ``end``); returns at once. :meth:`poll` moves it on and
        :meth:`take_finished` reports it. With ``compute_s_per_token``, a
        load that runs slower than computing the rest stops at a chunk
        boundary (the rest is computed); ``load_s_per_block`` (the link's
        recent price) tells a stalled read sooner; one not done by ``stop_at``
        (monotonic) stops there.

        ``start`` and ``end`` are block-aligned. Vineyard reads whole chunks,
        from the chunk boundary at or before ``start`` to the one at or after
        ``end``, but only blocks in ``[start, end)`` are written: blocks
        before ``start`` (vLLM's own prefix-cache hit, maybe shared with
        running requests) and after ``end`` (not the request's to fill) are
        left alone. The reader verifies every entry before it is copied; the
        only work on the caller's thread is the copy into place.
        """
        bs = self._layout.block_size
        assert start % bs == 0 and end % bs == 0
        first, read_end = self._read_range(digests, start, end)
        job = self._adopt(req_id, digests, first, read_end)
        if job is None:
            # A load that may be stopped for slowness reads its first chunk
            # on its own: its pace shows after one chunk, not one segment.
            bpc = self._layout.blocks_per_chunk
            lead = bpc if compute_s_per_token is not None else 0
            segments = segments_of(first, read_end, self._segment_blocks, lead)
            job = LoadJob(
                req_id=req_id,
                ids=synthetic_ids(digests[:read_end]),
                digests=list(digests[:read_end]),
                block_ids=[],
                start=0,
                last=0,
                segments=segments,
            )
        job.block_ids = list(block_ids)
        job.start, job.last = start // bs, end // bs
        job.loaded = job.start
        job.compute_s_per_token = compute_s_per_token
        job.load_s_per_block = load_s_per_block
        job.stop_at = stop_at
        self._jobs[req_id] = job
        if job.next_segment < len(job.segments):
            self._queue.append(job)
        self._copy_answers(job)  # what was read ahead
        if not job.segments:
            self._finish(job)  # nothing to read

    def _read_range(
        self, digests: Sequence[bytes], start: int, end: int
    ) -> tuple[int, int]:
        """The blocks a load of tokens ``[start, end)`` reads: whole
        chunks, as far as ``digests`` go."""
        bs, bpc = self._layout.block_size, self._layout.blocks_per_chunk
        first = start // self._layout.chunk_size * bpc
        return first, min(-(-(end // bs) // bpc), len(digests) // bpc) * bpc

    def read_ahead(
        self, req_id: str, digests: Sequence[bytes], start: int, end: int
    ) -> None:
        """Read the cached KV of tokens ``[start, end)`` of a request still
        queued into read buffers, so that its load, once it starts, has it
        (see the class); returns at once."""
        if req_id not in self._jobs:
            self._ahead.add(req_id, digests, *self._read_range(digests, start, end))

    def drop_read_ahead(self, req_id: str) -> None:
        """The request will not load what was read ahead (scheduled without
        a load, or aborted): its buffers are free again."""
        job = self._ahead.jobs.pop(req_id, None)
        if job is not None:
            self._drop(job)

    def _drop(self, job: LoadJob) -> None:
        """End a read-ahead unused: its answers' buffers are freed, their
        reads price the link all the same."""
        job.finished = True
        self._ahead.jobs.pop(job.req_id, None)
        blocks = sum(a.verified for a in job.answers.values())
        seconds = sum(a.read_s + a.verify_s for a in job.answers.values())
        if blocks and seconds > 0 and not job.fenced:
            self._load_times.append((blocks, seconds))
        self._metrics.add("read_ahead_unused_tokens", blocks * self._layout.block_size)
        self._free_answers(job)

    def _adopt(
        self, req_id: str, digests: Sequence[bytes], first: int, read_end: int
    ) -> LoadJob | None:
        """The request's read-ahead, made its load if it read the same
        chunks (else dropped)."""
        job = self._ahead.jobs.pop(req_id, None)
        if job is None:
            return None
        freed = self._ahead.adopt(job, digests, first, read_end)
        if freed is None:
            self._drop(job)
            return None
        self._free_buffers.extend(freed)
        job.started_at = time.perf_counter()
        blocks = sum(a.verified for a in job.answers.values())
        self._metrics.add("read_ahead_tokens", blocks * self._layout.block_size)
        return job

    def take_read_ahead(self) -> dict[str, tuple[int, int]]:
        return self._ahead.take_news()  # see ReadAheadJobs.take_news

    def cancel(self, req_id: str) -> None:
        """Stop a request's load (it was aborted): it is reported finished
        at once, since nothing is written into its blocks from now on (only
        this thread copies into KV blocks; a read still in flight lands in
        a read buffer and is dropped)."""
        self.drop_read_ahead(req_id)
        job = self._jobs.get(req_id)
        if job is not None:
            job.cancelled = True
            self._finish(job)

    def fence(self) -> None:
        """The cache was reset: every load still going finishes with
        nothing loaded (its blocks are recomputed), as what it reads
        predates the reset."""
        for job in list(self._jobs.values()) + list(self._ahead.jobs.values()):
            job.fenced = True
            job.loaded = job.start
            if job.ahead:
                self._drop(job)
            else:
                self._finish(job)

    def loading(self, req_id: str) -> bool:
        return req_id in self._jobs

    @property
    def reading(self) -> bool:
        """Whether reads are out or waiting to go (a poll may move on)."""
        return bool(self._in_flight or self._queue)

    def take_load_times(self) -> list[tuple[int, float]]:
        """``(blocks, seconds)`` of the loads and read-aheads finished since
        the last call, by their readers (or since a stopped one's read)."""
        times, self._load_times = self._load_times, []
        return times

    def _stop_slow_loads(self) -> None:
        """Stop the loads that run slower than computing the rest (see
        :func:`slow_loads`)."""
        bs = self._layout.block_size
        for job in slow_loads(self._jobs.values(), self._in_flight, bs):
            job.stopped_slow = True
            self._metrics.add("loads_stopped_slow")
            self._metrics.add("tokens_not_loaded_slow", (job.last - job.loaded) * bs)
            self._finish(job)

    def take_finished(self) -> list[tuple[str, int, int]]:
        """``(req_id, loaded_end, promised_end)`` of loads finished since
        the last call, in tokens; a load that was cancelled reports its
        promised end (nothing of it is used)."""
        done, self._finished = self._finished, []
        return done

    def poll(self, wait: bool = False, judge: bool = True) -> None:
        """Move loads on: collect the readers' answers that have arrived,
        copy their verified blocks into place and send the next reads.
        Never waits unless ``wait`` (then until every load is done). With
        ``judge`` (a step's start and end, not mid-pass: a load's first
        answers are mostly a file's latency) loads are judged slow, after
        the answers that arrived are in (a step that ran long must not make
        a load that was done look slow)."""
        self._collect(wait)
        if judge:
            self._stop_slow_loads()

    def _collect(self, wait: bool) -> None:
        while True:
            self._send_reads()
            answer = self._next_answer(wait)
            if answer is None:
                return
            read, ready = answer
            self._in_flight.remove(read)
            reader, job = read.reader, read.job
            try:
                # A stuck reader is given up on at once (and restarted).
                timeout_s = None if ready else 0.0
                reply = self._calls.receive(reader, QueryReply, timeout_s)
            except BackendError as e:
                logger.warning("vineyard cache read failed, recomputing: %s", e)
                self._release(read)
                (self._drop if job.ahead else self._finish)(job)
                continue
            self._free_buffers.extend(
                job.take_answer(read, reply.verified, reply.read_s, reply.verify_s)
            )
            if job.ahead:
                self._ahead.timed(reply.verified, reply.read_s + reply.verify_s)
            else:
                # The readers' next reads overlap the copy.
                self._send_reads()
                self._copy_answers(job)

    def _next_answer(self, wait: bool) -> tuple[SegmentRead, bool] | None:
        """The next read to take: an answered one, or a stuck one (given up
        on), or (``wait``, while loads are going) the oldest, waited for;
        ``(read, answered)``."""
        for read in self._in_flight:
            if read.reader.ready():
                return read, True
        for read in self._in_flight:
            # Stuck: no progress for the timeout (a reader starved of CPU or
            # waiting for a busy disk is slow), or twice the timeout passed.
            if (
                read.reader.stalled(self._timeout_s) is not None
                or time.monotonic() - read.sent_at >= 2 * self._timeout_s
            ):
                return read, False
        if wait and self._jobs and self._in_flight:
            return self._in_flight[0], True
        return None

    def _copy_answers(self, job: LoadJob) -> None:
        """Copy the job's answers that are next in order into its blocks;
        a short answer, or the last, finishes it."""
        while not job.finished and job.next_copy in job.answers:
            k = job.next_copy
            answer = job.answers.pop(k)
            job.next_copy = k + 1
            job.read_s += answer.read_s
            job.verify_s += answer.verify_s
            s, e = job.segments[k]
            skip, use = max(0, job.loaded - s), min(answer.verified, job.last - s)
            if use > skip:
                copy_started = time.perf_counter()
                blocks = job.block_ids[s + skip : s + use]
                self._copy_in(answer.buffer, skip, use, blocks)
                job.copy_s += time.perf_counter() - copy_started
                job.loaded = s + use
            self._free_buffers.append(answer.buffer)
            short = s + answer.verified < e
            if short or job.next_copy == len(job.segments) or job.loaded >= job.last:
                self._finish(job)

    def _send_reads(self) -> None:
        """Send the next segments' reads, of the first unfinished loads, to
        the idle readers (the first reader first), each into a free read
        buffer; then reads ahead, within their budget. A read a reader
        cannot take (it died, or is restarting) goes to another; with none
        left and none answering, the load stops there (the rest is
        recomputed)."""
        self._free_buffers.extend(self._held.take_back())
        busy = {id(read.reader) for read in self._in_flight}
        idle = [r for r in self._readers if id(r) not in busy and r.available]
        if self._queue and self._held.count == self._buffers.memory.count:
            # Every buffer waits for a killed reader to exit (which may take
            # as long as the filesystem does).
            self._log.warning(
                "no-buffer",
                "vineyard cache read failed, recomputing: every read buffer "
                "waits for a killed reader to exit",
            )
            for job in list(self._queue):
                self._finish(job)
            self._queue.clear()
        while self._free_buffers and self._queue:
            job = self._queue[0]
            if job.finished or job.next_segment >= len(job.segments):
                # Every read sent: the last answer finishes it.
                self._queue.popleft()
                continue
            if not idle:
                if self._in_flight:
                    return  # sent when a reader answers
                logger.warning(
                    "vineyard cache read failed, recomputing: no reader can "
                    "take it (restarting or disabled)"
                )
                self._finish(job)
                continue
            self._send(job, idle)
        self._send_reads_ahead(idle)

    def _send_reads_ahead(self, idle: list[BackendProcess]) -> None:
        """Reads ahead, oldest request first, while no load waits to read."""
        if self._queue:
            return
        reads, buffers = self._ahead.sendable(self._in_flight, len(self._readers))
        for job in list(self._ahead.jobs.values()):
            left = len(job.segments) - job.next_segment
            while reads and idle and left and min(buffers, len(self._free_buffers)):
                count = self._ahead.read_size(min(buffers, left))
                first, count = free_run(self._free_buffers, count)
                if self._send(job, idle, first, count):
                    reads, buffers, left = reads - 1, buffers - count, left - count

    def _send(
        self, job: LoadJob, idle: list[BackendProcess], first: int = -1, count: int = 1
    ) -> bool:
        """Send the job's next read (``count`` segments) to the first idle
        reader (taken off ``idle``), into the first free buffer (or ``count``
        from buffer ``first``)."""
        k, reader = job.next_segment, idle.pop(0)
        s, e = job.segments[k][0], job.segments[k + count - 1][1]
        first = self._free_buffers[0] if first < 0 else first
        for b in range(first, first + count):
            event = self._events[b]
            if event is not None:
                event.synchronize()  # the buffer's last copy is done
        try:
            # The load's first read marks the prefix used too.
            request = QueryRequest(
                first, job.ids[:s], job.ids[s:e], job.digests[s:e], k == 0, count
            )
            run = self._calls.send(reader, request)
        except BackendError as e:
            logger.warning("vineyard cache reader failed: %s", e)
            return False  # to another reader, if one is idle
        read = SegmentRead(job, k, first, reader, run, time.monotonic(), count)
        for b in read.buffers:
            self._free_buffers.remove(b)
        job.next_segment = k + count
        if job.first_sent_at is None:
            job.first_sent_at = time.perf_counter()
        self._in_flight.append(read)
        return True

    def _release(self, read: SegmentRead) -> None:
        """The buffers of a read that failed: free, unless its process may
        still write into them (see :class:`HeldBuffers`)."""
        for b in read.buffers:
            if not self._held.hold(b, read.run):
                self._free_buffers.append(b)

    def _finish(self, job: LoadJob) -> None:
        """Report ``job`` finished (once), with what it loaded."""
        if job.finished:
            return  # already reported
        job.finished = True
        self._free_answers(job)
        if self._jobs.get(job.req_id) is job:
            del self._jobs[job.req_id]
        with contextlib.suppress(ValueError):
            self._queue.remove(job)
        bs = self._layout.block_size
        loaded, end = job.loaded * bs, job.last * bs
        start = job.start * bs
        if job.cancelled:
            loaded = end
        elif not job.fenced:
            self._metrics.add("loaded_tokens", max(0, loaded - start))
            # The readers' own time; a load stopped before its first blocks
            # arrived: at least the time since its first read, for them.
            done = job.loaded - job.start
            first = job.segments[0][1] - job.segments[0][0] if job.segments else 0
            if done and job.read_s + job.verify_s > 0:
                self._load_times.append((done, job.read_s + job.verify_s))
            elif job.stopped_slow and first and job.first_sent_at is not None:
                seconds = time.perf_counter() - job.first_sent_at
                self._load_times.append((first, seconds))
            if loaded < end and not job.stopped_slow:
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

    def _free_answers(self, job: LoadJob) -> None:
        for answer in job.answers.values():
            self._free_buffers.append(answer.buffer)
        job.answers.clear()

    def _copy_in(
        self, buffer: int, first: int, end: int, block_ids: Sequence[int]
    ) -> None:
        """Copy entries ``[first, end)`` of a read buffer into KV blocks."""
        event = self._kv.scatter(
            self._buffers.memory.tensor[buffer, first:end], block_ids
        )
        if event is not None:
            self._events[buffer] = event  # the buffer's next read waits
