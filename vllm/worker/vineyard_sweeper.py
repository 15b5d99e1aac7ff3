# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Keeps a cache root healthy for months: a background sweep that bounds
its size, expires chunks by last use and removes what dead writers left.

Each writer backend runs one sweeper over the whole root (every namespace,
every instance's chunks). A chunk's mtime is its last use: vineyard sets it
when the chunk is written and a verified hit sets it again. Each sweep:

- expires chunks unused for longer than the TTL (if one is set);
- evicts the least recently used chunks when the root is over its budget
  (high-water mark) down to a low-water mark. The budget is the disk limit,
  or less when the filesystem runs low: a full disk makes room for itself.
  The marks leave room for at least one (high) and two (low) of the
  largest chunks, however small the filesystem;
- removes temporary files older than :data:`TEMP_MAX_AGE_S` (a write takes
  seconds; older ones belong to a writer that died) and empty directories
  (vineyard leaves one per write under ``__temp``).

Several instances sweeping one root at once only race to delete the same
files, which is harmless. Evicting chunk ``k`` of a prefix makes its later
chunks unreachable (lookups stop at the first missing chunk) until they are
evicted in turn; nothing unverified is ever loaded either way.

Imports neither vLLM nor torch (it runs in the backend process).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time

logger = logging.getLogger(__name__)

HIGH_WATER = 0.95  # evict when usage passes this share of the budget ...
LOW_WATER = 0.85  # ... down to this share
TEMP_MAX_AGE_S = 600.0
EMPTY_DIR_MIN_AGE_S = 60.0  # a writer may be about to fill a new folder
TEMP_DIR = "__temp"


class RootSweeper:
    """Background upkeep of a cache root (see the module docstring)."""

    def __init__(
        self, root: str, limit_bytes: int, ttl_s: float, interval_s: float
    ) -> None:
        self.root = root
        self.limit_bytes = limit_bytes
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("evicted_chunks", "expired_chunks", "orphans_removed"), 0
        )
        self.root_bytes = 0
        self.root_chunks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="vineyard-cache-sweeper", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        # Instances started together should not sweep in lockstep.
        delay = random.uniform(0.1, 1.0) * min(self.interval_s, 5.0)
        while not self._stop.wait(delay):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - upkeep must never kill serving
                logger.exception("vineyard cache sweep failed")
            delay = self.interval_s

    def take_stats(self) -> dict[str, int]:
        """Counts since the last call, and the root's current size."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
            return {
                **counts,
                "root_bytes": self.root_bytes,
                "root_chunks": self.root_chunks,
            }

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    @staticmethod
    def _unlink(path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False  # another sweeper or a reader's repair was first
        except OSError:
            # Read-only or failing filesystem, or not ours: the sweep goes
            # on with the rest (and counts only what it removed).
            return False

    def sweep(self, now: float | None = None) -> None:
        """One pass over the root: ``stat`` every entry once, then delete."""
        now = time.time() if now is None else now
        # (last use, bytes on disk, path, file size)
        chunks: list[tuple[float, int, str, int]] = []
        self._walk(self.root, now, chunks, in_temp=False)
        if self.ttl_s > 0:
            live = []
            for chunk in chunks:
                if now - chunk[0] > self.ttl_s:
                    if self._unlink(chunk[2]):
                        self._count("expired_chunks")
                else:
                    live.append(chunk)
            chunks = live
        total = sum(chunk[1] for chunk in chunks)
        budget = self.budget(total)
        # A write needs room for a whole chunk: when the margins are smaller
        # than one (a small filesystem, big chunks), a full disk would stay
        # just too full to take the next chunk and never reach the mark.
        largest = max((chunk[1] for chunk in chunks), default=0)
        high = min(HIGH_WATER * budget, budget - largest)
        if total > high:
            # Least recently used first; among chunks last used in the same
            # second (one write or one hit), the later chunks of a prefix
            # first (their files are longer), so what stays is still a
            # usable prefix.
            chunks.sort(key=lambda c: (int(c[0]), -c[3]))
            target = min(LOW_WATER * budget, budget - 2 * largest)
            evicted = done = 0
            for _, size, path, _ in chunks:
                if total <= target:
                    break
                # Gone either way (another sweeper may have been first).
                evicted += self._unlink(path)
                total -= size
                done += 1
            self._count("evicted_chunks", evicted)
            chunks = chunks[done:]
        with self._lock:
            self.root_bytes, self.root_chunks = total, len(chunks)

    def budget(self, cache_bytes: int) -> float:
        """The disk limit, or what the filesystem can hold now if that is
        less (the cache's own bytes count as available to it)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return float(self.limit_bytes)
        return float(min(self.limit_bytes, cache_bytes + st.f_bavail * st.f_frsize))

    def _walk(
        self,
        path: str,
        now: float,
        chunks: list[tuple[float, int, str, int]],
        in_temp: bool,
    ) -> bool:
        """Collect chunk files below ``path`` and clean temp files and empty
        directories; returns whether ``path`` is empty now."""
        try:
            entries = list(os.scandir(path))
        except OSError:
            return False  # removed meanwhile, or unreadable: leave it
        remaining = len(entries)
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    temp = in_temp or entry.name == TEMP_DIR
                    # Its age before this pass: removing the empty folders
                    # below it makes it look new, but a whole empty tree
                    # (vineyard leaves one per write) goes in one pass.
                    st = entry.stat(follow_symlinks=False)
                    empty = self._walk(entry.path, now, chunks, temp)
                    if empty and now - st.st_mtime > EMPTY_DIR_MIN_AGE_S:
                        os.rmdir(entry.path)
                        self._count("orphans_removed")
                        remaining -= 1
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # vanished or busy: the next sweep sees it
            if in_temp:
                if now - st.st_mtime > TEMP_MAX_AGE_S and self._unlink(entry.path):
                    self._count("orphans_removed")
                    remaining -= 1
            elif st.st_size == 0:
                # vineyard's placeholder before the rename: young ones are
                # live writes, old ones are left by a writer that died.
                if now - st.st_mtime > TEMP_MAX_AGE_S and self._unlink(entry.path):
                    self._count("orphans_removed")
                    remaining -= 1
            else:
                # The space it takes on disk (whole filesystem blocks).
                size = max(st.st_size, st.st_blocks * 512)
                chunks.append((st.st_mtime, size, entry.path, st.st_size))
        return remaining == 0
