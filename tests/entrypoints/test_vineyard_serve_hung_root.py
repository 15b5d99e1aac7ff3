# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` stops when asked while its cache root hangs.

The root is a real FUSE filesystem (``benchmarks/vineyard/slow_fs.py``) that
stops answering after a first chat has been saved. More chats arrive: their
lookups hang in it (and are given up), their writes hang (the writer times
out, is killed and restarts into the hung root, where its start hangs too).
Then a user's Ctrl-C (SIGINT): the server must exit within the drain
timeout plus a few seconds, the root still frozen, instead of waiting for
the filesystem (before, it was still running 120 s later: each backend's
close waited for its restart's startup timeout).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from tests.script_testing import ROOT, mount_slow_fs
from tests.vineyard_serve_testing import (
    QUESTIONS,
    STARTUP_TIMEOUT_S,
    Server,
    prepare_model,
    stacks_of_session,
)
from tests.vineyard_testing import engine_cpu

sys.path.insert(0, str(ROOT / "benchmarks" / "vineyard"))
from slow_fs import SlowFs  # noqa: E402

pytestmark = pytest.mark.engine

DRAIN_TIMEOUT_S = 5.0
BACKEND_TIMEOUT_S = 3.0
#: vLLM's own shutdown of the API server and engine, beyond the cache's.
SHUTDOWN_SLACK_S = 10.0


@pytest.fixture
def slow_fs(tmp_path: Path) -> Iterator[SlowFs]:
    fs = mount_slow_fs(tmp_path / "fs")
    yield fs
    fs.freeze(False)
    fs.close()


@pytest.mark.timeout(900)
def test_sigint_with_a_hung_root_exits_within_the_drain_timeout(
    slow_fs: SlowFs, tmp_path: Path
) -> None:
    server = Server(
        "hung-root",
        prepare_model(),
        tmp_path,
        slow_fs.mount / "root",
        engine_cpu(),
        extra_env={
            "VINEYARD_CACHE_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S),
            "VINEYARD_CACHE_BACKEND_TIMEOUT_S": str(BACKEND_TIMEOUT_S),
            "VINEYARD_CACHE_LOOKUP_TIMEOUT_S": "1",
        },
    )
    try:
        server.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
        server.ask(QUESTIONS[0])
        assert server.settle(), "the first chat was not saved"
        slow_fs.freeze(True)

        # More chats: lookups, writes and then a writer restart hang in the
        # root (the answers themselves are not waited for).
        def ask(question: str) -> None:
            with suppress(OSError):  # cut off by the shutdown
                server.ask(question)

        for question in QUESTIONS[1:4]:
            threading.Thread(target=ask, args=(question,), daemon=True).start()
        time.sleep(3 * BACKEND_TIMEOUT_S + 5)
        assert server.proc.poll() is None, "the server died on the hung root"
        start = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        bound = DRAIN_TIMEOUT_S + SHUTDOWN_SLACK_S
        deadline = start + bound
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        took = time.monotonic() - start
        assert server.proc.poll() is not None, (
            f"vllm serve still running {took:.0f} s after SIGINT; its "
            f"processes:\n{stacks_of_session(server.proc.pid)}\nlog tail:\n"
            + server.log()[-4000:]
        )
    finally:
        slow_fs.freeze(False)
        server.stop()
