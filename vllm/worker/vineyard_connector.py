# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``VineyardConnector``: vLLM V1's KV-connector hooks around every forward
pass, wired to :class:`~vllm.worker.vineyard_llm_cache.VineyardLLMCache`.

Scheduler side (EngineCore process): asks vineyard how many more prompt
tokens are cached (:meth:`get_num_new_matched_tokens`) and tells the worker,
per step, which cached chunks to load into which blocks and which tokens and
blocks each running request has now (:meth:`build_connector_meta`). Token ids
and block ids travel as deltas, so a decode step costs a few integers.

Worker side: loads before the forward pass (:meth:`start_load_kv`); after it
(:meth:`wait_for_save`) stages the newly completed chunks into a pool buffer
and returns at once while the backend writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.parallel_state import get_tp_group
from vllm.logger import init_logger

from vllm.worker.vineyard_backend import BackendError
from vllm.worker.vineyard_llm_cache import (
    COUNTERS,
    HISTOGRAMS,
    KVCacheLayout,
    SaveRequest,
    VineyardLLMCache,
    VineyardLLMCacheConfig,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

CONNECTOR_NAME = "VineyardConnector"
_NEVER = 1 << 62  # save_from of requests that must not be cached


# --------------------------------------------------------------------------
# What travels from the scheduler to the workers.
# --------------------------------------------------------------------------


@dataclass
class _RequestDelta:
    """A scheduled request's news for this step."""

    req_id: str
    new_token_ids: list[int]  # appended to what the worker has
    block_ids: list[int]  # appended, or the whole list if replace_blocks
    replace_blocks: bool  # first schedule, or resumed after preemption
    num_computed_tokens: int  # tokens whose KV exists after this step
    save_from: int  # where saves start (used on first sight)
    load: tuple[int, int] | None = None  # load tokens [start, end) first


@dataclass
class VineyardConnectorMetadata(KVConnectorMetadata):
    requests: list[_RequestDelta] = field(default_factory=list)


@dataclass
class VineyardHandshake(KVConnectorHandshakeMetadata):
    """A worker's layout, so the scheduler looks up the same namespace."""

    layout: KVCacheLayout


# --------------------------------------------------------------------------
# Metrics for vLLM's logger and /metrics.
# --------------------------------------------------------------------------


@dataclass
class VineyardConnectorStats(KVConnectorStats):
    """Counters (summed) and timing observations (concatenated)."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        for name in HISTOGRAMS:
            self.data.setdefault(name, [])

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        for name in HISTOGRAMS:
            self.data[name] = self.data[name] + list(other.data.get(name, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            name: self.data[name] for name in COUNTERS if self.data[name]
        }
        if self.data["query_tokens"]:
            out["hit_rate"] = round(
                self.data["hit_tokens"] / self.data["query_tokens"], 3
            )
        for name in HISTOGRAMS:
            values = self.data[name]
            if values:
                out[f"{name}_avg_ms"] = round(1000 * sum(values) / len(values), 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in COUNTERS + HISTOGRAMS)


_COUNTER_DOCS = {
    "query_tokens": "Tokens looked up in vineyard beyond the local prefix cache.",
    "hit_tokens": "Looked-up tokens found in vineyard.",
    "loaded_tokens": "Tokens whose KV was loaded from vineyard.",
    "load_errors": "Loads or lookups that failed or returned less than promised.",
    "updates_submitted": "Updates handed to the background writer.",
    "updates_completed": "Updates written by the backend.",
    "updates_skipped": "Updates skipped because every buffer was in flight.",
    "updates_failed": "Updates that failed (backend error, timeout or death).",
    "updates_dropped": "Updates dropped at shutdown after the drain timeout.",
    "tokens_written": "Tokens whose KV was written to vineyard.",
    "tokens_rejected": "Tokens vineyard refused (their prefix was not cached).",
    "backend_restarts": "Restarts of a vineyard backend process.",
    "backend_start_failures": "Caches that could not start (the cache is off).",
}
_HISTOGRAM_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1]
_HISTOGRAM_BUCKETS += [0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class VineyardPromMetrics(KVConnectorPromMetrics):
    """``vllm:vineyard_cache_*`` counters and histograms on ``/metrics``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {
                idx: metric.labels(*values)
                for idx, values in per_engine_labelvalues.items()
            }

        self._counters = {
            name: per_engine(
                self._counter_cls(
                    name=f"vllm:vineyard_cache_{name}",
                    documentation=doc,
                    labelnames=labelnames,
                )
            )
            for name, doc in _COUNTER_DOCS.items()
        }
        histogram_cls: Any = self._histogram_cls
        self._histograms = {
            name: per_engine(
                histogram_cls(
                    name=f"vllm:vineyard_cache_{name.removesuffix('_s')}_seconds",
                    documentation=f"vineyard cache {name.replace('_', ' ')}.",
                    buckets=_HISTOGRAM_BUCKETS,
                    labelnames=labelnames,
                )
            )
            for name in HISTOGRAMS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, counters in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counters[engine_idx].inc(value)
        for name, histograms in self._histograms.items():
            for value in transfer_stats_data.get(name, []):
                histograms[engine_idx].observe(value)


# --------------------------------------------------------------------------
# The connector.
# --------------------------------------------------------------------------


@dataclass
class _SchedulerRequest:
    request: Request
    tokens_sent: int = 0
    save_from: int = 0
    num_local_tokens: int = 0  # vLLM's own prefix-cache hit
    load: tuple[int, int] | None = None
    blocks_replaced: bool = True  # the next delta carries the full block list


@dataclass
class _WorkerRequest:
    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


def _cacheable(request: Request) -> bool:
    """Token ids alone must determine the KV: no embeddings, images, LoRA
    adapters or cache salts (which isolate tenants from each other)."""
    return (
        request.prompt_embeds is None
        and not request.mm_features
        and request.lora_request is None
        and getattr(request, "cache_salt", None) is None
    )


def lookup_all_ranks(
    lookups: Sequence[VineyardLLMCache], token_ids: Sequence[int], num_local: int
) -> tuple[int, int]:
    """:meth:`VineyardLLMCache.lookup` over every TP rank's namespace.

    Ranks store their own shards, so a chunk is usable only if every rank has
    it: the answer is the minimum (later ranks only look that far).
    """
    num_hit, save_from = lookups[0].lookup(token_ids, num_local)
    for cache in lookups[1:]:
        if num_hit == 0:
            break
        end = num_local + num_hit
        hit, rank_save_from = cache.lookup(token_ids[: end + 1], num_local)
        num_hit = min(num_hit, hit)
        save_from = min(save_from, rank_save_from)
    return num_hit, save_from


class VineyardConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector backed by the vineyard LLM cache."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = VineyardLLMCacheConfig.from_env()
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                f"{CONNECTOR_NAME} supports models with one KV cache group "
                f"(full attention); this model has "
                f"{len(kv_cache_config.kv_cache_groups)}"
            )
        self._group = kv_cache_config.kv_cache_groups[0]
        self.block_size = self._group.kv_cache_spec.block_size
        self.config.check_chunk_size(self.block_size)
        self.chunk_size = self.config.chunk_size
        self._max_num_batched_tokens = (
            vllm_config.scheduler_config.max_num_batched_tokens
        )
        # Scheduler state.
        self._lookups: list[VineyardLLMCache] = []
        self._requests: dict[str, _SchedulerRequest] = {}
        # Worker state.
        self._cache: VineyardLLMCache | None = None
        self._worker_requests: dict[str, _WorkerRequest] = {}
        self._load_errors: set[int] = set()
        self._tp_world_size = 1
        # Backend start failures not yet reported in the stats.
        self._start_failures = 0
        if role == KVConnectorRole.SCHEDULER:
            policy = self._kv_transfer_config.kv_load_failure_policy
            if policy != "recompute":
                # A cache is best-effort: a chunk evicted between lookup and
                # load must be recomputed, not fail the request.
                logger.info(
                    "%s sets kv_load_failure_policy=recompute (was %s)",
                    CONNECTOR_NAME,
                    policy,
                )
                self._kv_transfer_config.kv_load_failure_policy = "recompute"

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is just a future cache miss

    # ---- layout -------------------------------------------------------------

    def _layout(
        self, dtype: torch.dtype, kv_layout: str, tp_size: int, tp_rank: int
    ) -> KVCacheLayout:
        model_config = self._vllm_config.model_config
        parallel_config = self._vllm_config.parallel_config
        model = model_config.model
        if model_config.revision:
            model = f"{model}@{model_config.revision}"
        if model_config.quantization:
            model = f"{model}:{model_config.quantization}"
        return KVCacheLayout(
            model=model,
            dtype=str(dtype).removeprefix("torch."),
            num_layers=len(self._group.layer_names),
            num_kv_heads=model_config.get_num_kv_heads(parallel_config),
            head_size=model_config.get_head_size(),
            block_size=self.block_size,
            block_bytes=self._group.kv_cache_spec.page_size_bytes,
            kv_layout=kv_layout,
            tp_size=tp_size,
            tp_rank=tp_rank,
        )

    # ---- worker side ---------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = [kv_caches[name] for name in self._group.layer_names]
        first = tensors[0]
        per_block = list(first.shape)
        # Everything that changes the meaning of a block's bytes: the device,
        # the tensor's shape and, on the CPU, the instruction set that packs
        # blocks (AMX and AVX-512 lay them out differently).
        kv_layout = f"{first.device.type}:{'x'.join(map(str, per_block[1:]))}"
        if first.device.type == "cpu":
            kv_layout += f":{torch.backends.cpu.get_cpu_capability()}"
        tp_group = get_tp_group()
        self._tp_world_size = tp_group.world_size
        layout = self._layout(
            first.dtype, kv_layout, tp_group.world_size, tp_group.rank_in_group
        )
        try:
            self._cache = VineyardLLMCache(
                self.config,
                layout,
                self._max_num_batched_tokens,
                tensors,
                num_blocks=self._kv_cache_config.num_blocks,
            )
        except BackendError as e:
            # A backend that cannot start (e.g. the root cannot be created)
            # is backend trouble: serve without the cache (no handshake, so
            # the scheduler neither loads nor saves), but say so.
            logger.error("vineyard cache unavailable, serving without it: %s", e)
            self._start_failures += 1

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None if self._cache is None else VineyardHandshake(self._cache.layout)

    def _update_worker_requests(self, meta: VineyardConnectorMetadata) -> None:
        for delta in meta.requests:
            state = self._worker_requests.setdefault(delta.req_id, _WorkerRequest())
            state.token_ids.extend(delta.new_token_ids)
            if delta.replace_blocks:
                state.block_ids = list(delta.block_ids)
            else:
                state.block_ids.extend(delta.block_ids)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, VineyardConnectorMetadata)
        if self._cache is None:  # unavailable: nothing is loaded or saved
            return
        self._update_worker_requests(meta)
        for delta in meta.requests:
            if delta.load is None:
                continue
            start, end = delta.load
            state = self._worker_requests[delta.req_id]
            loaded = self._cache.load(state.token_ids, start, end, state.block_ids)
            if loaded < end:
                bs = self.block_size
                self._load_errors.update(state.block_ids[loaded // bs : end // bs])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saved once per step, after the forward pass

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, VineyardConnectorMetadata)
        if not meta.requests:  # the same on every rank
            return
        may_save = self._cache is not None and self._cache.can_save()
        if self._tp_world_size > 1:
            # Ranks store shards of the same chunks: they save or skip
            # together, so no rank holds chunks that its peers lack.
            flag = torch.tensor([int(may_save)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
            may_save = bool(flag.item())
        if self._cache is None:
            return
        saves = []
        for delta in meta.requests:
            state = self._worker_requests[delta.req_id]
            saves.append(
                SaveRequest(
                    req_id=delta.req_id,
                    token_ids=state.token_ids,
                    num_computed_tokens=delta.num_computed_tokens,
                    block_ids=state.block_ids,
                    save_from=delta.save_from,
                )
            )
        self._cache.save(saves, may_take_buffer=may_save)

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        for req_id in finished_req_ids:
            self._worker_requests.pop(req_id, None)
            if self._cache is not None:
                self._cache.release(req_id)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        caches = [self._cache] if self._cache is not None else self._lookups
        stats = VineyardConnectorStats()
        stats.data["backend_start_failures"] = self._start_failures
        self._start_failures = 0
        for rank, cache in enumerate(caches):
            data = cache.metrics.take()
            if rank > 0:
                # Every TP rank's namespace is looked up for the same tokens:
                # count the request's tokens once.
                data["query_tokens"] = data["hit_tokens"] = 0
            stats.aggregate(VineyardConnectorStats(data=data))
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return VineyardConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return VineyardPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def shutdown(self) -> None:
        if self._cache is not None:
            self._cache.close()
        for cache in self._lookups:
            cache.close()

    # ---- scheduler side ------------------------------------------------------

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Open each TP rank's namespace for lookups (rank order)."""
        num_ranks = self._vllm_config.parallel_config.tensor_parallel_size
        if len(metadata) < num_ranks:
            logger.error(
                "vineyard cache open on %d of %d workers: cache off",
                len(metadata),
                num_ranks,
            )
            return
        try:
            for _, handshake in sorted(metadata.items()):
                assert isinstance(handshake, VineyardHandshake)
                self._lookups.append(
                    VineyardLLMCache(
                        self.config, handshake.layout, self._max_num_batched_tokens
                    )
                )
        except BackendError as e:
            logger.error("vineyard cache lookups unavailable, cache off: %s", e)
            self._start_failures += 1
            for cache in self._lookups:
                cache.close()
            self._lookups = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _SchedulerRequest(request)
        state.load = None
        state.num_local_tokens = num_computed_tokens
        if not self._lookups or not _cacheable(request):
            state.save_from = _NEVER
            return 0, False
        num_hit, save_from = lookup_all_ranks(
            self._lookups, request.all_token_ids, num_computed_tokens
        )
        if state.tokens_sent == 0:
            state.save_from = save_from
        return num_hit, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens == 0:
            return
        start = state.num_local_tokens
        state.load = (start, start + num_external_tokens)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        meta = VineyardConnectorMetadata()
        if not self._lookups:
            return meta  # the cache is off: nothing to load or save
        new_blocks: dict[str, tuple[list[int], bool]] = {}
        for new_req in scheduler_output.scheduled_new_reqs:
            new_blocks[new_req.req_id] = (list(new_req.block_ids[0]), True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            block_ids = cached.new_block_ids[i]
            new_blocks[req_id] = (
                list(block_ids[0]) if block_ids else [],
                req_id in cached.resumed_req_ids,
            )
        chunk = self.chunk_size
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or state.save_from == _NEVER:
                continue  # not cacheable: the worker needs nothing
            request = state.request
            num_computed = request.num_computed_tokens + num_scheduled
            blocks, replace = new_blocks.get(req_id, ([], False))
            # Send the tokens of completed chunks (and of what is loaded).
            needed = num_computed // chunk * chunk
            if state.load is not None:
                needed = max(needed, state.load[1])
            needed = min(needed, request.num_tokens)
            new_tokens = list(request.all_token_ids[state.tokens_sent : needed])
            state.tokens_sent = max(state.tokens_sent, needed)
            meta.requests.append(
                _RequestDelta(
                    req_id=req_id,
                    new_token_ids=new_tokens,
                    block_ids=blocks,
                    replace_blocks=replace or state.blocks_replaced,
                    num_computed_tokens=num_computed,
                    save_from=state.save_from,
                    load=state.load,
                )
            )
            state.load = None
            state.blocks_replaced = False
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None
