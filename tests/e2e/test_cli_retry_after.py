"""The CLI waits out a ``Retry-After`` in either of its forms (RFC 9110 10.2.3), through a
proxy in front of the real gateway that answers the first read ``503`` with one: a proxy or
a load balancer is free to give an HTTP-date, which the CLI read as no ``Retry-After`` at
all and retried on its own backoff (a quarter of a second) instead."""

from __future__ import annotations

import http.server
import time
from collections.abc import Callable, Iterator
from email.utils import formatdate

import httpx
import pytest
from typer.testing import CliRunner

from tests.e2e.conftest import ACME, Stack
from tests.services import free_port, served
from worker.cli import app
from worker.cli._http import MAX_RETRY_AFTER_SECONDS, _retry_after

WAIT_SECONDS = 3


class _Proxy(http.server.ThreadingHTTPServer):
    def __init__(self, target: str, form: str) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.target = target
        self.form = form
        self.arrivals: list[float] = []  # when each GET /v1/indexes came
        self.until = 0.0  # the time the 503's Retry-After named


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Proxy

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.server.arrivals.append(time.time())
        if len(self.server.arrivals) == 1:
            # an HTTP-date has whole seconds: the next whole second past the wait
            self.server.until = float(int(time.time()) + WAIT_SECONDS + 1)
            if self.server.form == "date":
                value = formatdate(self.server.until, usegmt=True)
            else:
                value = str(WAIT_SECONDS + 1)
                self.server.until = time.time() + WAIT_SECONDS + 1
            body = b'{"error": {"type": "unavailable", "message": "restarting"}}'
            self.send_response(503)
            self.send_header("retry-after", value)
        else:
            headers = {"authorization": self.headers["authorization"]}
            answer = httpx.get(self.server.target + self.path, headers=headers, timeout=30)
            body = answer.content
            self.send_response(answer.status_code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def proxy(stack: Stack, request: pytest.FixtureRequest) -> Iterator[_Proxy]:
    with served(_Proxy(stack.live_url, request.param)) as server:
        yield server


@pytest.mark.parametrize("proxy", ["date", "seconds"], indirect=True)
def test_sift_waits_out_a_retry_after_in_either_form(
    stack: Stack, proxy: _Proxy, corpus: object
) -> None:
    """``sift indexes`` through a ``503`` whose ``Retry-After`` names a time 4 s ahead (as
    an HTTP-date, or as seconds): its second request comes no earlier than that time, and
    the command lists the indexes. A lower bound only: a loaded machine makes it later."""
    key = ACME["Authorization"].split()[1]
    env = {"SIFT_URL": proxy_url(proxy), "SIFT_API_KEY": key, "COLUMNS": "200", "NO_COLOR": "1"}
    result = CliRunner().invoke(app, ["indexes"], env=env)
    assert result.exit_code == 0, result.output
    assert "docs" in result.output, result.output
    assert len(proxy.arrivals) == 2, proxy.arrivals
    assert proxy.arrivals[1] >= proxy.until, (proxy.arrivals[1] - proxy.until, proxy.form)


def proxy_url(proxy: _Proxy) -> str:
    host, port = proxy.server_address[:2]
    return f"http://{host!s}:{port}"


def _an_hour_ago() -> str:
    return formatdate(time.time() - 3600, usegmt=True)


def _in_an_hour() -> str:
    return formatdate(time.time() + 3600, usegmt=True)


# Dates are made when the test runs, not when it is collected: pytest-xdist's workers must
# collect the same test ids, and a date in an id differs by the second between them.
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (lambda: "2", 2.0),
        (_an_hour_ago, 0.0),  # already past
        (_in_an_hour, MAX_RETRY_AFTER_SECONDS),  # capped
        (lambda: "-1", None),
        (lambda: "soon", None),
        (lambda: "Wed, 21 Oct 99999999999999999999 07:28:00 GMT", None),  # raised OverflowError
    ],
    ids=["seconds", "past-date", "far-date", "negative", "not-a-time", "year-past-any-clock"],
)
def test_a_retry_after_is_read_in_either_form_and_capped(
    value: Callable[[], str], expected: float | None
) -> None:
    assert _retry_after(httpx.Response(503, headers={"retry-after": value()})) == expected
