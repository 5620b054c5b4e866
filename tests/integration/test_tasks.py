"""The tasks run in-process against a real Redis: retry decision, poison messages, skips."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import pytest
import redis

from tests.fakes import EmptyRuntime, FakeEmbedder, InMemoryBackend, ScriptedReranker, reply
from tests.integration.es_loopback import Answer, FakeElasticsearchServer, error_body, running
from worker import clock
from worker.adapters.elasticsearch import ElasticsearchBackend
from worker.constants import SEARCH_KEY, WORKER_HEARTBEAT_KEY
from worker.contract import DocumentIn, ErrorInfo, RerankInfo, SearchResult, SearchSpec
from worker.core.pipeline import BeforeModel, SearchPipeline
from worker.core.types import RerankPrompt, RerankReply
from worker.errors import BackendUnavailable, ModeUnavailable
from worker.queue import base, liveness, tasks, webhook_task
from worker.queue.economy import is_prepared
from worker.queue.intake import INTAKE
from worker.queue.jobstore import BatchJob, CancelOutcome, JobStore, RunClaim, SearchJob
from worker.queue.tasks import batches
from worker.runtime.bootstrap import build_pipeline
from worker.runtime.inprocess import Runtime
from worker.runtime.ratelimit import ProviderLimiter
from worker.settings import load_settings

pytestmark = pytest.mark.integration


class ScriptedRuntime(EmptyRuntime):
    """Fails with the scripted errors, in order, then answers."""

    def __init__(
        self, *errors: Exception, first_half: Callable[[SearchSpec], None] | None = None
    ) -> None:
        self.errors = list(errors)
        self.calls = 0
        self.model_calls = 0
        self.first_half = first_half  # runs where retrieval would, before the model call
        self.spent: list[float] = []  # each run's deadline time spent by the runs before it

    def search(
        self,
        spec: SearchSpec,
        tenant: str,
        before_model: BeforeModel | None = None,
        *,
        spent: float = 0.0,
        answers: object = None,
    ) -> SearchResult:
        self.calls += 1
        self.spent.append(spent)
        if self.errors:
            raise self.errors.pop(0)
        if self.first_half is not None:
            self.first_half(spec)
        if before_model is not None:
            before_model(None)
        self.model_calls += 1
        return super().search(spec, tenant)


@pytest.fixture
def context(redis_url: str) -> Iterator[base.WorkerContext]:
    settings = load_settings(redis_url=redis_url, task_max_retries=2, task_max_deliveries=2)
    store = JobStore.from_url(redis_url)
    store.redis.flushdb()
    ctx = base.WorkerContext(settings=settings, store=store, limiter=ProviderLimiter(4))
    base.set_context(ctx)
    yield ctx
    base.set_context(None)
    store.close()


def _patch_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base.SiftTask, "backoff", lambda self: 0.0)


def test_retryable_errors_are_retried_then_succeed(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch_backoff(monkeypatch)
    runtime = ScriptedRuntime(BackendUnavailable("down"), BackendUnavailable("down"))
    context._runtime = runtime
    job = context.store.create_search("acme", SearchSpec(index="docs", query="q"))
    tasks.search.apply(args=[job.id])
    done = context.store.get_search(job.id)
    assert done is not None and done.status == "succeeded"
    assert runtime.calls == 3


def test_a_search_s_retry_finds_its_claim_let_go_when_it_is_sent(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task retry is a message another thread or worker may take as soon as its countdown
    (half a second at the least) is over. The run that sends it must have let its claim go
    by then (worker/queue/jobstore/runs.py): it let go only after the retry was sent, so a
    retry taken before that release landed found the claim held by a live worker, made no
    model call and left the search ``running`` with no message, for the re-drive to find
    minutes later. Here the retry's delivery is played at the moment it is sent."""
    _patch_backoff(monkeypatch)
    store = context.store
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)  # this worker, alive
    monkeypatch.setattr(liveness, "run_owner", lambda: "w1")
    runtime = ScriptedRuntime(BackendUnavailable("down"))
    context._runtime = runtime
    job = store.create_search("acme", SearchSpec(index="docs", query="q"))
    sent = base.SiftTask.retry
    delivered: list[bool] = []

    def retry(self: base.SiftTask, *args: Any, **kwargs: Any) -> Any:
        taken = store.claim_search(job.id, "w2", lease_seconds=30)  # the retry, delivered
        delivered.append(taken.granted)
        store.release_search(job.id, taken)
        return sent(self, *args, **kwargs)

    monkeypatch.setattr(base.SiftTask, "retry", retry)
    tasks.search.apply(args=[job.id])
    assert delivered == [True], delivered
    done = store.get_search(job.id)
    assert done is not None and done.status == "succeeded" and runtime.calls == 2


def _search_state(store: JobStore, job_id: str) -> tuple[dict[str, str], dict[str, str]]:
    """A search's record and the fleet's status counts, as Redis holds them."""
    from worker.constants import SEARCH_KEY, STATS_KEY

    record = store.redis.hgetall(SEARCH_KEY + job_id)
    return cast(dict[str, str], record), cast(dict[str, str], store.redis.hgetall(STATS_KEY))


def test_a_search_copy_that_loses_the_claim_changes_nothing_of_the_run_going_on(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search's message delivered again while its first run is going (kombu's restore, a
    reconnect's put-back): the copy finds the claim held by a live worker and leaves the
    search to that run (worker/queue/jobstore/runs.py). It wrote its own start first, so the
    record's ``started_at`` (and its ``move``) were the copy's, a run that never ran: the
    search's ``finished_at - started_at`` was shorter than the run that made its result."""
    from worker.constants import SEARCH_QUEUE

    store = context.store
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)  # this worker, alive
    monkeypatch.setattr(liveness, "run_owner", lambda: "w1")
    inside, go = threading.Event(), threading.Event()

    def held(spec: SearchSpec) -> None:  # the first run, at its retrieval
        inside.set()
        go.wait(30)

    runtime = ScriptedRuntime(first_half=held)
    context._runtime = runtime
    job = store.create_search("acme", SearchSpec(index="docs", query="q"))
    waits = _queue_waits(SEARCH_QUEUE)[0]
    first = threading.Thread(target=tasks.search.apply, args=([job.id],))
    first.start()
    try:
        assert inside.wait(30)
        running = _search_state(store, job.id)
        tasks.search.apply(args=[job.id])  # the copy
        assert _search_state(store, job.id) == running
    finally:
        go.set()
        first.join()
    done = store.get_search(job.id)
    assert done is not None and done.status == "succeeded", done
    assert done.started_at == float(running[0]["started_at"])  # the run that made the result
    assert runtime.model_calls == 1 and _queue_waits(SEARCH_QUEUE)[0] - waits == 1


def test_a_search_copy_that_loses_the_claim_to_a_run_about_to_retry_leaves_it_queued(
    context: base.WorkerContext,
) -> None:
    """A run that fails retryably requeues its search, then lets its claim go and sends its
    retry (:func:`worker.queue.tasks.search`). A copy delivered between the two loses the
    claim; it had moved the search back to ``running``, with a ``started_at`` of its own, a
    run that never ran, until the retry's run started."""
    store = context.store
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)
    runtime = ScriptedRuntime()
    context._runtime = runtime
    job = store.create_search("acme", SearchSpec(index="docs", query="q"))
    claim = store.claim_search(job.id, "w1", lease_seconds=30)  # the first run
    assert store.start_search(job.id) and store.requeue_search(job.id)  # its retry, coming
    waiting = _search_state(store, job.id)
    tasks.search.apply(args=[job.id])  # the copy
    assert _search_state(store, job.id) == waiting and runtime.calls == 0
    assert waiting[0]["status"] == "queued"
    store.release_search(job.id, claim)


