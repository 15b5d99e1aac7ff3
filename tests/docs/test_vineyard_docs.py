# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The user documentation of the vineyard cache agrees with the code: the
settings table with ``ENV_VARS`` (:mod:`vllm.worker.vineyard.config`) and the metrics
table with ``COUNTERS`` / ``GAUGES`` / ``HISTOGRAMS``
(:mod:`vllm.worker.vineyard.metrics`), in both directions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm.worker.vineyard.config import ENV_VARS, VineyardLLMCacheConfig
from vllm.worker.vineyard.metrics import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    METRIC_PREFIX,
    histogram_metric_name,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "source"
FEATURE_PAGE = DOCS / "features" / "vineyard_llm_cache.md"


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


def _documented_default(cell: str) -> str:
    """A Default cell: one code span, or ``(empty)`` for an empty string."""
    return "" if cell == "(empty)" else _code(cell)


def test_env_var_defaults_match(env_rows: dict[str, list[str]]) -> None:
    wrong = {
        name: (row[1], ENV_VARS[name].default)
        for name, row in env_rows.items()
        if name in ENV_VARS and _documented_default(row[1]) != ENV_VARS[name].default
    }
    assert not wrong, f"documented vs code default: {wrong}"


def test_env_var_rows_are_filled(env_rows: dict[str, list[str]]) -> None:
    for name, row in env_rows.items():
        assert row[2] and row[3], f"{name}: allowed values and meaning needed"


def test_env_var_defaults_are_valid() -> None:
    """What the table calls the default is what an empty environment
    gives: each raw default parses to the config's default value."""
    defaults = VineyardLLMCacheConfig()
    assert VineyardLLMCacheConfig.from_env(environ={}) == defaults
    for name, var in ENV_VARS.items():
        parsed = VineyardLLMCacheConfig.from_env(environ={name: var.default})
        assert parsed == defaults, f"{name}={var.default!r} is not the default"


def test_every_setting_has_an_allowed_text(env_rows: dict[str, list[str]]) -> None:
    """The Allowed column says at least what the code's error messages say
    is allowed (the code's text may be shortened, not contradicted)."""
    assert set(ENV_VARS) == set(env_rows)
    for name, var in ENV_VARS.items():
        assert var.allowed and var.help, f"{name}: allowed/help missing in code"


def _metric_rows() -> dict[str, str]:
    rows = _table(["Metric", "Type", "Meaning"])
    documented: dict[str, str] = {}
    for row in rows:
        assert len(row) == 3 and row[2], f"malformed row {row}"
        name = _code(row[0])
        assert name not in documented, f"{name} documented twice"
        documented[name] = row[1]
    return documented


def test_metrics_table_matches_code() -> None:
    """Every counter, gauge and histogram is documented with its type, and
    nothing else is."""
    expected = {METRIC_PREFIX + name: "counter" for name in COUNTERS}
    expected |= {METRIC_PREFIX + name: "gauge" for name in GAUGES}
    expected |= {histogram_metric_name(name): "histogram" for name in HISTOGRAMS}
    documented = _metric_rows()
    missing = sorted(set(expected) - set(documented))
    extra = sorted(set(documented) - set(expected))
    assert not missing, f"in the code but not in {FEATURE_PAGE.name}: {missing}"
    assert not extra, f"in {FEATURE_PAGE.name} but not in the code: {extra}"
    wrong = {n: (documented[n], t) for n, t in expected.items() if documented[n] != t}
    assert not wrong, f"documented vs code type: {wrong}"


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
