# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""benchmarks/benchmark_vineyard_llm_cache.py: its engine plan (fast), and a
whole ``--part all --tiny`` run, core part and four real engines, that must
write valid JSON and a PNG (slow, about a minute on 2 cores).

The tiny run checks that the benchmark works end to end, not its figures:
at this size an engine run lasts a fraction of a second, so throughput and
TTFT ratios are noise (the targets are judged by the full run, whose results
are in the docs)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from script_testing import ROOT, clean_env, load_script

BENCHMARK = ROOT / "benchmarks" / "benchmark_vineyard_llm_cache.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script(BENCHMARK, "vineyard_benchmark")


def test_help_lists_parts_and_outputs() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARK), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=clean_env(),
    ).stdout
    for option in ("--part", "all", "engine", "--tiny", "--json", "--plot"):
        assert option in out
    for option in ("--engine-rounds", "--engine-ttft-tokens", "--from-json"):
        assert option in out


def test_engine_plan_is_side_by_side(bench: ModuleType, tmp_path: Path) -> None:
    """Same prompts for every configuration, a fresh cache root for each,
    rotating order, and a TTFT hit on a fresh engine over a filled root."""
    args = bench.build_parser().parse_args(
        ["--tiny", "--engine-rounds", "3", "--engine-ttft-models", "tiny", "toy"]
    )
    config = bench.resolve_config(args)
    runs = bench.plan_engine_runs(config, str(tmp_path))
    tput = [r for r in runs if r.round is not None]
    assert len(tput) == 3 * 3
    orders = [[r.config for r in tput if r.round == i] for i in range(3)]
    assert sorted(orders[0]) == sorted(bench.ENGINE_CONFIGS)
    assert len({tuple(o) for o in orders}) == 3, "the order rotates"

    def prompts(run: Any, name: str) -> list[list[int]]:
        return next(p["prompts"] for p in run.phases if p["name"] == name)

    same = prompts(tput[0], "throughput")
    assert len(same) == config.engine_prompts
    for run in tput:
        assert prompts(run, "throughput") == same
    # Unique prompts: no two share their first tokens, so nothing hits.
    assert len({tuple(p[:64]) for p in same}) == len(same)
    low, high = config.engine_prompt_tokens
    assert all(low <= len(p) <= high for p in same)

    roots = [r.root for r in tput if r.config != "no cache"]
    assert all(roots) and len(set(roots)) == len(roots), "a fresh root each"
    assert all(r.root is None for r in tput if r.config == "no cache")

    for model in ("tiny", "toy"):
        cached = next(r for r in runs if r.model == model and "cached" in r.label)
        filled = [
            r
            for r in runs
            if r.model == model and any(p["name"] == "fill" for p in r.phases)
        ]
        assert len(filled) == 1 and filled[0].root == cached.root
        assert runs.index(filled[0]) < runs.index(cached)
        probes = prompts(cached, "ttft")
        assert probes and all(p in prompts(filled[0], "fill") for p in probes)
        recompute = next(
            r
            for r in runs
            if r.model == model
            and r.config == "no cache"
            and any(p["name"] == "ttft" for p in r.phases)
        )
        assert prompts(recompute, "ttft") == probes
        chunk = bench._engine_chunk_size()
        assert all(len(p) % chunk == 1 for p in probes), "whole chunks + 1"


@pytest.mark.engine
def test_tiny_run_writes_json_and_png(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "results.json", tmp_path / "results.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARK),
            "--part",
            "all",
            "--tiny",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
            "--root",
            str(tmp_path),
            "--engine-model-dir",
            str(tmp_path / "models"),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=clean_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for heading in ("[core 1]", "[core 3]", "[engine 1]", "[engine 2]"):
        assert heading in proc.stdout
    assert "load average" in proc.stdout

    results = json.loads(out_json.read_text())
    assert results["config"]["tiny"] is True
    assert results["environment"]["cpu_count"] >= 1
    core = results["core"]
    assert core["caller"] and core["throughput"] and core["skip"]["rows"]
    assert all(r["load_verified"] for r in core["throughput"])

    engine = results["engine"]
    configs = engine["throughput"]["configs"]
    assert list(configs) == ["no cache", "sync", "async"]
    for name, row in configs.items():
        best = row["best"]
        assert best["tokens_per_s"] > 0 and best["wall_s"] > 0
        counters = best["counters"]
        if name == "no cache":
            assert not counters.get("updates_submitted")
        else:
            # Every step saved: unique prompts, nothing was a hit.
            assert counters["updates_submitted"] > 0
            assert counters["tokens_written"] > 0
            assert counters.get("hit_tokens", 0) == 0
            assert counters.get("updates_failed", 0) == 0
    assert configs["no cache"]["relative"] == pytest.approx(1.0)

    (ttft,) = engine["ttft"]
    assert ttft["fully_cached"], ttft["cached_tokens"]
    assert ttft["hit_tokens"] >= ttft["prompt_tokens"] - 1
    assert ttft["recompute_median_s"] > 0 and ttft["cached_median_s"] > 0

    data = out_png.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert 10_000 < len(data) < 500_000

    # The JSON alone redraws the plot.
    again = tmp_path / "again.png"
    subprocess.run(
        [
            sys.executable,
            str(BENCHMARK),
            "--from-json",
            str(out_json),
            "--plot",
            str(again),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=clean_env(),
    )
    assert again.read_bytes().startswith(PNG_MAGIC)


def test_docs_show_the_latest_plot() -> None:
    """The Benchmark section of the feature page shows the committed plot and
    the command that made it."""
    page = ROOT / "docs" / "source" / "features" / "vineyard_llm_cache.md"
    text = page.read_text()
    section = text[text.index("\n## Benchmark") :]
    images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", section)
    assert images, "no plot in the Benchmark section"
    for image in images:
        path = (page.parent / image).resolve()
        assert path.exists(), f"{image} does not exist"
        assert path.read_bytes().startswith(PNG_MAGIC)
        assert path.stat().st_size < 200_000, f"{image} is over 200 KB"
    assert "benchmarks/benchmark_vineyard_llm_cache.py" in section
    assert "--plot" in section and "--part all" in section
