# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which chunks go, for the sweeper and the command-line tool's ``evict``:
expiry by last use, least recently used first down to a target, and the
high- and low-water marks of a budget.

A chunk's mtime is its last use (vineyard sets it when the chunk is written
and a verified hit sets it again). Every ``now`` here is a pass's start by
the clock it judges ages by: the clock that stamps the root's mtimes (see
:mod:`~vllm.worker.vineyard.storage.sweep_passes`). A last use further in the
future than clocks differ (:data:`CLOCK_SKEW_S`) counts as the oldest, so
a planted mtime cannot keep a chunk from eviction or expiry. On the past
side (a writer whose clock stamped it, and is behind),
:class:`ObservedLastUse` holds a chunk that appeared or changed since this
host's previous pass as used no earlier than that pass began: it is not
expired or evicted first for its writer's clock.

Imports neither vLLM nor torch (the sweeper runs in the backend process).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from vllm.worker.vineyard.storage.scan import ChunkFile

HIGH_WATER = 0.95  # evict when usage passes this share of the budget ...
LOW_WATER = 0.85  # ... down to this share
#: Most that hosts' clocks are taken to differ: a last use further in the
#: future than this is not believed.
CLOCK_SKEW_S = 300.0


def distrust_future(chunks: list[ChunkFile], now: float) -> None:
    """A chunk last used further in the future than :data:`CLOCK_SKEW_S`
    (a clock far ahead, or a planted mtime) would never age: it counts as
    the oldest instead, first to be evicted or expired."""
    for chunk in chunks:
        if chunk.mtime > now + CLOCK_SKEW_S:
            chunk.mtime = 0.0


class ObservedLastUse:
    """Last uses corrected by what this host saw between its passes. A chunk
    new or touched since this host's previous pass (absent then, or its
    mtime moved forward) was used after that pass began, whatever its
    writer's clock says: an older mtime (a clock behind, by any amount)
    counts as that pass's start. An mtime moved back (set on purpose) is
    taken as it is. Remembers one mtime per chunk between passes (tens of
    bytes each)."""

    def __init__(self) -> None:
        self._since: float | None = None  # the previous pass's start
        self._seen: dict[int, float] = {}  # inode: mtime at the previous pass
        self._raised: dict[int, tuple[float, float]] = {}  # inode: (mtime, use)

    def correct(self, chunks: list[ChunkFile], now: float) -> None:
        """Raise, in place, the mtimes of ``chunks`` found by a pass that
        began at ``now`` to their observed last use."""
        seen: dict[int, float] = {}
        raised: dict[int, tuple[float, float]] = {}
        for chunk in chunks:
            mtime = seen[chunk.ino] = chunk.mtime
            was = self._raised.get(chunk.ino)
            if was is not None and was[0] == mtime:
                raised[chunk.ino] = was
            elif (
                self._since is not None
                and mtime < self._since
                and mtime > self._seen.get(chunk.ino, -math.inf)
            ):
                raised[chunk.ino] = (mtime, self._since)
            else:
                continue
            chunk.mtime = raised[chunk.ino][1]
        self._seen, self._raised, self._since = seen, raised, now


def expire(
    chunks: list[ChunkFile],
    now: float,
    ttl_s: float,
    remove: Callable[[ChunkFile], bool],
) -> tuple[list[ChunkFile], int]:
    """Remove the chunks unused for longer than ``ttl_s`` (none when it is
    0). Returns the chunks left and how many of the others ``remove``
    removed (others were gone already)."""
    if ttl_s <= 0:
        return chunks, 0
    live = []
    expired = 0
    for chunk in chunks:
        if now - chunk.mtime > ttl_s:
            expired += remove(chunk)
        else:
            live.append(chunk)
    return live, expired


def eviction_target(
    chunks: list[ChunkFile], total: int, budget: float, need: int
) -> float | None:
    """How far to evict ``chunks`` (``total`` bytes on disk) under
    ``budget`` with ``need`` bytes about to be written: ``None`` while they
    stay under the high-water mark, else the low-water mark."""
    # A write needs room for a whole chunk: when the margins are smaller
    # than one (a small filesystem, big chunks), a full disk would stay
    # just too full to take the next chunk and never reach the mark.
    largest = max((chunk.disk_bytes for chunk in chunks), default=0)
    high = min(HIGH_WATER * budget, budget - largest)
    if total + need <= high:
        return None
    # A writer asked for this pass: room for the write it skipped too.
    return min(LOW_WATER * budget, budget - 2 * largest, high - need)


def evict_lru(
    chunks: list[ChunkFile],
    total: int,
    target: float,
    remove: Callable[[ChunkFile], bool],
) -> tuple[int, int, int]:
    """Evict the least recently used of ``chunks`` (sorted in place) until
    ``total``, their bytes on disk, is at most ``target``. Returns how many
    went (the first ones of ``chunks`` now), how many of those ``remove``
    removed (others were gone already) and the total left."""
    # Least recently used first; among chunks last used in the same second
    # (one write or one hit), the later chunks of a prefix first (their
    # files are longer), so what stays is still a usable prefix.
    chunks.sort(key=lambda c: (int(c.mtime), -c.size))
    done = removed = 0
    for chunk in chunks:
        if total <= target:
            break
        # Gone either way (another sweeper may have been first).
        removed += remove(chunk)
        total -= chunk.disk_bytes
        done += 1
    return done, removed, total
