"""The HTTP v1 request and response bodies (DESIGN.md §9); the OpenAPI document comes from them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from worker.constants import (
    MAX_BATCH_QUERIES,
    MAX_BATCH_QUERY_ID_CHARS,
    MAX_DOCUMENTS_PER_REQUEST,
    MAX_WEBHOOK_URL_CHARS,
)
from worker.contract import (
    CandidateLimit,
    DocumentRequest,
    ErrorInfo,
    Filters,
    Flag,
    FusionSpec,
    IndexName,
    JobStatus,
    Limit,
    Mode,
    SearchedText,
    SearchResult,
    SearchSpec,
    Usage,
    without_unset_overrides,
)

if TYPE_CHECKING:
    from worker.queue.jobstore import WebhookState


def iso(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, UTC).isoformat() if ts is not None else None


def webhook_out(state: WebhookState | None) -> WebhookOut | None:
    """A job record's webhook state as its ``GET`` shows it."""
    return None if state is None else WebhookOut(status=state.status, attempts=state.attempts)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


#: What an omitted ``rerank`` means, on both job routes
RERANK_DESCRIPTION = (
    "Rerank the fused candidates with the model. Left out (or null): this gateway's default, "
    "SIFT_RERANK_ENABLED, which it writes into the job, so the worker that runs it never "
    "decides by its own setting."
)


class SearchRequest(SearchSpec):
    """``POST /v1/searches``: the search, and where to send its webhook."""

    query: SearchedText
    rerank: Flag | None = Field(default=None, description=RERANK_DESCRIPTION)
    filters: Filters = Field(default_factory=dict)
    webhook_url: str | None = Field(default=None, min_length=1, max_length=MAX_WEBHOOK_URL_CHARS)


class WebhookOut(BaseModel):
    """Where the job's webhook stands (only a job created with ``webhook_url`` has one)."""

    status: Literal["pending", "retrying", "delivered", "failed"] = Field(
        description="`pending`: no attempt made yet (the job runs, or its first attempt is "
        "in flight); `retrying`: an attempt failed and the next one is due (the schedule "
        "runs up to 8 attempts over about 33 hours); `delivered`: the receiver answered 2xx; "
        "`failed`: it refused it (410 Gone, a redirect, an address the SSRF "
        "guard refused), or every attempt of the schedule failed. `delivered` is final; "
        "`failed` may still turn `delivered` when a copy sent before the give-up reaches the "
        "receiver."
    )
    attempts: int = Field(description="Attempts made so far (never goes down).")


class SearchJobOut(BaseModel):
    """A search job. ``result`` is there once it succeeded, ``error`` once it failed (in a
    ``202``, ``status`` is the last one the gateway read, and may be final with neither when
    Redis went away before it read them: ``GET`` the ``Location``)."""

    id: str
    status: JobStatus
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    result: SearchResult | None = None
    error: ErrorInfo | None = None
    webhook: WebhookOut | None = Field(
        default=None,
        description="Its webhook's delivery; null when it has no webhook_url, or when an "
        "earlier release settled it without recording how (outcome unknown).",
    )


class ErasedOut(BaseModel):
    """A search or batch erased by ``DELETE /v1/searches/{id}`` or ``DELETE
    /v1/batches/{id}/results``: every stored copy of it is gone, and it answers ``410 erased``
    from then on. Erasing it again answers the same, ``erased_at`` the first erasure's."""

    id: str
    kind: Literal["search", "batch"]
    erased_at: str = Field(description="When it was erased (ISO 8601, UTC).")


class BatchQueryIn(_Strict):
    id: str = Field(min_length=1, max_length=MAX_BATCH_QUERY_ID_CHARS)
    query: SearchedText
    limit: Limit | None = None
    mode: Mode | None = None
    filters: Filters = Field(default_factory=dict)


class BatchRequest(_Strict):
    """``POST /v1/batches``. ``lane="economy"`` reranks through the Message Batches API at
    half the token price; the batch completes when the provider's batches end."""

    index: IndexName
    queries: list[BatchQueryIn] = Field(min_length=1, max_length=MAX_BATCH_QUERIES)
    rerank: Flag | None = Field(default=None, description=RERANK_DESCRIPTION)
    include_trace: Flag = False
    webhook_url: str | None = Field(default=None, min_length=1, max_length=MAX_WEBHOOK_URL_CHARS)
    lane: Literal["standard", "economy"] = "standard"
    fusion: FusionSpec | None = Field(
        default=None,
        description="The fusion (method, weights, rank constant) for every query, over the "
        "index's and defaults.",
    )
    candidate_limit: CandidateLimit | None = Field(
        default=None, description="The rerank candidate window for every query."
    )

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return without_unset_overrides(handler(self))


class BatchCounts(BaseModel):
    total: int
    queued: int
    running: int
    succeeded: int
    failed: int
    canceled: int


