# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job, examples/offline_inference/vineyard_llm_cache.py: its helpers
(fast), and a whole ``--quick`` run with three real engines (slow, ~2 min)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from script_testing import ROOT, clean_env, load_script

EXAMPLE = ROOT / "examples" / "offline_inference" / "vineyard_llm_cache.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_script(EXAMPLE, "vineyard_example")


def test_help_explains_every_option() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for option in (
        "--model",
        "--toy-model-dir",
        "--cache-root",
        "--quick",
        "--num-documents",
        "--document-tokens",
        "--users-per-document",
        "--answer-tokens",
        "--num-probes",
        "--probe-tokens",
        "--multiprocessing",
        "--json",
    ):
        assert option in out
    assert "--run-engine" not in out  # internal


def test_workload_is_chunk_aligned(example: ModuleType) -> None:
    args = example.parse_args(["--quick", "--document-tokens", "700"])
    workload = example.make_workload(args, vocab_size=32000, chunk_size=256)
    assert all(len(d) % 256 == 0 and d for d in workload.documents)
    assert all(len(p) % 256 == 1 for p in workload.probes)
    assert all(
        len(chats) == args.num_documents * args.users_per_document
        for chats in workload.conversations.values()
    )
    ids = {t for d in workload.documents for t in d}
    assert min(ids) >= workload.token_range[0] and max(ids) < 32000
    # Deterministic for a seed.
    again = example.make_workload(args, vocab_size=32000, chunk_size=256)
    assert again.documents == workload.documents


def test_reference_runs_what_both_instances_run(example: ModuleType) -> None:
    args = example.parse_args(["--quick"])
    workload = example.make_workload(args, vocab_size=32000, chunk_size=256)
    names = {
        engine: [p["name"] for p in example.engine_phases(engine, workload)]
        for engine in example.ENGINE_PLAN
    }
    assert names["reference"] == names["instance 1"] + names["instance 2"]


def _fake_engines(example: ModuleType, flip: bool) -> dict[str, Any]:
    """Engine results as the engine processes write them, with or without
    one differing output."""
    args = example.parse_args(["--quick", "--num-probes", "1"])
    workload = example.make_workload(args, vocab_size=32000, chunk_size=256)
    prefix = example.METRIC_PREFIX

    def phase(spec: dict[str, Any], hit: int, changed: bool) -> dict[str, Any]:
        n = len(spec["prompts"])
        outputs = [[1, 2, 3] for _ in range(n)]
        if changed:
            outputs[0] = [1, 2, 4]
        return {
            "name": spec["name"],
            "kind": spec["kind"],
            "users": spec["users"],
            "prompts": spec["prompts"],
            "outputs": outputs,
            "num_cached_tokens": [hit] * n,
            "wall_s": 0.5,
            "probe_ttft_s": [0.1] * n if spec["kind"] == "probe" else [],
            "first_token_latency_s": [0.1] * n,
            "counters": {prefix + "query_tokens": 512, prefix + "hit_tokens": hit},
        }

    engines = {}
    for name, use_cache in example.ENGINES:
        hit = 256 if name == "instance 2" else 0
        phases = [
            phase(spec, hit, flip and name == "instance 2" and i == 1)
            for i, spec in enumerate(example.engine_phases(name, workload))
        ]
        counters = {prefix + "hit_tokens": hit * 10, prefix + "updates_submitted": 3}
        data = {
            "phases": phases,
            "counters": counters,
            "cache_config": {"chunk_size": 256, "max_inflight_tasks": 4},
        }
        engines[name] = example.EngineResult(name, use_cache, 1.0, data)
    return {"engines": engines, "workload": workload}


@pytest.mark.parametrize("flip", [False, True])
def test_report_detects_differing_outputs(example: ModuleType, flip: bool) -> None:
    fake = _fake_engines(example, flip)
    report, summary = example.build_report(
        fake["engines"], fake["workload"], "a model", "/cache"
    )
    assert summary["passed"] is (not flip)
    assert summary["checks"]["instance_2_hits"]
    assert ("Result: FAIL" in report) is flip
    assert len(summary["mismatches"]) == (1 if flip else 0)


@pytest.mark.engine
@pytest.mark.timeout(420)
def test_quick_run_passes(tmp_path: Path) -> None:
    result_json = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--quick",
            "--toy-model-dir",
            str(tmp_path / "model"),
            "--cache-root",
            str(tmp_path / "cache"),
            "--json",
            str(result_json),
        ],
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=400,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "outputs identical with and without the cache" in output
    assert "Result: PASS" in output
    summary = json.loads(result_json.read_text())
    assert summary["checks"] == {"outputs_identical": True, "instance_2_hits": True}
    assert summary["compared"] > 0 and not summary["mismatches"]
    first, second = summary["counters"]["instance 1"], summary["counters"]["instance 2"]
    # Instance 1 saved, instance 2 (a fresh engine on the same root) loaded.
    assert first["updates_completed"] > 0 and first["tokens_written"] > 0
    assert second["hit_tokens"] > 0 and second["loaded_tokens"] > 0
    assert first["updates_failed"] == second["updates_failed"] == 0
    assert first["load_errors"] == second["load_errors"] == 0
    turn_1 = next(
        p
        for p in summary["phases"]
        if p["engine"] == "instance 2" and p["phase"] == "users B, turn 1"
    )
    assert turn_1["hit_tokens"] > 0
