# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the in-process connector tests: real vLLM ``Request`` and
``SchedulerOutput`` objects driven by hand (as vLLM's own connector unit
tests do), and real worker-side caches on small CPU KV tensors.

:class:`Step` plays vLLM's scheduler for one step: it builds the
``SchedulerOutput`` the connector sees, and afterwards advances the requests
as ``Scheduler._update_after_schedule`` and ``update_from_output`` would
(``num_computed_tokens``, one sampled token per finished prefill).
:func:`admit` and :func:`run_step` play vLLM's asynchronous loads: a request
with a hit gets its blocks, waits while its workers load (steps in which it
is not scheduled), and is scheduled once they report it finished, from the
first block they could not load.
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from tests.vineyard_testing import random_tokens, resume_processes, wait_for_writes
from tests.worker import vineyard_cache_testing as cache_testing
from tests.worker.vineyard_cache_testing import TestingCache
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector.metadata import (
    RequestDelta,
    VineyardConnectorMetadata,
    VineyardWorkerReport,
)
from vllm.worker.vineyard.connector.scheduler import VineyardConnectorScheduler
from vllm.worker.vineyard.connector.worker import VineyardConnectorWorker
from vllm.worker.vineyard.storage.layout import KVCacheLayout

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 16
BLOCK_SIZE = 16
CHUNK_SIZE = 32  # two blocks
BLOCKS_PER_CHUNK = CHUNK_SIZE // BLOCK_SIZE
NUM_BLOCKS = 96
MAX_NUM_BATCHED_TOKENS = 128
VOCAB_SIZE = 32000


#: The settings of a connector test's cache (see the cache tests' helper).
make_config = functools.partial(
    cache_testing.make_config,
    chunk_size=CHUNK_SIZE,
    cpu_mem_limit_gb=0.5,
    backend_timeout_s=30.0,
)
#: ``random_kv(seed)``: random paged KV of every layer in one allocation, as
#: vLLM's CPU backend allocates it: ``[layers, blocks, heads, block_size,
#: 2 * head]``.
random_kv = functools.partial(
    cache_testing.random_kv,
    NUM_LAYERS,
    NUM_BLOCKS,
    NUM_KV_HEADS,
    BLOCK_SIZE,
    HEAD_SIZE,
    torch.float32,
    any_bits=False,
)


def make_layout(tp_size: int = 1, tp_rank: int = 0) -> KVCacheLayout:
    return KVCacheLayout(
        model="unit-model",
        dtype="float32",
        num_layers=NUM_LAYERS,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        block_size=BLOCK_SIZE,
        block_bytes=NUM_KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 4,
        kv_layout="cpu:unit",
        chunk_size=CHUNK_SIZE,
        tp_size=tp_size,
        tp_rank=tp_rank,
    )


@dataclass
class WorkerHarness:
    """One TP rank: a :class:`VineyardConnectorWorker` whose cache is a real
    cache (a :class:`TestingCache`, with its backend processes) over ``kv``.

    ``register_kv_caches`` needs vLLM's TP group; the tests set the cache
    the way it would, so everything after registration is the product's.
    """

    worker: VineyardConnectorWorker
    kv: torch.Tensor
    layout: KVCacheLayout

    @property
    def cache(self) -> TestingCache:
        assert isinstance(self.worker.cache, TestingCache)
        return self.worker.cache

    def block(self, block_id: int) -> torch.Tensor:
        """One block of every layer."""
        return self.kv[:, block_id].clone()

    def step(self, meta: VineyardConnectorMetadata) -> None:
        """What a forward pass does with the connector: load, then save."""
        self.worker.start_load_kv(meta)
        self.worker.wait_for_save(meta)

    def wait_for_writes(self, timeout_s: float = 30.0) -> None:
        wait_for_writes(self.cache, timeout_s)

    def pid(self, role: str) -> int:
        pid = self.cache.backend_pids()[role]
        assert pid is not None
        return pid

    def close(self) -> None:
        resume_processes(self.cache.backend_pids().values())  # a test may stop one
        self.worker.shutdown()


