# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What names a block: the chained digest of its token prefix
(:func:`extend_digests`), the vineyard id cut from it
(:func:`synthetic_id`), and the auth key that seals blocks
(:func:`load_auth_key`) with its public name (:func:`key_id`).

- A block's digest is 128 bits of chain state over the real token ids up
  to and including that block, seeded by the request's ``cache_salt``
  (:func:`root_digest`): it names the whole prefix and whatever else
  determines the block's KV.
- Vineyard keys entries by int32 ids; a block's id is a slice of its digest.
  Ids may collide; the digest in every entry's trailer
  (:mod:`~vllm.worker.vineyard.storage.sealing`) tells blocks apart.
- :data:`FORMAT_VERSION` is the version of everything stored: it seeds the
  chain, marks every trailer and names every namespace.

Imports neither vLLM nor torch (the backend processes use it).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence

import numpy as np

FORMAT_VERSION = 3
DIGEST_BYTES = 16


def root_digest(salt: str | None) -> bytes:
    """The chain's starting state: requests with different salts share no
    block (vLLM's own prefix cache isolates salts the same way)."""
    seed = b"vineyard-llm-cache/%d/" % FORMAT_VERSION
    if salt is not None:
        seed += b"salt:" + salt.encode()
    return hashlib.blake2b(seed, digest_size=DIGEST_BYTES).digest()


def extend_digests(
    digests: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    block_extra: Callable[[int], bytes] | None = None,
) -> list[bytes]:
    """Append the digests of the complete blocks of ``token_ids`` that
    ``digests`` does not have yet; returns ``digests``.

    ``digest[b] = blake2b(digest[b - 1] || int64 ids of block b || extra)``,
    128 bits of chain state, so a digest names the whole token prefix and
    whatever else determines its KV: ``salt`` seeds the chain, and
    ``block_extra(b)`` adds block ``b``'s own keys (multimodal items, prompt
    embeddings; see :mod:`~vllm.worker.vineyard.connector.request_keys`)."""
    done, end = len(digests), len(token_ids) // block_size
    if end <= done:
        return digests
    ids = np.asarray(token_ids[done * block_size : end * block_size], np.int64)
    blocks = ids.reshape(end - done, block_size)
    prev = digests[-1] if digests else root_digest(salt)
    for b, block in enumerate(blocks, start=done):
        data = prev + block.tobytes()
        if block_extra is not None:
            data += block_extra(b)
        prev = hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()
        digests.append(prev)
    return digests


def synthetic_id(digest: bytes) -> int:
    """The vineyard id (a positive int32) of a block."""
    return (int.from_bytes(digest[:4], "little") & 0x7FFFFFFF) or 1


def synthetic_ids(digests: Sequence[bytes]) -> list[int]:
    return [synthetic_id(d) for d in digests]


def load_auth_key(
    path: str, setting: str = "VINEYARD_CACHE_AUTH_KEY_FILE"
) -> bytes | None:
    """The 32-byte MAC key derived from the secret in ``path`` (None for no
    path); raises ``ValueError`` naming the ``setting`` (as the user wrote
    it) if it cannot be used."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            secret = f.read()
    except OSError as e:
        raise ValueError(
            f"{setting}={path!r} cannot be read ({e}); "
            "allowed: a readable file holding a secret of at least 16 bytes"
        ) from None
    secret = secret.strip()
    if len(secret) < 16:
        raise ValueError(
            f"{setting}={path!r} holds {len(secret)} bytes; "
            "allowed: a secret of at least 16 bytes"
        )
    return hashlib.blake2b(secret, digest_size=32, person=b"vineyard-kv").digest()


@functools.lru_cache(maxsize=16)
def key_id(key: bytes | None) -> str:
    """A public name of the key (for namespaces): instances with different
    keys keep apart instead of deleting each other's chunks. Anyone who can
    list the root sees it, so it is costly to compute (scrypt, about 16 MiB
    and tens of milliseconds): guessing a weak secret from it offline costs
    that much per guess, not a hash's nanoseconds."""
    if key is None:
        return "nokey"
    return hashlib.scrypt(
        key, salt=b"vineyard-llm-cache key id", n=1 << 14, r=8, p=1, dklen=6
    ).hex()
