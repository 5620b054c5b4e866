"""An erased economy batch's provider batches deleted at the provider
(:mod:`worker.queue.economy.deletion`), on a real Redis and the fake Message Batches API: the
erase keeps the ids of those Sift made (never a create in doubt's candidates) and writes the
delete task's message in its script; the task deletes each, cancels one not ended first,
and tries again later what the provider refused or failed."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import celery.exceptions
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from api_gateway.app import create_app
from api_gateway.queue import OutboxSender
from tests.fake_anthropic import FakeAnthropic, good, status
from tests.integration.gateway_app import gateway_settings
from tests.services import celery_worker
from worker.adapters.anthropic import AnthropicReranker
from worker.adapters.anthropic_batches import AnthropicMessageBatches
from worker.constants import (
    ECONOMY_DELETE_CHAIN_KEY,
    ECONOMY_DELETE_KEY,
    ECONOMY_DELETE_REFUSED_KEY,
    ECONOMY_DELETE_TASK,
    ECONOMY_PROVIDERS_KEY,
    SEARCH_QUEUE,
)
from worker.contract import RerankInfo, SearchResult, SearchSpec
from worker.observability import metrics
from worker.queue.base import WorkerContext
from worker.queue.economy.cancel import cancel_economy_batch
from worker.queue.economy.deletion import ask_refused_again, delete_erased, delete_provider_batch
from worker.queue.jobstore import EraseOutcome, JobStore
from worker.runtime.ratelimit import ProviderLimiter
from worker.settings import load_settings

pytestmark = pytest.mark.integration

MODEL = "claude-haiku-4-5"
QUEUE = "test-queue"
PARAMS = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


class Retry(celery.exceptions.Retry):
    """The task's retry, raised as Celery's is (one of its kind: the chain keeps its lease)."""


class _Task:
    """What the delete task uses of a Celery task: its context, its request, its retry."""

    def __init__(self, context: WorkerContext, task_id: str = "t1") -> None:
        self.context = context
        self.request = SimpleNamespace(id=task_id, retries=0)
        self.countdowns: list[float] = []

    def retry(self, countdown: float, **_: Any) -> Retry:
        self.countdowns.append(countdown)
        return Retry()


@pytest.fixture
def model() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as fake:
        fake.configure(batch_processing_seconds=0.0)
        yield fake


@pytest.fixture
def client(model: FakeAnthropic) -> AnthropicMessageBatches:
    sdk = anthropic.Anthropic(base_url=model.url, api_key="sk-ant-test", max_retries=0)
    return AnthropicMessageBatches(AnthropicReranker(MODEL, client=sdk))


def _made(client: AnthropicMessageBatches) -> str:
    return client.create([{"custom_id": "i0", "params": PARAMS}]).id


def _held(model: FakeAnthropic) -> set[str]:
    return {b["id"] for b in model.batches()}


def _erased_batch(
    store: JobStore,
    providers: dict[str, dict[str, Any]],
    message_of: Callable[[str], tuple[str, str]] | None = None,
) -> str:
    """A finished batch of acme's whose economy lane recorded ``providers``, erased; the
    delete task's message ``message_of(batch id)`` (default: a stand-in on :data:`QUEUE`)."""
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    store.start_item(batch.id, "q0")
    store.finish_item(
        batch.id, "q0", result=SearchResult(hits=[], rerank=RerankInfo(applied=False))
    )
    if providers:
        store.economy_save(batch.id, ECONOMY_PROVIDERS_KEY,
                           {pid: json.dumps(r) for pid, r in providers.items()})  # fmt: skip
    message = (QUEUE, json.dumps({"task": "delete", "batch": batch.id}))
    if message_of is not None:
        message = message_of(batch.id)
    assert store.erase_job("batch", "acme", batch.id, message).outcome is EraseOutcome.ERASED
    return batch.id


def test_the_erase_keeps_the_provider_batches_sift_made_and_writes_the_task_once(
    store: JobStore,
) -> None:
    made = {"round": 1, "requests": 4, "created_at": 1.0, "ended_at": 2.0, "submission": "s1"}
    candidate = {**made, "submission": "s2", "ended_at": None, "doubt": True}
    batch_id = _erased_batch(store, {"msgbatch_a": made, "msgbatch_b": made,
                                     "msgbatch_other": candidate})  # fmt: skip
    assert store.provider_deletions(batch_id) == ["msgbatch_a", "msgbatch_b"]
    assert store.provider_candidates(batch_id) == {"msgbatch_other": "s2"}
    assert store.redis.llen(QUEUE) == 1
    assert 0 < store.redis.ttl(ECONOMY_DELETE_KEY + batch_id) <= store.result_ttl
    again = store.erase_job("batch", "acme", batch_id, (QUEUE, "again"))
    assert again.outcome is EraseOutcome.ERASED and store.redis.llen(QUEUE) == 1
    store.provider_deleted(batch_id, "msgbatch_a")
    store.provider_deleted(batch_id, "msgbatch_b")
    assert not store.redis.exists(ECONOMY_DELETE_KEY + batch_id)
    # a batch whose lane made none (the standard lane's, say): no task
    assert _erased_batch(store, {})
    assert store.redis.llen(QUEUE) == 1
    # only a candidate not judged yet: kept aside with its create's submission, to judge
    only = _erased_batch(store, {"msgbatch_c": candidate})
    assert store.redis.llen(QUEUE) == 2
    assert store.provider_deletions(only) == [] and store.provider_candidates(only) == {
        "msgbatch_c": "s2"
    }


