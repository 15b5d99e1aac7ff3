# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The removals of chunk files that resets start (:class:`ResetRemovals`):
queued with the lookups, in a lookup thread's process, so a slow or hung
root holds up the engine for at most :data:`RESET_WAIT_S`; their outcome is
logged when they finish (failures counted ``reset_failures``)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from vllm.logger import init_logger

from vllm.worker.vineyard.connector.lookup_jobs import NamespaceRemoval
from vllm.worker.vineyard.connector.lookups import BackgroundLookups
from vllm.worker.vineyard.metrics import VineyardCacheMetrics

logger = init_logger(__name__)

#: Longest ``reset_cache`` waits for its removal of chunk files (then the
#: removal goes on in the background; the reset's fence holds at once).
RESET_WAIT_S = 1.0


class ResetRemovals:
    def __init__(
        self,
        lookups: BackgroundLookups,
        metrics: Callable[[], VineyardCacheMetrics],
    ):
        self._lookups = lookups
        self._metrics = metrics
        self._pending: collections.deque[NamespaceRemoval] = collections.deque()

    def start(self, root: str, namespaces: Sequence[str]) -> None:
        """Remove every chunk file of ``namespaces`` under ``root``; wait
        for it at most :data:`RESET_WAIT_S`."""
        removal = self._lookups.remove_namespaces(root, sorted(set(namespaces)))
        self._pending.append(removal)
        removal.done.wait(RESET_WAIT_S)
        self.log_finished()

    def log_finished(self) -> None:
        """Log the removals that finished (and count failures)."""
        while self._pending and self._pending[0].done.is_set():
            removal = self._pending.popleft()
            where = ", ".join(removal.namespaces)
            if removal.error is not None:
                self._metrics().add("reset_failures")
                logger.warning(
                    "vineyard cache reset of %s did not finish (%s): chunks may "
                    "be left on the root (never loaded by this instance)",
                    where,
                    removal.error,
                )
            else:
                logger.info(
                    "vineyard cache reset: %d chunk file(s) removed from %s%s",
                    len(removal.removed),
                    where,
                    f"; {removal.left} could not be removed" if removal.left else "",
                )
