# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The root's usage as its writers share it between sweeps
(:class:`SharedUsage`), for the sweeper's :meth:`make_room`.

The writers share an estimate of the root's usage in its
:data:`~vllm.worker.vineyard.storage.root_files.USAGE_LEDGER` (under
``flock``): what the last sweep left, plus what every writer reserved
since. A writer reserves the chunks it is about to write; when they do not
fit under the limit it first runs a pass at once that evicts room for them
too. So the chunk files of all the writers that share the ledger stay
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
import os
import threading
import time
from collections.abc import Iterator

from vllm.worker.vineyard.storage.root_files import (
    USAGE_LEDGER,
    Usage,
    flock_within,
    open_root_file,
    read_ledger,
    write_ledger,
)

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
                os.close(fd)  # releases the lock

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
        self, nbytes: int, limit_bytes: int, max_age_s: float, force: bool
    ) -> bool:
        """Add ``nbytes`` to the root's pending usage if they fit under
        ``limit_bytes`` by the measure of a sweep at most ``max_age_s`` ago
        (or ``force``); whether added."""
        with self.hold() as usage:
            fits = (
                usage.stamp > 0
                and self.unchanged_s(usage) <= max_age_s
                and usage.base + usage.pending + nbytes <= limit_bytes
            )
            if not (fits or force):
                return False
            usage.pending += nbytes
            self._reservation = (usage.epoch, nbytes)
            return True

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
        os.close(fd)
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
