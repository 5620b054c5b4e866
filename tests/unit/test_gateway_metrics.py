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


def test_every_path_of_the_openapi_document_has_its_server_errors_at_zero() -> None:
    """The app makes each route's 500 and 503 at zero from the routers it includes: a router
    left out of that list would have its first 5xx read as no increase."""
    from api_gateway.app import create_app
    from api_gateway.metrics import SERVER_ERRORS
    from worker.settings import Settings

    app = create_app(Settings(redis_url="redis://127.0.0.1:9/0"))
    made = {
        (sample.labels["method"], sample.labels["route"], sample.labels["status"])
        for family in app.state.metrics.registry.collect()
        for sample in family.samples
        if sample.name == "sift_http_requests_total" and sample.value == 0
    }
    paths = app.openapi()["paths"]
    operations = {(method.upper(), path) for path in paths for method in paths[path]}
    assert made == {(*operation, status) for operation in operations for status in SERVER_ERRORS}
