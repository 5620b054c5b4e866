"""One finished job's erasure in the job store (:mod:`worker.queue.jobstore.erasure`), on a real
Redis: every key of it goes, a job not finished is refused, and nothing a late run (its
outage note too), a late webhook or a step of the economy lane writes afterwards brings any
of it back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from starlette.testclient import TestClient

from api_gateway.app import create_app
from tests.integration.gateway_app import ACME, gateway_settings
from tests.keys import ACME_KEY
from tests.services import celery_worker, webhook_inbox
from worker.adapters.embedded import EmbeddedBackend
from worker.constants import (
    ECONOMY_LEASE_KEY,
    ECONOMY_PROVIDERS_KEY,
    ECONOMY_RUNS_KEY,
    ECONOMY_STATE_KEY,
    ECONOMY_WATCH_KEY,
    ERASED_KEY,
    IDEMPOTENCY_KEY,
    REDRIVE_COUNT_KEY,
    REDRIVE_OUTAGES_KEY,
    REDRIVE_POSITIONS_KEY,
    REWRITE_INTERVAL_SECONDS,
    REWRITE_LATCH_KEY,
    REWRITE_OWED_KEY,
    REWRITE_PAYMENT_KEY,
    SEARCH_KEY,
    WEBHOOK_EVENT_SEARCH_COMPLETED,
    WEBHOOKS_OWED_KEY,
)
from worker.contract import RerankInfo, SearchResult, SearchSpec
from worker.processes.stack import child_env, redis_server
from worker.queue import base, webhook_task
from worker.queue.jobstore import EraseOutcome, IdempotencyRef, JobStore, Rewrite, webhook_event
from worker.queue.jobstore.jobindex import job_index_key
from worker.queue.redrive import Sweeper
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
    assert store.count_delivery("run-msg", 0, job.id) == 1
    store.note_outage(job.id, [0], ("run-msg", 0))  # a run Redis unreachable ended
    assert store.erase_job("search", "acme", job.id).status == "running"
    assert store.finish_search(job.id, result=_result())
    store.note_outage(job.id, [0], ("done-msg", 0))  # final: nothing of it is sent again
    assert not store.redis.exists(REDRIVE_OUTAGES_KEY + job.id)  # its finish took the notes
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
    store.count_delivery("run-msg", 0, job.id)  # its message back, then another run's outage
    store.note_outage(job.id, [0], ("late-msg", 0))
    assert store.claim_webhook(job.id, 1, "w2", lease_seconds=30).granted
    store.webhook_due(job.id, 1e12, 2)
    store.webhook_settled(job.id, "delivered", 1)
    # the mark, and the Idempotency-Key's binding (its SHA-256s and the id: no text)
    left = sorted(_naming(store, job.id, query))
    assert left == sorted([ERASED_KEY + job.id, *store.redis.scan_iter(f"{IDEMPOTENCY_KEY}*")])
    assert store.was_erased(job.id)


def _named(store: JobStore, job_id: str) -> list[str]:
    return sorted(key for key in store.redis.scan_iter(count=1000) if job_id in key)


def test_a_jobs_final_move_takes_its_outage_notes_so_no_key_names_it_past_its_record(
    store: JobStore,
) -> None:
    """The notes a run that Redis unreachable ended left (sift:redrive-outages:<id>) go with
    the job's final move: a final job is never re-driven, and an erase or purge made by an
    older release, whose key lists predate the notes, deletes the record and leaves no key
    naming the job (a search's, a batch's completed by its last item, one completed by a
    cancel)."""
    job = store.create_search("acme", SearchSpec(index="docs", query="q"), webhook_url=HOOK)
    assert store.start_search(job.id)
    store.note_outage(job.id, [0], ("run-msg", 0))
    assert store.count_delivery("run-msg", 0, job.id) == 0  # its message back, uncounted
    store.note_outage(job.id, [0], ("run-msg", 1))
    assert _named(store, job.id) == [REDRIVE_OUTAGES_KEY + job.id, SEARCH_KEY + job.id]
    assert store.finish_search(job.id, result=_result())
    assert _named(store, job.id) == [SEARCH_KEY + job.id]

    items = [(f"q{n}", SearchSpec(index="docs", query="q")) for n in range(2)]
    ended, canceled = (store.create_batch("acme", "docs", items) for _ in range(2))
    for batch in (ended, canceled):
        assert store.start_item(batch.id, "q0")
        store.note_outage(batch.id, [0, 1], ("chunk-msg", 0))
        store.finish_item(batch.id, "q0", result=_result())
        assert store.redis.exists(REDRIVE_OUTAGES_KEY + batch.id)
    assert store.start_item(ended.id, "q1")
    assert store.finish_item(ended.id, "q1", result=_result()).batch_completed
    assert not store.redis.exists(REDRIVE_OUTAGES_KEY + ended.id)
    # the cancel's messages come after the notes in its script's keys: each in its own list
    completed = store.cancel_batch(
        canceled.id, announce=[("hook-q", "hook")], count=("count-q", "count")
    )
    assert completed == (1, True)
    assert not store.redis.exists(REDRIVE_OUTAGES_KEY + canceled.id)
    assert [store.redis.lrange(q, 0, -1) for q in ("hook-q", "count-q")] == [["hook"], ["count"]]
    open_batch = store.create_batch("acme", "docs", items)
    assert store.start_item(open_batch.id, "q0")
    store.note_outage(open_batch.id, [0], ("chunk-msg", 0))
    left_open = store.cancel_batch(
        open_batch.id, count=("count-q", "count 2"), provider=("provider-q", "provider")
    )
    assert left_open == (1, False)  # q0 runs on: its notes stay, as the batch is not final
    assert store.redis.exists(REDRIVE_OUTAGES_KEY + open_batch.id)
    assert store.redis.lrange("provider-q", 0, -1) == ["provider"]
    assert store.redis.lrange("count-q", 0, -1) == ["count 2", "count"]


def test_a_jobs_final_move_takes_its_re_drive_counters_so_no_key_names_it_past_its_record(
    store: JobStore,
) -> None:
    """The re-drive's counters of a job (sift:redrives:<id>, a batch's
    sift:redrive-positions:<id>) go with its final move, as its outage notes do: a final job is
    never re-driven again, and they lived their retention naming it (a search's, a batch's
    completed by its last item, one completed by a cancel; one left open keeps them)."""
    job = store.create_search("acme", SearchSpec(index="docs", query="q"), webhook_url=HOOK)
    assert store.start_search(job.id)
    assert store.count_redrive(job.id) == 1
    assert _named(store, job.id) == [REDRIVE_COUNT_KEY + job.id, SEARCH_KEY + job.id]
    assert store.finish_search(job.id, result=_result())
    assert _named(store, job.id) == [SEARCH_KEY + job.id]

    items = [(f"q{n}", SearchSpec(index="docs", query="q")) for n in range(2)]
    ended, canceled, open_batch = (store.create_batch("acme", "docs", items) for _ in range(3))
    counters = (REDRIVE_COUNT_KEY, REDRIVE_POSITIONS_KEY)
    for batch in (ended, canceled, open_batch):
        assert store.start_item(batch.id, "q0")
        assert store.count_redrive(batch.id) == 1
        assert store.count_redrive_positions(batch.id, [0, 1]) == {0: 1, 1: 1}
        store.finish_item(batch.id, "q0", result=_result())
        assert all(store.redis.exists(prefix + batch.id) for prefix in counters)
    assert store.start_item(ended.id, "q1")
    assert store.finish_item(ended.id, "q1", result=_result()).batch_completed
    assert not any(store.redis.exists(prefix + ended.id) for prefix in counters)
    # the cancel's messages come after the counters in its script's keys: each in its own list
    completed = store.cancel_batch(
        canceled.id, announce=[("hook-q", "hook")], count=("count-q", "count")
    )
    assert completed == (1, True)
    assert not any(store.redis.exists(prefix + canceled.id) for prefix in counters)
    assert [store.redis.lrange(q, 0, -1) for q in ("hook-q", "count-q")] == [["hook"], ["count"]]
    assert store.start_item(open_batch.id, "q1")
    left_open = store.cancel_batch(
        open_batch.id, count=("count-q", "count 2"), provider=("provider-q", "provider")
    )
    assert left_open == (0, False)  # q1 runs on: its counters stay, as the batch is not final
    assert all(store.redis.exists(prefix + open_batch.id) for prefix in counters)
    assert store.redis.lrange("provider-q", 0, -1) == ["provider"]


def test_a_re_drive_counted_after_a_jobs_final_move_or_its_erase_writes_nothing(
    store: JobStore,
) -> None:
    """A sweep that found a job's work lost counts the re-drive after the job's final move or
    its erase (the run came back, or the tenant erased it, between the two): nothing is
    written, as for an outage's note. Before, the count brought sift:redrives:<id> (a batch's
    sift:redrive-positions:<id>) back for the retention, naming a finished or erased job."""
    job = store.create_search("acme", SearchSpec(index="docs", query="q"))
    assert store.start_search(job.id)
    assert store.count_redrive(job.id) == 1
    assert store.finish_search(job.id, result=_result())
    assert store.count_redrive(job.id) == 0  # final: not counted, its count gone with it
    assert _named(store, job.id) == [SEARCH_KEY + job.id]
    assert store.erase_job("search", "acme", job.id).outcome is EraseOutcome.ERASED
    assert store.count_redrive(job.id) == 0
    items = [(f"q{n}", SearchSpec(index="docs", query="q")) for n in range(2)]
    batch = store.create_batch("acme", "docs", items)
    assert store.count_redrive_positions(batch.id, [0, 1]) == {0: 1, 1: 1}
    for qid, _ in items:
        assert store.start_item(batch.id, qid)
        store.finish_item(batch.id, qid, result=_result())
    assert store.count_redrive_positions(batch.id, [0, 1]) == {0: 0, 1: 0}
    assert store.erase_job("batch", "acme", batch.id).outcome is EraseOutcome.ERASED
    assert store.count_redrive_positions(batch.id, [1]) == {1: 0}
    assert store.count_redrive(batch.id) == 0
    assert _named(store, job.id) == [ERASED_KEY + job.id]
    assert _named(store, batch.id) == [ERASED_KEY + batch.id]


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
    store.note_outage(batch.id, [0, 1], ("done-chunk", 0))  # final: nothing of it is sent again
    assert not store.redis.exists(REDRIVE_OUTAGES_KEY + batch.id)

    assert store.erase_job("batch", "globex", batch.id).outcome is EraseOutcome.MISSING
    assert store.erase_job("batch", "acme", batch.id).outcome is EraseOutcome.ERASED
    assert store.get_batch(batch.id) is None
    # late writes: an item's copy, a run claim, the economy lane's steps
    assert not store.start_item(batch.id, first)
    assert not store.finish_item(batch.id, second, result=_result()).applied
    store.claim_item(batch.id, first, "w2", lease_seconds=30)
    store.count_delivery("chunk-msg", 0, batch.id)  # a chunk's run Redis unreachable ended
    store.note_outage(batch.id, [0, 1], ("chunk-msg", 0))
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


def test_an_erase_and_a_purge_keep_the_same_provider_batches_to_delete(store: JobStore) -> None:
    """Which of an economy batch's provider batches are deleted at the provider: those Sift
    made, never a create in doubt's candidates (``"doubt": true``: maybe another client's)
    unless their results proved them ours (``"proven": true``).
    The erase's script and the purge (:meth:`keep_provider_deletions`) choose them alike,
    whatever a record holds."""
    records = {
        "made": {"round": 1, "requests": 2, "ended_at": None},
        "candidate": {"round": 1, "requests": 2, "ended_at": None, "doubt": True},
        "proven": {"round": 1, "requests": 2, "doubt": True, "proven": True},
        "proven-string": {"doubt": True, "proven": "true"},
        "not-doubt": {"doubt": False},
        "doubt-string": {"doubt": "true"},
        "doubt-one": {"doubt": 1},
        "a-list": [1],
        "null": None,
    }
    raw = {pid: json.dumps(record) for pid, record in records.items()} | {"not-json": "{"}
    erased, purged = (_finished_batch(store, tenant) for tenant in ("acme", "globex"))
    for batch_id in (erased, purged):
        store.economy_save(batch_id, ECONOMY_PROVIDERS_KEY, raw)

    provider = ("test:economy-delete-queue", "a message")
    assert store.erase_job("batch", "acme", erased, provider).outcome is EraseOutcome.ERASED
    kept = store.keep_provider_deletions(purged)

    expected = sorted(set(raw) - {"candidate", "proven-string"})
    assert store.provider_deletions(erased) == expected
    assert kept == store.provider_deletions(purged) == expected


def _finished_batch(store: JobStore, tenant: str) -> str:
    batch = store.create_batch(tenant, "docs", [("q", SearchSpec(index="docs", query="q"))])
    assert store.start_item(batch.id, "q")
    assert store.finish_item(batch.id, "q", result=_result()).batch_completed
    return batch.id


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


def _settled(client: Any) -> dict[str, Any]:
    """Redis's persistence INFO once no AOF rewrite or RDB save runs or waits to."""
    deadline = time.monotonic() + 30  # a hang guard, not a speed check
    while True:
        info = client.info("persistence")
        busy = ("aof_rewrite_in_progress", "aof_rewrite_scheduled", "rdb_bgsave_in_progress")
        if not any(info[name] for name in busy):
            assert info["aof_last_bgrewrite_status"] == "ok", info
            assert info["rdb_last_bgsave_status"] == "ok", info
            return cast(dict[str, Any], info)
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


