# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What besides its token ids determines a request's KV, as the cache's
block digests carry it (see
:func:`~vllm.worker.vineyard.storage.digests.extend_digests`).

- ``cache_salt``: the digest chain starts from it.
- A LoRA adapter: the identity of its weights (a digest of every byte
  vLLM loads, :mod:`.weight_identity`): the same prompt with another
  adapter, or an adapter retrained under the same name, path or Hub id,
  never shares KV. vLLM's own block keys hold the name and path only.
- The scheduler's epoch: a reset gives the instance a new one, so
  nothing computed before it (by old weights, or written late) is ever
  loaded by this instance again.
- Multimodal items and prompt embeddings: vLLM's own per-block keys
  (``generate_block_hash_extra_keys``): each item's hash and placeholder
  offset in every block it covers, the embeddings' bytes of each block.
  Items are named by vLLM's content hash, or by the ``multi_modal_uuids``
  the caller gave (trusted, as vLLM's own prefix cache trusts them).

Plain token-id requests before any reset get no extra keys, so their digests
(and the files already on a root) stay as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from vllm.worker.vineyard.log_limiter import LogLimiter

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = init_logger(__name__)
_log = LogLimiter(logger)


@dataclass(frozen=True)
class RequestKeys:
    """The digest chain's seed, and the extra bytes of each block."""

    seed: str | None
    block_extra: Callable[[int], bytes] | None = None


def request_keys(
    request: Request,
    block_size: int,
    adapter: str | None = None,
    epoch: str | None = None,
) -> RequestKeys:
    """The keys of ``request``'s blocks besides their token ids, with the
    identity of its LoRA adapter's weights and the scheduler's epoch."""
    seed = request.cache_salt
    if adapter is not None:
        seed = f"{seed or ''}\0lora:{adapter}"
    if epoch is not None:
        seed = f"{seed or ''}\0epoch:{epoch}"
    if not request.mm_features and request.prompt_embeds is None:
        return RequestKeys(seed)

    def block_extra(block: int) -> bytes:
        start = block * block_size
        keys, _ = generate_block_hash_extra_keys(request, start, start + block_size, 0)
        # Tuples of str, bytes and int: repr is stable across processes.
        return repr(keys).encode() if keys else b""

    return RequestKeys(seed, block_extra)


#: ``kv_transfer_params`` keys a request sets to steer the cache: ``False``
#: keeps it out of the cache (nothing loaded, nothing saved: e.g. private
#: data); a token count caps what it loads.
USE_CACHE_PARAM = "vineyard_cache"
MAX_LOAD_PARAM = "vineyard_max_load_tokens"


@dataclass(frozen=True)
class RequestOptions:
    """What a request asked of the cache (see :func:`request_options`)."""

    use_cache: bool = True
    max_load_tokens: int | None = None
    problem: str | None = None  # a value that was not understood


def request_options(request: Request) -> RequestOptions:
    """The request's ``kv_transfer_params`` for the cache. A value that is
    not understood keeps the request out of the cache (its ``problem``
    says why): an opt-out must never be missed."""
    options = _parse_options(request.kv_transfer_params or {})
    if options.problem is not None:
        _log.warning(
            "options",
            "vineyard cache: a request's kv_transfer_params has %s: it is "
            "served without the cache",
            options.problem,
        )
    return options


def _parse_options(params: dict[str, Any]) -> RequestOptions:
    use = params.get(USE_CACHE_PARAM, True)
    cap = params.get(MAX_LOAD_PARAM)
    if not isinstance(use, bool):
        return RequestOptions(False, problem=f"{USE_CACHE_PARAM}={use!r} (a bool)")
    if cap is not None and (
        isinstance(cap, bool) or not isinstance(cap, int) or cap < 0
    ):
        return RequestOptions(
            False, problem=f"{MAX_LOAD_PARAM}={cap!r} (an integer >= 0)"
        )
    return RequestOptions(use, cap)
