"""The Redis job store against a real redis-server: compare-and-set, counts, TTLs, idempotency."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from typing import Any

import pytest
import redis
import redis.asyncio

from worker import clock
from worker.constants import (
    BATCH_COUNTS_KEY,
    BATCH_ITEMS_KEY,
    BATCH_KEY,
    BATCH_MOVES_KEY,
    BATCH_ORDER_KEY,
    BATCH_RESULTS_KEY,
    BATCH_SPECS_KEY,
    BATCH_STAGE_SLICE,
    BATCH_STAGING_TTL_SECONDS,
    ERROR_TENANT_REMOVED,
    IDEMPOTENCY_KEY,
    IDEMPOTENCY_PENDING_TTL_SECONDS,
    IDEMPOTENCY_TTL_SECONDS,
    INGEST_DOCS_KEY,
    INGEST_KEY,
    SEARCH_KEY,
    STATS_KEY,
    STATS_UNTRACKED_KEY,
    WEBHOOKS_OWED_KEY,
    WRITE_VERSION_TENANT_KEY,
)
from worker.contract import DocumentIn, ErrorInfo, RerankInfo, SearchResult, SearchSpec, Usage
from worker.observability.metrics import RETRIEVAL_CHANNELS
from worker.queue.jobstore import (
    AsyncJobStore,
    CancelOutcome,
    IdempotencyClaim,
    IdempotencyKeyBound,
    IdempotencyOutcome,
    IdempotencyRef,
    ItemTransition,
    JobStore,
)
from worker.queue.jobstore.batches import STAGES
from worker.queue.jobstore.jobindex import job_index_key
from worker.queue.jobstore.searches import _create_search_call, _new_search

pytestmark = pytest.mark.integration


def result(tag: str) -> SearchResult:
    return SearchResult(hits=[], rerank=RerankInfo(applied=False, fallback_reason=tag))


def spec(query: str = "q") -> SearchSpec:
    return SearchSpec(index="docs", query=query)


def _lose_the_first_exec_reply(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Break the connection once, after the first MULTI's EXEC reached Redis and its reply
    was read: the reply is thrown away, as a connection cut then loses it. Answers a flag
    set once that happened."""
    from redis.client import Pipeline

    real_parse = Pipeline.parse_response
    broken = [False]

    def parse_then_break(self: Pipeline, *args: object, **kwargs: object) -> object:
        reply = real_parse(self, *args, **kwargs)
        if isinstance(reply, list) and self.explicit_transaction and not broken[0]:
            broken[0] = True  # EXEC's reply, read and thrown away
            raise redis.ConnectionError("reply lost")
        return reply

    monkeypatch.setattr(Pipeline, "parse_response", parse_then_break)
    return broken


