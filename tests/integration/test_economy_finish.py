"""An economy item's end against the embedded backend, a real redis-server and the fake
Messages API (the real SDK over loopback HTTP), its steps driven directly (no worker
process): the read of its candidates as stored at its finish, and the figures it counts in
the real Prometheus registry."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import pytest

from tests.fake_anthropic import FakeAnthropic, errored
from tests.fakes import FakeEmbedder
from tests.integration.test_economy_doubts import _mapping, _submission, _Task, workers
from tests.integration.test_economy_doubts import _prepared as prepared_batch
from worker.adapters.anthropic import AnthropicReranker
from worker.adapters.anthropic_batches import AnthropicMessageBatches
from worker.adapters.embedded import EmbeddedBackend
from worker.constants import ECONOMY_PREPARED_KEY, ECONOMY_RUNS_KEY, LANE_ECONOMY, POLICY_ID
from worker.contract import DocumentIn, SearchSpec
from worker.core.pipeline import RerankRun, load_prepared
from worker.errors import AttemptOutcome, BackendUnavailable, IndexNotFound, RerankAttemptError
from worker.observability.metrics import PrometheusRecorder
from worker.queue.base import WorkerContext
from worker.queue.economy import finish
from worker.queue.economy.records import new_run
from worker.queue.jobstore import BatchJob, JobStore
from worker.runtime.bootstrap import build_pipeline
from worker.runtime.inprocess import Runtime
from worker.runtime.ratelimit import ProviderLimiter
from worker.settings import load_settings

pytestmark = pytest.mark.integration

__all__ = ["workers"]  # a fixture (test_economy_doubts.py's) these tests use too

MODEL = "claude-haiku-4-5"
TOPICS = ["apple orchard harvest", "river delta flooding", "volcano eruption ash"]


class Counted:
    """A real backend, its reads of stored documents (and of whether an index exists)
    counted on their way to it."""

    COUNTED = ("stored_documents", "holds", "channels")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.inner, name)
        if name not in self.COUNTED:
            return found

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return found(*args, **kwargs)

        return counted


@pytest.fixture
def model() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as fake:
        yield fake


@pytest.fixture
def backend(tmp_path: Path) -> Counted:
    return Counted(EmbeddedBackend(tmp_path / "data"))


@pytest.fixture
def context(store: JobStore, model: FakeAnthropic, redis_url: str, backend: Any) -> WorkerContext:
    """A worker's context whose economy pipeline runs on the embedded backend (its index
    ``docs``, acme's, of 18 documents), reports to the Prometheus registry, and sends its
    prompts to the fake Messages API."""
    settings = load_settings(
        redis_url=redis_url,
        rerank_enabled=True,
        generation_model=f"anthropic:{MODEL}",
    )
    sdk = anthropic.Anthropic(base_url=model.url, api_key="sk-ant-test", max_retries=0)
    reranker = AnthropicReranker(MODEL, client=sdk)
    pipeline = build_pipeline(
        settings,
        backend=backend,
        embedder=FakeEmbedder(),
        reranker=reranker,
        recorder=PrometheusRecorder(LANE_ECONOMY),
    )
    docs = [
        DocumentIn(id=f"d{i}", text=f"{topic} notes number {i}")
        for i, topic in enumerate(TOPICS * 6)
    ]
    Runtime(pipeline).ingest("docs", "acme", docs)
    return WorkerContext(
        settings=settings,
        store=store,
        limiter=ProviderLimiter(4),
        _runtime=SimpleNamespace(economy=pipeline),  # type: ignore[arg-type]
        _batches=AnthropicMessageBatches(reranker),
    )


def _prepared(context: WorkerContext, n: int) -> tuple[BatchJob, list[str]]:
    """A batch of ``n`` items on the three topics, each prepared, none sent yet."""
    return prepared_batch(
        context,
        n,
        lambda i: SearchSpec(index="docs", query=TOPICS[i % 3], limit=3, include_trace=True),
    )


def _candidates(context: WorkerContext, batch: BatchJob, qids: list[str]) -> list[set[str]]:
    """Each item's candidates' ids, as kept when it was prepared."""
    pipeline = context.runtime.economy
    raws = context.store.economy_get(batch.id, ECONOMY_PREPARED_KEY, qids)
    return [
        {c.document.id for c in load_prepared(pipeline, json.loads(str(raw))).candidates}
        for raw in raws
    ]


@pytest.mark.parametrize("ids_per_read", [None, 5])
def test_a_page_s_candidates_are_read_together_and_deletes_still_show(
    context: WorkerContext,
    model: FakeAnthropic,
    backend: Counted,
    workers: None,
    monkeypatch: pytest.MonkeyPatch,
    ids_per_read: int | None,
) -> None:
    """Each item's candidates are read as stored when it finishes. They were read one item
    at a time: a call to the backend per item, up to 100,000 for one provider batch, in the
    poll. A page of results now reads the ids of all its items on one index together, in
    slices of ``STORED_READ_IDS``; a document deleted since the items were prepared is still
    in none of their hits."""
    if ids_per_read is not None:
        monkeypatch.setattr(finish, "STORED_READ_IDS", ids_per_read)
    batch, qids = _prepared(context, 12)
    candidates = _candidates(context, batch, qids)
    deleted = sorted(candidates[0])[0]
    assert backend.inner.delete_documents("docs", "acme", [deleted]) == 1
    _submission(context, batch, qids, "1")
    [first] = model.batches()
    backend.calls.clear()
    _mapping(context, batch, first["id"])
    distinct = len(set().union(*candidates))
    slices = 1 if ids_per_read is None else math.ceil(distinct / ids_per_read)
    assert ids_per_read is None or slices > 1  # the test reads more than one slice
    assert backend.calls["stored_documents"] == slices, backend.calls
    results = context.store.batch_results(batch.id, 0, 12)
    assert [r.status for r in results] == ["succeeded"] * 12, results
    shown = [r.payload or "" for r in results]
    holding = [text for text, ids in zip(shown, candidates, strict=True) if deleted in ids]
    assert holding  # an item had it among its candidates, as prepared
    assert all(f'"deleted_since_retrieval":["{deleted}"]' in text for text in holding), holding
    assert all(f'"id":"{deleted}"' not in text for text in shown)


def _figures(outcome: str) -> dict[str, float]:
    """The figures an economy item's end counts, as the Prometheus registry holds them: the
    search done ``error``, its model answer's duration of ``outcome``, the item failed."""
    from prometheus_client import REGISTRY

    def value(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    return {
        "search_done": value(
            "sift_search_duration_seconds_count", {"mode": "hybrid", "outcome": "error"}
        ),
        "rerank_done": value(
            "sift_rerank_duration_seconds_count",
            {"model": MODEL, "outcome": outcome, "lane": LANE_ECONOMY},
        ),
        "items_failed": value(
            "sift_jobs_completed_total", {"kind": "batch_item", "status": "failed"}
        ),
    }


def _grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before}


