"""A signed webhook reaches a local receiver and verifies with the standardwebhooks library."""

from __future__ import annotations

import json
import queue
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from tests.e2e.conftest import ACME, GLOBEX, INDEX, KEYS, MODEL, Stack, unpriced_stack
from tests.fake_anthropic import USAGE_FIELDS, malformed, status
from tests.services import (
    SHUTDOWN_POLL_SECONDS,
    Received,
    webhook_figures,
    webhook_inbox,
)
from worker.core.cost import cost_usd, price_for
from worker.core.types import TokenUsage
from worker.settings import DEFAULT_PRICES


@pytest.fixture
def receiver() -> Iterator[tuple[str, queue.Queue[Received]]]:
    with webhook_inbox() as inbox:
        yield inbox


def _received(inbox: queue.Queue[Received], secret: str = KEYS[0]["webhook_secret"]) -> Any:
    """The next delivery's body, its signature verified."""
    body, headers = inbox.get(timeout=60)
    payload = Webhook(secret).verify(body, headers)
    assert headers["webhook-id"] == f"msg_{payload['data']['id']}"
    return payload


def _batch(client: httpx.Client, url: str, queries: list[str], **fields: Any) -> str:
    items = [{"id": f"q{i}", "query": query} for i, query in enumerate(queries)]
    body = {"index": INDEX, "webhook_url": url, "queries": items, **fields}
    response = client.post("/v1/batches", json=body, headers=ACME)
    assert response.status_code == 202, response.text
    batch_id: str = response.json()["id"]
    return batch_id


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
    searched = stack.live.get(f"/v1/searches/{search['id']}", headers=ACME).json()
    assert seen["search.completed"]["data"] == webhook_figures(searched)
    assert seen["search.completed"]["data"]["status"] == "succeeded"
    batched = stack.live.get(f"/v1/batches/{batch['id']}", headers=ACME).json()
    assert seen["batch.completed"]["data"] == webhook_figures(batched)
    assert batched["counts"]["succeeded"] == 30
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


def test_a_reranked_batch_s_webhook_carries_its_final_figures(
    stack: Stack, corpus: object, receiver: tuple[str, queue.Queue[Received]]
) -> None:
    """A receiver needs no ``GET``: the body has the batch's counts, token usage, cost and
    rerank outcomes, equal to what its ``GET`` answers. Before: only its id and status."""
    url, inbox = receiver
    before = stack.model.usage()["responses"]
    batch_id = _batch(stack.live, url, ["green tea", "bees", "tea leaves"], rerank=True)
    data = _received(inbox)["data"]
    batch = stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json()
    assert data == webhook_figures(batch)
    assert data["counts"] == {
        "total": 3,
        "queued": 0,
        "running": 0,
        "succeeded": 3,
        "failed": 0,
        "canceled": 0,
    }
    assert data["rerank_outcomes"] == {"applied": 3, "fallback": 0, "skipped": 0}
    usage = data["usage"]
    assert usage["requests"] == 3 == stack.model.usage()["responses"] - before
    tokens = {name: usage[name] for name in USAGE_FIELDS}
    expected = cost_usd(TokenUsage(**tokens), price_for(MODEL, DEFAULT_PRICES))
    assert expected is not None and expected > 0
    assert usage["cost_usd"] == pytest.approx(expected)


def test_a_batch_tells_its_failures_by_kind_as_its_results_show_them(
    stack: Stack, corpus: object, receiver: tuple[str, queue.Queue[Received]]
) -> None:
    """Why a batch's items failed, without reading its results: its ``GET``, its listing
    entry and its webhook body count its failed items by error type (``failures``) and its
    ``rerank_failed`` ones by class (``rerank_failures``), as the errors of its results say.
    Under fail_closed, the first two calls answered 400 fail their two items at once
    (``http_4xx``, never retried); the other two items, which alone are left to call, take
    three malformed answers each (``malformed``, after their retries)."""
    url, inbox = receiver
    stack.model.script([status(400), status(400)] + [malformed("no json here")] * 6)
    queries = ["green tea", "bees", "tea leaves", "green tea"]
    batch_id = _batch(stack.live, url, queries, rerank=True)
    data = _received(inbox)["data"]
    batch = stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json()
    page = stack.live.get(f"/v1/batches/{batch_id}/results", headers=ACME).json()
    errors = [item["error"] for item in page["results"] if item["status"] == "failed"]
    assert len(errors) == batch["counts"]["failed"] == 4, page
    assert batch["failures"] == {"rerank_failed": 4}
    assert batch["rerank_failures"] == {"http_4xx": 2, "malformed": 2}
    assert batch["failures"] == Counter(error["type"] for error in errors)
    assert batch["rerank_failures"] == Counter(error["reason"] for error in errors)
    assert all(f"({error['reason']})" in error["message"] for error in errors), errors
    assert data == webhook_figures(batch)
    listed = stack.live.get("/v1/batches", headers=ACME).json()["batches"]
    (entry,) = [b for b in listed if b["id"] == batch_id]
    assert (entry["failures"], entry["rerank_failures"]) == (
        batch["failures"],
        batch["rerank_failures"],
    )


