"""The economy lane's creates in doubt against a real redis-server and the fake Messages API
(the real SDK over loopback HTTP), their steps driven directly (no worker process): what
two runs deciding at the same instant do, made deterministic by holding each at the same
point until the other reached it too."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx2
import pytest
from opentelemetry import trace

from tests.fake_anthropic import FakeAnthropic, drop, errored, status
from tests.keys import GLOBEX_KEY
from tests.unit.test_pipeline import make
from worker import clock
from worker.adapters.anthropic import AnthropicReranker
from worker.adapters.anthropic_batches import CALL_TIMEOUT_SECONDS, AnthropicMessageBatches
from worker.clock import SharedClock
from worker.constants import (
    BATCH_ITEMS_KEY,
    BATCH_KEY,
    ECONOMY_POLL_TASK,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RESEND_CLAIM,
    ECONOMY_RUNS_KEY,
    ECONOMY_SENDING_MARK,
    ECONOMY_STATE_KEY,
    ECONOMY_SUBMIT_TASK,
    WORKER_HEARTBEAT_KEY,
)
from worker.contract import SearchSpec
from worker.errors import AttemptOutcome, BackendUnavailable, RerankAttemptError
from worker.queue import economy, liveness
from worker.queue.base import WorkerContext
from worker.queue.economy import cancel, doubts, leases, records, submission
from worker.queue.economy.cancel import cancel_quietly
from worker.queue.economy.finish import fail_items
from worker.queue.jobstore import BatchJob, JobStore
from worker.runtime.ratelimit import ProviderLimiter
from worker.settings import load_settings

pytestmark = pytest.mark.integration

SPEC = SearchSpec(index="docs", query="volcano eruption ash", limit=3)
MODEL = "claude-haiku-4-5"


class Rendezvous:
    """Holds each of ``parties`` threads at :meth:`arrive` until every other one arrived as
    well, or finished (:meth:`leave`): threads that both get there pass it together, each
    having read what it read before and written nothing after; one that gets there alone is
    not held for ever. (The timeout only keeps a broken test from hanging.)"""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.arrived = self.left = 0
        self.cond = threading.Condition()

    def arrive(self) -> None:
        with self.cond:
            self.arrived += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.arrived + self.left >= self.parties, timeout=60)

    def leave(self) -> None:
        with self.cond:
            self.left += 1
            self.cond.notify_all()


class _Task:
    """What the economy lane's steps use of a Celery task: its worker context, its request,
    and its app's ``send_task`` (recorded, not sent)."""

    def __init__(self, context: WorkerContext, task_id: str) -> None:
        self.context = context
        self.request = SimpleNamespace(id=task_id, retries=0)
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.app = SimpleNamespace(send_task=lambda name, **kw: self.sent.append((name, kw)))

    def retry(self, **_: Any) -> None:
        raise AssertionError("no step of these tests should retry")

    def announce_batch(self, batch: BatchJob, status: str) -> None:
        self.sent.append(("batch.completed", {"id": batch.id, "status": status}))


@pytest.fixture
def model() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as fake:
        yield fake


@pytest.fixture
def context(store: JobStore, model: FakeAnthropic, redis_url: str) -> WorkerContext:
    pipeline, _, _ = make([])  # rerank on: each prepared item has its prompt
    sdk = anthropic.Anthropic(base_url=model.url, api_key="sk-ant-test", max_retries=0)
    return WorkerContext(
        settings=load_settings(redis_url=redis_url),
        store=store,
        limiter=ProviderLimiter(4),
        _runtime=SimpleNamespace(economy=pipeline),  # type: ignore[arg-type]
        _batches=AnthropicMessageBatches(AnthropicReranker(MODEL, client=sdk)),
    )


def _foreign_batch(model: FakeAnthropic, requests: int) -> str:
    """Another client's provider batch in the workspace, of ``requests`` requests."""
    sdk = anthropic.Anthropic(base_url=model.url, api_key="sk-ant-test")
    params = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    made = sdk.messages.batches.create(
        requests=[{"custom_id": f"x{i}", "params": params} for i in range(requests)]  # type: ignore[misc]
    )
    return made.id


def _in_doubt(context: WorkerContext, model: FakeAnthropic, n: int) -> tuple[BatchJob, list[str]]:
    """A batch of ``n`` prepared items waiting on a create in doubt (submission ``sub``) whose
    two candidates, other clients' provider batches of as many requests, have both ended:
    each one's poll has marked its candidate ended (the instant after which both polls look
    at the whole group). Answers the batch and the candidates."""
    store = context.store
    items = [(f"q{i}", SPEC) for i in range(n)]
    batch = store.create_batch("acme", "docs", items, lane="economy")
    pipeline = economy.economy_pipeline(_Task(context, "chunk"))  # type: ignore[arg-type]
    at = time.time()
    runs: dict[str, str] = {}
    for position, (qid, spec) in enumerate(items):
        store.start_item(batch.id, qid)
        economy.save_prepared(store, batch.id, qid, position, pipeline.prepare(spec, "acme"))
        run = records.new_run(position)
        run.update(provider=economy.DOUBT + "sub", submission="sub", round=1, submitted_at=at,
                   first_submitted_at=at)  # fmt: skip
        runs[qid] = json.dumps(run)
    store.economy_save(batch.id, ECONOMY_RUNS_KEY, runs)
    candidates = [_foreign_batch(model, n), _foreign_batch(model, n)]
    for provider_id in candidates:
        record = {"round": 1, "requests": n, "created_at": at, "ended_at": time.time(),
                  "submission": "sub", "doubt": True}  # fmt: skip
        store.economy_save(batch.id, ECONOMY_PROVIDERS_KEY, {provider_id: json.dumps(record)})
    return batch, candidates