def _finished_search(store: JobStore, query: str, tenant: str = "acme") -> str:
    job = store.create_search(tenant, SearchSpec(index="docs", query=query))
    store.finish_search(job.id, result=_result())
    return job.id


def test_an_erase_has_redis_rewrite_its_aof_so_the_erased_text_leaves_its_disk(
    tmp_path: Path,
) -> None:
    """Redis as ``sift up`` runs it (AOF on, ``everysec``): the AOF holds the writes that
    stored the job until Redis rewrites it, which the erase asks for (``BGREWRITEAOF``);
    after it no file of Redis's holds the text. Before, they held it until Redis rewrote the
    AOF on its own, once the file had doubled: days on a quiet store."""
    query = "erasable " + uuid.uuid4().hex
    with redis_server(tmp_path, appendonly=True) as url:
        store = JobStore.from_url(url + "/0")
        try:
            job_id = _finished_search(store, query)
            assert _on_disk(tmp_path, query)  # the AOF's writes
            assert store.erase_job("search", "acme", job_id).outcome is EraseOutcome.ERASED
            assert _naming(store, query) == []
            assert _settled(store.redis)["aof_rewrites"] == 1
            assert not _on_disk(tmp_path, query)
        finally:
            store.close()


def test_an_erase_repeated_after_an_older_gateways_has_redis_rewrite_its_aof(
    tmp_path: Path,
) -> None:
    """An erase made by a gateway older than the rewrite's mark deleted the job and wrote its
    erasure mark, but owed no rewrite: the AOF kept the text. The same erase sent again (the
    way to have it leave the disk) owes and asks the rewrite as a first one does. Before, it
    answered "erased already" and asked nothing: the text stayed until Redis's own rewrite."""
    query = "erasable " + uuid.uuid4().hex
    with redis_server(tmp_path, appendonly=True) as url:
        store = JobStore.from_url(url + "/0")
        try:
            job_id = _finished_search(store, query)
            # the older gateway's erase: the job's keys gone, the mark written, nothing owed
            store.redis.delete(SEARCH_KEY + job_id)
            store.redis.zrem(job_index_key("search", "acme"), job_id)
            store.redis.hset(
                ERASED_KEY + job_id,
                mapping={"tenant": "acme", "kind": "search", "erased_at": "1.0"},
            )
            assert _naming(store, query) == [] and _on_disk(tmp_path, query)
            assert not store.redis.exists(REWRITE_OWED_KEY)
            erasure = store.erase_job("search", "acme", job_id)
            assert (erasure.outcome, erasure.erased_at) == (EraseOutcome.ERASED, 1.0)
            assert _settled(store.redis)["aof_rewrites"] == 1
            assert not _on_disk(tmp_path, query)
            assert store.erase_job("search", "globex", job_id).outcome is EraseOutcome.MISSING
        finally:
            store.close()