def test_a_search_s_queue_wait_is_observed_once_when_a_copy_runs_it_after_a_retry(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of a search's message reads the search (``queued``, never started), then is
    held up; meanwhile the first delivery runs it, fails retryably, lets its claim go and
    sends its retry, and the copy, going on, takes the claim and makes the result.
    ``sift_job_queue_wait_seconds{queue="sift.search"}`` counts the search's wait once, at
    its first run: the copy counted it again, from the record it read before that run."""
    from worker.constants import SEARCH_QUEUE

    _patch_backoff(monkeypatch)
    store = context.store
    runtime = ScriptedRuntime(BackendUnavailable("down"))
    context._runtime = runtime
    job = store.create_search("acme", SearchSpec(index="docs", query="q"))
    read, go = threading.Event(), threading.Event()
    get_search = store.get_search

    def held_up(job_id: str) -> SearchJob | None:
        found = get_search(job_id)
        if threading.current_thread().name == "copy":
            read.set()
            go.wait(30)
        return found

    monkeypatch.setattr(store, "get_search", held_up)
    copy = threading.Thread(target=tasks.search.apply, args=([job.id],), name="copy")
    sent = base.SiftTask.retry

    def retry(self: base.SiftTask, *args: Any, **kwargs: Any) -> Any:
        go.set()  # the first run let its claim go: the copy goes on, and runs it
        copy.join()
        return sent(self, *args, **kwargs)

    monkeypatch.setattr(base.SiftTask, "retry", retry)
    waits = _queue_waits(SEARCH_QUEUE)[0]
    copy.start()
    try:
        assert read.wait(30)
        tasks.search.apply(args=[job.id])  # the first delivery; its retry finds it final
    finally:
        go.set()
        copy.join()
    done = get_search(job.id)
    assert done is not None and done.status == "succeeded" and runtime.calls == 2, done
    assert _queue_waits(SEARCH_QUEUE)[0] - waits == 1


class _SlotsHeldElsewhere:
    """The CPU slots, all held by other searches when one is asked for, each time as
    ``waits`` says (then none): it is had after that many seconds of real time (the claim's
    lease runs in Redis's clock), once ``meanwhile`` (what happens during a wait) has run."""

    def __init__(self, waits: list[float], meanwhile: Callable[[], None] | None = None) -> None:
        self.waits = waits
        self.meanwhile = meanwhile

    def __enter__(self) -> None:
        wait = self.waits.pop(0) if self.waits else 0.0
        time.sleep(wait)
        if wait and self.meanwhile is not None:
            self.meanwhile()

    def __exit__(self, *exc: object) -> None:
        return None


class _SpentRuntime(Runtime):
    """The in-process runtime, noting the ``spent`` each run of a search is given."""

    spents: list[float]

    def search(self, *args: Any, spent: float = 0.0, **kwargs: Any) -> SearchResult:
        self.spents.append(spent)
        return super().search(*args, spent=spent, **kwargs)


def _slot_waiting_runtime(
    context: base.WorkerContext,
    monkeypatch: pytest.MonkeyPatch,
    deadline: float,
    step: Any,
    meanwhile: Callable[[], None] | None = None,
    waits: list[float] | None = None,
) -> _SpentRuntime:
    """A real pipeline (reranking with ``step``) whose first search waits one and a half
    deadlines for its CPU slot (or as ``waits`` says; ``meanwhile`` running at a wait's
    end), the task's lease (its deadline) ``deadline`` seconds."""
    settings = load_settings(
        rerank_enabled=True,
        generation_model="anthropic:claude-haiku-4-5",
        search_deadline_seconds=deadline,
    )
    monkeypatch.setattr(context, "settings", context.settings.model_copy(update={
        "search_deadline_seconds": deadline
    }))  # fmt: skip
    made = build_pipeline(
        settings,
        backend=InMemoryBackend(),
        embedder=FakeEmbedder(),
        reranker=ScriptedReranker([step]),
    )
    topics = ["volcano eruption ash", "river delta flooding", "chess opening theory"]
    docs = [DocumentIn(id=f"d{i}", text=topic) for i, topic in enumerate(topics)]
    Runtime(made).ingest("docs", "acme", docs)
    pipeline = SearchPipeline(
        made.backend, made.embedder, made.reranker, made.config,
        cpu_slots=_SlotsHeldElsewhere(waits or [1.5 * deadline], meanwhile),
        index_settings=made.index_settings,
    )  # fmt: skip
    runtime = _SpentRuntime(pipeline)
    runtime.spents = []
    context._runtime = runtime
    return runtime


def test_a_search_s_claim_starts_once_it_holds_its_cpu_slot(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The search's deadline starts once it holds its CPU slot; its run claim (lease: one
    deadline) was taken before the wait and kept its time from there. A run that waited
    longer than its lease was taken over by a copy of its message delivered after the lease
    ran out from the claim (a second run, a second paid model call). The claim is sent again
    once the slot is held: the copy, delivered during the model call, is refused."""
    store = context.store
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)  # this worker, alive
    monkeypatch.setattr(liveness, "run_owner", lambda: "w1")
    job = store.create_search("acme", SearchSpec(index="docs", query="volcano ash", limit=2))
    copies: list[bool] = []

    def model_call(prompt: RerankPrompt, timeout: float) -> RerankReply:
        copy = store.claim_search(job.id, "w2", lease_seconds=2.0)  # a copy, delivered
        copies.append(copy.granted)
        return reply([0, 1])(prompt, timeout)

    runtime = _slot_waiting_runtime(context, monkeypatch, 2.0, model_call)
    tasks.search.apply(args=[job.id])
    assert copies == [False], copies
    done = store.get_search(job.id)
    assert done is not None and done.status == "succeeded" and runtime.spents == [0.0]


def test_a_search_s_claim_leaves_out_its_wait_for_the_slot_again_after_a_retrieval_retry(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retrieval retry's back-off lets the CPU slot go, and the deadline leaves out the
    wait to hold one again; the run's claim counted it. Past the lease, a copy of the
    message delivered during the model call took the claim over (a second paid call). The
    claim is sent again once the slot is held again, the run's own time kept."""
    _patch_backoff(monkeypatch)
    store = context.store
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)
    monkeypatch.setattr(liveness, "run_owner", lambda: "w1")
    job = store.create_search("acme", SearchSpec(index="docs", query="volcano ash", limit=2))
    copies: list[bool] = []

    def model_call(prompt: RerankPrompt, timeout: float) -> RerankReply:
        copies.append(store.claim_search(job.id, "w2", lease_seconds=2.0).granted)
        return reply([0, 1])(prompt, timeout)

    runtime = _slot_waiting_runtime(context, monkeypatch, 2.0, model_call, waits=[0.0, 3.0])
    runtime.pipeline.config = dataclasses.replace(runtime.pipeline.config, backend_max_attempts=2)
    backend = runtime.pipeline.backend
    assert isinstance(backend, InMemoryBackend)
    backend.fail_next = 1  # its retrieval fails once, retried within the run
    tasks.search.apply(args=[job.id])
    assert copies == [False] and len(backend.calls) == 2, (copies, backend.calls)
    done = store.get_search(job.id)
    assert done is not None and done.status == "succeeded" and runtime.spents == [0.0], done
    used = float(store.redis.hget(SEARCH_KEY + job.id, "run").split("|")[0])
    assert used < 2.0, used  # the run's own time, not the wait's


def test_a_search_run_whose_claim_a_copy_took_over_during_its_slot_wait_stops_unbilled(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that waited longer than its lease for its CPU slot, a copy of its message
    taking the claim over meanwhile (the lease was over), is refused its claim's restart
    once the slot is held. It went on all the same: a second paid model call, and the
    search finished under the copy's claim. It stops there now, writing nothing: no model
    call, the search left to the copy (still running, its claim the copy's)."""
    store = context.store
    for worker in ("w1", "w2"):
        store.redis.set(WORKER_HEARTBEAT_KEY + worker, "1", px=60_000)  # both alive
    monkeypatch.setattr(liveness, "run_owner", lambda: "w1")
    job = store.create_search("acme", SearchSpec(index="docs", query="volcano ash", limit=2))
    copies = []
    calls: list[RerankPrompt] = []

    def model_call(prompt: RerankPrompt, timeout: float) -> RerankReply:
        calls.append(prompt)
        return reply([0, 1])(prompt, timeout)

    def copy_delivered() -> None:  # past the first run's lease: the copy takes its claim
        copies.append(store.claim_search(job.id, "w2", lease_seconds=30.0))

    runtime = _slot_waiting_runtime(context, monkeypatch, 2.0, model_call, copy_delivered)
    tasks.search.apply(args=[job.id])
    assert [copy.granted for copy in copies] == [True] and calls == [], (copies, calls)
    running = store.get_search(job.id)
    assert running is not None and running.status == "running" and runtime.spents == [0.0]
    assert not store.claim_search(job.id, "w1", lease_seconds=30.0).granted  # the copy's


def test_a_batch_item_run_whose_claim_a_copy_took_over_during_its_slot_wait_stops_unbilled(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a batch item: its run stopped by a claim taken over during its slot
    wait neither calls the model nor finishes the item (the stop is no error of it)."""
    store = context.store
    for worker in ("w1", "w2"):
        store.redis.set(WORKER_HEARTBEAT_KEY + worker, "1", px=60_000)
    monkeypatch.setattr(liveness, "run_owner", lambda: "w1")
    spec = SearchSpec(index="docs", query="volcano ash", limit=2)
    batch = store.create_batch("acme", "docs", [("q0", spec)])
    copies = []
    calls: list[RerankPrompt] = []

    def model_call(prompt: RerankPrompt, timeout: float) -> RerankReply:
        calls.append(prompt)
        return reply([0, 1])(prompt, timeout)

    def copy_delivered() -> None:
        copies.append(store.claim_item(batch.id, "q0", "w2", lease_seconds=30.0))

    _slot_waiting_runtime(context, monkeypatch, 2.0, model_call, copy_delivered)
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    assert [copy.granted for copy in copies] == [True] and calls == [], (copies, calls)
    (item,) = store.batch_items(batch.id, ["q0"])
    assert item.status == "running", item  # not finished, not failed
    assert not store.claim_item(batch.id, "q0", "w1", lease_seconds=30.0).granted


def test_a_batch_item_whose_worker_stops_during_its_slot_wait_goes_back_unretrieved(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM (the item queue's hand-back) while a started item waits for its CPU slot:
    it goes back once it holds the slot, before its retrieval, `queued` again with its claim
    let go uncounted. It ran its retrieval first and went back at its model call: with the
    300 items a worker starts queued for its few slots, a rolling restart waited for every
    one's retrieval, thrown away, and was cut off at its stop deadline (25 s, 57 items still
    `running`, counted lost, on a real stack whose model answered in 1 s)."""
    store = context.store
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)
    monkeypatch.setattr(liveness, "run_owner", lambda: "w1")
    monkeypatch.setattr(INTAKE, "_stopping", False)  # the chunk's hand-back stops the intake
    spec = SearchSpec(index="docs", query="volcano ash", limit=2)
    batch = store.create_batch("acme", "docs", [("q0", spec)])
    calls: list[RerankPrompt] = []

    def model_call(prompt: RerankPrompt, timeout: float) -> RerankReply:
        calls.append(prompt)
        return reply([0, 1])(prompt, timeout)

    runtime = _slot_waiting_runtime(context, monkeypatch, 2.0, model_call, context.items.hand_back)
    backend = runtime.pipeline.backend
    assert isinstance(backend, InMemoryBackend)
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    assert backend.calls == [] and calls == [], (backend.calls, calls)
    (item,) = store.batch_items(batch.id, ["q0"])
    assert item.status == "queued", item
    claim = store.claim_item(batch.id, "q0", "w2", lease_seconds=30.0)
    assert claim.granted and claim.lost == 0 and claim.spent == 0.0, claim


def test_a_retried_search_s_spent_time_starts_once_its_first_run_held_its_cpu_slot(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's time (what its retry is told it spent, and the task's check that a retry has
    any deadline left) counted from its claim, taken before the wait for the CPU slot: a
    first run that waited longer than the deadline for its slot, then hit a retryable error,
    was not retried (no time left, by that count) and the search failed. Counted from the
    slot, it is retried, told the first run's own time."""
    _patch_backoff(monkeypatch)
    store = context.store
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)
    monkeypatch.setattr(liveness, "run_owner", lambda: "w1")
    job = store.create_search("acme", SearchSpec(index="docs", query="volcano ash", limit=2))
    runtime = _slot_waiting_runtime(context, monkeypatch, 2.0, reply([0, 1]))
    backend = runtime.pipeline.backend
    assert isinstance(backend, InMemoryBackend)
    runtime.pipeline.config = dataclasses.replace(runtime.pipeline.config, backend_max_attempts=1)
    backend.fail_next = 1  # the first run's retrieval, once its slot is held: retryable
    tasks.search.apply(args=[job.id])
    done = store.get_search(job.id)
    assert done is not None and done.status == "succeeded", done
    assert len(runtime.spents) == 2 and runtime.spents[1] < 3.0, runtime.spents  # not the wait
    used = float(store.redis.hget(SEARCH_KEY + job.id, "run").split("|")[0])
    assert used < 3.0, used


def test_retries_are_bounded(context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_backoff(monkeypatch)
    runtime = ScriptedRuntime(*[BackendUnavailable("down")] * 10)
    context._runtime = runtime
    job = context.store.create_search("acme", SearchSpec(index="docs", query="q"))
    tasks.search.apply(args=[job.id])
    done = context.store.get_search(job.id)
    assert done is not None and done.status == "failed"
    assert done.error is not None and done.error.type == "backend_unavailable"
    assert runtime.calls == 3  # the first try and task_max_retries=2 retries


def test_permanent_errors_are_not_retried(context: base.WorkerContext) -> None:
    runtime = ScriptedRuntime(ModeUnavailable("no vectors in this index"))
    context._runtime = runtime
    job = context.store.create_search("acme", SearchSpec(index="docs", query="q"))
    tasks.search.apply(args=[job.id])
    done = context.store.get_search(job.id)
    assert done is not None and done.status == "failed" and runtime.calls == 1
    assert done.error is not None and done.error.type == "mode_unavailable"


def test_an_unexpected_error_shows_the_tenant_its_class_and_the_log_its_text(
    context: base.WorkerContext, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug's exception text is a library's, and may name the infrastructure: a failed
    search and batch item showed ``OSError: connect to 10.0.0.7:9200 refused`` in their
    ``error.message`` (a Redis error's showed the Redis host and port, to the tenant). The
    record names the class; the worker's log keeps the text, with its traceback."""
    leak = "connect to 10.0.0.7:9200 refused"
    context._runtime = ScriptedRuntime(OSError(leak), OSError(leak))
    store = context.store
    job = store.create_search("acme", SearchSpec(index="docs", query="q"))
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="q0"))])
    tasks.search.apply(args=[job.id])
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    done = store.get_search(job.id)
    (item,) = store.batch_results(batch.id, 0, 1)
    assert item.status == "failed" and item.payload is not None
    item_error = ErrorInfo.model_validate(json.loads(item.payload)["error"])
    for error in (done.error if done else None, item_error):
        assert error is not None and error.type == "internal_error", error
        assert "OSError" in error.message and "10.0.0.7" not in error.message, error
    assert caplog.text.count(leak) >= 2  # each one's traceback, in the worker's log


NODE_GONE = "[es-node-7][10.9.8.7:9300] Node not connected"


@pytest.fixture
def es_server() -> Iterator[FakeElasticsearchServer]:
    """The Elasticsearch stand-in answering every request 503, ES's reason naming the node
    that left by its address, as a cluster losing a node does."""
    server = FakeElasticsearchServer()
    gone = error_body("node_not_connected_exception", NODE_GONE, 503)
    server.fallback = lambda request: Answer(503, gone)
    yield from running(server)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("outage", ["refused", "node gone"])
def test_an_elasticsearch_outage_shows_the_tenant_its_kind_and_the_log_its_detail(
    context: base.WorkerContext,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    es_server: FakeElasticsearchServer,
    outage: str,
) -> None:
    """A search and an ingest failing ``backend_unavailable`` showed the tenant ES's reason,
    which names a node by its address (``[es-node-7][10.9.8.7:9300] Node not connected``);
    the client's text of a refused connection names the cluster's host and port. The record
    says what kind of failure it was; the worker's log keeps the detail."""
    _patch_backoff(monkeypatch)
    caplog.set_level(logging.WARNING)
    port = _closed_port()
    url = f"http://elastic:s3cret@127.0.0.1:{port}" if outage == "refused" else es_server.url
    settings = load_settings(search_backend="elasticsearch", elasticsearch_url=url)
    backend = ElasticsearchBackend.from_settings(settings)
    context._runtime = Runtime(
        build_pipeline(settings, backend=backend, embedder=FakeEmbedder(), sleep=lambda s: None)
    )
    store = context.store
    search = store.create_search("acme", SearchSpec(index="docs", query="q"))
    ingest = store.create_ingest("acme", "docs", [DocumentIn(id="1", text="t")])
    tasks.search.apply(args=[search.id])
    tasks.ingest.apply(args=[ingest.id])
    searched, ingested = store.get_search(search.id), store.get_ingest(ingest.id)
    detail, kind = (
        (f"port={port}", "connection refused") if outage == "refused" else (NODE_GONE, "503")
    )
    for job in (searched, ingested):
        assert job is not None and job.error is not None, job
        assert job.error.type == "backend_unavailable", job.error
        message = job.error.message
        assert kind in message, message
        for leak in (str(port), "s3cret", "10.9.8.7", "es-node-7"):
            assert leak not in message, message
    assert detail in caplog.text, caplog.text  # the worker's log: what the operator needs


def test_a_poison_message_is_failed_not_looped(context: base.WorkerContext) -> None:
    """And counted under its record's own error type: the failures counter said "internal",
    the label of a bug, for a job whose worker kept dying."""
    from prometheus_client import REGISTRY

    def failures() -> float:
        labels = {"kind": "search", "error": "delivery_limit_exceeded"}
        return REGISTRY.get_sample_value("sift_job_failures_total", labels) or 0.0

    runtime = ScriptedRuntime()
    context._runtime = runtime
    job = context.store.create_search("acme", SearchSpec(index="docs", query="q"))
    for _ in range(2):  # two deliveries whose worker died mid-task
        context.store.count_delivery("poison-1", 0)
    before = failures()
    tasks.search.apply(args=[job.id], task_id="poison-1")
    done = context.store.get_search(job.id)
    assert done is not None and done.status == "failed"
    assert done.error is not None and done.error.type == "delivery_limit_exceeded"
    assert runtime.calls == 0
    assert failures() - before == 1.0


def _completed(kind: str, status: str) -> float:
    """``sift_jobs_completed_total{kind, status}``."""
    from prometheus_client import REGISTRY

    labels = {"kind": kind, "status": status}
    return REGISTRY.get_sample_value("sift_jobs_completed_total", labels) or 0.0


def test_copies_of_a_running_search_s_message_are_no_poison(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search's message delivered again and again while its first run is going (kombu puts
    a running task's message back at each broker reconnect; the re-drive sends a copy): each
    copy finds the claim held by a live worker and leaves the search to that run, counting no
    delivery. The copies were counted before their claim was refused, so the one past
    ``SIFT_TASK_MAX_DELIVERIES`` (2 here) failed the search ``delivery_limit_exceeded`` under
    the live run: its record, its webhook and the completed counter said ``failed``, and the
    run's result, made and paid for, was refused."""
    store = context.store
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)  # this worker, alive
    monkeypatch.setattr(liveness, "run_owner", lambda: "w1")
    sent: list[str] = []
    monkeypatch.setattr(base.SiftTask, "send_webhook", lambda self, *args: sent.append(args[4]))
    inside, go = threading.Event(), threading.Event()

    def held(spec: SearchSpec) -> None:  # the first run, at its retrieval
        inside.set()
        go.wait(30)

    runtime = ScriptedRuntime(first_half=held)
    context._runtime = runtime
    job = store.create_search("acme", SearchSpec(index="docs", query="q"), webhook_url="http://h/")
    before = {status: _completed("search", status) for status in ("succeeded", "failed")}
    first = threading.Thread(target=tasks.search.apply, args=([job.id],), kwargs={"task_id": "m"})
    first.start()
    try:
        assert inside.wait(30)
        running = _search_state(store, job.id)
        for _ in range(context.settings.task_max_deliveries):  # the copies, one past the limit
            tasks.search.apply(args=[job.id], task_id="m")
        meanwhile = _search_state(store, job.id)
    finally:
        go.set()
        first.join()
    assert meanwhile == running  # the copies wrote nothing
    done = store.get_search(job.id)
    assert done is not None and done.status == "succeeded", done
    assert sent == ["succeeded"] and runtime.model_calls == 1
    after = {status: _completed("search", status) - before[status] for status in before}
    assert after == {"succeeded": 1.0, "failed": 0.0}
    assert store.count_delivery("m", 0) == 2  # the first run's, and this one: none of a copy


def test_a_chunk_skips_canceled_and_finished_items(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
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


def test_a_batch_item_whose_claim_the_job_store_cannot_take_is_not_failed(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item's run claim is the job store's call, not the item's work: one that fails
    (Redis unreachable past the client's 30 s of retries) must not finish the item ``failed``
    with ``internal_error`` (it did, once Redis was back for the finish). The chunk's runner
    breaks, as when the item's start fails: the item stays running for a redelivery (the
    re-drive), which runs it."""
    store = context.store
    runtime = ScriptedRuntime()
    context._runtime = runtime
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="q0"))])

    def down(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(store, "claim_item", down)
    broke = tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    got = store.get_batch(batch.id)
    assert got is not None
    assert got.counts["failed"] == 0, got.counts
    assert got.counts["running"] == 1 and broke.failed() and runtime.model_calls == 0
    monkeypatch.delattr(store, "claim_item")  # Redis is back: the re-drive's chunk runs it
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    done = store.get_batch(batch.id)
    assert done is not None and done.status == "succeeded" and runtime.model_calls == 1


def test_a_search_or_item_whose_run_meets_redis_down_is_run_again_uncharged(
    context: base.WorkerContext,
) -> None:
    """Redis unreachable past the client's 30 s of retries during a claimed run (its
    index's settings, its cancel check, the rate budget): the job store's failure, not the
    job's. It ended ``failed`` ``internal_error`` with Redis's own text. Now the task fails
    with the job still running, and its claim is not let go (letting go would charge the
    outage to the job's one deadline): the redelivery takes it over with nothing spent."""
    down = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    store = context.store
    runtime = ScriptedRuntime(down, down)
    context._runtime = runtime
    job = store.create_search("acme", SearchSpec(index="docs", query="q"))
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="q0"))])
    assert tasks.search.apply(args=[job.id]).failed()
    assert tasks.batch_chunk.apply(args=[batch.id, 0, 1]).failed()
    ran = store.get_search(job.id)
    got = store.get_batch(batch.id)
    assert ran is not None and ran.status == "running", ran
    assert got is not None and got.counts["running"] == 1, got.counts
    assert runtime.model_calls == 0
    assert tasks.search.apply(args=[job.id]).successful()  # Redis is back: the re-drive's
    assert tasks.batch_chunk.apply(args=[batch.id, 0, 1]).successful()
    done, finished = store.get_search(job.id), store.get_batch(batch.id)
    assert done is not None and done.status == "succeeded", done
    assert finished is not None and finished.status == "succeeded", finished.counts
    assert runtime.model_calls == 2 and runtime.spent[2:] == [0.0, 0.0], runtime.spent


