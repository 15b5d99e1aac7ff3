# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A reader that stops answering in the middle of a load: the forward
thread gives up on it without ever waiting for it to exit, and the read
buffer it was given is not used again until it has.

A reader killed while it waits in the filesystem (uninterruptible sleep, a
hung network root) does not die until the filesystem answers, and then its
read still lands in the buffer it was given. These tests hold a real reader
in that state: it is stopped (SIGSTOP) so it does not answer, and the
product's SIGKILL of it lands only when the test says (:class:`DeferredKills`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vineyard_testing import wait_until
from tests.worker.vineyard_cache_testing import (
    CHUNK_SIZE,
    CacheFactory,
    CacheHarness,
    make_tokens,
    pid_exists,
    same_bits,
    stop_process,
)
from vllm.worker.vineyard.backend.protocol import QueryRequest

pytestmark = pytest.mark.timeout(180)

CACHED = 4 * CHUNK_SIZE
DST_BLOCK = 60
#: A call on the forward thread that gives up on a reader returns within
#: this (the wait it must not make: a killed process's exit, 2 s).
FORWARD_CALL_S = 0.2


class DeferredKills:
    """SIGKILLs of chosen pids, by the product, land only when the test
    says: a process in uninterruptible sleep dies only once its call
    returns."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self._pids: set[int] = set()
        real_send_signal = subprocess.Popen.send_signal
        real_killpg = os.killpg

        def send_signal(proc: subprocess.Popen[Any], sig: int) -> None:
            if sig != signal.SIGKILL or proc.pid not in self._pids:
                real_send_signal(proc, sig)

        def killpg(pgid: int, sig: int) -> None:
            if sig != signal.SIGKILL or pgid not in self._pids:
                real_killpg(pgid, sig)

        monkeypatch.setattr(subprocess.Popen, "send_signal", send_signal)
        monkeypatch.setattr(os, "killpg", killpg)

    def defer(self, pid: int) -> None:
        self._pids.add(pid)

    def land(self, pid: int) -> None:
        """The filesystem answers: the kill lands."""
        self._pids.discard(pid)
        os.kill(pid, signal.SIGKILL)

    def land_all(self) -> None:
        for pid in list(self._pids):
            self.land(pid)


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> Iterator[DeferredKills]:
    deferred = DeferredKills(monkeypatch)
    yield deferred
    deferred.land_all()


class SentBuffers:
    """The read buffer of every read the cache sends (or tries to: the
    reader may be restarting), in order."""

    def __init__(self, h: CacheHarness, monkeypatch: pytest.MonkeyPatch):
        self.buffers: list[int] = []
        calls = h.cache._calls
        real_send = calls.send

        def send(backend: Any, request: Any) -> Any:
            if isinstance(request, QueryRequest):
                self.buffers.append(request.buffer_id)
            return real_send(backend, request)

        monkeypatch.setattr(calls, "send", send)


def saved(h: CacheHarness) -> tuple[list[int], list[int]]:
    """Tokens of four cached chunks (and one more token), and their KV
    blocks."""
    tokens = make_tokens(CACHED + 1)
    src = h.save_tokens(tokens, 0)
    assert h.lookup(tokens) == (CACHED, CACHED)
    return tokens, src


def give_up_on_the_reader(
    h: CacheHarness, kills: DeferredKills, tokens: list[int], req_id: str
) -> tuple[int, float]:
    """Stop the reader (its kill deferred) and run a load on it the way the
    worker does (a poll per step) until the load is given up on; returns
    the stopped pid and the longest poll."""
    pid = h.pid("read")
    kills.defer(pid)
    stop_process(pid)
    dst = h.blocks_for(DST_BLOCK, CACHED)
    before = h.kv.clone()
    loads = h.cache.loads
    loads.start(req_id, h.digests(tokens), 0, CACHED, dst)
    longest = 0.0
    finished: list[tuple[str, int, int]] = []
    deadline = time.monotonic() + 60.0
    while not finished and time.monotonic() < deadline:
        start = time.perf_counter()
        loads.poll()
        longest = max(longest, time.perf_counter() - start)
        finished = loads.take_finished()
        time.sleep(0.005)  # the next step
    # Short: nothing loaded, nothing written into the blocks.
    assert finished == [(req_id, 0, CACHED)]
    assert same_bits(h.kv, before)
    # Killed, but not gone.
    assert pid_exists(pid)
    return pid, longest


def restart_reader(h: CacheHarness, tokens: list[int]) -> None:
    """A load starts the reader's restart (and comes up short); wait for
    the restart."""
    dst = h.blocks_for(DST_BLOCK, CACHED)
    assert h.load(tokens, 0, CACHED, dst) == 0
    reader = h.cache._readers[0]
    restarter = reader._restarter
    assert restarter is not None, "no restart was started"
    restarter.join(60)
    assert not restarter.is_alive()
    assert reader.available


def load_all(h: CacheHarness, tokens: list[int], src: list[int]) -> None:
    dst = h.blocks_for(DST_BLOCK, CACHED)
    assert h.load(tokens, 0, CACHED, dst) == CACHED
    n = CACHED // h.block_size
    assert same_bits(h.kv[:, dst[:n]], h.kv[:, src[:n]])


def test_giving_up_on_a_stuck_reader_never_waits_on_the_forward_thread(
    make_cache: CacheFactory, kills: DeferredKills
) -> None:
    """The reader stops answering and does not die when killed: the poll
    that gives up on it returns at once (the kill is sent, the process is
    reaped on a thread of its own once it exits), the load is short and
    counted; once the process is gone, the reader restarts and loads hit."""
    h = make_cache(backend_timeout_s=0.5, readers=1)
    tokens, src = saved(h)
    pid, longest = give_up_on_the_reader(h, kills, tokens, "stuck")
    assert longest < FORWARD_CALL_S, f"a poll took {longest:.2f} s"
    assert h.counters()["load_errors"] == 1
    kills.land(pid)
    # Reaped without any call on the forward thread.
    assert wait_until(lambda: not pid_exists(pid), 10.0)
    restart_reader(h, tokens)
    load_all(h, tokens, src)
    assert h.pid("read") != pid


def test_a_given_up_readers_buffer_waits_until_it_is_gone(
    make_cache: CacheFactory, kills: DeferredKills, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read buffer a killed reader was given is not handed out again
    while that process lives (it may still write into it); loads go on in
    the other buffer, and the held one is used again once it is gone."""
    h = make_cache(backend_timeout_s=0.5, readers=1, read_ahead_buffers=0)
    assert h.cache._read_buffers.memory.count == 2
    tokens, src = saved(h)
    sent = SentBuffers(h, monkeypatch)
    pid, _ = give_up_on_the_reader(h, kills, tokens, "stuck")
    held = sent.buffers[-1]
    restart_reader(h, tokens)
    given_up = len(sent.buffers)
    for _ in range(3):  # four segments each
        load_all(h, tokens, src)
    assert pid_exists(pid), "the killed reader must still be there"
    after = sent.buffers[given_up:]
    assert len(after) >= 12 and held not in after, (held, after)

    kills.land(pid)
    assert wait_until(lambda: not pid_exists(pid), 10.0)
    reused = len(sent.buffers)
    load_all(h, tokens, src)
    assert held in sent.buffers[reused:], (held, sent.buffers[reused:])


