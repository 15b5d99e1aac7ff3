# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vineyard's KV cache as a backend opens it: ``vineyard.llm`` imported
without the rest of vineyard, and the cache of a namespace over the shared
buffers, one vineyard entry per KV block.

Imports neither vLLM nor torch (it runs in the backend process).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from vllm.worker.vineyard.backend.protocol import BackendSpec
from vllm.worker.vineyard.storage.chunks import HASH_DIGITS

YEAR_S = 365 * 24 * 3600

_REGISTRY_VAR = "__VINEYARD_INTERNAL_REGISTRY"


def import_vineyard_llm() -> Any:
    """``vineyard.llm`` without the rest of vineyard.

    vineyard's package ``__init__`` imports pandas, pyarrow and its
    deployment tools: over a second of CPU in every backend process, for
    nothing the file-mode KV cache uses. Its extension needs only vineyard's
    object registry, whose path vineyard's ``__init__`` passes in
    ``__VINEYARD_INTERNAL_REGISTRY`` while it loads its extensions; this
    does the same with an empty package module. Anywhere that layout is
    missing (another vineyard build), the full import.
    """
    if "vineyard" not in sys.modules:
        spec = importlib.util.find_spec("vineyard")
        locations = spec.submodule_search_locations if spec else None
        registry = (
            os.path.join(locations[0], "libvineyard_internal_registry.so")
            if locations
            else ""
        )
        if spec is not None and registry and os.path.isfile(registry):
            sys.modules["vineyard"] = importlib.util.module_from_spec(spec)
            before = os.environ.get(_REGISTRY_VAR)
            os.environ[_REGISTRY_VAR] = registry
            try:
                import vineyard.llm  # noqa: F401 - the package body is skipped
            except ImportError:
                for name in [m for m in sys.modules if m.split(".")[0] == "vineyard"]:
                    del sys.modules[name]
            finally:
                if before is None:
                    del os.environ[_REGISTRY_VAR]
                else:
                    os.environ[_REGISTRY_VAR] = before
    import vineyard.llm

    return vineyard.llm


def open_kv_cache(
    llm: Any, spec: BackendSpec, base: int
) -> tuple[Any, list[list[list[tuple[Any, Any]]]]]:
    """vineyard's KV cache of the namespace, and per buffer the list of its
    entries as vineyard takes them (the buffers start at address ``base``)."""
    # Expiry and eviction are the sweeper's (by last use, across every
    # process): vineyard's own TTL counts from the write and only for
    # the process that wrote, so it is switched off.
    config = llm.FileCacheConfig(
        chunk_size=spec.blocks_per_chunk,
        hash_chunk_size=HASH_DIGITS if spec.flat_paths else 2,
        root=spec.namespace_dir,
        gc_interval=YEAR_S,
        ttl=10 * YEAR_S,
    )
    half = spec.entry_bytes // 2
    cache = llm.KVCache(
        config, tensor_nbytes=half, cache_capacity=spec.max_blocks, layer=1
    )
    # One vineyard entry per block: K and V are the two halves of it.
    # Building these lists is slow, so once per buffer.
    kv_lists = [
        [
            [(llm.KVTensor(ptr, half), llm.KVTensor(ptr + half, half))]
            for ptr in range(
                base + b * spec.buffer_bytes,
                base + (b + 1) * spec.buffer_bytes,
                spec.entry_bytes,
            )
        ]
        for b in range(spec.num_buffers)
    ]
    return cache, kv_lists