def test_a_message_that_comes_back_after_each_outage_is_not_poison(
    context: base.WorkerContext,
) -> None:
    """The same message of a search delivered again after each of its runs met Redis
    unreachable past the client's 30 s of retries (its ack lost with the outage, the orphan
    check puts it back): each delivery was counted, so the one past
    ``SIFT_TASK_MAX_DELIVERIES`` failed the search ``delivery_limit_exceeded``, with no fault
    of its own. The run's outage note uncounts its delivery, as a hand-back does."""
    limit = context.settings.task_max_deliveries
    down = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    store = context.store
    runtime = ScriptedRuntime(*[down] * (limit + 1))
    context._runtime = runtime
    job = store.create_search("acme", SearchSpec(index="docs", query="q"))
    for _ in range(limit + 1):
        assert tasks.search.apply(args=[job.id], task_id="outage-msg").failed()
    assert tasks.search.apply(args=[job.id], task_id="outage-msg").successful()
    done = store.get_search(job.id)
    assert done is not None and done.status == "succeeded", done
    assert runtime.model_calls == 1


class _IngestMeetsRedisDown(ScriptedRuntime):
    """Its ingest meets Redis down (an index's settings, a write version read) once."""

    def ingest(
        self,
        index: str,
        tenant: str,
        documents: list[DocumentIn],
        progress: Callable[[int], None] | None = None,
        *,
        version: int | None = None,
    ) -> int:
        if self.errors:
            raise self.errors.pop(0)
        return len(documents)


def test_an_ingest_whose_run_meets_redis_down_is_run_again_not_failed(
    context: base.WorkerContext,
) -> None:
    """As a search's (above): Redis unreachable past the client's 30 s of retries inside an
    ingest's run is the job store's failure, not the ingest's. It ended ``failed``
    ``internal_error`` once Redis was back for the finish, though nothing was wrong with the
    documents (the write may even have been made); now the task fails with the job still
    running and its claim kept, for its redelivery (the re-drive), which runs it."""
    down = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    store = context.store
    context._runtime = _IngestMeetsRedisDown(down)
    job = store.create_ingest("acme", "docs", [DocumentIn(id="1", text="t")])
    assert tasks.ingest.apply(args=[job.id]).failed()
    ran = store.get_ingest(job.id)
    assert ran is not None and ran.status == "running" and ran.error is None, ran
    assert tasks.ingest.apply(args=[job.id]).successful()  # Redis is back: the re-drive's
    done = store.get_ingest(job.id)
    assert done is not None and done.status == "succeeded" and done.upserted == 1, done


def _one_item_economy_batch(context: base.WorkerContext) -> tuple[JobStore, BatchJob]:
    """A one-item economy batch over an in-memory index of one document, the worker
    ``context`` running it in process (a fake embedder, no model call scripted)."""
    from worker.runtime.inprocess import build_runtime

    runtime = build_runtime(
        context.settings,
        backend=InMemoryBackend(),
        embedder=FakeEmbedder(),
        reranker=ScriptedReranker([]),
    )
    runtime.ingest("docs", "acme", [DocumentIn(id="1", text="green tea leaves")])
    context._runtime = runtime
    spec = SearchSpec(index="docs", query="green tea", mode="fts", rerank=True)
    batch = context.store.create_batch("acme", "docs", [("q0", spec)], lane="economy")
    return context.store, batch


def test_an_economy_item_whose_first_half_the_job_store_cannot_keep_is_not_failed(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An economy item's first half (retrieval, its prompt) ran, and the job store cannot
    keep it (Redis unreachable past the client's 30 s of retries): that is the job store's
    failure, not the item's, and costs nothing to run again (no model call yet). It ended
    ``failed`` ``internal_error`` (a bug, by the contract) once Redis was back for the finish,
    and a one-item batch ended failed. The chunk's runner breaks now, as for a standard
    item whose claim cannot be taken: the item stays running for a redelivery (the
    re-drive), which prepares it again, keeps it, and its submission goes."""
    submitted: list[str] = []
    monkeypatch.setattr(batches, "maybe_submit", lambda task, batch_id: submitted.append(batch_id))
    store, batch = _one_item_economy_batch(context)

    def down(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(store, "economy_save_prepared", down)
    broke = tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    got = store.get_batch(batch.id)
    assert got is not None and got.counts["failed"] == 0, got.counts
    assert got.counts["running"] == 1 and broke.failed()
    assert not store.economy_settled(batch.id)  # nothing to submit yet
    assert store.pending_positions(batch.id) == [0]  # the re-drive's to send again
    monkeypatch.delattr(store, "economy_save_prepared")  # Redis is back: the re-drive's chunk
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    (item,) = store.batch_items(batch.id, ["q0"])
    assert item.status == "running" and is_prepared(store, batch.id, "q0"), item
    assert store.economy_settled(batch.id) and submitted[-1] == batch.id


def test_an_economy_chunk_whose_last_first_half_was_kept_unheard_still_enqueues_the_submission(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write keeping an economy item's first half reached Redis, and its reply was lost
    (Redis gone past the client's 30 s of retries): the item is prepared, and the chunk's
    runner breaks (the task fails). It was the batch's last item to settle, so this chunk
    is the one to enqueue the submission, which it did only when no runner broke: none was
    ever sent. And nothing else would send it: the re-drive re-sends chunks for items still
    to prepare (none: ``pending_positions`` is empty), and a submission never enqueued has
    no watch. The batch stayed ``running`` for good, its item prepared and never sent."""
    submitted: list[str] = []
    monkeypatch.setattr(batches, "maybe_submit", lambda task, batch_id: submitted.append(batch_id))
    store, batch = _one_item_economy_batch(context)
    save = store.economy_save_prepared

    def unheard(*args: Any, **kwargs: Any) -> Any:
        save(*args, **kwargs)  # written; its reply lost
        raise redis.ConnectionError("Connection closed by server.")

    monkeypatch.setattr(store, "economy_save_prepared", unheard)
    broke = tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    assert broke.failed() and is_prepared(store, batch.id, "q0")
    assert store.pending_positions(batch.id) == []  # no re-drive will come
    assert submitted == [batch.id]


def test_an_economy_submission_claimed_by_a_chunk_that_died_before_sending_it_is_sent(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk that finds every item prepared claims the batch's one submission, then
    sends it (its message, and the watch that sends it again when lost). Redis gone right
    after the claim (past the client's 30 s of retries; or the worker killed there): the
    claim was kept, and nothing was sent or watched. A chunk run again finds the claim
    taken, the re-drive sends chunks only for items still to prepare, and the sweep's watch
    had no entry: the submission never went, the batch ``running`` for good. The watch is
    set before the claim now, and the sweep sends the submission once it is overdue."""
    from worker.constants import ECONOMY_SUBMIT_TASK
    from worker.queue import economy

    store, batch = _one_item_economy_batch(context)

    def down(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(store, "economy_hand_over", down)  # right after the claim
    broke = tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    assert broke.failed() and not store.economy_claim(batch.id, economy.SUBMIT_CLAIM)
    monkeypatch.delattr(store, "economy_hand_over")  # Redis is back
    assert tasks.batch_chunk.apply(args=[batch.id, 0, 1]).successful()  # a copy: claimed
    assert store.pending_positions(batch.id) == []  # no re-drive of its chunk
    sent: list[tuple[str, list[Any]]] = []
    later = time.time() + economy.WATCH_MARGIN_SECONDS + 1
    economy.rewake(store, lambda name, args, queue, task_id: sent.append((name, args)), later)
    assert sent == [(ECONOMY_SUBMIT_TASK, [batch.id])]


def _batch_state(store: JobStore, batch_id: str) -> list[dict[str, str]]:
    """A batch's record, its items' statuses, counts and results, and the fleet's counts."""
    from worker.constants import (
        BATCH_COUNTS_KEY,
        BATCH_ITEMS_KEY,
        BATCH_KEY,
        BATCH_RESULTS_KEY,
        STATS_KEY,
    )

    keys = [BATCH_KEY, BATCH_ITEMS_KEY, BATCH_COUNTS_KEY, BATCH_RESULTS_KEY]
    return [cast(dict[str, str], store.redis.hgetall(key + batch_id)) for key in keys] + [
        cast(dict[str, str], store.redis.hgetall(STATS_KEY))
    ]


@pytest.mark.parametrize("holder", ["in_its_model_call_canceled", "requeued_for_its_retry"])
def test_a_chunk_copy_that_loses_an_item_s_claim_changes_nothing_of_that_item(
    context: base.WorkerContext, holder: str
) -> None:
    """A batch chunk's message delivered again while a run of its item holds the item's
    claim, its worker alive (worker/queue/jobstore/runs.py): the copy leaves the item to that
    run. Its start was written before its claim was refused: the batch canceled while that run
    was in its model call, the start canceled the item (the run's paid result then refused,
    the batch completed ``canceled``), where a cancel leaves a run past its check to finish;
    and an item that run had requeued for its retry, before letting its claim go, was moved
    back to ``running`` by a copy that never ran it."""
    store = context.store
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)  # the holder's worker, alive
    runtime = ScriptedRuntime()
    context._runtime = runtime
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="q0"))])
    assert store.start_item(batch.id, "q0")  # the first delivery's run
    claim = store.claim_item(batch.id, "q0", "w1", lease_seconds=30)
    if holder == "in_its_model_call_canceled":
        assert store.cancel_batch(batch.id) == (0, False)  # left to that run
    else:
        assert store.requeue_item(batch.id, "q0")  # its claim let go next
    held = _batch_state(store, batch.id)
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])  # the copy
    assert _batch_state(store, batch.id) == held and runtime.calls == 0
    if holder == "in_its_model_call_canceled":  # that run finishes it on its paid answer
        result = SearchResult(hits=[], rerank=RerankInfo(applied=False))
        assert store.finish_item(batch.id, "q0", result=result).batch_completed
        done = store.get_batch(batch.id)
        assert done is not None and done.status == "succeeded", done
    store.release_item(batch.id, "q0", claim)


