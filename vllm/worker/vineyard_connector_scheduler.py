# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler side of ``VineyardConnector`` (EngineCore process).

It asks the cache how many more prompt tokens are cached (by file metadata,
reading no KV) and tells the workers, per step, which cached chunks to load
into which blocks and which blocks each running request has now. Blocks are
named by chained digests of their token ids (and ``cache_salt``), computed
here once and sent to the workers as deltas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from vllm.worker.vineyard_config import VineyardLLMCacheConfig
from vllm.worker.vineyard_connector_metadata import (
    RequestDelta,
    VineyardConnectorMetadata,
    VineyardHandshake,
)
from vllm.worker.vineyard_lookup import VineyardCacheLookup
from vllm.worker.vineyard_metrics import VineyardCacheMetrics
from vllm.worker.vineyard_store import extend_digests

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

NEVER = 1 << 62  # save_from of requests that must not be cached


def cacheable(request: Request) -> bool:
    """Token ids (and the salt, which goes into the digests) must determine
    the KV: no embeddings, images or LoRA adapters."""
    return (
        request.prompt_embeds is None
        and not request.mm_features
        and request.lora_request is None
    )


@dataclass
class _RequestState:
    request: Request
    digests: list[bytes] = field(default_factory=list)
    digests_sent: int = 0
    save_from: int = 0
    num_local_tokens: int = 0  # vLLM's own prefix-cache hit
    load: tuple[int, int] | None = None
    blocks_replaced: bool = True  # the next delta carries the full block list

    def digests_up_to(self, num_tokens: int, block_size: int) -> list[bytes]:
        """The digests of the complete blocks among the first
        ``num_tokens`` tokens (computed once per block)."""
        if len(self.digests) * block_size < num_tokens // block_size * block_size:
            extend_digests(
                self.digests,
                self.request.all_token_ids[:num_tokens],
                block_size,
                self.request.cache_salt,
            )
        return self.digests


class VineyardConnectorScheduler:
    def __init__(
        self,
        config: VineyardLLMCacheConfig,
        block_size: int,
        chunk_size: int,
        tp_size: int,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._tp_size = tp_size
        self._lookup: VineyardCacheLookup | None = None
        self._requests: dict[str, _RequestState] = {}
        self._idle_metrics = VineyardCacheMetrics(config.metrics_enabled)

    @property
    def metrics(self) -> VineyardCacheMetrics:
        return self._lookup.metrics if self._lookup else self._idle_metrics

    def set_handshakes(
        self, metadata: Mapping[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Open each TP rank's namespace for lookups (rank order)."""
        if len(metadata) < self._tp_size:
            logger.error(
                "vineyard cache open on %d of %d workers: cache off",
                len(metadata),
                self._tp_size,
            )
            return
        layouts = []
        for _, handshake in sorted(metadata.items()):
            assert isinstance(handshake, VineyardHandshake)
            layouts.append(handshake.layout)
        self._lookup = VineyardCacheLookup(self.config, layouts)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestState(request)
        state.load = None
        state.num_local_tokens = num_computed_tokens
        if self._lookup is None or not cacheable(request):
            state.save_from = NEVER
            return 0, False
        digests = state.digests_up_to(request.num_tokens, self.block_size)
        num_hit, save_from = self._lookup.lookup(
            digests, num_computed_tokens, request.num_tokens
        )
        if state.digests_sent == 0:
            state.save_from = save_from
        return num_hit, False

    def update_state_after_alloc(self, request: Request, num_external: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external == 0:
            return
        start = state.num_local_tokens
        state.load = (start, start + num_external)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> VineyardConnectorMetadata:
        meta = VineyardConnectorMetadata()
        if self._lookup is None:
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
        chunk, bs = self.chunk_size, self.block_size
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or state.save_from == NEVER:
                continue  # not cacheable: the worker needs nothing
            request = state.request
            num_computed = request.num_computed_tokens + num_scheduled
            blocks, replace = new_blocks.get(req_id, ([], False))
            # The digests of completed chunks, and of every chunk a load
            # reads (a load that ends inside a chunk reads all of it).
            needed = num_computed // chunk * chunk
            if state.load is not None:
                needed = max(needed, -(-state.load[1] // chunk) * chunk)
            digests = state.digests_up_to(min(needed, request.num_tokens), bs)
            new_digests = digests[state.digests_sent : needed // bs]
            state.digests_sent += len(new_digests)
            meta.requests.append(
                RequestDelta(
                    req_id=req_id,
                    new_digests=new_digests,
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

    def request_finished(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
