# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Read-ahead on vLLM's real ``Scheduler`` (a real worker side on a real
root): a request with a hit queued behind a long prompt has its hit read
while it waits, and once scheduled it is loaded (a copy) before the forward
pass of the step that schedules it, even on a link priced slower than
computing (without read-ahead that hit is computed); its bytes are the
saved ones."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from vllm.v1.request import RequestStatus

from tests.v1.kv_connector.unit.test_vineyard_load_costs import (
    FakeClock,
    connector_costs,
    feed_loads,
    first_scheduled,
)
from tests.v1.kv_connector.unit.vineyard_connector_testing import fresh_tokens
from tests.v1.kv_connector.unit.vineyard_scheduler_testing import (
    BLOCK_SIZE,
    MAX_NUM_BATCHED_TOKENS,
    Engine,
    FakeWorker,
    create_request,
    create_scheduler,
    create_vllm_config,
    expected_blocks,
    make_model_dir,
)
from vllm.worker.vineyard.connector.vineyard_connector import VineyardConnector

pytestmark = pytest.mark.timeout(180)

HIT = 8 * BLOCK_SIZE  # tokens
LONG = 12 * MAX_NUM_BATCHED_TOKENS  # a prompt that takes 12 steps' budget
#: Computing is priced slow enough (160 ms per block) that a real read on a
#: busy machine is never judged slower than computing (a load stopped as
#: slow loads less than its hit).
COMPUTE_S_PER_TOKEN = 1e-2


@pytest.mark.parametrize(
    "read_ahead_buffers,load_s_per_token", [(0, 1.0), (8, 1.0), (8, 1e-6)]
)
def test_a_queued_hit_is_read_ahead_and_loaded_in_one_step(
    tmp_path: Path, read_ahead_buffers: int, load_s_per_token: float
) -> None:
    """Loading costs more than computing (1 s per token): the hit is read
    ahead and loaded, or (no read-ahead buffers) computed. Loading costs
    less than a step: no read-ahead (the load ends in a step anyway). A
    load either way costs a small share of a step (a copy, or a fast
    link): it is made before the forward pass of the step that schedules
    its request, which is computed in that step."""
    config = create_vllm_config(
        make_model_dir(tmp_path / "model"),
        tmp_path / "root",
        enable_prefix_caching=False,
        load_policy="auto",
        read_ahead_buffers=read_ahead_buffers,
    )
    worker = FakeWorker(config)
    engine = Engine(create_scheduler(config), worker)
    try:
        clock = FakeClock()
        costs = connector_costs(engine, clock, COMPUTE_S_PER_TOKEN)
        prompt = fresh_tokens(HIT + 1)
        assert first_scheduled(engine, "saved", prompt) == 0
        worker.wait_for_writes()
        feed_loads(costs, clock, load_s_per_token)
        worker.kv.fill_(-1.0)  # nothing but a load puts those bytes back

        engine.add(create_request("long", fresh_tokens(LONG)))
        engine.step()  # the long prompt takes every step's budget
        queued = engine.add(create_request("queued", prompt))
        connector = engine.scheduler.connector
        assert isinstance(connector, VineyardConnector)
        scheduler = connector._scheduler
        assert scheduler is not None and scheduler._lookup is not None
        assert scheduler._lookup._jobs["queued"].done.wait(30.0)

        ordered = False
        while queued.status == RequestStatus.WAITING:
            record = engine.step()
            meta = record.scheduler_output.kv_connector_metadata
            ordered |= any(o.req_id == "queued" for o in meta.read_aheads)  # type: ignore[union-attr]
            time.sleep(0.02)  # reads go on between steps
        slow = load_s_per_token == 1.0
        assert ordered == (read_ahead_buffers > 0 and slow)
        loaded = "queued" in record.loads()
        assert loaded == (read_ahead_buffers > 0 or not slow)
        if not loaded:  # the slow link: computed
            assert engine.counter("tokens_not_loaded_slow") == HIT
            return
        assert record.loads()["queued"].sync_wait_s is not None
        assert "queued" not in (record.kv_output.finished_recving or ())
        new = record.new_request("queued")
        assert new is not None and new.num_computed_tokens == HIT
        block_ids = worker.requests["queued"].block_ids[: HIT // BLOCK_SIZE]
        assert torch.equal(
            worker.blocks(block_ids), expected_blocks(prompt, HIT // BLOCK_SIZE)
        )
        engine.drain()
        assert engine.counter("read_ahead_tokens") == HIT * ordered
        assert engine.counter("read_ahead_unused_tokens") == 0
        assert engine.counter("load_errors") == 0
        assert engine.counter("tokens_not_loaded_slow") == 0
    finally:
        engine.close()
        worker.close()
