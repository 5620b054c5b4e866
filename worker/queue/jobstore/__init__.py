"""The Redis job store: search, batch and ingest records, shared by the gateway and the workers.

It depends on redis-py, tenacity and the shared top level of :mod:`worker` only (constants,
the contract, errors, the Redis client's options, write versions, the coalescer), no Celery,
so the gateway may import it (an import-linter contract checks it).

Layout (every prefix is in :mod:`worker.constants`):

    sift:search:<id>          hash   kind, tenant, status, spec, result, error, webhook_url,
                                     created_at, started_at, finished_at, move (the token
                                     of its last status change), run (its run claim),
                                     owed_bytes (what its result owes: sift:stats:jobs)
    sift:batch:<id>           hash   tenant, index, lane, rerank, webhook_url, total,
                                     created_at, canceled_at, finished_at, cancel_move (the
                                     last cancel's token and answer), owed_item_bytes (what
                                     each item's result owes)
    sift:batch-order:<id>     list   query ids in submission order (pages read from it)
    sift:batch-specs:<id>     hash   query id -> SearchSpec JSON
    sift:batch-items:<id>     hash   query id -> status
    sift:batch-results:<id>   hash   query id -> {"result"} or {"error"} JSON
    sift:batch-counts:<id>    hash   status -> count (queued, running, succeeded, failed, canceled)
    sift:batch-moves:<id>     hash   query id -> the token and answer of the move that made
                                     the item final (a move sent again answers as it ran)
    sift:batch-runs:<id>      hash   query id -> its run claim (runs.py; a search's is its
                                     record's ``run`` field)
    sift:batch-lost:<id>      hash   query id -> its runs lost (taken over from a dead worker):
                                     past SIFT_TASK_MAX_DELIVERIES it fails as poison
    sift:eco-prepared:<id>    hash   query id -> prepared search JSON (economy lane, until final)
    sift:eco-runs:<id>        hash   query id -> {"pos","provider","round",...,"run"} JSON
    sift:eco-providers:<id>   hash   provider batch id -> {"round","requests","created_at",...}
    sift:eco-state:<id>       hash   once-only claims (``submit``)
    sift:eco-lease:<id> <w>   string the run of economy task ``w`` under way: worker, token
    sift:ingest:<id>          hash   like a search record, with index and document count
    sift:ingest-docs:<id>     string the documents (a delete: the ids), until the task has run
    sift:write-version:<t>    string the tenant's last write version (upserts, deletes, drops,
                                     settings); starts from sift:write-version, earlier releases'
    sift:write-version-legacy hash   {mark, seen}: whether an earlier release still writes
    sift:index-reply:<id>     list   one index read's answer, for 60 s
    sift:index-size:<t>:<i>   hash   documents, bytes: what the tenant's index holds (its
                                     title, text and metadata), written after each write job
    sift:idem:<tenant>:<h>    string {"fp", "state", "job"} for one Idempotency-Key
    sift:attempts:<task>:<n>  string deliveries of one task message
    sift:attempts-freed:<task>:<n> string of them, those left uncounted as an outage's returns
    sift:stats:jobs           hash   queued / running searches and batch items right now,
                                     and owed_bytes: what their results will still write, as
                                     each job's admission priced it (added with its queued
                                     count, released as each ends, in the same scripts)
    sift:active               zset   search, ingest and batch ids not final yet
                                     -> the time of their last status change (the re-drive's)
    sift:jobs:<kind>:<tenant> zset   the tenant's search, batch or ingest ids -> created_at
                                     (the job lists; written with the job's record)
    sift:erased:<id>          hash   tenant, kind, erased_at: a search or batch its tenant
                                     erased (every other key of it deleted), for the retention
    sift:eco-delete:<id>      set    an erased batch's provider batches not deleted at the
                                     provider yet (sift.economy_delete empties it)
    sift:rewrite-owed         string an erasure since Redis was last asked to rewrite its
                                     files (AOF, RDB): they may still hold the erased text
    sift:rewrite-latch        string a rewrite was asked within REWRITE_INTERVAL_SECONDS
                                     (rewrite.py: one per interval, whatever the erases)
    sift:rewrite-payment      string a sift.rewrite_owed message is due at the latch's
                                     expiry (one per interval, whatever the erases held back)

Retention, enforced by TTLs: every job, batch and ingest record lives
``SIFT_RESULT_RETENTION_SECONDS`` (``RESULT_TTL_SECONDS``, 7 days, by default) from the
write that ended it, and has no TTL before (one that expired while queued or running left
its count in ``sift:stats:jobs`` for good); an Idempotency-Key is
remembered ``IDEMPOTENCY_TTL_SECONDS`` (24 hours) from the write that creates its job, and
again from each request that finds it bound (a
claim that names no job yet, ``IDEMPOTENCY_PENDING_TTL_SECONDS``); delivery counters and
pending ingest documents live 24 hours from their job's commit; a batch's items, and an
ingest's documents, written before its record, live ``BATCH_STAGING_TTL_SECONDS`` until the
record's commit keeps them (a batch's with no TTL) with it. A job
leaves ``sift:active`` when it becomes final, or when the re-drive finds its record gone (an
older release's, which expired).

Every status change is one Lua script: a compare-and-set on the status that also
moves the counts. A record that is already ``succeeded``, ``failed`` or
``canceled`` is never written again, so a redelivered task never produces a
second result and the batch counts never drift.

The modules, by record kind: :mod:`~worker.queue.jobstore.records` (the records and items it
hands out), :mod:`~worker.queue.jobstore.scripts` (the Lua), :mod:`~worker.queue.jobstore.store`
(the connection and the status transitions every kind shares), then one mixin each for
searches, ingests, delete jobs and index-read replies (:mod:`~worker.queue.jobstore.lifecycle`),
batches, a batch item's moves (:mod:`~worker.queue.jobstore.batch_items`), the economy lane's
state, Idempotency-Keys, deliveries (with the re-drive's view), run claims
(:mod:`~worker.queue.jobstore.runs`; a run Redis unreachable ended settles what it can once
Redis answers again, :mod:`~worker.queue.jobstore.outages`), and the tenants' job lists
(:mod:`~worker.queue.jobstore.jobindex` writes a job's entry with its record,
:mod:`~worker.queue.jobstore.listing` reads them), and a tenant's erasure
(:mod:`~worker.queue.jobstore.tenants`, ``sift tenant purge``) and one finished job's
(:mod:`~worker.queue.jobstore.erasure`, ``DELETE /v1/searches/{id}``);
:class:`JobStore` is all of them. :mod:`~worker.queue.jobstore.asyncstore`
is the gateway's ``redis.asyncio`` store for a search's create.
"""