def make_worker(
    config: VineyardLLMCacheConfig, layout: KVCacheLayout, seed: int = 0
) -> WorkerHarness:
    kv = random_kv(seed)
    worker = VineyardConnectorWorker(
        config,
        lambda *_: layout,
        MAX_NUM_BATCHED_TOKENS,
        NUM_BLOCKS,
    )
    worker.cache = TestingCache(
        config,
        layout,
        MAX_NUM_BATCHED_TOKENS,
        [kv[i] for i in range(NUM_LAYERS)],
        NUM_BLOCKS,
    )
    return WorkerHarness(worker, kv, layout)


@contextlib.contextmanager
def tp_workers(
    config: VineyardLLMCacheConfig, tp_size: int = 2
) -> Iterator[list[WorkerHarness]]:
    """One worker per TP rank on ``config``'s root (each rank in its own
    namespace, over its own random KV); all closed on exit."""
    workers = [
        make_worker(config, make_layout(tp_size, rank), seed=rank)
        for rank in range(tp_size)
    ]
    try:
        yield workers
    finally:
        for w in workers:
            w.close()


def make_scheduler(
    config: VineyardLLMCacheConfig, layouts: Sequence[KVCacheLayout]
) -> VineyardConnectorScheduler:
    """A scheduler side that has had every rank's handshake."""
    from vllm.worker.vineyard.connector.metadata import VineyardHandshake

    sched = VineyardConnectorScheduler(
        config, BLOCK_SIZE, config.chunk_tokens(BLOCK_SIZE), len(layouts)
    )
    sched.set_handshakes(
        {rank: VineyardHandshake(layout) for rank, layout in enumerate(layouts)}
    )
    return sched


_rng = random.Random(1234)


def fresh_tokens(n: int) -> list[int]:
    """Fresh random token ids (a new prompt on every call)."""
    return random_tokens(_rng, n)


def make_request(
    req_id: str, prompt: list[int] | None, max_tokens: int = 64, **kwargs: Any
) -> Request:
    return Request(
        req_id, prompt, SamplingParams(max_tokens=max_tokens), None, **kwargs
    )


def num_blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


@dataclass
class Step:
    """One scheduler step: new requests (with all their blocks), running
    ones (with the blocks they got now), resumed ones (with all theirs)."""

    new: list[tuple[Request, list[int], int]] = field(default_factory=list)
    running: list[tuple[Request, list[int], int]] = field(default_factory=list)
    resumed: list[tuple[Request, list[int], int]] = field(default_factory=list)
    # Filled by run_step: the deltas that started the new requests' loads,
    # and the blocks the workers could not load.
    loads: list[RequestDelta] = field(default_factory=list)
    load_errors: set[int] = field(default_factory=set)

    def output(self) -> SchedulerOutput:
        out = SchedulerOutput.make_empty()
        for req, blocks, n in self.new:
            out.scheduled_new_reqs.append(
                NewRequestData.from_request(req, (list(blocks),))
            )
            out.num_scheduled_tokens[req.request_id] = n
        cached: CachedRequestData = out.scheduled_cached_reqs
        for req, blocks, n in self.running + self.resumed:
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append((list(blocks),) if blocks else None)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            cached.num_output_tokens.append(req.num_output_tokens)
            out.num_scheduled_tokens[req.request_id] = n
        cached.resumed_req_ids = {req.request_id for req, _, _ in self.resumed}
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        return out

    def advance(self) -> None:
        """After the step: the scheduled tokens are computed, and a request
        whose prompt is done samples one token."""
        for req, _, n in self.new + self.running + self.resumed:
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                req.append_output_token_ids(_rng.randrange(3, VOCAB_SIZE))


@dataclass
class Allocated:
    """vLLM's ``KVCacheBlocks`` as ``update_state_after_alloc`` reads it."""

    block_ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.block_ids,)


#: Requests admitted with an external hit whose load has not run yet:
#: request id -> tokens to load.
_admitted: dict[str, int] = {}