def test_an_ended_provider_batch_is_deleted_and_a_missing_one_is_done(
    model: FakeAnthropic, client: AnthropicMessageBatches
) -> None:
    provider_id = _made(client)
    assert delete_provider_batch(client, provider_id) is None
    assert _held(model) == set()
    assert delete_provider_batch(client, provider_id) is None  # 404: deleted already


def test_a_provider_batch_not_ended_is_canceled_then_deleted_once_ended(
    model: FakeAnthropic, client: AnthropicMessageBatches
) -> None:
    model.configure(batch_processing_seconds=600.0, batch_cancel_seconds=600.0)
    provider_id = _made(client)
    assert delete_provider_batch(client, provider_id) == 0.0  # refused: canceled instead
    assert [b["status"] for b in model.batches()] == ["canceling"]
    assert delete_provider_batch(client, provider_id) == 0.0  # still canceling
    model.configure(batch_processing_seconds=600.0, batch_cancel_seconds=0.0)
    assert delete_provider_batch(client, provider_id) is None
    assert _held(model) == set()


def test_a_failed_delete_is_tried_again_after_what_the_provider_asks(
    model: FakeAnthropic, client: AnthropicMessageBatches
) -> None:
    provider_id = _made(client)
    model.script_batch_calls("delete", [status(429, retry_after=7), status(529)])
    assert delete_provider_batch(client, provider_id) == 7.0
    assert delete_provider_batch(client, provider_id) == 0.0
    assert _held(model) == {provider_id}
    assert delete_provider_batch(client, provider_id) is None
    assert _held(model) == set()


def test_the_task_deletes_what_it_can_and_retries_the_rest(
    model: FakeAnthropic, client: AnthropicMessageBatches, store: JobStore, redis_url: str
) -> None:
    ended = _made(client)
    model.configure(batch_processing_seconds=600.0, batch_cancel_seconds=600.0)
    running = _made(client)
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": None}
    batch_id = _erased_batch(store, {ended: record, running: record})
    context = WorkerContext(settings=load_settings(redis_url=redis_url), store=store,
                            limiter=ProviderLimiter(1), _batches=client)  # fmt: skip
    task = _Task(context)
    with pytest.raises(Retry):
        delete_erased(task, batch_id)  # type: ignore[arg-type]
    assert store.provider_deletions(batch_id) == [running]
    assert _held(model) == {running} and task.countdowns
    model.configure(batch_cancel_seconds=0.0)
    delete_erased(task, batch_id)  # type: ignore[arg-type]
    assert store.provider_deletions(batch_id) == [] and _held(model) == set()
    delete_erased(task, batch_id)  # type: ignore[arg-type]  # a copy of the message: nothing


def _deletes(result: str) -> float:
    return float(metrics.PROVIDER_DELETES.labels(result)._value.get())


