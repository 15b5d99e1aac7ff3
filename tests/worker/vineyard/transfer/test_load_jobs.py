# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""When a load stops as slow (:meth:`LoadJob.runs_slow`): a read waits as
long as computing its blocks would, or, where the link's recent price is
known, until it has waited several times that price (a stall), but either
way at least a quarter of computing the blocks the load has left; the
blocks read so far stop it once they took longer than computing them, and
at least a tenth of computing the hit (and, where the link's price is
known, with a few blocks more at that price); the last read is waited for
as long as computing its blocks, stalled or not; a read's wait does not
count its reader's wait for a CPU."""

from __future__ import annotations

from typing import Any, cast

import pytest

from vllm.worker.vineyard.transfer.load_jobs import (
    FIRST_BLOCKS_WAIT,
    STALL_FACTOR,
    WAIT_SHARE,
    LoadJob,
    SegmentRead,
    segments_of,
)

BS = 16  # tokens per block
BLOCKS = 100  # the hit
COMPUTE_S = 1e-3  # per token: 16 ms a block, 1.6 s the hit
FLOOR_S = FIRST_BLOCKS_WAIT * BLOCKS * BS * COMPUTE_S  # 0.16 s


def patience_s(loaded: int) -> float:
    """The least a waiting read waits (0.4 s for the whole hit)."""
    return WAIT_SHARE * (BLOCKS - loaded) * BS * COMPUTE_S


SEGMENT = 20  # blocks per read after the first chunk


def job(loaded: int, load_s_per_block: float | None) -> LoadJob:
    return LoadJob(
        req_id="r",
        ids=list(range(BLOCKS)),
        digests=[],
        block_ids=list(range(BLOCKS)),
        start=0,
        last=BLOCKS,
        segments=segments_of(0, BLOCKS, SEGMENT, lead=1),
        loaded=loaded,
        compute_s_per_token=COMPUTE_S,
        load_s_per_block=load_s_per_block,
    )


class Reader:
    """A reader's handle as a load sees it: how long its process waited for
    a CPU during the read (asked only of a read that waited too long)."""

    def __init__(self, cpu_wait_s: float) -> None:
        self._cpu_wait_s = cpu_wait_s
        self.asked = 0

    def cpu_wait_s(self) -> float:
        self.asked += 1
        return self._cpu_wait_s


def waiting(
    load: LoadJob, segment: int, waited_s: float, reader: Reader | None = None
) -> SegmentRead:
    reader = Reader(0.0) if reader is None else reader
    return SegmentRead(
        load, segment, 0, cast(Any, reader), cast(Any, None), 100.0 - waited_s
    )


@pytest.mark.parametrize(
    ("loaded", "segment", "link_s", "waited_s", "slow"),
    [
        # The first read (one chunk): a quarter of computing the hit.
        (0, 0, None, 0.95 * patience_s(0), False),
        (0, 0, None, 1.05 * patience_s(0), True),
        (0, 0, 1e-4, 0.95 * patience_s(0), False),  # a stall waits that long too
        # A read of 20 blocks: as long as computing them (0.32 s), or a
        # quarter of computing the 99 blocks left (0.396 s), the longer.
        (1, 1, None, 0.95 * patience_s(1), False),
        (1, 1, None, 1.05 * patience_s(1), True),
        (61, 4, None, 0.3, False),  # 39 left: 0.156 s
        (61, 4, None, 0.34, True),
        # ... or, stalled, STALL_FACTOR times the link's price (80 ms), but
        # at least that quarter.
        (61, 4, 1e-3, STALL_FACTOR * 1e-3 * SEGMENT * 1.5, False),
        (61, 4, 1e-3, 0.95 * patience_s(61), False),
        (61, 4, 1e-3, 1.05 * patience_s(61), True),
        # A link priced slower than computing: computing's wait decides.
        (61, 4, 20e-3, 0.3, False),
        (61, 4, 20e-3, 0.34, True),
    ],
)
def test_a_waiting_read(
    loaded: int, segment: int, link_s: float | None, waited_s: float, slow: bool
) -> None:
    load = job(loaded, link_s)
    assert load.runs_slow(waiting(load, segment, waited_s), 100.0, BS) is slow


