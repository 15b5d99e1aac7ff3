# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Loads before the forward pass of the step that schedules their request
(vLLM's synchronous loads), on vLLM's real ``Scheduler`` with a real worker
side on a real root: a hit expected to load within a small share of a step
is loaded so and computed in that step; a dearer one waits in
``WAITING_FOR_REMOTE_KVS`` for a step; one that comes up short reports its
blocks in that step, vLLM recomputes them, and nothing that step computed
on them is saved."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from tests.v1.kv_connector.unit.test_vineyard_load_costs import (
    FakeClock,
    connector_costs,
    feed_loads,
    first_scheduled,
)
from tests.v1.kv_connector.unit.vineyard_connector_testing import fresh_tokens
from tests.v1.kv_connector.unit.vineyard_scheduler_testing import (
    BLOCK_SIZE,
    Engine,
    FakeWorker,
    create_request,
    create_vllm_config,
    expected_blocks,
    make_model_dir,
    running,
)
from vllm.worker.vineyard.connector import load_orders
from vllm.worker.vineyard.connector.load_orders import LoadOrders
from vllm.worker.vineyard.connector.vineyard_connector import VineyardConnector
from vllm.worker.vineyard.transfer.load_jobs import SegmentRead
from vllm.worker.vineyard.transfer.saves import SaveRequest

pytestmark = pytest.mark.timeout(180)

CHUNK = 2 * BLOCK_SIZE
HIT = 8 * BLOCK_SIZE  # tokens: four chunks
#: Computing priced at 10 ms a token: steps of 1.28 s (the fed ones).
COMPUTE_S_PER_TOKEN = 1e-2
STEP_S = COMPUTE_S_PER_TOKEN * 4 * 32


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Engine, FakeWorker]]:
    config = create_vllm_config(
        make_model_dir(tmp_path / "model"),
        tmp_path / "root",
        chunk_size=CHUNK,
        enable_prefix_caching=False,
        load_policy="auto",
    )
    with running(config) as rig:
        yield rig


def saved_hit(engine: Engine, worker: FakeWorker, load_s_per_token: float) -> list[int]:
    """A prompt whose first ``HIT`` tokens are saved; loads priced at
    ``load_s_per_token``; the worker's KV blanked (only a load fills it)."""
    costs = connector_costs(engine, FakeClock(), COMPUTE_S_PER_TOKEN)
    prompt = fresh_tokens(HIT + 1)
    assert first_scheduled(engine, "saved", prompt) == 0
    worker.wait_for_writes()
    feed_loads(costs, FakeClock(), load_s_per_token)
    worker.kv.fill_(-1.0)
    return prompt


def add_looked_up(
    engine: Engine, req_id: str, prompt: list[int], max_tokens: int = 2
) -> Request:
    request = engine.add(create_request(req_id, prompt, max_tokens=max_tokens))
    connector = engine.scheduler.connector
    assert isinstance(connector, VineyardConnector)
    lookups = connector._scheduler._lookup  # type: ignore[union-attr]
    assert lookups is not None and lookups._jobs[req_id].done.wait(30.0)
    return request


