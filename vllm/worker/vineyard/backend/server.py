# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vineyard backend process (its engine-side handle is
:mod:`vllm.worker.vineyard.backend.client`).

vineyard-llm holds the GIL for the whole of every call, so calling it from a
thread of vLLM's process would stall the forward pass for the full write.
Every vineyard call therefore runs in a process of its own, started with
``subprocess`` (vLLM's workers are daemonic and may not use
``multiprocessing``). KV bytes live in shared memory (a ``memfd`` that both
processes map); only small descriptors (buffer slot, block ids) cross the
socket. The backend also seals (write) and verifies (read) every entry
(:mod:`~vllm.worker.vineyard.storage.chunks`), and the writer sweeps the
root (:mod:`~vllm.worker.vineyard.storage.sweeper`), so none of that work
runs on the engine's threads either.

Started through :mod:`vllm.worker.vineyard.launch`, so that a backend never
imports vLLM or torch and starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import mmap
import os
import signal
import stat
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from vllm.worker.vineyard.backend.protocol import BackendSpec
from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.storage import chunks, sweeper
from vllm.worker.vineyard.storage import root as root_format

logger = logging.getLogger(__name__)

YEAR_S = 365 * 24 * 3600


# --------------------------------------------------------------------------
# Backend process side (no vLLM, no torch).
# --------------------------------------------------------------------------


_REGISTRY_VAR = "__VINEYARD_INTERNAL_REGISTRY"


def _import_vineyard_llm() -> Any:
    """``vineyard.llm`` without the rest of vineyard.

    vineyard's package ``__init__`` imports pandas, pyarrow and its
    deployment tools: over a second of CPU in every backend process, for
    nothing the file-mode KV cache uses. Its extension needs only vineyard's
    object registry, whose path vineyard's ``__init__`` passes in
    ``__VINEYARD_INTERNAL_REGISTRY`` while it loads its extensions; this
    does the same with an empty package module. Anywhere that layout is
    missing (another vineyard build), the full import.
    """
    if "vineyard" not in sys.modules:
        spec = importlib.util.find_spec("vineyard")
        locations = spec.submodule_search_locations if spec else None
        registry = (
            os.path.join(locations[0], "libvineyard_internal_registry.so")
            if locations
            else ""
        )
        if spec is not None and registry and os.path.isfile(registry):
            sys.modules["vineyard"] = importlib.util.module_from_spec(spec)
            before = os.environ.get(_REGISTRY_VAR)
            os.environ[_REGISTRY_VAR] = registry
            try:
                import vineyard.llm  # noqa: F401 - the package body is skipped
            except ImportError:
                for name in [m for m in sys.modules if m.split(".")[0] == "vineyard"]:
                    del sys.modules[name]
            finally:
                if before is None:
                    del os.environ[_REGISTRY_VAR]
                else:
                    os.environ[_REGISTRY_VAR] = before
    import vineyard.llm

    return vineyard.llm


