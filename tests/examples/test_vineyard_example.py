# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job, examples/offline_inference/vineyard_llm_cache.py, run as a
user would: ``--quick`` on the real model (SmolLM2-135M-Instruct), three
fresh engine processes, about a minute.

This is also the suite's real-model engine test: two fresh engines share a
cache root, the second loads the KV of the document's first three sections
(two whole chunks of the ~680-token shared prefix), and every
answer is the same text as on an engine with the cache off. Random-weight
toy models stay the tool of every other engine test (faster, and a KV
mix-up changes their outputs for sure); ``vllm serve`` on the real model is
tested in ``tests/entrypoints/test_vineyard_serve.py``."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.script_testing import ROOT, clean_env, load_script
from tests.vineyard_testing import engine_cpu

EXAMPLES = ROOT / "examples" / "offline_inference"
EXAMPLE = EXAMPLES / "vineyard_llm_cache.py"


@pytest.fixture(scope="session")
def real_model() -> str:
    """SmolLM2-135M-Instruct as a checkpoint directory (converted once into
    the user's cache directory, then reused)."""
    module = load_script(EXAMPLES / "vineyard_real_model.py", "vineyard_real_model")
    return module.prepare_model()


def test_help_explains_every_option() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for option in ("--model", "--cache-root", "--quick", "--dtype", "--json"):
        assert option in out
    assert "--run-instance" not in out  # internal


@pytest.mark.engine
@pytest.mark.timeout(420)
def test_quick_run_passes(real_model: str, tmp_path: Path) -> None:
    result_json = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--quick",
            "--model",
            real_model,
            "--cache-root",
            str(tmp_path / "cache"),
            "--json",
            str(result_json),
        ],
        env={**clean_env(), "VLLM_CPU_OMP_THREADS_BIND": str(engine_cpu())},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "Result: PASS" in output
    summary = json.loads(result_json.read_text())
    assert summary["passed"]
    assert summary["checks"] == {"answers_identical": True, "instance_2_loaded": True}
    # Real text, the same with the cache off.
    assert summary["answers"] == summary["reference_answers"]
    assert all(len(answer.split()) >= 3 for answer in summary["answers"])
    for answer in summary["answers"]:
        assert f"A: {answer}" in output
    first, second = summary["counters"]["instance 1"], summary["counters"]["instance 2"]
    # Instance 1 saved the document, instance 2 (a fresh process) loaded it.
    assert first["tokens_written"] >= 512 and first["updates_failed"] == 0
    assert second["hit_tokens"] >= 512 and second["loaded_tokens"] >= 512
    assert second["load_errors"] == 0
    assert 0 < summary["hit_rate"] <= 1
    # Times are reported, not judged: the test machine is shared and noisy
    # (the benchmark measures the speedup).
    assert all(t > 0 for t in summary["ttft_s"].values())


def test_model_is_prepared_by_one_process_at_a_time(tmp_path: Path) -> None:
    """While another process holds the conversion lock, prepare_model waits,
    then reuses the checkpoint that process finished instead of converting
    it again."""
    module = load_script(EXAMPLES / "vineyard_real_model.py", "vineyard_real_model")
    target = tmp_path / "model"
    returned: list[str] = []
    with open(tmp_path / ".model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # "another process" is converting
        waiter = threading.Thread(
            target=lambda: returned.append(module.prepare_model(target))
        )
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not returned  # it waits for the lock
        target.mkdir()
        (target / module.MARKER).write_text("converted by the other process\n")
    waiter.join(30)
    assert returned == [str(target)]
    assert (target / module.MARKER).read_text() == "converted by the other process\n"
