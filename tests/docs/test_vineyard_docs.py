# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The user documentation of the vineyard cache agrees with the code: the
environment variable table with ``ENV_VARS`` and the metrics table with
``COUNTERS`` / ``HISTOGRAMS``, in both directions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm.worker.vineyard_llm_cache import COUNTERS, ENV_VARS, HISTOGRAMS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "source"
FEATURE_PAGE = DOCS / "features" / "vineyard_llm_cache.md"
METRIC_PREFIX = "vllm:vineyard_cache_"


def _table(header: list[str]) -> list[list[str]]:
    """The rows of the Markdown table in the feature page whose header row
    has exactly these cells (the separator row is dropped)."""
    lines = FEATURE_PAGE.read_text().splitlines()

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    starts = [
        i
        for i, line in enumerate(lines)
        if line.startswith("|") and cells(line) == header
    ]
    assert len(starts) == 1, f"expected one table with header {header}"
    rows = []
    for line in lines[starts[0] + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    assert rows, f"table {header} is empty"
    return rows


def _code(cell: str) -> str:
    """The text of a cell that is one inline code span."""
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"expected `code` in table cell {cell!r}"
    return match.group(1)


@pytest.fixture(scope="module")
def env_rows() -> dict[str, list[str]]:
    rows = _table(["Variable", "Default", "Allowed", "Meaning"])
    documented: dict[str, list[str]] = {}
    for row in rows:
        assert len(row) == 4, f"malformed row {row}"
        name = _code(row[0])
        assert name not in documented, f"{name} documented twice"
        documented[name] = row
    return documented


def test_every_env_var_is_documented(env_rows: dict[str, list[str]]) -> None:
    missing = sorted(set(ENV_VARS) - set(env_rows))
    assert not missing, f"in ENV_VARS but not in {FEATURE_PAGE.name}: {missing}"


def test_no_doc_only_env_var(env_rows: dict[str, list[str]]) -> None:
    extra = sorted(set(env_rows) - set(ENV_VARS))
    assert not extra, f"in {FEATURE_PAGE.name} but not in ENV_VARS: {extra}"


def test_env_var_defaults_match(env_rows: dict[str, list[str]]) -> None:
    wrong = {
        name: (_code(row[1]), ENV_VARS[name].default)
        for name, row in env_rows.items()
        if name in ENV_VARS and _code(row[1]) != ENV_VARS[name].default
    }
    assert not wrong, f"documented vs code default: {wrong}"


def test_env_var_rows_are_filled(env_rows: dict[str, list[str]]) -> None:
    for name, row in env_rows.items():
        assert row[2] and row[3], f"{name}: allowed values and meaning needed"


def test_env_var_defaults_are_valid() -> None:
    # What the docs call the default must also parse.
    for name, var in ENV_VARS.items():
        var.parse(name, var.default)


def test_metrics_table_matches_code() -> None:
    rows = _table(["Metric", "Type", "Meaning"])
    documented = {_code(row[0]): row[1] for row in rows}
    expected = {METRIC_PREFIX + name: "counter" for name in COUNTERS}
    expected |= {
        f"{METRIC_PREFIX}{name.removesuffix('_s')}_seconds": "histogram"
        for name in HISTOGRAMS
    }
    assert documented == expected


def test_feature_page_is_linked_and_complete() -> None:
    assert "features/vineyard_llm_cache" in (DOCS / "index.md").read_text()
    text = FEATURE_PAGE.read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    for heading in (
        "Quick start",
        "Configuration",
        "How it works",
        "Sizing",
        "Metrics",
        "Backends",
        "Operations",
        "Limitations",
        "Benchmark",
    ):
        assert heading in headings, f"missing section {heading!r}"
    # The example and the benchmark the page points to exist.
    root = DOCS.parents[1]
    for path in re.findall(r"`((?:examples|benchmarks|tools)/[\w/.]+)`", text):
        assert (root / path).exists(), f"{path} named in the docs does not exist"
