# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the cache lays KV out in vineyard's file store: chunk files, where
they are, and the one parser of their layout.

- **Entries.** One vineyard entry per vLLM KV block, all layers together:
  vineyard's cost is per entry, so a block of ``L`` layers is one entry, not
  ``block_size * L``. An entry is the block's bytes followed by a trailer
  (:mod:`~vllm.worker.vineyard.storage.sealing`); its id comes from the
  block's digest (:mod:`~vllm.worker.vineyard.storage.digests`).
- **Paths.** Vineyard stores chunk ``i`` of a sequence at the namespace's
  directory + the MurmurHash3 (x86, 32 bit, seed 0) of all ids up to the end
  of the chunk, as 8 hex digits in folders of 2. Lookups ``stat`` those
  paths and read no KV at all.
- **Chunk files.** An int32 count ``n``, the ``n`` int32 ids of the prefix
  up to the chunk's end, then the chunk's entries: :func:`chunk_file_bytes`
  and :class:`ChunkShape` are the one description of that layout, for the
  cache, the scans and the tools.

Imports neither vLLM nor torch: the backend processes (run as scripts) and
the scheduler both use it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import mmh3
import numpy as np

from vllm.worker.vineyard.storage.far_calls import calls_at_once_when_far
from vllm.worker.vineyard.storage.safe_io import OPEN_FILE
from vllm.worker.vineyard.storage.sealing import MAGIC_PREFIX, TRAILER_BYTES

#: A header naming more ids than this is no chunk's (far beyond any
#: context): it is not read.
_MAX_HEADER_IDS = 1 << 22


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


#: Hex digits of a chunk's path (a 32-bit hash): vineyard's
#: ``hash_chunk_size`` for flat namespaces (one path component).
HASH_DIGITS = 8


class ChunkFiles:
    """The chunk files of one namespace directory, as vineyard names them.

    ``blocks_per_chunk`` entries of ``entry_bytes`` make one chunk file:
    an int32 count ``n``, the ``n`` ids of the prefix up to the chunk's end,
    then the chunk's entries (K and V halves each)."""

    def __init__(
        self,
        namespace_dir: str,
        blocks_per_chunk: int,
        entry_bytes: int,
        flat: bool = True,
    ):
        self.namespace_dir = namespace_dir
        self.blocks_per_chunk = blocks_per_chunk
        self.entry_bytes = entry_bytes
        # Flat: every chunk file right in the namespace's folder (no
        # directory to make per chunk: a write costs a third of the round
        # trips of a far root); else in folders of 2 hex digits, 4 deep.
        self.flat = flat
        self.hash_chunk_size = HASH_DIGITS if flat else 2

    def path(self, ids: Sequence[int]) -> str:
        """The file of the chunk that ends at the end of ``ids``."""
        return self._path(np.asarray(ids, np.int32).tobytes())

    def _path(self, header_ids: bytes) -> str:
        h = mmh3.hash(header_ids, 0, signed=False)
        name = f"{h:0{HASH_DIGITS}x}"
        if self.flat:
            return os.path.join(self.namespace_dir, name)
        return os.path.join(
            self.namespace_dir, name[0:2], name[2:4], name[4:6], name[6:8]
        )

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
        ``avoid``: files known unreadable (path below :attr:`namespace_dir` ->
        inode, mtime in ns), which count as missing while unchanged."""
        path = self.path(ids)
        try:
            st = os.stat(path)
        except OSError:
            return False
        if avoid:
            known = avoid.get(os.path.relpath(path, self.namespace_dir))
            if known == (st.st_ino, st.st_mtime_ns):
                return False
        return st.st_size == self.file_bytes(len(ids))

    def touch(self, ids: Sequence[int], first_chunk: int, num_chunks: int) -> None:
        """Mark chunks as used now (their mtime is their last use); on a
        far root at once (:func:`calls_at_once_when_far`)."""
        bpc = self.blocks_per_chunk

        def touch_one(chunk: int) -> None:
            # A chunk evicted meanwhile has nothing to keep.
            with contextlib.suppress(OSError):
                os.utime(self.path(ids[: (chunk + 1) * bpc]))

        chunks = range(first_chunk, first_chunk + num_chunks)
        for _ in calls_at_once_when_far(touch_one, chunks):
            pass

    def remove(self, ids: Sequence[int]) -> bool:
        """Delete the chunk ending at ``ids`` (so a later write can replace
        it: vineyard never overwrites an existing chunk file)."""
        try:
            os.unlink(self.path(ids))
            return True
        except FileNotFoundError:
            return False


class PendingTouches:
    """Hits' chunks to mark used (:meth:`ChunkFiles.touch`) once the reader
    is idle: a ``utime`` per chunk is a round trip on a network filesystem,
    which a request's load need not wait for. Marks wait at most
    ``max_delay_s`` for an idle moment."""

    def __init__(self, files: ChunkFiles, max_delay_s: float):
        self._files = files
        self._max_delay_s = max_delay_s
        self._touches: list[tuple[list[int], int, int]] = []
        self._since = 0.0  # when the oldest waiting mark was added

    def add(
        self, ids: list[int], first_chunk: int, num_chunks: int, now: float
    ) -> None:
        if num_chunks <= 0:
            return
        if not self._touches:
            self._since = now
        self._touches.append((ids, first_chunk, num_chunks))

    def due(self, now: float) -> bool:
        """Whether marks waited their longest by ``now``."""
        return bool(self._touches) and now - self._since >= self._max_delay_s

    def __bool__(self) -> bool:
        return bool(self._touches)

    def run(self) -> None:
        """Mark every waiting hit's chunks used now."""
        touches, self._touches = self._touches, []
        for ids, first_chunk, num_chunks in touches:
            self._files.touch(ids, first_chunk, num_chunks)