class PacingRuntime(ScriptedRuntime):
    """Counts its batch items paced on the rate budget, and those let go unsearched; runs
    ``meanwhile`` while an item waits on the budget."""

    def __init__(self, meanwhile: Callable[[], None]) -> None:
        super().__init__()
        self.meanwhile = meanwhile
        self.paced = self.unpaced = 0

    def pace(
        self,
        stopping: Callable[[], bool] | None = None,
        canceled: Callable[[], bool] | None = None,
    ) -> None:
        self.paced += 1
        self.meanwhile()

    def unpace(self) -> None:
        self.unpaced += 1


def test_a_chunk_run_whose_item_another_run_claimed_while_it_paced_lets_the_pace_go(
    context: base.WorkerContext,
) -> None:
    """A chunk's run started an item and paced it on the shared rate budget (where it counts
    in every process's readings until its call is reserved); while it waited there, another
    run (a copy of the chunk) claimed the item: this run lets the pace go at once. It
    counted on for PENDING_SECONDS (60 s), holding the cluster's batches back by a call's
    refill time, as no search's end told the budget."""
    store = context.store
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)  # the other run's worker
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="q0"))])
    claims = []
    runtime = PacingRuntime(
        lambda: claims.append(store.claim_item(batch.id, "q0", "w1", lease_seconds=30))
    )
    context._runtime = runtime
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    assert claims[0].granted  # the other run's, taken during the pace
    assert (runtime.paced, runtime.unpaced, runtime.calls) == (1, 1, 0)
    store.release_item(batch.id, "q0", claims[0])


def _runs_lost(store: JobStore, batch_id: str, query_id: str, runs: int) -> RunClaim:
    """``runs`` runs of the item, each claimed by a worker that then died (no heartbeat): the
    last one's claim, whose loss the next claim counts (``runs - 1`` counted until then)."""
    claim: RunClaim | None = None
    for n in range(runs):
        claim = store.claim_item(batch_id, query_id, f"dead-{n}", lease_seconds=30.0)
        assert claim.granted
        store.ended_item(batch_id, query_id, claim)  # its process is gone
    assert claim is not None
    return claim


def test_a_chunk_copy_past_the_delivery_limit_fails_only_an_item_whose_own_runs_were_lost(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch chunk's message past ``SIFT_TASK_MAX_DELIVERIES`` (every worker that held it
    lost, or a copy put back at a broker reconnect) fails as poison only an item whose own
    runs were lost that many times (q2); it runs one that never ran (q1), and leaves one a
    live run holds (q0) to that run. It failed every item no live run held: a worker holds
    many more chunks than it runs items, so three workers lost failed items never started.
    (And before the claim came first, it failed the live run's item too, refusing that run's
    result, its model call billed.)"""
    monkeypatch.setattr(liveness, "run_owner", lambda: "w2")  # a threads-pool worker's runs
    store = context.store
    store.redis.set(WORKER_HEARTBEAT_KEY + "w1", "1", px=60_000)  # the holder's worker, alive
    announced: list[str] = []
    monkeypatch.setattr(base.SiftTask, "announce_batch", lambda self, b, s: announced.append(s))
    runtime = ScriptedRuntime()
    context._runtime = runtime
    specs = [(q, SearchSpec(index="docs", query=q)) for q in ("q0", "q1", "q2")]
    batch = store.create_batch("acme", "docs", specs)
    assert store.start_item(batch.id, "q0")  # the live run's
    claim = store.claim_item(batch.id, "q0", "w1", lease_seconds=30)
    assert store.start_item(batch.id, "q2")
    _runs_lost(store, batch.id, "q2", context.settings.task_max_deliveries)
    before = {status: _completed("batch_item", status) for status in ("succeeded", "failed")}
    store.set_deliveries("copy", 0, context.settings.task_max_deliveries)
    tasks.batch_chunk.apply(args=[batch.id, 0, 3], task_id="copy")  # past the limit
    q0, q1, q2 = store.batch_results(batch.id, 0, 3)
    assert q0.status == "running", q0  # left to its run
    assert q1.status == "succeeded", q1  # never lost: run
    assert q2.status == "failed" and q2.payload is not None, q2  # lost three times
    assert json.loads(q2.payload)["error"]["type"] == "delivery_limit_exceeded"
    assert announced == [] and runtime.calls == 1
    result = SearchResult(hits=[], rerank=RerankInfo(applied=False))
    finish = store.finish_item(batch.id, "q0", result=result)  # the run finishes it
    assert finish.applied and finish.batch_completed
    store.ended_item(batch.id, "q0", claim)
    after = {status: _completed("batch_item", status) - before[status] for status in before}
    assert after == {"succeeded": 1.0, "failed": 1.0}  # the copy's two (the run's is its own)


def test_an_item_whose_runs_were_lost_fewer_times_than_the_limit_runs(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs of the item lost (its claim taken over from dead workers), its chunk's
    message delivered for the first time (re-driven, or another chunk of it): it runs."""
    monkeypatch.setattr(liveness, "run_owner", lambda: "w2")
    runtime = ScriptedRuntime()
    context._runtime = runtime
    store = context.store
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="q0"))])
    assert store.start_item(batch.id, "q0")
    _runs_lost(store, batch.id, "q0", context.settings.task_max_deliveries - 1)
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    (item,) = store.batch_results(batch.id, 0, 1)
    assert item.status == "succeeded" and runtime.calls == 1, item


def test_a_prefork_child_s_chunk_past_the_delivery_limit_fails_its_items_as_poison(
    context: base.WorkerContext,
) -> None:
    """A prefork child's claims name no owner (its parent's heartbeat outlives it), so a
    claim taken over tells no lost run from one gone, and counts none: its chunk's
    deliveries judge its items, as before. Judged by runs lost alone, an item that kills
    its child every time would be delivered again until its batch expired."""
    runtime = ScriptedRuntime()
    context._runtime = runtime
    store = context.store
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="q0"))])
    store.set_deliveries("spent", 0, context.settings.task_max_deliveries)
    tasks.batch_chunk.apply(args=[batch.id, 0, 1], task_id="spent")  # run_owner() is ''
    (item,) = store.batch_results(batch.id, 0, 1)
    assert item.status == "failed" and item.payload is not None and runtime.calls == 0, item
    assert json.loads(item.payload)["error"]["type"] == "delivery_limit_exceeded"


def test_a_poisoned_chunk_of_a_canceled_batch_cancels_an_item_requeued_since(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item running when its batch was canceled, then requeued for a retry (its run hit
    a retryable error): the retry's chunk cancels it at its start, as the cancel would have
    had it been queued. The chunk's delivery past ``SIFT_TASK_MAX_DELIVERIES`` failed it
    ``delivery_limit_exceeded`` instead: the status, the counters and the batch's counts said
    failed for an item the user's cancel had stopped. An item that kept a paid model answer
    is still failed with that usage (test below)."""
    store = context.store
    announced: list[str] = []
    monkeypatch.setattr(base.SiftTask, "announce_batch", lambda self, b, s: announced.append(s))
    runtime = ScriptedRuntime()
    context._runtime = runtime
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="q0"))])
    assert store.start_item(batch.id, "q0")  # running when the batch is canceled
    assert store.cancel_batch(batch.id) == (0, False)  # left to its run
    assert store.requeue_item(batch.id, "q0")  # its run's retryable error
    before = {status: _completed("batch_item", status) for status in ("failed", "canceled")}
    store.set_deliveries("poisoned", 0, context.settings.task_max_deliveries)
    tasks.batch_chunk.apply(args=[batch.id, 0, 1], task_id="poisoned")
    (item,) = store.batch_results(batch.id, 0, 1)
    assert item.status == "canceled", item
    after = {status: _completed("batch_item", status) - before[status] for status in before}
    assert after == {"failed": 0.0, "canceled": 1.0} and runtime.calls == 0
    done = store.get_batch(batch.id)
    assert done is not None and done.status == "canceled" and announced == ["canceled"], done


def test_a_chunk_copy_leaves_an_economy_item_whose_first_half_was_kept(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The economy lane's first half is kept once (:func:`worker.queue.economy.save_prepared`:
    the first kept stays, its prompt may be with the provider); a copy of the chunk finds it
    kept and leaves the item to its provider batch. The copy's start came first: in a batch
    canceled meanwhile (the cancel leaves running items to their provider batches, canceled
    there) it canceled the item, so a request the provider had processed, and billed, found
    its item final: its result refused, the batch completed ``canceled`` by a copy."""

    monkeypatch.setattr(batches, "maybe_submit", lambda *args: None)  # nothing to submit
    store = context.store
    runtime = ScriptedRuntime()
    context._runtime = runtime
    spec = SearchSpec(index="docs", query="q0")
    batch = store.create_batch("acme", "docs", [("q0", spec)], lane="economy")
    assert store.start_item(batch.id, "q0")  # the first delivery's run: its first half kept
    assert store.economy_save_prepared(batch.id, "q0", '{"pos":0}')
    assert store.cancel_batch(batch.id) == (0, False)  # left to its provider batch
    held = _batch_state(store, batch.id)
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])  # the copy
    assert _batch_state(store, batch.id) == held and runtime.calls == 0