from __future__ import annotations

from worker.queue.jobstore.asyncstore import AsyncJobStore
from worker.queue.jobstore.batch_items import BatchItemRecords
from worker.queue.jobstore.batches import BatchRecords
from worker.queue.jobstore.delivery import DeliveryRecords
from worker.queue.jobstore.erasure import EraseOutcome, Erasure, ErasureRecords
from worker.queue.jobstore.idempotency import (
    IdempotencyClaim,
    IdempotencyKeyBound,
    IdempotencyOutcome,
    IdempotencyRecords,
    IdempotencyRef,
    fingerprint,
)
from worker.queue.jobstore.ingests import IngestRecords
from worker.queue.jobstore.lanes import EconomyLaneRecords
from worker.queue.jobstore.lifecycle import LifecycleRecords
from worker.queue.jobstore.listing import Cursor, JobListing, JobPage
from worker.queue.jobstore.outages import settle_outage
from worker.queue.jobstore.records import (
    FINAL,
    BatchItem,
    BatchJob,
    CancelOutcome,
    Enqueue,
    IngestJob,
    ItemOutcome,
    ItemTransition,
    SearchJob,
    WebhookState,
    webhook_event,
    webhook_figures,
)
from worker.queue.jobstore.rewrite import Rewrite, owe_rewrite
from worker.queue.jobstore.runs import ClaimAnswers, RunClaim, RunRecords
from worker.queue.jobstore.searches import SearchRecords
from worker.queue.jobstore.tenants import TenantJobs, TenantRecords
from worker.redis_client import CONNECTION_OPTIONS

__all__ = [
    "CONNECTION_OPTIONS",
    "FINAL",
    "AsyncJobStore",
    "BatchItem",
    "BatchJob",
    "CancelOutcome",
    "ClaimAnswers",
    "Cursor",
    "Enqueue",
    "EraseOutcome",
    "Erasure",
    "IdempotencyClaim",
    "IdempotencyKeyBound",
    "IdempotencyOutcome",
    "IdempotencyRef",
    "IngestJob",
    "ItemOutcome",
    "ItemTransition",
    "JobListing",
    "JobPage",
    "JobStore",
    "Rewrite",
    "RunClaim",
    "SearchJob",
    "TenantJobs",
    "WebhookState",
    "fingerprint",
    "owe_rewrite",
    "settle_outage",
    "webhook_event",
    "webhook_figures",
]


class JobStore(
    SearchRecords,
    LifecycleRecords,
    IngestRecords,
    ErasureRecords,  # before the tenants' records it builds on
    TenantRecords,  # before the batch mixins it builds on (the order Python resolves)
    BatchRecords,
    BatchItemRecords,
    EconomyLaneRecords,
    IdempotencyRecords,
    DeliveryRecords,
    RunRecords,
    JobListing,
):
    """Job records in Redis. Thread-safe: redis-py's client pools its connections, and the
    status transitions' own connection serves one call at a time (their coalescer's).

    store = JobStore.from_url("redis://localhost:6379/0")
    job = store.create_search("acme", SearchSpec(index="docs", query="q"), webhook_url=None)
    store.start_search(job.id); store.finish_search(job.id, result=result)
    """
