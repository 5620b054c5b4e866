"""The gateway's HTTP metrics: labels a caller cannot grow."""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive, Scope, Send

from api_gateway.metrics import GatewayMetrics
from api_gateway.middleware import MetricsMiddleware


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _request(middleware: MetricsMiddleware, method: str) -> None:
    scope: Scope = {"type": "http", "method": method, "path": "/nowhere", "headers": []}

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        return None

    asyncio.run(middleware(scope, receive, send))


def test_a_method_no_route_serves_is_counted_as_other() -> None:
    """HTTP/1.1 lets the caller send any token as the method (uvicorn's h11 parser takes
    them all): made-up methods must not each become a series."""
    metrics = GatewayMetrics()
    middleware = MetricsMiddleware(_not_found, metrics)
    for method in ("FOOBAR", "X-1", "PROPFIND", "GET"):
        _request(middleware, method)
    methods = {
        sample.labels["method"]
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == "sift_http_requests_total"
    }
    assert methods == {"GET", "other"}


def test_a_request_that_waited_its_longest_wait_lands_in_a_finite_bucket() -> None:
    """``?wait=`` holds a request up to MAX_WAIT_SECONDS; it answers a moment after. Those
    requests must not all read as +Inf."""
    from worker.constants import MAX_WAIT_SECONDS

    metrics = GatewayMetrics()
    metrics.duration.labels("POST", "/v1/searches").observe(MAX_WAIT_SECONDS + 0.05)
    finite = [
        float(sample.labels["le"])
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == "sift_http_request_duration_seconds_bucket"
        and sample.labels["le"] != "+Inf"
        and sample.value >= 1
    ]
    assert finite and min(finite) <= 4 * MAX_WAIT_SECONDS
