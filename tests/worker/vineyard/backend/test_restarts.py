# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The backend processes dying, stalling and coming back: the cache
degrades to recompute (counted), restarts them (counted) and works again.

Backends are killed (SIGKILL) and stalled (SIGSTOP) by pid, from outside,
as a crash or a hung disk would do it: the product has no test hooks.
Lookups never involve a backend (they ``stat`` chunk files), so a dead
reader shows in loads only.
"""

from __future__ import annotations

import collections
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.script_testing import mount_slow_fs
from tests.vineyard_testing import wait_until
from tests.worker.vineyard_cache_testing import (
    CHUNK_SIZE,
    CacheFactory,
    CacheHarness,
    default_settings,
    kill_process,
    make_tokens,
    pid_exists,
    same_bits,
    stop_process,
)
from vllm.worker.vineyard import cores, launch
from vllm.worker.vineyard.backend import progress
from vllm.worker.vineyard.backend.client import CLOSE_WAIT_S, BackendProcess
from vllm.worker.vineyard.backend.protocol import BackendError, BackendSpec

SEQ_LEN = 4 * CHUNK_SIZE + 3
CACHED = 4 * CHUNK_SIZE
DST_BLOCK = 40


def saved_sequence(h: CacheHarness, req_id: str = "req") -> tuple[list[int], list[int]]:
    """A sequence of four cached chunks: its tokens and source blocks."""
    tokens = make_tokens(SEQ_LEN)
    blocks = h.blocks_for(0, SEQ_LEN)
    written = h.counters()["tokens_written"]
    h.save_all([h.request(req_id, tokens, SEQ_LEN, blocks)])
    h.cache.saves.release(req_id)
    assert h.counters()["tokens_written"] - written == CACHED
    return tokens, blocks


def kill_later(pid: int, delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, os.kill, (pid, signal.SIGKILL))
    timer.start()
    return timer


def wait_restarted(h: CacheHarness) -> None:
    """Wait until the reader's background restart is over."""
    reader = h.cache._readers[0]
    assert reader is not None
    restarter = reader._restarter
    assert restarter is not None, "no restart was started"
    restarter.join(30)
    assert not restarter.is_alive()


def test_reader_dying_during_a_load(make_cache: CacheFactory):
    """A reader that dies while a load waits for it: the load returns short
    at once (nothing written into the blocks, counted), the next load
    restarts it and hits."""
    h = make_cache()
    tokens, src = saved_sequence(h)
    # The lookup reads files, not the reader: it hits whatever the reader.
    assert h.lookup(tokens) == (CACHED, CACHED)

    pid = h.pid("read")
    stop_process(pid)
    timer = kill_later(pid, 0.3)
    dst = h.blocks_for(DST_BLOCK, SEQ_LEN)
    before = h.kv.clone()
    t0 = time.perf_counter()
    assert h.load(tokens, 0, CACHED, dst) == 0
    elapsed = time.perf_counter() - t0
    timer.join()
    # It waited for the death, not for the backend timeout.
    assert elapsed < h.config.backend_timeout_s / 2
    assert same_bits(h.kv, before)
    counters = h.counters()
    assert counters["load_errors"] == 1
    assert counters["loaded_tokens"] == 0
    assert wait_until(lambda: not pid_exists(pid), 5.0)

    # The next call starts a restart on another thread (loads run on the
    # forward thread, which never waits for one) and comes up short at
    # once; then loads work again.
    assert h.load(tokens, 0, CACHED, dst) == 0
    wait_restarted(h)
    assert h.load(tokens, 0, CACHED, dst) == CACHED
    n = CACHED // h.block_size
    assert same_bits(h.kv[:, dst[:n]], h.kv[:, src[:n]])
    counters = h.counters()
    assert counters["backend_restarts"] == 1
    assert counters["load_errors"] == 2
    assert h.pid("read") != pid


