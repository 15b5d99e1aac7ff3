# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``VineyardConnector`` under vLLM's real ``Scheduler``, in-process.

vLLM's scheduler builds the SCHEDULER-role connector itself and decides
everything it decides in an engine (local prefix-cache hits, admission,
``WAITING_FOR_REMOTE_KVS``, recomputation after load errors, aborts); a
WORKER-role connector over real CPU KV tensors and real vineyard backend
processes runs each step's metadata in the model runner's order (see
:mod:`vineyard_scheduler_testing`). No model runs: the fake worker writes
deterministic KV for the tokens it computes, so the bytes a load puts in a
block are checked against what was saved.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from tests.v1.kv_connector.unit.vineyard_connector_testing import fresh_tokens
from tests.v1.kv_connector.unit.vineyard_scheduler_testing import (
    BLOCK_SIZE,
    MAX_NUM_BATCHED_TOKENS,
    NUM_BLOCKS,
    Engine,
    FakeWorker,
    StepRecord,
    assert_scheduler_empty,
    corrupt_entry,
    create_request,
    create_scheduler,
    create_vllm_config,
    expected_blocks,
    make_model_dir,
)
from tests.vineyard_testing import resume_processes, wait_until
from vllm.worker.vineyard.connector.load_orders import LoadOrders
from vllm.worker.vineyard.connector.lookups import VineyardCacheLookup
from vllm.worker.vineyard.connector.metadata import VineyardConnectorMetadata
from vllm.worker.vineyard.storage.digests import extend_digests

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vineyard-root")


class Rig:
    """A test's workers (one per chunk size, made on first use) and engines
    (vLLM schedulers handshaken with a worker), all on the module's cache
    root and closed after the test: a load that a failed test left behind
    must not reach the next test's scheduler."""

    def __init__(self, model_dir: str, root: Path):
        self.model_dir = model_dir
        self.root = root
        self._workers: dict[int, FakeWorker] = {}
        self._engines: list[Engine] = []

    def worker(self, chunk_size: int = BLOCK_SIZE) -> FakeWorker:
        if chunk_size not in self._workers:
            config = create_vllm_config(
                self.model_dir, self.root, chunk_size=chunk_size
            )
            self._workers[chunk_size] = FakeWorker(config)
        return self._workers[chunk_size]

    def engine(
        self,
        worker: FakeWorker,
        num_blocks: int = NUM_BLOCKS,
        encoder_budget: int = 0,
        **config: Any,
    ) -> Engine:
        """``config``: ``create_vllm_config`` arguments and cache settings."""
        vllm_config = create_vllm_config(
            self.model_dir, self.root, chunk_size=worker.layout.chunk_size, **config
        )
        scheduler = create_scheduler(
            vllm_config, num_blocks, encoder_budget=encoder_budget
        )
        engine = Engine(scheduler, worker)
        self._engines.append(engine)
        return engine

    def close(self) -> None:
        for engine in self._engines:
            engine.close()
        for worker in self._workers.values():
            worker.close()