@pytest.mark.parametrize(
    "load_s_per_token,alone,in_its_step",
    [
        (1e-6, False, True),
        # A load of the hit takes 3/4 of a step (more than the largest
        # share), still faster than computing it: a step later, unless
        # the request is alone in the engine (it delays no other).
        (0.75 * STEP_S / HIT, False, False),
        (0.75 * STEP_S / HIT, True, True),
    ],
)
def test_a_cheap_hit_is_loaded_and_computed_in_one_step(
    engine: tuple[Engine, FakeWorker],
    load_s_per_token: float,
    alone: bool,
    in_its_step: bool,
) -> None:
    eng, worker = engine
    prompt = saved_hit(eng, worker, load_s_per_token)
    if not alone:  # a request decoding beside it
        eng.add(create_request("other", fresh_tokens(BLOCK_SIZE), max_tokens=64))
        eng.run_until(lambda r: r.num_scheduled("other") > 0)
    request = add_looked_up(eng, "hit", prompt)
    record = eng.run_until(lambda r: "hit" in r.loads())
    assert (record.loads()["hit"].sync_wait_s is not None) == in_its_step
    assert (record.num_scheduled("hit") > 0) == in_its_step
    if in_its_step:
        assert request.status == RequestStatus.RUNNING
        assert "hit" not in (record.kv_output.finished_recving or ())
    else:
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        record = eng.run_until(lambda r: r.num_scheduled("hit") > 0)
    new = record.new_request("hit")
    assert new is not None and new.num_computed_tokens == HIT
    block_ids = worker.requests["hit"].block_ids[: HIT // BLOCK_SIZE]
    assert torch.equal(
        worker.blocks(block_ids), expected_blocks(prompt, HIT // BLOCK_SIZE)
    )
    eng.drain()
    assert eng.counter("loaded_tokens") == HIT
    assert eng.counter("load_errors") == 0


def test_a_short_load_in_its_step_is_recomputed_and_not_saved(
    engine: tuple[Engine, FakeWorker],
) -> None:
    """A chunk file removed after the lookup found it: the load before the
    forward pass stops there, its blocks from there are reported in that
    step, vLLM recomputes them (the request's blocks hold its KV), the
    step saves nothing of the request, and a later save writes the chunk
    again."""
    eng, worker = engine
    prompt = saved_hit(eng, worker, 1e-6)
    add_looked_up(eng, "short", prompt)
    os.remove(worker.chunk_path(prompt, 2))
    saves: list[Sequence[SaveRequest]] = []
    save = worker.cache.saves.save

    def recorded_save(requests: Sequence[SaveRequest]) -> bool:
        saves.append(requests)
        return save(requests)

    worker.cache.saves.save = recorded_save  # type: ignore[method-assign]

    record = eng.run_until(lambda r: "short" in r.loads())
    assert record.loads()["short"].sync_wait_s is not None
    block_ids = worker.requests["short"].block_ids
    lost = set(block_ids[2 * CHUNK // BLOCK_SIZE : HIT // BLOCK_SIZE])
    assert record.kv_output.invalid_block_ids == lost
    # No rank saves what the step computed on the blocks the load left.
    (held,) = [s for s in saves[-1] if s.req_id == "short"]
    assert held.save_from >= held.num_computed_tokens
    eng.drain()
    assert eng.counter("load_errors") == 1
    assert eng.counter("loaded_tokens") == 2 * CHUNK
    finished_blocks, finished_kv = worker.finished["short"]
    assert finished_blocks[: HIT // BLOCK_SIZE] == block_ids[: HIT // BLOCK_SIZE]
    n = HIT // BLOCK_SIZE
    assert torch.equal(finished_kv[:, :n], expected_blocks(prompt, n))

    worker.wait_for_writes()
    assert os.path.exists(worker.chunk_path(prompt, 2))  # saved again
    worker.kv.fill_(-1.0)
    add_looked_up(eng, "again", prompt)
    record = eng.run_until(lambda r: r.num_scheduled("again") > 0)
    new = record.new_request("again")
    assert new is not None and new.num_computed_tokens == HIT
    again = worker.requests["again"].block_ids[:n]
    assert torch.equal(worker.blocks(again), expected_blocks(prompt, n))


def test_a_load_in_its_step_stops_when_its_wait_is_over(
    engine: tuple[Engine, FakeWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load before the forward pass that is not done when its wait is
    over (none here) stops where it is: the forward pass is not held up, the
    blocks it left are reported in that step and recomputed (counted as a
    load stopped for speed), and the request's KV is whole."""
    eng, worker = engine
    prompt = saved_hit(eng, worker, 1e-6)
    monkeypatch.setattr(load_orders, "SYNC_WAIT_FACTOR", 0.0)
    monkeypatch.setattr(load_orders, "SYNC_WAIT_SLACK_S", 0.0)
    monkeypatch.setattr(load_orders, "SYNC_WAIT_STEPS", 0.0)
    add_looked_up(eng, "stopped", prompt)
    record = eng.run_until(lambda r: "stopped" in r.loads())
    assert record.loads()["stopped"].sync_wait_s == 0.0
    assert record.kv_output.invalid_block_ids
    eng.drain()
    assert eng.counter("loads_stopped_slow") == 1
    assert eng.counter("loaded_tokens") < HIT
    assert eng.counter("load_errors") == 0
    n = HIT // BLOCK_SIZE
    _, finished_kv = worker.finished["stopped"]
    assert torch.equal(finished_kv[:, :n], expected_blocks(prompt, n))


def test_the_forward_pass_never_runs_beside_its_requests_load(
    engine: tuple[Engine, FakeWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load before the forward pass whose reader waits for a CPU is not
    stopped at its ``stop_at`` (computing the rest would wait for one too):
    it is waited for until done, never left loading while the pass attends
    to its request's blocks (the pass would read blocks not filled yet)."""
    eng, worker = engine
    prompt = saved_hit(eng, worker, 1e-6)
    monkeypatch.setattr(load_orders, "SYNC_WAIT_FACTOR", 0.0)
    monkeypatch.setattr(load_orders, "SYNC_WAIT_SLACK_S", 0.0)
    monkeypatch.setattr(load_orders, "SYNC_WAIT_STEPS", 0.0)
    # Every read's reader waits for a CPU: its deadline moves past stop_at.
    monkeypatch.setattr(SegmentRead, "cpu_wait_s", lambda self, now: 60.0)
    n = HIT // BLOCK_SIZE
    at_pass: list[tuple[bool, torch.Tensor]] = []
    forward = worker._forward

    def recorded_forward(so: SchedulerOutput) -> tuple[list[str], list[list[int]]]:
        if "hit" in so.num_scheduled_tokens:
            block_ids = worker.requests["hit"].block_ids[:n]
            at_pass.append(
                (worker.cache.loads.loading("hit"), worker.blocks(block_ids))
            )
        return forward(so)

    monkeypatch.setattr(worker, "_forward", recorded_forward)
    add_looked_up(eng, "hit", prompt)
    record = eng.run_until(lambda r: "hit" in r.loads())
    assert record.loads()["hit"].sync_wait_s == 0.0
    assert not record.kv_output.invalid_block_ids
    loading, kv = at_pass[0]
    assert not loading
    assert torch.equal(kv, expected_blocks(prompt, n))
    eng.drain()
    assert eng.counter("loaded_tokens") == HIT
    assert eng.counter("loads_stopped_slow") == 0


@pytest.mark.parametrize("requests,loads", [(0, 32), (1, 32), (3, 16), (9, 6)])
def test_a_steps_loads_may_take_a_step_divided_by_its_requests(
    requests: int, loads: int
) -> None:
    """A step of 1 s with ``requests`` requests before: loads of 1/64 s each
    are made before the forward pass until they would take more than a
    step divided by one more request than that (half a step at most)."""
    costs = SimpleNamespace(last_step_s=1.0, load_s=lambda blocks: blocks / 64)
    orders = LoadOrders(costs, BLOCK_SIZE)  # type: ignore[arg-type]
    step = SimpleNamespace(
        total_num_scheduled_tokens=requests,
        num_scheduled_tokens={f"r{i}": 1 for i in range(requests)},
    )
    orders.step_scheduled(step)  # type: ignore[arg-type]
    made = 0
    while orders.sync_wait_s(BLOCK_SIZE) is not None:
        made += 1
    assert made == loads
    orders.step_scheduled(SimpleNamespace(total_num_scheduled_tokens=0))  # type: ignore[arg-type]
    assert orders.sync_wait_s(BLOCK_SIZE) is not None  # a new step's budget


def test_a_request_finished_in_its_load_step_saves_what_it_computed(
    engine: tuple[Engine, FakeWorker],
) -> None:
    """A request whose hit is loaded before the forward pass that computes
    the rest of its prompt and whose one output token finishes it: the
    chunks that step computed are saved (a later request finds them)."""
    eng, worker = engine
    prompt = saved_hit(eng, worker, 1e-6)
    longer = prompt[:HIT] + fresh_tokens(2 * CHUNK + 1)
    request = add_looked_up(eng, "longer", longer, max_tokens=1)
    record = eng.run_until(lambda r: "longer" in r.loads())
    assert record.loads()["longer"].sync_wait_s is not None
    eng.drain()
    assert request.is_finished()
    worker.wait_for_writes()
    for chunk in range(HIT // CHUNK, (HIT + 2 * CHUNK) // CHUNK):
        assert os.path.exists(worker.chunk_path(longer, chunk)), chunk
