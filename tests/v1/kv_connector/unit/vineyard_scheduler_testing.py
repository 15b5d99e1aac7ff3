# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers of the tests that drive vLLM's real ``Scheduler`` with
``VineyardConnector`` as its KV connector, in-process (as vLLM's own
``tests/v1/kv_connector/unit/utils.py`` does: ``create_vllm_config``,
``create_scheduler``, ``create_request``), against a real worker side.

:class:`FakeWorker` plays one model runner: a ``VineyardConnector`` with the
WORKER role over real CPU KV tensors (``register_kv_caches`` runs the
product's code; real vineyard backend processes on a tmp root) and, instead
of a forward pass, writes deterministic KV for the tokens each step computes
(:func:`token_kv`), so saved and loaded bytes can be checked. It calls the
connector in the order of vLLM's ``KVConnectorModelRunnerMixin``.
:class:`Engine` plays ``EngineCore.step``: ``schedule()``, the worker, then
``update_from_output``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.scheduler import SchedulerPolicy
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.vineyard_testing import wait_for_writes
from tests.worker.vineyard_cache_testing import TestingCache, testing_caches
from vllm.worker.vineyard.connector.metadata import (
    RequestDelta,
    VineyardConnectorMetadata,
)
from vllm.worker.vineyard.connector.vineyard_connector import VineyardConnector
from vllm.worker.vineyard.storage.digests import extend_digests, synthetic_ids
from vllm.worker.vineyard.storage.layout import KVCacheLayout

NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_SIZE = 16
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 64
NUM_BLOCKS = 64  # of the worker's KV tensors (and by default the scheduler's)
VOCAB_SIZE = 32000
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
#: The least time run_until steps for before it gives up (see there).
MIN_RUN_S = 30.0


# ---- configs, scheduler and requests (after vLLM's unit/utils.py) -----------


def make_model_dir(path: Path) -> str:
    """A Llama ``config.json`` of the KV shape above (no weights: nothing
    here runs a model)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": NUM_HEADS * HEAD_SIZE,
        "intermediate_size": 128,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_SIZE,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def create_vllm_config(
    model_dir: str,
    root: Path,
    chunk_size: int = 0,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
    enable_prefix_caching: bool = True,
    policy: SchedulerPolicy = "fcfs",
    **settings: Any,
) -> VllmConfig:
    """A ``VllmConfig`` with ``VineyardConnector`` on ``root``; ``settings``
    are more ``kv_connector_extra_config`` keys (the cache's settings)."""
    model_config = ModelConfig(
        model=model_dir,
        dtype="float32",
        seed=42,
        skip_tokenizer_init=True,
        max_model_len=4096,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=4096,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        policy=policy,
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    extra: dict[str, Any] = {
        "root": str(root),
        "chunk_size": chunk_size,
        "cpu_mem_limit_gb": 0.5,
        "backend_timeout_s": 30.0,
        "drain_timeout_s": 5.0,
        # Every hit is loaded: the fake forward passes cost nothing.
        "load_policy": "always",
        **settings,
    }
    kv_transfer_config = KVTransferConfig(
        kv_connector="VineyardConnector",
        kv_connector_module_path="vllm.worker.vineyard.connector.vineyard_connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
    )
    return VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )


def make_kv_cache_config(
    num_blocks: int = NUM_BLOCKS, sliding_window: int | None = None
) -> KVCacheConfig:
    """One group of every layer, as the CPU worker has it: full attention,
    or with ``sliding_window`` every layer windowed (Mistral-7B-v0.1 style:
    vLLM frees a request's blocks once they leave the window)."""
    spec: AttentionSpec
    if sliding_window is None:
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.float32,
        )
    else:
        spec = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.float32,
            sliding_window=sliding_window,
        )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)],
    )


def create_scheduler(
    vllm_config: VllmConfig,
    num_blocks: int = NUM_BLOCKS,
    sliding_window: int | None = None,
    encoder_budget: int = 0,
) -> Scheduler:
    """vLLM's scheduler with the connector (role SCHEDULER) it builds itself.
    ``encoder_budget``: encoder tokens per step and in the encoder cache, so
    that requests with multimodal items are scheduled (the model here is
    text-only, which would give none)."""
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=make_kv_cache_config(num_blocks, sliding_window),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    if encoder_budget:
        scheduler.max_num_encoder_input_tokens = encoder_budget
        scheduler.encoder_cache_manager = EncoderCacheManager(encoder_budget)
    return scheduler


