"""A worker killed after the model answered, before the result was saved: the redelivered
run finishes on the answer its claim kept, and the model is called once (it was called
twice, the cost paid twice, when the answer died with the process). The job's usage, its
trace and the usage the metrics were told all show that one call.

The worker is a real Celery worker (prefork, one child: the child's death is redelivered at
once, which the threads pool does once the dead worker's heartbeat lapses) running a real
pipeline, the Anthropic SDK against the fake Messages API, an in-memory index
(``answering_runtime``)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from api_gateway.queue import OutboxSender
from tests.fake_anthropic import FakeAnthropic
from tests.integration.answering_runtime import counted
from tests.services import celery_worker, redis_server
from worker.constants import (
    BATCH_CHUNK_TASK,
    BATCH_QUEUE,
    BATCH_RUNS_KEY,
    SEARCH_QUEUE,
    SEARCH_TASK,
)
from worker.contract import SearchResult, SearchSpec
from worker.queue.jobstore import BatchJob, JobStore, SearchJob

pytestmark = pytest.mark.integration


class Setup(NamedTuple):
    store: JobStore
    model: FakeAnthropic
    flag: Path  # exists: the worker dies after its next model answer
    usage_log: Path  # a line per model usage the metrics were told
    extra: Path  # exists: a process built from now on has tenant zeta's extra document
    failing: Path  # exists: the next process built fails that many retrievals first


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = Path(tmp_path_factory.mktemp("answer"))
    with redis_server(tmp / "redis") as url, FakeAnthropic() as model:
        env = {
            "SIFT_REDIS_URL": url + "/0",
            "SIFT_RUNTIME_FACTORY": "tests.integration.answering_runtime:build",
            "SIFT_RERANK_ENABLED": "true",
            "SIFT_GENERATION_MODEL": "anthropic:claude-haiku-4-5",
            "ANTHROPIC_BASE_URL": model.url,
            "ANTHROPIC_API_KEY": "sk-ant-test",
            "SIFT_WORKER_METRICS_PORT": "0",
            "SIFT_WORKER_SOFT_SHUTDOWN_SECONDS": "1",
            "DIE_AFTER_MODEL_FLAG": str(tmp / "die"),
            "MODEL_USAGE_LOG": str(tmp / "usage.log"),
            "SEARCH_DONE_LOG": str(tmp / "done.log"),
            "DIE_AFTER_DONE_FLAG": str(tmp / "die-done"),
            "RERANK_OUTCOME_LOG": str(tmp / "outcomes.log"),
            "DIE_AFTER_OUTCOME_FLAG": str(tmp / "die-outcome"),
            "RETRIEVAL_LOG": str(tmp / "retrieval.log"),
            "DIE_AFTER_RETRIEVAL_FLAG": str(tmp / "die-retrieval"),
            "SIFT_ECONOMY_POLL_SECONDS": "0.5",
            "EXTRA_DOCUMENT_FLAG": str(tmp / "extra"),
            "FAIL_RETRIEVAL_FLAG": str(tmp / "failing"),
            "CANCEL_BEFORE_MODEL_FLAG": str(tmp / "cancel-before-model"),
        }
        store = JobStore.from_url(url + "/0")
        with celery_worker(tmp / "w", env, "answer", concurrency=1, pool="prefork"):
            yield Setup(
                store, model, tmp / "die", tmp / "usage.log", tmp / "extra", tmp / "failing"
            )
        store.close()


def _wait(read: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if read():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError("never final")


def _died(flag: Path) -> None:
    """Wait until the worker died at ``flag`` (which it deletes as it dies): one dying as it
    records figures held until the job is saved may still be running when the test sees the
    job final (the save is made first)."""
    deadline = time.monotonic() + 60
    while flag.exists():
        assert time.monotonic() < deadline, f"the worker never died at {flag.name}"
        time.sleep(0.1)


def _one_call(setup: Setup, result: SearchResult | None) -> None:
    """The model was called once, and the job's usage, its trace and the metrics say so."""
    assert not setup.flag.exists()  # the worker did die after the model answered
    assert result is not None and result.rerank.applied
    calls = setup.model.requests()
    assert len(calls) == 1, len(calls)
    billed = setup.model.usage()
    assert result.usage.requests == 1
    assert result.usage.input_tokens == billed["input_tokens"] > 0
    assert result.usage.output_tokens == billed["output_tokens"]
    assert result.trace is not None and [a["outcome"] for a in result.trace["attempts"]] == ["ok"]
    told = setup.usage_log.read_text().splitlines()
    assert len(told) == 1, told


