# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where a cache hit's time goes, per request, as the scheduler sees it:
from the request's arrival, its first lookup, the promise of cached tokens,
the load sent to the workers, the load reported finished, the forward pass
scheduled, to that forward pass's end. The phases between these moments
(``HIT_PHASES``) are consecutive, so they add up to the request's time to
its first token, but for the front end's work before arrival and after.
The workers split the load itself (read, verify, copy: ``load_*_s``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm.worker.vineyard.metrics import HIT_PHASES, VineyardCacheMetrics


@dataclass
class HitTimeline:
    """The moments of one request's hit (``time.monotonic()``; the arrival
    is vLLM's wall-clock ``arrival_time``)."""

    arrival: float  # wall clock
    asked: float = field(default_factory=time.monotonic)
    asked_wall: float = field(default_factory=time.time)
    promised: float | None = None
    load_sent: float | None = None
    loaded: float | None = None
    scheduled: float | None = None

    def answered(self, num_hit: int) -> bool:
        """A lookup answered; whether this is still a hit to time (the first
        promise counts; a request found with nothing is not timed)."""
        if self.promised is None and num_hit > 0:
            self.promised = time.monotonic()
        return self.promised is not None

    def sent(self) -> None:
        if self.promised is not None and self.load_sent is None:
            self.load_sent = time.monotonic()

    def finished_loading(self) -> None:
        if self.load_sent is not None and self.loaded is None:
            self.loaded = time.monotonic()

    def forward_scheduled(self) -> bool:
        """Its forward pass after the load was scheduled now; whether this
        is that pass (the timeline then waits for :meth:`observe`)."""
        if self.loaded is None or self.scheduled is not None:
            return False
        self.scheduled = time.monotonic()
        return True

    def observe(self, metrics: VineyardCacheMetrics) -> None:
        """The forward pass ended: record every phase."""
        assert self.promised is not None and self.load_sent is not None
        assert self.loaded is not None and self.scheduled is not None
        moments = [self.asked, self.promised, self.load_sent, self.loaded]
        moments += [self.scheduled, time.monotonic()]
        durations = [max(0.0, self.asked_wall - self.arrival)]
        durations += [b - a for a, b in zip(moments, moments[1:], strict=False)]
        for phase, seconds in zip(HIT_PHASES, durations, strict=True):
            metrics.observe(phase, seconds)
