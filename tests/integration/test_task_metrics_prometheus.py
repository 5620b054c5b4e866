"""A worker's task metrics read through a real Prometheus: a task's first retry is seen.

``rate()`` and ``increase()`` count a series from its first sample: a series that first
appears at its first event (1) shows no increase at all. A worker makes its known series at
zero when it starts for that reason; ``sift_task_retries_total`` was left out, so a worker's
first webhook retry read 0 in Prometheus (18 retries on a two-worker stack read 12.3 over the
run).

The real stack: redis-server, the gateway, one ``sift worker``, the fake Messages API, a
webhook receiver that answers 500 once, then 204, and a real ``prometheus`` scraping the
worker every second.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.prometheus_support import Prometheus, requires_prometheus, run_prometheus
from tests.reliability.support import (
    FlakyReceiver,
    ingest,
    sample_queries,
    stack_env,
    submit_search,
    wait_for,
)
from tests.services import celery_worker, free_port, gateway, redis_server
from worker.constants import PROMETHEUS_JOB_WORKER, TASK_NAMES, WEBHOOK_TASK

pytestmark = [pytest.mark.integration, requires_prometheus()]

JOB = PROMETHEUS_JOB_WORKER
RETRIES = f'sift_task_retries_total{{task="{WEBHOOK_TASK}"}}'


@pytest.fixture
def flaky() -> Iterator[FlakyReceiver]:
    with FlakyReceiver(1).serve() as receiver:
        yield receiver


def samples(prometheus: Prometheus, selector: str) -> list[float]:
    """Every sample Prometheus holds of the one series of ``selector``, oldest first."""
    [series] = prometheus.query(f"{selector}[10m]")
    return [float(value) for _, value in series["values"]]


@pytest.mark.timeout(180)
def test_a_worker_s_first_webhook_retry_shows_in_increase(
    tmp_path: Path, flaky: FlakyReceiver
) -> None:
    port = free_port()
    with FakeAnthropic() as model, redis_server(tmp_path / "redis") as url:
        env = stack_env(url + "/0", model.url, SIFT_WORKER_METRICS_PORT=str(port))
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            celery_worker(tmp_path / "w", env, "w"),
            run_prometheus(tmp_path / "prometheus", {JOB: [f"127.0.0.1:{port}"]}) as prometheus,
        ):
            prometheus.wait_for_scrapes(JOB, 2)  # the worker as it started, before any task
            every_task = prometheus.values("sift_task_retries_total", by="task")
            ingest(client)
            submit_search(client, sample_queries()[0], webhook_url=flaky.url)
            wait_for(lambda: flaky.posts() == 2, "the webhook's retry and its delivery", 60)
            prometheus.wait_for_value(f"sum({RETRIES})", 1.0)
            prometheus.wait_for_more_scrapes(JOB)
            increase = prometheus.values(f"sum(increase({RETRIES}[10m]))")[""]
            retries = samples(prometheus, RETRIES)
    assert every_task == dict.fromkeys(TASK_NAMES, 0.0)
    # the series was there at zero before the retry: Prometheus counts it
    assert retries[0] == 0.0 and retries[-1] == 1.0
    assert 1.0 <= increase < 1.5, increase  # extrapolated past the last scrape, at most
