"""The v1 job routes: documents, searches, batches (DESIGN.md §9)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import redis
from fastapi import APIRouter, Header, Path, Query, Request, Response
from pydantic import BaseModel
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from api_gateway.backpressure import RETRY_AFTER_SECONDS, Backlog, BacklogFull
from api_gateway.bodies import BATCH_BODY, parse_batch
from api_gateway.deps import (
    ERRORS,
    STORE_AWAY,
    Tenant,
    Wait,
    accepted,
    app_settings,
    async_job_store,
    decode_token,
    encode_token,
    is_id,
    job_store,
    location,
    off_loop,
    poll_until,
    task_sender,
)
from api_gateway.errors import UNAVAILABLE_RETRY_AFTER_SECONDS, ApiError, ErrorBody
from api_gateway.queue import OutboxSender, TaskMessage, TaskSender
from api_gateway.routing import GetAnswersHead
from api_gateway.schemas import (
    BatchCounts,
    BatchOut,
    BatchRerankOutcomes,
    BatchResultsPage,
    DocumentsRequest,
    IngestJobOut,
    SearchJobOut,
    SearchRequest,
    iso,
)
from worker.constants import (
    BATCH_CHUNK_TASK,
    BATCH_ID_PREFIX,
    BATCH_QUEUE,
    CANCEL_COUNT_TASK,
    DEFAULT_PAGE_SIZE,
    ECONOMY_CANCEL_TASK,
    INGEST_ID_PREFIX,
    INGEST_QUEUE,
    INGEST_TASK,
    LANE_ECONOMY,
    MAX_DOCUMENT_CHARS,
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_PAGE_SIZE,
    SEARCH_ID_PREFIX,
    SEARCH_QUEUE,
    SEARCH_TASK,
    WEBHOOK_EVENT_BATCH_COMPLETED,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
)
from worker.contract import INDEX_PATTERN, JobStatus, SearchSpec
from worker.errors import InvalidRequest
from worker.observability import metrics
from worker.queue.jobstore import (
    BatchJob,
    CancelOutcome,
    Enqueue,
    IdempotencyClaim,
    IdempotencyKeyBound,
    IdempotencyOutcome,
    IdempotencyRef,
    IngestJob,
    JobStore,
    SearchJob,
    fingerprint,
    webhook_event,
)
from worker.settings import Settings
from worker.webhooks.urlguard import check_webhook_url

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", route_class=GetAnswersHead)
T = TypeVar("T")

# How long a gateway goes on sending a cancel's count take again, after the cancel's answer,
# when the take's own answer was not heard (Redis down past its 5 s): a Redis restart, or a
# failover, and then some. Past it, what that take took (if it ran) is never counted.
COUNT_RETAKE_SECONDS = 600.0

IdemKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=MAX_IDEMPOTENCY_KEY_CHARS,
        description="Same key and body: the same job. Different body: 422. "
        "While the first request is still being answered: 409.",
    ),
]
BUSY: dict[int | str, dict[str, Any]] = {
    429: {
        "model": ErrorBody,
        "description": "The backlog is past `SIFT_MAX_BACKLOG` queued searches and batch "
        "items (`backlog_full`); nothing was accepted. Retry after `Retry-After` seconds.",
        "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}},
    }
}


async def _admit(request: Request, items: int) -> None:
    """Backpressure: 429 with ``Retry-After`` when ``items`` more would pass the backlog limit."""
    backlog: Backlog | None = getattr(request.app.state, "backlog", None)
    if backlog is None or backlog.limit <= 0:
        return
    if items > backlog.limit:  # a 429 would say "retry", and no retry admits it
        raise InvalidRequest(
            "queries",
            f"{items} queries are more than the backlog holds (SIFT_MAX_BACKLOG is "
            f"{backlog.limit}), so no retry admits them: send them in batches of at most "
            f"{backlog.limit}",
        )
    try:
        await backlog.admit(items)
    except BacklogFull as exc:
        log.warning("backpressure: %s", exc)
        raise ApiError(
            429,
            "backlog_full",
            exc.public,
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        ) from exc


J = TypeVar("J", SearchJob, BatchJob, IngestJob)


def _create_and_enqueue(
    sender: TaskSender,
    create: Callable[[Enqueue | None], J],
    messages: Callable[[str], list[TaskMessage]],
) -> J:
    """Store a job and enqueue its tasks: in one MULTI through the outbox, else one after
    the other through Celery."""
    if isinstance(sender, OutboxSender):
        outbox = sender
        return create(lambda job_id: outbox.messages(messages(job_id)))
    job = create(None)
    sender.send_many(messages(job.id))
    return job


async def _create_and_enqueue_async(
    sender: TaskSender,
    create: Callable[[Enqueue | None], Awaitable[J]],
    messages: Callable[[str], list[TaskMessage]],
) -> J:
    """:func:`_create_and_enqueue` with the store on the event loop (the gateway's hot path)."""
    if isinstance(sender, OutboxSender):
        outbox = sender
        return await create(lambda job_id: outbox.messages(messages(job_id)))
    job = await create(None)
    await off_loop(sender.send_many, messages(job.id))
    return job


def _search_out(job: SearchJob) -> SearchJobOut:
    out = SearchJobOut(
        id=job.id,
        status=job.status,
        created_at=iso(job.created_at) or "",
        started_at=iso(job.started_at),
        finished_at=iso(job.finished_at),
    )
    if job.result is not None:
        result = job.result
        if not job.spec.include_trace and result.trace is not None:
            result = result.model_copy(update={"trace": None})
        out.result = result
    if job.error is not None:
        out.error = job.error
    return out


def _search_response(request: Request, job: SearchJob, *, read: bool = True) -> Response:
    """200 with a final job, else 202 with its ``Location``; ``read`` False: ``job`` is not
    the record as read whole (Redis went away), so never a final answer, whatever its status."""
    body = _search_out(job).model_dump_json(exclude_none=False)
    if job.status.final and read:
        return Response(body, media_type="application/json")
    headers = location(request, "get_search", job_id=job.id)
    return Response(body, status_code=202, media_type="application/json", headers=headers)


async def _check_url(settings: Settings, url: str | None) -> None:
    if url is not None:
        await off_loop(
            check_webhook_url, url, allow_private=settings.webhook_allow_private_networks
        )


class _Idempotency:
    """Stripe-style Idempotency-Key handling around one job-creating request.

    The key is claimed first (a pending marker: a second request meanwhile gets 409), then
    bound to its job in the transaction that creates the job, for 24 hours. From then on a
    request with the key gets that job, whatever became of the first request: answered,
    still in its ``?wait``, or killed with its gateway. A marker that no job was bound to
    means nothing was created; it answers 409 until it expires (or its request fails and
    releases it), then the key is free. The create itself writes only if the key is bound to
    no job, so even a marker that expired under a live request cannot give a second job.
    """

    def __init__(self, store: JobStore, tenant: str, key: str | None, fp: str) -> None:
        self.store, self.tenant, self.key, self.fp = store, tenant, key, fp

    @classmethod
    def of(
        cls, store: JobStore, tenant: str, key: str | None, route: str, body: BaseModel
    ) -> _Idempotency:
        """The key of a small body (a search): its fingerprint computed here."""
        # the body's fingerprint is only needed with a key (most requests have none)
        fp = "" if key is None else fingerprint(route, body.model_dump(mode="json"))
        return cls(store, tenant, key, fp)

    @property
    def ref(self) -> IdempotencyRef | None:
        """The key, to bind to the job in the job's own transaction; None without one."""
        return None if self.key is None else IdempotencyRef(self.tenant, self.key, self.fp)

    async def earlier_job(self) -> str | None:
        """The job of an earlier request with this key, None to go ahead; raises 409/422."""
        if self.key is None:
            return None
        return self._answer(
            await off_loop(self.store.claim_idempotency, self.tenant, self.key, self.fp)
        )

    def bound_job(self, bound: IdempotencyKeyBound) -> str:
        """The job another request with this key created while this one was on its way."""
        job_id = self._answer(bound.claim)
        assert job_id is not None
        return job_id

    def _answer(self, claim: IdempotencyClaim) -> str | None:
        if claim.outcome is IdempotencyOutcome.MISMATCH:
            raise ApiError(
                422,
                "idempotency_key_reused",
                "Idempotency-Key: already used with a different request body",
                field="Idempotency-Key",
            )
        if claim.outcome is IdempotencyOutcome.IN_PROGRESS:
            raise ApiError(
                409,
                "idempotency_key_in_progress",
                "Idempotency-Key: the first request with this key has not created its job "
                "yet; retry",
                field="Idempotency-Key",
            )
        return claim.job_id if claim.outcome is IdempotencyOutcome.REPLAY else None

    async def failed(self) -> None:
        """Free the key of a request that failed before its job was created (a key already
        bound to a job stays bound)."""
        if self.key is not None:
            await off_loop(self.store.release_idempotency, self.tenant, self.key)


# --- documents ------------------------------------------------------------------------------


def _lost(kind: str, job_id: str) -> ApiError:
    """The answer of a request whose job Redis lost while it waited on it (a restart without
    its data: the record, and the task message unless a worker had taken it): no outcome of
    it can be read, ever, and the request sent again makes it again (a ``202`` pointed its
    ``Location`` at a ``404``)."""
    log.error("%s %s: lost by the job store (Redis restarted without its data)", kind, job_id)
    return ApiError(
        503,
        "unavailable",
        f"the job store lost this {kind} (Redis restarted without its data), so its outcome "
        f"cannot be known; send the request again after {UNAVAILABLE_RETRY_AFTER_SECONDS} s",
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_SECONDS)},
    )


