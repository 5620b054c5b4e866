"""Batches over HTTP through the queue: 1,000 items all accounted for, pages, cancel."""

from __future__ import annotations

import time
from typing import Any

from tests.e2e.conftest import ACME, GLOBEX, INDEX, Stack

FINAL = {"succeeded", "failed", "canceled"}


def _wait_batch(stack: Stack, batch_id: str, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = stack.live.get(f"/v1/batches/{batch_id}", headers=ACME).json()
        counts = batch["counts"]
        assert sum(counts[s] for s in ("queued", "running", *FINAL)) == counts["total"]
        if batch["finished_at"] or time.monotonic() > deadline:
            return batch
        time.sleep(0.2)


def _all_results(stack: Stack, batch_id: str, page_size: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    token = None
    while True:
        params: dict[str, Any] = {"page_size": page_size}
        if token:
            params["page_token"] = token
        page = stack.live.get(f"/v1/batches/{batch_id}/results", params=params, headers=ACME)
        assert page.status_code == 200, page.text
        body = page.json()
        assert len(body["results"]) <= page_size
        results += body["results"]
        token = body["next_page_token"]
        if token is None:
            return results


def test_a_batch_of_1000_is_fully_accounted_for(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    items = [
        {
            "id": f"q{i:04d}",
            "query": queries[i % len(queries)],
            **({"limit": 5} if i % 3 == 0 else {}),
            **({"mode": "fts"} if i % 7 == 0 else {}),
        }
        for i in range(1000)
    ]
    started = time.monotonic()
    response = stack.live.post(
        "/v1/batches", json={"index": INDEX, "queries": items, "rerank": False}, headers=ACME
    )
    assert response.status_code == 202, response.text
    batch = response.json()
    assert batch["counts"]["total"] == 1000 and batch["lane"] == "standard"
    done = _wait_batch(stack, batch["id"])
    elapsed = time.monotonic() - started
    assert done["status"] == "succeeded", done
    assert done["counts"]["succeeded"] == 1000, done["counts"]
    results = _all_results(stack, batch["id"], page_size=137)
    assert [r["query_id"] for r in results] == [item["id"] for item in items]
    assert all(r["status"] == "succeeded" and r["result"]["hits"] for r in results)
    assert all(len(r["result"]["hits"]) <= 5 for r in results[::3])
    print(f"1000-item batch: {elapsed:.1f}s, {1000 / elapsed:.0f} queries/s")
    # not visible to another tenant
    assert stack.live.get(f"/v1/batches/{batch['id']}", headers=GLOBEX).status_code == 404


def _completed(client: Any) -> dict[tuple[str, str], float]:
    """The gateway's ``sift_jobs_completed_total`` by (kind, status)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.labels["kind"], sample.labels["status"]): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
        if sample.name == "sift_jobs_completed_total"
    }


def test_a_batch_sent_again_with_its_key_is_the_same_batch_marked_replayed(
    stack: Stack,
) -> None:
    """``Idempotent-Replayed: true`` (Stripe's header) tells a client that a key's answer is a
    batch an earlier request made: ``sift batch`` run again says it picked one up."""
    body = {"index": INDEX, "queries": [{"id": "1", "query": "replayed"}]}
    headers = {**ACME, "Idempotency-Key": "batch-replay-1"}
    first = stack.idle.post("/v1/batches", json=body, headers=headers)
    assert first.status_code == 202 and "idempotent-replayed" not in first.headers
    again = stack.idle.post("/v1/batches", json=body, headers=headers)
    assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["location"] == first.headers["location"]


def test_cancel_a_queued_batch(stack: Stack) -> None:
    completed = _completed(stack.idle)
    items = [{"id": str(i), "query": f"query {i}"} for i in range(50)]
    batch = stack.idle.post(
        "/v1/batches", json={"index": INDEX, "queries": items}, headers=ACME
    ).json()
    assert batch["status"] == "queued"
    response = stack.idle.delete(f"/v1/batches/{batch['id']}", headers=ACME)
    assert response.status_code == 200
    canceled = response.json()
    assert canceled["status"] == "canceled"
    assert canceled["counts"] == {
        "total": 50,
        "queued": 0,
        "running": 0,
        "succeeded": 0,
        "failed": 0,
        "canceled": 50,
    }
    page = stack.idle.get(
        f"/v1/batches/{batch['id']}/results", params={"page_size": 1000}, headers=ACME
    ).json()
    assert [r["status"] for r in page["results"]] == ["canceled"] * 50
    assert page["next_page_token"] is None
    again = stack.idle.delete(f"/v1/batches/{batch['id']}", headers=ACME)
    # the first cancel finished it, canceled: a repeat says so, and changes nothing
    assert again.status_code == 200 and again.json() == canceled, again.text
    assert stack.idle.get(f"/v1/batches/{batch['id']}", headers=ACME).json() == canceled
    after = _completed(stack.idle)  # the cancel completed 50 items and the batch, once
    assert after["batch_item", "canceled"] - completed["batch_item", "canceled"] == 50
    assert after["batch", "canceled"] - completed["batch", "canceled"] == 1


def test_cancel_a_running_batch_skips_what_has_not_run(
    stack: Stack, corpus: object, queries: list[str]
) -> None:
    items = [{"id": f"c{i}", "query": queries[i % len(queries)]} for i in range(2000)]
    batch = stack.live.post(
        "/v1/batches", json={"index": INDEX, "queries": items}, headers=ACME
    ).json()
    canceled = stack.live.delete(f"/v1/batches/{batch['id']}", headers=ACME).json()
    assert canceled["counts"]["canceled"] > 0
    done = _wait_batch(stack, batch["id"])
    counts = done["counts"]
    assert counts["queued"] == counts["running"] == 0
    assert counts["succeeded"] + counts["canceled"] == 2000
    assert done["status"] == "canceled"
    results = _all_results(stack, batch["id"], page_size=1000)
    by_status = {s: sum(1 for r in results if r["status"] == s) for s in FINAL}
    assert by_status["succeeded"] == counts["succeeded"]
    assert by_status["canceled"] == counts["canceled"]
    assert all("result" not in r for r in results if r["status"] == "canceled")


def test_the_gateways_batch_log_lines_carry_their_batch_id(stack: Stack) -> None:
    """Every log record carries the job id in its ``[...]`` slot (STYLE.md 11); the gateway's
    own lines for a batch accepted and canceled had ``[-]`` there, the id in the message
    alone. On the idle gateway, whose jobs no worker takes, so the cancel cancels."""
    body = {"index": INDEX, "queries": [{"id": "q1", "query": "tea"}, {"id": "q2", "query": "jam"}]}
    batch = stack.idle.post("/v1/batches", json=body, headers=ACME).json()
    canceled = stack.idle.delete(f"/v1/batches/{batch['id']}", headers=ACME)
    assert canceled.status_code == 200, canceled.text
    log = stack.logs[2].read_text(errors="replace")  # the idle gateway's
    lines = [line for line in log.splitlines() if f"batch {batch['id']}:" in line]
    assert any("items in chunks" in line for line in lines), lines
    assert any("items canceled" in line for line in lines), lines
    assert all(f"[{batch['id']}]" in line for line in lines), lines


def test_a_results_page_token_reads_only_the_batch_that_issued_it(stack: Stack) -> None:
    """The results' token was a bare offset (``o:2``): one batch's read another from there.
    It is bound to its batch as the lists' tokens are to their list: another batch's is the
    same ``422`` naming ``page_token``, and the batch's own still reads its next page."""
    ids = []
    for name in ("a", "b"):
        queries = [{"id": f"{name}{i}", "query": "tea"} for i in range(3)]
        body = {"index": INDEX, "queries": queries, "rerank": False}
        response = stack.live.post("/v1/batches", json=body, headers=ACME)
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
    first, second = ids
    page = stack.live.get(
        f"/v1/batches/{first}/results", params={"page_size": 2}, headers=ACME
    ).json()
    token = page["next_page_token"]
    assert token is not None, page
    crossed = stack.live.get(
        f"/v1/batches/{second}/results", params={"page_token": token}, headers=ACME
    )
    assert crossed.status_code == 422, crossed.text
    error = crossed.json()["error"]
    assert error["field"] == "page_token" and "is not a token this list issued" in error["message"]
    own = stack.live.get(f"/v1/batches/{first}/results", params={"page_token": token}, headers=ACME)
    assert own.status_code == 200, own.text
    assert [r["query_id"] for r in own.json()["results"]] == ["a2"]
