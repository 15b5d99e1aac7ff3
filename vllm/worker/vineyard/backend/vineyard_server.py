# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A reader's or writer's backend (:class:`VineyardServer`): vineyard's KV
cache over the buffers shared with the engine, sealing every entry it
writes and verifying every entry it reads
(:mod:`~vllm.worker.vineyard.storage.sealing`), so that none of that work
runs on the engine's threads. The writer also sweeps the root
(:mod:`~vllm.worker.vineyard.storage.sweeper`) and writes only what fits
under the disk limit.

- vineyard opens whatever it finds at a chunk's path, following links and
  blocking on a FIFO: what is there and is not a regular file is removed
  before a write and never read.
- A chunk that fails verification is removed and counted (the next save
  writes it again), unless it is another prefix's valid chunk at the same
  path (a hash collision: counted, left in place); one that cannot be read
  now is reported and left alone.
- A hit marks its chunks used after its reply, once the reader is idle
  (:class:`~vllm.worker.vineyard.storage.chunks.PendingTouches`); every
  request but a read sees the hits before it marked.

Imports neither vLLM nor torch (it runs in the backend process).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import time
from collections.abc import Callable, Iterator

from vllm.worker.vineyard.backend.protocol import (
    BackendSpec,
    BackendStats,
    PingReply,
    PingRequest,
    QueryReply,
    QueryRequest,
    RemoveReply,
    RemoveRequest,
    StatsReply,
    StatsRequest,
    UpdateReply,
    UpdateRequest,
)
from vllm.worker.vineyard.backend.vineyard_kv import import_vineyard_llm, open_kv_cache
from vllm.worker.vineyard.backend.write_errors import (
    release_failed_temp_files,
    write_error_reason,
)
from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.storage.chunks import ChunkFiles, PendingTouches
from vllm.worker.vineyard.storage.digests import load_auth_key, synthetic_id
from vllm.worker.vineyard.storage.far_calls import calls_at_once_when_far
from vllm.worker.vineyard.storage.sealing import Sealer
from vllm.worker.vineyard.storage.sweeper import RootSweeper

logger = logging.getLogger(__name__)

#: Longest a hit's marking waits for an idle reader (reads come first).
TOUCH_DELAY_MAX_S = 1.0

#: What a cache backend counts (sent with every reply, then reset).
_COUNTERS = (
    "bytes_read",
    "bytes_written",
    "chunks_skipped_for_room",
    "corrupt_chunks",
    "path_collisions",
    "write_errors",
)


def _start_sweeper(
    spec: BackendSpec, root_lost: Callable[[], str | None]
) -> RootSweeper:
    """The writer's sweeper of the whole cache root, started."""
    settings = spec.settings
    root_sweeper = RootSweeper(
        spec.cache_root,
        settings.disk_limit_bytes,
        settings.ttl_s,
        settings.sweep_interval_s,
        modes=settings.modes,
        root_lost=root_lost,
    )
    root_sweeper.start()
    return root_sweeper


