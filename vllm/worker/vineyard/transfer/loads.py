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
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

from vllm.worker.vineyard.backend.client import BackendProcess
from vllm.worker.vineyard.backend.protocol import (
    BackendError,
    QueryReply,
    QueryRequest,
)
from vllm.worker.vineyard.backend.runs import BackendRun
from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.metrics import VineyardCacheMetrics
from vllm.worker.vineyard.storage.digests import synthetic_ids
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.transfer.backends import BackendCalls
from vllm.worker.vineyard.transfer.kv_copy import KVBlockCopier
from vllm.worker.vineyard.transfer.staging import ReadBuffers

logger = init_logger(__name__)

#: Longest a load waits for its first blocks, as a share of computing all
#: of its blocks, before it stops (the rest is computed).
FIRST_BLOCKS_WAIT = 0.1


@dataclass
class _Read:
    """A segment's read sent to a reader, not answered yet."""

    job: LoadJob
    segment: int
    buffer: int
    reader: BackendProcess
    run: BackendRun  # the reader's process that got it
    sent_at: float


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
    # What computing a token costs the engine now (from the scheduler): a
    # load slower than computing the rest is stopped; None: never stopped.
    compute_s_per_token: float | None = None
    cancelled: bool = False
    fenced: bool = False  # a reset came: nothing it read is used
    stopped_slow: bool = False  # slower than computing: the rest computed
    # When its first read went out (a load stopped before its first blocks
    # arrived prices the link by the time since).
    first_sent_at: float | None = None
    finished: bool = False  # reported: answers still in flight are dropped
    started_at: float = field(default_factory=time.perf_counter)
    read_s: float = 0.0  # the readers' time reading, verifying; ours copying
    verify_s: float = 0.0
    copy_s: float = 0.0


