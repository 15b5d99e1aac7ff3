# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vineyard backend process and the engine-side handle that drives it.

vineyard-llm holds the GIL for the whole of every call, so calling it from a
thread of vLLM's process would stall the forward pass for the full write.
Every vineyard call therefore runs in a process of its own, started with
``subprocess`` (vLLM's workers are daemonic and may not use
``multiprocessing``). KV bytes live in shared memory (a ``memfd`` that both
processes map); only small descriptors (buffer slot, block ids) cross the
socket. The backend also seals (write) and verifies (read) every entry
(:mod:`vineyard_store`), and the writer sweeps the root
(:mod:`vineyard_sweeper`), so none of that work runs on the engine's
threads either.

This file is also the backend's entry point: it is run as a script (by path,
not with ``-m``) so that the backend never imports vLLM or torch and starts in
a fraction of a second.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
import logging
import mmap
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

if __package__:
    from vllm.worker import vineyard_store as store
    from vllm.worker import vineyard_sweeper as sweeper
else:  # run as the backend's script: import the siblings, not vLLM
    import vineyard_store as store  # type: ignore[no-redef]
    import vineyard_sweeper as sweeper  # type: ignore[no-redef]

logger = logging.getLogger(__name__)

YEAR_S = 365 * 24 * 3600


class BackendError(RuntimeError):
    """The backend process failed, timed out, died or is disabled."""


@dataclass(frozen=True)
class BackendSpec:
    """Everything a backend needs to open its namespace and map the buffers.

    A buffer holds ``max_blocks`` entries of ``entry_bytes`` (one KV block of
    every layer, then its trailer). The writer (``sweep=True``) also keeps
    the whole cache root (``cache_root``) within its budget.
    """

    root: str  # the namespace directory
    blocks_per_chunk: int
    entry_bytes: int
    max_blocks: int
    num_buffers: int
    auth_key_file: str = ""
    group_access: bool = False
    sweep: bool = False
    cache_root: str = ""
    disk_limit_bytes: int = 0
    ttl_s: float = 0.0
    sweep_interval_s: float = 30.0

    @property
    def buffer_bytes(self) -> int:
        return self.max_blocks * self.entry_bytes


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


