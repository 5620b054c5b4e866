"""A job whose worker process dies is redelivered, then failed as poison instead of looping."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_gateway.queue import OutboxSender
from tests.services import celery_worker, redis_server
from worker.constants import SEARCH_QUEUE, SEARCH_TASK
from worker.contract import SearchSpec
from worker.queue.jobstore import JobStore, SearchJob

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobStore]:
    tmp = Path(tmp_path_factory.mktemp("loss"))
    with redis_server(tmp / "redis") as url:
        env = {
            "SIFT_REDIS_URL": url + "/0",
            "SIFT_RUNTIME_FACTORY": "tests.integration.dying_runtime:build_runtime",
            "SIFT_TASK_MAX_DELIVERIES": "2",
            "SIFT_WORKER_METRICS_PORT": "0",
            "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
        }
        store = JobStore.from_url(url + "/0")
        with celery_worker(tmp / "w", env, "loss", concurrency=1, pool="prefork"):
            yield store
        store.close()


def _submit(store: JobStore, query: str) -> SearchJob:
    sender = OutboxSender(store)
    return store.create_search(
        "acme",
        SearchSpec(index="docs", query=query),
        enqueue=lambda job_id: sender.messages([(SEARCH_TASK, [job_id], SEARCH_QUEUE)]),
    )


def _wait_final(store: JobStore, job_id: str, timeout: float = 60) -> SearchJob:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = store.get_search(job_id)
        if job is not None and job.status.final:
            return job
        time.sleep(0.1)
    raise AssertionError(f"{job_id} never became final")


def test_a_poison_job_is_failed_after_the_delivery_limit(store: JobStore) -> None:
    poison = _submit(store, "die")
    done = _wait_final(store, poison.id)
    assert done.status == "failed"
    assert done.error is not None and done.error.type == "delivery_limit_exceeded"
    # and the worker is still serving: the next job runs normally
    healthy = _wait_final(store, _submit(store, "fine").id)
    assert healthy.status == "succeeded"