def test_stalled_reader_times_out_and_is_replaced(make_cache: CacheFactory):
    h = make_cache(backend_timeout_s=1.0)
    tokens, src = saved_sequence(h)
    pid = h.pid("read")
    stop_process(pid)
    dst = h.blocks_for(DST_BLOCK, SEQ_LEN)
    before = h.kv.clone()
    t0 = time.perf_counter()
    assert h.load(tokens, 0, CACHED, dst) == 0
    # It gave up after the timeout (not before); the upper bound only
    # proves it did not hang.
    assert time.perf_counter() - t0 >= 0.9
    assert same_bits(h.kv, before)
    assert h.counters()["load_errors"] == 1
    # The stalled process was killed, not left behind.
    assert wait_until(lambda: not pid_exists(pid), 5.0)
    assert h.load(tokens, 0, CACHED, dst) == 0  # starts the restart
    wait_restarted(h)
    assert h.load(tokens, 0, CACHED, dst) == CACHED
    n = CACHED // h.block_size
    assert same_bits(h.kv[:, dst[:n]], h.kv[:, src[:n]])
    assert h.counters()["backend_restarts"] == 1


def test_backend_restarts_then_is_disabled_after_too_many(make_cache: CacheFactory):
    h = make_cache(readers=1)  # another reader would serve the loads
    tokens, _ = saved_sequence(h)
    dst = h.blocks_for(DST_BLOCK, SEQ_LEN)
    for restart in range(1, 4):
        old = h.pid("read")
        kill_process(old)
        # Found dead before the request is sent: restarted in the
        # background (this load comes up short at once), then loads work.
        assert h.load(tokens, 0, CACHED, dst) == 0
        wait_restarted(h)
        assert h.load(tokens, 0, CACHED, dst) == CACHED
        assert h.pid("read") != old
        counters = h.counters()
        assert counters["backend_restarts"] == restart
        assert counters["load_errors"] == restart
    kill_process(h.pid("read"))
    # Degrades to recompute: a short load every time, no exception, no
    # wait (a disabled backend is not called; the bound is generous).
    for _ in range(3):
        done = threading.Event()
        results: list[int] = []

        def load() -> None:
            results.append(h.load(tokens, 0, CACHED, dst))  # noqa: B023
            done.set()  # noqa: B023

        threading.Thread(target=load, daemon=True).start()
        assert done.wait(h.config.backend_timeout_s / 2), "load blocked"
        assert results == [0]
    # The first of those loads found the reader dead and started a restart
    # on another thread; that thread is what disables the backend.
    wait_restarted(h)
    reader = h.cache._readers[0]
    assert reader is not None
    assert reader.disabled_reason is not None
    assert not h.cache.can_load()  # the scheduler stops promising hits
    counters = h.counters()
    assert counters["load_errors"] == 3 + 3
    assert counters["backend_restarts"] == 3
    # Lookups still answer (from the files), and writes go on: the writer
    # is another process.
    assert h.lookup(tokens) == (CACHED, CACHED)
    more_tokens, _ = saved_sequence(h, "other")
    assert h.lookup(more_tokens) == (CACHED, CACHED)
    assert h.counters()["updates_failed"] == 0
    # Once the restart window has passed, the reader is tried again.
    reader._restart_window_s = 0.0
    assert h.load(tokens, 0, CACHED, dst) == 0  # starts the restart
    wait_restarted(h)
    assert h.cache.can_load()
    assert h.load(tokens, 0, CACHED, dst) == CACHED
    assert h.counters()["backend_restarts"] == 4


def test_restarts_spread_over_time_are_forgiven(make_cache: CacheFactory):
    """Restarts older than the window do not count towards disabling."""
    h = make_cache()
    tokens, _ = saved_sequence(h)
    dst = h.blocks_for(DST_BLOCK, SEQ_LEN)
    reader = h.cache._readers[0]
    assert reader is not None
    for _ in range(5):
        kill_process(h.pid("read"))
        assert h.load(tokens, 0, CACHED, dst) == 0
        wait_restarted(h)
        assert h.load(tokens, 0, CACHED, dst) == CACHED
        # Age the restarts past the window.
        reader._recent_restarts = collections.deque(
            t - reader._restart_window_s for t in reader._recent_restarts
        )
    assert reader.disabled_reason is None
    assert h.counters()["backend_restarts"] == 5


