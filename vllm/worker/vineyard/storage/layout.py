# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the cached bytes depend on: :class:`KVCacheLayout`, the shape of
the stored KV and the namespace it is stored under, with the identity of
the model's weights (:mod:`~vllm.worker.vineyard.storage.weights`) and its
config overrides."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.digests import FORMAT_VERSION
from vllm.worker.vineyard.storage.sealing import TRAILER_BYTES


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
    # What changes the KV bytes under the same shapes: vLLM's KV cache dtype
    # (fp8 variants are all stored as uint8), the weights' identity and the
    # config overrides.
    kv_cache_dtype: str = "auto"
    weights: str = ""
    hf_overrides: str = ""
    flat_paths: bool = True  # chunk files right in the namespace's folder

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
            self.flat_paths,
        )


def overrides_text(overrides: object) -> str:
    """vLLM's ``hf_overrides`` as a stable string (a callable by name)."""
    if not overrides:
        return ""
    if callable(overrides):
        module = getattr(overrides, "__module__", "")
        return f"callable:{module}.{getattr(overrides, '__qualname__', '')}"
    return json.dumps(overrides, sort_keys=True, default=str)
