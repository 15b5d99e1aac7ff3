# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the serving benchmarks share (``benchmark_serve.py`` and
``serve_chats.py``): ``vllm serve`` on the main example's model as a
:class:`Server`, its Prometheus counters, the servers' environments with
and without the cache (:func:`setup`), and the run's folder and result
file. Neither script imports the other: both import this module.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.script_testing import clean_env, load_script  # noqa: E402
from tests.vineyard_serve_testing import free_port  # noqa: E402

#: Longest a server is given to exit after SIGINT before it is killed.
EXIT_BOUND_S = 60.0
#: vLLM's own KV cache (GiB): less than the prefixes the scenarios send.
KVCACHE_SPACE_GIB = 1
#: The cache's backend and lookup timeouts (s).
BACKEND_TIMEOUT_S = 5.0
LOOKUP_TIMEOUT_S = 2.0


def counter(url: str, name: str) -> float:
    """A Prometheus counter of the server, summed over its label sets."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{")
    )


def histogram_means(urls: list[str], names: Sequence[str]) -> dict[str, float]:
    """Per Prometheus histogram of ``names``, the mean of every observation
    the servers made (its ``_sum`` over its ``_count``); left out where
    none was made."""
    means = {}
    for name in names:
        count = sum(counter(url, f"{name}_count") for url in urls)
        if count:
            means[name] = sum(counter(url, f"{name}_sum") for url in urls) / count
    return means


class Server:
    def __init__(
        self, name: str, model: str, work: Path, env_extra: dict[str, str],
        args: list[str],
    ):  # fmt: skip
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / f"{name}.log"
        env = clean_env()
        env.update(HF_HUB_OFFLINE="1", **env_extra)
        # glibc's malloc thresholds fixed, as the operations page advises on
        # a CPU: left dynamic, a server's allocation history moves each of
        # its prefills by up to 1.8x, and with it every ratio here.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 << 20))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
        cmd = [str(Path(sys.executable).parent / "vllm"), "serve", model]
        cmd += ["--served-model-name", "smollm2", "--dtype", "float32"]
        cmd += ["--enforce-eager", "--max-model-len", "2048"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited:\n{self.log_path.read_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"{self.name} not healthy in {timeout_s} s")

    def stop(self) -> float:
        """SIGINT; the seconds until it exited (inf: killed after the
        bound)."""
        start = time.monotonic()
        took = float("inf")
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=EXIT_BOUND_S)
                took = time.monotonic() - start
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()
        return took


def setup(
    kvcache_space_gib: int = KVCACHE_SPACE_GIB,
    backend_timeout_s: float = BACKEND_TIMEOUT_S,
    lookup_timeout_s: float = LOOKUP_TIMEOUT_S,
) -> tuple[str, dict[str, str], Callable[[Path], dict[str, str]]]:
    """The model, the servers' environment without the cache, and with the
    cache on a root."""
    module = load_script(
        ROOT / "examples" / "offline_inference" / "vineyard_real_model.py",
        "vineyard_real_model",
    )
    model = module.prepare_model()
    base_env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "0",
    }

    def cache_env(root: Path) -> dict[str, str]:
        return {
            **base_env,
            "VLLM_USE_VINEYARD_CACHE": "1",
            "VINEYARD_CACHE_ROOT": str(root),
            "VINEYARD_CACHE_BACKEND_TIMEOUT_S": str(backend_timeout_s),
            "VINEYARD_CACHE_LOOKUP_TIMEOUT_S": str(lookup_timeout_s),
        }

    return model, base_env, cache_env


#: The nice value of a filesystem's daemons that must share the instances'
#: cores: a kernel client's work runs in the callers' system calls and in
#: kernel threads, ahead of user processes; a daemon at the instances' own
#: priority waits behind their busy loops, a delay no kernel client adds.
DAEMON_NICE = -10


def favour(pids: list[int]) -> int | None:
    """Give every thread of these processes :data:`DAEMON_NICE` (threads
    they start later inherit it): the nice value set, or ``None`` where
    this process may not raise a priority (not root)."""
    done = False
    for pid in pids:
        with contextlib.suppress(OSError):  # threads come and go
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    os.setpriority(os.PRIO_PROCESS, int(tid), DAEMON_NICE)
                    done = True
                except PermissionError:
                    return None
                except OSError:
                    pass
    return DAEMON_NICE if done else None


def pin_off(pids: list[int], busy: set[int]) -> list[int] | None:
    """Move every thread of these processes to the cores this process may
    use that are not in ``busy`` (e.g. a FUSE daemon off the cores the
    instances bind): the cores they now run on, or ``None`` where no core is
    free (they are left as they are)."""
    free = os.sched_getaffinity(0) - busy
    if not free:
        return None
    for pid in pids:
        with contextlib.suppress(OSError):  # threads come and go
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), free)
    return sorted(free)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``--quick``, ``--json`` and ``--workdir``, as every scenario takes
    them."""
    parser.add_argument("--quick", action="store_true", help="a short run (CI)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument(
        "--workdir", help="keep logs, roots and results here (default: a temp dir)"
    )


@contextlib.contextmanager
def run_folder(workdir: str | None) -> Iterator[Path]:
    """The run's folder (logs, roots): under ``workdir`` it is kept for a
    look, else a temporary one, removed afterwards."""
    if workdir:
        os.makedirs(workdir, exist_ok=True)
        yield Path(tempfile.mkdtemp(dir=workdir))
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def write_result(path: str | None, result: dict[str, Any]) -> None:
    """The results as JSON at ``path`` (``--json``), if given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
