# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Keeps a cache root healthy for months: a background sweep that bounds
its size, expires chunks by last use and removes what dead writers left.

Each writer backend runs one sweeper over the whole root (every namespace,
every instance's chunks). A chunk's mtime is its last use: vineyard sets it
when the chunk is written and a verified hit sets it again. Mtimes are
stamped by the clock of the root's filesystem (on NFS, the server's), so a
pass judges ages by that clock too, read from a probe file it touches
(:func:`~vllm.worker.vineyard.storage.root_files.root_clock`): a host whose
own clock is off does not expire fresh chunks. Where the probe cannot be
touched (a read-only root), a pass takes this host's clock, corrected by the
offset measured last. Each sweep:

- expires chunks unused for longer than the TTL (if one is set);
- evicts the least recently used chunks when the root is over its budget
  (high-water mark) down to a low-water mark. The budget is the disk limit,
  or less when the filesystem runs low: a full disk makes room for itself.
  The marks leave room for at least one (high) and two (low) of the
  largest chunks, however small the filesystem;
- removes temporary files older than :data:`TEMP_MAX_AGE_S` (a write takes
  seconds; older ones belong to a writer that died) and empty directories
  (vineyard leaves one per write under ``__temp``).

It touches only the cache's own entries, as
:mod:`~vllm.worker.vineyard.storage.scan` tells them: chunk files,
vineyard's temporary files and placeholders and the directories of
namespaces. Namespace manifests are never removed; files outside
namespaces or of another shape, links and mount points are left alone
(logged once, not counted in the cache's size).

Between sweeps the writers hold the disk limit themselves
(:meth:`RootSweeper.make_room`), by the usage they share in the root's
ledger (:mod:`~vllm.worker.vineyard.storage.usage`): a write stores only the
chunks that fit and asks this thread for a pass that makes room for the
rest (skipped, counted); it never runs a pass itself. The free-space part
of the budget is measured by the passes only: a write the filesystem
refused (:meth:`RootSweeper.write_failed`) asks for a pass that makes room
for it, as the filesystem may be full below the high-water mark.

One pass per root at a time: a pass holds ``flock`` on the root's
:data:`~vllm.worker.vineyard.storage.root_files.SWEEP_LOCK` (so that N
instances of M ranks do not all walk the root every interval). A periodic
sweep that finds it held is skipped; a pass a writer asked for waits for it
up to :data:`LOCK_WAIT_S`, then runs regardless. Where there is no
lock to be had (a file planted at its path, a filesystem without locks)
passes go unlocked: several at once only race to delete the same files (the
same LRU order), which is harmless. Both files are opened without following
links.

The disk limit and TTL are the root's own
(:class:`~vllm.worker.vineyard.storage.root_files.RootSettings`): the first
process that sweeps a root records its own settings there, and every pass
of every process reads them, so one instance with a small limit or TTL
cannot shrink everyone's cache (a process whose own settings differ says so
once). Where they cannot be read, a process sweeps with its own. Which
chunks go, and in what order: :mod:`~vllm.worker.vineyard.storage.eviction`.

Evicting chunk ``k`` of a prefix makes its later
chunks unreachable (lookups stop at the first missing chunk) until they are
evicted in turn; nothing unverified is ever loaded either way.

Imports neither vLLM nor torch (it runs in the backend process).
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Sequence

from vllm.worker.vineyard.storage.eviction import (
    HIGH_WATER,
    ObservedLastUse,
    distrust_future,
    evict_lru,
    eviction_target,
    expire,
)
from vllm.worker.vineyard.storage.removal import remove_dir, remove_file
from vllm.worker.vineyard.storage.root_files import (
    CLOCK_PROBE,
    SWEEP_LOCK,
    RootSettings,
    flock_within,
    open_root_file,
    read_root_settings,
    record_root_settings,
    root_clock,
)
from vllm.worker.vineyard.storage.safe_io import release
from vllm.worker.vineyard.storage.scan import ChunkFile, RootScan, scan_root
from vllm.worker.vineyard.storage.usage import SharedUsage

logger = logging.getLogger(__name__)

