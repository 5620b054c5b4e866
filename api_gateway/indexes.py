"""The v1 index lifecycle routes: list and show indexes, list and read documents, delete
documents or a tenant's whole index (issue 13), change an index's own search settings (issue 15).

Reads go to a worker, which holds the backend (the gateway imports no backend): the gateway
enqueues a ``sift.index_read`` task on the search queue with a one-off reply key and pops
the answer with ``BLPOP`` for up to ``INDEX_READ_TIMEOUT_SECONDS``, else ``503``; it waits on
the asyncio client, holding no threadpool thread (``/readyz`` and the searches' blocking calls
share those 40). A settings
change (``PATCH``) goes the same way: the worker checks the tenant has the index, then stores
it. Deletes are jobs of the ingest kind (``operation`` "delete" or "drop"), answered like an
ingest: ``202`` with a ``Location`` to poll (``GET /v1/ingestions/{id}``), or ``200`` once
final within ``?wait=``. Every route is the caller's tenant's: another tenant's index or
document gives the very same ``404`` as one nobody has, and a delete job of it deletes nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Annotated, Any, Final

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import BaseModel, Field
from starlette.convertors import Convertor, register_url_convertor

from api_gateway.checks import V1_ROUTE
from api_gateway.deps import (
    ERRORS,
    LOCATION_HEADER,
    REPLAYED_HEADER_DOC,
    UNAVAILABLE_DOC,
    PageSize,
    Tenant,
    Wait,
    async_job_store,
    job_store,
    off_loop,
    task_sender,
)
from api_gateway.errors import (
    UNAVAILABLE_RETRY_AFTER,
    ApiError,
    ErrorBody,
    job_store_full,
    job_store_unavailable,
)
from api_gateway.jobs import IdemKey, submit_write
from api_gateway.routing import GetAnswersHead
from api_gateway.schemas import IngestJobOut, _Strict, iso
from api_gateway.tokens import decode_cursor, encode_cursor, max_cursor_chars
from worker.constants import (
    DEFAULT_PAGE_SIZE,
    DOCUMENT_PREVIEW_CHARS,
    ERROR_JOB_STORE_FULL,
    ERROR_TENANT_REMOVED,
    ERROR_UNAVAILABLE,
    INDEX_CHANGE_GRACE_SECONDS,
    INDEX_READ_TASK,
    INDEX_READ_TIMEOUT_SECONDS,
    MAX_DOCUMENTS_PER_REQUEST,
    MAX_LIST_READ_BYTES,
    SEARCH_QUEUE,
)
from worker.contract import (
    INDEX_PATTERN,
    STORED_METADATA_DOC,
    FusionMethod,
    IndexSettingsPatch,
    StoredValue,
)
from worker.errors import InvalidRequest
from worker.redis_client import CANNOT_PERSIST

log = logging.getLogger(__name__)
router = APIRouter(
    prefix="/v1", tags=["indexes"], route_class=GetAnswersHead, dependencies=V1_ROUTE
)


class DocIdConvertor(Convertor[str]):
    """A document id in a path: the rest of the path, line breaks included. Starlette's
    ``path`` is ``.*``, which stops at a line break, and its route's ``$`` matches before a
    last one: ``DELETE .../documents/d1%0A`` deleted document ``d1``."""

    regex = "(?s:.*)"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("doc_id", DocIdConvertor())

MAX_DOC_ID_CHARS = 512
# named ``id`` as in DESIGN.md §9 (its OpenAPI name, and the field a 422 or 404 names)
DocIdPath = Annotated[str, Path(alias="id", min_length=1, max_length=MAX_DOC_ID_CHARS)]
DocId = Annotated[str, Field(min_length=1, max_length=MAX_DOC_ID_CHARS)]
MAX_INDEX_NAME_CHARS = 128
IndexPath = Annotated[
    str, Path(min_length=1, max_length=MAX_INDEX_NAME_CHARS, pattern=INDEX_PATTERN)
]


# a document's id: up to 512 four-byte characters; an index's name: ASCII
_MAX_CURSOR_CHARS = max_cursor_chars(4 * MAX_DOC_ID_CHARS)
_MAX_INDEX_CURSOR_CHARS = max_cursor_chars(MAX_INDEX_NAME_CHARS)
JOB_RESPONSES: dict[int | str, dict[str, Any]] = {
    202: {
        "model": IngestJobOut,
        "description": "Accepted: the job, queued or running.",
        "headers": {**LOCATION_HEADER, **REPLAYED_HEADER_DOC},
    },
    200: {
        "model": IngestJobOut,
        "description": "Finished within `wait`.",
        "headers": REPLAYED_HEADER_DOC,
    },
    **ERRORS,
}


class FusionWeightsOut(BaseModel):
    bm25: float | None = None
    knn: float | None = None


class FusionSettingsOut(BaseModel):
    method: FusionMethod | None = None
    weights: FusionWeightsOut = Field(default_factory=FusionWeightsOut)
    rank_constant: int | None = None


class IndexSettingsOut(BaseModel):
    """The index's own search settings as stored; ``null``: unset (the default applies)."""

    fusion: FusionSettingsOut = Field(default_factory=FusionSettingsOut)
    candidate_limit: int | None = None