@pytest.mark.parametrize("code", [401, 403])
def test_a_delete_refused_for_its_key_is_logged_once_counted_and_not_asked_again(
    model: FakeAnthropic,
    client: AnthropicMessageBatches,
    store: JobStore,
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
    code: int,
) -> None:
    """A 401 (the key not valid: the retrieve after it answers the same) or a 403 (the key
    may not delete) is no refusal for the batch's state, which a later try could get past:
    the task stops asking, says which provider batch is left at the provider, once, and
    counts it. Before, it was asked again at the poll cadence for the whole retention, an
    ERROR logged each time (a 403), or a WARNING (a 401)."""
    provider_id = _made(client)
    deleted = _made(client)
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": 2.0}
    batch_id = _erased_batch(store, {provider_id: record, deleted: record})
    model.script_batch_calls("delete", [status(code)] if provider_id < deleted else
                             [good(), status(code)])  # fmt: skip
    model.script_batch_calls("retrieve", [status(code)] if code == 401 else [])
    context = WorkerContext(settings=load_settings(redis_url=redis_url), store=store,
                            limiter=ProviderLimiter(1), _batches=client)  # fmt: skip
    task = _Task(context)
    refused, done = _deletes("refused"), _deletes("deleted")
    with caplog.at_level(logging.ERROR, logger="worker.queue.economy.deletion"):
        delete_erased(task, batch_id)  # type: ignore[arg-type]  # no retry raised
    assert task.countdowns == []
    assert store.provider_deletions(batch_id) == []
    assert _held(model) == {provider_id}  # left there, named in the log
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and batch_id in errors[0] and provider_id in errors[0], errors
    assert (_deletes("refused") - refused, _deletes("deleted") - done) == (1, 1)
    delete_erased(task, batch_id)  # type: ignore[arg-type]  # a copy of the message: nothing
    assert task.countdowns == [] and len(caplog.records) == 1
    # kept aside: a starting worker asks it again, once; the key still refused, it is
    # logged and counted once more and waits for the next start, never asked at each poll
    assert store.refused_batches() == [batch_id]
    model.script_batch_calls("delete", [status(code)])
    model.script_batch_calls("retrieve", [status(code)] if code == 401 else [])
    sent: list[tuple[str, str]] = []
    assert ask_refused_again(store, lambda *args: sent.append(args)) == 1
    with caplog.at_level(logging.ERROR, logger="worker.queue.economy.deletion"):
        delete_erased(task, *sent[0])  # type: ignore[arg-type]
        delete_erased(task, *sent[0])  # type: ignore[arg-type]  # its copy: the token is used
    assert task.countdowns == [] and len(caplog.records) == 2
    assert _deletes("refused") - refused == 1 and _held(model) == {provider_id}  # counted once
    for _ in range(2):  # two workers start at once: each sends its task
        assert ask_refused_again(store, lambda *args: sent.append(args)) == 1
    stale, fresh = sent[-2:]
    delete_erased(task, *stale)  # type: ignore[arg-type]  # the earlier token: takes nothing
    assert _held(model) == {provider_id}
    delete_erased(task, *fresh)  # type: ignore[arg-type]  # the key fixed: deleted
    assert _held(model) == set() and _deletes("deleted") - done == 2
    assert store.refused_batches() == [] and ask_refused_again(store, sent.append) == 0
    assert store.redis.keys(f"*{batch_id}*") == [f"sift:erased:{batch_id}"]


def test_a_delete_refused_at_a_full_redis_is_kept_aside_whole(store: JobStore) -> None:
    """Keeping a refused delete aside moves its id in one script: removed from the provider
    batches to delete, then added to the refused ones. Lua rolls nothing back, so a write
    refused after the removal would lose the id; at a full Redis (its ``maxmemory``,
    ``noeviction``) none is: the server refuses only a script's first growing write, and
    this one's first write is the removal. The move is made whole there, not refused (a
    script adding first would be: nothing moved, the delete task failing on Redis)."""
    made = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": 2.0}
    batch_id = _erased_batch(store, {"msgbatch_a": made, "msgbatch_b": made})
    used = int(store.redis.info("memory")["used_memory"])
    store.redis.config_set("maxmemory", used // 2)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            store.redis.set("probe", "1")  # the refusal is real
        assert store.provider_refused(batch_id, "msgbatch_a")  # its first refusal
    finally:
        store.redis.config_set("maxmemory", 0)
    assert store.provider_deletions(batch_id) == ["msgbatch_b"]
    assert store.redis.hkeys(ECONOMY_DELETE_REFUSED_KEY + batch_id) == ["msgbatch_a"]
    assert store.refused_batches() == [batch_id]


def test_a_candidate_of_a_create_in_doubt_judged_ours_is_deleted_with_the_rest(
    store: JobStore,
) -> None:
    """A candidate whose results held a line of the create in doubt is ours (``proven``, as
    :func:`worker.queue.economy.results.map_results` records it): its requests and results
    are this batch's queries and candidates' text, deleted with the rest, by an erase and by
    a purge (:meth:`JobStore.keep_provider_deletions`). One judged another client's, or not
    judged yet (not ended: whose it is, no one knows), is left. Before, every candidate was
    left, ours too."""
    made = {"round": 1, "requests": 4, "created_at": 1.0, "ended_at": 2.0, "submission": "s1"}
    candidate = {**made, "submission": "s2", "doubt": True}
    providers = {
        "msgbatch_made": made,
        "msgbatch_ours": {**candidate, "proven": True},
        "msgbatch_theirs": {**candidate, "proven": False},
        "msgbatch_unjudged": {**candidate, "ended_at": None},
    }
    erased = _erased_batch(store, providers)
    assert store.provider_deletions(erased) == ["msgbatch_made", "msgbatch_ours"]
    assert store.provider_candidates(erased) == {"msgbatch_unjudged": "s2"}  # to judge
    purged = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    store.economy_save(purged.id, ECONOMY_PROVIDERS_KEY,
                       {pid: json.dumps(r) for pid, r in providers.items()})  # fmt: skip
    assert store.keep_provider_deletions(purged.id) == ["msgbatch_made", "msgbatch_ours"]
    assert store.provider_candidates(purged.id) == {"msgbatch_unjudged": "s2"}


def test_the_task_judges_a_candidate_kept_aside_once_it_ended_by_its_results(
    model: FakeAnthropic, client: AnthropicMessageBatches, store: JobStore, redis_url: str
) -> None:
    """A candidate not judged when its batch was erased: while it runs it is neither canceled
    nor deleted (it may be another client's), and asked again later; once it ended, one
    whose results hold a line of the create (``custom_id`` naming its submission) is deleted,
    one without is left, one the provider no longer has is dropped."""
    model.configure(batch_processing_seconds=600.0)
    ours = client.create([{"custom_id": "i0-s2", "params": PARAMS}]).id
    theirs = _made(client)  # its line "i0" names no submission
    gone = _made(client)
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": None,
              "submission": "s2", "doubt": True}  # fmt: skip
    batch_id = _erased_batch(store, {ours: record, theirs: record, gone: record})
    context = WorkerContext(settings=load_settings(redis_url=redis_url), store=store,
                            limiter=ProviderLimiter(1), _batches=client)  # fmt: skip
    task = _Task(context)
    with pytest.raises(Retry):
        delete_erased(task, batch_id)  # type: ignore[arg-type]
    assert {b["status"] for b in model.batches()} == {"in_progress"}  # none canceled
    assert set(store.provider_candidates(batch_id)) == {ours, theirs, gone}
    client.cancel(gone)  # ended, then deleted by its owner: the provider has it no more
    model.configure(batch_processing_seconds=600.0, batch_cancel_seconds=0.0)
    client.delete(gone)
    model.configure(batch_processing_seconds=0.0)
    delete_erased(task, batch_id)  # type: ignore[arg-type]  # no retry: all judged
    assert _held(model) == {theirs}
    assert store.provider_candidates(batch_id) == {} and store.provider_deletions(batch_id) == []