def test_a_burst_of_erases_forks_one_rewrite_and_the_sweep_pays_the_one_held_back(
    tmp_path: Path,
) -> None:
    """The first erase starts a rewrite; one within REWRITE_INTERVAL_SECONDS of it starts
    none (a burst would fork Redis once an erase) but leaves it owed, and the re-drive's sweep
    asks for it once the interval's latch is gone (deleted here: the interval passing)."""
    queries = ["erasable " + uuid.uuid4().hex for _ in range(2)]
    with redis_server(tmp_path, appendonly=True) as url:
        store = JobStore.from_url(url + "/0")
        try:
            first, second = (_finished_search(store, q) for q in queries)
            store.erase_job("search", "acme", first)
            assert _settled(store.redis)["aof_rewrites"] == 1
            assert _on_disk(tmp_path, queries[1]) and not _on_disk(tmp_path, queries[0])
            store.erase_job("search", "acme", second)
            assert _settled(store.redis)["aof_rewrites"] == 1  # held back by the latch
            assert _on_disk(tmp_path, queries[1])
            sweeper = Sweeper(store, lambda *_: None, interval_seconds=30, stall_seconds=120)
            sweeper.sweep()
            assert _settled(store.redis)["aof_rewrites"] == 1  # still within the interval
            assert store.redis.ttl(REWRITE_LATCH_KEY) <= REWRITE_INTERVAL_SECONDS
            store.redis.delete(REWRITE_LATCH_KEY)
            sweeper.sweep()
            assert _settled(store.redis)["aof_rewrites"] == 2
            assert not _on_disk(tmp_path, queries[1])
            sweeper.sweep()  # nothing owed: no third rewrite
            assert _settled(store.redis)["aof_rewrites"] == 2
        finally:
            store.close()


