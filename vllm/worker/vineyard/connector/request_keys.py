# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What besides its token ids determines a request's KV, as the cache's
block digests carry it (see
:func:`~vllm.worker.vineyard.storage.chunks.extend_digests`).

- ``cache_salt``: the digest chain starts from it.
- A LoRA adapter: its name, path and a fingerprint of its files (config
  and weights, computed once per adapter load): the same prompt with
  another adapter, or an adapter retrained under the same name, never
  shares KV. vLLM's own block keys hold the name and path only.
- Multimodal items and prompt embeddings: vLLM's own per-block keys
  (``generate_block_hash_extra_keys``): each item's hash and placeholder
  offset in every block it covers, the embeddings' bytes of each block.
  Items are named by vLLM's content hash, or by the ``multi_modal_uuids``
  the caller gave (trusted, as vLLM's own prefix cache trusts them).

Plain token-id requests get no extra keys, so their digests (and the files
already on a root) stay as they were.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from vllm.worker.vineyard.storage.layout import weights_fingerprint

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request


@dataclass(frozen=True)
class RequestKeys:
    """The digest chain's seed, and the extra bytes of each block."""

    seed: str | None
    block_extra: Callable[[int], bytes] | None = None


@functools.lru_cache(maxsize=256)
def _adapter_fingerprint(lora_int_id: int, name: str, path: str) -> str:
    # Keyed by vLLM's adapter id as well: an adapter loaded again (a new id)
    # is read again, as vLLM's workers read it again.
    return weights_fingerprint(path, None)


def adapter_identity(lora: LoRARequest) -> str:
    """The adapter's name, path and the fingerprint of its files."""
    if lora.load_inplace:  # vLLM reloads it in place: so do we
        fingerprint = weights_fingerprint(lora.lora_path, None)
    else:
        fingerprint = _adapter_fingerprint(
            lora.lora_int_id, lora.lora_name, lora.lora_path
        )
    return f"{lora.lora_name}\0{lora.lora_path}\0{fingerprint}"


def request_keys(request: Request, block_size: int) -> RequestKeys:
    """The keys of ``request``'s blocks besides their token ids."""
    seed = request.cache_salt
    if request.lora_request is not None:
        seed = f"{seed or ''}\0lora:{adapter_identity(request.lora_request)}"
    if not request.mm_features and request.prompt_embeds is None:
        return RequestKeys(seed)

    def block_extra(block: int) -> bytes:
        start = block * block_size
        keys, _ = generate_block_hash_extra_keys(request, start, start + block_size, 0)
        # Tuples of str, bytes and int: repr is stable across processes.
        return repr(keys).encode() if keys else b""

    return RequestKeys(seed, block_extra)
