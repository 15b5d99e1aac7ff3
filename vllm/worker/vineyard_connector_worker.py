# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The worker side of ``VineyardConnector`` (one per TP rank).

Before the forward pass it loads the chunks the scheduler found cached
(:meth:`start_load_kv`); after it (:meth:`wait_for_save`) it stages the
newly completed chunks into a pool buffer and returns at once while the
backend writes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from vllm.distributed.parallel_state import get_tp_group
from vllm.logger import init_logger

from vllm.worker.vineyard_backend import BackendError
from vllm.worker.vineyard_config import VineyardLLMCacheConfig
from vllm.worker.vineyard_connector_metadata import (
    VineyardConnectorMetadata,
    VineyardHandshake,
)
from vllm.worker.vineyard_llm_cache import SaveRequest, VineyardLLMCache
from vllm.worker.vineyard_lookup import KVCacheLayout

logger = init_logger(__name__)


@dataclass
class _WorkerRequest:
    digests: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


def kv_layout_name(kv: torch.Tensor) -> str:
    """Everything that changes the meaning of a block's bytes: the device,
    the tensor's shape and, on the CPU, the instruction set that packs
    blocks (AMX and AVX-512 lay them out differently)."""
    name = f"{kv.device.type}:{'x'.join(map(str, kv.shape[1:]))}"
    if kv.device.type == "cpu":
        name += f":{torch.backends.cpu.get_cpu_capability()}"
    return name


class VineyardConnectorWorker:
    def __init__(
        self,
        config: VineyardLLMCacheConfig,
        layout_of: Callable[[torch.dtype, str, int, int], KVCacheLayout],
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
        self._short_loads: set[str] = set()
        self._tp_world_size = 1
        self.start_failures = 0  # not yet reported in the stats

    def register_kv_caches(self, tensors: list[torch.Tensor]) -> None:
        tp_group = get_tp_group()
        self._tp_world_size = tp_group.world_size
        layout = self._layout_of(
            tensors[0].dtype,
            kv_layout_name(tensors[0]),
            tp_group.world_size,
            tp_group.rank_in_group,
        )
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
            self.start_failures += 1

    def handshake(self) -> VineyardHandshake | None:
        return None if self.cache is None else VineyardHandshake(self.cache.layout)

    def _update_requests(self, meta: VineyardConnectorMetadata) -> None:
        for delta in meta.requests:
            state = self._requests.setdefault(delta.req_id, _WorkerRequest())
            state.digests.extend(delta.new_digests)
            if delta.replace_blocks:
                state.block_ids = list(delta.block_ids)
            else:
                state.block_ids.extend(delta.block_ids)

    def start_load_kv(self, meta: VineyardConnectorMetadata) -> None:
        if self.cache is None:  # unavailable: nothing is loaded or saved
            return
        self._update_requests(meta)
        for delta in meta.requests:
            if delta.load is None:
                continue
            start, end = delta.load
            state = self._requests[delta.req_id]
            loaded = self.cache.load(state.digests, start, end, state.block_ids)
            if loaded < end:
                bs = self.cache.layout.block_size
                self._load_errors.update(state.block_ids[loaded // bs : end // bs])
                # vLLM discards this step for the request and recomputes
                # from ``loaded``: its KV after that is not right until then.
                self._short_loads.add(delta.req_id)
                self.cache.resume_from(delta.req_id, loaded)

    def wait_for_save(self, meta: VineyardConnectorMetadata) -> None:
        if not meta.requests:  # the same on every rank
            return
        may_save = self.cache is not None and self.cache.can_save()
        if self._tp_world_size > 1:
            # Ranks store shards of the same chunks: they save or skip
            # together, so no rank holds chunks that its peers lack.
            flag = torch.tensor([int(may_save)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
            may_save = bool(flag.item())
        if self.cache is None:
            return
        # A request whose load came up short attended to blocks that were
        # never filled: nothing of this step is saved for it (later steps
        # save what vLLM recomputes).
        short, self._short_loads = self._short_loads, set()
        saves = [
            SaveRequest(
                req_id=delta.req_id,
                block_digests=self._requests[delta.req_id].digests,
                num_computed_tokens=delta.num_computed_tokens,
                block_ids=self._requests[delta.req_id].block_ids,
                save_from=delta.save_from,
            )
            for delta in meta.requests
            if delta.req_id not in short
        ]
        self.cache.save(saves, may_take_buffer=may_save)

    def get_finished(self, finished_req_ids: set[str]) -> None:
        for req_id in finished_req_ids:
            self._requests.pop(req_id, None)
            if self.cache is not None:
                self.cache.release(req_id)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.cache is not None:
            self.cache.close()
