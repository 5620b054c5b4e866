"""The search routes: one search submitted (answered when final within ``wait``) and read."""

from __future__ import annotations

import dataclasses
import logging

from fastapi import Request, Response

from api_gateway.backpressure import traced_candidates
from api_gateway.deps import (
    ERRORS,
    REPLAYED_HEADER,
    REPLAYED_HEADER_DOC,
    STORE_AWAY,
    Tenant,
    Wait,
    accepted,
    app_settings,
    async_job_store,
    is_id,
    job_answer,
    job_store,
    off_loop,
    poll_until,
    task_sender,
)
from api_gateway.errors import ErrorBody
from api_gateway.jobs._idempotency import IdemKey, _Idempotency
from api_gateway.jobs._shared import (
    BUSY,
    ERASED,
    JobIdPath,
    _admitted,
    _check_url,
    _create_and_enqueue_async,
    _rerank_of,
    erase,
    gone,
    not_there,
    replay_gone,
    results_size,
    router,
)
from api_gateway.schemas import ErasedOut, SearchJobOut, SearchRequest, iso, webhook_out
from worker.constants import SEARCH_ID_PREFIX, SEARCH_QUEUE, SEARCH_TASK
from worker.contract import JobStatus, SearchSpec
from worker.observability import metrics
from worker.observability.logcontext import job_context
from worker.queue.jobstore import IdempotencyKeyBound, JobStore, SearchJob

log = logging.getLogger(__package__)  # api_gateway.jobs: one logger for the job routes


def _search_out(job: SearchJob) -> SearchJobOut:
    out = SearchJobOut(
        id=job.id,
        status=job.status,
        created_at=iso(job.created_at) or "",
        started_at=iso(job.started_at),
        finished_at=iso(job.finished_at),
        webhook=webhook_out(job.webhook),
    )
    if job.result is not None:
        result = job.result
        if not job.spec.include_trace and result.trace is not None:
            result = result.model_copy(update={"trace": None})
        out.result = result
    if job.error is not None:
        out.error = job.error
        if not job.spec.include_trace and job.error.trace is not None:
            out.error = job.error.model_copy(update={"trace": None})
    return out


def _search_response(request: Request, job: SearchJob, *, read: bool = True) -> Response:
    """200 with a final job, else 202 with its ``Location``; ``read`` False: ``job`` is not
    the record as read whole (Redis went away), so never a final answer, whatever its status."""
    body = _search_out(job).model_dump_json(exclude_none=False)
    final = job.status.final and read
    return job_answer(request, body, final=final, route="get_search", job_id=job.id)


@router.post(
    "/searches",
    response_model=SearchJobOut,
    status_code=202,
    responses={
        200: {
            "model": SearchJobOut,
            "description": "Finished within `wait`.",
            "headers": REPLAYED_HEADER_DOC,
        },
        **accepted("Queued or running; poll the `Location`.", keyed=True),
        **ERRORS,
        **BUSY,
        **ERASED,
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
    rerank = _rerank_of(settings, body.rerank)
    idem = _Idempotency.of(store, tenant, idempotency_key, "POST /v1/searches", body)
    job_id = await idem.earlier_job()
    fresh: SearchJob | None = None
    if job_id is None:
        async_store = async_job_store(request)
        try:
            # a new job's only: a resend by its key gets the job its URL was checked for
            await _check_url(request, settings, body.webhook_url, tenant)
            asked = body.model_dump(exclude={"webhook_url"})
            spec = SearchSpec.model_validate({**asked, "rerank": rerank})
            adding, owed, what = await results_size(  # priced as a batch of one, by its index
                request,
                tenant,
                body.index,
                [("", spec.model_dump_json())],
                body.limit,
                traced_candidates(spec, settings.rerank_candidate_limit),
                "this search",
            )
            async with _admitted(request, 1, adding, what, field="limit"):
                # one script on the event loop: the record, the task message, the key's binding
                fresh = await _create_and_enqueue_async(
                    task_sender(request),
                    lambda enqueue: async_store.create_search(
                        tenant,
                        spec,
                        webhook_url=body.webhook_url,
                        enqueue=enqueue,
                        claim=idem.ref,
                        owed_bytes=owed,
                    ),
                    lambda job_id: [(SEARCH_TASK, [job_id], SEARCH_QUEUE)],
                )
        except IdempotencyKeyBound as bound:
            job_id = idem.bound_job(bound)
        except BaseException:
            await idem.failed(request)
            raise
        else:
            metrics.job_submitted("search")
            job_id = fresh.id
    if fresh is not None and wait == 0:
        return _search_response(request, fresh)  # just queued: no need to read it back
    response = await _answer_search(request, store, job_id, tenant, wait, fresh)
    if fresh is None:  # an earlier request's, by its key
        response.headers[REPLAYED_HEADER] = "true"
    return response


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
        with job_context(job_id):
            log.warning("search %s: the job store is away; answered as accepted", job_id)
        # what this request knows: the job it made, in the last status its poll read
        known = fresh if seen is None else dataclasses.replace(fresh, status=seen)
        return _search_response(request, known, read=False)
    if job is None and fresh is not None:  # erased by its tenant meanwhile, or lost
        raise await gone(request, "search", job_id, tenant)
    if job is None or job.tenant != tenant:  # an earlier request's, by its key
        raise await replay_gone(request, "search", job_id, tenant)
    return _search_response(request, job)


@router.get(
    "/searches/{id}",
    response_model=SearchJobOut,
    responses={**ERRORS, **ERASED},
    summary="A search job, with its result once finished",
)
async def get_search(request: Request, job_id: JobIdPath, tenant: Tenant) -> Response:
    job = (
        await off_loop(job_store(request).get_search, job_id)
        if is_id(job_id, SEARCH_ID_PREFIX)
        else None
    )
    if job is None or job.tenant != tenant:
        raise await not_there(request, "search", job_id, tenant)
    return Response(_search_out(job).model_dump_json(), media_type="application/json")


@router.delete(
    "/searches/{id}",
    response_model=ErasedOut,
    responses={
        **ERRORS,
        409: {
            "model": ErrorBody,
            "description": "`not_finished`: the search is queued or running; nothing was "
            "erased. Erase it once it has finished (within its deadline).",
        },
    },
    summary="Erase a finished search's stored record",
    description="Deletes everything stored of the search: its record (query, result with "
    "its hits' text and trace, error, usage), its place in `GET /v1/searches`, and its "
    "webhook if not yet delivered (it is not sent). From then on `GET /v1/searches/{id}` "
    "(and a request sent again with its `Idempotency-Key`) answers `410 erased`, for the "
    "retention (`SIFT_RESULT_RETENTION_SECONDS`), then `404`. Erasing it again answers the "
    "same `200`. Another tenant's search, or none, is `404`.",
)
async def erase_search(request: Request, job_id: JobIdPath, tenant: Tenant) -> ErasedOut:
    return await erase(request, "search", job_id, tenant)
