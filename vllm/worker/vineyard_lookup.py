# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the cached bytes depend on (:class:`KVCacheLayout`, the namespace)
and the scheduler's lookup (:class:`VineyardCacheLookup`), which learns how
much of a prompt is cached from file metadata alone: no KV is read and no
backend process is involved."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.worker.vineyard_backend_process import (
    BackendError,
    BackendProcess,
    BackendSpec,
)
from vllm.worker.vineyard_config import VineyardLLMCacheConfig
from vllm.worker.vineyard_metrics import VineyardCacheMetrics
from vllm.worker.vineyard_root import count_cached_chunks
from vllm.worker.vineyard_store import (
    FORMAT_VERSION,
    TRAILER_BYTES,
    ChunkFiles,
    LogLimiter,
    synthetic_ids,
)

logger = logging.getLogger(__name__)

#: Longest a scheduler step waits, over all its lookups, for lookups it
#: started: on a fast disk a lookup is answered in the step that asked
#: (no added step), on a slow or hung one the step goes on.
STEP_WAIT_S = 0.005
#: Most lookup threads stuck in the filesystem at once before lookups are
#: answered as misses until one returns.
MAX_STUCK_THREADS = 4


@dataclass(frozen=True)
class KVCacheLayout:
    """The shape of the KV that the cache stores, and its namespace.

    Vineyard keys chunks by ids alone, so everything that makes the bytes of
    a chunk differ goes into the namespace: two models (or dtypes, block or
    chunk sizes, kernel layouts, TP shards, storage formats, auth keys)
    sharing one root never see each other's KV.
    """

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    block_bytes: int  # one block of one layer
    kv_layout: str  # device, per-layer tensor shape, CPU instruction set
    chunk_size: int  # tokens
    tp_size: int = 1
    tp_rank: int = 0
    key_id: str = "nokey"  # which auth key seals the chunks
    # What changes the KV bytes under the same shapes: vLLM's KV cache dtype
    # (fp8 variants are all stored as uint8), the weights' identity and the
    # config overrides.
    kv_cache_dtype: str = "auto"
    weights: str = ""
    hf_overrides: str = ""

    def __post_init__(self) -> None:
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk of {self.chunk_size} tokens is not a whole number of "
                f"{self.block_size}-token blocks"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    @property
    def payload_bytes(self) -> int:
        """One block of every layer: the payload of one vineyard entry."""
        return self.num_layers * self.block_bytes

    @property
    def entry_bytes(self) -> int:
        return self.payload_bytes + TRAILER_BYTES

    @property
    def namespace(self) -> str:
        ident = json.dumps(
            {
                "format": FORMAT_VERSION,
                **{k: getattr(self, k) for k in self.__dataclass_fields__},
            },
            sort_keys=True,
        )
        digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
        name = re.sub(
            r"[^A-Za-z0-9._-]+", "_", os.path.basename(self.model.rstrip("/"))
        )[:48]
        return (
            f"v{FORMAT_VERSION}-{name}-{digest}-c{self.chunk_size}"
            f"-tp{self.tp_size}r{self.tp_rank}-{self.key_id}"
        )

    def files(self, cache_root: str) -> ChunkFiles:
        return ChunkFiles(
            os.path.join(cache_root, self.namespace),
            self.blocks_per_chunk,
            self.entry_bytes,
        )


#: Checkpoint files whose identity goes into the namespace.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_FINGERPRINT_READ = 1 << 20  # bytes read from each end of a weight file
#: Config files hashed whole: a model's, and a LoRA adapter's.
_CONFIG_FILES = ("config.json", "adapter_config.json")


