# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Loads read ahead for queued requests (see :meth:`~vllm.worker.vineyard.
transfer.loads.LoadPipeline.read_ahead`): which requests, within which
budget of read buffers, how far each got as last reported, and how one
becomes its request's load."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllm.worker.vineyard.config import READ_AHEAD_BUFFERS_MAX
from vllm.worker.vineyard.storage.digests import synthetic_ids
from vllm.worker.vineyard.transfer.load_jobs import LoadJob, SegmentRead, segments_of

#: How long one read ahead is expected to take, at most: a load that comes
#: meanwhile waits for the reader about that long.
READ_S = 0.1
#: Least memory the read-ahead buffers of a worker hold in all: a small
#: model's quarter-step buffers would otherwise hold a few hundred tokens,
#: less than one queued hit. Never more buffers than the setting allows
#: (:data:`~vllm.worker.vineyard.config.READ_AHEAD_BUFFERS_MAX`).
MIN_BYTES = 16 << 20


def read_ahead_buffers(setting: int, buffer_bytes: int) -> int:
    """Read buffers for read-ahead: the setting's count (``0``: none), or
    more where that holds less than :data:`MIN_BYTES`."""
    if setting == 0:
        return 0
    return max(setting, min(READ_AHEAD_BUFFERS_MAX, -(-MIN_BYTES // buffer_bytes)))


class ReadAheadJobs:
    """The read-aheads of one load pipeline, oldest first."""

    def __init__(self, budget: int, segment_blocks: int, block_size: int):
        self.budget = budget  # read buffers they may hold, answered or not
        self.jobs: dict[str, LoadJob] = {}
        self._segment_blocks = segment_blocks
        self._block_size = block_size
        self._reported: dict[str, tuple[int, int]] = {}
        self._segment_s: float | None = None  # a segment's read, lately

    def add(
        self, req_id: str, digests: Sequence[bytes], first: int, read_end: int
    ) -> None:
        """Read blocks ``[first, read_end)`` ahead for a queued request."""
        if not self.budget or req_id in self.jobs or read_end <= first:
            return
        self.jobs[req_id] = LoadJob(
            req_id=req_id,
            ids=synthetic_ids(digests[:read_end]),
            digests=list(digests[:read_end]),
            block_ids=[],
            start=first,
            last=read_end,
            segments=segments_of(first, read_end, self._segment_blocks),
            ahead=True,
        )

    def sendable(
        self, in_flight: Iterable[SegmentRead], num_readers: int
    ) -> tuple[int, int]:
        """How many reads ahead may go out now, into how many buffers: on
        one reader fewer than there are (at least one), within the budget."""
        ahead = [read for read in in_flight if read.job.ahead]
        held = sum(read.count for read in ahead)
        held += sum(len(job.answers) for job in self.jobs.values())
        reads = max(0, max(1, num_readers - 1) - len(ahead))
        return reads, max(0, self.budget - held)

    def timed(self, blocks: int, seconds: float) -> None:
        """A read ahead answered: what a segment costs now."""
        if blocks:
            self._segment_s = seconds / blocks * self._segment_blocks

    def read_size(self, most: int) -> int:
        """Segments one read ahead takes: as many as are expected to take at
        most :data:`READ_S` (one, until a read is timed): a load that comes
        meanwhile waits for the reader at most about that long."""
        if self._segment_s is None:
            return 1
        return max(1, min(most, int(READ_S / max(self._segment_s, 1e-6))))

    def take_news(self) -> dict[str, tuple[int, int]]:
        """``{req_id: (first token, end)}`` read ahead whole and in order,
        of the read-aheads that moved on since the last call, and ``(0,
        0)`` for those that ended (loaded or dropped)."""
        news, bs = {}, self._block_size
        for req_id, job in self.jobs.items():
            ready = (job.segments[0][0] * bs, job.ready_end() * bs)
            if ready[1] > ready[0] and self._reported.get(req_id) != ready:
                news[req_id] = self._reported[req_id] = ready
        for req_id in [r for r in self._reported if r not in self.jobs]:
            del self._reported[req_id]
            news[req_id] = (0, 0)
        return news

    def adopt(
        self, job: LoadJob, digests: Sequence[bytes], first: int, read_end: int
    ) -> list[int] | None:
        """Make a read-ahead the load of blocks ``[first, read_end)`` of its
        request (the same chunks from ``first`` on): the buffers of answers
        it no longer needs, to be freed; ``None`` if it cannot serve."""
        n = min(len(job.digests), read_end)
        begin, end = job.segments[0][0], job.segments[-1][1]
        if not (begin <= first < end and job.digests[n - 1] == digests[n - 1]):
            return None
        job.ahead = False
        k0 = next(k for k, (s, e) in enumerate(job.segments) if s <= first < e)
        keep = [segment for segment in job.segments if segment[0] < read_end]
        unused = [k for k in job.answers if k < k0 or k >= len(keep)]
        freed = [job.answers.pop(k).buffer for k in unused]
        if keep[-1][1] < read_end:
            keep += segments_of(keep[-1][1], read_end, self._segment_blocks)
        job.segments = keep
        job.next_copy = k0
        job.next_segment = min(max(job.next_segment, k0), len(keep))
        job.ids = synthetic_ids(digests[:read_end])
        job.digests = list(digests[:read_end])
        return freed


def free_run(free: Iterable[int], count: int) -> tuple[int, int]:
    """The longest run of buffers back to back among ``free`` (at least
    one), at most ``count``: its first buffer and its length."""
    buffers = sorted(free)
    best, start = (buffers[0], 1), 0
    for i in range(1, len(buffers) + 1):
        if i == len(buffers) or buffers[i] != buffers[i - 1] + 1:
            if i - start > best[1]:
                best = (buffers[start], i - start)
            start = i
    return best[0], min(best[1], count)
