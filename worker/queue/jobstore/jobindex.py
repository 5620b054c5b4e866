"""Each tenant's job index: the ids of its searches, batches and ingests by creation time.

Why. ``GET /v1/searches`` (and batches, ingestions) lists a tenant's jobs newest first without
scanning Redis's keyspace: one zset per kind and tenant (``sift:jobs:<kind>:<tenant>``), job id
-> creation time. A job joins it in the very write that creates its record (the search's Lua
script, the ingest's script, the batch's ``MULTI``), so a listed id always had a record; a record
expires on its own (its TTL), and the reads (:mod:`~worker.queue.jobstore.listing`) drop the
members whose record is gone. The index keeps members ``JOB_INDEX_RETENTIONS`` retention
periods at most and expires as long after its newest job, so a tenant that never lists its
jobs does not grow it without bound.
"""

from __future__ import annotations

import redis

from worker.constants import JOB_INDEX_KEY, JOB_INDEX_RETENTIONS

KIND_SEARCH = "search"
KIND_BATCH = "batch"
KIND_INGEST = "ingest"


def job_index_key(kind: str, tenant: str) -> str:
    """The index of ``tenant``'s jobs of one kind (the tenant comes from its API key)."""
    return f"{JOB_INDEX_KEY}{kind}:{tenant}"


def index_job(
    pipe: redis.client.Pipeline, kind: str, tenant: str, job_id: str, created_at: float, ttl: int
) -> None:
    """Queue, in the ``MULTI`` that creates the job, its entry in its tenant's index, the
    trim of members too old to have a record, and the index's expiry (``ttl``: a record's)."""
    key, keep = job_index_key(kind, tenant), ttl * JOB_INDEX_RETENTIONS
    pipe.zadd(key, {job_id: created_at})
    pipe.zremrangebyscore(key, "-inf", created_at - keep)
    pipe.expire(key, keep)
