"""Sift's one exception tree; every adapter translates library errors into it.

    SiftError                      (retryable: bool)
    ├── InvalidRequest             bad input, names the field          permanent
    ├── ConfigError                bad settings, names the variable    permanent
    ├── ModeUnavailable            the index cannot serve the mode      permanent
    ├── IndexNotFound              no such index for this tenant        permanent
    ├── EmbeddingModelMismatch     the index's vectors are another      permanent
    │                              embedding model's than the worker's
    ├── IndexLimitReached          a new index past the tenant's cap    permanent
    ├── TenantRemoved              the job's tenant has no key here     permanent
    ├── BackendError
    │   ├── BackendUnavailable     connection, timeout, 5xx             retryable
    │   └── BackendRequestError    4xx, bad mapping, missing index      permanent
    │       └── BackendAccessRefused   Sift's credentials refused (401/403):  permanent
    │                              ``config_error``, the deployment's to fix
    ├── RerankAttemptError         one model call failed, with its class (retryable unless
    │                              http_4xx, budget_exhausted or refused)
    ├── RerankFailed               the rerank failed for good (fail_closed), names the class
    └── DeadlineExceeded           the search's deadline ran out        permanent

    Canceled                       not a failure: a batch item stopped before its model call

Adapters raise these with ``raise ... from exc`` so the cause stays visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from worker.constants import ERROR_TENANT_REMOVED

if TYPE_CHECKING:
    from worker.contract import Usage


class AttemptOutcome(StrEnum):
    """The class of one rerank attempt; exactly one per attempt (DESIGN.md §4)."""

    OK = "ok"
    TIMEOUT = "timeout"  # the provider's 408 (its request timeout) included
    HTTP_5XX = "http_5xx"  # 529 overloaded, 409 and a 4xx sent ``x-should-retry: true`` included
    RATE_LIMITED = "rate_limited"  # 429
    CONNECTION = "connection"
    HTTP_4XX = "http_4xx"  # permanent (any other 4xx, or ``x-should-retry: false``), never retried
    MALFORMED = "malformed"  # the response failed schema validation
    REFUSED = "refused"  # the model refused (stop_reason "refusal"): billed, never retried
    BUDGET_EXHAUSTED = "budget_exhausted"  # not sent: the rate budget frees it past the deadline


# Classes no retry can change: a permanent 4xx; a call the rate budget cannot admit in time;
# a refusal, which the provider repeats for the same prompt.
_FINAL_OUTCOMES = frozenset(
    (AttemptOutcome.HTTP_4XX, AttemptOutcome.BUDGET_EXHAUSTED, AttemptOutcome.REFUSED)
)


class SiftError(Exception):
    """The root of Sift's errors."""

    retryable: bool = False
    code: str = "error"
    # what the search's model calls used (and cost) before it failed: the job's error shows
    # it as ``usage`` (not named so here: an attempt's error carries its own TokenUsage)
    job_usage: Usage | None = None
    # the search's trace up to the failure, when it asked for one (``include_trace``): the
    # job's error shows it as ``trace``
    job_trace: dict[str, Any] | None = None
    # each stage's seconds up to the failure, asked for or not: its batch's ``stage_seconds``
    # counts a failed item's time as its ``usage`` counts its billed calls (None: none kept)
    job_seconds: dict[str, float] | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def validation_message(msg: object) -> str:
    """A pydantic error's message as Sift says it: without the ``Value error, `` that pydantic
    puts before a validator's own ``ValueError`` text.

    >>> validation_message("Value error, must be at least 1")
    'must be at least 1'
    >>> validation_message("Input should be a valid integer")
    'Input should be a valid integer'
    """
    return str(msg).removeprefix("Value error, ")


class InvalidRequest(SiftError):
    code = "invalid_request"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.problem = message  # without the field's name, as a 422 lists it under fields


class ConfigError(SiftError):
    code = "config_error"


class ModeUnavailable(SiftError):
    code = "mode_unavailable"


class IndexNotFound(SiftError):
    """The tenant has no such index. Built from the name alone, so every path that raises it
    (no document of the tenant, or no index at all on the backend) says the same words: an
    index only another tenant uses must not be told apart from one nobody has."""

    code = "index_not_found"

    def __init__(self, index: str) -> None:
        super().__init__(f"index {index!r} does not exist: ingest documents into it first")
        self.index = index


class EmbeddingModelMismatch(SiftError):
    """The tenant's index holds vectors of another embedding model than this worker's.

    Vectors of two models live in unrelated spaces: a query of one scored against
    documents of the other ranks by noise, with no error anywhere. So a write never mixes
    them into one index, and a kNN search never compares across them; both fail with this,
    naming the two models and the way out."""

    code = "embedding_model_mismatch"

    def __init__(self, index: str, held: str, model: str) -> None:
        super().__init__(
            f"index {index!r} holds vectors of embedding model {held!r}, but this worker "
            f"embeds with {model!r}: ingest into a new index, or drop this one "
            f"(DELETE /v1/indexes/{index}) and ingest it again (or run workers with {held!r})"
        )
        self.index = index
        self.held = held
        self.model = model


