"""A job's ``POST`` answer says where its webhook stands as its ``GET`` does.

``POST /v1/searches`` with a ``webhook_url`` answered ``"webhook": null`` (documented as "no
``webhook_url``") while the ``GET`` right after, and a replay of its ``Idempotency-Key``,
answered ``{"status": "pending", "attempts": 0}``: the 202 is built from the record the
gateway made, which never set it. Through the gateway app on a real Redis; no worker is
needed (the jobs stay queued). The host is a public literal: nothing to look up.
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from tests.integration.gateway_app import ACME

HOOK = "http://93.184.216.34/hook"
PENDING = {"status": "pending", "attempts": 0}
SEARCH = {"index": "docs", "query": "tea"}
BATCH = {"index": "docs", "queries": [{"id": "a", "query": "tea"}]}


@pytest.mark.parametrize(("path", "body"), [("/v1/searches", SEARCH), ("/v1/batches", BATCH)])
def test_a_post_with_a_webhook_url_answers_it_pending_as_its_get_does(
    client: TestClient, path: str, body: dict[str, object]
) -> None:
    posted = client.post(path, json={**body, "webhook_url": HOOK}, headers=ACME)
    assert posted.status_code == 202, posted.text
    assert posted.json()["webhook"] == PENDING
    got = client.get(f"{path}/{posted.json()['id']}", headers=ACME).json()
    assert got["webhook"] == posted.json()["webhook"]


@pytest.mark.parametrize(("path", "body"), [("/v1/searches", SEARCH), ("/v1/batches", BATCH)])
def test_a_post_and_its_replay_answer_the_same_webhook(
    client: TestClient, path: str, body: dict[str, object]
) -> None:
    headers = {**ACME, "Idempotency-Key": "k1"}
    first = client.post(path, json={**body, "webhook_url": HOOK}, headers=headers)
    replay = client.post(path, json={**body, "webhook_url": HOOK}, headers=headers)
    assert replay.headers.get("idempotent-replayed") == "true"
    assert first.json()["webhook"] == replay.json()["webhook"] == PENDING


def test_a_post_without_a_webhook_url_answers_none(client: TestClient) -> None:
    posted = client.post("/v1/searches", json=SEARCH, headers=ACME)
    assert posted.status_code == 202 and posted.json()["webhook"] is None