def _erase_message(store: JobStore) -> Callable[[str], tuple[str, str]]:
    """The erase's own task message for a batch: the real task's, as the erase writes it."""
    sender = OutboxSender(store)
    return lambda batch_id: sender.messages([(ECONOMY_DELETE_TASK, [batch_id], SEARCH_QUEUE)])[0]


def _worker_env(redis_url: str, model: FakeAnthropic | None, **more: str) -> dict[str, str]:
    """A real worker's settings: the fake's model and key when ``model`` is given (else none:
    no ``SIFT_GENERATION_MODEL``), a quick soft shutdown, no re-drive, and ``more``."""
    env = {
        "SIFT_REDIS_URL": redis_url,
        "SIFT_WORKER_METRICS_PORT": "0",
        "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
        "SIFT_REDRIVE_INTERVAL_SECONDS": "0",
    }
    if model is not None:
        env |= {"SIFT_GENERATION_MODEL": f"anthropic:{MODEL}", "ANTHROPIC_BASE_URL": model.url,
                "ANTHROPIC_API_KEY": "sk-ant-test"}  # fmt: skip
    return env | more


def _until(what: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a speed check
    while not what():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _erased_with_a_refused_delete(
    model: FakeAnthropic, client: AnthropicMessageBatches, store: JobStore
) -> tuple[str, str]:
    """An erased batch of one ended provider batch whose delete the provider will refuse
    for the key (403): (the provider batch, the Sift batch)."""
    provider_id = _made(client)
    model.script_batch_calls("delete", [status(403)])
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": 2.0}
    return provider_id, _erased_batch(store, {provider_id: record}, _erase_message(store))


def test_a_delete_refused_for_its_key_is_asked_again_once_when_a_worker_starts(
    model: FakeAnthropic,
    client: AnthropicMessageBatches,
    store: JobStore,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """A real worker whose key the provider refuses (403) logs the refusal once and stops
    asking; the operator fixes the key and restarts the worker, which asks that delete again
    once as it starts, and it is deleted. Before, a refusal was final: the provider batch
    stayed there for its 29 days though the key now works."""
    provider_id, batch_id = _erased_with_a_refused_delete(model, client, store)
    env = _worker_env(redis_url, model)
    log = tmp_path / "refused.log"
    with celery_worker(tmp_path, env, "refused", concurrency=2):
        _until(lambda: f"provider batch {provider_id} not deleted" in log.read_text())
        _until(lambda: not store.provider_deletions(batch_id))
    assert _held(model) == {provider_id}  # refused: left there, and not asked again
    with celery_worker(tmp_path, env, "fixed", concurrency=2):  # the key works now
        _until(lambda: _held(model) == set())
    assert f"provider batch {provider_id}: deleted" in (tmp_path / "fixed.log").read_text()
    assert store.redis.keys(f"*{batch_id}*") == [f"sift:erased:{batch_id}"]


def test_a_real_worker_s_chain_failed_by_redis_gives_its_lease_back(
    model: FakeAnthropic,
    client: AnthropicMessageBatches,
    store: JobStore,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """A real worker's delete task that Redis fails after it took the chain (its script
    keeping a refused delete aside answers an error: the key holds a value of another type)
    fails, acked, and gives the chain's lease back: no retry of it comes. Before, the lease
    stayed for three polls past the run (up to 32 min at the default cap), and a starting
    worker's task in that window left its work to it."""
    _, batch_id = _erased_with_a_refused_delete(model, client, store)
    store.redis.set(ECONOMY_DELETE_REFUSED_KEY + batch_id, "not a hash")
    log = tmp_path / "failed.log"
    with celery_worker(tmp_path, _worker_env(redis_url, model), "failed", concurrency=2):
        _until(lambda: "sift.economy_delete" in log.read_text()
               and "WRONGTYPE" in log.read_text())  # fmt: skip
        _until(lambda: not store.redis.exists(ECONOMY_DELETE_CHAIN_KEY + batch_id))
    assert not _retrying(log)  # failed, acked: no retry of it comes


def test_a_candidate_whose_judgement_the_key_refuses_is_judged_again_when_a_worker_starts(
    model: FakeAnthropic, client: AnthropicMessageBatches, store: JobStore, redis_url: str
) -> None:
    """A candidate kept aside whose read the provider refuses for the key (403) is kept with
    its create's submission among the refused ones, and judged, once, by the task a starting
    worker sends: ours, it is deleted then."""
    ours = client.create([{"custom_id": "i0-s2", "params": PARAMS}]).id
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": None,
              "submission": "s2", "doubt": True}  # fmt: skip
    batch_id = _erased_batch(store, {ours: record})
    context = WorkerContext(settings=load_settings(redis_url=redis_url), store=store,
                            limiter=ProviderLimiter(1), _batches=client)  # fmt: skip
    task = _Task(context)
    model.script_batch_calls("retrieve", [status(403)])
    delete_erased(task, batch_id)  # type: ignore[arg-type]  # no retry: refused for good
    assert task.countdowns == [] and store.provider_candidates(batch_id) == {}
    assert _held(model) == {ours}
    sent: list[tuple[str, str]] = []
    assert ask_refused_again(store, lambda *args: sent.append(args)) == 1
    delete_erased(task, *sent[0])  # type: ignore[arg-type]
    assert _held(model) == set() and store.refused_batches() == []


def test_an_erase_a_worker_without_the_model_takes_is_deleted_by_one_with_it(
    model: FakeAnthropic,
    client: AnthropicMessageBatches,
    store: JobStore,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """The deployment turned rerank off (no ``SIFT_GENERATION_MODEL``) after an economy
    batch ran, then the batch is erased: the worker that takes the delete cannot ask the
    provider, and asks again at the poll's cadence; once a worker with the model runs, the
    provider batch is deleted. Before, the first worker logged the ids and acked the message:
    nothing read ``sift:eco-delete:<batch>`` again, and the provider kept the batch."""
    provider_id = _made(client)
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": 2.0}
    batch_id = _erased_batch(store, {provider_id: record}, _erase_message(store))
    env = _worker_env(redis_url, None, SIFT_ECONOMY_POLL_SECONDS="1")
    with celery_worker(tmp_path, env, "nomodel", concurrency=2):
        _until(lambda: "not deleted" in (tmp_path / "nomodel.log").read_text())
    assert _held(model) == {provider_id}
    assert store.provider_deletions(batch_id) == [provider_id]
    model_env = _worker_env(redis_url, model, SIFT_ECONOMY_POLL_SECONDS="1")
    with celery_worker(tmp_path, model_env, "model", concurrency=2):
        _until(lambda: _held(model) == set())
        _until(lambda: not store.provider_deletions(batch_id))
    assert store.redis.keys(f"*{batch_id}*") == [f"sift:erased:{batch_id}"]


def test_a_cancel_without_the_model_is_asked_again_at_the_poll_cadence(
    model: FakeAnthropic, client: AnthropicMessageBatches, store: JobStore, redis_url: str
) -> None:
    """``sift.economy_cancel`` taken by a worker without ``SIFT_GENERATION_MODEL`` retries at
    the poll's cadence (it failed, its message acked, and the provider batch ran on, billed);
    the retry a worker with the model takes cancels it."""
    model.configure(batch_processing_seconds=600.0, batch_cancel_seconds=0.0)
    running = _made(client)
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="a"))])
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": None}
    store.economy_save(batch.id, ECONOMY_PROVIDERS_KEY, {running: json.dumps(record)})
    settings = load_settings(redis_url=redis_url)
    without = _Task(WorkerContext(settings=settings, store=store, limiter=ProviderLimiter(1)))
    with pytest.raises(Retry):
        cancel_economy_batch(without, batch.id)  # type: ignore[arg-type]
    assert without.countdowns == [settings.economy_poll_seconds]
    assert [b["status"] for b in model.batches()] == ["in_progress"]
    task = _Task(WorkerContext(settings=settings, store=store, limiter=ProviderLimiter(1),
                               _batches=client))  # fmt: skip
    task.app = SimpleNamespace(send_task=lambda *a, **kw: None)  # type: ignore[attr-defined]
    cancel_economy_batch(task, batch.id)  # type: ignore[arg-type]
    assert [b["status"] for b in model.batches()] != ["in_progress"]


