"""The pipeline through bootstrap with fakes: rerank outcomes, failure policies, usage, trace."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes import (
    USAGE,
    BusySlots,
    FakeClock,
    FakeEmbedder,
    InMemoryBackend,
    RecordingRecorder,
    ScriptedReranker,
    fail,
    reply,
)
from worker.adapters.anthropic import RerankMalformedError
from worker.contract import DocumentIn, SearchSpec, Usage
from worker.core.pipeline import SearchPipeline
from worker.core.types import TokenUsage
from worker.errors import (
    AttemptOutcome,
    Canceled,
    ConfigError,
    EmbeddingModelMismatch,
    RerankAttemptError,
    RerankFailed,
    RunTakenOver,
)
from worker.runtime.bootstrap import build_pipeline
from worker.runtime.inprocess import Runtime
from worker.settings import load_settings

TOPICS = [
    "apple orchard harvest",
    "river delta flooding",
    "volcano eruption ash",
    "chess opening theory",
    "jazz saxophone solo",
    "glacier retreat climate",
]


def make(
    steps: list[Any] | None = None,
    policy: str = "fail_closed",
    clock: FakeClock | None = None,
    **settings: Any,
) -> tuple[SearchPipeline, ScriptedReranker | None, RecordingRecorder]:
    clock = clock or FakeClock()
    config = load_settings(
        rerank_enabled=steps is not None,
        generation_model="anthropic:claude-haiku-4-5" if steps is not None else None,
        rerank_failure_policy=policy,
        search_deadline_seconds=10,
        generation_timeout_seconds=4,
        generation_max_requests=3,
        **settings,
    )
    reranker = ScriptedReranker(steps) if steps is not None else None
    recorder = RecordingRecorder()
    pipeline = build_pipeline(
        config,
        backend=InMemoryBackend(),
        embedder=FakeEmbedder(),
        reranker=reranker,
        recorder=recorder,
        clock=clock,
        sleep=clock.sleep,
    )
    runtime = Runtime(pipeline)
    for tenant in ("acme", "globex"):
        docs = [
            DocumentIn(
                id=f"{tenant}-{i}",
                title=topic.split()[0],
                text=f"{topic} notes {tenant}",
                metadata={"lang": "en" if i % 2 else "de"},
            )
            for i, topic in enumerate(TOPICS * 6)
        ]
        runtime.ingest("docs", tenant, docs)
    return pipeline, reranker, recorder


def with_busy_slots(
    made: SearchPipeline, recorder: RecordingRecorder, clock: FakeClock, wait: float = 25.0
) -> SearchPipeline:
    """:func:`make`'s pipeline again, its CPU slots all held by others: one is had only after
    ``wait`` seconds (:class:`BusySlots`)."""
    return SearchPipeline(
        made.backend, made.embedder, made.reranker, made.config, recorder,
        clock=clock, sleep=clock.sleep, cpu_slots=BusySlots(clock, wait),
        index_settings=made.index_settings,
    )  # fmt: skip


def spec(**kw: Any) -> SearchSpec:
    return SearchSpec(**{"index": "docs", "query": "volcano ash eruption", "limit": 5, **kw})


def test_no_reranker_returns_the_fused_top_k() -> None:
    pipeline, _, recorder = make()
    result = pipeline.search(spec(), "acme")
    assert len(result.hits) == 5
    assert [h.ranks.final for h in result.hits] == [1, 2, 3, 4, 5]
    assert [h.ranks.rrf for h in result.hits] == [1, 2, 3, 4, 5]
    assert result.rerank.applied is False and result.rerank.fallback_reason is None
    assert result.usage.requests == 0
    assert all(h.id.startswith("acme-") for h in result.hits)
    assert recorder.events["search", "ok"] == 1


def test_applied_rerank_keeps_the_models_order_and_never_pads() -> None:
    pipeline, reranker, recorder = make([reply([3, 3, 0, 1, 99])])
    result = pipeline.search(spec(include_trace=True), "acme")
    assert reranker is not None and len(reranker.calls) == 1
    prompt, _ = reranker.calls[0]
    assert prompt.candidate_count == 30  # coarse_limit = max(5, 30)
    assert [h.ranks.rrf for h in result.hits] == [3, 1]
    assert [h.ranks.final for h in result.hits] == [1, 2]
    assert result.rerank.applied and result.rerank.policy == "listwise.v2"
    trace = result.trace
    assert trace is not None
    assert trace["kept_positions"] == [3, 1]
    assert [d["reason"] for d in trace["dropped_positions"]] == [
        "duplicate",
        "out_of_range",
        "out_of_range",
    ]
    assert len(trace["candidates"]) == 30 and trace["channel_window"] == 120
    assert recorder.events["outcome", "applied"] == 1 and recorder.events["attempt", "ok"] == 1


@pytest.mark.parametrize("rerank", [True, False])
def test_a_trace_shows_each_candidate_s_text_as_far_as_the_prompt_does(rerank: bool) -> None:
    """A trace listed each candidate's document whole: 200 candidates of 100,000 characters
    made one trace of 20 MB, which admission priced at 4 kB (review rev23b). A candidate's
    text is cut where the prompt cuts it for the model (``SIFT_RERANK_CANDIDATE_MAX_CHARS``),
    the search reranked or not; its hits carry their texts whole."""
    pipeline, _, _ = make([reply([2, 1])], rerank_candidate_max_chars=50)
    text = "volcano ash eruption " * 100
    documents = [DocumentIn(id=f"d{i}", title="t", text=text) for i in range(8)]
    Runtime(pipeline).ingest("long", "acme", documents)
    result = pipeline.search(spec(index="long", include_trace=True, rerank=rerank), "acme")
    assert result.trace is not None
    candidates = result.trace["candidates"]
    assert len(candidates) == (8 if rerank else 5)  # the index's 8 for the model, or 5 hits
    assert [c["text"] for c in candidates] == [text[:50]] * len(candidates)
    assert [c["truncated"] for c in candidates] == [rerank] * len(candidates)  # by the prompt
    assert result.trace["candidate_max_chars"] == 50
    assert result.hits and all(hit.text == text for hit in result.hits)


def test_before_model_runs_just_before_the_model_call_and_can_stop_the_search() -> None:
    pipeline, reranker, recorder = make([reply([1])])
    checks: list[int] = []

    def cancel(_: object) -> None:
        assert reranker is not None
        checks.append(len(reranker.calls))  # retrieval is done, the model not yet called
        raise Canceled("the batch was canceled")

    with pytest.raises(Canceled):
        pipeline.search(spec(), "acme", before_model=cancel)
    assert checks == [0] and reranker is not None and reranker.calls == []
    assert ("search", "error") not in recorder.events  # stopped, not failed
    result = pipeline.search(spec(), "acme", before_model=lambda _: checks.append(-1))
    assert result.rerank.applied and checks == [0, -1] and len(reranker.calls) == 1


def test_before_model_runs_again_before_each_retry_with_what_was_billed() -> None:
    """A batch canceled while its item waits out a back-off (a 429's retry-after, a malformed
    answer's retry) stops the item before its next call, which it had not: the check ran
    once, before the first attempt, and the retries went on for a canceled batch. Each check
    after the first is handed what the run was billed so far, for the canceled record."""
    billed = TokenUsage(input_tokens=120, output_tokens=7)
    steps = [
        fail(RerankAttemptError(AttemptOutcome.RATE_LIMITED, "429", retry_after=1)),
        fail(RerankMalformedError("bad json", usage=billed, model="claude-haiku-4-5")),
        reply([2]),
    ]
    pipeline, reranker, recorder = make(steps)
    seen: list[tuple[int, Usage | None]] = []

    def cancel_on_the_third(usage: Usage | None) -> None:
        assert reranker is not None
        seen.append((len(reranker.calls), usage))
        if len(seen) == 3:
            raise Canceled("the batch was canceled")

    with pytest.raises(Canceled):
        pipeline.search(spec(), "acme", before_model=cancel_on_the_third)
    assert reranker is not None and len(reranker.calls) == 2  # the third never sent
    assert [calls for calls, _ in seen] == [0, 1, 2]
    assert seen[0][1] is None and seen[1][1] is not None and seen[1][1].input_tokens == 0
    assert seen[2][1] is not None
    assert (seen[2][1].requests, seen[2][1].input_tokens, seen[2][1].output_tokens) == (2, 120, 7)
    assert ("search", "error") not in recorder.events  # stopped, not failed


def test_before_model_is_not_run_when_no_model_call_is_needed() -> None:
    pipeline, _, _ = make()
    called: list[bool] = []
    assert pipeline.search(spec(), "acme", before_model=lambda _: called.append(True)).hits
    assert called == []


def test_first_stage_ranks_and_scores_survive_the_rerank() -> None:
    pipeline, _, _ = make([reply([2, 1])])
    coarse = {h.id: h for h in make()[0].search(spec(limit=30), "acme").hits}
    result = pipeline.search(spec(), "acme")
    for hit in result.hits:
        assert hit.ranks.rrf == coarse[hit.id].ranks.rrf
        assert hit.scores == coarse[hit.id].scores


def test_no_valid_ranks_falls_back_to_coarse_top_k() -> None:
    pipeline, _, recorder = make([reply([0, -2, 31, 31])])
    result = pipeline.search(spec(), "acme")
    assert [h.ranks.rrf for h in result.hits] == [1, 2, 3, 4, 5]
    assert result.rerank.applied is False
    assert result.rerank.fallback_reason == "no_valid_ranks"
    assert recorder.events["outcome", "fallback_no_valid_ranks"] == 1
    assert recorder.events["attempt", "ok"] == 1  # a valid answer is not malformed


CLASSES = [
    AttemptOutcome.TIMEOUT,
    AttemptOutcome.HTTP_5XX,
    AttemptOutcome.RATE_LIMITED,
    AttemptOutcome.CONNECTION,
    AttemptOutcome.MALFORMED,
]


@pytest.mark.parametrize("outcome", CLASSES)
def test_fail_closed_fails_the_search_naming_the_class(outcome: AttemptOutcome) -> None:
    steps = [fail(RerankAttemptError(outcome, "scripted"))] * 3
    pipeline, reranker, recorder = make(steps)
    with pytest.raises(RerankFailed) as info:
        pipeline.search(spec(), "acme")
    assert info.value.reason == outcome.value
    assert reranker is not None and len(reranker.calls) == 3
    assert recorder.events["attempt", outcome.value] == 3
    assert sum(n for (kind, _), n in recorder.events.items() if kind == "attempt") == 3
    assert recorder.events["outcome", "failed"] == 1
    assert recorder.events["search", "error"] == 1


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_a_failed_rerank_s_trace_calls_a_fallback_one_only_when_one_was_served(
    policy: str,
) -> None:
    """Under ``fail_closed`` no fallback is served: the failed job's ``error.trace`` said
    ``fallback_reason: "error:http_5xx"`` all the same. It names the ``failure`` now, its
    ``fallback_reason`` null; under ``fail_open`` the fallback's reason stands, no failure."""
    steps = [fail(RerankAttemptError(AttemptOutcome.HTTP_5XX, "scripted"))] * 3
    pipeline, _, _ = make(steps, policy=policy)
    if policy == "fail_closed":
        with pytest.raises(RerankFailed) as info:
            pipeline.search(spec(include_trace=True), "acme")
        trace = info.value.job_trace
    else:
        trace = pipeline.search(spec(include_trace=True), "acme").trace
    assert trace is not None
    if policy == "fail_closed":
        assert (trace["fallback_reason"], trace["failure"]) == (None, "http_5xx"), trace
    else:
        assert trace["fallback_reason"] == "error:http_5xx" and "failure" not in trace, trace


@pytest.mark.parametrize("outcome", [*CLASSES, AttemptOutcome.HTTP_4XX])
def test_fail_open_returns_coarse_top_k_with_the_reason(outcome: AttemptOutcome) -> None:
    steps = [fail(RerankAttemptError(outcome, "scripted"))] * 3
    pipeline, reranker, recorder = make(steps, policy="fail_open")
    backend = pipeline.backend
    assert isinstance(backend, InMemoryBackend)
    result = pipeline.search(spec(), "acme")
    assert [h.ranks.rrf for h in result.hits] == [1, 2, 3, 4, 5]
    assert result.rerank.applied is False
    assert result.rerank.fallback_reason == f"error:{outcome.value}"
    assert len(backend.calls) == 1  # never a second query
    expected_calls = 1 if outcome is AttemptOutcome.HTTP_4XX else 3
    assert reranker is not None and len(reranker.calls) == expected_calls
    assert recorder.events["attempt", outcome.value] == expected_calls
    assert recorder.events["outcome", "fallback_error"] == 1


def test_each_attempt_is_counted_once_in_its_class() -> None:
    steps = [
        fail(RerankAttemptError(AttemptOutcome.RATE_LIMITED, "429", retry_after=1)),
        fail(RerankAttemptError(AttemptOutcome.MALFORMED, "bad json")),
        reply([2]),
    ]
    pipeline, _, recorder = make(steps)
    result = pipeline.search(spec(include_trace=True), "acme")
    attempts = {k[1]: n for k, n in recorder.events.items() if k[0] == "attempt"}
    assert attempts == {"rate_limited": 1, "malformed": 1, "ok": 1}
    assert result.trace is not None
    assert [a["outcome"] for a in result.trace["attempts"]] == ["rate_limited", "malformed", "ok"]
    assert result.usage.requests == 3


def test_slow_model_never_pushes_the_search_past_its_deadline() -> None:
    clock = FakeClock()
    steps = [fail(RerankAttemptError(AttemptOutcome.TIMEOUT, "slow"), clock, takes=4.0)] * 5
    pipeline, reranker, _ = make(steps, policy="fail_open", clock=clock)
    start = clock.now
    result = pipeline.search(spec(), "acme")
    assert clock.now - start <= 10.0
    assert result.rerank.fallback_reason == "error:timeout"
    assert reranker is not None
    assert all(timeout <= 4.0 for _, timeout in reranker.calls)


def test_a_search_s_deadline_starts_once_it_holds_its_cpu_slot() -> None:
    # A standard batch's chunk puts its items on the item pool at once, and they queue for
    # the CPU slots: that wait is a queue's, as the wait before the task is, not the
    # search's. Charged to the deadline (10 s here), a 25 s wait left no time for the model.
    clock = FakeClock()
    made, reranker, recorder = make([reply([0, 1])], clock=clock)
    pipeline = with_busy_slots(made, recorder, clock)
    result = pipeline.search(spec(), "acme")
    assert result.rerank.applied and result.rerank.fallback_reason is None
    assert reranker is not None and len(reranker.calls) == 1
    assert recorder.events["search", "ok"] == 1


class _SlotKeeper:
    """An answer keeper noting when the run is told it holds its CPU slot (the clock then)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.held: list[tuple[float, float, float]] = []  # (waited, ran, the clock when told)

    def saved(self) -> None:
        return None

    def save(self, answer: Any) -> None:
        return None

    def slot_held(self, waited: float, ran: float = 0.0) -> None:
        self.held.append((waited, ran, self.clock.now))

    def later(self, figures: Any) -> None:
        for record in figures:
            record()


def test_a_search_tells_its_answer_keeper_once_it_holds_its_cpu_slot() -> None:
    # The run claim (the queue's keeper) was taken before the slot's wait, with a lease of
    # one deadline: the keeper is told how long that wait was, once the slot is held and
    # before the deadline starts, so the claim starts there as the deadline does.
    clock = FakeClock()
    made, _, recorder = make([reply([0, 1])], clock=clock)
    pipeline = with_busy_slots(made, recorder, clock)
    keeper = _SlotKeeper(clock)
    asked = clock.now
    result = pipeline.search(spec(), "acme", answers=keeper)
    assert result.rerank.applied and keeper.held == [(25.0, 0.0, asked + 25.0)]


class _TakenOverKeeper(_SlotKeeper):
    """The keeper of a run whose claim a copy of its message took over during the wait."""

    def slot_held(self, waited: float, ran: float = 0.0) -> None:
        super().slot_held(waited, ran)
        raise RunTakenOver("another run took its claim over")


def test_a_run_whose_claim_was_taken_over_during_its_slot_wait_stops_before_its_search() -> None:
    # The copy holding the claim makes the search's model call and records its figures: this
    # run neither retrieves, nor calls the model, nor counts a search (ok or error).
    clock = FakeClock()
    made, reranker, recorder = make([reply([0, 1])], clock=clock)
    assert isinstance(made.backend, InMemoryBackend)
    pipeline = with_busy_slots(made, recorder, clock)
    keeper = _TakenOverKeeper(clock)
    with pytest.raises(RunTakenOver):
        pipeline.search(spec(), "acme", answers=keeper)
    assert keeper.held and made.backend.calls == [] and reranker is not None
    assert reranker.calls == [] and not recorder.events, recorder.events


class _Killed(BaseException):
    """The worker process dying mid-call (SIGKILL): nothing after it runs."""


class _KeepingKeeper(_SlotKeeper):
    """A keeper holding what its run saved, as the run claim does in Redis."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.kept: Any = None

    def saved(self) -> Any:
        return self.kept

    def save(self, answer: Any) -> None:
        self.kept = answer


def test_a_billed_attempt_is_kept_before_its_retry_and_shown_by_the_run_after_a_crash() -> None:
    # The first attempt answers malformed output (billed), the retry dies with its process:
    # the keeper holds the billed attempt (as shown no candidates), so the next run calls again
    # and shows both calls billed. Kept only once the call ended, the billed attempt was on
    # no record. A second crash after another billed attempt keeps all three.
    clock = FakeClock()

    def killed(prompt: Any, timeout: float) -> Any:
        raise _Killed

    billed = RerankMalformedError("not the schema", usage=USAGE, model="claude-haiku-4-5")
    steps = [fail(billed), killed, fail(billed), killed, reply([0, 1])]
    pipeline, reranker, _ = make(steps, clock=clock)
    keeper = _KeepingKeeper(clock)
    for crashes in (1, 2):
        with pytest.raises(_Killed):
            pipeline.search(spec(), "acme", answers=keeper)
        assert keeper.kept["shown"] is None and len(keeper.kept["attempts"]) == crashes
    result = pipeline.search(spec(), "acme", answers=keeper)
    assert result.rerank.applied and reranker is not None and len(reranker.calls) == 5
    assert result.usage.requests == 3 and result.usage.input_tokens == 3 * USAGE.input_tokens
    assert keeper.kept["shown"] is not None  # the whole run, ended: a run after it reads it


def test_a_retrieval_retry_s_wait_to_hold_a_cpu_slot_again_is_not_the_deadline_s() -> None:
    # A retrieval retry's back-off lets the slot go, and the items queued for the slots take
    # it: the wait to hold one again is that queue's too, as the first one is. Charged (25 s
    # against 10 s here), the retry never ran: deadline_exceeded before the model was asked.
    clock = FakeClock()
    made, reranker, recorder = make([reply([0, 1])], clock=clock)
    assert isinstance(made.backend, InMemoryBackend)
    made.backend.fail_next = 1  # SQLITE_BUSY, say: retryable
    pipeline = with_busy_slots(made, recorder, clock)
    result = pipeline.search(spec(), "acme")
    assert len(made.backend.calls) == 2  # the failure, then the retry
    assert result.rerank.applied and result.rerank.fallback_reason is None
    assert reranker is not None and len(reranker.calls) == 1
    assert recorder.events["search", "ok"] == 1


def test_a_retrieval_retry_tells_its_answer_keeper_once_it_holds_its_cpu_slot_again() -> None:
    # The run claim (leased for one deadline) counted the wait to hold a slot again after a
    # retrieval retry's back-off, which the deadline leaves out: past the lease, a copy of the
    # search's message took the claim over and made a second model call. The keeper is told
    # the wait and the time the run had run (the back-off's, its retrieval taking none here).
    clock = FakeClock()
    made, _, recorder = make([reply([0, 1])], clock=clock)
    assert isinstance(made.backend, InMemoryBackend)
    made.backend.fail_next = 1
    pipeline = with_busy_slots(made, recorder, clock)
    keeper = _SlotKeeper(clock)
    result = pipeline.search(spec(), "acme", answers=keeper)
    assert result.rerank.applied and len(made.backend.calls) == 2
    (first, again) = keeper.held
    assert first[:2] == (25.0, 0.0) and again[0] == 25.0 and 0.0 < again[1] < 1.0, keeper.held


def test_a_retried_search_runs_in_what_is_left_and_observes_only_its_own_run() -> None:
    # A task retry or redelivery passes the seconds earlier runs used: the deadline is what is
    # left of the one search's, while the latency metric takes this run's own time (the
    # earlier runs were observed when they ended; counting them again inflates the sum).
    clock = FakeClock()
    steps = [fail(RerankAttemptError(AttemptOutcome.TIMEOUT, "slow"), clock, takes=4.0)] * 5
    pipeline, reranker, recorder = make(steps, policy="fail_open", clock=clock)
    start = clock.now
    result = pipeline.search(spec(), "acme", spent=7.0)
    assert clock.now - start <= 3.0  # 10 s deadline, 7 s already spent
    assert result.rerank.fallback_reason == "error:timeout"
    assert reranker is not None and all(timeout <= 3.0 for _, timeout in reranker.calls)
    assert recorder.search_seconds == [clock.now - start]


def test_usage_and_cost_come_from_the_reported_usage() -> None:
    pipeline, _, recorder = make([reply([1])])
    result = pipeline.search(spec(), "acme")
    u = result.usage
    assert (u.requests, u.input_tokens, u.output_tokens) == (1, 1000, 40)
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens) == (200, 100)
    # claude-haiku-4-5: $1 in, $5 out, $0.10 cache read, $1.25 cache write per million
    expected = (1000 * 1.0 + 40 * 5.0 + 200 * 0.10 + 100 * 1.25) / 1e6
    assert u.cost_usd == pytest.approx(expected)
    assert recorder.cost == pytest.approx(expected)
    assert recorder.usage["input"] == USAGE.input_tokens