def _lose_the_first_script_reply(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Break the connection once, after the first script call (``EVALSHA``) reached Redis and
    its reply was read: the reply is thrown away, as a connection cut then loses it. Answers
    a flag set once that happened."""
    real_parse = redis.Redis.parse_response
    broken = [False]

    def parse_then_break(self: redis.Redis, connection: Any, command: str, **options: Any) -> Any:
        reply = real_parse(self, connection, command, **options)
        if command == "EVALSHA" and not broken[0]:
            broken[0] = True  # the script's reply, read and thrown away
            raise redis.ConnectionError("reply lost")
        return reply

    monkeypatch.setattr(redis.Redis, "parse_response", parse_then_break)
    return broken


def test_a_search_is_finished_once(store: JobStore) -> None:
    job = store.create_search("acme", spec())
    assert store.start_search(job.id)
    assert store.start_search(job.id)  # a redelivery may start it again
    assert store.finish_search(job.id, result=result("first"))
    assert not store.finish_search(job.id, result=result("second"))
    assert not store.finish_search(job.id, error=ErrorInfo(type="x", message="late"))
    assert not store.start_search(job.id)
    done = store.get_search(job.id)
    assert done is not None and done.status == "succeeded"
    assert done.result is not None and done.result.rerank.fallback_reason == "first"
    assert done.error is None
    assert store.in_flight() == {"queued": 0, "running": 0}


def test_the_bytes_a_job_owes_are_added_at_its_create_and_released_as_its_items_end(
    store: JobStore, redis_url: str
) -> None:
    """What the gateway priced a job's results at is owed (``owed_bytes`` in the stats hash)
    from the script or MULTI that counts it queued to the scripts that end it: a search's
    finish, a batch item's finish or cancel, a batch's cancel (an even share an item, rounded
    up). Once nothing is queued or running, nothing is owed, whatever a worker of an earlier
    release left unreleased; the gateway's reading never goes below zero."""

    def owed() -> int | None:
        value = store.redis.hget(STATS_KEY, "owed_bytes")
        return None if value is None else int(value)

    store.redis.hset(STATS_KEY, "owed_bytes", 7_000)  # left by a worker of an earlier release
    search = store.create_search("acme", spec(), owed_bytes=1_000)
    assert owed() == 8_000
    batch = store.create_batch(
        "acme", "docs", [(f"q{i}", spec()) for i in range(4)], owed_bytes=4_003
    )
    assert owed() == 8_000 + 4 * 1_001
    assert store.start_search(search.id) and owed() == 8_000 + 4 * 1_001  # still owed
    assert store.finish_search(search.id, result=result("s"))
    assert owed() == 7_000 + 4 * 1_001
    assert store.start_item(batch.id, "q0")
    assert store.finish_item(batch.id, "q0", result=result("q0")).applied
    assert owed() == 7_000 + 3 * 1_001
    assert not store.finish_item(batch.id, "q0", result=result("again")).applied
    assert store.cancel_item(batch.id, "q1").applied and owed() == 7_000 + 2 * 1_001
    assert store.start_item(batch.id, "q2")  # running: the batch's cancel leaves it
    assert store.cancel_batch(batch.id) == (1, False) and owed() == 7_000 + 1_001
    assert store.finish_item(batch.id, "q2", error=ErrorInfo(type="x", message="m")).applied
    assert store.in_flight() == {"queued": 0, "running": 0}
    assert owed() is None  # nothing queued or running: the 7,000 left over went with it
    unpriced = store.create_search("acme", spec())  # no maxmemory, or an earlier gateway's
    assert owed() is None and store.finish_search(unpriced.id, result=result("u"))
    store.redis.hset(STATS_KEY, "owed_bytes", -5)  # whatever drift: read as none

    async def read() -> int:
        async_store = AsyncJobStore.from_url(redis_url, max_connections=1)
        try:
            return await async_store.owed_bytes()
        finally:
            await async_store.close()

    assert asyncio.run(read()) == 0


def test_each_final_move_with_a_webhook_records_it_owed_until_settled(store: JobStore) -> None:
    """A search's finish, a batch's last item and a cancel completing a batch record the
    webhook owed, in their own script, scored at the move; a job with no webhook, an ingest
    and a move that is not final record nothing."""
    hook = "https://example.com/hook"
    search = store.create_search("acme", spec(), webhook_url=hook)
    silent = store.create_search("acme", spec())
    batch = store.create_batch("acme", "docs", [("a", spec()), ("b", spec())], webhook_url=hook)
    canceled = store.create_batch("acme", "docs", [("a", spec())], webhook_url=hook)
    ingest = store.create_ingest("acme", "docs", [DocumentIn(id="d", text="t")])
    assert store.start_search(search.id) and store.start_search(silent.id)
    assert store.start_item(batch.id, "a") and store.start_ingest(ingest.id)
    store.finish_item(batch.id, "a", result=result("a"))
    assert store.redis.zcard(WEBHOOKS_OWED_KEY) == 0  # nothing final with a hook yet
    before = clock.now()  # the clock a record's times are on (worker/clock.py)
    assert store.finish_search(search.id, result=result("s"))
    assert store.finish_search(silent.id, result=result("s"))
    assert store.finish_ingest(ingest.id, upserted=1)
    assert store.finish_item(batch.id, "b", result=result("b")).batch_completed
    assert store.cancel_batch(canceled.id) == (1, True)
    owed = dict(store.redis.zrange(WEBHOOKS_OWED_KEY, 0, -1, withscores=True))
    assert set(owed) == {search.id, batch.id, canceled.id}
    assert all(before <= when <= clock.now() for when in owed.values())
    assert set(store.webhooks_overdue(time.time() + 1, 10)) == set(owed)
    store.webhook_due(search.id, time.time() + 60)  # a retry's time: later only
    store.webhook_due(search.id, 0)
    assert set(store.webhooks_overdue(time.time() + 1, 10)) == {batch.id, canceled.id}
    for job_id in owed:
        store.webhook_settled(job_id, "delivered", 1)
    store.webhook_due(search.id, time.time())  # settled: not owed again
    assert store.redis.zcard(WEBHOOKS_OWED_KEY) == 0


def test_a_cancel_completing_a_removed_tenant_s_batch_writes_no_webhook_message(
    store: JobStore,
) -> None:
    """A batch with an item failed ``tenant_removed``, completed by a cancel: its webhook
    settles ``failed`` after 0 attempts in the cancel's script (no key is left to sign it),
    and the cancel writes no webhook message. It wrote one, whose task found the webhook
    settled and dropped it as a copy ("settled already; this copy is dropped")."""
    from worker.queue.jobstore import WebhookState

    hook = "https://hooks.example/x"
    batch = store.create_batch("acme", "docs", [("a", spec()), ("b", spec())], webhook_url=hook)
    assert store.start_item(batch.id, "a")
    removed = ErrorInfo(type=ERROR_TENANT_REMOVED, message="tenant 'acme' has no key")
    assert store.finish_item(batch.id, "a", error=removed).applied
    hooks = [("q.hooks", "batch.completed")]
    assert store.cancel_batch(batch.id, announce=hooks) == (1, True)
    got = store.get_batch(batch.id)
    assert got is not None and got.webhook == WebhookState("failed", 0)
    assert store.redis.zscore(WEBHOOKS_OWED_KEY, batch.id) is None
    assert store.redis.llen("q.hooks") == 0


def test_a_job_s_record_says_where_its_webhook_stands_in_every_order(store: JobStore) -> None:
    """None without a webhook_url; pending, then retrying with the attempts made (a retry
    recorded), then how it ended: a copy's delivery is never overwritten by another copy's
    failure, and a delivery after a give-up is shown (the receiver got it)."""
    from worker.queue.jobstore import WebhookState

    hook = "https://hooks.example/x"
    silent = store.create_search("acme", spec())
    search = store.create_search("acme", spec(), webhook_url=hook)
    batch = store.create_batch("acme", "docs", [("a", spec())], webhook_url=hook)
    given_up = store.create_search("acme", spec(), webhook_url=hook)
    assert store.start_search(search.id) and store.finish_search(search.id, result=result("s"))
    assert store.start_search(given_up.id)
    assert store.finish_search(given_up.id, result=result("s"))
    assert store.start_item(batch.id, "a") and store.finish_item(batch.id, "a", result=result("a"))

    def state(job_id: str) -> WebhookState | None:
        job = store.get_batch(job_id) if job_id == batch.id else store.get_search(job_id)
        assert job is not None
        return job.webhook

    assert state(silent.id) is None
    assert state(search.id) == WebhookState("pending", 0)
    assert store.webhook_due(search.id, time.time() + 60, 2)  # attempt 1 failed, 2 due
    assert state(search.id) == WebhookState("retrying", 1)
    store.webhook_settled(search.id, "delivered", 2)
    store.webhook_settled(search.id, "failed", 3)  # a copy failing after: its end not shown
    assert state(search.id) == WebhookState("delivered", 3)  # its attempt was made
    store.webhook_settled(batch.id, "failed", 1)  # refused
    assert state(batch.id) == WebhookState("failed", 1)
    store.webhook_settled(given_up.id, "failed", 8)  # the schedule spent
    assert state(given_up.id) == WebhookState("failed", 8)
    store.webhook_settled(given_up.id, "delivered", 3)  # a copy in flight delivered after all
    assert state(given_up.id) == WebhookState("delivered", 8)  # its own count: not fewer shown
    store.webhook_settled(given_up.id, "failed", 9)  # yet another copy fails after
    assert state(given_up.id) == WebhookState("delivered", 9)


def test_the_attempts_a_webhook_shows_never_go_down(store: JobStore) -> None:
    """A copy settling with fewer attempts than its schedule's recorded retry implies (a
    copy started before the retries) shows the attempts made, not its own count."""
    from worker.queue.jobstore import WebhookState

    job = store.create_search("acme", spec(), webhook_url="https://hooks.example/x")
    assert store.start_search(job.id) and store.finish_search(job.id, result=result("s"))
    assert store.webhook_due(job.id, time.time() + 60, 5)  # attempts 1-4 failed, 5 due
    store.webhook_settled(job.id, "delivered", 1)  # the first message's copy got through
    got = store.get_search(job.id)
    assert got is not None and got.webhook == WebhookState("delivered", 4)


def test_a_webhook_an_older_release_settled_stays_unknown(store: JobStore) -> None:
    """An older Sift's settled mark ("1": delivered or not, it did not say) shows null, and a
    copy failing after it does not overwrite it with ``failed`` (it may have been delivered)."""
    job = store.create_search("acme", spec(), webhook_url="https://hooks.example/x")
    assert store.start_search(job.id) and store.finish_search(job.id, result=result("s"))
    store.redis.hset(SEARCH_KEY + job.id, "webhook_settled", "1")  # as an older release wrote
    assert (got := store.get_search(job.id)) is not None and got.webhook is None
    store.webhook_settled(job.id, "failed", 2)
    assert (got := store.get_search(job.id)) is not None and got.webhook is None
    assert store.redis.hget(SEARCH_KEY + job.id, "webhook_settled") == "1"


def test_a_webhook_a_release_before_its_fields_sent_is_unknown_not_pending(
    store: JobStore,
) -> None:
    """A final job a release before 86d62aa ended (a293bac: no webhook field, only
    ``webhook_url``, and no ``sift:webhooks-owed``, whose worker sent the webhook itself)
    shows null, not ``pending`` with 0 attempts forever; a final job of today's whose
    webhook is owed still shows ``pending``, in its GET and in the batch list."""
    from worker.queue.jobstore import WebhookState

    hook = "https://hooks.example/x"
    old_search, old_batch = "srch_" + "0" * 32, "bat_" + "0" * 32
    at = repr(time.time())
    store.redis.hset(SEARCH_KEY + old_search, mapping={  # the fields a293bac wrote
        "kind": "search", "tenant": "acme", "status": "succeeded",
        "spec": spec().model_dump_json(), "webhook_url": hook, "created_at": at,
        "started_at": at, "finished_at": at, "result": result("s").model_dump_json(),
    })  # fmt: skip
    store.redis.hset(BATCH_KEY + old_batch, mapping={
        "tenant": "acme", "index": "docs", "lane": "standard", "rerank": "",
        "webhook_url": hook, "total": "1", "created_at": at, "finished_at": at,
    })  # fmt: skip
    store.redis.hset(BATCH_COUNTS_KEY + old_batch, mapping={"succeeded": 1})
    store.redis.zadd(job_index_key("batch", "acme"), {old_batch: float(at)})
    search = store.create_search("acme", spec(), webhook_url=hook)
    batch = store.create_batch("acme", "docs", [("a", spec())], webhook_url=hook)
    assert store.start_search(search.id) and store.finish_search(search.id, result=result("s"))
    assert store.start_item(batch.id, "a") and store.finish_item(batch.id, "a", result=result("a"))

    pending = WebhookState("pending", 0)
    got = [store.get_search(old_search), store.get_batch(old_batch)]
    assert [job.webhook if job else "gone" for job in got] == [None, None]
    got = [store.get_search(search.id), store.get_batch(batch.id)]
    assert [job.webhook if job else "gone" for job in got] == [pending, pending]
    listed = store.list_batches("acme", status=None, after=None, page_size=10).jobs
    assert {job.id: job.webhook for job in listed} == {old_batch: None, batch.id: pending}
    running = store.create_search("acme", spec(), webhook_url=hook)  # not final: none sent
    assert (got_running := store.get_search(running.id)) and got_running.webhook == pending


def test_a_redelivered_item_never_produces_a_second_result(store: JobStore) -> None:
    batch = store.create_batch("acme", "docs", [(f"q{i}", spec()) for i in range(3)])
    assert store.start_item(batch.id, "q0") and store.start_item(batch.id, "q0")
    first = store.finish_item(batch.id, "q0", result=result("first"))
    again = store.finish_item(batch.id, "q0", error=ErrorInfo(type="x", message="again"))
    assert first.applied and not again.applied
    [outcome] = store.batch_results(batch.id, 0, 1)
    assert outcome.status == "succeeded" and '"first"' in (outcome.payload or "")
    got = store.get_batch(batch.id)
    assert got is not None
    assert got.counts == {"queued": 2, "running": 0, "succeeded": 1, "failed": 0, "canceled": 0}


def test_a_finish_sent_again_or_late_adds_to_its_batchs_totals_once(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the same finish sent again (its reply lost: the same token), and a second delivery's
    # finish (another token), are answered without adding the item's usage a second time
    batch = store.create_batch("acme", "docs", [("q0", spec()), ("q1", spec())])
    assert store.start_item(batch.id, "q0")
    used = Usage(requests=2, input_tokens=900, output_tokens=40, cost_usd=0.0011)
    paid = SearchResult(hits=[], rerank=RerankInfo(applied=True), usage=used)
    monkeypatch.setattr("worker.queue.jobstore.store.move_token", lambda: "the-same-token")
    assert store.finish_item(batch.id, "q0", result=paid).applied
    assert store.finish_item(batch.id, "q0", result=paid).applied  # answered as it ran
    monkeypatch.undo()
    assert not store.finish_item(batch.id, "q0", result=paid).applied
    assert store.start_item(batch.id, "q1")
    billed = Usage(requests=1, cost_usd=None)
    failed = ErrorInfo(type="rerank_failed", message="x", usage=billed, reason="malformed")
    monkeypatch.setattr("worker.queue.jobstore.store.move_token", lambda: "a-failure-token")
    assert store.finish_item(batch.id, "q1", error=failed).applied
    assert store.finish_item(batch.id, "q1", error=failed).applied  # answered as it ran
    monkeypatch.undo()
    assert not store.finish_item(batch.id, "q1", error=failed).applied
    got = store.get_batch(batch.id)
    assert got is not None
    assert got.usage == Usage(requests=3, input_tokens=900, output_tokens=40, cost_usd=None)
    assert got.rerank_outcomes == {"applied": 1, "fallback": 0, "skipped": 0}
    assert (got.failures, got.rerank_failures) == ({"rerank_failed": 1}, {"malformed": 1})


def test_a_batch_made_before_its_failures_were_counted_shows_them_unknown(
    store: JobStore,
) -> None:
    # made by a release that kept its totals but not its failures by kind: an item it failed
    # before the upgrade was never counted so, and the one failed since is not all of them
    batch = store.create_batch("acme", "docs", [("q0", spec()), ("q1", spec())])
    store.redis.hdel(BATCH_KEY + batch.id, "totals_failures")  # as that release wrote it
    assert store.start_item(batch.id, "q1")
    late = ErrorInfo(type="rerank_failed", message="x", reason="timeout")
    assert store.finish_item(batch.id, "q1", error=late).applied
    got = store.get_batch(batch.id)
    assert got is not None and got.counts["failed"] == 1
    assert (got.failures, got.rerank_failures) == (None, None)
    assert got.usage == Usage() and got.rerank_outcomes is not None  # those were kept


def test_counts_never_drift_under_racing_redeliveries_and_cancel(store: JobStore) -> None:
    n = 400
    store.create_search("acme", spec(), owed_bytes=1_000)  # queued throughout
    batch = store.create_batch(
        "acme", "docs", [(f"q{i}", spec()) for i in range(n)], owed_bytes=n * 100
    )
    completions: list[bool] = []
    canceled_by_a_start: list[str] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        order = list(range(n))
        rng.shuffle(order)
        for i in order:
            qid = f"q{i}"
            begun = store.begin_item(batch.id, qid)
            if begun.canceled:
                # running in another thread when the cancel came (so the cancel left it), and
                # started again here, as a redelivery would: the mark cancels it
                with lock:
                    canceled_by_a_start.append(qid)
                    completions.append(begun.batch_completed)
            elif begun.started:
                if rng.random() < 0.1:
                    t = store.finish_item(batch.id, qid, error=ErrorInfo(type="e", message="m"))
                else:
                    t = store.finish_item(batch.id, qid, result=result(str(seed)))
                with lock:
                    completions.append(t.batch_completed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    canceled = store.cancel_batch(batch.id)
    for t in threads:
        t.join()
    got = store.get_batch(batch.id)
    assert got is not None and canceled is not CancelOutcome.MISSING
    if canceled is CancelOutcome.ALREADY_FINISHED:  # the workers were done first
        canceled = (0, False)
    assert not isinstance(canceled, CancelOutcome)
    c = got.counts
    assert c["queued"] == c["running"] == 0
    assert c["succeeded"] + c["failed"] + c["canceled"] == n
    assert c["canceled"] == canceled[0] + len(canceled_by_a_start)
    assert len(set(canceled_by_a_start)) == len(canceled_by_a_start)  # each once
    outcomes = store.batch_results(batch.id, 0, n)
    assert [o.query_id for o in outcomes] == [f"q{i}" for i in range(n)]
    for status in ("succeeded", "failed", "canceled"):
        assert sum(o.status == status for o in outcomes) == c[status]
    assert sum(completions) + int(canceled[1]) == 1  # the batch completes exactly once
    assert got.finished_at is not None
    assert got.status == ("canceled" if c["canceled"] else "succeeded")
    # every item's share released once, whichever move or cancel ended it: the search's left
    assert store.in_flight() == {"queued": 1, "running": 0}
    assert store.redis.hget(STATS_KEY, "owed_bytes") == "1000"


def _snapshot(store: JobStore, batch_id: str) -> list[dict[str, str]]:
    """Every hash of a batch, and the deployment's stats, as stored."""
    keys = (BATCH_KEY, BATCH_ITEMS_KEY, BATCH_COUNTS_KEY, BATCH_RESULTS_KEY)
    return [store.redis.hgetall(k + batch_id) for k in keys] + [store.redis.hgetall(STATS_KEY)]


def test_a_batchs_totals_are_its_final_items_summed_under_racing_finishes_and_cancel(
    store: JobStore,
) -> None:
    # threads finish, fail and cancel (with billed usage) the same items in random orders, as
    # redeliveries would, while the batch is canceled: whatever outcome won each item, the
    # batch's totals are the sums of the outcomes its results hash holds
    n = 300
    batch = store.create_batch("acme", "docs", [(f"q{i}", spec()) for i in range(n)])
    seconds: dict[str, dict[str, float]] = {}  # the stages of each result that won its item

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        order = list(range(n))
        rng.shuffle(order)
        for i in order:
            qid = f"q{i}"
            store.begin_item(batch.id, qid)  # started or not, it sends its outcome (late)
            used = Usage(
                requests=rng.randint(1, 3),
                input_tokens=rng.randint(0, 5000),
                output_tokens=rng.randint(0, 90),
                cache_read_input_tokens=rng.choice([0, 700]),
                cost_usd=rng.uniform(1e-6, 0.01),
            )
            pick = rng.random()
            timed = {"queue_wait": rng.uniform(0, 9), "rerank": rng.random()}
            if pick < 0.05:  # a failure before its rerank: no class, no seconds
                late = ErrorInfo(type="deadline_exceeded", message="m", usage=used)
                store.finish_item(batch.id, qid, error=late)
            elif pick < 0.15:  # a failed rerank: its seconds count as its usage does
                why = rng.choice(["malformed", "timeout", "budget_exhausted"])
                failed = ErrorInfo(type="rerank_failed", message="m", usage=used, reason=why)
                failed._stage_seconds = timed
                if store.finish_item(batch.id, qid, error=failed).applied:
                    seconds[qid] = timed
            elif pick < 0.3:
                store.cancel_item(batch.id, qid, usage=used)
            else:
                reason = rng.choice([None, "no_valid_ranks"])
                info = RerankInfo(applied=reason is None and pick < 0.8, fallback_reason=reason)
                done = SearchResult(hits=[], rerank=info, usage=used)
                done._stage_seconds = timed
                if store.finish_item(batch.id, qid, result=done).applied:
                    seconds[qid] = timed

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    while (now := store.get_batch(batch.id)) is not None and now.counts["queued"] > n // 2:
        time.sleep(0.001)
    store.cancel_batch(batch.id)  # half way through
    for t in threads:
        t.join()
    got = store.get_batch(batch.id)
    assert got is not None and got.finished_at is not None
    outcomes = [json.loads(o.payload) for o in store.batch_results(batch.id, 0, n) if o.payload]
    usages = [Usage(**(o.get("result") or o.get("error") or o)["usage"]) for o in outcomes]
    summed = sum(usages, Usage())
    assert got.usage.model_dump(exclude={"cost_usd"}) == summed.model_dump(exclude={"cost_usd"})
    assert summed.cost_usd is not None and got.usage.cost_usd == pytest.approx(summed.cost_usd)
    ranked = [o["result"]["rerank"] for o in outcomes if "result" in o]
    assert got.rerank_outcomes == {
        "applied": sum(1 for r in ranked if r["applied"]),
        "fallback": sum(1 for r in ranked if not r["applied"] and r["fallback_reason"]),
        "skipped": sum(1 for r in ranked if not r["applied"] and not r["fallback_reason"]),
    }
    assert got.stage_seconds == pytest.approx(
        {s: sum(won[s] for won in seconds.values()) for s in ("queue_wait", "rerank")}
    )
    assert sum(got.rerank_outcomes.values()) == got.counts["succeeded"] > 0
    assert got.counts["failed"] > 0 and got.counts["canceled"] > 0
    # its failures by type, and its failed reranks by class, as its results show them
    errors = [o["error"] for o in outcomes if "error" in o]
    assert got.failures == Counter(e["type"] for e in errors)
    assert got.rerank_failures == Counter(e["reason"] for e in errors if "reason" in e)
    assert sum(got.failures.values()) == got.counts["failed"]
    assert got.failures["deadline_exceeded"] > 0 and len(got.rerank_failures) == 3


def test_a_batchs_stage_seconds_follow_the_pipeline_with_native_fusion(store: JobStore) -> None:
    """An item that Elasticsearch fused natively (its ``rrf`` stage, the one request in place
    of bm25, knn and fuse) shows that stage before the rerank, as it ran: it sorted last. Its
    wait for a CPU slot (``slot_wait``) comes between its queue's and its embedding, as it ran:
    it sorted last too."""
    batch = store.create_batch("acme", "docs", [("q0", spec()), ("q1", spec())])
    ran = [("queue_wait", 0.5), ("slot_wait", 0.0625), ("embed", 0.25), ("rrf", 0.125)]
    ran.append(("rerank", 1.0))
    for qid in ("q0", "q1"):
        store.begin_item(batch.id, qid)
        done = SearchResult(hits=[], rerank=RerankInfo(applied=True), usage=Usage())
        done._stage_seconds = dict(ran)
        assert store.finish_item(batch.id, qid, result=done).applied
    got = store.get_batch(batch.id)
    assert got is not None and got.stage_seconds is not None
    assert list(got.stage_seconds.items()) == [(stage, 2 * s) for stage, s in ran]


def test_every_retrieval_stage_has_its_place_in_a_batchs_stage_order() -> None:
    """The stages a search's time is split into (the metric's closed channel set) each have a
    place in the batch's order, before the rerank: none is left to sort last."""
    assert set(RETRIEVAL_CHANNELS) <= set(STAGES)
    assert STAGES[0] == "queue_wait" and STAGES[-1] == "rerank"


def test_a_finished_batch_is_not_canceled_and_nothing_changes(store: JobStore) -> None:
    batch = store.create_batch("acme", "docs", [(f"q{i}", spec()) for i in range(3)])
    for i in range(3):
        assert store.start_item(batch.id, f"q{i}")
        store.finish_item(batch.id, f"q{i}", result=result(str(i)))
    before = _snapshot(store, batch.id)
    for _ in range(2):
        assert store.cancel_batch(batch.id) is CancelOutcome.ALREADY_FINISHED
    assert _snapshot(store, batch.id) == before
    got = store.get_batch(batch.id)
    assert got is not None and got.status == "succeeded" and got.canceled_at is None


def test_items_taken_but_not_past_their_start_or_model_call_are_canceled(
    store: JobStore,
) -> None:
    """A cancel marks the batch; an item a worker had started (running, before its model
    call) is canceled by its check, and one redelivered after the cancel by its start."""
    batch = store.create_batch("acme", "docs", [(f"q{i}", spec()) for i in range(4)])
    for i in range(3):
        assert store.start_item(batch.id, f"q{i}")  # q3 stays queued
    assert store.cancel_batch(batch.id) == (1, False)  # only q3 was queued
    assert store.cancel_batch(batch.id) == (0, False)  # cancel twice: nothing more
    check = store.check_item(batch.id, "q0")
    assert check.applied and check.canceled and not check.started
    again = store.begin_item(batch.id, "q1")  # a redelivered chunk restarts q1
    assert again.applied and again.canceled and not again.started
    done = store.finish_item(batch.id, "q2", result=result("past its model call"))
    assert done.applied and done.batch_completed and not done.canceled
    got = store.get_batch(batch.id)
    assert got is not None and got.status == "canceled"
    assert got.counts == {"queued": 0, "running": 0, "succeeded": 1, "failed": 0, "canceled": 3}
    assert store.in_flight() == {"queued": 0, "running": 0}
    assert not store.check_item(batch.id, "q2").applied  # final: the check stops it too


def test_the_check_before_the_model_call_changes_nothing_without_a_cancel(
    store: JobStore,
) -> None:
    batch = store.create_batch("acme", "docs", [("a", spec()), ("b", spec())])
    assert store.start_item(batch.id, "a")
    before = _snapshot(store, batch.id)
    check = store.check_item(batch.id, "a")
    assert check.applied and not check.canceled and not check.batch_completed
    assert _snapshot(store, batch.id) == before
    assert not store.check_item(batch.id, "b").applied  # not started: no model call either


def _race_the_last_finish(store: JobStore, jitter: bool) -> str:
    """One round: item "b", the last, is running; its worker checks the mark and finishes
    while a cancel comes. Checks that everything agrees; answers which order it was."""
    batch = store.create_batch("acme", "docs", [("a", spec()), ("b", spec())])
    store.start_item(batch.id, "a")
    store.finish_item(batch.id, "a", result=result("a"))
    store.start_item(batch.id, "b")
    go = threading.Barrier(2)
    worker: list[ItemTransition] = []
    cancel: list[object] = []

    def work() -> None:
        go.wait()
        check = store.check_item(batch.id, "b")
        worker.append(check)
        if check.started:
            worker.append(store.finish_item(batch.id, "b", result=result("b")))

    def cancel_it() -> None:
        go.wait()
        if jitter:
            time.sleep(random.random() / 1000)
        cancel.append(store.cancel_batch(batch.id))

    threads = [threading.Thread(target=work), threading.Thread(target=cancel_it)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = store.get_batch(batch.id)
    assert got is not None and got.finished_at is not None
    c = got.counts
    assert c["queued"] == c["running"] == 0 and c["succeeded"] + c["canceled"] == 2
    [answer] = cancel
    assert sum(t.batch_completed for t in worker) == 1  # the batch completes exactly once
    if answer is CancelOutcome.ALREADY_FINISHED:  # the finish won: nothing changed
        assert got.status == "succeeded" and got.canceled_at is None
        return "finished first"
    assert answer == (0, False)  # b was running, not queued
    if worker[0].canceled:  # the cancel came before the check: b canceled there
        assert len(worker) == 1 and got.status == "canceled" and c["canceled"] == 1
        return "canceled before the check"
    # between the check and the finish: b was past its model call, and finished
    assert got.status == "succeeded" and got.canceled_at is not None
    return "canceled after the check"


def test_a_cancel_racing_the_last_finish_is_decided_by_one_side(store: JobStore) -> None:
    """Whichever order the scripts run in, the status, the counts, the cancel's answer and
    the single completion agree."""
    seen = {_race_the_last_finish(store, jitter=i % 3 > 0) for i in range(150)}
    print(f"orders seen: {sorted(seen)}")
    assert len(seen) >= 2  # the race went more than one way


def test_a_status_change_sent_again_after_it_ran_answers_as_it_ran(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py sends a command again when the connection broke with its reply still out (a
    Redis restart, a network blip): every status change here runs twice, as it then does.
    The second run answers what the first did and changes nothing more, so a finish is
    still announced (webhook, count), the finish that completed a batch still says so, and
    a cancel still says what it canceled (not ``already_finished``); its webhook, written
    by the cancel when it completes the batch, is written once."""
    real_scripts, real_cancel = store._evalsha_all, store._cancel_batch

    def twice(calls: list[Any]) -> list[Any]:
        real_scripts(calls)
        return real_scripts(calls)

    def cancel_twice(**kwargs: Any) -> Any:
        real_cancel(**kwargs)
        return real_cancel(**kwargs)

    monkeypatch.setattr(store, "_evalsha_all", twice)
    monkeypatch.setattr(store, "_cancel_batch", cancel_twice)
    job = store.create_search("acme", spec())
    assert store.start_search(job.id)
    assert store.finish_search(job.id, result=result("r"))
    assert not store.finish_search(job.id, result=result("late"))  # another call: refused
    assert store.get_search_status(job.id) == "succeeded"

    single = store.create_batch("acme", "docs", [("a", spec())])
    assert store.start_item(single.id, "a")
    done = store.finish_item(single.id, "a", result=result("r"))
    assert done.applied and done.batch_completed

    batch = store.create_batch("acme", "docs", [(f"q{i}", spec()) for i in range(3)])
    assert store.start_item(batch.id, "q0")
    assert store.finish_item(batch.id, "q0", result=result("r")) == ItemTransition(True)
    assert store.start_item(batch.id, "q1")
    hooks = [("q.hooks", "batch.completed")]
    assert store.cancel_batch(batch.id, announce=hooks) == (1, False)  # q2; q1 is running
    stopped = store.check_item(batch.id, "q1")  # before its model call: canceled
    assert stopped == ItemTransition(applied=True, batch_completed=True, canceled=True)
    assert store.redis.llen("q.hooks") == 0  # the worker that completed it announces it
    got = store.get_batch(batch.id)
    assert got is not None and got.status == "canceled"
    assert got.counts == {"queued": 0, "running": 0, "succeeded": 1, "failed": 0, "canceled": 2}

    queued = store.create_batch("acme", "docs", [(f"q{i}", spec()) for i in range(2)])
    assert store.cancel_batch(queued.id, announce=hooks) == (2, True)
    assert store.redis.lrange("q.hooks", 0, -1) == ["batch.completed"]  # once
    assert store.cancel_batch(queued.id, announce=hooks) is CancelOutcome.ALREADY_FINISHED
    assert store.redis.llen("q.hooks") == 1
    assert store.in_flight() == {"queued": 0, "running": 0}


def test_finish_and_start_item_moves_both_in_one_call(store: JobStore) -> None:
    batch = store.create_batch("acme", "docs", [(f"q{i}", spec()) for i in range(3)])
    assert store.start_item(batch.id, "q0")
    done, started = store.finish_and_start_item(
        batch.id, "q0", result=result("r"), start=(batch.id, "q1")
    )
    assert done.applied and not done.batch_completed and started and started.started
    got = store.get_batch(batch.id)
    assert got is not None
    assert got.counts == {"queued": 1, "running": 1, "succeeded": 1, "failed": 0, "canceled": 0}
    assert store.cancel_item(batch.id, "q2").applied
    done, started = store.finish_and_start_item(
        batch.id, "q1", error=ErrorInfo(type="e", message="m"), start=(batch.id, "q2")
    )
    assert done.applied and done.batch_completed  # q2 was canceled: the batch is complete
    assert started is not None and not started.applied  # a canceled item does not start
    got = store.get_batch(batch.id)
    assert got is not None
    assert got.counts == {"queued": 0, "running": 0, "succeeded": 1, "failed": 1, "canceled": 1}


def test_transitions_of_many_threads_share_round_trips_and_keep_their_own_answers(
    store: JobStore, round_trips: list[int]
) -> None:
    n = 300
    batch = store.create_batch("acme", "docs", [(f"q{i}", spec()) for i in range(n)])
    barrier = threading.Barrier(30)
    answers: dict[str, tuple[bool, bool]] = {}

    def worker(k: int) -> None:
        barrier.wait()
        for i in range(k, n, 30):
            started = store.start_item(batch.id, f"q{i}")
            again = store.start_item(batch.id, f"q{i}")  # a redelivery starts it again
            done = store.finish_item(batch.id, f"q{i}", result=result(f"r{i}"))
            late = store.finish_item(batch.id, f"q{i}", result=result("late"))
            answers[f"q{i}"] = (started and again and done.applied, late.applied)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == {f"q{i}": (True, False) for i in range(n)}
    assert sum(round_trips) == 4 * n
    assert len(round_trips) < 4 * n  # some round trips carried several
    outcomes = store.batch_results(batch.id, 0, n)
    assert all(f'"r{i}"' in (o.payload or "") for i, o in enumerate(outcomes))


def test_transitions_reload_their_script_after_the_server_forgets_it(store: JobStore) -> None:
    batch = store.create_batch("acme", "docs", [("a", spec())])
    assert store.start_item(batch.id, "a")
    store.redis.script_flush()  # what a Redis restart does to the script cache
    other = store.create_batch("acme", "docs", [("b", spec())])  # a start in another batch
    done, started = store.finish_and_start_item(
        batch.id, "a", result=result("r"), start=(other.id, "b")
    )
    assert done.applied and started is not None and started.started
    assert store.start_search(store.create_search("acme", spec()).id)


BATCH_PREFIXES = (
    BATCH_KEY,
    BATCH_ORDER_KEY,
    BATCH_SPECS_KEY,
    BATCH_ITEMS_KEY,
    BATCH_COUNTS_KEY,
    BATCH_RESULTS_KEY,
    BATCH_MOVES_KEY,
)


def test_every_final_record_has_a_ttl(store: JobStore) -> None:
    job = store.create_search("acme", spec())
    store.finish_search(job.id, result=result("r"))
    batch = store.create_batch("acme", "docs", [("a", spec())])
    store.start_item(batch.id, "a")
    store.finish_item(batch.id, "a", result=result("r"))
    keys = [SEARCH_KEY + job.id] + [prefix + batch.id for prefix in BATCH_PREFIXES]
    for key in keys:
        assert 0 < int(store.redis.ttl(key)) <= 7 * 24 * 3600, key


def _job_of(store: JobStore, kind: str) -> tuple[str, str, Any, Any]:
    """A new ``kind`` job of one item: its id, the stats hash counting it, and how to start
    and to finish it."""
    if kind == "search":
        job_id = store.create_search("acme", spec()).id
        return (
            job_id,
            STATS_KEY,
            lambda: store.start_search(job_id),
            lambda: store.finish_search(job_id, result=result("r")),
        )
    if kind == "batch":
        job_id = store.create_batch("acme", "docs", [("a", spec())]).id
        return (
            job_id,
            STATS_KEY,
            lambda: store.start_item(job_id, "a"),
            lambda: store.finish_item(job_id, "a", result=result("r")),
        )
    job_id = store.create_ingest("acme", "docs", [DocumentIn(id="d", text="t")]).id
    return (
        job_id,
        STATS_UNTRACKED_KEY,
        lambda: store.start_ingest(job_id),
        lambda: store.finish_ingest(job_id),
    )


@pytest.mark.parametrize("kind", ["search", "batch", "ingest"])
def test_a_job_not_final_outlives_its_retention_and_is_counted_as_long(
    redis_url: str, store: JobStore, kind: str
) -> None:
    """``sift:stats:jobs`` counts the searches and batch items queued or running. A record
    kept its retention from its submission (or its last move) and expired while still queued
    or running (every worker stopped longer than the retention, or a backlog as long): its
    count stayed in the hash for good, the gauge and ``SIFT_MAX_BACKLOG``'s admission drifting
    up, its GET a 404 for a job the API had accepted. A job not final has no TTL: it stays,
    counted and watched by the re-drive, and its retention runs from its end."""
    short = JobStore.from_url(redis_url, result_ttl=1)
    try:
        job_id, stats, start, finish = _job_of(short, kind)
        for state, move in (("queued", None), ("running", start)):
            if move is not None:
                assert move()
            time.sleep(1.5)  # past the retention, 1 s from this move
            assert _counted(short, stats) == {"queued": 0, "running": 0, state: 1}
            assert job_id in short.stalled_jobs(0), state  # the re-drive still sees it
            assert _status(short, kind, job_id) == state
        finish()
        assert _counted(short, stats) == {"queued": 0, "running": 0}
        assert _status(short, kind, job_id) == "succeeded"
        time.sleep(1.5)  # its retention from its end
        assert _status(short, kind, job_id) is None
    finally:
        short.close()


def _counted(store: JobStore, stats: str) -> dict[str, int]:
    counts = {"queued": 0, "running": 0}
    return counts | {state: int(n) for state, n in store.redis.hgetall(stats).items()}


def _status(store: JobStore, kind: str, job_id: str) -> str | None:
    if kind == "batch":
        batch = store.get_batch(job_id)
        return None if batch is None else batch.status.value
    get = store.get_search_status if kind == "search" else store.get_ingest_status
    status = get(job_id)
    return None if status is None else status.value


@pytest.mark.parametrize("dies", [False, True], ids=["", "its process dying at once"])
@pytest.mark.parametrize("ending", ["its last item", "a cancel"])
def test_a_batch_lives_its_retention_from_its_end_not_its_submission(
    store: JobStore, monkeypatch: pytest.MonkeyPatch, ending: str, dies: bool
) -> None:
    """Retention is 7 days from a job's last write: a batch that ended on day 6.9 (an
    economy batch, a backlog) was gone from its GET and the list hours later, its keys'
    TTLs set once, at its submission (a search's and an ingest's move with their records).
    The script that ends the batch sets them: a second round trip after it (as before) was
    lost with a process that died between the two."""
    batch = store.create_batch("acme", "docs", [("a", spec()), ("b", spec())])
    for prefix in BATCH_PREFIXES:
        store.redis.expire(prefix + batch.id, 100)  # the batch is nearly 7 days old
    store.start_item(batch.id, "a")
    store.finish_item(batch.id, "a", result=result("r"))
    if dies:  # the process is gone once the ending script has run: no command after it

        def dead(*args: Any, **kwargs: Any) -> Any:
            raise SystemExit("the process died")

        monkeypatch.setattr(store.redis, "pipeline", dead)
    if ending == "a cancel":
        assert store.cancel_batch(batch.id) == (1, True)
    else:
        store.start_item(batch.id, "b")
        assert store.finish_item(batch.id, "b", result=result("r")).batch_completed
    for prefix in BATCH_PREFIXES:
        assert int(store.redis.ttl(prefix + batch.id)) > 7 * 24 * 3600 - 60, prefix


def test_a_batch_is_dated_at_its_commit_not_before_its_items_are_staged(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lists are newest first by ``created_at``, and a job created while a client pages
    through is on none of the following pages. A big batch stages its items first (100,000
    in about half a second): dated before that, one committed after another batch (made
    while it staged) was listed below it, on a page the client had not read yet."""
    stage = store._stage_items
    made: list[str] = []

    def staging(batch_id: str, specs: Any) -> None:
        stage(batch_id, specs)
        monkeypatch.setattr(store, "_stage_items", stage)
        # another batch made and committed meanwhile
        made.append(store.create_batch("acme", "docs", [("x", spec())]).id)

    monkeypatch.setattr(store, "_stage_items", staging)
    slow = store.create_batch("acme", "docs", [("a", spec())])
    other = store.get_batch(made[0])
    assert other is not None and slow.created_at >= other.created_at
    stored = store.get_batch(slow.id)
    assert stored is not None and stored.created_at == slow.created_at


def test_ingests_queued_and_running_are_counted_apart_and_come_back_to_zero(
    store: JobStore,
) -> None:
    """Ingests are not in the searches' queued and running gauge, but in a count of their
    own: its moves took one off ``queued`` that no creation had added, so it drifted down by
    one an ingest for good (-78 after 78 ingests)."""

    def untracked() -> dict[str, int]:
        counts = store.redis.hgetall(STATS_UNTRACKED_KEY)
        return {k: int(counts.get(k, 0)) for k in ("queued", "running")}

    first = store.create_ingest("acme", "docs", [DocumentIn(id="a", text="t")])
    second = store.create_ingest("acme", "docs", [DocumentIn(id="b", text="t")])
    assert untracked() == {"queued": 2, "running": 0}
    assert store.start_ingest(first.id) and store.start_ingest(second.id)
    assert store.requeue_ingest(second.id)
    assert untracked() == {"queued": 1, "running": 1}
    assert store.start_ingest(second.id)
    assert store.finish_ingest(first.id, upserted=1)
    assert store.finish_ingest(second.id, error=ErrorInfo(type="x", message="m"))
    assert untracked() == {"queued": 0, "running": 0}
    assert store.in_flight() == {"queued": 0, "running": 0}


def _versions_by_date(store: JobStore, tenant: str) -> list[tuple[str, int]]:
    """The tenant's ingest-kind jobs as ``GET /v1/ingestions`` orders them, oldest first,
    each with the write version its record holds (the one its worker applies)."""
    listed = store.redis.zrange(job_index_key("ingest", tenant), 0, -1)
    return [(j, int(store.redis.hget(INGEST_KEY + j, "version"))) for j in listed]


def test_an_ingest_accepted_while_another_s_documents_travel_is_versioned_as_it_is_listed(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big ingest of "d" and a small one of "d" accepted while the big one's documents were
    being sent: the big one took its write version before sending them and was dated after,
    so the small one held the higher version (its text the one the backend kept) yet was
    listed as the older write. Whichever is listed newer must hold the higher version."""
    from redis.connection import Connection

    marker = "big-ingest-" + "x" * 16
    send = Connection.send_packed_command
    made: list[str] = []

    def sending(self: Connection, command: Any, check_health: bool = True) -> None:
        parts = command if isinstance(command, list) else [command]
        if not made and any(marker.encode() in bytes(p) for p in parts):
            made.append(store.create_ingest("acme", "docs", [DocumentIn(id="d", text="s")]).id)
        send(self, command, check_health)

    monkeypatch.setattr(Connection, "send_packed_command", sending)
    big = store.create_ingest("acme", "docs", [DocumentIn(id="d", text=marker * 100_000)])
    monkeypatch.undo()
    listed = _versions_by_date(store, "acme")
    assert [j for j, _ in listed] == [made[0], big.id]  # the big one committed last
    assert listed[0][1] < listed[1][1], "the newest listed write is not the one that wins"
    stored = store.get_ingest(big.id)  # what the gateway answered is what the record holds
    assert stored is not None and stored.version == listed[1][1]
    assert (big.version, big.created_at) == (stored.version, stored.created_at)


def test_an_ingest_is_listed_above_one_dated_ahead_of_redis_s_clock(store: JobStore) -> None:
    """Redis's clock stepped back (or two ingests in one microsecond): a new ingest, whose
    write version is above every earlier one's, is dated after the newest ingest listed, not
    at the clock, which would list it below one it was accepted after."""
    first = store.create_ingest("acme", "docs", [DocumentIn(id="d", text="t")])
    ahead = first.created_at + 60.0  # as if dated before the clock went a minute back
    store.redis.zadd(job_index_key("ingest", "acme"), {first.id: ahead})
    store.redis.hset(INGEST_KEY + first.id, "created_at", repr(ahead))
    second = store.create_ingest("acme", "docs", [DocumentIn(id="d", text="u")])
    assert second.created_at > ahead and second.version is not None
    assert [j for j, _ in _versions_by_date(store, "acme")] == [first.id, second.id]
    stored = store.get_ingest(second.id)
    assert stored is not None and stored.created_at == second.created_at


def test_an_ingest_is_dated_after_its_documents_reach_redis(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A big ingest's documents (up to 32 MB) took tens of milliseconds on the wire inside
    its dated MULTI: a job committed while they travelled was dated after it yet was in the
    index first, so a client that read page 1 then met the big ingest on page 2, below what
    it had read. Here another ingest commits while the documents are being sent."""
    from redis.connection import Connection

    marker = "big-ingest-" + "x" * 16
    send = Connection.send_packed_command
    made: list[str] = []

    def sending(self: Connection, command: Any, check_health: bool = True) -> None:
        parts = command if isinstance(command, list) else [command]
        if not made and any(marker.encode() in bytes(p) for p in parts):
            made.append(store.create_ingest("acme", "docs", [DocumentIn(id="s", text="t")]).id)
        send(self, command, check_health)

    monkeypatch.setattr(Connection, "send_packed_command", sending)
    big = store.create_ingest("acme", "docs", [DocumentIn(id="b", text=marker * 100_000)])
    monkeypatch.undo()
    other = store.get_ingest(made[0])
    assert other is not None and big.created_at >= other.created_at
    listed = store.redis.zrange(job_index_key("ingest", "acme"), 0, -1)
    assert listed == [other.id, big.id]  # oldest first: the big one is the newest
    stored = store.get_ingest(big.id)
    assert stored is not None and stored.created_at == big.created_at


def test_an_ingest_s_documents_wait_for_its_commit_with_a_short_ttl(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documents are written before the record: a gateway that dies between the two
    leaves no job, no index entry, no message, and its documents for the staging TTL only;
    once committed they are kept for the ingest task."""

    def dead(*args: Any, **kwargs: Any) -> Any:
        raise SystemExit("the gateway died before its commit")

    with monkeypatch.context() as patch:
        patch.setattr(store, "_create_write_script", dead)
        with pytest.raises(SystemExit):
            store.create_ingest("acme", "docs", [DocumentIn(id="a", text="t")], enqueue=_msgs)
    (staged,) = store.redis.keys(INGEST_DOCS_KEY + "*")
    assert 0 < store.redis.ttl(staged) <= BATCH_STAGING_TTL_SECONDS
    assert store.redis.keys("sift:ingest:*") == [] and store.redis.llen("q.work") == 0
    assert store.redis.zcard(job_index_key("ingest", "acme")) == 0
    job = store.create_ingest("acme", "docs", [DocumentIn(id="b", text="t")], enqueue=_msgs)
    assert store.redis.ttl(INGEST_DOCS_KEY + job.id) > BATCH_STAGING_TTL_SECONDS
    assert store.ingest_documents(job.id) == [DocumentIn(id="b", text="t")]


def test_an_ingest_whose_reply_was_lost_is_not_written_twice(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a batch's: the connection breaks after the script that creates the record ran,
    its reply lost; sent again, it finds the record, writes nothing more (no second message,
    count, version or index entry), and answers the version and date the record holds."""
    broken = _lose_the_first_script_reply(monkeypatch)
    job = store.create_ingest("acme", "docs", [DocumentIn(id="a", text="t")], enqueue=_msgs)
    assert broken[0]
    assert (
        store.redis.llen("q.work") == 1 and store.redis.hget(STATS_UNTRACKED_KEY, "queued") == "1"
    )
    assert store.redis.zcard(job_index_key("ingest", "acme")) == 1
    assert store.ingest_documents(job.id) == [DocumentIn(id="a", text="t")]
    stored = store.get_ingest(job.id)
    assert stored is not None and (stored.version, stored.created_at) == (
        job.version,
        job.created_at,
    )
    assert store.redis.get(WRITE_VERSION_TENANT_KEY + "acme") == str(job.version)


def _msgs(job_id: str) -> list[tuple[str, str]]:
    return [("q.work", "msg:" + job_id)]


def test_idempotency_claims(store: JobStore) -> None:
    first = store.claim_idempotency("acme", "k", "fp1")
    assert first.outcome is IdempotencyOutcome.NEW
    assert store.claim_idempotency("acme", "k", "fp1").outcome is IdempotencyOutcome.IN_PROGRESS
    assert store.claim_idempotency("acme", "k", "fp2").outcome is IdempotencyOutcome.MISMATCH
    assert store.claim_idempotency("globex", "k", "fp2").outcome is IdempotencyOutcome.NEW
    job = store.create_search("acme", spec(), claim=IdempotencyRef("acme", "k", "fp1"))
    replay = store.claim_idempotency("acme", "k", "fp1")
    assert replay.outcome is IdempotencyOutcome.REPLAY and replay.job_id == job.id
    assert store.release_idempotency("globex", "k")
    assert store.claim_idempotency("globex", "k", "fp3").outcome is IdempotencyOutcome.NEW
    # a key bound to its job is never released: the request's reply may be what was lost
    assert not store.release_idempotency("acme", "k")
    assert store.claim_idempotency("acme", "k", "fp1").job_id == job.id


def test_a_key_used_again_is_kept_24_hours_from_its_last_use(store: JobStore) -> None:
    """``sift batch`` run again picks up its batch by the key, for 24 hours from the run
    before: a replay keeps the key that long again. Kept 24 hours from the job's creation
    only, a pick-up at hour 23 left it an hour, and a key chained after a canceled batch
    (the CLI's next key) outlived the key that led to it: a run after that made a second
    batch for the same file."""
    ref = IdempotencyRef("acme", "k", "fp")
    job = store.create_search("acme", spec(), claim=ref)
    [key] = store.redis.keys(IDEMPOTENCY_KEY + "*")
    store.redis.expire(key, 3600)  # hour 23
    replay = store.claim_idempotency("acme", "k", "fp")
    assert replay.outcome is IdempotencyOutcome.REPLAY and replay.job_id == job.id
    assert IDEMPOTENCY_TTL_SECONDS - 60 < store.redis.ttl(key) <= IDEMPOTENCY_TTL_SECONDS
    # a pending marker (no job yet) is not kept longer by a request that finds it
    assert store.claim_idempotency("acme", "p", "fp").outcome is IdempotencyOutcome.NEW
    marker = next(k for k in store.redis.keys(IDEMPOTENCY_KEY + "*") if k != key)
    assert store.claim_idempotency("acme", "p", "fp").outcome is IdempotencyOutcome.IN_PROGRESS
    assert store.redis.ttl(marker) <= IDEMPOTENCY_PENDING_TTL_SECONDS


def _jobs(store: JobStore) -> int:
    return len(store.redis.keys(SEARCH_KEY + "*")) + len(store.redis.keys(BATCH_KEY + "*"))


def test_a_key_bound_to_a_job_is_kept_24_hours_from_the_write_that_creates_the_job(
    store: JobStore,
) -> None:
    """The binding is in the job's own write, with the key's full TTL: the pending
    marker's expiry (a crashed request) never frees a key whose job exists."""
    ref = IdempotencyRef("acme", "k", "fp")
    assert store.claim_idempotency("acme", "k", "fp").outcome is IdempotencyOutcome.NEW
    [marker] = store.redis.keys(IDEMPOTENCY_KEY + "*")
    assert 0 < store.redis.ttl(marker) <= IDEMPOTENCY_PENDING_TTL_SECONDS
    job = store.create_search("acme", spec(), claim=ref)
    assert IDEMPOTENCY_PENDING_TTL_SECONDS < store.redis.ttl(marker) <= IDEMPOTENCY_TTL_SECONDS
    assert json.loads(store.redis.get(marker))["job"] == job.id
    batch = store.create_batch(
        "acme", "docs", [("a", spec())], claim=IdempotencyRef("acme", "b", "f")
    )
    [bound] = [k for k in store.redis.keys(IDEMPOTENCY_KEY + "*") if k != marker]
    assert json.loads(store.redis.get(bound))["job"] == batch.id
    assert store.redis.ttl(bound) > IDEMPOTENCY_PENDING_TTL_SECONDS


def test_a_batch_s_items_wait_for_its_commit_with_a_short_ttl(store: JobStore) -> None:
    """Items are written in slices before the record; until the commit they expire soon
    (a gateway that died in between leaves nothing for long), after it they are kept, as
    the record is, until the batch ends. No record, no message: nothing reads them
    meanwhile."""
    n = 2 * BATCH_STAGE_SLICE + 3
    store._stage_items("bat_staged", [(f"q{i}", spec().model_dump_json()) for i in range(n)])
    assert store.get_batch("bat_staged") is None
    for key in (BATCH_ORDER_KEY, BATCH_SPECS_KEY, BATCH_ITEMS_KEY):
        assert 0 < store.redis.ttl(key + "bat_staged") <= BATCH_STAGING_TTL_SECONDS
    batch = store.create_batch("acme", "docs", [(f"q{i}", spec()) for i in range(n)])
    assert store.redis.lrange(BATCH_ORDER_KEY + batch.id, 0, -1) == [f"q{i}" for i in range(n)]
    assert store.redis.hlen(BATCH_SPECS_KEY + batch.id) == n
    for key in (BATCH_KEY, BATCH_ORDER_KEY, BATCH_SPECS_KEY, BATCH_ITEMS_KEY, BATCH_COUNTS_KEY):
        assert store.redis.ttl(key + batch.id) == -1, key  # none until its end


@pytest.mark.parametrize("kind", ["search", "batch"])
def test_a_create_with_a_key_bound_to_another_job_writes_nothing(
    store: JobStore, kind: str
) -> None:
    """Two requests with one key that both got past the claim (the first one's marker
    expired while it was still on its way): the second create writes nothing and names the
    first job, or says the body differs."""

    def create(fp: str) -> str:
        ref = IdempotencyRef("acme", "k", fp)
        msgs = lambda job_id: [("q.work", "msg:" + job_id)]  # noqa: E731
        if kind == "search":
            return store.create_search("acme", spec(), enqueue=msgs, claim=ref).id
        return store.create_batch("acme", "docs", [("a", spec())], enqueue=msgs, claim=ref).id

    first = create("fp")
    before = (_jobs(store), store.redis.llen("q.work"), store.redis.hget(STATS_KEY, "queued"))
    with pytest.raises(IdempotencyKeyBound) as again:
        create("fp")
    assert again.value.claim == IdempotencyClaim(IdempotencyOutcome.REPLAY, first)
    with pytest.raises(IdempotencyKeyBound) as other:
        create("another body")
    assert other.value.claim.outcome is IdempotencyOutcome.MISMATCH
    after = (_jobs(store), store.redis.llen("q.work"), store.redis.hget(STATS_KEY, "queued"))
    assert after == before == (1, 1, "1")
    if kind == "batch":  # the items written before the commit were dropped with it
        assert len(store.redis.keys("sift:batch-*")) == 5  # the first batch's own


def test_a_pending_marker_of_another_request_does_not_block_the_create(store: JobStore) -> None:
    """Only a key bound to a job stops a create: a marker (this request's, or one left by a
    request that died before creating anything) is replaced by the binding."""
    store.claim_idempotency("acme", "k", "someone else's body")
    job = store.create_search("acme", spec(), claim=IdempotencyRef("acme", "k", "fp"))
    claim = store.claim_idempotency("acme", "k", "fp")
    assert claim == IdempotencyClaim(IdempotencyOutcome.REPLAY, job.id)


def test_a_search_create_run_twice_writes_once(store: JobStore) -> None:
    """A retried script call (its first reply lost with the connection) finds its record and
    writes nothing again: no second queued count, no second message."""
    job = store.create_search("acme", spec(), enqueue=lambda job_id: [("q.work", job_id)])
    keys, args = _create_search_call(job, 3600, lambda job_id: [("q.work", job_id)], None)
    assert store._create_search(keys=keys, args=args) == 0
    assert store.redis.llen("q.work") == 1 and store.redis.hget(STATS_KEY, "queued") == "1"


def test_a_batch_multi_whose_reply_was_lost_is_not_written_twice(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection breaks after EXEC reached Redis: redis-py's retry, under the WATCH,
    finds the batch's record and writes nothing more."""
    broken = _lose_the_first_exec_reply(monkeypatch)
    batch = store.create_batch(
        "acme", "docs", [(f"q{i}", spec()) for i in range(3)],
        enqueue=lambda job_id: [("q.work", job_id)],
    )  # fmt: skip
    assert broken[0]
    assert store.redis.lrange(BATCH_ORDER_KEY + batch.id, 0, -1) == ["q0", "q1", "q2"]
    assert store.redis.llen("q.work") == 1 and store.redis.hget(STATS_KEY, "queued") == "3"


def test_the_sync_and_the_async_store_create_the_same_search(
    store: JobStore, redis_url: str
) -> None:
    """Record, queued count, task messages and the Idempotency-Key's binding, in one
    script: the gateway's asyncio store writes exactly what the blocking one does."""

    def messages(job_id: str) -> list[tuple[str, str]]:
        return [("q.search", "msg:" + job_id), ("q.other", "other:" + job_id)]

    async def create_async() -> str:
        async_store = AsyncJobStore.from_url(redis_url, max_connections=4)
        try:
            job = await async_store.create_search(
                "acme", spec("x"), webhook_url="https://example.com/h", enqueue=messages,
                claim=IdempotencyRef("acme", "key-2", "fp2"),
            )  # fmt: skip
            assert await async_store.in_flight() == {"queued": 2, "running": 0}
            return job.id
        finally:
            await async_store.close()

    sync_id = store.create_search(
        "acme", spec("x"), webhook_url="https://example.com/h", enqueue=messages,
        claim=IdempotencyRef("acme", "key-1", "fp1"),
    ).id  # fmt: skip
    async_id = asyncio.run(create_async())
    records = [store.get_search(job_id) for job_id in (sync_id, async_id)]
    assert all(r is not None for r in records)
    first, second = (r for r in records if r is not None)
    assert (first.tenant, first.status, first.spec, first.webhook_url) == (
        second.tenant, second.status, second.spec, second.webhook_url,
    )  # fmt: skip
    assert (
        store.redis.hgetall(SEARCH_KEY + sync_id).keys()
        == store.redis.hgetall(SEARCH_KEY + async_id).keys()
    )
    assert int(store.redis.ttl(SEARCH_KEY + async_id)) == -1  # queued: none until its end
    assert store.redis.hget(STATS_KEY, "queued") == "2"
    assert store.redis.lrange("q.search", 0, -1) == ["msg:" + async_id, "msg:" + sync_id]
    assert store.redis.lrange("q.other", 0, -1) == ["other:" + async_id, "other:" + sync_id]
    for key, fp, job_id in (("key-1", "fp1", sync_id), ("key-2", "fp2", async_id)):
        claim = store.claim_idempotency("acme", key, fp)
        assert claim.outcome is IdempotencyOutcome.REPLAY and claim.job_id == job_id
        assert store.claim_idempotency("acme", key, "other").outcome is IdempotencyOutcome.MISMATCH
    bound = list(store.redis.keys(IDEMPOTENCY_KEY + "*"))
    assert len(bound) == 2
    for name in bound:
        assert json.loads(store.redis.get(name))["state"] == "created"
        assert int(store.redis.ttl(name)) > IDEMPOTENCY_PENDING_TTL_SECONDS


def test_delivery_counter(store: JobStore) -> None:
    assert [store.count_delivery("t", 0) for _ in range(3)] == [1, 2, 3]
    assert store.count_delivery("t", 1) == 1


def test_missing_records(store: JobStore) -> None:
    assert store.get_search("srch_nope") is None
    assert store.get_batch("bat_nope") is None
    assert store.cancel_batch("bat_nope") is CancelOutcome.MISSING
    assert not store.finish_search("srch_nope", result=result("x"))
    assert not store.finish_item("bat_nope", "q", result=result("x")).applied
    assert isinstance(store.redis, redis.Redis)


def test_the_create_script_sent_again_after_it_ran_creates_nothing_more(store: JobStore) -> None:
    """The gateway's asyncio store tries a command once more after a connection error, and
    the error may have come after the script ran (only its reply lost). The same call again,
    same job id: still one record, one queued count, one message, and the key bound to
    that one job."""
    job = _new_search("acme", spec("again"), None)
    keys, args = _create_search_call(
        job, store.result_ttl, lambda job_id: [("q.search", "msg:" + job_id)],
        IdempotencyRef("acme", "key-again", "fp"),
    )  # fmt: skip
    assert store._create_search(keys=keys, args=args) == 1
    before = store.redis.hgetall(SEARCH_KEY + job.id)
    assert store._create_search(keys=keys, args=args) == 0  # the retry: nothing to do
    assert store.redis.hgetall(SEARCH_KEY + job.id) == before
    assert store.redis.hget(STATS_KEY, "queued") == "1"
    assert store.redis.lrange("q.search", 0, -1) == ["msg:" + job.id]
    claim = store.claim_idempotency("acme", "key-again", "fp")
    assert (claim.outcome, claim.job_id) == (IdempotencyOutcome.REPLAY, job.id)


def test_an_index_read_s_answer_is_awaited_past_the_client_s_socket_timeout(
    redis_url: str,
) -> None:
    # The gateway's store has a 10 s socket timeout and waits up to 10 s for a worker's
    # answer to an index read: one BLPOP of the whole wait was cut by the socket timeout, a
    # 503 "Redis did not answer" where the worker had answered or "no worker answered" was due.
    # It waits on its asyncio client (a wait on a thread held one /readyz needed).
    worker_store = JobStore.from_url(redis_url)

    async def awaited() -> None:
        gateway_store = AsyncJobStore.from_url(redis_url, socket_timeout=1.0)
        try:
            key = worker_store.new_reply_key()
            answering = asyncio.create_task(
                asyncio.to_thread(_later, 1.6, worker_store.reply, key, '{"found": null}')
            )
            assert await gateway_store.await_reply(key, 3.0) == '{"found": null}'
            await answering
            started = time.monotonic()
            assert await gateway_store.await_reply(worker_store.new_reply_key(), 1.5) is None
            assert time.monotonic() - started >= 1.5
        finally:
            await gateway_store.close()

    try:
        asyncio.run(awaited())
    finally:
        worker_store.close()


def test_index_reads_past_the_reply_waits_take_turns_within_their_timeout(
    redis_url: str,
) -> None:
    # One wait at a time: a second read's answer is still taken when the first's slice ends,
    # and a read that never gets a turn within its timeout is None, not late.
    worker_store = JobStore.from_url(redis_url)

    async def awaited() -> None:
        client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        gateway_store = AsyncJobStore(client, reply_waits=1)
        try:
            first, second = worker_store.new_reply_key(), worker_store.new_reply_key()
            worker_store.reply(second, "second")
            unanswered = asyncio.create_task(gateway_store.await_reply(first, 2.5))
            await asyncio.sleep(0.1)  # the first holds the one turn, in a BLPOP of 1 s
            assert await gateway_store.await_reply(second, 2.0) == "second"
            started = time.monotonic()
            assert await gateway_store.await_reply(worker_store.new_reply_key(), 0.2) is None
            assert time.monotonic() - started < 1.0  # its 0.2 s, not the first's slice
            assert await unanswered is None
        finally:
            await client.aclose()

    try:
        asyncio.run(awaited())
    finally:
        worker_store.close()


def _later(delay: float, fn: Any, *args: Any) -> None:
    time.sleep(delay)
    fn(*args)
