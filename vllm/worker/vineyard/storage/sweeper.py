# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Keeps a cache root healthy for months (:class:`RootSweeper`): a
background sweep that bounds its size, expires chunks by last use and
removes what dead writers left, while the writers hold the disk limit
between sweeps.

- Each writer backend runs one sweeper over the whole root (every
  namespace, every instance's chunks), on a thread of its own: what a pass
  does is :mod:`~vllm.worker.vineyard.storage.sweep_passes`.
- One pass per root at a time
  (:mod:`~vllm.worker.vineyard.storage.sweep_lock`): a periodic sweep that
  finds the lock held is skipped; a pass a writer asked for waits for it,
  then runs regardless.
- A write stores only the chunks that fit under the disk limit, by the
  usage the writers share in the root's ledger
  (:mod:`~vllm.worker.vineyard.storage.usage`), and asks this thread for a
  pass that makes room for the rest: a write never runs or waits for a
  pass, which on a large root or with the lock held elsewhere would hold up
  every write.

Imports neither vLLM nor torch (it runs in the backend process).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence

from vllm.worker.vineyard.storage.eviction import HIGH_WATER
from vllm.worker.vineyard.storage.file_modes import OWNER_ONLY, FileModes
from vllm.worker.vineyard.storage.removal import remove_file
from vllm.worker.vineyard.storage.root_files import RootSettings
from vllm.worker.vineyard.storage.safe_io import release
from vllm.worker.vineyard.storage.scan import ChunkFile
from vllm.worker.vineyard.storage.sweep_lock import LOCK_WAIT_S, SweepLock
from vllm.worker.vineyard.storage.sweep_passes import SweepPasses
from vllm.worker.vineyard.storage.usage import SharedUsage

logger = logging.getLogger(__name__)

#: Removed chunk paths kept for the next report (KV events), at most.
MAX_REMOVED_REPORTED = 10_000
#: A process that found the lock held at every sweep for this many
#: intervals (a lock held that long) waits for it, then sweeps regardless.
MAX_SKIPPED_INTERVALS = 10
#: Writes the filesystem refused ask for a pass at most this often (a disk
#: that stays full would otherwise have the root walked after every write).
REFUSED_PASS_GAP_S = 5.0
#: A new chunk file's space on disk is estimated in blocks of this size
#: (until the next scan counts it exactly).
DISK_BLOCK = 4096


class RootSweeper:
    """Background upkeep of a cache root (see the module docstring).
    ``limit_bytes`` and ``ttl_s`` are this process's own settings, which
    the root's recorded ones override (see
    :class:`~vllm.worker.vineyard.storage.sweep_passes.SweepPasses`);
    ``modes``: those of the settings file it records where there is none."""

    def __init__(
        self,
        root: str,
        limit_bytes: int,
        ttl_s: float,
        interval_s: float,
        modes: FileModes = OWNER_ONLY,
        root_lost: Callable[[], str | None] | None = None,
    ) -> None:
        self.root = root
        # Why the root is not to be touched now (a lost mount), or None.
        self._root_lost = root_lost
        self._lost_logged = False
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("evicted_chunks", "expired_chunks", "orphans_removed"), 0
        )
        self.root_bytes = 0
        self.root_chunks = 0
        # Chunk files removed since the last take_stats (for KV events).
        self._removed: list[str] = []
        self._passes = SweepPasses(
            root, RootSettings(limit_bytes, ttl_s), modes, self._count, self._remove
        )
        # One pass at a time in this process (the thread's, the writer's),
        # and in the root (the root's lock).
        self._pass_lock = threading.Lock()
        self._root_lock = SweepLock(root)
        self._last_pass = time.monotonic()
        self._usage = SharedUsage(root)
        self.passes = 0
        self.skipped_sweeps = 0  # another process held the root's lock
        self.requested_passes = 0  # passes make_room asked for
        self._need = 0  # bytes the writer asked room for (under _lock)
        self._refused = False  # the filesystem refused a write (under _lock)
        self._refused_at = -math.inf  # when a refused write last asked
        self._wake = threading.Event()  # a pass is asked for, or stop
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="vineyard-cache-sweeper", daemon=True
        )

    @property
    def settings(self) -> RootSettings:
        """The settings that govern now (the root's, as last read)."""
        return self._passes.settings

    @property
    def limit_bytes(self) -> int:
        return self.settings.disk_limit_bytes

    @property
    def ttl_s(self) -> float:
        return self.settings.ttl_s

    @property
    def pass_asked(self) -> bool:
        """Whether a writer asked for a pass that has not run yet."""
        return self._wake.is_set() and not self._stop.is_set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        # Instances started together should not sweep in lockstep.
        delay = random.uniform(0.1, 1.0) * min(self.interval_s, 5.0)
        while True:
            self._wake.wait(delay)
            if self._stop.is_set():
                return
            try:
                if self._lost():
                    self._wake.clear()
                    delay = self.interval_s
                    continue
                if self._wake.is_set():
                    self.run_requested_pass()
                # A pass run on request counts as the periodic one.
                due = self._last_pass + self.interval_s - time.monotonic()
                if self.passes and due > 0:
                    delay = due
                    continue
                delay = self.interval_s
                if self._swept_elsewhere():
                    # No pass here (a pass reads them): the root's settings
                    # still for the writer's reservations.
                    self._passes.follow_root_settings()
                else:
                    self.sweep()
            except Exception:  # noqa: BLE001 - upkeep must never kill serving
                logger.exception("vineyard cache sweep failed")

    def _lost(self) -> bool:
        """Whether the root is lost (a mount gone): then no pass, and none
        of the sweepers' files made in the empty folder left in its place
        (logged once per loss)."""
        lost = self._root_lost() if self._root_lost is not None else None
        if lost is None:
            self._lost_logged = False
            return False
        if not self._lost_logged:
            self._lost_logged = True
            logger.warning("vineyard cache sweeps of %s paused: %s", self.root, lost)
        return True

    def _swept_elsewhere(self) -> bool:
        """Whether another process swept the root within the interval (by
        the ledger), so that this one need not walk it again: then take its
        figures. Not for :data:`MAX_SKIPPED_INTERVALS` in a row, so that
        a process whose passes keep losing the race still checks the root
        itself now and then (whoever passes, the root's settings apply)."""
        if time.monotonic() - self._last_pass > MAX_SKIPPED_INTERVALS * self.interval_s:
            return False
        with self._usage.hold() as usage:
            stamp, base, chunks = usage.stamp, usage.base, usage.chunks
            unchanged_s = self._usage.unchanged_s(usage)
        if not (stamp > 0 and unchanged_s < self.interval_s):
            return False
        with self._lock:
            self.root_bytes, self.root_chunks = base, chunks
            self.skipped_sweeps += 1
        return True

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

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self._counts[name] += n

    def _remove(self, chunk: ChunkFile) -> bool:
        if not remove_file(self.root, chunk.path, chunk.ino):
            return False
        with self._lock:
            if len(self._removed) < MAX_REMOVED_REPORTED:
                self._removed.append(chunk.path)
        return True

    def sweep(self, now: float | None = None) -> bool:
        """One pass over the root, unless another process is running one
        (holds the root's lock): then nothing, and False. ``now``: the
        time the pass judges ages by, instead of the root's clock."""
        if self._lost():
            return False
        with self._pass_lock:
            # Skipped for too long (a lock held that long): wait, then go.
            idle_s = time.monotonic() - self._last_pass
            stale = idle_s > MAX_SKIPPED_INTERVALS * self.interval_s
            return self._locked_pass(now, 0, LOCK_WAIT_S if stale else 0.0)

    def make_room(self, sizes: Sequence[int]) -> int:
        """Called by the writer before it stores new chunks (``sizes``: the
        bytes each adds on disk, in order): reserves the leading ones that
        fit under the disk limit and returns how many, for the writer to
        store those only; then call :meth:`wrote`. When not all fit, the
        root passes the high-water mark, or no recent sweep measured it, the
        sweeper's thread is asked for a pass that makes room (for the rest
        too): a write never runs or waits for a pass (on a large root, or
        with the root's lock held elsewhere, that would hold up every
        write)."""
        if not sum(sizes):
            return len(sizes)
        # Asked for past the high-water mark already, so that the room is
        # there before writes reach the limit.
        fit, due = self._usage.reserve(
            sizes,
            self.limit_bytes,
            2 * self.interval_s,
            int(HIGH_WATER * self.limit_bytes),
        )
        if due:
            with self._lock:
                self._need = max(self._need, sum(sizes[fit:]))
            self._wake.set()
        return fit

    def write_failed(self, need: int) -> None:
        """The filesystem refused a write of ``need`` more bytes (it may be
        full while the root is below the high-water mark of the budget the
        last pass measured, as a write may be several chunks): asks the
        sweeper's thread for a pass that makes room for them, unless a
        refused write asked for one within :data:`REFUSED_PASS_GAP_S` (or
        the interval, if shorter)."""
        now = time.monotonic()
        if now - self._refused_at < min(REFUSED_PASS_GAP_S, self.interval_s):
            return
        self._refused_at = now
        with self._lock:
            self._need = max(self._need, need)
            self._refused = True
        self._wake.set()

    def run_requested_pass(self) -> bool:
        """The pass a writer asked for (:meth:`make_room`), on the sweeper's
        thread: waits for another process's pass up to :data:`LOCK_WAIT_S`
        (then runs unlocked), and walks the root only if the room is still
        short. Returns whether it walked."""
        self._wake.clear()
        with self._lock:
            need, self._need = self._need, 0
            refused, self._refused = self._refused, False
        if self._lost():
            return False
        with self._pass_lock:
            fd, _ = self._root_lock.take(LOCK_WAIT_S)
            try:
                # Another pass (one waited for above) may have made room;
                # a refused write's room is the filesystem's to tell.
                if not refused and not self._usage.short_of(
                    need, int(HIGH_WATER * self.limit_bytes), 2 * self.interval_s
                ):
                    return False
                self.requested_passes += 1
                self._pass(None, need)
                return True
            finally:
                if fd is not None:
                    release(fd)

    def wrote(self, nbytes: int) -> None:
        """Of what :meth:`make_room` reserved, the writer stored ``nbytes``:
        the rest is given back (unless a sweep has counted since)."""
        self._usage.stored(nbytes)

    @staticmethod
    def new_file_bytes(size: int) -> int:
        """The space a new file of ``size`` bytes takes, as estimated until
        a scan counts it (whole blocks)."""
        return -(-size // DISK_BLOCK) * DISK_BLOCK

    def _locked_pass(self, now: float | None, need: int, wait_s: float) -> bool:
        fd, go = self._root_lock.take(wait_s)
        if not go:
            with self._lock:
                self.skipped_sweeps += 1
            logger.debug("vineyard cache sweep of %s skipped: another runs", self.root)
            return False
        try:
            self._pass(now, need)
        finally:
            if fd is not None:
                release(fd)
        return True

    def _pass(self, now: float | None, need: int) -> None:
        """One pass (``need``: bytes about to be written, counted in), and
        what it measured in the root's ledger."""
        now = self._passes.start(now)
        with self._usage.hold() as usage:
            pending = usage.pending  # reserved before the scan: it counts them
        total, num_chunks = self._passes.clean(now, need)
        with self._lock:
            self.root_bytes, self.root_chunks = total, num_chunks
        self._record_usage(total, num_chunks, pending)
        self.passes += 1
        self._last_pass = time.monotonic()

    def _record_usage(self, total: int, num_chunks: int, pending: int) -> None:
        """What this pass measured, in the root's usage (``pending``: what
        was reserved before its scan began, now counted in ``total``)."""
        with self._usage.hold() as usage:
            # Reserved while the scan ran: maybe counted twice until the
            # next sweep (the safe side). Reserved before it and still being
            # written: not counted (at most one write per writer).
            usage.base, usage.chunks = total, num_chunks
            usage.pending = max(0, usage.pending - pending)
            usage.epoch += 1
            usage.stamp = time.time()
            self._usage.unchanged_s(usage)  # seen now
