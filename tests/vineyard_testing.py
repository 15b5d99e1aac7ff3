# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Generic helpers shared by every vineyard cache test directory (the cache,
connector and engine tests): the cores engines compute on, polling with a
deadline, waiting for a cache's background writes, and letting stopped
backend processes go.

Tests import it as a package module
(``from tests.vineyard_testing import wait_until``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.worker.vineyard_llm_cache import VineyardLLMCache


def engine_cpu() -> int:
    """The core that this test process's engines compute on
    (``VLLM_CPU_OMP_THREADS_BIND``): one per pytest-xdist worker, so that
    engines of tests running side by side do not share a core."""
    cpus = sorted(os.sched_getaffinity(0))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return cpus[int(worker.removeprefix("gw")) % len(cpus)]


def other_cpu() -> int:
    """A core for an engine that runs beside one on :func:`engine_cpu` (the
    same core on a one-core machine)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[(cpus.index(engine_cpu()) + 1) % len(cpus)]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; whether it
    held. Tests assert the result, so a condition that never comes fails
    the test instead of hanging it."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def wait_for_writes(cache: VineyardLLMCache, timeout_s: float = 30.0) -> None:
    """Wait until ``cache`` has no update in flight (every staging buffer is
    back): its background writes are done, written or failed."""
    assert wait_until(
        lambda: cache._pool.num_free == cache._pool.max_buffers, timeout_s
    ), "background writes did not finish"


def resume_processes(pids: Iterable[int | None]) -> None:
    """SIGCONT every pid (``None`` and gone ones skipped): a backend that a
    test stopped with SIGSTOP must run again before its cache can close."""
    for pid in pids:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


#: The vocabulary of the toy models and fake engines (ids 0-2 left out).
VOCAB_SIZE = 32000


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` random token ids drawn from ``rng``."""
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]
