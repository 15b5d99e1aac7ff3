# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Load or compute: the scheduler's live estimates of a hit's two prices,
and the decision between them (:class:`LoadCosts`).

- Loading (per cache root): the seconds per block of the workers' recent
  loads (wall time: the link, the round trips per chunk file, the readers'
  queue), the median of the last :data:`LOAD_SAMPLES`, so a root a network
  away is priced as it is now, and a change shows within a few loads.
- Computing (per engine): the engine's recent steps (from a step's
  scheduling to its output), as ``seconds = overhead + per_token *
  tokens`` (exponentially weighted least squares), at its current load:
  computing a hit takes its tokens at ``per_token`` and one step's
  overhead per step of them.

A hit is promised only when loading it is expected to finish sooner than
computing it, by :data:`MARGIN`; otherwise it is computed (counted
``tokens_not_loaded_slow``). Estimates follow changes both ways: a slower
link shows in the next loads; a link found too slow gets no loads, so at
most every :data:`PROBE_INTERVAL_S` one hit is loaded anyway as a probe,
whose price replaces the old ones (the workers stop any load that runs
slower than computing the rest, so a probe costs little). Until both
estimates exist, hits are loaded. The estimates outlive the engine
(:class:`RememberedCosts`): a restarted engine starts from the prices its
predecessor on this host saw for the same root and namespace.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from vllm.worker.vineyard.metrics import VineyardCacheMetrics

logger = logging.getLogger(__name__)

#: Loading must be expected to take at most 1/MARGIN of computing.
MARGIN = 1.25
#: A root found too slow gets one load (a probe) at most this often.
PROBE_INTERVAL_S = 10.0
#: Loads whose median prices a block (a change shows within half of them).
LOAD_SAMPLES = 5
#: Weight of the newest step in the price of a token (a few steps dominate).
NEW_STEP_WEIGHT = 0.3
#: Steps with fewer scheduled tokens than this (decode steps) say little
#: about the price of a prompt token.
MIN_STEP_TOKENS = 32
MAX_STEPS_IN_FLIGHT = 2


