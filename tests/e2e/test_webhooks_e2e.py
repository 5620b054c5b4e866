"""A signed webhook reaches a local receiver and verifies with the standardwebhooks library."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator

import pytest
from standardwebhooks.webhooks import Webhook

from tests.e2e.conftest import ACME, INDEX, KEYS, Stack
from tests.services import Received, webhook_inbox


@pytest.fixture
def receiver() -> Iterator[tuple[str, queue.Queue[Received]]]:
    with webhook_inbox() as inbox:
        yield inbox


def test_search_and_batch_webhooks_are_signed(
    stack: Stack, corpus: object, receiver: tuple[str, queue.Queue[Received]]
) -> None:
    url, inbox = receiver
    search = stack.live.post(
        "/v1/searches", json={"index": INDEX, "query": "tea", "webhook_url": url}, headers=ACME
    ).json()
    batch = stack.live.post(
        "/v1/batches",
        json={
            "index": INDEX,
            "webhook_url": url,
            "queries": [{"id": str(i), "query": "bees"} for i in range(30)],
        },
        headers=ACME,
    ).json()
    verifier = Webhook(KEYS[0]["webhook_secret"])
    seen = {}
    for _ in range(2):
        body, headers = inbox.get(timeout=30)
        payload = verifier.verify(body, headers)
        assert headers["webhook-id"] == f"msg_{payload['data']['id']}"
        seen[payload["type"]] = payload
    assert seen["search.completed"]["data"] == {"id": search["id"], "status": "succeeded"}
    assert seen["batch.completed"]["data"] == {"id": batch["id"], "status": "succeeded"}
    assert set(json.loads(body)) == {"type", "timestamp", "data"}
    with pytest.raises(queue.Empty):  # each event once: no copy in another queue
        inbox.get(timeout=1.0)


def test_the_job_counters_have_no_webhook_series_that_nothing_counts(
    stack: Stack, corpus: object, receiver: tuple[str, queue.Queue[Received]]
) -> None:
    """Webhooks are counted by ``sift_webhook_deliveries_total``. The job counters also
    exported a ``kind="webhook"`` series that nothing ever counted: it read 0 submitted and 0
    completed on the gateway and the worker while webhooks went out."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    url, inbox = receiver
    body = {"index": INDEX, "query": "tea", "webhook_url": url}
    assert stack.live.post("/v1/searches", json=body, headers=ACME).status_code == 202
    inbox.get(timeout=30)
    for target in (stack.worker_metrics_url, stack.live_url + "/metrics"):
        text = httpx.get(target, timeout=10).text
        kinds = {
            (sample.name, sample.labels["kind"])
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name.startswith(("sift_jobs_", "sift_job_failures"))
            and "kind" in sample.labels
        }
        assert ("sift_jobs_submitted_total", "search") in kinds, target  # the series are read
        assert not {kind for kind in kinds if kind[1] == "webhook"}, (target, sorted(kinds))
    deliveries = httpx.get(stack.worker_metrics_url, timeout=10).text
    assert 'sift_webhook_deliveries_total{result="delivered"}' in deliveries
