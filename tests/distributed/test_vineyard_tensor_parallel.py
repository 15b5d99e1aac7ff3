# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor parallelism: each rank stores its own shard under its own
namespace, and ranks agree on what is loaded (the minimum across ranks)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from vineyard_toy_model import make_toy_llama

from vllm.worker.vineyard_connector import lookup_all_ranks
from vllm.worker.vineyard_llm_cache import (
    KVCacheLayout,
    SaveRequest,
    VineyardLLMCache,
    VineyardLLMCacheConfig,
)

NUM_LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD = 2, 32, 16, 2, 32
CHUNK = 32

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


def _run_tp_engine(tmp_path: Path, model: str) -> dict:
    script = tmp_path / "tp_engine.py"
    script.write_text(ENGINE_SCRIPT)
    env = {
        **os.environ,
        "VLLM_USE_VINEYARD_CACHE": "1",
        "VINEYARD_CACHE_ROOT": str(tmp_path / "cache"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # One core per rank (vLLM's NUMA auto-binding needs two nodes).
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }
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
def test_tp2_engine_saves_shards_and_loads_them(tmp_path: Path) -> None:
    model = make_toy_llama(str(tmp_path / "model"))
    first = _run_tp_engine(tmp_path, model)
    assert first["cached"] == 0
    # Writes finish in the background (reported with a later step, and
    # drained at shutdown): the second engine's hits prove they landed.
    assert first["metrics"]["vllm:vineyard_cache_updates_submitted"] > 0
    shards = sorted(p.name.rsplit("-", 1)[1] for p in (tmp_path / "cache").iterdir())
    assert shards == ["tp2r0", "tp2r1"]

    second = _run_tp_engine(tmp_path, model)
    assert second["cached"] == 768  # 900 tokens: whole 256-token chunks
    assert second["tokens"] == first["tokens"]
    assert second["metrics"]["vllm:vineyard_cache_hit_tokens"] == 768
    assert second["metrics"]["vllm:vineyard_cache_load_errors"] == 0


def _rank_cache(root: Path, rank: int) -> VineyardLLMCache:
    layout = KVCacheLayout(
        model="tp-model",
        dtype="float32",
        num_layers=NUM_LAYERS,
        num_kv_heads=HEADS,
        head_size=HEAD,
        block_size=BLOCK,
        block_bytes=HEADS * BLOCK * 2 * HEAD * 4,
        kv_layout="cpu:test",
        tp_size=2,
        tp_rank=rank,
    )
    kv = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) for _ in range(NUM_LAYERS)]
    config = VineyardLLMCacheConfig(root=str(root), chunk_size=CHUNK)
    return VineyardLLMCache(config, layout, 4 * CHUNK, kv, NUM_BLOCKS)


@pytest.mark.parametrize("saved", [(4, 2), (2, 4), (0, 3), (3, 3)])
def test_ranks_agree_on_the_minimum(tmp_path: Path, saved: tuple[int, int]) -> None:
    tokens = list(range(100, 100 + 5 * CHUNK + 1))
    caches = [_rank_cache(tmp_path, rank) for rank in range(2)]
    try:
        for cache, chunks in zip(caches, saved, strict=True):
            cache.save(
                [SaveRequest("r", tokens, chunks * CHUNK, list(range(NUM_BLOCKS)))]
            )
            assert cache.wait_for_updates(30)
        num_hit, save_from = lookup_all_ranks(caches, tokens, 0)
        assert num_hit == min(saved) * CHUNK
        assert save_from == min(saved) * CHUNK
        # With a local prefix hit, only what lies beyond it counts.
        if min(saved) >= 2:
            assert lookup_all_ranks(caches, tokens, CHUNK) == (
                (min(saved) - 1) * CHUNK,
                min(saved) * CHUNK,
            )
    finally:
        for cache in caches:
            cache.close()