def test_an_item_ending_index_not_found_counts_its_search_and_its_answer_once(
    context: WorkerContext, model: FakeAnthropic, backend: Counted, workers: None
) -> None:
    """An item whose index was dropped while its provider batch ran ends ``index_not_found``
    with its billed usage; the model answered it, billed, but neither the search
    (``sift_search_duration_seconds{outcome="error"}``) nor that answer
    (``sift_rerank_duration_seconds``) was counted, as the standard lane counts a search
    that fails after its model call. Both are now, once: not again when the item's end is
    run again (a poll delivered again), its transition then applying nothing."""
    batch, qids = _prepared(context, 3)
    _submission(context, batch, qids, "1")
    [first] = model.batches()
    raw = context.store.economy_get(batch.id, ECONOMY_PREPARED_KEY, ["q0"])[0]
    item = load_prepared(context.runtime.economy, json.loads(str(raw)))  # kept till it ends
    assert backend.inner.delete_index("docs", "acme", version=None) > 0
    before = _figures("ok")
    task = _mapping(context, batch, first["id"])
    results = context.store.batch_results(batch.id, 0, 3)
    assert [r.status for r in results] == ["failed"] * 3, results
    assert all('"index_not_found"' in (r.payload or "") for r in results), results
    assert _grown(before, _figures("ok")) == {"search_done": 3, "rerank_done": 3, "items_failed": 3}
    # its end run again: the item is final, nothing is counted twice
    again = _figures("ok")
    run = RerankRun()
    finish.finish_item(task, batch, "q0", item, run, now=IndexNotFound("docs"))  # type: ignore[arg-type]
    _mapping(context, batch, first["id"])
    assert _grown(again, _figures("ok")) == {"search_done": 0, "rerank_done": 0, "items_failed": 0}


