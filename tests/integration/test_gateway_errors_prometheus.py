"""A gateway's first 5xx on a route, read through a real Prometheus.

``rate()`` and ``increase()`` count a series from its first sample: a
``sift_http_requests_total`` series that first appears at its first request (1) shows no
increase at all, so a route's first 503 after a gateway start read 0. The gateway makes each
route's server-error series at zero when it starts, as a worker does its own.

The real stack: redis-server, the gateway (``sift gateway``), and a real ``prometheus``
scraping it every second; Redis is then stopped, and ``/readyz`` answers 503.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from api_gateway.metrics import SERVER_ERRORS
from tests.prometheus_support import requires_prometheus, run_prometheus
from tests.services import gateway, redis_server
from worker.constants import PROMETHEUS_JOB_GATEWAY

pytestmark = [pytest.mark.integration, requires_prometheus()]

JOB = PROMETHEUS_JOB_GATEWAY
KEY = {"key": "acme-key-0001", "tenant": "acme", "webhook_secret": "whsec_YWNtZQ=="}
READYZ_503 = 'sift_http_requests_total{route="/readyz",status="503"}'


@pytest.mark.timeout(180)
def test_a_gateway_s_first_503_shows_in_increase(tmp_path: Path) -> None:
    with ExitStack() as redis:
        redis_url = redis.enter_context(redis_server(tmp_path / "redis"))
        env = {
            "SIFT_API_KEYS": json.dumps([KEY]),
            "SIFT_REDIS_URL": f"{redis_url}/0",
            "SIFT_DATA_DIR": str(tmp_path / "data"),
        }
        with (
            gateway(tmp_path, env) as url,
            run_prometheus(tmp_path / "prometheus", {JOB: [url.removeprefix("http://")]}) as prom,
        ):
            prom.wait_for_scrapes(JOB, 2)  # the gateway as it started, before any 5xx
            at_start = prom.query('sift_http_requests_total{status=~"5.."}')
            redis.close()  # Redis stops: the gateway is not ready
            assert httpx.get(f"{url}/readyz", timeout=30).status_code == 503
            prom.wait_for_value(f"sum({READYZ_503})", 1.0)
            prom.wait_for_more_scrapes(JOB)
            increase = prom.values(f"sum(increase({READYZ_503}[10m]))")[""]
            [series] = prom.query(f"{READYZ_503}[10m]")
    samples = [float(value) for _, value in series["values"]]
    # the series was there at zero before the 503: Prometheus counts it
    assert samples[0] == 0.0 and samples[-1] == 1.0
    assert 1.0 <= increase < 1.5, increase  # extrapolated past the last scrape, at most
    five_xx = {
        (s["metric"]["method"], s["metric"]["route"], s["metric"]["status"]) for s in at_start
    }
    assert {float(s["value"][1]) for s in at_start} == {0.0}
    assert {("GET", "/readyz", status) for status in SERVER_ERRORS} <= five_xx
    assert {("POST", "/v1/searches", status) for status in SERVER_ERRORS} <= five_xx
    assert {status for _, _, status in five_xx} == set(SERVER_ERRORS)
    assert not any(method == "HEAD" for method, _, _ in five_xx)