class IndexLimitReached(SiftError):
    """A write would make one index more than the tenant may hold
    (``SIFT_MAX_INDEXES_PER_TENANT``): each costs the backend a table or a shard, so one
    tenant could otherwise use up what every tenant shares. It names only the caller's own
    figures, and the way out."""

    code = "index_limit_reached"

    def __init__(self, index: str, held: int, limit: int, unlisted: Sequence[str] = ()) -> None:
        empty = ""
        if unlisted:  # Elasticsearch's empty indexes, which count but are not listed
            names = ", ".join(repr(name) for name in unlisted[:10])
            more = f" and {len(unlisted) - 10} more" if len(unlisted) > 10 else ""
            empty = (
                f" ({len(unlisted)} of them hold no document, so are not listed: "
                f"{names}{more}; a delete by id into a new name made them)"
            )
        super().__init__(
            f"index {index!r} cannot be made: this tenant holds {held} indexes{empty}, the "
            f"most SIFT_MAX_INDEXES_PER_TENANT ({limit}) allows; drop one (DELETE "
            "/v1/indexes/NAME) or ask the operator to raise the setting"
        )
        self.index = index
        self.held = held
        self.limit = limit
        self.unlisted = list(unlisted)


class TenantRemoved(SiftError):
    """The job's tenant has no key among the worker's (``SIFT_API_KEYS`` /
    ``SIFT_API_KEYS_FILE``, as read at its start): the operator removed it after the job was
    queued. Raised where the job would start, so none of it runs (no retrieval, no embedding,
    no model call) and nothing is billed for a tenant that no longer exists."""

    code = ERROR_TENANT_REMOVED

    def __init__(self, tenant: str) -> None:
        super().__init__(
            f"tenant {tenant!r} has no API key on this worker (removed from SIFT_API_KEYS / "
            "SIFT_API_KEYS_FILE): the job was not run"
        )
        self.tenant = tenant


class BackendError(SiftError):
    code = "backend_error"


class BackendUnavailable(BackendError):
    code = "backend_unavailable"
    retryable = True


class BackendRequestError(BackendError):
    code = "backend_request_error"


class BackendAccessRefused(BackendRequestError):
    """The backend refused Sift's own credentials or their rights (Elasticsearch's 401 or
    403): the deployment's setting is wrong, not the tenant's request, so a job says
    ``config_error``. Still a :class:`BackendError`: what waits out a backend's failure (an
    economy poll reading its candidates) waits for the operator's fix too."""

    code = "config_error"


class RerankAttemptError(SiftError):
    """One model call failed. ``outcome`` is its class; ``retry_after`` comes from the provider.
    ``sent`` is False for an attempt the provider never saw: one this process held back (its
    in-flight limit full, or a 429's pause, past the attempt's time, or no time left at all),
    or one whose connection was never made (the host's lookup failed or timed out, the
    connection was refused or timed out, the SDK found no credentials)."""

    code = "rerank_attempt_failed"
    # the Message Batches call that failed (``create``, ``retrieve``, ``results``, ``list``,
    # ``cancel``; set by that adapter), None for a Messages call: a status error reading a
    # provider batch says nothing for good of the batch, which the provider runs on
    call: str | None = None
    # the provider's HTTP status (set by the adapter), None for no answer: a delete refused
    # for its key (401, 403) is not asked again, where one refused for the batch's state is;
    # a 409 or a 4xx it says to retry is counted ``http_5xx`` with its 5xx, yet no sign of
    # an outage
    status: int | None = None

    def __init__(
        self,
        outcome: AttemptOutcome,
        message: str,
        retry_after: float | None = None,
        *,
        sent: bool = True,
    ) -> None:
        super().__init__(f"{outcome.value}: {message}")
        self.outcome = outcome
        self.retry_after = retry_after
        self.sent = sent
        self.retryable = outcome not in _FINAL_OUTCOMES


class RerankFailed(SiftError):
    """The rerank failed for good under ``fail_closed``; ``reason`` names the class."""

    code = "rerank_failed"

    def __init__(
        self,
        reason: str,
        message: str,
        usage: Usage | None = None,
        trace: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"rerank failed ({reason}): {message}")
        self.reason = reason
        self.job_usage = usage
        self.job_trace = trace


class DeadlineExceeded(SiftError):
    code = "deadline_exceeded"


class Canceled(Exception):
    """A batch item stopped before its model call because its batch was canceled (the
    hook passed to :meth:`worker.core.pipeline.SearchPipeline.search` raises it); the job
    store holds the item as ``canceled`` already. Not a :class:`SiftError`: nothing failed,
    and no job ever shows it as an error."""


class HandedBack(Exception):
    """A batch item stopped before its model call because its worker is stopping (a
    SIGTERM: a scale-down, a rolling restart): it was waiting for the rate budget (its
    pacing, its reservation, given back) or had not sent its call yet, or its calls so far
    read no token (refused: a 429, a 529; or timed out unanswered) and it waited before the
    next. It goes back to its chunk as handed back, for another worker, as an item not
    started does; no usage was read (those calls are kept with its claim, for the run that
    takes it on to show). Not a :class:`SiftError`: nothing failed."""


class RunTakenOver(Exception):
    """A run of a search or a batch item whose claim another run took over while it waited
    for its CPU slot (past its lease): it stops there, before its retrieval and its model
    call, and writes nothing; the run holding the claim finishes the job
    (:meth:`worker.queue.jobstore.ClaimAnswers.slot_held`). Not a :class:`SiftError`: nothing
    failed, and no job ever shows it."""