def test_tenant_and_filters_apply_inside_every_channel() -> None:
    pipeline, reranker, _ = make([reply(list(range(1, 31)))])
    result = pipeline.search(spec(filters={"lang": "en"}, include_trace=True), "globex")
    assert result.hits and all(h.id.startswith("globex-") for h in result.hits)
    assert all(h.metadata["lang"] == "en" for h in result.hits)
    assert result.trace is not None
    assert all(c["id"].startswith("globex-") for c in result.trace["candidates"])
    assert reranker is not None
    assert "acme" not in reranker.calls[0][0].user


def test_a_rerank_asked_of_a_worker_with_no_model_fails_as_the_deployments() -> None:
    """``rerank: true`` reaches a worker with no model only past a gateway that has one (it
    refuses the request without): the request was valid, and it failed ``invalid_request``,
    the client's fault. It is a rerank failed for good, of the class ``no_generation_model``:
    ``rerank_failed`` under ``fail_closed``, counted once as a failed rerank."""
    pipeline, _, recorder = make()
    with pytest.raises(RerankFailed) as info:
        pipeline.search(spec(rerank=True, include_trace=True), "acme")
    assert info.value.reason == "no_generation_model" and not info.value.retryable
    assert "SIFT_GENERATION_MODEL" in info.value.message
    assert info.value.job_trace is not None
    assert info.value.job_trace["failure"] == "no_generation_model"
    assert recorder.events["outcome", "failed"] == 1 and recorder.events["search", "error"] == 1