def _batch_told_once(setup: Setup, batch_id: str, result: SearchResult) -> None:
    """The batch's totals hold its one item's usage and rerank outcome once: the run that
    died added nothing, the run on the kept answer added them."""
    done = setup.store.get_batch(batch_id)
    assert done is not None
    assert done.usage == result.usage
    assert done.rerank_outcomes == {"applied": 1, "fallback": 0, "skipped": 0}


def _arm(setup: Setup) -> None:
    setup.model.reset()
    setup.usage_log.write_text("")
    setup.flag.touch()


def _arm_for(flag: Path | None, job_id: str) -> None:
    """Arm ``flag`` (``die-done``, ``die-outcome``, ``die-retrieval``) for the searches of
    the job ids starting ``job_id`` alone, before its message is sent: a search of an earlier
    test whose figures are counted late (after its record was final) does not trip it (it
    did, and the worker died in this test's search, not after counting it)."""
    if flag is not None:
        flag.write_text(job_id)


def _run_search(setup: Setup, tenant: str, spec: SearchSpec, arm: Path | None = None) -> SearchJob:
    """Run one search through the queue to its end; its final record."""
    sender = OutboxSender(setup.store)

    def enqueue(job_id: str) -> list[tuple[str, str]]:
        _arm_for(arm, job_id)
        return sender.messages([(SEARCH_TASK, [job_id], SEARCH_QUEUE)])

    job = setup.store.create_search(tenant, spec, enqueue=enqueue)
    _wait(lambda: (j := setup.store.get_search(job.id)) is not None and j.status.final)
    done = setup.store.get_search(job.id)
    assert done is not None
    return done


def _search(setup: Setup, tenant: str, spec: SearchSpec) -> SearchResult:
    """Run one search through the queue to its end: it must succeed; its result."""
    return _succeeded(_run_search(setup, tenant, spec))


def _succeeded(job: SearchJob) -> SearchResult:
    assert job.status == "succeeded" and job.result, job
    return job.result


def _submit_batch(
    setup: Setup,
    items: list[tuple[str, SearchSpec]],
    tenant: str = "acme",
    lane: str = "standard",
    arm: Path | None = None,
) -> BatchJob:
    """A batch of ``items`` on index docs, its one chunk queued."""
    sender = OutboxSender(setup.store)

    def enqueue(batch_id: str) -> list[tuple[str, str]]:
        _arm_for(arm, batch_id + "/")  # its items' ids: "<batch id>/<query id>"
        return sender.messages([(BATCH_CHUNK_TASK, [batch_id, 0, len(items)], BATCH_QUEUE)])

    return setup.store.create_batch(tenant, "docs", items, lane=lane, enqueue=enqueue)


def _run_batch(
    setup: Setup, spec: SearchSpec, lane: str = "standard", arm: Path | None = None
) -> BatchJob:
    """A one-item batch of ``spec`` for tenant acme, run to its end."""
    batch = _submit_batch(setup, [("q0", spec)], lane=lane, arm=arm)
    _wait(lambda: (b := setup.store.get_batch(batch.id)) is not None and b.status.final)
    return batch


def test_a_search_whose_worker_died_after_the_model_answered_calls_it_once(setup: Setup) -> None:
    _arm(setup)
    spec = SearchSpec(index="docs", query="gamma", rerank=True, include_trace=True)
    _one_call(setup, _search(setup, "acme", spec))


