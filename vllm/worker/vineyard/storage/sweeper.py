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

Between sweeps the writers hold the disk limit themselves
(:meth:`RootSweeper.make_room`). They share an estimate of the root's usage
in its :data:`~vineyard_root_files.USAGE_LEDGER` (under ``flock``): what the last
sweep left, plus what every writer reserved since. A writer reserves the
chunks it is about to write; when they do not fit under the limit it first
runs a pass at once that evicts room for them too. So the chunk files of
all the writers that share the ledger stay within the limit, plus the
chunks that are being written while a scan runs (at most one write, a few
chunks, per writer). Where the ledger cannot be had (a read-only root, a
filesystem without locks, a ledger held for over :data:`LEDGER_WAIT_S`)
each writer counts its own writes: the limit then holds within one write
per writer plus what the others stored since this writer's last scan. The
free-space part of the budget stays the periodic sweeps'. The ledger is
advisory: a wrong value costs an extra pass or an overshoot until the next
sweep, never data.

One pass per root at a time: a pass holds ``flock`` on the root's
:data:`~vineyard_root_files.SWEEP_LOCK` (so that N instances of M ranks do not all
walk the root every interval). A periodic sweep that finds it held is
skipped; a writer that needs room waits for it up to :data:`LOCK_WAIT_S`,
then runs its pass regardless. Where there is no lock to be had (a file
planted at its path, a filesystem without locks) passes go unlocked: several
at once only race to delete the same files (the same LRU order), which is
harmless. Both files are opened without following links.

The disk limit and TTL are the root's own (:class:`~vineyard_root_files.RootSettings`
in :data:`~vineyard_root_files.ROOT_SETTINGS`): the first process that sweeps a
root records its own settings there, and every pass of every process reads
them, so one instance with a small limit or TTL cannot shrink everyone's
cache (a process whose own settings differ says so once). Where they cannot
be read, a process sweeps with its own. A chunk whose last use lies further
in the future than hosts' clocks differ (:data:`CLOCK_SKEW_S`) counts as the
oldest: a planted mtime cannot keep a chunk from eviction or expiry.

Evicting chunk ``k`` of a prefix makes its later
chunks unreachable (lookups stop at the first missing chunk) until they are
evicted in turn; nothing unverified is ever loaded either way.

