"""The job lists: ``GET /v1/searches``, ``/v1/batches`` and ``/v1/ingestions``, the caller's
own jobs newest first, by status, a page at a time, within the retention window.

Each tenant's jobs have their own index in the job store (written with each job's record,
:mod:`worker.queue.jobstore.jobindex`), so a list never reads another tenant's jobs. The page
token is a cursor (where the last page ended, :class:`~worker.queue.jobstore.Cursor`), so a
job created while a client pages through shows up on no page twice, with a digest that ties
it to the tenant's list (:func:`api_gateway.tokens.encode_cursor`, as the index and document
listings' are): another tenant's token, or another list's, is a 422 naming ``page_token``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from api_gateway.checks import V1_ROUTE
from api_gateway.deps import (
    ERRORS,
    PageSize,
    Tenant,
    is_id,
    job_store,
    off_loop,
)
from api_gateway.jobs import batch_out, ingest_out
from api_gateway.routing import GetAnswersHead
from api_gateway.schemas import BatchOut, IngestJobOut, iso
from api_gateway.tokens import NOT_OURS, decode_cursor, encode_cursor, max_cursor_chars
from worker.constants import (
    BATCH_ID_PREFIX,
    DEFAULT_PAGE_SIZE,
    INGEST_ID_PREFIX,
    MAX_LIST_READ_BYTES,
    MAX_LIST_SCAN,
    SEARCH_ID_PREFIX,
)
from worker.contract import ErrorInfo, JobStatus, Mode
from worker.errors import InvalidRequest
from worker.queue.jobstore import BatchJob, Cursor, IngestJob, JobPage, SearchJob
from worker.queue.jobstore.jobindex import KIND_BATCH, KIND_INGEST, KIND_SEARCH

router = APIRouter(prefix="/v1", route_class=GetAnswersHead, dependencies=V1_ROUTE)

_TIME = re.compile(r"[0-9]{1,12}(\.[0-9]{1,20})?")  # a creation time, as repr() writes it
# the longest id: its prefix and 32 hex digits
# each list's kind and the prefix of its jobs' ids
_ID_PREFIX = {
    KIND_SEARCH: SEARCH_ID_PREFIX,
    KIND_BATCH: BATCH_ID_PREFIX,
    KIND_INGEST: INGEST_ID_PREFIX,
}
_ID_CHARS = max(map(len, _ID_PREFIX.values())) + 32
_MAX_PLACE_CHARS = 12 + 1 + 20 + 1 + _ID_CHARS  # "<time>:<id>", the longest _TIME allows
_MAX_TOKEN_CHARS = max_cursor_chars(_MAX_PLACE_CHARS)
J = TypeVar("J", SearchJob, BatchJob, IngestJob)
Item = TypeVar("Item", bound=BaseModel)

PageToken = Annotated[
    str | None,
    Query(
        max_length=_MAX_TOKEN_CHARS,
        description="The previous page's `next_page_token`; leave it out for the first page.",
    ),
]
StatusFilter = Annotated[
    JobStatus | None, Query(description="Only the jobs in this status (a batch's own status).")
]
_LISTED = (
    f"Newest first, within the retention window (SIFT_RESULT_RETENTION_SECONDS, 7 days by "
    f"default, from a job's end). With "
    f"`status`, one request reads at most {MAX_LIST_SCAN} jobs, so a page can hold fewer than "
    f"`page_size` (even none): go on while `next_page_token` is not null. Any page also "
    f"ends once the records it read hold {MAX_LIST_READ_BYTES // 2**20} MiB of specs (a "
    f"search's filters), the next entry starting the next page. A job created "
    f"while you page through appears on none of the following pages; no job appears twice. "
    f"A page token is this list's for the caller alone: another tenant's or another list's "
    f"is `422` naming `page_token`."
)


class SearchListItem(BaseModel):
    """A search in a list: what it asked and how it went; its result is at
    ``GET /v1/searches/{id}``."""

    id: str
    status: JobStatus
    index: str
    query: str
    mode: Mode
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    error: ErrorInfo | None = None


class SearchList(BaseModel):
    searches: list[SearchListItem]
    next_page_token: str | None


class BatchList(BaseModel):
    batches: list[BatchOut]
    next_page_token: str | None


class IngestionList(BaseModel):
    ingestions: list[IngestJobOut]
    next_page_token: str | None


def encode_job_cursor(kind: str, tenant: str, cursor: Cursor | None) -> str | None:
    """The page token of ``tenant``'s list of ``kind`` (a search, a batch, an ingest) that
    starts after ``cursor`` (None: there is no next page).

    >>> cursor = Cursor(1764000000.25, "bat_" + "0" * 32)
    >>> decode_job_cursor(encode_job_cursor("batch", "acme", cursor), "batch", "acme")
    Cursor(created_at=1764000000.25, job_id='bat_00000000000000000000000000000000')
    """
    if cursor is None:
        return None
    return encode_cursor("c", (kind, tenant), f"{cursor.created_at!r}:{cursor.job_id}")


def decode_job_cursor(token: str | None, kind: str, tenant: str) -> Cursor | None:
    """The cursor in a page token of ``tenant``'s list of ``kind``. Only the exact text
    :func:`encode_job_cursor` made for this tenant and list is one; anything else is a 422
    naming ``page_token`` before Redis sees it (another tenant's token, another list's, a
    batch-results token, an edited one, or one of the cursors without a digest a list issued
    before, which any tenant's list took)."""
    place = decode_cursor(token, "c", (kind, tenant), _MAX_PLACE_CHARS)
    if place is None:
        return None
    at, _, job_id = place.partition(":")
    if not _TIME.fullmatch(at) or not is_id(job_id, _ID_PREFIX[kind]):
        raise InvalidRequest("page_token", NOT_OURS)
    cursor = Cursor(float(at), job_id)
    if encode_job_cursor(kind, tenant, cursor) != token:  # the time as repr() writes it
        raise InvalidRequest("page_token", NOT_OURS)
    return cursor


async def _page(
    read: Callable[..., JobPage[J]],
    out: Callable[[J], Item],
    kind: str,
    tenant: str,
    status: JobStatus | None,
    page_size: int,
    page_token: str | None,
) -> tuple[list[Item], str | None]:
    """The body of each list route: one page of the store's ``read`` (from the cursor in
    ``page_token``, a token of ``tenant``'s list of ``kind``), each job as ``out`` shows it,
    and the next page's token. The token is not tied to ``status``: it is a place in the
    tenant's list, the same whatever the filter."""
    after = decode_job_cursor(page_token, kind, tenant)
    page = await off_loop(read, tenant, status=status, after=after, page_size=page_size)
    return [out(job) for job in page.jobs], encode_job_cursor(kind, tenant, page.next)


def _search_item(job: SearchJob) -> SearchListItem:
    return SearchListItem(
        id=job.id,
        status=job.status,
        index=job.spec.index,
        query=job.spec.query,
        mode=job.spec.mode,
        created_at=iso(job.created_at) or "",
        started_at=iso(job.started_at),
        finished_at=iso(job.finished_at),
        # its trace, as its result, is GET /v1/searches/{id}'s to show
        error=job.error.model_copy(update={"trace": None}) if job.error else None,
    )


@router.get(
    "/searches",
    response_model=SearchList,
    responses=ERRORS,
    summary="The caller's searches, newest first",
    description=_LISTED,
)
async def list_searches(
    request: Request,
    tenant: Tenant,
    status: StatusFilter = None,
    page_size: PageSize = DEFAULT_PAGE_SIZE,
    page_token: PageToken = None,
) -> SearchList:
    searches, token = await _page(
        job_store(request).list_searches,
        _search_item,
        KIND_SEARCH,
        tenant,
        status,
        page_size,
        page_token,
    )
    return SearchList(searches=searches, next_page_token=token)


@router.get(
    "/batches",
    response_model=BatchList,
    responses=ERRORS,
    summary="The caller's batches, newest first",
    description=_LISTED,
)
async def list_batches(
    request: Request,
    tenant: Tenant,
    status: StatusFilter = None,
    page_size: PageSize = DEFAULT_PAGE_SIZE,
    page_token: PageToken = None,
) -> BatchList:
    batches, token = await _page(
        job_store(request).list_batches,
        batch_out,
        KIND_BATCH,
        tenant,
        status,
        page_size,
        page_token,
    )
    return BatchList(batches=batches, next_page_token=token)


@router.get(
    "/ingestions",
    response_model=IngestionList,
    responses=ERRORS,
    summary="The caller's ingest jobs, newest first",
    description=_LISTED,
)
async def list_ingestions(
    request: Request,
    tenant: Tenant,
    status: StatusFilter = None,
    page_size: PageSize = DEFAULT_PAGE_SIZE,
    page_token: PageToken = None,
) -> IngestionList:
    ingestions, token = await _page(
        job_store(request).list_ingests,
        ingest_out,
        KIND_INGEST,
        tenant,
        status,
        page_size,
        page_token,
    )
    return IngestionList(ingestions=ingestions, next_page_token=token)
