# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Generic helpers shared by every vineyard cache test directory (the cache,
connector and engine tests): polling with a deadline, waiting for a cache's
background writes, and letting stopped backend processes go.

``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so this module
imports by name (``from vineyard_testing import wait_until``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.worker.vineyard_llm_cache import VineyardLLMCache


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
    assert wait_until(lambda: cache.pool.num_in_flight == 0, timeout_s), (
        "background writes did not finish"
    )


def resume_processes(pids: Iterable[int | None]) -> None:
    """SIGCONT every pid (``None`` and gone ones skipped): a backend that a
    test stopped with SIGSTOP must run again before its cache can close."""
    for pid in pids:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def server_counter(url: str, name: str) -> float:
    """A ``vllm:vineyard_cache_*`` counter as a server's /metrics shows it
    (summed over its label sets)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"vllm:vineyard_cache_{name}_total{{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
