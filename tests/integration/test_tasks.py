"""The tasks run in-process against a real Redis: retry decision, poison messages, skips."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from worker import tasks
from worker.contract import DocumentIn, RerankInfo, SearchResult, SearchSpec
from worker.errors import BackendUnavailable, ModeUnavailable
from worker.jobstore import JobStore
from worker.ratelimit import ProviderLimiter
from worker.settings import load_settings

pytestmark = pytest.mark.integration


class ScriptedRuntime:
    """Fails with the scripted errors, in order, then answers."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def search(self, spec: SearchSpec, tenant: str) -> SearchResult:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return SearchResult(hits=[], rerank=RerankInfo(applied=False))

    def ingest(self, index: str, tenant: str, documents: list[DocumentIn]) -> int:
        return len(documents)


@pytest.fixture
def context(redis_url: str) -> Iterator[tasks.WorkerContext]:
    settings = load_settings(redis_url=redis_url, task_max_retries=2, task_max_deliveries=2)
    store = JobStore.from_url(redis_url)
    store.redis.flushdb()
    ctx = tasks.WorkerContext(settings=settings, store=store, limiter=ProviderLimiter(4))
    tasks.set_context(ctx)
    yield ctx
    tasks.set_context(None)
    store.close()


def _patch_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tasks.SiftTask, "backoff", lambda self: 0.0)


def test_retryable_errors_are_retried_then_succeed(
    context: tasks.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch_backoff(monkeypatch)
    runtime = ScriptedRuntime(BackendUnavailable("down"), BackendUnavailable("down"))
    context._runtime = runtime
    job = context.store.create_search("acme", SearchSpec(index="docs", query="q"))
    tasks.search.apply(args=[job.id])
    done = context.store.get_search(job.id)
    assert done is not None and done.status == "succeeded"
    assert runtime.calls == 3


def test_retries_are_bounded(context: tasks.WorkerContext, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_backoff(monkeypatch)
    runtime = ScriptedRuntime(*[BackendUnavailable("down")] * 10)
    context._runtime = runtime
    job = context.store.create_search("acme", SearchSpec(index="docs", query="q"))
    tasks.search.apply(args=[job.id])
    done = context.store.get_search(job.id)
    assert done is not None and done.status == "failed"
    assert done.error is not None and done.error.type == "backend_unavailable"
    assert runtime.calls == 3  # the first try and task_max_retries=2 retries


def test_permanent_errors_are_not_retried(context: tasks.WorkerContext) -> None:
    runtime = ScriptedRuntime(ModeUnavailable("no vectors in this index"))
    context._runtime = runtime
    job = context.store.create_search("acme", SearchSpec(index="docs", query="q"))
    tasks.search.apply(args=[job.id])
    done = context.store.get_search(job.id)
    assert done is not None and done.status == "failed" and runtime.calls == 1
    assert done.error is not None and done.error.type == "mode_unavailable"


def test_a_poison_message_is_failed_not_looped(context: tasks.WorkerContext) -> None:
    runtime = ScriptedRuntime()
    context._runtime = runtime
    job = context.store.create_search("acme", SearchSpec(index="docs", query="q"))
    for _ in range(2):  # two deliveries whose worker died mid-task
        context.store.count_delivery("poison-1", 0)
    tasks.search.apply(args=[job.id], task_id="poison-1")
    done = context.store.get_search(job.id)
    assert done is not None and done.status == "failed"
    assert done.error is not None and done.error.type == "delivery_limit_exceeded"
    assert runtime.calls == 0


def test_a_chunk_skips_canceled_and_finished_items(
    context: tasks.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch_backoff(monkeypatch)
    runtime = ScriptedRuntime(BackendUnavailable("blip"))
    context._runtime = runtime
    store = context.store
    items = [(f"q{i}", SearchSpec(index="docs", query=f"q{i}")) for i in range(6)]
    batch = store.create_batch("acme", "docs", items)
    store.start_item(batch.id, "q0")
    store.finish_item(
        batch.id, "q0", result=SearchResult(hits=[], rerank=RerankInfo(applied=False))
    )
    tasks.batch_chunk.apply(args=[batch.id, 0, 3])  # q1 blips once and is retried
    store.cancel_batch(batch.id)  # q3..q5 were never started
    tasks.batch_chunk.apply(args=[batch.id, 3, 6])
    tasks.batch_chunk.apply(args=[batch.id, 0, 3])  # a redelivery changes nothing
    got = store.get_batch(batch.id)
    assert got is not None
    assert got.counts == {"queued": 0, "running": 0, "succeeded": 3, "failed": 0, "canceled": 3}
    assert runtime.calls == 3  # q1 twice, q2 once
    assert got.status == "canceled" and got.finished_at is not None


def test_ingest_task(context: tasks.WorkerContext) -> None:
    context._runtime = ScriptedRuntime()
    job = context.store.create_ingest("acme", "docs", [DocumentIn(id="1", text="t")])
    tasks.ingest.apply(args=[job.id])
    done = context.store.get_ingest(job.id)
    assert done is not None and done.status == "succeeded" and done.upserted == 1