def test_a_batch_item_whose_worker_died_after_the_model_answered_calls_it_once(
    setup: Setup,
) -> None:
    _arm(setup)
    spec = SearchSpec(index="docs", query="delta", rerank=True, include_trace=True)
    batch = _run_batch(setup, spec)
    (item,) = setup.store.batch_results(batch.id, 0, 1)
    assert item.status == "succeeded" and item.payload is not None, item
    result = SearchResult.model_validate(json.loads(item.payload)["result"])
    _one_call(setup, result)
    _batch_told_once(setup, batch.id, result)


def test_a_batch_canceled_after_its_item_s_model_answered_finishes_the_item_on_it(
    setup: Setup,
) -> None:
    """The batch is canceled between the worker's death (after the model answered) and the
    item's redelivered start: the item is past its model call, paid for, so it finishes on the
    kept answer, as an item whose worker lived does once its call was made. Before, the start
    canceled it, and its record showed none of that call's usage (the metrics had counted it)."""
    _arm(setup)
    setup.flag.write_text("cancel")
    spec = SearchSpec(index="docs", query="beta", rerank=True, include_trace=True)
    batch = _run_batch(setup, spec)
    done = setup.store.get_batch(batch.id)
    assert done is not None and done.canceled_at is not None  # the cancel did land
    (item,) = setup.store.batch_results(batch.id, 0, 1)
    assert item.status == "succeeded" and item.payload is not None, item
    result = SearchResult.model_validate(json.loads(item.payload)["result"])
    _one_call(setup, result)
    assert done.status == "succeeded" and done.counts["succeeded"] == 1, done
    _batch_told_once(setup, batch.id, result)


def test_a_search_is_counted_done_once_when_its_worker_died_after_counting_it(
    setup: Setup,
) -> None:
    """The worker dies just after the pipeline counted the search done, before its result
    was saved: the redelivered run finishes on the kept answer, and the search (then a batch
    item) is counted done once (before: twice, each run counting its own; the tokens and cost
    were once)."""
    _arm(setup)
    setup.flag.unlink()  # this one dies after the count, not after the model answered
    done_log, die = setup.usage_log.with_name("done.log"), setup.flag.with_name("die-done")
    spec = SearchSpec(index="docs", query="alpha", rerank=True, include_trace=True)
    job = _run_search(setup, "acme", spec, arm=die)
    _died(die)
    assert counted(done_log, job.id) == ["ok"]
    assert job.status == "succeeded" and job.result and job.result.usage.requests == 1, job
    assert len(setup.model.requests()) == 1
    # and a batch item's
    setup.model.reset()
    batch = _run_batch(setup, spec, arm=die)
    _died(die)
    assert counted(done_log, f"{batch.id}/q0") == ["ok"]
    (item,) = setup.store.batch_results(batch.id, 0, 1)
    assert item.status == "succeeded" and len(setup.model.requests()) == 1, item


def test_a_search_needing_no_model_call_counts_its_outcome_once_when_its_worker_died(
    setup: Setup,
) -> None:
    """A reranked search with no candidates needs no model call: it counted
    ``sift_rerank_outcomes_total{outcome="skipped"}`` as it ran, so a worker dying before its
    result was saved had the redelivered run count it again. It is counted with the search's
    other figures now, once the result is saved."""
    _arm(setup)
    setup.flag.unlink()
    outcomes, die = setup.usage_log.with_name("outcomes.log"), setup.flag.with_name("die-outcome")
    spec = SearchSpec(index="docs", query="nothing matches", mode="fts", rerank=True)
    job = _run_search(setup, "acme", spec, arm=die)
    result = _succeeded(job)
    _died(die)
    assert not result.hits and not result.rerank.applied and not setup.model.requests()
    assert counted(outcomes, job.id) == ["skipped"]


