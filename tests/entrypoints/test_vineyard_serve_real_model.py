# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` on a real model (SmolLM2-135M-Instruct) with
``VLLM_USE_VINEYARD_CACHE=1``, on loopback, through the OpenAI chat API:
chats that share a long system document get the document's KV from a cache
that another server filled, answer with the same text as a server without
the cache, and the hit shows on ``/metrics``.

The three servers start side by side (their startup is most of the time);
the second one is asked only after the first has stopped and so has written
everything it computed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from script_testing import ROOT, clean_env, load_script
from vineyard_testing import server_counter

pytestmark = pytest.mark.engine

EXAMPLES = ROOT / "examples" / "offline_inference"
# Three servers start at once: on a loaded two-core machine that can take
# minutes (about a minute when it is otherwise idle).
STARTUP_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 120
CHUNK_SIZE = 256
QUESTIONS = [
    "How many items can a member borrow at the same time?",
    "How long can a DVD be borrowed?",
]


def _system_document() -> str:
    """Sections 1-3 of the example's handbook, ~680 tokens."""
    text = (EXAMPLES / "vineyard_shared_document.md").read_text()
    return text[: text.index("## 4.")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``vllm serve``, started now; ``wait_ready()`` waits for /health."""

    def __init__(
        self, name: str, model: str, tmp_path: Path, cache_root: Path | None, cpu: int
    ):
        self.name = name
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"{name}.log"
        env = clean_env()
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=str(cpu),
            VINEYARD_CACHE_CHUNK_SIZE=str(CHUNK_SIZE),
        )
        if cache_root is not None:
            env.update(VLLM_USE_VINEYARD_CACHE="1", VINEYARD_CACHE_ROOT=str(cache_root))
        vllm_cli = str(Path(sys.executable).parent / "vllm")
        cmd = [vllm_cli, "serve", model, "--served-model-name", "smollm2"]
        cmd += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        # A session of its own: stop() can end the engine processes too.
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log_path.read_text()[-6000:]
                raise AssertionError(f"{self.name} exited during startup:\n{log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"{self.name} not healthy after {STARTUP_TIMEOUT_S} s")

    def ask(self, question: str) -> str:
        """One user's chat completion: the shared document, then a
        question."""
        body = {
            "model": "smollm2",
            "messages": [
                {"role": "system", "content": _system_document()},
                {
                    "role": "user",
                    "content": f"According to the handbook: {question} "
                    "Answer in one sentence.",
                },
            ],
            "max_tokens": 24,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as r:
            return json.load(r)["choices"][0]["message"]["content"]

    def metric(self, name: str) -> float:
        return server_counter(self.url, name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # drains the cache's writes
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        # Whatever is left of this server (an engine process orphaned by a
        # failed startup, a cache backend).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[dict[str, Server]]:
    module = load_script(EXAMPLES / "vineyard_real_model.py", "vineyard_real_model")
    model = module.prepare_model()
    root = tmp_path / "cache"
    cpus = sorted(os.sched_getaffinity(0))
    other = cpus[1] if len(cpus) > 1 else cpus[0]
    started = {
        "first": Server("first", model, tmp_path, root, cpus[0]),
        "second": Server("second", model, tmp_path, root, other),
        "no-cache": Server("no-cache", model, tmp_path, None, other),
    }
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for server in started.values():
            server.wait_ready(deadline)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.mark.timeout(720)
def test_serve_real_model_hits_another_servers_cache(
    servers: dict[str, Server],
) -> None:
    first, second = servers["first"], servers["second"]
    reference = [servers["no-cache"].ask(q) for q in QUESTIONS]
    assert all(len(answer.split()) >= 3 for answer in reference), reference

    # The first server computes the document, answers and saves it; on
    # shutdown it finishes its writes.
    assert first.ask(QUESTIONS[0]) == reference[0]
    assert first.metric("query_tokens") >= 2 * CHUNK_SIZE
    assert first.metric("hit_tokens") == 0
    first.stop()
    assert first.proc.returncode is not None

    # The second server (same cache root) loads the document for a new
    # question and answers as the server without the cache does.
    assert second.metric("hit_tokens") == 0
    assert second.ask(QUESTIONS[1]) == reference[1]
    assert second.metric("hit_tokens") >= 2 * CHUNK_SIZE
    assert second.metric("loaded_tokens") >= 2 * CHUNK_SIZE
    assert second.metric("load_errors") == 0
    # Another user, the first question: vLLM's own prefix cache now.
    assert second.ask(QUESTIONS[0]) == reference[0]
