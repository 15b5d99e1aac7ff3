# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the cached bytes depend on: :class:`KVCacheLayout`, the shape of
the stored KV and the namespace it is stored under, and the fingerprints of
model weights and overrides that go into it."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass

from vllm.worker.vineyard.storage.chunks import (
    FORMAT_VERSION,
    TRAILER_BYTES,
    ChunkFiles,
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
    # What changes the KV bytes under the same shapes: vLLM's KV cache dtype
    # (fp8 variants are all stored as uint8), the weights' identity and the
    # config overrides.
    kv_cache_dtype: str = "auto"
    weights: str = ""
    hf_overrides: str = ""

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


#: Checkpoint files whose identity goes into the namespace.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_FINGERPRINT_READ = 1 << 20  # bytes read from each end of a weight file
#: Config files hashed whole: a model's, and a LoRA adapter's.
_CONFIG_FILES = ("config.json", "adapter_config.json")


def weights_fingerprint(model: str, revision: str | None) -> str:
    """What identifies the weights (of a model or a LoRA adapter), so that
    weights updated in place (at the same path or an unpinned hub name) get
    a new namespace or new digests: for a local
    checkpoint, a hash of its config and index files, and of each weight
    file's name, size and first and last MiB; for a hub name, the pinned
    revision, or the commit of the snapshot vLLM downloaded."""
    if os.path.isdir(model):
        h = hashlib.sha256()
        for name in sorted(os.listdir(model)):
            path = os.path.join(model, name)
            if not os.path.isfile(path):
                continue
            if name in _CONFIG_FILES or name.endswith("index.json"):
                with open(path, "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
            elif name.endswith(_WEIGHT_SUFFIXES):
                size = os.path.getsize(path)
                h.update(f"{name}\0{size}\0".encode())
                with open(path, "rb") as f:
                    h.update(f.read(_FINGERPRINT_READ))
                    f.seek(max(0, size - _FINGERPRINT_READ))
                    h.update(f.read(_FINGERPRINT_READ))
        return "sha256:" + h.hexdigest()[:32]
    if revision:
        return f"revision:{revision}"
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # noqa: BLE001 - no hub, no snapshot: best effort
        found = None
    if isinstance(found, str):
        # .../snapshots/<commit>/config.json
        return "commit:" + os.path.basename(os.path.dirname(found))
    return "unknown"


def overrides_text(overrides: object) -> str:
    """vLLM's ``hf_overrides`` as a stable string (a callable by name)."""
    if not overrides:
        return ""
    if callable(overrides):
        module = getattr(overrides, "__module__", "")
        return f"callable:{module}.{getattr(overrides, '__qualname__', '')}"
    return json.dumps(overrides, sort_keys=True, default=str)