def test_a_rewrite_already_running_leaves_the_erasures_rewrite_owed(tmp_path: Path) -> None:
    """A rewrite running when the erase asks for one (Redis answers an error) may have forked
    before the erase, so its files may hold the text: the erase still answers erased, and the
    rewrite stays owed for the next interval (the re-drive's sweep asks it then)."""
    with redis_server(tmp_path, appendonly=True) as url:
        store = JobStore.from_url(url + "/0")
        try:
            job_id = _finished_search(store, "erasable " + uuid.uuid4().hex)
            store.redis.config_set("rdb-key-save-delay", 1_000_000)  # a second a key
            store.redis.bgrewriteaof()  # forked now, before the erase: slow, its keys held
            assert store.redis.info("persistence")["aof_rewrite_in_progress"] == 1
            assert store.erase_job("search", "acme", job_id).outcome is EraseOutcome.ERASED
            assert store.redis.exists(REWRITE_OWED_KEY)
            assert store.rewrite_files() is Rewrite.LATCHED  # not again within the interval
            # the slow rewrite stopped (its AOF turned off and on: a rewrite of its own), and
            # the interval passed: the owed one is asked
            store.redis.config_set("rdb-key-save-delay", 0)
            store.redis.config_set("appendonly", "no")
            store.redis.config_set("appendonly", "yes")
            _settled(store.redis)
            store.redis.delete(REWRITE_LATCH_KEY)
            assert store.rewrite_files() is Rewrite.STARTED
            assert not store.redis.exists(REWRITE_OWED_KEY)
            _settled(store.redis)
        finally:
            store.close()


