# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM KV events for the blocks an instance knows are in vineyard, so a
KV-aware router sees a prefix that is one load away (scheduler side).

With ``--kv-events-config`` on, the scheduler announces ``BlockStored``
(medium ``STORAGE``) for a request's blocks once every TP rank has saved
them, or once a lookup finds them on the root; and ``BlockRemoved`` when
this instance's sweeps evict or expire them, or :meth:`reset_cache`
removes them. Blocks carry vLLM's own block hashes (those of the GPU
prefix cache's events for the same tokens), so a router matches them to
prompts the same way. What another instance saves or evicts on a shared
root is announced by that instance only.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.digests import synthetic_ids

if TYPE_CHECKING:
    from vllm.v1.request import Request

#: Chunks whose removal can still be announced; older ones are forgotten
#: (their removal then goes unannounced, which a router ages out).
MAX_TRACKED_CHUNKS = 200_000


class StorageEvents:
    """Collects the events of one scheduler; :meth:`take` drains them."""

    def __init__(self, block_size: int, rank_files: Sequence[ChunkFiles]):
        self.block_size = block_size
        self._rank_files = list(rank_files)
        self._events: list[KVCacheEvent] = []
        # announced chunk (by rank 0's path) -> (vLLM hashes of its blocks,
        # its files on every rank); a chunk is gone once any rank's file is.
        self._chunks: collections.OrderedDict[
            str, tuple[list[ExternalBlockHash], list[str]]
        ] = collections.OrderedDict()
        self._chunk_of_path: dict[str, str] = {}

    def stored(
        self, request: Request, digests: Sequence[bytes], first: int, end: int
    ) -> None:
        """Blocks ``[first, end)`` of ``request`` (whole chunks) are in
        vineyard on every rank."""
        hashes = request.block_hashes
        end = min(end, len(hashes), len(digests))
        if end <= first:
            return  # vLLM computes no block hashes (prefix caching off)
        bs = self.block_size
        lora = request.lora_request
        converted = [maybe_convert_block_hash(h) for h in hashes[first:end]]
        self._events.append(
            BlockStored(
                block_hashes=list(converted),
                parent_block_hash=(
                    maybe_convert_block_hash(hashes[first - 1]) if first else None
                ),
                token_ids=list(request.all_token_ids[first * bs : end * bs]),
                block_size=bs,
                lora_id=lora.lora_int_id if lora else None,
                medium=MEDIUM_STORAGE,
                lora_name=lora.lora_name if lora else None,
            )
        )
        ids = synthetic_ids(digests[:end])
        bpc = self._rank_files[0].blocks_per_chunk
        for chunk_end in range(first + bpc, end + 1, bpc):
            paths = [files.path(ids[:chunk_end]) for files in self._rank_files]
            key = paths[0]
            self._chunks[key] = (
                converted[chunk_end - bpc - first : chunk_end - first],
                paths,
            )
            self._chunks.move_to_end(key)
            for path in paths:
                self._chunk_of_path[path] = key
        while len(self._chunks) > MAX_TRACKED_CHUNKS:
            _, (_, paths) = self._chunks.popitem(last=False)
            for path in paths:
                self._chunk_of_path.pop(path, None)

    def removed(self, paths: Iterable[str]) -> None:
        """These chunk files were removed (evicted, expired, purged)."""
        hashes: list[ExternalBlockHash] = []
        for path in paths:
            key = self._chunk_of_path.pop(path, None)
            chunk = self._chunks.pop(key, None) if key is not None else None
            if chunk is not None:
                hashes.extend(chunk[0])
                for other in chunk[1]:
                    self._chunk_of_path.pop(other, None)
        if hashes:
            self._events.append(
                BlockRemoved(
                    block_hashes=list(dict.fromkeys(hashes)), medium=MEDIUM_STORAGE
                )
            )

    def removed_all(self) -> None:
        """Every announced block is gone (the cache was reset)."""
        self.removed(list(self._chunks))

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