class IndexOut(BaseModel):
    """The caller's part of one index."""

    name: str
    documents: int = Field(description="The caller's documents in it.")
    backend: str
    embedding_model: str | None = Field(
        None, description="The embedder of its vectors (not recorded by Elasticsearch)."
    )
    dimensions: int | None = None
    last_write_at: str | None = Field(
        None, description="The caller's last applied write (not recorded by Elasticsearch)."
    )
    settings: IndexSettingsOut = Field(
        default_factory=IndexSettingsOut,
        description="Its own search settings (PATCH /v1/indexes/{index}); a search's own "
        "override them.",
    )


class IndexesPage(BaseModel):
    indexes: list[IndexOut]
    next_page_token: str | None = None


class StoredDocumentOut(BaseModel):
    """One document as stored (its vector is not returned)."""

    id: str
    text: str
    title: str
    revision: str
    metadata: dict[str, StoredValue] = Field(description=STORED_METADATA_DOC)
    version: int | None = Field(None, description="The accepted write that stored it.")


class ListedDocumentOut(BaseModel):
    """One document in a listing: what ``GET .../documents/{id}`` shows but the text, of
    which only the start and the length (a text runs to 100,000 characters; a page holds up
    to 1,000 documents). Never the vector."""

    id: str
    title: str
    revision: str
    metadata: dict[str, StoredValue] = Field(description=STORED_METADATA_DOC)
    version: int | None = Field(None, description="The accepted write that stored it.")
    text_preview: str = Field(
        description=f"The first {DOCUMENT_PREVIEW_CHARS} characters of the text "
        "(GET the document for all of it)."
    )
    text_length: int = Field(description="The whole text's length in characters.")


class DocumentsPage(BaseModel):
    documents: list[ListedDocumentOut]
    next_page_token: str | None  # on every page (null on the last), so declared required


class DeleteDocumentsRequest(_Strict):
    """``POST /v1/indexes/{index}/documents/delete``."""

    ids: list[DocId] = Field(min_length=1, max_length=MAX_DOCUMENTS_PER_REQUEST)


#: The answers of a route a worker reads for (``_read``): its failures under the worker's types
READ_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    500: {
        "model": ErrorBody,
        "description": "The worker's read failed for good, under the type a failed job's "
        "record gives it: `backend_request_error` or `backend_error` (the search backend "
        "refused the request), `config_error` (a setting is wrong, or the backend refused "
        "Sift's own credentials), `internal_error` (a bug). Sending it again fails again.",
    },
    503: {
        "model": ErrorBody,
        "description": UNAVAILABLE_DOC + " `backend_unavailable`: no worker answered in "
        "time, or the search backend did not answer. `tenant_removed`: "
        "the caller's tenant was removed from the workers' keys (this gateway still takes "
        "its key until it restarts).",
    },
}


def _index_out(raw: dict[str, Any]) -> IndexOut:
    return IndexOut(
        name=raw["name"],
        documents=raw["documents"],
        backend=raw["backend"],
        embedding_model=raw.get("model"),
        dimensions=raw.get("dimension"),
        last_write_at=iso(raw.get("last_write")),
        settings=IndexSettingsOut.model_validate(raw.get("settings") or {}),
    )


def encode_index_cursor(tenant: str, name: str) -> str:
    """The page token of the index list: the last name listed, tied to the tenant's list
    (``i``, where a document listing's is ``d``).

    >>> decode_index_cursor(encode_index_cursor("acme", "docs"), "acme")
    'docs'
    """
    return encode_cursor("i", ("i", tenant), name)


def decode_index_cursor(token: str | None, tenant: str) -> str | None:
    """The name the index list's page starts after (None: the first page)."""
    return decode_cursor(token, "i", ("i", tenant), MAX_INDEX_NAME_CHARS)


