"""The gateway's Prometheus metrics, in a registry of its own per app."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from worker.constants import (
    METRIC_HTTP_DURATION,
    METRIC_HTTP_REQUESTS,
    METRIC_JOBS_IN_FLIGHT,
    METRIC_JOBS_SUBMITTED,
)


class InFlightCollector(Collector):
    """``sift_jobs_in_flight{state}``: searches and batch items queued or running, at scrape."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            METRIC_JOBS_IN_FLIGHT,
            "Searches and batch items not yet final, by state.",
            labels=["state"],
        )
        try:
            counts = self._read()
        except Exception:  # a scrape must not fail because Redis is down
            counts = {}
        for state in ("queued", "running"):
            if state in counts:
                family.add_metric([state], counts[state])
        yield family


class GatewayMetrics:
    def __init__(self, in_flight: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            METRIC_HTTP_REQUESTS,
            "HTTP requests answered, by route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            METRIC_HTTP_DURATION,
            "Seconds to answer one HTTP request, by route template.",
            ["method", "route"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30),
        )
        self.submitted = Counter(
            METRIC_JOBS_SUBMITTED,
            "Jobs accepted, by kind (search, batch_item, ingest).",
            ["kind"],
            registry=self.registry,
        )
        self.registry.register(InFlightCollector(in_flight))
