# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Load or compute, decided from measurements: :class:`LoadCosts` with a
fake clock and fed timings, then on vLLM's real ``Scheduler`` (a real worker
side on a real root): a slow root gets no promise, a fast one the whole
hit, a recovering one the hit again after its probe (a timed read off the
requests); and a load that turns out slower than computing stops at a chunk
boundary."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.v1.kv_connector.unit.vineyard_connector_testing import fresh_tokens
from tests.v1.kv_connector.unit.vineyard_scheduler_testing import (
    BLOCK_SIZE,
    MAX_NUM_BATCHED_TOKENS,
    Engine,
    FakeWorker,
    create_request,
    create_scheduler,
    create_vllm_config,
    make_model_dir,
)
from tests.vineyard_testing import resume_processes
from vllm.worker.vineyard.connector import load_costs
from vllm.worker.vineyard.connector.load_costs import (
    FIRST_PROBE_INTERVAL_S,
    LOOKUP_STEP_SHARE,
    LOOKUP_WAIT_SHARE,
    MARGIN,
    MAX_FIXED_SHARE,
    MAX_LOOKUPS_WAIT_S,
    MIN_STEP_TOKENS,
    PROBE_CUT,
    PROBE_INTERVAL_S,
    READ_AHEAD_STEP_SHARE,
    LoadCosts,
    RememberedCosts,
)
from vllm.worker.vineyard.connector.lookups import STEP_WAIT_S, BackgroundLookups
from vllm.worker.vineyard.connector.metadata import VineyardConnectorMetadata
from vllm.worker.vineyard.connector.vineyard_connector import VineyardConnector
from vllm.worker.vineyard.metrics import VineyardCacheMetrics

pytestmark = pytest.mark.timeout(180)

