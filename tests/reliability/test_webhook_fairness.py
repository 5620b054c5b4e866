"""One tenant's hung webhook receiver cannot hold up another tenant's webhooks.

A worker process sends at most ``SIFT_WEBHOOK_DELIVERIES_PER_PROCESS`` (16) deliveries at
once and puts the rest off by a hop. Before a tenant's share was bounded, one tenant's
receiver that answered nothing held all 16, and every other tenant's webhook was put off
again and again until those deliveries ended (the 30 s cap, then the next of them).

A real gateway and worker at the default bounds (16 a process, 12 a tenant); the total cap
set past the test, so that the receiver's deliveries hang for as long as it drips. Tenant
acme's 20 searches send their webhooks to a receiver that drips its headers a byte at a time
(no read timeout trips); tenant beta's search, submitted once acme's receiver holds its
share, has its webhook delivered while acme's receiver still holds those 12, uncut."""

from __future__ import annotations

import json
import queue
from pathlib import Path

import httpx
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.integration.slow_receivers import slow_receiver
from tests.reliability.support import (
    INDEX,
    KEYS,
    ingest,
    sample_documents,
    sample_queries,
    stack_env,
    submit_search,
    wait_for,
)
from tests.services import Received, celery_worker, gateway, redis_server, webhook_inbox
from worker.settings import Settings

pytestmark = pytest.mark.integration

SHARE = Settings().webhook_deliveries_per_tenant  # the default: one tenant's slots
BETA = {"Authorization": "Bearer beta-key-0001"}
BETA_KEY = {"key": "beta-key-0001", "tenant": "beta", "webhook_secret": "whsec_YmV0YS1zZWNyZXQ="}


@pytest.mark.timeout(240)
def test_a_tenant_s_hung_receiver_does_not_hold_up_another_tenant_s_webhook(
    tmp_path: Path,
) -> None:
    with (
        FakeAnthropic(delay=0.05) as model,
        redis_server(tmp_path / "redis") as url,
        # drips its headers a byte every 0.5 s (under the 15 s read timeout), for 200 s at most
        slow_receiver(drip=0.5, max_bytes=400) as hung,
        webhook_inbox() as (beta_url, inbox),
    ):
        env = stack_env(
            url + "/0",
            model.url,
            SIFT_API_KEYS=json.dumps([*KEYS, BETA_KEY]),
            SIFT_WEBHOOK_TOTAL_TIMEOUT_SECONDS="600",
        )
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            celery_worker(tmp_path / "w", env, "w", concurrency=64),
        ):
            ingest(client)
            loaded = client.post(
                f"/v1/indexes/{INDEX}/documents",
                params={"wait": 30},
                json={"documents": sample_documents()},
                headers=BETA,
            )
            assert loaded.status_code == 200, loaded.text
            query = sample_queries()[0]
            for _ in range(20):
                submit_search(client, query, webhook_url=hung.url)
            wait_for(lambda: hung.held >= SHARE, "acme's deliveries at its receiver", 60)
            beta = client.post(
                "/v1/searches",
                json={"index": INDEX, "query": query, "webhook_url": beta_url},
                headers=BETA,
            )
            assert beta.status_code == 202, beta.text
            got: list[Received] = []

            def arrived() -> bool:
                try:
                    got.append(inbox.get(timeout=0.5))
                except queue.Empty:
                    return False
                return True

            wait_for(arrived, "beta's webhook, while acme's receiver hangs", 50)
            assert json.loads(got[0][0])["data"]["id"] == beta.json()["id"]
            # acme's receiver still holds its share, every one of them still dripping
            assert hung.held == SHARE and hung.requests == SHARE, (hung.held, hung.requests)
            assert not hung.cut.is_set() and not hung.ran_out.is_set()