def test_writer_killed_between_writes_restarts_on_the_next_write(
    make_cache: CacheFactory,
):
    h = make_cache()
    saved_sequence(h, "a")
    old = h.pid("write")
    kill_process(old)
    written = h.counters()["tokens_written"]
    # saved_sequence checks the delta: this write went on after the restart.
    tokens, _ = saved_sequence(h, "b")
    assert h.counters()["tokens_written"] - written == CACHED
    assert h.lookup(tokens) == (CACHED, CACHED)
    assert h.pid("write") != old
    counters = h.counters()
    assert counters["backend_restarts"] == 1
    assert counters["updates_failed"] == 0


def test_writer_dying_mid_write_fails_that_task_only(make_cache: CacheFactory):
    """A write in flight when the writer dies fails (counted); the tasks
    queued behind it are written by the restarted writer."""
    h = make_cache(max_inflight_tasks=4)
    cache = h.cache
    lost = make_tokens(SEQ_LEN)
    kept = [make_tokens(SEQ_LEN) for _ in range(2)]
    pid = h.pid("write")
    stop_process(pid)
    # Each save takes one buffer; the first one's write is stuck in the
    # stopped backend, the others queue behind it.
    assert cache.save([h.request("lost", lost, CACHED, h.blocks_for(0, SEQ_LEN))])
    for i, tokens in enumerate(kept):
        blocks = h.blocks_for(20 * (i + 1), SEQ_LEN)
        assert cache.save([h.request(f"kept{i}", tokens, CACHED, blocks)])
    assert cache.pool.num_in_flight == 3
    writer, updater = cache._writer, cache._updater
    assert writer is not None and updater is not None
    # The first task has been taken and sent: the updater waits for its
    # answer (the request is in flight), the other two are queued.
    assert wait_until(
        lambda: updater._queue.qsize() == 2 and writer._in_flight == "update"
    )
    os.kill(pid, signal.SIGKILL)
    h.wait()
    counters = h.counters()
    assert counters["updates_failed"] == 1
    assert counters["updates_completed"] == 2
    assert counters["backend_restarts"] == 1
    assert counters["tokens_written"] == 2 * CACHED
    assert cache.pool.num_in_flight == 0
    assert h.lookup(lost) == (0, 0)
    for tokens in kept:
        assert h.lookup(tokens) == (CACHED, CACHED)


def test_writes_run_at_lower_priority_than_reads(small_cache: CacheHarness):
    """The writer is background work; the reader serves the forward pass."""
    reader_nice = os.getpriority(os.PRIO_PROCESS, small_cache.pid("read"))
    writer_nice = os.getpriority(os.PRIO_PROCESS, small_cache.pid("write"))
    assert writer_nice == min(19, reader_nice + 10)


def test_backends_load_only_vineyards_kv_cache(small_cache: CacheHarness):
    """A backend starts in a fraction of a second: it imports vineyard's KV
    cache extension but neither the rest of vineyard (pandas, pyarrow), nor
    vLLM, nor torch. What a process imported shows in its mapped files
    (torch's OpenMP runtime may be mapped without torch: vLLM's CPU
    platform puts it in ``LD_PRELOAD`` once an engine config is made in
    this process, and the backends inherit the environment)."""
    h = small_cache
    saved_sequence(h)  # the backends have started and served
    for kind in ("read", "write"):
        with open(f"/proc/{h.pid(kind)}/maps") as f:
            mapped = f.read()
        assert "_llm_C" in mapped, kind
        for heavy in ("pyarrow", "pandas", "torch/_C", "libtorch", "vineyard/_C."):
            assert heavy not in mapped, (kind, heavy)


def _spec(tmp_path: Path, **fields: Any) -> BackendSpec:
    """A backend's spec for a namespace under ``tmp_path``: one-block
    chunks of small entries, no buffers unless ``fields`` say so."""
    fields = {"max_blocks": 0, "num_buffers": 0, **fields}
    namespace = str(tmp_path / "namespace")
    return BackendSpec(
        settings=default_settings(),
        namespace_dir=namespace,
        blocks_per_chunk=1,
        entry_bytes=256,
        **fields,
    )