def test_without_an_aof_an_erase_has_redis_save_its_rdb_snapshot_again(tmp_path: Path) -> None:
    """A Redis with RDB save points and no AOF: the snapshot taken before the erase holds the
    text, and the erase has Redis save it again (``BGSAVE``), without it."""
    query = "erasable " + uuid.uuid4().hex
    with redis_server(tmp_path) as url:
        store = JobStore.from_url(url + "/0")
        try:
            store.redis.config_set("save", "3600 1")
            job_id = _finished_search(store, query)
            store.redis.bgsave()
            _settled(store.redis)
            assert _on_disk(tmp_path, query)  # the snapshot
            store.erase_job("search", "acme", job_id)
            assert _settled(store.redis)["aof_rewrites"] == 0  # no AOF made
            assert not _on_disk(tmp_path, query)
        finally:
            store.close()


def test_with_an_aof_and_save_points_both_files_are_rewritten(tmp_path: Path) -> None:
    """Redis as ``deploy/docker-compose.yml`` runs it: AOF on and Redis's default save points,
    a ``dump.rdb`` beside the AOF holding the text too. The erase has both rewritten: the
    AOF, then the snapshot (``BGSAVE SCHEDULE``: after the rewrite's child)."""
    query = "erasable " + uuid.uuid4().hex
    with redis_server(tmp_path, appendonly=True) as url:
        store = JobStore.from_url(url + "/0")
        try:
            store.redis.config_set("save", "3600 1 300 100 60 10000")  # Redis's default
            job_id = _finished_search(store, query)
            store.redis.bgsave()
            _settled(store.redis)
            assert (tmp_path / "dump.rdb").is_file() and _on_disk(tmp_path, query)
            saved = store.redis.info("persistence")["rdb_last_save_time"]
            store.erase_job("search", "acme", job_id)
            deadline = time.monotonic() + 30  # a hang guard: the save waits for the rewrite
            while (info := _settled(store.redis))["rdb_changes_since_last_save"]:
                assert time.monotonic() < deadline, info
                time.sleep(0.05)
            assert info["aof_rewrites"] == 1 and info["rdb_last_save_time"] >= saved
            assert not _on_disk(tmp_path, query)
        finally:
            store.close()


