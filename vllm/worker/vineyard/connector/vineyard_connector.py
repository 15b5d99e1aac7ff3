# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``VineyardConnector``: vLLM V1's KV-connector hooks, forwarded to the
scheduler side (:mod:`.scheduler`) or the worker side (:mod:`.worker`) by
role."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector.metadata import VineyardConnectorMetadata
from vllm.worker.vineyard.connector.scheduler import VineyardConnectorScheduler
from vllm.worker.vineyard.connector.stats import (
    VineyardConnectorStats,
    VineyardPromMetrics,
)
from vllm.worker.vineyard.connector.worker import VineyardConnectorWorker, layout_for
from vllm.worker.vineyard.storage.digests import key_id, load_auth_key

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

CONNECTOR_NAME = "VineyardConnector"
#: The KV caches whose blocks the cache can move whole: full attention, and
#: sliding windows (vLLM frees a request's blocks once they leave the
#: window; the scheduler tells the workers, see ``RequestDelta.held_from``).
#: Exact types: subclasses such as R-SWA free blocks in the middle, sinks
#: and Mamba state are not plain token-aligned blocks.
SUPPORTED_KV_CACHE_SPECS = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)


def unsupported_kv_cache(kv_cache_config: KVCacheConfig) -> str | None:
    """Why the cache cannot serve a model with this KV cache, or None."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return f"{len(groups)} KV cache groups (supported: one)"
    spec = groups[0].kv_cache_spec
    if type(spec) not in SUPPORTED_KV_CACHE_SPECS:
        return (
            f"{type(spec).__name__} layers (supported: full or "
            "sliding-window attention)"
        )
    return None


class VineyardConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector backed by the vineyard LLM cache."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        # Settings are validated here, at startup, in every process.
        self.config = VineyardLLMCacheConfig.from_env(
            extra_config=self._kv_transfer_config.kv_connector_extra_config
        )
        self._key_id = key_id(
            load_auth_key(
                self.config.auth_key_file, self.config.setting("auth_key_file")
            )
        )
        # A model whose KV cache the cache cannot serve runs with it off.
        self._cache_off = unsupported_kv_cache(kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        self._group = groups[0] if groups else None
        spec = self._group.kv_cache_spec if self._group else None
        self.block_size = spec.block_size if spec else 0
        self.chunk_size = (
            0 if self._cache_off else self.config.chunk_tokens(self.block_size)
        )
        if self._cache_off and role == KVConnectorRole.SCHEDULER:
            logger.warning(
                "vineyard cache off for model %s: its KV cache has %s; it is "
                "served without the cache",
                vllm_config.model_config.model,
                self._cache_off,
            )
        self._scheduler: VineyardConnectorScheduler | None = None
        self._worker: VineyardConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(vllm_config, spec)
        else:
            self._worker = VineyardConnectorWorker(
                self.config,
                layout_for(vllm_config, self.config, self._group, self._key_id),
                vllm_config.scheduler_config.max_num_batched_tokens,
                kv_cache_config.num_blocks,
            )

    def _make_scheduler(
        self, vllm_config: VllmConfig, spec: KVCacheSpec | None
    ) -> VineyardConnectorScheduler:
        policy = self._kv_transfer_config.kv_load_failure_policy
        if policy != "recompute":
            # A cache is best-effort: a chunk evicted or found corrupt
            # between lookup and load is recomputed, never a failure.
            logger.info(
                "%s sets kv_load_failure_policy=recompute (was %s)",
                CONNECTOR_NAME,
                policy,
            )
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        events = vllm_config.kv_events_config
        return VineyardConnectorScheduler(
            self.config,
            self.block_size,
            self.chunk_size,
            vllm_config.parallel_config.tensor_parallel_size,
            publish_events=bool(events and events.enable_kv_cache_events),
            windowed=isinstance(spec, SlidingWindowSpec),
            cache_off=self._cache_off,
            prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is just a future cache miss

    def _meta(self) -> VineyardConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, VineyardConnectorMetadata)
        return meta

    # ---- worker side ---------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        if self._cache_off or self._group is None:
            return  # no cache: nothing is loaded or saved
        self._worker.register_kv_caches(
            [kv_caches[name] for name in self._group.layer_names]
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake() if self._worker else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.between_layers()  # never waits

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # saved once per step, after the forward pass

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._meta())

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return None, self._worker.get_finished(finished_req_ids) or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_report() if self._worker else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = VineyardConnectorStats()
        if self._worker is not None:
            stats.aggregate(VineyardConnectorStats(data=self._worker.take_stats()))
        if self._scheduler is not None:
            stats.aggregate(VineyardConnectorStats(data=self._scheduler.metrics.take()))
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
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ---- scheduler side ------------------------------------------------------

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.set_handshakes(metadata)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def reset_cache(self) -> bool | None:
        """Remove this instance's chunks from the root (see
        :meth:`VineyardConnectorScheduler.reset_cache`)."""
        return self._scheduler.reset_cache() if self._scheduler else None

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler.take_events() if self._scheduler else ()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.request_finished(request)
        return False, None
