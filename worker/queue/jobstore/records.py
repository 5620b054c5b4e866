"""What the job store hands out: the search, ingest and batch records, a batch's items and
their outcomes, and the small helpers the record kinds share (ids, times, the webhook
message).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from worker import clock
from worker.contract import ErrorInfo, JobStatus, SearchResult, SearchSpec, Usage

# Given a new job's id, the broker messages to write with its record: (list key, raw message).
Enqueue = Callable[[str], Sequence[tuple[str, str]]]

# what an ingest-kind job writes: documents, deletes by id, or the tenant's whole index
WriteOperation = Literal["upsert", "delete", "drop"]
WRITE_OPERATIONS: tuple[WriteOperation, ...] = ("upsert", "delete", "drop")


def write_operation(value: str | None) -> WriteOperation:
    """A stored operation field (none: an upsert written before deletes existed)."""
    for operation in WRITE_OPERATIONS:
        if value == operation:
            return operation
    return "upsert"


WebhookStatus = Literal["pending", "retrying", "delivered", "failed"]
# what a settled webhook's record says it ended as (_WEBHOOK_SETTLED writes one of these)
WEBHOOK_ENDS: tuple[WebhookStatus, ...] = ("delivered", "failed")


@dataclass(frozen=True, slots=True)
class WebhookState:
    """Where a job's webhook stands: ``attempts`` made so far, and ``status``: ``pending``
    (none made yet, or the first in flight), ``retrying`` (a retry is due), ``delivered``
    (a 2xx, from any copy: final), ``failed`` (refused, or its schedule spent; a copy sent
    before the give-up may still turn it ``delivered``). ``attempts`` never goes down."""

    status: WebhookStatus
    attempts: int


def webhook_state(raw: dict[str, str], *, owed: bool) -> WebhookState | None:
    """The webhook state a job's record fields say, ``owed`` whether ``sift:webhooks-owed``
    holds the job; None without a webhook, or when how it stands is not known: one an older
    Sift settled without saying how it ended, or that of a final job a release before
    86d62aa ended, which wrote no webhook field at all. Today's final move records the
    webhook owed in the script that makes the job final, and it stays owed until the script
    that settles it writes how it ended, so a final job with neither a field nor that entry
    had its webhook sent (or given up) by an older worker: ``pending, 0 attempts`` forever,
    as it read before, said that it never was.

    >>> webhook_state({}, owed=False)
    >>> webhook_state({"webhook_url": "https://h.example/x"}, owed=False)
    WebhookState(status='pending', attempts=0)
    >>> webhook_state({"webhook_url": "https://h.example/x", "finished_at": "1.0"}, owed=True)
    WebhookState(status='pending', attempts=0)
    >>> webhook_state({"webhook_url": "https://h.example/x", "finished_at": "1.0"}, owed=False)
    >>> webhook_state({"webhook_url": "https://h.example/x", "webhook_attempt": "3"}, owed=True)
    WebhookState(status='retrying', attempts=2)
    >>> webhook_state({"webhook_url": "https://h.example/x", "webhook_attempt": "3",
    ...                "webhook_settled": "delivered", "webhook_attempts": "3"}, owed=False)
    WebhookState(status='delivered', attempts=3)
    >>> webhook_state({"webhook_url": "https://h.example/x", "webhook_settled": "1"}, owed=False)
    """
    if not raw.get("webhook_url"):
        return None
    settled = raw.get("webhook_settled")
    if settled is not None:
        for end in WEBHOOK_ENDS:
            if settled == end:
                return WebhookState(end, int(raw.get("webhook_attempts") or 0))
        return None
    retry = raw.get("webhook_attempt")  # the attempt a recorded retry makes next
    if retry:
        return WebhookState("retrying", int(retry) - 1)
    if raw.get("finished_at") and not owed:
        return None
    return WebhookState("pending", 0)


FINAL = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELED)
_STATUSES = tuple(JobStatus)


def _now() -> float:
    """A record's time (created, started, finished, erased...) on the shared clock: the
    gateway that creates a job and the workers that start and end it may be on hosts whose
    own clocks are minutes apart (a job started before it was created, a listing out of
    order across gateways)."""
    return clock.now()


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _opt_float(value: str | None) -> float | None:
    return float(value) if value else None


def _in_flight(stats: dict[str, str]) -> dict[str, int]:
    return {s: max(0, int(stats.get(s, 0))) for s in ("queued", "running")}


@dataclass(slots=True)
class SearchJob:
    """One search job as the store holds it."""

    id: str
    tenant: str
    status: JobStatus
    spec: SearchSpec
    created_at: float
    webhook_url: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    result: SearchResult | None = None
    error: ErrorInfo | None = None
    webhook: WebhookState | None = None  # None: no webhook_url, or an older Sift settled it
    # (how is not known: webhook_state)


@dataclass(slots=True)
class IngestJob:
    """One ingest job: documents upserted into one index for one tenant."""

    id: str
    tenant: str
    index: str
    status: JobStatus
    documents: int
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    upserted: int | None = None
    error: ErrorInfo | None = None
    # the index lifecycle: "upsert" (documents), "delete" (ids) or "drop" (the tenant's
    # index), and the write version the gateway gave it when it accepted it
    operation: WriteOperation = "upsert"
    version: int | None = None
    deleted: int | None = None


@dataclass(slots=True)
class BatchJob:
    """One batch: its settings and the live counts of its items by status."""

    id: str
    tenant: str
    index: str
    lane: str
    total: int
    created_at: float
    counts: dict[str, int] = field(default_factory=dict)
    rerank: bool | None = None
    webhook_url: str | None = None
    canceled_at: float | None = None
    finished_at: float | None = None
    # the sum of its final items' usage (a result's, a failure's, a canceled item's billed
    # rounds), its succeeded items' rerank outcomes ("applied", "fallback", "skipped") and
    # the seconds by stage of those and of its rerank_failed items; None: unknown (a batch
    # an older release made, whose items it finished were never added:
    # jobstore/batches.py's TOTALS_MARKER)
    usage: Usage | None = field(default_factory=Usage)
    rerank_outcomes: dict[str, int] | None = field(default_factory=dict)
    stage_seconds: dict[str, float] | None = field(default_factory=dict)
    # its failed items by their error's type, and its rerank_failed ones by their class
    # (ErrorInfo.reason): only the kinds that occurred; None: unknown, as usage, or made by
    # a release that kept its totals but not these (jobstore/batches.py's FAILURES_MARKER)
    failures: dict[str, int] | None = field(default_factory=dict)
    rerank_failures: dict[str, int] | None = field(default_factory=dict)
    webhook: WebhookState | None = None  # None: no webhook_url, or an older Sift settled it
    # (how is not known: webhook_state)

    @property
    def status(self) -> JobStatus:
        """Once every item is final: ``canceled`` if a cancel canceled at least one item,
        else ``succeeded`` (a cancel that came when every item was past its model call
        changed nothing, so it does not show). ``canceled_at`` says when a cancel came."""
        if self.finished_at is not None:
            if self.counts.get(JobStatus.CANCELED.value, 0) > 0:
                return JobStatus.CANCELED
            return JobStatus.SUCCEEDED
        if self.counts.get("queued", 0) == self.total and self.canceled_at is None:
            return JobStatus.QUEUED
        return JobStatus.RUNNING


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One batch item with the spec it was submitted with."""

    query_id: str
    status: JobStatus
    spec: SearchSpec | None


