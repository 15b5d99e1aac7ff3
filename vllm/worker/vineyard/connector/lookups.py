# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The scheduler's lookups: :class:`VineyardCacheLookup` learns how much of a
prompt every TP rank's namespace holds from file metadata alone (no KV is
read), in lookup processes that can be abandoned when the root hangs;
:class:`BackgroundLookups` runs them off the scheduler's thread, each with a
deadline."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

from vllm.worker.vineyard.backend.client import BackendProcess
from vllm.worker.vineyard.backend.protocol import (
    BackendError,
    BackendSettings,
    BackendSpec,
    LookupRequest,
    ProbeRequest,
    ResetRequest,
)
from vllm.worker.vineyard.config import VineyardLLMCacheConfig
from vllm.worker.vineyard.connector.lookup_jobs import Job, LookupJob, NamespaceRemoval
from vllm.worker.vineyard.log_limiter import LogLimiter
from vllm.worker.vineyard.metrics import VineyardCacheMetrics
from vllm.worker.vineyard.storage.cached_chunks import count_cached_chunks
from vllm.worker.vineyard.storage.digests import synthetic_ids
from vllm.worker.vineyard.storage.layout import KVCacheLayout
from vllm.worker.vineyard.storage.removal import remove_namespace_chunks
from vllm.worker.vineyard.storage.timed_reads import (
    time_any_chunk_reads,
    time_chunk_reads,
)

logger = logging.getLogger(__name__)