def test_a_rerank_asked_of_a_worker_with_no_model_falls_back_under_fail_open() -> None:
    pipeline, _, recorder = make(policy="fail_open")
    fused = pipeline.search(spec(rerank=False), "acme")
    result = pipeline.search(spec(rerank=True), "acme")
    assert result.rerank.applied is False and result.rerank.policy is not None
    assert result.rerank.fallback_reason == "error:no_generation_model"
    assert [h.id for h in result.hits] == [h.id for h in fused.hits]
    assert recorder.events["outcome", "fallback_error"] == 1
    assert recorder.events["search", "fallback"] == 1
    # the deployment's default (SIFT_RERANK_ENABLED, off without a model) reranks nothing
    assert pipeline.search(spec(), "acme").rerank.fallback_reason is None


def test_rerank_can_be_turned_off_per_request() -> None:
    pipeline, reranker, _ = make([reply([2])])
    result = pipeline.search(spec(rerank=False), "acme")
    assert result.rerank.applied is False and reranker is not None and reranker.calls == []


def test_backend_outage_is_retried_within_the_deadline_then_reported() -> None:
    pipeline, _, _ = make()
    backend = pipeline.backend
    assert isinstance(backend, InMemoryBackend)
    backend.fail_next = 1
    assert pipeline.search(spec(), "acme").hits  # one failure, then success
    backend.fail_next = 10
    from worker.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable):
        pipeline.search(spec(), "acme")


