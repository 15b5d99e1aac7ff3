# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm serve`` on the main job's real model (SmolLM2-135M-Instruct) for
the tests: start, wait for /health, chat about a shared document, read
``/metrics``, stop with SIGINT as a user would."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.script_testing import ROOT, clean_env, load_script

EXAMPLES = ROOT / "examples" / "offline_inference"
# Three servers start at once: on a loaded two-core machine that can take
# minutes (about a minute when it is otherwise idle).
STARTUP_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 120
#: Longest orderly exit after SIGINT (the cache's drain timeout is 5 s).
EXIT_BOUND_S = 60
#: Longest wait for background writes to be reported.
SETTLE_S = 60
#: Tokens of the shared document a chat must at least look up, save and
#: then load (the document is ~680 tokens; the chunk is the default block).
DOCUMENT_TOKENS = 512
QUESTIONS = [
    "How many items can a member borrow at the same time?",
    "How long can a DVD be borrowed?",
]


def system_document() -> str:
    """Sections 1-3 of the example's handbook, ~680 tokens."""
    text = (EXAMPLES / "vineyard_shared_document.md").read_text()
    return text[: text.index("## 4.")]


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


def free_port() -> int:
    """A free local port below the kernel's ephemeral range: a client that
    keeps connecting to a port while its server starts (a ZMQ subscriber,
    a /health poll) can otherwise get that port as its own source port and
    connect to itself (TCP simultaneous open), never reaching the server."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.SystemRandom().sample(range(10000, max(low, 10001)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``vllm serve``, started now; ``wait_ready()`` waits for /health."""

    def __init__(
        self,
        name: str,
        model: str,
        tmp_path: Path,
        cache_root: Path | None,
        cpu: int,
        *,
        prefix_caching: bool = False,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ):
        self.name = name
        self.log_path = tmp_path / f"{name}.log"
        env = clean_env()
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=str(cpu),
        )
        if cache_root is not None:
            # Every hit loaded: the tests count them (see vineyard_engine_testing).
            env.update(
                VLLM_USE_VINEYARD_CACHE="1",
                VINEYARD_CACHE_ROOT=str(cache_root),
                VINEYARD_CACHE_LOAD_POLICY="always",
            )
        env.update(extra_env or {})
        vllm_cli = str(Path(sys.executable).parent / "vllm")
        cmd = [vllm_cli, "serve", model, "--served-model-name", "smollm2"]
        cmd += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
        if not prefix_caching:
            cmd += ["--no-enable-prefix-caching"]
        self._cmd, self._env = [*cmd, "--host", "127.0.0.1", *extra_args], env
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.hang_report = ""  # where its processes were when it did not exit
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A session of its own: stop() can end the engine processes too.
        self.proc = subprocess.Popen(
            [*self._cmd, "--port", str(self.port)],
            env=self._env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, deadline: float) -> None:
        starts = 1
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log_path.read_text()[-6000:]
                if "Address already in use" in log and starts < 3:
                    # A port vLLM found free was taken before it bound it
                    # (another test's server starting beside this one).
                    self._log.write(f"--- restarted ({starts}): a port was taken\n")
                    self._log.flush()
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)  # its engine
                    starts += 1
                    self._start()
                    continue
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
                {"role": "system", "content": system_document()},
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
            self.complete_one_token()
            time.sleep(0.2)
        return False

    def complete_one_token(self) -> None:
        body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 1}
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S):
            pass

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> bool:
        """SIGINT, as a user's Ctrl-C; whether the server exited by itself
        within :data:`EXIT_BOUND_S` (else it is killed)."""
        exited = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # drains the cache's writes
            try:
                self.proc.wait(timeout=EXIT_BOUND_S)
            except subprocess.TimeoutExpired:
                exited = False
                self.hang_report = stacks_of_session(self.proc.pid)
        # Whatever is left of this server (an engine process orphaned by a
        # failed startup, a cache backend).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        return exited


def stacks_of_session(sid: int) -> str:
    """Where every process of session ``sid`` is: Python stacks by py-spy
    (a dev dependency; without pausing it, so a process blocked in the
    kernel does not block the dump), else each thread's kernel wait
    channel."""
    pids = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if entry.name.isdigit() and os.getsid(int(entry.name)) == sid:
                pids.append(int(entry.name))
    py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    report = []
    for pid in sorted(pids):
        with contextlib.suppress(OSError):  # it exited meanwhile
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            report.append(f"--- pid {pid}: {cmdline.decode(errors='replace')[:200]}")
        if py_spy is not None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                dump = subprocess.run(
                    [py_spy, "dump", "--nonblocking", "--pid", str(pid)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                if dump.returncode == 0:  # a Python process
                    report.append(dump.stdout)
                    continue
        for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
            with contextlib.suppress(OSError):
                comm = (task / "comm").read_text().strip()
                report.append(f"  {task.name} {comm}: {(task / 'wchan').read_text()}")
    return "\n".join(report)


def prepare_model() -> str:
    """The main job's model as a local checkpoint (built once)."""
    module = load_script(EXAMPLES / "vineyard_real_model.py", "vineyard_real_model")
    return module.prepare_model()
