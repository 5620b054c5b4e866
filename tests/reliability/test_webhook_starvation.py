"""Slow webhook receivers cannot take a worker's threads from the searches.

Webhooks run in the same Celery thread pool as searches and batch items. A receiver that
sends its status line a byte at a time never trips the per-read timeout, so before the
bound every thread of a worker could sit in such deliveries (600 of them held a default
worker's 2 x 300 threads in the audit, and every tenant's searches waited).

Here a worker of 6 threads, at most 2 deliveries at once: 8 searches' webhooks go to a
receiver dripping its headers (a byte every 0.5 s, under the 15 s read timeout; the total
cap set past the test), and a plain search submitted after them still runs while the
receiver holds 2 deliveries, the other 6 put off."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.integration.slow_receivers import slow_receiver
from tests.reliability.support import (
    ACME,
    ingest,
    sample_queries,
    stack_env,
    submit_search,
    wait_for,
)
from tests.services import celery_worker, gateway, redis_server

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_trickling_receivers_hold_only_the_bound_of_a_worker_s_threads(tmp_path: Path) -> None:
    with (
        FakeAnthropic(delay=0.05) as model,
        redis_server(tmp_path / "redis") as url,
        slow_receiver(drip=0.5, max_bytes=400) as receiver,
    ):
        env = stack_env(
            url + "/0",
            model.url,
            SIFT_WEBHOOK_DELIVERIES_PER_PROCESS="2",
            SIFT_WEBHOOK_TOTAL_TIMEOUT_SECONDS="600",
        )
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            celery_worker(tmp_path / "w", env, "w", concurrency=6),
        ):
            ingest(client)
            query = sample_queries()[0]
            for _ in range(8):
                submit_search(client, query, webhook_url=receiver.url)
            wait_for(lambda: receiver.held >= 2, "deliveries at the receiver", 60)
            plain = submit_search(client, query)
            path = f"/v1/searches/{plain}"
            wait_for(
                lambda: client.get(path, headers=ACME).json()["status"] == "succeeded",
                "the plain search, with the receiver holding deliveries",
                60,
            )
            assert receiver.held == 2 and receiver.requests == 2  # the rest put off
            assert not receiver.cut.is_set() and not receiver.ran_out.is_set()
