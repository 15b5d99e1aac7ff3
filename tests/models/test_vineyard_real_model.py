# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vineyard cache on a real model (SmolLM2-135M-Instruct, float32):
users chat about a shared ~700-token document on two fresh engines (separate
processes) sharing one cache root. The second engine loads the document's
KV instead of computing it, and every answer is the same text as on an
engine without the cache.

Random-weight toy models stay the tool of every other engine test (faster,
and a KV mix-up changes their outputs for sure); this one shows the cache
with real text. Each engine runs this file as a script (the cache settings
must be in the environment before vLLM is imported).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from vllm.renderers.chat_utils import ChatCompletionMessageParam

TESTS = Path(__file__).resolve().parents[1]
EXAMPLES = TESTS.parent / "examples" / "offline_inference"
METRIC_PREFIX = "vllm:vineyard_cache_"
CHUNK_SIZE = 256
QUESTIONS = [
    "How many items can a member borrow at the same time?",
    "How much does a replacement library card cost?",
]


def document() -> str:
    """Sections 1-3 of the example's handbook (~680 tokens: two whole
    chunks of 256 are cacheable)."""
    text = (EXAMPLES / "vineyard_shared_document.md").read_text()
    return text[: text.index("## 4.")]


def chat(question: str) -> list[ChatCompletionMessageParam]:
    return [
        {"role": "system", "content": document()},
        {
            "role": "user",
            "content": f"According to the handbook: {question} Answer in one sentence.",
        },
    ]


# --------------------------------------------------------------------------
# Engine side: ``python test_vineyard_real_model.py SPEC_JSON RESULT_PATH``.
# --------------------------------------------------------------------------


def _engine_main(spec: dict[str, Any], result_path: str) -> None:
    from vllm.v1.metrics.reader import Counter

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        disable_log_stats=False,  # for LLM.get_metrics()
        seed=0,
    )
    if spec["go_file"]:  # started early: ready, but asks only when told to
        deadline = time.monotonic() + 300
        while not os.path.exists(spec["go_file"]) and time.monotonic() < deadline:
            time.sleep(0.1)

    def counters() -> dict[str, int]:
        out: dict[str, int] = {}
        for metric in llm.get_metrics():
            if isinstance(metric, Counter) and metric.name.startswith(METRIC_PREFIX):
                name = metric.name.removeprefix(METRIC_PREFIX)
                out[name] = out.get(name, 0) + int(metric.value)
        return out

    params = SamplingParams(temperature=0, max_tokens=24)
    answers, cached, prompt_lens = [], [], []
    for question in spec["questions"]:  # one user after another
        out = llm.chat(chat(question), params, use_tqdm=False)[0]
        answers.append(out.outputs[0].text)
        cached.append(out.num_cached_tokens or 0)
        prompt_lens.append(len(out.prompt_token_ids or []))
    # Let the background saves land (the worker reports with each step).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        c = counters()
        done = c.get("updates_completed", 0) + c.get("updates_failed", 0)
        if done >= c.get("updates_submitted", 0):
            break
        llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.2)
    result = {
        "answers": answers,
        "num_cached_tokens": cached,
        "prompt_lens": prompt_lens,
        "counters": counters(),
    }
    Path(result_path).write_text(json.dumps(result))


# --------------------------------------------------------------------------
# Test side.
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def real_model() -> str:
    """SmolLM2-135M-Instruct as a checkpoint directory (converted once into
    the user's cache directory, then reused)."""
    from script_testing import load_script  # tests/ is on sys.path

    module = load_script(EXAMPLES / "vineyard_real_model.py", "vineyard_real_model")
    return module.prepare_model()


class Engine:
    """One engine in a fresh process, started now; ``result()`` waits."""

    def __init__(
        self,
        name: str,
        model: str,
        questions: list[str],
        tmp_path: Path,
        cache_root: Path | None,
        cpu: int = 0,
        go_file: Path | None = None,
    ):
        self.name = name
        self.result_path = tmp_path / f"{name}.json"
        self.log_path = tmp_path / f"{name}.log"
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("VINEYARD_", "VLLM_USE_VINEYARD"))
            and k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "POD_NAME")
        }
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            # Engines that run at the same time compute on different cores.
            VLLM_CPU_OMP_THREADS_BIND=str(cpu),
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VINEYARD_CACHE_CHUNK_SIZE=str(CHUNK_SIZE),
        )
        if cache_root is not None:
            env.update(VLLM_USE_VINEYARD_CACHE="1", VINEYARD_CACHE_ROOT=str(cache_root))
        go = str(go_file) if go_file else None
        spec = json.dumps({"model": model, "questions": questions, "go_file": go})
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, spec, str(self.result_path)],
                env=env,
                cwd=tmp_path,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # kill() ends its cache backends too
            )

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def result(self) -> dict[str, Any]:
        try:
            returncode = self.proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            self.kill()
            returncode = -9
        log = self.log_path.read_text()
        assert returncode == 0, f"{self.name} failed:\n{log[-6000:]}"
        return json.loads(self.result_path.read_text())


def _second_cpu() -> int:
    """A core for an engine that runs beside another (the same core on a
    one-core machine)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[1] if len(cpus) > 1 else cpus[0]


@pytest.mark.engine
@pytest.mark.timeout(420)
def test_second_engine_loads_shared_document(real_model: str, tmp_path: Path) -> None:
    root, go = tmp_path / "cache", tmp_path / "go"
    # Three fresh processes start side by side (starting is most of the
    # time). Engine 1 (cache on) and the reference (cache off) answer at once;
    # engine 2 (same cache root) asks a new question first, once engine 1
    # has exited and so has written what it computed.
    other = _second_cpu()
    first = Engine("engine-1", real_model, QUESTIONS[:1], tmp_path, root)
    reference = Engine("no-cache", real_model, QUESTIONS, tmp_path, None, other)
    second = Engine("engine-2", real_model, QUESTIONS[::-1], tmp_path, root, other, go)
    try:
        saved = first.result()
        go.touch()
        no_cache, loaded = reference.result(), second.result()
    finally:
        for engine in (first, reference, second):
            engine.kill()

    prompt_len = no_cache["prompt_lens"][0]
    cacheable = (prompt_len - 1) // CHUNK_SIZE * CHUNK_SIZE
    assert prompt_len >= 600 and cacheable >= 2 * CHUNK_SIZE

    # The same text with and without the cache, and real sentences.
    assert saved["answers"] == no_cache["answers"][:1]
    assert loaded["answers"] == no_cache["answers"][::-1]
    assert all(len(answer.split()) >= 3 for answer in no_cache["answers"])

    # Engine 1 saved the document's chunks; engine 2 loaded them for its
    # first request (its second one hits vLLM's own prefix cache).
    assert saved["counters"]["tokens_written"] >= cacheable
    assert saved["counters"]["updates_failed"] == 0
    counters = loaded["counters"]
    assert counters["hit_tokens"] >= cacheable
    assert counters["loaded_tokens"] >= cacheable
    assert counters["load_errors"] == 0
    assert loaded["num_cached_tokens"][0] >= cacheable


if __name__ == "__main__":
    _engine_main(json.loads(sys.argv[1]), sys.argv[2])
