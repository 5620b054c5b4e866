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
