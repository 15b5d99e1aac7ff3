# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A request steers the cache through ``kv_transfer_params``: it opts out
(nothing loaded, nothing saved) or caps what it loads; a value that is not
understood keeps it out. The scheduler side of ``VineyardConnector``, its
lookups on chunks a real worker wrote."""

from __future__ import annotations

from typing import Any

import pytest

from tests.v1.kv_connector.unit.test_vineyard_connector_scheduler import cache_prompt
from tests.v1.kv_connector.unit.vineyard_connector_testing import (
    BLOCK_SIZE,
    CHUNK_SIZE,
    WorkerHarness,
    admit,
    fresh_tokens,
    make_layout,
    make_request,
    make_scheduler,
)
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector.request_state import NEVER

pytestmark = pytest.mark.timeout(120)


def with_params(req_id: str, prompt: list[int], params: dict[str, Any]) -> Any:
    request = make_request(req_id, prompt)
    request.kv_transfer_params = params
    return request


@pytest.mark.parametrize(
    "params,hit,cached",
    [
        ({}, 3 * CHUNK_SIZE, True),
        ({"vineyard_cache": True}, 3 * CHUNK_SIZE, True),
        ({"vineyard_cache": False}, 0, False),
        ({"vineyard_max_load_tokens": CHUNK_SIZE + 3}, CHUNK_SIZE, True),
        ({"vineyard_max_load_tokens": 0}, 0, True),
        ({"vineyard_cache": "no"}, 0, False),  # not understood: kept out
        ({"vineyard_max_load_tokens": -1}, 0, False),
        ({"other_connector_key": 1}, 3 * CHUNK_SIZE, True),
    ],
    ids=[
        "none",
        "cache-on",
        "opt-out",
        "cap",
        "cap-zero",
        "bad-switch",
        "bad-cap",
        "other-key",
    ],
)
def test_kv_transfer_params(
    config: VineyardLLMCacheConfig,
    worker: WorkerHarness,
    params: dict[str, Any],
    hit: int,
    cached: bool,
) -> None:
    prompt = fresh_tokens(3 * CHUNK_SIZE + 1)
    cache_prompt(config, worker, prompt, 3 * CHUNK_SIZE)
    sched = make_scheduler(config, [make_layout()])
    request = with_params("steered", prompt, params)
    assert admit(sched, request) == hit
    assert (sched._requests[request.request_id].save_from != NEVER) == cached
    opted_out = sched.metrics.take()["requests_opted_out"]
    assert opted_out == (0 if cached else 1)
    assert hit % BLOCK_SIZE == 0
    sched.shutdown()