Imports neither vLLM nor torch (it runs in the backend process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator

from vllm.worker.vineyard.storage import root as root_format
from vllm.worker.vineyard.storage import root_files

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
#: Longest a writer that needs room waits for another process's pass before
#: it runs its own unlocked (well within the writer's call timeout).
LOCK_WAIT_S = 5.0
_LOCK_POLL_S = 0.05
#: A process that found the lock held at every sweep for this many
#: intervals (a lock held that long) waits for it, then sweeps regardless.
MAX_SKIPPED_INTERVALS = 10
#: A new chunk file's space on disk is estimated in blocks of this size
#: (until the next scan counts it exactly).
DISK_BLOCK = 4096
#: Longest wait for the ledger's lock (held for microseconds at a time)
#: before this process counts on its own, for the next LEDGER_RETRY_S.
LEDGER_WAIT_S = 1.0
LEDGER_RETRY_S = 60.0
#: Most that hosts' clocks are taken to differ: a last use further in the
#: future than this is not believed.
CLOCK_SKEW_S = 300.0


def distrust_future(chunks: list[root_format.ChunkFile], now: float) -> None:
    """A chunk last used further in the future than :data:`CLOCK_SKEW_S`
    (a clock far ahead, or a planted mtime) would never age: it counts as
    the oldest instead, first to be evicted or expired."""
    for chunk in chunks:
        if chunk.mtime > now + CLOCK_SKEW_S:
            chunk.mtime = 0.0


def _flock(fd: int, wait_s: float, poll_s: float) -> bool:
    """Take ``flock`` on ``fd``, waiting up to ``wait_s``; whether it is
    held. Raises ``OSError`` on a filesystem without locks."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


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
        self,
        root: str,
        limit_bytes: int,
        ttl_s: float,
        interval_s: float,
        group_access: bool = False,
    ) -> None:
        self.root = root
        # This process's own settings; the root's recorded ones govern (see
        # the module docstring), read at every pass.
        self.own_settings = root_files.RootSettings(limit_bytes, ttl_s)
        self.limit_bytes = limit_bytes
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.group_access = group_access
        self._settings_noted: root_files.RootSettings | str | None = None
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
        # The root's usage (see the module docstring): the ledger's, kept
        # here too for when it cannot be had.
        self._ledger_lock = threading.Lock()
        self._ledger_retry_at = 0.0
        self._ledger_warned = False
        self._usage_here = root_files.Usage()
        # The ledger's sweep count as this process last saw it, and when
        # (its own clock) it saw it change: how fresh the ledger is, judged
        # without comparing this host's clock with another's.
        self._epoch_seen = -1
        self._epoch_changed_at = 0.0
        self._reservation = (-1, 0)  # epoch, bytes: make_room's last
        self.passes = 0
        self.skipped_sweeps = 0  # another process held the root's lock
        self.writer_passes = 0  # passes make_room ran
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
            # A pass the writer ran to make room counts as this one.
            due = self._last_pass + self.interval_s - time.monotonic()
            if self.passes and due > 0:
                delay = due
                continue
            delay = self.interval_s
            try:
                if self._swept_elsewhere():
                    # No pass here (a pass reads them): the root's settings
                    # still for the writer's reservations.
                    self._follow_root_settings()
                else:
                    self.sweep()
            except Exception:  # noqa: BLE001 - upkeep must never kill serving
                logger.exception("vineyard cache sweep failed")

    def _swept_elsewhere(self) -> bool:
        """Whether another process swept the root within the interval (by
        the ledger), so that this one need not walk it again: then take its
        figures. Not for :data:`MAX_SKIPPED_INTERVALS` in a row, so that
        a process whose passes keep losing the race still checks the root
        itself now and then (whoever passes, the root's settings apply)."""
        if time.monotonic() - self._last_pass > MAX_SKIPPED_INTERVALS * self.interval_s:
            return False
        with self._usage() as usage:
            stamp, base, chunks = usage.stamp, usage.base, usage.chunks
            unchanged_s = self._unchanged_s(usage)
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

    def _remove(self, chunk: root_format.ChunkFile) -> bool:
        if not root_format.remove_file(self.root, chunk.path, chunk.ino):
            return False
        with self._lock:
            if len(self._removed) < MAX_REMOVED_REPORTED:
                self._removed.append(chunk.path)
        return True

    def sweep(self, now: float | None = None) -> bool:
        """One pass over the root, unless another process is running one
        (holds the root's lock): then nothing, and False."""
        with self._pass_lock:
            # Skipped for too long (a lock held that long): wait, then go.
            idle_s = time.monotonic() - self._last_pass
            stale = idle_s > MAX_SKIPPED_INTERVALS * self.interval_s
            return self._locked_pass(now, 0, LOCK_WAIT_S if stale else 0.0)

    def make_room(self, nbytes: int) -> bool:
        """Called by the writer before it stores ``nbytes`` more on disk:
        reserve them in the root's usage; when they do not fit under the
        disk limit (or no recent sweep measured the root), first run a pass
        that evicts room for them too. Then call :meth:`wrote`. Returns
        whether it ran a pass."""
        if nbytes <= 0 or self._reserve(nbytes, force=False):
            return False
        with self._pass_lock:
            fd, _ = self._lock_root(LOCK_WAIT_S)
            try:
                # Another pass (this process's, or one waited for above)
                # may have made room: then no walk of the root.
                if self._reserve(nbytes, force=False):
                    return False
                self.writer_passes += 1
                try:
                    self._pass(None, nbytes)
                except Exception:  # noqa: BLE001 - upkeep must never fail a write
                    logger.exception("vineyard cache sweep failed")
                self._reserve(nbytes, force=True)  # what room there is: write
                return True
            finally:
                if fd is not None:
                    os.close(fd)  # releases the lock

    def wrote(self, nbytes: int) -> None:
        """Of what :meth:`make_room` reserved, the writer stored ``nbytes``:
        the rest is given back (unless a sweep has counted since)."""
        epoch, reserved = self._reservation
        self._reservation = (-1, 0)
        if reserved > nbytes:
            with self._usage() as usage:
                if usage.epoch == epoch:
                    usage.pending = max(0, usage.pending - (reserved - nbytes))

    @staticmethod
    def new_file_bytes(size: int) -> int:
        """The space a new file of ``size`` bytes takes, as estimated until
        a scan counts it (whole blocks)."""
        return -(-size // DISK_BLOCK) * DISK_BLOCK

    def _reserve(self, nbytes: int, force: bool) -> bool:
        """Add ``nbytes`` to the root's pending usage if they fit under the
        limit by a recent sweep's measure (or ``force``); whether added."""
        with self._usage() as usage:
            fits = (
                usage.stamp > 0
                and self._unchanged_s(usage) <= 2 * self.interval_s
                and usage.base + usage.pending + nbytes <= self.limit_bytes
            )
            if not (fits or force):
                return False
            usage.pending += nbytes
            self._reservation = (usage.epoch, nbytes)
            return True

    def _unchanged_s(self, usage: root_files.Usage) -> float:
        """How long the ledger has gone without a sweep, by this process's
        own clock: it watches the sweep count change, and never compares
        its clock with the stamp another host wrote (hosts' clocks may be
        minutes apart). A ledger first seen counts as fresh: if nobody
        sweeps it, this process's own sweep comes within an interval."""
        now = time.monotonic()
        if usage.epoch != self._epoch_seen:
            self._epoch_seen = usage.epoch
            self._epoch_changed_at = now
        return now - self._epoch_changed_at

    @contextlib.contextmanager
    def _usage(self) -> Iterator[root_files.Usage]:
        """The root's usage, to read and update: the ledger's, under its
        lock; where it cannot be had, this process's own."""
        with self._ledger_lock:
            fd = self._open_ledger()
            if fd is None:
                yield self._usage_here
                return
            try:
                usage = root_files.read_ledger(fd) or root_files.Usage()
                yield usage
                self._usage_here = dataclasses.replace(usage)
                try:
                    root_files.write_ledger(fd, usage)
                except OSError as e:
                    self._warn_ledger(f"cannot write it ({e})")
            finally:
                os.close(fd)  # releases the lock

    def _open_ledger(self) -> int | None:
        """The ledger, open and locked (closing it releases the lock);
        ``None`` where it cannot be had (then not tried again for
        :data:`LEDGER_RETRY_S`: a ledger held that long would slow every
        write)."""
        if time.monotonic() < self._ledger_retry_at:
            return None
        try:
            fd = root_files.open_root_file(
                self.root, root_files.USAGE_LEDGER, writable=True
            )
        except OSError as e:
            self._warn_ledger(f"cannot open it ({e})")
            return None
        try:
            if _flock(fd, LEDGER_WAIT_S, _LOCK_POLL_S / 10):
                return fd
            why = f"held by another for over {LEDGER_WAIT_S} s"
        except OSError as e:  # a filesystem without locks
            why = f"cannot lock it ({e})"
        os.close(fd)
        self._warn_ledger(why)
        return None

    def _warn_ledger(self, why: str) -> None:
        self._ledger_retry_at = time.monotonic() + LEDGER_RETRY_S
        if not self._ledger_warned:
            self._ledger_warned = True
            logger.warning(
                "vineyard cache writer on %s counts only its own writes between "
                "sweeps: the usage ledger %s %s (writers of other processes "
                "may then take the root past its limit by what they write "
                "between this one's sweeps); logged once",
                self.root,
                root_files.USAGE_LEDGER,
                why,
            )

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
                os.close(fd)  # releases the lock
        return True

    def _lock_root(self, wait_s: float) -> tuple[int | None, bool]:
        """Take the root's lock: ``(fd, True)`` when held (closing ``fd``
        releases it); ``(None, False)`` when another process holds it, or,
        after waiting ``wait_s`` for it, ``(None, True)``: the caller needs
        its pass. Where no lock can be had, ``(None, True)``: the pass goes
        unlocked (see the module docstring)."""
        try:
            fd = root_files.open_root_file(self.root, root_files.SWEEP_LOCK)
        except OSError as e:
            self._warn_unlocked(f"cannot open it ({e})")
            return None, True
        try:
            if _flock(fd, wait_s, _LOCK_POLL_S):
                return fd, True
        except OSError as e:  # a filesystem without locks
            os.close(fd)
            self._warn_unlocked(f"cannot lock it ({e})")
            return None, True
        os.close(fd)
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
                root_files.SWEEP_LOCK,
                why,
            )

    def _pass(self, now: float | None, need: int) -> None:
        """``stat`` every entry once, then delete; over the high-water mark
        (``need`` bytes about to be written counted in), evict."""
        now = time.time() if now is None else now
        self._follow_root_settings()
        with self._usage() as usage:
            pending = usage.pending  # reserved before the scan: it counts them
        scan = root_format.scan_root(self.root)
        self._report(scan)
        self._remove_leftovers(scan, now)
        chunks = scan.chunks
        distrust_future(chunks, now)
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
        if total + need > high:
            # The writer waits for this pass: room for its write as well.
            target = min(LOW_WATER * budget, budget - 2 * largest, high - need)
            done, evicted, total = evict_lru(chunks, total, target, self._remove)
            self._count("evicted_chunks", evicted)
            chunks = chunks[done:]
        with self._lock:
            self.root_bytes, self.root_chunks = total, len(chunks)
        with self._usage() as usage:
            # Reserved while the scan ran: maybe counted twice until the
            # next sweep (the safe side). Reserved before it and still being
            # written: not counted (at most one write per writer).
            usage.base, usage.chunks = total, len(chunks)
            usage.pending = max(0, usage.pending - pending)
            usage.epoch += 1
            usage.stamp = time.time()
            self._unchanged_s(usage)  # seen now
        self.passes += 1
        self._last_pass = time.monotonic()

    def _follow_root_settings(self) -> None:
        """Take the root's settings for this pass, recording this process's
        own where the root has none yet."""
        own = self.own_settings
        try:
            settings = root_files.read_root_settings(self.root)
            if settings is None:
                settings = root_files.record_root_settings(
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
        self.limit_bytes, self.ttl_s = settings.disk_limit_bytes, settings.ttl_s

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