def test_enabling_rerank_without_a_model_is_a_start_up_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(rerank_enabled=True)
    assert "SIFT_RERANK_ENABLED" in str(info.value)
    assert "SIFT_GENERATION_MODEL" in str(info.value)


def test_a_model_with_no_price_has_an_unknown_cost_not_a_zero_one() -> None:
    pipeline, _, recorder = make([reply([1])], prices={})
    result = pipeline.search(spec(), "acme")
    assert result.usage.cost_usd is None
    assert result.usage.input_tokens == USAGE.input_tokens  # the tokens are still reported
    assert recorder.events["unpriced", "claude-haiku-4-5"] == 1
    assert result.usage.model_dump()["cost_usd"] is None  # null in the job's JSON


def test_a_priced_model_counts_no_unpriced_call() -> None:
    pipeline, _, recorder = make([reply([1])])
    pipeline.search(spec(), "acme")
    assert not [key for key in recorder.events if key[0] == "unpriced"]


def test_a_failed_rerank_reports_what_its_billed_attempts_used() -> None:
    from worker.adapters.anthropic import RerankMalformedError

    billed = RerankMalformedError("not the schema", usage=USAGE, model="claude-haiku-4-5")
    timeout = RerankAttemptError(AttemptOutcome.TIMEOUT, "slow")  # unbilled: no usage
    pipeline, _, _ = make([fail(billed), fail(timeout), fail(billed)])
    with pytest.raises(RerankFailed) as info:
        pipeline.search(spec(), "acme")
    usage = info.value.job_usage
    assert usage is not None
    assert (usage.requests, usage.input_tokens, usage.output_tokens) == (3, 2000, 80)
    one = (1000 * 1.0 + 40 * 5.0 + 200 * 0.10 + 100 * 1.25) / 1e6
    assert usage.cost_usd == pytest.approx(2 * one)


