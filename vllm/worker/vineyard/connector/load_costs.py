# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Load or compute: the scheduler's live estimates of a hit's two prices,
and the decision between them (:class:`LoadCosts`).

- Loading (per cache root): the seconds per block of the workers' recent
  loads (the readers' own time reading and verifying: the link, the round
  trips per chunk file; not the steps that move loads on), the median of
  the last :data:`LOAD_SAMPLES`, so a root a network away is priced as it
  is now, and a change shows within a few loads.
- Computing (per engine): the seconds per token of the engine's recent
  steps of the hit's size (from a step's scheduling to its output; sizes
  2^k to 2^(k+1) tokens: on a CPU a long prompt's token costs several
  times a short one's), weighted by their tokens, at its current load,
  less each step's fixed cost (scheduling, sampling, the batch's
  decoding): the time of its recent small steps, which compute next to no
  prompt tokens.

A hit is promised only when loading it is expected to finish sooner than
computing it, by :data:`MARGIN`; otherwise it is computed (counted
``tokens_not_loaded_slow``). Estimates follow changes both ways: a slower
link shows in the next loads; a link found too slow gets no loads, so the
link is priced again by a probe, 1 s later, then twice as long after each
that finds it slow, up to every :data:`PROBE_INTERVAL_S`: a timed read of a
hit's first chunk files off the requests
(:class:`~.link_probes.LinkProbes`; that hit is computed meanwhile), whose
price replaces the old ones. A probe stops once it is sure to price a block
at :data:`PROBE_CUT` times what loading must beat: a link that is still
slow is read only until that shows (its price is then that lower bound).
Without probes (lookups in process) the hit itself is loaded as the probe
(the workers stop any load that runs slower than computing the rest, so it
costs little). Until both estimates exist, hits are loaded. The link is
probed as the engine starts, off any request, and the start waits for it
(up to :data:`START_PROBE_WAIT_S`; hits that come before it ends are
decided by the prices at hand); if the namespace has no chunk then, at the
first hit. The estimates outlive the engine (:class:`RememberedCosts`): a
restarted engine starts from the prices its predecessor on this host saw
for the same root and namespace (computing's until its own steps are
timed; the link's until its probe ends).
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vllm.worker.vineyard.connector.link_probes import LinkProbes
from vllm.worker.vineyard.connector.lookups import STEP_WAIT_S, VineyardCacheLookup
from vllm.worker.vineyard.metrics import VineyardCacheMetrics

logger = logging.getLogger(__name__)

#: Loading must be expected to take at most 1/MARGIN of computing.
MARGIN = 1.25
#: A root found too slow gets one probe (a timed read, or a load) after this
#: long, then twice as long after each that finds it slow, up to
#: :data:`PROBE_INTERVAL_S` (one probe's price can be a busy moment's).
FIRST_PROBE_INTERVAL_S = 1.0
PROBE_INTERVAL_S = 5.0
#: A probe stops once it is sure to price a block at this many times what a
#: load must beat (a slow link shared by several hosts is not kept busy by
#: probes that tell only that it is still slow).
PROBE_CUT = 2.0
#: Loads whose median prices a block (a change shows within half of them).
LOAD_SAMPLES = 5
#: Weight of the newest step in the price of a token (a few steps dominate).
NEW_STEP_WEIGHT = 0.3
#: Steps with fewer scheduled tokens than this (decode steps) price a
#: step's fixed cost, not a prompt token.
MIN_STEP_TOKENS = 32
#: A step's fixed cost takes at most this share of a prompt step's time
#: (a guard against a burst of slow small steps).
MAX_FIXED_SHARE = 0.8
MAX_STEPS_IN_FLIGHT = 2
#: A queued hit is read ahead when its load is expected to take more than
#: this share of a step: a load ends in the step that starts it only with
#: room to spare (its reads start after the step does, on a busy machine,
#: and a step is priced without its fixed cost).
READ_AHEAD_STEP_SHARE = 0.5
#: A prompt computed for speed waits for its lookup (which says where its
#: saves start) at most this share of computing it: a save of chunks cached
#: already costs a copy of their KV, a few percent of computing them.
LOOKUP_WAIT_SHARE = 0.03
#: A scheduler step waits for the lookups of arriving requests up to this
#: share of the engine's last step, where that is more than STEP_WAIT_S (and
#: at most MAX_LOOKUPS_WAIT_S): a lookup not answered in the step that asks
#: waits a whole step more, and a root a few round trips away answers in
#: tens of ms, not 5.
LOOKUP_STEP_SHARE = 0.05
MAX_LOOKUPS_WAIT_S = 0.1
#: The engine's start waits this long at most for its link probe (a hung
#: root delays the start by no more).
START_PROBE_WAIT_S = 3.0


@dataclass
class _Size:
    """Recent steps of one size: tokens, seconds and weight, exponentially
    weighted (large steps count most)."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0


class _StepTimes:
    """The seconds per token of recent prompt steps, per size (steps of
    2^k to 2^(k+1) tokens: on a CPU a long prompt's token costs several
    times a short one's, its attention reaching further), less each step's
    fixed cost: the seconds of recent small steps."""

    def __init__(self) -> None:
        self.sizes: dict[int, _Size] = {}
        self.small_seconds = 0.0  # of the small steps, weighted
        self.small_steps = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        keep = 1.0 - NEW_STEP_WEIGHT
        if tokens < MIN_STEP_TOKENS:
            self.small_seconds = keep * self.small_seconds + seconds
            self.small_steps = keep * self.small_steps + 1.0
            return
        size = self.sizes.setdefault(tokens.bit_length(), _Size())
        size.tokens = keep * size.tokens + tokens
        size.seconds = keep * size.seconds + seconds
        size.steps = keep * size.steps + 1.0

    def per_token(self, tokens: int | None = None) -> float | None:
        """For a prompt of ``tokens``: the price of the steps nearest its
        size (of the larger on a tie); ``None``: the highest of any size."""
        if not self.sizes:
            return None
        if tokens is None:
            return max(self._price(size) for size in self.sizes.values())
        k = max(tokens, 1).bit_length()
        nearest = min(self.sizes, key=lambda s: (abs(s - k), -s))
        return self._price(self.sizes[nearest])

    def _price(self, size: _Size) -> float:
        small = self.small_seconds / self.small_steps if self.small_steps else 0.0
        fixed = min(small * size.steps, MAX_FIXED_SHARE * size.seconds)
        return (size.seconds - fixed) / size.tokens

    def state(self) -> dict[str, Any]:
        return {
            "sizes": {str(k): asdict(size) for k, size in self.sizes.items()},
            "small": [self.small_seconds, self.small_steps],
        }

    def restore(self, state: dict[str, Any]) -> None:
        sizes = {int(k): _Size(**v) for k, v in state["sizes"].items()}
        small_seconds, small_steps = (float(x) for x in state["small"])
        self.sizes = {k: s for k, s in sizes.items() if s.tokens > 0}
        self.small_seconds, self.small_steps = small_seconds, small_steps


class LoadCosts:
    """The scheduler's estimates and decision (see the module docstring)."""

    def __init__(
        self,
        block_size: int,
        metrics: Callable[[], VineyardCacheMetrics],
        clock: Callable[[], float] = time.monotonic,
        decide: bool = True,
    ):
        self.block_size = block_size
        # False (load policy "always"): every hit is loaded, none stopped.
        self.decide = decide
        self._metrics = metrics
        self._clock = clock
        # Seconds per block of the last loads.
        self._load_s_per_block: collections.deque[float] = collections.deque(
            maxlen=LOAD_SAMPLES
        )
        self._steps = _StepTimes()
        self._last_load_at = -float("inf")
        self._last_probe_at = -float("inf")
        self._probe_interval = FIRST_PROBE_INTERVAL_S
        self._hit_probe = False  # the probe running was started at a hit
        self._in_flight: collections.deque[tuple[float, int]] = collections.deque()
        self._last_step_s = 0.0
        self._loading = True  # the decision last logged
        self._probing = False  # a probe was promised, its price not seen
        # The link's price from this engine's own loads or probes (not only
        # remembered from a predecessor).
        self._own_price = False
        self.probes: LinkProbes | None = None  # timed reads off the requests

    def probe_with(self, lookup: VineyardCacheLookup) -> None:
        """Price the link by timed reads in ``lookup``'s processes (on a
        thread of their own), not by loading hits; the first now, of any
        chunk files, waited for up to :data:`START_PROBE_WAIT_S` (the engine
        is not ready yet: its first hits are decided by the link as it is
        now, and no process starts on its core as they come)."""
        if not self.decide:
            return
        self.probes = LinkProbes(lookup)
        per_token = self.compute_s_per_token  # a predecessor's, if any
        self.probes.start_any(self._probe_cut(per_token or 0.0))
        if not self.probes.wait(START_PROBE_WAIT_S):
            logger.warning(
                "vineyard cache: the link probe at the start did not end "
                "within %.0f s: hits are decided by remembered prices meanwhile",
                START_PROBE_WAIT_S,
            )
            return
        self._take_probes()
        per_block = self.load_s(1)
        if per_block is not None:
            logger.info(
                "vineyard cache: the root reads a block in %.2f ms",
                1e3 * per_block,
            )

    # ---- samples ---------------------------------------------------------

    def observe_load(self, blocks: int, seconds: float) -> None:
        """A worker's load of ``blocks`` took its readers ``seconds``."""
        if blocks <= 0 or seconds <= 0.0:
            return
        if self._probing:
            # Loads are rare while hits are computed: this is the probe's,
            # a fresh price of the link that replaces the old ones.
            self._probing = False
            self._load_s_per_block.clear()
        self._load_s_per_block.append(seconds / blocks)
        self._own_price = True
        self._last_load_at = self._clock()
        self._publish()

    def _take_probes(self) -> None:
        """A probe's price replaces the old ones (loads are rare while hits
        are computed)."""
        for blocks, seconds in self.probes.take_results() if self.probes else ():
            self._probing = True
            self.observe_load(blocks, seconds)

    def step_scheduled(self, num_tokens: int) -> None:
        """A step with ``num_tokens`` scheduled tokens starts now. (vLLM
        reports no output for a step without tokens; at most two steps
        are in flight, with async scheduling.)"""
        if num_tokens > 0:
            if len(self._in_flight) == MAX_STEPS_IN_FLIGHT:
                self._in_flight.popleft()  # its output never came
            self._in_flight.append((self._clock(), num_tokens))

    def step_finished(self) -> None:
        """The oldest step in flight ended now: its time per token."""
        self._take_probes()
        if not self._in_flight:
            return
        started, tokens = self._in_flight.popleft()
        self._last_step_s = self._clock() - started
        self._steps.add(tokens, self._last_step_s)
        self._publish()

    # ---- estimates and the decision -------------------------------------

    @property
    def compute_s_per_token(self) -> float | None:
        """What computing a prompt token costs now, at most (in the longest
        prompts' steps)."""
        return self._steps.per_token()

    @property
    def last_step_s(self) -> float:
        """How long the engine's last step took (0 before the first)."""
        return self._last_step_s

    def load_s(self, blocks: int) -> float | None:
        """The expected time of a load of ``blocks``, if known."""
        if not self._load_s_per_block:
            return None
        return statistics.median(self._load_s_per_block) * blocks

    def stop_price(self, hit_tokens: int) -> float | None:
        """What a load of ``hit_tokens`` must beat per token, or be stopped
        (see the workers' loads); ``None``: never stopped."""
        return self._steps.per_token(hit_tokens) if self.decide else None

    def compute_s(self, tokens: int) -> float | None:
        """The expected time to compute a prompt's ``tokens``."""
        per_token = self._steps.per_token(tokens)
        return None if per_token is None else per_token * tokens

    def lookup_wait_s(self, tokens: int) -> float:
        """How long a prompt of ``tokens`` computed for speed may wait for
        its lookup: :data:`LOOKUP_WAIT_SHARE` of computing them."""
        compute_s = self.compute_s(tokens)
        return 0.0 if compute_s is None else LOOKUP_WAIT_SHARE * compute_s

    def lookups_wait_s(self) -> float:
        """How long the next scheduler step may wait in all for lookups
        (see :data:`LOOKUP_STEP_SHARE`)."""
        share = min(LOOKUP_STEP_SHARE * self._last_step_s, MAX_LOOKUPS_WAIT_S)
        return max(STEP_WAIT_S, share)

    def worth_reading_ahead(self, hit_tokens: int, step_tokens: int) -> bool:
        """Whether loading ``hit_tokens`` is expected to take more than
        :data:`READ_AHEAD_STEP_SHARE` of a step of ``step_tokens`` (or
        either is not known yet): then a queued request's hit is read ahead,
        as its load might not end in the step that starts it."""
        load_s = self.load_s(hit_tokens // self.block_size)
        step_s = self.compute_s(step_tokens)
        if load_s is None or step_s is None:
            return True
        return load_s > READ_AHEAD_STEP_SHARE * step_s

    def loads_may_win(self) -> bool:
        """Whether a hit of any length may be loaded now: not while loading
        a token is known to cost more than computing it, unless a probe is
        due (then the caller need not wait for a lookup to compute)."""
        self._take_probes()
        per_block, per_token = self.load_s(1), self.compute_s_per_token
        if self._probing_a_hit():
            return False  # hits are computed while the link is priced
        if not self.decide or per_block is None or per_token is None:
            return True
        if per_block * MARGIN <= per_token * self.block_size:
            return True
        return self._probe_due()

    def _probe_due(self) -> bool:
        since = max(self._last_load_at, self._last_probe_at)
        return self._clock() - since >= self._probe_interval

    def _probing_a_hit(self) -> bool:
        """A probe started at a hit runs: the link was found slow (or is not
        this engine's to know), so hits are computed until it ends. While
        the engine start's probe runs, the prices at hand decide."""
        return self.probes is not None and self.probes.busy and self._hit_probe

    def _probe_cut(self, compute_s_per_token: float) -> float:
        """Where a probe stops (see :data:`PROBE_CUT`): seconds per block."""
        return PROBE_CUT * compute_s_per_token * self.block_size / MARGIN

    def _probed(self) -> None:
        self._last_probe_at = self._clock()
        self._probe_interval = min(2 * self._probe_interval, PROBE_INTERVAL_S)

    def declined(self, hit_tokens: int) -> None:
        """``hit_tokens`` found cached are computed for speed."""
        self._metrics().add("tokens_not_loaded_slow", hit_tokens)

    def promise(self, hit_tokens: int, digests: Sequence[bytes] = ()) -> int:
        """How many of ``hit_tokens`` (a cached prefix, whole blocks, of the
        prompt whose block digests are ``digests``) to load: all of them, or
        none when computing them is expected to be faster, or while the
        link is priced (a probe of this hit's chunk files)."""
        if hit_tokens <= 0 or not self.decide:
            return max(0, hit_tokens)
        self._take_probes()
        load_s = self.load_s(hit_tokens // self.block_size)
        compute_s = self.compute_s(hit_tokens)
        if load_s is None or compute_s is None:
            return hit_tokens  # its load prices the link (and stops if slow)
        wins = load_s * MARGIN <= compute_s
        if self.probes is not None:
            due = (not self._own_price or not wins) and self._probe_due()
            cut = self._probe_cut(compute_s / hit_tokens)
            blocks = hit_tokens // self.block_size
            if due and self.probes.start(digests, blocks, cut):
                self._hit_probe = True
                self._probed()
            if self._probing_a_hit():
                self.declined(hit_tokens)  # computed while the link is priced
                return 0
        if wins:
            self._log_decision(True, load_s, compute_s)
            self._probe_interval = FIRST_PROBE_INTERVAL_S
            return hit_tokens
        self._log_decision(False, load_s, compute_s)
        if self._probe_due() and self.probes is None:
            self._probed()
            self._probing = True
            return hit_tokens  # a probe: is the link faster again?
        self.declined(hit_tokens)
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
            "steps": self._steps.state(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Start from remembered estimates (ignored if malformed)."""
        with contextlib.suppress(AttributeError, KeyError, TypeError, ValueError):
            loads = [float(s) for s in state.get("load_s_per_block", [])]
            steps = _StepTimes()
            steps.restore(state["steps"])
            self._load_s_per_block.extend(s for s in loads if s > 0)
            self._steps = steps
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
