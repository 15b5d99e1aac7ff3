# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One pass per root at a time (:class:`SweepLock`): a pass holds ``flock``
on the root's :data:`~vllm.worker.vineyard.storage.root_files.SWEEP_LOCK`,
so that N instances of M ranks do not all walk the root every interval.

Where there is no lock to be had (a file planted at its path, a filesystem
without locks) passes go unlocked: several at once only race to delete the
same files in the same LRU order, which is harmless, so the lock is never a
reason to skip the upkeep for good. The file is opened without following
links and without blocking.

Imports neither vLLM nor torch (the sweeper runs in the backend process).
"""

from __future__ import annotations

import logging

from vllm.worker.vineyard.storage.root_files import (
    SWEEP_LOCK,
    flock_within,
    open_root_file,
)
from vllm.worker.vineyard.storage.safe_io import release

logger = logging.getLogger(__name__)

#: Longest a pass a writer asked for waits for another process's pass before
#: it runs unlocked.
LOCK_WAIT_S = 5.0
_LOCK_POLL_S = 0.05


class SweepLock:
    """The lock on one root's passes, as one process takes it (it warns
    once when passes go unlocked)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._warned = False

    def take(self, wait_s: float) -> tuple[int | None, bool]:
        """Take the root's lock: ``(fd, True)`` when held (closing ``fd``
        with :func:`~vllm.worker.vineyard.storage.safe_io.release` releases
        it); ``(None, False)`` when another process holds it, or, after
        waiting ``wait_s`` for it, ``(None, True)``: the caller needs its
        pass. Where no lock can be had, ``(None, True)``: the pass goes
        unlocked."""
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
        if not self._warned:
            self._warned = True
            logger.warning(
                "vineyard cache sweep of %s runs without its lock %s: %s "
                "(processes may then sweep the root at once: harmless, only "
                "more work); logged once",
                self.root,
                SWEEP_LOCK,
                why,
            )