def encode_document_cursor(tenant: str, index: str, doc_id: str) -> str:
    """The page token of a document listing: the last id listed, tied to the tenant's index."""
    return encode_cursor("d", (tenant, index), doc_id)


def decode_document_cursor(token: str | None, tenant: str, index: str) -> str | None:
    """The id a document listing's page starts after; a 422 before a worker sees it when it
    is not this listing's."""
    return decode_cursor(token, "d", (tenant, index), MAX_DOC_ID_CHARS)


def _not_found(index: str) -> ApiError:
    # the words of worker.errors.IndexNotFound: the same for any index the caller lacks
    return ApiError(
        404,
        "index_not_found",
        f"index {index!r} does not exist: ingest documents into it first",
        field="index",
    )


async def _read(
    request: Request, operation: str, tenant: str, index: str, doc_id: str, body: str = ""
) -> Any:
    """Ask a worker for one index read; its ``found`` answer (None: the tenant has none).

    The read is sent ahead of every message waiting on the search queue (``send_next``):
    behind them, FIFO, a backlog of searches longer than its wait made it ``503`` while every
    worker was healthy. It carries ``start_by``, when its wait ends, on Redis's clock (which
    the worker checks it with: this host's may be seconds off the worker's): a worker drops
    a read or change it takes later, which no one waits for any more (it ran, answering no
    one, and each retry of its client added another)."""
    store = job_store(request)
    key = store.new_reply_key()
    start_by = await async_job_store(request).server_time() + INDEX_READ_TIMEOUT_SECONDS
    args: list[Any] = [key, operation, tenant, index, doc_id, body, start_by]
    wait = INDEX_READ_TIMEOUT_SECONDS
    if operation == "update":  # started by then or never; answered within the grace after
        # (a change applied after its 503, behind a newer one, would be lost)
        wait += INDEX_CHANGE_GRACE_SECONDS
        what = (
            f"index settings change within {wait:g} s (none started by "
            f"{INDEX_READ_TIMEOUT_SECONDS:g} s makes it)"
        )
    else:
        what = f"index read within {wait:g} s"
    await off_loop(task_sender(request).send_next, INDEX_READ_TASK, args, SEARCH_QUEUE)
    # on the event loop: a wait no worker answers holds no thread /readyz or a search needs
    raw = await async_job_store(request).await_reply(key, wait)
    if raw is None:
        raise ApiError(
            503,
            "backend_unavailable",
            f"no worker answered the {what}; retry",
            headers=UNAVAILABLE_RETRY_AFTER,  # as the job store's own 503 says when
        )
    answer = json.loads(raw)
    error = answer.get("error")
    if error is not None:
        if error.get("type") == "index_not_found":
            raise _not_found(index)
        if error.get("type") == ERROR_UNAVAILABLE:  # the worker's Redis failed its read
            raise job_store_unavailable(error["message"])
        if error.get("type") == ERROR_JOB_STORE_FULL:  # the worker's Redis refused a write
            raise job_store_full(disk=error.get("message") == CANNOT_PERSIST)
        if error.get("type") == "invalid_request":
            # the worker's message starts with the field's name: a 422 lists it without
            field = error.get("field") or "body"
            raise InvalidRequest(field, error["message"].removeprefix(f"{field}: "))
        raise worker_failure(error["type"], error["message"])
    return answer["found"]


#: The worker's failures of an index read that a retry may pass, and when to ask again: the
#: search backend down (``BackendUnavailable``, the one retryable ``SiftError`` a read meets),
#: and a removed tenant's key, which its gateway takes until it restarts (docs/security.md):
#: no time to say
_RETRYABLE: Final[dict[str, Mapping[str, str] | None]] = {
    "backend_unavailable": UNAVAILABLE_RETRY_AFTER,
    ERROR_TENANT_REMOVED: None,
}


def worker_failure(type_: str, message: str) -> ApiError:
    """The answer to an index read whose worker failed (not the job store: its 503s are
    the gateway's own), under the worker's type, as a failed job's record has it: ``503``
    for what a retry may pass, ``500`` for what none will (an Elasticsearch 4xx, a wrong
    setting or refused credentials, a bug). All were ``503 backend_unavailable``, so a
    client retried a permanent failure for ever.

    >>> worker_failure("config_error", "answered 401").status
    500
    """
    if type_ in _RETRYABLE:
        return ApiError(503, type_, f"the index read failed: {message}", headers=_RETRYABLE[type_])
    return ApiError(500, type_, f"the index read failed: {message}")


