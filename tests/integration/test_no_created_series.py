"""``/metrics`` exports the series docs/observability.md names, and not prometheus-client's
``*_created`` ones (a gauge per counter, histogram and summary child holding its creation
time), which no dashboard, rule or contract reads. A gateway run without
``PROMETHEUS_MULTIPROC_DIR`` and a worker run as one process with the threads pool serve this
process's own registry, and exported them: 193 series on an idle gateway. In multiprocess mode
prometheus-client never wrote them.

Everything is real: redis-server, ``sift gateway``, ``sift worker``, an ingest through them.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.keys import ACME_KEY
from tests.reliability.support import ingest, stack_env
from tests.services import celery_worker, free_port, gateway, redis_server

pytestmark = pytest.mark.integration


def _sample_names(url: str) -> set[str]:
    text = httpx.get(url, timeout=10).text
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_neither_the_gateway_nor_a_worker_exports_created_series(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # each its own registry
    with redis_server(tmp_path / "redis") as base_url:
        metrics_port = free_port()
        env = stack_env(
            base_url + "/0",
            "http://127.0.0.1:9",  # no model call is made: an ingest alone
            SIFT_API_KEYS=json.dumps([ACME_KEY]),
            SIFT_RERANK_ENABLED="false",
            SIFT_WORKER_METRICS_PORT=str(metrics_port),
        )
        env.pop("SIFT_GENERATION_MODEL")
        with (
            celery_worker(tmp_path / "w", env, "w1", concurrency=4),
            gateway(tmp_path / "g", {**env, "SIFT_WORKER_METRICS_PORT": "0"}) as url,
            httpx.Client(base_url=url, timeout=30) as client,
        ):
            ingest(client)  # counters and histograms with children, in both processes
            served = {
                "gateway": _sample_names(url + "/metrics"),
                "worker": _sample_names(f"http://127.0.0.1:{metrics_port}/metrics"),
            }
    for process, names in served.items():  # their counters are there
        assert {"sift_jobs_submitted_total", "sift_jobs_completed_total"} & names, process
    created = {p: sorted(n for n in names if n.endswith("_created")) for p, names in served.items()}
    assert created == {"gateway": [], "worker": []}, created
