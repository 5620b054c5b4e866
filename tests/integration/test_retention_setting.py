"""``SIFT_RESULT_RETENTION_SECONDS``: how long a job's record and results stay in Redis from
the write that ended it, the same in the gateway, the workers and the re-drive. Redis holds
every result that long under ``noeviction``, so a deployment sizes it by this (deploy/README.md
§3); it was 7 days, fixed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from api_gateway.app import create_app
from tests.integration.gateway_app import ACME, gateway_settings
from worker.constants import BATCH_KEY, MIN_RESULT_RETENTION_SECONDS, SEARCH_KEY
from worker.contract import ErrorInfo, SearchSpec
from worker.queue import base
from worker.queue.jobstore import JobStore

THREE_DAYS = 3 * 24 * 3600


def _within(ttl: int, seconds: int) -> bool:
    return seconds - 60 < ttl <= seconds


@pytest.fixture
def worker_context(
    redis_url: str, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> Iterator[base.WorkerContext]:
    """The worker process's context, built afresh from settings with a 3-day retention."""
    monkeypatch.setattr(base, "_context", None)
    context = base.get_context(gateway_settings(redis_url, result_retention_seconds=THREE_DAYS))
    yield context
    context.store.close()


def test_the_gateway_keeps_what_it_ends_for_the_retention_set(
    redis_url: str, store: JobStore
) -> None:
    """What it creates has no TTL until it ends (a job not final never expires); a batch its
    cancel ends lives the retention from then."""
    with TestClient(
        create_app(gateway_settings(redis_url, result_retention_seconds=THREE_DAYS))
    ) as c:
        search = c.post("/v1/searches", json={"index": "docs", "query": "tea"}, headers=ACME)
        batch = c.post(
            "/v1/batches",
            json={"index": "docs", "queries": [{"id": "a", "query": "tea"}]},
            headers=ACME,
        )
        assert search.status_code == 202 and batch.status_code == 202, (search.text, batch.text)
        assert int(store.redis.ttl(SEARCH_KEY + search.json()["id"])) == -1
        assert int(store.redis.ttl(BATCH_KEY + batch.json()["id"])) == -1
        canceled = c.delete(f"/v1/batches/{batch.json()['id']}", headers=ACME)
        assert canceled.status_code == 200, canceled.text
    assert _within(int(store.redis.ttl(BATCH_KEY + batch.json()["id"])), THREE_DAYS)


def test_the_worker_ends_a_job_with_the_retention_set(
    store: JobStore, worker_context: base.WorkerContext
) -> None:
    """A job the worker ends lives the retention from then (the default store kept 7 days,
    whatever the gateway was told)."""
    job = store.create_search("acme", SearchSpec(index="docs", query="tea"))
    worker = worker_context.store
    assert worker.start_search(job.id)
    assert worker.finish_search(job.id, error=ErrorInfo(type="internal_error", message="m"))
    ttl = int(store.redis.ttl(SEARCH_KEY + job.id))
    assert _within(ttl, THREE_DAYS), ttl


def test_a_retention_shorter_than_a_webhooks_retries_is_refused(redis_url: str) -> None:
    with pytest.raises(ValidationError, match="result_retention_seconds"):
        gateway_settings(redis_url, result_retention_seconds=MIN_RESULT_RETENTION_SECONDS - 1)