def test_a_poisoned_economy_chunk_leaves_an_item_whose_first_half_was_kept(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An economy chunk's message past ``SIFT_TASK_MAX_DELIVERIES`` (its workers killed as
    they ran it) fails as poison the items that have no first half kept, and leaves those
    that have to the submission and their provider batch, as a copy's start does. It failed
    them: an item whose request the provider had already (the submission sent by the run
    killed last) showed ``failed`` ``delivery_limit_exceeded``, its paid answer refused and
    its usage shown nowhere; and an item both kept and final counted twice in the check that
    every item is settled, so the submission went while another chunk's items were still
    queued (here q2), and those, once prepared, were never sent: running for good."""

    submitted: list[str] = []
    monkeypatch.setattr(batches, "maybe_submit", lambda task, batch_id: submitted.append(batch_id))
    store = context.store
    runtime = ScriptedRuntime()
    context._runtime = runtime
    specs = [(q, SearchSpec(index="docs", query=q)) for q in ("q0", "q1", "q2")]
    batch = store.create_batch("acme", "docs", specs, lane="economy")
    assert store.start_item(batch.id, "q0")  # an earlier delivery's run: its first half kept
    assert store.economy_save_prepared(batch.id, "q0", '{"pos":0}')
    store.set_deliveries("last", 0, context.settings.task_max_deliveries)
    tasks.batch_chunk.apply(args=[batch.id, 0, 2], task_id="last")  # poisoned
    q0, q1, q2 = store.batch_results(batch.id, 0, 3)
    assert q0.status == "running", q0  # left to its provider batch
    assert q1.status == "failed" and q1.payload is not None, q1  # never prepared
    assert json.loads(q1.payload)["error"]["type"] == "delivery_limit_exceeded"
    assert q2.status == "queued" and not store.economy_settled(batch.id)  # q2 is to come
    assert submitted == [batch.id] and runtime.calls == 0


def test_a_chunk_completes_its_batch_once_its_last_item_s_finish_was_heard(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk task waits for its items on the process's item pool, then lets go the claims
    of runs that ended without a finish (a copy's), counts the batch completed and sends its
    webhook. The runner of its last item said the item was done before its finish was heard
    (which drops that run from the claims the task lets go), so a thread switch between the
    two, which a busy process makes at any point, had the task go through the claims while
    the runner dropped one: 'dictionary changed size during iteration', the task failed
    after its batch completed, and the batch's completion was never counted in
    ``sift_jobs_completed_total`` nor its webhook sent (the re-drive sends an owed one half
    an hour later). Here the runner is switched out at that point, until the task has woken."""
    from worker.queue.items import Chunk

    store = context.store
    runtime = ScriptedRuntime()
    context._runtime = runtime
    announced: list[str] = []
    monkeypatch.setattr(base.SiftTask, "announce_batch", lambda self, b, s: announced.append(s))
    batch = store.create_batch("acme", "docs", [("q0", SearchSpec(index="docs", query="q0"))])
    task_thread = threading.get_ident()
    woken, dropped = threading.Event(), threading.Event()
    wait, record, ended = Chunk.wait, Chunk.record, store.ended_item

    def task_wait(chunk: Chunk) -> None:
        wait(chunk)
        woken.set()

    def runner_record(chunk: Chunk, batch_completed: bool, retry: bool) -> None:
        record(chunk, batch_completed, retry)
        woken.wait(10)  # switched out here until the task has woken

    def ended_item(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == task_thread:
            dropped.wait(10)  # the runner goes on meanwhile
        else:
            dropped.set()
        return ended(*args, **kwargs)

    monkeypatch.setattr(Chunk, "wait", task_wait)
    monkeypatch.setattr(Chunk, "record", runner_record)
    monkeypatch.setattr(store, "ended_item", ended_item)
    before = _completed("batch", "succeeded")
    ran = tasks.batch_chunk.apply(args=[batch.id, 0, 1])
    assert ran.successful(), ran.result
    done = store.get_batch(batch.id)
    assert done is not None and done.status == "succeeded" and runtime.model_calls == 1
    assert announced == ["succeeded"]
    assert _completed("batch", "succeeded") - before == 1.0


def test_a_cancel_stops_started_items_before_their_model_call(
    context: base.WorkerContext,
) -> None:
    """Every item is running (retrieval done) when the cancel comes: the check before the
    model call cancels each, no model call is made, and the batch ends ``canceled``."""
    store = context.store
    items = [(f"q{i}", SearchSpec(index="docs", query=f"q{i}")) for i in range(6)]
    batch = store.create_batch("acme", "docs", items)
    all_running = threading.Barrier(6)
    canceled = threading.Event()

    def first_half(spec: SearchSpec) -> None:
        all_running.wait(10)
        if spec.query == "q0":
            assert store.cancel_batch(batch.id) == (0, False)  # nothing queued any more
            canceled.set()
        canceled.wait(10)

    runtime = ScriptedRuntime(first_half=first_half)
    context._runtime = runtime
    tasks.batch_chunk.apply(args=[batch.id, 0, 6])
    got = store.get_batch(batch.id)
    assert got is not None
    assert got.counts == {"queued": 0, "running": 0, "succeeded": 0, "failed": 0, "canceled": 6}
    assert got.status == "canceled" and got.finished_at is not None
    assert runtime.calls == 6 and runtime.model_calls == 0
    assert store.cancel_batch(batch.id) == CancelOutcome.ALREADY_FINISHED


def test_a_cancel_after_the_model_calls_changes_no_outcome(context: base.WorkerContext) -> None:
    """A cancel that comes once every item is past its model call cancels nothing: the
    batch ends ``succeeded`` (``canceled_at`` says a cancel came)."""
    store = context.store
    items = [(f"q{i}", SearchSpec(index="docs", query=f"q{i}")) for i in range(3)]
    batch = store.create_batch("acme", "docs", items)
    runtime = ScriptedRuntime()
    context._runtime = runtime
    store.start_item(batch.id, "q0")  # q0 runs elsewhere, past its model call
    tasks.batch_chunk.apply(args=[batch.id, 1, 3])
    assert store.cancel_batch(batch.id) == (0, False)
    assert store.finish_item(
        batch.id, "q0", result=SearchResult(hits=[], rerank=RerankInfo(applied=False))
    ).batch_completed
    got = store.get_batch(batch.id)
    assert got is not None and got.status == "succeeded" and got.canceled_at is not None
    assert got.counts["succeeded"] == 3 and got.counts["canceled"] == 0


def test_ingest_task(context: base.WorkerContext) -> None:
    context._runtime = ScriptedRuntime()
    job = context.store.create_ingest("acme", "docs", [DocumentIn(id="1", text="t")])
    tasks.ingest.apply(args=[job.id])
    done = context.store.get_ingest(job.id)
    assert done is not None and done.status == "succeeded" and done.upserted == 1


def test_an_ingest_whose_documents_expired_is_failed_and_counted_once(
    context: base.WorkerContext,
) -> None:
    """The documents wait 24 h for their task; one run later fails ``expired``, and that
    failure is counted like any other (it was not: the record said failed, the counters
    said nothing). A redelivery of it changes nothing and counts nothing more."""
    from prometheus_client import REGISTRY

    from worker.constants import INGEST_DOCS_KEY

    def counted() -> tuple[float, float]:
        done = REGISTRY.get_sample_value(
            "sift_jobs_completed_total", {"kind": "ingest", "status": "failed"}
        )
        failures = REGISTRY.get_sample_value(
            "sift_job_failures_total", {"kind": "ingest", "error": "expired"}
        )
        return done or 0.0, failures or 0.0

    context._runtime = ScriptedRuntime()
    job = context.store.create_ingest("acme", "docs", [DocumentIn(id="1", text="t")])
    context.store.redis.delete(INGEST_DOCS_KEY + job.id)  # past its TTL
    before = counted()
    for _ in range(2):
        tasks.ingest.apply(args=[job.id])
    done = context.store.get_ingest(job.id)
    assert done is not None and done.status == "failed"
    assert done.error is not None and done.error.type == "expired"
    after = counted()
    assert (after[0] - before[0], after[1] - before[1]) == (1.0, 1.0)


def test_a_redelivered_economy_poll_of_a_finished_batch_sends_its_webhook_again(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker whose result mapping completed an economy batch may die before it enqueues
    the webhook: the poll's message comes back, finds the batch finished, and sends it (the
    same webhook-id). A first delivery that finds it finished (a cancel won) sends nothing:
    the cancel sent it."""
    from worker.queue import economy

    sent: list[tuple[str, str, str]] = []
    monkeypatch.setattr(
        base.SiftTask,
        "send_webhook",
        lambda self, event, job_id, tenant, url, status: sent.append((event, job_id, status)),
    )
    store = context.store
    spec = SearchSpec(index="docs", query="q")
    batch = store.create_batch(
        "acme", "docs", [("q0", spec)], lane="economy", webhook_url="https://hooks.example/x"
    )
    store.start_item(batch.id, "q0")
    store.finish_item(
        batch.id, "q0", result=SearchResult(hits=[], rerank=RerankInfo(applied=False))
    )
    economy.economy_poll.apply(args=[batch.id, "msgbatch_1"], task_id="poll-1")
    assert sent == []  # a first delivery: not a lost webhook
    economy.economy_poll.apply(args=[batch.id, "msgbatch_1"], task_id="poll-1")  # redelivered
    assert sent == [("batch.completed", batch.id, "succeeded")]


@pytest.mark.parametrize(("retry_in", "counted"), [(None, "failed"), (60.0, "retry")])
def test_a_webhook_attempt_that_ends_a_spent_schedule_is_counted_failed(
    context: base.WorkerContext,
    monkeypatch: pytest.MonkeyPatch,
    retry_in: float | None,
    counted: str,
) -> None:
    """A 5xx on the schedule's last attempt is a failed delivery (nothing follows it), not a
    retry; the same answer earlier in the schedule is a retry."""
    from types import SimpleNamespace

    from celery.exceptions import Retry

    from worker.observability import metrics
    from worker.settings import Settings
    from worker.webhooks import delivery as webhooks

    key = SimpleNamespace(tenant="acme", webhook_secrets=lambda: ["whsec_x"])
    monkeypatch.setattr(Settings, "all_api_keys", lambda self: [key])
    answer = webhooks.DeliveryResult(webhooks.DeliveryOutcome.RETRY, "http 500", 500)
    decision = webhooks.DeliveryDecision(result=answer, attempt=8, retry_in=retry_in)
    monkeypatch.setattr(webhooks, "run_delivery", lambda **_: decision)
    monkeypatch.setattr(base.SiftTask, "retry", lambda self, **_: Retry("later"))
    event = {
        "type": "search.completed", "tenant": "acme", "url": "https://hooks.example/x",
        "attempt": 8, "occurred_at": "2026-12-01T00:00:00Z",
        "data": {"id": "srch_1", "status": "succeeded"},
    }  # fmt: skip

    def count(result: str) -> float:
        return float(metrics.WEBHOOK_DELIVERIES.labels(result)._value.get())

    before = {r: count(r) for r in ("retry", "failed")}
    webhook_task.webhook.apply(args=[event])
    assert {r: count(r) - before[r] for r in before} == {
        r: float(r == counted) for r in ("retry", "failed")
    }


def _queue_waits(queue: str) -> tuple[float, float]:
    """``sift_job_queue_wait_seconds{queue}``: its count and sum."""
    from prometheus_client import REGISTRY

    labels = {"queue": queue}
    count = REGISTRY.get_sample_value("sift_job_queue_wait_seconds_count", labels) or 0.0
    total = REGISTRY.get_sample_value("sift_job_queue_wait_seconds_sum", labels) or 0.0
    return count, total


def test_an_ingest_observes_its_queue_wait_once(context: base.WorkerContext) -> None:
    """Every queue's wait is visible, the ingest queue's too (its series was pre-registered
    on every dashboard and never observed)."""
    import time

    from worker.constants import INGEST_QUEUE

    context._runtime = ScriptedRuntime()
    job = context.store.create_ingest("acme", "docs", [DocumentIn(id="1", text="t")])
    time.sleep(0.05)
    before = _queue_waits(INGEST_QUEUE)
    ran_from = clock.now()  # the clock the wait is measured on (worker/clock.py)
    tasks.ingest.apply(args=[job.id])
    ran_by = clock.now()
    tasks.ingest.apply(args=[job.id])  # a redelivery of a finished job: no second wait
    count, total = _queue_waits(INGEST_QUEUE)
    assert count - before[0] == 1
    # from the job's creation to the moment its run began, which came between these two
    waited = total - before[1]
    assert ran_from - job.created_at - 1e-6 <= waited <= ran_by - job.created_at + 1e-6


@pytest.mark.parametrize("retry", [False, True])
def test_a_webhook_attempt_observes_how_late_it_ran(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch, retry: bool
) -> None:
    """A webhook attempt's queue wait: from when it was due (the job's end for the first
    attempt, its retry's time after) to its run, so a backed-up webhook queue shows."""
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from worker.constants import WEBHOOK_QUEUE
    from worker.settings import Settings
    from worker.webhooks import delivery as webhooks

    key = SimpleNamespace(tenant="acme", webhook_secrets=lambda: ["whsec_x"])
    monkeypatch.setattr(Settings, "all_api_keys", lambda self: [key])
    answer = webhooks.DeliveryResult(webhooks.DeliveryOutcome.DELIVERED, "http 204", 204)
    decision = webhooks.DeliveryDecision(result=answer, attempt=1, retry_in=None)
    monkeypatch.setattr(webhooks, "run_delivery", lambda **_: decision)
    # the job ended 5 minutes ago, on the clock the wait is measured on (worker/clock.py)
    finished = datetime.fromtimestamp(clock.now(), UTC) - timedelta(seconds=300)
    event: dict[str, object] = {
        "type": "search.completed", "tenant": "acme", "url": "https://hooks.example/x",
        "occurred_at": finished.isoformat(), "data": {"id": "srch_1", "status": "succeeded"},
    }  # fmt: skip
    due = finished.timestamp()
    if retry:  # a second attempt due 2 s ago
        due = clock.now() - 2.0
        event.update(attempt=2, due_at=due)
    before = _queue_waits(WEBHOOK_QUEUE)
    ran_from = clock.now()
    webhook_task.webhook.apply(args=[event])
    ran_by = clock.now()
    count, total = _queue_waits(WEBHOOK_QUEUE)
    assert count - before[0] == 1
    # from when it was due to the moment it ran, which came between these two readings
    assert ran_from - due - 1e-6 <= total - before[1] <= ran_by - due + 1e-6


@dataclass
class _Webhooks:
    """A finished search, and what the webhook task sent for it instead of sending it."""

    done: SearchJob
    bodies: list[bytes]  # each attempt's body, as it would be signed and sent
    retries: list[dict[str, Any]]  # each retry's message


def _capturing_webhooks(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch, *, delivered: bool
) -> _Webhooks:
    """A search finished through the task (its tenant with a webhook secret), and the webhook
    task's attempts captured: each answered 204 when ``delivered``, else 500 with a retry due
    at once, whose message is captured too."""
    from datetime import datetime
    from types import SimpleNamespace

    from worker.settings import Settings
    from worker.webhooks import delivery as webhooks

    context._runtime = ScriptedRuntime()
    job = context.store.create_search("acme", SearchSpec(index="docs", query="q"))
    tasks.search.apply(args=[job.id])
    done = context.store.get_search(job.id)
    assert done is not None and done.status == "succeeded" and done.finished_at is not None
    key = SimpleNamespace(tenant="acme", webhook_secrets=lambda: ["whsec_x"])
    monkeypatch.setattr(Settings, "all_api_keys", lambda self: [key])
    if delivered:
        answer = webhooks.DeliveryResult(webhooks.DeliveryOutcome.DELIVERED, "http 204", 204)
    else:
        answer = webhooks.DeliveryResult(webhooks.DeliveryOutcome.RETRY, "http 500", 500)
    sent = _Webhooks(done, [], [])

    def run_delivery(**kwargs: Any) -> webhooks.DeliveryDecision:
        when = datetime.fromisoformat(kwargs["occurred_at"])
        args = (kwargs["event_type"], kwargs["job_id"], kwargs["status"])
        sent.bodies.append(webhooks.payload(*args, occurred_at=when, figures=kwargs["figures"]))
        retry_in = None if delivered else 0.0
        return webhooks.DeliveryDecision(
            result=answer, attempt=kwargs["attempt"], retry_in=retry_in
        )

    monkeypatch.setattr(webhooks, "run_delivery", run_delivery)
    sent.retries = _capturing_retries(monkeypatch)
    return sent


def _searched_with_a_webhook(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> SearchJob:
    """A search with a webhook URL, finished through the task; its tenant has a webhook
    secret, so its webhook can be signed."""
    from types import SimpleNamespace

    from worker.settings import Settings

    context._runtime = ScriptedRuntime()
    spec = SearchSpec(index="docs", query="q")
    job = context.store.create_search("acme", spec, webhook_url="https://hooks.example/x")
    tasks.search.apply(args=[job.id])
    key = SimpleNamespace(tenant="acme", webhook_secrets=lambda: ["whsec_x"])
    monkeypatch.setattr(Settings, "all_api_keys", lambda self: [key])
    return job


def _capturing_retries(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Each retry a task asks for, its message kept (``Retry`` raised, nothing sent)."""
    from celery.exceptions import Retry

    retries: list[dict[str, Any]] = []

    def retry(self: base.SiftTask, *, args: list[Any], **_: Any) -> Retry:
        retries.append(args[0])
        return Retry("later")

    monkeypatch.setattr(base.SiftTask, "retry", retry)
    return retries


def _search_event(job_id: str, **fields: Any) -> dict[str, Any]:
    from worker.queue.jobstore import webhook_event

    return webhook_event(
        "search.completed", job_id, "acme", "https://hooks.example/x", "succeeded", **fields
    )


@pytest.mark.parametrize(("attempt", "ends"), [(1, "retrying"), (8, "failed")])
def test_a_webhook_attempt_its_soft_time_limit_cuts_is_a_timeout_on_the_schedule(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch, attempt: int, ends: str
) -> None:
    """``--pool prefork`` raises SoftTimeLimitExceeded where the task runs: inside the POST,
    should the attempt's cap and the job store's stalls before it outlast the limit. The
    attempt is a timeout, as the cap's: its retry recorded and sent (the schedule's last:
    given up, owed no more). Before, it was raised out of the task, recorded nowhere: the
    webhook stayed owed and ``pending``, and the re-drive sent it again for 7 days."""
    from celery.exceptions import SoftTimeLimitExceeded

    from worker.constants import WEBHOOKS_OWED_KEY
    from worker.webhooks import delivery as webhooks

    job = _searched_with_a_webhook(context, monkeypatch)
    retries = _capturing_retries(monkeypatch)

    def run_delivery(**kwargs: Any) -> webhooks.DeliveryDecision:
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(webhooks, "run_delivery", run_delivery)
    webhook_task.webhook.apply(args=[{**_search_event(job.id), "attempt": attempt}])
    state = context.store.get_search(job.id)
    assert state is not None and state.webhook is not None
    assert (state.webhook.status, state.webhook.attempts) == (ends, attempt)
    owed = context.store.redis.zscore(WEBHOOKS_OWED_KEY, job.id)
    if ends == "retrying":
        assert [r["attempt"] for r in retries] == [attempt + 1] and owed is not None
    else:
        assert retries == [] and owed is None


def test_a_webhook_retry_carries_the_figures_its_first_attempt_read(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first attempt reads the job's final figures from its record; a retry sends the
    same bytes from its message, even once the record is gone (expired between attempts)."""
    import json

    from worker.queue.jobstore import webhook_figures

    sent = _capturing_webhooks(context, monkeypatch, delivered=False)
    job_id = sent.done.id
    webhook_task.webhook.apply(args=[_search_event(job_id)])
    context.store.redis.flushdb()  # the record expired before the retry
    webhook_task.webhook.apply(args=[sent.retries[0]])
    first, second = (json.loads(body)["data"] for body in sent.bodies)
    assert first == {"id": job_id, **webhook_figures(sent.done)}
    assert first["usage"] is not None and first["error"] is None
    assert sent.bodies[0] == sent.bodies[1]  # the same bytes, the record gone
    assert second == first


def test_every_copy_of_a_job_s_webhook_sends_the_same_bytes_timed_at_the_job_s_end(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finish's message, then, each retry's message lost, the re-drive's copies making
    attempts 2 and 3, built 10 minutes later and at the end (each event timed when it was
    built): one body, its ``timestamp`` the record's ``finished_at``. Before, each copy's
    body said when its copy was built."""
    import json
    from datetime import UTC, datetime

    # not delivered: a copy of a delivered webhook sends nothing (its record says so)
    sent = _capturing_webhooks(context, monkeypatch, delivered=False)
    ended_at = sent.done.finished_at
    assert ended_at is not None
    for attempt, built in enumerate((ended_at + 0.004, ended_at + 600, ended_at), start=1):
        event = _search_event(sent.done.id, occurred_at=built) | {"attempt": attempt}
        webhook_task.webhook.apply(args=[event])
    bodies = sent.bodies
    assert len(bodies) == 3 and bodies[0] == bodies[1] == bodies[2]
    ended = datetime.fromtimestamp(ended_at, UTC).isoformat().replace("+00:00", "Z")
    assert json.loads(bodies[0])["timestamp"] == ended


def test_an_older_release_s_retry_message_without_figures_sends_them(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rolling upgrade: a retry message made by a release without figures (attempt 2, its
    wait over) reads them from the record, sends a body with them, and its own retry carries
    them (the same bytes from then on)."""
    import json
    import time

    from worker.queue.jobstore import webhook_figures

    sent = _capturing_webhooks(context, monkeypatch, delivered=False)
    done = sent.done
    old = _search_event(done.id) | {"attempt": 2, "due_at": time.time() - 1}  # no figures
    webhook_task.webhook.apply(args=[old])
    assert sent.retries[0]["attempt"] == 3 and sent.retries[0]["figures"] == webhook_figures(done)
    webhook_task.webhook.apply(args=[sent.retries[0] | {"due_at": time.time() - 1}])
    assert json.loads(sent.bodies[0])["data"] == {"id": done.id, **webhook_figures(done)}
    assert sent.bodies[0] == sent.bodies[1]


def test_a_webhook_the_re_drive_sends_again_goes_on_with_its_schedule(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver answering 500 every time, and every retry message lost (the re-drive sends
    each again, past its grace): the re-drive's message makes the attempt that was lost, not
    the schedule's first, so the webhook is attempted the schedule's number of times in all,
    then given up and owed no more. Before, each re-drive started the schedule again: its
    attempts never ended while messages were lost."""
    import time
    from datetime import datetime

    from celery.exceptions import Retry

    from worker.constants import WEBHOOKS_OWED_KEY
    from worker.queue.redrive import Sweeper
    from worker.webhooks import delivery as webhooks

    job = _searched_with_a_webhook(context, monkeypatch)
    attempts: list[int] = []

    def run_delivery(**kwargs: Any) -> webhooks.DeliveryDecision:  # a 500, every time
        attempts.append(kwargs["attempt"])
        answer = webhooks.DeliveryResult(webhooks.DeliveryOutcome.RETRY, "http 500", 500)
        retry_in = webhooks.next_delay(kwargs["attempt"], scale=0.0)
        return webhooks.DeliveryDecision(answer, kwargs["attempt"], retry_in)

    monkeypatch.setattr(webhooks, "run_delivery", run_delivery)
    monkeypatch.setattr(base.SiftTask, "retry", lambda self, **_: Retry("lost"))
    resent: list[dict[str, Any]] = []
    sweeper = Sweeper(
        context.store,
        lambda name, args, queue, task_id: resent.append(args[0]),
        interval_seconds=30,
        stall_seconds=120,
        webhook_grace_seconds=1600,
    )
    message = _search_event(job.id, occurred_at=datetime.now().timestamp())
    now = time.time()
    for _ in range(3 * webhooks.MAX_ATTEMPTS):
        webhook_task.webhook.apply(args=[message])  # its retry's message is lost
        now += 1601
        if not sweeper.resend_webhooks(now=now):
            break
        message = resent[-1]
    assert attempts == list(range(1, webhooks.MAX_ATTEMPTS + 1))
    assert context.store.redis.zscore(WEBHOOKS_OWED_KEY, job.id) is None  # given up


def test_a_batch_item_s_queue_wait_is_observed_once_when_its_retry_message_was_lost(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item's first run fails retryably (requeued, its chunk's retry sent) and the retry
    message is lost: the re-drive sends the chunk again, a first delivery (retries 0) that
    finds the item ``queued``. ``sift_job_queue_wait_seconds{queue="sift.batch"}`` counts
    the item's wait once, at its first run (it counted it again at the re-driven run, as if
    a second item had waited). The item's own ``queue_wait`` (its trace, its batch's
    ``stage_seconds``) is to the start of the run that made its result, as documented."""
    from celery.exceptions import Retry

    from worker.constants import BATCH_QUEUE

    _patch_backoff(monkeypatch)
    monkeypatch.setattr(base.SiftTask, "retry", lambda self, **_: Retry("lost"))
    runtime = ScriptedRuntime(BackendUnavailable("blip"))
    context._runtime = runtime
    store = context.store
    spec = SearchSpec(index="docs", query="q", include_trace=True)
    batch = store.create_batch("acme", "docs", [("q0", spec)])
    before = _queue_waits(BATCH_QUEUE)
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])  # fails retryably; its retry is lost
    item = store.batch_items(batch.id, ["q0"])[0]
    assert item.status == "queued" and runtime.calls == 1, item
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])  # the re-drive's message: a first delivery
    assert runtime.calls == 2
    assert _queue_waits(BATCH_QUEUE)[0] - before[0] == 1
    done = store.get_batch(batch.id)
    assert done is not None and done.status == "succeeded", done


