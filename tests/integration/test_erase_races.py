"""A job erased by its tenant while another request of the tenant reads it (the gateway in
process on a real Redis; the erase put between the request's reads through the store, so
the race is met every run): the request answers ``410 erased``, as a read after the erase
does, never a ``503`` saying Redis lost the job, nor a page of results that is empty."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.integration.gateway_app import ACME
from worker.constants import BATCH_ID_PREFIX
from worker.contract import RerankInfo, SearchResult, SearchSpec
from worker.queue.jobstore import EraseOutcome, JobStore

pytestmark = pytest.mark.integration


def _erase_first(monkeypatch: pytest.MonkeyPatch, method: str, end: Any) -> None:
    """Have the store's next ``method`` call erase its job first (``end`` finishes it, as
    erase asks), as a DELETE of the same tenant landing between two reads of a request."""
    ran = getattr(JobStore, method)

    def erased_first(self: JobStore, job_id: str, *args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(JobStore, method, ran)
        end(self, job_id)
        kind = "batch" if job_id.startswith(BATCH_ID_PREFIX) else "search"
        assert self.erase_job(kind, "acme", job_id).outcome is EraseOutcome.ERASED
        return ran(self, job_id, *args, **kwargs)

    monkeypatch.setattr(JobStore, method, erased_first)


def _finish_search(store: JobStore, job_id: str) -> None:
    store.claim_search(job_id, "w1", lease_seconds=30)
    assert store.start_search(job_id)
    assert store.finish_search(
        job_id, result=SearchResult(hits=[], rerank=RerankInfo(applied=False))
    )


def test_a_waiting_search_erased_by_its_tenant_answers_erased(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _erase_first(monkeypatch, "get_search_status", _finish_search)
    answer = client.post("/v1/searches", params={"wait": 5}, headers=ACME,
                         json={"index": "docs", "query": "tea"})  # fmt: skip
    assert answer.status_code == 410, answer.text
    assert answer.json()["error"]["type"] == "erased", answer.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_new_batch_erased_by_its_tenant_before_it_is_read_back_answers_erased(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _erase_first(monkeypatch, "get_batch", lambda store, batch_id: store.cancel_batch(batch_id))
    body = {"index": "docs", "queries": [{"id": "q1", "query": "tea"}]}
    answer = client.post("/v1/batches", headers=ACME, json=body)
    assert answer.status_code == 410, answer.text
    assert answer.json()["error"]["type"] == "erased", answer.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_results_page_read_as_its_batch_is_erased_answers_erased(
    client: TestClient, store: JobStore, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """The erase between the page's read of the batch and of its items (``before`` the
    order's read: the page was ``[]`` with a token for the next one), or between the order's
    read and the items' (``after``: each item read as ``queued``, with no outcome)."""
    items = [(f"q{i}", SearchSpec(index="docs", query="tea")) for i in range(3)]
    batch = store.create_batch("acme", "docs", items)
    store.cancel_batch(batch.id)  # finished: it can be erased
    ran = JobStore.batch_query_ids

    def erasing(self: JobStore, batch_id: str, *args: Any) -> list[str]:
        if when == "before":
            self.erase_job("batch", "acme", batch_id)
        qids = ran(self, batch_id, *args)
        if when == "after":
            self.erase_job("batch", "acme", batch_id)
        return qids

    monkeypatch.setattr(JobStore, "batch_query_ids", erasing)
    page = client.get(f"/v1/batches/{batch.id}/results", params={"page_size": 2}, headers=ACME)
    assert page.status_code == 410, page.text
    assert page.json()["error"]["type"] == "erased", page.text


def test_a_cancel_whose_batch_is_erased_after_its_read_answers_erased(
    client: TestClient, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The erase between the cancel's read of the batch (it was there) and its script (the
    batch gone): the cancel answers ``410 erased``, as one sent after the erase does, not a
    ``404`` saying there is no such batch."""
    items = [(f"q{i}", SearchSpec(index="docs", query="tea")) for i in range(3)]
    batch = store.create_batch("acme", "docs", items)
    _erase_first(monkeypatch, "cancel_batch", lambda store, batch_id: store.cancel_batch(batch_id))
    answer = client.delete(f"/v1/batches/{batch.id}", headers=ACME)
    assert answer.status_code == 410, answer.text
    assert answer.json()["error"] == {
        "type": "erased",
        "message": answer.json()["error"]["message"],
        "field": "id",
    }, answer.text
    assert client.delete(f"/v1/batches/{batch.id}", headers=ACME).status_code == 410
