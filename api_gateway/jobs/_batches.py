"""The batch routes: a batch submitted, read, its results paged, and canceled."""

from __future__ import annotations

import logging
from typing import Annotated

import redis
from fastapi import Query, Request, Response
from fastapi.exceptions import RequestValidationError

from api_gateway.bodies import BATCH_BODY, parse_batch, read_as_json
from api_gateway.deps import (
    ERRORS,
    REPLAYED_HEADER,
    STORE_AWAY,
    ResultsPageSize,
    Tenant,
    accepted,
    app_settings,
    is_id,
    job_store,
    location,
    off_loop,
    task_sender,
)
from api_gateway.errors import (
    UNAVAILABLE_RETRY_AFTER,
    UNAVAILABLE_RETRY_AFTER_SECONDS,
    ApiError,
    ErrorBody,
)
from api_gateway.jobs._cancel_count import _count_cancel
from api_gateway.jobs._idempotency import IdemKey, _Idempotency
from api_gateway.jobs._shared import (
    BUSY,
    ERASED,
    JobIdPath,
    _admitted,
    _check_url,
    _create_and_enqueue,
    _rerank_of,
    erase,
    gone,
    not_there,
    replay_gone,
    results_size,
    router,
)
from api_gateway.queue import TaskMessage
from api_gateway.schemas import (
    BatchCounts,
    BatchOut,
    BatchRerankOutcomes,
    BatchResultsPage,
    ErasedOut,
    iso,
    webhook_out,
)
from api_gateway.tokens import decode_results_token, encode_results_token
from worker.constants import (
    BATCH_CHUNK_TASK,
    BATCH_ID_PREFIX,
    BATCH_QUEUE,
    CANCEL_COUNT_TASK,
    DEFAULT_PAGE_SIZE,
    ECONOMY_CANCEL_TASK,
    ERROR_UNAVAILABLE,
    LANE_ECONOMY,
    MAX_RESULTS_PAGE_BYTES,
    SEARCH_QUEUE,
    WEBHOOK_EVENT_BATCH_COMPLETED,
    WEBHOOK_QUEUE,
    WEBHOOK_TASK,
)
from worker.contract import JobStatus
from worker.observability import metrics
from worker.observability.logcontext import job_context
from worker.queue.jobstore import BatchJob, CancelOutcome, IdempotencyKeyBound, webhook_event

log = logging.getLogger(__package__)  # api_gateway.jobs: one logger for the job routes


def batch_out(batch: BatchJob) -> BatchOut:
    return BatchOut(
        id=batch.id,
        status=batch.status,
        index=batch.index,
        lane="economy" if batch.lane == LANE_ECONOMY else "standard",
        counts=BatchCounts(total=batch.total, **batch.counts),
        usage=batch.usage,
        rerank_outcomes=None
        if batch.rerank_outcomes is None
        else BatchRerankOutcomes(**batch.rerank_outcomes),
        stage_seconds=batch.stage_seconds,
        failures=batch.failures,
        rerank_failures=batch.rerank_failures,
        created_at=iso(batch.created_at) or "",
        finished_at=iso(batch.finished_at),
        canceled_at=iso(batch.canceled_at),
        webhook=webhook_out(batch.webhook),
    )


async def _owned_batch(request: Request, batch_id: str, tenant: str) -> BatchJob:
    batch = (
        await off_loop(job_store(request).get_batch, batch_id)
        if is_id(batch_id, BATCH_ID_PREFIX)
        else None
    )
    if batch is None or batch.tenant != tenant:
        raise await not_there(request, "batch", batch_id, tenant)
    return batch


