# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the cached bytes depend on (:class:`KVCacheLayout`, the namespace)
and the scheduler's lookup (:class:`VineyardCacheLookup`), which learns how
much of a prompt is cached from file metadata alone: no KV is read and no
backend process is involved."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.worker.vineyard_config import VineyardLLMCacheConfig
from vllm.worker.vineyard_metrics import VineyardCacheMetrics
from vllm.worker.vineyard_store import (
    FORMAT_VERSION,
    TRAILER_BYTES,
    ChunkFiles,
    synthetic_ids,
)


@dataclass(frozen=True)
class KVCacheLayout:
    """The shape of the KV that the cache stores, and its namespace.

    Vineyard keys chunks by ids alone, so everything that makes the bytes of
    a chunk differ goes into the namespace: two models (or dtypes, block or
    chunk sizes, kernel layouts, TP shards, storage formats, auth keys)
    sharing one root never see each other's KV.
    """

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    block_bytes: int  # one block of one layer
    kv_layout: str  # device, per-layer tensor shape, CPU instruction set
    chunk_size: int  # tokens
    tp_size: int = 1
    tp_rank: int = 0
    key_id: str = "nokey"  # which auth key seals the chunks

    def __post_init__(self) -> None:
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk of {self.chunk_size} tokens is not a whole number of "
                f"{self.block_size}-token blocks"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def payload_bytes(self) -> int:
        """One block of every layer: the payload of one vineyard entry."""
        return self.num_layers * self.block_bytes

    @property
    def entry_bytes(self) -> int:
        return self.payload_bytes + TRAILER_BYTES

    @property
    def namespace(self) -> str:
        ident = json.dumps(
            {
                "format": FORMAT_VERSION,
                **{k: getattr(self, k) for k in self.__dataclass_fields__},
            },
            sort_keys=True,
        )
        digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
        name = re.sub(
            r"[^A-Za-z0-9._-]+", "_", os.path.basename(self.model.rstrip("/"))
        )[:48]
        return (
            f"v{FORMAT_VERSION}-{name}-{digest}-c{self.chunk_size}"
            f"-tp{self.tp_size}r{self.tp_rank}-{self.key_id}"
        )

    def files(self, cache_root: str) -> ChunkFiles:
        return ChunkFiles(
            os.path.join(cache_root, self.namespace),
            self.blocks_per_chunk,
            self.entry_bytes,
        )


class VineyardCacheLookup:
    """The scheduler's view of the cache: how many leading chunks of a
    prompt every TP rank holds, by ``stat`` of their chunk files.

    A chunk is usable only if every rank has it (ranks store their own
    shards), so the answer is the minimum across ranks. A file that is there
    but turns out bad is caught by the worker's verification, and vLLM
    recomputes from there.
    """

    def __init__(
        self, config: VineyardLLMCacheConfig, layouts: Sequence[KVCacheLayout]
    ):
        assert layouts, "one layout per TP rank"
        self.chunk_size = layouts[0].chunk_size
        self.block_size = layouts[0].block_size
        self._files = [layout.files(config.root) for layout in layouts]
        self.metrics = VineyardCacheMetrics(config.metrics_enabled)

    def lookup(
        self, digests: Sequence[bytes], num_local_tokens: int, num_tokens: int
    ) -> tuple[int, int]:
        """How many tokens beyond vLLM's local prefix hit are cached.

        ``digests`` are the chained digests of the prompt's complete blocks.
        Returns ``(num_hit_tokens, save_from)``. The hit ends at the last
        complete block before the token vLLM must compute (so at most one
        block plus that token is recomputed); a chunk that reaches past
        that block is used in part. ``save_from`` is the end of the cached
        chunks, where the request's saves start.
        """
        bs, bpc = self.block_size, self.chunk_size // self.block_size
        want_blocks = min((num_tokens - 1) // bs, len(digests))
        # A chunk is found by the ids of all its blocks, so only chunks the
        # prompt holds whole can be looked up.
        max_chunks = min(-(-want_blocks // bpc), len(digests) // bpc)
        ids = synthetic_ids(digests[: max_chunks * bpc])
        cached = max_chunks
        for files in self._files:
            found = files.count_complete(ids, cached)
            self.metrics.add("lookup_stats", min(found + 1, cached))
            cached = found
        hit_end = min(cached * bpc, want_blocks) * bs
        num_hit = max(0, hit_end - num_local_tokens)
        self.metrics.add("query_tokens", max(0, want_blocks * bs - num_local_tokens))
        self.metrics.add("hit_tokens", num_hit)
        return num_hit, cached * self.chunk_size
