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
