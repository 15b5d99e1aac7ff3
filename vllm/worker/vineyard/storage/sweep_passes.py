# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a pass over a cache root does (:class:`SweepPasses`), and what one
process's passes remember between them.

A pass ``stat``\\ s every entry of the root once
(:func:`~vllm.worker.vineyard.storage.scan.scan_root`), then:

- expires chunks unused for longer than the TTL (if one is set);
- evicts the least recently used chunks when the root is over its budget
  (the disk limit, or less when the filesystem runs low), in the order and
  down to the marks of :mod:`~vllm.worker.vineyard.storage.eviction`;
- removes leftovers older than :data:`TEMP_MAX_AGE_S` (their writer died)
  and empty directories older than :data:`EMPTY_DIR_MIN_AGE_S`.

A chunk's mtime is its last use (vineyard sets it on write, a verified hit
sets it again), stamped by the clock of the root's filesystem, so a pass
judges ages by that clock too: a host whose own clock is off does not
expire fresh chunks. The disk limit and TTL are the root's own
(:class:`~vllm.worker.vineyard.storage.root_files.RootSettings`), so one
instance with a small limit or TTL cannot shrink everyone's cache.

A pass touches only the cache's own entries, as the scan tells them;
namespace manifests are never removed, and what is not the cache's is
logged once and left alone. Evicting chunk ``k`` of a prefix makes its
later chunks unreachable (lookups stop at the first missing chunk) until
they go in turn; nothing unverified is ever loaded either way.

Imports neither vLLM nor torch (it runs in the backend process).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from vllm.worker.vineyard.storage.eviction import (
    ObservedLastUse,
    distrust_future,
    evict_lru,
    eviction_target,
    expire,
)
from vllm.worker.vineyard.storage.file_modes import FileModes
from vllm.worker.vineyard.storage.removal import remove_dir, remove_file
from vllm.worker.vineyard.storage.root_files import (
    CLOCK_PROBE,
    RootSettings,
    read_root_settings,
    record_root_settings,
    root_clock,
)
from vllm.worker.vineyard.storage.scan import ChunkFile, RootScan, scan_root

logger = logging.getLogger(__name__)

#: A temporary file or placeholder older than this belongs to a writer that
#: died (a write takes seconds).
TEMP_MAX_AGE_S = 600.0
#: A writer may be about to fill a new folder. Where clients stamp mtimes
#: (not the root's server), this age also bounds the clock skew between
#: hosts that this removal tolerates (like TEMP_MAX_AGE_S).
EMPTY_DIR_MIN_AGE_S = 600.0
#: Most entries that are not the cache's remembered as logged (each is
#: logged once; past this many, no more are).
MAX_REPORTED = 10_000


class SweepPasses:
    """The passes of one process over one root. ``count(name, n)`` adds to
    the sweeper's counters; ``remove(chunk)`` removes a chunk file (and
    reports it) and says whether it went."""

    def __init__(
        self,
        root: str,
        own_settings: RootSettings,
        modes: FileModes,
        count: Callable[[str, int], None],
        remove: Callable[[ChunkFile], bool],
    ) -> None:
        self.root = root
        # This process's own settings; the root's recorded ones govern,
        # read at every pass.
        self.own_settings = own_settings
        self.settings = own_settings  # the ones that govern now
        self._modes = modes
        self._count = count
        self._remove = remove
        self._settings_noted: RootSettings | str | None = None
        self._reported: set[str] = set()  # entries not the cache's, logged
        # The root's clock minus this host's, as last measured.
        self._clock_offset = 0.0
        self._clock_warned = False
        self._last_use = ObservedLastUse()

    def start(self, now: float | None) -> float:
        """Begin a pass: the time it judges ages by (``now``, else the
        root's clock, read at every pass so that the offset stays current)
        and the root's settings."""
        root_now = self._root_now()
        self.follow_root_settings()
        return root_now if now is None else now

    def clean(self, now: float, need: int) -> tuple[int, int]:
        """Scan the root and remove what goes (over the high-water mark,
        ``need`` bytes about to be written counted in, evict); the chunk
        bytes and chunk files left."""
        scan = scan_root(self.root)
        self._report(scan)
        self._remove_leftovers(scan, now)
        self._last_use.correct(scan.chunks, now)
        distrust_future(scan.chunks, now)
        chunks, expired = expire(scan.chunks, now, self.settings.ttl_s, self._remove)
        self._count("expired_chunks", expired)
        total = sum(chunk.disk_bytes for chunk in chunks)
        target = eviction_target(chunks, total, self.budget(total), need)
        if target is not None:
            done, evicted, total = evict_lru(chunks, total, target, self._remove)
            self._count("evicted_chunks", evicted)
            chunks = chunks[done:]
        return total, len(chunks)

    def _root_now(self) -> float:
        """Now by the clock that stamps the root's mtimes. Where the probe
        cannot be touched (a read-only root): this host's clock corrected by
        the offset measured last (warned once)."""
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

    def follow_root_settings(self) -> None:
        """Take the root's settings, recording this process's own where the
        root has none yet (the first recorder wins). Where they cannot be
        read, this process sweeps with its own; one whose own differ from
        the root's says so once."""
        own = self.own_settings
        try:
            settings = read_root_settings(self.root)
            if settings is None:
                settings = record_root_settings(self.root, own, modes=self._modes)
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
        (vineyard leaves one per write under ``__temp``) goes in one pass."""
        # Entries left per directory that may become empty.
        left = {d.path: d.entries for d in scan.dirs}

        def removed(path: str) -> None:
            self._count("orphans_removed", 1)
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
        less (the cache's own bytes count as available to it): a full disk
        makes room for itself."""
        limit = self.settings.disk_limit_bytes
        try:
            st = os.statvfs(self.root)
        except OSError:
            return float(limit)
        return float(min(limit, cache_bytes + st.f_bavail * st.f_frsize))
