# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The documentation of the vineyard cache (``docs/source``: a feature page,
an operations page, a design page and a benchmarks page) agrees with the
code, in both directions:

- the feature page's settings table with ``VineyardLLMCacheConfig`` and
  ``ENV_VARS`` (:mod:`vllm.worker.vineyard.config`);
- the operations page's metrics table with ``COUNTERS`` / ``GAUGES`` /
  ``HISTOGRAMS`` (:mod:`vllm.worker.vineyard.metrics`);
- the design page's file table with every module under
  ``vllm/worker/vineyard/`` (found by walking the tree, so a new module
  fails here until it is documented);
- the benchmarks page with the numbers its plot is drawn from
  (``benchmarks/vineyard/plot_data.json``), and the plot with them.

And the pages hold together: none is longer than :data:`MAX_PAGE_LINES`,
each is listed in the index and the README, every relative link in the
README and the docs resolves (to a file, and to a heading or label there),
and every repository path they name exists."""

from __future__ import annotations

import dataclasses
import re
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.script_testing import ROOT, clean_env, load_script
from vllm.worker.vineyard.config import (
    ENABLE_VAR,
    ENV_VARS,
    VineyardLLMCacheConfig,
    env_name,
)
from vllm.worker.vineyard.metrics import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    METRIC_PREFIX,
    histogram_metric_name,
)

DOCS = ROOT / "docs" / "source"
README = ROOT / "README.md"
FEATURE_PAGE = DOCS / "features" / "vineyard_llm_cache.md"
OPERATIONS_PAGE = DOCS / "serving" / "vineyard_llm_cache_operations.md"
DESIGN_PAGE = DOCS / "design" / "vineyard_llm_cache.md"
BENCHMARKS_PAGE = DOCS / "performance" / "vineyard_llm_cache_benchmarks.md"
PAGES = (FEATURE_PAGE, OPERATIONS_PAGE, DESIGN_PAGE, BENCHMARKS_PAGE)
#: Longest a page under docs/source may be.
MAX_PAGE_LINES = 600
#: The package the design page's file table covers, and the module beside it.
PACKAGE = ROOT / "vllm" / "worker" / "vineyard"
CACHE_MODULE = ROOT / "vllm" / "worker" / "vineyard_llm_cache.py"
PLOT_SCRIPT = ROOT / "benchmarks" / "vineyard" / "plot.py"
PLOT_PNG = DOCS / "assets" / "vineyard_llm_cache_benchmark.png"
#: Most the docs' assets may weigh together (raw benchmark output stays out).
MAX_ASSETS_BYTES = 200 << 10
#: Most the plot's numbers may weigh.
MAX_PLOT_DATA_BYTES = 8 << 10


# ---------------------------------------------------------------------------
# Reading the pages.
# ---------------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(page: Path, header: list[str]) -> list[list[list[str]]]:
    """The rows of every Markdown table in ``page`` whose header row has
    exactly these cells (the separator row is dropped)."""
    lines = page.read_text().splitlines()
    tables = []
    for i, line in enumerate(lines):
        if not (line.startswith("|") and _cells(line) == header):
            continue
        rows = []
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            rows.append(_cells(row))
        assert rows, f"{page.name}: table {header} is empty"
        tables.append(rows)
    return tables


def _table(page: Path, header: list[str]) -> list[list[str]]:
    """The rows of the one table in ``page`` with this header."""
    tables = _tables(page, header)
    assert len(tables) == 1, f"{page.name}: expected one table with header {header}"
    return tables[0]


def _code(cell: str) -> str:
    """The text of a cell that is one inline code span."""
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"expected `code` in table cell {cell!r}"
    return match.group(1)


FENCED_BLOCK = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", FENCED_BLOCK.sub("", text))


def _anchors(page: Path) -> set[str]:
    """What ``#anchor`` may name in ``page``: its headings as GitHub (and
    MyST with heading anchors) names them, and its MyST labels."""
    text = FENCED_BLOCK.sub("", page.read_text())
    anchors = set(re.findall(r"^\(([\w-]+)\)=$", text, flags=re.MULTILINE))
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower())
        anchors.add(slug.replace(" ", "-"))
    return anchors


# ---------------------------------------------------------------------------
# Settings (feature page).
# ---------------------------------------------------------------------------

SETTINGS_HEADER = ["Variable", "Key", "Default", "Allowed", "Meaning"]


@pytest.fixture(scope="module")
def env_rows() -> dict[str, list[str]]:
    documented: dict[str, list[str]] = {}
    for row in _table(FEATURE_PAGE, SETTINGS_HEADER):
        assert len(row) == len(SETTINGS_HEADER), f"malformed row {row}"
        name = _code(row[0])
        assert name not in documented, f"{name} documented twice"
        documented[name] = row
    return documented


def test_every_env_var_is_documented(env_rows: dict[str, list[str]]) -> None:
    missing = sorted(set(ENV_VARS) - set(env_rows))
    assert not missing, f"in ENV_VARS but not in {FEATURE_PAGE.name}: {missing}"


def test_every_config_setting_is_in_the_settings_table(
    env_rows: dict[str, list[str]],
) -> None:
    """Every field of ``VineyardLLMCacheConfig`` (but where the values came
    from) is a documented setting, under its environment variable: a field
    added without ``_setting`` is caught too."""
    names = {
        env_name(f.name)
        for f in dataclasses.fields(VineyardLLMCacheConfig)
        if f.name != "sources"
    }
    missing = sorted(names - set(env_rows))
    assert not missing, f"config settings not in {FEATURE_PAGE.name}: {missing}"


def test_no_doc_only_env_var(env_rows: dict[str, list[str]]) -> None:
    extra = sorted(set(env_rows) - set(ENV_VARS))
    assert not extra, f"in {FEATURE_PAGE.name} but not in ENV_VARS: {extra}"


def test_extra_config_keys_match(env_rows: dict[str, list[str]]) -> None:
    """The Key column is each setting's ``kv_connector_extra_config`` key;
    the switch itself has none (its only job is to supply that config)."""
    for name, row in env_rows.items():
        expected = "-" if name == ENABLE_VAR else ENV_VARS[name].key
        found = row[1] if row[1] == "-" else _code(row[1])
        assert found == expected, f"{name}: key {found!r}, code says {expected!r}"


def _documented_default(cell: str) -> str:
    """A Default cell: one code span, or ``(empty)`` for an empty string."""
    return "" if cell == "(empty)" else _code(cell)


def test_env_var_defaults_match(env_rows: dict[str, list[str]]) -> None:
    wrong = {
        name: (row[2], ENV_VARS[name].default)
        for name, row in env_rows.items()
        if name in ENV_VARS and _documented_default(row[2]) != ENV_VARS[name].default
    }
    assert not wrong, f"documented vs code default: {wrong}"


def test_env_var_rows_are_filled(env_rows: dict[str, list[str]]) -> None:
    for name, row in env_rows.items():
        assert row[3] and row[4], f"{name}: allowed values and meaning needed"


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


# ---------------------------------------------------------------------------
# Metrics (operations page).
# ---------------------------------------------------------------------------


def test_metrics_table_matches_code() -> None:
    """Every counter, gauge and histogram is documented with its type, and
    nothing else is."""
    documented: dict[str, str] = {}
    for row in _table(OPERATIONS_PAGE, ["Metric", "Type", "Meaning"]):
        assert len(row) == 3 and row[2], f"malformed row {row}"
        name = _code(row[0])
        assert name not in documented, f"{name} documented twice"
        documented[name] = row[1]
    expected = {METRIC_PREFIX + name: "counter" for name in COUNTERS}
    expected |= {METRIC_PREFIX + name: "gauge" for name in GAUGES}
    expected |= {histogram_metric_name(name): "histogram" for name in HISTOGRAMS}
    page = OPERATIONS_PAGE.name
    missing = sorted(set(expected) - set(documented))
    extra = sorted(set(documented) - set(expected))
    assert not missing, f"in the code but not in {page}: {missing}"
    assert not extra, f"in {page} but not in the code: {extra}"
    wrong = {n: (documented[n], t) for n, t in expected.items() if documented[n] != t}
    assert not wrong, f"documented vs code type: {wrong}"


# ---------------------------------------------------------------------------
# The code's files (design page).
# ---------------------------------------------------------------------------


def _modules() -> set[str]:
    """Every module of the cache, as a path from the repository root:
    ``vllm/worker/vineyard_llm_cache.py`` and every ``.py`` file under
    ``vllm/worker/vineyard/`` but empty ``__init__.py`` files."""
    found = {CACHE_MODULE}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" and not path.read_text().strip():
            continue
        found.add(path)
    return {p.relative_to(ROOT).as_posix() for p in found}


@pytest.fixture(scope="module")
def file_rows() -> dict[str, str]:
    documented: dict[str, str] = {}
    for row in _table(DESIGN_PAGE, ["File", "What it owns"]):
        assert len(row) == 2 and row[1], f"malformed row {row}"
        path = _code(row[0])
        assert path not in documented, f"{path} documented twice"
        documented[path] = row[1]
    return documented


def test_every_module_is_in_the_design_file_table(file_rows: dict[str, str]) -> None:
    missing = sorted(_modules() - set(file_rows))
    assert not missing, (
        f"modules missing from the file table of {DESIGN_PAGE.name} "
        f"(add one line each): {missing}"
    )


def test_design_file_table_names_only_modules(file_rows: dict[str, str]) -> None:
    extra = sorted(set(file_rows) - _modules())
    assert not extra, f"{DESIGN_PAGE.name} lists files that are not modules: {extra}"


# ---------------------------------------------------------------------------
# The pages as a site.
# ---------------------------------------------------------------------------


def _doc_files() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_no_page_is_too_long() -> None:
    lengths = {p.relative_to(DOCS).as_posix(): len(p.read_text().splitlines())
               for p in _doc_files()}  # fmt: skip
    too_long = {page: n for page, n in lengths.items() if n > MAX_PAGE_LINES}
    assert not too_long, f"pages over {MAX_PAGE_LINES} lines: {too_long}"


def test_pages_are_in_the_index_and_the_readme() -> None:
    index = (DOCS / "index.md").read_text()
    readme = README.read_text()
    for page in PAGES:
        assert page.exists(), f"{page} is missing"
        name = page.relative_to(DOCS).with_suffix("").as_posix()
        assert re.search(rf"^{re.escape(name)}$", index, flags=re.MULTILINE), (
            f"{name} is not in the index's toctree"
        )
        assert f"]({page.relative_to(ROOT).as_posix()})" in readme, (
            f"README.md does not link {page.name}"
        )


@pytest.mark.parametrize(
    ("page", "sections"),
    [
        (FEATURE_PAGE, ["When it helps", "Installation", "Quick start",
                        "Configuration", "Metrics"]),
        (OPERATIONS_PAGE, ["The cache root", "Disk budget", "Eviction and expiry",
                           "Faults", "Trust and authentication",
                           "The command-line tool", "Resetting an instance's cache",
                           "KV events for routers", "Metrics", "Dashboard",
                           "Limitations"]),
        (DESIGN_PAGE, ["What is cached, per model and request", "Storage format",
                       "Processes", "Lookups", "Loads", "Asynchronous updates",
                       "Reset", "Where to look in the code"]),
        (BENCHMARKS_PAGE, ["Runs", "Plot", "Targets", "Core", "Engine", "Serving",
                           "Several instances", "Chunk size"]),
    ],
    ids=lambda x: x.stem if isinstance(x, Path) else "",
)  # fmt: skip
def test_page_has_its_sections(page: Path, sections: list[str]) -> None:
    headings = re.findall(r"^##+ (.+)$", page.read_text(), flags=re.MULTILINE)
    missing = [s for s in sections if s not in headings]
    assert not missing, f"{page.name} misses sections {missing}"


def test_relative_links_resolve() -> None:
    """Every relative link (and image) in the README and the docs names a
    file that exists, and a heading or label of it when it has an anchor."""
    broken = []
    for source in [README, *_doc_files()]:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(source.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = (source.parent / path).resolve() if path else source
            where = f"{source.relative_to(ROOT)}: {target}"
            if not file.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{where} (no such heading or label)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_named_paths_exist() -> None:
    """The repository paths the pages name in code spans (examples, scripts,
    tests, modules) exist."""
    missing = []
    for page in _doc_files():
        spans = re.findall(
            r"`((?:examples|benchmarks|tools|tests|vllm|docs)/[^`\s]*)`",
            page.read_text(),
        )
        missing += [f"{page.name}: {p}" for p in spans if not (ROOT / p).exists()]
    assert not missing, f"named in the docs but not in the tree: {missing}"


def test_benchmark_runs_state_commit_and_date() -> None:
    rows = _table(BENCHMARKS_PAGE, ["Benchmark", "Commit", "Date", "Machine"])
    machines = {
        row[0] for row in _table(BENCHMARKS_PAGE, ["Machine", "Hardware", "Software"])
    }
    for benchmark, commit, date, machine in rows:
        assert re.match(r"`[0-9a-f]{7,40}`", commit), f"{benchmark}: commit {commit}"
        assert re.fullmatch(r"\d{1,2} [A-Z][a-z]+ \d{4}", date), f"{benchmark}: {date}"
        assert machine in machines, f"{benchmark}: unknown machine {machine}"


def test_every_target_says_whether_it_is_met() -> None:
    for target, result in _table(BENCHMARKS_PAGE, ["Target", "Result"]):
        assert re.search(r"\b(met|not met|measured)\b", result), (
            f"target {target!r}: the result says neither met, not met nor measured"
        )


# ---------------------------------------------------------------------------
# Benchmark output and the plot.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plot_script() -> ModuleType:
    return load_script(PLOT_SCRIPT, "vineyard_benchmark_plot")


@pytest.fixture(scope="module")
def plot_data(plot_script: ModuleType) -> dict:
    data: dict = plot_script.load_plot_data()
    return data


def test_raw_benchmark_output_stays_out_of_the_docs() -> None:
    """Raw benchmark JSON lives in git history, not in the tree: the docs'
    assets are the plot (and whatever else is small)."""
    assets = [p for p in (DOCS / "assets").rglob("*") if p.is_file()]
    raw = [p.name for p in assets if p.suffix == ".json"]
    assert not raw, f"raw benchmark output in docs/source/assets: {raw}"
    total = sum(p.stat().st_size for p in assets)
    assert total <= MAX_ASSETS_BYTES, f"docs/source/assets holds {total} bytes"
    assert PLOT_PNG in assets


def test_plot_data_is_only_what_the_plot_draws(
    plot_script: ModuleType, plot_data: dict
) -> None:
    """``plot_data.json`` is small and holds exactly what :func:`plot_data`
    keeps of the benchmarks' output (no raw output beside the script)."""
    assert plot_script.DATA_PATH.stat().st_size <= MAX_PLOT_DATA_BYTES
    kept = plot_script.plot_data(
        plot_data["engine"], plot_data["core"], plot_data["source"]
    )
    assert kept == plot_data, "plot_data.json holds more (or other) than it draws"