def test_an_economy_item_needing_no_model_call_counts_its_figures_once_when_its_worker_died(
    setup: Setup,
) -> None:
    """The economy lane's first half of an item with no candidates is final at once: it
    counted ``outcome="skipped"`` (and the search done) as it ran, so a worker dying once it
    was counted, before the item's result was saved, had the redelivered chunk count it
    again. They are counted once the item is finished now (the worker dies after the save)."""
    _arm(setup)
    setup.flag.unlink()
    outcomes, die = setup.usage_log.with_name("outcomes.log"), setup.flag.with_name("die-outcome")
    spec = SearchSpec(index="docs", query="nothing matches", mode="fts", rerank=True)
    batch = _run_batch(setup, spec, lane="economy", arm=die)
    _died(die)
    (item,) = setup.store.batch_results(batch.id, 0, 1)
    assert item.status == "succeeded" and not setup.model.requests(), item
    assert counted(outcomes, f"{batch.id}/q0") == ["skipped"]


def test_a_search_s_retrieval_is_counted_once_when_its_worker_died_after_counting_it(
    setup: Setup,
) -> None:
    """The worker dies just after retrieval's last figure (the candidates fusion kept) was
    counted: a search's, a batch item's, an economy item's. Each stage's duration and hits
    (``sift_retrieval_duration_seconds``, ``sift_retrieval_hits``) are counted once: with
    the search's other figures, after its result (the economy item's prepared search) is
    saved. Before, they were counted as the search ran, so again by the redelivered run."""
    _arm(setup)
    setup.flag.unlink()
    told, die = setup.usage_log.with_name("retrieval.log"), setup.flag.with_name("die-retrieval")
    spec = SearchSpec(index="docs", query="gamma", rerank=True)
    stages = ["embed", "bm25", "knn", "fuse"]
    once = sorted([f"seconds {s}" for s in stages] + [f"hits {s}" for s in stages[1:]])
    for lane in ("search", "standard", "economy"):
        setup.model.reset()
        if lane == "search":
            job_id = _run_search(setup, "acme", spec, arm=die).id
        else:
            batch = _run_batch(setup, spec, lane, arm=die)
            (item,) = setup.store.batch_results(batch.id, 0, 1)
            assert item.status == "succeeded", (lane, item)
            job_id = f"{batch.id}/q0"
        _died(die)
        assert sorted(counted(told, job_id)) == once, lane


def test_an_economy_item_is_counted_done_once_when_its_finish_died_after_counting_it(
    setup: Setup,
) -> None:
    """An economy item's second half (its provider result polled back) dies just after the
    search was counted done, before the item's result was saved: the redelivered poll
    finishes it again. Its figures of the search (``sift_search_duration_seconds``, its
    answer's ``sift_rerank_duration_seconds`` and ``sift_rerank_outcomes_total``) are counted
    once, after the save (before: twice)."""
    _arm(setup)
    setup.flag.unlink()
    done_log, die = setup.usage_log.with_name("done.log"), setup.flag.with_name("die-done")
    outcomes = setup.usage_log.with_name("outcomes.log")
    spec = SearchSpec(index="docs", query="beta", rerank=True)
    batch = _run_batch(setup, spec, lane="economy", arm=die)
    _died(die)
    (item,) = setup.store.batch_results(batch.id, 0, 1)
    assert item.status == "succeeded", item
    assert counted(done_log, f"{batch.id}/q0") == ["ok"]
    assert counted(outcomes, f"{batch.id}/q0") == ["applied"]


def test_a_batch_item_canceled_before_its_model_call_counts_its_retrieval_once(
    setup: Setup,
) -> None:
    """The batch is canceled between a standard-lane item's retrieval and its model call: the
    item ends ``canceled``, not counted done, and its retrieval (which ran) is counted once,
    each stage's duration and hits. Before, the retrieval's figures were held with the
    search's until its result was saved, and a canceled item saves none: never counted."""
    _arm(setup)
    setup.flag.unlink()
    told = setup.usage_log.with_name("retrieval.log")
    done_log = setup.usage_log.with_name("done.log")
    cancel = setup.flag.with_name("cancel-before-model")
    cancel.touch()
    batch = _run_batch(setup, SearchSpec(index="docs", query="gamma", rerank=True))
    assert not cancel.exists()  # the cancel did land before the model call
    (item,) = setup.store.batch_results(batch.id, 0, 1)
    assert item.status == "canceled" and not setup.model.requests(), item
    stages = ["embed", "bm25", "knn", "fuse"]
    once = sorted([f"seconds {s}" for s in stages] + [f"hits {s}" for s in stages[1:]])
    item_id = f"{batch.id}/q0"
    _wait(lambda: len(counted(told, item_id)) >= len(once), timeout=10)
    assert sorted(counted(told, item_id)) == once
    assert counted(done_log, item_id) == []


