"""One finished job's erasure in the job store (:mod:`worker.queue.jobstore.erasure`), on a real
Redis: every key of it goes, a job not finished is refused, and nothing a late run, a late
webhook or a step of the economy lane writes afterwards brings any of it back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.keys import ACME_KEY
from tests.services import webhook_inbox
from worker.adapters.embedded import EmbeddedBackend
from worker.constants import (
    ECONOMY_LEASE_KEY,
    ECONOMY_RUNS_KEY,
    ECONOMY_STATE_KEY,
    ECONOMY_WATCH_KEY,
    ERASED_KEY,
    IDEMPOTENCY_KEY,
    WEBHOOK_EVENT_SEARCH_COMPLETED,
    WEBHOOKS_OWED_KEY,
)
from worker.contract import RerankInfo, SearchResult, SearchSpec
from worker.processes.stack import child_env, redis_server
from worker.queue import base, webhook_task
from worker.queue.jobstore import EraseOutcome, IdempotencyRef, JobStore, webhook_event
from worker.queue.jobstore.jobindex import job_index_key
from worker.runtime.ratelimit import ProviderLimiter
from worker.settings import load_settings

HOOK = "https://hooks.example/x"


def _result() -> SearchResult:
    return SearchResult(hits=[], rerank=RerankInfo(applied=False))


def _naming(store: JobStore, *texts: str) -> list[str]:
    """The keys whose name, or any of whose values (hash fields, list, set or zset members),
    holds one of ``texts``."""
    found = []
    for key in store.redis.scan_iter(count=1000):
        kind = store.redis.type(key)
        parts = [key]
        if kind == "string":
            parts.append(str(store.redis.get(key)))
        elif kind == "hash":
            parts += [p for pair in store.redis.hgetall(key).items() for p in pair]
        elif kind == "list":
            parts += store.redis.lrange(key, 0, -1)
        elif kind == "set":
            parts += list(store.redis.smembers(key))
        elif kind == "zset":
            parts += store.redis.zrange(key, 0, -1)
        if any(text in str(part) for part in parts for text in texts):
            found.append(str(key))
    return found


def test_an_erased_search_is_not_written_back_by_a_late_run_or_webhook(store: JobStore) -> None:
    query = "erasable " + uuid.uuid4().hex
    claim = IdempotencyRef("acme", "key-1", "fp")
    job = store.create_search("acme", SearchSpec(index="docs", query=query), webhook_url=HOOK,
                              claim=claim)  # fmt: skip
    assert store.erase_job("search", "acme", job.id).outcome is EraseOutcome.NOT_FINISHED
    run = store.claim_search(job.id, "w1", lease_seconds=30)
    assert store.start_search(job.id)
    assert store.erase_job("search", "acme", job.id).status == "running"
    assert store.finish_search(job.id, result=_result())
    assert store.redis.zscore(WEBHOOKS_OWED_KEY, job.id) is not None  # its webhook is owed
    assert store.erase_job("search", "globex", job.id).outcome is EraseOutcome.MISSING

    erased = store.erase_job("search", "acme", job.id)
    assert erased.outcome is EraseOutcome.ERASED and erased.erased_at is not None
    assert store.erase_job("search", "acme", job.id) == erased  # again: the same answer
    assert store.erase_job("search", "globex", job.id).outcome is EraseOutcome.MISSING
    assert store.erasure(job.id, "acme") == erased.erased_at
    assert store.erasure(job.id, "globex") is None
    assert store.get_search(job.id) is None
    assert store.redis.zscore(job_index_key("search", "acme"), job.id) is None

    # a redelivered copy of its run, and of its webhook, each after the erase
    again = store.claim_search(job.id, "w2", lease_seconds=30)
    store.release_search(job.id, again)
    store.release_search(job.id, run)
    assert not store.start_search(job.id)
    assert not store.requeue_search(job.id)
    assert not store.finish_search(job.id, result=_result())
    assert store.claim_webhook(job.id, 1, "w2", lease_seconds=30).granted
    store.webhook_due(job.id, 1e12, 2)
    store.webhook_settled(job.id, "delivered", 1)
    # the mark, and the Idempotency-Key's binding (its SHA-256s and the id: no text)
    left = sorted(_naming(store, job.id, query))
    assert left == sorted([ERASED_KEY + job.id, *store.redis.scan_iter(f"{IDEMPOTENCY_KEY}*")])
    assert store.was_erased(job.id)


def test_an_erased_batch_is_not_written_back_by_a_late_item_or_economy_step(
    store: JobStore,
) -> None:
    texts = ["erasable " + uuid.uuid4().hex for _ in range(2)]
    items = [(f"q-{uuid.uuid4().hex}", SearchSpec(index="docs", query=t)) for t in texts]
    batch = store.create_batch("acme", "docs", items, webhook_url=HOOK)
    store.economy_save(batch.id, ECONOMY_STATE_KEY, {"submit": "1"})
    store.economy_expect(batch.id, "submit", 1e12)
    assert store.economy_lease(batch.id, "submit", "w1 t1", 30)
    first, second = (qid for qid, _ in items)
    assert store.start_item(batch.id, first)
    store.finish_item(batch.id, first, result=_result())
    assert store.erase_job("batch", "acme", batch.id).outcome is EraseOutcome.NOT_FINISHED
    assert store.start_item(batch.id, second)
    assert store.finish_item(batch.id, second, result=_result()).batch_completed

    assert store.erase_job("batch", "globex", batch.id).outcome is EraseOutcome.MISSING
    assert store.erase_job("batch", "acme", batch.id).outcome is EraseOutcome.ERASED
    assert store.get_batch(batch.id) is None
    # late writes: an item's copy, a run claim, the economy lane's steps
    assert not store.start_item(batch.id, first)
    assert not store.finish_item(batch.id, second, result=_result()).applied
    store.claim_item(batch.id, first, "w2", lease_seconds=30)
    assert not store.economy_save(batch.id, ECONOMY_RUNS_KEY, {first: "{}"})
    assert not store.economy_save_prepared(batch.id, first, "{}")
    store.economy_expect(batch.id, "submit", 1e12)
    assert not store.economy_lease(batch.id, "poll", "w2 t2", 30)
    store.claim_webhook(batch.id, 1, "w2", lease_seconds=30)
    store.webhook_settled(batch.id, "failed", 1)
    assert _naming(store, batch.id, *texts, first, second) == [ERASED_KEY + batch.id]


def test_a_batchs_erase_takes_its_own_economy_leases_and_watch_and_no_other_batchs(
    store: JobStore,
) -> None:
    """The leases and the watch's members are found by one scan over every batch's: the
    erased batch's go; another tenant's batch's stay, and so do those of an id that begins
    as the erased one's."""
    batches = []
    for tenant in ("acme", "globex"):
        batch = store.create_batch(tenant, "docs", [("q", SearchSpec(index="docs", query="q"))])
        assert store.start_item(batch.id, "q")
        assert store.finish_item(batch.id, "q", result=_result()).batch_completed
        batches.append(batch.id)
    erased, kept = batches
    for batch_id in (erased, kept):
        store.economy_expect(batch_id, "submit", 1e12)
        assert store.economy_lease(batch_id, "submit", "w1 t1", 30)
    lookalike = erased + "x"  # as the economy lane would write them for such a batch
    store.redis.set(ECONOMY_LEASE_KEY + f"{lookalike} submit", "w1 t1")
    store.redis.zadd(ECONOMY_WATCH_KEY, {f"{lookalike} submit": 1e12})

    assert store.erase_job("batch", "acme", erased).outcome is EraseOutcome.ERASED
    assert store.redis.zscore(ECONOMY_WATCH_KEY, f"{erased} submit") is None
    assert not store.redis.exists(ECONOMY_LEASE_KEY + f"{erased} submit")
    assert store.redis.zscore(ECONOMY_WATCH_KEY, f"{kept} submit") is not None
    assert store.redis.get(ECONOMY_LEASE_KEY + f"{kept} submit") == "w1 t1"
    assert store.redis.zscore(ECONOMY_WATCH_KEY, f"{lookalike} submit") is not None
    assert store.redis.get(ECONOMY_LEASE_KEY + f"{lookalike} submit") == "w1 t1"


