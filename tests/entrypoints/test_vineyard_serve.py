# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm serve` with VLLM_USE_VINEYARD_CACHE=1 and nothing else: a real
server on loopback serves cache hits across a restart, with the outputs of
a server without the cache, reports them on /metrics, and exits in order on
SIGINT (the drain of its background writes included)."""

import json
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from script_testing import clean_env
from vineyard_testing import server_counter
from vineyard_toy_model import make_toy_llama

pytestmark = pytest.mark.engine

STARTUP_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 120
#: Longest orderly exit after SIGINT (the cache's drain timeout is 5 s).
EXIT_BOUND_S = 60
#: Longest wait for background writes to be reported.
SETTLE_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, cache_root: Path | None, log: Path):
        self.model = model
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **clean_env(),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0",
        }
        if cache_root is not None:  # else no cache at all
            env["VLLM_USE_VINEYARD_CACHE"] = "1"
            env["VINEYARD_CACHE_ROOT"] = str(cache_root)
            env["VINEYARD_CACHE_CHUNK_SIZE"] = "256"
        vllm_cli = str(Path(sys.executable).parent / "vllm")
        cmd = [vllm_cli, "serve", model, "--skip-tokenizer-init", "--enforce-eager"]
        # float32: in bf16 a prefill split at another token (cached prefix
        # vs one pass) rounds differently, as with vLLM's own prefix cache.
        cmd += ["--dtype", "float32", "--max-model-len", "4096", "--block-size", "64"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "vllm serve exited during startup"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s")

    def complete(self, prompt: list[int], max_tokens: int = 12) -> list[int]:
        body = json.dumps(
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
        ).encode()
        request = urllib.request.Request(
            f"{self.url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as r:
            return json.load(r)["choices"][0]["token_ids"]

    def metric(self, name: str) -> float:
        return server_counter(self.url, name)

    def settle(self) -> bool:
        """Wait until every update handed to the background writer is
        reported done (completed, failed or dropped). Workers report their
        counters with an engine step, so a one-token request steps it."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            done = sum(
                self.metric(f"updates_{outcome}")
                for outcome in ("completed", "failed", "dropped")
            )
            if done >= self.metric("updates_submitted"):
                return True
            self.complete([7], max_tokens=1)  # shorter than a chunk
            time.sleep(0.2)
        return False

    def stop(self) -> bool:
        """SIGINT, as a user's Ctrl-C; whether the server exited by itself
        within :data:`EXIT_BOUND_S` (else it is killed)."""
        exited = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=EXIT_BOUND_S)
            except subprocess.TimeoutExpired:
                exited = False
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return exited


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple]:
    model = make_toy_llama(str(tmp_path / "model"))
    servers: list[Server] = []

    def start(use_cache: bool = True) -> Server:
        log = tmp_path / f"serve{len(servers)}.log"
        server = Server(model, tmp_path / "cache" if use_cache else None, log)
        servers.append(server)
        server.wait_ready()
        return server

    yield start, tmp_path
    for server in servers:
        server.stop()


def test_serve_hits_across_restart(serve) -> None:
    start, tmp_path = serve
    rng = random.Random(7)
    document = [rng.randrange(3, 32000) for _ in range(1200)]
    questions = [[rng.randrange(3, 32000) for _ in range(40)] for _ in range(2)]

    plain = start(use_cache=False)
    expected = [plain.complete(document + q) for q in questions]
    assert plain.stop()

    first = start()
    assert [first.complete(document + q) for q in questions] == expected
    assert first.settle(), "background writes were not reported in time"
    assert first.metric("updates_submitted") >= 1
    assert first.metric("updates_failed") == 0
    assert first.metric("tokens_written") >= 1024
    # An orderly exit: SIGINT, the drain, and out within the bound.
    assert first.stop(), f"vllm serve did not exit within {EXIT_BOUND_S} s"
    assert first.proc.returncode == 0, first.proc.returncode

    second = start()
    # The document's chunks come from vineyard, not vLLM's (empty) local cache.
    assert [second.complete(document + q) for q in questions] == expected
    assert second.metric("hit_tokens") >= 1024
    assert second.metric("loaded_tokens") >= 1024
    assert second.metric("load_errors") == 0
    log = (tmp_path / "serve2.log").read_text()
    assert "vineyard cache on at" in log
    assert "vineyard cache on at" not in (tmp_path / "serve0.log").read_text()
