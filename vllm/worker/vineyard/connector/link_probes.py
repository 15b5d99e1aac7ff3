# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The link's price measured off the requests (:class:`LinkProbes`): a
timed read of a hit's first chunk files, or at the engine's start of
whichever chunk files the namespace lists first, on a thread and in a
lookup process of its own (a probe on a slow or hung root holds up no
lookup and no request), one at a time. :class:`~.load_costs.LoadCosts`
asks for one at the start, and the start waits for it (so the first hit is
decided by the link as it is now, not as a predecessor saw it); at a hit
when its price of loading is still not this engine's own (the namespace had
no chunk at the start), or when one is due again (the link was found too
slow a while ago), and computes that hit meanwhile. A probe may be given
the price it is to beat: it stops once it is sure to be slower (see
:mod:`~vllm.worker.vineyard.storage.timed_reads`)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

from vllm.logger import init_logger

from vllm.worker.vineyard.backend.protocol import BackendError
from vllm.worker.vineyard.connector.lookups import VineyardCacheLookup

logger = init_logger(__name__)

#: A probe reads whole chunk files up to about this many bytes: enough for
#: a link's bandwidth to show over its round trips.
PROBE_BYTES = 1 << 20
#: ... and at most this many chunk files.
PROBE_CHUNKS = 16


class LinkProbes:
    def __init__(self, lookup: VineyardCacheLookup):
        self._lookup = lookup
        # (digests, cut_s_per_block) of the probe to run
        self._queue: queue.SimpleQueue[tuple[list[bytes], float]] = queue.SimpleQueue()
        self._results: list[tuple[int, float]] = []
        self._lock = threading.Lock()
        self._idle = threading.Event()  # cleared while a probe is queued or runs
        self._idle.set()
        threading.Thread(
            target=self._run, name="vineyard-cache-link-probe", daemon=True
        ).start()

    def start(
        self, digests: Sequence[bytes], blocks: int, cut_s_per_block: float = 0.0
    ) -> bool:
        """Time the read of the first chunk files of a prefix that holds
        ``blocks`` cached blocks, cut once sure to cost more than
        ``cut_s_per_block`` (0: never); ``False`` while another probe
        runs."""
        bpc = self._lookup.chunk_size // self._lookup.block_size
        chunks = min(blocks // bpc, PROBE_CHUNKS)
        digests = list(digests[: chunks * bpc])
        return chunks > 0 and self._put(digests, cut_s_per_block)

    def start_any(self, cut_s_per_block: float = 0.0) -> bool:
        """Time the read of whichever chunk files the namespace lists first
        (it may have none: then no price comes)."""
        return self._put([], cut_s_per_block)

    def _put(self, digests: list[bytes], cut_s_per_block: float) -> bool:
        with self._lock:
            if not self._idle.is_set():
                return False
            self._idle.clear()
        self._queue.put((digests, cut_s_per_block))
        return True

    @property
    def busy(self) -> bool:
        """A probe is queued or running."""
        return not self._idle.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the probe running to end; whether
        none runs."""
        return self._idle.wait(timeout_s)

    def take_results(self) -> list[tuple[int, float]]:
        """``(blocks, seconds)`` of the probes finished since the last call."""
        with self._lock:
            results, self._results = self._results, []
        return results

    def _run(self) -> None:
        # This thread's lookup process, started now: a probe does not wait
        # for a process to start.
        self._lookup.warm_up()
        bpc = self._lookup.chunk_size // self._lookup.block_size
        while True:
            digests, cut = self._queue.get()  # no digests: any chunk files
            chunks = len(digests) // bpc if digests else PROBE_CHUNKS
            start = time.perf_counter()
            try:
                result = self._lookup.time_reads(digests, chunks, PROBE_BYTES, cut)
            except BackendError as e:
                # Gave up after the backend timeout: at least this slow.
                logger.warning("vineyard cache link probe failed: %s", e)
                result = (bpc, time.perf_counter() - start)
            with self._lock:
                if result[0] > 0:
                    self._results.append(result)
                self._idle.set()