async def _delete_job(
    request: Request,
    tenant: str,
    index: str,
    ids: list[str] | None,
    wait: float,
    key: str | None,
) -> Response:
    """A delete job of ``ids`` (None: the index), replayed by its ``Idempotency-Key``."""
    store = job_store(request)
    return await submit_write(
        request,
        (tenant, key, f"{request.method} {request.url.path}", lambda: ids),
        lambda enqueue, claim: store.create_deletion(
            tenant, index, ids, enqueue=enqueue, claim=claim
        ),
        wait,
        admit=None,  # a delete is taken still: it frees room
    )


async def _read_index(
    request: Request, operation: str, tenant: str, index: str, body: str = ""
) -> Any:
    """:func:`_read` of one of the caller's indexes as a whole: one it does not have (another
    tenant's name or nobody's) is the 404 naming ``index``."""
    found = await _read(request, operation, tenant, index, "", body)
    if found is None:
        raise _not_found(index)
    return found


@router.get(
    "/indexes",
    response_model=IndexesPage,
    responses=READ_ERRORS,
    summary="The caller's indexes, by name, one page at a time",
    description="Each index holding at least one of the caller's documents, with the "
    "caller's count, ordered by name. Each page starts after the last name of the one "
    "before (`next_page_token`, `null` on the last page), so an index made or dropped while "
    "you page through moves no other across a page's edge: none that was there throughout "
    "is shown twice or missed.",
)
async def list_indexes(
    request: Request,
    tenant: Tenant,
    page_size: PageSize = DEFAULT_PAGE_SIZE,
    page_token: Annotated[
        str | None,
        Query(
            max_length=_MAX_INDEX_CURSOR_CHARS,
            description="The previous page's `next_page_token`; leave it out for the first.",
        ),
    ] = None,
) -> IndexesPage:
    after = decode_index_cursor(page_token, tenant)
    body = json.dumps({"after": after, "limit": page_size})
    found = await _read(request, "list", tenant, "", "", body)
    indexes = [_index_out(i) for i in found["indexes"]]
    token = encode_index_cursor(tenant, indexes[-1].name) if found["more"] else None
    return IndexesPage(indexes=indexes, next_page_token=token)


@router.get(
    "/indexes/{index}",
    response_model=IndexOut,
    responses=READ_ERRORS,
    summary="One of the caller's indexes",
)
async def get_index(request: Request, tenant: Tenant, index: IndexPath) -> IndexOut:
    return _index_out(await _read_index(request, "show", tenant, index))


@router.patch(
    "/indexes/{index}",
    response_model=IndexOut,
    responses=READ_ERRORS,
    summary="Change the caller's index's own search settings",
    description="A JSON Merge Patch: a field left out stays, `null` clears it back to the "
    "default (`SIFT_FUSION_METHOD`, `SIFT_FUSION_WEIGHTS`, `SIFT_FUSION_RANK_CONSTANT`, "
    "`SIFT_RERANK_CANDIDATE_LIMIT`). A search's own `fusion` and `candidate_limit` override "
    "these, field by field. Answers the index as `GET` does; the settings go with a drop of "
    "the index. Worker processes other than the one that stored them see them within 2 s.",
)
async def update_index(
    request: Request, body: IndexSettingsPatch, tenant: Tenant, index: IndexPath
) -> IndexOut:
    patch = body.model_dump(mode="json", exclude_unset=True)
    return _index_out(
        await _read_index(request, "update", tenant, index, json.dumps(patch) or "{}")
    )