def _running_candidate(model: FakeAnthropic, client: AnthropicMessageBatches) -> str:
    """A create in doubt's candidate still running (for an hour): never judged before then."""
    model.configure(batch_processing_seconds=3600.0)
    return client.create([{"custom_id": "i0-s2", "params": PARAMS}]).id


def test_each_worker_start_hands_the_refused_deletes_to_the_batch_s_one_delete_chain(
    model: FakeAnthropic, client: AnthropicMessageBatches, store: JobStore, redis_url: str
) -> None:
    """A delete refused for the key and a candidate still running: the erase's task retries
    (one chain, to judge the candidate). Each worker start's task takes the refused delete
    back and hands it to that chain, whose next run asks it, and ends: one chain, however
    many starts. Before, each start's task asked it and, finding the candidate running,
    retried too: N starts, N+1 chains polling the same candidate until it ended (24 h)."""
    made = _made(client)
    running = _running_candidate(model, client)
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": 2.0}
    candidate = {**record, "ended_at": None, "submission": "s2", "doubt": True}
    batch_id = _erased_batch(store, {made: record, running: candidate})
    context = WorkerContext(settings=load_settings(redis_url=redis_url), store=store,
                            limiter=ProviderLimiter(1), _batches=client)  # fmt: skip
    chain = _Task(context, "erase")
    model.script_batch_calls("delete", [status(403)])
    with pytest.raises(Retry):
        delete_erased(chain, batch_id)  # type: ignore[arg-type]
    assert store.provider_deletions(batch_id) == [] and store.refused_batches() == [batch_id]
    sent: list[tuple[str, str]] = []
    for start in range(5):  # a rollout, OOM restarts, a crash loop
        sent.clear()
        assert ask_refused_again(store, lambda *args: sent.append(args)) == (start == 0)
        for args in sent:
            delete_erased(_Task(context, f"start{start}"), *args)  # type: ignore[arg-type]
    assert store.provider_deletions(batch_id) == [made]  # handed to the chain
    with pytest.raises(Retry):  # the chain's next run: the key works now; the candidate runs
        delete_erased(chain, batch_id)  # type: ignore[arg-type]
    assert _held(model) == {running} and store.provider_deletions(batch_id) == []
    model.configure(batch_processing_seconds=0.0)
    delete_erased(chain, batch_id)  # type: ignore[arg-type]  # judged ours: deleted, the end
    assert _held(model) == set()
    assert store.redis.keys(f"*{batch_id}*") == [f"sift:erased:{batch_id}"]