def _starting_backends() -> list[psutil.Process]:
    return [
        child
        for child in psutil.Process().children(recursive=True)
        if child.cmdline()[1:3] == launch.command("backend")[1:]
    ]


def test_close_while_a_backend_starts_is_bounded(tmp_path: Path) -> None:
    """A backend that does not get ready (here: stopped before its first
    run; for real, hung on a dead filesystem) while another thread waits for
    it (a restart) holding the handle: close() kills it, process group and
    all, and returns within seconds, not after the startup timeout."""
    spec = _spec(tmp_path, max_blocks=4, num_buffers=1)
    shm = os.memfd_create("vineyard-test")
    os.ftruncate(shm, spec.buffer_bytes)
    before = {p.pid for p in _starting_backends()}
    backend = BackendProcess("write", spec, shm, 5.0, startup_timeout_s=60, wait=False)
    (proc,) = [p for p in _starting_backends() if p.pid not in before]
    proc.suspend()
    failed: list[BaseException] = []

    def restart() -> None:
        try:
            backend.wait_ready()
        except BackendError as e:
            failed.append(e)

    waiter = threading.Thread(target=restart)
    waiter.start()
    # It holds the handle, waiting for the backend.
    assert wait_until(backend._lock.locked, 10.0)
    start = time.monotonic()
    backend.close()
    assert time.monotonic() - start < CLOSE_WAIT_S + 2.0
    waiter.join(5.0)
    assert not waiter.is_alive() and failed
    assert wait_until(lambda: not psutil.pid_exists(proc.pid), 5.0)
    os.close(shm)


def test_a_slow_writer_that_progresses_is_not_restarted(
    make_cache: CacheFactory, tmp_path: Path
) -> None:
    """A writer that takes several timeouts for one write, on a root whose
    every ``stat`` and ``open`` takes 25 ms (vineyard makes some 30 such
    calls per chunk) and while it is stopped and
    continued in steps (starved of CPU), is waited for: it makes progress,
    so it is slow, not hung. (A stopped one makes none: see
    test_stalled_reader_times_out_and_is_replaced.)"""
    timeout_s = 2.0
    fs = mount_slow_fs(tmp_path / "fs", latency_ms=25.0)
    try:
        h = make_cache(root=fs.mount / "cache", backend_timeout_s=timeout_s)
        pid = h.pid("write")
        stepping = threading.Event()

        def starve() -> None:
            while not stepping.wait(0.3):  # runs 0.3 s of every 0.6 s
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.3)
                os.kill(pid, signal.SIGCONT)

        starver = threading.Thread(target=starve, daemon=True)
        start = time.perf_counter()
        starver.start()
        try:
            saved_sequence(h)  # asserts every whole chunk was written
        finally:
            stepping.set()
            starver.join()
            os.kill(pid, signal.SIGCONT)
        took_s = time.perf_counter() - start
        counters = h.counters()
        assert took_s > 1.5 * timeout_s, "not slow: the test would prove nothing"
        assert counters["backend_restarts"] == 0
        assert counters["updates_failed"] == 0
        assert h.pid("write") == pid
    finally:
        fs.close()


class CpuHogs:
    """Busy loops at the highest priority on ``core``, with the threads of
    process ``pid`` moved there: starved as beside busy engines. Several,
    so that the scheduler gives it no slice at all for seconds (one busy
    loop still lets it run about every 2 s)."""

    def __init__(self, pid: int, core: set[int], count: int = 4) -> None:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), core)

        def on_that_core_first() -> None:
            os.sched_setaffinity(0, core)
            os.nice(-20)

        self._hogs = [
            subprocess.Popen(
                [sys.executable, "-c", "while True: pass"],
                preexec_fn=on_that_core_first,
            )
            for _ in range(count)
        ]

    def wait_busy(self, cpu_s: float = 0.05, timeout_s: float = 30.0) -> None:
        """Until every busy loop has run ``cpu_s`` (an interpreter takes a
        while to start on a loaded machine)."""
        hogs = [psutil.Process(hog.pid) for hog in self._hogs]
        assert wait_until(
            lambda: all(sum(hog.cpu_times()[:2]) >= cpu_s for hog in hogs),
            timeout_s,
        )

    def stop(self) -> None:
        for hog in self._hogs:
            hog.kill()
            hog.wait()