def _number(cell: str) -> float:
    """The first number of a table cell (``**0.967**``, ``2.62 (0.42x)``)."""
    match = re.search(r"\d[\d,]*\.?\d*", cell)
    assert match, f"no number in {cell!r}"
    return float(match.group().replace(",", ""))


def test_plot_data_matches_the_benchmarks_page(plot_data: dict) -> None:
    """The plot shows the page's runs: each model's throughput ratios, each
    cached prompt's speedups, and the core's GB/s (the median of the
    repeats) are the page's figures, as rounded there."""
    throughput = {
        (row[0], row[1]): _number(row[3])
        for row in _table(
            BENCHMARKS_PAGE,
            ["model", "configuration", "tokens/s", "vs no cache",
             "forward thread per save", "writer CPU s/GB"],
        )
    }  # fmt: skip
    ttft_tables = _tables(
        BENCHMARKS_PAGE,
        ["prompt tokens", "recompute", "this cache", "speedup",
         "`ExampleConnector`", "speedup", "loaded / recomputed",
         "cache / floor", "peer / floor"],
    )  # fmt: skip
    models = plot_data["engine"]["models"]
    assert len(ttft_tables) == len(models)
    for model, rows in zip(models, ttft_tables, strict=True):
        name = model["model"]
        for cfg, ratio in model["throughput"]["ratio_vs_no_cache"].items():
            assert throughput[(name, cfg)] == round(ratio, 3), (name, cfg)
        plotted = [
            (r["tokens"], round(r["async"]["speedup"], 1),
             round(r["peer"]["speedup"], 1))
            for r in model["ttft"]["rows"]
        ]  # fmt: skip
        documented = [(int(_number(r[0])), _number(r[3]), _number(r[5])) for r in rows]
        assert plotted == documented, f"{name}: plotted vs documented TTFT speedups"
    core_rows = _table(
        BENCHMARKS_PAGE,
        ["repeat", "cache write", "writev+fdatasync", "cache read (checksum)",
         "cache read (keyed BLAKE3)", "readv (warm)",
         "save / one memcpy (writer idle)", "run: saves copied / skipped",
         "run: save p50 / p99 / max", "run: memcpy median / max",
         "run: p99 / one memcpy", "run: save max / memcpy max"],
    )  # fmt: skip
    columns = {"write_gbps": 1, "writev_gbps": 2, "read_gbps": 3,
               "read_keyed_gbps": 4, "readv_gbps": 5}  # fmt: skip
    for key, column in columns.items():
        median = statistics.median(_number(row[column]) for row in core_rows)
        assert median == round(plot_data["core"]["summary"][key], 2), key


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_redraws_the_docs_png(tmp_path: Path) -> None:
    """``plot.py OUT.png`` draws the docs' plot from ``plot_data.json``, as
    a user runs it: a PNG of the committed one's size."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    proc = subprocess.run(
        [sys.executable, str(PLOT_SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _png_size(out.read_bytes()) == _png_size(PLOT_PNG.read_bytes())
