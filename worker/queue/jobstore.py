"""The Redis job store: search, batch and ingest records, shared by the gateway and the workers.

It depends on redis-py and :mod:`worker.contract` only, so the gateway may import it.

Layout (every prefix is in :mod:`worker.constants`):

    sift:search:<id>          hash   kind, tenant, status, spec, result, error, webhook_url,
                                     created_at, started_at, finished_at
    sift:batch:<id>           hash   tenant, index, lane, rerank, webhook_url, total,
                                     created_at, canceled_at, finished_at
    sift:batch-order:<id>     list   query ids in submission order (pages read from it)
    sift:batch-specs:<id>     hash   query id -> SearchSpec JSON
    sift:batch-items:<id>     hash   query id -> status
    sift:batch-results:<id>   hash   query id -> {"result"} or {"error"} JSON
    sift:batch-counts:<id>    hash   status -> count (queued, running, succeeded, failed, canceled)
    sift:eco-prepared:<id>    hash   query id -> prepared search JSON (economy lane, until final)
    sift:eco-runs:<id>        hash   query id -> {"pos","provider","round",...,"run"} JSON
    sift:eco-providers:<id>   hash   provider batch id -> {"round","requests","created_at",...}
    sift:eco-state:<id>       hash   once-only claims (``submit``)
    sift:ingest:<id>          hash   like a search record, with index and document count
    sift:ingest-docs:<id>     string the documents, until the ingest task has run
    sift:idem:<tenant>:<h>    string {"fp", "state", "job"} for one Idempotency-Key
    sift:attempts:<task>:<n>  string deliveries of one task message
    sift:stats:jobs           hash   queued / running searches and batch items right now
    sift:active               zset   search, ingest and standard-lane batch ids not final yet
                                     -> the time of their last status change (the re-drive's)

Retention, enforced by TTLs: every job, batch and ingest record lives
``RESULT_TTL_SECONDS`` (7 days) from its last write; an Idempotency-Key is
remembered ``IDEMPOTENCY_TTL_SECONDS`` (24 hours) from the write that creates its job (a
claim that names no job yet, ``IDEMPOTENCY_PENDING_TTL_SECONDS``); delivery counters and
pending ingest documents live 24 hours; a batch's items, written before its record, live
``BATCH_STAGING_TTL_SECONDS`` until the record's commit gives them its retention. A job
leaves ``sift:active`` when it becomes final, or, failing that, once its last change is
older than the records' retention.

Every status change is one Lua script: a compare-and-set on the status that also
moves the counts. A record that is already ``succeeded``, ``failed`` or
``canceled`` is never written again, so a redelivered task never produces a
second result and the batch counts never drift.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, cast

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ConstantBackoff, ExponentialBackoff
from redis.commands.core import Script
from redis.exceptions import NoScriptError
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from worker.coalesce import Coalescer
from worker.constants import (
    ACTIVE_JOBS_KEY,
    ATTEMPTS_KEY,
    ATTEMPTS_TTL_SECONDS,
    BATCH_COUNTS_KEY,
    BATCH_ID_PREFIX,
    BATCH_ITEMS_KEY,
    BATCH_KEY,
    BATCH_ORDER_KEY,
    BATCH_RESULTS_KEY,
    BATCH_SPECS_KEY,
    BATCH_STAGE_SLICE,
    BATCH_STAGING_TTL_SECONDS,
    ECONOMY_PREPARED_KEY,
    ECONOMY_STATE_KEY,
    IDEMPOTENCY_KEY,
    IDEMPOTENCY_PENDING_TTL_SECONDS,
    IDEMPOTENCY_TTL_SECONDS,
    INGEST_DOCS_KEY,
    INGEST_DOCS_TTL_SECONDS,
    INGEST_ID_PREFIX,
    INGEST_KEY,
    LANE_ECONOMY,
    REDRIVE_COUNT_KEY,
    RESULT_TTL_SECONDS,
    SEARCH_ID_PREFIX,
    SEARCH_KEY,
    STATS_KEY,
    STATS_UNTRACKED_KEY,
)
from worker.contract import DocumentIn, ErrorInfo, JobStatus, SearchResult, SearchSpec

# Given a new job's id, the broker messages to write with its record: (list key, raw message).
Enqueue = Callable[[str], Sequence[tuple[str, str]]]

FINAL = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELED)
_STATUSES = tuple(JobStatus)

# KEYS: record, stats, active. ARGV: to, allowed-from (comma list), ttl, now, job id, then
# field/value pairs. Returns -1 when the record is missing, 0 when refused, 1 when applied.
_TRANSITION_JOB = """
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return -1 end
if cur == 'succeeded' or cur == 'failed' or cur == 'canceled' then return 0 end
local to = ARGV[1]
if not string.find(',' .. ARGV[2] .. ',', ',' .. cur .. ',', 1, true) then return 0 end
redis.call('HSET', KEYS[1], 'status', to)
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if cur ~= to then
  if cur == 'queued' or cur == 'running' then redis.call('HINCRBY', KEYS[2], cur, -1) end
  if to == 'queued' or to == 'running' then redis.call('HINCRBY', KEYS[2], to, 1) end
end
if to == 'succeeded' or to == 'failed' or to == 'canceled' then
  redis.call('ZREM', KEYS[3], ARGV[5])
else
  redis.call('ZADD', KEYS[3], 'XX', ARGV[4], ARGV[5])
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return 1
"""

# KEYS: items, results, counts, batch, stats, active.
# ARGV: query id, to, allowed-from (comma list), outcome JSON or '', now, batch id, and '1'
# when a cancel of the batch turns this move into a cancel (a start, or the check before the
# model call; the batch's cancel mark is read in the same script, so no round trip more).
# Returns {code, 1 if the move became a cancel}: code -1 missing, 0 refused, 1 applied,
# 2 applied and the batch just completed.
_TRANSITION_ITEM = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return {-1, 0} end
if cur == 'succeeded' or cur == 'failed' or cur == 'canceled' then return {0, 0} end
local to, outcome, canceled = ARGV[2], ARGV[4], 0
if not string.find(',' .. ARGV[3] .. ',', ',' .. cur .. ',', 1, true) then return {0, 0} end
if ARGV[7] == '1' and redis.call('HEXISTS', KEYS[4], 'canceled_at') == 1 then
  to, outcome, canceled = 'canceled', '', 1
end
redis.call('HSET', KEYS[1], ARGV[1], to)
if outcome ~= '' then redis.call('HSET', KEYS[2], ARGV[1], outcome) end
if cur ~= to then
  redis.call('HINCRBY', KEYS[3], cur, -1)
  redis.call('HINCRBY', KEYS[3], to, 1)
  if cur == 'queued' or cur == 'running' then redis.call('HINCRBY', KEYS[5], cur, -1) end
  if to == 'queued' or to == 'running' then redis.call('HINCRBY', KEYS[5], to, 1) end
end
if to == 'succeeded' or to == 'failed' or to == 'canceled' then
  local c = redis.call('HMGET', KEYS[3], 'succeeded', 'failed', 'canceled')
  local done = (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0) + (tonumber(c[3]) or 0)
  local total = tonumber(redis.call('HGET', KEYS[4], 'total')) or -1
  if done >= total and redis.call('HSETNX', KEYS[4], 'finished_at', ARGV[5]) == 1 then
    redis.call('ZREM', KEYS[6], ARGV[6])
    return {2, canceled}
  end
end
redis.call('ZADD', KEYS[6], 'XX', ARGV[5], ARGV[6])
return {1, canceled}
"""