#: How the reader opens a chunk file to tell "unreadable" from "bad".
_OPEN_CHUNK = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
        self._files = store.ChunkFiles(
            spec.root, spec.blocks_per_chunk, spec.entry_bytes
        )
        self._sealer = store.Sealer(
            store.load_auth_key(spec.auth_key_file), os.path.basename(spec.root)
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
            ("bytes_read", "bytes_written", "corrupt_chunks", "write_errors"), 0
        )
        self._removed: list[str] = []  # corrupt chunk files removed
        self._log = store.LogLimiter(logger)
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
            self._clear_chunk_paths(prefix, ids)
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

    def _clear_chunk_paths(self, prefix: list[int], ids: list[int]) -> None:
        """Before vineyard writes these chunks: what is at their paths and
        is not a regular file (a FIFO would block the write, a link would be
        followed outside the root) is removed, counted as a corrupt chunk.
        A regular file is kept (vineyard keeps a chunk it has)."""
        for _, path, mode in self._chunk_entries(prefix, ids):
            if mode is None or stat.S_ISREG(mode):
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
        disk, is deleted and counted."""
        views = self._views[buffer_id]
        bpc = self._spec.blocks_per_chunk
        for view in views[: len(ids)]:
            store.Sealer.clear(view)
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
            bad_end = good + bpc
        elif found < len(ids) and self._files.is_complete(prefix + ids[: found + bpc]):
            # On disk at its full size, yet vineyard did not read it: a file
            # of another prefix (bad), or one this process cannot open now
            # (another instance's group, a stale handle, out of descriptors:
            # not bad, left alone).
            path = self._files.path(prefix + ids[: found + bpc])
            try:
                os.close(os.open(path, _OPEN_CHUNK))
                bad_end = found + bpc
            except OSError as e:
                self._log.warning(
                    "unreadable",
                    "vineyard cache chunk could not be read (left in place): %s: %s",
                    path,
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


def _serve(argv: list[str]) -> int:
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
    shm = mmap.mmap(args.shm_fd, spec.num_buffers * spec.buffer_bytes)
    try:
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


# --------------------------------------------------------------------------
# Engine side.
# --------------------------------------------------------------------------


class BackendProcess:
    """Engine-side handle of one backend process.

    :meth:`call` is thread-safe and never waits longer than ``timeout_s``;
    :meth:`send` and :meth:`receive` split it, so the caller can work while
    the backend does (one request in flight at a time). When the process
    dies, answers garbage or stalls, it is killed and restarted on the next
    call. After ``max_restarts`` restarts within ``restart_window_s`` it is
    disabled for that long: every call fails at once with
    :class:`BackendError` and the cache degrades to recompute; then it is
    tried again (a filesystem that recovers gets its cache back).
    """

    def __init__(
        self,
        name: str,
        spec: BackendSpec,
        shm_fd: int,
        timeout_s: float,
        max_restarts: int = 3,
        startup_timeout_s: float = 60.0,
        nice: int = 0,
        wait: bool = True,
        restart_in_background: bool = False,
        restart_window_s: float = 600.0,
    ):
        """Starts the process; with ``wait=False`` returns at once and
        :meth:`wait_ready` waits (so several backends start in parallel)."""
        self.name = name
        self._spec = spec
        self._shm_fd = shm_fd
        self._timeout_s = timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._max_restarts = max_restarts
        self._nice = nice
        # Callers that must never wait (the forward thread) get an error at
        # once while the process is restarted on a thread of its own.
        self._restart_in_background = restart_in_background
        self._restarter: threading.Thread | None = None
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._in_flight: str | None = None  # the op sent and not yet received
        # Spawned, not yet ready (see ``wait``).
        self._starting: tuple[subprocess.Popen[bytes], Connection] | None = None
        self._restart_window_s = restart_window_s
        self._recent_restarts: collections.deque[float] = collections.deque()
        self.restarts = 0  # in the process's lifetime (for the metrics)
        self._disabled: tuple[str, float] | None = None  # why, since when
        self._closed = False
        with self._lock:
            self._spawn_locked()
            if wait:
                self._await_ready_locked()

    @property
    def disabled_reason(self) -> str | None:
        """Why calls fail at once now, or ``None``; a backend disabled for
        the restart window is enabled again."""
        disabled = self._disabled
        if disabled is None:
            return None
        reason, since = disabled
        if time.monotonic() - since < self._restart_window_s:
            return reason
        logger.info("Enabling the %s vineyard backend again", self.name)
        self._disabled = None
        return None

    @property
    def available(self) -> bool:
        """Whether a call would be served now: not closed, not disabled and
        not restarting (read without the lock: a hint, not a promise)."""
        restarter = self._restarter
        return (
            not self._closed
            and self.disabled_reason is None
            and (restarter is None or not restarter.is_alive())
            and self._starting is None
        )

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start_locked(self) -> None:
        self._spawn_locked()
        self._await_ready_locked()

    def wait_ready(self) -> None:
        """Wait for a backend started with ``wait=False`` to be ready;
        raises :class:`BackendError` if it cannot start."""
        with self._lock:
            if self._starting is not None:
                self._await_ready_locked()

    def _spawn_locked(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        parent_cpus = ""
        if hasattr(os, "sched_getaffinity"):
            parent_cpus = ",".join(str(c) for c in os.sched_getaffinity(0))
        env = dict(os.environ)
        # vineyard names its temp files by PID; PIDs repeat across
        # containers sharing a root, so give every backend a unique name.
        env.setdefault("POD_NAME", f"{socket.gethostname()}-{os.getpid()}-{id(self):x}")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--conn-fd",
            str(child_sock.fileno()),
            "--shm-fd",
            str(self._shm_fd),
            "--spec",
            json.dumps(asdict(self._spec)),
            "--parent-cpus",
            parent_cpus,
            "--nice",
            str(self._nice),
        ]
        try:
            proc = subprocess.Popen(
                cmd,
                pass_fds=(child_sock.fileno(), self._shm_fd),
                stdin=subprocess.DEVNULL,
                env=env,
                # Own process group: a terminal's Ctrl-C goes to vLLM, which
                # then shuts us down in order. Not a session of its own:
                # Linux schedules each session as one group (autogroup), and
                # a fresh group on a loaded core was seen to wait 20 s and
                # more before its first run there.
                process_group=0,
            )
        finally:
            child_sock.close()
        self._starting = (proc, Connection(parent_sock.detach()))

    def _await_ready_locked(self) -> None:
        assert self._starting is not None
        proc, conn = self._starting
        self._starting = None
        try:
            if not conn.poll(self._startup_timeout_s):
                raise BackendError(
                    f"{self.name} backend did not start within "
                    f"{self._startup_timeout_s:.0f} s"
                )
            status, payload = conn.recv()
            if status != "ready":
                raise BackendError(f"{self.name} backend failed to start: {payload}")
        except (EOFError, OSError) as e:
            conn.close()
            self._reap(proc)
            raise BackendError(
                f"{self.name} backend exited during startup "
                f"(exit code {proc.returncode}): {e}"
            ) from e
        except BackendError:
            conn.close()
            self._reap(proc)
            raise
        self._proc, self._conn = proc, conn

    @staticmethod
    def _reap(proc: subprocess.Popen[bytes], grace_s: float = 2.0) -> None:
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("vineyard backend pid %d did not exit", proc.pid)

    def _stop_locked(self) -> None:
        self._in_flight = None
        if self._starting is not None:
            proc, conn = self._starting
            self._starting = None
            conn.close()
            self._reap(proc)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._reap(self._proc)
            self._proc = None

    def _ensure_running_locked(self) -> Connection:
        if self._closed:
            raise BackendError(f"{self.name} backend is closed")
        if self.disabled_reason is not None:
            raise BackendError(self.disabled_reason)
        if self._running_locked():
            assert self._conn is not None
            return self._conn
        self._stop_locked()
        now = time.monotonic()
        recent = self._recent_restarts
        while recent and now - recent[0] >= self._restart_window_s:
            recent.popleft()  # forgiven after a period of success
        if len(recent) >= self._max_restarts:
            reason = (
                f"{self.name} backend disabled for "
                f"{self._restart_window_s:.0f} s after {len(recent)} restarts; "
                "the cache recomputes instead meanwhile"
            )
            self._disabled = (reason, now)
            recent.clear()
            logger.warning("%s", reason)
            raise BackendError(reason)
        recent.append(now)
        self.restarts += 1
        logger.warning(
            "Restarting the %s vineyard backend (restart %d of %d allowed "
            "within %.0f s)",
            self.name,
            len(recent),
            self._max_restarts,
            self._restart_window_s,
        )
        self._start_locked()
        assert self._conn is not None
        return self._conn

    def _fail_locked(self, error: Exception) -> BackendError:
        code = self._proc.poll() if self._proc else None
        self._stop_locked()
        return BackendError(f"{self.name} backend died (exit code {code}): {error}")

    def send(self, *request: Any) -> None:
        """Send a request; :meth:`receive` gets its answer. With
        ``restart_in_background`` a dead process is restarted on another
        thread, and calls fail at once until it is up."""
        if self._restart_in_background:
            if not self._lock.acquire(blocking=False):
                raise BackendError(f"{self.name} backend is restarting")
        else:
            self._lock.acquire()
        try:
            assert self._in_flight is None, "one request at a time"
            if self._restart_in_background and not self._running_locked():
                self._restart_later_locked()
            conn = self._ensure_running_locked()
            try:
                conn.send(request)
            except (EOFError, OSError) as e:
                raise self._fail_locked(e) from e
            self._in_flight = request[0]
        finally:
            self._lock.release()

    def _running_locked(self) -> bool:
        return (
            self._conn is not None
            and self._proc is not None
            and self._proc.poll() is None
        )

    def _restart_later_locked(self) -> None:
        """Start the restart on a thread of its own and fail this call."""
        if self._closed or self.disabled_reason is not None:
            return  # _ensure_running_locked says why
        if self._restarter is None or not self._restarter.is_alive():

            def restart() -> None:
                with self._lock, contextlib.suppress(BackendError):
                    self._ensure_running_locked()

            self._restarter = threading.Thread(
                target=restart, name=f"vineyard-{self.name}-restart", daemon=True
            )
            self._restarter.start()
        raise BackendError(f"{self.name} backend is restarting")

    def ready(self) -> bool:
        """Whether :meth:`receive` would return (or fail) without waiting:
        the answer to the request sent last has arrived, or there is none
        to wait for."""
        with self._lock:
            conn = self._conn
            if self._in_flight is None or conn is None:
                return True
            try:
                return conn.poll(0)
            except (EOFError, OSError):
                return True  # receive() reports it

    def receive(self, timeout_s: float | None = None) -> Any:
        """The answer to the request sent last."""
        timeout = self._timeout_s if timeout_s is None else timeout_s
        with self._lock:
            op, conn = self._in_flight, self._conn
            if op is None or conn is None:
                raise BackendError(f"{self.name} backend lost the request")
            try:
                if not conn.poll(timeout):
                    # A late answer would be read as the next request's.
                    self._stop_locked()
                    raise BackendError(
                        f"{self.name} backend did not answer {op!r} within {timeout} s"
                    )
                status, payload = conn.recv()
            except (EOFError, OSError) as e:
                raise self._fail_locked(e) from e
            self._in_flight = None
        if status != "ok":
            raise BackendError(f"{self.name} backend error: {payload}")
        return payload

    def call(self, *request: Any, timeout_s: float | None = None) -> Any:
        """Send one request and wait for its answer."""
        self.send(*request)
        return self.receive(timeout_s)

    def close(self) -> None:
        self._closed = True
        # Kill first, without the lock: a call in flight then fails at once
        # instead of holding the lock until its timeout.
        starting = self._starting
        for proc in (self._proc, starting[0] if starting else None):
            if proc is not None and proc.poll() is None:
                proc.kill()
        with self._lock:
            self._stop_locked()


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
