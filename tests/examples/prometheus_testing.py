# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A real Prometheus server for the tests (Debian's ``prometheus`` package,
installed by ``tools/setup_env.sh``): its own config, data directory and
free port, scraping one target every second; queries through its HTTP
API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.vineyard_serve_testing import free_port

#: The scrape interval (s); the rate window of the queries is 15 s, so
#: every window holds several scrapes.
SCRAPE_INTERVAL_S = 1
STARTUP_TIMEOUT_S = 60


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusError(RuntimeError):
    pass


class Prometheus:
    """``prometheus`` scraping ``target`` (host:port) as job ``job``,
    started now; ``wait_ready()`` waits for ``/-/ready``."""

    def __init__(self, binary: str, target: str, tmp_path: Path, job: str = "vllm"):
        self.job = job
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
            f"  scrape_timeout: {SCRAPE_INTERVAL_S}s\n"
            "scrape_configs:\n"
            f"  - job_name: {job}\n"
            "    static_configs:\n"
            f'      - targets: ["{target}"]\n'
        )
        self.log_path = tmp_path / "prometheus.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1d",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5):
                    return
            except OSError:
                time.sleep(0.2)
        raise PrometheusError(f"prometheus not ready in {STARTUP_TIMEOUT_S} s")

    def api(self, path: str, **params: Any) -> dict[str, Any]:
        """The JSON answer of ``/api/v1/<path>``, also for an error status
        (a bad query is answered 400 with ``status: error``); a
        :class:`PrometheusError` where Prometheus does not answer."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(
                f"{self.url}/api/v1/{path}?{query}", timeout=30
            ) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            try:
                return json.loads(body)
            except ValueError:
                raise PrometheusError(f"{path} {params}: {e}: {body}") from e
        except OSError as e:  # not answering (exited, or not up yet)
            raise PrometheusError(f"{path} {params}: {e}") from e

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        return self.api("query", **params)

    def query_range(
        self, expr: str, start: float, end: float, step: float
    ) -> dict[str, Any]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)

    def value(self, expr: str) -> float | None:
        """The single value of an instant query now (None if empty)."""
        answer = self.query(expr)
        if answer.get("status") != "success":
            raise PrometheusError(f"{expr}: {answer}")
        result = answer["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