@router.post(
    "/batches",
    response_model=BatchOut,
    status_code=202,
    responses={
        **accepted("Accepted; poll the `Location`.", keyed=True),
        **ERRORS,
        **BUSY,
        **ERASED,
    },
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
    raw = await request.body()
    if not read_as_json(request.headers.get("content-type")):
        raise RequestValidationError([], body=raw)  # the 415 every other route answers
    # parsed and fingerprinted in a thread, a slice at a time (api_gateway/bodies.py)
    parsed = await off_loop(
        parse_batch,
        raw,
        route if idempotency_key else None,
        rerank_default=settings.rerank_enabled,
        window=settings.rerank_candidate_limit,
    )
    body, items = parsed.head, parsed.items
    rerank = _rerank_of(settings, body.rerank)  # as each item's spec says it
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
            # a new job's only: a resend by its key gets the job its URL was checked for
            await _check_url(request, settings, body.webhook_url, tenant)
            adding, owed, what = await results_size(
                request,
                tenant,
                parsed.head.index,
                parsed.items,
                parsed.hits,
                parsed.traced,
                f"this batch of {len(parsed.items)} queries",
                parsed.waiting,
            )
            async with _admitted(request, total, adding, what):  # the whole batch, or none
                batch = await off_loop(
                    _create_and_enqueue,
                    sender,
                    lambda enqueue: store.create_batch(
                        tenant,
                        body.index,
                        items,
                        lane=body.lane,
                        rerank=rerank,
                        webhook_url=body.webhook_url,
                        enqueue=enqueue,
                        claim=idem.ref,
                        owed_bytes=owed,
                    ),
                    chunks,
                )
        except IdempotencyKeyBound as bound:
            batch_id = idem.bound_job(bound)
        except BaseException:
            await idem.failed(request)
            raise
        else:
            metrics.job_submitted("batch")
            metrics.job_submitted("batch_item", batch.total)
            with job_context(batch.id):
                log.info(
                    "batch %s: %d items in chunks of %d for %s", batch.id, batch.total, size, tenant
                )
            batch_id, made = batch.id, batch
    try:
        if made is None:  # an earlier request's, by its key
            found = await off_loop(store.get_batch, batch_id)
            if found is None or found.tenant != tenant:
                raise await replay_gone(request, "batch", batch_id, tenant)
            batch = found
        elif (found := await off_loop(store.get_batch, batch_id)) is None:
            # erased by its tenant since the commit, or Redis came back empty
            raise await gone(request, "batch", batch_id, tenant)
        else:
            batch = found
    except STORE_AWAY:
        if made is None:
            raise
        # it exists: a 503 had the client send it again and make a second batch
        with job_context(batch_id):
            log.warning("batch %s: the job store is away; answered as accepted", batch_id)
        batch = made
    headers = location(request, "get_batch", id=batch.id)
    if made is None:  # an earlier request's, by its key
        headers[REPLAYED_HEADER] = "true"
    return Response(
        batch_out(batch).model_dump_json(),
        status_code=202,
        media_type="application/json",
        headers=headers,
    )


@router.get(
    "/batches/{id}",
    response_model=BatchOut,
    responses={**ERRORS, **ERASED},
    summary="A batch's status and counts",
)
async def get_batch(request: Request, batch_id: JobIdPath, tenant: Tenant) -> BatchOut:
    return batch_out(await _owned_batch(request, batch_id, tenant))


@router.get(
    "/batches/{id}/results",
    response_model=BatchResultsPage,
    responses={**ERRORS, **ERASED},
    summary="A batch's results, one page at a time, in submission order",
    description="Every item appears once over the pages, with `result` or `error` once final. "
    "A page ends at `page_size` items, or sooner, before the first item whose stored result "
    f"would take the page's past {MAX_RESULTS_PAGE_BYTES // 2**20} MiB (an item larger than "
    "that is a page of its own): items of many long hits are megabytes each. Each page's "
    "`next_page_token` goes on at the item after its last; `null` on the last page.",
)
async def get_batch_results(
    request: Request,
    batch_id: JobIdPath,
    tenant: Tenant,
    page_size: ResultsPageSize = DEFAULT_PAGE_SIZE,
    page_token: Annotated[str | None, Query(max_length=64)] = None,
) -> Response:
    """The page is read in one snapshot that stops at the byte budget, in Redis, so the
    gateway holds about one budget (plus one item) of results, however large the items."""
    offset = decode_results_token(page_token, batch_id)
    batch = await _owned_batch(request, batch_id, tenant)
    outcomes = await off_loop(job_store(request).batch_results_page, batch_id, offset, page_size)
    if outcomes is None:  # erased (or expired) since it was read: 410 (or 404), as after
        raise await not_there(request, "batch", batch_id, tenant)
    end = offset + len(outcomes)
    token = encode_results_token(batch_id, end) if end < batch.total else None
    body = (
        '{"results":['
        + ",".join(o.to_json() for o in outcomes)
        + '],"next_page_token":'
        + ('"' + token + '"' if token else "null")
        + "}"
    )
    return Response(body, media_type="application/json")


@router.delete(
    "/batches/{id}",
    response_model=BatchOut,
    responses={
        **ERRORS,
        **ERASED,
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
async def cancel_batch(request: Request, batch_id: JobIdPath, tenant: Tenant) -> BatchOut:
    with job_context(batch_id):  # its log lines, and its count's retake task, carry the id
        return await _cancel_batch(request, batch_id, tenant)


async def _cancel_batch(request: Request, batch_id: str, tenant: Tenant) -> BatchOut:
    owned = await _owned_batch(request, batch_id, tenant)
    sender = task_sender(request)
    # the webhook of a cancel that completes the batch goes out with the cancel itself (one
    # script): announced even if the answer is lost or this gateway dies right after
    announce: list[tuple[str, str]] = []
    # so is the count of what it ends (sift_jobs_completed_total): counted here once the
    # answer is heard, else by the worker that takes this message (taken once, either way)
    (count,) = sender.messages([(CANCEL_COUNT_TASK, [batch_id], BATCH_QUEUE)])
    # and the cancel of an economy batch's provider batches, so that a gateway dying after
    # the script does not leave the provider processing (and billing) what was canceled; it
    # goes on the search queue, never behind the batch queue's chunks (worker.queue.config)
    provider: tuple[str, str] | None = None
    if owned.lane == LANE_ECONOMY:
        (provider,) = sender.messages([(ECONOMY_CANCEL_TASK, [batch_id], SEARCH_QUEUE)])
    if owned.webhook_url:
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
            job_store(request).cancel_batch,
            batch_id,
            announce=announce,
            count=count,
            provider=provider,
        )
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # the store retried the cancel's script for 5 s (the same token: a reply lost after
        # it ran is answered as it ran); past that, whether it ran is unknown, and a plain
        # "retry" read as "not canceled" while the batch may end canceled
        log.error("batch %s: the cancel's answer was not heard: %s", batch_id, exc)
        raise ApiError(
            503,
            ERROR_UNAVAILABLE,
            f"id: the job store is unavailable, so whether batch {batch_id!r} was canceled is "
            f"unknown; send the cancel again after {UNAVAILABLE_RETRY_AFTER_SECONDS} s: it "
            "answers 200 with the batch if it is still running or ended canceled, and 409 "
            "already_finished if it ran to its end with no item canceled (a cancel that "
            "came too late to cancel any item changes nothing)",
            field="id",
            headers=UNAVAILABLE_RETRY_AFTER,
        ) from exc
    if outcome is CancelOutcome.MISSING:  # erased (or expired) since it was read: 410 (or 404)
        raise await not_there(request, "batch", batch_id, tenant)
    if isinstance(outcome, CancelOutcome):  # already finished: nothing changed now
        # what an earlier cancel, its answer lost, ended
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
    canceled, _ = outcome
    log.info("batch %s: %d items canceled", batch_id, canceled)
    batch = await _owned_batch(request, batch_id, tenant)
    await _count_cancel(request, batch_id)
    return batch_out(batch)


@router.delete(
    "/batches/{id}/results",
    response_model=ErasedOut,
    responses={
        **ERRORS,
        409: {
            "model": ErrorBody,
            "description": "`not_finished`: the batch has items queued or running; nothing "
            "was erased. Cancel it first (`DELETE /v1/batches/{id}`) or wait for it to finish "
            "(one canceled already: its items past their model call finish).",
        },
    },
    summary="Erase a finished batch: its items, queries and results",
    description="Deletes everything stored of the batch: its items' queries and ids, their "
    "results (hits' text, traces, errors, usage), its record and counts, its economy lane's "
    "state, its place in `GET /v1/batches`, and its webhook if not yet delivered (it is not "
    "sent); an economy batch's provider batches (Message Batches holding its queries and "
    "candidates' text, which the provider keeps 29 days) are deleted at the provider by a "
    "worker just after, all but a lost create's candidates, which may be another client's. "
    "From then on `GET /v1/batches/{id}`, its results, its cancel (and a request sent "
    "again with its `Idempotency-Key`) answer `410 erased`, for the retention "
    "(`SIFT_RESULT_RETENTION_SECONDS`), then `404`. Erasing it again answers the same `200`. "
    "Another tenant's batch, or none, is `404`. (`DELETE /v1/batches/{id}` cancels, as "
    "DESIGN.md says.)",
)
async def erase_batch(request: Request, batch_id: JobIdPath, tenant: Tenant) -> ErasedOut:
    return await erase(request, "batch", batch_id, tenant)
