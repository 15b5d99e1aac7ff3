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

Imports neither vLLM nor torch (the backend processes run it).
"""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Mapping, Sequence

from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.far_calls import calls_at_once_when_far
from vllm.worker.vineyard.storage.removal import remove_file


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
    file where a rank's lookup stopped and each damaged one right after it
    (see :func:`_remove_damaged_chunks`)."""
    cached = max_chunks
    for files in rank_files:
        found, stats = count_complete_chunks(files, ids, cached, avoid)
        counts["lookup_stats"] = counts.get("lookup_stats", 0) + stats
        if found < cached:
            _remove_damaged_chunks(files, ids, found, cached, counts, log)
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


def _remove_damaged_chunks(
    files: ChunkFiles,
    ids: list[int],
    first: int,
    end: int,
    counts: dict[str, int],
    log: LogLimiter,
) -> None:
    """Remove chunk ``first`` if damaged, then each damaged chunk after it
    up to ``end``: a write cut short (a full disk) can leave several chunks
    of one prefix damaged, and one a lookup never reaches would never be
    written again (vineyard keeps a file it finds at a chunk's path)."""
    bpc = files.blocks_per_chunk
    for chunk in range(first, end):
        if not _remove_if_damaged(files, ids[: (chunk + 1) * bpc], counts, log):
            return


def _remove_if_damaged(
    files: ChunkFiles,
    ids: list[int],
    counts: dict[str, int],
    log: LogLimiter,
) -> bool:
    """A regular file where a lookup stopped, of neither vineyard's
    placeholder size (0) nor the chunk's, is a damaged chunk (vineyard
    renames whole chunks into place, but a disk that fills mid-write can
    leave one cut short): remove it, so that the next save writes the
    chunk again (vineyard keeps a file it finds at a chunk's path). Unless
    it is another prefix's chunk whose ids hash to the same path: that one
    is valid, and left alone.
    Whether a damaged file was removed."""
    path = files.path(ids)
    try:
        st = os.lstat(path)
    except OSError:
        return False  # missing: the common miss
    if not stat.S_ISREG(st.st_mode) or st.st_size in (0, files.file_bytes(len(ids))):
        return False
    try:
        collision = files.holds_other_prefix(ids)
    except OSError:
        return False  # cannot be read now: not known to be bad
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
        return True
    return False