def test_loads_with_every_buffer_held_are_recomputed(
    make_cache: CacheFactory, kills: DeferredKills, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read buffer is held by a reader killed but not gone: a load
    is reported short at once (recomputed) without a read, not left pending
    until one exits; loads hit again once they are gone."""
    h = make_cache(backend_timeout_s=0.5, readers=1, read_ahead_buffers=0)
    assert h.cache._read_buffers.memory.count == 2
    tokens, src = saved(h)
    first, _ = give_up_on_the_reader(h, kills, tokens, "stuck-1")
    restart_reader(h, tokens)
    second, _ = give_up_on_the_reader(h, kills, tokens, "stuck-2")
    errors = h.counters()["load_errors"]

    loads = h.cache.loads
    dst = h.blocks_for(DST_BLOCK, CACHED)
    before = h.kv.clone()
    sent = SentBuffers(h, monkeypatch)
    start = time.perf_counter()
    loads.start("no-buffer", h.digests(tokens), 0, CACHED, dst)
    loads.poll()
    assert time.perf_counter() - start < FORWARD_CALL_S
    assert loads.take_finished() == [("no-buffer", 0, CACHED)]
    assert sent.buffers == []  # no buffer was handed out
    assert same_bits(h.kv, before)
    assert h.counters()["load_errors"] == errors + 1

    for pid in (first, second):
        kills.land(pid)
    assert wait_until(lambda: not (pid_exists(first) or pid_exists(second)), 10.0)
    restart_reader(h, tokens)
    load_all(h, tokens, src)
