# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The cache's metrics as vLLM publishes them: connector stats (summed
across steps and ranks, in ``LLM.get_metrics()`` and the periodic log line)
and Prometheus metrics (``vllm:vineyard_cache_*`` on ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm.worker.vineyard.metrics import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    METRIC_PREFIX,
    histogram_metric_name,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5]
_BUCKETS += [1.0, 2.5, 5.0, 10.0]


@dataclass
class VineyardConnectorStats(KVConnectorStats):
    """Counters (summed), gauges (the largest: each rank's writer samples
    the same root) and timings (concatenated)."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)
        for name in HISTOGRAMS:
            self.data.setdefault(name, [])

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        for name in GAUGES:
            if name in other.data:
                self.data[name] = max(self.data.get(name, 0), other.data[name])
        for name in HISTOGRAMS:
            self.data[name] = self.data[name] + list(other.data.get(name, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            name: self.data[name] for name in COUNTERS if self.data[name]
        }
        if self.data["query_tokens"]:
            out["hit_rate"] = round(
                self.data["hit_tokens"] / self.data["query_tokens"], 3
            )
        for name in GAUGES:
            if name in self.data:
                out[name] = self.data[name]
        for name in HISTOGRAMS:
            values = self.data[name]
            if values:
                out[f"{name}_avg_ms"] = round(1000 * sum(values) / len(values), 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in [*COUNTERS, *HISTOGRAMS]) and (
            not any(name in self.data for name in GAUGES)
        )


class VineyardPromMetrics(KVConnectorPromMetrics):
    """``vllm:vineyard_cache_*`` counters, gauges and histograms on
    ``/metrics``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(metric: Any) -> dict[int, Any]:
            return {
                idx: metric.labels(*values)
                for idx, values in per_engine_labelvalues.items()
            }

        self._counters = {
            name: per_engine(
                self._counter_cls(
                    name=METRIC_PREFIX + name, documentation=doc, labelnames=labelnames
                )
            )
            for name, doc in COUNTERS.items()
        }
        gauge_cls: Any = self._gauge_cls
        self._gauges = {
            name: per_engine(
                gauge_cls(
                    name=METRIC_PREFIX + name,
                    documentation=doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                )
            )
            for name, doc in GAUGES.items()
        }
        histogram_cls: Any = self._histogram_cls
        self._histograms = {
            name: per_engine(
                histogram_cls(
                    name=histogram_metric_name(name),
                    documentation=doc,
                    buckets=_BUCKETS,
                    labelnames=labelnames,
                )
            )
            for name, doc in HISTOGRAMS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, counters in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counters[engine_idx].inc(value)
        for name, gauges in self._gauges.items():
            if name in transfer_stats_data:
                gauges[engine_idx].set(transfer_stats_data[name])
        for name, histograms in self._histograms.items():
            for value in transfer_stats_data.get(name, []):
                histograms[engine_idx].observe(value)