@pytest.fixture
def rig(model_dir: str, root: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    """Engines whose loads are all asynchronous (the request waits in
    ``WAITING_FOR_REMOTE_KVS``); loads before the forward pass are tested
    in ``test_vineyard_sync_loads.py``."""
    monkeypatch.setattr(LoadOrders, "sync_wait_s", lambda *_: None)
    made = Rig(model_dir, root)
    yield made
    made.close()


class LookupGate:
    """Holds the scheduler's lookups (on its lookup threads) while closed,
    and counts the lookups that answered."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.answered = 0

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    def wrap(
        self, real: Callable[..., tuple[int, int]]
    ) -> Callable[..., tuple[int, int]]:
        def gated(lookup: VineyardCacheLookup, *args: object) -> tuple[int, int]:
            self._open.wait(30.0)
            answer = real(lookup, *args)
            self.answered += 1
            return answer

        return gated


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[LookupGate]:
    """A gate on every lookup, open at first; opened at teardown so no
    thread stays stuck."""
    lookup_gate = LookupGate()
    monkeypatch.setattr(
        VineyardCacheLookup, "find", lookup_gate.wrap(VineyardCacheLookup.find)
    )
    yield lookup_gate
    lookup_gate.open()


def cache_prompt(
    engine: Engine, req_id: str, prompt: list[int], **request: Any
) -> torch.Tensor:
    """Run a request for ``prompt`` to the end (its prefill and one decode
    step save its whole chunks), wait for the writes, empty vLLM's local
    prefix cache (as another instance would have it), and return the bytes
    of the request's prompt blocks as the worker had them. ``request``: more
    ``Request`` arguments."""
    engine.add(create_request(req_id, prompt, **request))
    engine.drain()
    engine.worker.wait_for_writes()
    assert engine.scheduler.reset_prefix_cache()
    block_ids, data = engine.worker.finished[req_id]
    num_full = len(prompt) // BLOCK_SIZE
    assert len(block_ids) >= num_full
    return data[:, :num_full]


def scheduled_with(record: StepRecord, req: Request) -> int | None:
    """``num_computed_tokens`` a request was first scheduled with, if this
    step scheduled it as new."""
    new = record.new_request(req.request_id)
    return None if new is None else new.num_computed_tokens


def reported_loaded(record: StepRecord, req: Request) -> bool:
    return req.request_id in (record.kv_output.finished_recving or ())


# ---- 1. a pending lookup, then a hit ----------------------------------------


@pytest.mark.parametrize(
    "prompt_len,hit",
    [(4 * BLOCK_SIZE + 5, 4 * BLOCK_SIZE), (4 * BLOCK_SIZE, 3 * BLOCK_SIZE)],
    ids=["partial-last-block", "block-aligned-prompt"],
)
def test_pending_lookup_then_hit_loads_the_saved_bytes(
    rig: Rig,
    gate: LookupGate,
    prompt_len: int,
    hit: int,
) -> None:
    """A prompt is computed and saved; a second request for it, while its
    lookup is pending, stays WAITING and unscheduled (the connector answers
    None); once the lookup answers it waits in WAITING_FOR_REMOTE_KVS with
    the load the lookup promised, and runs after the worker reports the
    load, from the last whole block before its final token, with exactly
    the first request's bytes in the loaded blocks."""
    worker = rig.worker()
    engine = rig.engine(worker)
    prompt = fresh_tokens(prompt_len)
    saved = cache_prompt(engine, f"t1-save-{prompt_len}", prompt)
    gate.close()
    worker.kv.fill_(-1.0)  # nothing but a load can put those bytes back

    req = engine.add(create_request(f"t1-load-{prompt_len}", prompt))
    for _ in range(3):
        record = engine.step()
        assert record.num_scheduled(req.request_id) == 0
        assert req.status == RequestStatus.WAITING
        assert req.num_computed_tokens == 0
        assert record.loads() == {}
    gate.open()
    record = engine.run_until(
        lambda _: req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, max_steps=50
    )
    assert record.num_scheduled(req.request_id) == 0
    delta = record.loads()[req.request_id]
    assert delta.load == (0, hit)
    assert req.num_computed_tokens == hit

    record = engine.run_until(lambda r: r.num_scheduled(req.request_id) > 0)
    assert scheduled_with(record, req) == hit
    assert record.num_scheduled(req.request_id) == prompt_len - hit
    (reported,) = [r for r in engine.records if reported_loaded(r, req)]
    assert reported is not record  # the step after the report runs it
    assert all(not r.kv_output.invalid_block_ids for r in engine.records)

    block_ids = worker.requests[req.request_id].block_ids
    loaded = worker.blocks(block_ids[: hit // BLOCK_SIZE])
    assert torch.equal(loaded, saved[:, : hit // BLOCK_SIZE])
    assert torch.equal(loaded, expected_blocks(prompt, hit // BLOCK_SIZE))
    engine.drain()
    assert engine.counter("loaded_tokens") == hit
    assert engine.counter("hit_tokens") == hit
    assert engine.counter("load_errors") == 0


# ---- 2. a lookup past its deadline ------------------------------------------


@dataclass
class TimedOut:
    engine: Engine
    req: Request
    record: StepRecord  # the step that scheduled the request
    waited_s: float  # from its arrival to that step


def time_out_a_lookup(rig: Rig, gate: LookupGate, timeout_s: float) -> TimedOut:
    """A cached prompt whose lookup hangs (the gate stays closed) until the
    request is scheduled."""
    prompt = fresh_tokens(3 * BLOCK_SIZE + 4)
    worker = rig.worker()
    cache_prompt(rig.engine(worker), f"timeout-save-{prompt[0]}", prompt)
    gate.close()
    engine = rig.engine(worker, lookup_timeout_s=timeout_s)
    req = engine.add(create_request(f"timeout-{prompt[0]}", prompt))
    start = time.monotonic()
    record = engine.run_until(
        lambda r: r.num_scheduled(req.request_id) > 0, pause_s=0.01
    )
    return TimedOut(engine, req, record, time.monotonic() - start)


def test_lookup_past_its_deadline_is_a_counted_miss(
    rig: Rig,
    gate: LookupGate,
) -> None:
    """The prompt is cached, but the filesystem hangs for the lookup: the
    request waits unscheduled until the lookup timeout, then is scheduled
    as a miss (no external tokens, the whole prompt computed, no load), and
    ``lookup_timeouts`` counts it once in the stats vLLM logs."""
    timeout_s = 0.3
    out = time_out_a_lookup(rig, gate, timeout_s)
    engine, req, record = out.engine, out.req, out.record
    assert out.waited_s >= timeout_s
    assert len(engine.records) > 1  # it waited for the lookup, unscheduled
    assert all(r.num_scheduled(req.request_id) == 0 for r in engine.records[:-1])
    assert req.status == RequestStatus.RUNNING
    assert scheduled_with(record, req) == 0
    assert record.num_scheduled(req.request_id) == req.num_prompt_tokens
    assert all(r.loads() == {} for r in engine.records)
    assert engine.counter("lookup_timeouts") == 1
    assert engine.counter("hit_tokens") == 0
    gate.open()
    engine.drain()
    assert engine.counter("lookup_timeouts") == 1
    assert engine.counter("loaded_tokens") == 0


def test_an_abandoned_lookup_adds_no_hit(
    rig: Rig,
    gate: LookupGate,
) -> None:
    """When the hung filesystem answers the abandoned lookup later, the
    request was already served as a miss: ``hit_tokens`` must not count
    the tokens it never loaded (it would inflate the logged hit rate)."""
    engine = time_out_a_lookup(rig, gate, 0.3).engine
    answered = gate.answered
    gate.open()
    assert wait_until(lambda: gate.answered > answered)  # the late answer
    engine.drain()
    assert engine.counter("loaded_tokens") == 0
    assert engine.counter("hit_tokens") == 0


# ---- 3. a load error --------------------------------------------------------


@pytest.mark.parametrize(
    "chunk_size,bad_block,resume_at",
    [
        (BLOCK_SIZE, 1, BLOCK_SIZE),
        (2 * BLOCK_SIZE, 3, 2 * BLOCK_SIZE),
        (2 * BLOCK_SIZE, 1, 0),
    ],
    ids=["chunk16-block1", "chunk32-block3", "chunk32-block1"],
)
def test_load_error_recomputes_from_the_first_bad_chunk(
    rig: Rig,
    chunk_size: int,
    bad_block: int,
    resume_at: int,
) -> None:
    """Four cached blocks are promised; between the lookup and the load a
    byte in the middle of block ``bad_block``'s KV is flipped on disk. In
    the step that reports the load finished, the worker reports the
    request's blocks from the bad chunk on as invalid (chunks are verified
    whole); vLLM schedules the request from that chunk's first token, with
    the saved bytes of the good prefix in place, and recomputes the rest.
    The bad chunk is removed and counted, and the recomputed chunks are
    saved again, so the next lookup finds the whole prefix."""
    worker = rig.worker(chunk_size)
    layout = worker.layout
    bpc = layout.blocks_per_chunk
    hit_blocks = 4
    engine = rig.engine(worker)
    prompt = fresh_tokens(hit_blocks * BLOCK_SIZE + 5)
    saved = cache_prompt(engine, f"t3-save-{chunk_size}-{bad_block}", prompt)
    worker.kv.fill_(-1.0)
    path = worker.chunk_path(prompt, bad_block // bpc)
    req = create_request(f"t3-load-{chunk_size}-{bad_block}", prompt)
    load_blocks: list[int] = []
    original: list[bytes] = []

    def corrupt_before_the_load(so: SchedulerOutput) -> None:
        meta = so.kv_connector_metadata
        assert isinstance(meta, VineyardConnectorMetadata)
        for delta in meta.requests:
            if delta.req_id == req.request_id and delta.load is not None:
                assert delta.load == (0, hit_blocks * BLOCK_SIZE)
                with open(path, "rb") as f:
                    original.append(f.read())
                corrupt_entry(
                    path, bad_block % bpc, layout.entry_bytes, layout.payload_bytes
                )
                load_blocks.extend(delta.block_ids)

    engine.add(req)
    engine.run_until(
        lambda _: req.status == RequestStatus.WAITING_FOR_REMOTE_KVS,
        before_execute=corrupt_before_the_load,
    )
    assert len(load_blocks) == hit_blocks  # an async load allocates only these
    record = engine.run_until(lambda r: r.num_scheduled(req.request_id) > 0)
    assert scheduled_with(record, req) == resume_at
    assert record.num_scheduled(req.request_id) == min(
        len(prompt) - resume_at, MAX_NUM_BATCHED_TOKENS
    )

    (report,) = [r for r in engine.records if reported_loaded(r, req)]
    assert report.kv_output.invalid_block_ids == set(
        load_blocks[resume_at // BLOCK_SIZE : hit_blocks]
    )
    assert sum(len(r.kv_output.invalid_block_ids) for r in engine.records) == (
        hit_blocks - resume_at // BLOCK_SIZE
    )
    block_ids = worker.requests[req.request_id].block_ids
    good = resume_at // BLOCK_SIZE
    if good:
        assert block_ids[:good] == load_blocks[:good]  # kept, not reloaded
    assert torch.equal(worker.blocks(block_ids[:good]), saved[:, :good])

    engine.drain()
    _, data = worker.finished[req.request_id]
    assert torch.equal(data[:, :hit_blocks], expected_blocks(prompt, hit_blocks))
    assert engine.counter("loaded_tokens") == resume_at
    assert engine.counter("load_errors") == 1
    assert engine.counter("corrupt_chunks") == 1
    worker.wait_for_writes()
    with open(path, "rb") as f:  # written again, byte for byte
        assert f.read() == original[0]
    digests = extend_digests([], prompt, BLOCK_SIZE)
    lookup = VineyardCacheLookup(worker.cache.config, [layout])
    assert lookup.lookup(digests, 0, len(prompt))[0] == hit_blocks * BLOCK_SIZE


# ---- 4. an abort during a load ----------------------------------------------


def test_abort_while_loading_frees_blocks_after_the_worker_reports(
    rig: Rig,
) -> None:
    """The reader backend is stopped, so a request's load cannot finish;
    the request is aborted in WAITING_FOR_REMOTE_KVS. vLLM keeps its blocks
    until the worker, told the request finished, reports its load finished
    (in that same step); then they are free and the scheduler holds
    nothing. Once the reader runs again, its late answer for the aborted
    load is dropped and the next request's load is exact."""
    worker = rig.worker()
    engine = rig.engine(worker)
    prompt = fresh_tokens(4 * BLOCK_SIZE + 5)
    saved = cache_prompt(engine, "t4-save", prompt)
    hit = 4 * BLOCK_SIZE
    pool = engine.scheduler.kv_cache_manager.block_pool
    reader = worker.cache.backend_pids()["read"]
    assert reader is not None
    os.kill(reader, signal.SIGSTOP)
    try:
        req = engine.add(create_request("t4-abort", prompt))
        engine.run_until(lambda _: req.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        for _ in range(3):
            record = engine.step()
            assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            assert not record.kv_output.finished_recving
            time.sleep(0.01)
        free_before = pool.get_num_free_blocks()

        (aborted,) = engine.scheduler.finish_requests(
            req.request_id, RequestStatus.FINISHED_ABORTED
        )
        assert aborted is req and req.status == RequestStatus.FINISHED_ABORTED
        assert req.request_id in engine.scheduler.requests  # its blocks held
        assert pool.get_num_free_blocks() == free_before

        record = engine.step()
        assert req.request_id in record.scheduler_output.finished_req_ids
        assert record.kv_output.finished_recving == {req.request_id}
        assert not record.kv_output.invalid_block_ids
        assert req.request_id not in engine.scheduler.requests
        assert pool.get_num_free_blocks() == free_before + hit // BLOCK_SIZE
        assert_scheduler_empty(engine.scheduler)
    finally:
        resume_processes([reader])

    assert engine.scheduler.reset_prefix_cache()
    worker.kv.fill_(-1.0)
    after = engine.add(create_request("t4-after", prompt))
    record = engine.run_until(lambda r: r.num_scheduled(after.request_id) > 0)
    assert scheduled_with(record, after) == hit
    block_ids = worker.requests[after.request_id].block_ids
    assert torch.equal(
        worker.blocks(block_ids[: hit // BLOCK_SIZE]), saved[:, : hit // BLOCK_SIZE]
    )
    engine.drain()
    assert engine.counter("loaded_tokens") == hit  # the aborted load's: none
    assert engine.counter("load_errors") == 0
    assert_scheduler_empty(engine.scheduler)


# ---- 5. preemption after a load ---------------------------------------------


def test_preempted_after_a_load_is_loaded_again_into_new_blocks(rig: Rig) -> None:
    """Eleven usable blocks, no local prefix cache, priority scheduling. A
    request for a cached prompt loads it and runs; a more important request
    arrives and grows until blocks run out, and vLLM preempts the loaded
    one (freeing its blocks). When it is scheduled again it is looked up
    again: its prompt and the chunks of its own outputs it saved before the
    preemption are loaded into its new blocks (the worker's block list is
    replaced), and it resumes from there. Every block of both requests ends
    with exactly the KV the fake model computes for its tokens."""
    worker = rig.worker()
    engine = rig.engine(
        worker, num_blocks=12, enable_prefix_caching=False, policy="priority"
    )
    prompt = fresh_tokens(4 * BLOCK_SIZE + 5)
    cache_prompt(engine, "t5-save", prompt)
    worker.kv.fill_(-1.0)

    req = engine.add(create_request("t5-loaded", prompt, max_tokens=30, priority=1))
    rid = req.request_id
    first = len(engine.records)
    engine.run_until(lambda r: r.num_scheduled(rid) > 0)  # loaded, running
    grower = engine.add(create_request("t5-grower", fresh_tokens(48), max_tokens=60))

    def preempted(record: StepRecord) -> bool:
        return rid in (record.scheduler_output.preempted_req_ids or ())

    engine.run_until(preempted, max_steps=400)
    assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
    computed = 4 * BLOCK_SIZE + sum(
        r.num_scheduled(rid) for r in engine.records[first:]
    )
    assert computed > len(prompt)  # it was decoding
    hit = computed // BLOCK_SIZE * BLOCK_SIZE  # its prompt and saved outputs
    # Those chunks are on disk before it is looked up again (the writer is
    # a niced process on a busy machine).
    worker.wait_for_writes()

    record = engine.run_until(lambda r: rid in r.loads(), max_steps=400)
    delta = record.loads()[rid]
    assert delta.load == (0, hit) and delta.replace_blocks
    assert len(delta.block_ids) == hit // BLOCK_SIZE
    record = engine.run_until(lambda r: r.num_scheduled(rid) > 0)
    cached = record.scheduler_output.scheduled_cached_reqs
    assert rid in cached.resumed_req_ids
    assert cached.num_computed_tokens[cached.req_ids.index(rid)] == hit
    assert record.num_scheduled(rid) == req.num_tokens - 1 - hit  # then sampled
    assert worker.requests[rid].block_ids[: hit // BLOCK_SIZE] == delta.block_ids
    assert torch.equal(
        worker.blocks(delta.block_ids),
        expected_blocks(req.all_token_ids, hit // BLOCK_SIZE),
    )

    engine.drain(max_steps=400)
    assert sum(preempted(r) for r in engine.records) == 1
    for done in (grower, req):
        assert done.num_output_tokens == done.max_tokens
        num_full = (done.num_tokens - 1) // BLOCK_SIZE  # the last is not computed
        _, data = worker.finished[done.request_id]
        expected = expected_blocks(done.all_token_ids, num_full)
        assert torch.equal(data[:, :num_full], expected)
    assert engine.counter("loaded_tokens") == 4 * BLOCK_SIZE + hit
    assert engine.counter("load_errors") == 0
    assert_scheduler_empty(engine.scheduler)


# ---- 6. multimodal items ----------------------------------------------------


def _image(identifier: str) -> MultiModalFeatureSpec:
    """An image whose placeholder starts at the second block."""
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=BLOCK_SIZE + 4, length=2 * BLOCK_SIZE),
    )


def test_images_key_the_blocks_from_their_placeholder_on(rig: Rig) -> None:
    """A prompt with an image is saved; the same text with another image
    hits only the block before the placeholder (its KV does not depend on
    the image), and the same image hits the whole prompt and loads the
    bytes that were saved."""
    worker = rig.worker()
    engine = rig.engine(worker, encoder_budget=1024)
    prompt = fresh_tokens(5 * BLOCK_SIZE + 3)
    saved = cache_prompt(engine, "img-save", prompt, mm_features=[_image("image-a")])

    def first_scheduled(req_id: str, image: str) -> tuple[int, Request]:
        req = engine.add(create_request(req_id, prompt, mm_features=[_image(image)]))
        record = engine.run_until(lambda r: r.num_scheduled(req.request_id) > 0)
        computed = scheduled_with(record, req)
        assert computed is not None
        return computed, req

    other, _ = first_scheduled("img-other", "image-b")
    assert other == BLOCK_SIZE
    engine.drain()
    assert engine.scheduler.reset_prefix_cache()
    same, req = first_scheduled("img-same", "image-a")
    assert same == 5 * BLOCK_SIZE
    block_ids = worker.requests[req.request_id].block_ids
    assert torch.equal(worker.blocks(block_ids[:5]), saved[:, :5])
    engine.drain()
    assert engine.counter("load_errors") == 0
