# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker side of ``VineyardConnector`` (one per TP rank).

Loads are asynchronous but for cheap ones the scheduler orders before a
step's forward pass, which :meth:`start_load_kv` waits for (see
:mod:`.load_orders`). Otherwise it hands the reads of the blocks the
scheduler found cached to the reader backends and returns; each step
collects the reads that arrived, copies them into place and reports the
finished loads (:meth:`get_finished`) and the blocks that could not be
loaded (:meth:`take_load_errors`), while the requests wait in vLLM's
``WAITING_FOR_REMOTE_KVS``. After the forward pass (:meth:`wait_for_save`)
it stages the newly completed chunks into a pool buffer and returns at once
while the backend writes them. After each step the worker reports to the
scheduler (:meth:`build_report`) what this rank's writes stored and
whether its reader can load: no step runs a collective; the
scheduler decides on the minimum over ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.parallel_state import get_tp_group
from vllm.logger import init_logger

from vllm.worker.vineyard.backend.protocol import BackendError
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector.metadata import (
    VineyardConnectorMetadata,
    VineyardHandshake,
    VineyardWorkerReport,
)
from vllm.worker.vineyard.connector.weight_identity import model_identity
from vllm.worker.vineyard.metrics import VineyardCacheMetrics
from vllm.worker.vineyard.storage.chunking import blocks_per_chunk_of
from vllm.worker.vineyard.storage.file_modes import file_modes
from vllm.worker.vineyard.storage.layout import KVCacheLayout, overrides_text
from vllm.worker.vineyard.storage.root import check_root
from vllm.worker.vineyard.storage.weights import WeightsUnidentified
from vllm.worker.vineyard.transfer.saves import SaveRequest
from vllm.worker.vineyard_llm_cache import VineyardLLMCache

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

logger = init_logger(__name__)

#: A worker's layout from its KV tensor's dtype and kernel layout and its
#: TP size and rank.
LayoutOf = Callable[[torch.dtype, str, int, int], KVCacheLayout]


@dataclass
class _WorkerRequest:
    digests: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    held_from: int = 0  # blocks before it vLLM has freed (sliding window)


def layout_for(
    vllm_config: VllmConfig,
    config: VineyardLLMCacheConfig,
    group: KVCacheGroupSpec | None,
    key_id: str,
) -> LayoutOf:
    """How this engine's workers name the layout of their KV (and so its
    namespace), once they know the tensor's dtype and kernel layout and
    their TP rank. The chunk size is the setting's, or (none set) the one
    recorded in the root for its round trip (:mod:`~vllm.worker.vineyard.
    storage.chunking`). Raises :class:`WeightsUnidentified`, and
    :class:`BackendError` when the root cannot be reached."""

    def layout(
        dtype: torch.dtype, kv_layout: str, tp_size: int, tp_rank: int
    ) -> KVCacheLayout:
        assert group is not None
        block_size = group.kv_cache_spec.block_size
        if config.chunk_size:
            chunk_size = config.chunk_tokens(block_size)
        else:
            modes = file_modes(config.group_access)
            try:
                root = check_root(config.root, modes, config.setting("root"))
                chunk_size = block_size * blocks_per_chunk_of(root, block_size, modes)
            except OSError as e:
                raise BackendError(f"cannot reach the cache root: {e}") from e
        model_config = vllm_config.model_config
        model = model_config.model
        if model_config.revision:
            model = f"{model}@{model_config.revision}"
        if model_config.quantization:
            model = f"{model}:{model_config.quantization}"
        return KVCacheLayout(
            model=model,
            dtype=str(dtype).removeprefix("torch."),
            num_layers=len(group.layer_names),
            num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
            head_size=model_config.get_head_size(),
            block_size=block_size,
            block_bytes=group.kv_cache_spec.page_size_bytes,
            kv_layout=kv_layout,
            chunk_size=chunk_size,
            tp_size=tp_size,
            tp_rank=tp_rank,
            key_id=key_id,
            kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
            weights=model_identity(vllm_config),
            hf_overrides=overrides_text(model_config.hf_overrides),
        )

    return layout


def kv_layout_name(kv: torch.Tensor) -> str:
    """Everything that changes the meaning of a block's bytes: the device,
    the tensor's shape and, on the CPU, the instruction set that packs
    blocks (AMX and AVX-512 lay them out differently)."""
    name = f"{kv.device.type}:{'x'.join(map(str, kv.shape[1:]))}"
    if kv.device.type == "cpu":
        name += f":{torch.backends.cpu.get_cpu_capability()}"
    return name