def test_an_attempt_sent_with_no_answer_read_is_counted_as_possibly_billed() -> None:
    """A timeout, or a connection lost after the request went out: the provider may have
    finished the call and billed it, but no usage was read, so no token or dollar counts it.
    It is counted apart, with its prompt's estimated input tokens (the rate budget's
    estimate; here the budget is off, so the uncorrected one). An attempt never sent, or one
    whose usage was read, is not: its bill is known."""
    from worker.core.tokens import prompt_tokens

    timeout = RerankAttemptError(AttemptOutcome.TIMEOUT, "slow")
    lost = RerankAttemptError(AttemptOutcome.CONNECTION, "reset by peer")
    unsent = RerankAttemptError(AttemptOutcome.CONNECTION, "refused", sent=False)
    pipeline, reranker, recorder = make([fail(timeout), fail(unsent), fail(lost)], "fail_open")
    assert pipeline.search(spec(), "acme").rerank.fallback_reason is not None
    assert reranker is not None and len(reranker.calls) == 3
    estimate = round(prompt_tokens(reranker.calls[0][0]))
    assert estimate > 0
    assert recorder.events["unread", "claude-haiku-4-5"] == 2
    assert recorder.unread_tokens == 2 * estimate
    billed = RerankMalformedError("not the schema", usage=USAGE, model="claude-haiku-4-5")
    answered_408 = RerankAttemptError(AttemptOutcome.TIMEOUT, "HTTP 408: request timed out")
    answered_408.status = 408  # the provider answered: it stopped the call, no answer lost
    again, _, answered = make([fail(billed), fail(answered_408), reply([1])])
    again.search(spec(), "acme")
    assert not [key for key in answered.events if key[0] == "unread"]