def test_a_redis_that_keeps_no_file_is_asked_for_no_rewrite(store: JobStore) -> None:
    """The tests' Redis (no AOF, no save points): nothing to rewrite, and nothing forked."""
    store.erase_job("search", "acme", _finished_search(store, "q"))
    info = _settled(store.redis)
    assert info["aof_rewrites"] == 0 and info["rdb_last_bgsave_time_sec"] == -1


def test_sift_tenant_purge_has_redis_rewrite_its_aof(tmp_path: Path) -> None:
    """After a purge no file of Redis's holds the tenant's query (AOF on, as ``sift up``)."""
    query = "purgeable " + uuid.uuid4().hex
    with redis_server(tmp_path / "redis", appendonly=True) as url:
        store = JobStore.from_url(url + "/0")
        try:
            _finished_search(store, query)
            assert _on_disk(tmp_path / "redis", query)
            purge = _purge_acme(url, tmp_path)
            assert purge.returncode == 0, purge.stdout + purge.stderr
            assert "Redis was asked to rewrite its files" in purge.stdout, purge.stdout
            assert _settled(store.redis)["aof_rewrites"] == 1
            assert not _on_disk(tmp_path / "redis", query)
        finally:
            store.close()


def _purge_acme(url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The real ``sift tenant purge acme --yes`` on the Redis at ``url`` and an embedded
    data folder in ``tmp_path`` that holds the tenant's (empty) index list."""
    backend = EmbeddedBackend(tmp_path / "data")
    backend.indexes("acme")
    backend.close()
    env = {"SIFT_REDIS_URL": url + "/0", "SIFT_DATA_DIR": str(tmp_path / "data"),
           "COLUMNS": "200", "NO_COLOR": "1"}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "tenant", "purge", "acme", "--yes"],
        env=child_env(env, inherit_sift=False), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _paid_with_the_re_drive_off(tmp_path: Path, url: str, store: JobStore) -> int:
    """Run a real worker with the re-drive off until the rewrite owed is paid; answers how
    many AOF rewrites Redis has made."""
    env = {"SIFT_REDIS_URL": url + "/0", "SIFT_WORKER_METRICS_PORT": "0",
           "SIFT_REDRIVE_INTERVAL_SECONDS": "0"}  # fmt: skip
    before = int(_settled(store.redis)["aof_rewrites"])
    with celery_worker(tmp_path, env, "worker", concurrency=2):
        deadline = time.monotonic() + 60  # a hang guard, not a speed check
        while store.redis.exists(REWRITE_OWED_KEY) or not _rewrite_asked(store.redis, before):
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
            time.sleep(0.1)
        return int(_settled(store.redis)["aof_rewrites"])