def test_a_writer_starved_of_cpu_is_not_restarted(
    make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer whose core busy processes at the highest priority take for
    3 s (as busy engines can) is runnable, not hung: its write, three
    timeouts late and past the cap on a request's busy time (lowered here
    to two timeouts; waits for a CPU do not count), completes and it is not
    restarted. (It stays on the starved core: see
    test_a_starved_backend_may_run_on_every_core.)"""
    monkeypatch.setattr(progress, "MAX_BUSY_TIMEOUTS", 2)
    monkeypatch.setattr(progress, "STARVED_S", float("inf"))
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores: one to starve, one for the test")
    h = make_cache(backend_timeout_s=1.0)
    pid = h.pid("write")
    hogs = CpuHogs(pid, {cores[-1]})
    try:
        threading.Timer(3.0, hogs.stop).start()
        start = time.perf_counter()
        saved_sequence(h)  # asserts every whole chunk was written
        took_s = time.perf_counter() - start
    finally:
        hogs.stop()
    counters = h.counters()
    assert took_s > 2.0, "not starved: the test would prove nothing"
    assert counters["backend_restarts"] == 0
    assert counters["updates_failed"] == 0
    assert h.pid("write") == pid


def test_a_starved_backend_may_run_on_every_core(make_cache: CacheFactory) -> None:
    """A writer that waits for a CPU on the cores it was given (busy
    processes at the highest priority take them, as another instance's
    engine can) for ``STARVED_S`` is let run on every core: its write
    finishes long before the hogs stop. One that is not starved keeps
    off the caller's core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores: one to starve, one for the test")
    caller_core, busy = cores[0], {cores[-1]}
    os.sched_setaffinity(0, {caller_core})  # as vLLM's CPU worker binds itself
    try:
        h = make_cache(backend_timeout_s=20.0)
    finally:
        os.sched_setaffinity(0, set(cores))
    pid = h.pid("write")
    assert caller_core not in os.sched_getaffinity(pid)
    hogs = CpuHogs(pid, busy)  # until the write is done
    try:
        start = time.perf_counter()
        saved_sequence(h)  # asserts every whole chunk was written
        took_s = time.perf_counter() - start
        every_core = os.sched_getaffinity(pid)
    finally:
        hogs.stop()
    assert every_core > busy, every_core
    assert took_s < 15.0, took_s  # the hogs alone would starve it for good
    counters = h.counters()
    assert counters["backend_restarts"] == 0
    assert counters["updates_failed"] == 0


def test_a_backend_starts_off_the_callers_core(tmp_path: Path) -> None:
    """A backend is moved off the cores of the thread that spawns it (as
    vLLM's CPU worker binds itself) as it is spawned: its interpreter's
    start, before any code of its own runs, takes no CPU from the worker."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    namespaces = (str(tmp_path / "namespace"),)
    spec = _spec(tmp_path, role="lookup", lookup_namespace_dirs=namespaces)
    before = {p.pid for p in _starting_backends()}
    os.sched_setaffinity(0, {cores[0]})
    try:
        backend = BackendProcess("lookup", spec, None, 5.0, wait=False)
        (proc,) = [p for p in _starting_backends() if p.pid not in before]
        placed = os.sched_getaffinity(proc.pid)  # its interpreter just started
    finally:
        os.sched_setaffinity(0, set(cores))
    try:
        assert placed == set(cores) - {cores[0]}, placed
        backend.wait_ready()
        assert os.sched_getaffinity(proc.pid) == placed  # and it stays there
    finally:
        backend.close()


def test_a_wait_for_a_cpu_counts_while_it_lasts() -> None:
    """The kernel counts a wait for a CPU once it ends; a process still
    waiting is seen runnable without gaining CPU time, which counts up to
    the moment it is asked about (a load asks before it stops as slow)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores: one to starve, one for the test")
    busy = {cores[-1]}
    waiter = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    hogs = CpuHogs(waiter.pid, busy)
    try:
        hogs.wait_busy()
        os.setpriority(os.PRIO_PROCESS, waiter.pid, 19)
        watch = progress.ProgressWatch("test", None)
        watch.start(waiter.pid)
        time.sleep(0.5)
        assert watch.cpu_wait_s(waiter.pid) >= 0.3
    finally:
        hogs.stop()
        waiter.kill()
        waiter.wait()