# KEYS: items, counts, batch, stats, active. ARGV: now, batch id.
# Returns {canceled count, 1 if the batch just completed}, {-1, 0} when missing, and
# {-2, 0} when the batch had already finished: then nothing is written (the check and the
# cancel are one script, so a cancel racing the last item's finish is decided by one side).
_CANCEL_BATCH = """
if redis.call('EXISTS', KEYS[3]) == 0 then return {-1, 0} end
if redis.call('HEXISTS', KEYS[3], 'finished_at') == 1 then return {-2, 0} end
redis.call('HSETNX', KEYS[3], 'canceled_at', ARGV[1])
local all = redis.call('HGETALL', KEYS[1])
local n = 0
for i = 1, #all, 2 do
  if all[i + 1] == 'queued' then
    redis.call('HSET', KEYS[1], all[i], 'canceled')
    n = n + 1
  end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[2], 'queued', -n)
  redis.call('HINCRBY', KEYS[2], 'canceled', n)
  redis.call('HINCRBY', KEYS[4], 'queued', -n)
end
local c = redis.call('HMGET', KEYS[2], 'succeeded', 'failed', 'canceled')
local done = (tonumber(c[1]) or 0) + (tonumber(c[2]) or 0) + (tonumber(c[3]) or 0)
local total = tonumber(redis.call('HGET', KEYS[3], 'total')) or -1
if done >= total and redis.call('HSETNX', KEYS[3], 'finished_at', ARGV[1]) == 1 then
  redis.call('ZREM', KEYS[5], ARGV[2])
  return {n, 1}
end
return {n, 0}
"""


# A new search, atomically (one command where a MULTI would be seven round trips of parsing).
# KEYS: record, stats, the active set, one list per task message, then the Idempotency-Key's
# record if any. ARGV: ttl, message count m, record field count n, the job's id and its
# score in the active set, n fields and values, m raw messages, then that key's binding to
# this job and its TTL. Returns 1 when it created the job; the key's record (JSON) when the
# key is already bound to a job, and nothing is written; 0 when the record exists already
# (this very call ran before: a retry after a lost reply), and nothing is written again.
_CREATE_SEARCH = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local m, n = tonumber(ARGV[2]), tonumber(ARGV[3])
if #KEYS > 3 + m then
  local earlier = redis.call('GET', KEYS[4 + m])
  if earlier and type(cjson.decode(earlier)['job']) == 'string' then return earlier end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 6, 5 + n))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
redis.call('HINCRBY', KEYS[2], 'queued', 1)
redis.call('ZADD', KEYS[3], ARGV[5], ARGV[4])
for i = 1, m do redis.call('LPUSH', KEYS[3 + i], ARGV[5 + n + i]) end
if #KEYS > 3 + m then
  redis.call('SET', KEYS[4 + m], ARGV[6 + n + m], 'EX', tonumber(ARGV[7 + n + m]))
end
return 1
"""

# Claim an Idempotency-Key for one request. KEYS: the key's record. ARGV: the pending
# marker, its TTL. Returns the record already there (JSON), or nothing when it claimed.
_CLAIM_IDEMPOTENCY = """
local earlier = redis.call('GET', KEYS[1])
if earlier then return earlier end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
return false
"""

# Forget a pending marker, never a key bound to a job. KEYS: the key's record. Returns 1
# when it deleted the marker.
_RELEASE_IDEMPOTENCY = """
local earlier = redis.call('GET', KEYS[1])
if not earlier or type(cjson.decode(earlier)['job']) == 'string' then return 0 end
return redis.call('DEL', KEYS[1])
"""


# How both stores connect: text replies, and no call left hanging on a dead connection.
# Maintenance notifications (a Redis Enterprise/Cloud feature, on by default with RESP3 in
# redis-py 8) make the pool skip its check-out probe, so redis.asyncio 8.1 hands out a
# connection the server closed (redis/redis-py#4252; the sync pool with hiredis: #4128):
# the first command after a Redis restart failed. Off, a closed connection is replaced
# before anything is written to it.
CONNECTION_OPTIONS: dict[str, Any] = {
    "decode_responses": True,
    "socket_connect_timeout": 5,
    "socket_timeout": 30,
    "health_check_interval": 30,
    "maint_notifications_config": MaintNotificationsConfig(enabled=False),
}


def _now() -> float:
    return time.time()


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _opt_float(value: str | None) -> float | None:
    return float(value) if value else None


def _in_flight(stats: dict[str, str]) -> dict[str, int]:
    return {s: max(0, int(stats.get(s, 0))) for s in ("queued", "running")}


class IdempotencyOutcome(StrEnum):
    """What a claimed Idempotency-Key means for this request."""

    NEW = "new"  # first use: go ahead and create the job
    REPLAY = "replay"  # same key, same body, a job was created: answer with that job
    MISMATCH = "mismatch"  # same key, different body: 422
    IN_PROGRESS = "in_progress"  # claimed by a request that has not created its job yet: 409


@dataclass(frozen=True, slots=True)
class IdempotencyClaim:
    outcome: IdempotencyOutcome
    job_id: str | None = None


@dataclass(frozen=True, slots=True)
class IdempotencyRef:
    """One request's Idempotency-Key: whose it is, and the fingerprint of its body."""

    tenant: str
    key: str
    fingerprint: str


class IdempotencyKeyBound(Exception):
    """A ``create_*`` with a claim found the key already bound to a job (another request
    with it created one first): nothing was written. ``claim`` says what to answer:
    ``REPLAY`` with that job, or ``MISMATCH`` (it was created for another body)."""

    def __init__(self, claim: IdempotencyClaim) -> None:
        super().__init__(f"Idempotency-Key already bound: {claim.outcome} {claim.job_id}")
        self.claim = claim


@dataclass(slots=True)
class SearchJob:
    """One search job as the store holds it."""

    id: str
    tenant: str
    status: JobStatus
    spec: SearchSpec
    created_at: float
    webhook_url: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    result: SearchResult | None = None
    error: ErrorInfo | None = None


@dataclass(slots=True)
class IngestJob:
    """One ingest job: documents upserted into one index for one tenant."""

    id: str
    tenant: str
    index: str
    status: JobStatus
    documents: int
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    upserted: int | None = None
    error: ErrorInfo | None = None