@dataclass(frozen=True, slots=True)
class ItemOutcome:
    """One line of a batch's results; ``payload`` is the stored ``{"result"}`` or ``{"error"}``."""

    query_id: str
    status: JobStatus
    payload: str | None = None

    def to_json(self) -> str:
        """``{"query_id","status","result"?,"error"?}`` without re-parsing the stored payload."""
        head = '{"query_id":' + json.dumps(self.query_id) + ',"status":"' + self.status.value + '"'
        if self.payload and len(self.payload) > 2:
            return head + "," + self.payload[1:]
        return head + "}"


@dataclass(frozen=True, slots=True)
class ItemTransition:
    """What one item move did. ``canceled``: the batch had been canceled, so the move (a
    start, or the check before the model call) canceled the item instead."""

    applied: bool
    batch_completed: bool = False
    canceled: bool = False

    @property
    def started(self) -> bool:
        """A start that applied and was not turned into a cancel: run the item."""
        return self.applied and not self.canceled


class CancelOutcome(StrEnum):
    """Why :meth:`JobStore.cancel_batch` changed nothing."""

    MISSING = "missing"
    ALREADY_FINISHED = "already_finished"


_BATCH_COUNTS = ("queued", "running", "succeeded", "failed", "canceled")
_RERANK_OUTCOMES = ("applied", "fallback", "skipped")


def webhook_figures(job: BatchJob | SearchJob) -> dict[str, Any]:
    """A finished job's final figures for its webhook body, as its ``GET`` shows them: a
    batch's ``status``, ``counts``, ``usage`` (``cost_usd`` in it), ``rerank_outcomes``,
    ``failures`` and ``rerank_failures`` (each ``None`` when unknown: a batch an older
    release made); a search's ``status``, ``usage`` (its result's, or its failure's billed
    attempts'; ``None`` when it made no model call before failing) and ``error`` (its type,
    and a ``rerank_failed`` one's ``reason``, its class) or ``None``. Never a search's hits
    nor a batch's results: the body stays small, the result is at the job's URL.
    """
    if isinstance(job, BatchJob):
        counts = {"total": job.total} | {name: job.counts.get(name, 0) for name in _BATCH_COUNTS}
        return {
            "status": job.status.value,
            "counts": counts,
            "usage": None if job.usage is None else job.usage.model_dump(),
            "rerank_outcomes": None
            if job.rerank_outcomes is None
            else {name: job.rerank_outcomes.get(name, 0) for name in _RERANK_OUTCOMES},
            "failures": job.failures,
            "rerank_failures": job.rerank_failures,
        }
    usage = job.result.usage if job.result is not None else job.error and job.error.usage
    return {
        "status": job.status.value,
        "usage": None if usage is None else usage.model_dump(),
        "error": None if job.error is None else job.error.model_dump(include={"type", "reason"}),
    }


def webhook_event(
    event_type: str,
    job_id: str,
    tenant: str,
    url: str,
    status: str,
    *,
    occurred_at: float | None = None,
) -> dict[str, Any]:
    """The message a ``sift.webhook`` task gets. ``webhook_id`` is stable across retries.
    ``occurred_at``: when the job finished (epoch seconds; default now)."""
    when = datetime.fromtimestamp(clock.now() if occurred_at is None else occurred_at, UTC)
    return {
        "webhook_id": f"msg_{job_id}",
        "type": event_type,
        "occurred_at": when.isoformat(),
        "tenant": tenant,
        "url": url,
        "data": {"id": job_id, "status": status},
    }