#: Longest a scheduler step waits, over all its lookups, for lookups it
#: started (unless given more, see :meth:`BackgroundLookups.begin_step`):
#: on a fast disk a lookup is answered in the step that asked (no added
#: step), on a slow or hung one the step goes on.
STEP_WAIT_S = 0.005
#: Most lookup threads stuck in the filesystem at once before lookups are
#: answered as misses until one returns.
MAX_STUCK_THREADS = 4
#: How long a chunk file that could not be read is not promised (unless it
#: changes first), and how many such files are remembered at most.
UNREADABLE_RETRY_S = 600.0
MAX_UNREADABLE = 1024


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
        # Unreadable chunk files: path below a namespace -> (inode, mtime
        # in ns, until when they are avoided).
        self._unreadable: dict[str, tuple[int, int, float]] = {}
        self._unreadable_lock = threading.Lock()  # lookup threads read it
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

    def warm_up(self) -> None:
        """Start this thread's lookup process now, not the spare (that is
        the first lookup's); a failure is logged, the first call tries
        again."""
        if not self._in_process and getattr(self._processes, "process", None) is None:
            try:
                self._processes.process = self._start_process()
            except BackendError as e:
                logger.warning("vineyard cache lookup process did not start: %s", e)

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
            settings=BackendSettings.from_config(self.config),
            namespace_dir=files.namespace_dir,
            blocks_per_chunk=files.blocks_per_chunk,
            entry_bytes=files.entry_bytes,
            max_blocks=0,
            num_buffers=0,
            role="lookup",
            lookup_namespace_dirs=tuple(f.namespace_dir for f in self._files),
            flat_paths=files.flat,
        )
        # What a request's scheduling waits for.
        timeout_s = self.config.backend_timeout_s
        process = BackendProcess(
            "lookup", spec, None, timeout_s, exit_wait_s=0.1, waited_for=True
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

    def remove_namespaces(
        self, root: str, namespaces: Sequence[str]
    ) -> tuple[list[str], int]:
        """Delete every chunk file of ``namespaces`` under ``root``: the
        paths deleted (below its real path) and how many could not be. Runs
        in this thread's lookup process (a hung root raises
        :class:`BackendError` after ``backend_timeout_s``, and the process
        is abandoned)."""
        if self._in_process:
            return remove_namespace_chunks(root, set(namespaces))
        reply = self._process().call(
            ResetRequest(root, list(namespaces)),
            timeout_s=self.config.backend_timeout_s,
        )
        return reply.removed, reply.left

    def time_reads(
        self,
        digests: Sequence[bytes],
        max_chunks: int,
        max_bytes: int,
        cut_s_per_block: float = 0.0,
    ) -> tuple[int, float]:
        """Read the first chunk files of a prefix (rank 0's), or with no
        ``digests`` those the namespace lists first, timed: ``(blocks read,
        seconds)`` (see :func:`time_chunk_reads`), in this thread's lookup
        process (a hung root raises :class:`BackendError` after
        ``backend_timeout_s``)."""
        bpc = self.chunk_size // self.block_size
        ids = synthetic_ids(digests[: max_chunks * bpc])
        files, cut = self._files[0], cut_s_per_block
        if self._in_process and not ids:
            return time_any_chunk_reads(files, max_chunks, max_bytes, cut)
        if self._in_process:
            return time_chunk_reads(files, ids, max_chunks, max_bytes, cut)
        reply = self._process().call(
            ProbeRequest(ids, max_chunks, max_bytes, cut),
            timeout_s=self.config.backend_timeout_s,
        )
        return reply.blocks, reply.seconds

    def count(
        self, num_local_tokens: int, num_tokens: int, num_digests: int, num_hit: int
    ) -> None:
        """Count a lookup's answer, once the scheduler takes it."""
        want_blocks = min((num_tokens - 1) // self.block_size, num_digests)
        query = max(0, want_blocks * self.block_size - num_local_tokens)
        self.metrics.add("query_tokens", query)
        self.metrics.add("hit_tokens", num_hit)

    def avoid(self, unreadable: Sequence[tuple[str, int, int]]) -> None:
        """Chunk files a reader could not read (path below the namespace,
        inode, mtime in ns): counted missing for :data:`UNREADABLE_RETRY_S`
        unless they change (replaced, healed, rewritten) before, so a bad
        file costs one failed load, not one per request."""
        until = time.monotonic() + UNREADABLE_RETRY_S
        with self._unreadable_lock:
            for path, ino, mtime_ns in unreadable:
                self._unreadable.pop(path, None)
                self._unreadable[path] = (ino, mtime_ns, until)
            while len(self._unreadable) > MAX_UNREADABLE:
                del self._unreadable[next(iter(self._unreadable))]

    def _avoided(self) -> dict[str, tuple[int, int]]:
        """The unreadable files still avoided (path -> inode, mtime)."""
        now = time.monotonic()
        with self._unreadable_lock:
            self._unreadable = {
                p: entry for p, entry in self._unreadable.items() if entry[2] >= now
            }
            return {p: (ino, mtime) for p, (ino, mtime, _) in self._unreadable.items()}

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
        avoid = self._avoided() if self._unreadable else {}
        if self._in_process:
            counts: dict[str, int] = {}
            cached = count_cached_chunks(
                self._files, ids, max_chunks, counts, self._log, avoid
            )
        else:
            reply = self._process().call(
                LookupRequest(ids, max_chunks, avoid),
                timeout_s=self.config.backend_timeout_s,
            )
            cached, counts = reply.cached, reply.counts
        self.metrics.record(counts)
        hit_end = min(cached * bpc, want_blocks) * bs
        return max(0, hit_end - num_local_tokens), cached * self.chunk_size


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

    Threads: one works the queue; an abandoned one is stuck in the
    filesystem. A thread back from an abandoned lookup is no longer
    abandoned: it works the queue again if no thread does (none could be
    started), else it exits. So at most one thread works, the abandoned
    list holds only threads still stuck, and live threads are at most
    ``MAX_STUCK_THREADS + 1``.
    """

    def __init__(self, lookup: VineyardCacheLookup, timeout_s: float):
        self._lookup = lookup
        self.metrics = lookup.metrics
        self._timeout_s = timeout_s
        self._jobs: dict[str, LookupJob] = {}
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._busy: dict[threading.Thread, Job | None] = {}
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
                if isinstance(job, NamespaceRemoval):
                    job.removed, job.left = self._lookup.remove_namespaces(
                        job.root, job.namespaces
                    )
                else:
                    # From token 0: the request's local hit is taken off
                    # when the answer is given (it may change meanwhile).
                    job.result = self._lookup.find(job.digests, 0, job.num_tokens)
            except Exception as e:  # noqa: BLE001 - a miss, never a crash
                if isinstance(job, NamespaceRemoval):
                    job.error = str(e)
                else:
                    self._log.warning(
                        "failed", "vineyard cache lookup failed (a miss): %s", e
                    )
            job.done.set()
            with self._lock:
                if me in self._busy:
                    self._busy[me] = None
                    continue
                # Back from a lookup it was abandoned in.
                self._abandoned = [t for t in self._abandoned if t is not me]
                if self._busy or self._closed:
                    return  # another thread works the queue
                self._busy[me] = None
            logger.info("vineyard cache lookup thread is back from the filesystem")

    def _replace_stuck_threads(self, now: float) -> None:
        """Abandon threads stuck in one lookup past the deadline (when the
        filesystem answers, each works again or exits: see the class) and
        start another while at most ``MAX_STUCK_THREADS`` are stuck."""
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
            num_stuck = len(self._abandoned)
        if stuck and working == 0 and num_stuck <= MAX_STUCK_THREADS:
            logger.warning(
                "vineyard cache lookup stuck for more than %.1f s (a hung "
                "filesystem?); lookups go on in a new thread",
                self._timeout_s,
            )
            self._start_thread()

    def remove_namespaces(
        self, root: str, namespaces: Sequence[str]
    ) -> NamespaceRemoval:
        """Queue the removal of every chunk file of ``namespaces`` (see
        :meth:`VineyardCacheLookup.remove_namespaces`); returns at once."""
        removal = NamespaceRemoval(root, list(namespaces))
        self._queue.put(removal)
        return removal

    def avoid(self, unreadable: Sequence[tuple[str, int, int]]) -> None:
        """See :meth:`VineyardCacheLookup.avoid`."""
        self._lookup.avoid(unreadable)

    def begin_step(self, wait_s: float = STEP_WAIT_S) -> None:
        """A new scheduler step: it waits up to ``wait_s`` in all for
        lookups."""
        self._wait_left = wait_s
        self._replace_stuck_threads(time.monotonic())

    def lookup(
        self,
        req_id: str,
        digests: Sequence[bytes],
        num_local_tokens: int,
        num_tokens: int,
    ) -> tuple[int, int] | None:
        """``(num_hit_tokens, save_from)`` of the request's lookup (see
        :meth:`VineyardCacheLookup.lookup`), or ``None`` while pending
        after the step's share of waiting."""
        job = self.start(req_id, digests, num_tokens)
        if not job.done.is_set() and self._wait_left > 0:
            start = time.monotonic()
            job.done.wait(self._wait_left)
            self._wait_left -= time.monotonic() - start
        if not job.done.is_set() and time.monotonic() >= job.deadline:
            self.forget(req_id)  # a late answer is dropped (and not counted)
            self.metrics.add("lookup_timeouts")
            self._lookup.count(num_local_tokens, num_tokens, len(digests), 0)
            return 0, 0
        return self.take(req_id, num_local_tokens)

    def take(self, req_id: str, num_local_tokens: int) -> tuple[int, int] | None:
        """The request's lookup's answer once it is in (counted), whatever
        the request's length now; else ``None``."""
        job = self._jobs.get(req_id)
        if job is None or not job.done.is_set():
            return None
        del self._jobs[req_id]
        answer = (max(0, job.result[0] - num_local_tokens), job.result[1])
        self._lookup.count(
            num_local_tokens, job.num_tokens, len(job.digests), answer[0]
        )
        return answer

    def start(
        self, req_id: str, digests: Sequence[bytes], num_tokens: int
    ) -> LookupJob:
        """The request's lookup, queued now if it has none for this prompt
        (never waits): a request's lookup can start when it arrives."""
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
            job = LookupJob(list(digests), num_tokens, deadline)
            self._jobs[req_id] = job
            self._queue.put(job)
        return job

    def peek(self, req_id: str) -> tuple[int, int] | None:
        """The end of the request's hit (from token 0) and of its cached
        chunks if its lookup is done, else ``None``; the lookup is still
        answered by :meth:`lookup`."""
        job = self._jobs.get(req_id)
        if job is None or not job.done.is_set() or job.cancelled:
            return None
        return job.result

    def forget(self, req_id: str) -> None:
        job = self._jobs.pop(req_id, None)
        if job is not None:
            job.cancelled = True  # finished: a queued pass is not needed

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with self._lock:
                # A stuck thread may come back and take one too.
                count = len(self._busy) + len(self._abandoned)
            for _ in range(count):
                self._queue.put(None)
            self._lookup.close()