_none_hash_initialized = False


def create_request(
    req_id: str,
    prompt: list[int],
    max_tokens: int = 2,
    priority: int = 0,
    **kwargs: Any,
) -> Request:
    """A request with vLLM's block hasher (its local prefix cache needs it);
    ``kwargs``: more ``Request`` arguments (e.g. ``mm_features``)."""
    global _none_hash_initialized
    if not _none_hash_initialized:
        init_none_hash(sha256)
        _none_hash_initialized = True
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        priority=priority,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        **kwargs,
    )


# ---- the fake model: deterministic KV per token -----------------------------


def extend_position_digests(digests: list[bytes], tokens: Sequence[int]) -> None:
    """Chained digests of every token prefix (``digests[p]`` names
    ``tokens[: p + 1]``), extended to ``len(tokens)``."""
    prev = digests[-1] if digests else b"fake-model"
    for tok in tokens[len(digests) :]:
        prev = hashlib.blake2b(
            prev + tok.to_bytes(4, "little"), digest_size=16
        ).digest()
        digests.append(prev)


def token_kv(digest: bytes) -> torch.Tensor:
    """The KV the fake model computes for one token: ``[layers, heads,
    2 * head]``, a function of the whole prefix up to that token."""
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(NUM_LAYERS, NUM_KV_HEADS, 2 * HEAD_SIZE, generator=gen)


