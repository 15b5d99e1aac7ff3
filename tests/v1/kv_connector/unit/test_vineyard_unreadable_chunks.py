# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A chunk file that is on the root but cannot be read (an I/O error, a
file in split-brain on a replicated filesystem) costs one failed load, not
one per request: vLLM's real ``Scheduler``, a real worker side, and a FUSE
root that fails reads of one file with EIO (``slow_fs.py``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from vllm.v1.request import Request

from tests.script_testing import mount_slow_fs
from tests.v1.kv_connector.unit.vineyard_connector_testing import fresh_tokens
from tests.v1.kv_connector.unit.vineyard_scheduler_testing import (
    BLOCK_SIZE,
    Engine,
    FakeWorker,
    create_request,
    create_scheduler,
    create_vllm_config,
    make_model_dir,
)
from tests.vineyard_testing import resume_processes

pytestmark = pytest.mark.timeout(180)


def first_scheduled(engine: Engine, request: Request) -> int:
    """The tokens a request had when first scheduled (its hit)."""
    engine.add(request)
    record = engine.run_until(lambda r: r.num_scheduled(request.request_id) > 0)
    new = record.new_request(request.request_id)
    assert new is not None
    engine.drain()
    return new.num_computed_tokens


def test_an_unreadable_chunk_is_not_promised_until_it_changes(tmp_path: Path) -> None:
    fs = mount_slow_fs(tmp_path / "fs", direct_io=True)  # every read fails
    try:
        config = create_vllm_config(
            make_model_dir(tmp_path / "model"),
            fs.mount / "root",
            chunk_size=BLOCK_SIZE,  # whatever the FUSE root's round trip
            enable_prefix_caching=False,
        )
        worker = FakeWorker(config)
        engine = Engine(create_scheduler(config), worker)
        try:
            prompt = fresh_tokens(4 * BLOCK_SIZE + 1)
            assert first_scheduled(engine, create_request("saved", prompt)) == 0
            worker.wait_for_writes()
            bad = worker.chunk_path(prompt, 2)
            fs.set(eio=[bad])
            # No write replaces the bad file meanwhile (vineyard does when a
            # failed request saves that chunk again, if it can delete it).
            writer = worker.cache.backend_pids()["write"]
            assert writer is not None
            os.kill(writer, signal.SIGSTOP)
            try:
                # Promised whole; the read fails at the bad chunk.
                loaded = first_scheduled(engine, create_request("fails", prompt))
                assert loaded == 2 * BLOCK_SIZE
                assert engine.counter("load_errors") == 1
                # Not promised again: the chunks before it load, no error.
                for i in range(3):
                    hit = first_scheduled(engine, create_request(f"again-{i}", prompt))
                    assert hit == 2 * BLOCK_SIZE
                assert engine.counter("load_errors") == 1
            finally:
                resume_processes([writer])
            # Healed (its replicas agree again: the file changes), so it is
            # promised and loaded again.
            fs.set(eio=[])
            worker.wait_for_writes()
            os.utime(bad)
            hit = first_scheduled(engine, create_request("healed", prompt))
            assert hit == 4 * BLOCK_SIZE
            assert engine.counter("load_errors") == 1
        finally:
            engine.close()
            worker.close()
    finally:
        fs.close()
