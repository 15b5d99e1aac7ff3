# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor parallelism in a real TP=2 engine: each rank stores its own shard
under its own namespace, a fresh engine loads them (both ranks), and its
outputs equal a TP=2 engine without the cache.

The scheduler's rule that a chunk counts only if every rank has it (the
minimum across ranks) is tested without an engine in
``tests/v1/kv_connector/unit/test_vineyard_connector_scheduler.py``.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from script_testing import clean_env
from vineyard_toy_model import make_toy_llama

PROMPT_LEN = 900
CACHED = 768  # whole 256-token chunks of 900 tokens

ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, random, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True,
                  dtype="float32", max_model_len=4096, block_size=64,
                  tensor_parallel_size=2, disable_log_stats=False)
        rng = random.Random(3)
        prompt = [rng.randrange(3, 32000) for _ in range(900)]
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0, max_tokens=10,
                                          ignore_eos=True))[0]
        metrics = {m.name: m.value for m in llm.get_metrics()
                   if m.name.startswith("vllm:vineyard_cache_")
                   and hasattr(m, "value")}
        print("RESULT " + json.dumps({"tokens": list(out.outputs[0].token_ids),
                                      "cached": out.num_cached_tokens,
                                      "metrics": metrics}))
    """
)


def _run_tp_engine(tmp_path: Path, model: str, use_cache: bool = True) -> Any:
    """One TP=2 engine (multiprocessing: one worker process per rank); the
    process exits only after the engine's shutdown, which drains the
    background writes."""
    script = tmp_path / "tp_engine.py"
    script.write_text(ENGINE_SCRIPT)
    env = {
        **clean_env(),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # One core per rank (vLLM's NUMA auto-binding needs two nodes).
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }
    if use_cache:
        env["VLLM_USE_VINEYARD_CACHE"] = "1"
        env["VINEYARD_CACHE_ROOT"] = str(tmp_path / "cache")
        env["VINEYARD_CACHE_CHUNK_SIZE"] = "256"
    proc = subprocess.run(
        [sys.executable, str(script), model],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.engine
@pytest.mark.timeout(1200)
def test_tp2_engine_saves_shards_and_loads_them(tmp_path: Path) -> None:
    model = make_toy_llama(str(tmp_path / "model"))
    plain = _run_tp_engine(tmp_path, model, use_cache=False)
    assert plain["metrics"] == {}  # no cache, no vineyard metrics

    first = _run_tp_engine(tmp_path, model)
    assert first["cached"] == 0
    assert first["tokens"] == plain["tokens"]
    assert first["metrics"]["vllm:vineyard_cache_updates_submitted"] > 0
    shards = sorted(p.name.rsplit("-", 2)[1] for p in (tmp_path / "cache").iterdir())
    assert shards == ["tp2r0", "tp2r1"]

    # The first engine exited after its shutdown, which drains the writes:
    # the second engine finds every whole chunk on both ranks.
    second = _run_tp_engine(tmp_path, model)
    assert second["cached"] == CACHED
    assert second["tokens"] == plain["tokens"]
    metrics = second["metrics"]
    assert metrics["vllm:vineyard_cache_hit_tokens"] == CACHED
    # Both ranks loaded their shard of every hit token.
    assert metrics["vllm:vineyard_cache_loaded_tokens"] == 2 * CACHED
    assert metrics["vllm:vineyard_cache_load_errors"] == 0
