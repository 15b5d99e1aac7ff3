# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA adapters are identified off the scheduler's thread, and an adapter
that cannot be identified costs its requests the cache, never the engine:
the scheduler side of ``VineyardConnector`` without an engine, its lookups
on a real root."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
from vllm.lora.request import LoRARequest

from tests.v1.kv_connector.unit.vineyard_connector_testing import (
    CHUNK_SIZE,
    admit,
    fresh_tokens,
    make_layout,
    make_request,
    make_scheduler,
)
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector import weight_identity
from vllm.worker.vineyard.connector.request_state import NEVER
from vllm.worker.vineyard.storage import weights

pytestmark = pytest.mark.timeout(120)


def make_adapter(path: Path) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (path / "adapter_model.safetensors").write_bytes(b"weights" * 100)
    return str(path)


@pytest.mark.parametrize(
    "error", [FileNotFoundError(2, "No such file or directory"), RuntimeError("bug")]
)
def test_an_adapter_that_cannot_be_identified_is_served_uncached(
    config: VineyardLLMCacheConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: Exception,
) -> None:
    """Its folder vanishes while it is read (or the identification fails
    otherwise): its requests are neither loaded nor saved, counted, logged
    once; the scheduler goes on."""

    def fail(self: weights.FileDigests, path: str) -> str:
        raise error

    monkeypatch.setattr(weights.FileDigests, "digest", fail)
    sched = make_scheduler(config, [make_layout()])
    lora = LoRARequest("vanishing", 1, make_adapter(tmp_path / "adapter"))
    prompt = fresh_tokens(3 * CHUNK_SIZE + 1)
    for i in range(2):
        req = make_request(f"uncached-{i}", prompt, lora_request=lora)
        assert admit(sched, req) == 0
        assert sched._requests[req.request_id].save_from == NEVER
    assert sched.metrics.take()["unidentified_weights"] == 2
    logged = [r for r in caplog.records if "cannot be identified" in r.getMessage()]
    assert len(logged) == 1
    # A request without the adapter is cached as before.
    plain = make_request("plain", prompt)
    admit(sched, plain)
    assert sched._requests[plain.request_id].save_from != NEVER
    sched.shutdown()


def test_an_adapter_is_identified_off_the_scheduler_thread(
    config: VineyardLLMCacheConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While an adapter's files are read (a slow filesystem), its requests
    wait as for a lookup and the scheduler's calls return at once; once
    known, they are cached; past the lookup timeout they run uncached."""
    release = threading.Event()
    real = weight_identity.adapter_identity

    def slow(lora_path: str) -> str:
        assert release.wait(30)
        return real(lora_path)

    monkeypatch.setattr(weight_identity, "adapter_identity", slow)
    sched = make_scheduler(config, [make_layout()])
    lora = LoRARequest("slow", 1, make_adapter(tmp_path / "adapter"))
    prompt = fresh_tokens(2 * CHUNK_SIZE + 1)
    req = make_request("waits", prompt, lora_request=lora)
    for _ in range(3):
        start = time.monotonic()
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
        assert time.monotonic() - start < 0.1
    release.set()
    assert admit(sched, req) == 0  # identified: a miss, and saved
    assert sched._requests[req.request_id].save_from == 0
    sched.shutdown()

    # Past the lookup timeout, a request runs uncached.
    release.clear()
    quick = dataclasses.replace(config, lookup_timeout_s=0.2)
    sched = make_scheduler(quick, [make_layout()])
    late = make_request(
        "late", prompt, lora_request=LoRARequest("slow", 2, lora.lora_path)
    )
    assert sched.get_num_new_matched_tokens(late, 0) == (None, False)
    sched._requests[late.request_id].asked_at -= 1.0  # its deadline passed
    assert sched.get_num_new_matched_tokens(late, 0) == (0, False)
    assert sched._requests[late.request_id].save_from == NEVER
    release.set()
    sched.shutdown()
