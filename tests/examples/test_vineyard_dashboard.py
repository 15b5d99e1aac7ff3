# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Grafana dashboard of the vineyard cache,
``examples/observability/vineyard_cache/grafana.json``: it is well-formed
(every panel queries Prometheus through the ``datasource`` variable, counters
only through ``rate()``/``increase()``), and every metric it names is one
the cache really exports: against the names in
:mod:`vllm.worker.vineyard.metrics` (cheap), and against the live
``/metrics`` of ``vllm serve`` with the cache on, after two chats that share
a document (the server of ``tests/entrypoints/test_vineyard_serve.py``).

A metric family that exists but has no sample yet is found by its
``# TYPE`` line; a counter is queried with its ``_total`` suffix and a
histogram through ``_bucket``/``_sum``/``_count``, so a counter named
without ``_total`` (a query that returns nothing) is reported missing.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.script_testing import ROOT
from tests.vineyard_serve_testing import (
    QUESTIONS,
    STARTUP_TIMEOUT_S,
    Server,
    prepare_model,
)
from tests.vineyard_testing import engine_cpu
from vllm.worker.vineyard.metrics import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    METRIC_PREFIX,
    histogram_metric_name,
)

DASHBOARD = ROOT / "examples" / "observability" / "vineyard_cache" / "grafana.json"
METRIC_NAME = re.compile(r"vllm:[a-zA-Z0-9_:]+")
#: A metric that a range function turns into a rate.
RATED = re.compile(r"\b(?:rate|irate|increase)\(\s*(vllm:[a-zA-Z0-9_:]+)")
#: The series a query may name, by family type (``# TYPE``).
SERIES_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}
#: Sample names of counters and histograms: cumulative, so plotted only as
#: a rate.
CUMULATIVE = ("_total", "_bucket", "_sum", "_count")
#: Labels the dashboard's variables select on that the server itself sets
#: (``job`` and ``instance`` come from Prometheus's scrape).
SERVER_LABELS = ("model_name", "engine")


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but rows, also those inside a collapsed row."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """The PromQL of every panel target and query variable."""
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def metric_names(dashboard: dict[str, Any]) -> set[str]:
    """Every ``vllm:`` name in the dashboard: queries, variables and the
    panel descriptions that name their metrics."""
    return set(METRIC_NAME.findall(json.dumps(dashboard)))


def connector_series() -> set[str]:
    """The series the cache's Prometheus metrics expose, from their
    definitions."""
    series = {f"{METRIC_PREFIX}{name}_total" for name in COUNTERS}
    series |= {f"{METRIC_PREFIX}{name}" for name in GAUGES}
    series |= {
        histogram_metric_name(name) + suffix
        for name in HISTOGRAMS
        for suffix in SERIES_SUFFIXES["histogram"]
    }
    return series


@dataclass
class Exposition:
    """What a ``/metrics`` page declares (``# TYPE`` lines) and shows
    (sample lines)."""

    types: dict[str, str] = field(default_factory=dict)
    samples: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Exposition:
        page = cls()
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                family, kind = line.split()[2:4]
                page.types[family] = kind
            elif line and not line.startswith("#"):
                name = re.split(r"[{ ]", line, maxsplit=1)[0]
                page.samples.setdefault(name, []).append(line)
        return page

    def family_type(self, series: str) -> str | None:
        """The type of the family a series belongs to, if declared."""
        for family, kind in self.types.items():
            # prometheus_client declares a counter with its _total suffix.
            base = family.removesuffix("_total") if kind == "counter" else family
            if any(series == base + s for s in SERIES_SUFFIXES.get(kind, ())):
                return kind
        return None

    def missing(self, names: Iterable[str]) -> list[str]:
        """The names that are no series of this page: neither sampled nor
        the queryable series of a declared family."""
        return sorted(
            n for n in names if n not in self.samples and self.family_type(n) is None
        )


def test_dashboard_is_well_formed() -> None:
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    found = list(panels(dashboard))
    assert found
    ids = [p["id"] for p in dashboard["panels"]]
    ids += [p["id"] for row in dashboard["panels"] for p in row.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids are not unique"
    for panel in found:
        title = panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", title
        assert panel["targets"], f"{title}: no targets"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), f"{title}: {expr}"
            assert expr.count("{") == expr.count("}"), f"{title}: {expr}"
            # Every selector filters by the dashboard's variables (a target
            # without a metric is a constant line, e.g. the disk limit).
            names = METRIC_NAME.findall(expr)
            selected = expr.count('model_name=~"$model_name"')
            assert selected == len(names), f"{title}: {expr}"
            # Counters and histograms are plotted as rates, never raw.
            cumulative = Counter(n for n in names if n.endswith(CUMULATIVE))
            assert cumulative == Counter(RATED.findall(expr)), f"{title}: {expr}"


def test_names_are_the_connectors_metrics() -> None:
    """Static: every ``vllm:vineyard_cache_*`` name is a series the
    connector defines, and every metric it defines has a panel."""
    names = metric_names(load_dashboard())
    exported = connector_series()
    unknown = sorted(
        n for n in names if n.startswith(METRIC_PREFIX) and n not in exported
    )
    assert not unknown, f"not defined in vllm/worker/vineyard/metrics.py: {unknown}"
    wanted = {f"{METRIC_PREFIX}{name}_total" for name in COUNTERS}
    wanted |= {f"{METRIC_PREFIX}{name}" for name in GAUGES}
    wanted |= {histogram_metric_name(name) + "_bucket" for name in HISTOGRAMS}
    assert not wanted - names, f"no panel shows {sorted(wanted - names)}"


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory: pytest.TempPathFactory) -> Exposition:
    """``/metrics`` of ``vllm serve`` with the cache on, after a chat that
    saves a shared document and a second one that loads it."""
    model = prepare_model()
    tmp_path = tmp_path_factory.mktemp("dashboard")
    server = Server(
        "cache",
        model,
        tmp_path,
        tmp_path / "cache",
        engine_cpu(),
        # The latency histograms get samples too.
        extra_env={"VINEYARD_CACHE_METRICS_ENABLED": "1"},
    )
    try:
        server.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
        server.ask(QUESTIONS[0])
        assert server.settle(), "background writes were not reported in time"
        server.ask(QUESTIONS[1])
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
            text = r.read().decode()
    finally:
        server.stop()
    return Exposition.parse(text)


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_names_are_on_a_live_server(live_metrics: Exposition) -> None:
    dashboard = load_dashboard()
    # The check itself: an unknown name and a counter without _total (a
    # query that returns nothing) are missing.
    bogus = ["vllm:vineyard_cache_no_such_metric", f"{METRIC_PREFIX}hit_tokens"]
    assert live_metrics.missing(bogus) == sorted(bogus)

    names = metric_names(dashboard)
    missing = live_metrics.missing(names)
    assert not missing, f"the server's /metrics has no {missing}"
    # The cache was on and looked up the chats' prompts.
    queried = live_metrics.samples[f"{METRIC_PREFIX}query_tokens_total"]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in queried) > 0

    for expr in expressions(dashboard):
        # Rates only of counters and histograms, never of a gauge.
        for name in RATED.findall(expr):
            assert live_metrics.family_type(name) in ("counter", "histogram"), (
                f"rate of {name} ({live_metrics.family_type(name)}) in {expr}"
            )
    # Sampled series carry the labels the dashboard's variables select.
    for name in sorted(names & live_metrics.samples.keys()):
        for line in live_metrics.samples[name]:
            for label in SERVER_LABELS:
                assert f'{label}="' in line, f"no {label} label: {line}"