def _concurrently(steps: list[Callable[[], None]], rendezvous: Rendezvous) -> None:
    errors: list[BaseException] = []

    def run(step: Callable[[], None]) -> None:
        try:
            step()
        except BaseException as exc:  # asserted below, in the test's thread
            errors.append(exc)
        finally:
            rendezvous.leave()

    threads = [threading.Thread(target=run, args=(step,)) for step in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors


def test_two_candidate_polls_mapping_at_once_send_the_items_again_once(
    context: WorkerContext, model: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both candidates of a create in doubt end without a line of it, and their two polls map
    their results at the same instant: each finds every candidate ended and the items still
    waiting. The items must be sent again once: one provider batch, not two, each paid."""
    batch, candidates = _in_doubt(context, model, 2)
    # each run is held just before it would write its create down (its reads all done)
    # until the other got as far, or ended without sending: the race's worst interleaving
    rendezvous = Rendezvous(2)
    new_submission = submission.new_submission

    def held() -> str:
        rendezvous.arrive()
        return new_submission()

    monkeypatch.setattr(submission, "new_submission", held)  # where submit() reads it
    tasks = [_Task(context, f"poll-{provider_id}") for provider_id in candidates]
    _concurrently(
        [
            lambda t=task, p=provider_id: economy.map_results(t, batch, p)  # type: ignore[misc]
            for task, provider_id in zip(tasks, candidates, strict=True)
        ],
        rendezvous,
    )
    made = [b for b in model.batches() if b["id"] not in candidates]
    assert len(made) == 1, [b["custom_ids"] for b in made]  # sent again once, paid once
    [resent] = made
    assert sorted(economy.position_of(c) for c in resent["custom_ids"]) == [0, 1]
    runs = context.store.economy_all(batch.id, ECONOMY_RUNS_KEY)
    assert {json.loads(r)["provider"] for r in runs.values()} == {resent["id"]}
    polls = [kw["args"] for task in tasks for _, kw in task.sent]
    assert polls == [[batch.id, resent["id"]]]  # and one poll of it


def test_the_resend_claim_stays_with_the_poll_that_took_it(store: JobStore) -> None:
    """Only the first candidate's poll sends a create's items again; that poll, run again
    (its resend failed and is retried, or its worker died), still may."""
    batch = store.create_batch("acme", "docs", [("q0", SPEC)], lane="economy")
    claim = ECONOMY_RESEND_CLAIM + "sub"
    assert store.economy_claim_for(batch.id, claim, "msgbatch_a")
    assert not store.economy_claim_for(batch.id, claim, "msgbatch_b")
    assert store.economy_claim_for(batch.id, claim, "msgbatch_a")  # its own, run again
    other = ECONOMY_RESEND_CLAIM + "other"
    assert store.economy_claim_for(batch.id, other, "msgbatch_b")  # another create's


# --- a create whose run is taken over while its body goes out --------------------------------


class Stall:
    """A run stopped where it calls this (SIGSTOP, a VM paused, a swap storm) until the test
    lets it go on."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()

    def __call__(self) -> None:
        self.reached.set()
        assert self.go.wait(60), "the test never let the stalled run go on"


def _prepared(
    context: WorkerContext, n: int, spec_of: Callable[[int], SearchSpec] = lambda _: SPEC
) -> tuple[BatchJob, list[str]]:
    """A batch of ``n`` items (the ``i``-th asking ``spec_of(i)``), each prepared (its prompt
    waiting to go), none sent yet."""
    store = context.store
    items = [(f"q{i}", spec_of(i)) for i in range(n)]
    batch = store.create_batch("acme", "docs", items, lane="economy")
    pipeline = economy.economy_pipeline(_Task(context, "chunk"))  # type: ignore[arg-type]
    for position, (qid, spec) in enumerate(items):
        store.start_item(batch.id, qid)
        economy.save_prepared(store, batch.id, qid, position, pipeline.prepare(spec, "acme"))
    return batch, [qid for qid, _ in items]


def _backdate(store: JobStore, batch_id: str, seconds: float, *, marks: bool) -> None:
    """Time passing: the creates written down on the batch's runs started ``seconds``
    earlier (and, with ``marks``, their bodies' last pieces went out that much earlier)."""
    runs = {}
    for qid, raw in store.economy_all(batch_id, ECONOMY_RUNS_KEY).items():
        run = json.loads(raw)
        if run.get("pending"):
            run["pending"]["at"] -= seconds
            runs[qid] = json.dumps(run)
    store.economy_save(batch_id, ECONOMY_RUNS_KEY, runs)
    if marks:
        state = store.economy_all(batch_id, ECONOMY_STATE_KEY)
        store.economy_save(batch_id, ECONOMY_STATE_KEY, {
            field: repr(float(value) - seconds)
            for field, value in state.items() if field.startswith(ECONOMY_SENDING_MARK)
        })  # fmt: skip


@pytest.fixture
def workers(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each thread is a worker of its own, named after it, its heartbeat alive."""
    monkeypatch.setattr(
        liveness, "current", lambda: SimpleNamespace(worker_id=threading.current_thread().name)
    )
    for name in ("w1", threading.current_thread().name):
        store.redis.set(WORKER_HEARTBEAT_KEY + name, "1", px=600_000)


def _submission(context: WorkerContext, batch: BatchJob, qids: list[str], name: str) -> None:
    """One run of the batch's submission (``sift.economy_submit``'s, under its lease)."""
    task = _Task(context, f"submit-{name}")
    fresh = context.store.get_batch(batch.id) or batch
    leases.leased(task, batch.id, economy.SUBMIT_CLAIM, lambda: economy.submit(task, fresh, qids))  # type: ignore[arg-type]


def _in_thread(
    target: Callable[[], None], name: str
) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # asserted by the test, in its own thread
            errors.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread, errors


def _answered_by(context: WorkerContext, batch: BatchJob, provider: dict[str, Any]) -> None:
    """Every item waits on ``provider`` (and only it), each named in it once."""
    runs = [json.loads(r) for r in context.store.economy_all(batch.id, ECONOMY_RUNS_KEY).values()]
    assert {r["provider"] for r in runs} == {provider["id"]}
    assert {r["submission"] for r in runs} == {economy.submission_of(provider["custom_ids"][0])}
    assert sorted(economy.position_of(c) for c in provider["custom_ids"]) == [0, 1]


def test_a_run_taken_over_before_its_upload_never_makes_its_batch_after_all(
    context: WorkerContext, model: FakeAnthropic, workers: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Run 1 writes its create down and stalls before its body goes out, past its heartbeat
    and past the doubt window: run 2 takes the submission over, finds no batch made, and
    sends the items; then gives the lease back as it ends. Run 1, resumed, must not make its
    batch after all (two provider batches, paid twice): it finds its lease gone and stops
    the upload short, though nobody holds the lease by then."""
    batch, qids = _prepared(context, 2)
    client = context.batches
    assert client is not None
    create, stall = client.create, Stall()

    def stalled(*args: Any, **kwargs: Any) -> Any:
        stall()
        return create(*args, **kwargs)

    monkeypatch.setattr(client, "create", stalled)
    first, errors = _in_thread(lambda: _submission(context, batch, qids, "1"), "w1")
    assert stall.reached.wait(60)
    context.store.redis.delete(WORKER_HEARTBEAT_KEY + "w1")  # judged dead: its beat lapsed
    _backdate(context.store, batch.id, economy.DOUBT_WINDOW_SECONDS + 1, marks=True)
    monkeypatch.setattr(client, "create", create)
    _submission(context, batch, qids, "2")
    [sent] = model.batches()
    stall.go.set()
    first.join(60)
    assert not errors, errors
    assert [b["id"] for b in model.batches()] == [sent["id"]]  # run 1 made none
    _answered_by(context, batch, sent)


def test_a_run_taken_over_during_its_upload_is_waited_for_and_stops_short(
    context: WorkerContext, model: FakeAnthropic, workers: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Run 1's create started longer ago than the doubt window, and its body is still going
    out (a large body, a slow link) when it stalls, a piece sent: run 2, taking over, must
    not take the create to have made nothing (its batch may yet be made, when the body's
    last piece goes), but wait the window past the last piece. Run 1, resumed, stops its
    upload short; once the window has passed, the next run sends the items, once."""
    batch, qids = _prepared(context, 2)
    client = context.batches
    assert client is not None
    create, stall = client.create, Stall()

    def stalled(requests: Any, before_write: Callable[[], None]) -> Any:
        pieces = 0

        def guard() -> None:
            nonlocal pieces
            pieces += 1
            if pieces == 2:  # its first piece gone out, the last not yet
                stall()
            before_write()

        return create(requests, before_write=guard)

    monkeypatch.setattr(client, "create", stalled)
    first, errors = _in_thread(lambda: _submission(context, batch, qids, "1"), "w1")
    assert stall.reached.wait(60)
    context.store.redis.delete(WORKER_HEARTBEAT_KEY + "w1")
    _backdate(context.store, batch.id, economy.DOUBT_WINDOW_SECONDS + 1, marks=False)
    monkeypatch.setattr(client, "create", create)
    with pytest.raises(RerankAttemptError, match="may still be under way") as waited:
        _submission(context, batch, qids, "2")
    assert waited.value.retry_after is not None and waited.value.retry_after > 0
    assert model.batches() == []
    stall.go.set()
    first.join(60)
    assert not errors, errors
    assert model.batches() == []  # stopped short: the provider never had the whole body
    _backdate(context.store, batch.id, economy.DOUBT_WINDOW_SECONDS + 1, marks=True)
    _submission(context, batch, qids, "3")
    [sent] = model.batches()
    _answered_by(context, batch, sent)


def test_a_create_in_doubt_whose_upload_outlasted_the_window_finds_its_batch(
    context: WorkerContext, model: FakeAnthropic, workers: None
) -> None:
    """A create whose body took longer than the doubt window to go out, its answer then
    lost (a timeout): its batch was made when the last piece went, past the window after
    the create's start. It is looked for up to the window past that last piece, found, and
    polled as a candidate: the items are not sent a second time."""
    batch, qids = _prepared(context, 2)
    store, started = context.store, time.time() - 600
    runs = {}
    for position, qid in enumerate(qids):
        run = records.new_run(position)
        run["pending"] = {"submission": "sub", "at": started, "requests": 2, "answered": True}
        runs[qid] = json.dumps(run)
    store.economy_save(batch.id, ECONOMY_RUNS_KEY, runs)
    store.economy_save(
        batch.id, ECONOMY_STATE_KEY, {ECONOMY_SENDING_MARK + "sub": repr(time.time())}
    )
    sdk = anthropic.Anthropic(base_url=model.url, api_key="sk-ant-test")
    params = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    made = sdk.messages.batches.create(
        requests=[{"custom_id": economy.custom_id(i, "sub"), "params": params} for i in range(2)]  # type: ignore[misc]
    )
    task = _Task(context, "submit-1")
    economy.submit(task, batch, qids)  # type: ignore[arg-type]
    assert [b["id"] for b in model.batches()] == [made.id]  # nothing sent again
    waiting = [json.loads(r) for r in store.economy_all(batch.id, ECONOMY_RUNS_KEY).values()]
    assert {r["provider"] for r in waiting} == {economy.DOUBT + "sub"}
    assert [kw["args"] for _, kw in task.sent] == [[batch.id, made.id]]  # its poll


def test_a_streamed_create_sends_the_bytes_the_sdks_typed_create_would(
    model: FakeAnthropic,
) -> None:
    """The create's body goes out a piece at a time through the SDK's ``post``: it must be the
    bytes ``messages.batches.create`` sends (the SDK's JSON: UTF-8, not ``\\uXXXX``), so that
    a body that fits the provider's size limit sent by the SDK fits it sent in pieces too.
    Escaped, a request of non-ASCII text took up to three times its bytes (an emoji's 4 bytes
    as 12): this one was refused (413) at the limit the SDK's own body fits exactly."""
    seen: list[bytes] = []

    def record(request: Any) -> None:
        seen.append(request.read())

    params = {"model": MODEL, "max_tokens": 16,
              "messages": [{"role": "user", "content": "café, 日本の火山灰 😀 " * 40}]}  # fmt: skip
    requests = [{"custom_id": f"i{i}-abcdefabcdef", "params": params} for i in range(3)]
    hooked = httpx2.Client(event_hooks={"request": [record]})
    with anthropic.Anthropic(
        base_url=model.url, api_key="sk-ant-test", max_retries=0, http_client=hooked
    ) as sdk:
        sdk.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    (typed,) = seen
    model.configure(batch_max_bytes=len(typed))
    with anthropic.Anthropic(base_url=model.url, api_key="sk-ant-test", max_retries=0) as plain:
        made = AnthropicMessageBatches(AnthropicReranker(MODEL, client=plain)).create(requests)
    assert made.requests == 3
    assert len(model.batches()) == 2  # the SDK's, and the streamed one: not refused


class _Tracer(trace.Tracer):
    """A tracer whose every span carries one valid, sampled context (no SDK installed)."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def start_span(self, name: str, *_: Any, **__: Any) -> trace.Span:
        self.started.append(name)
        context = trace.SpanContext(
            0x5EED, 0xB47C, is_remote=False, trace_flags=trace.TraceFlags(1)
        )
        return trace.NonRecordingSpan(context)

    def start_as_current_span(self, *_: Any, **__: Any) -> Any:
        raise NotImplementedError


class _Provider(trace.TracerProvider):
    def __init__(self) -> None:
        self.tracer = _Tracer()

    def get_tracer(self, *_: Any, **__: Any) -> trace.Tracer:
        return self.tracer


def test_a_streamed_create_sends_the_headers_the_sdks_typed_create_would(
    model: FakeAnthropic,
) -> None:
    """With OpenTelemetry on, the SDK's typed create starts its span and sends its trace
    context (``traceparent``); a ``post`` that names no span had neither: the create, the one
    Message Batches call that costs, went untraced. Every header the typed create sends,
    the streamed one sends (the body's length aside, which the other test checks)."""
    heads: list[dict[str, str]] = []
    provider = _Provider()
    hooked = httpx2.Client(event_hooks={"request": [lambda r: heads.append(dict(r.headers))]})
    params = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    requests = [{"custom_id": f"i{i}-abcdefabcdef", "params": params} for i in range(2)]
    with anthropic.Anthropic(
        base_url=model.url,
        api_key="sk-ant-test",
        max_retries=0,
        http_client=hooked,
        open_telemetry={"tracer_provider": provider},
    ) as sdk:
        sdk.messages.batches.create(requests=requests, timeout=CALL_TIMEOUT_SECONDS)  # type: ignore[arg-type]
        AnthropicMessageBatches(AnthropicReranker(MODEL, client=sdk)).create(requests)
    typed, streamed = ({k: v for k, v in h.items() if k != "content-length"} for h in heads)
    assert typed["traceparent"].startswith("00-")
    assert streamed == typed
    assert provider.tracer.started == ["anthropic.messages.batches.create"] * 2


def test_a_submission_run_again_after_a_cancel_leaves_the_items_it_sent_to_their_batch(
    context: WorkerContext, model: FakeAnthropic, workers: None
) -> None:
    """A submission sent two items to a provider batch, and its run ended before it was
    marked done (its worker killed: the message is delivered again); the batch is canceled,
    then the submission runs again. The item prepared since, in no provider batch, is
    canceled at once; the two sent wait on their provider batch, whose cancel ends the
    requests not processed (``canceled``) and whose processed ones finish their items: each
    item says what happened to its request. Before, the run canceled all three at once, and
    the lines of the requests the provider had processed (and billed) were dropped."""
    batch, qids = _prepared(context, 3)
    sent_first = qids[:2]
    _submission(context, batch, sent_first, "1")
    [sent] = model.batches()
    store = context.store
    assert store.cancel_batch(batch.id) == (0, False)  # every item is running
    _submission(context, batch, qids, "2")  # its message delivered again
    statuses = dict(zip(qids, store.economy_get(batch.id, BATCH_ITEMS_KEY, qids), strict=True))
    assert statuses == {"q0": "running", "q1": "running", "q2": "canceled"}
    assert [b["id"] for b in model.batches()] == [sent["id"]]  # nothing sent again
    runs = [json.loads(r) for r in store.economy_get(batch.id, ECONOMY_RUNS_KEY, sent_first)]
    assert {r["provider"] for r in runs} == {sent["id"]}
    got = store.get_batch(batch.id)
    assert got is not None and got.finished_at is None and got.counts["canceled"] == 1


def _mapping(context: WorkerContext, batch: BatchJob, provider_id: str) -> _Task:
    """One run of a provider batch's poll that finds it ended: its results mapped (under
    its lease), any resubmission sent."""
    task = _Task(context, f"poll-{provider_id}")
    fresh = context.store.get_batch(batch.id) or batch
    leases.leased(
        task, batch.id, provider_id, lambda: economy.map_results(task, fresh, provider_id)
    )  # type: ignore[arg-type]
    return task


def _on_its_last_attempt(
    context: WorkerContext, model: FakeAnthropic
) -> tuple[BatchJob, dict[str, Any]]:
    """A batch of two whose q0 errored in its first two provider batches (ended at once), so
    that the third, still in progress (its provider batch returned), holds q0's last attempt."""
    model.script_batch({"i0": [errored("overloaded_error"), errored("overloaded_error")]})
    batch, qids = _prepared(context, 2)
    _submission(context, batch, qids, "1")
    [first] = model.batches()  # ended at once
    _mapping(context, batch, first["id"])
    [_, second] = model.batches()
    model.configure(batch_processing_seconds=300.0)  # the third stays in progress
    _mapping(context, batch, second["id"])
    [_, _, third] = model.batches()
    return batch, third


@pytest.mark.parametrize("cancel", ["before_its_mapping", "after_its_resubmission"])
def test_a_canceled_batch_s_item_whose_request_errored_is_canceled_whenever_the_cancel_came(
    context: WorkerContext, model: FakeAnthropic, workers: None, cancel: str
) -> None:
    """The provider answered q0's request ``errored`` (``overloaded_error``: retryable, not
    billed), q1's succeeded, and the user canceled the batch before q0 had its answer. Its
    request is one Sift would send again; canceled, it is not, and q0 ends ``canceled``,
    whenever the cancel came: after the poll had mapped the results and resubmitted q0 (the
    resubmission's provider batch canceled: its line ``canceled``), or before the poll got
    to them (up to its 600 s backoff after the provider batch ended). In that second order
    q0 ended ``failed`` ``rerank_failed`` (``http_5xx``): the failure policy, as if its
    attempts were spent, for a request Sift chose not to send again because of the cancel."""
    model.script_batch({"i0": [errored("overloaded_error")]})
    batch, qids = _prepared(context, 2)
    _submission(context, batch, qids, "1")
    [first] = model.batches()  # ended at once
    model.configure(batch_processing_seconds=300.0)  # a resubmission stays in progress
    store = context.store
    if cancel == "before_its_mapping":
        assert store.cancel_batch(batch.id) == (0, False)  # both wait on the provider
    task = _mapping(context, batch, first["id"])
    if cancel == "after_its_resubmission":
        [_, again] = model.batches()
        assert store.cancel_batch(batch.id) == (0, False)
        context.batches.cancel(again["id"])  # sift.economy_cancel's call
        task = _mapping(context, batch, again["id"])
    q0, q1 = store.batch_results(batch.id, 0, 2)
    assert q1.status == "succeeded", q1
    assert q0.status == "canceled", q0
    assert len(model.batches()) == (1 if cancel == "before_its_mapping" else 2)
    done = store.get_batch(batch.id)
    assert done is not None and done.finished_at is not None, done
    assert done.counts["canceled"] == 1 and done.counts["failed"] == 0, done.counts
    assert [kw["status"] for name, kw in task.sent if name == "batch.completed"] == [done.status]


def test_a_cancel_sift_sent_is_the_users_though_the_gateway_s_clock_is_ahead(
    context: WorkerContext, model: FakeAnthropic, workers: None
) -> None:
    """q0's request errored twice (``overloaded_error``), so its third is its last; the user
    cancels while it waits, and Sift cancels its provider batch (``sift.economy_cancel``),
    still in progress: its line comes back ``canceled``. The gateway's clock runs a minute
    ahead of the provider's, so the batch's ``canceled_at`` reads after the provider's
    ``ended_at``. The cancel was still the user's, Sift's reached the provider batch before
    it ended: q0 ends ``canceled``. Before, the two clocks
    were compared alone: the line was taken for a cancel made outside Sift, an ``http_5xx``
    attempt, the last, and q0 ended ``failed`` ``rerank_failed`` in a batch the user
    canceled."""
    batch, third = _on_its_last_attempt(context, model)
    store = context.store
    assert store.cancel_batch(batch.id) == (0, False)
    ahead = (store.get_batch(batch.id).canceled_at or 0.0) + 60.0  # type: ignore[union-attr]
    store.redis.hset(BATCH_KEY + batch.id, "canceled_at", repr(ahead))
    model.configure(batch_cancel_seconds=0.5)  # canceling, then ended, as the API does
    cancel_quietly(store, batch.id, context.batches, third["id"])  # sift.economy_cancel's
    for _ in range(300):
        if context.batches.retrieve(third["id"]).ended:
            break
        time.sleep(0.1)
    task = _Task(context, f"poll-{third['id']}")
    ended_at = context.batches.retrieve(third["id"]).ended_at
    fresh = store.get_batch(batch.id) or batch
    leases.leased(
        task, batch.id, third["id"],
        lambda: economy.map_results(task, fresh, third["id"], ended_at),  # type: ignore[arg-type]
    )  # fmt: skip
    q0, q1 = store.batch_results(batch.id, 0, 2)
    assert q1.status == "succeeded", q1
    assert q0.status == "canceled", q0
    assert len(model.batches()) == 3


@pytest.mark.parametrize("offset", [-300.0, 300.0])
def test_a_user_s_cancel_at_a_provider_minutes_off_is_the_user_s(
    context: WorkerContext, model: FakeAnthropic, workers: None, shared_clock: SharedClock,
    offset: float,
) -> None:  # fmt: skip
    """The provider's clock is 5 minutes off Redis's: it stamps a batch's ``ended_at`` on it,
    and dates its answers so. q0's request errored twice, so its third is its last; the
    user cancels while it waits, and Sift's cancel ends the third provider batch at once
    (its answer ``ended``: no cancel is noted as sent), which leaves the user's
    ``canceled_at`` and the provider's ``ended_at`` to say whose cancel it was. The poll
    reads ``ended_at`` moved by the offset its answer's ``Date`` shows: q0 ends ``canceled``.
    Before, 5 minutes behind, the end read 5 minutes before the user's cancel: its line was
    taken for a cancel made outside Sift, an ``http_5xx`` attempt, the last, and q0 ended
    ``failed`` in a batch the user canceled."""
    from worker.queue.economy import poll

    model.configure(clock_offset_seconds=offset)
    batch, third = _on_its_last_attempt(context, model)
    store = context.store
    assert store.cancel_batch(batch.id) == (0, False)
    assert cancel_quietly(store, batch.id, context.batches, third["id"])  # ended at once
    assert not cancel.cancel_sent(store, batch.id, third["id"])
    chain = store.redis.hget(ECONOMY_STATE_KEY + batch.id, f"chain {third['id']}")
    poll._poll(_Task(context, str(chain)), batch.id, third["id"])  # type: ignore[arg-type]
    q0, q1 = store.batch_results(batch.id, 0, 2)
    assert q1.status == "succeeded", q1
    assert q0.status == "canceled", q0


def test_a_cancel_outside_sift_at_a_provider_ahead_is_not_the_user_s(
    context: WorkerContext, model: FakeAnthropic, workers: None, shared_clock: SharedClock
) -> None:
    """The provider's clock is 5 minutes ahead of Redis's. q0's third request, its last, is
    in a provider batch someone cancels in the Console; the user cancels the batch 5 s
    later. Its line is a failed attempt (``http_5xx``, canceled outside Sift), not the
    user's cancel: q0 ends ``failed``. Before, the provider's ``ended_at``, 5 minutes ahead,
    read after the user's cancel, and q0 ended ``canceled``, its failure untold."""
    from worker.queue.economy import poll

    model.configure(clock_offset_seconds=300.0)
    batch, third = _on_its_last_attempt(context, model)
    store = context.store
    model.cancel_batch(third["id"])  # from the Console: ended at once
    assert store.cancel_batch(batch.id) == (0, False)
    later = (store.get_batch(batch.id).canceled_at or 0.0) + 5.0  # type: ignore[union-attr]
    store.redis.hset(BATCH_KEY + batch.id, "canceled_at", repr(later))
    assert cancel_quietly(store, batch.id, context.batches, third["id"])  # ended before it
    chain = store.redis.hget(ECONOMY_STATE_KEY + batch.id, f"chain {third['id']}")
    poll._poll(_Task(context, str(chain)), batch.id, third["id"])  # type: ignore[arg-type]
    q0, q1 = store.batch_results(batch.id, 0, 2)
    assert q1.status == "succeeded", q1
    assert q0.status == "failed" and "canceled outside Sift" in (q0.payload or ""), q0


def test_a_submission_with_nothing_prepared_needs_no_provider_client(
    store: JobStore, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An economy batch whose items all ended without a prompt (rerank off, or a deployment
    with no generation model, where the lane is a plain batch) sends nothing: its submission
    ends quietly. With no model it logged ERROR "submission failed for good: ... the economy
    lane needs SIFT_GENERATION_MODEL" for a batch that had succeeded."""
    context = WorkerContext(
        settings=load_settings(redis_url=redis_url),
        store=store,
        limiter=ProviderLimiter(4),
        _runtime=SimpleNamespace(economy=None),  # type: ignore[arg-type]
        _batches=None,  # no SIFT_GENERATION_MODEL
    )
    batch = store.create_batch("acme", "docs", [("q0", SPEC)], lane="economy", rerank=False)
    with caplog.at_level("WARNING"):
        sent = submission.submit(_Task(context, "submit"), batch, [])  # type: ignore[arg-type]
    assert sent == []
    assert not caplog.records, caplog.text


def test_a_canceled_provider_batch_is_polled_soon_not_at_the_poll_s_next_turn(
    context: WorkerContext, model: FakeAnthropic
) -> None:
    """The cancel of an economy batch asks the provider to cancel its provider batch, which
    ends it (``canceling``, then ``ended``); the items in it end once a poll maps its lines.
    That poll came at its chain's next turn, up to ``SIFT_ECONOMY_POLL_MAX_SECONDS`` (10
    minutes) later: the canceled batch read ``running`` all that time. The cancel now sends
    the poll again, due in a few seconds (the poll's chain goes on from it)."""
    model.configure(batch_processing_seconds=3600.0)
    store = context.store
    batch = store.create_batch("acme", "docs", [("q0", SPEC)], lane="economy")
    provider_id = _foreign_batch(model, 1)  # stands for Sift's own, in progress
    record = {"round": 1, "requests": 1, "created_at": time.time(), "submission": "sub"}
    store.economy_save(batch.id, ECONOMY_PROVIDERS_KEY, {provider_id: json.dumps(record)})
    task = _Task(context, "cancel")
    cancel.cancel_economy_batch(task, batch.id)  # type: ignore[arg-type]
    assert [b["status"] for b in model.batches()] != ["in_progress"]  # canceled there
    polls = [kw for name, kw in task.sent if name == ECONOMY_POLL_TASK]
    assert [p["args"] for p in polls] == [[batch.id, provider_id]], task.sent
    assert 0 < polls[0]["countdown"] <= cancel.CANCELED_POLL_SECONDS, polls


def test_a_provider_batch_the_submission_cancels_for_a_cancel_during_its_create_is_polled_soon(
    context: WorkerContext, model: FakeAnthropic, workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch is canceled while its submission's create runs (the submission read it
    before the cancel, and the cancel's ``sift.economy_cancel`` found no provider batch
    recorded yet): the submission cancels the provider batch it made, and sends its poll
    again due in a few seconds, as that task does, so the items end once their canceled
    lines are mapped. Before, the poll stayed at its first turn (``SIFT_ECONOMY_POLL_SECONDS``,
    30 s): the canceled batch read ``running`` 30 s on the real stack, where a cancel coming
    after the create is polled at 5 s."""
    model.configure(batch_processing_seconds=3600.0)
    batch, qids = _prepared(context, 2)
    task = _Task(context, "submit")
    _cancel_during_the_first_create(context, batch, monkeypatch)
    leases.leased(task, batch.id, economy.SUBMIT_CLAIM, lambda: economy.submit(task, batch, qids))  # type: ignore[arg-type]
    [made] = model.batches()
    assert made["status"] != "in_progress"  # canceled there
    polls = [kw for name, kw in task.sent if name == ECONOMY_POLL_TASK]
    assert [p["args"] for p in polls][-1] == [batch.id, made["id"]], task.sent
    assert 0 < polls[-1]["countdown"] <= cancel.CANCELED_POLL_SECONDS, polls


def _cancel_during_the_first_create(
    context: WorkerContext, batch: BatchJob, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's cancel lands while the submission's first create goes out (as its body's
    first piece is written: the provider makes that batch), after the submission read the
    batch and after ``sift.economy_cancel`` found no provider batch recorded."""
    guard = submission.upload_guard

    def cancelling(*args: Any) -> Callable[[], None]:
        renew = guard(*args)

        def before_write() -> None:
            if context.store.get_batch(batch.id).canceled_at is None:  # type: ignore[union-attr]
                assert context.store.cancel_batch(batch.id) == (0, False)  # every item running
            renew()

        return before_write

    monkeypatch.setattr(submission, "upload_guard", cancelling)


def test_a_cancel_during_a_submission_s_create_sends_none_of_its_later_provider_batches(
    context: WorkerContext, model: FakeAnthropic, workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submission of three provider batches (one request each) whose batch is canceled
    while its first create goes out: that one, made, is canceled at the provider and its item
    waits on its canceled line; the two items not sent yet are canceled at once, never sent.
    Before, the submission went on to create the other two provider batches after the
    cancel, canceling them only once every create was made: the provider ran (and billed)
    what it processed of requests the user had canceled before they were sent."""
    model.configure(batch_processing_seconds=3600.0)
    context.settings = context.settings.model_copy(update={"economy_max_requests_per_batch": 1})
    batch, qids = _prepared(context, 3)
    _cancel_during_the_first_create(context, batch, monkeypatch)
    _submission(context, batch, qids, "1")
    [made] = model.batches()  # the first only
    assert made["status"] != "in_progress"  # canceled there
    statuses = context.store.economy_get(batch.id, BATCH_ITEMS_KEY, qids)
    assert statuses == ["running", "canceled", "canceled"]
    got = context.store.get_batch(batch.id)
    assert got is not None and got.finished_at is None and got.counts["canceled"] == 2


def test_a_cancel_runs_a_submission_waiting_to_retry_its_create_at_once(
    context: WorkerContext, workers: None
) -> None:
    """The batch's submission failed its create (a provider outage) and waits for its retry,
    due at the poll's cadence (up to ``SIFT_ECONOMY_POLL_MAX_SECONDS``, 10 minutes); then the
    user cancels. The cancel's task sends the submission anew, due now, and that run cancels
    the items it had to send: the batch ends ``canceled`` at once. Before, the task found no
    provider batch to cancel and did nothing: the batch read ``running`` until the retry
    came (19 s on the real stack with a 20 s cadence)."""
    batch, qids = _prepared(context, 2)
    store = context.store
    store.economy_expect(batch.id, economy.SUBMIT_CLAIM, time.time() + 600)  # its retry's
    assert store.cancel_batch(batch.id) == (0, False)  # every item running
    task = _Task(context, "cancel")
    cancel.cancel_economy_batch(task, batch.id)  # type: ignore[arg-type]
    [(name, sent)] = task.sent
    assert (name, sent["args"], sent["countdown"]) == (ECONOMY_SUBMIT_TASK, [batch.id], None)
    _submission(context, batch, qids, "again")
    got = store.get_batch(batch.id)
    assert got is not None and got.status.value == "canceled", got
    assert got.counts["canceled"] == 2


def test_a_create_failing_after_a_cancel_is_tried_again_at_once(
    context: WorkerContext, model: FakeAnthropic, workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user cancels while the submission's create goes out, and the create fails (a
    529): the submission is tried again at once, to cancel its items, not at the poll's
    cadence (the cancel's task found it running, so left it to its run)."""
    model.script_batch_calls("create", [status(529)])
    batch, _ = _prepared(context, 2)
    _cancel_during_the_first_create(context, batch, monkeypatch)
    task = _Task(context, "submit")
    retries: list[dict[str, Any]] = []

    def retry(**kwargs: Any) -> None:
        retries.append(kwargs)
        raise kwargs["exc"]

    task.retry = retry  # type: ignore[method-assign]
    with pytest.raises(RerankAttemptError):
        leases.leased(
            task, batch.id, economy.SUBMIT_CLAIM, lambda: submission._submit(task, batch.id)
        )  # type: ignore[arg-type]
    assert [r["countdown"] for r in retries] == [0.0]


def _backend_down(context: WorkerContext, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The index's backend failing every read of stored documents (an outage while the
    provider batch ran); answers the calls it refused."""
    refused: list[int] = []

    def down(*args: Any, **kwargs: Any) -> Any:
        refused.append(1)
        raise BackendUnavailable("the backend is down")

    backend = context.runtime.economy.backend  # type: ignore[attr-defined]
    monkeypatch.setattr(backend, "stored_documents", down)
    return refused


def test_a_mapping_whose_backend_fails_leaves_its_items_to_the_poll_run_again(
    context: WorkerContext, model: FakeAnthropic, workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An item finishes on its candidates as stored then (one read of the backend): the
    read failing raises out of the mapping, the items still running, so the poll runs again
    (``_poll`` retries on a BackendError) and finishes them once the backend is back."""
    batch, qids = _prepared(context, 2)
    _submission(context, batch, qids, "1")
    [first] = model.batches()
    refused = _backend_down(context, monkeypatch)
    with pytest.raises(BackendUnavailable):
        _mapping(context, batch, first["id"])
    assert refused
    assert [r.status for r in context.store.batch_results(batch.id, 0, 2)] == ["running"] * 2
    monkeypatch.undo()
    _mapping(context, batch, first["id"])
    done = context.store.get_batch(batch.id)
    assert done is not None and done.counts["succeeded"] == 2, done


def test_items_the_failure_policy_ends_end_though_the_backend_fails(
    context: WorkerContext, model: FakeAnthropic, workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a poll gave up (its watch met: nothing runs it again), the failure policy ends
    the items waiting on it; the read of their candidates failing ends them ``failed`` with
    that error (with the usage billed), never leaves them running for good."""
    batch, qids = _prepared(context, 2)
    _backend_down(context, monkeypatch)
    task = _Task(context, "poll-gave-up")
    failure = RerankAttemptError(AttemptOutcome.TIMEOUT, "the provider batch expired")
    fail_items(task, batch, qids, failure)  # type: ignore[arg-type]
    results = context.store.batch_results(batch.id, 0, 2)
    assert [r.status for r in results] == ["failed", "failed"], results
    assert all('"backend_unavailable"' in (r.payload or "") for r in results), results


class _Retried(Exception):
    pass


def test_a_poll_whose_backend_fails_mapping_is_retried_not_failed(
    context: WorkerContext, model: FakeAnthropic, workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poll of an ended provider batch whose mapping meets the backend down retries
    (its watch kept expecting it): the task failed, and its items waited for the watch's
    re-wake, minutes later, logged as a task error."""
    from worker.queue.economy import poll

    batch, qids = _prepared(context, 2)
    _submission(context, batch, qids, "1")
    [first] = model.batches()
    _backend_down(context, monkeypatch)
    chain = context.store.redis.hget(ECONOMY_STATE_KEY + batch.id, f"chain {first['id']}")
    task = _Task(context, str(chain))  # the poll message the submission sent
    retried: list[dict[str, Any]] = []

    def retry(**kwargs: Any) -> None:
        retried.append(kwargs)
        raise _Retried

    task.retry = retry  # type: ignore[method-assign]
    with pytest.raises(_Retried):
        poll._poll(task, batch.id, first["id"])  # type: ignore[arg-type]
    assert retried and retried[0]["countdown"] > 0
    assert [r.status for r in context.store.batch_results(batch.id, 0, 2)] == ["running"] * 2


def test_a_poll_whose_backend_fails_mapping_past_its_give_up_ends_the_items_failed(
    context: WorkerContext, model: FakeAnthropic, workers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend failing every read of the items' candidates until the poll's give-up (the
    economy deadline and the provider's 24 hours past it, as a provider error's): the poll
    is not sent again, its items end ``failed`` with the backend's error and their billed
    usage, and the batch completes. Before, a backend failing for good (a request it
    refuses) was retried at the poll's cadence for ever, the batch ``running``."""
    from worker.queue.economy import poll

    batch, qids = _prepared(context, 2)
    _submission(context, batch, qids, "1")
    [first] = model.batches()
    _backend_down(context, monkeypatch)
    past = batch.created_at + context.settings.economy_deadline_seconds
    past += poll.PROVIDER_EXPIRY_SECONDS + 60
    monkeypatch.setattr(clock, "now", lambda: past)
    chain = context.store.redis.hget(ECONOMY_STATE_KEY + batch.id, f"chain {first['id']}")
    task = _Task(context, str(chain))
    poll._poll(task, batch.id, first["id"])  # type: ignore[arg-type]
    results = context.store.batch_results(batch.id, 0, 2)
    assert [r.status for r in results] == ["failed", "failed"], results
    errors = [json.loads(r.to_json())["error"] for r in results]
    assert {e["type"] for e in errors} == {"backend_unavailable"}, errors
    assert all(e["usage"]["requests"] == 1 for e in errors), errors  # the answers billed
    done = context.store.get_batch(batch.id)
    assert done is not None and done.finished_at is not None, done
    assert task.sent == [("batch.completed", {"id": batch.id, "status": "succeeded"})]


def test_a_removed_tenants_prepared_items_are_not_sent(
    context: WorkerContext, model: FakeAnthropic, redis_url: str
) -> None:
    """Items a worker prepared (their prompts waiting for the submission) of a tenant then
    removed, the workers restarted with the other tenants' keys alone: the submission sends
    nothing (no provider batch, nothing billed) and ends the items ``failed``
    ``tenant_removed`` (not the failure policy: a ``fail_open`` fallback would serve a tenant
    that no longer exists), completing the batch. Before, their prompts went to the provider."""
    batch, qids = _prepared(context, 3)
    removed = WorkerContext(
        settings=load_settings(redis_url=redis_url, api_keys=[GLOBEX_KEY]),
        store=context.store,
        limiter=ProviderLimiter(4),
        _runtime=context._runtime,
        _batches=context._batches,
    )
    task = _Task(removed, "submit")
    assert submission.submit(task, batch, qids) == []  # type: ignore[arg-type]
    assert model.batches() == []
    results = context.store.batch_results(batch.id, 0, 3)
    assert [r.status for r in results] == ["failed"] * 3, results
    errors = {json.loads(r.to_json())["error"]["type"] for r in results}
    assert errors == {"tenant_removed"}, results
    done = context.store.get_batch(batch.id)
    assert done is not None and done.finished_at is not None
    assert task.sent == [("batch.completed", {"id": batch.id, "status": "succeeded"})]


def _host_time(skew: float) -> SimpleNamespace:
    """A module's ``time`` on a host whose wall clock is ``skew`` seconds off (its monotonic
    clock true, as a host with a misconfigured NTP has)."""
    return SimpleNamespace(
        time=lambda: time.time() + skew, monotonic=time.monotonic, sleep=time.sleep,
        strftime=time.strftime, gmtime=time.gmtime,
    )  # fmt: skip


@pytest.fixture
def shared_clock(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> SharedClock:
    """The process's shared clock, read from the test's Redis as a worker's beat reads it."""
    shared = SharedClock()
    shared.read(store.redis.time)
    monkeypatch.setattr(clock, "CLOCK", shared)
    return shared


def _candidates_polled(context: WorkerContext, batch: BatchJob) -> bool:
    """Whether every item waits on the candidates of its create in doubt (found, polled)."""
    runs = [json.loads(r) for r in context.store.economy_all(batch.id, ECONOMY_RUNS_KEY).values()]
    return all(str(r["provider"]).startswith(economy.DOUBT) for r in runs)


def test_a_cancel_while_a_create_is_in_doubt_looks_for_its_batch(
    context: WorkerContext, model: FakeAnthropic, workers: None
) -> None:
    """The batch is canceled while its submission waits to try again a create whose answer
    was lost (the provider made the batch). The submission, run again, cancels its items,
    and the provider batch that create made is a candidate, polled and judged. Before, the
    items were canceled unsought: that provider batch, known to nothing, ran to its end,
    every request billed, and an erase left it, the queries' text with it, at the provider."""
    model.configure(batch_processing_seconds=3600.0)
    batch, qids = _prepared(context, 2)
    model.script_batch_calls("create", [drop()])  # the batch made, its answer lost
    with pytest.raises(RerankAttemptError):
        _submission(context, batch, qids, "1")
    assert context.store.cancel_batch(batch.id) == (0, False)  # every item running
    _submission(context, batch, qids, "2")
    [made] = model.batches()
    assert _candidates_polled(context, batch)
    doubts = context.store.economy_all(batch.id, ECONOMY_PROVIDERS_KEY)
    assert list(doubts) == [made["id"]] and json.loads(doubts[made["id"]])["doubt"]
    assert context.store.economy_get(batch.id, BATCH_ITEMS_KEY, qids) == ["canceled"] * 2


@pytest.mark.parametrize("skew", [-300.0, -150.0, 150.0])
def test_a_create_in_doubt_made_on_a_host_minutes_off_is_found(
    context: WorkerContext, model: FakeAnthropic, workers: None, shared_clock: SharedClock,
    monkeypatch: pytest.MonkeyPatch, skew: float,
) -> None:  # fmt: skip
    """A create made by a worker whose wall clock is ``skew`` seconds off, its answer lost
    (the connection cut after the provider made the batch); the next run, on a worker with
    a true clock, looks for it and finds it: its items wait on it, and nothing is sent
    again. Before, the window it looked in was the first worker's clock's (the create's
    start and its last piece), the provider's ``created_at`` its own: past the 120 s
    window, the batch was not found, and the items were sent again, paid twice."""
    batch, qids = _prepared(context, 2)
    model.script_batch_calls("create", [drop()])  # the batch made, its answer lost
    for module in (submission, leases, doubts):  # run 1, on the host whose clock is off
        monkeypatch.setattr(module, "time", _host_time(skew), raising=False)
    with pytest.raises(RerankAttemptError):
        _submission(context, batch, qids, "1")
    for module in (submission, leases, doubts):
        monkeypatch.setattr(module, "time", time, raising=False)
    _submission(context, batch, qids, "2")
    assert len(model.batches()) == 1, "the items were sent in a second provider batch"
    assert _candidates_polled(context, batch)


@pytest.mark.parametrize("offset", [-300.0, 300.0])
def test_a_create_in_doubt_at_a_provider_minutes_off_is_found(
    context: WorkerContext, model: FakeAnthropic, workers: None, shared_clock: SharedClock,
    offset: float,
) -> None:  # fmt: skip
    """The provider's clock is 5 minutes off the workers' and Redis's: it stamps its batches'
    ``created_at`` on it, and dates its answers so. A create in doubt is looked for in the
    window moved by the offset its answers' ``Date`` shows, and found. Before, the window
    was on Sift's clock alone: the batch, 5 minutes away, was not found, and the items were
    sent again, paid twice."""
    model.configure(clock_offset_seconds=offset)
    batch, qids = _prepared(context, 2)
    model.script_batch_calls("create", [drop()])  # the batch made, its answer lost
    with pytest.raises(RerankAttemptError):
        _submission(context, batch, qids, "1")
    _submission(context, batch, qids, "2")
    assert len(model.batches()) == 1, "the items were sent in a second provider batch"
    assert _candidates_polled(context, batch)
