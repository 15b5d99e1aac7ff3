# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Metrics of the vineyard cache: names and help text (written once) and the
thread-safe recorder that the cache's parts count into. vLLM's connector
stats and Prometheus classes that publish them are in
:mod:`vllm.worker.vineyard.connector.stats`."""

from __future__ import annotations

import threading
from typing import Any

METRIC_PREFIX = "vllm:vineyard_cache_"

#: Counters: summed across steps and ranks.
COUNTERS: dict[str, str] = {
    "query_tokens": "Tokens looked up in vineyard beyond the local prefix cache.",
    "hit_tokens": "Looked-up tokens found in vineyard.",
    "lookup_stats": "File metadata calls (stat) made by lookups.",
    "lookup_timeouts": "Lookups answered as a miss because the filesystem took "
    "longer than the lookup timeout.",
    "loaded_tokens": "Tokens whose KV was loaded from vineyard (verified).",
    "load_errors": "Loads that failed or returned less than the lookup promised.",
    "corrupt_chunks": "Chunks that failed verification (or could not be read) "
    "and were removed.",
    "path_collisions": "Chunks neither loaded nor written because their path "
    "(or their ids) held another prefix's valid chunk (a hash collision), "
    "which was left in place.",
    "bytes_read": "KV bytes read from vineyard (loads only; lookups read none).",
    "bytes_written": "KV bytes written to vineyard.",
    "writer_cpu_us": "CPU time of the writer backends (writes, checksums, the "
    "root's upkeep), in microseconds.",
    "reader_cpu_us": "CPU time of the reader backends (reads, verification), "
    "in microseconds.",
    "updates_submitted": "Updates handed to the background writer.",
    "updates_completed": "Updates written without a write error.",
    "updates_skipped": "Updates skipped because every buffer was in flight.",
    "updates_failed": "Updates with a write error, backend error, timeout or death.",
    "updates_dropped": "Updates dropped at shutdown after the drain timeout.",
    "saves_dropped_freed": "Retried saves dropped because vLLM had freed the "
    "request's blocks (a sliding window moved past them); its later chunks are "
    "not saved.",
    "tokens_written": "Tokens whose KV was written to vineyard.",
    "tokens_rejected": "Tokens vineyard refused because their prefix was not "
    "cached (evicted or skipped).",
    "write_errors": "Chunk writes the filesystem failed (e.g. disk full, I/O error).",
    "chunks_skipped_for_room": "Chunks not written because the root was at its "
    "disk limit; a background sweep makes room (a write never waits for one).",
    "evicted_chunks": "Chunks evicted (least recently used) to keep the root "
    "within its budget.",
    "expired_chunks": "Chunks expired after the TTL since their last use.",
    "orphans_removed": "Temporary files and empty directories left by writers "
    "that died, removed.",
    "backend_restarts": "Restarts of a vineyard backend process.",
    "backend_start_failures": "Caches that could not start (the cache is off).",
    "unidentified_weights": "Requests served without the cache because the "
    "weights of their LoRA adapter could not be identified (or not within the "
    "lookup timeout), and engines serving without it because their model's "
    "weights could not be identified.",
    "updates_fenced": "Updates dropped, or their chunks removed, because the "
    "cache was reset after they were staged.",
    "reset_failures": "Cache resets whose removal of chunk files did not "
    "finish (the reset's fence holds regardless).",
    "tokens_not_loaded_slow": "Cached tokens computed instead of loaded because "
    "loading them was predicted, or turned out, slower than computing them "
    "(a slow link to the root); a request that does not wait for its lookup "
    "counts its hit only if the lookup was in.",
    "loads_stopped_slow": "Loads stopped at a chunk boundary because they ran "
    "slower than computing the rest; the rest was computed.",
    "loads_before_forward": "Hits loaded before the forward pass of the step "
    "that scheduled their request, which was computed in that step (cheap "
    "loads; the others load while their requests wait).",
    "read_ahead_tokens": "Cached tokens read while their request was queued, "
    "then loaded by it (loads that had them at once).",
    "read_ahead_unused_tokens": "Cached tokens read while their request was "
    "queued but not loaded by it (computed, aborted, or the cache reset).",
    "requests_opted_out": "Requests that opted out of the cache "
    "(kv_transfer_params): nothing loaded, nothing saved.",
    "unsupported_models": "Engines serving without the cache because their "
    "model's KV cache is not supported (several KV cache groups, Mamba state, "
    "attention other than full or sliding window).",
}
#: Gauges: the latest sample wins.
GAUGES: dict[str, str] = {
    "root_bytes": "Bytes of chunks under the cache root (sampled by the sweep).",
    "root_chunks": "Chunk files under the cache root (sampled by the sweep).",
    "load_us_per_token": "What loading a cached token from the root costs now "
    "(estimated from recent loads), in microseconds.",
    "compute_us_per_token": "What computing a prompt token costs this engine "
    "now (estimated from recent steps), in microseconds.",
}
#: Timing histograms (seconds), when VINEYARD_CACHE_METRICS_ENABLED=1.
HISTOGRAMS: dict[str, str] = {
    "update_queue_delay_s": "Time from an update's submit to the start of its write.",
    "update_exec_s": "Time the backend takes to write one update.",
    "save_caller_s": "Forward thread's time per save (copy and submit).",
    "load_s": "Time from a load's start on a worker to its end (all its reads, "
    "checks and copies).",
    "load_read_s": "The reader backend's time reading one load's chunks.",
    "load_verify_s": "The reader backend's time verifying one load's entries.",
    "load_copy_s": "Forward thread's time copying one load's blocks into place.",
    # Where a hit's time goes, per request with a hit, as the scheduler sees
    # it; consecutive, so they add up to its time from arrival to its first
    # forward pass's end.
    "hit_queue_s": "A request with a hit: from its arrival to its first lookup.",
    "hit_lookup_s": "A request with a hit: from its first lookup to the promise "
    "of cached tokens (the background lookup).",
    "hit_load_start_s": "A request with a hit: from the promise to its load "
    "sent to the workers (its blocks allocated).",
    "hit_load_s": "A request with a hit: from its load sent to the workers to "
    "the scheduler learning it finished.",
    "hit_promotion_s": "A request with a hit: from its load finished to its "
    "forward pass scheduled.",
    "hit_forward_s": "A request with a hit: its forward pass after the load (the "
    "tokens not loaded, at least the last one).",
}
#: The phases of a hit, in order (see HISTOGRAMS).
HIT_PHASES = (
    "hit_queue_s",
    "hit_lookup_s",
    "hit_load_start_s",
    "hit_load_s",
    "hit_promotion_s",
    "hit_forward_s",
)


class VineyardCacheMetrics:
    """Thread-safe counters and gauges (always) and timing observations
    (when enabled). :meth:`take` returns what was recorded since the last
    call (the shape vLLM's connector stats want); :attr:`totals` keeps the
    running counters."""

    def __init__(self, histograms_enabled: bool):
        self.histograms_enabled = histograms_enabled
        self._lock = threading.Lock()
        self.totals: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._delta: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._gauges: dict[str, int] = {}
        self._observations: dict[str, list[float]] = {h: [] for h in HISTOGRAMS}

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self.totals[name] += value
            self._delta[name] += value

    def record(self, stats: dict[str, int]) -> None:
        """Counters and gauges reported by a backend."""
        with self._lock:
            for name, value in stats.items():
                if name in GAUGES:
                    self._gauges[name] = value
                elif value:
                    self.totals[name] += value
                    self._delta[name] += value

    def observe(self, name: str, seconds: float) -> None:
        if self.histograms_enabled:
            with self._lock:
                self._observations[name].append(seconds)

    def take(self) -> dict[str, Any]:
        with self._lock:
            counters, self._delta = self._delta, dict.fromkeys(COUNTERS, 0)
            gauges, self._gauges = self._gauges, {}
            observations = self._observations
            self._observations = {h: [] for h in HISTOGRAMS}
        return {**counters, **gauges, **observations}

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.totals)


def histogram_metric_name(name: str) -> str:
    return f"{METRIC_PREFIX}{name.removesuffix('_s')}_seconds"