@pytest.mark.parametrize("lane", ["standard", "economy"])
def test_a_batch_item_s_retrieval_figures_are_counted_once_a_run_when_its_retry_was_lost(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch, lane: str
) -> None:
    """A real pipeline over an in-memory index: the item's first run fails its retrieval (the
    backend down for its 3 attempts), is requeued, and its retry message is lost; the
    re-drive's chunk runs it again and it succeeds. The figures are each run's, once: the
    failed run's attempts (counted at its requeue, the move that ended that run) and the
    run that made the result (counted once it was saved): one fusion, one search done, one
    queue wait."""
    from celery.exceptions import Retry

    from tests.fakes import FakeEmbedder, InMemoryBackend, RecordingRecorder
    from worker.constants import BATCH_QUEUE
    from worker.runtime.inprocess import build_runtime

    _patch_backoff(monkeypatch)
    monkeypatch.setattr(base.SiftTask, "retry", lambda self, **_: Retry("lost"))
    backend, recorder = InMemoryBackend(), RecordingRecorder()
    runtime = build_runtime(
        context.settings, backend=backend, embedder=FakeEmbedder(), recorder=recorder
    )
    runtime.ingest("docs", "acme", [DocumentIn(id="1", text="green tea leaves")])
    context._runtime = runtime
    store = context.store
    monkeypatch.setattr(batches, "maybe_submit", lambda *args: None)  # nothing to submit
    spec = SearchSpec(index="docs", query="green tea", mode="fts")  # final with no model call
    batch = store.create_batch("acme", "docs", [("q0", spec)], lane=lane)
    backend.fail_next = 3  # the first run's three retrieval attempts
    waits = _queue_waits(BATCH_QUEUE)[0]
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])  # requeued; its retry message is lost
    assert store.batch_items(batch.id, ["q0"])[0].status == "queued"
    failed_run = recorder.events.copy()
    assert ("hits", "fuse") not in failed_run and ("search", "error") in failed_run
    tasks.batch_chunk.apply(args=[batch.id, 0, 1])  # the re-drive's message
    done = store.get_batch(batch.id)
    assert done is not None and done.status == "succeeded", done
    second = recorder.events - failed_run
    assert second[("hits", "fuse")] == second[("retrieval", "fuse")] == 1, recorder.events
    assert second[("hits", "bm25")] == second[("search", "ok")] == 1, recorder.events
    assert _queue_waits(BATCH_QUEUE)[0] - waits == 1


