# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the load pipeline keeps of a load: its segments (the reads, whole
chunks each), the answers not copied yet, and how far it got. A load read
ahead for a queued request is the same job before it has blocks to fill."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm.logger import init_logger

from vllm.worker.vineyard.backend.client import BackendProcess
from vllm.worker.vineyard.backend.runs import BackendRun
from vllm.worker.vineyard.log_limiter import LogLimiter

logger = init_logger(__name__)

#: A load's pace is judged once its reads took this share of computing all
#: of its blocks (one chunk's read is mostly a file's latency, which a busy
#: filesystem varies by tens of milliseconds).
FIRST_BLOCKS_WAIT = 0.1
#: A read waiting this many times what the link's recent loads took for as
#: many blocks has stalled (if that is shorter than computing its blocks).
STALL_FACTOR = 4.0
#: A read not answered yet stops its load only once it waited this share of
#: computing every block the load has left: on a busy machine a reader
#: waits for a core, and a filesystem has slow moments, for a tenth of a
#: second or more, while computing the rest costs that many blocks.
WAIT_SHARE = 0.25
#: A load's pace counts the link's recent price as this many blocks read
#: too: one slow answer (a reader's or a filesystem's busy moment) must not
#: stop a load that the link's history says is fast; a link that slowed
#: shows within a few blocks.
PRICED_BLOCKS = 2


@dataclass
class Answer:
    """A segment read and verified into a buffer, not copied yet."""

    buffer: int
    verified: int  # blocks from the segment's start
    read_s: float
    verify_s: float


@dataclass
class SegmentRead:
    """A read sent to a reader, not answered yet: ``count`` segments from
    ``segment`` into as many buffers from ``buffer`` (back to back)."""

    job: LoadJob
    segment: int
    buffer: int
    reader: BackendProcess
    run: BackendRun  # the reader's process that got it
    sent_at: float
    count: int = 1

    @property
    def buffers(self) -> range:
        return range(self.buffer, self.buffer + self.count)

    def cpu_wait_s(self, now: float) -> float:
        """Of its wait so far, how long its reader waited for a CPU."""
        return min(self.reader.cpu_wait_s(), now - self.sent_at)


def segments_of(
    first: int, end: int, step: int, lead: int = 0
) -> list[tuple[int, int]]:
    """Block ranges of the reads of blocks ``[first, end)``: ``step``
    blocks each, the first ``lead`` blocks on their own."""
    segments = [(first, min(first + lead, end))] if lead and end > first else []
    start = min(first + lead, end) if lead else first
    return segments + [(b, min(b + step, end)) for b in range(start, end, step)]