def ingest_out(job: IngestJob) -> IngestJobOut:
    return IngestJobOut(
        id=job.id,
        status=job.status,
        index=job.index,
        documents=job.documents,
        created_at=iso(job.created_at) or "",
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
    if job.status.final:
        return Response(body_out, media_type="application/json")
    headers = location(request, "get_ingestion", job_id=job.id)
    return Response(body_out, status_code=202, media_type="application/json", headers=headers)


@router.post(
    "/indexes/{index}/documents",
    response_model=IngestJobOut,
    status_code=202,
    responses={
        200: {"model": IngestJobOut, "description": "Ingested within `wait`."},
        **accepted("Queued or running; poll the `Location`."),
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
) -> Response:
    """Enqueues an ingest job and answers 202 with its id (poll
    ``GET /v1/ingestions/{id}``), or 200 when it finished within ``wait`` seconds."""
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
        if len(doc.text) > MAX_DOCUMENT_CHARS:
            raise InvalidRequest(
                f"documents[{i}].text", f"longer than {MAX_DOCUMENT_CHARS} characters"
            )
        if not doc.text.strip():
            raise InvalidRequest(f"documents[{i}].text", "is empty after trimming whitespace")
    store = job_store(request)
    job = await enqueue_ingest(
        request,
        lambda enqueue: store.create_ingest(tenant, index, body.documents, enqueue=enqueue),
    )
    log.info("ingest %s: %d documents for %s/%s", job.id, job.documents, tenant, index)
    return await ingest_response(request, job, wait)


@router.get(
    "/ingestions/{job_id}", response_model=IngestJobOut, responses=ERRORS, summary="An ingest job"
)
async def get_ingestion(request: Request, job_id: str, tenant: Tenant) -> IngestJobOut:
    job = (
        await off_loop(job_store(request).get_ingest, job_id)
        if is_id(job_id, INGEST_ID_PREFIX)
        else None
    )
    if job is None or job.tenant != tenant:
        raise ApiError(404, "not_found", f"id: no ingest job {job_id!r}", field="id")
    return ingest_out(job)


# --- searches -------------------------------------------------------------------------------


@router.post(
    "/searches",
    response_model=SearchJobOut,
    status_code=202,
    responses={
        200: {"model": SearchJobOut, "description": "Finished within `wait`."},
        **accepted("Queued or running; poll the `Location`."),
        **ERRORS,
        **BUSY,
    },
    summary="Submit one search",
)
async def create_search(
    request: Request,
    body: SearchRequest,
    tenant: Tenant,
    wait: Wait = 0.0,
    idempotency_key: IdemKey = None,
) -> Response:
    """Answers 202 with the queued job, or 200 with the finished job if it finished within
    ``wait`` seconds."""
    settings, store = app_settings(request), job_store(request)
    await _check_url(settings, body.webhook_url)
    idem = _Idempotency.of(store, tenant, idempotency_key, "POST /v1/searches", body)
    job_id = await idem.earlier_job()
    fresh: SearchJob | None = None
    if job_id is None:
        async_store = async_job_store(request)
        try:
            await _admit(request, 1)
            spec = SearchSpec.model_validate(body.model_dump(exclude={"webhook_url"}))
            # one script on the event loop: the record, the task message, the key's binding
            fresh = await _create_and_enqueue_async(
                task_sender(request),
                lambda enqueue: async_store.create_search(
                    tenant, spec, webhook_url=body.webhook_url, enqueue=enqueue, claim=idem.ref
                ),
                lambda job_id: [(SEARCH_TASK, [job_id], SEARCH_QUEUE)],
            )
        except IdempotencyKeyBound as bound:
            job_id = idem.bound_job(bound)
        except BaseException:
            await idem.failed()
            raise
        else:
            metrics.job_submitted("search")
            job_id = fresh.id
    if fresh is not None and wait == 0:
        return _search_response(request, fresh)  # just queued: no need to read it back
    return await _answer_search(request, store, job_id, tenant, wait, fresh)


async def _answer_search(
    request: Request,
    store: JobStore,
    job_id: str,
    tenant: str,
    wait: float,
    fresh: SearchJob | None,
) -> Response:
    """The search ``job_id`` once final or after ``wait``; ``fresh`` is the one this request
    made (answered as accepted if Redis is away then: it exists, and a 503 had the client
    send the request again and make a second one; a resent key's job is read or 503)."""

    async def read() -> SearchJob | None:
        return await off_loop(store.get_search, job_id)

    async def read_status() -> JobStatus | None:
        return await off_loop(store.get_search_status, job_id)

    seen: JobStatus | None = None  # the last status the poll read
    if wait > 0:
        seen = await poll_until(read_status, lambda s: s.final, wait)
    try:
        job = await read()
    except STORE_AWAY:
        if fresh is None:
            raise
        log.warning("search %s: the job store is away; answered as accepted", job_id)
        # what this request knows: the job it made, in the last status its poll read
        known = fresh if seen is None else dataclasses.replace(fresh, status=seen)
        return _search_response(request, known, read=False)
    if job is None and fresh is not None:
        raise _lost("search", job_id)
    if job is None or job.tenant != tenant:
        raise ApiError(404, "not_found", f"id: no search {job_id!r} (expired?)", field="id")
    return _search_response(request, job)


@router.get(
    "/searches/{job_id}",
    response_model=SearchJobOut,
    responses=ERRORS,
    summary="A search job, with its result once finished",
)
async def get_search(request: Request, job_id: str, tenant: Tenant) -> Response:
    job = (
        await off_loop(job_store(request).get_search, job_id)
        if is_id(job_id, SEARCH_ID_PREFIX)
        else None
    )
    if job is None or job.tenant != tenant:
        raise ApiError(404, "not_found", f"id: no search {job_id!r}", field="id")
    return Response(_search_out(job).model_dump_json(), media_type="application/json")


# --- batches --------------------------------------------------------------------------------


def batch_out(batch: BatchJob) -> BatchOut:
    return BatchOut(
        id=batch.id,
        status=batch.status,
        index=batch.index,
        lane="economy" if batch.lane == "economy" else "standard",
        counts=BatchCounts(total=batch.total, **batch.counts),
        usage=batch.usage,
        rerank_outcomes=BatchRerankOutcomes(**batch.rerank_outcomes),
        stage_seconds=batch.stage_seconds,
        created_at=iso(batch.created_at) or "",
        finished_at=iso(batch.finished_at),
        canceled_at=iso(batch.canceled_at),
    )


async def _owned_batch(request: Request, batch_id: str, tenant: str) -> BatchJob:
    batch = (
        await off_loop(job_store(request).get_batch, batch_id)
        if is_id(batch_id, BATCH_ID_PREFIX)
        else None
    )
    if batch is None or batch.tenant != tenant:
        raise ApiError(404, "not_found", f"id: no batch {batch_id!r}", field="id")
    return batch


@router.post(
    "/batches",
    response_model=BatchOut,
    status_code=202,
    responses={**accepted("Accepted; poll the `Location`."), **ERRORS, **BUSY},
    summary="Submit a batch of searches",
    openapi_extra=BATCH_BODY,
)
async def create_batch(
    request: Request,
    tenant: Tenant,
    idempotency_key: IdemKey = None,
) -> Response:
    """Stores every item as ``queued`` and fans the batch out in chunk tasks.
    ``lane="economy"`` sends the reranks as Message Batches at half the price: the batch
    completes when the provider's batches end (minutes to hours). The body
    (``BatchRequest``) is parsed and stored off the event loop."""
    settings, store = app_settings(request), job_store(request)
    route = "POST /v1/batches"
    # parsed and fingerprinted in a thread, a slice at a time (api_gateway/bodies.py)
    parsed = await off_loop(parse_batch, await request.body(), route if idempotency_key else None)
    body, items = parsed.head, parsed.items
    await _check_url(settings, body.webhook_url)
    idem = _Idempotency(store, tenant, idempotency_key, parsed.fingerprint)
    batch_id = await idem.earlier_job()
    made: BatchJob | None = None  # by this request
    if batch_id is None:
        size, total, sender = settings.batch_chunk_size, len(items), task_sender(request)

        def chunks(new_id: str) -> list[TaskMessage]:
            return [
                (BATCH_CHUNK_TASK, [new_id, start, min(start + size, total)], BATCH_QUEUE)
                for start in range(0, total, size)
            ]

        try:
            await _admit(request, len(items))  # the whole batch, or none of it
            batch = await off_loop(
                _create_and_enqueue,
                sender,
                lambda enqueue: store.create_batch(
                    tenant,
                    body.index,
                    items,
                    lane=body.lane,
                    rerank=body.rerank,
                    webhook_url=body.webhook_url,
                    enqueue=enqueue,
                    claim=idem.ref,
                ),
                chunks,
            )
        except IdempotencyKeyBound as bound:
            batch_id = idem.bound_job(bound)
        except BaseException:
            await idem.failed()
            raise
        else:
            metrics.job_submitted("batch")
            metrics.job_submitted("batch_item", batch.total)
            log.info(
                "batch %s: %d items in chunks of %d for %s", batch.id, batch.total, size, tenant
            )
            batch_id, made = batch.id, batch
    try:
        if made is None:
            batch = await _owned_batch(request, batch_id, tenant)
        elif (found := await off_loop(store.get_batch, batch_id)) is None:
            raise _lost("batch", batch_id)  # Redis came back empty since the commit
        else:
            batch = found
    except STORE_AWAY:
        if made is None:
            raise
        # it exists: a 503 had the client send it again and make a second batch
        log.warning("batch %s: the job store is away; answered as accepted", batch_id)
        batch = made
    return Response(
        batch_out(batch).model_dump_json(),
        status_code=202,
        media_type="application/json",
        headers=location(request, "get_batch", batch_id=batch.id),
    )


@router.get(
    "/batches/{batch_id}",
    response_model=BatchOut,
    responses=ERRORS,
    summary="A batch's status and counts",
)
async def get_batch(request: Request, batch_id: str, tenant: Tenant) -> BatchOut:
    return batch_out(await _owned_batch(request, batch_id, tenant))


@router.get(
    "/batches/{batch_id}/results",
    response_model=BatchResultsPage,
    responses=ERRORS,
    summary="A batch's results, one page at a time, in submission order",
)
async def get_batch_results(
    request: Request,
    batch_id: str,
    tenant: Tenant,
    page_size: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = DEFAULT_PAGE_SIZE,
    page_token: Annotated[str | None, Query(max_length=64)] = None,
) -> Response:
    """Every item appears once over the pages, with ``result`` or ``error`` once final."""
    offset = decode_token(page_token)
    batch = await _owned_batch(request, batch_id, tenant)
    outcomes = await off_loop(job_store(request).batch_results, batch_id, offset, page_size)
    end = offset + len(outcomes)
    token = encode_token(end) if end < batch.total else None
    body = (
        '{"results":['
        + ",".join(o.to_json() for o in outcomes)
        + '],"next_page_token":'
        + ('"' + token + '"' if token else "null")
        + "}"
    )
    return Response(body, media_type="application/json")


async def _count_cancel(request: Request, batch_id: str) -> None:
    """Count what the batch's cancels ended and no one has counted (this one's, and an
    earlier one's whose answer was lost). A take whose answer is not heard (Redis down past
    its 5 s of retries) may have run: then what it took is in no record, and the cancel's
    count message finds nothing. So it is sent again with its token until Redis answers it
    (:func:`_take_again`), in a task of the gateway's own (``app.state.retakes``), not the
    request's: the request is over (counted and timed) once answered, and a gateway told to
    stop does not wait for Redis (:func:`stop_retakes`)."""
    store, token = job_store(request), os.urandom(8).hex()
    try:
        items, completed = await off_loop(store.take_cancel_count, batch_id, token)
    except redis.RedisError as exc:
        log.warning("batch %s: the cancel's count is taken again later: %s", batch_id, exc)
        retakes: set[asyncio.Task[None]] = request.app.state.retakes
        task = asyncio.create_task(_take_again(store, batch_id, token))
        retakes.add(task)
        task.add_done_callback(retakes.discard)
        return
    metrics.cancel_counted(items, completed)


async def _take_again(store: JobStore, batch_id: str, token: str) -> None:
    """A take sent again with its token for :data:`COUNT_RETAKE_SECONDS`: answered what it
    took if it ran, and if it did not, it takes what the count message has not taken (that
    message's take, with a token of its own, then finds nothing): counted once either way."""
    try:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(redis.RedisError),
            stop=stop_after_delay(COUNT_RETAKE_SECONDS),
            wait=wait_fixed(1.0),
            reraise=True,
        ):
            with attempt:
                items, completed = await off_loop(store.take_cancel_count, batch_id, token)
    except redis.RedisError as exc:
        log.error("batch %s: what the cancel ended may be left uncounted: %s", batch_id, exc)
        return
    except asyncio.CancelledError:  # the gateway stops (stop_retakes)
        log.error(
            "batch %s: the gateway stops: what the cancel ended may be left uncounted", batch_id
        )
        raise
    metrics.cancel_counted(items, completed)


async def stop_retakes(retakes: set[asyncio.Task[None]]) -> None:
    """The gateway stops: give up the takes still sent again (each waits for the Redis call
    it has under way, at most its 5 s of retries), as a gateway dying gives them up."""
    for task in retakes:
        task.cancel()
    await asyncio.gather(*retakes, return_exceptions=True)


@router.delete(
    "/batches/{batch_id}",
    response_model=BatchOut,
    responses={
        **ERRORS,
        409: {
            "model": ErrorBody,
            "description": "`already_finished`: every item of the batch was already final "
            "and no cancel had canceled any (it ended `succeeded`); nothing changed (its "
            "status, counts and webhook stand).",
        },
    },
    summary="Cancel the items of a batch that have not reached their model call",
    description="Marks the batch canceled. Items still queued are canceled at once; items a "
    "worker has taken but not started, and started items that have not yet made their model "
    "call, are canceled when they next check the mark (before they start, and before the "
    "model call); items past it finish. The batch ends `canceled` if the cancel canceled at "
    "least one item, otherwise with the status it would have had, and its `batch.completed` "
    "webhook says the same. Cancelling again before it ends cancels only what was requeued "
    "since; a batch already finished is `409 already_finished` and is left as it was, unless "
    "an earlier cancel made it `canceled`: a cancel repeated then answers `200` with the "
    "batch as it is (so a client whose cancel was answered `503`, its outcome unknown, learns "
    "that it took effect). In the "
    "economy lane, the batch's provider batches are canceled too: their requests not yet "
    "processed come back canceled.",
)
async def cancel_batch(request: Request, batch_id: str, tenant: Tenant) -> BatchOut:
    owned = await _owned_batch(request, batch_id, tenant)
    sender = task_sender(request)
    # the webhook of a cancel that completes the batch goes out with the cancel itself (one
    # script): announced even if the answer is lost or this gateway dies right after
    announce: list[tuple[str, str]] = []
    # so is the count of what it ends (sift_jobs_completed_total): counted here once the
    # answer is heard, else by the worker that takes this message (taken once, either way)
    count: tuple[str, str] | None = None
    if isinstance(sender, OutboxSender):
        (count,) = sender.messages([(CANCEL_COUNT_TASK, [batch_id], BATCH_QUEUE)])
    if owned.webhook_url and isinstance(sender, OutboxSender):
        event = webhook_event(
            WEBHOOK_EVENT_BATCH_COMPLETED,
            batch_id,
            tenant,
            owned.webhook_url,
            JobStatus.CANCELED.value,
        )
        announce = sender.messages([(WEBHOOK_TASK, [event], WEBHOOK_QUEUE)])
    try:
        outcome = await off_loop(
            job_store(request).cancel_batch, batch_id, announce=announce, count=count
        )
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # the store retried the cancel's script for 5 s (the same token: a reply lost after
        # it ran is answered as it ran); past that, whether it ran is unknown, and a plain
        # "retry" read as "not canceled" while the batch may end canceled
        log.error("batch %s: the cancel's answer was not heard: %s", batch_id, exc)
        raise ApiError(
            503,
            "unavailable",
            f"id: the job store is unavailable, so whether batch {batch_id!r} was canceled is "
            f"unknown; send the cancel again after {UNAVAILABLE_RETRY_AFTER_SECONDS} s: it "
            "answers 200 with the batch if it is still running or ended canceled, and 409 "
            "already_finished if it ran to its end with no item canceled (a cancel that "
            "came too late to cancel any item changes nothing)",
            field="id",
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_SECONDS)},
        ) from exc
    if outcome is CancelOutcome.MISSING:
        raise ApiError(404, "not_found", f"id: no batch {batch_id!r}", field="id")
    if isinstance(outcome, CancelOutcome):  # already finished: nothing changed now
        if count is not None:  # what an earlier cancel, its answer lost, ended
            await _count_cancel(request, batch_id)
        finished = await _owned_batch(request, batch_id, tenant)
        if finished.status is JobStatus.CANCELED:
            # an earlier cancel canceled items and the batch ended canceled: this one repeats
            # it (a client whose first cancel's answer was lost learns it took effect)
            return batch_out(finished)
        raise ApiError(
            409,
            "already_finished",
            f"id: batch {batch_id!r} has already finished; nothing was canceled",
            field="id",
        )
    canceled, completed = outcome
    log.info("batch %s: %d items canceled", batch_id, canceled)
    batch = await _owned_batch(request, batch_id, tenant)
    if batch.lane == LANE_ECONOMY and not completed and batch.finished_at is None:
        # items waiting on the provider end when their provider batches are canceled
        await off_loop(sender.send, ECONOMY_CANCEL_TASK, [batch_id], BATCH_QUEUE)
    if count is not None:
        await _count_cancel(request, batch_id)
    else:  # no outbox carried the count: it is this answer's
        if canceled:
            metrics.job_completed("batch_item", "canceled", count=canceled)
        if completed:
            metrics.job_completed("batch", batch.status.value)
    if completed and batch.webhook_url and not announce:
        event = webhook_event(
            WEBHOOK_EVENT_BATCH_COMPLETED, batch_id, tenant, batch.webhook_url, batch.status.value
        )
        await off_loop(sender.send, WEBHOOK_TASK, [event], WEBHOOK_QUEUE)
    return batch_out(batch)