def test_an_item_the_failure_policy_ends_on_a_failing_backend_counts_its_search_once(
    context: WorkerContext, backend: Counted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a poll gave up, the failure policy ends the items waiting on it; the backend
    failing the read of their candidates ends them ``failed`` with its error. Their search
    and its failed rerank are counted, once, as for any search failing after its model
    call."""
    batch, qids = _prepared(context, 2)

    def down(*args: Any, **kwargs: Any) -> Any:
        raise BackendUnavailable("the backend is down")

    monkeypatch.setattr(backend.inner, "stored_documents", down)
    before = _figures("timeout")
    task = _Task(context, "poll-gave-up")
    failure = RerankAttemptError(AttemptOutcome.TIMEOUT, "the provider batch expired")
    finish.fail_items(task, batch, qids, failure)  # type: ignore[arg-type]
    results = context.store.batch_results(batch.id, 0, 2)
    assert all('"backend_unavailable"' in (r.payload or "") for r in results), results
    assert _grown(before, _figures("timeout")) == {
        "search_done": 2,
        "rerank_done": 2,
        "items_failed": 2,
    }
    finish.fail_items(task, batch, qids, failure)  # type: ignore[arg-type]
    assert _grown(before, _figures("timeout"))["search_done"] == 2


def _as_an_older_release_kept(context: WorkerContext, batch: BatchJob, policy: str) -> None:
    """Rewrite the batch's prepared records as a release of prompt policy ``policy`` kept
    them (its id in their trace only: no release before it stored it apart), and its runs as
    it kept them once it had sent their prompts (no policy named: its own was the one)."""
    store = context.store
    for qid, raw in store.economy_all(batch.id, ECONOMY_PREPARED_KEY).items():
        data = json.loads(raw)
        data.pop("policy", None)
        data["trace"]["policy"] = policy
        store.economy_save(batch.id, ECONOMY_PREPARED_KEY, {qid: json.dumps(data)})
    for qid, raw in store.economy_all(batch.id, ECONOMY_RUNS_KEY).items():
        run = json.loads(raw)
        run.pop("policy", None)
        store.economy_save(batch.id, ECONOMY_RUNS_KEY, {qid: json.dumps(run)})


def _outcomes(policy: str) -> float:
    from prometheus_client import REGISTRY

    labels = {"policy": policy, "outcome": "applied"}
    return REGISTRY.get_sample_value("sift_rerank_outcomes_total", labels) or 0.0


@pytest.mark.parametrize("answer", ["sent_before_the_upgrade", "sent_again_after_it"])
def test_an_item_prepared_before_an_upgrade_names_the_policy_of_the_prompt_it_was_answered_by(
    context: WorkerContext, model: FakeAnthropic, workers: None, answer: str
) -> None:
    """An item prepared and sent by an older release (prompt policy ``listwise.v1``) and
    finished by this one was labelled this release's policy (:data:`POLICY_ID`) in its
    result's ``rerank.policy`` and in ``sift_rerank_outcomes_total``, though the model had
    answered the older prompt (its trace said so). Both now name the prompt its answer came
    from: the older one's; this release's once the item was sent again by it (its first
    request errored), the prompt it sends being rebuilt by this release's builder."""
    if answer == "sent_again_after_it":
        model.script_batch({"i0": [errored("overloaded_error")]})
    batch, qids = _prepared(context, 1)
    _submission(context, batch, qids, "1")
    _as_an_older_release_kept(context, batch, "listwise.v1")
    [first] = model.batches()
    before = {policy: _outcomes(policy) for policy in ("listwise.v1", POLICY_ID)}
    _mapping(context, batch, first["id"])
    if answer == "sent_again_after_it":
        [_, again] = model.batches()
        _mapping(context, batch, again["id"])
    expected = "listwise.v1" if answer == "sent_before_the_upgrade" else POLICY_ID
    assert expected != "listwise.v1" or POLICY_ID != "listwise.v1"  # this release's is newer
    [result] = context.store.batch_results(batch.id, 0, 1)
    assert result.status == "succeeded", result
    payload = json.loads(result.payload or "{}")["result"]
    assert payload["rerank"] == {"applied": True, "policy": expected, "fallback_reason": None}
    assert payload["trace"]["policy"] == expected
    grown = {policy: _outcomes(policy) - seen for policy, seen in before.items()}
    assert grown == {policy: float(policy == expected) for policy in grown}, grown


def _without_model(context: WorkerContext, failure_policy: str) -> WorkerContext:
    """``context`` as a worker with no generation model has it (rerank turned off for good):
    its economy pipeline of ``failure_policy`` with no reranker, and no Message Batches
    client."""
    with_model = context.runtime.economy
    config = replace(with_model.config, failure_policy=failure_policy)
    pipeline = with_model.variant(config=config, recorder=with_model.recorder)
    pipeline.reranker = None
    return WorkerContext(
        settings=context.settings,
        store=context.store,
        limiter=ProviderLimiter(4),
        _runtime=SimpleNamespace(economy=pipeline),  # type: ignore[arg-type]
        _batches=None,
    )


def test_items_never_sent_end_in_the_fused_order_under_fail_open_on_a_worker_without_the_model(
    context: WorkerContext, model: FakeAnthropic, backend: Counted, workers: None
) -> None:
    """Items never sent, their economy deadline past on a worker with no generation model
    (none left in the pool: rerank turned off for good), end as the standard lane answers a
    rerank asked of such a worker: under ``fail_open``, ``succeeded`` in the fused order,
    ``fallback_reason: "error:no_generation_model"``, nothing billed; an item whose
    candidate was deleted meanwhile shows it in no hit. (``fail_closed``, the default, is
    driven over a real stack in ``tests/reliability/test_economy_no_model.py``.)"""
    batch, qids = _prepared(context, 3)
    without_model = _without_model(context, "fail_open")
    pipeline = without_model.runtime.economy
    fused = [
        [c.document.id for c in load_prepared(pipeline, json.loads(str(raw))).candidates]
        for raw in context.store.economy_get(batch.id, ECONOMY_PREPARED_KEY, qids)
    ]
    deleted = fused[0][0]
    assert backend.inner.delete_documents("docs", "acme", [deleted]) == 1
    task = _Task(without_model, "submit")
    finish.end_without_model(task, batch, qids)  # type: ignore[arg-type]
    results = context.store.batch_results(batch.id, 0, 3)
    assert [r.status for r in results] == ["succeeded"] * 3, results
    for outcome, ids in zip(results, fused, strict=True):
        result = json.loads(str(outcome.payload))["result"]
        rerank = result["rerank"]
        assert rerank["applied"] is False, rerank
        assert rerank["fallback_reason"] == "error:no_generation_model", rerank
        live = [i for i in ids if i != deleted]
        assert [h["id"] for h in result["hits"]] == live[:3], result["hits"]
        assert result["usage"]["requests"] == 0, result["usage"]
    assert ("batch.completed", {"id": batch.id, "status": "succeeded"}) in task.sent
    assert model.batches() == []


@pytest.mark.parametrize("failure_policy", ["fail_closed", "fail_open"])
def test_an_item_ended_without_the_model_shows_what_its_earlier_rounds_were_billed(
    context: WorkerContext, workers: None, failure_policy: str
) -> None:
    """An item ended for lack of a model shows what earlier rounds of it were billed, as an
    item the failure policy ends past the deadline (:func:`finish.fail_items`) does, under
    either policy: under ``fail_open`` its result showed no request (the fused order's
    ``Usage()``), where ``fail_closed``'s error showed them. (No path today gives an item
    never sent a billed round, :func:`end_without_model`'s only items: the ending is kept
    right for the day one does.)"""
    batch, qids = _prepared(context, 1)
    [raw] = context.store.economy_get(batch.id, ECONOMY_PREPARED_KEY, qids)
    billed = new_run(int(json.loads(str(raw))["pos"]))
    billed.update(attempts=[{"n": 1, "outcome": "malformed"}], usage=[120, 9, 0, 0],
                  cost_usd=0.0002)  # fmt: skip
    context.store.economy_save(batch.id, ECONOMY_RUNS_KEY, {qids[0]: json.dumps(billed)})
    task = _Task(_without_model(context, failure_policy), "submit")
    finish.end_without_model(task, batch, qids)  # type: ignore[arg-type]
    [outcome] = context.store.batch_results(batch.id, 0, 1)
    payload = json.loads(str(outcome.payload))
    shown = payload["error" if failure_policy == "fail_closed" else "result"]["usage"]
    expected = {"requests": 1, "input_tokens": 120, "output_tokens": 9}
    assert {name: shown[name] for name in expected} == expected, payload
    assert shown["cost_usd"] == pytest.approx(0.0002), payload


def test_an_item_ended_without_the_model_names_the_model_its_create_went_to(
    context: WorkerContext, workers: None
) -> None:
    """An item whose create failed outright (a worker of another model tried it, after a
    deploy) and which then ended for lack of a model names in its trace the model that
    create went to, as an item :func:`finish.fail_items` ends does (:func:`as_sent`); it
    named the model of the worker that prepared it."""
    batch, qids = _prepared(context, 1)
    [raw] = context.store.economy_get(batch.id, ECONOMY_PREPARED_KEY, qids)
    prepared = json.loads(str(raw))
    other = "claude-sonnet-4-5"
    assert prepared["trace"]["model"] != other  # prepared by a worker of another model
    tried = new_run(int(prepared["pos"]))
    tried.update(model=other, policy=POLICY_ID)  # a create made, failed, nothing pending
    context.store.economy_save(batch.id, ECONOMY_RUNS_KEY, {qids[0]: json.dumps(tried)})
    task = _Task(_without_model(context, "fail_closed"), "submit")
    finish.end_without_model(task, batch, qids)  # type: ignore[arg-type]
    [outcome] = context.store.batch_results(batch.id, 0, 1)
    error = json.loads(str(outcome.payload))["error"]
    assert error["type"] == "rerank_failed", error
    assert error["trace"]["model"] == other, error["trace"]


def test_items_ended_without_the_model_on_a_gone_index_count_their_search_alone_once(
    context: WorkerContext, backend: Counted, workers: None
) -> None:
    """Items never sent, ended for lack of a model after their index was dropped, end
    ``index_not_found`` with no usage and count what a search failing before any model call
    counts: the search done ``error``, the item failed, and no model answer (none was
    made: ``SearchPipeline.unfinished`` without a run). Run again, nothing is counted
    twice."""
    batch, qids = _prepared(context, 2)
    assert backend.inner.delete_index("docs", "acme", version=None) > 0
    before = _figures("deadline")  # what a run with no call would be labelled, if counted
    task = _Task(_without_model(context, "fail_closed"), "submit")
    finish.end_without_model(task, batch, qids)  # type: ignore[arg-type]
    results = context.store.batch_results(batch.id, 0, 2)
    errors = [json.loads(str(r.payload))["error"] for r in results]
    assert [(e["type"], e["usage"]) for e in errors] == [("index_not_found", None)] * 2, errors
    grown = {"search_done": 2, "rerank_done": 0, "items_failed": 2}
    assert _grown(before, _figures("deadline")) == grown
    finish.end_without_model(task, batch, qids)  # type: ignore[arg-type]
    assert _grown(before, _figures("deadline")) == grown
    assert ("batch.completed", {"id": batch.id, "status": "succeeded"}) in task.sent
