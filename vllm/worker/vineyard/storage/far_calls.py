# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Filesystem calls made at once where the root is a round trip away
(:func:`calls_at_once_when_far`): a lookup's ``stat``, a load's ``lstat``
and ``utime`` of each chunk file would otherwise cost a round trip each, one
after another.

Imports neither vLLM nor torch (the backend processes run it).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: A call slower than this went to a server (a local ``stat`` takes
#: microseconds, a client's attribute cache answers as fast): the next calls
#: go out at once.
FAR_CALL_S = 0.0002
#: At most this many calls in flight at once; a caller that stops early has
#: had at most this many less one made in vain.
CALLS_AT_ONCE = 16


def calls_at_once_when_far(fn: Callable[[T], R], items: Sequence[T]) -> Iterator[R]:
    """``fn(item)`` for each of ``items``, in order and lazily: one at a
    time while each returns quickly; once one takes a round trip
    (:data:`FAR_CALL_S`), the next ones :data:`CALLS_AT_ONCE` at a time,
    each wave made when the caller asks past the one before. An exception
    of ``fn`` is raised where its result would be yielded."""
    far = False
    i = 0
    while i < len(items):
        if far:
            wave = items[i : i + CALLS_AT_ONCE]
            i += len(wave)
            yield from _threads().map(fn, wave)
        else:
            start = time.perf_counter()
            result = fn(items[i])
            far = time.perf_counter() - start > FAR_CALL_S
            i += 1
            yield result


class _Threads:
    """Daemon threads that make calls at once (one stuck on a hung root
    keeps no process from exiting)."""

    def __init__(self, count: int):
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        for _ in range(count):
            threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self._tasks.get()()  # never raises: see map

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> Iterator[R]:
        """Starts ``fn(item)`` for every item at once and, once all have
        returned, yields their results in order."""
        results: dict[int, R] = {}
        errors: dict[int, Exception] = {}
        left = threading.Semaphore(0)

        def task(i: int, item: T) -> Callable[[], None]:
            def run() -> None:
                try:
                    results[i] = fn(item)
                except Exception as e:
                    errors[i] = e
                finally:
                    left.release()

            return run

        for i, item in enumerate(items):
            self._tasks.put(task(i, item))
        for _ in items:
            left.acquire()
        for i in range(len(items)):
            if i in errors:
                raise errors[i]
            yield results[i]


_threads_made: _Threads | None = None
_threads_lock = threading.Lock()


def _threads() -> _Threads:
    global _threads_made
    with _threads_lock:
        if _threads_made is None:
            _threads_made = _Threads(CALLS_AT_ONCE)
        return _threads_made


def _forget_threads() -> None:
    global _threads_made, _threads_lock
    # A forked child has none of its parent's threads: it makes its own.
    _threads_made, _threads_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_threads)
