# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The root's usage as its writers share it between sweeps
(:class:`SharedUsage`), for the sweeper's :meth:`make_room`.

The writers share an estimate of the root's usage in its
:data:`~vllm.worker.vineyard.storage.root_files.USAGE_LEDGER` (under
``flock``): what the last sweep left, plus what every writer reserved
since. A writer reserves the chunks it is about to write and writes those
that fit under the limit; the rest are skipped (counted), and the sweeper's
thread runs a pass that evicts room for them: a write never waits for a
pass. So the chunk files of all the writers that share the ledger stay
within the limit, plus the chunks that are being written while a scan runs
(at most one write, a few chunks, per writer). Where the ledger cannot be
had (a read-only root, a filesystem without locks, a ledger held for over
:data:`LEDGER_WAIT_S`) each writer counts its own writes: the limit then
holds within one write per writer plus what the others stored since this
writer's last scan. The free-space part of the budget stays the periodic
sweeps'. The ledger is advisory: a wrong value costs an extra pass or an
overshoot until the next sweep, never data.

Imports neither vLLM nor torch (the sweeper runs in the backend process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Sequence

from vllm.worker.vineyard.storage.root_files import (
    USAGE_LEDGER,
    Usage,
    flock_within,
    open_root_file,
    read_ledger,
    write_ledger,
)
from vllm.worker.vineyard.storage.safe_io import release

logger = logging.getLogger(__name__)

#: Longest wait for the ledger's lock (held for microseconds at a time)
#: before this process counts on its own, for the next LEDGER_RETRY_S.
LEDGER_WAIT_S = 1.0
LEDGER_RETRY_S = 60.0
_POLL_S = 0.005


class SharedUsage:
    """The root's usage, to read and update under the ledger's lock; where
    the ledger cannot be had, this process's own count."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._warned = False
        self._here = Usage()  # the ledger's as last seen, or the own count
        # The ledger's sweep count as this process last saw it, and when
        # (its own clock) it saw it change: how fresh the ledger is, judged
        # without comparing this host's clock with another's.
        self._epoch_seen = -1
        self._epoch_changed_at = 0.0
        self._reservation = (-1, 0)  # epoch, bytes: reserve's last

    @contextlib.contextmanager
    def hold(self) -> Iterator[Usage]:
        """The root's usage, to read and update: the ledger's, under its
        lock; where it cannot be had, this process's own."""
        with self._lock:
            fd = self._open()
            if fd is None:
                yield self._here
                return
            try:
                usage = read_ledger(fd) or Usage()
                yield usage
                self._here = dataclasses.replace(usage)
                try:
                    write_ledger(fd, usage)
                except OSError as e:
                    self._warn(f"cannot write it ({e})")
            finally:
                release(fd)

    def unchanged_s(self, usage: Usage) -> float:
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

    def reserve(
        self,
        sizes: Sequence[int],
        limit_bytes: int,
        max_age_s: float,
        due_above: int,
    ) -> tuple[int, bool]:
        """Add to the root's pending usage the leading ``sizes`` (bytes of
        chunks about to be written, in order) that fit under
        ``limit_bytes``. Returns how many, and whether a pass is due: not
        all fit, the usage passes ``due_above``, or the ledger is stale (no
        sweep measured the root within ``max_age_s`` by this process's
        clock, or none ever did). A stale estimate still bounds what the
        ledger's writers stored, as their reservations add up in it until
        a sweep counts them."""
        with self.hold() as usage:
            total = usage.base + usage.pending
            fit = 0
            for size in sizes:
                if total + size > limit_bytes:
                    break
                total += size
                fit += 1
            reserved = total - usage.base - usage.pending
            usage.pending += reserved
            self._reservation = (usage.epoch, reserved)
            stale = usage.stamp <= 0 or self.unchanged_s(usage) > max_age_s
            return fit, stale or fit < len(sizes) or total > due_above

    def short_of(self, nbytes: int, room_bytes: int, max_age_s: float) -> bool:
        """Whether ``nbytes`` more would take the usage past ``room_bytes``,
        or no sweep measured it within ``max_age_s`` (reserving nothing)."""
        with self.hold() as usage:
            return (
                usage.stamp <= 0
                or self.unchanged_s(usage) > max_age_s
                or usage.base + usage.pending + nbytes > room_bytes
            )

    def stored(self, nbytes: int) -> None:
        """Of what :meth:`reserve` reserved last, ``nbytes`` were stored:
        the rest is given back (unless a sweep has counted since)."""
        epoch, reserved = self._reservation
        self._reservation = (-1, 0)
        if reserved > nbytes:
            with self.hold() as usage:
                if usage.epoch == epoch:
                    usage.pending = max(0, usage.pending - (reserved - nbytes))

    def _open(self) -> int | None:
        """The ledger, open and locked (closing it releases the lock);
        ``None`` where it cannot be had (then not tried again for
        :data:`LEDGER_RETRY_S`: a ledger held that long would slow every
        write)."""
        if time.monotonic() < self._retry_at:
            return None
        try:
            fd = open_root_file(self.root, USAGE_LEDGER, writable=True)
        except OSError as e:
            self._warn(f"cannot open it ({e})")
            return None
        try:
            if flock_within(fd, LEDGER_WAIT_S, _POLL_S):
                return fd
            why = f"held by another for over {LEDGER_WAIT_S} s"
        except OSError as e:  # a filesystem without locks
            why = f"cannot lock it ({e})"
        release(fd)
        self._warn(why)
        return None

    def _warn(self, why: str) -> None:
        self._retry_at = time.monotonic() + LEDGER_RETRY_S
        if not self._warned:
            self._warned = True
            logger.warning(
                "vineyard cache writer on %s counts only its own writes between "
                "sweeps: the usage ledger %s %s (writers of other processes "
                "may then take the root past its limit by what they write "
                "between this one's sweeps); logged once",
                self.root,
                USAGE_LEDGER,
                why,
            )
