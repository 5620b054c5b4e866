"""The gateway's own HTTP metrics, in a registry per app; the §9 ones are in
worker.observability.metrics."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi.routing import APIRoute, APIRouter
from prometheus_client import CollectorRegistry, Counter, Histogram

from worker.constants import METRIC_HTTP_DURATION, METRIC_HTTP_REQUESTS

# The server errors the gateway answers: 500 internal_error, 503 (unavailable, job_store_full,
# starting). Each route's are made at zero at start, so its first one shows in rate().
SERVER_ERRORS = ("500", "503")


class GatewayMetrics:
    """Requests by method, route template and status, and their latency."""

    def __init__(self) -> None:
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
            # past 30 s: a request that waited its longest ``?wait=`` (30 s) answers just after
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30, 60),
        )

    def preregister(self, routers: Iterable[APIRouter]) -> None:
        """Create each route's server-error series at zero: ``rate()`` and ``increase()``
        count a series from its first sample, so a route's first 5xx since the gateway
        started read 0. By the methods each route declares (a ``HEAD`` is left to its first)."""
        for api in routers:
            for route in api.routes:
                if isinstance(route, APIRoute):
                    for method in route.methods or ():
                        for status in SERVER_ERRORS:
                            self.requests.labels(method, route.path_format, status)
