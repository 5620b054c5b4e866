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
import pytest

from tests.fake_anthropic import FakeAnthropic
from tests.unit.test_pipeline import make
from worker.adapters.anthropic import AnthropicReranker
from worker.adapters.anthropic_batches import AnthropicMessageBatches
from worker.constants import ECONOMY_PROVIDERS_KEY, ECONOMY_RESEND_CLAIM, ECONOMY_RUNS_KEY
from worker.contract import SearchSpec
from worker.queue import economy
from worker.queue.base import WorkerContext
from worker.queue.jobstore import BatchJob, JobStore
from worker.ratelimit import ProviderLimiter
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
        run = economy._new_run(position)
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
    new_submission = economy.new_submission

    def held() -> str:
        rendezvous.arrive()
        return new_submission()

    monkeypatch.setattr(economy, "new_submission", held)
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