def test_a_redelivered_search_sends_its_webhook_again_only_while_no_attempt_is_known(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search's message delivered again once the search is final sends its webhook again
    (the worker that finished it may have died before enqueueing it) only while the webhook
    is owed and no retry of it is recorded. Once a retry is recorded its schedule is running
    (a lost retry message is the re-drive's, which goes on with that schedule); once it is
    delivered or given up it is owed no more. Before, every such delivery sent a copy that
    started a schedule of its own: a webhook given up after its 8 attempts was attempted
    again, and one delivered was delivered again."""
    import time

    sent: list[str] = []
    monkeypatch.setattr(base.SiftTask, "send_webhook", lambda self, *args: sent.append(args[1]))
    context._runtime = ScriptedRuntime()
    store = context.store
    job = store.create_search(
        "acme", SearchSpec(index="docs", query="q"), webhook_url="https://hooks.example/x"
    )
    tasks.search.apply(args=[job.id])
    assert sent == [job.id]  # the finish's own
    tasks.search.apply(args=[job.id])  # a redelivery: its first message may never have gone
    assert sent == [job.id, job.id]
    assert store.webhook_due(job.id, time.time() + 300, 2)  # attempt 1 made, 2 due
    tasks.search.apply(args=[job.id])
    store.webhook_settled(job.id, "delivered", 2)  # delivered (or given up)
    tasks.search.apply(args=[job.id])
    assert sent == [job.id, job.id]


def test_two_copies_of_a_webhook_failing_the_same_attempt_go_on_as_one_schedule(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two messages of one webhook make the same attempt (the finish's, and a redelivered
    task's copy sent while the first had not run yet), and the receiver answers 500 to the
    first: one retry goes on, not two schedules side by side (each of 8 attempts), and the
    copy, which runs once that attempt ended, sends nothing (it sent the attempt again)."""
    from datetime import datetime

    from worker.webhooks import delivery as webhooks

    job = _searched_with_a_webhook(context, monkeypatch)
    answer = webhooks.DeliveryResult(webhooks.DeliveryOutcome.RETRY, "http 500", 500)
    sent: list[int] = []

    def run_delivery(**kw: Any) -> webhooks.DeliveryDecision:
        sent.append(kw["attempt"])
        return webhooks.DeliveryDecision(answer, kw["attempt"], 5.0)

    monkeypatch.setattr(webhooks, "run_delivery", run_delivery)
    retries = _capturing_retries(monkeypatch)
    message = _search_event(job.id, occurred_at=datetime.now().timestamp())
    webhook_task.webhook.apply(args=[message])
    webhook_task.webhook.apply(args=[message])  # the copy, the same attempt
    assert sent == [1]
    assert [r["attempt"] for r in retries] == [2]
    assert context.store.webhook_attempt(job.id) == 2


def test_two_copies_of_a_webhook_s_first_attempt_in_flight_at_once_send_it_once(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search's message delivered again (kombu's restore after a broker outage) while the
    webhook's first message is being sent: the job is final and its webhook owed with no
    retry recorded, so the redelivered search sends a copy, a message of its own (another
    task id), and the copy runs while the first is still at the receiver. The copy sends
    nothing: the first holds the attempt's claim, one per job, so the copy waits it out (a
    hop of the same attempt) and then finds the webhook delivered. Before, both sent
    attempt 1, and the receiver got it twice though nothing had failed (CI: ``test_lost_replies``
    got ``['succeeded', 'succeeded']``)."""
    from worker.queue.jobstore import WebhookState
    from worker.webhooks import delivery as webhooks

    sends: list[dict[str, Any]] = []
    at_receiver, release = threading.Event(), threading.Event()
    answer = webhooks.DeliveryResult(webhooks.DeliveryOutcome.DELIVERED, "http 204", 204)

    def run_delivery(**kw: Any) -> webhooks.DeliveryDecision:
        sends.append(kw)
        if len(sends) == 1:  # the first: held at the receiver until the copy has run
            at_receiver.set()
            release.wait(30)
        return webhooks.DeliveryDecision(answer, kw["attempt"], None)

    monkeypatch.setattr(webhooks, "run_delivery", run_delivery)
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(
        base.SiftTask, "send_webhook", lambda self, *args: events.append(_search_event(args[1]))
    )
    job = _searched_with_a_webhook(context, monkeypatch)  # its finish sent the first event
    first = threading.Thread(target=webhook_task.webhook.apply, args=([events[0]],))
    first.start()
    try:
        assert at_receiver.wait(30)
        hops = _capturing_retries(monkeypatch)
        tasks.search.apply(args=[job.id])  # the redelivery: its copy
        assert len(events) == 2
        webhook_task.webhook.apply(args=[events[1]])
        assert len(sends) == 1  # the copy waits for the first's claim
        assert [hop["attempt"] for hop in hops] == [1]
    finally:
        release.set()
        first.join(30)
    webhook_task.webhook.apply(args=[hops[0]])  # the copy's hop: delivered meanwhile
    assert len(sends) == 1 and len(hops) == 1
    done = context.store.get_search(job.id)
    assert done is not None and done.webhook == WebhookState("delivered", 1)


@pytest.mark.parametrize("claimant", ["dead worker", "lease over"])
def test_a_webhook_attempt_whose_claimant_died_is_made_by_another_copy(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch, claimant: str
) -> None:
    """The copy holding the first attempt's claim died mid-delivery (its worker killed): the
    next copy of that attempt (its own message put back by the dead-worker check, or another
    copy) makes it, once the claimant's heartbeat is gone or, for a claim that named no
    worker, once its lease is over. The webhook is not lost with the claim. While the
    claimant's heartbeat lives, the copy waits."""
    from worker.constants import WORKER_HEARTBEAT_KEY
    from worker.queue.jobstore import WebhookState
    from worker.webhooks import delivery as webhooks

    sent: list[int] = []
    answer = webhooks.DeliveryResult(webhooks.DeliveryOutcome.DELIVERED, "http 204", 204)

    def run_delivery(**kw: Any) -> webhooks.DeliveryDecision:
        sent.append(kw["attempt"])
        return webhooks.DeliveryDecision(answer, kw["attempt"], None)

    monkeypatch.setattr(webhooks, "run_delivery", run_delivery)
    hops = _capturing_retries(monkeypatch)
    job = _searched_with_a_webhook(context, monkeypatch)
    store = context.store
    if claimant == "dead worker":  # its heartbeat lives, then the worker dies
        store.redis.set(WORKER_HEARTBEAT_KEY + "w-dead", "1")
        assert store.claim_webhook(job.id, 1, "w-dead", lease_seconds=300.0).granted
        webhook_task.webhook.apply(args=[_search_event(job.id)])
        assert sent == [] and [hop["attempt"] for hop in hops] == [1]  # it waits
        store.redis.delete(WORKER_HEARTBEAT_KEY + "w-dead")
    else:  # a process without a heartbeat of its own, its lease over
        assert store.claim_webhook(job.id, 1, "", lease_seconds=0.0).granted
    webhook_task.webhook.apply(args=[_search_event(job.id)])
    assert sent == [1]
    done = store.get_search(job.id)
    assert done is not None and done.webhook == WebhookState("delivered", 1)


def test_a_poisoned_job_whose_dead_run_kept_a_model_answer_shows_that_billed_call(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run called the model and kept its answer in its claim, then its worker died, and so
    did the next ones until the message's deliveries were spent: the poison path fails the
    item (and a search) ``delivery_limit_exceeded``. The call the dead run made was billed:
    the error's ``usage`` shows it, and so do the batch's ``usage`` and ``cost_usd``, as a
    failure after a taken-over answer does. Before, the poisoned failure had no usage: the
    provider billed a call no record showed."""
    from worker.constants import BATCH_RUNS_KEY, SEARCH_KEY
    from worker.core.pipeline import RerankRun, dump_run
    from worker.core.types import RerankReply, TokenUsage

    usage = TokenUsage(900, 12, 0, 0)
    kept = RerankRun(
        attempts=[{"n": 1, "outcome": "ok", "seconds": 0.4}],
        usage=usage,
        cost_usd=0.0011,
        returned=[1],
        reply=RerankReply([1], usage, "m"),
    )
    answer = json.dumps({**dump_run(kept), "shown": "digest"})
    runtime = ScriptedRuntime()
    context._runtime = runtime
    store = context.store
    spec = SearchSpec(index="docs", query="q")
    batch = store.create_batch("acme", "docs", [("q0", spec)])
    assert store.start_item(batch.id, "q0")
    monkeypatch.setattr(liveness, "run_owner", lambda: "w2")  # judged by its runs lost
    # its third run kept the answer, then it died too
    claim = _runs_lost(store, batch.id, "q0", context.settings.task_max_deliveries)
    assert store.keep_answer(BATCH_RUNS_KEY + batch.id, "q0", claim, answer)
    tasks.batch_chunk.apply(args=[batch.id, 0, 1], task_id="poison-chunk")
    (item,) = store.batch_results(batch.id, 0, 1)
    assert item.status == "failed" and item.payload is not None, item
    error = json.loads(item.payload)["error"]
    assert error["type"] == "delivery_limit_exceeded", error
    assert error["usage"] is not None, error
    assert error["usage"]["requests"] == 1 and error["usage"]["input_tokens"] == 900
    assert error["usage"]["cost_usd"] == pytest.approx(0.0011)
    done = store.get_batch(batch.id)
    assert done is not None and done.usage is not None
    assert done.usage.model_dump() == error["usage"]
    # and a search's, likewise
    job = store.create_search("acme", spec)
    assert store.start_search(job.id)
    claim = store.claim_search(job.id, "", lease_seconds=30.0)
    assert store.keep_answer(SEARCH_KEY + job.id, "run", claim, answer)
    store.set_deliveries("poison-search", 0, context.settings.task_max_deliveries)
    tasks.search.apply(args=[job.id], task_id="poison-search")
    failed = store.get_search(job.id)
    assert failed is not None and failed.error is not None, failed
    assert failed.error.type == "delivery_limit_exceeded" and failed.error.usage is not None
    assert failed.error.usage.requests == 1 and failed.error.usage.input_tokens == 900
    assert runtime.calls == 0


def test_a_webhook_copy_failing_after_another_copy_delivered_it_starts_no_schedule(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two messages of one webhook (the finish's, and a redelivered task's copy sent while
    the first had not run yet): the first is delivered, then the copy runs, its receiver
    about to answer a 500. The webhook was delivered and its record says so: the copy sends
    nothing and starts no schedule. Before, it sent the duplicate, and a copy
    failing once the webhook was settled went on with a schedule of its own, up to 8
    attempts over a day of a webhook already delivered, and ended counted ``failed`` (given
    up) if the receiver kept refusing the duplicate."""
    from datetime import datetime

    from worker.webhooks import delivery as webhooks

    job = _searched_with_a_webhook(context, monkeypatch)
    answers = [
        webhooks.DeliveryResult(webhooks.DeliveryOutcome.DELIVERED, "http 200", 200),
        webhooks.DeliveryResult(webhooks.DeliveryOutcome.RETRY, "http 500", 500),
    ]

    def run_delivery(**kw: Any) -> webhooks.DeliveryDecision:
        answer = answers.pop(0)
        retry_in = 5.0 if answer.outcome is webhooks.DeliveryOutcome.RETRY else None
        return webhooks.DeliveryDecision(answer, kw["attempt"], retry_in)

    monkeypatch.setattr(webhooks, "run_delivery", run_delivery)
    retries = _capturing_retries(monkeypatch)
    message = _search_event(job.id, occurred_at=datetime.now().timestamp())
    webhook_task.webhook.apply(args=[message])  # delivered
    webhook_task.webhook.apply(args=[message])  # the copy: it would meet a 500
    assert len(answers) == 1  # the copy sent nothing: the webhook was delivered
    assert retries == []


def test_webhook_deliveries_beyond_the_process_bound_are_put_off_not_waited_for(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the bound at 2, five webhooks due at once to a receiver that answers nothing:
    two are sent and wait on it; the other three are put off (a hop of the same event, the
    attempt unspent) and their threads are free while the two still wait. Before the bound,
    all five threads sat in the receiver (a default worker's every thread, in the audit).
    Each put-off is counted in ``sift_webhook_deferrals_total`` (before: in no metric but
    the task's ``wait`` outcome, which a hop toward a retry's due time shares)."""
    from types import SimpleNamespace

    from tests.integration.slow_receivers import slow_receiver
    from worker.observability import metrics
    from worker.settings import Settings

    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    key = SimpleNamespace(tenant="acme", webhook_secrets=lambda: [secret])
    monkeypatch.setattr(Settings, "all_api_keys", lambda self: [key])
    context.settings = context.settings.model_copy(
        update={"webhook_deliveries_per_process": 2, "webhook_allow_private_networks": True}
    )
    hops = _capturing_retries(monkeypatch)

    def count(result: str) -> float:
        return float(metrics.WEBHOOK_DELIVERIES.labels(result)._value.get())

    def deferred() -> float:
        return float(metrics.WEBHOOK_DEFERRALS.labels("search.completed")._value.get())

    before = {r: count(r) for r in ("delivered", "retry", "failed")}
    deferred_before = deferred()
    with slow_receiver() as receiver:
        events = {f"srch_{i}": _search_event(f"srch_{i}") for i in range(5)}
        for event in events.values():
            event["url"] = receiver.url
        threads = {
            job_id: threading.Thread(target=webhook_task.webhook.apply, args=([event],))
            for job_id, event in events.items()
        }
        for thread in threads.values():
            thread.start()
        try:
            for _ in range(600):  # a hang guard: until every one is at the receiver or put off
                if receiver.held + len(hops) >= 5:
                    break
                threading.Event().wait(0.05)
            put_off = {hop["data"]["id"] for hop in hops}
            for job_id in put_off:
                threads[job_id].join(30)
            assert receiver.held == 2 and len(hops) == 3
            assert deferred() - deferred_before == 3.0
            assert all(not threads[job_id].is_alive() for job_id in put_off)
            sending = set(events) - put_off
            assert all(threads[job_id].is_alive() for job_id in sending)
            assert all(hop == {**events[hop["data"]["id"]], "attempt": 1} for hop in hops)
        finally:
            receiver.release.set()
            for thread in threads.values():
                thread.join(30)
    assert receiver.requests == 2
    after = {r: count(r) - before[r] for r in before}
    assert after == {"delivered": 2.0, "retry": 0.0, "failed": 0.0}  # a put-off is no attempt


def test_a_webhook_cut_at_its_total_cap_is_a_retried_attempt(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver trickling its headers (a byte every 0.1 s, under a 10 s read timeout) is cut
    at the 1 s cap: the task counts a `retry` delivery and sends the next attempt's message,
    as for any timeout. Before the cap it waited out the whole drip, then a transport error."""
    from types import SimpleNamespace

    from tests.integration.slow_receivers import slow_receiver
    from worker.observability import metrics
    from worker.settings import Settings

    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    key = SimpleNamespace(tenant="acme", webhook_secrets=lambda: [secret])
    monkeypatch.setattr(Settings, "all_api_keys", lambda self: [key])
    context.settings = context.settings.model_copy(
        update={
            "webhook_allow_private_networks": True,
            "webhook_read_timeout_seconds": 10.0,
            "webhook_total_timeout_seconds": 1.0,
        }
    )
    retries = _capturing_retries(monkeypatch)
    before = float(metrics.WEBHOOK_DELIVERIES.labels("retry")._value.get())
    with slow_receiver(drip=0.1, max_bytes=200) as receiver:
        event = _search_event("srch_1")
        event["url"] = receiver.url
        webhook_task.webhook.apply(args=[event])
        assert receiver.cut.wait(30) and not receiver.ran_out.is_set()
    assert float(metrics.WEBHOOK_DELIVERIES.labels("retry")._value.get()) - before == 1.0
    assert [r["attempt"] for r in retries] == [2]


def test_a_webhook_whose_host_name_lookup_hangs_is_a_retried_timeout_at_its_cap(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The SSRF guard looks the host up with getaddrinfo, which takes no timeout: a DNS server
    that never answers held the delivery's thread until the system resolver gave up (5 s a
    try by default, its tries and servers multiplied; 20 s here), past the 1 s cap, and that
    give-up, a temporary failure, was then a refusal (``failed``, never retried). Now the
    attempt ends at its cap while the lookup still hangs: a timeout, counted ``retry``, the
    next attempt's message sent on the schedule."""
    import socket
    from types import SimpleNamespace

    from worker.observability import metrics
    from worker.settings import Settings

    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    key = SimpleNamespace(tenant="acme", webhook_secrets=lambda: [secret])
    monkeypatch.setattr(Settings, "all_api_keys", lambda self: [key])
    context.settings = context.settings.model_copy(
        update={"webhook_allow_private_networks": True, "webhook_total_timeout_seconds": 1.0}
    )
    answered = threading.Event()
    real = socket.getaddrinfo

    def hanging(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "hangs.example":  # its DNS server never answers; the resolver gives up
            answered.wait(20.0)
            answered.set()
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    retries = _capturing_retries(monkeypatch)
    before = {
        r: float(metrics.WEBHOOK_DELIVERIES.labels(r)._value.get()) for r in ("retry", "failed")
    }
    event = _search_event("srch_1")
    event["url"] = "http://hangs.example/hook"
    try:
        with caplog.at_level("INFO", logger="worker.webhooks.delivery"):
            webhook_task.webhook.apply(args=[event])
        assert not answered.is_set()  # it did not wait for the lookup
    finally:
        answered.set()
    after = {
        r: float(metrics.WEBHOOK_DELIVERIES.labels(r)._value.get()) - before[r] for r in before
    }
    assert after == {"retry": 1.0, "failed": 0.0}
    assert [r["attempt"] for r in retries] == [2]
    assert "retry (timeout: the name lookup, at the 1 s cap)" in caplog.text


def test_webhook_lookups_a_resolver_never_answers_hold_a_share_of_the_threads_and_no_queue(
    context: base.WorkerContext, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A lookup given up on at its cap keeps its thread until the resolver answers, and a
    resolver may never answer. One tenant's 32 webhooks to hosts whose lookups never end held
    all 32 lookup threads; every later lookup, any tenant's, queued behind them, waited out
    its whole cap and was reported as a lookup that took too long (here: acme's webhook to a
    receiver on loopback never sent). Now one tenant's hung lookups hold 24 (a quarter of the
    threads kept for tenants with none in the resolver), its further ones are refused at once,
    and acme's webhook goes out. With every thread hung (eight more tenants' one each), acme's
    next lookup is refused at once, never queued: a retried attempt that says why."""
    import socket
    from types import SimpleNamespace

    from tests.services import webhook_inbox
    from worker.observability import metrics
    from worker.queue.jobstore import webhook_event
    from worker.settings import Settings
    from worker.webhooks import delivery

    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    tenants = ["acme", "evil", *(f"t{i}" for i in range(8))]
    keys = [SimpleNamespace(tenant=t, webhook_secrets=lambda: [secret]) for t in tenants]
    monkeypatch.setattr(Settings, "all_api_keys", lambda self: keys)

    def cap(seconds: float) -> None:
        """Each delivery's cap: short while hung lookups are given up on (each waits it out),
        long for the delivery to the receiver, which a loaded machine can slow past 0.2 s."""
        context.settings = context.settings.model_copy(
            update={
                "webhook_allow_private_networks": True,
                "webhook_total_timeout_seconds": seconds,
            }
        )

    cap(0.2)
    monkeypatch.setattr(delivery, "_LOOKUPS", delivery._lookup_pool())  # this test's own
    never = threading.Event()
    asked: list[str] = []
    real = socket.getaddrinfo

    def resolver(host: Any, *args: Any, **kwargs: Any) -> Any:
        if str(host).endswith(".hangs.example"):  # its resolver never answers
            asked.append(host)
            never.wait()  # set as the test ends, so the threads end
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    _capturing_retries(monkeypatch)

    def count(result: str) -> float:
        return float(metrics.WEBHOOK_DELIVERIES.labels(result)._value.get())

    def send(job_id: str, tenant: str, url: str) -> None:
        event = webhook_event("search.completed", job_id, tenant, url, "succeeded")
        webhook_task.webhook.apply(args=[event])

    before = {r: count(r) for r in ("delivered", "retry", "failed")}
    try:
        with (
            webhook_inbox() as (url, inbox),
            caplog.at_level("INFO", logger="worker.webhooks.delivery"),
        ):
            for i in range(delivery.LOOKUP_THREADS):
                send(f"srch_evil{i}", "evil", f"http://h{i}.hangs.example/hook")
            # 8 threads are free, kept for the other tenants: the reason says it is evil's
            assert "thread free for this tenant (24 of 32 wait on the resolver)" in caplog.text
            cap(30.0)
            send("srch_acme1", "acme", url)
            assert inbox.qsize() == 1  # delivered, its lookup on a thread kept free
            cap(0.2)
            share = delivery.LOOKUP_THREADS * 3 // 4
            assert len(asked) == share  # evil's others were refused, not queued
            for i in range(8):
                send(f"srch_t{i}", f"t{i}", f"http://t{i}.hangs.example/hook")
            assert len(asked) == delivery.LOOKUP_THREADS  # every thread in the resolver
            caplog.clear()
            send("srch_acme2", "acme", url)
            assert inbox.qsize() == 1  # not sent
            assert "retry (dns: no name lookup thread free for this tenant (32 of 32" in caplog.text
            assert "name lookup, at the" not in caplog.text  # not waited out as a timeout
    finally:
        never.set()
    after = {r: count(r) - before[r] for r in before}
    assert after == {"delivered": 1.0, "retry": 41.0, "failed": 0.0}


@pytest.mark.parametrize(
    ("answer", "attempt", "retry_in", "shown"),
    [
        ("http 500", 8, None, ("failed", 8)),  # the schedule spent
        ("http 404", 2, None, ("failed", 2)),  # refused
        ("http 204", 3, None, ("delivered", 3)),
        ("http 500", 3, 60.0, ("retrying", 3)),  # attempt 4 due
    ],
)
def test_a_webhook_attempt_records_where_the_webhook_stands(
    context: base.WorkerContext,
    monkeypatch: pytest.MonkeyPatch,
    answer: str,
    attempt: int,
    retry_in: float | None,
    shown: tuple[str, int],
) -> None:
    """What the job's GET shows of its webhook comes from each attempt's end: a give-up and
    a refusal are ``failed``, a 2xx ``delivered``, each with the attempts made; a retry due
    is ``retrying``."""
    from worker.queue.jobstore import WebhookState
    from worker.webhooks import delivery as webhooks

    job = _searched_with_a_webhook(context, monkeypatch)
    code = int(answer.split()[1])
    outcome = {
        204: webhooks.DeliveryOutcome.DELIVERED,
        404: webhooks.DeliveryOutcome.FAILED,
        500: webhooks.DeliveryOutcome.RETRY,
    }[code]
    result = webhooks.DeliveryResult(outcome, answer, code)
    decision = webhooks.DeliveryDecision(result=result, attempt=attempt, retry_in=retry_in)
    monkeypatch.setattr(webhooks, "run_delivery", lambda **_: decision)
    _capturing_retries(monkeypatch)
    webhook_task.webhook.apply(args=[{**_search_event(job.id), "attempt": attempt}])
    done = context.store.get_search(job.id)
    assert done is not None and done.webhook == WebhookState(*shown)  # type: ignore[arg-type]


def test_a_chunk_of_a_finished_standard_batch_is_left_untouched(
    context: base.WorkerContext,
) -> None:
    """A chunk message of a batch that has finished, every item final (a cancel's chunks
    still queued: a 100,000-query batch has 4,000), has nothing to run and no webhook to send
    again: it is acked at once, its chunk not claimed, its delivery not counted, its items
    not read. Each went through all of that, and the batches sent after a big one canceled
    waited in the queue behind its thousands of chunks."""
    store = context.store
    spec = SearchSpec(index="docs", query="volcano ash", limit=2)
    batch = store.create_batch("acme", "docs", [("q0", spec), ("q1", spec)])
    store.cancel_batch(batch.id)
    finished = store.get_batch(batch.id)
    assert finished is not None and finished.finished_at is not None, finished
    before = set(store.redis.keys("*"))
    assert tasks.batch_chunk.apply(args=[batch.id, 0, 2]).successful()
    assert set(store.redis.keys("*")) == before  # no claim, no delivery counted