class VineyardServer:
    """A reader or writer: vineyard's KV cache over the shared buffers,
    sealing what it writes and verifying what it reads."""

    def __init__(self, spec: BackendSpec, shm: mmap.mmap):
        import numpy as np

        llm = import_vineyard_llm()

        # Owner-only unless the operator shares the cache with a group.
        os.umask(spec.settings.modes.umask)
        self._spec = spec
        os.makedirs(spec.namespace_dir, exist_ok=True)
        self._entries = np.frombuffer(shm, np.uint8).reshape(
            spec.num_buffers, spec.max_blocks, spec.entry_bytes
        )
        self._views = [
            [memoryview(row) for row in buffer] for buffer in self._entries
        ]  # fmt: skip
        self._files = ChunkFiles(
            spec.namespace_dir, spec.blocks_per_chunk, spec.entry_bytes, spec.flat_paths
        )
        self._sealer = Sealer(
            load_auth_key(spec.settings.auth_key_file),
            os.path.basename(spec.namespace_dir),
        )
        self._cache, self._kv_lists = open_kv_cache(
            llm, spec, int(self._entries.ctypes.data)
        )
        self._stats = dict.fromkeys(_COUNTERS, 0)
        # This process's CPU time is reported in the counter of its role.
        self._cpu_counter = "writer_cpu_us" if spec.sweep else "reader_cpu_us"
        self._cpu_reported = time.process_time()
        self._removed: list[str] = []  # corrupt chunk files removed
        self._unreadable: list[tuple[str, int, int]] = []  # see BackendStats
        self._log = LogLimiter(logger)
        self._touches = PendingTouches(self._files, TOUCH_DELAY_MAX_S)
        # The root's filesystem at start: a mount that goes away leaves an
        # empty local folder (or none) at its path (see _root_lost).
        self._root_dev = os.stat(spec.cache_root).st_dev
        self._sweeper: RootSweeper | None = (
            _start_sweeper(spec, self._root_lost) if spec.sweep else None
        )

    def _root_lost(self) -> str | None:
        """Why nothing may be written to the root now, or ``None``. A lost
        mount (lazy unmount, dead client) leaves an empty local folder at
        its path, or none: writes there would fill the local disk, unseen
        by other hosts and hidden once the mount returns. So with the
        namespace's folder gone, the root must still be on the filesystem
        it was on at start (then the sweeper removed the folder, and
        vineyard makes it again)."""
        try:
            if stat.S_ISDIR(os.stat(self._spec.namespace_dir).st_mode):
                return None
        except OSError:
            pass
        try:
            dev = os.stat(self._spec.cache_root).st_dev
        except OSError as e:
            return f"the cache root cannot be reached ({e.strerror or e})"
        if dev != self._root_dev:
            return (
                "the cache root is not on the filesystem it was on at start "
                "(was it unmounted?)"
            )
        return None

    def update(self, request: UpdateRequest) -> UpdateReply:
        """Seal and write the request's segments. Returns, per segment, the
        entries vineyard holds now and the reason of a write error (None
        when the rest was only refused for want of its prefix)."""
        views = self._views[request.buffer_id]
        kv_list = self._kv_lists[request.buffer_id]
        bpc = self._spec.blocks_per_chunk
        results: list[tuple[int, str | None]] = []
        lost = self._root_lost()
        if lost is not None:
            self._stats["write_errors"] += len(request.segments)
            return UpdateReply([(0, lost)] * len(request.segments), self.take_stats())
        for segment in request.segments:
            first, prefix = segment.first_slot, segment.prefix_ids
            ids = segment.ids[: self._clear_chunk_paths(prefix, segment.ids)]
            if not ids:  # another prefix's chunk comes first: all refused
                results.append((0, None))
                continue
            for i, digest in enumerate(segment.digests):
                self._sealer.seal(views[first + i], digest)
            # The disk limit holds at every write: only the chunks that fit
            # are written; the sweeper makes room for the rest in the
            # background (see there).
            new: list[int] = []  # per chunk, the bytes it adds
            if self._sweeper is not None:
                full = prefix + ids
                for end in range(len(prefix) + bpc, len(full) + 1, bpc):
                    on_disk = self._files.is_complete(full[:end])
                    size = self._sweeper.new_file_bytes(self._files.file_bytes(end))
                    new.append(0 if on_disk else size)
                fit = self._sweeper.make_room(new)
                if fit < len(new):
                    self._stats["chunks_skipped_for_room"] += len(new) - fit
                    ids = ids[: fit * bpc]
                    if not ids:
                        results.append((0, None))
                        continue
            try:
                stored = int(
                    self._cache.update(prefix, ids, kv_list[first:][: len(ids)])
                )
            except (RuntimeError, OSError) as e:  # e.g. a dead mount: ENOTCONN
                if self._sweeper is not None:
                    self._sweeper.wrote(0)
                    self._sweeper.write_failed(sum(new))
                release_failed_temp_files(
                    os.path.join(self._spec.namespace_dir, "__temp")
                )
                self._stats["write_errors"] += 1
                results.append((0, self._root_lost() or f"write failed ({e})"))
                continue
            if self._sweeper is not None:
                self._sweeper.wrote(sum(new[: stored // bpc]))
            error = None
            if stored < len(ids) and (
                not prefix or self._files.is_complete(prefix)
            ):  # fmt: skip
                failed = prefix + ids[: stored + bpc]
                if not self._files.is_complete(failed):
                    leaked = release_failed_temp_files(
                        os.path.join(self._spec.namespace_dir, "__temp")
                    )
                    error = write_error_reason(
                        self._spec.namespace_dir,
                        self._files.file_bytes(len(failed)),
                        leaked,
                    )
                    if error is not None:
                        self._stats["write_errors"] += 1
                        if self._sweeper is not None:
                            self._sweeper.write_failed(sum(new[stored // bpc :]))
            self._stats["bytes_written"] += stored * self._spec.entry_bytes
            results.append((stored, error))
        return UpdateReply(results, self.take_stats())

    def _chunk_entries(
        self, prefix: list[int], ids: list[int]
    ) -> Iterator[tuple[int, str, int | None]]:
        """``(end, path, mode)`` of the path of each whole chunk of ``ids``
        (``mode`` from ``lstat``, ``None`` if nothing is there), lazily; on
        a far root the ``lstat`` calls go out at once
        (:func:`calls_at_once_when_far`)."""

        def entry(end: int) -> tuple[int, str, int | None]:
            path = self._files.path(prefix + ids[:end])
            try:
                return end, path, os.lstat(path).st_mode
            except OSError:
                return end, path, None

        bpc = self._spec.blocks_per_chunk
        return calls_at_once_when_far(entry, range(bpc, len(ids) + 1, bpc))

    def _clear_chunk_paths(self, prefix: list[int], ids: list[int]) -> int:
        """Before vineyard writes these chunks: what is at their paths and
        is not a regular file (a FIFO would block the write, a link would be
        followed outside the root) is removed, counted as a corrupt chunk.
        A regular file is kept (vineyard keeps a chunk it has). Returns how
        many of ``ids`` vineyard may write: those before a chunk whose path
        holds another prefix's chunk (a collision), as vineyard deletes what
        is at the path of every chunk from the first it cannot write on."""
        bpc = self._spec.blocks_per_chunk
        for end, path, mode in self._chunk_entries(prefix, ids):
            if mode is None:
                continue
            if stat.S_ISREG(mode):
                # Unreadable now: vineyard cannot read it either.
                with contextlib.suppress(OSError):
                    if self._files.holds_other_prefix(prefix + ids[:end]):
                        self._collision(prefix + ids[:end])
                        return end - bpc
                continue
            try:
                if stat.S_ISDIR(mode):
                    os.rmdir(path)  # only if empty: never a tree
                else:
                    os.unlink(path)  # the link itself, never its target
            except OSError:
                pass  # then vineyard's write of it fails, counted as such
            self._count_bad(
                "corrupt_chunks",
                "irregular",
                "vineyard cache: removed what is not a chunk at a chunk path: %s",
                path,
            )
        return len(ids)

    def _regular_chunks(self, prefix: list[int], ids: list[int]) -> int:
        """How many of ``ids`` lie in chunks whose paths hold a regular
        file or nothing; an entry of another kind (a link, a FIFO, a
        directory) is never opened, and is counted as a corrupt chunk."""
        bpc = self._spec.blocks_per_chunk
        for end, path, mode in self._chunk_entries(prefix, ids):
            if mode is None:
                break  # missing: vineyard's read stops there anyway
            if not stat.S_ISREG(mode):
                self._count_bad(
                    "corrupt_chunks",
                    "irregular",
                    "vineyard cache: no regular file at a chunk path, not read: %s",
                    path,
                )
                return end - bpc
        return len(ids)

    def query(self, request: QueryRequest) -> QueryReply:
        """Read the cached leading chunks of the request's ``ids`` (which
        follow ``prefix``) into the buffer from slot 0 and verify every
        entry. Returns the number of verified entries (whole chunks); a
        chunk that fails verification, or that vineyard cannot read though
        it is on disk, is deleted and counted, unless it is another
        prefix's valid chunk (a hash collision: counted, left in place)."""
        prefix, ids, digests = request.prefix, request.ids, request.digests
        buffers = range(request.buffer_id, request.buffer_id + request.num_buffers)
        views = [view for b in buffers for view in self._views[b]]
        bpc = self._spec.blocks_per_chunk
        for view in views[: len(ids)]:
            Sealer.clear(view)
        # vineyard opens what it finds at a chunk's path, following links
        # and blocking on a FIFO: read only up to the first such entry.
        ids = ids[: self._regular_chunks(prefix, ids)]
        kv = [entry for b in buffers for entry in self._kv_lists[b]][: len(ids)]
        started = time.perf_counter()
        found = int(self._cache.query(prefix, ids, kv)) if ids else 0
        found = min(found, len(ids)) // bpc * bpc
        self._stats["bytes_read"] += found * self._spec.entry_bytes
        read = time.perf_counter()
        verified = 0
        while verified < found and self._sealer.verify(
            views[verified], digests[verified]
        ):
            verified += 1
        verify_s = time.perf_counter() - read
        good = verified // bpc * bpc
        if good < found:  # failed verification
            bad_end = self._failed_chunk(prefix, ids, digests, views, verified)
        else:
            bad_end = self._unread_chunk(prefix, ids, found)
        if bad_end is not None:
            self._remove_corrupt(prefix + ids[:bad_end])
        # A hit is a use: it keeps these chunks from eviction and expiry,
        # and (``touch_prefix``) the chunks before them that vLLM's own
        # prefix cache served this time, so LRU follows every use.
        first = 0 if request.touch_prefix and good else len(prefix) // bpc
        end = (len(prefix) + good) // bpc
        self._touches.add(prefix + ids, first, end - first, time.monotonic())
        return QueryReply(good, self.take_stats(), read - started, verify_s)

    def when_idle(self) -> None:
        """What waits for no request to be waiting: marking hits used."""
        self._touches.run()

    def _failed_chunk(
        self,
        prefix: list[int],
        ids: list[int],
        digests: list[bytes],
        views: list[memoryview],
        verified: int,
    ) -> int | None:
        """The end of the chunk whose entry ``verified`` failed verification
        if it is damaged; ``None`` if it is another prefix's (a collision)."""
        bpc = self._spec.blocks_per_chunk
        good = verified // bpc * bpc
        # A valid block of another prefix that has this block's id
        # (vineyard keys blocks by these 31-bit ids alone) is no damage;
        # a block under an id not its own (a forged header) is.
        view = views[verified]
        claimed = Sealer.digest_of(view)
        if (
            claimed != digests[verified]
            and synthetic_id(claimed) == ids[verified]
            and self._sealer.verify(view, claimed)
        ):
            self._collision(prefix + ids[: good + bpc])
            return None
        return good + bpc

    def _unread_chunk(
        self, prefix: list[int], ids: list[int], found: int
    ) -> int | None:
        """The end of the chunk after the ``found`` entries if it is on disk
        at its full size and damaged, though vineyard did not read it;
        else ``None``."""
        bpc = self._spec.blocks_per_chunk
        if not (
            found < len(ids) and self._files.is_complete(prefix + ids[: found + bpc])
        ):
            return None
        # On disk at its full size, yet vineyard did not read it: the
        # chunk of another prefix at the same path (a collision, left
        # alone), a damaged one (removed), or one this process cannot
        # open now (another instance's group, a stale handle, out of
        # descriptors: not bad, left alone).
        end = found + bpc
        try:
            if self._files.holds_other_prefix(prefix + ids[:end]):
                self._collision(prefix + ids[:end])
                return None
            return end
        except OSError as e:
            self._unreadable_chunk(prefix + ids[:end], e)
            return None

    def _unreadable_chunk(self, ids: list[int], error: OSError) -> None:
        """A chunk file that cannot be read (an I/O error, a file in
        split-brain) and stays: reported, so that lookups stop promising
        it until it changes."""
        path = self._files.path(ids)
        self._log.warning(
            "unreadable",
            "vineyard cache chunk could not be read (left in place, not "
            "promised again until it changes): %s: %s",
            path,
            error,
        )
        with contextlib.suppress(OSError):
            st = os.stat(path)
            relative = os.path.relpath(path, self._spec.namespace_dir)
            self._unreadable.append((relative, st.st_ino, st.st_mtime_ns))

    def _remove_corrupt(self, ids: list[int]) -> None:
        """Remove the damaged chunk file of ``ids`` (counted, reported)."""
        try:
            removed = self._files.remove(ids)
        except OSError as e:
            self._unreadable_chunk(ids, e)
            return
        if removed:
            self._removed.append(self._files.path(ids))
        self._count_bad(
            "corrupt_chunks",
            "corrupt",
            "vineyard cache chunk failed verification and was removed "
            "(it will be recomputed and written again): %s",
            self._files.path(ids),
        )

    def _collision(self, ids: list[int]) -> None:
        """The chunk at the path of ``ids`` is another prefix's, valid:
        this prefix neither loads nor writes it, and the file stays."""
        self._count_bad(
            "path_collisions",
            "collision",
            "vineyard cache chunk of another prefix at this prefix's path "
            "(a hash collision; left in place, the tokens are recomputed): %s",
            self._files.path(ids),
        )

    def _count_bad(self, counter: str, kind: str, msg: str, path: str) -> None:
        """Count a chunk path found bad, and say which (rate-limited by
        ``kind``)."""
        self._stats[counter] += 1
        self._log.warning(kind, msg, path)

    def take_stats(self) -> BackendStats:
        """Counters since the last call, and the chunk files removed
        meanwhile (corrupt, expired, evicted)."""
        counters = self._stats
        self._stats = dict.fromkeys(self._stats, 0)
        cpu = time.process_time()
        counters[self._cpu_counter] = int(1e6 * (cpu - self._cpu_reported))
        self._cpu_reported = cpu
        removed, self._removed = self._removed, []
        unreadable, self._unreadable = self._unreadable, []
        if self._sweeper is not None:
            counters.update(self._sweeper.take_stats())
            removed += self._sweeper.take_removed()
        return BackendStats(counters, removed, unreadable)

    def handle(
        self, request: object
    ) -> UpdateReply | QueryReply | StatsReply | RemoveReply | PingReply:
        if not isinstance(request, QueryRequest) or self._touches.due(time.monotonic()):
            self._touches.run()
        if isinstance(request, UpdateRequest):
            return self.update(request)
        if isinstance(request, RemoveRequest):
            removed = sum(self._files.remove(ids) for ids in request.chunks)
            return RemoveReply(removed, self.take_stats())
        if isinstance(request, QueryRequest):
            return self.query(request)
        if isinstance(request, StatsRequest):
            return StatsReply(self.take_stats())
        if isinstance(request, PingRequest):
            return PingReply(os.getpid())
        raise ValueError(f"unknown backend request {request!r}")
