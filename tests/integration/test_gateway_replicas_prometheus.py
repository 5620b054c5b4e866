"""The jobs dashboard with two gateway replicas on one Redis, as deploy/k8s runs them.

Each gateway reports the fleet-wide figures it reads from the job store and the broker
(``sift_jobs_in_flight{state="queued"}``, ``sift_queue_backlog``) on its own ``/metrics``, and
Prometheus scrapes every replica: a panel that sums them counts the same jobs once per replica.
A real redis-server, two real gateways under uvicorn, a real Prometheus; no worker, so the
submitted searches stay queued.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.prometheus_support import (
    Prometheus,
    concrete,
    panel_queries,
    requires_prometheus,
    run_prometheus,
    wait_until,
)
from tests.services import gateway, redis_server
from worker.constants import PROMETHEUS_JOB_GATEWAY

pytestmark = [
    pytest.mark.integration,
    requires_prometheus(),
]

ROOT = Path(__file__).resolve().parents[2]
KEY = {"key": "acme-key-0001", "tenant": "acme", "webhook_secret": "whsec_YWNtZQ=="}
QUEUED = 3  # searches submitted, none run
JOB = PROMETHEUS_JOB_GATEWAY


def panel(title: str) -> str:
    """The one query of the jobs dashboard's panel ``title``."""
    found = [q for q in panel_queries(ROOT / "grafana" / "sift-jobs.json") if q.panel == title]
    assert len(found) == 1, found
    return concrete(found[0].expr)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("replicas")
    with redis_server(tmp / "redis") as redis_url:
        env = {
            "SIFT_API_KEYS": json.dumps([KEY]),
            "SIFT_REDIS_URL": f"{redis_url}/0",
            "SIFT_DATA_DIR": str(tmp / "data"),
        }
        with (
            gateway(tmp, env, "gateway-a") as first,
            gateway(tmp, env, "gateway-b") as second,
            httpx.Client(
                base_url=first, headers={"Authorization": f"Bearer {KEY['key']}"}, timeout=30
            ) as client,
        ):
            for i in range(QUEUED):
                body: dict[str, Any] = {"index": "docs", "query": f"volcano {i}", "limit": 3}
                response = client.post("/v1/searches", json=body)
                assert response.status_code == 202, response.text
            targets = {JOB: [url.removeprefix("http://") for url in (first, second)]}
            with run_prometheus(tmp / "prometheus", targets) as prometheus:
                prometheus.wait_for_scrapes(JOB, 3)
                yield prometheus


def test_both_replicas_report_the_fleets_queued_jobs(replicas: Prometheus) -> None:
    """The premise: each replica's /metrics carries the same fleet-wide count."""
    per_replica = replicas.values('sift_jobs_in_flight{state="queued"}', by="instance")
    assert list(per_replica.values()) == [QUEUED, QUEUED]


def test_jobs_in_flight_panel_counts_each_queued_job_once(replicas: Prometheus) -> None:
    shown = replicas.values(panel("Jobs in flight by state"), by="state")
    assert shown["queued"] == QUEUED


def test_backlog_panels_count_each_message_once(replicas: Prometheus) -> None:
    wait_until(
        lambda: replicas.values(panel("Backlog (all queues)")).get("") == QUEUED,
        "the backlog of the queued searches",
    )