class LoadPipeline:
    """The loads of one cache (its ``loads``), moved on by the thread that
    calls it (the forward thread) and never waiting unless told to.

    Several readers read (and verify) segments at once, the next ones of
    a load included, each into a free read buffer; their answers are taken
    in the order the reads went out, so blocks are copied in order and a
    segment that comes back short ends its load there (the answers to the
    reads after it are dropped).

    A reader given up on (stuck, or dead) is killed without waiting, and
    the buffer it was given stays unused until its process is gone: killed
    in an uninterruptible filesystem call, it exits only when the call
    returns, and its read then still lands in that buffer. Loads go on
    with the other buffers; while every buffer is held so, a load stops
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
    ):
        assert buffers.memory.count > len(readers) > 0
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
        # Buffers of reads given up on, until their process is gone: the
        # buffer, the process, since when.
        self._held: list[tuple[int, BackendRun, float]] = []
        # Loads by request, in the order their reads go out; the reads in
        # flight, oldest first.
        self._jobs: dict[str, LoadJob] = {}
        self._queue: collections.deque[LoadJob] = collections.deque()
        self._in_flight: collections.deque[_Read] = collections.deque()
        self._finished: list[tuple[str, int, int]] = []
        # (blocks, seconds) of finished loads: what loading costs now.
        self._load_times: list[tuple[int, float]] = []
        self._segment_blocks = buffers.memory.max_blocks

    def start(
        self,
        req_id: str,
        digests: Sequence[bytes],
        start: int,
        end: int,
        block_ids: Sequence[int],
        compute_s_per_token: float | None = None,
    ) -> None:
        """Begin loading the cached KV of tokens ``[start, end)`` into the
        request's blocks (``digests`` and ``block_ids`` cover the request
        from token 0, ``digests`` up to the end of the chunk that holds
        ``end``); returns at once. :meth:`poll` moves it on and
        :meth:`take_finished` reports it. With ``compute_s_per_token``, a
        load that runs slower than computing the rest stops at a chunk
        boundary (the rest is computed).

        ``start`` and ``end`` are block-aligned. Vineyard reads whole chunks,
        from the chunk boundary at or before ``start`` to the one at or after
        ``end``, but only blocks in ``[start, end)`` are written: blocks
        before ``start`` (vLLM's own prefix-cache hit, maybe shared with
        running requests) and after ``end`` (not the request's to fill) are
        left alone. The reader verifies every entry before it is copied.

        The readers read segments of a read buffer each (whole chunks) while
        the engine runs; the only work on the caller's thread is the copy of
        verified blocks into place.
        """
        bs, bpc = self._layout.block_size, self._layout.blocks_per_chunk
        assert start % bs == 0 and end % bs == 0
        first, last = start // self._layout.chunk_size * bpc, end // bs
        read_end = min(-(-last // bpc), len(digests) // bpc) * bpc
        step = self._segment_blocks
        # A load that may be stopped for slowness reads its first chunk on
        # its own: its pace shows after one chunk, not one segment.
        lead = bpc if compute_s_per_token is not None and read_end > first else 0
        segments = [(first, min(first + lead, read_end))] if lead else []
        segments += [
            (b, min(b + step, read_end)) for b in range(first + lead, read_end, step)
        ]
        job = LoadJob(
            req_id=req_id,
            ids=synthetic_ids(digests[:read_end]),
            digests=list(digests[:read_end]),
            block_ids=list(block_ids),
            start=start // bs,
            last=last,
            segments=segments,
            compute_s_per_token=compute_s_per_token,
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

    def fence(self) -> None:
        """The cache was reset: every load still going finishes with
        nothing loaded (its blocks are recomputed), as what it reads
        predates the reset."""
        for job in list(self._jobs.values()):
            job.fenced = True
            job.loaded = job.start
            self._finish(job)

    def loading(self, req_id: str) -> bool:
        return req_id in self._jobs

    def take_load_times(self) -> list[tuple[int, float]]:
        """``(blocks, seconds)`` of the loads finished since the last call
        (the readers' time reading and verifying them; a load stopped for
        slowness with nothing loaded: its first segment and the time since
        its first read, as a lower bound)."""
        times, self._load_times = self._load_times, []
        return times

    def _stop_slow_loads(self) -> None:
        """Stop the loads that run slower than computing the rest, by the
        readers' own time (reading and verifying: a busy engine's long
        steps, which move loads on, and time queued for a reader do not
        count): once the blocks read so far took longer per block than
        computing a block takes, or a read not answered yet has taken
        longer than computing its blocks would (the first read: at least
        :data:`FIRST_BLOCKS_WAIT` of computing them all). A link slower
        than computing costs a request about one segment's computation (a
        load's first segment is one chunk)."""
        now, bs = time.monotonic(), self._layout.block_size
        unanswered: dict[int, _Read] = {}  # job -> its oldest read in flight
        for read in self._in_flight:
            unanswered.setdefault(id(read.job), read)
        for job in list(self._jobs.values()):
            c = job.compute_s_per_token
            left = job.last - job.loaded
            if c is None or job.finished or left <= 0:
                continue
            done = job.loaded - job.start
            slow = done > 0 and job.read_s + job.verify_s > c * bs * done
            waiting = unanswered.get(id(job))
            if waiting is not None and not slow:
                s, e = job.segments[waiting.segment]
                blocks = float(e - s)
                if waiting.segment == 0:
                    blocks = max(blocks, FIRST_BLOCKS_WAIT * (job.last - job.start))
                slow = now - waiting.sent_at > c * bs * blocks
            if slow:
                job.stopped_slow = True
                self._metrics.add("loads_stopped_slow")
                self._metrics.add("tokens_not_loaded_slow", left * bs)
                self._finish(job)

    def take_finished(self) -> list[tuple[str, int, int]]:
        """``(req_id, loaded_end, promised_end)`` of loads finished since
        the last call, in tokens; a load that was cancelled reports its
        promised end (nothing of it is used)."""
        done, self._finished = self._finished, []
        return done

    def poll(self, wait: bool = False) -> None:
        """Move loads on: collect the readers' answers that have arrived,
        copy their verified blocks into place and send the next reads.
        Never waits unless ``wait`` (then until every load is done). Loads
        are judged slow after the answers that arrived are in (a step that
        ran long must not make a load that was done look slow)."""
        self._collect(wait)
        self._stop_slow_loads()

    def _collect(self, wait: bool) -> None:
        while True:
            self._send_reads()
            if not self._in_flight:
                return
            read = self._in_flight[0]
            reader, job = read.reader, read.job
            ready = wait or reader.ready()
            # Stuck: no progress for the timeout; a reader starved of CPU or
            # waiting for a busy disk is slow, and waited for, but a
            # request waits for a read at most twice the timeout.
            stuck = not ready and (
                reader.stalled(self._timeout_s) is not None
                or time.monotonic() - read.sent_at >= 2 * self._timeout_s
            )
            if not (ready or stuck):
                return
            self._in_flight.popleft()
            try:
                # A stuck reader is given up on at once (and restarted).
                timeout_s = None if ready else 0.0
                reply = self._calls.receive(reader, QueryReply, timeout_s)
            except BackendError as e:
                logger.warning("vineyard cache read failed, recomputing: %s", e)
                self._release(read)
                self._finish(job)
                continue
            if job.finished:  # an earlier segment ended it
                self._free_buffers.append(read.buffer)
                continue
            verified = reply.verified
            job.read_s += reply.read_s
            job.verify_s += reply.verify_s
            s, seg_end = job.segments[read.segment]
            last = s + verified < seg_end or read.segment + 1 == len(job.segments)
            if last:
                job.next_segment = len(job.segments)  # no more reads
            # The readers' next reads overlap this copy.
            self._send_reads()
            skip, use = max(0, job.loaded - s), min(verified, job.last - s)
            if use > skip:
                copy_started = time.perf_counter()
                self._copy_in(read.buffer, skip, use, job.block_ids[s + skip : s + use])
                job.copy_s += time.perf_counter() - copy_started
                job.loaded = s + use
            self._free_buffers.append(read.buffer)
            if last:
                self._finish(job)

    def _send_reads(self) -> None:
        """Send the next segments' reads, of the first unfinished loads, to
        the idle readers (the first reader first), each into a free read
        buffer. A read a reader cannot take (it died, or is restarting) goes
        to another; with none left and none answering, the load stops
        there (the rest is recomputed)."""
        self._take_back_held()
        busy = {id(read.reader) for read in self._in_flight}
        idle = [r for r in self._readers if id(r) not in busy and r.available]
        if self._queue and len(self._held) == self._buffers.memory.count:
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
            k = job.next_segment
            if job.finished or k >= len(job.segments):
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
            s, e = job.segments[k]
            reader, buffer = idle.pop(0), self._free_buffers[0]
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
                run = self._calls.send(reader, request)
            except BackendError as e:
                logger.warning("vineyard cache reader failed: %s", e)
                continue  # to another reader, if one is idle
            self._free_buffers.popleft()
            job.next_segment = k + 1
            if job.first_sent_at is None:
                job.first_sent_at = time.perf_counter()
            read = _Read(job, k, buffer, reader, run, time.monotonic())
            self._in_flight.append(read)

    def _release(self, read: _Read) -> None:
        """The buffer of a read that failed: free, unless its process was
        stopped before it answered and has not exited yet (it may still
        write into the buffer)."""
        if read.run.may_still_write():
            self._held.append((read.buffer, read.run, time.monotonic()))
        else:
            self._free_buffers.append(read.buffer)

    def _take_back_held(self) -> None:
        """Free the held buffers whose process is gone (never waits)."""
        if not self._held:
            return
        held, self._held, now = self._held, [], time.monotonic()
        for buffer, run, since in held:
            if run.gone():
                self._free_buffers.append(buffer)
                continue
            self._held.append((buffer, run, since))
            if now - since >= self._timeout_s:
                self._log.warning(
                    "held",
                    "vineyard cache reader pid %d was killed %.0f s ago and "
                    "has not exited (stuck in the filesystem?); its read "
                    "buffer is not used until it has",
                    run.pid,
                    now - since,
                )

    def _finish(self, job: LoadJob) -> None:
        """Report ``job`` finished (once), with what it loaded."""
        if job.finished:
            return  # already reported
        job.finished = True
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

    def _copy_in(
        self, buffer: int, first: int, end: int, block_ids: Sequence[int]
    ) -> None:
        """Copy entries ``[first, end)`` of a read buffer into KV blocks."""
        event = self._kv.scatter(
            self._buffers.memory.tensor[buffer, first:end], block_ids
        )
        if event is not None:
            self._events[buffer] = event  # the buffer's next read waits