def test_a_failed_search_s_webhook_carries_its_error_type_reason_and_billed_usage(
    stack: Stack, corpus: object, receiver: tuple[str, queue.Queue[Received]]
) -> None:
    url, inbox = receiver
    stack.model.script([malformed("no json here")] * 3)  # fail_closed: rerank_failed
    body = {"index": INDEX, "query": "green tea", "rerank": True, "webhook_url": url}
    job = stack.live.post("/v1/searches", json=body, headers=ACME).json()
    data = _received(inbox)["data"]
    search = stack.live.get(f"/v1/searches/{job['id']}", headers=ACME).json()
    assert search["status"] == "failed", search
    assert data == webhook_figures(search)
    assert data["error"] == {"type": "rerank_failed", "reason": "malformed"}
    assert data["usage"]["requests"] == 3 and data["usage"]["cost_usd"] > 0
    assert "result" not in data and "hits" not in json.dumps(data)


def test_a_canceled_batch_s_webhook_carries_its_final_figures(
    stack: Stack, corpus: object, receiver: tuple[str, queue.Queue[Received]]
) -> None:
    """Cancelled once its first item reached the model: that item finishes (billed), the rest
    are canceled, and the body's figures are the batch's final ones."""
    url, inbox = receiver
    before = stack.model.counts()["received"]
    batch_id = _batch(stack.live, url, ["green tea"] * 300, rerank=True)
    deadline = time.monotonic() + 30
    while stack.model.counts()["received"] == before:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert stack.live.delete(f"/v1/batches/{batch_id}", headers=ACME).status_code == 200
    data = _received(inbox)["data"]
    batch = stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json()
    assert data == webhook_figures(batch)
    assert data["status"] == "canceled" and data["counts"]["canceled"] > 0
    assert data["counts"]["succeeded"] == data["rerank_outcomes"]["applied"] > 0
    assert data["usage"]["requests"] >= 1 and data["usage"]["cost_usd"] > 0


@pytest.fixture(scope="module")
def unpriced(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A worker and gateway on database 3 of the stack's Redis whose price table lacks the
    model, against the same fake Messages API, private webhook receivers allowed."""
    tmp = tmp_path_factory.mktemp("unpriced-webhooks")
    allowed = {"SIFT_WEBHOOK_ALLOW_PRIVATE_NETWORKS": "true"}
    with unpriced_stack(stack, tmp, 3, **allowed) as (client, _):
        yield client


def test_an_unpriced_batch_s_webhook_says_its_cost_is_unknown(
    unpriced: httpx.Client, receiver: tuple[str, queue.Queue[Received]]
) -> None:
    url, inbox = receiver
    batch_id = _batch(unpriced, url, ["green tea", "tea leaves"], rerank=True)
    data = _received(inbox)["data"]
    batch = unpriced.get(f"/v1/batches/{batch_id}", headers=ACME).json()
    assert data == webhook_figures(batch)
    assert data["usage"]["requests"] == 2 and data["usage"]["input_tokens"] > 0
    assert "cost_usd" in data["usage"] and data["usage"]["cost_usd"] is None


class _ScriptedReceiver:
    """A receiver answering ``status`` (the test changes it), counting the POSTs it got."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.status = 500
        self.posts = 0
        me = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                me.posts += 1
                self.send_response(me.status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, args=(SHUTDOWN_POLL_SECONDS,), daemon=True
        )
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _webhook_until(client: httpx.Client, path: str, status: str) -> dict[str, Any]:
    """The job's ``webhook`` once its status is ``status`` (60 s at most: a hang guard)."""
    for _ in range(600):
        webhook: dict[str, Any] | None = client.get(path, headers=ACME).json()["webhook"]
        if webhook is not None and webhook["status"] == status:
            return webhook
        time.sleep(0.1)
    raise AssertionError(f"{path}: webhook never {status}; last {webhook}")


def test_a_job_s_get_shows_where_its_webhook_stands(stack: Stack, corpus: object) -> None:
    """A search's and a batch's ``GET`` carry ``webhook``: ``retrying`` with the attempts made
    while the receiver answers 500, ``delivered`` with every attempt counted once it answers
    204, ``failed`` after one attempt answered 410 Gone, and ``null`` without a ``webhook_url``;
    another tenant sees none of it (404). Before: nothing about the webhook at all."""
    receiver = _ScriptedReceiver()
    refusing = _ScriptedReceiver()
    refusing.status = 410
    try:
        plain = stack.live.post(
            "/v1/searches", json={"index": INDEX, "query": "tea"}, headers=ACME
        ).json()
        search = stack.live.post(
            "/v1/searches",
            json={"index": INDEX, "query": "tea", "webhook_url": receiver.url},
            headers=ACME,
        ).json()
        path = f"/v1/searches/{search['id']}"
        retrying = _webhook_until(stack.live, path, "retrying")
        assert 1 <= retrying["attempts"] <= receiver.posts
        receiver.status = 204
        delivered = _webhook_until(stack.live, path, "delivered")
        assert delivered == {"status": "delivered", "attempts": receiver.posts}
        assert stack.live.get(path, headers=GLOBEX).status_code == 404

        batch_id = _batch(stack.live, refusing.url, ["bees"])
        failed = _webhook_until(stack.live, f"/v1/batches/{batch_id}", "failed")
        assert failed == {"status": "failed", "attempts": 1} and refusing.posts == 1
        plain_batch = stack.live.post(
            "/v1/batches",
            json={"index": INDEX, "queries": [{"id": "q", "query": "bees"}]},
            headers=ACME,
        ).json()
        for job in (f"/v1/searches/{plain['id']}", f"/v1/batches/{plain_batch['id']}"):
            got = stack.live.get(job, headers=ACME).json()
            assert "webhook" in got and got["webhook"] is None
    finally:
        receiver.close()
        refusing.close()