def test_a_chain_whose_worker_died_is_taken_over_by_the_next_message(
    model: FakeAnthropic, client: AnthropicMessageBatches, store: JobStore, redis_url: str
) -> None:
    """The chain's lease lapses when its worker died and no copy of its message came back:
    the next message for the batch (a starting worker's) takes the chain over and retries,
    and a late copy of the old one, finding the new chain, ends."""
    running = _running_candidate(model, client)
    candidate = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": None,
                 "submission": "s2", "doubt": True}  # fmt: skip
    batch_id = _erased_batch(store, {running: candidate})
    context = WorkerContext(settings=load_settings(redis_url=redis_url), store=store,
                            limiter=ProviderLimiter(1), _batches=client)  # fmt: skip
    old, new = _Task(context, "old"), _Task(context, "new")
    with pytest.raises(Retry):
        delete_erased(old, batch_id)  # type: ignore[arg-type]
    assert store.redis.pttl(ECONOMY_DELETE_CHAIN_KEY + batch_id) > 0  # its lease, renewed
    delete_erased(new, batch_id)  # type: ignore[arg-type]  # the chain lives: handed over
    assert new.countdowns == []
    store.redis.delete(ECONOMY_DELETE_CHAIN_KEY + batch_id)  # the lease lapsed
    with pytest.raises(Retry):
        delete_erased(new, batch_id)  # type: ignore[arg-type]  # takes the chain over
    delete_erased(old, batch_id)  # type: ignore[arg-type]  # a late copy of the old: ends
    assert len(old.countdowns) == 1
    model.configure(batch_processing_seconds=0.0)
    delete_erased(new, batch_id)  # type: ignore[arg-type]
    assert _held(model) == set()
    assert store.redis.keys(f"*{batch_id}*") == [f"sift:erased:{batch_id}"]


