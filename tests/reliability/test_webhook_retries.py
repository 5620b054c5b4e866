"""A webhook whose delivery fails, then succeeds, is delivered once per attempt, however long
its retry waits.

A retry waits as a Celery countdown: the worker holds the message, unacked, until it is due.
kombu's Redis transport puts back every message unacked for longer than the broker's
visibility timeout (about 27 minutes at the defaults), so a wait past it (the schedule's
waits run to 10 hours) came back as a second copy, then a third: each copy made the attempt
and scheduled its own next one, and a receiver down for a few hours was sent the same event
many times over, in a number that grew with each attempt.

The test shortens the two things it is about and nothing else: the visibility timeout (4 s)
and the retry schedule (``SIFT_WEBHOOK_RETRY_SCALE`` 0.05: the third attempt comes 12 to
18 s after the second, well past the timeout). The receiver answers 500 twice, then 204.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fake_anthropic import FakeAnthropic
from tests.reliability.support import (
    ACME,
    FlakyReceiver,
    ingest,
    sample_queries,
    stack_env,
    submit_search,
    wait_for,
)
from tests.services import celery_worker, free_port, gateway, redis_server, webhook_figures
from worker.webhooks.delivery import RETRY_SCHEDULE_SECONDS

pytestmark = pytest.mark.integration

VISIBILITY_SECONDS = 4
SCALE = 0.05
FAILURES = 2  # the receiver's first answers are 500


def deliveries(url: str) -> tuple[dict[str, float], float]:
    """``sift_webhook_deliveries_total`` by ``result``, and ``sift_task_retries_total`` of
    the webhook task, as the worker serves them."""
    out: dict[str, float] = {}
    retries = 0.0
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if not sample.name.endswith("_total") or not sample.value:
                continue
            if family.name == "sift_webhook_deliveries":
                out[sample.labels["result"]] = sample.value
            elif family.name == "sift_task_retries" and sample.labels["task"] == "sift.webhook":
                retries = sample.value
    return out, retries


@pytest.fixture
def flaky() -> Iterator[FlakyReceiver]:
    with FlakyReceiver(FAILURES).serve() as receiver:
        yield receiver


@pytest.mark.timeout(240)
def test_a_retry_waiting_past_the_visibility_timeout_is_sent_once(
    tmp_path: Path, flaky: FlakyReceiver
) -> None:
    # the wait before the attempt that succeeds outlasts the visibility timeout
    assert RETRY_SCHEDULE_SECONDS[FAILURES] * SCALE * 0.8 > 2 * VISIBILITY_SECONDS
    port = free_port()
    with FakeAnthropic(delay=0.05) as model, redis_server(tmp_path / "redis") as url:
        env = stack_env(
            url + "/0",
            model.url,
            SIFT_WORKER_METRICS_PORT=str(port),
            SIFT_BROKER_VISIBILITY_TIMEOUT_SECONDS=str(VISIBILITY_SECONDS),
            SIFT_WEBHOOK_RETRY_SCALE=str(SCALE),
        )
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            celery_worker(tmp_path / "w", env, "w"),
        ):
            ingest(client)
            job_id = submit_search(client, sample_queries()[0], webhook_url=flaky.url)
            wait_for(lambda: flaky.posts() > FAILURES, "the attempt that succeeds", 120)
            # copies of the last attempt are due at the same moment; a later one would be
            # another attempt's, which a 204 ends: give both time to land
            time.sleep(3 * VISIBILITY_SECONDS)
            job = client.get(f"/v1/searches/{job_id}", headers=ACME).json()
            counted, retries = deliveries(f"http://127.0.0.1:{port}/metrics")
    bodies = flaky.bodies
    assert len(bodies) == FAILURES + 1, [b["timestamp"] for b in bodies]
    assert all(b == bodies[0] for b in bodies)  # the same event, the same bytes
    assert bodies[0]["data"] == webhook_figures(job)  # the search's final figures
    assert job["status"] == "succeeded" and job["result"]["usage"]["requests"] == 1
    assert counted == {"retry": float(FAILURES), "delivered": 1.0}  # one count per attempt
    # a hop of the wait is no retry: the task was put back once per failed attempt (the
    # third attempt's wait alone is 6 to 9 hops of 2 s)
    assert retries == float(FAILURES)
