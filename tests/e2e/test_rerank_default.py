"""A search or batch that leaves ``rerank`` out, run by a gateway and a worker whose
``SIFT_RERANK_ENABLED`` differ (a rollout that has reached one and not the other, or a value
lost from one of them), over the real stack.

The gateway checks the request against its own settings, so its default is the one the
request was accepted under: it writes it into the job, and the worker runs what the job says.
Before, the worker decided an omitted ``rerank`` by its own setting: a gateway set to rerank
got fused results with ``applied: false`` and no reason, and a gateway set not to got reranks
(and their bills) it never asked for. A job stored without the field, as a gateway before
this change stored it, still goes by the worker's setting, so an upgrade in place runs the
jobs already queued as it did.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_gateway.queue import OutboxSender
from tests.e2e.conftest import ACME, INDEX, finished_batch, split_stack
from tests.fake_anthropic import FakeAnthropic
from worker.constants import SEARCH_QUEUE, SEARCH_TASK
from worker.contract import SearchSpec
from worker.queue.jobstore import JobStore, SearchJob

pytestmark = pytest.mark.integration


@contextmanager
def _differing(
    tmp: Path, *, gateway_reranks: bool, worker_reranks: bool
) -> Iterator[tuple[httpx.Client, JobStore, FakeAnthropic]]:
    """A gateway and a worker, both with a generation model, whose ``SIFT_RERANK_ENABLED``
    are as given, the six documents ingested: the client, the job store, the model."""
    model = {"SIFT_GENERATION_MODEL": "anthropic:claude-haiku-4-5"}
    with split_stack(
        tmp,
        gateway_env={**model, "SIFT_RERANK_ENABLED": str(gateway_reranks).lower()},
        worker_env={**model, "SIFT_RERANK_ENABLED": str(worker_reranks).lower()},
    ) as stack:
        store = JobStore.from_url(stack.redis_url)
        try:
            yield stack.client, store, stack.model
        finally:
            store.close()


def _search(client: httpx.Client, **asked: Any) -> dict[str, Any]:
    """A search of ``honey`` run to its end, ``rerank`` left out unless ``asked``: its result."""
    body = {"index": INDEX, "query": "honey", "limit": 3, **asked}
    response = client.post("/v1/searches", params={"wait": 30}, json=body)
    assert response.status_code == 200, response.text
    searched = response.json()
    assert searched["status"] == "succeeded", searched
    return dict(searched["result"])


def _batch_reranks(client: httpx.Client) -> list[dict[str, Any]]:
    """A two-query batch, ``rerank`` left out, run to its end: each item's ``rerank``."""
    queries = [{"id": f"q{i}", "query": "honey"} for i in range(2)]
    batch, page = finished_batch(client, {"index": INDEX, "queries": queries}, ACME)
    assert batch["counts"]["succeeded"] == 2, batch
    return [item["result"]["rerank"] for item in page["results"]]


def _stored_before_the_change(store: JobStore) -> SearchJob:
    """A search job as a gateway before this change stored it, ``rerank`` left out of its
    spec, queued and run to its end: its final record."""
    sender = OutboxSender(store)
    spec = SearchSpec(index=INDEX, query="honey", limit=3)
    assert spec.rerank is None  # the record's spec says "rerank": null, as it did then
    job = store.create_search(
        "acme",
        spec,
        enqueue=lambda job_id: sender.messages([(SEARCH_TASK, [job_id], SEARCH_QUEUE)]),
    )
    deadline = time.monotonic() + 30  # a hang guard, not a speed check
    while (found := store.get_search(job.id)) is None or not found.status.final:
        assert time.monotonic() < deadline, found
        time.sleep(0.05)
    assert found.status == "succeeded" and found.result is not None, found
    return found


@pytest.mark.timeout(240)
def test_a_gateway_that_reranks_by_default_has_its_searches_reranked(tmp_path: Path) -> None:
    """Gateway ``SIFT_RERANK_ENABLED=true``, worker ``false``: the searches and batch items
    that leave ``rerank`` out are reranked, as the gateway that took them says."""
    with _differing(tmp_path, gateway_reranks=True, worker_reranks=False) as (client, store, model):
        assert _search(client)["rerank"]["applied"] is True
        assert all(rerank["applied"] for rerank in _batch_reranks(client))
        assert len(model.requests()) == 3  # one call a search
        assert _search(client, rerank=False)["rerank"]["applied"] is False  # as asked

        old = _stored_before_the_change(store)
        assert old.result is not None and old.result.rerank.applied is False  # the worker's
        assert len(model.requests()) == 3


@pytest.mark.timeout(240)
def test_a_gateway_that_does_not_rerank_by_default_has_no_search_reranked(
    tmp_path: Path,
) -> None:
    """Gateway ``SIFT_RERANK_ENABLED=false``, worker ``true``: the searches and batch items
    that leave ``rerank`` out are not reranked, and the model is not called (or billed)."""
    with _differing(tmp_path, gateway_reranks=False, worker_reranks=True) as (client, store, model):
        assert _search(client)["rerank"] == {
            "applied": False,
            "policy": None,
            "fallback_reason": None,
        }
        assert not any(rerank["applied"] for rerank in _batch_reranks(client))
        assert model.requests() == []
        assert _search(client, rerank=True)["rerank"]["applied"] is True  # as asked

        old = _stored_before_the_change(store)
        assert old.result is not None and old.result.rerank.applied is True  # the worker's
        assert len(model.requests()) == 2
