"""The index read task: one index read (list, show, a document) or settings change, answered
to the gateway waiting for it."""

from __future__ import annotations

import json
import logging

import redis
from celery import shared_task

from worker.constants import (
    ERROR_JOB_STORE_FULL,
    ERROR_UNAVAILABLE,
    INDEX_READ_TASK,
)
from worker.errors import TenantRemoved
from worker.observability import metrics
from worker.queue import lifecycle
from worker.queue.base import SiftTask, error_info
from worker.redis_client import CANNOT_PERSIST, cannot_persist

log = logging.getLogger(__name__)


def job_store_error(exc: BaseException) -> dict[str, str] | None:
    """The answer to an index read whose run met Redis failing: the gateway's own 503 of
    the job store (``job_store_full`` at Redis's maxmemory or unable to persist to its disk,
    ``unavailable`` down or silent), not an ``internal_error`` it told its client as the
    search backend's ``backend_unavailable``. None for any other error, a bug's. Redis's
    text names its host and port: the log has it, the answer says what failed.

    >>> job_store_error(redis.TimeoutError("Timeout reading from 10.0.0.5:6379"))["message"]
    'Redis did not answer the worker in time'
    >>> job_store_error(redis.ResponseError("WRONGTYPE Operation against a key")) is None
    True
    """
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return {"type": ERROR_JOB_STORE_FULL, "message": "Redis reached its maxmemory"}
    if cannot_persist(exc):
        return {"type": ERROR_JOB_STORE_FULL, "message": CANNOT_PERSIST}
    if isinstance(exc, redis.TimeoutError):
        return {"type": ERROR_UNAVAILABLE, "message": "Redis did not answer the worker in time"}
    if isinstance(exc, redis.ConnectionError):
        return {"type": ERROR_UNAVAILABLE, "message": "the worker could not reach Redis"}
    return None


@shared_task(  # type: ignore[untyped-decorator]
    name=INDEX_READ_TASK, base=SiftTask, bind=True
)
def index_read(
    self: SiftTask,
    reply_key: str,
    operation: str,
    tenant: str,
    index: str,
    doc_id: str,
    body: str = "",
    start_by: float = 0.0,
) -> None:
    """Answer one index read (list, show, a document) or settings change (``update``, with
    its patch as ``body``) on ``reply_key`` (first, so the logs name the read by it). Never
    retried: the gateway waits a few seconds for the answer, then answers 503, and the
    client asks again (a change is a merge patch: applying it twice changes nothing more).
    A change not started by ``start_by`` (epoch seconds on Redis's clock, ``TIME``: the
    gateway's host and this one may disagree by seconds) is dropped unapplied: its gateway
    has answered 503 or is about to, and a later change may have been made since; so is one
    that has not had its index's settings lock by then. Redis failing is answered as the
    job store's failure wherever it comes, in reading its clock for ``start_by`` too (that
    one dropped the change unanswered, and its gateway waited out its 13 s to say no worker
    answered); only the answer's own write can tell no one, so it is logged. A read carries
    its ``start_by`` too, the end of its gateway's wait: one taken later (a backlog, a
    worker started late) is dropped unrun, logged and counted
    (``sift_index_reads_dropped_total``), as no one waits for its answer any more."""
    try:
        if start_by and self.context.store.server_time() > start_by:
            log.warning(
                "index %s for %s/%s came after its gateway gave up; dropped",
                operation,
                tenant,
                index,
            )
            metrics.index_read_dropped(operation)
            return
        self.context.admit(tenant)  # a removed tenant's index is not read nor changed either
        runtime = self.context.runtime
        answer = lifecycle.read(runtime, operation, tenant, index, doc_id, body, start_by)
    except TenantRemoved as exc:  # the gateway answers it 503, naming the removal
        answer = json.dumps({"error": {"type": exc.code, "message": str(exc)}})
    except Exception as exc:  # the gateway must hear something, not time out
        if (error := job_store_error(exc)) is not None:
            log.warning("index read %s for %s: the job store failed: %r", operation, tenant, exc)
        else:
            log.exception("index read %s for %s: unexpected error", operation, tenant)
            error = {"type": "internal_error", "message": error_info(exc).message}
        answer = json.dumps({"error": error})
    try:
        self.context.store.reply(reply_key, answer)
    except redis.RedisError as exc:  # nothing left to tell the gateway with: its wait ends in 503
        log.warning(
            "index read %s for %s: its answer on %s could not be sent: %r",
            operation,
            tenant,
            reply_key,
            exc,
        )
