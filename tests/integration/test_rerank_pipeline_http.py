"""The whole pipeline with the real Anthropic SDK against the fake Messages API over HTTP.

Every failure class, under both failure policies: the right counter, the right job
outcome, the right number of HTTP attempts, and the deadline held.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import pytest

from tests import fake_anthropic as fa
from tests.fakes import FakeEmbedder, InMemoryBackend, RecordingRecorder
from worker.adapters.anthropic import AnthropicReranker
from worker.contract import DocumentIn, SearchSpec
from worker.core.pipeline import SearchPipeline
from worker.core.types import RerankPrompt, RerankReply
from worker.errors import RerankFailed
from worker.runtime.bootstrap import build_pipeline, build_reranker
from worker.runtime.inprocess import Runtime
from worker.settings import load_settings

pytestmark = pytest.mark.integration

MODEL = "claude-haiku-4-5"
DEADLINE = 3.0
ATTEMPT_TIMEOUT = 0.6
# what a case whose failure is no stall runs under: an answer of the fake that a loaded
# machine delays past the stall case's 0.6 s is no timeout that case should see
ROOMY = {"deadline": 30.0, "attempt_timeout": 10.0}


@pytest.fixture(scope="module")
def server() -> Iterator[fa.FakeAnthropic]:
    with fa.FakeAnthropic() as fake:
        yield fake


@pytest.fixture
def fake(server: fa.FakeAnthropic) -> Iterator[fa.FakeAnthropic]:
    server.reset()
    server.configure(thinking_tokens=64, cache_read_input_tokens=0, cache_creation_input_tokens=0)
    yield server


@dataclass
class Asked:
    """What the pipeline asked for: each attempt's timeout, and each wait between attempts
    (waited all the same)."""

    timeouts: list[float] = field(default_factory=list)
    sleeps: list[float] = field(default_factory=list)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        time.sleep(seconds)


class TimeoutsSeen:
    """A Reranker that notes the timeout of every attempt, then passes it on."""

    def __init__(self, inner: AnthropicReranker, asked: Asked) -> None:
        self.inner, self.asked = inner, asked
        self.model, self.effort = inner.model, inner.effort

    def rerank(self, prompt: RerankPrompt, timeout_seconds: float) -> RerankReply:
        self.asked.timeouts.append(timeout_seconds)
        return self.inner.rerank(prompt, timeout_seconds)


def build(
    fake: fa.FakeAnthropic,
    policy: str,
    asked: Asked | None = None,
    *,
    deadline: float = DEADLINE,
    attempt_timeout: float = ATTEMPT_TIMEOUT,
) -> tuple[SearchPipeline, RecordingRecorder]:
    settings = load_settings(
        rerank_enabled=True,
        generation_model=f"anthropic:{MODEL}",
        rerank_failure_policy=policy,
        search_deadline_seconds=deadline,
        generation_timeout_seconds=attempt_timeout,
        generation_max_requests=3,
    )
    client = anthropic.Anthropic(base_url=fake.url, api_key="sk-test", max_retries=0)
    recorder = RecordingRecorder()
    asked = asked or Asked()
    pipeline = build_pipeline(
        settings,
        backend=InMemoryBackend(),
        embedder=FakeEmbedder(),
        reranker=TimeoutsSeen(AnthropicReranker(MODEL, client=client), asked),
        recorder=recorder,
        sleep=asked.sleep,
    )
    Runtime(pipeline).ingest(
        "docs",
        "acme",
        [
            DocumentIn(id=f"d{i}", title=f"note {i}", text=f"volcano ash report number {i}")
            for i in range(40)
        ],
    )
    return pipeline, recorder


def search(pipeline: SearchPipeline) -> Any:
    return pipeline.search(
        SearchSpec(index="docs", query="volcano ash", limit=5, include_trace=True), "acme"
    )


# (behaviours to script, attempt class, attempts expected)
FAILURES = {
    "timeout": ([fa.stall(5)] * 3, "timeout", 3),
    "http_5xx": ([fa.status(500), fa.status(529), fa.status(503)], "http_5xx", 3),
    "rate_limited": ([fa.status(429, retry_after=0.2)] * 3, "rate_limited", 3),
    "connection": ([fa.drop()] * 3, "connection", 3),
    "http_4xx": ([fa.status(400)], "http_4xx", 1),
    "malformed": (
        [fa.malformed("not json"), fa.malformed('{"positions": ["1"]}'), fa.positions([1.5])],
        "malformed",
        3,
    ),
}


@pytest.mark.parametrize("name", list(FAILURES))
def test_fail_closed_fails_with_the_class(fake: fa.FakeAnthropic, name: str) -> None:
    behaviours, result, attempts = FAILURES[name]
    fake.script(behaviours)
    asked = Asked()
    limits: dict[str, float] = {} if name == "timeout" else ROOMY
    pipeline, recorder = build(fake, "fail_closed", asked, **limits)
    with pytest.raises(RerankFailed) as info:
        search(pipeline)
    assert info.value.reason == result
    assert len(fake.requests()) == attempts
    assert recorder.events["attempt", result] == attempts
    assert sum(n for key, n in recorder.events.items() if key[0] == "attempt") == attempts
    assert recorder.events["outcome", "failed"] == 1
    # the deadline held, as far as HTTP goes: every attempt was sent with at most its share
    # of it, the waits between them fit in it (the budget's own arithmetic is checked on a
    # fake clock in tests/unit/test_budget.py), and a stalled attempt left on its timeout,
    # before the fake answered
    assert len(asked.timeouts) == attempts
    attempt_timeout = limits.get("attempt_timeout", ATTEMPT_TIMEOUT)
    assert all(0 < timeout <= attempt_timeout for timeout in asked.timeouts), asked
    search_deadline = limits.get("deadline", DEADLINE)
    assert len(asked.sleeps) == attempts - 1 and sum(asked.sleeps) < search_deadline, asked
    if name == "timeout":
        deadline = time.monotonic() + 30
        while fake.counts()["statuses"] != {"499": attempts}:  # each client left, unanswered
            assert time.monotonic() < deadline, fake.counts()
            time.sleep(0.02)


@pytest.mark.parametrize("name", list(FAILURES))
def test_fail_open_returns_the_coarse_window(fake: fa.FakeAnthropic, name: str) -> None:
    behaviours, result, attempts = FAILURES[name]
    fake.script(behaviours)
    pipeline, recorder = build(fake, "fail_open", **({} if name == "timeout" else ROOMY))
    found = search(pipeline)
    assert found.rerank.applied is False
    assert found.rerank.fallback_reason == f"error:{result}"
    assert [h.ranks.rrf for h in found.hits] == [1, 2, 3, 4, 5]
    assert [a["outcome"] for a in found.trace["attempts"]] == [result] * attempts
    assert recorder.events["outcome", "fallback_error"] == 1


def test_recovery_after_transient_failures_uses_the_third_answer(fake: fa.FakeAnthropic) -> None:
    fake.script([fa.status(529), fa.status(429, retry_after=0.1), fa.positions([4, 2, 2, 99])])
    pipeline, recorder = build(fake, "fail_closed")
    found = search(pipeline)
    assert found.rerank.applied is True
    assert [h.ranks.rrf for h in found.hits] == [4, 2]
    assert found.trace["dropped_positions"] == [
        {"value": 2, "reason": "duplicate"},
        {"value": 99, "reason": "out_of_range"},
    ]
    attempts = {key[1]: n for key, n in recorder.events.items() if key[0] == "attempt"}
    assert attempts == {"http_5xx": 1, "rate_limited": 1, "ok": 1}


@pytest.mark.parametrize(
    ("answers", "classes"),
    [
        ([fa.status(408), fa.status(409)], {"timeout": 1, "http_5xx": 1}),
        ([fa.status(400, should_retry=True)], {"http_5xx": 1}),
    ],
    ids=["408-then-409", "400-x-should-retry-true"],
)
def test_a_4xx_the_provider_says_to_retry_is_retried_in_the_standard_lane(
    fake: fa.FakeAnthropic, answers: list[fa.Behaviour], classes: dict[str, int]
) -> None:
    # the SDK's own policy retries a 408, a 409 and any answer with x-should-retry: true;
    # Sift's retries replace it, and failed the search at the first (http_4xx)
    fake.script([*answers, fa.positions([2, 1])])
    pipeline, recorder = build(fake, "fail_closed")
    found = search(pipeline)
    assert found.rerank.applied is True
    assert [h.ranks.rrf for h in found.hits][:2] == [2, 1]
    attempts = {key[1]: n for key, n in recorder.events.items() if key[0] == "attempt"}
    assert attempts == {**classes, "ok": 1}


def test_usage_and_cost_equal_what_the_fake_reported(fake: fa.FakeAnthropic) -> None:
    fake.configure(cache_read_input_tokens=500, cache_creation_input_tokens=120)
    fake.script([fa.malformed("oops"), fa.good()])
    pipeline, recorder = build(fake, "fail_closed")
    found = search(pipeline)
    reported = fake.usage()
    assert found.usage.requests == 2
    assert found.usage.input_tokens == reported["input_tokens"]
    assert found.usage.output_tokens == reported["output_tokens"]
    assert found.usage.cache_read_input_tokens == reported["cache_read_input_tokens"] == 1000
    assert found.usage.cache_creation_input_tokens == reported["cache_creation_input_tokens"]
    expected = (
        reported["input_tokens"] * 1.0
        + reported["output_tokens"] * 5.0
        + reported["cache_read_input_tokens"] * 0.10
        + reported["cache_creation_input_tokens"] * 1.25
    ) / 1e6
    assert found.usage.cost_usd == pytest.approx(expected)
    assert recorder.cost == pytest.approx(expected)


def test_no_valid_ranks_is_a_fallback_not_a_failure(fake: fa.FakeAnthropic) -> None:
    fake.script([fa.positions([0, -1, 31])])
    pipeline, recorder = build(fake, "fail_closed")
    found = search(pipeline)
    assert found.rerank.fallback_reason == "no_valid_ranks"
    assert recorder.events["attempt", "ok"] == 1
    assert recorder.events["outcome", "fallback_no_valid_ranks"] == 1


@pytest.mark.parametrize(
    ("model", "sent"), [("claude-haiku-4-5", None), ("claude-sonnet-4-6", "low")]
)
def test_the_effort_the_settings_give_each_model_is_sent_and_traced(
    fake: fa.FakeAnthropic, monkeypatch: pytest.MonkeyPatch, model: str, sent: str | None
) -> None:
    """The reranker as the worker builds it from its settings (SIFT_GENERATION_EFFORT at its
    default, auto): the README's model is sent no effort (the API refuses it), a model that
    takes it the lowest level; the search succeeds, and its trace says what was sent."""
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    settings = load_settings(rerank_enabled=True, generation_model=f"anthropic:{model}")
    reranker = build_reranker(settings)
    assert isinstance(reranker, AnthropicReranker)
    pipeline = build_pipeline(
        settings, backend=InMemoryBackend(), embedder=FakeEmbedder(), reranker=reranker
    )
    docs = [DocumentIn(id=f"d{i}", text=f"volcano ash report number {i}") for i in range(10)]
    Runtime(pipeline).ingest("docs", "acme", docs)
    try:
        result = search(pipeline)
    finally:
        reranker.close()
    assert result.rerank.applied and result.trace is not None
    assert [a["outcome"] for a in result.trace["attempts"]] == ["ok"]
    assert result.trace["model"] == model and result.trace["effort"] == sent
    (request,) = fake.requests()
    assert request["body"]["output_config"].get("effort") == sent
