"""The index lifecycle's records: delete jobs (by id, or the tenant's whole index) and the
answers of index reads.

A delete is an ingest-kind job (``operation`` "delete" or "drop"): the same record, the
same task, the same re-drive and outbox, polled at ``GET /v1/ingestions/{id}``; its write
version comes from the counter every upsert's does, so the backend can order them.

An index read (list, show, one document) runs on a worker, which holds the backend; it
answers by pushing JSON onto a one-off list, ``INDEX_REPLY_KEY`` + a request id, that the
gateway pops with ``BLPOP``s of :func:`reply_slice_seconds`
(:meth:`AsyncJobStore.await_reply <worker.queue.jobstore.AsyncJobStore.await_reply>`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import cast

from worker.clock import server_seconds
from worker.constants import (
    INDEX_REPLY_KEY,
    INDEX_REPLY_TTL_SECONDS,
    INDEX_SIZE_KEY,
    INGEST_DOCS_KEY,
)
from worker.queue.jobstore.idempotency import IdempotencyRef
from worker.queue.jobstore.ingests import IngestRecords
from worker.queue.jobstore.records import Enqueue, IngestJob


class LifecycleRecords(IngestRecords):
    """Delete jobs and index-read replies."""

    def create_deletion(
        self,
        tenant: str,
        index: str,
        ids: Sequence[str] | None,
        *,
        enqueue: Enqueue | None = None,
        claim: IdempotencyRef | None = None,
    ) -> IngestJob:
        """A job deleting ``ids`` from the tenant's index, or (``ids`` None) the tenant's
        whole index; with ``claim``, its Idempotency-Key bound to it (as an upsert's)."""
        if ids is None:
            return self._create_write(tenant, index, "drop", None, 0, enqueue, claim)
        unique = list(dict.fromkeys(ids))
        payload = json.dumps(unique, separators=(",", ":"))
        return self._create_write(tenant, index, "delete", payload, len(unique), enqueue, claim)

    def deletion_ids(self, job_id: str) -> list[str] | None:
        """The ids a delete job deletes; None once they expired."""
        raw = cast(str | None, self.redis.get(INGEST_DOCS_KEY + job_id))
        return None if raw is None else [str(i) for i in json.loads(raw)]

    def record_index_size(self, tenant: str, index: str, documents: int, stored: int) -> None:
        """Keep what the tenant's index holds, as the backend read it after a write job: its
        ``documents`` and their ``stored`` bytes (no document: the key goes). A whole
        reading, not a delta: a job run twice, or two jobs' readings landing out of order,
        leave it true again by the next write."""
        key = index_size_key(tenant, index)
        if documents <= 0:
            self.redis.delete(key)
        else:
            self.redis.hset(key, mapping={"documents": documents, "bytes": stored})

    @staticmethod
    def new_reply_key() -> str:
        return INDEX_REPLY_KEY + uuid.uuid4().hex

    def server_time(self) -> float:
        """Redis's clock, epoch seconds: the one a settings change's ``start_by`` is on (set
        by the gateway, checked by a worker on another host)."""
        return server_seconds(self.redis.time())

    def reply(self, key: str, answer: str) -> None:
        """A worker's answer to one index read."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.rpush(key, answer)
        pipe.expire(key, INDEX_REPLY_TTL_SECONDS)
        pipe.execute()


# at least 10 ms: a BLPOP timeout Redis reads as 0 would block for good
MIN_REPLY_SLICE_SECONDS = 0.01


def reply_slice_seconds(socket_timeout: float | None) -> float:
    """The longest ``BLPOP`` of a wait for an index read's answer: a second at most, and half
    the client's socket timeout. One of the whole wait (10 s) was cut by the gateway's socket
    timeout (``SIFT_GATEWAY_REDIS_TIMEOUT_SECONDS``, 10 s) as if Redis had stalled. A Redis
    that does stall still fails the slice at that timeout.

    >>> reply_slice_seconds(10.0), reply_slice_seconds(1.0), reply_slice_seconds(None)
    (1.0, 0.5, 1.0)
    """
    return min(1.0, socket_timeout / 2) if socket_timeout else 1.0


def index_size_key(tenant: str, index: str) -> str:
    return f"{INDEX_SIZE_KEY}{tenant}:{index}"


def index_size_of(raw: Sequence[str | None]) -> tuple[int, int] | None:
    """The documents and stored bytes of a tenant's index from its key's ``documents`` and
    ``bytes`` (an HMGET's answer); None when not recorded.

    >>> index_size_of(["3", "900"])
    (3, 900)
    >>> index_size_of([None, None]) is None
    True
    """
    documents, stored = raw
    if documents is None or stored is None:
        return None
    return int(documents), int(stored)