def _shown(request: dict[str, Any]) -> list[str]:
    """The candidate texts a model request showed, in its order (the prompt's "[N] ..." lines)."""
    (message,) = request["body"]["messages"]
    content = message["content"]
    text = content if isinstance(content, str) else "".join(b["text"] for b in content)
    return [m.group(1).strip() for m in re.finditer(r"^\s*\[\d+\] (.*)$", text, re.M)]


def test_a_kept_answer_is_not_applied_to_candidates_the_model_never_saw(setup: Setup) -> None:
    """The index changed between the run that called the model and the run that took its
    claim over (an ingest landed meanwhile): the kept positions number the first run's
    candidates, so the result must not be those positions applied to the second run's
    (before: ``rerank.applied`` with a document the model was never shown, in an order
    it never gave). The result is the model's answer over what it was shown."""
    spec = SearchSpec(index="docs", query="gamma delta", rerank=True, include_trace=True)
    setup.extra.unlink(missing_ok=True)
    # the worker's process builds its runtime here: without the extra document
    _search(setup, "zeta", spec)
    _arm(setup)
    setup.extra.touch()  # the process taking the claim over will have it
    result = _search(setup, "zeta", spec)
    assert not setup.flag.exists()  # the worker did die after the model answered
    shown = _shown(setup.model.requests()[-1])
    assert result.rerank.applied
    got = [hit.text for hit in result.hits]
    # the fake ranks what it was shown in reverse: the result is that, for the last prompt
    assert got and got == list(reversed(shown))[: len(got)], (got, shown)
    # both calls were billed (the dead run's, its answer for other candidates, and this
    # one's): the result shows both, once each (before: the second alone)
    assert len(setup.model.requests()) == 2
    assert result.usage.requests == len(result.trace["attempts"]) == 2  # type: ignore[index]
    assert result.usage.input_tokens == setup.model.usage()["input_tokens"]
    assert result.usage.output_tokens == setup.model.usage()["output_tokens"]


def test_a_kept_answer_outlives_a_task_retry_of_the_run_taking_it_over(setup: Setup) -> None:
    """The run taking the claim over (with the answer kept) fails before it reaches it (its
    retrieval unavailable, the pipeline's attempts spent: a task retry): the retry finishes
    on the answer. Before, the run letting go before its retry dropped the answer, and the
    retry called the model again: the cost paid twice."""
    spec = SearchSpec(index="docs", query="epsilon", mode="fts", rerank=True, include_trace=True)
    # the worker's process builds its runtime here: its retrievals do not fail
    _search(setup, "acme", spec)
    _arm(setup)
    setup.failing.write_text("3")  # the process taking the claim over: its 3 attempts fail
    result = _search(setup, "acme", spec)
    assert not setup.failing.exists()  # the run taking over did fail (and was retried)
    _one_call(setup, result)