@pytest.mark.parametrize(
    ("waited_s", "cpu_wait_s", "slow"),
    [
        (2.0, 1.9, False),  # 0.1 s with a CPU: within its patience
        (2.0, 1.5, True),  # 0.5 s with a CPU: too long
        (2.0, 5.0, False),  # its threads' waits add up: at most all of it
    ],
)
def test_a_readers_wait_for_a_cpu_is_not_the_links(
    waited_s: float, cpu_wait_s: float, slow: bool
) -> None:
    """A read waits by the time its reader had a CPU (two engines' busy
    cores starve a reader for seconds while its read takes milliseconds);
    the kernel is asked only once the read waited too long."""
    load, reader = job(0, None), Reader(cpu_wait_s)
    assert load.runs_slow(waiting(load, 0, waited_s, reader), 100.0, BS) is slow
    assert reader.asked == 1
    quick = Reader(cpu_wait_s)
    assert not load.runs_slow(waiting(load, 0, 0.01, quick), 100.0, BS)
    assert quick.asked == 0


def test_the_pace_of_the_blocks_read() -> None:
    """Blocks read slower than computing them stop the load, once its
    reads took a tenth of computing the hit."""
    load = job(21, None)
    load.read_s = 21 * BS * COMPUTE_S * 0.9
    assert not load.runs_slow(None, 100.0, BS)
    load.read_s = 21 * BS * COMPUTE_S * 1.1
    assert load.runs_slow(None, 100.0, BS)
    early = job(1, None)  # one chunk read: its pace waits for the tenth
    early.read_s = 0.9 * FLOOR_S
    assert not early.runs_slow(None, 100.0, BS)


@pytest.mark.parametrize(
    ("blocks_read", "slow"),
    [
        (1, False),  # one slow answer: the link's price says it is fast
        (2, True),  # a link that slowed shows within a few blocks
    ],
)
def test_the_pace_counts_the_links_price(blocks_read: int, slow: bool) -> None:
    """Blocks read at twice computing's time, on a link priced at a tenth
    of it (a hit of 10 blocks: judged from its first block on)."""
    block_s = BS * COMPUTE_S
    load = job(BLOCKS - 10 + blocks_read, 0.1 * block_s)
    load.start = BLOCKS - 10
    load.read_s = 2 * block_s * blocks_read
    assert load.runs_slow(None, 100.0, BS) is slow
    # Without a price, the reads are judged by themselves: slow at once.
    load.load_s_per_block = None
    assert load.runs_slow(None, 100.0, BS)


@pytest.mark.parametrize("reads_follow", [True, False])
def test_a_stalled_last_read_waits_as_long_as_computing_its_blocks(
    reads_follow: bool,
) -> None:
    """A read of 20 blocks that waited 20 times the link's price: stopped
    if more reads follow it (a filesystem that hangs holds them too), not if
    it is the last (stopping would compute its blocks: it is waited for up
    to that long, 0.32 s)."""
    link_s = 1e-3
    load = job(61, link_s)
    if not reads_follow:
        load.last = 81  # segment 4 (blocks 61-81) is the last
    waited_s = 0.9 * SEGMENT * BS * COMPUTE_S
    assert waited_s > STALL_FACTOR * link_s * SEGMENT
    assert waited_s > WAIT_SHARE * (load.last - load.loaded) * BS * COMPUTE_S
    assert load.runs_slow(waiting(load, 4, waited_s), 100.0, BS) is reads_follow
    assert load.runs_slow(waiting(load, 4, 1.1 * SEGMENT * BS * COMPUTE_S), 100.0, BS)


@pytest.mark.parametrize(
    ("reading", "cpu_wait_s", "slow"),
    [
        (False, 0.0, True),  # past its stop, nothing in flight
        (True, 0.0, True),  # past its stop, its read had a CPU
        (True, 0.05, True),  # 0.15 s with a CPU: 0.05 s past its stop
        (True, 0.15, False),  # 0.05 s with a CPU: not yet at its stop
    ],
)
def test_a_load_before_the_forward_pass_stops_at_its_time(
    reading: bool, cpu_wait_s: float, slow: bool
) -> None:
    """A synchronous load's stop (0.1 s after its read was sent) moves by
    its reader's wait for a CPU; the read itself is well within patience."""
    load = job(1, None)
    load.stop_at = 99.9
    read = waiting(load, 1, 0.2, Reader(cpu_wait_s)) if reading else None
    assert load.runs_slow(read, 100.0, BS) is slow


def test_without_a_compute_price_never_slow() -> None:
    load = job(1, 1e-3)
    load.compute_s_per_token = None
    assert not load.runs_slow(waiting(load, 1, 1e3), 100.0, BS)
