# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Timed reads, the link's price measured off any request: of a prefix's
first chunk files (:func:`time_chunk_reads`), or of whichever chunk files
the namespace lists first (:func:`time_any_chunk_reads`: an engine's start,
before it knows any prefix).

The files are read :data:`READS_AT_ONCE` at a time, as a load's are
(vineyard reads a load's chunk files on a thread per core): read one at a
time, each file's round trips leave the link idle, and the price is the
latency's, not what loads pay (behind a 256 MB/s FUSE link, one 4 MiB
file at a time 1.3-1.5x of the link's time, 64 KiB files 4.2x; loads of
4 MiB files 1.1x).

A probe given the price it is to beat (``cut_s_per_block``) stops once it
is sure to price a block above it: a link known to be slow is read only as
long as it takes to know it is still slow, not for a whole probe (behind
16 MB/s, four 4 MiB files are a second of a link that other hosts share).
Its price is then that lower bound, which is all the decision needs.

Imports neither vLLM nor torch (the backend processes run it).
"""

from __future__ import annotations

import itertools
import os
import string
import threading
import time
from collections.abc import Iterator

from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.safe_io import OPEN_FILE

#: Files read at once, and the fewest a probe reads where a prefix has them.
READS_AT_ONCE = 4
#: Bytes read per ``pread`` (a cut probe reads at most this much more per
#: file in flight).
_READ_PIECE = 1 << 18
#: Listed files taken per file to read (some may be unreadable).
_LISTED_PER_READ = 4


def time_chunk_reads(
    files: ChunkFiles,
    ids: list[int],
    max_chunks: int,
    max_bytes: int,
    cut_s_per_block: float = 0.0,
) -> tuple[int, float]:
    """Read the leading chunk files of ``ids`` whole (at most ``max_chunks``;
    :data:`READS_AT_ONCE` at least, and more up to about ``max_bytes``, by
    the first chunk's size), as a load reads them: ``(blocks read,
    seconds)``. Counts the files before the first one that is missing or
    cannot be read, and the time until they were read; no bytes are kept
    or checked. With ``cut_s_per_block``, stops once reading the files is
    sure to take longer than that per block: then ``(blocks of the files,
    seconds so far)``, a price at least that high."""
    bpc = files.blocks_per_chunk
    most = _files_to_read(files, max_chunks, max_bytes)
    paths = [files.path(ids[: (k + 1) * bpc]) for k in range(len(ids) // bpc)]
    return _time_reads(files, paths[:most], most, cut_s_per_block, stop_at_miss=True)


def time_any_chunk_reads(
    files: ChunkFiles, max_chunks: int, max_bytes: int, cut_s_per_block: float = 0.0
) -> tuple[int, float]:
    """:func:`time_chunk_reads` of the chunk files the namespace lists first
    (skipping any that cannot be read); ``(0, 0.0)`` if it has none. Only
    the reads are timed, not the listing (a load lists nothing)."""
    most = _files_to_read(files, max_chunks, max_bytes)
    try:
        listed = list(itertools.islice(_listed_chunks(files), _LISTED_PER_READ * most))
    except OSError:
        return 0, 0.0  # no namespace folder yet, or it cannot be listed
    return _time_reads(files, listed, most, cut_s_per_block)


def _files_to_read(files: ChunkFiles, max_chunks: int, max_bytes: int) -> int:
    first = files.file_bytes(files.blocks_per_chunk)
    return max(0, min(max_chunks, max(READS_AT_ONCE, -(-max_bytes // first))))


def _time_reads(
    files: ChunkFiles,
    paths: list[str],
    most: int,
    cut_s_per_block: float,
    stop_at_miss: bool = False,
) -> tuple[int, float]:
    """Read ``paths`` in order, :data:`READS_AT_ONCE` at a time, until
    ``most`` are read (or, ``stop_at_miss``, one could not be read):
    ``(blocks, seconds)`` of the files read (the leading ones with
    ``stop_at_miss``) and the time until the last of them was; or, cut
    (see :func:`time_chunk_reads`), of the files to read and the time so
    far."""
    lock = threading.Lock()
    ends: dict[int, float] = {}  # index of a file read -> when it was
    next_path = in_flight = 0
    stop = cut = False
    to_read = min(most, len(paths))
    start = time.perf_counter()
    cut_at = start + to_read * files.blocks_per_chunk * cut_s_per_block

    def reader() -> None:
        nonlocal next_path, in_flight, stop, cut
        while True:
            with lock:
                if stop or next_path == len(paths) or len(ends) + in_flight >= most:
                    return
                i, next_path, in_flight = next_path, next_path + 1, in_flight + 1
            size = _read_whole(paths[i], cut_at if cut_s_per_block > 0 else None)
            with lock:
                in_flight -= 1
                if size is None:
                    stop = cut = True
                elif size:
                    ends[i] = time.perf_counter()
                elif stop_at_miss:
                    stop = True  # missing, unreadable, or a placeholder

    threads = [
        # Daemons: a read hung in the root holds no exit of this process.
        threading.Thread(target=reader, name="vineyard-cache-timed-read", daemon=True)
        for _ in range(min(READS_AT_ONCE, most, len(paths)))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if cut:
        return to_read * files.blocks_per_chunk, time.perf_counter() - start
    if stop_at_miss:
        read = list(itertools.takewhile(ends.__contains__, range(len(paths))))
    else:
        read = list(ends)
    if not read:
        return 0, 0.0
    return len(read) * files.blocks_per_chunk, max(ends[i] for i in read) - start


def _read_whole(path: str, cut_at: float | None = None) -> int | None:
    """The bytes of the file at ``path``, read whole and dropped; 0 if it
    cannot be opened or read; ``None`` if ``cut_at`` (a
    ``time.perf_counter()``) passed before it was."""
    if cut_at is not None and time.perf_counter() > cut_at:
        return None
    try:
        fd = os.open(path, OPEN_FILE)
    except OSError:
        return 0
    offset = 0
    try:
        while piece := os.pread(fd, _READ_PIECE, offset):
            offset += len(piece)
            if cut_at is not None and time.perf_counter() > cut_at:
                return None
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