def test_a_batch_canceled_while_its_item_waits_to_retry_on_a_kept_answer_counts_it_once(
    setup: Setup,
) -> None:
    """The worker dies after the model answered; the run taking the claim over fails its
    retrieval and lets the claim go (the answer carried on) to be retried; the batch is
    canceled while that retry waits. The item is past its model call, paid for: its retry
    finishes it on the kept answer, and the batch's usage and cost show that call once.
    Before, the item waited ``queued``, the cancel canceled it with the queued items, and
    neither its record nor the batch's totals showed the call the provider billed."""
    spec = SearchSpec(index="docs", query="delta", mode="fts", rerank=True, include_trace=True)
    _search(setup, "acme", spec)  # the worker's process builds its runtime: no failures
    _arm(setup)
    setup.failing.write_text("3")  # the process taking the claim over: its 3 attempts fail
    batch = _submit_batch(setup, [("q0", spec)])
    runs = BATCH_RUNS_KEY + batch.id

    def let_go_for_its_retry() -> bool:  # "<used>||0|||<answer>": no holder, the answer on
        held = setup.store.redis.hget(runs, "q0")
        return isinstance(held, str) and re.match(r"^[^|]*\|\|0\|\|\|.", held) is not None

    _wait(let_go_for_its_retry, timeout=60)
    assert setup.store.cancel_batch(batch.id) == (0, False)  # it is past its model call
    _wait(lambda: (b := setup.store.get_batch(batch.id)) is not None and b.status.final)
    assert not setup.failing.exists()  # the run taking over did fail (and was retried)
    (item,) = setup.store.batch_results(batch.id, 0, 1)
    assert item.status == "succeeded" and item.payload is not None, item
    result = SearchResult.model_validate(json.loads(item.payload)["result"])
    _one_call(setup, result)
    _batch_told_once(setup, batch.id, result)
    done = setup.store.get_batch(batch.id)
    assert done is not None and done.status == "succeeded", done


def test_a_batch_s_totals_stay_its_items_sums_when_its_worker_died_after_a_save(
    setup: Setup,
) -> None:
    """The worker dies once an item's result is saved, while it records that item's figures
    (``sift_search_duration_seconds``, counted after the save): the redelivered chunk finds
    the item final and runs the other. The batch's record adds each item's usage, cost,
    rerank outcome and seconds by stage in the script that saves it, so its totals are its
    two items' sums, each once: the process's own Prometheus figures die with it (a counter
    reset to Prometheus), the record's do not."""
    from worker.core.pipeline import stage_seconds

    _arm(setup)
    setup.flag.unlink()
    die = setup.flag.with_name("die-done")
    spec = SearchSpec(index="docs", query="gamma", mode="fts", rerank=True, include_trace=True)
    items = [("q0", spec), ("q1", spec.model_copy(update={"query": "beta"}))]
    batch = _submit_batch(setup, items, arm=die)  # an item of this batch's
    _wait(lambda: (b := setup.store.get_batch(batch.id)) is not None and b.status.final)
    _died(die)
    results = []
    for item in setup.store.batch_results(batch.id, 0, 2):
        assert item.status == "succeeded" and item.payload is not None, item
        results.append(SearchResult.model_validate(json.loads(item.payload)["result"]))
    done = setup.store.get_batch(batch.id)
    assert done is not None and done.usage is not None and done.stage_seconds is not None
    billed = setup.model.usage()
    assert done.usage.requests == sum(r.usage.requests for r in results) == 2
    assert done.usage.input_tokens == sum(r.usage.input_tokens for r in results)
    # the other item may have been in its model call when the worker died: that call is
    # billed and its answer died with the process (docs/reliability.md), so the provider
    # may have billed one call more than the results show, never fewer
    assert 0 < done.usage.input_tokens <= billed["input_tokens"]
    cost = sum(r.usage.cost_usd or 0.0 for r in results)
    assert done.usage.cost_usd == pytest.approx(cost) and cost > 0
    assert done.rerank_outcomes == {"applied": 2, "fallback": 0, "skipped": 0}
    summed: dict[str, float] = {}
    for result in results:
        assert result.trace is not None
        for stage, seconds in stage_seconds(result.trace).items():
            summed[stage] = summed.get(stage, 0.0) + seconds
    assert done.stage_seconds.keys() == summed.keys(), (done.stage_seconds, summed)
    for stage, seconds in summed.items():
        assert done.stage_seconds[stage] == pytest.approx(seconds, abs=0.01), stage


