# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""fp8 KV caches in a real engine. ``fp8_e4m3`` and ``fp8_e5m2`` are both
stored as ``uint8`` blocks of the same shape, yet their bytes mean
different numbers: each variant gets a namespace of its own, so one never
loads the other's KV. With the cache on, each variant's outputs are those
of the same variant without the cache, and its second ask hits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.vineyard_engine_testing import (
    ReferenceRunner,
    cacheable_prefix,
    engine_env,
    run_engine,
)
from tests.vineyard_testing import random_tokens
from vllm.worker.vineyard.storage.scan import scan_root


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {
                flag for line in f if line.startswith("flags") for flag in line.split()
            }
    except OSError:
        return set()


pytestmark = [
    pytest.mark.engine,
    pytest.mark.timeout(600),
    # vLLM's CPU backend refuses fp8 KV caches on other CPUs at startup.
    pytest.mark.skipif(
        not _cpu_flags() & {"avx512f", "amx_bf16"},
        reason="vLLM's CPU fp8 KV cache needs x86 with AVX-512 or AMX",
    ),
]

MAX_TOKENS = 8
PROMPT_LEN = 700


def test_fp8_variants_keep_apart(
    toy_model: str, reference: ReferenceRunner, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    prompt = random_tokens(random.Random(5), PROMPT_LEN)
    rounds = [{"prompts": [prompt], "max_tokens": MAX_TOKENS}] * 2
    variants = ("fp8_e4m3", "fp8_e5m2")
    outputs = {}
    for dtype in variants:
        # vLLM's own prefix cache off: the second ask must come from vineyard.
        kwargs = {"enable_prefix_caching": False, "kv_cache_dtype": dtype}
        plain = reference(toy_model, [prompt], MAX_TOKENS, **kwargs).last.outputs
        run = run_engine(toy_model, rounds, engine_env(root), tmp_path / dtype,
                         llm_kwargs=kwargs)  # fmt: skip
        first, second = run.rounds
        assert first.outputs == second.outputs == plain
        # The other variant's chunks (written first) are not this one's.
        assert first.num_cached_tokens == [0]
        assert second.num_cached_tokens == [cacheable_prefix(PROMPT_LEN)]
        assert run.delta(1, "load_errors") == 0
        outputs[dtype] = plain
    # The variants differ (so sharing KV would have shown), and each has
    # a namespace of its own.
    assert outputs["fp8_e4m3"] != outputs["fp8_e5m2"]
    manifests = [ns.manifest for ns in scan_root(str(root)).namespaces.values()]
    layouts = [m.layout for m in manifests if m is not None]
    assert sorted((lay["kv_cache_dtype"], lay["dtype"]) for lay in layouts) == [
        ("fp8_e4m3", "uint8"),
        ("fp8_e5m2", "uint8"),
    ]