def test_a_chain_ended_by_an_unexpected_error_gives_its_lease_back_to_the_next_message(
    model: FakeAnthropic,
    client: AnthropicMessageBatches,
    store: JobStore,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chain's run ended by an exception Celery does not retry (Redis failing as it drops
    a deleted id, here; a bug) is acked: the chain is over, and it gives its lease back, so
    the next message for the batch (a starting worker's) takes the chain and deletes. Its
    retries keep it (the retry's copy is the chain). Before, the lease stayed until it
    lapsed (up to 32 min at the default poll cap): that message found it live, left its
    ids to a chain that no longer existed, and ended."""
    made, waiting = _made(client), _running_candidate(model, client)
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": 2.0}
    candidate = {**record, "ended_at": None, "submission": "s2", "doubt": True}
    batch_id = _erased_batch(store, {made: record, waiting: candidate})
    context = WorkerContext(settings=load_settings(redis_url=redis_url), store=store,
                            limiter=ProviderLimiter(1), _batches=client)  # fmt: skip
    chain = _Task(context, "erase")
    with pytest.raises(Retry):  # the candidate runs: the chain retries, its lease kept
        delete_erased(chain, batch_id)  # type: ignore[arg-type]
    assert store.redis.get(ECONOMY_DELETE_CHAIN_KEY + batch_id) == "erase"
    store.redis.sadd(ECONOMY_DELETE_KEY + batch_id, made)  # as a start's token task puts back

    def failing(*_: Any) -> None:
        raise redis.ConnectionError("Connection reset by peer")

    monkeypatch.setattr(store, "provider_deleted", failing)
    with pytest.raises(redis.ConnectionError):
        delete_erased(chain, batch_id)  # type: ignore[arg-type]
    assert not store.redis.exists(ECONOMY_DELETE_CHAIN_KEY + batch_id)  # given back
    monkeypatch.undo()
    model.configure(batch_processing_seconds=0.0)
    delete_erased(_Task(context, "start"), batch_id)  # type: ignore[arg-type]  # takes it
    assert _held(model) == set()
    assert store.redis.keys(f"*{batch_id}*") == [f"sift:erased:{batch_id}"]


def test_a_start_without_the_model_takes_the_refused_ones_and_its_retry_deletes_them(
    model: FakeAnthropic, client: AnthropicMessageBatches, store: JobStore, redis_url: str
) -> None:
    """A worker without ``SIFT_GENERATION_MODEL`` starting takes the batch's refused deletes
    back (its token task runs before it knows it has no client), then retries at the poll's
    cadence: a later start asks nothing (none is refused now), and the retry a worker with the
    model takes deletes them. The ids never sit in ``sift:eco-delete:<batch>`` with no task
    to read them."""
    made = _made(client)
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": 2.0}
    batch_id = _erased_batch(store, {made: record})
    settings = load_settings(redis_url=redis_url)
    with_model = WorkerContext(settings=settings, store=store, limiter=ProviderLimiter(1),
                               _batches=client)  # fmt: skip
    model.script_batch_calls("delete", [status(403)])
    delete_erased(_Task(with_model, "erase"), batch_id)  # type: ignore[arg-type]  # refused
    assert store.refused_batches() == [batch_id]
    no_model = WorkerContext(settings=load_settings(redis_url=redis_url, generation_model=None),
                             store=store, limiter=ProviderLimiter(1))  # fmt: skip
    assert no_model.batches is None
    sent: list[tuple[str, str]] = []
    assert ask_refused_again(store, lambda *args: sent.append(args)) == 1
    without = _Task(no_model, "start1")
    with pytest.raises(Retry):
        delete_erased(without, *sent[-1])  # type: ignore[arg-type]
    assert without.countdowns == [settings.economy_poll_seconds]
    assert store.provider_deletions(batch_id) == [made] and store.refused_batches() == []
    assert ask_refused_again(store, lambda *args: sent.append(args)) == 0  # start 2: nothing
    delete_erased(_Task(with_model, "start1"), batch_id)  # type: ignore[arg-type]  # its retry
    assert _held(model) == set()
    assert store.redis.keys(f"*{batch_id}*") == [f"sift:erased:{batch_id}"]


def _retrying(log: Path) -> set[str]:
    """The delete tasks (Celery keeps a task's id across its retries) that retried in ``log``."""
    text = log.read_text() if log.exists() else ""
    return set(re.findall(r"sift\.economy_delete\[([0-9a-f-]+)\] retry", text))


def _ended(log: Path) -> set[str]:
    text = log.read_text() if log.exists() else ""
    return set(re.findall(r"sift\.economy_delete\[([0-9a-f-]+)\] succeeded", text))


def test_worker_starts_keep_one_delete_chain_per_erased_batch(
    model: FakeAnthropic,
    client: AnthropicMessageBatches,
    store: JobStore,
    redis_url: str,
    tmp_path: Path,
) -> None:
    """Real workers: the erase's task retries while a candidate runs; two more starts each
    send their token task, which hands the refused delete to that chain and ends. Before,
    each start's task retried too, a chain of its own until the candidate ended."""
    made = _made(client)
    running = _running_candidate(model, client)
    model.script_batch_calls("delete", [status(403)] * 200)  # this key may not delete
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": 2.0}
    candidate = {**record, "ended_at": None, "submission": "s2", "doubt": True}
    _erased_batch(store, {made: record, running: candidate}, _erase_message(store))
    env = _worker_env(
        redis_url, model, SIFT_ECONOMY_POLL_SECONDS="0.5", SIFT_ECONOMY_POLL_MAX_SECONDS="1"
    )
    with celery_worker(tmp_path, env, "start0", concurrency=4):
        _until(lambda: len(_retrying(tmp_path / "start0.log")) == 1)
    chains = _retrying(tmp_path / "start0.log")
    for start in (1, 2):
        log = tmp_path / f"start{start}.log"
        with celery_worker(tmp_path, env, f"start{start}", concurrency=4):
            # the start's own task has run: ended, or retried as a chain of its own
            _until(lambda: bool((_ended(log) | _retrying(log)) - chains))  # noqa: B023
            _until(lambda: bool(_retrying(log) & chains))  # noqa: B023  # the chain polls on
            chains |= _retrying(log)
    assert len(chains) == 1, f"{len(chains)} delete chains for one erased batch"
    assert _held(model) == {made, running}


def test_a_refusal_is_counted_once_per_provider_batch_and_a_candidate_s_read_not_at_all(
    model: FakeAnthropic, client: AnthropicMessageBatches, store: JobStore, redis_url: str
) -> None:
    """``refused`` less the ``deleted`` that follow is what the provider still holds of an
    erasure (docs/observability.md): a delete refused at the erase and again at a start, then
    deleted at the next, counts one of each; a candidate whose read the key refused, judged
    another client's after a start, counts neither. Before, the first counted two
    ``refused`` for one ``deleted``, and the candidate one ``refused`` with nothing after:
    two erasures read as held where the provider held none of Sift's."""
    made = _made(client)
    theirs = _made(client)  # ended; its line "i0" names no submission of the create's
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": 2.0}
    candidate = {**record, "ended_at": None, "submission": "s2", "doubt": True}
    batch_id = _erased_batch(store, {made: record, theirs: candidate})
    context = WorkerContext(settings=load_settings(redis_url=redis_url), store=store,
                            limiter=ProviderLimiter(1), _batches=client)  # fmt: skip
    refused, deleted = _deletes("refused"), _deletes("deleted")
    model.script_batch_calls("retrieve", [status(403)])  # the candidate's read refused
    model.script_batch_calls("delete", [status(403)])  # the made one's delete refused
    delete_erased(_Task(context, "erase"), batch_id)  # type: ignore[arg-type]
    assert (_deletes("refused") - refused, _deletes("deleted") - deleted) == (1, 0)
    sent: list[tuple[str, str]] = []
    for start, answer in enumerate([status(403), good()]):  # the key fixed at the second
        model.script_batch_calls("delete", [answer])
        assert ask_refused_again(store, lambda *args: sent.append(args)) == 1
        delete_erased(_Task(context, f"start{start}"), *sent[-1])  # type: ignore[arg-type]
    assert _held(model) == {theirs}  # Sift's deleted; the other client's left
    assert (_deletes("refused") - refused, _deletes("deleted") - deleted) == (1, 1)
    assert store.redis.keys(f"*{batch_id}*") == [f"sift:erased:{batch_id}"]


def _refused_gauge(text: str) -> dict[str, float]:
    """``sift_provider_batch_deletes_refused`` in a ``/metrics`` page, by ``kind``."""
    return {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sift_provider_batch_deletes_refused"
    }


def test_the_gateway_s_metrics_show_the_refused_deletes_the_provider_still_holds(
    model: FakeAnthropic, client: AnthropicMessageBatches, store: JobStore, redis_url: str
) -> None:
    """``sift_provider_batch_deletes_refused`` is read from Redis at each scrape, as the
    backlog is: the provider batches of erasures whose delete the key was refused, kept
    aside until a worker starts (``delete``), and the candidates whose read it refused
    (``candidate``: maybe another client's); a start with the key fixed empties it. Before,
    nothing showed them: the counter's ``refused`` less ``deleted`` needs every worker's
    counts since the refusal, and resets with a worker."""
    made, other = _made(client), _made(client)
    record = {"round": 1, "requests": 1, "created_at": 1.0, "ended_at": 2.0}
    candidate = {**record, "submission": "s2", "doubt": True}
    batch_id = _erased_batch(store, {made: record, other: candidate})
    context = WorkerContext(settings=load_settings(redis_url=redis_url), store=store,
                            limiter=ProviderLimiter(1), _batches=client)  # fmt: skip
    with TestClient(create_app(gateway_settings(redis_url))) as gateway:
        assert _refused_gauge(gateway.get("/metrics").text) == {"delete": 0, "candidate": 0}
        model.script_batch_calls("retrieve", [status(403)])
        model.script_batch_calls("delete", [status(403)])
        delete_erased(_Task(context, "erase"), batch_id)  # type: ignore[arg-type]
        assert _refused_gauge(gateway.get("/metrics").text) == {"delete": 1, "candidate": 1}
        sent: list[tuple[str, str]] = []
        assert ask_refused_again(store, lambda *args: sent.append(args)) == 1
        delete_erased(_Task(context, "start"), *sent[-1])  # type: ignore[arg-type]
        assert _held(model) == {other}  # Sift's deleted; the other client's left
        assert _refused_gauge(gateway.get("/metrics").text) == {"delete": 0, "candidate": 0}
