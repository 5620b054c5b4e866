"""A Redis that accepts connections and never answers, seen by a real Prometheus at its
default scrape timeout (10 s), as deploy/prometheus/prometheus.yml leaves it.

The gateway's ``/metrics`` reads the backlog and the queued jobs from Redis, and reports them
``NaN`` when it cannot: ``SiftBacklogUnknown`` (critical) reads that. Its reads waited the
gateway's ``SIFT_GATEWAY_REDIS_TIMEOUT_SECONDS`` (10 s) for a silent Redis, so every scrape
took just past 10 s and Prometheus gave up on it: ``up`` read 0, no ``NaN`` was ever scraped,
and only ``SiftGatewayScrapeFailing`` (a warning naming a gateway down or a token refused)
fired. Redis is SIGSTOPped here, as a hung or cut-off Redis is silent.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
import yaml

from tests.prometheus_support import RULES, requires_prometheus, run_prometheus, wait_until
from tests.reliability.support import KEYS
from tests.services import gateway, redis_server
from worker.constants import PROMETHEUS_JOB_GATEWAY

pytestmark = [pytest.mark.integration, requires_prometheus()]

JOB = PROMETHEUS_JOB_GATEWAY
# the shortest interval Prometheus's default 10 s scrape timeout allows
INTERVAL = "10s"
[BACKLOG_UNKNOWN] = [
    rule["expr"]
    for group in yaml.safe_load(RULES.read_text())["groups"]
    for rule in group["rules"]
    if rule.get("alert") == "SiftBacklogUnknown"
]


@contextmanager
def silent(url: str) -> Iterator[None]:
    """redis-server stopped (SIGSTOP): its connections stay open, nothing answers."""
    pid = int(redis.Redis.from_url(url).info("server")["process_id"])
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.timeout(240)
def test_a_silent_redis_is_scraped_as_an_unknown_backlog(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as url:
        env = {
            "SIFT_REDIS_URL": url + "/0",
            "SIFT_API_KEYS": json.dumps(KEYS),
            "SIFT_DATA_DIR": str(tmp_path / "data"),
        }
        with (
            gateway(tmp_path / "g", env) as base,
            run_prometheus(
                tmp_path / "prometheus", {JOB: [base.removeprefix("http://")]}, [RULES], INTERVAL
            ) as prometheus,
        ):
            prometheus.wait_for_scrapes(JOB, 1)
            with silent(url):
                scraped = prometheus.scrape_count(JOB)
                wait_until(
                    lambda: prometheus.scrape_count(JOB) >= scraped + 2,
                    "two scrapes of the gateway while Redis is silent",
                    120,
                )
                up = prometheus.values(f'up{{job="{JOB}"}}')
                backlog = prometheus.query("sift_queue_backlog")
                unknown = prometheus.query(BACKLOG_UNKNOWN)
    assert list(up.values()) == [1.0]  # the scrape answered in time
    assert {s["metric"]["queue"]: s["value"][1] for s in backlog} == {
        "sift.search": "NaN",
        "sift.batch": "NaN",
        "sift.ingest": "NaN",
        "sift.webhooks": "NaN",
    }
    assert len(unknown) == 1  # SiftBacklogUnknown's expression holds: it fires after its 2m
