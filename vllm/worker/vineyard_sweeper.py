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

It touches only the cache's own entries, as :mod:`vineyard_root` tells
them: chunk files, vineyard's temporary files and placeholders and the
directories of namespaces. Namespace manifests are never removed; files
outside namespaces or of another shape, links and mount points are left
alone (logged once, not counted in the cache's size).

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
from collections.abc import Callable

if __package__:
    from vllm.worker import vineyard_root as root_format
else:  # run in the backend's script: the siblings, not vLLM
    import vineyard_root as root_format  # type: ignore[no-redef]

logger = logging.getLogger(__name__)

HIGH_WATER = 0.95  # evict when usage passes this share of the budget ...
LOW_WATER = 0.85  # ... down to this share
TEMP_MAX_AGE_S = 600.0
#: Removed chunk paths kept for the next report (KV events), at most.
MAX_REMOVED_REPORTED = 10_000
EMPTY_DIR_MIN_AGE_S = 60.0  # a writer may be about to fill a new folder
TEMP_DIR = root_format.TEMP_DIR
#: Most entries that are not the cache's remembered as logged (each is
#: logged once; past this many, no more are).
MAX_REPORTED = 10_000


def evict_lru(
    chunks: list[root_format.ChunkFile],
    total: int,
    target: float,
    remove: Callable[[root_format.ChunkFile], bool],
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
        # Chunk files removed since the last take_stats (for KV events).
        self._removed: list[str] = []
        self._reported: set[str] = set()  # entries not the cache's, logged
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

    def take_removed(self) -> list[str]:
        """The chunk files expired or evicted since the last call (at most
        :data:`MAX_REMOVED_REPORTED`; the rest go unreported)."""
        with self._lock:
            removed, self._removed = self._removed, []
            return removed

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _remove(self, chunk: root_format.ChunkFile) -> bool:
        if not root_format.remove_file(self.root, chunk.path, chunk.ino):
            return False
        with self._lock:
            if len(self._removed) < MAX_REMOVED_REPORTED:
                self._removed.append(chunk.path)
        return True

    def sweep(self, now: float | None = None) -> None:
        """One pass over the root: ``stat`` every entry once, then delete."""
        now = time.time() if now is None else now
        scan = root_format.scan_root(self.root)
        self._report(scan)
        self._remove_leftovers(scan, now)
        chunks = scan.chunks
        if self.ttl_s > 0:
            live = []
            for chunk in chunks:
                if now - chunk.mtime > self.ttl_s:
                    if self._remove(chunk):
                        self._count("expired_chunks")
                else:
                    live.append(chunk)
            chunks = live
        total = sum(chunk.disk_bytes for chunk in chunks)
        budget = self.budget(total)
        # A write needs room for a whole chunk: when the margins are smaller
        # than one (a small filesystem, big chunks), a full disk would stay
        # just too full to take the next chunk and never reach the mark.
        largest = max((chunk.disk_bytes for chunk in chunks), default=0)
        high = min(HIGH_WATER * budget, budget - largest)
        if total > high:
            target = min(LOW_WATER * budget, budget - 2 * largest)
            done, evicted, total = evict_lru(chunks, total, target, self._remove)
            self._count("evicted_chunks", evicted)
            chunks = chunks[done:]
        with self._lock:
            self.root_bytes, self.root_chunks = total, len(chunks)

    def _remove_leftovers(self, scan: root_format.RootScan, now: float) -> None:
        """Old temporary files and placeholders (their writer died), then
        old empty directories, children first: a whole empty tree
        (vineyard leaves one per write) goes in one pass."""
        # Entries left per directory that may become empty.
        left = {d.path: d.entries for d in scan.dirs}

        def removed(path: str) -> None:
            self._count("orphans_removed")
            parent = os.path.dirname(path)
            if parent in left:
                left[parent] -= 1

        for item in scan.leftovers:
            if now - item.mtime > TEMP_MAX_AGE_S and root_format.remove_file(
                self.root, item.path, item.ino
            ):
                removed(item.path)
        for d in scan.dirs:
            # Its age before this pass: a writer may be about to fill it.
            if (
                left[d.path] == 0
                and now - d.mtime > EMPTY_DIR_MIN_AGE_S
                and root_format.remove_dir(self.root, d.path)
            ):
                removed(d.path)

    def _report(self, scan: root_format.RootScan) -> None:
        """Log, once each, what the sweep leaves alone."""
        new = [f for f in scan.foreign if f.path not in self._reported]
        errors = [e for e in scan.errors if e[0] not in self._reported]
        if len(self._reported) >= MAX_REPORTED or not (new or errors):
            return
        self._reported.update(f.path for f in new)
        self._reported.update(path for path, _ in errors)
        shown = [f"{f.path} ({f.reason})" for f in new[:5]]
        shown += [f"{path} (unreadable: {why})" for path, why in errors[:5]]
        more = len(new) + len(errors) - len(shown)
        logger.warning(
            "vineyard cache sweep of %s leaves alone %d entries that are not "
            "the cache's own or cannot be read (never deleted, not counted "
            "in its size): %s%s%s",
            self.root,
            len(new) + len(errors),
            "; ".join(shown),
            f"; and {more} more" if more > 0 else "",
            "; `vineyard-llm-cache verify` checks files where chunks belong"
            if any(f.at_chunk_path for f in new)
            else "",
        )

    def budget(self, cache_bytes: int) -> float:
        """The disk limit, or what the filesystem can hold now if that is
        less (the cache's own bytes count as available to it)."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return float(self.limit_bytes)
        return float(min(self.limit_bytes, cache_bytes + st.f_bavail * st.f_frsize))
