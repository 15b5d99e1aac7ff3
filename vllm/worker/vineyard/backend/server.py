# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vineyard backend process: its entry point (:func:`main`), the
status envelope it answers in, and its roles (its engine-side handle is
:mod:`vllm.worker.vineyard.backend.client`).

vineyard-llm holds the GIL for the whole of every call, so calling it from a
thread of vLLM's process would stall the forward pass for the full write.
Every vineyard call therefore runs in a process of its own, started with
``subprocess`` (vLLM's workers are daemonic and may not use
``multiprocessing``). KV bytes live in shared memory (a ``memfd`` that both
processes map); only small descriptors (buffer slot, block ids) cross the
socket, as the requests and replies of
:mod:`~vllm.worker.vineyard.backend.protocol` (dispatched on their type).

Roles: a reader or the writer
(:class:`~vllm.worker.vineyard.backend.vineyard_server.VineyardServer`),
or the scheduler's lookups (:class:`_LookupServer`, by ``stat`` alone, and
its timed reads of the link).
Started through :mod:`vllm.worker.vineyard.launch`, so that a backend never
imports vLLM or torch and starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

from vllm.worker.vineyard.backend.protocol import (
    BackendSpec,
    LookupReply,
    LookupRequest,
    PingReply,
    PingRequest,
    ProbeReply,
    ProbeRequest,
    ResetReply,
    ResetRequest,
)
from vllm.worker.vineyard.backend.vineyard_server import VineyardServer
from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.storage.cached_chunks import count_cached_chunks
from vllm.worker.vineyard.storage.chunks import ChunkFiles
from vllm.worker.vineyard.storage.removal import remove_namespace_chunks
from vllm.worker.vineyard.storage.timed_reads import (
    time_any_chunk_reads,
    time_chunk_reads,
)

logger = logging.getLogger(__name__)


class _LookupServer:
    """The scheduler's lookups, by ``stat`` of chunk files (no vineyard, no
    KV read), and its timed reads of the link (no bytes kept): in a process
    of their own, so that a call stuck on a hung root holds up no process
    that vLLM waits for at shutdown."""

    def __init__(self, spec: BackendSpec):
        self._rank_files = [
            ChunkFiles(
                namespace_dir, spec.blocks_per_chunk, spec.entry_bytes, spec.flat_paths
            )
            for namespace_dir in spec.lookup_namespace_dirs
        ]
        self._log = LogLimiter(logger)

    def handle(
        self, request: object
    ) -> LookupReply | ProbeReply | ResetReply | PingReply:
        if isinstance(request, LookupRequest):
            counts: dict[str, int] = {}
            cached = count_cached_chunks(
                self._rank_files,
                request.ids,
                request.max_chunks,
                counts,
                self._log,
                request.avoid,
            )
            return LookupReply(cached, counts)
        if isinstance(request, ProbeRequest):
            files, ids = self._rank_files[0], request.ids
            n, max_bytes = request.max_chunks, request.max_bytes
            cut = request.cut_s_per_block
            if not ids:
                return ProbeReply(*time_any_chunk_reads(files, n, max_bytes, cut))
            return ProbeReply(*time_chunk_reads(files, ids, n, max_bytes, cut))
        if isinstance(request, ResetRequest):
            return ResetReply(
                *remove_namespace_chunks(request.root, set(request.namespaces))
            )
        if isinstance(request, PingRequest):
            return PingReply(os.getpid())
        raise ValueError(f"unknown lookup request {request!r}")

    def when_idle(self) -> None:
        """Nothing waits for an idle lookup process."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conn-fd", type=int, required=True)
    parser.add_argument("--shm-fd", type=int, required=True)
    parser.add_argument("--spec", type=str, required=True)
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
    if args.nice:
        os.nice(args.nice)

    spec = BackendSpec.from_json(args.spec)
    conn = Connection(args.conn_fd)
    server: VineyardServer | _LookupServer
    try:
        if spec.role == "lookup":
            server = _LookupServer(spec)
        else:
            # The reader maps its buffers (which the engine has backed) at
            # once, so that its first load does not fault them in page by
            # page; the writer's (the update pool) are backed as needed.
            populate = 0 if spec.sweep else getattr(mmap, "MAP_POPULATE", 0)
            shm = mmap.mmap(
                args.shm_fd,
                spec.num_buffers * spec.buffer_bytes,
                flags=mmap.MAP_SHARED | populate,
            )
            server = VineyardServer(spec, shm)
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
            if not conn.poll(0):
                server.when_idle()
        except (EOFError, OSError):
            return 0
