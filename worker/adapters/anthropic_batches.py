"""The Anthropic Message Batches API for the economy lane: create, retrieve, results, cancel.

Usage::

    batches = AnthropicMessageBatches(AnthropicReranker("claude-haiku-4-5"))
    batch = batches.create([{"custom_id": "i0", "params": batches.request_params(prompt)}])
    batches.retrieve(batch.id).ended                 # poll until True
    for line in batches.results(batch.id): ...       # JSONL, streamed, in no particular order
    batches.cancel(batch.id)

Each request's ``params`` are exactly the standard lane's ``messages.create`` arguments
(:meth:`AnthropicReranker.request_params`), and a succeeded result is parsed by the same
:func:`~worker.adapters.anthropic.parse_reply`. The shapes are the installed SDK's own
(``anthropic.types.messages``: ``MessageBatch``, ``MessageBatchIndividualResponse``).

A failed API call is a :class:`~worker.errors.RerankAttemptError` with its class, raised
``from`` the SDK's exception: retryable unless ``http_4xx``, so the task layer retries it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anthropic

from worker.adapters.anthropic import (
    AnthropicReranker,
    RerankMalformedError,
    _describe,
    _status_error,
    parse_reply,
)
from worker.core.types import RerankPrompt, RerankReply
from worker.errors import AttemptOutcome, RerankAttemptError

if TYPE_CHECKING:
    from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse

log = logging.getLogger(__name__)

__all__ = ["AnthropicMessageBatches", "BatchLine", "ProviderBatch", "errored_outcome"]

T = TypeVar("T")
CALL_TIMEOUT_SECONDS = 60.0  # create, retrieve, cancel
RESULTS_TIMEOUT_SECONDS = 300.0  # streaming a results file

# An errored request's error type -> the attempt class (DESIGN.md §4): what the same error
# would be, answered as an HTTP status to a standard-lane call.
_ERRORED: dict[str, AttemptOutcome] = {
    "rate_limit_error": AttemptOutcome.RATE_LIMITED,
    "api_error": AttemptOutcome.HTTP_5XX,
    "overloaded_error": AttemptOutcome.HTTP_5XX,
    "timeout_error": AttemptOutcome.HTTP_5XX,
}


def errored_outcome(error_type: str | None) -> AttemptOutcome:
    """The class of an ``errored`` result; unknown and request errors are permanent."""
    return _ERRORED.get(error_type or "", AttemptOutcome.HTTP_4XX)


@dataclass(frozen=True, slots=True)
class ProviderBatch:
    """A Message Batch as Sift needs it: its id, its processing status and its counts."""

    id: str
    processing_status: str  # in_progress | canceling | ended
    request_counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        return self.processing_status == "ended"


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One line of a results file. ``kind`` is the provider's result type.

    ``succeeded``: ``reply`` is set, or ``error`` is a ``malformed`` RerankMalformedError (the
    answer failed the schema; its usage is on the error). ``errored``: ``error`` has the class.
    ``expired`` and ``canceled``: neither.
    """

    custom_id: str
    kind: Literal["succeeded", "errored", "expired", "canceled"]
    reply: RerankReply | None = None
    error: RerankAttemptError | None = None


class AnthropicMessageBatches:
    """The Message Batches endpoints over the reranker's SDK client (retries off)."""

    def __init__(self, reranker: AnthropicReranker) -> None:
        self.reranker = reranker
        self.model = reranker.model

    def request_params(self, prompt: RerankPrompt) -> dict[str, Any]:
        """One request's ``params``: exactly the standard lane's ``messages.create`` arguments."""
        return self.reranker.request_params(prompt)

    def create(self, requests: Sequence[Mapping[str, Any]]) -> ProviderBatch:
        """Create one Message Batch of ``{"custom_id", "params"}`` requests."""
        batches = self.reranker.client.messages.batches
        batch = _call(
            lambda: batches.create(requests=requests, timeout=CALL_TIMEOUT_SECONDS),  # type: ignore[arg-type]
            "create",
        )
        return _provider_batch(batch)

    def retrieve(self, batch_id: str) -> ProviderBatch:
        batches = self.reranker.client.messages.batches
        return _provider_batch(
            _call(lambda: batches.retrieve(batch_id, timeout=CALL_TIMEOUT_SECONDS), "retrieve")
        )

    def cancel(self, batch_id: str) -> ProviderBatch:
        """Ask the provider to cancel; the batch goes ``canceling``, then ``ended``."""
        batches = self.reranker.client.messages.batches
        return _provider_batch(
            _call(lambda: batches.cancel(batch_id, timeout=CALL_TIMEOUT_SECONDS), "cancel")
        )

    def results(self, batch_id: str) -> Iterator[BatchLine]:
        """Stream an ended batch's results file, line by line, in the provider's order."""
        batches = self.reranker.client.messages.batches
        decoder = _call(
            lambda: batches.results(batch_id, timeout=RESULTS_TIMEOUT_SECONDS), "results"
        )
        try:
            iterator = iter(decoder)
            while True:
                try:
                    response = next(iterator)
                except StopIteration:
                    return
                except (anthropic.AnthropicError, OSError, ValueError) as exc:
                    raise RerankAttemptError(
                        AttemptOutcome.CONNECTION, f"results of {batch_id} cut: {exc}"
                    ) from exc
                yield _line(response)
        finally:
            decoder.close()


def _line(response: MessageBatchIndividualResponse) -> BatchLine:
    result = response.result
    custom_id = response.custom_id
    if result.type == "succeeded":
        try:
            return BatchLine(custom_id, "succeeded", reply=parse_reply(result.message))
        except RerankMalformedError as error:
            return BatchLine(custom_id, "succeeded", error=error)
    if result.type == "errored":
        detail = result.error.error
        error_type = getattr(detail, "type", None)
        message = f"{error_type}: {getattr(detail, 'message', '')}"
        return BatchLine(
            custom_id,
            "errored",
            error=RerankAttemptError(errored_outcome(error_type), message),
        )
    if result.type == "expired":
        return BatchLine(custom_id, "expired")
    return BatchLine(custom_id, "canceled")


def _provider_batch(batch: MessageBatch) -> ProviderBatch:
    counts = batch.request_counts
    return ProviderBatch(
        id=batch.id,
        processing_status=batch.processing_status,
        request_counts={
            "processing": counts.processing,
            "succeeded": counts.succeeded,
            "errored": counts.errored,
            "canceled": counts.canceled,
            "expired": counts.expired,
        },
    )


def _call(fn: Callable[[], T], what: str) -> T:
    """One Message Batches API call, its failure translated into an attempt class."""
    try:
        return fn()
    except anthropic.APITimeoutError as exc:
        raise RerankAttemptError(AttemptOutcome.TIMEOUT, f"batches.{what}: no answer") from exc
    except anthropic.APIConnectionError as exc:
        raise RerankAttemptError(AttemptOutcome.CONNECTION, _describe(exc)) from exc
    except anthropic.APIStatusError as exc:
        raise _status_error(exc) from exc
    except anthropic.AnthropicError as exc:
        raise RerankAttemptError(AttemptOutcome.HTTP_4XX, _describe(exc)) from exc
