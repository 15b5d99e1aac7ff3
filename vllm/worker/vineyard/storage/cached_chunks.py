# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The lookup's count of cached chunks (:func:`count_cached_chunks`): by
``stat`` alone, from a prefix's ids (no walk of the root, no KV read), for
the scheduler's lookup process and the backend. On a root a round trip
away the ``stat`` calls go out together
(:func:`~vllm.worker.vineyard.storage.far_calls.calls_at_once_when_far`),
so that a lookup costs a few round trips, not one per chunk. Where a
lookup stops at a damaged chunk file it removes it, so that the next save
writes it again.
And timed reads, the link's price measured off any request: of a prefix's
first chunk files (:func:`time_chunk_reads`), or of whichever chunk files
the namespace lists first (:func:`time_any_chunk_reads`: an engine's start,
before it knows any prefix).

Imports neither vLLM nor torch (the backend processes run it).
"""

from __future__ import annotations

import itertools
import os
import stat
import string
import time
from collections.abc import Iterator, Mapping, Sequence

from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.far_calls import calls_at_once_when_far
from vllm.worker.vineyard.storage.removal import remove_file
from vllm.worker.vineyard.storage.safe_io import OPEN_FILE

#: Bytes read per ``pread`` of a timed read.
_READ_PIECE = 1 << 20


def count_cached_chunks(
    rank_files: list[ChunkFiles],
    ids: list[int],
    max_chunks: int,
    counts: dict[str, int],
    log: LogLimiter,
    avoid: Mapping[str, tuple[int, int]] | None = None,
) -> int:
    """How many leading chunks of ``ids`` (up to ``max_chunks``) every
    rank's namespace holds whole, by ``stat`` alone (the minimum over
    ranks); files known unreadable (``avoid``, see
    :meth:`ChunkFiles.is_complete`) count as missing. Adds to ``counts``:
    ``lookup_stats``, and ``corrupt_chunks`` or ``path_collisions`` for a
    file where a rank's lookup stopped (see :func:`_remove_if_damaged`)."""
    bpc = rank_files[0].blocks_per_chunk if rank_files else 1
    cached = max_chunks
    for files in rank_files:
        found, stats = count_complete_chunks(files, ids, cached, avoid)
        counts["lookup_stats"] = counts.get("lookup_stats", 0) + stats
        if found < cached:
            _remove_if_damaged(files, ids[: (found + 1) * bpc], counts, log)
        cached = found
    return cached