def _rewrite_asked(client: Any, before: int) -> bool:
    """Whether Redis has run, runs or has scheduled an AOF rewrite since it had made
    ``before``: the worker drops the owed mark just before it asks."""
    info = client.info("persistence")
    busy = info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]
    return bool(busy) or int(info["aof_rewrites"]) > before


def test_with_the_re_drive_off_a_worker_pays_the_rewrite_the_latch_held_back(
    tmp_path: Path,
) -> None:
    """``SIFT_REDRIVE_INTERVAL_SECONDS=0``: an erase through the gateway within the interval
    of the last rewrite leaves its own owed and sends ``sift.rewrite_owed``, due when the
    latch expires (shortened here to seconds: the interval all but passed; a task taken
    before it asks again at its expiry); a real worker takes it, and the erased text leaves
    the AOF. Before, only the re-drive's sweep paid it:
    the text stayed on the disk until the next erase past the interval, however long."""
    queries = ["erasable " + uuid.uuid4().hex for _ in range(2)]
    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis", appendonly=True) as url:
        store = JobStore.from_url(url + "/0")
        try:
            first, second = (_finished_search(store, q) for q in queries)
            with TestClient(create_app(gateway_settings(url + "/0"))) as gateway:
                assert gateway.delete(f"/v1/searches/{first}", headers=ACME).status_code == 200
                assert _settled(store.redis)["aof_rewrites"] == 1
                store.redis.persist(REWRITE_LATCH_KEY)  # held until the worker runs
                assert gateway.delete(f"/v1/searches/{second}", headers=ACME).status_code == 200
                assert store.redis.exists(REWRITE_PAYMENT_KEY)  # the task is on its way
            assert store.redis.exists(REWRITE_OWED_KEY)  # held back by the latch
            store.redis.expire(REWRITE_LATCH_KEY, 2)  # the interval all but passed
            assert _on_disk(tmp_path / "redis", queries[1])
            assert _paid_with_the_re_drive_off(tmp_path, url, store) == 2
            assert not _on_disk(tmp_path / "redis", queries[1])
            assert not store.redis.exists(REWRITE_PAYMENT_KEY)
        finally:
            store.close()


def test_with_the_re_drive_off_a_worker_pays_the_rewrite_a_purge_owes(tmp_path: Path) -> None:
    """A ``sift tenant purge`` within the interval of the last rewrite sends
    ``sift.rewrite_owed`` due at the latch's expiry, as an erase does, asked again until the
    latch (shortened here to 2 s after the purge) lets it through; a real
    worker with the re-drive off pays it, and the tenant's query leaves the AOF. Before, the
    purge said the re-drive's sweep would ask it, and with the re-drive off nothing did."""
    query = "purgeable " + uuid.uuid4().hex
    with redis_server(tmp_path / "redis", appendonly=True) as url:
        store = JobStore.from_url(url + "/0")
        try:
            _finished_search(store, query)
            store.redis.set(REWRITE_LATCH_KEY, "1")  # a rewrite asked just now, held
            purge = _purge_acme(url, tmp_path)
            assert purge.returncode == 0, purge.stdout + purge.stderr
            assert store.redis.exists(REWRITE_OWED_KEY)  # held back by the latch
            store.redis.expire(REWRITE_LATCH_KEY, 2)  # the interval all but passed: the
            # task, due at once (the latch had no expiry), is taken early and asks again
            assert _paid_with_the_re_drive_off(tmp_path, url, store) == 1
            assert not _on_disk(tmp_path / "redis", query)
        finally:
            store.close()