def weights_fingerprint(model: str, revision: str | None) -> str:
    """What identifies the weights (of a model or a LoRA adapter), so that
    weights updated in place (at the same path or an unpinned hub name) get
    a new namespace or new digests: for a local
    checkpoint, a hash of its config and index files, and of each weight
    file's name, size and first and last MiB; for a hub name, the pinned
    revision, or the commit of the snapshot vLLM downloaded."""
    if os.path.isdir(model):
        h = hashlib.sha256()
        for name in sorted(os.listdir(model)):
            path = os.path.join(model, name)
            if not os.path.isfile(path):
                continue
            if name in _CONFIG_FILES or name.endswith("index.json"):
                with open(path, "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
            elif name.endswith(_WEIGHT_SUFFIXES):
                size = os.path.getsize(path)
                h.update(f"{name}\0{size}\0".encode())
                with open(path, "rb") as f:
                    h.update(f.read(_FINGERPRINT_READ))
                    f.seek(max(0, size - _FINGERPRINT_READ))
                    h.update(f.read(_FINGERPRINT_READ))
        return "sha256:" + h.hexdigest()[:32]
    if revision:
        return f"revision:{revision}"
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # noqa: BLE001 - no hub, no snapshot: best effort
        found = None
    if isinstance(found, str):
        # .../snapshots/<commit>/config.json
        return "commit:" + os.path.basename(os.path.dirname(found))
    return "unknown"


def overrides_text(overrides: object) -> str:
    """vLLM's ``hf_overrides`` as a stable string (a callable by name)."""
    if not overrides:
        return ""
    if callable(overrides):
        module = getattr(overrides, "__module__", "")
        return f"callable:{module}.{getattr(overrides, '__qualname__', '')}"
    return json.dumps(overrides, sort_keys=True, default=str)


class VineyardCacheLookup:
    """The scheduler's view of the cache: how many leading chunks of a
    prompt every TP rank holds, by ``stat`` of their chunk files.

    A chunk is usable only if every rank has it (ranks store their own
    shards), so the answer is the minimum across ranks. A file that is there
    but turns out bad is caught by the worker's verification, and vLLM
    recomputes from there.

    With ``in_process=False`` (the scheduler's) the ``stat`` calls run in a
    lookup process per calling thread (:class:`BackendProcess`, role
    ``lookup``): a thread waits for it on a socket, never in the filesystem,
    so a hung root cannot keep the scheduler's process from exiting. A
    process that does not answer within ``backend_timeout_s`` (a slow disk
    is only slow: the request was answered at its lookup deadline anyway)
    is killed and abandoned (it exits when the filesystem answers).
    """

    def __init__(
        self,
        config: VineyardLLMCacheConfig,
        layouts: Sequence[KVCacheLayout],
        in_process: bool = True,
    ):
        assert layouts, "one layout per TP rank"
        self.config = config
        self.chunk_size = layouts[0].chunk_size
        self.block_size = layouts[0].block_size
        self._files = [layout.files(config.root) for layout in layouts]
        self.metrics = VineyardCacheMetrics(config.metrics_enabled)
        self._log = LogLimiter(logger)
        self._in_process = in_process
        self._processes = threading.local()
        self._started: list[BackendProcess] = []
        self._started_lock = threading.Lock()
        self._closed = False
        # Started now, for the first lookup thread: a request's first lookup
        # does not wait for a process to start.
        self._spare: BackendProcess | None = None
        if not in_process:
            try:
                self._spare = self._start_process()
            except BackendError as e:
                logger.warning("vineyard cache lookup process did not start: %s", e)

    def lookup(
        self, digests: Sequence[bytes], num_local_tokens: int, num_tokens: int
    ) -> tuple[int, int]:
        """How many tokens beyond vLLM's local prefix hit are cached.

        ``digests`` are the chained digests of the prompt's complete blocks.
        Returns ``(num_hit_tokens, save_from)``. The hit ends at the last
        complete block before the token vLLM must compute (so at most one
        block plus that token is recomputed); a chunk that reaches past
        that block is used in part. ``save_from`` is the end of the cached
        chunks, where the request's saves start.
        """
        num_hit, save_from = self.find(digests, num_local_tokens, num_tokens)
        self.count(num_local_tokens, num_tokens, len(digests), num_hit)
        return num_hit, save_from

    def _process(self) -> BackendProcess:
        """This thread's lookup process (started on its first lookup)."""
        process: BackendProcess | None = getattr(self._processes, "process", None)
        if process is None:
            with self._started_lock:
                process, self._spare = self._spare, None
            process = process or self._start_process()
            self._processes.process = process
        return process

    def _start_process(self) -> BackendProcess:
        files = self._files[0]
        spec = BackendSpec(
            root=files.root,
            blocks_per_chunk=files.blocks_per_chunk,
            entry_bytes=files.entry_bytes,
            max_blocks=0,
            num_buffers=0,
            role="lookup",
            lookup_roots=tuple(f.root for f in self._files),
        )
        process = BackendProcess(
            "lookup", spec, None, self.config.backend_timeout_s, exit_wait_s=0.1
        )
        with self._started_lock:
            if self._closed:
                process.close()
                raise BackendError("lookups are closed")
            self._started.append(process)
        return process

    def close(self) -> None:
        """Stop the lookup processes (killed, never waited for)."""
        with self._started_lock:
            self._closed = True
            started, self._started = self._started, []
        for process in started:
            process.close()

    def count(
        self, num_local_tokens: int, num_tokens: int, num_digests: int, num_hit: int
    ) -> None:
        """Count a lookup's answer, once the scheduler takes it."""
        want_blocks = min((num_tokens - 1) // self.block_size, num_digests)
        query = max(0, want_blocks * self.block_size - num_local_tokens)
        self.metrics.add("query_tokens", query)
        self.metrics.add("hit_tokens", num_hit)

    def find(
        self, digests: Sequence[bytes], num_local_tokens: int, num_tokens: int
    ) -> tuple[int, int]:
        """:meth:`lookup` without counting its answer (a background lookup
        may be answered as a miss before the filesystem answers it)."""
        bs, bpc = self.block_size, self.chunk_size // self.block_size
        want_blocks = min((num_tokens - 1) // bs, len(digests))
        # A chunk is found by the ids of all its blocks, so only chunks the
        # prompt holds whole can be looked up.
        max_chunks = min(-(-want_blocks // bpc), len(digests) // bpc)
        ids = synthetic_ids(digests[: max_chunks * bpc])
        if self._in_process:
            counts: dict[str, int] = {}
            cached = count_cached_chunks(
                self._files, ids, max_chunks, counts, self._log
            )
        else:
            reply = self._process().call(
                "lookup", ids, max_chunks, timeout_s=self.config.backend_timeout_s
            )
            cached, counts = reply["cached"], reply["stats"]
        self.metrics.record(counts)
        hit_end = min(cached * bpc, want_blocks) * bs
        return max(0, hit_end - num_local_tokens), cached * self.chunk_size


@dataclass
class _LookupJob:
    """One request's lookup: the filesystem's answer does not depend on
    vLLM's local hit, so a request whose local hit changes keeps its job."""

    digests: list[bytes]
    num_tokens: int
    deadline: float  # monotonic: the request's, from its first ask
    started_at: float | None = None  # when a thread began it (not queued)
    cancelled: bool = False  # replaced or answered: a thread skips it
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[int, int] = (0, 0)  # (hit end from token 0, save_from)


class BackgroundLookups:
    """Runs :class:`VineyardCacheLookup` on background threads, so the
    scheduler's thread never touches the filesystem.

    :meth:`lookup` answers from a finished lookup, ``None`` while one is
    pending ("ask again next step"), and a miss once the request's deadline
    (``timeout_s`` from its first ask) has passed (counted as
    ``lookup_timeouts``). One job per request: asked again with another
    local hit (vLLM's prefix cache changes while the request waits), the
    job is re-aimed, not repeated. A ``stat`` that hangs cannot be
    cancelled, so a thread that has run one lookup for longer than
    ``timeout_s`` (time in the queue does not count) is abandoned and
    another takes over the queue: a hung filesystem costs hits, never the
    engine's progress, and a slow one starts no extra threads.
    """

    def __init__(self, lookup: VineyardCacheLookup, timeout_s: float):
        self._lookup = lookup
        self.metrics = lookup.metrics
        self._timeout_s = timeout_s
        self._jobs: dict[str, _LookupJob] = {}
        self._queue: queue.SimpleQueue[_LookupJob | None] = queue.SimpleQueue()
        self._busy: dict[threading.Thread, _LookupJob | None] = {}
        self._abandoned: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._log = LogLimiter(logger)
        self._wait_left = STEP_WAIT_S
        self._closed = False
        self._start_thread()

    def _start_thread(self) -> None:
        thread = threading.Thread(
            target=self._run, name="vineyard-cache-lookup", daemon=True
        )
        with self._lock:
            self._busy[thread] = None
        thread.start()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled:
                continue
            with self._lock:
                job.started_at = time.monotonic()
                self._busy[me] = job
            try:
                # From token 0: the request's local hit is taken off when
                # the answer is given (it may change meanwhile).
                job.result = self._lookup.find(job.digests, 0, job.num_tokens)
            except Exception as e:  # noqa: BLE001 - a miss, never a crash
                self._log.warning(
                    "failed", "vineyard cache lookup failed (a miss): %s", e
                )
            job.done.set()
            with self._lock:
                self._busy[me] = None

    def _replace_stuck_threads(self, now: float) -> None:
        """Abandon threads stuck in one lookup past the deadline (they
        exit when the filesystem answers) and start others."""
        with self._lock:
            stuck = [
                t
                for t, job in self._busy.items()
                if job is not None
                and job.started_at is not None
                and now - job.started_at > self._timeout_s
            ]
            for thread in stuck:
                del self._busy[thread]
            working = len(self._busy)
        self._abandoned = [t for t in self._abandoned + stuck if t.is_alive()]
        if stuck and working == 0 and len(self._abandoned) <= MAX_STUCK_THREADS:
            logger.warning(
                "vineyard cache lookup stuck for more than %.1f s (a hung "
                "filesystem?); lookups go on in a new thread",
                self._timeout_s,
            )
            self._start_thread()

    def begin_step(self) -> None:
        """A new scheduler step: its share of waiting for lookups."""
        self._wait_left = STEP_WAIT_S
        self._replace_stuck_threads(time.monotonic())

    def lookup(
        self,
        req_id: str,
        digests: Sequence[bytes],
        num_local_tokens: int,
        num_tokens: int,
    ) -> tuple[int, int] | None:
        """``(num_hit_tokens, save_from)`` of the request's lookup (see
        :meth:`VineyardCacheLookup.lookup`), or ``None`` while pending."""
        job = self._jobs.get(req_id)
        if job is None or (job.num_tokens, len(job.digests)) != (
            num_tokens,
            len(digests),
        ):
            # New, or the prompt grew (a preempted request's outputs): a
            # filesystem pass is needed, by the request's first deadline.
            if job is not None:
                job.cancelled = True
                deadline = job.deadline
            else:
                deadline = time.monotonic() + self._timeout_s
            job = _LookupJob(list(digests), num_tokens, deadline)
            self._jobs[req_id] = job
            self._queue.put(job)
        if not job.done.is_set() and self._wait_left > 0:
            start = time.monotonic()
            job.done.wait(self._wait_left)
            self._wait_left -= time.monotonic() - start
        if job.done.is_set():
            hit_end, save_from = job.result
            answer = (max(0, hit_end - num_local_tokens), save_from)
        elif time.monotonic() >= job.deadline:
            job.cancelled = True
            self.metrics.add("lookup_timeouts")
            answer = (0, 0)  # a late answer is dropped (and not counted)
        else:
            return None
        del self._jobs[req_id]
        self._lookup.count(num_local_tokens, num_tokens, len(digests), answer[0])
        return answer

    def forget(self, req_id: str) -> None:
        job = self._jobs.pop(req_id, None)
        if job is not None:
            job.cancelled = True  # finished: a queued pass is not needed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with self._lock:
                count = len(self._busy)
            for _ in range(count):
                self._queue.put(None)
            self._lookup.close()