@dataclass
class LoadJob:
    """One request's load: which blocks to read (in segments of whole
    chunks) and to fill, and how far it got. While ``ahead`` it is read
    ahead for a request still queued: answers are kept, nothing copied."""

    req_id: str
    ids: list[int]  # vineyard ids of every block read
    digests: list[bytes]
    block_ids: list[int]  # the request's KV blocks from token 0
    start: int  # first block to fill
    last: int  # end of the blocks to fill
    segments: list[tuple[int, int]]  # block ranges read per query
    ahead: bool = False
    next_segment: int = 0  # the next to read
    next_copy: int = 0  # the next to copy (answers are copied in order)
    answers: dict[int, Answer] = field(default_factory=dict)
    loaded: int = 0  # end of the blocks filled so far
    # What computing a token costs the engine now (from the scheduler): a
    # load slower than computing the rest is stopped; None: never stopped.
    compute_s_per_token: float | None = None
    load_s_per_block: float | None = None  # the link's recent price
    # A load before its step's forward pass: stopped then (monotonic; its
    # waiting reader's wait for a CPU moves it later).
    stop_at: float | None = None
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

    def runs_slow(self, waiting: SegmentRead | None, now: float, bs: int) -> bool:
        """Whether it runs slower than computing the rest (or is past its
        ``stop_at``, not counting the waiting read's reader's wait for a
        CPU: computing the rest would wait for one too): the blocks read
        so far (with :data:`PRICED_BLOCKS` more at the link's recent price,
        where known) took longer per block than computing a block, or
        ``waiting`` (its next answer's read, sent at monotonic time) has
        waited longer than computing its blocks would, or stalled with more
        reads to follow: waited :data:`STALL_FACTOR` times what the link's
        recent loads took for as many; a waiting read, either way, at least
        :data:`WAIT_SHARE` of computing the blocks left, not counting its
        reader's wait for a CPU (asked only then; the reader moves to every
        core)."""
        stop_at = self.stop_at
        if (
            stop_at is not None
            and now >= stop_at
            and (waiting is None or now - waiting.cpu_wait_s(now) >= stop_at)
        ):
            return True
        c = self.compute_s_per_token
        done = self.loaded - self.start
        if c is None:
            return False
        least = FIRST_BLOCKS_WAIT * (self.last - self.start)
        read_s, blocks = self.read_s + self.verify_s, max(done, least)
        if self.load_s_per_block is not None:
            read_s += PRICED_BLOCKS * self.load_s_per_block
            blocks += PRICED_BLOCKS
        if done > 0 and read_s > c * bs * blocks:
            return True
        if waiting is None:
            return False
        waited = now - waiting.sent_at
        if not self._waits_too_long(waiting, waited, c * bs):
            return False
        waited -= waiting.cpu_wait_s(now)
        return self._waits_too_long(waiting, waited, c * bs)

    def _waits_too_long(
        self, waiting: SegmentRead, waited: float, block_s: float
    ) -> bool:
        """See :meth:`runs_slow` (``block_s``: computing a block)."""
        n = len(self.segments)
        s = self.segments[waiting.segment][0]
        e = self.segments[min(waiting.segment + waiting.count, n) - 1][1]
        if waited <= WAIT_SHARE * block_s * (self.last - self.loaded):
            return False
        if waited > block_s * (e - s):
            return True
        if self.load_s_per_block is None or e >= self.last:
            # The last read is waited for as long as computing its blocks
            # (what stopping costs): a stall that would hold later reads
            # too is what stops a load sooner.
            return False
        return waited > STALL_FACTOR * self.load_s_per_block * (e - s)

    def take_answer(
        self, read: SegmentRead, verified: int, read_s: float, verify_s: float
    ) -> list[int]:
        """Keep the answer to ``read`` (``verified`` blocks from its first
        segment's start) as one per segment and buffer; returns the buffers
        not needed (the job ended, or they hold what it copied already)."""
        n = len(self.segments)
        if self.finished or read.segment >= n:
            return list(read.buffers)
        first = self.segments[read.segment][0]
        last = self.segments[min(read.segment + read.count, n) - 1][1]
        unused = []
        for i, buffer in enumerate(read.buffers):
            k = read.segment + i
            if not self.next_copy <= k < n:
                unused.append(buffer)
                continue
            s, e = self.segments[k]
            got = max(0, min(e - s, first + verified - s))
            share = (e - s) / max(1, last - first)
            self.answers[k] = Answer(buffer, got, read_s * share, verify_s * share)
            if got < e - s:
                self.next_segment = n  # no reads past it
        return unused

    def ready_end(self) -> int:
        """The end of the blocks answered whole, in order from the first
        segment not copied."""
        if self.next_copy >= len(self.segments):
            return self.segments[-1][1] if self.segments else self.start
        end, k = None, self.next_copy
        while k in self.answers:
            s, e = self.segments[k]
            end = s + self.answers[k].verified
            if end < e:
                break
            k += 1
        return self.segments[self.next_copy][0] if end is None else end


def slow_loads(
    jobs: Iterable[LoadJob], in_flight: Iterable[SegmentRead], bs: int
) -> list[LoadJob]:
    """The loads that run slower than computing the rest
    (:meth:`LoadJob.runs_slow`), by the readers' own time (a busy engine's
    long steps, time queued for a reader or a CPU do not count): a slow link
    costs a request at most about a tenth of computing its hit more than
    computing it, a read that stalls a quarter (a last read: its blocks'
    computing)."""
    now = time.monotonic()
    unanswered: dict[int, SegmentRead] = {}  # job -> its next answer's read
    for read in in_flight:
        if read.job.next_copy <= read.segment < len(read.job.segments):
            unanswered.setdefault(id(read.job), read)
    return [
        job
        for job in jobs
        if not job.finished
        and job.last > job.loaded
        and job.runs_slow(unanswered.get(id(job)), now, bs)
    ]


class HeldBuffers:
    """Read buffers of reads given up on, until their process is gone: a
    reader killed in an uninterruptible filesystem call exits only when the
    call returns, and its read then still lands in the buffer."""

    def __init__(self, timeout_s: float):
        self._timeout_s = timeout_s  # a wait that long is logged
        self._held: list[tuple[int, BackendRun, float]] = []
        self._log = LogLimiter(logger)

    @property
    def count(self) -> int:
        return len(self._held)

    def hold(self, buffer: int, run: BackendRun) -> bool:
        """Hold ``buffer`` if ``run`` may still write into it."""
        if not run.may_still_write():
            return False
        self._held.append((buffer, run, time.monotonic()))
        return True

    def take_back(self) -> list[int]:
        """The held buffers whose process is gone (never waits)."""
        if not self._held:
            return []
        held, self._held, now, freed = self._held, [], time.monotonic(), []
        for buffer, run, since in held:
            if run.gone():
                freed.append(buffer)
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
        return freed
