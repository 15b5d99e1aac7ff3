# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What crosses from the scheduler to the workers each step, and from the
workers to the scheduler once (the handshake)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from vllm.worker.vineyard_lookup import KVCacheLayout


@dataclass
class RequestDelta:
    """A scheduled request's news for this step. Blocks are named by their
    chained digests (see :mod:`vineyard_store`), sent once each, so a decode
    step costs a few integers."""

    req_id: str
    new_digests: list[bytes]  # appended to the digests the worker has
    block_ids: list[int]  # appended, or the whole list if replace_blocks
    replace_blocks: bool  # first schedule, or resumed after preemption
    num_computed_tokens: int  # tokens whose KV exists after this step
    save_from: int  # where saves start (used on first sight)
    load: tuple[int, int] | None = None  # load tokens [start, end) first


@dataclass
class VineyardConnectorMetadata(KVConnectorMetadata):
    requests: list[RequestDelta] = field(default_factory=list)


@dataclass
class VineyardHandshake(KVConnectorHandshakeMetadata):
    """A worker's layout, so the scheduler looks up the same namespace."""

    layout: KVCacheLayout