def test_usage_sums_to_unknown_when_any_part_is_unknown() -> None:
    from worker.contract import Usage

    assert (Usage(cost_usd=0.5) + Usage(cost_usd=0.25)).cost_usd == pytest.approx(0.75)
    assert (Usage(cost_usd=0.5) + Usage(cost_usd=None)).cost_usd is None


def test_an_unpriced_model_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    from worker.runtime.bootstrap import warn_if_unpriced

    settings = load_settings(generation_model="anthropic:claude-unlisted-9", prices={})
    with caplog.at_level("WARNING", logger="worker.runtime.bootstrap"):
        assert warn_if_unpriced(settings) and warn_if_unpriced(settings)
    warnings = [r.getMessage() for r in caplog.records if "no price" in r.getMessage()]
    assert len(warnings) == 1
    assert "claude-unlisted-9" in warnings[0] and "SIFT_PRICES" in warnings[0]
    assert not warn_if_unpriced(load_settings(generation_model="anthropic:claude-haiku-4-5"))


def test_rate_limits_of_a_model_the_worker_does_not_use_are_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A typo (``claude-haiku-45``) left the model it was meant for unmetered, silently."""
    from worker.runtime.bootstrap import warn_if_unused_rate_limits

    settings = load_settings(
        generation_model="anthropic:claude-haiku-4-5",
        rate_limits={"claude-haiku-45": {"rpm": 50}, "claude-haiku-4-5": {"economy": {"rpm": 5}}},
    )
    with caplog.at_level("WARNING", logger="worker.runtime.bootstrap"):
        assert warn_if_unused_rate_limits(settings) == ["claude-haiku-45"]
    (warning,) = [r.getMessage() for r in caplog.records if "SIFT_RATE_LIMITS" in r.getMessage()]
    assert "'claude-haiku-45'" in warning and "claude-haiku-4-5" in warning
    used = load_settings(
        generation_model="anthropic:claude-haiku-4-5",
        rate_limits={"anthropic:claude-haiku-4-5": {"rpm": 50}},
    )
    assert warn_if_unused_rate_limits(used) == []
    # no model: every limit is unused, and the warning says the worker calls none
    caplog.clear()
    with caplog.at_level("WARNING", logger="worker.runtime.bootstrap"):
        assert warn_if_unused_rate_limits(
            load_settings(rate_limits={"claude-haiku-4-5": {"rpm": 50}})
        ) == ["claude-haiku-4-5"]
    assert any("no model" in r.getMessage() for r in caplog.records)


def test_a_knn_search_of_another_models_vectors_is_refused_bm25_alone_is_served() -> None:
    """The index's vectors came from ``other-model``: a query embedded by this worker's
    model would be scored in another space. vector and hybrid fail with the typed error
    (no kNN ran, no BM25-only answer passed off as hybrid); fts serves as before."""
    pipeline, _, _ = make()
    backend = pipeline.backend
    assert isinstance(backend, InMemoryBackend)
    backend.models[("docs", "acme")] = "other-model"
    for mode in ("vector", "hybrid"):
        with pytest.raises(EmbeddingModelMismatch, match=r"'other-model'.*'fake-bow-64'"):
            pipeline.search(SearchSpec(index="docs", query="volcano ash", mode=mode), "acme")
    assert backend.calls == []  # refused before retrieval
    fts = pipeline.search(SearchSpec(index="docs", query="volcano ash", mode="fts"), "acme")
    assert fts.hits
    # a hybrid search whose kNN channel is weighted 0 compares no vectors: served
    spec = SearchSpec.model_validate(
        {"index": "docs", "query": "volcano ash", "fusion": {"weights": {"knn": 0}}}
    )
    assert pipeline.search(spec, "acme").hits
    assert pipeline.search(SearchSpec(index="docs", query="volcano ash"), "globex").hits


def test_an_ingest_of_another_models_vectors_is_refused_and_writes_nothing() -> None:
    pipeline, _, _ = make()
    backend = pipeline.backend
    assert isinstance(backend, InMemoryBackend)
    before = dict(backend.rows)
    backend.models[("docs", "acme")] = "other-model"
    with pytest.raises(EmbeddingModelMismatch):
        Runtime(pipeline).ingest("docs", "acme", [DocumentIn(id="acme-0", text="replaced")])
    assert backend.rows == before


def test_the_trace_tells_the_wait_for_a_cpu_slot_the_deadline_leaves_out() -> None:
    # The wait is no part of the deadline (a queue's), and was in no trace: a single search
    # queued behind a batch's items for its slot showed 5 ms of work in a search of 2 s.
    # A retrieval retry's wait to hold the slot again counts as well.
    clock = FakeClock()
    made, _, recorder = make([reply([0, 1])], clock=clock)
    assert isinstance(made.backend, InMemoryBackend)
    made.backend.fail_next = 1
    pipeline = with_busy_slots(made, recorder, clock, wait=3.0)
    result = pipeline.search(spec(include_trace=True), "acme")
    assert result.trace is not None and result.trace["slot_wait_seconds"] == 6.0
    prepared = with_busy_slots(made, recorder, clock, wait=2.0).prepare(spec(), "acme")
    assert prepared.trace["slot_wait_seconds"] == 2.0  # an economy item's first half