def admit(
    sched: VineyardConnectorScheduler, req: Request, num_local_tokens: int = 0
) -> int:
    """What vLLM's scheduler does for a waiting request: ask the connector
    for external hits (again next step while the lookup is pending). Sets
    ``num_computed_tokens`` to local + external hits; returns the external
    hit, which :func:`run_step` loads when the request is first scheduled."""
    num_external: int | None = None
    for _ in range(2000):
        num_external, load_async = sched.get_num_new_matched_tokens(
            req, num_local_tokens
        )
        if num_external is not None:
            break
        sched.build_connector_meta(SchedulerOutput.make_empty())  # next step
    assert num_external is not None, "the lookup never finished"
    assert load_async == (num_external > 0)
    if num_external:
        _admitted[req.request_id] = num_external
    req.num_computed_tokens = num_local_tokens + num_external
    return num_external


def allocate(
    sched: VineyardConnectorScheduler, req: Request, blocks: Sequence[int]
) -> VineyardConnectorMetadata:
    """An admitted request gets its blocks; returns the metadata of the
    step in which it waits for its load (the workers start it)."""
    allocated: Any = Allocated(list(blocks))
    sched.update_state_after_alloc(req, allocated, _admitted.pop(req.request_id))
    return sched.build_connector_meta(SchedulerOutput.make_empty())


def load_step(
    sched: VineyardConnectorScheduler,
    req: Request,
    blocks: Sequence[int],
    workers: Sequence[WorkerHarness] = (),
    timeout_s: float = 30.0,
) -> tuple[RequestDelta, set[int]]:
    """The steps of an admitted request's asynchronous load: its blocks
    are allocated, the workers load them while it waits, and their reports
    reach the scheduler; ``num_computed_tokens`` then ends at the first
    block that could not be loaded (as vLLM's ``recompute`` policy does).
    Returns the delta that started the load and the blocks the workers
    could not load."""
    meta = allocate(sched, req, blocks)
    invalid: set[int] = set()
    for w in workers:
        w.worker.start_load_kv(meta)
        deadline = time.monotonic() + timeout_s
        while req.request_id not in w.worker.get_finished(set()):
            assert time.monotonic() < deadline, "the load never finished"
            time.sleep(0.001)
        invalid |= w.worker.take_load_errors()
    sched.update_connector_output(
        KVConnectorOutput(
            finished_recving={req.request_id},
            invalid_block_ids=invalid,
            kv_connector_worker_meta=reports(workers),
        )
    )
    bad = [i for i, b in enumerate(blocks) if b in invalid]
    if bad:
        req.num_computed_tokens = min(req.num_computed_tokens, bad[0] * BLOCK_SIZE)
    return only(meta), invalid


def run_step(
    sched: VineyardConnectorScheduler,
    step: Step,
    workers: Sequence[WorkerHarness] = (),
) -> VineyardConnectorMetadata:
    """Run the loads of newly admitted requests, then build the step's
    metadata, run it on every worker, advance."""
    for req, blocks, _ in step.new:
        if req.request_id in _admitted:
            delta, invalid = load_step(sched, req, blocks, workers)
            step.loads.append(delta)
            step.load_errors |= invalid
    meta = sched.build_connector_meta(step.output())
    for w in workers:
        w.step(meta)
    step.advance()
    report_to(sched, workers)
    return meta


def reports(workers: Sequence[WorkerHarness]) -> VineyardWorkerReport | None:
    """The workers' reports of a step, combined as vLLM's
    ``KVOutputAggregator`` does (a rank with nothing to say sends None)."""
    combined: VineyardWorkerReport | None = None
    for w in workers:
        report = w.worker.build_report()
        if combined is None:
            combined = report
        elif report is not None:
            combined = combined.aggregate(report)
    return combined


def report_to(
    sched: VineyardConnectorScheduler, workers: Sequence[WorkerHarness]
) -> None:
    """The end of a step: the workers' reports reach the scheduler."""
    sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=reports(workers))
    )


def only(meta: VineyardConnectorMetadata) -> RequestDelta:
    assert len(meta.requests) == 1, meta.requests
    return meta.requests[0]