@dataclass
class _WeightedFit:
    """``y = a + b * x`` by exponentially weighted least squares."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - NEW_STEP_WEIGHT
        self.w = keep * self.w + 1.0
        self.x = keep * self.x + x
        self.y = keep * self.y + y
        self.xx = keep * self.xx + x * x
        self.xy = keep * self.xy + x * y

    def line(self) -> tuple[float, float] | None:
        """``(a, b)``, both >= 0; ``None`` before any sample."""
        if self.w == 0.0 or self.x <= 0.0:
            return None
        det = self.w * self.xx - self.x * self.x
        if det > 1e-6 * self.w * self.xx:
            b = (self.w * self.xy - self.x * self.y) / det
            a = (self.y - b * self.x) / self.w
            if a >= 0.0 and b > 0.0:
                return a, b
        return 0.0, self.y / self.x  # one size seen, or no line through it


class LoadCosts:
    """The scheduler's estimates and decision (see the module docstring)."""

    def __init__(
        self,
        block_size: int,
        max_step_tokens: int,
        metrics: Callable[[], VineyardCacheMetrics],
        clock: Callable[[], float] = time.monotonic,
        decide: bool = True,
    ):
        self.block_size = block_size
        # False (load policy "always"): every hit is loaded, none stopped.
        self.decide = decide
        self.max_step_tokens = max_step_tokens
        self._metrics = metrics
        self._clock = clock
        # Seconds per block of the last loads.
        self._load_s_per_block: collections.deque[float] = collections.deque(
            maxlen=LOAD_SAMPLES
        )
        self._steps_fit = _WeightedFit()  # x: tokens, y: seconds
        self._last_load_at = -float("inf")
        self._last_probe_at = -float("inf")
        self._steps: collections.deque[tuple[float, int]] = collections.deque()
        self._loading = True  # the decision last logged
        self._probing = False  # a probe was promised, its price not seen

    # ---- samples ---------------------------------------------------------

    def observe_load(self, blocks: int, seconds: float) -> None:
        """A worker's load of ``blocks`` took ``seconds`` (wall time)."""
        if blocks <= 0 or seconds <= 0.0:
            return
        if self._probing:
            # Loads are rare while hits are computed: this is the probe's,
            # a fresh price of the link that replaces the old ones.
            self._probing = False
            self._load_s_per_block.clear()
        self._load_s_per_block.append(seconds / blocks)
        self._last_load_at = self._clock()
        self._publish()

    def step_scheduled(self, num_tokens: int) -> None:
        """A step with ``num_tokens`` scheduled tokens starts now. (vLLM
        reports no output for a step without tokens; at most two steps
        are in flight, with async scheduling.)"""
        if num_tokens > 0:
            if len(self._steps) == MAX_STEPS_IN_FLIGHT:
                self._steps.popleft()  # its output never came
            self._steps.append((self._clock(), num_tokens))

    def step_finished(self) -> None:
        """The oldest step in flight ended now: its time per token."""
        if not self._steps:
            return
        started, tokens = self._steps.popleft()
        if tokens < MIN_STEP_TOKENS:
            return
        self._steps_fit.add(tokens, self._clock() - started)
        self._publish()

    # ---- estimates and the decision -------------------------------------

    @property
    def compute_s_per_token(self) -> float | None:
        """What one more prompt token costs a step now."""
        line = self._steps_fit.line()
        return None if line is None else line[1]

    def load_s(self, blocks: int) -> float | None:
        """The expected wall time of a load of ``blocks``, if known."""
        if not self._load_s_per_block:
            return None
        return statistics.median(self._load_s_per_block) * blocks

    @property
    def stop_price(self) -> float | None:
        """What a load must beat per token, or be stopped (see the
        workers' loads); ``None``: never stopped."""
        return self.compute_s_per_token if self.decide else None

    def compute_s(self, tokens: int) -> float | None:
        """The expected time to compute ``tokens`` prompt tokens."""
        line = self._steps_fit.line()
        if line is None:
            return None
        steps = -(-tokens // self.max_step_tokens)
        return line[0] * steps + line[1] * tokens

    def promise(self, hit_tokens: int) -> int:
        """How many of ``hit_tokens`` (a cached prefix, whole blocks) to
        load: all of them, or none when computing them is expected to be
        faster (but for a probe now and then)."""
        if hit_tokens <= 0 or not self.decide:
            return max(0, hit_tokens)
        load_s = self.load_s(hit_tokens // self.block_size)
        compute_s = self.compute_s(hit_tokens)
        if load_s is None or compute_s is None or load_s * MARGIN <= compute_s:
            self._log_decision(True, load_s, compute_s)
            return hit_tokens
        self._log_decision(False, load_s, compute_s)
        now = self._clock()
        if now - max(self._last_load_at, self._last_probe_at) >= PROBE_INTERVAL_S:
            self._last_probe_at = now
            self._probing = True
            return hit_tokens  # a probe: is the link faster again?
        self._metrics().add("tokens_not_loaded_slow", hit_tokens)
        return 0

    def _log_decision(
        self, loading: bool, load_s: float | None, compute_s: float | None
    ) -> None:
        if loading == self._loading:
            return
        self._loading = loading
        assert load_s is not None and compute_s is not None
        logger.warning(
            "vineyard cache: loading a hit from the root is now %s than "
            "computing it (%.1f ms vs %.1f ms for this one): hits are %s",
            "faster" if loading else "slower",
            1e3 * load_s,
            1e3 * compute_s,
            "loaded again" if loading else "computed until the link is faster",
        )

    def state(self) -> dict[str, Any]:
        """The estimates, to remember across restarts."""
        return {
            "load_s_per_block": list(self._load_s_per_block),
            "steps": asdict(self._steps_fit),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Start from remembered estimates (ignored if malformed)."""
        with contextlib.suppress(TypeError, ValueError):
            loads = [float(s) for s in state.get("load_s_per_block", [])]
            steps = _WeightedFit(**{k: float(v) for k, v in state["steps"].items()})
            self._load_s_per_block.extend(s for s in loads if s > 0)
            self._steps_fit = steps
            if self._load_s_per_block:
                self._last_load_at = self._clock()  # the next probe is due later
            self._publish()

    def _publish(self) -> None:
        gauges = {}
        per_block = self.load_s(1)
        if per_block is not None:
            gauges["load_us_per_token"] = round(1e6 * per_block / self.block_size)
        per_token = self.compute_s_per_token
        if per_token is not None:
            gauges["compute_us_per_token"] = round(1e6 * per_token)
        self._metrics().record(gauges)


#: Estimates are remembered at most this often (and at shutdown).
REMEMBER_INTERVAL_S = 60.0


class RememberedCosts:
    """The estimates of :class:`LoadCosts`, kept in a local file across
    restarts, per cache root and namespace (several engines of one host
    share the file; the last to write a key wins). Best effort: a file that
    cannot be read or written costs only a cold start."""

    def __init__(self, path: str, key: str, costs: LoadCosts):
        self._path = path
        self._key = key
        self._costs = costs
        self._saved_at = time.monotonic()
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                state = json.load(f).get(key)
            if isinstance(state, dict):
                costs.restore(state)

    def maybe_save(self) -> None:
        if time.monotonic() - self._saved_at >= REMEMBER_INTERVAL_S:
            self.save()

    def save(self) -> None:
        self._saved_at = time.monotonic()
        folder = os.path.dirname(self._path) or "."
        with contextlib.suppress(OSError, ValueError):
            os.makedirs(folder, exist_ok=True)
            doc: dict[str, Any] = {}
            with contextlib.suppress(OSError, ValueError), open(self._path) as f:
                loaded = json.load(f)
                if isinstance(loaded, dict):
                    doc = loaded
            doc[self._key] = self._costs.state()
            fd, tmp = tempfile.mkstemp(prefix=".costs-", dir=folder)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self._path)