HIT = 8 * BLOCK_SIZE  # tokens
LATE_PROMPT = 3 * HIT + 1  # tokens: a prompt that takes PROMPT_STEPS steps
PROMPT_STEPS = -(-LATE_PROMPT // MAX_NUM_BATCHED_TOKENS)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def feed_compute(costs: LoadCosts, clock: FakeClock, s_per_token: float) -> None:
    """Steps of the engine that cost ``s_per_token`` per scheduled token."""
    for _ in range(10):
        costs.step_scheduled(4 * MIN_STEP_TOKENS)
        clock.now += s_per_token * 4 * MIN_STEP_TOKENS
        costs.step_finished()


def feed_loads(costs: LoadCosts, clock: FakeClock, s_per_token: float) -> None:
    """Loads of several sizes that cost ``s_per_token`` per token."""
    for blocks in (2, 8, 4, 8, 16, 8, 4, 8):
        clock.now += 0.01
        costs.observe_load(blocks, s_per_token * blocks * BLOCK_SIZE)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def metrics() -> VineyardCacheMetrics:
    return VineyardCacheMetrics(False)


@pytest.fixture
def costs(clock: FakeClock, metrics: VineyardCacheMetrics) -> LoadCosts:
    return LoadCosts(BLOCK_SIZE, lambda: metrics, clock)


def test_unknown_costs_load(costs: LoadCosts, clock: FakeClock) -> None:
    assert costs.promise(HIT) == HIT
    feed_compute(costs, clock, 1e-4)
    assert costs.promise(HIT) == HIT  # no load measured yet


def test_a_slow_root_gets_no_promise_and_a_fast_one_the_whole_hit(
    costs: LoadCosts, clock: FakeClock, metrics: VineyardCacheMetrics
) -> None:
    feed_compute(costs, clock, 1e-4)
    feed_loads(costs, clock, 1e-4 * MARGIN * 2)  # twice too slow
    assert costs.promise(HIT) == 0
    assert metrics.take()["tokens_not_loaded_slow"] == HIT
    feed_loads(costs, clock, 1e-4 / MARGIN / 2)  # twice fast enough
    assert costs.promise(HIT) == HIT
    gauges = metrics.take()
    assert gauges["load_us_per_token"] < 1e6 * 1e-4 / MARGIN
    assert gauges["compute_us_per_token"] == 100


def test_a_recovering_root_gets_the_hit_after_its_probe(
    costs: LoadCosts, clock: FakeClock
) -> None:
    feed_compute(costs, clock, 1e-4)
    feed_loads(costs, clock, 1e-3)
    assert costs.promise(HIT) == 0
    assert not costs.loads_may_win()  # no need to wait for a lookup
    clock.now += FIRST_PROBE_INTERVAL_S / 2
    assert costs.promise(HIT) == 0  # no probe yet
    clock.now += FIRST_PROBE_INTERVAL_S / 2
    assert costs.loads_may_win()  # a probe is due
    assert costs.promise(HIT) == HIT  # the probe
    assert costs.promise(HIT) == 0  # one probe per interval
    feed_loads(costs, clock, 1e-5)  # the probe and the loads after it: fast
    assert costs.promise(HIT) == HIT


class FakeProbes:
    """:class:`LinkProbes` whose probes finish when the test says."""

    def __init__(self) -> None:
        self.started: list[int] = []  # blocks of each probe started
        self.cuts: list[float] = []  # and where it stops
        self.busy = False
        self.results: list[tuple[int, float]] = []

    def start(self, digests: object, blocks: int, cut_s_per_block: float) -> bool:
        if self.busy:
            return False
        self.started.append(blocks)
        self.cuts.append(cut_s_per_block)
        self.busy = True
        return True

    def finish(self, blocks: int, seconds: float) -> None:
        self.busy = False
        self.results.append((blocks, seconds))

    def take_results(self) -> list[tuple[int, float]]:
        results, self.results = self.results, []
        return results


def test_a_probe_prices_the_link_off_the_requests(
    costs: LoadCosts, clock: FakeClock, metrics: VineyardCacheMetrics
) -> None:
    """With probes, a recovering link is priced by a timed read while its
    hit is computed: no request loads to find out."""
    probes = FakeProbes()
    costs.probes = probes  # type: ignore[assignment]
    feed_compute(costs, clock, 1e-4)
    feed_loads(costs, clock, 1e-3)  # too slow
    assert costs.promise(HIT) == 0
    assert probes.started == []
    clock.now += PROBE_INTERVAL_S
    assert costs.promise(HIT) == 0  # computed while the link is priced
    assert probes.started == [HIT // BLOCK_SIZE]
    assert not costs.loads_may_win()  # the lookup need not be waited for
    assert costs.promise(HIT) == 0  # still probing
    assert metrics.take()["tokens_not_loaded_slow"] == 3 * HIT
    probes.finish(8, 8 * 1e-6 * BLOCK_SIZE)  # fast again: replaces the old
    assert costs.promise(HIT) == HIT
    assert len(probes.started) == 1


def test_a_slow_link_is_probed_again_after_1_2_4_5_seconds(
    costs: LoadCosts, clock: FakeClock
) -> None:
    """One probe's price can be a busy moment's: a link found slow is
    probed again soon, then less and less often."""
    probes = FakeProbes()
    costs.probes = probes  # type: ignore[assignment]
    feed_compute(costs, clock, 1e-4)
    feed_loads(costs, clock, 1e-3)  # too slow
    waits = []
    start = clock.now
    while len(probes.started) < 5:
        clock.now += 0.25
        assert costs.promise(HIT) == 0
        if probes.busy:
            waits.append(clock.now - start)
            probes.finish(8, 8 * 1e-3 * BLOCK_SIZE)  # still slow
            assert costs.promise(HIT) == 0  # its price taken now
            start = clock.now
    assert waits == [1.0, 2.0, 4.0, PROBE_INTERVAL_S, PROBE_INTERVAL_S]


def test_a_probe_stops_at_twice_what_a_load_must_beat(
    costs: LoadCosts, clock: FakeClock, metrics: VineyardCacheMetrics
) -> None:
    """A probe of a slow link stops once it is sure to price a block at
    PROBE_CUT times what a load must beat; that price, a lower bound, keeps
    hits computed, and the next probe comes later."""
    probes = FakeProbes()
    costs.probes = probes  # type: ignore[assignment]
    feed_compute(costs, clock, 1e-4)
    feed_loads(costs, clock, 1e-2)  # a hundred times too slow
    clock.now += PROBE_INTERVAL_S
    assert costs.promise(HIT) == 0
    must_beat = 1e-4 * BLOCK_SIZE / MARGIN  # seconds per block
    assert probes.cuts == [pytest.approx(PROBE_CUT * must_beat)]
    probes.finish(8, 8 * PROBE_CUT * must_beat)  # cut: at least that slow
    clock.now += FIRST_PROBE_INTERVAL_S
    assert costs.promise(HIT) == 0
    assert costs.load_s(1) == pytest.approx(PROBE_CUT * must_beat)
    assert len(probes.started) == 1  # not due again yet
    assert metrics.take()["tokens_not_loaded_slow"] == 2 * HIT


def test_while_the_starts_probe_runs_the_prices_at_hand_decide(
    costs: LoadCosts, clock: FakeClock, metrics: VineyardCacheMetrics
) -> None:
    """Hits that come while the engine start's probe runs are not held to
    computing: a fast remembered price loads them, a slow one computes."""
    probes = FakeProbes()
    probes.busy = True  # the start's probe (of any chunk files)
    costs.probes = probes  # type: ignore[assignment]
    feed_compute(costs, clock, 1e-4)
    feed_loads(costs, clock, 1e-6)
    assert costs.loads_may_win()
    assert costs.promise(HIT) == HIT
    feed_loads(costs, clock, 1e-3)
    assert costs.promise(HIT) == 0
    assert metrics.take()["tokens_not_loaded_slow"] == HIT
    assert probes.started == []  # one probe at a time


class HungLookup:
    """A lookup whose timed reads wait until released (a hung root)."""

    chunk_size = BLOCK_SIZE
    block_size = BLOCK_SIZE

    def __init__(self) -> None:
        self.release = threading.Event()

    def warm_up(self) -> None:
        pass

    def time_reads(self, *args: object) -> tuple[int, float]:
        self.release.wait()
        return 1, 1e-3


def test_the_start_waits_a_bounded_time_for_its_probe(
    costs: LoadCosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(load_costs, "START_PROBE_WAIT_S", 0.2)
    lookup = HungLookup()
    started = time.monotonic()
    costs.probe_with(lookup)  # type: ignore[arg-type]
    assert 0.2 <= time.monotonic() - started < 5.0
    probes = costs.probes
    assert probes is not None and probes.busy  # still running: not waited for
    lookup.release.set()
    assert probes.wait(5.0)
    assert costs.promise(HIT) == HIT  # its price is in (nothing else known)
    assert costs.load_s(1) == pytest.approx(1e-3)


def test_with_probes_an_unknown_link_is_loaded(
    costs: LoadCosts, clock: FakeClock
) -> None:
    """Nothing known (a new root): the hit is loaded, and its load prices
    the link (it stops itself if slow); no probe."""
    probes = FakeProbes()
    costs.probes = probes  # type: ignore[assignment]
    feed_compute(costs, clock, 1e-4)
    assert costs.promise(HIT) == HIT
    assert probes.started == []


def test_a_restarted_engine_probes_before_loading(
    tmp_path: Path, clock: FakeClock, metrics: VineyardCacheMetrics
) -> None:
    """Remembered prices decide nothing about the link now: the first hit
    starts a probe and is computed; the probe's price decides the next."""
    path = str(tmp_path / "load_costs.json")
    first = LoadCosts(BLOCK_SIZE, lambda: metrics, clock)
    remembered = RememberedCosts(path, "root|ns", first)
    feed_compute(first, clock, 1e-4)
    feed_loads(first, clock, 1e-6)  # fast, then
    remembered.save()
    restarted = LoadCosts(BLOCK_SIZE, lambda: metrics, clock)
    RememberedCosts(path, "root|ns", restarted)
    probes = FakeProbes()
    restarted.probes = probes  # type: ignore[assignment]
    assert restarted.promise(HIT) == 0
    assert probes.started == [HIT // BLOCK_SIZE]
    probes.finish(8, 8 * 1e-3 * BLOCK_SIZE)  # the link is slow now
    assert restarted.promise(HIT) == 0
    assert len(probes.started) == 1  # its own price: no probe until due
    clock.now += PROBE_INTERVAL_S
    assert restarted.promise(HIT) == 0
    probes.finish(8, 8 * 1e-6 * BLOCK_SIZE)  # recovered
    assert restarted.promise(HIT) == HIT


def step(costs: LoadCosts, clock: FakeClock, tokens: int, seconds: float) -> None:
    costs.step_scheduled(tokens)
    clock.now += seconds
    costs.step_finished()


def test_computing_is_priced_by_the_tokens_of_recent_steps(
    costs: LoadCosts, clock: FakeClock
) -> None:
    """Seconds per token, weighted by tokens (large steps count most), less
    each step's fixed cost, which small (decode) steps price: a few short
    prompts' steps do not price a token far above a long hit's."""
    overhead, per_token = 0.02, 2e-4
    for tokens in (64, 1024, 64):  # no small step yet: the overhead is in
        step(costs, clock, tokens, overhead + per_token * tokens)
    price = costs.compute_s_per_token
    assert price is not None
    assert price > per_token + overhead / 1024
    for tokens in (1, 64, 1024, 8, 64, 512, 1, 1024, 96):
        step(costs, clock, tokens, overhead + per_token * tokens)
    for tokens in (64, 700, 2048):
        expected = per_token * tokens
        assert costs.compute_s(tokens) == pytest.approx(expected, rel=0.05)
    price = costs.compute_s_per_token
    assert price == pytest.approx(per_token, rel=0.05)


def test_a_long_prompts_token_is_priced_by_long_prompts_steps(
    costs: LoadCosts, clock: FakeClock
) -> None:
    """On a CPU a long prompt's token costs several times a short one's (its
    attention reaches further): each is priced by steps of its size."""
    for _ in range(3):
        step(costs, clock, 512, 512 * 1e-4)
        step(costs, clock, 4096, 4096 * 4e-4)
    assert costs.compute_s(500) == pytest.approx(500 * 1e-4)
    assert costs.compute_s(1500) == pytest.approx(1500 * 1e-4)  # nearer 512
    assert costs.compute_s(4000) == pytest.approx(4000 * 4e-4)
    assert costs.compute_s(20000) == pytest.approx(20000 * 4e-4)
    assert costs.compute_s_per_token == pytest.approx(4e-4)  # the highest
    assert costs.stop_price(500) == pytest.approx(1e-4)


@pytest.mark.parametrize("load_share", [0.4, 0.6])
def test_a_hit_is_read_ahead_when_its_load_takes_over_half_a_step(
    costs: LoadCosts, clock: FakeClock, load_share: float
) -> None:
    """A queued hit whose load takes over half a step is read ahead: a load
    started with a step might not end in it."""
    assert costs.worth_reading_ahead(HIT, 4 * MIN_STEP_TOKENS)  # nothing known
    feed_compute(costs, clock, 1e-4)
    step_s = costs.compute_s(4 * MIN_STEP_TOKENS)
    assert step_s is not None
    feed_loads(costs, clock, load_share * step_s / HIT)
    worth = costs.worth_reading_ahead(HIT, 4 * MIN_STEP_TOKENS)
    assert worth == (load_share > READ_AHEAD_STEP_SHARE)


@pytest.mark.parametrize(
    ("step_s", "wait_s"),
    [
        (0.01, STEP_WAIT_S),  # short steps: the floor
        (1.0, LOOKUP_STEP_SHARE * 1.0),
        (100.0, MAX_LOOKUPS_WAIT_S),
    ],
)
def test_lookups_are_waited_for_a_share_of_the_last_step(
    costs: LoadCosts, clock: FakeClock, step_s: float, wait_s: float
) -> None:
    assert costs.lookups_wait_s() == STEP_WAIT_S  # no step yet
    costs.step_scheduled(4 * MIN_STEP_TOKENS)
    clock.now += step_s
    costs.step_finished()
    assert costs.lookups_wait_s() == pytest.approx(wait_s)


def test_a_burst_of_slow_small_steps_takes_only_a_share_of_a_step(
    costs: LoadCosts, clock: FakeClock
) -> None:
    for _ in range(5):
        step(costs, clock, 1024, 0.2)
        step(costs, clock, 1, 10.0)  # a stall, not a step's fixed cost
    price = costs.compute_s_per_token
    assert price == pytest.approx(0.2 * (1 - MAX_FIXED_SHARE) / 1024)


def test_a_restarted_engine_starts_from_the_remembered_prices(
    costs: LoadCosts,
    clock: FakeClock,
    metrics: VineyardCacheMetrics,
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "costs.json")
    feed_compute(costs, clock, 1e-4)
    feed_loads(costs, clock, 1e-2)
    RememberedCosts(path, "root|ns", costs).save()
    again = LoadCosts(BLOCK_SIZE, lambda: metrics, clock)
    RememberedCosts(path, "root|ns", again)
    assert again.compute_s_per_token == pytest.approx(1e-4)  # known at once
    assert again.promise(HIT) == HIT  # a probe first: is the link as slow?
    assert again.promise(HIT) == 0  # known slow
    other = LoadCosts(BLOCK_SIZE, lambda: metrics, clock)
    RememberedCosts(path, "another root|ns", other)
    assert other.promise(HIT) == HIT  # nothing known: loaded
    old = {"root|ns": {"load_s_per_block": [1.0], "steps": {"tokens": 1.0}}}
    Path(path).write_text(json.dumps(old))  # an earlier version's
    earlier = LoadCosts(BLOCK_SIZE, lambda: metrics, clock)
    RememberedCosts(path, "root|ns", earlier)  # a cold start, no error
    assert earlier.compute_s_per_token is None
    Path(path).write_text("{not json")
    broken = LoadCosts(BLOCK_SIZE, lambda: metrics, clock)
    RememberedCosts(path, "root|ns", broken)  # a cold start, no error
    assert broken.promise(HIT) == HIT


# ---- on vLLM's real Scheduler -----------------------------------------------


def wait_for_probe(costs: LoadCosts) -> None:
    probes = costs.probes
    assert probes is not None
    deadline = time.monotonic() + 30.0
    while probes.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not probes.busy


def connector_costs(
    engine: Engine, clock: FakeClock, compute_s_per_token: float
) -> LoadCosts:
    """The scheduler's estimates on ``clock``, fed by the test alone as
    far as computing goes (the fake forward passes take no time), once the
    probe at the engine's start ended."""
    connector = engine.scheduler.connector
    assert isinstance(connector, VineyardConnector)
    assert connector._scheduler is not None
    costs = connector._scheduler._costs
    wait_for_probe(costs)
    costs._clock = clock
    feed_compute(costs, clock, compute_s_per_token)
    costs.step_scheduled = lambda num_tokens: None  # type: ignore[method-assign]
    costs.step_finished = lambda: None  # type: ignore[method-assign]
    return costs


def first_scheduled(engine: Engine, req_id: str, prompt: list[int]) -> int:
    """The tokens the request had when first scheduled; its lookup (started
    when it arrives) is let finish first, so that a hit computed for speed
    is counted."""
    request = engine.add(create_request(req_id, prompt))
    connector = engine.scheduler.connector
    assert isinstance(connector, VineyardConnector)
    lookups = connector._scheduler._lookup  # type: ignore[union-attr]
    assert lookups is not None
    job = lookups._jobs.get(request.request_id)
    assert job is None or job.done.wait(30.0)
    record = engine.run_until(lambda r: r.num_scheduled(request.request_id) > 0)
    new = record.new_request(request.request_id)
    assert new is not None
    engine.drain()
    return new.num_computed_tokens


def test_the_decision_on_the_real_scheduler(tmp_path: Path) -> None:
    config = create_vllm_config(
        make_model_dir(tmp_path / "model"),
        tmp_path / "root",
        enable_prefix_caching=False,
        load_policy="auto",
    )
    worker = FakeWorker(config)
    engine = Engine(create_scheduler(config), worker)
    try:
        # Computing is slow enough (10 ms per token) that a real load here
        # is always faster.
        clock = FakeClock()
        costs = connector_costs(engine, clock, 1e-2)
        prompt = fresh_tokens(HIT + 1)
        assert first_scheduled(engine, "saved", prompt) == 0
        worker.wait_for_writes()

        feed_loads(costs, clock, 1.0)  # a slow root
        assert first_scheduled(engine, "slow", prompt) == 0
        assert engine.counter("tokens_not_loaded_slow") == HIT
        assert engine.counter("loaded_tokens") == 0

        feed_loads(costs, clock, 1e-6)  # fast again
        assert first_scheduled(engine, "fast", prompt) == HIT
        assert engine.counter("loaded_tokens") == HIT

        feed_loads(costs, clock, 1.0)  # slow, then the link recovers
        assert first_scheduled(engine, "slow-again", prompt) == 0
        clock.now += PROBE_INTERVAL_S
        # The link is priced by a timed read of the hit's chunk files in a
        # lookup process; the hit is computed meanwhile.
        assert first_scheduled(engine, "probe", prompt) == 0
        wait_for_probe(costs)
        assert first_scheduled(engine, "after-probe", prompt) == HIT
        assert engine.counter("load_errors") == 0
    finally:
        engine.close()
        worker.close()


def test_an_engine_prices_the_link_at_its_start(tmp_path: Path) -> None:
    """A restarted engine's predecessor remembered a slow link; the link is
    fast now. The new engine reads some chunk files as it starts, so its
    first hit is loaded (not computed while a probe runs, as it would be on
    the remembered price)."""
    config = create_vllm_config(
        make_model_dir(tmp_path / "model"),
        tmp_path / "root",
        enable_prefix_caching=False,
        load_policy="auto",
    )
    prompt = fresh_tokens(HIT + 1)
    worker = FakeWorker(config)
    engine = Engine(create_scheduler(config), worker)
    try:
        clock = FakeClock()
        costs = connector_costs(engine, clock, 1e-2)
        assert costs.load_s(1) is None  # an empty root: no price
        assert first_scheduled(engine, "saved", prompt) == 0
        worker.wait_for_writes()
        feed_loads(costs, clock, 1.0)  # slow: remembered at shutdown
    finally:
        engine.close()
        worker.close()

    worker = FakeWorker(config)
    engine = Engine(create_scheduler(config), worker)
    try:
        connector = engine.scheduler.connector
        assert isinstance(connector, VineyardConnector)
        probes = connector._scheduler._costs.probes  # type: ignore[union-attr]
        assert probes is not None and not probes.busy  # ready once priced
        costs = connector_costs(engine, FakeClock(), 1e-2)
        assert costs.loads_may_win()  # the probe's price replaced the old
        load_s = costs.load_s(1)
        assert load_s is not None and load_s < 1e-2 * BLOCK_SIZE
        assert first_scheduled(engine, "restarted", prompt) == HIT
        assert engine.counter("tokens_not_loaded_slow") == 0
    finally:
        engine.close()
        worker.close()


def test_a_load_slower_than_computing_stops(tmp_path: Path) -> None:
    """The reader stops answering (a link that turned slow): the load stops
    once waiting costs more than computing its first segment, its tokens
    are computed, and it counts as stopped, not failed."""
    config = create_vllm_config(
        make_model_dir(tmp_path / "model"),
        tmp_path / "root",
        enable_prefix_caching=False,
        load_policy="auto",
    )
    worker = FakeWorker(config)
    engine = Engine(create_scheduler(config), worker)
    try:
        connector_costs(engine, FakeClock(), 1e-4)  # 0.1 ms per token
        prompt = fresh_tokens(HIT + 1)
        assert first_scheduled(engine, "saved", prompt) == 0
        worker.wait_for_writes()
        readers = [p for n, p in worker.cache.backend_pids().items() if n != "write"]
        for pid in readers:
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
        try:
            assert first_scheduled(engine, "stalled", prompt) == 0
        finally:
            resume_processes(readers)
        assert engine.counter("loads_stopped_slow") == 1
        assert engine.counter("tokens_not_loaded_slow") == HIT
        assert engine.counter("load_errors") == 0
    finally:
        engine.close()
        worker.close()


@dataclass
class SavedPrefix:
    """A prefix of ``HIT`` tokens saved to the root, behind a link far too
    slow to load it (hits of it are computed for speed)."""

    engine: Engine
    worker: FakeWorker
    costs: LoadCosts
    lookups: BackgroundLookups
    tokens: list[int]

    def tokens_written(self) -> int:
        self.worker.wait_for_writes()
        return self.worker.cache.metrics.snapshot()["tokens_written"]


@contextlib.contextmanager
def a_saved_prefix_behind_a_slow_link(
    tmp_path: Path, compute_s_per_token: float
) -> Iterator[SavedPrefix]:
    config = create_vllm_config(
        make_model_dir(tmp_path / "model"),
        tmp_path / "root",
        enable_prefix_caching=False,
        load_policy="auto",
    )
    worker = FakeWorker(config)
    engine = Engine(create_scheduler(config), worker)
    try:
        costs = connector_costs(engine, FakeClock(), compute_s_per_token)
        connector = engine.scheduler.connector
        assert isinstance(connector, VineyardConnector)
        lookups = connector._scheduler._lookup  # type: ignore[union-attr]
        assert lookups is not None
        saved = SavedPrefix(engine, worker, costs, lookups, fresh_tokens(HIT))
        assert first_scheduled(engine, "saved", saved.tokens + fresh_tokens(1)) == 0
        assert saved.tokens_written() == HIT
        feed_loads(costs, FakeClock(), 1.0)  # the link: far too slow
        yield saved
    finally:
        engine.close()
        worker.close()


@pytest.mark.parametrize("steps_late", [1, PROMPT_STEPS])
def test_a_hit_computed_before_its_lookup_is_in_is_not_saved_again(
    tmp_path: Path, steps_late: int
) -> None:
    """Computing is known to win, so a request whose lookup is not in
    after its share of waiting is computed at once; once the lookup is in
    (a step later, or only once the request decodes, one token longer than
    the prompt it was asked for), it is taken and counted, and the saves go
    on past the chunks found (they are cached already), on the worker too."""
    with a_saved_prefix_behind_a_slow_link(tmp_path, 1e-4) as saved:
        engine, lookups = saved.engine, saved.lookups
        ask, take, taken = lookups.lookup, lookups.take, []

        def not_in_yet(req_id: str, *args: Any) -> Any:
            return None if req_id == "late" else ask(req_id, *args)

        def in_after_steps(req_id: str, num_local_tokens: int) -> Any:
            taken.append(req_id)
            if taken.count("late") <= steps_late:
                return None
            return take(req_id, num_local_tokens)

        lookups.lookup = not_in_yet  # type: ignore[method-assign,assignment]
        lookups.take = in_after_steps  # type: ignore[method-assign]
        first = len(engine.records)
        prompt = saved.tokens + fresh_tokens(LATE_PROMPT - HIT)
        assert first_scheduled(engine, "late", prompt) == 0
        save_from = []
        for record in engine.records[first:]:
            meta = record.scheduler_output.kv_connector_metadata
            assert isinstance(meta, VineyardConnectorMetadata)
            save_from += [d.save_from for d in meta.requests if d.req_id == "late"]
        # Saved from 0 until the lookup was in, then from HIT.
        assert save_from == [0] * steps_late + [HIT] * (len(save_from) - steps_late)
        assert engine.counter("tokens_not_loaded_slow") == HIT  # counted late
        assert "late" not in lookups._jobs  # taken, not asked again
        if steps_late == 1:
            # Written: the first step's tokens (unless that update was
            # skipped, as on a busy machine: they are cached anyway), then
            # the rest.
            budget = MAX_NUM_BATCHED_TOKENS
            written = saved.tokens_written() - HIT
            counts = saved.worker.cache.metrics.snapshot()
            assert written in (2 * HIT, budget + 2 * HIT), {
                k: v
                for k, v in counts.items()
                if k.startswith(("updates_", "backend_"))
            }


@pytest.mark.parametrize("lookup_s", [0.0, 0.2])
def test_a_hit_computed_for_speed_waits_a_share_of_computing_for_its_lookup(
    tmp_path: Path, lookup_s: float
) -> None:
    """A hit computed for speed waits for its lookup (here up to 3% of
    26 s): its first step saves only past the chunks found, so the step
    copies no KV that is cached already."""
    with a_saved_prefix_behind_a_slow_link(tmp_path, 0.1) as saved:
        engine, lookups = saved.engine, saved.lookups
        wait_s = LOOKUP_WAIT_SHARE * 0.1 * 2 * HIT
        assert saved.costs.lookup_wait_s(2 * HIT) == pytest.approx(wait_s)
        find = lookups._lookup.find

        def slow_find(*args: Any) -> Any:
            time.sleep(lookup_s)  # 0.2: past the step's share of waiting
            return find(*args)

        lookups._lookup.find = slow_find  # type: ignore[method-assign,assignment]
        request = engine.add(
            create_request("computed", saved.tokens + fresh_tokens(HIT))
        )
        record = engine.run_until(lambda r: r.num_scheduled(request.request_id) > 0)
        new = record.new_request(request.request_id)
        assert new is not None and new.num_computed_tokens == 0
        meta = record.scheduler_output.kv_connector_metadata
        assert isinstance(meta, VineyardConnectorMetadata)
        assert [d.save_from for d in meta.requests if d.req_id == "computed"] == [HIT]
        engine.drain()
        assert engine.counter("tokens_not_loaded_slow") == HIT
        assert saved.tokens_written() == 2 * HIT  # only the chunks after the hit


@pytest.mark.parametrize(("step_s", "first_step"), [(0.01, False), (100.0, True)])
def test_a_far_lookup_is_waited_for_in_a_long_step(
    tmp_path: Path,
    step_s: float,
    first_step: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup a few round trips long (50 ms) is answered in the step
    that asks, and its hit's load starts there, when the engine's steps
    are long (it waits up to a share of one; the cap is raised here, as a
    loaded test machine may not answer within the real one), not a whole
    step later; after steps of 10 ms it is asked again next step (a step
    waits STEP_WAIT_S). Computing is priced high, so that a load slowed by
    a busy machine is not stopped as slower than computing."""
    monkeypatch.setattr(load_costs, "MAX_LOOKUPS_WAIT_S", 10.0)
    with a_saved_prefix_behind_a_slow_link(tmp_path, 0.1) as saved:
        engine, costs, lookups = saved.engine, saved.costs, saved.lookups
        clock = FakeClock()
        costs._clock = clock
        feed_loads(costs, clock, 1e-9)  # the link: fast again
        LoadCosts.step_scheduled(costs, 4 * MIN_STEP_TOKENS)
        clock.now += step_s
        LoadCosts.step_finished(costs)
        find = lookups._lookup.find

        def far_find(*args: Any) -> Any:
            time.sleep(0.05)
            return find(*args)

        lookups._lookup.find = far_find  # type: ignore[method-assign,assignment]
        engine.step()  # its budget is set as the step before is built
        request = engine.add(create_request("far", saved.tokens + fresh_tokens(1)))
        assert ("far" in engine.step().loads()) == first_step
        engine.run_until(lambda r: r.num_scheduled(request.request_id) > 0)
        engine.drain()
        assert engine.counter("hit_tokens") == HIT
