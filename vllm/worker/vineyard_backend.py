# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vineyard backend process and the engine-side handle that drives it.

vineyard-llm holds the GIL for the whole of every call, so calling it from a
thread of vLLM's process would stall the forward pass for the full write. Every
vineyard call therefore runs in a process of its own, started with
``subprocess`` (vLLM's workers are daemonic and may not use
``multiprocessing``). KV bytes live in shared memory (a ``memfd`` that both
processes map); only small descriptors (buffer slot, token ids) cross the
socket.

This file is also the backend's entry point: it is run as a script (by path,
not with ``-m``) so that the backend never imports vLLM or torch and starts in
a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)


class BackendError(RuntimeError):
    """The backend process failed, timed out, died or is disabled."""


@dataclass(frozen=True)
class BackendSpec:
    """Everything the backend needs to open the cache and read the buffers.

    A buffer holds ``max_blocks`` KV blocks of every layer, laid out as
    ``[num_layers][max_blocks][block_bytes]``. Vineyard addresses KV per token
    and per layer, so each block is cut into ``block_size`` equal opaque
    slices, each split into a "K" and a "V" half. The bytes are never
    interpreted, which keeps any kernel-specific block packing intact.
    """

    root: str
    chunk_size: int
    ttl_s: int
    num_layers: int
    block_size: int
    block_bytes: int
    max_blocks: int
    num_buffers: int

    @property
    def token_bytes(self) -> int:
        return self.block_bytes // self.block_size

    @property
    def buffer_bytes(self) -> int:
        return self.num_layers * self.max_blocks * self.block_bytes

    @property
    def buffer_tokens(self) -> int:
        return self.max_blocks * self.block_size


# --------------------------------------------------------------------------
# Backend process side (no vLLM, no torch).
# --------------------------------------------------------------------------


class _VineyardServer:
    def __init__(self, spec: BackendSpec, shm: mmap.mmap):
        import numpy as np
        from vineyard.llm import FileCacheConfig, KVCache, KVTensor

        self._spec = spec
        self._kv_tensor = KVTensor
        self._base = int(np.frombuffer(shm, dtype=np.uint8).ctypes.data)
        os.makedirs(spec.root, exist_ok=True)
        config = FileCacheConfig(
            chunk_size=spec.chunk_size,
            root=spec.root,
            gc_interval=max(1, min(spec.ttl_s, 1800)),
            ttl=spec.ttl_s,
        )
        self._cache = KVCache(
            config,
            tensor_nbytes=spec.token_bytes // 2,
            cache_capacity=spec.buffer_tokens,
            layer=spec.num_layers,
        )
        # Building KVTensor lists is slow (tens of ms per 512 tokens): build
        # each buffer's list once and slice it per call.
        self._kv_lists: dict[int, list[list[tuple[Any, Any]]]] = {}

    def _kv_list(self, buffer_id: int) -> list[list[tuple[Any, Any]]]:
        kv_list = self._kv_lists.get(buffer_id)
        if kv_list is None:
            spec = self._spec
            half = spec.token_bytes // 2
            kv_tensor = self._kv_tensor
            buffer_base = self._base + buffer_id * spec.buffer_bytes
            layer_stride = spec.max_blocks * spec.block_bytes
            kv_list = []
            for slot in range(spec.buffer_tokens):
                offset = (slot // spec.block_size) * spec.block_bytes + (
                    slot % spec.block_size
                ) * spec.token_bytes
                layers = []
                for layer in range(spec.num_layers):
                    ptr = buffer_base + layer * layer_stride + offset
                    layers.append((kv_tensor(ptr, half), kv_tensor(ptr + half, half)))
                kv_list.append(layers)
            self._kv_lists[buffer_id] = kv_list
        return kv_list

    def update(
        self, buffer_id: int, segments: list[tuple[int, list[int], list[int]]]
    ) -> list[int]:
        """Write segments ``(first_slot, prefix, tokens)``; returns the number
        of tokens vineyard reports cached for each segment."""
        kv_list = self._kv_list(buffer_id)
        stored = []
        for first_slot, prefix, tokens in segments:
            kv = kv_list[first_slot : first_slot + len(tokens)]
            stored.append(int(self._cache.update(prefix, tokens, kv)))
        return stored

    def query(self, buffer_id: int, prefix: list[int], tokens: list[int]) -> int:
        """Read the cached leading chunks of ``tokens`` into the buffer,
        starting at slot 0; returns the number of tokens read."""
        kv = self._kv_list(buffer_id)[: len(tokens)]
        return int(self._cache.query(prefix, tokens, kv))

    def handle(self, request: tuple[Any, ...]) -> Any:
        op = request[0]
        if op == "update":
            return self.update(request[1], request[2])
        if op == "query":
            return self.query(request[1], request[2], request[3])
        if op == "ping":
            return os.getpid()
        if op == "sleep":  # test hook: simulates a stalled backend
            time.sleep(request[1])
            return None
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

    ``call`` is thread-safe and never waits longer than ``timeout_s``. When
    the process dies, answers garbage or stalls, it is killed and restarted on
    the next call, up to ``max_restarts`` times; after that every call fails
    at once with :class:`BackendError` and the cache degrades to recompute.
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
    ):
        self.name = name
        self._spec = spec
        self._shm_fd = shm_fd
        self._timeout_s = timeout_s
        self._startup_timeout_s = startup_timeout_s
        self._max_restarts = max_restarts
        self._nice = nice
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self.restarts = 0
        self.disabled_reason: str | None = None
        self._closed = False
        with self._lock:
            self._start_locked()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start_locked(self) -> None:
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
                # Own session: a terminal's Ctrl-C goes to vLLM, which then
                # shuts us down in order.
                start_new_session=True,
            )
        finally:
            child_sock.close()
        conn = Connection(parent_sock.detach())
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
        if (
            self._conn is not None
            and self._proc is not None
            and self._proc.poll() is None
        ):
            return self._conn
        self._stop_locked()
        if self.restarts >= self._max_restarts:
            self.disabled_reason = (
                f"{self.name} backend disabled after {self.restarts} "
                "restarts; the cache now recomputes instead"
            )
            logger.warning("%s", self.disabled_reason)
            raise BackendError(self.disabled_reason)
        self.restarts += 1
        logger.warning(
            "Restarting the %s vineyard backend (restart %d/%d)",
            self.name,
            self.restarts,
            self._max_restarts,
        )
        self._start_locked()
        assert self._conn is not None
        return self._conn

    def call(self, *request: Any, timeout_s: float | None = None) -> Any:
        """Send one request and wait for its answer."""
        timeout = self._timeout_s if timeout_s is None else timeout_s
        with self._lock:
            conn = self._ensure_running_locked()
            try:
                conn.send(request)
                if not conn.poll(timeout):
                    # The answer may still come later and would then be
                    # read as the answer to the next request: restart.
                    self._stop_locked()
                    raise BackendError(
                        f"{self.name} backend did not answer "
                        f"{request[0]!r} within {timeout} s"
                    )
                status, payload = conn.recv()
            except (EOFError, OSError) as e:
                code = self._proc.poll() if self._proc else None
                self._stop_locked()
                raise BackendError(
                    f"{self.name} backend died (exit code {code}): {e}"
                ) from e
        if status != "ok":
            raise BackendError(f"{self.name} backend error: {payload}")
        return payload

    def kill(self) -> None:
        """Kill the process without closing the handle (for tests)."""
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.wait()

    def close(self) -> None:
        self._closed = True
        # Kill first, without the lock: a call in flight then fails at once
        # instead of holding the lock until its timeout.
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        with self._lock:
            self._stop_locked()


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