def count_complete_chunks(
    files: ChunkFiles,
    ids: Sequence[int],
    max_chunks: int,
    avoid: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[int, int]:
    """``(leading chunks of ids on disk whole, stat calls made)``, up to
    ``max_chunks``: up to the first missing chunk, one ``stat`` at a time
    on a local disk; on a root a round trip away at once
    (:func:`calls_at_once_when_far`: a hit of ``n`` chunks costs about
    ``1 + n / 16`` round trips instead of ``n + 1``)."""
    bpc = files.blocks_per_chunk
    calls = itertools.count()

    def complete(chunk: int) -> bool:
        next(calls)  # atomic: the calls may run on several threads
        return files.is_complete(ids[: (chunk + 1) * bpc], avoid)

    found = 0
    for whole in calls_at_once_when_far(complete, range(max_chunks)):
        if not whole:
            break
        found += 1
    return found, next(calls)


def _remove_if_damaged(
    files: ChunkFiles,
    ids: list[int],
    counts: dict[str, int],
    log: LogLimiter,
) -> None:
    """A regular file where a lookup stopped, of neither vineyard's
    placeholder size (0) nor the chunk's, is a damaged chunk (vineyard
    renames whole chunks into place, so no write is ever seen half done):
    remove it, so that the next save writes the chunk again (vineyard keeps
    a file it finds at a chunk's path). Unless it is another prefix's chunk
    whose ids hash to the same path: that one is valid, and left alone."""
    path = files.path(ids)
    try:
        st = os.lstat(path)
    except OSError:
        return  # missing: the common miss
    if not stat.S_ISREG(st.st_mode) or st.st_size in (0, files.file_bytes(len(ids))):
        return
    try:
        collision = files.holds_other_prefix(ids)
    except OSError:
        return  # cannot be read now: not known to be bad
    if collision:
        counts["path_collisions"] = counts.get("path_collisions", 0) + 1
        log.warning(
            "collision",
            "vineyard cache chunk of another prefix at this prefix's path "
            "(a hash collision; left in place, the tokens are recomputed): %s",
            path,
        )
    elif remove_file(files.namespace_dir, path, st.st_ino):
        counts["corrupt_chunks"] = counts.get("corrupt_chunks", 0) + 1
        log.warning(
            "wrong-size",
            "vineyard cache chunk of the wrong size (%d bytes, not %d) was "
            "removed; it is written again by the next save: %s",
            st.st_size,
            files.file_bytes(len(ids)),
            path,
        )


def time_chunk_reads(
    files: ChunkFiles, ids: list[int], max_chunks: int, max_bytes: int
) -> tuple[int, float]:
    """Read the leading chunk files of ``ids`` whole (at most ``max_chunks``,
    and no more once ``max_bytes`` are read), as a load reads them:
    ``(blocks read, seconds)``. Stops at a file that is missing or cannot be
    read (what was read still counts); no bytes are kept or checked."""
    bpc = files.blocks_per_chunk
    paths = (files.path(ids[: (k + 1) * bpc]) for k in range(len(ids) // bpc))
    return _time_reads(files, paths, max_chunks, max_bytes, stop_at_miss=True)


def time_any_chunk_reads(
    files: ChunkFiles, max_chunks: int, max_bytes: int
) -> tuple[int, float]:
    """:func:`time_chunk_reads` of the chunk files the namespace lists first
    (skipping any that cannot be read); ``(0, 0.0)`` if it has none. Only
    the reads are timed, not the listing (a load lists nothing)."""
    try:
        return _time_reads(files, _listed_chunks(files), max_chunks, max_bytes)
    except OSError:
        return 0, 0.0  # no namespace folder yet, or it cannot be listed


def _time_reads(
    files: ChunkFiles,
    paths: Iterator[str],
    max_chunks: int,
    max_bytes: int,
    stop_at_miss: bool = False,
) -> tuple[int, float]:
    blocks = done = files_read = 0
    seconds = 0.0
    while files_read < max_chunks and done < max_bytes:
        path = next(paths, None)
        if path is None:
            break
        start = time.perf_counter()
        size = _read_whole(path)
        seconds += time.perf_counter() - start
        if size:
            files_read += 1
            blocks, done = blocks + files.blocks_per_chunk, done + size
        elif stop_at_miss:
            break  # missing, unreadable, or vineyard's empty placeholder
    return blocks, seconds


def _read_whole(path: str) -> int:
    """The bytes of the file at ``path``, read whole and dropped; 0 if it
    cannot be opened or read."""
    try:
        fd = os.open(path, OPEN_FILE)
    except OSError:
        return 0
    offset = 0
    try:
        while piece := os.pread(fd, _READ_PIECE, offset):
            offset += len(piece)
    except OSError:
        return 0
    finally:
        os.close(fd)
    return offset


def _listed_chunks(files: ChunkFiles) -> Iterator[str]:
    """The namespace's chunk file paths in directory order, listed lazily
    (a probe reads a few: a large folder on a far root is not listed
    whole)."""
    # Flat: the files right there; else 3 folders deep, 2 hex digits each.
    depth = 0 if files.flat else 3
    yield from _walk(files.namespace_dir, depth, files.hash_chunk_size)


def _walk(folder: str, depth: int, digits: int) -> Iterator[str]:
    with os.scandir(folder) as entries:
        for entry in entries:
            if not _is_hex(entry.name, digits):
                continue
            if depth == 0:
                yield entry.path
                continue
            try:
                yield from _walk(entry.path, depth - 1, digits)
            except OSError:
                continue  # not a folder, or gone


def _is_hex(name: str, digits: int) -> bool:
    return len(name) == digits and all(c in string.hexdigits for c in name)
