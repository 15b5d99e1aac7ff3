# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` with ``VLLM_USE_VINEYARD_CACHE=1`` and nothing else, on a
real model (SmolLM2-135M-Instruct) on loopback, through the OpenAI chat API:
a chat that shares a long system document with an earlier one gets the
document's KV from vineyard (vLLM's default multi-process engine: the plugin
runs in the spawned EngineCore), answers with the same text as a server
without the cache, shows it on ``/metrics``, and the server exits in order
on SIGINT (the drain of its background writes included).

Both servers run without vLLM's own prefix cache, so the second chat's
prefix can only come from vineyard and the reference recomputes everything.
That another engine process loads what one wrote is tested with the real
model by the main job's test (``tests/examples``) and with toy models in
``tests/v1/kv_connector/test_vineyard_engine_cross_instance.py``. The two
servers start side by side (their startup is most of the time).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vineyard_serve_testing import (
    DOCUMENT_TOKENS,
    EXIT_BOUND_S,
    QUESTIONS,
    STARTUP_TIMEOUT_S,
    Server,
    prepare_model,
)
from tests.vineyard_testing import engine_cpu, other_cpu

pytestmark = pytest.mark.engine


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[dict[str, Server]]:
    model = prepare_model()
    started = {
        "cache": Server("cache", model, tmp_path, tmp_path / "cache", engine_cpu()),
        "no-cache": Server("no-cache", model, tmp_path, None, other_cpu()),
    }
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for server in started.values():
            server.wait_ready(deadline)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.mark.timeout(720)
def test_serve_loads_a_shared_document_from_vineyard(
    servers: dict[str, Server],
) -> None:
    server, plain = servers["cache"], servers["no-cache"]
    reference = [plain.ask(q) for q in QUESTIONS]
    assert all(len(answer.split()) >= 3 for answer in reference), reference

    # The first user's chat computes the document, answers and saves it.
    assert server.ask(QUESTIONS[0]) == reference[0]
    assert server.metric("query_tokens") >= DOCUMENT_TOKENS
    assert server.metric("hit_tokens") == 0
    assert server.settle(), "background writes were not reported in time"
    assert server.metric("updates_failed") == 0
    assert server.metric("tokens_written") >= DOCUMENT_TOKENS

    # The second user's chat loads the document from vineyard and answers
    # as the server without the cache does.
    assert server.ask(QUESTIONS[1]) == reference[1]
    assert server.metric("hit_tokens") >= DOCUMENT_TOKENS
    assert server.metric("loaded_tokens") >= DOCUMENT_TOKENS
    assert server.metric("load_errors") == 0

    # An orderly exit: SIGINT, the drain, and out within the bound.
    exited = server.stop()
    assert exited, (
        f"vllm serve did not exit within {EXIT_BOUND_S} s; its log ends:\n"
        f"{server.log()[-4000:]}\nits processes:\n{server.hang_report}"
    )
    assert server.proc.returncode == 0, server.proc.returncode
    # The cache is on where, and only where, it was switched on.
    assert "vineyard cache on at" in server.log()
    assert "vineyard cache on at" not in plain.log()