TEMP_MAX_AGE_S = 600.0
#: Removed chunk paths kept for the next report (KV events), at most.
MAX_REMOVED_REPORTED = 10_000
#: A writer may be about to fill a new folder. Where clients stamp mtimes
#: (not the root's server), this age also bounds the clock skew between
#: hosts that this removal tolerates (like TEMP_MAX_AGE_S).
EMPTY_DIR_MIN_AGE_S = 600.0
#: Most entries that are not the cache's remembered as logged (each is
#: logged once; past this many, no more are).
MAX_REPORTED = 10_000
#: Longest a pass a writer asked for waits for another process's pass before
#: it runs unlocked.
LOCK_WAIT_S = 5.0
_LOCK_POLL_S = 0.05
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
    """Background upkeep of a cache root (see the module docstring)."""

    def __init__(
        self,
        root: str,
        limit_bytes: int,
        ttl_s: float,
        interval_s: float,
        group_access: bool = False,
        root_lost: Callable[[], str | None] | None = None,
    ) -> None:
        self.root = root
        # Why the root is not to be touched now (a lost mount), or None.
        self._root_lost = root_lost
        self._lost_logged = False
        # This process's own settings; the root's recorded ones govern (see
        # the module docstring), read at every pass.
        self.own_settings = RootSettings(limit_bytes, ttl_s)
        self.settings = self.own_settings  # the ones that govern now
        self.interval_s = interval_s
        self.group_access = group_access
        self._settings_noted: RootSettings | str | None = None
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("evicted_chunks", "expired_chunks", "orphans_removed"), 0
        )
        self.root_bytes = 0
        self.root_chunks = 0
        # Chunk files removed since the last take_stats (for KV events).
        self._removed: list[str] = []
        self._reported: set[str] = set()  # entries not the cache's, logged
        # One pass at a time in this process (the thread's, the writer's).
        self._pass_lock = threading.Lock()
        self._last_pass = time.monotonic()
        self._lock_warned = False
        # The root's clock minus this host's, as last measured.
        self._clock_offset = 0.0
        self._clock_warned = False
        self._usage = SharedUsage(root)
        self._last_use = ObservedLastUse()
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
                    self._follow_root_settings()
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

    def _count(self, name: str, n: int = 1) -> None:
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
            fd, _ = self._lock_root(LOCK_WAIT_S)
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
        fd, go = self._lock_root(wait_s)
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

    def _lock_root(self, wait_s: float) -> tuple[int | None, bool]:
        """Take the root's lock: ``(fd, True)`` when held (closing ``fd``
        releases it); ``(None, False)`` when another process holds it, or,
        after waiting ``wait_s`` for it, ``(None, True)``: the caller needs
        its pass. Where no lock can be had, ``(None, True)``: the pass goes
        unlocked (see the module docstring)."""
        try:
            fd = open_root_file(self.root, SWEEP_LOCK)
        except OSError as e:
            self._warn_unlocked(f"cannot open it ({e})")
            return None, True
        try:
            if flock_within(fd, wait_s, _LOCK_POLL_S):
                return fd, True
        except OSError as e:  # a filesystem without locks
            release(fd)
            self._warn_unlocked(f"cannot lock it ({e})")
            return None, True
        release(fd)
        if wait_s > 0:
            self._warn_unlocked(f"held by another for over {wait_s} s")
        return None, wait_s > 0

    def _warn_unlocked(self, why: str) -> None:
        if not self._lock_warned:
            self._lock_warned = True
            logger.warning(
                "vineyard cache sweep of %s runs without its lock %s: %s "
                "(processes may then sweep the root at once: harmless, only "
                "more work); logged once",
                self.root,
                SWEEP_LOCK,
                why,
            )

    def _pass(self, now: float | None, need: int) -> None:
        """``stat`` every entry once, then delete; over the high-water mark
        (``need`` bytes about to be written counted in), evict."""
        root_now = self._root_now()  # every pass: the offset stays measured
        now = root_now if now is None else now
        self._follow_root_settings()
        with self._usage.hold() as usage:
            pending = usage.pending  # reserved before the scan: it counts them
        scan = scan_root(self.root)
        self._report(scan)
        self._remove_leftovers(scan, now)
        self._last_use.correct(scan.chunks, now)
        distrust_future(scan.chunks, now)
        chunks, expired = expire(scan.chunks, now, self.ttl_s, self._remove)
        self._count("expired_chunks", expired)
        total = sum(chunk.disk_bytes for chunk in chunks)
        target = eviction_target(chunks, total, self.budget(total), need)
        if target is not None:
            done, evicted, total = evict_lru(chunks, total, target, self._remove)
            self._count("evicted_chunks", evicted)
            chunks = chunks[done:]
        with self._lock:
            self.root_bytes, self.root_chunks = total, len(chunks)
        self._record_usage(total, len(chunks), pending)
        self.passes += 1
        self._last_pass = time.monotonic()

    def _root_now(self) -> float:
        """Now by the clock that stamps the root's mtimes; where it cannot
        be read, this host's clock corrected by the offset measured last
        (warned once)."""
        try:
            now = root_clock(self.root)
        except OSError as e:
            if not self._clock_warned:
                self._clock_warned = True
                logger.warning(
                    "vineyard cache sweeps of %s judge ages by this host's "
                    "clock (%+.1f s: the offset to the root's clock last "
                    "measured), as they cannot touch %s to read the root's "
                    "(%s); logged once",
                    self.root,
                    self._clock_offset,
                    CLOCK_PROBE,
                    e,
                )
            return time.time() + self._clock_offset
        self._clock_offset = now - time.time()
        return now

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

    def _follow_root_settings(self) -> None:
        """Take the root's settings for this pass, recording this process's
        own where the root has none yet."""
        own = self.own_settings
        try:
            settings = read_root_settings(self.root)
            if settings is None:
                settings = record_root_settings(
                    self.root, own, group_access=self.group_access
                )
        except (OSError, ValueError) as e:
            if self._settings_noted != "own":
                self._settings_noted = "own"
                logger.warning(
                    "vineyard cache root %s: cannot use its settings (%s); this "
                    "process sweeps with its own (%s) meanwhile; "
                    "`vineyard-llm-cache settings` records them anew",
                    self.root,
                    e,
                    own.describe(),
                )
            settings = own
        else:
            if settings != own and settings != self._settings_noted:
                logger.warning(
                    "vineyard cache root %s has settings of its own (%s), which "
                    "govern every process's upkeep of it; this process's (%s, "
                    "VINEYARD_CACHE_DISK_LIMIT_GB and VINEYARD_CACHE_TTL_S) are "
                    "not used. Change the root's with `vineyard-llm-cache "
                    "settings %s --disk-limit SIZE --ttl-s S`",
                    self.root,
                    settings.describe(),
                    own.describe(),
                    self.root,
                )
            self._settings_noted = settings
        self.settings = settings

    def _remove_leftovers(self, scan: RootScan, now: float) -> None:
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
            if now - item.mtime > TEMP_MAX_AGE_S and remove_file(
                self.root, item.path, item.ino
            ):
                removed(item.path)
        for d in scan.dirs:
            # Its age before this pass: a writer may be about to fill it.
            if (
                left[d.path] == 0
                and now - d.mtime > EMPTY_DIR_MIN_AGE_S
                and remove_dir(self.root, d.path)
            ):
                removed(d.path)

    def _report(self, scan: RootScan) -> None:
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
