"""One tenant's hung webhook receiver cannot hold up another tenant's webhooks.

A worker process sends at most ``SIFT_WEBHOOK_DELIVERIES_PER_PROCESS`` (16) deliveries at
once and puts the rest off by a hop. Before a tenant's share was bounded, one tenant's
receiver that answered nothing held all 16, and every other tenant's webhook was put off
again and again until those deliveries ended (the 30 s cap, then the next of them).

A real gateway and worker at the default bounds (16 a process, 12 a tenant); the total cap
set past the test, so that the receiver's deliveries hang for as long as it drips. Tenant
acme's 20 searches send their webhooks to a receiver that drips its headers a byte at a time
(no read timeout trips); tenant beta's search, submitted once acme's receiver holds its
share, has its webhook delivered while acme's receiver still holds those 12, uncut.

Two tenants' hung receivers: a share alone left the other 4 slots to the second tenant to
come, and acme's 12 with gamma's 4 held all 16 while a third tenant's webhook was put off
until they ended. A quarter of the slots are now kept for tenants sending nothing else, so
gamma, sending already, takes one of them, and beta's webhook goes out on the rest."""

from __future__ import annotations

import json
import queue
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fake_anthropic import FakeAnthropic
from tests.integration.slow_receivers import slow_receiver
from tests.reliability.support import (
    INDEX,
    KEYS,
    ingest,
    sample_queries,
    stack_env,
    submit_search,
    wait_for,
)
from tests.services import (
    Received,
    celery_worker,
    free_port,
    gateway,
    http_get,
    redis_server,
    webhook_inbox,
)
from worker.settings import Settings

pytestmark = pytest.mark.integration

SHARE = Settings().webhook_deliveries_per_tenant  # the default: one tenant's slots
BETA = {"Authorization": "Bearer beta-key-0001"}
BETA_KEY = {"key": "beta-key-0001", "tenant": "beta", "webhook_secret": "whsec_YmV0YS1zZWNyZXQ="}
GAMMA = {"Authorization": "Bearer gamma-key-0001"}
GAMMA_KEY = {
    "key": "gamma-key-0001",
    "tenant": "gamma",
    "webhook_secret": "whsec_Z2FtbWEtc2VjcmV0",
}


def _search(client: httpx.Client, headers: dict[str, str], url: str) -> str:
    query = sample_queries()[0]
    body = {"index": INDEX, "query": query, "webhook_url": url}
    response = client.post("/v1/searches", json=body, headers=headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _arrives(inbox: queue.Queue[Received], seconds: float, what: str) -> Received:
    """The first webhook at ``inbox`` within ``seconds`` (``what`` it is, for the timeout)."""
    got: list[Received] = []

    def arrived() -> bool:
        try:
            got.append(inbox.get(timeout=0.5))
        except queue.Empty:
            return False
        return True

    wait_for(arrived, what, seconds)
    return got[0]


def _deferrals(metrics_url: str) -> float:
    """The worker's ``sift_webhook_deferrals_total``, every event type."""
    text = http_get(metrics_url, timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "sift_webhook_deferrals"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


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
            ingest(client, BETA)
            for _ in range(20):
                submit_search(client, sample_queries()[0], webhook_url=hung.url)
            wait_for(lambda: hung.held >= SHARE, "acme's deliveries at its receiver", 60)
            beta = _search(client, BETA, beta_url)
            body, _ = _arrives(inbox, 50, "beta's webhook, while acme's receiver hangs")
            assert json.loads(body)["data"]["id"] == beta
            # acme's receiver still holds its share, every one of them still dripping
            assert hung.held == SHARE and hung.requests == SHARE, (hung.held, hung.requests)
            assert not hung.cut.is_set() and not hung.ran_out.is_set()


@pytest.mark.timeout(240)
def test_two_tenants_hung_receivers_leave_a_third_tenant_s_webhook_a_slot(
    tmp_path: Path,
) -> None:
    """acme's 12 deliveries hold its share, then gamma's 5 take what the rule leaves them
    (before: 4, the last free slots; now: 1, the rest put off); once one of gamma's is put
    off (the worker's deferral count: before, only with all 16 held), beta's search's webhook
    is delivered while both receivers still drip, uncut."""
    port = free_port()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    with (
        FakeAnthropic(delay=0.05) as model,
        redis_server(tmp_path / "redis") as url,
        # each drips its headers a byte every 0.5 s, for 200 s at most
        slow_receiver(drip=0.5, max_bytes=400) as acme_hung,
        slow_receiver(drip=0.5, max_bytes=400) as gamma_hung,
        webhook_inbox() as (beta_url, inbox),
    ):
        env = stack_env(
            url + "/0",
            model.url,
            SIFT_API_KEYS=json.dumps([*KEYS, BETA_KEY, GAMMA_KEY]),
            SIFT_WEBHOOK_TOTAL_TIMEOUT_SECONDS="600",
            SIFT_WORKER_METRICS_PORT=str(port),
        )
        with (
            gateway(tmp_path / "g", env) as base,
            httpx.Client(base_url=base, timeout=30) as client,
            celery_worker(tmp_path / "w", env, "w", concurrency=64),
        ):
            ingest(client)
            ingest(client, BETA)
            ingest(client, GAMMA)
            for _ in range(SHARE):  # acme's share, and none of acme's put off
                submit_search(client, sample_queries()[0], webhook_url=acme_hung.url)
            wait_for(lambda: acme_hung.held >= SHARE, "acme's deliveries at its receiver", 60)
            assert _deferrals(metrics_url) == 0
            for _ in range(5):
                _search(client, GAMMA, gamma_hung.url)
            wait_for(
                lambda: gamma_hung.held >= 1 and _deferrals(metrics_url) >= 1,
                "gamma's deliveries at its receiver, one of them put off",
                60,
            )
            beta = _search(client, BETA, beta_url)
            body, _ = _arrives(
                inbox, 50, "the third tenant's webhook, while the others' receivers hang"
            )
            assert json.loads(body)["data"]["id"] == beta
            # both receivers still hold what they took, every one of them still dripping
            assert (acme_hung.held, gamma_hung.held) == (SHARE, 1)
            for hung in (acme_hung, gamma_hung):
                assert not hung.cut.is_set() and not hung.ran_out.is_set()