def test_an_item_failing_after_it_took_a_kept_answer_over_shows_that_billed_call(
    setup: Setup,
) -> None:
    """The worker dies after the model answered; the runs taking the claim over fail their
    retrieval until the task's retries are spent: the item fails ``backend_unavailable``,
    and its error's ``usage`` (and so the batch's ``usage`` and ``cost_usd``) shows the one
    call the provider billed, as a failure after a billed attempt does. Before, the error
    had no usage: the call was paid, and no record said so (the metrics did)."""
    spec = SearchSpec(index="docs", query="alpha", mode="fts", rerank=True, include_trace=True)
    _search(setup, "acme", spec)  # the worker's process builds its runtime: no failures
    _arm(setup)
    # every retrieval of the runs taking it over fails: 3 attempts in each of the 4 runs
    # (the redelivered one and SIFT_TASK_MAX_RETRIES retries), then the item fails
    setup.failing.write_text("12")
    batch = _run_batch(setup, spec)
    (item,) = setup.store.batch_results(batch.id, 0, 1)
    assert item.status == "failed" and item.payload is not None, item
    error = json.loads(item.payload)["error"]
    assert error["type"] == "backend_unavailable", error
    assert len(setup.model.requests()) == 1
    billed = setup.model.usage()
    assert error["usage"] is not None, error
    assert error["usage"]["requests"] == 1
    assert error["usage"]["input_tokens"] == billed["input_tokens"] > 0
    assert error["usage"]["cost_usd"] is not None and error["usage"]["cost_usd"] > 0
    done = setup.store.get_batch(batch.id)
    assert done is not None and done.usage is not None
    assert done.usage.model_dump() == error["usage"]
    # and a search's, likewise
    _arm(setup)
    setup.failing.write_text("12")
    failed = _run_search(setup, "acme", spec)
    assert failed.error is not None, failed
    assert failed.error.type == "backend_unavailable" and failed.error.usage is not None
    assert failed.error.usage.input_tokens == setup.model.usage()["input_tokens"] > 0
    assert failed.error.usage.requests == len(setup.model.requests()) == 1
    _search(setup, "acme", spec)  # and no failure is left for the next test: it succeeds


def test_an_item_canceled_before_calling_again_past_a_kept_answer_shows_the_billed_call(
    setup: Setup,
) -> None:
    """The worker dies after the model answered, the batch is canceled, and an ingest lands
    before the item's redelivered run: that run starts (a kept answer: past its model call),
    but its candidates differ, so it would call the model again, and its check before that
    call finds the cancel: the item ends ``canceled``. The dead run's call was billed: the
    item's ``usage`` and its batch's ``usage`` and ``cost_usd`` show it once. Before, a
    canceled item carried no usage, and the paid call was in no record."""
    spec = SearchSpec(index="docs", query="gamma delta", rerank=True, include_trace=True)
    setup.extra.unlink(missing_ok=True)
    _arm(setup)  # the worker dies once: the process after it has no extra document
    _search(setup, "zeta", spec)
    _arm(setup)
    setup.flag.write_text("cancel")  # the batch is canceled as the worker dies
    setup.extra.touch()  # the process taking the claim over has the extra document
    batch = _submit_batch(setup, [("q0", spec)], "zeta")
    _wait(lambda: (b := setup.store.get_batch(batch.id)) is not None and b.status.final)
    setup.extra.unlink()
    assert not setup.flag.exists()  # the worker did die after the model answered
    (item,) = setup.store.batch_results(batch.id, 0, 1)
    assert item.status == "canceled" and item.payload is not None, item
    assert len(setup.model.requests()) == 1  # the one call, billed
    billed = setup.model.usage()
    usage = json.loads(item.payload)["usage"]
    assert usage["requests"] == 1 and usage["input_tokens"] == billed["input_tokens"] > 0
    assert usage["cost_usd"] is not None and usage["cost_usd"] > 0
    done = setup.store.get_batch(batch.id)
    assert done is not None and done.status == "canceled" and done.usage is not None
    assert done.usage.model_dump() == usage
