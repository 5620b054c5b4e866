"""What every job route shares: the router, backpressure, storing a job and enqueueing its
tasks, the webhook URL and rerank checks, and the answer for a job Redis lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Path, Request

from api_gateway.backpressure import (
    FULL_RETRY_AFTER_SECONDS,
    HIT_OVERHEAD_BYTES,
    RESULTS,
    RETRY_AFTER_SECONDS,
    SMALLER,
    Backlog,
    BacklogFull,
    StoreFull,
    StoreMemory,
    TooLargeForStore,
    batch_bytes,
    hit_bytes,
    results_bytes,
    trace_candidate_bytes,
)
from api_gateway.checks import V1_ROUTE
from api_gateway.deps import (
    app_settings,
    async_job_store,
    is_id,
    job_store,
    off_loop,
    task_sender,
)
from api_gateway.errors import (
    UNAVAILABLE_RETRY_AFTER,
    UNAVAILABLE_RETRY_AFTER_SECONDS,
    ApiError,
    ErrorBody,
)
from api_gateway.queue import OutboxSender, TaskMessage
from api_gateway.routing import GetAnswersHead
from api_gateway.schemas import ErasedOut, iso
from worker.constants import (
    BATCH_ID_PREFIX,
    ECONOMY_DELETE_TASK,
    ERROR_JOB_STORE_FULL,
    ERROR_UNAVAILABLE,
    REWRITE_TASK,
    SEARCH_ID_PREFIX,
    SEARCH_QUEUE,
)
from worker.errors import InvalidRequest
from worker.observability.logcontext import job_context
from worker.queue.jobstore import BatchJob, Enqueue, EraseOutcome, IngestJob, SearchJob
from worker.settings import Settings
from worker.webhooks.urlguard import (
    FIELD,
    LOOKUP_TIMEOUT_SETTING,
    LookupsBusy,
    LookupThreads,
    check_webhook_url,
    failed_for_now,
    split_webhook_url,
)

log = logging.getLogger(__package__)  # api_gateway.jobs: one logger for the job routes

router = APIRouter(prefix="/v1", route_class=GetAnswersHead, dependencies=V1_ROUTE)
T = TypeVar("T")
# a job's id in its path, named ``id`` as in DESIGN.md §9 (its OpenAPI name, and the field
# a 422 or 404 names), as the document routes' is
JobIdPath = Annotated[str, Path(alias="id")]


BUSY: dict[int | str, dict[str, Any]] = {
    429: {
        "model": ErrorBody,
        "description": "The backlog is past `SIFT_MAX_BACKLOG` queued searches and batch "
        "items (`backlog_full`); nothing was accepted. Retry after `Retry-After` seconds.",
        "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}},
    }
}


ERASED: dict[int | str, dict[str, Any]] = {
    410: {
        "model": ErrorBody,
        "description": "`erased`: the caller erased this job (`DELETE /v1/searches/{id}`, "
        "`DELETE /v1/batches/{id}/results`); nothing of it is kept. Answered for the "
        "retention (`SIFT_RESULT_RETENTION_SECONDS`) after the erasure, then `404`.",
    }
}
_ID_PREFIXES = {"search": SEARCH_ID_PREFIX, "batch": BATCH_ID_PREFIX}
# how a job not finished yet comes to an end, for the 409 of its erase
_HOW_TO_END = {
    "search": "erase it once it has finished (a search ends within its deadline)",
    "batch": "cancel it first (DELETE /v1/batches/{id}) or wait for it to finish, then erase it",
}


ErasableKind = Literal["search", "batch"]


def no_job(kind: str, job_id: str) -> ApiError:
    """The ``404`` of a job the caller has none of (never made, expired, or another
    tenant's)."""
    return ApiError(404, "not_found", f"id: no {kind} {job_id!r}", field="id")


async def not_there(request: Request, kind: ErasableKind, job_id: str, tenant: str) -> ApiError:
    """The answer for a search or batch ``tenant`` cannot read: ``410 erased`` when it erased
    it, else ``404`` (never made, expired, or another tenant's: one answer, so a tenant learns
    nothing of another's ids)."""
    if is_id(job_id, _ID_PREFIXES[kind]):
        erased_at = await off_loop(job_store(request).erasure, job_id, tenant)
        if erased_at is not None:
            return ApiError(
                410,
                "erased",
                f"id: {kind} {job_id!r} was erased at {iso(erased_at)}; nothing of it is kept",
                field="id",
            )
    return no_job(kind, job_id)


async def erase(request: Request, kind: ErasableKind, job_id: str, tenant: str) -> ErasedOut:
    """Erase the caller's finished search or batch ``job_id`` (:meth:`JobStore.erase_job`):
    ``404`` when it has no such job, ``409 not_finished`` (nothing erased) while it is queued or
    running, else the erasure, the first one's time when it was erased already. A batch's
    provider batches (the economy lane's) are deleted at the provider after, by a worker."""
    if not is_id(job_id, _ID_PREFIXES[kind]):
        raise no_job(kind, job_id)
    # an economy batch's provider batches are deleted at the provider by a task whose
    # message the erase's script writes (only if the lane made any): deleted even if this
    # gateway dies right after; the gateway has no model client of its own
    provider = None
    if kind == "batch":
        (provider,) = task_sender(request).messages([(ECONOMY_DELETE_TASK, [job_id], SEARCH_QUEUE)])
    # the Redis file rewrite an erase within the last one's interval leaves owed is paid by a
    # worker at the interval's end, this task's (sent only then): not only by the re-drive
    payment = task_sender(request).due(REWRITE_TASK, [], SEARCH_QUEUE)
    erasure = await off_loop(job_store(request).erase_job, kind, tenant, job_id, provider, payment)
    if erasure.outcome is EraseOutcome.MISSING:
        raise no_job(kind, job_id)
    if erasure.outcome is EraseOutcome.NOT_FINISHED:
        how = _HOW_TO_END[kind].replace("{id}", job_id)
        status = erasure.status or "running"
        if kind == "batch":  # its status as its GET shows it: queued until an item starts
            batch = await off_loop(job_store(request).get_batch, job_id)
            if batch is not None:
                status = batch.status
            if batch is not None and batch.canceled_at is not None:
                # one canceled already has its items past their model call left
                how = (
                    f"it was canceled at {iso(batch.canceled_at)}, and its items past their "
                    "model call finish: erase it once it has finished"
                )
        raise ApiError(
            409,
            "not_finished",
            f"id: {kind} {job_id!r} is {status}, not finished, so nothing was erased: {how}",
            field="id",
        )
    assert erasure.erased_at is not None
    with job_context(job_id):
        log.info("%s %s: erased by tenant %s", kind, job_id, tenant)
    return ErasedOut(id=job_id, kind=kind, erased_at=iso(erasure.erased_at) or "")


async def results_size(
    request: Request,
    tenant: str,
    index: str,
    items: list[tuple[str, str]],
    hits: int,
    traced: int,
    what: str,
    waiting: int = 0,
) -> tuple[int, int, str]:
    """What a search or batch will add to the job store with its results (:func:`batch_bytes`
    of its ``items``, a search one), each of its ``hits`` priced by its index's mean
    document as the workers recorded it (:func:`hit_bytes`; one read of Redis), and each of
    the ``traced`` candidates its traces list, and of the ``waiting`` ones its economy items
    keep while they wait at the provider, by the same, cut to the prompt's
    ``SIFT_RERANK_CANDIDATE_MAX_CHARS`` (:func:`trace_candidate_bytes`); of that, what its
    results owe until its items finish (:func:`results_bytes`, which its record keeps); and
    how a refusal names it (``what``, with the index's figures). An index of ``n``
    documents gives a query ``n`` hits (and candidates) at most, so they are counted up to
    that. A Redis with no ``maxmemory`` admits by none of it: nothing is read, 0 added, and
    its results owe what hits of the fixed size would
    (:data:`~api_gateway.backpressure.HIT_BYTES`), should a ``maxmemory`` be set meanwhile."""
    memory: StoreMemory | None = getattr(request.app.state, "memory", None)
    if memory is None or not await memory.limited():
        return 0, results_bytes(len(items), hits, traced, waiting=waiting), what
    size = await async_job_store(request).index_size(tenant, index)
    if size is not None:
        hits, traced, waiting = (min(n, len(items) * size[0]) for n in (hits, traced, waiting))
    per_hit = hit_bytes(size)
    per_candidate = trace_candidate_bytes(size, app_settings(request).rerank_candidate_max_chars)
    if size is not None:
        listed = f" and {traced} trace candidates" if traced else ""
        if waiting:
            listed += f" and {waiting} candidates kept while waiting at the provider"
        what += (
            f" (up to {hits} hits{listed} over index {index!r}, whose documents hold "
            f"{per_hit - HIT_OVERHEAD_BYTES:,} bytes on average)"
        )
    owed = results_bytes(len(items), hits, traced, per_hit, per_candidate, waiting)
    return batch_bytes(items, hits, traced, per_hit, per_candidate, waiting), owed, what


async def room_for_new_work(
    request: Request,
    adding: int = 0,
    what: str = "",
    field: str = "queries",
    holds: str = RESULTS,
    smaller: str = SMALLER,
) -> None:
    """503 ``job_store_full`` with ``Retry-After`` when Redis holds 90 % of its ``maxmemory``
    or more, or would with the ``adding`` bytes of ``what`` (a search or batch:
    :func:`results_size`) (:class:`StoreMemory`): the room left is for the jobs running. One
    that alone would pass the 90 % is a 422 naming ``field`` (a batch's queries, a search's
    limit): no retry admits it."""
    memory: StoreMemory | None = getattr(request.app.state, "memory", None)
    if memory is None:
        return
    try:
        await memory.admit(adding, what, holds, smaller)
    except TooLargeForStore as exc:
        raise InvalidRequest(field, str(exc)) from exc
    except StoreFull as exc:
        log.warning("backpressure: %s", exc)
        raise ApiError(
            503,
            ERROR_JOB_STORE_FULL,
            exc.public,
            headers={"Retry-After": str(FULL_RETRY_AFTER_SECONDS)},
        ) from exc


@contextlib.asynccontextmanager
async def _admitted(
    request: Request, items: int, adding: int = 0, what: str = "", field: str = "queries"
) -> AsyncIterator[None]:
    """Backpressure: 503 when Redis is nearly full, or would be with the ``adding`` bytes of
    ``what`` (:func:`room_for_new_work`, a 422 naming ``field`` for one that never fits);
    429 with ``Retry-After`` when ``items`` more would pass the backlog limit; else the block
    stores their job (:func:`_in_backlog`), its bytes counted as this gateway's until it
    ends (:meth:`StoreMemory.storing`)."""
    async with _in_store(request, adding, what, field), _in_backlog(request, items):
        yield


@contextlib.asynccontextmanager
async def _in_store(
    request: Request,
    adding: int,
    what: str,
    field: str,
    holds: str = RESULTS,
    smaller: str = SMALLER,
) -> AsyncIterator[None]:
    """503 when Redis is nearly full, or would be with the ``adding`` bytes of ``what`` (a 422
    naming ``field`` for one that never fits: :func:`room_for_new_work`); else the block stores
    the job, its bytes counted as this gateway's until it ends (:meth:`StoreMemory.storing`)."""
    await room_for_new_work(request, adding, what, field, holds, smaller)
    memory: StoreMemory | None = getattr(request.app.state, "memory", None)
    with memory.storing(adding) if memory is not None else contextlib.nullcontext():
        yield


@contextlib.asynccontextmanager
async def _in_backlog(request: Request, items: int) -> AsyncIterator[None]:
    """429 with ``Retry-After`` when ``items`` more would pass the backlog limit; else the block
    stores their job, held in the backlog's count until it ends (:meth:`Backlog.admitted`)."""
    backlog: Backlog | None = getattr(request.app.state, "backlog", None)
    if backlog is None or backlog.limit <= 0:
        yield
        return
    if items > backlog.limit:  # a 429 would say "retry", and no retry admits it
        raise InvalidRequest(
            "queries",
            f"{items} queries are more than the backlog holds (SIFT_MAX_BACKLOG is "
            f"{backlog.limit}), so no retry admits them: send them in batches of at most "
            f"{backlog.limit}",
        )
    try:
        async with backlog.admitted(items):
            yield
    except BacklogFull as exc:  # raised on admission only: the block raises none
        log.warning("backpressure: %s", exc)
        raise ApiError(
            429,
            "backlog_full",
            exc.public,
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        ) from exc


J = TypeVar("J", SearchJob, BatchJob, IngestJob)


def _create_and_enqueue(
    sender: OutboxSender,
    create: Callable[[Enqueue | None], J],
    messages: Callable[[str], list[TaskMessage]],
) -> J:
    """Store a job and enqueue its tasks, in one MULTI through the outbox."""
    return create(lambda job_id: sender.messages(messages(job_id)))


async def _create_and_enqueue_async(
    sender: OutboxSender,
    create: Callable[[Enqueue | None], Awaitable[J]],
    messages: Callable[[str], list[TaskMessage]],
) -> J:
    """:func:`_create_and_enqueue` with the store on the event loop (the gateway's hot path)."""
    return await create(lambda job_id: sender.messages(messages(job_id)))


async def _check_url(request: Request, settings: Settings, url: str | None, tenant: str) -> None:
    """The SSRF guard on a webhook URL being registered (``422`` naming ``webhook_url``).

    Its host's name lookup (getaddrinfo, which takes no timeout) runs on one of the gateway's
    own lookup threads (:class:`LookupThreads`: ``tenant``'s share of them, none queued) and
    is waited on, on the event loop, at most ``SIFT_WEBHOOK_CONNECT_TIMEOUT_SECONDS``: one
    still unanswered then, or finding no thread free, is a ``503`` naming ``webhook_url``
    and that setting, nothing stored. Before, the lookup ran in the threadpool the gateway's
    store calls and sync dependencies share, for as long as the resolver took: a resolver
    that never answered held the request, and one of those threads, forever."""
    if url is None:
        return
    _, host, port = split_webhook_url(url)
    lookups: LookupThreads = request.app.state.lookups
    within = settings.webhook_connect_timeout_seconds
    try:
        found = lookups.submit(host, port, tenant, type=socket.SOCK_STREAM)
    except LookupsBusy as exc:
        raise _lookup_unavailable(
            f"the name lookup of the host {host!r} found no lookup thread free for this tenant "
            f"(its lookups wait on a resolver that has not answered; each request waits at "
            f"most {within:g} s, {LOOKUP_TIMEOUT_SETTING})",
            within,
        ) from exc
    waited = asyncio.wrap_future(found)
    waited.add_done_callback(_retrieved)
    done, _ = await asyncio.wait({waited}, timeout=within)  # never cancels the lookup
    if not done:
        log.warning("webhook_url: the name lookup of %r unanswered at %g s", host, within)
        raise _lookup_unavailable(
            f"the name lookup of the host {host!r} did not answer within {within:g} s "
            f"({LOOKUP_TIMEOUT_SETTING})",
            within,
        )
    if failed_for_now(found.exception()):
        raise _lookup_unavailable(
            f"the name lookup of the host {host!r} failed for now (temporary failure in name "
            "resolution: the resolver's servers did not answer)",
            within,
        )
    check_webhook_url(  # the answer, or the lookup's error, read back: no thread needed
        url, allow_private=settings.webhook_allow_private_networks, lookup=_answer(found)
    )


def _answer(found: Future[list[tuple[Any, ...]]]) -> Callable[..., list[tuple[Any, ...]]]:
    return lambda *_args, **_kwargs: found.result()


def _retrieved(waited: asyncio.Future[Any]) -> None:
    """A lookup answered after its request gave up on it: its error is nobody's to log."""
    if not waited.cancelled():
        waited.exception()


def _lookup_unavailable(why: str, within: float) -> ApiError:
    return ApiError(
        503,
        ERROR_UNAVAILABLE,
        f"{FIELD}: {why}; nothing was stored: send the request again later",
        field=FIELD,
        headers={"Retry-After": str(math.ceil(within))},
    )


def _rerank_of(settings: Settings, rerank: bool | None) -> bool:
    """Whether the request's searches rerank, as the job will say: as it asks, else this
    gateway's default (``SIFT_RERANK_ENABLED``), which the settings check keeps off without a
    model. The job carries the answer, so the worker never decides it by its own setting:
    a worker set otherwise ran an omitted ``rerank`` its own way, unreranked where this
    gateway promised a rerank (``applied: false``, no reason given), or reranked, and billed,
    where it promised none.

    A request asking for a rerank (``rerank: true``) on a deployment with no generation
    model is ``422`` naming ``rerank``, before anything is stored: it was accepted, then
    failed in the worker (a batch's every item), which reads the same settings."""
    if rerank and settings.generation_model is None:
        raise InvalidRequest(
            "rerank",
            "is true, but this deployment has no generation model to rerank with: set "
            "SIFT_GENERATION_MODEL (for example anthropic:claude-haiku-4-5), or leave "
            "rerank out",
        )
    return settings.rerank_enabled if rerank is None else rerank


async def gone(request: Request, kind: ErasableKind, job_id: str, tenant: str) -> ApiError:
    """The answer of a request that made ``job_id`` and then found it gone: ``410 erased``
    when ``tenant`` erased it meanwhile (a ``DELETE`` of the same tenant while this request
    waited on it: the job had finished), else lost by Redis (:func:`_lost`). Answered as
    lost, an erase the tenant asked for was a ``503`` that had its client make the job
    again, and an ERROR log of a restart that never happened."""
    answer = await not_there(request, kind, job_id, tenant)
    return answer if answer.status == 410 else _lost(kind, job_id)


def key_job_gone(kind: str, job_id: str) -> ApiError:
    """The answer of a request sent again with its ``Idempotency-Key``, bound to ``job_id``,
    whose record the job store no longer holds (a Redis restored without it, a purge under
    way): ``410`` naming the key, the same for each resend while the key stays bound (its
    24 hours). A new key makes the job again: the client's call, not the gateway's, as the
    first one may have run (a write made again is newer than a write of its ids accepted
    since)."""
    with job_context(job_id):
        log.warning("%s %s: its Idempotency-Key's job is gone from the job store", kind, job_id)
    return ApiError(
        410,
        "idempotency_key_job_gone",
        f"Idempotency-Key: its {kind} {job_id!r} is no longer kept (the job store lost its "
        "record), so what it did cannot be read, and this key answers so until it expires; "
        f"send the request with a new Idempotency-Key to make the {kind} again",
        field="Idempotency-Key",
    )


async def replay_gone(request: Request, kind: ErasableKind, job_id: str, tenant: str) -> ApiError:
    """The answer of a request sent again with its ``Idempotency-Key``, bound to ``job_id``,
    that finds the job gone: ``410 erased`` when ``tenant`` erased it, else
    :func:`key_job_gone`."""
    answer = await not_there(request, kind, job_id, tenant)
    return answer if answer.status == 410 else key_job_gone(kind, job_id)


def _lost(kind: str, job_id: str) -> ApiError:
    """The answer of a request whose job Redis lost while it waited on it (a restart without
    its data: the record, and the task message unless a worker had taken it): no outcome of
    it can be read, ever, and the request sent again makes it again (a ``202`` pointed its
    ``Location`` at a ``404``)."""
    with job_context(job_id):
        log.error("%s %s: lost by the job store (Redis restarted without its data)", kind, job_id)
    return ApiError(
        503,
        ERROR_UNAVAILABLE,
        f"the job store lost this {kind} (Redis restarted without its data), so its outcome "
        f"cannot be known; send the request again after {UNAVAILABLE_RETRY_AFTER_SECONDS} s",
        headers=UNAVAILABLE_RETRY_AFTER,
    )