class BatchRerankOutcomes(BaseModel):
    """How the batch's succeeded items were ranked: by the model (``applied``), in the fused
    order after a rerank that gave no usable ranks or erred (``fallback``), or not reranked
    (``skipped``: none asked, or no candidates to rank; only the second is the ``skipped`` of
    ``sift_rerank_outcomes_total``). An item whose rerank failed it is in ``counts.failed``."""

    applied: int = 0
    fallback: int = 0
    skipped: int = 0


class BatchOut(BaseModel):
    """A batch: ``succeeded`` once every item is final (items keep their own status).

    ``usage`` is the sum of its final items' usage: each result's, each failure's (attempts
    billed before it failed), each canceled item's billed rounds; ``cost_usd`` at the lane's
    price (the economy lane's is the Message Batches discount, half), ``null`` when any item
    called a model with no price. It grows as items finish. ``failures`` counts its failed
    items by error type, ``rerank_failures`` its ``rerank_failed`` ones by class: why they
    failed, without reading its results. ``usage``, ``rerank_outcomes``, ``stage_seconds``,
    ``failures`` and ``rerank_failures`` are ``null`` (unknown) for a batch an older Sift
    made, which did not add up its items as they finished: never a zero that looks known."""

    id: str
    status: JobStatus
    index: str
    lane: Literal["standard", "economy"]
    counts: BatchCounts
    usage: Usage | None = Field(
        default_factory=Usage,
        description="Its final items' usage summed; null when unknown (a batch an older Sift "
        "made: the items it finished were never added up).",
    )
    rerank_outcomes: BatchRerankOutcomes | None = Field(
        default_factory=BatchRerankOutcomes,
        description="Its succeeded items by how they were ranked; null when unknown, as usage.",
    )
    stage_seconds: dict[str, float] | None = Field(
        default_factory=dict,
        description="Seconds by stage, in the order they run (queue_wait, slot_wait: the wait "
        "for a CPU slot, embed, bm25, knn, fuse, rerank; or rrf in place of bm25, knn and fuse "
        "where Elasticsearch fuses natively), summed over its finished items, as usage is: "
        "its succeeded items and those that failed their rerank (rerank_failed, up to the "
        "failure); an item that failed before its rerank, or was canceled, kept none. Where "
        "its time went. An economy item's rerank is its provider batch's wait. null when "
        "unknown, as usage.",
    )
    failures: dict[str, int] | None = Field(
        default_factory=dict,
        description="Its failed items by their error's type (rerank_failed, "
        "deadline_exceeded, index_not_found, tenant_removed, ...): only the types some item "
        "failed with, their sum counts.failed. It grows as items finish. null when unknown: "
        "a batch an older Sift made, which did not count its failed items by kind.",
    )
    rerank_failures: dict[str, int] | None = Field(
        default_factory=dict,
        description="Its rerank_failed items by their error's reason, the rerank's failure "
        "class (timeout, http_5xx, rate_limited, connection, http_4xx, malformed, refused, "
        "budget_exhausted, deadline, no_generation_model): only the classes some item failed "
        "with, their sum failures.rerank_failed. null when unknown, as failures.",
    )
    created_at: str
    finished_at: str | None = None
    canceled_at: str | None = None
    webhook: WebhookOut | None = Field(
        default=None,
        description="Its webhook's delivery; null when it has no webhook_url, or when an "
        "earlier release settled it without recording how (outcome unknown).",
    )


class BatchResultItem(BaseModel):
    """``usage`` only on a ``canceled`` item whose model calls were billed before the cancel
    (an economy item resubmitted, then canceled; an item whose killed worker's run had its
    model answer, for candidates an ingest then changed): a finished item's is in its result
    or error."""

    query_id: str
    status: JobStatus
    result: SearchResult | None = None
    error: ErrorInfo | None = None
    usage: Usage | None = None


class BatchResultsPage(BaseModel):
    """One page of results, in submission order; every item appears exactly once over all pages."""

    results: list[BatchResultItem]
    next_page_token: str | None


class DocumentsRequest(_Strict):
    """``POST /v1/indexes/{index}/documents``."""

    documents: list[DocumentRequest] = Field(min_length=1, max_length=MAX_DOCUMENTS_PER_REQUEST)


class IngestJobOut(BaseModel):
    """An ingest job; ``upserted`` once it succeeded (a delete job: ``deleted``)."""

    id: str
    status: JobStatus
    index: str
    documents: int
    created_at: str
    started_at: str | None = Field(
        None,
        description="When a worker started it (the last start, if it was run again): its queue "
        "wait is from `created_at`, its run (embedding and writing) to `finished_at`.",
    )
    finished_at: str | None = None
    upserted: int | None = None
    error: ErrorInfo | None = None
    operation: Literal["upsert", "delete", "drop"] = Field(
        "upsert",
        description="`delete`: documents by id (`documents` ids); `drop`: the caller's index.",
    )
    deleted: int | None = Field(
        None, description="A delete job, once it succeeded: the caller's documents that went."
    )


class Health(BaseModel):
    """``/healthz``'s and ``/readyz``'s 200 (a 503 is an ``ErrorBody``)."""

    status: Literal["ok"]