#: Inside a forward pass, loads are moved on at most this often (before a
#: layer's attention): a read answered mid-pass has the next one sent then,
#: not at the pass's end, so a load of several reads finishes in one step.
BETWEEN_LAYERS_POLL_S = 0.002
#: How often a load before the forward pass is moved on while waited for.
LOAD_NOW_POLL_S = 0.0005


class VineyardConnectorWorker:
    def __init__(
        self,
        config: VineyardLLMCacheConfig,
        layout_of: LayoutOf,
        max_num_batched_tokens: int,
        num_blocks: int,
    ) -> None:
        self.config = config
        self._layout_of = layout_of
        self._max_num_batched_tokens = max_num_batched_tokens
        self._num_blocks = num_blocks
        self.cache: VineyardLLMCache | None = None
        self._requests: dict[str, _WorkerRequest] = {}
        self._load_errors: set[int] = set()
        # Loads before this forward pass, and when each is stopped.
        self._sync_loads: dict[str, float] = {}
        self._finished_loading: set[str] = set()  # to report (asynchronous)
        self._could_load: bool | None = None  # as last reported
        self._resets = 0  # the scheduler's reset_cache calls, as seen
        self._polled_at = 0.0  # the last poll between layers (monotonic)
        # What happens to the worker before (or instead of) its cache.
        self._metrics = VineyardCacheMetrics(config.metrics_enabled)

    def register_kv_caches(self, tensors: list[torch.Tensor]) -> None:
        tp_group = get_tp_group()
        try:
            layout = self._layout_of(
                tensors[0].dtype,
                kv_layout_name(tensors[0]),
                tp_group.world_size,
                tp_group.rank_in_group,
            )
        except WeightsUnidentified as e:
            # Its KV could not be told from other weights' KV: no cache.
            logger.error(
                "vineyard cache off: the model's weights cannot be identified "
                "(%s); serving without the cache",
                e,
            )
            self._metrics.add("unidentified_weights")
            return
        except BackendError as e:
            logger.error("vineyard cache unavailable, serving without it: %s", e)
            self._metrics.add("backend_start_failures")
            return
        try:
            self.cache = VineyardLLMCache(
                self.config,
                layout,
                self._max_num_batched_tokens,
                tensors,
                self._num_blocks,
            )
        except BackendError as e:
            # A backend that cannot start (e.g. the root cannot be created)
            # is backend trouble: serve without the cache (no handshake, so
            # the scheduler neither loads nor saves), but say so.
            logger.error("vineyard cache unavailable, serving without it: %s", e)
            self._metrics.add("backend_start_failures")

    def handshake(self) -> VineyardHandshake | None:
        return None if self.cache is None else VineyardHandshake(self.cache.layout)

    def _update_requests(self, meta: VineyardConnectorMetadata) -> None:
        for delta in meta.requests:
            state = self._requests.setdefault(delta.req_id, _WorkerRequest())
            state.digests[delta.digests_from :] = delta.new_digests
            if delta.replace_blocks:
                state.block_ids = list(delta.block_ids)
                state.held_from = delta.held_from
            else:
                state.block_ids.extend(delta.block_ids)
                state.held_from = max(state.held_from, delta.held_from)

    def start_load_kv(self, meta: VineyardConnectorMetadata) -> None:
        if self.cache is None:  # unavailable: nothing is loaded or saved
            return
        if meta.resets != self._resets:
            self._resets = meta.resets
            self.cache.fence()
        self._update_requests(meta)
        for order in meta.read_aheads:
            self.cache.loads.read_ahead(
                order.req_id, order.digests, order.start, order.end
            )
        for delta in meta.requests:
            if delta.load is None and delta.replace_blocks:
                # Scheduled without a load: what was read ahead is not used.
                self.cache.loads.drop_read_ahead(delta.req_id)
            if delta.load is not None:
                state = self._requests[delta.req_id]
                start, end = delta.load
                stop_at = None
                if delta.sync_wait_s is not None:
                    stop_at = time.monotonic() + delta.sync_wait_s
                    self._sync_loads[delta.req_id] = stop_at
                self.cache.loads.start(
                    delta.req_id,
                    state.digests,
                    start,
                    end,
                    state.block_ids,
                    delta.compute_s_per_token,
                    delta.load_s_per_block,
                    stop_at,
                )
        self.cache.loads.poll()
        for req_id, stop_at in list(self._sync_loads.items()):
            self._load_now(req_id, stop_at)
        self._take_finished_loads()

    def _load_now(self, req_id: str, stop_at: float) -> None:
        """Wait for a load ordered before this forward pass until it
        finishes or is stopped where it is (past ``stop_at``, not counting
        its reader's wait for a CPU; the blocks it left are reported in this
        step and vLLM recomputes its request from there). Never returns
        while it loads: the pass attends to its request's blocks."""
        assert self.cache is not None
        loads = self.cache.loads
        while loads.loading(req_id):
            # Judged past stop_at: a load past its deadline stops.
            loads.poll(judge=time.monotonic() >= stop_at)
            if loads.loading(req_id):
                time.sleep(LOAD_NOW_POLL_S)

    def between_layers(self) -> None:
        """vLLM's hook before a layer's attention: loads move on (answers
        copied, next reads sent), never waiting, and are judged slow only
        when a step starts and ends, as without these polls. What is copied
        belongs to requests that wait for their loads, never to this pass's."""
        if self.cache is None or not self.cache.loads.reading:
            return
        now = time.monotonic()
        if now - self._polled_at >= BETWEEN_LAYERS_POLL_S:
            self._polled_at = now
            self.cache.loads.poll(judge=False)

    def wait_for_save(self, meta: VineyardConnectorMetadata) -> None:
        if self.cache is None or not meta.requests:
            return
        saves = [
            SaveRequest(
                req_id=delta.req_id,
                block_digests=self._requests[delta.req_id].digests,
                num_computed_tokens=delta.num_computed_tokens,
                block_ids=self._requests[delta.req_id].block_ids,
                save_from=delta.save_from,
                held_from=self._requests[delta.req_id].held_from,
            )
            for delta in meta.requests
            # A request waiting for its load has nothing new computed.
            if not self.cache.loads.loading(delta.req_id)
        ]
        self.cache.saves.save(saves)

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """The requests whose loads finished (loaded, short or cancelled)
        since the last call; forgets the requests vLLM finished."""
        if self.cache is not None:
            for req_id in finished_req_ids:
                self.cache.loads.cancel(req_id)  # aborted while loading
            self.cache.loads.poll()
            self._take_finished_loads()
        finished_loading, self._finished_loading = self._finished_loading, set()
        for req_id in finished_req_ids:
            self._requests.pop(req_id, None)
            if self.cache is not None:
                self.cache.saves.release(req_id)
        return finished_loading

    def _take_finished_loads(self) -> None:
        """The loads that finished: the blocks each left are reported (vLLM
        recomputes from the first, and the scheduler has them saved again
        on every rank); an asynchronous one is reported finished by
        :meth:`get_finished`."""
        assert self.cache is not None
        bs = self.cache.layout.block_size
        for req_id, loaded, end in self.cache.loads.take_finished():
            sync = self._sync_loads.pop(req_id, None) is not None
            if not sync:
                self._finished_loading.add(req_id)
            state = self._requests.get(req_id)
            if loaded < end and state is not None:
                self._load_errors.update(state.block_ids[loaded // bs : end // bs])

    def build_report(self) -> VineyardWorkerReport | None:
        """What happened since the last report: what this rank's writes
        stored (also of requests that finished meanwhile), whether its
        reader can load, and which chunk files were removed."""
        if self.cache is None:
            return None
        rank = self.cache.layout.tp_rank
        report = VineyardWorkerReport(resets=self._resets)
        stored = self.cache.saves.take_stored()
        if stored:
            report.stored[rank] = stored
        can_load = self.cache.can_load()
        if can_load != self._could_load:
            self._could_load = can_load
            report.can_load[rank] = can_load
        report.removed = self.cache.take_removed_paths()
        report.unreadable = self.cache.take_unreadable()
        report.load_times = self.cache.loads.take_load_times()
        read_ahead = self.cache.loads.take_read_ahead()
        if read_ahead:
            report.read_ahead[rank] = read_ahead
        news = (
            report.stored
            or report.can_load
            or report.removed
            or report.unreadable
            or report.load_times
            or report.read_ahead
        )
        return report if news else None

    def take_stats(self) -> dict[str, Any]:
        """What the worker and its cache counted since the last call."""
        stats = self._metrics.take()
        if self.cache is not None:
            for name, value in self.cache.metrics.take().items():
                stats[name] = stats.get(name, 0) + value
        return stats

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.cache is not None:
            self.cache.close()