@pytest.mark.parametrize("kind", ["ingest", "nothing"])
def test_only_a_search_or_a_batch_is_erased(store: JobStore, kind: str) -> None:
    with pytest.raises(ValueError, match="kind"):
        store.erase_job(kind, "acme", "x")


def test_a_tenant_purge_deletes_the_marks_of_the_jobs_it_erased(store: JobStore) -> None:
    mine = store.create_search("acme", SearchSpec(index="docs", query="q"))
    theirs = store.create_search("globex", SearchSpec(index="docs", query="q"))
    for job in (mine, theirs):
        store.finish_search(job.id, result=_result())
        store.erase_job("search", job.tenant, job.id)
    assert store.delete_tenant_keys("acme")["erasure marks"] == 1
    assert not store.was_erased(mine.id) and store.was_erased(theirs.id)


def test_sift_tenant_purge_leaves_no_key_naming_a_tenant_that_erased_a_job(
    store: JobStore, redis_url: str, tmp_path: Path
) -> None:
    job = store.create_search("acme", SearchSpec(index="docs", query="q"))
    store.finish_search(job.id, result=_result())
    store.erase_job("search", "acme", job.id)
    backend = EmbeddedBackend(tmp_path)  # the workers' data folder (the purge refuses another)
    backend.indexes("acme")
    backend.close()
    env = {"SIFT_REDIS_URL": redis_url, "SIFT_DATA_DIR": str(tmp_path), "COLUMNS": "200",
           "NO_COLOR": "1"}  # fmt: skip
    purge = subprocess.run(
        [sys.executable, "-m", "worker.cli", "tenant", "purge", "acme", "--yes"],
        env=child_env(env, inherit_sift=False), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert purge.returncode == 0, purge.stdout + purge.stderr
    row = next(line for line in purge.stdout.splitlines() if "marks of jobs it erased" in line)
    assert row.split()[-2:] == ["1", "│"], row
    assert _naming(store, "acme", job.id) == []


@pytest.fixture
def worker(redis_url: str, store: JobStore) -> Iterator[None]:
    """The webhook task's context, in this process: acme's key, private receivers allowed."""
    settings = load_settings(
        redis_url=redis_url, api_keys=json.dumps([ACME_KEY]), webhook_allow_private_networks=True
    )
    base.set_context(base.WorkerContext(settings=settings, store=store, limiter=ProviderLimiter(1)))
    yield
    base.set_context(None)


def test_a_webhook_owed_when_its_search_is_erased_is_not_sent(
    store: JobStore, worker: None
) -> None:
    with webhook_inbox() as (url, inbox):
        jobs = [store.create_search("acme", SearchSpec(index="docs", query="q"), webhook_url=url)
                for _ in range(2)]  # fmt: skip
        for job in jobs:
            store.finish_search(job.id, result=_result())
        kept, erased = jobs
        store.erase_job("search", "acme", erased.id)
        for job in (erased, kept):  # the erased one's message first: the inbox keeps order
            event = webhook_event(WEBHOOK_EVENT_SEARCH_COMPLETED, job.id, "acme", url, "succeeded")
            webhook_task.webhook.apply(args=[event])
        body, _ = inbox.get(timeout=10)  # the kept one's, delivered: the receiver answered
        assert json.loads(body)["data"]["id"] == kept.id
        assert inbox.empty()  # and nothing for the erased one, which came before it
    assert _naming(store, erased.id) == [ERASED_KEY + erased.id]


def _on_disk(directory: Path, text: str) -> bool:
    """Whether any file Redis keeps in ``directory`` (its AOF's parts) holds ``text``."""
    return any(text.encode() in f.read_bytes() for f in directory.rglob("*") if f.is_file())


def test_the_aof_keeps_an_erased_job_until_redis_rewrites_it(tmp_path: Path) -> None:
    """What docs/queue.md's Erase says the erase leaves: the AOF holds the writes that stored
    the job until Redis rewrites it (``BGREWRITEAOF``, or on its own once the file doubled);
    after a rewrite no file of Redis's holds the text."""
    query = "erasable " + uuid.uuid4().hex
    with redis_server(tmp_path, appendonly=True, appendfsync="always") as url:
        store = JobStore.from_url(url + "/0")
        try:
            job = store.create_search("acme", SearchSpec(index="docs", query=query))
            store.finish_search(job.id, result=_result())
            store.erase_job("search", "acme", job.id)
            assert _naming(store, query) == []
            assert _on_disk(tmp_path, query)  # the AOF's writes, not yet rewritten
            store.redis.bgrewriteaof()
            deadline = time.monotonic() + 30  # a hang guard, not a speed check
            while True:
                info = store.redis.info("persistence")
                if not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
                    break
                assert time.monotonic() < deadline, info
                time.sleep(0.05)
            assert info["aof_last_bgrewrite_status"] == "ok", info
            assert not _on_disk(tmp_path, query)
        finally:
            store.close()