def expected_blocks(tokens: Sequence[int], num_blocks: int) -> torch.Tensor:
    """What the fake model writes into the first ``num_blocks`` blocks of a
    request with these tokens: ``[layers, blocks, heads, block, 2 * head]``."""
    digests: list[bytes] = []
    extend_position_digests(digests, tokens[: num_blocks * BLOCK_SIZE])
    out = torch.empty(NUM_LAYERS, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    for p, d in enumerate(digests):
        out[:, p // BLOCK_SIZE, :, p % BLOCK_SIZE, :] = token_kv(d)
    return out


def sampled_token(digest: bytes) -> int:
    return 3 + int.from_bytes(digest[8:12], "little") % (VOCAB_SIZE - 3)


# ---- the worker side --------------------------------------------------------


@dataclass
class _RunnerRequest:
    """What a model runner keeps of a request (its cached state)."""

    tokens: list[int]
    block_ids: list[int]
    digests: list[bytes] = field(default_factory=list)
    num_prompt: int = 0


class FakeWorker:
    """One TP rank: a WORKER-role ``VineyardConnector`` over real CPU KV
    tensors (``[layers, blocks, heads, block, 2 * head]``, one allocation,
    one tensor per layer registered as vLLM's CPU worker does)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        num_blocks: int = NUM_BLOCKS,
        sliding_window: int | None = None,
    ):
        self.kv = torch.zeros(
            NUM_LAYERS, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE
        )
        self.connector = VineyardConnector(
            vllm_config,
            KVConnectorRole.WORKER,
            make_kv_cache_config(num_blocks, sliding_window),
        )
        # register_kv_caches asks vLLM's TP group for the rank: TP 1 here.
        tp1 = SimpleNamespace(world_size=1, rank_in_group=0)
        with (
            mock.patch(
                "vllm.worker.vineyard.connector.worker.get_tp_group", return_value=tp1
            ),
            testing_caches(),
        ):
            self.connector.register_kv_caches(
                {name: self.kv[i] for i, name in enumerate(LAYER_NAMES)}
            )
        assert self.cache is not None, "the worker's cache did not start"
        self.requests: dict[str, _RunnerRequest] = {}
        #: Block tables of finished requests, and their blocks' bytes when
        #: vLLM told the worker they finished (before any reuse).
        self.finished: dict[str, tuple[list[int], torch.Tensor]] = {}

    @property
    def cache(self) -> TestingCache:
        worker = self.connector._worker
        assert worker is not None and isinstance(worker.cache, TestingCache)
        return worker.cache

    @property
    def layout(self) -> KVCacheLayout:
        return self.cache.layout

    def blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        return self.kv[:, list(block_ids)].clone()

    def wait_for_writes(self, timeout_s: float = 30.0) -> None:
        wait_for_writes(self.cache, timeout_s)

    def chunk_path(
        self, tokens: Sequence[int], chunk: int, seed: str | None = None
    ) -> str:
        """The file of chunk ``chunk`` of a prompt in this rank's namespace
        (``seed``: the digest chain's, see ``request_keys``)."""
        ids = synthetic_ids(extend_digests([], list(tokens), BLOCK_SIZE, seed))
        bpc = self.layout.blocks_per_chunk
        return self.cache.files.path(ids[: (chunk + 1) * bpc])

    def close(self) -> None:
        self.connector.shutdown()

    # ---- one step, in the order of KVConnectorModelRunnerMixin ------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.finished[req_id] = (state.block_ids, self.blocks(state.block_ids))
        for new in so.scheduled_new_reqs:
            assert new.prompt_token_ids is not None
            self.requests[new.req_id] = _RunnerRequest(
                list(new.prompt_token_ids),
                list(new.block_ids[0]),
                num_prompt=len(new.prompt_token_ids),
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            # A token sampled on blocks a load left empty was discarded.
            del state.tokens[state.num_prompt + cached.num_output_tokens[i] :]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                assert new_ids is not None
                state.block_ids = list(new_ids[0])
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])

    def _forward(self, so: SchedulerOutput) -> tuple[list[str], list[list[int]]]:
        """Write the KV of every scheduled token; sample one token for each
        request whose prompt (and outputs) are all computed."""
        num_computed = {
            new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs
        }
        cached = so.scheduled_cached_reqs
        num_computed.update(
            zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        )
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start, end = num_computed[req_id], num_computed[req_id] + n
            extend_position_digests(state.digests, state.tokens[:end])
            for p in range(start, end):
                block = state.block_ids[p // BLOCK_SIZE]
                self.kv[:, block, :, p % BLOCK_SIZE, :] = token_kv(state.digests[p])
            req_ids.append(req_id)
            if end >= len(state.tokens):
                token = sampled_token(state.digests[end - 1])
                state.tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])  # a chunk of a prefill samples nothing
        return req_ids, sampled

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        c = self.connector
        self._update_states(so)
        if so.new_block_ids_to_zero:
            self.kv[:, so.new_block_ids_to_zero] = 0
        assert so.kv_connector_metadata is not None
        c.bind_connector_metadata(so.kv_connector_metadata)
        if so.has_sync_kv_loads:
            c.start_load_kv(None)  # type: ignore[arg-type]
        req_ids, sampled = self._forward(so)
        if not so.has_sync_kv_loads:
            c.start_load_kv(None)  # type: ignore[arg-type]
        c.wait_for_save()
        results = c.get_transfer_results(so.finished_req_ids)
        invalid = c.get_block_ids_with_load_errors()
        stats = c.get_kv_connector_stats()
        build_meta = getattr(c, "build_connector_worker_meta", None)
        worker_meta = build_meta() if build_meta is not None else None
        c.clear_connector_metadata()
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=invalid,
                kv_connector_stats=stats,
                kv_connector_worker_meta=worker_meta,
            ),
        )


# ---- the engine loop --------------------------------------------------------


@dataclass
class StepRecord:
    scheduler_output: SchedulerOutput
    runner_output: ModelRunnerOutput
    outputs: dict[int, EngineCoreOutputs]

    def num_scheduled(self, req_id: str) -> int:
        return self.scheduler_output.num_scheduled_tokens.get(req_id, 0)

    def new_request(self, req_id: str) -> NewRequestData | None:
        for new in self.scheduler_output.scheduled_new_reqs:
            if new.req_id == req_id:
                return new
        return None

    def loads(self) -> dict[str, RequestDelta]:
        """The loads the connector's metadata started this step."""
        meta = self.scheduler_output.kv_connector_metadata
        assert isinstance(meta, VineyardConnectorMetadata)
        return {d.req_id: d for d in meta.requests if d.load is not None}

    @property
    def kv_output(self) -> KVConnectorOutput:
        out = self.runner_output.kv_connector_output
        assert out is not None
        return out

    def connector_stats(self) -> dict[str, Any]:
        """The connector stats (workers' and scheduler's) vLLM logged."""
        for eco in self.outputs.values():
            if eco.scheduler_stats is not None:
                return dict(eco.scheduler_stats.kv_connector_stats or {})
        return {}


