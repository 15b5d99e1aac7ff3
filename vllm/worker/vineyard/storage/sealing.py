# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How every stored entry is proved before it is used: the
:data:`TRAILER_BYTES` trailer that ends it, written by :meth:`Sealer.seal`
and checked by :meth:`Sealer.verify`.

- An entry is one vLLM KV block of every layer (opaque bytes: kernels pack
  blocks their own way) followed by its trailer.
- The trailer holds the block's full digest
  (:mod:`~vllm.worker.vineyard.storage.digests`) and a checksum of the
  block's bytes, digest and namespace (xxh3-128), or with a key a MAC
  (keyed BLAKE3).
- A load verifies every entry before the KV is used, so a synthetic-id
  collision, bit rot, a truncated file, a stale buffer or a planted file is
  a miss, never wrong KV.

Imports neither vLLM nor torch (the backend processes seal and verify).
"""

from __future__ import annotations

import hashlib
from typing import Any

import xxhash

from vllm.worker.vineyard.storage.digests import (
    DIGEST_BYTES,
    FORMAT_VERSION,
    synthetic_id,
)

TRAILER_BYTES = 64
#: How every trailer starts (then the format version): tools tell the
#: cache's files from others by it without knowing their layout.
MAGIC_PREFIX = b"VYKV"
_MAGIC = MAGIC_PREFIX + bytes([FORMAT_VERSION])
_MAC_BYTES = 32
# Trailer: magic(5) keyed(1) pad(2) | digest(16) | checksum or MAC(32) | pad(8)
_DIGEST_AT = 8
_MAC_AT = _DIGEST_AT + DIGEST_BYTES


class Sealer:
    """Writes and checks entry trailers (with a MAC when there is a key).

    The checksum or MAC covers the block's bytes, its prefix digest and
    its namespace (the directory name): a chunk file copied into another
    namespace (another model, dtype, TP rank) fails verification there,
    whether or not the copier has the key."""

    def __init__(self, key: bytes | None, namespace: str):
        self._key = key
        self._flag = 1 if key is not None else 0
        self._namespace = namespace.encode()
        if key is not None:
            import blake3  # only needed with a key

            self._blake3: Any = blake3.blake3

    def _mac(self, payload: memoryview, digest: bytes) -> bytes:
        if self._key is None:
            # One call, seeded with the digest and the namespace (binding
            # the bytes to their prefix and place), not a streaming hasher
            # over all three: verification is on a load's critical path.
            seed = hashlib.blake2b(
                digest + self._namespace, digest_size=8, person=b"vineyard-seed"
            ).digest()
            return xxhash.xxh3_128_digest(
                payload, int.from_bytes(seed, "little")
            ).ljust(_MAC_BYTES, b"\0")
        # Several threads on a large block (BLAKE3's tree mode; the same
        # MAC): a load's verification is on the request's critical path.
        h = self._blake3(key=self._key, max_threads=self._blake3.AUTO)
        h.update(payload)
        h.update(digest)
        h.update(self._namespace)
        return h.digest()

    def seal(self, entry: memoryview, digest: bytes) -> None:
        """Write the trailer of one entry (payload, then trailer)."""
        payload_end = len(entry) - TRAILER_BYTES
        mac = self._mac(entry[:payload_end], digest)
        trailer = _MAGIC + bytes([self._flag, 0, 0]) + digest + mac
        entry[payload_end : payload_end + len(trailer)] = trailer

    def verify(self, entry: memoryview, digest: bytes) -> bool:
        """Whether the entry is a sealed block with this digest, intact."""
        payload_end = len(entry) - TRAILER_BYTES
        trailer = bytes(entry[payload_end:])
        if trailer[: len(_MAGIC) + 1] != _MAGIC + bytes([self._flag]):
            return False
        if trailer[_DIGEST_AT:_MAC_AT] != digest:
            return False
        return trailer[_MAC_AT : _MAC_AT + _MAC_BYTES] == self._mac(
            entry[:payload_end], digest
        )

    @staticmethod
    def digest_of(entry: memoryview) -> bytes:
        """The digest an entry's trailer claims (unverified): checking a
        stored chunk without its tokens starts from it."""
        at = len(entry) - TRAILER_BYTES + _DIGEST_AT
        return bytes(entry[at : at + DIGEST_BYTES])

    @staticmethod
    def clear(entry: memoryview) -> None:
        """Void an entry's trailer, so bytes a read leaves stale never pass."""
        entry[len(entry) - TRAILER_BYTES :] = bytes(TRAILER_BYTES)


def claimed_id(entry: memoryview | bytes) -> int | None:
    """The block id an entry's trailer claims (unverified), or ``None``
    where it ends in no trailer of the cache's (of any format version)."""
    at = len(entry) - TRAILER_BYTES
    if bytes(entry[at : at + len(MAGIC_PREFIX)]) != MAGIC_PREFIX:
        return None
    return synthetic_id(Sealer.digest_of(memoryview(entry)))
