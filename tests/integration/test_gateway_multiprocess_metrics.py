"""The gateway's ``/metrics`` in multiprocess mode, as the Docker image runs it.

``deploy/Dockerfile`` sets ``PROMETHEUS_MULTIPROC_DIR`` for every container, the gateway's
included, so prometheus-client keeps every value of the gateway process in files there, its
own HTTP metrics too. A real gateway under uvicorn with that variable set, a real
redis-server, ``promtool check metrics`` and a real Prometheus scraping it: each metric must
appear once.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.prometheus_support import (
    Prometheus,
    promtool_binary,
    requires_prometheus,
    run_prometheus,
)
from tests.services import gateway, redis_server
from worker.constants import PROMETHEUS_JOB_GATEWAY

pytestmark = [
    pytest.mark.integration,
    requires_prometheus(promtool=True),
]

KEY = {"key": "acme-key-0001", "tenant": "acme", "webhook_secret": "whsec_YWNtZQ=="}
JOB = PROMETHEUS_JOB_GATEWAY


@dataclass
class Scraped:
    text: str
    prometheus: Prometheus
    directory: Path


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    tmp = tmp_path_factory.mktemp("gateway-multiproc")
    (tmp / "multiproc").mkdir()
    with redis_server(tmp / "redis") as redis_url:
        env = {
            "SIFT_API_KEYS": json.dumps([KEY]),
            "SIFT_REDIS_URL": f"{redis_url}/0",
            "SIFT_DATA_DIR": str(tmp / "data"),
            "PROMETHEUS_MULTIPROC_DIR": str(tmp / "multiproc"),  # as deploy/Dockerfile sets it
        }
        with gateway(tmp, env, "gateway") as url:
            for _ in range(3):
                assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
            targets = {JOB: [url.removeprefix("http://")]}
            with run_prometheus(tmp / "prometheus", targets) as prometheus:
                prometheus.wait_for_scrapes(JOB, 2)
                text = httpx.get(f"{url}/metrics", timeout=10).text
                yield Scraped(text, prometheus, tmp / "multiproc")


def test_each_metric_family_is_exposed_once(scraped: Scraped) -> None:
    helps = Counter(re.findall(r"^# HELP (\S+) ", scraped.text, re.MULTILINE))
    assert helps["sift_http_requests_total"] == 1
    assert [name for name, n in helps.items() if n > 1] == []


def test_promtool_accepts_the_exposition(scraped: Scraped) -> None:
    binary = promtool_binary()
    assert binary is not None
    checked = subprocess.run(
        [binary, "check", "metrics"], input=scraped.text, capture_output=True, text=True
    )
    assert "parsing error" not in checked.stdout + checked.stderr, checked.stderr


def test_prometheus_stores_the_gateways_requests(scraped: Scraped) -> None:
    healthz = scraped.prometheus.values(
        'sift_http_requests_total{route="/healthz",status="200"}', by="route"
    )
    assert healthz == {"/healthz": 3.0}
    assert scraped.prometheus.values(f'up{{job="{JOB}"}}') == {"": 1.0}


def test_the_gateway_did_run_in_multiprocess_mode(scraped: Scraped) -> None:
    assert list(scraped.directory.glob("counter_*.db"))


def test_the_gateway_makes_a_missing_metrics_folder(tmp_path: Path) -> None:
    """deploy/k8s mounts an emptyDir at /tmp (the root filesystem is read-only), which hides
    the /tmp/sift-metrics the Dockerfile made: the gateway's PROMETHEUS_MULTIPROC_DIR names a
    folder that does not exist. The gateway must make it and serve, not fail its first metric
    (FileNotFoundError in preregister) and never come up."""
    folder = tmp_path / "tmp" / "sift-metrics"  # its parent exists, as the emptyDir /tmp does
    folder.parent.mkdir()
    with redis_server(tmp_path / "redis") as redis_url:
        env = {
            "SIFT_API_KEYS": json.dumps([KEY]),
            "SIFT_REDIS_URL": f"{redis_url}/0",
            "SIFT_DATA_DIR": str(tmp_path / "data"),
            "PROMETHEUS_MULTIPROC_DIR": str(folder),
        }
        with gateway(tmp_path, env, "gateway") as url:
            assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
            text = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'sift_http_requests_total{method="GET",route="/healthz",status="200"}' in text
    assert list(folder.glob("counter_*.db"))