class Engine:
    """``EngineCore`` in one thread: vLLM's scheduler and one fake worker,
    after the handshake (the scheduler side learns the worker's layout)."""

    def __init__(self, scheduler: Scheduler, worker: FakeWorker):
        self.scheduler = scheduler
        self.worker = worker
        self.records: list[StepRecord] = []
        connector = scheduler.get_kv_connector()
        assert connector is not None
        handshake = worker.connector.get_handshake_metadata()
        assert handshake is not None
        connector.set_xfer_handshake_metadata({0: handshake})

    def add(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        return request

    def step(
        self, before_execute: Callable[[SchedulerOutput], None] | None = None
    ) -> StepRecord:
        so = self.scheduler.schedule()
        if before_execute is not None:
            before_execute(so)
        runner_output = self.worker.execute(so)
        outputs = self.scheduler.update_from_output(so, runner_output)
        record = StepRecord(so, runner_output, outputs)
        self.records.append(record)
        return record

    def run_until(
        self,
        done: Callable[[StepRecord], bool],
        max_steps: int = 200,
        pause_s: float = 0.002,
        before_execute: Callable[[SchedulerOutput], None] | None = None,
    ) -> StepRecord:
        """Step until ``done`` holds for a step (loads finish in the
        background: the steps pause a little); fails after ``max_steps``
        steps and at least :data:`MIN_RUN_S` seconds (lookups and loads have
        deadlines in time, and a loaded machine runs fewer steps in it)."""
        deadline = time.monotonic() + MIN_RUN_S
        steps = 0
        while steps < max_steps or time.monotonic() < deadline:
            record = self.step(before_execute)
            steps += 1
            if done(record):
                return record
            time.sleep(pause_s)
        raise AssertionError(f"not done after {steps} steps")

    def drain(self, max_steps: int = 200) -> None:
        """Step until every request has finished and been freed."""
        self.run_until(lambda _: not self.scheduler.has_requests(), max_steps)

    def counter(self, name: str) -> int:
        """A connector counter summed over every step's logged stats."""
        return sum(int(r.connector_stats().get(name, 0)) for r in self.records)

    def close(self) -> None:
        self.scheduler.shutdown()


@contextlib.contextmanager
def running(
    config: VllmConfig, worker_config: VllmConfig | None = None
) -> Iterator[tuple[Engine, FakeWorker]]:
    """An ``Engine`` of vLLM's scheduler on ``config`` and a worker (on
    ``worker_config``, by default the same), both closed afterwards."""
    worker = FakeWorker(worker_config or config)
    engine = Engine(create_scheduler(config), worker)
    try:
        yield engine, worker
    finally:
        engine.close()
        worker.close()


def epoch_of(engine: Engine) -> str | None:
    """The scheduler connector's epoch (a reset starts a new one)."""
    connector = engine.scheduler.connector
    assert isinstance(connector, VineyardConnector)
    assert connector._scheduler is not None
    return connector._scheduler._epoch


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No request, no held block (after vLLM's unit/utils.py)."""
    assert len(scheduler.requests) == 0
    assert len(scheduler.waiting) == 0
    assert len(scheduler.kv_holding_waiting) == 0
    assert len(scheduler.running) == 0
    assert len(scheduler.finished_recving_kv_req_ids) == 0
    assert len(scheduler.failed_recving_kv_req_ids) == 0
    assert len(scheduler._inflight_prefills) == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks)


def corrupt_entry(path: str, entry: int, entry_bytes: int, payload_bytes: int) -> None:
    """Flip one byte in the middle of entry ``entry``'s KV in a chunk file
    (an int32 count ``n``, ``n`` int32 ids, then the entries)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(4), "little")
        offset = 4 + 4 * n + entry * entry_bytes + payload_bytes // 2
        assert os.path.getsize(path) > offset, "no such entry"
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
