# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the cache lays KV out in vineyard's file store, and how every stored
byte is proved before it is used.

- **Entries.** One vineyard entry per vLLM KV block, all layers together:
  vineyard's cost is per entry, so a block of ``L`` layers is one entry, not
  ``block_size * L``. An entry is the block's bytes (opaque: kernels pack
  blocks their own way) followed by a :data:`TRAILER_BYTES` trailer.
- **Ids.** Vineyard keys entries by int32 ids. A block's id is a slice of a
  chained 128-bit digest of the real token ids up to and including that
  block (and of the request's ``cache_salt``), see :func:`extend_digests`.
- **Proof.** The trailer holds the block's full digest and a checksum of the
  block's bytes and digest (xxh3-128), or with a key a MAC (keyed BLAKE3).
  A load verifies every entry before the KV is used, so a synthetic-id
  collision, bit rot, a truncated file, a stale buffer or a planted file is
  a miss, never wrong KV.
- **Paths.** Vineyard stores chunk ``i`` of a sequence at ``root`` + the
  MurmurHash3 (x86, 32 bit, seed 0) of all ids up to the end of the chunk,
  as 8 hex digits in folders of 2. Lookups ``stat`` those paths and read no
  KV at all.
- **Chunk files.** An int32 count ``n``, the ``n`` int32 ids of the prefix
  up to the chunk's end, then the chunk's entries: :func:`chunk_file_bytes`
  and :class:`ChunkShape` are the one description of that layout, for the
  cache, the scans and the tools.

This module imports neither vLLM nor torch: the backend processes (run as
scripts) and the scheduler both use it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mmh3
import numpy as np
import xxhash

from vllm.worker.vineyard.storage.safe_io import OPEN_FILE

FORMAT_VERSION = 3
TRAILER_BYTES = 64
#: How every trailer starts (then the format version): tools tell the
#: cache's files from others by it without knowing their layout.
MAGIC_PREFIX = b"VYKV"
_MAGIC = MAGIC_PREFIX + bytes([FORMAT_VERSION])
_DIGEST_BYTES = 16
_MAC_BYTES = 32
# Trailer: magic(5) keyed(1) pad(2) | digest(16) | checksum or MAC(32) | pad(8)
_DIGEST_AT = 8
_MAC_AT = _DIGEST_AT + _DIGEST_BYTES
#: A header naming more ids than this is no chunk's (far beyond any
#: context): it is not read.
_MAX_HEADER_IDS = 1 << 22


def root_digest(salt: str | None) -> bytes:
    """The chain's starting state: requests with different salts share no
    block (vLLM's own prefix cache isolates salts the same way)."""
    seed = b"vineyard-llm-cache/%d/" % FORMAT_VERSION
    if salt is not None:
        seed += b"salt:" + salt.encode()
    return hashlib.blake2b(seed, digest_size=_DIGEST_BYTES).digest()


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
        prev = hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()
        digests.append(prev)
    return digests


def synthetic_id(digest: bytes) -> int:
    """The vineyard id (a positive int32) of a block."""
    return (int.from_bytes(digest[:4], "little") & 0x7FFFFFFF) or 1


def synthetic_ids(digests: Sequence[bytes]) -> list[int]:
    return [synthetic_id(d) for d in digests]


# --------------------------------------------------------------------------
# Trailers: seal on write, verify on read.
# --------------------------------------------------------------------------


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
            # One-shot, seeded with the digest and the namespace (binds the
            # bytes to their prefix and place): twice as fast here as the
            # streaming hasher.
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
        return bytes(entry[at : at + _DIGEST_BYTES])

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


# --------------------------------------------------------------------------
# The layout of a chunk file.
# --------------------------------------------------------------------------


def header_count(head: bytes) -> int:
    """The id count ``n`` that a chunk file's first 4 bytes hold (0 when
    the file has fewer)."""
    return int.from_bytes(head, sys.byteorder, signed=True) if len(head) == 4 else 0


def header_ids(raw: bytes) -> list[int]:
    """The ids of a chunk file's header (the ``4 * n`` bytes after ``n``)."""
    return np.frombuffer(raw, np.int32).tolist()


def entries_at(num_ids: int) -> int:
    """Where a chunk file of ``num_ids`` ids has its entries: after the
    count and the ids."""
    return 4 + 4 * num_ids


def chunk_file_bytes(num_ids: int, blocks_per_chunk: int, entry_bytes: int) -> int:
    """The size of a whole chunk file: header, ids, entries."""
    return entries_at(num_ids) + blocks_per_chunk * entry_bytes


@dataclass(frozen=True)
class ChunkShape:
    """What a namespace's chunk files look like: by its layout (a ``stat``
    tells), else by each file's own header (read)."""

    blocks_per_chunk: int | None = None
    entry_bytes: int | None = None
    legacy: bool = False  # format 1: no trailers

    def mismatch(
        self, size: int, read: Callable[[int, int], bytes] | None
    ) -> str | None:
        """Why a non-empty file of ``size`` bytes is not shaped as one of
        the namespace's chunk files (``None`` if it is); ``read(offset,
        count)`` reads it, needed only without a layout."""
        if self.blocks_per_chunk is not None and self.entry_bytes is not None:
            # n must be a positive multiple of blocks_per_chunk (a chunk's
            # ids are those of its whole prefix).
            bpc = self.blocks_per_chunk
            ids_bytes = size - chunk_file_bytes(0, bpc, self.entry_bytes)
            if ids_bytes > 0 and ids_bytes % (4 * bpc) == 0:
                return None
            return f"size {size} fits no chunk of this namespace's layout"
        assert read is not None, "without a layout a chunk's header is read"
        n = header_count(read(0, 4))
        if n < 1 or entries_at(n) >= size:
            return f"its header (n={n}) does not fit its size {size}"
        if self.legacy:
            return None
        tail = size - TRAILER_BYTES
        if tail < entries_at(n) or read(tail, len(MAGIC_PREFIX)) != MAGIC_PREFIX:
            return "it does not end in an entry's trailer"
        return None


# --------------------------------------------------------------------------
# Chunk files.
# --------------------------------------------------------------------------


class ChunkFiles:
    """The chunk files of one namespace directory, as vineyard names them.

    ``blocks_per_chunk`` entries of ``entry_bytes`` make one chunk file:
    an int32 count ``n``, the ``n`` ids of the prefix up to the chunk's end,
    then the chunk's entries (K and V halves each)."""

    def __init__(self, root: str, blocks_per_chunk: int, entry_bytes: int):
        self.root = root
        self.blocks_per_chunk = blocks_per_chunk
        self.entry_bytes = entry_bytes

    def path(self, ids: Sequence[int]) -> str:
        """The file of the chunk that ends at the end of ``ids``."""
        return self._path(np.asarray(ids, np.int32).tobytes())

    def _path(self, header_ids: bytes) -> str:
        h = mmh3.hash(header_ids, 0, signed=False)
        name = f"{h:08x}"
        return os.path.join(self.root, name[0:2], name[2:4], name[4:6], name[6:8])

    def holds_other_prefix(self, ids: Sequence[int]) -> bool:
        """Whether the file at the path of ``ids`` is the whole chunk of
        another prefix whose ids hash to the same path (a 32-bit collision):
        a valid chunk, which this prefix must leave alone. ``False`` for a
        file that names these ids, or that is cut short, or that names a
        prefix of another path (copied or planted: nobody reads it there),
        which are this prefix's to remove. Reads the header only; raises
        ``OSError`` when the file cannot be opened or read now (then it is
        nobody's to remove)."""
        mine = np.asarray(ids, np.int32).tobytes()
        path = self._path(mine)
        fd = os.open(path, OPEN_FILE)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return False  # no chunk at all (never read: it could block)
            n = header_count(os.pread(fd, 4, 0))
            if not 0 < n <= _MAX_HEADER_IDS or st.st_size != self.file_bytes(n):
                return False  # no chunk's header, or cut short
            theirs = os.pread(fd, 4 * n, 4)
        finally:
            os.close(fd)
        return theirs != mine and self._path(theirs) == path

    def file_bytes(self, num_ids: int) -> int:
        return chunk_file_bytes(num_ids, self.blocks_per_chunk, self.entry_bytes)

    def is_complete(
        self, ids: Sequence[int], avoid: Mapping[str, tuple[int, int]] | None = None
    ) -> bool:
        """Whether the chunk ending at ``ids`` is on disk at its full size
        (vineyard publishes a chunk by renaming over an empty placeholder).
        ``avoid``: files known unreadable (path below :attr:`root` ->
        inode, mtime in ns), which count as missing while unchanged."""
        path = self.path(ids)
        try:
            st = os.stat(path)
        except OSError:
            return False
        if avoid:
            known = avoid.get(os.path.relpath(path, self.root))
            if known == (st.st_ino, st.st_mtime_ns):
                return False
        return st.st_size == self.file_bytes(len(ids))

    def count_complete(
        self,
        ids: Sequence[int],
        max_chunks: int,
        avoid: Mapping[str, tuple[int, int]] | None = None,
    ) -> int:
        """How many leading chunks of ``ids`` are on disk, by ``stat`` only
        (no KV is read): one metadata call per chunk, stopping at the first
        missing one (so at most ``result + 1`` calls). ``avoid``: see
        :meth:`is_complete`."""
        bpc = self.blocks_per_chunk
        n = 0
        while n < max_chunks and self.is_complete(ids[: (n + 1) * bpc], avoid):
            n += 1
        return n

    def touch(self, ids: Sequence[int], first_chunk: int, num_chunks: int) -> None:
        """Mark chunks as used now (their mtime is their last use)."""
        bpc = self.blocks_per_chunk
        for c in range(first_chunk, first_chunk + num_chunks):
            # A chunk evicted meanwhile has nothing to keep.
            with contextlib.suppress(OSError):
                os.utime(self.path(ids[: (c + 1) * bpc]))

    def remove(self, ids: Sequence[int]) -> bool:
        """Delete the chunk ending at ``ids`` (so a later write can replace
        it: vineyard never overwrites an existing chunk file)."""
        try:
            os.unlink(self.path(ids))
            return True
        except FileNotFoundError:
            return False