@dataclass(slots=True)
class BatchJob:
    """One batch: its settings and the live counts of its items by status."""

    id: str
    tenant: str
    index: str
    lane: str
    total: int
    created_at: float
    counts: dict[str, int] = field(default_factory=dict)
    rerank: bool | None = None
    webhook_url: str | None = None
    canceled_at: float | None = None
    finished_at: float | None = None

    @property
    def status(self) -> JobStatus:
        """Once every item is final: ``canceled`` if a cancel canceled at least one item,
        else ``succeeded`` (a cancel that came when every item was past its model call
        changed nothing, so it does not show). ``canceled_at`` says when a cancel came."""
        if self.finished_at is not None:
            if self.counts.get(JobStatus.CANCELED.value, 0) > 0:
                return JobStatus.CANCELED
            return JobStatus.SUCCEEDED
        if self.counts.get("queued", 0) == self.total and self.canceled_at is None:
            return JobStatus.QUEUED
        return JobStatus.RUNNING


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One batch item with the spec it was submitted with."""

    query_id: str
    status: JobStatus
    spec: SearchSpec | None


@dataclass(frozen=True, slots=True)
class ItemOutcome:
    """One line of a batch's results; ``payload`` is the stored ``{"result"}`` or ``{"error"}``."""

    query_id: str
    status: JobStatus
    payload: str | None = None

    def to_json(self) -> str:
        """``{"query_id","status","result"?,"error"?}`` without re-parsing the stored payload."""
        head = '{"query_id":' + json.dumps(self.query_id) + ',"status":"' + self.status.value + '"'
        if self.payload and len(self.payload) > 2:
            return head + "," + self.payload[1:]
        return head + "}"


@dataclass(frozen=True, slots=True)
class ItemTransition:
    """What one item move did. ``canceled``: the batch had been canceled, so the move (a
    start, or the check before the model call) canceled the item instead."""

    applied: bool
    batch_completed: bool = False
    canceled: bool = False

    @property
    def started(self) -> bool:
        """A start that applied and was not turned into a cancel: run the item."""
        return self.applied and not self.canceled


class CancelOutcome(StrEnum):
    """Why :meth:`JobStore.cancel_batch` changed nothing."""

    MISSING = "missing"
    ALREADY_FINISHED = "already_finished"


def _new_search(tenant: str, spec: SearchSpec, webhook_url: str | None) -> SearchJob:
    return SearchJob(
        id=_new_id(SEARCH_ID_PREFIX),
        tenant=tenant,
        status=JobStatus.QUEUED,
        spec=spec,
        created_at=_now(),
        webhook_url=webhook_url,
    )


def _create_search_call(
    job: SearchJob, ttl: int, enqueue: Enqueue | None, claim: IdempotencyRef | None
) -> tuple[list[str], list[str | int]]:
    """KEYS and ARGV of :data:`_CREATE_SEARCH` for a new search: its record, its task
    messages, and its Idempotency-Key's pending record."""
    fields = [
        "kind", "search", "tenant", job.tenant, "status", job.status.value,
        "spec", job.spec.model_dump_json(), "webhook_url", job.webhook_url or "",
        "created_at", repr(job.created_at),
    ]  # fmt: skip
    messages = list(enqueue(job.id)) if enqueue is not None else []
    keys = [SEARCH_KEY + job.id, STATS_KEY, ACTIVE_JOBS_KEY, *(key for key, _ in messages)]
    args: list[str | int] = [ttl, len(messages), len(fields), job.id, repr(job.created_at)]
    args += fields
    args += [raw for _, raw in messages]
    if claim is not None:
        name, value, expiry = _idem_binding(claim, job.id)
        keys.append(name)
        args += [value, expiry]
    return keys, args


def _search_created(job: SearchJob, reply: Any, claim: IdempotencyRef | None) -> SearchJob:
    """``job``, which :data:`_CREATE_SEARCH` answered ``reply`` to; raises
    :class:`IdempotencyKeyBound` when the key named another job and nothing was written."""
    if isinstance(reply, str) and claim is not None:
        earlier = _claim_of(reply, claim.fingerprint)
        if earlier.job_id != job.id:  # our own id: this call had run already (a retry)
            raise IdempotencyKeyBound(earlier)
    return job


def _stage_messages(pipe: redis.client.Pipeline, enqueue: Enqueue | None, job_id: str) -> None:
    """Queue the job's task messages in the same MULTI as its record (an outbox)."""
    if enqueue is not None:
        for key, raw in enqueue(job_id):
            pipe.lpush(key, raw)


def _staged_keys(batch_id: str) -> tuple[str, str, str]:
    """A batch's item keys, written before its record (order, specs, statuses)."""
    return BATCH_ORDER_KEY + batch_id, BATCH_SPECS_KEY + batch_id, BATCH_ITEMS_KEY + batch_id


def _attempts_key(task_id: str, retry: int) -> str:
    return f"{ATTEMPTS_KEY}{task_id}:{retry}"


def _idem_key(tenant: str, key: str) -> str:
    return IDEMPOTENCY_KEY + tenant + ":" + hashlib.sha256(key.encode()).hexdigest()


def _idem_binding(ref: IdempotencyRef, job_id: str) -> tuple[str, str, int]:
    """(key, value, TTL) of a key bound to its job: written in the job's own transaction,
    kept for the key's full 24 hours whatever becomes of the request that created it."""
    record = {"fp": ref.fingerprint, "state": "created", "job": job_id}
    return _idem_key(ref.tenant, ref.key), json.dumps(record), IDEMPOTENCY_TTL_SECONDS


def _bound(raw: str | None, fingerprint: str) -> IdempotencyClaim | None:
    """The key's claim if its record ``raw`` names a job (``REPLAY`` or ``MISMATCH``); None
    if the key is free or only claimed (a pending marker, whoever's: go ahead)."""
    if raw is None or not isinstance(json.loads(raw).get("job"), str):
        return None
    return _claim_of(raw, fingerprint)


def _claim_of(raw: str, fingerprint: str) -> IdempotencyClaim:
    """What a key's stored record means for a request with this body's ``fingerprint``. A
    record names its job from the transaction that created the job on (records written
    before that change may say ``"state": "done"``; the job is what counts)."""
    earlier = json.loads(raw)
    job = earlier.get("job")
    if earlier.get("fp") != fingerprint:
        return IdempotencyClaim(IdempotencyOutcome.MISMATCH, job)
    if isinstance(job, str):
        return IdempotencyClaim(IdempotencyOutcome.REPLAY, job)
    return IdempotencyClaim(IdempotencyOutcome.IN_PROGRESS)


_ScriptCall = tuple[Script, list[str], list[str]]  # a registered script, its keys and args
# to, allowed-from, outcome, and whether the batch's cancel mark turns the move into a cancel
_START_ITEM = (JobStatus.RUNNING, "queued,running", "", True)
_CHECK_ITEM = (JobStatus.RUNNING, "running", "", True)  # before the model call
_Move = tuple[str, str, JobStatus, str, str, bool]  # batch id, query id, then as above