@router.get(
    "/indexes/{index}/documents",
    response_model=DocumentsPage,
    responses=READ_ERRORS,
    summary="The caller's documents in one of its indexes, by id, one page at a time",
    description="Ordered by id (Unicode code point order). Each page starts after the last "
    "id of the one before (`next_page_token`, `null` on the last page), so a document "
    "written or deleted while you page through moves no other across a page's edge: none "
    "that was there throughout is shown twice or missed. A document whose delete job has "
    "succeeded is not listed; across all pages, the count is the index's `documents`. "
    f"Each text as its first {DOCUMENT_PREVIEW_CHARS} characters and its length, never "
    "the vector. Metadata is shown whole, so a page also ends before the document that "
    f"would take it past {MAX_LIST_READ_BYTES // 2**20} MiB of JSON (its first is shown "
    "however large). An index the caller does not have is the 404 `GET /v1/indexes/{index}` "
    "answers, whether another tenant uses the name or nobody does.",
)
async def list_documents(
    request: Request,
    tenant: Tenant,
    index: IndexPath,
    page_size: PageSize = DEFAULT_PAGE_SIZE,
    page_token: Annotated[
        str | None,
        Query(
            max_length=_MAX_CURSOR_CHARS,
            description="The previous page's `next_page_token`; leave it out for the first.",
        ),
    ] = None,
) -> DocumentsPage:
    after = decode_document_cursor(page_token, tenant, index)
    body = json.dumps({"after": after, "limit": page_size})
    found = await _read_index(request, "documents", tenant, index, body)
    docs = [ListedDocumentOut.model_validate(d) for d in found["documents"]]
    token = encode_document_cursor(tenant, index, docs[-1].id) if found["more"] else None
    return DocumentsPage(documents=docs, next_page_token=token)


@router.get(
    "/indexes/{index}/documents/{id:doc_id}",
    response_model=StoredDocumentOut,
    responses=READ_ERRORS,
    summary="One of the caller's documents as stored (no vector)",
    description="A document the index lacks is the 404 `not_found` naming `id`; an index "
    "the caller does not have is the 404 `GET /v1/indexes/{index}` answers, whether another "
    "tenant uses the name or nobody does.",
)
async def get_document(
    request: Request, tenant: Tenant, index: IndexPath, doc_id: DocIdPath
) -> StoredDocumentOut:
    found = await _read(request, "document", tenant, index, doc_id)
    if found is None:
        raise ApiError(
            404, "not_found", f"id: no document {doc_id!r} in index {index!r}", field="id"
        )
    return StoredDocumentOut.model_validate(found)


@router.delete(
    "/indexes/{index}/documents/{id:doc_id}",
    response_model=IngestJobOut,
    status_code=202,
    responses=JOB_RESPONSES,
    summary="Delete one of the caller's documents (a job; poll GET /v1/ingestions/{id})",
    description="Once the job has succeeded no search, batch item or trace returns the "
    "document from either channel. `deleted` counts the caller's documents that existed "
    "(0 for one nobody has, or another tenant's). Ordered with upserts of the same id: the "
    "write accepted last wins, whichever worker runs first.",
)
async def delete_document(
    request: Request,
    tenant: Tenant,
    index: IndexPath,
    doc_id: DocIdPath,
    wait: Wait = 0.0,
    idempotency_key: IdemKey = None,
) -> Response:
    return await _delete_job(request, tenant, index, [doc_id], wait, idempotency_key)


@router.post(
    "/indexes/{index}/documents/delete",
    response_model=IngestJobOut,
    status_code=202,
    responses=JOB_RESPONSES,
    summary="Delete the caller's documents by id (a job; poll GET /v1/ingestions/{id})",
)
async def delete_documents(
    request: Request,
    body: DeleteDocumentsRequest,
    tenant: Tenant,
    index: IndexPath,
    wait: Wait = 0.0,
    idempotency_key: IdemKey = None,
) -> Response:
    return await _delete_job(request, tenant, index, body.ids, wait, idempotency_key)


@router.delete(
    "/indexes/{index}",
    response_model=IngestJobOut,
    status_code=202,
    responses=JOB_RESPONSES,
    summary="Delete the caller's index: all of its documents (a job)",
    description="Embedded backend: the caller's rows, BM25 postings and vectors. "
    "Elasticsearch: the caller's own ES index and any a reindex kept (other tenants' "
    "indexes of the same name stay; an index that also holds another tenant's documents "
    "loses only the caller's). A delete job that fails part-way (Elasticsearch down) is "
    "retried; each run deletes what it finds, so one that succeeds leaves nothing. An "
    "upsert accepted before the delete and run after it writes nothing on both: on "
    "Elasticsearch one that ran into the delete's window has its documents deleted again "
    "by id (each retry of its job repeats that) and reports 0 written; if that take-back "
    "never succeeds, the upsert's job fails rather than succeeds. On Elasticsearch an "
    "upsert accepted after the delete but run before it goes with the index, though its "
    "job reported it written.",
)
async def delete_index(
    request: Request,
    tenant: Tenant,
    index: IndexPath,
    wait: Wait = 0.0,
    idempotency_key: IdemKey = None,
) -> Response:
    return await _delete_job(request, tenant, index, None, wait, idempotency_key)
