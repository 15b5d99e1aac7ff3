# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Grafana dashboard of the vineyard cache,
``examples/observability/vineyard_cache/grafana.json``: it is well-formed
(every panel queries Prometheus through the ``datasource`` variable, counters
only through ``rate()``/``increase()``), and every metric it names is one
the cache really exports: against the names in
:mod:`vllm.worker.vineyard.metrics` (cheap), and against the live
``/metrics`` of ``vllm serve`` with the cache on, after three chats that share
a document (the server of ``tests/entrypoints/test_vineyard_serve.py``).

A metric family that exists but has no sample yet is found by its
``# TYPE`` line; a counter is queried with its ``_total`` suffix and a
histogram through ``_bucket``/``_sum``/``_count``, so a counter named
without ``_total`` (a query that returns nothing) is reported missing.

And on a real Prometheus (Debian's ``prometheus``, installed by
``tools/setup_env.sh``; skipped where it is missing) that scrapes that
server every second while it serves three chats (the second and third hit
the first's document): the dashboard's variables are resolved as Grafana
does (``label_values()`` through the label values API, "All" as a regex of
every value), and every panel's every query is evaluated, as a range query
over the chats (what a time series panel plots: a non-empty matrix) and, for
stat panels, also as an instant query just after the last hit (a vector).
Metrics are rated only if Prometheus's metadata calls them counters or
histograms, every selector selects the server's series, and a quantile is a
number wherever its histogram had observations.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.examples.prometheus_testing import (
    SCRAPE_INTERVAL_S,
    Prometheus,
    PrometheusError,
    prometheus_binary,
)
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

#: Metrics a panel shows that the live server may not export (yet), each
#: with why: the queries of panels that name one are skipped, saying so,
#: where Prometheus has no series of it (any other absent metric fails).
ALLOWED_ABSENT: dict[str, str] = {
    f"{METRIC_PREFIX}load_us_per_token": "published once the load-cost "
    "estimator has timed a load (new; may not be published yet)",
    f"{METRIC_PREFIX}compute_us_per_token": "published once the load-cost "
    "estimator has timed a step (new; may not be published yet)",
}
#: Queries (panel title, refId) that return no data on the test's server
#: by design, each with why; they are still evaluated (a valid query) and
#: their selectors must select the server's series.
ALLOWED_EMPTY: dict[tuple[str, str], str] = {
    ("Hit rate", "C"): "the test's server runs with --no-enable-prefix-caching "
    "(so vineyard is asked for every prompt token): vLLM's prefix cache counts "
    "no queries, and the ratio's `> 0` guard leaves nothing",
}
#: What Grafana would substitute for its built-in variables (the range and
#: its length are the query window's, see PromRun).
RATE_INTERVAL = "15s"  # Grafana: at least 4 scrape intervals
STEP_S = 1
#: Panels that show one value (of an instant query, or the last of a range).
SINGLE_VALUE_PANELS = ("stat", "gauge", "bargauge")
#: A metric name and its label matchers.
SELECTOR = re.compile(r"(vllm:[a-zA-Z0-9_:]+)(\{[^}]*\})?")
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$", re.DOTALL)
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


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


def dashboard_targets() -> list[Any]:
    """One test parameter per panel query: (panel id, refId)."""
    try:
        dashboard = load_dashboard()
    except (OSError, ValueError):
        return []  # test_dashboard_is_well_formed says why
    params = []
    for panel in panels(dashboard):
        slug = re.sub(r"\W+", "_", panel["title"]).strip("_")
        for target in panel.get("targets", []):
            ref_id = target["refId"]
            params.append(
                pytest.param(panel["id"], ref_id, id=f"{panel['id']}-{slug}-{ref_id}")
            )
    return params


def test_allowed_gaps_name_the_dashboards_queries() -> None:
    """The allowed-absent metrics and allowed-empty queries exist in the
    dashboard (the lists do not outlive what they excuse)."""
    dashboard = load_dashboard()
    names = metric_names(dashboard)
    assert not ALLOWED_ABSENT.keys() - names
    queries = {
        (p["title"], t["refId"]) for p in panels(dashboard) for t in p["targets"]
    }
    assert not ALLOWED_EMPTY.keys() - queries


@dataclass
class LiveRun:
    """What the live server's run left: its ``/metrics`` after the chats
    and, where Prometheus could run, the Prometheus that scraped it."""

    metrics: Exposition
    server_port: int
    prometheus: Prometheus | None = None
    #: Why the Prometheus checks are skipped (no ``prometheus`` binary).
    prometheus_missing: str = ""
    #: Why they fail (a Prometheus that did not start or scrape).
    prometheus_failed: str = ""
    #: Unix times: the first chat's start; the last scrape Prometheus had
    #: made (a few after it had the chats' final counts).
    chats_start: float = 0.0
    scraped_until: float = 0.0
    #: Prometheus's metric metadata, read while the server was up:
    #: {metric family: type}.
    metadata: dict[str, str] = field(default_factory=dict)


def sample_total(page: Exposition, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.samples.get(name, []))


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise PrometheusError(f"Prometheus: {what} not within {timeout_s} s")
        time.sleep(0.25)


def wait_scraped_before_chats(prometheus: Prometheus) -> None:
    """The server's counters scraped twice, so the chats' increases are
    rates (a first sample already counting them would hide them)."""
    sel = f'{{job="{prometheus.job}"}}'
    series = f"sum(count_over_time({METRIC_PREFIX}query_tokens_total{sel}[1m]))"
    wait_for(
        lambda: (
            prometheus.value(f"up{sel}") == 1 and (prometheus.value(series) or 0) >= 2
        ),
        "two scrapes of the server's vineyard counters",
    )


def wait_scraped_after_chats(prometheus: Prometheus, page: Exposition) -> float:
    """Wait until Prometheus has the chats' final counts (those of the
    server's ``/metrics`` after them), then for a few more scrapes; the
    time of the last one."""
    sel = f'{{job="{prometheus.job}"}}'
    finals = {
        name: sample_total(page, f"{METRIC_PREFIX}{name}_total")
        for name in ("query_tokens", "hit_tokens")
    }
    wait_for(
        lambda: all(
            prometheus.value(f"sum({METRIC_PREFIX}{name}_total{sel})") == total
            for name, total in finals.items()
        ),
        f"the chats' final counts {finals}",
    )
    after = time.time() + 3 * SCRAPE_INTERVAL_S
    last: list[float] = []

    def scraped_since() -> bool:
        stamp = prometheus.value(f"max(timestamp(up{sel} == 1))")
        last[:] = [stamp or 0.0]
        return stamp is not None and stamp >= after

    wait_for(scraped_since, "three more scrapes")
    return last[0]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    """``vllm serve`` with the cache on, scraped every second by a real
    Prometheus where one is installed, through three chats: the first
    saves a shared document, the second (another question) and the third
    (the first again) load it. ``/metrics`` is read after them; Prometheus
    is kept, with what it scraped, for the module's tests."""
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
    binary = prometheus_binary()
    prometheus: Prometheus | None = None
    run = LiveRun(Exposition(), server.port)
    try:
        try:
            if binary is None:
                run.prometheus_missing = (
                    "no `prometheus` binary on PATH (Debian's prometheus "
                    "package; tools/setup_env.sh installs it where apt-get works)"
                )
            else:
                prom_dir = tmp_path / "prometheus"
                prom_dir.mkdir()
                # Started beside the server: it scrapes it once it is up.
                prometheus = Prometheus(binary, f"127.0.0.1:{server.port}", prom_dir)
            server.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
            if prometheus is not None:
                try:
                    prometheus.wait_ready()
                    wait_scraped_before_chats(prometheus)
                except PrometheusError as e:
                    run.prometheus_failed = f"{e}\n{prometheus.log()}"
            run.chats_start = time.time()
            server.ask(QUESTIONS[0])
            assert server.settle(), "background writes were not reported in time"
            server.ask(QUESTIONS[1])
            server.ask(QUESTIONS[0])  # the same prompt again
            with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
                run.metrics = Exposition.parse(r.read().decode())
            if prometheus is not None and not run.prometheus_failed:
                try:
                    run.scraped_until = wait_scraped_after_chats(
                        prometheus, run.metrics
                    )
                    run.metadata = {
                        family: entries[0]["type"]
                        for family, entries in prometheus.api("metadata")[
                            "data"
                        ].items()
                    }
                except PrometheusError as e:
                    run.prometheus_failed = f"{e}\n{prometheus.log()}"
        finally:
            server.stop()
        run.prometheus = prometheus
        yield run
    finally:
        if prometheus is not None:
            prometheus.stop()


@pytest.fixture(scope="module")
def live_metrics(live: LiveRun) -> Exposition:
    """``/metrics`` of ``vllm serve`` with the cache on, after a chat that
    saves a shared document and two that load it."""
    return live.metrics


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


@dataclass
class PromRun:
    """The Prometheus that scraped the live server, and the dashboard's
    variables as Grafana would substitute them for that server."""

    prometheus: Prometheus
    metadata: dict[str, str]
    #: The range queries' window (unix times): the chats and the scrapes
    #: after them, at least a minute.
    start: float
    end: float
    #: The instant queries' time: just after the last hit was scraped (the
    #: rate windows hold the chats' increases).
    evaluated_at: float
    #: {name: text substituted for ``$name``}.
    variables: dict[str, str] = field(default_factory=dict)
    #: {name: values} of the query variables (``label_values()``).
    variable_values: dict[str, list[str]] = field(default_factory=dict)

    def substitute(self, expr: str) -> str:
        def value(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            assert name in self.variables, f"unknown variable ${name} in {expr}"
            return self.variables[name]

        return VARIABLE.sub(value, expr)

    def resolve_variables(self, dashboard: dict[str, Any]) -> None:
        """Grafana's built-ins, then the dashboard's variables in order
        (each query may use those before it), every query variable on its
        default "All": a regex of all its values."""
        range_s = math.ceil(self.end - self.start)
        self.variables = {
            "__rate_interval": RATE_INTERVAL,
            "__interval": f"{STEP_S}s",
            "__interval_ms": str(1000 * STEP_S),
            "__range": f"{range_s}s",
            "__range_s": str(range_s),
            "__range_ms": str(1000 * range_s),
        }
        for var in dashboard["templating"]["list"]:
            name = var["name"]
            if var["type"] == "datasource":
                continue  # no query names it
            if var["type"] != "query":
                self.variables[name] = str(var["current"]["value"])
                continue
            query = var["query"]
            query = query["query"] if isinstance(query, dict) else query
            match = LABEL_VALUES.match(query)
            assert match, f"${name}: not a label_values() query: {query}"
            selector, label = match.groups()
            answer = self.prometheus.api(
                f"label/{label}/values",
                **{"match[]": self.substitute(selector)},
                start=self.start,
                end=self.end,
            )
            assert answer["status"] == "success", f"${name}: {answer}"
            values = answer["data"]
            self.variable_values[name] = values
            # Grafana's "All" of a multi-value variable: (a|b), each value
            # escaped for a regex inside a PromQL string.
            escaped = [re.escape(v).replace("\\", "\\\\") for v in values]
            self.variables[name] = "(" + "|".join(escaped) + ")"

    def family_type(self, name: str) -> str | None:
        """The type Prometheus's metadata gives the family of a series."""
        if name in self.metadata:
            return self.metadata[name]
        for suffix in SERIES_SUFFIXES["histogram"]:
            if name.endswith(suffix) and name.removesuffix(suffix) in self.metadata:
                return self.metadata[name.removesuffix(suffix)]
        return None

    def series(self, selector: str) -> list[dict[str, str]]:
        answer = self.prometheus.api(
            "series", **{"match[]": selector}, start=self.start, end=self.end
        )
        assert answer["status"] == "success", f"{selector}: {answer}"
        return answer["data"]

    def query_range(self, expr: str) -> dict[str, Any]:
        return self.prometheus.query_range(expr, self.start, self.end, STEP_S)


@pytest.fixture(scope="module")
def prom(live: LiveRun) -> PromRun:
    if live.prometheus is None:
        pytest.skip(live.prometheus_missing)
    if live.prometheus_failed:
        pytest.fail(live.prometheus_failed)
    end = live.scraped_until
    start = min(live.chats_start - 10, end - 60)
    # When the hits were scraped: the first sample with the final count.
    hits = f"{METRIC_PREFIX}hit_tokens_total"
    final_hits = sample_total(live.metrics, hits)
    assert final_hits > 0, "the chats had no hits"
    answer = live.prometheus.query_range(
        f'sum({hits}{{job="{live.prometheus.job}"}})', start, end, STEP_S
    )
    assert answer["status"] == "success", answer
    hit_at = min(
        float(t)
        for s in answer["data"]["result"]
        for t, v in s["values"]
        if float(v) >= final_hits
    )
    run = PromRun(
        live.prometheus,
        live.metadata,
        start,
        end,
        evaluated_at=min(hit_at + 2 * SCRAPE_INTERVAL_S, end),
    )
    run.resolve_variables(load_dashboard())
    return run


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_variables_list_the_live_server(prom: PromRun, live: LiveRun) -> None:
    """Job, Model, Instance and Engine list the server (one each)."""
    assert prom.variable_values == {
        "job": [prom.prometheus.job],
        "model_name": ["smollm2"],  # --served-model-name
        "instance": [f"127.0.0.1:{live.server_port}"],
        "engine": ["0"],
    }


def check_quantiles(
    prom: PromRun, expr: str, where: str, matrix: list[dict[str, Any]]
) -> None:
    """Every histogram a quantile reads has ``le`` buckets, observations
    in the window, and the quantile is a number wherever the rate window
    held observations."""
    buckets = [(n, m) for n, m in SELECTOR.findall(expr) if n.endswith("_bucket")]
    assert buckets, f"{where}: histogram_quantile() of no _bucket series"
    quantiles = {t: float(v) for s in matrix for t, v in s["values"]}
    for name, matchers in buckets:
        les = {s.get("le") for s in prom.series(name + matchers)}
        assert "+Inf" in les and len(les - {None}) > 1, f"{where}: {name} le={les}"
        count = name.removesuffix("_bucket") + "_count" + matchers
        answer = prom.query_range(f"sum(rate({count}[{RATE_INTERVAL}]))")
        observed = [
            t for s in answer["data"]["result"] for t, v in s["values"] if float(v) > 0
        ]
        assert observed, f"{where}: no observations of {count}"
        not_numbers = [(t, quantiles.get(t)) for t in observed]
        not_numbers = [(t, q) for t, q in not_numbers if q is None or math.isnan(q)]
        assert not not_numbers, f"{where}: no quantile where observed: {not_numbers}"


@pytest.mark.engine
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("panel_id", "ref_id"), dashboard_targets())
def test_query_on_prometheus(prom: PromRun, panel_id: int, ref_id: str) -> None:
    """One panel query, evaluated by Prometheus after the dashboard's
    variables are substituted: valid, on the server's series, with data of
    the type its panel shows."""
    panel = next(p for p in panels(load_dashboard()) if p["id"] == panel_id)
    target = next(t for t in panel["targets"] if t["refId"] == ref_id)
    expr = prom.substitute(target["expr"])
    where = f"{panel['title']} ({panel['type']}) {ref_id}: {expr}"

    names = list(dict.fromkeys(METRIC_NAME.findall(expr)))
    absent = [n for n in names if not prom.series(n)]
    unexcused = [n for n in absent if n not in ALLOWED_ABSENT]
    assert not unexcused, f"{where}: the live server has no {unexcused}"
    if absent:
        reasons = "; ".join(f"{n}: {ALLOWED_ABSENT[n]}" for n in absent)
        pytest.skip(f"{panel['title']} {ref_id}: not on the live server: {reasons}")
    # Rates only of what Prometheus knows as counters or histograms, and a
    # metric used raw is a gauge.
    rated = set(RATED.findall(expr))
    for name in names:
        kind = prom.family_type(name)
        wanted = ("counter", "histogram") if name in rated else ("gauge",)
        assert kind in wanted, f"{where}: {name} is a {kind}, used as {wanted}"
    # The variables' labels select the server's series (no wrong label).
    for name, matchers in SELECTOR.findall(expr):
        assert prom.series(name + matchers), f"{where}: {name}{matchers} selects none"

    answer = prom.query_range(expr)
    assert answer["status"] == "success", f"{where}: {answer}"
    assert answer["data"]["resultType"] == "matrix", where
    matrix = answer["data"]["result"]
    excuse = ALLOWED_EMPTY.get((panel["title"], ref_id))
    if not matrix and excuse is not None:
        pytest.skip(f"{panel['title']} {ref_id}: no data, as expected: {excuse}")
    assert matrix, f"{where}: no data over the chats"
    values = [float(v) for s in matrix for _, v in s["values"]]
    assert any(math.isfinite(v) for v in values), f"{where}: only {set(values)}"
    if "histogram_quantile" in expr:
        check_quantiles(prom, expr, where, matrix)

    if panel["type"] in SINGLE_VALUE_PANELS:
        answer = prom.prometheus.query(expr, at=prom.evaluated_at)
        assert answer["status"] == "success", f"{where}: {answer}"
        kind, result = answer["data"]["resultType"], answer["data"]["result"]
        assert kind in ("vector", "scalar"), f"{where}: an instant {kind}"
        values = [float(result[1])] if kind == "scalar" else []
        values += [float(s["value"][1]) for s in result] if kind == "vector" else []
        assert values, f"{where}: no value just after the last hit"
        assert all(math.isfinite(v) for v in values), f"{where}: {values}"
    else:
        assert panel["type"] == "timeseries", f"{where}: a {panel['type']} panel"