def test_a_wait_for_a_cpu_is_sampled_at_most_every_few_milliseconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load waiting on a read asks every poll (an idle engine polls
    every few milliseconds): ``/proc`` is read again only once the last
    sample is :data:`progress.RESAMPLE_S` old."""
    samples = []
    real_sample = progress._sample

    def counted(*args: object, **kwargs: object) -> object:
        samples.append(time.monotonic())
        return real_sample(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(progress, "_sample", counted)
    watch = progress.ProgressWatch("test", None)
    watch.start(os.getpid())
    time.sleep(progress.RESAMPLE_S)
    for _ in range(50):
        watch.cpu_wait_s(os.getpid())
    assert len(samples) <= 3  # the start's, then one per RESAMPLE_S at most
    time.sleep(progress.RESAMPLE_S)
    watch.cpu_wait_s(os.getpid())
    assert len(samples) >= 3


def test_a_reader_that_waits_for_a_cpu_may_run_on_every_core(
    make_cache: CacheFactory,
) -> None:
    """A request waits for its load: a reader that waited for a CPU during
    one read, however short (busy processes at the highest priority take
    its cores, as another instance's engine can), runs on every core from
    then on. Until then it keeps off the caller's core, as the writer."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores: one to starve, one for the test")
    caller_core, busy = cores[0], {cores[-1]}
    os.sched_setaffinity(0, {caller_core})  # as vLLM's CPU worker binds itself
    try:
        h = make_cache()
    finally:
        os.sched_setaffinity(0, set(cores))
    tokens, _ = saved_sequence(h)
    dst = h.blocks_for(DST_BLOCK, SEQ_LEN)
    pid = h.pid("read")
    assert h.load(tokens, 0, CACHED, dst) == CACHED
    assert caller_core not in os.sched_getaffinity(pid)  # not starved yet
    hogs = CpuHogs(pid, busy)
    try:
        threading.Timer(0.5, hogs.stop).start()
        assert h.load(tokens, 0, CACHED, dst) == CACHED
        every_core = os.sched_getaffinity(pid)
    finally:
        hogs.stop()
    assert every_core == set(cores), every_core
    assert caller_core not in os.sched_getaffinity(h.pid("write"))
    assert h.counters()["load_errors"] == 0


def _resident_kib(pid: int, size: int) -> list[int]:
    """The resident KiB of each of ``pid``'s mappings of a staging memfd
    of ``size`` bytes."""
    size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE  # mapped in whole pages
    resident, current = [], False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header
                start, end = (int(x, 16) for x in fields[0].split("-"))
                current = "memfd:vineyard-cache" in line and end - start == size
            elif current and fields[0] == "Rss:":
                resident.append(int(fields[1]))
    return resident


@pytest.mark.parametrize(
    ("cpus", "bound_to", "accelerator", "readers"),
    [
        (2, {0, 1}, False, 1),  # a CPU worker on every core: one reader
        (2, {0}, False, 1),  # one core left: one reader
        (8, {0, 1, 2, 3}, False, 2),  # four cores left
        (2, {0, 1}, True, 2),  # a GPU worker's thread mostly waits
        (1, {0}, True, 1),
    ],
)
def test_two_readers_where_two_cores_are_free(
    monkeypatch: pytest.MonkeyPatch,
    cpus: int,
    bound_to: set[int],
    accelerator: bool,
    readers: int,
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: bound_to)
    assert cores.default_readers(accelerator) == readers


def test_the_reader_maps_its_buffers_before_the_first_load(make_cache: CacheFactory):
    """The engine backs the read buffers at startup, and the reader maps
    them at once too, so that no load faults in the reader's pages."""
    h = make_cache()
    memory = h.cache._read_buffers.memory
    size = memory.count * memory.buffer_bytes
    (resident,) = _resident_kib(h.pid("read"), size)
    assert resident * 1024 >= size, (resident, size)