def _rerun(call: _ScriptCall) -> Any:
    """A script call made through redis-py, which loads the script first if need be; its
    reply, or its error."""
    script, keys, args = call
    try:
        return script(keys=keys, args=args)
    except redis.RedisError as exc:
        return exc


class JobStore:
    """Job records in Redis. Thread-safe: redis-py's client pools its connections, and the
    status transitions' own connection serves one call at a time (their coalescer's).

    store = JobStore.from_url("redis://localhost:6379/0")
    job = store.create_search("acme", SearchSpec(index="docs", query="q"), webhook_url=None)
    store.start_search(job.id); store.finish_search(job.id, result=result)
    """

    def __init__(self, client: redis.Redis, *, result_ttl: int = RESULT_TTL_SECONDS) -> None:
        self.redis = client
        self.result_ttl = result_ttl
        self._transition_job = client.register_script(_TRANSITION_JOB)
        self._transition_item = client.register_script(_TRANSITION_ITEM)
        self._cancel_batch = client.register_script(_CANCEL_BATCH)
        self._create_search = client.register_script(_CREATE_SEARCH)
        self._claim_idempotency = client.register_script(_CLAIM_IDEMPOTENCY)
        self._release_idempotency = client.register_script(_RELEASE_IDEMPOTENCY)
        # status transitions that threads ask for while one round trip is out go together
        # in the next (a worker's hundreds of threads each make two per search)
        self._transitions: Coalescer[list[_ScriptCall], list[Any]] = Coalescer(
            self._run_scripts, size=len
        )
        self._own: Any = None  # the transitions' connection (see _evalsha_all)
        self._own_pid = 0

    @classmethod
    def from_url(
        cls, url: str, *, max_connections: int | None = None, outage_seconds: float = 0.0
    ) -> JobStore:
        """A store on ``url``. With ``max_connections``, a thread that finds every connection
        busy waits for one (up to 20 s) instead of failing its job. With ``outage_seconds``,
        a command that meets a refused or broken connection is retried, backing off from
        50 ms to 1 s, for about that long (a Redis restart), instead of failing its job;
        otherwise redis-py's default applies (3 quick retries)."""
        options: dict[str, Any] = dict(CONNECTION_OPTIONS)
        if outage_seconds > 0:
            # 0.05 + 0.1 + 0.2 + 0.4 + 0.8 s, then 1 s a retry
            options["retry"] = Retry(
                ExponentialBackoff(cap=1.0, base=0.05), retries=int(outage_seconds) + 4
            )
        if max_connections is None:
            return cls(redis.Redis.from_url(url, **options))
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=20, **options
        )
        return cls(redis.Redis(connection_pool=pool))

    def close(self) -> None:
        """Close the client and its pool's connections (a pool given to redis-py explicitly,
        as ``from_url(max_connections=)`` does, is not closed by ``Redis.close``)."""
        self.redis.close()
        self.redis.connection_pool.disconnect()
        if self._own is not None:
            self._own.disconnect()

    def ping(self) -> bool:
        return bool(self.redis.ping())

    # --- searches ---------------------------------------------------------------------------

    def create_search(
        self,
        tenant: str,
        spec: SearchSpec,
        *,
        webhook_url: str | None = None,
        enqueue: Enqueue | None = None,
        claim: IdempotencyRef | None = None,
    ) -> SearchJob:
        """Store a ``queued`` search atomically (one script), with its task messages from
        ``enqueue`` and, with ``claim``, the Idempotency-Key bound to it; raises
        :class:`IdempotencyKeyBound`, writing nothing, if that key names a job already."""
        job = _new_search(tenant, spec, webhook_url)
        keys, args = _create_search_call(job, self.result_ttl, enqueue, claim)
        return _search_created(job, self._create_search(keys=keys, args=args), claim)

    def get_search(self, job_id: str) -> SearchJob | None:
        raw = cast(dict[str, str], self.redis.hgetall(SEARCH_KEY + job_id))
        if not raw or raw.get("kind") != "search":
            return None
        return SearchJob(
            id=job_id,
            tenant=raw["tenant"],
            status=JobStatus(raw["status"]),
            spec=SearchSpec.model_validate_json(raw["spec"]),
            created_at=float(raw["created_at"]),
            webhook_url=raw.get("webhook_url") or None,
            started_at=_opt_float(raw.get("started_at")),
            finished_at=_opt_float(raw.get("finished_at")),
            result=SearchResult.model_validate_json(raw["result"]) if raw.get("result") else None,
            error=ErrorInfo.model_validate_json(raw["error"]) if raw.get("error") else None,
        )

    def get_search_status(self, job_id: str) -> JobStatus | None:
        return self._status(SEARCH_KEY + job_id)

    def get_ingest_status(self, job_id: str) -> JobStatus | None:
        return self._status(INGEST_KEY + job_id)

    def _status(self, key: str) -> JobStatus | None:
        value = cast(str | None, self.redis.hget(key, "status"))
        return JobStatus(value) if value else None

    def start_search(self, job_id: str) -> bool:
        """queued (or running, on redelivery) -> running. False if it is final or missing."""
        return self._job(
            SEARCH_KEY, job_id, JobStatus.RUNNING, "queued,running", {"started_at": repr(_now())}
        )

    def requeue_search(self, job_id: str) -> bool:
        """running -> queued, before a retry."""
        return self._job(SEARCH_KEY, job_id, JobStatus.QUEUED, "running")

    def finish_search(
        self, job_id: str, *, result: SearchResult | None = None, error: ErrorInfo | None = None
    ) -> bool:
        """-> succeeded (with ``result``) or failed (with ``error``), unless already final."""
        return self._finish(SEARCH_KEY, job_id, result=result, error=error)

    # --- ingest -----------------------------------------------------------------------------

    def create_ingest(
        self,
        tenant: str,
        index: str,
        documents: Sequence[DocumentIn],
        *,
        enqueue: Enqueue | None = None,
    ) -> IngestJob:
        job = IngestJob(
            id=_new_id(INGEST_ID_PREFIX),
            tenant=tenant,
            index=index,
            status=JobStatus.QUEUED,
            documents=len(documents),
            created_at=_now(),
        )
        key = INGEST_KEY + job.id
        payload = json.dumps([d.model_dump() for d in documents], separators=(",", ":"))
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(INGEST_DOCS_KEY + job.id, payload, ex=INGEST_DOCS_TTL_SECONDS)
        pipe.hset(
            key,
            mapping={
                "kind": "ingest",
                "tenant": tenant,
                "index": index,
                "status": job.status.value,
                "documents": str(job.documents),
                "created_at": repr(job.created_at),
            },
        )
        pipe.expire(key, self.result_ttl)
        pipe.zadd(ACTIVE_JOBS_KEY, {job.id: job.created_at})  # watched by the re-drive
        _stage_messages(pipe, enqueue, job.id)
        pipe.execute()
        return job

    def get_ingest(self, job_id: str) -> IngestJob | None:
        raw = cast(dict[str, str], self.redis.hgetall(INGEST_KEY + job_id))
        if not raw or raw.get("kind") != "ingest":
            return None
        return IngestJob(
            id=job_id,
            tenant=raw["tenant"],
            index=raw["index"],
            status=JobStatus(raw["status"]),
            documents=int(raw["documents"]),
            created_at=float(raw["created_at"]),
            started_at=_opt_float(raw.get("started_at")),
            finished_at=_opt_float(raw.get("finished_at")),
            upserted=int(raw["upserted"]) if raw.get("upserted") else None,
            error=ErrorInfo.model_validate_json(raw["error"]) if raw.get("error") else None,
        )

    def ingest_documents(self, job_id: str) -> list[DocumentIn] | None:
        raw = cast(str | None, self.redis.get(INGEST_DOCS_KEY + job_id))
        if raw is None:
            return None
        return [DocumentIn.model_validate(d) for d in json.loads(raw)]

    def start_ingest(self, job_id: str) -> bool:
        return self._job(
            INGEST_KEY,
            job_id,
            JobStatus.RUNNING,
            "queued,running",
            {"started_at": repr(_now())},
            count=False,
        )

    def requeue_ingest(self, job_id: str) -> bool:
        return self._job(INGEST_KEY, job_id, JobStatus.QUEUED, "running", count=False)

    def finish_ingest(
        self, job_id: str, *, upserted: int | None = None, error: ErrorInfo | None = None
    ) -> bool:
        fields: dict[str, str] = {"finished_at": repr(_now())}
        if error is not None:
            status = JobStatus.FAILED
            fields["error"] = error.model_dump_json()
        else:
            status = JobStatus.SUCCEEDED
            fields["upserted"] = str(upserted or 0)
        applied = self._job(INGEST_KEY, job_id, status, "queued,running", fields, count=False)
        if applied:
            self.redis.delete(INGEST_DOCS_KEY + job_id)
        return applied

    # --- batches ----------------------------------------------------------------------------

    def create_batch(
        self,
        tenant: str,
        index: str,
        items: Sequence[tuple[str, SearchSpec | str]],
        *,
        lane: str = "standard",
        rerank: bool | None = None,
        webhook_url: str | None = None,
        enqueue: Enqueue | None = None,
        claim: IdempotencyRef | None = None,
    ) -> BatchJob:
        """Store a batch and its items, all ``queued``, with its task messages from
        ``enqueue`` and, with ``claim``, the Idempotency-Key bound to it.

        The items go first, in a pipeline of slices (:meth:`_stage_items`): Redis serves
        other clients between two slices, where one MULTI of 100,000 items held it for a
        quarter of a second. Nothing reads them until the batch's record exists, which the
        commit then writes in one MULTI with its counts, its task messages and the key's
        binding (the outbox: no record without its messages). The MULTI runs under a WATCH
        of the key and of the record: it raises :class:`IdempotencyKeyBound`, writing
        nothing and dropping the items, if the key names a job already; and a MULTI whose
        reply was lost to a broken connection is not written twice (the WATCH makes redis-py
        try again, which finds the record). Query ids must be unique; a spec may come as its
        JSON already (the gateway's, which turns each slice of a big batch into strings as it
        validates it)."""
        batch = BatchJob(
            id=_new_id(BATCH_ID_PREFIX),
            tenant=tenant,
            index=index,
            lane=lane,
            total=len(items),
            created_at=_now(),
            rerank=rerank,
            webhook_url=webhook_url,
        )
        batch.counts = {s.value: 0 for s in _STATUSES}
        batch.counts[JobStatus.QUEUED.value] = batch.total
        bid = batch.id
        self._stage_items(
            bid, [(qid, s if isinstance(s, str) else s.model_dump_json()) for qid, s in items]
        )
        messages = list(enqueue(bid)) if enqueue is not None else []
        binding = _idem_binding(claim, bid) if claim is not None else None
        watched = [BATCH_KEY + bid] + ([binding[0]] if binding is not None else [])

        def commit(pipe: redis.client.Pipeline) -> None:
            if pipe.exists(BATCH_KEY + bid):
                return  # this MULTI was applied, its reply lost
            if binding is not None and claim is not None:
                earlier = _bound(cast(str | None, pipe.get(binding[0])), claim.fingerprint)
                if earlier is not None:
                    pipe.unwatch()
                    self.redis.delete(*_staged_keys(bid))
                    raise IdempotencyKeyBound(earlier)
            pipe.multi()
            self._commit_batch(pipe, batch, messages)
            if binding is not None:
                name, value, ttl = binding
                pipe.set(name, value, ex=ttl)

        self.redis.transaction(commit, *watched)
        return batch

    def _stage_items(self, batch_id: str, specs: Sequence[tuple[str, str]]) -> None:
        """Write a new batch's items (order, specs, statuses), ``BATCH_STAGE_SLICE`` per
        command, living ``BATCH_STAGING_TTL_SECONDS`` until the commit keeps them: a gateway
        that dies before its commit leaves nothing for long. One pipeline, which starts by
        emptying the keys, so a retry of it (redis-py sends it again after a broken
        connection) does not push the order twice."""
        order, spec_key, item_key = _staged_keys(batch_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(order, spec_key, item_key)
        for start in range(0, len(specs), BATCH_STAGE_SLICE):
            part = specs[start : start + BATCH_STAGE_SLICE]
            pipe.rpush(order, *[qid for qid, _ in part])
            pipe.hset(spec_key, mapping=dict(part))
            pipe.hset(item_key, mapping={qid: "queued" for qid, _ in part})
        for key in (order, spec_key, item_key):
            pipe.expire(key, BATCH_STAGING_TTL_SECONDS)
        pipe.execute()

    def _commit_batch(
        self, pipe: redis.client.Pipeline, batch: BatchJob, messages: Sequence[tuple[str, str]]
    ) -> None:
        """Queue a new batch's commit in ``pipe``'s MULTI: its record, counts, the retention
        of every key (its staged items' too), the queued count, the re-drive's active set
        and its task messages."""
        bid = batch.id
        pipe.hset(
            BATCH_KEY + bid,
            mapping={
                "tenant": batch.tenant,
                "index": batch.index,
                "lane": batch.lane,
                "rerank": "" if batch.rerank is None else ("1" if batch.rerank else "0"),
                "webhook_url": batch.webhook_url or "",
                "total": str(batch.total),
                "created_at": repr(batch.created_at),
            },
        )
        pipe.hset(BATCH_COUNTS_KEY + bid, mapping={k: str(v) for k, v in batch.counts.items()})
        # a placeholder field ("" is never a query id) so the key exists now and takes its TTL
        pipe.hset(BATCH_RESULTS_KEY + bid, "", "")
        for key in (BATCH_KEY, BATCH_COUNTS_KEY, BATCH_RESULTS_KEY):
            pipe.expire(key + bid, self.result_ttl)
        for key in _staged_keys(bid):
            pipe.expire(key, self.result_ttl)
        pipe.hincrby(STATS_KEY, JobStatus.QUEUED.value, batch.total)
        if batch.lane != LANE_ECONOMY:  # the economy lane's items wait on provider batches
            pipe.zadd(ACTIVE_JOBS_KEY, {bid: batch.created_at})
        for key, raw in messages:
            pipe.lpush(key, raw)

    def get_batch(self, batch_id: str) -> BatchJob | None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(BATCH_KEY + batch_id)
        pipe.hgetall(BATCH_COUNTS_KEY + batch_id)
        raw, counts = cast(list[dict[str, str]], pipe.execute())
        if not raw:
            return None
        rerank = raw.get("rerank", "")
        return BatchJob(
            id=batch_id,
            tenant=raw["tenant"],
            index=raw["index"],
            lane=raw.get("lane", "standard"),
            total=int(raw["total"]),
            created_at=float(raw["created_at"]),
            counts={s.value: int(counts.get(s.value, 0)) for s in _STATUSES},
            rerank=None if rerank == "" else rerank == "1",
            webhook_url=raw.get("webhook_url") or None,
            canceled_at=_opt_float(raw.get("canceled_at")),
            finished_at=_opt_float(raw.get("finished_at")),
        )

    def batch_query_ids(self, batch_id: str, start: int, stop: int) -> list[str]:
        """Query ids ``start`` (inclusive) to ``stop`` (exclusive), in submission order."""
        if stop <= start:
            return []
        return cast(list[str], self.redis.lrange(BATCH_ORDER_KEY + batch_id, start, stop - 1))

    def batch_items(self, batch_id: str, query_ids: Sequence[str]) -> list[BatchItem]:
        if not query_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        pipe.hmget(BATCH_ITEMS_KEY + batch_id, list(query_ids))
        pipe.hmget(BATCH_SPECS_KEY + batch_id, list(query_ids))
        statuses, specs = cast(list[list[str | None]], pipe.execute())
        items = []
        for qid, status, spec in zip(query_ids, statuses, specs, strict=True):
            if status is None:
                continue
            items.append(
                BatchItem(
                    qid, JobStatus(status), SearchSpec.model_validate_json(spec) if spec else None
                )
            )
        return items

    def start_item(self, batch_id: str, query_id: str) -> bool:
        """queued (or running, on redelivery) -> running. False if final, canceled or missing,
        or if its batch has been canceled (then the item is canceled instead)."""
        return self.begin_item(batch_id, query_id).started

    def begin_item(self, batch_id: str, query_id: str) -> ItemTransition:
        """:meth:`start_item`, answering the transition: ``canceled`` (and maybe
        ``batch_completed``) when the batch's cancel mark canceled the item instead."""
        return self._item(batch_id, query_id, *_START_ITEM)

    def check_item(self, batch_id: str, query_id: str) -> ItemTransition:
        """Before a running item's model call: if its batch has been canceled, running ->
        canceled (``canceled`` set; go no further), else nothing changes (``applied``: go
        on). Not ``applied``: the item is no longer running (finished by another
        delivery); go no further either. One script, one round trip, shared with other
        threads' transitions."""
        return self._item(batch_id, query_id, *_CHECK_ITEM)

    def batch_canceled(self, batch_id: str) -> bool:
        """Whether a cancel has marked the batch (one ``HEXISTS``; :meth:`check_item` is
        what acts on it, atomically)."""
        return bool(self.redis.hexists(BATCH_KEY + batch_id, "canceled_at"))

    def requeue_item(self, batch_id: str, query_id: str) -> bool:
        return self._item(batch_id, query_id, JobStatus.QUEUED, "running", "", False).applied

    def finish_item(
        self,
        batch_id: str,
        query_id: str,
        *,
        result: SearchResult | None = None,
        error: ErrorInfo | None = None,
    ) -> ItemTransition:
        """-> succeeded or failed, at most once; says whether that completed the batch."""
        transition, _ = self.finish_and_start_item(batch_id, query_id, result=result, error=error)
        return transition

    def finish_and_start_item(
        self,
        batch_id: str,
        query_id: str,
        *,
        result: SearchResult | None = None,
        error: ErrorInfo | None = None,
        start: tuple[str, str] | None = None,
    ) -> tuple[ItemTransition, ItemTransition | None]:
        """:meth:`finish_item`, then :meth:`begin_item` of ``start`` (batch id, query id; of
        any batch), in one round trip: a thread that runs items back to back pays one per
        item. Answers the finish, and the start's transition (None without ``start``)."""
        if error is not None:
            status, payload = JobStatus.FAILED, '{"error":' + error.model_dump_json() + "}"
        else:
            assert result is not None
            status, payload = JobStatus.SUCCEEDED, '{"result":' + result.model_dump_json() + "}"
        moves: list[_Move] = [(batch_id, query_id, status, "queued,running", payload, False)]
        if start is not None:
            moves.append((*start, *_START_ITEM))
        transitions = self._items(moves)
        return transitions[0], transitions[1] if start is not None else None

    def cancel_batch(self, batch_id: str) -> tuple[int, bool] | CancelOutcome:
        """Mark the batch canceled and cancel every item still queued; an item already
        taken by a worker is canceled when it next checks the mark (before it starts and
        before its model call). Returns (canceled now, batch completed now); a missing or
        finished batch changes nothing and returns why."""
        keys = [
            BATCH_ITEMS_KEY + batch_id,
            BATCH_COUNTS_KEY + batch_id,
            BATCH_KEY + batch_id,
            STATS_KEY,
            ACTIVE_JOBS_KEY,
        ]
        canceled, completed = cast(
            list[int], self._cancel_batch(keys=keys, args=[repr(_now()), batch_id])
        )
        if canceled == -1:
            return CancelOutcome.MISSING
        if canceled == -2:
            return CancelOutcome.ALREADY_FINISHED
        return int(canceled), bool(completed)

    def batch_results(self, batch_id: str, start: int, count: int) -> list[ItemOutcome]:
        """``count`` results from position ``start``, in submission order."""
        qids = self.batch_query_ids(batch_id, start, start + count)
        if not qids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        pipe.hmget(BATCH_ITEMS_KEY + batch_id, qids)
        pipe.hmget(BATCH_RESULTS_KEY + batch_id, qids)
        statuses, outcomes = cast(list[list[str | None]], pipe.execute())
        return [
            ItemOutcome(qid, JobStatus(status or "queued"), outcome or None)
            for qid, status, outcome in zip(qids, statuses, outcomes, strict=True)
        ]

    def cancel_item(self, batch_id: str, query_id: str) -> ItemTransition:
        """queued or running -> canceled (the provider canceled its request), at most once."""
        return self._item(batch_id, query_id, JobStatus.CANCELED, "queued,running", "", False)

    def query_ids_at(self, batch_id: str, positions: Sequence[int]) -> list[str | None]:
        """The query ids at these positions of the submission order (None past the end)."""
        pipe = self.redis.pipeline(transaction=False)
        for position in positions:
            pipe.lindex(BATCH_ORDER_KEY + batch_id, position)
        return cast(list[str | None], pipe.execute())

    # --- the economy lane -------------------------------------------------------------------

    def economy_save(self, batch_id: str, key: str, values: dict[str, str]) -> None:
        """HSET ``values`` into one of the batch's economy hashes (``ECONOMY_*_KEY``)."""
        if not values:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key + batch_id, mapping={k: v for k, v in values.items()})
        pipe.expire(key + batch_id, self.result_ttl)
        pipe.execute()

    def economy_get(self, batch_id: str, key: str, fields: Sequence[str]) -> list[str | None]:
        if not fields:
            return []
        return cast(list[str | None], self.redis.hmget(key + batch_id, list(fields)))

    def economy_all(self, batch_id: str, key: str) -> dict[str, str]:
        return cast(dict[str, str], self.redis.hgetall(key + batch_id))

    def economy_fields(self, batch_id: str, key: str) -> list[str]:
        return cast(list[str], self.redis.hkeys(key + batch_id))

    def economy_drop(self, batch_id: str, key: str, fields: Sequence[str]) -> None:
        if fields:
            self.redis.hdel(key + batch_id, *fields)

    def economy_claim(self, batch_id: str, claim: str) -> bool:
        """True for the first caller only: e.g. the one chunk that enqueues the submission."""
        key = ECONOMY_STATE_KEY + batch_id
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(key, claim, repr(_now()))
        pipe.expire(key, self.result_ttl)
        won, _ = pipe.execute()
        return bool(won)

    def economy_settled(self, batch_id: str) -> bool:
        """True once every item of the batch is final or prepared (its prompt waits to go)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hlen(ECONOMY_PREPARED_KEY + batch_id)
        pipe.hmget(BATCH_COUNTS_KEY + batch_id, [s.value for s in FINAL])
        pipe.hget(BATCH_KEY + batch_id, "total")
        prepared, finals, total = pipe.execute()
        done = int(prepared) + sum(int(n or 0) for n in finals)
        return total is not None and done >= int(total)

    def economy_delete(self, batch_id: str) -> None:
        """Forget a finished batch's prepared searches (the biggest economy key)."""
        self.redis.delete(ECONOMY_PREPARED_KEY + batch_id)

    # --- idempotency ------------------------------------------------------------------------

    def claim_idempotency(self, tenant: str, key: str, fingerprint: str) -> IdempotencyClaim:
        """Claim ``key`` for this request (a pending marker, ``IDEMPOTENCY_PENDING_TTL_SECONDS``),
        or say what an earlier request with it did: a key bound to a job replays that job,
        whether or not the request that created it is still being answered."""
        marker = json.dumps({"fp": fingerprint, "state": "pending", "job": None})
        earlier = self._claim_idempotency(
            keys=[_idem_key(tenant, key)], args=[marker, IDEMPOTENCY_PENDING_TTL_SECONDS]
        )
        if earlier is None:
            return IdempotencyClaim(IdempotencyOutcome.NEW)
        return _claim_of(cast(str, earlier), fingerprint)

    def release_idempotency(self, tenant: str, key: str) -> bool:
        """Forget the pending marker of a request that failed before creating its job, so a
        retry may go ahead; a key bound to a job stays bound (the reply may have been lost
        after the job was written)."""
        return bool(self._release_idempotency(keys=[_idem_key(tenant, key)]))

    # --- deliveries and stats ---------------------------------------------------------------

    def count_delivery(self, task_id: str, retry: int) -> int:
        """How many times this message (task id, retry number) has been delivered, this one too."""
        return self._increment(_attempts_key(task_id, retry), ATTEMPTS_TTL_SECONDS)

    def set_deliveries(self, task_id: str, retry: int, count: int) -> None:
        """Start a message's delivery counter at ``count`` (a re-drive past its cap is sent
        already spent, so the task takes its poison path)."""
        self.redis.set(_attempts_key(task_id, retry), count, ex=ATTEMPTS_TTL_SECONDS)

    def in_flight(self) -> dict[str, int]:
        """Searches and batch items queued and running now, across the deployment."""
        return _in_flight(cast(dict[str, str], self.redis.hgetall(STATS_KEY)))

    # --- the re-drive's view (worker/queue/redrive.py) ------------------------------------------

    def stalled_jobs(self, idle_seconds: float) -> list[str]:
        """Search, ingest and standard-lane batch ids not final whose status last changed more than
        ``idle_seconds`` ago, the longest idle first. Forgets ids idle past the retention."""
        now = _now()
        pipe = self.redis.pipeline(transaction=False)
        pipe.zremrangebyscore(ACTIVE_JOBS_KEY, "-inf", now - self.result_ttl)
        pipe.zrangebyscore(ACTIVE_JOBS_KEY, "-inf", now - idle_seconds)
        _, ids = pipe.execute()
        return cast(list[str], ids)

    def forget_active(self, job_id: str) -> None:
        """Drop a job from the active set (its record is gone, or it is final)."""
        self.redis.zrem(ACTIVE_JOBS_KEY, job_id)

    def pending_positions(self, batch_id: str) -> list[int] | None:
        """The submission positions of a batch's items still queued or running (None: no
        such batch)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.lrange(BATCH_ORDER_KEY + batch_id, 0, -1)
        pipe.hgetall(BATCH_ITEMS_KEY + batch_id)
        order, statuses = cast(tuple[list[str], dict[str, str]], pipe.execute())
        if not order:
            return None
        pending = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
        return [i for i, qid in enumerate(order) if statuses.get(qid) in pending]

    def count_redrive(self, job_id: str) -> int:
        """Count one more re-drive of this job; answers how many there have been."""
        return self._increment(REDRIVE_COUNT_KEY + job_id, self.result_ttl)

    # --- task messages ---------------------------------------------------------------------

    def push_messages(self, messages: Sequence[tuple[str, str]]) -> None:
        """LPUSH ready-made broker messages, (list key, raw message), as kombu's Redis does."""
        pipe = self.redis.pipeline(transaction=False)
        for key, raw in messages:
            pipe.lpush(key, raw)
        pipe.execute()

    # --- internals --------------------------------------------------------------------------

    def _increment(self, key: str, ttl: int) -> int:
        """Add one to the counter at ``key`` and (re)start its TTL; answers the new count."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.incr(key)
        pipe.expire(key, ttl)
        count, _ = pipe.execute()
        return int(count)

    def _finish(
        self, prefix: str, job_id: str, *, result: SearchResult | None, error: ErrorInfo | None
    ) -> bool:
        fields: dict[str, str] = {"finished_at": repr(_now())}
        if error is not None:
            status = JobStatus.FAILED
            fields["error"] = error.model_dump_json()
        else:
            assert result is not None
            status = JobStatus.SUCCEEDED
            fields["result"] = result.model_dump_json()
        return self._job(prefix, job_id, status, "queued,running", fields)

    def _job(
        self,
        prefix: str,
        job_id: str,
        to: JobStatus,
        allowed: str,
        fields: dict[str, str] | None = None,
        *,
        count: bool = True,
    ) -> bool:
        args: list[str] = [to.value, allowed, str(self.result_ttl), repr(_now()), job_id]
        for name, value in (fields or {}).items():
            args += [name, value]
        stats = STATS_KEY if count else STATS_UNTRACKED_KEY
        keys = [prefix + job_id, stats, ACTIVE_JOBS_KEY]
        (code,) = self._transitions.call([(self._transition_job, keys, args)])
        if isinstance(code, Exception):
            raise code
        return int(code) == 1

    def _item(
        self,
        batch_id: str,
        query_id: str,
        to: JobStatus,
        allowed: str,
        payload: str,
        cancelable: bool,
    ) -> ItemTransition:
        (transition,) = self._items([(batch_id, query_id, to, allowed, payload, cancelable)])
        return transition

    def _items(self, moves: Sequence[_Move]) -> list[ItemTransition]:
        """Item transitions (batch id, query id, to, allowed-from, outcome JSON or '', and
        whether the batch's cancel mark makes it a cancel), in order, in one round trip."""
        now = repr(_now())
        calls: list[_ScriptCall] = [
            (
                self._transition_item,
                [
                    BATCH_ITEMS_KEY + batch_id,
                    BATCH_RESULTS_KEY + batch_id,
                    BATCH_COUNTS_KEY + batch_id,
                    BATCH_KEY + batch_id,
                    STATS_KEY,
                    ACTIVE_JOBS_KEY,
                ],
                [query_id, to.value, allowed, payload, now, batch_id, "1" if cancelable else ""],
            )
            for batch_id, query_id, to, allowed, payload, cancelable in moves
        ]
        first, *rest = self._transitions.call(calls)
        if isinstance(first, Exception):
            raise first
        # a later move that failed did not apply: the first one did, and is what counts
        replies = [first] + [[0, 0] if isinstance(reply, Exception) else reply for reply in rest]
        return [
            ItemTransition(
                applied=int(code) >= 1,
                batch_completed=int(code) == 2,
                canceled=int(code) >= 1 and int(canceled) == 1,
            )
            for code, canceled in replies
        ]

    def _run_scripts(self, requests: list[list[_ScriptCall]]) -> list[list[Any]]:
        """Each request's script calls, all in one round trip; each call's reply, or its
        error, in its place. One the server no longer holds (a restart empties its script
        cache) runs again on its own, which loads it."""
        replies = self._evalsha_all([call for request in requests for call in request])
        answers: list[list[Any]] = []
        at = 0
        for request in requests:
            answers.append(
                [
                    _rerun(call) if isinstance(reply, NoScriptError) else reply
                    for call, reply in zip(request, replies[at : at + len(request)], strict=True)
                ]
            )
            at += len(request)
        return answers

    def _evalsha_all(self, calls: list[_ScriptCall]) -> list[Any]:
        """``EVALSHA`` of every call, written at once and read back on the store's own
        connection, retried the way the client's commands are. The coalescer makes one call
        at a time, so one connection serves it, with none of a pool checkout's checks."""
        commands = [
            ("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args in calls
        ]
        if self._own is None or self._own_pid != os.getpid():
            self._own, self._own_pid = self.redis.connection_pool.make_connection(), os.getpid()
        conn = self._own

        def send_and_read() -> list[Any]:
            conn.send_packed_command(conn.pack_commands(commands))
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:  # the script's own error, or NOSCRIPT
                    replies.append(exc)
            return replies

        return cast(
            list[Any], conn.retry.call_with_retry(send_and_read, lambda _: conn.disconnect())
        )


class AsyncJobStore:
    """The gateway's hot path on ``redis.asyncio``: no thread per request. It runs the same
    scripts with the same arguments as :class:`JobStore` (``_create_search_call``).

    store = AsyncJobStore.from_url("redis://localhost:6379/0", max_connections=128)
    job = await store.create_search("acme", spec, enqueue=outbox.messages_for(...))
    """

    def __init__(
        self, client: redis.asyncio.Redis, *, result_ttl: int = RESULT_TTL_SECONDS
    ) -> None:
        self.redis = client
        self.result_ttl = result_ttl
        self._create_search = client.register_script(_CREATE_SEARCH)

    @classmethod
    def from_url(cls, url: str, *, max_connections: int = 128) -> AsyncJobStore:
        """A store on ``url``; a request that finds every connection busy waits for one
        (up to 20 s), as :meth:`JobStore.from_url` with ``max_connections`` does.

        A command that meets a broken connection (a refused connect, a failed health check,
        a reset) is tried once more, on a new connection, 50 ms later. That is safe for what
        this store sends: the ``in_flight`` read, and the create script, which does nothing
        when its record exists (its first try ran; only the reply was lost)."""
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=20,
            retry=AsyncRetry(ConstantBackoff(0.05), retries=1),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            **CONNECTION_OPTIONS,
        )
        return cls(redis.asyncio.Redis(connection_pool=pool))

    async def close(self) -> None:
        await self.redis.aclose()
        await self.redis.connection_pool.disconnect()

    async def create_search(
        self,
        tenant: str,
        spec: SearchSpec,
        *,
        webhook_url: str | None = None,
        enqueue: Enqueue | None = None,
        claim: IdempotencyRef | None = None,
    ) -> SearchJob:
        """:meth:`JobStore.create_search`, awaited."""
        job = _new_search(tenant, spec, webhook_url)
        keys, args = _create_search_call(job, self.result_ttl, enqueue, claim)
        return _search_created(job, await self._create_search(keys=keys, args=args), claim)

    async def in_flight(self) -> dict[str, int]:
        """:meth:`JobStore.in_flight`, awaited."""
        return _in_flight(cast(dict[str, str], await self.redis.hgetall(STATS_KEY)))


def webhook_event(
    event_type: str, job_id: str, tenant: str, url: str, status: str
) -> dict[str, Any]:
    """The message a ``sift.webhook`` task gets. ``webhook_id`` is stable across retries."""
    return {
        "webhook_id": f"msg_{job_id}",
        "type": event_type,
        "occurred_at": datetime.now(UTC).isoformat(),
        "tenant": tenant,
        "url": url,
        "data": {"id": job_id, "status": status},
    }


def fingerprint(*parts: Iterable[Any] | Any) -> str:
    """A stable hash of a request (its route and its canonical JSON body)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