def _write_error_reason(
    path: str, need_bytes: int, leaked_files: int = 1
) -> str | None:
    """Why a write failed: vineyard swallows the errno, so ask the
    filesystem what it most likely was. ``None``: not the filesystem.

    A write that failed in the filesystem leaves vineyard's temp file open
    (``leaked_files``). A failure with neither a leaked file nor a full or
    unwritable root is a race with another process on the same root (a
    writer of the same chunks, a sweeper evicting the prefix and another
    writer putting it back): vineyard has no locking. That is a refusal,
    not an error: the chunk is someone else's to write or is written again
    when a request needs it."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        return f"cache root unusable ({e})"
    if not os.path.isdir(path):
        return "cache root unusable (not a directory)"
    if st.f_bavail * st.f_frsize < need_bytes:
        return "no space left on device (ENOSPC)"
    if not os.access(path, os.W_OK):
        return "cache root not writable"
    if not leaked_files:
        return None
    return "write failed (I/O error or quota; vineyard does not report errno)"


def _release_failed_temp_files(temp_dir: str) -> int:
    """Close and delete the temp files of writes that failed.

    When a chunk write fails (ENOSPC, EIO), vineyard returns without closing
    the temp file it was writing: the descriptor leaks, and with it the
    space the partial file holds, even after the file is deleted. On a disk
    that stays full, one leaks per failed chunk until the process runs out
    of descriptors (and then cannot read either). Vineyard opens and closes
    every file within a call, so after ``update`` returns any descriptor of
    this process still open on a file under its temp folder is such a leak.
    Returns how many were released."""
    prefix = temp_dir.rstrip(os.sep) + os.sep
    released = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0  # no procfs: nothing to find
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith(prefix):
            continue
        try:
            os.close(int(name))
        except OSError:
            continue
        released += 1
        path = target.removesuffix(" (deleted)")
        if path != target:
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)  # a partial file: the retry writes it anew
    return released


class _VineyardServer:
    def __init__(self, spec: BackendSpec, shm: mmap.mmap):
        import numpy as np

        llm = _import_vineyard_llm()

        # Owner-only unless the operator shares the cache with a group.
        os.umask(0o007 if spec.group_access else 0o077)
        self._spec = spec
        os.makedirs(spec.root, exist_ok=True)
        self._entries = np.frombuffer(shm, np.uint8).reshape(
            spec.num_buffers, spec.max_blocks, spec.entry_bytes
        )
        self._views = [
            [memoryview(row) for row in buffer] for buffer in self._entries
        ]  # fmt: skip
        self._files = chunks.ChunkFiles(
            spec.root, spec.blocks_per_chunk, spec.entry_bytes
        )
        self._sealer = chunks.Sealer(
            chunks.load_auth_key(spec.auth_key_file), os.path.basename(spec.root)
        )
        # Expiry and eviction are the sweeper's (by last use, across every
        # process): vineyard's own TTL counts from the write and only for
        # the process that wrote, so it is switched off.
        config = llm.FileCacheConfig(
            chunk_size=spec.blocks_per_chunk,
            root=spec.root,
            gc_interval=YEAR_S,
            ttl=10 * YEAR_S,
        )
        half = spec.entry_bytes // 2
        self._cache = llm.KVCache(
            config, tensor_nbytes=half, cache_capacity=spec.max_blocks, layer=1
        )
        # One vineyard entry per block: K and V are the two halves of it.
        # Building these lists is slow, so once per buffer.
        base = int(self._entries.ctypes.data)
        self._kv_lists = [
            [
                [(llm.KVTensor(ptr, half), llm.KVTensor(ptr + half, half))]
                for ptr in range(
                    base + b * spec.buffer_bytes,
                    base + (b + 1) * spec.buffer_bytes,
                    spec.entry_bytes,
                )
            ]
            for b in range(spec.num_buffers)
        ]
        self._stats = dict.fromkeys(
            (
                "bytes_read",
                "bytes_written",
                "corrupt_chunks",
                "path_collisions",
                "write_errors",
            ),
            0,
        )
        self._removed: list[str] = []  # corrupt chunk files removed
        self._log = LogLimiter(logger)
        self._sweeper: Any = None
        if spec.sweep:
            self._sweeper = sweeper.RootSweeper(
                spec.cache_root,
                spec.disk_limit_bytes,
                spec.ttl_s,
                spec.sweep_interval_s,
                spec.group_access,
            )
            self._sweeper.start()

    def update(
        self,
        buffer_id: int,
        segments: list[tuple[int, list[int], list[int], list[bytes]]],
    ) -> dict[str, Any]:
        """Seal and write segments ``(first_slot, prefix ids, ids,
        digests)``. Returns, per segment, the entries vineyard holds now and
        the reason of a write error (None when the rest was only refused
        for want of its prefix)."""
        views = self._views[buffer_id]
        kv_list = self._kv_lists[buffer_id]
        bpc = self._spec.blocks_per_chunk
        results: list[tuple[int, str | None]] = []
        for first, prefix, ids, digests in segments:
            ids = ids[: self._clear_chunk_paths(prefix, ids)]
            if not ids:  # another prefix's chunk comes first: all refused
                results.append((0, None))
                continue
            for i, digest in enumerate(digests):
                self._sealer.seal(views[first + i], digest)
            # The disk limit holds at every write: room for the chunks not
            # on disk yet is made before they are written (see the sweeper).
            new: list[int] = []  # per chunk, the bytes it adds
            if self._sweeper is not None:
                full = prefix + ids
                for end in range(len(prefix) + bpc, len(full) + 1, bpc):
                    on_disk = self._files.is_complete(full[:end])
                    size = self._sweeper.new_file_bytes(self._files.file_bytes(end))
                    new.append(0 if on_disk else size)
                self._sweeper.make_room(sum(new))
            stored = int(self._cache.update(prefix, ids, kv_list[first:][: len(ids)]))
            if self._sweeper is not None:
                self._sweeper.wrote(sum(new[: stored // bpc]))
            error = None
            if stored < len(ids) and (
                not prefix or self._files.is_complete(prefix)
            ):  # fmt: skip
                failed = prefix + ids[: stored + bpc]
                if not self._files.is_complete(failed):
                    leaked = _release_failed_temp_files(
                        os.path.join(self._spec.root, "__temp")
                    )
                    error = _write_error_reason(
                        self._spec.root, self._files.file_bytes(len(failed)), leaked
                    )
                    if error is not None:
                        self._stats["write_errors"] += 1
            self._stats["bytes_written"] += stored * self._spec.entry_bytes
            results.append((stored, error))
        return {"stored": results, "stats": self.take_stats()}

    def _chunk_entries(
        self, prefix: list[int], ids: list[int]
    ) -> Iterator[tuple[int, str, int | None]]:
        """``(end, path, mode)`` of the path of each whole chunk of ``ids``
        (``mode`` from ``lstat``, ``None`` if nothing is there)."""
        bpc = self._spec.blocks_per_chunk
        for end in range(bpc, len(ids) + 1, bpc):
            path = self._files.path(prefix + ids[:end])
            try:
                yield end, path, os.lstat(path).st_mode
            except OSError:
                yield end, path, None

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
            self._stats["corrupt_chunks"] += 1
            self._log.warning(
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
                self._stats["corrupt_chunks"] += 1
                self._log.warning(
                    "irregular",
                    "vineyard cache: no regular file at a chunk path, not read: %s",
                    path,
                )
                return end - bpc
        return len(ids)

    def query(
        self,
        buffer_id: int,
        prefix: list[int],
        ids: list[int],
        digests: list[bytes],
        touch_prefix: bool = False,
    ) -> dict[str, Any]:
        """Read the cached leading chunks of ``ids`` (which follow
        ``prefix``) into the buffer from slot 0 and verify every entry.
        Returns the number of verified entries (whole chunks); a chunk that
        fails verification, or that vineyard cannot read though it is on
        disk, is deleted and counted, unless it is another prefix's valid
        chunk (a hash collision: counted, left in place)."""
        views = self._views[buffer_id]
        bpc = self._spec.blocks_per_chunk
        for view in views[: len(ids)]:
            chunks.Sealer.clear(view)
        # vineyard opens what it finds at a chunk's path, following links
        # and blocking on a FIFO: read only up to the first such entry.
        ids = ids[: self._regular_chunks(prefix, ids)]
        kv = self._kv_lists[buffer_id][: len(ids)]
        found = int(self._cache.query(prefix, ids, kv)) if ids else 0
        found = min(found, len(ids)) // bpc * bpc
        self._stats["bytes_read"] += found * self._spec.entry_bytes
        verified = 0
        while verified < found and self._sealer.verify(
            views[verified], digests[verified]
        ):
            verified += 1
        good = verified // bpc * bpc
        bad_end = None
        if good < found:  # failed verification
            # A valid block of another prefix that has this block's id
            # (vineyard keys blocks by these 31-bit ids alone) is no damage;
            # a block under an id not its own (a forged header) is.
            view = views[verified]
            claimed = chunks.Sealer.digest_of(view)
            if (
                claimed != digests[verified]
                and chunks.synthetic_id(claimed) == ids[verified]
                and self._sealer.verify(view, claimed)
            ):
                self._collision(prefix + ids[: good + bpc])
            else:
                bad_end = good + bpc
        elif found < len(ids) and self._files.is_complete(prefix + ids[: found + bpc]):
            # On disk at its full size, yet vineyard did not read it: the
            # chunk of another prefix at the same path (a collision, left
            # alone), a damaged one (removed), or one this process cannot
            # open now (another instance's group, a stale handle, out of
            # descriptors: not bad, left alone).
            end = found + bpc
            try:
                if self._files.holds_other_prefix(prefix + ids[:end]):
                    self._collision(prefix + ids[:end])
                else:
                    bad_end = end
            except OSError as e:
                self._log.warning(
                    "unreadable",
                    "vineyard cache chunk could not be read (left in place): %s: %s",
                    self._files.path(prefix + ids[:end]),
                    e,
                )
        if bad_end is not None:
            if self._files.remove(prefix + ids[:bad_end]):
                self._removed.append(self._files.path(prefix + ids[:bad_end]))
            self._stats["corrupt_chunks"] += 1
            self._log.warning(
                "corrupt",
                "vineyard cache chunk failed verification and was removed "
                "(it will be recomputed and written again): %s",
                self._files.path(prefix + ids[:bad_end]),
            )
        # A hit is a use: it keeps these chunks from eviction and expiry,
        # and (``touch_prefix``) the chunks before them that vLLM's own
        # prefix cache served this time, so LRU follows every use.
        first = 0 if touch_prefix and good else len(prefix) // bpc
        self._files.touch(prefix + ids, first, (len(prefix) + good) // bpc - first)
        return {"verified": good, "stats": self.take_stats()}

    def _collision(self, ids: list[int]) -> None:
        """The chunk at the path of ``ids`` is another prefix's, valid:
        this prefix neither loads nor writes it, and the file stays."""
        self._stats["path_collisions"] += 1
        self._log.warning(
            "collision",
            "vineyard cache chunk of another prefix at this prefix's path "
            "(a hash collision; left in place, the tokens are recomputed): %s",
            self._files.path(ids),
        )

    def take_stats(self) -> dict[str, Any]:
        """Counters since the last call, and ``removed_paths``: the chunk
        files removed meanwhile (corrupt, expired, evicted)."""
        stats: dict[str, Any] = self._stats
        self._stats = dict.fromkeys(self._stats, 0)
        removed, self._removed = self._removed, []
        if self._sweeper is not None:
            stats.update(self._sweeper.take_stats())
            removed += self._sweeper.take_removed()
        stats["removed_paths"] = removed
        return stats

    def handle(self, request: tuple[Any, ...]) -> Any:
        op = request[0]
        if op == "update":
            return self.update(request[1], request[2])
        if op == "query":
            return self.query(*request[1:])
        if op == "stats":
            return self.take_stats()
        if op == "ping":
            return os.getpid()
        raise ValueError(f"unknown backend request {op!r}")


class _LookupServer:
    """The scheduler's lookups, by ``stat`` of chunk files (no vineyard, no
    KV read): in a process of their own, so that a lookup stuck on a hung
    root holds up no process that vLLM waits for at shutdown."""

    def __init__(self, spec: BackendSpec):
        self._rank_files = [
            chunks.ChunkFiles(root, spec.blocks_per_chunk, spec.entry_bytes)
            for root in spec.lookup_roots
        ]
        self._log = LogLimiter(logger)

    def handle(self, request: tuple[Any, ...]) -> Any:
        op = request[0]
        if op == "lookup":
            counts: dict[str, int] = {}
            cached = root_format.count_cached_chunks(
                self._rank_files, request[1], request[2], counts, self._log
            )
            return {"cached": cached, "stats": counts}
        if op == "ping":
            return os.getpid()
        raise ValueError(f"unknown lookup request {op!r}")


def _widen_affinity(parent_cpus: list[int]) -> None:
    """vLLM's CPU worker pins itself (and so its children) to its OpenMP
    cores; run the backend on the other cores so it does not compete with
    the forward pass, or on all cores if there are no others."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        all_cpus = set(range(os.cpu_count() or 1))
        others = all_cpus - set(parent_cpus)
        os.sched_setaffinity(0, others or all_cpus)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conn-fd", type=int, required=True)
    parser.add_argument("--shm-fd", type=int, required=True)
    parser.add_argument("--spec", type=str, required=True)
    parser.add_argument("--parent-cpus", type=str, default="")
    parser.add_argument("--nice", type=int, default=0)
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s "
        "[vineyard-backend pid=%(process)d] %(message)s",
    )
    # The engine decides when we stop (by closing the socket); Ctrl-C in the
    # terminal must not kill us first and lose in-flight writes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if args.parent_cpus:
        _widen_affinity([int(c) for c in args.parent_cpus.split(",")])
    if args.nice:
        os.nice(args.nice)

    spec = BackendSpec(**json.loads(args.spec))
    conn = Connection(args.conn_fd)
    server: _VineyardServer | _LookupServer
    try:
        if spec.role == "lookup":
            server = _LookupServer(spec)
        else:
            shm = mmap.mmap(args.shm_fd, spec.num_buffers * spec.buffer_bytes)
            server = _VineyardServer(spec, shm)
    except Exception as e:  # report why we cannot serve, then exit
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return 1
    conn.send(("ready", os.getpid()))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return 0  # the engine closed the socket or died
        try:
            reply: tuple[str, Any] = ("ok", server.handle(request))
        except Exception as e:  # noqa: BLE001 - reported to the engine
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return 0
