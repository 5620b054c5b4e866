"""The document routes: an upsert's ingest job queued and answered, and an ingest job read."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Annotated

from fastapi import Path, Request, Response

from api_gateway.backpressure import STORED_FACTOR
from api_gateway.deps import (
    ERRORS,
    REPLAYED_HEADER,
    REPLAYED_HEADER_DOC,
    Tenant,
    Wait,
    accepted,
    is_id,
    job_answer,
    job_store,
    off_loop,
    poll_until,
    task_sender,
)
from api_gateway.errors import ApiError
from api_gateway.jobs._idempotency import IdemKey, _Idempotency
from api_gateway.jobs._shared import (
    JobIdPath,
    _create_and_enqueue,
    _in_store,
    _lost,
    key_job_gone,
    router,
)
from api_gateway.schemas import DocumentsRequest, IngestJobOut, iso
from worker.constants import INGEST_ID_PREFIX, INGEST_QUEUE, INGEST_TASK
from worker.contract import BLANK, INDEX_PATTERN, is_blank
from worker.errors import InvalidRequest
from worker.observability import metrics
from worker.observability.logcontext import job_context
from worker.queue.jobstore import (
    Enqueue,
    IdempotencyKeyBound,
    IdempotencyRef,
    IngestJob,
    fingerprint,
)

# what an upsert's bytes hold and how to send one that never fits, as its refusal says them
UPSERT_WORDS = ("as its documents wait for a worker", "send its documents in smaller requests")

log = logging.getLogger(__package__)  # api_gateway.jobs: one logger for the job routes


def ingest_out(job: IngestJob) -> IngestJobOut:
    return IngestJobOut(
        id=job.id,
        status=job.status,
        index=job.index,
        documents=job.documents,
        created_at=iso(job.created_at) or "",
        started_at=iso(job.started_at),
        finished_at=iso(job.finished_at),
        upserted=job.upserted,
        error=job.error,
        operation=job.operation,
        deleted=job.deleted,
    )


async def enqueue_ingest(
    request: Request, create: Callable[[Enqueue | None], IngestJob]
) -> IngestJob:
    """Store an ingest job (an upsert or a deletion, as ``create`` makes it) and queue its
    task."""
    job: IngestJob = await off_loop(
        _create_and_enqueue,
        task_sender(request),
        create,
        lambda job_id: [(INGEST_TASK, [job_id], INGEST_QUEUE)],
    )
    metrics.job_submitted("ingest")
    return job


async def ingest_response(request: Request, job: IngestJob, wait: float) -> Response:
    """The answer to a request that queued an ingest ``job``: 200 when it is final within
    ``wait`` seconds, else 202 with its ``Location`` to poll."""
    if wait > 0:
        store = job_store(request)

        async def read() -> IngestJob | None:
            return await off_loop(store.get_ingest, job.id)

        found = await poll_until(read, lambda j: j.status.final, wait, job)
        if found is None:
            raise _lost("ingest", job.id)
        job = found
    body_out = ingest_out(job).model_dump_json()
    return job_answer(
        request, body_out, final=job.status.final, route="get_ingestion", job_id=job.id
    )


@router.post(
    "/indexes/{index}/documents",
    response_model=IngestJobOut,
    status_code=202,
    responses={
        200: {
            "model": IngestJobOut,
            "description": "Ingested within `wait`.",
            "headers": REPLAYED_HEADER_DOC,
        },
        **accepted("Queued or running; poll the `Location`.", keyed=True),
        **ERRORS,
    },
    summary="Upsert documents by id into an index, for the caller's tenant",
)
async def upsert_documents(
    request: Request,
    body: DocumentsRequest,
    tenant: Tenant,
    index: Annotated[str, Path(min_length=1, max_length=128, pattern=INDEX_PATTERN)],
    wait: Wait = 0.0,
    idempotency_key: IdemKey = None,
) -> Response:
    """Enqueues an ingest job and answers 202 with its id (poll
    ``GET /v1/ingestions/{id}``), or 200 when it finished within ``wait`` seconds. A request
    sent again with its ``Idempotency-Key`` answers the job the first one made: made again,
    it would take a newer write version than a delete of its ids accepted in between, and
    bring them back."""
    first_at: dict[str, int] = {}
    for i, doc in enumerate(body.documents):
        # one write per id: the job's documents share one write version, so a backend
        # kept the first of two and silently dropped the later one (not newer)
        if doc.id in first_at:
            raise InvalidRequest(
                f"documents[{i}].id",
                f"duplicate id {doc.id!r} (first at documents[{first_at[doc.id]}])",
            )
        first_at[doc.id] = i
        if is_blank(doc.text):
            raise InvalidRequest(f"documents[{i}].text", BLANK)
    # its documents wait in Redis for a worker: priced at the body's bytes as Redis holds
    # them (a text JSON escapes weighs more there), or ingests would take Redis past the
    # 90 % kept for the jobs running, into its maxmemory
    adding = math.ceil(len(await request.body()) * STORED_FACTOR)
    store = job_store(request)
    route = f"POST /v1/indexes/{index}/documents"
    return await submit_write(
        request,
        (tenant, idempotency_key, route, lambda: body.model_dump(mode="json")),
        lambda enqueue, claim: store.create_ingest(
            tenant, index, body.documents, enqueue=enqueue, claim=claim
        ),
        wait,
        admit=(adding, f"this ingest of {len(body.documents)} documents"),
    )


async def submit_write(
    request: Request,
    keyed: tuple[str, str | None, str, Callable[[], object]],
    create: Callable[[Enqueue | None, IdempotencyRef | None], IngestJob],
    wait: float,
    *,
    admit: tuple[int, str] | None,
) -> Response:
    """Store an ingest-kind job (an upsert, a delete or a drop) as ``create`` makes it, and
    answer it. ``keyed``: the tenant, its ``Idempotency-Key`` (None: none), the request's
    route and its body as JSON: a request sent again with its key answers the job the first
    one made (``Idempotent-Replayed``): made again, it would take a newer write version than a
    write of the same ids accepted in between, and undo it (a resent upsert would bring back
    what a delete removed, a resent delete remove what an upsert wrote). ``admit``: the bytes
    the job adds to Redis and what it is, refused when they would fill the job store (an
    upsert's; a delete is taken still: it frees room)."""
    tenant, key, route, body = keyed
    store = job_store(request)
    # an upsert's body is up to 32 MB: its fingerprint is made off the event loop
    fp = "" if key is None else await off_loop(lambda: fingerprint(route, body()))
    idem = _Idempotency(store, tenant, key, fp)
    job_id = await idem.earlier_job()
    if job_id is None:
        try:
            admitted = (
                _in_store(request, *admit, "documents", *UPSERT_WORDS)
                if admit is not None
                else contextlib.nullcontext()
            )
            async with admitted:
                job = await enqueue_ingest(request, lambda enqueue: create(enqueue, idem.ref))
        except IdempotencyKeyBound as bound:
            job_id = idem.bound_job(bound)
        except BaseException:
            await idem.failed(request)
            raise
        else:
            with job_context(job.id):
                log.info(
                    "ingest %s: %s of %d for %s/%s",
                    job.id, job.operation, job.documents, tenant, job.index,
                )  # fmt: skip
            return await ingest_response(request, job, wait)
    earlier = await off_loop(store.get_ingest, job_id)
    if earlier is None:
        raise key_job_gone("ingest", job_id)
    response = await ingest_response(request, earlier, wait)
    response.headers[REPLAYED_HEADER] = "true"
    return response


@router.get(
    "/ingestions/{id}", response_model=IngestJobOut, responses=ERRORS, summary="An ingest job"
)
async def get_ingestion(request: Request, job_id: JobIdPath, tenant: Tenant) -> IngestJobOut:
    job = (
        await off_loop(job_store(request).get_ingest, job_id)
        if is_id(job_id, INGEST_ID_PREFIX)
        else None
    )
    if job is None or job.tenant != tenant:
        raise ApiError(404, "not_found", f"id: no ingest job {job_id!r}", field="id")
    return ingest_out(job)
