"""The Anthropic Message Batches API for the economy lane: create, retrieve, results, cancel,
delete.

Usage::

    batches = AnthropicMessageBatches(AnthropicReranker("claude-haiku-4-5"))
    batch = batches.create([{"custom_id": "i0", "params": batches.request_params(prompt)}])
    batches.retrieve(batch.id).ended                 # poll until True
    for line in batches.results(batch.id): ...       # JSONL, streamed, in no particular order
    batches.cancel(batch.id)
    batches.delete(batch.id)                         # once ended: its requests and results

Each request's ``params`` are exactly the standard lane's ``messages.create`` arguments
(:meth:`AnthropicReranker.request_params`), and a succeeded result is parsed by the same
:func:`~worker.adapters.anthropic.parse_reply`. The shapes are the installed SDK's own
(``anthropic.types.messages``: ``MessageBatch``, ``MessageBatchIndividualResponse``).

A failed API call is a :class:`~worker.errors.RerankAttemptError` with its class, raised
``from`` the SDK's exception: retryable unless ``http_4xx``, so the task layer retries it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from email.utils import parsedate_to_datetime
from typing import Any, Literal, TypeVar

import anthropic
from anthropic.types import Message
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse

from worker import clock
from worker.adapters.anthropic import (
    AnthropicReranker,
    RerankMalformedError,
    _describe,
    _status_error,
    check_positions,
    parse_reply,
)
from worker.core.types import RerankPrompt, RerankReply
from worker.errors import AttemptOutcome, RerankAttemptError

log = logging.getLogger(__name__)

__all__ = [
    "AnthropicMessageBatches",
    "BatchLine",
    "ProviderBatch",
    "encode_body",
    "errored_outcome",
    "parse_line",
]

T = TypeVar("T")
CALL_TIMEOUT_SECONDS = 60.0  # create, retrieve, cancel, delete
RESULTS_TIMEOUT_SECONDS = 300.0  # streaming a results file
LIST_PAGE = 100  # Message Batches listed a call (the API allows 1 to 1,000)
UPLOAD_PIECE_BYTES = 1 << 20  # a create's body goes out this much at a time (its guard between)

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
    created_at: float | None = None  # epoch seconds, on the provider's clock
    ended_at: float | None = None  # the same; set once ``processing_status`` is ended
    # the provider's clock minus the shared one (:mod:`worker.clock`), as the answer's
    # ``Date`` showed it (:func:`provider_offset`); None: not known
    offset: float | None = None

    @property
    def ended(self) -> bool:
        return self.processing_status == "ended"

    @property
    def shared_ended_at(self) -> float | None:
        """``ended_at`` on the shared clock: moved by :attr:`offset` when it is known.

        >>> ProviderBatch("b", "ended", ended_at=1300.0, offset=300.0).shared_ended_at
        1000.0
        """
        if self.ended_at is None or self.offset is None:
            return self.ended_at
        return self.ended_at - self.offset

    @property
    def requests(self) -> int:
        """How many requests it holds (its counts always add up to them)."""
        return sum(self.request_counts.values())


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One line of a results file. ``kind`` is the provider's result type, or ``malformed``.

    ``succeeded``: ``reply`` is set, or ``error`` is a ``malformed`` RerankMalformedError (the
    answer failed the schema; its usage is on the error). ``errored``: ``error`` has the class.
    ``expired`` and ``canceled``: neither. ``malformed``: the line itself did not parse;
    ``error`` is ``malformed`` (resubmitted like a malformed answer).
    """

    custom_id: str
    kind: Literal["succeeded", "errored", "expired", "canceled", "malformed"]
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

    @staticmethod
    def checked(line: BatchLine, prompt: RerankPrompt) -> BatchLine:
        """``line`` as the standard lane would read its answer to ``prompt``: a succeeded
        answer with more positions than the request's ``max_tokens`` lets a model write is
        ``malformed`` (:func:`~worker.adapters.anthropic.check_positions`), billed all the
        same. The results file does not say which request a line answered, so it is checked
        once the line is mapped to its item."""
        if line.reply is None:
            return line
        try:
            check_positions(line.reply, prompt.max_tokens)
        except RerankMalformedError as error:
            return BatchLine(line.custom_id, line.kind, error=error)
        return line

    def create(
        self, requests: Sequence[Mapping[str, Any]], before_write: Callable[[], None] | None = None
    ) -> ProviderBatch:
        """Create one Message Batch of ``{"custom_id", "params"}`` requests.

        The body (``batches.create``'s own, ``{"requests": [...]}``, with its length) goes out
        through the SDK's ``post`` a piece at a time, :data:`UPLOAD_PIECE_BYTES`, then its last
        byte alone, and ``before_write`` runs before each piece: raising, it stops the upload
        short of its end, so the provider, which never had the whole body, makes nothing.
        The API has no idempotency key: this is how a create whose run was taken over (the
        new run may send the same requests again) is kept from making its batch after all."""
        body = encode_body({"requests": list(requests)})

        def pieces() -> Iterator[bytes]:
            for start in range(0, len(body) - 1, UPLOAD_PIECE_BYTES):
                if before_write is not None:
                    before_write()
                yield body[start : min(start + UPLOAD_PIECE_BYTES, len(body) - 1)]
            if before_write is not None:
                before_write()
            yield body[-1:]

        client = self.reranker.client
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        # and the span ``batches.create`` names (the SDK's internal options): without a span
        # name the SDK starts none for a call and sends no trace context (``traceparent``)
        options: Any = {
            "headers": headers,
            "timeout": CALL_TIMEOUT_SECONDS,
            "span_name": "anthropic.messages.batches.create",
            "span_route": "/v1/messages/batches",
            "span_attributes": {"anthropic.message.batch.request_count": len(requests)},
            "span_created_id": "anthropic.message.batch.id",
        }
        batch = _call(
            lambda: client.post(
                "/v1/messages/batches", cast_to=MessageBatch, content=pieces(), options=options
            ),
            "create",
        )
        return _provider_batch(batch)

    def retrieve(self, batch_id: str) -> ProviderBatch:
        """The batch as it stands, with the provider's clock offset its answer's ``Date``
        shows (:attr:`ProviderBatch.offset`): its ``ended_at`` is on the provider's clock,
        and the user's cancel, on the shared one, is set against it
        (:attr:`ProviderBatch.shared_ended_at`)."""
        batches = self.reranker.client.messages.batches.with_raw_response
        raw = _call(lambda: batches.retrieve(batch_id, timeout=CALL_TIMEOUT_SECONDS), "retrieve")
        offset = provider_offset(raw.headers.get("date"), clock.now())
        return replace(_provider_batch(_call(raw.parse, "retrieve")), offset=offset)

    def created_between(self, start: float, end: float) -> list[ProviderBatch]:
        """The workspace's Message Batches created between ``start`` and ``end`` (epoch
        seconds on the shared clock, :mod:`worker.clock`), read newest first, a page at a
        time, until one is older than ``start``. The API has no idempotency key: this is how
        a create whose answer was lost is found.

        The provider stamps ``created_at`` on its own clock: the window is moved by that
        clock's offset from the shared one, read from the ``Date`` of the first page's
        answer (:func:`provider_window`). A provider 5 minutes off had its batch looked for
        5 minutes away from when it was made, not found, and its requests sent again."""
        batches = self.reranker.client.messages.batches.with_raw_response
        raw = _call(lambda: batches.list(limit=LIST_PAGE, timeout=CALL_TIMEOUT_SECONDS), "list")
        start, end = provider_window(start, end, raw.headers.get("date"), clock.now())
        page = _call(raw.parse, "list")
        found: list[ProviderBatch] = []
        while True:
            for batch in page.data:
                created = batch.created_at.timestamp()
                if created < start:
                    return found
                if created <= end:
                    found.append(_provider_batch(batch))
            if not page.has_next_page():
                return found
            page = _call(page.get_next_page, "list")

    def cancel(self, batch_id: str) -> ProviderBatch:
        """Ask the provider to cancel; the batch goes ``canceling``, then ``ended``."""
        batches = self.reranker.client.messages.batches
        return _provider_batch(
            _call(lambda: batches.cancel(batch_id, timeout=CALL_TIMEOUT_SECONDS), "cancel")
        )

    def delete(self, batch_id: str) -> bool:
        """Delete an ended batch at the provider, its requests and results with it (kept
        there 29 days otherwise); False when the provider has no batch by that id (deleted
        already, or another workspace's). One not ended is refused (400: ``http_4xx``)."""
        batches = self.reranker.client.messages.batches

        def delete() -> bool:
            try:
                batches.delete(batch_id, timeout=CALL_TIMEOUT_SECONDS)
            except anthropic.NotFoundError:
                return False
            return True

        return _call(delete, "delete")

    def results(self, batch_id: str) -> Iterator[BatchLine]:
        """Stream an ended batch's results file, line by line, in the provider's order.

        The lines are read here, not by the SDK's decoder: a line that is not JSON would end
        its iteration for good (every line after it lost on each try), and a transport error
        mid-file escapes it as an ``httpx`` error, not an SDK one. Here a download cut is a
        ``connection`` attempt error (retryable: the poll reads the file again), and a line
        that does not parse is a ``malformed`` line of its own (:func:`parse_line`)."""
        batches = self.reranker.client.messages.batches
        decoder = _call(
            lambda: batches.results(batch_id, timeout=RESULTS_TIMEOUT_SECONDS), "results"
        )
        try:
            lines = decoder.http_response.iter_lines()
            while True:
                try:
                    raw = next(lines)
                except StopIteration:
                    return
                except Exception as exc:  # any transport failure mid-file: the download cut
                    cut = RerankAttemptError(
                        AttemptOutcome.CONNECTION, f"results of {batch_id} cut: {exc!r}"
                    )
                    cut.call = "results"
                    raise cut from exc
                if raw.strip():
                    yield parse_line(raw)
        finally:
            decoder.close()


def encode_body(value: Any) -> bytes:
    """``value`` as the SDK's own JSON body: UTF-8 text unescaped, compact, no NaN (its
    ``openapi_dumps``). ``json.dumps``'s default writes non-ASCII as ``\\uXXXX``: a body
    of the same JSON up to three times as long, refused (413) at a size the SDK's fits.

    >>> encode_body({"t": "café 😀"})
    b'{"t":"caf\\xc3\\xa9 \\xf0\\x9f\\x98\\x80"}'
    """
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def parse_line(raw: str) -> BatchLine:
    """One line of a results file. A line that is not JSON, or has no ``custom_id``, is a
    ``malformed`` line with ``custom_id`` ``""`` (no item's); one whose result does not have
    the documented shape (an unknown ``type``, a ``succeeded`` without its message) is a
    ``malformed`` line of its item, never a guess at what it meant.

    >>> parse_line('{"custom_id":"i1","result":{"type":"expired"}}').kind
    'expired'
    >>> line = parse_line('{"custom_id":"i1","result":{"type":"paused"}}')
    >>> line.custom_id, line.kind, line.error.outcome.value
    ('i1', 'malformed', 'malformed')
    >>> parse_line("not json").custom_id
    ''
    """
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    if not isinstance(custom_id, str):
        return _malformed("", f"a results line that names no request: {raw[:200]!r}")
    try:
        return _line(MessageBatchIndividualResponse.construct(**value))
    except (AttributeError, TypeError, KeyError, ValueError) as exc:
        return _malformed(custom_id, f"a result of an unknown shape ({exc}): {raw[:200]!r}")


def _malformed(custom_id: str, message: str) -> BatchLine:
    return BatchLine(
        custom_id, "malformed", error=RerankAttemptError(AttemptOutcome.MALFORMED, message)
    )


def _line(response: MessageBatchIndividualResponse) -> BatchLine:
    result = response.result
    custom_id = response.custom_id
    if result.type == "succeeded":
        if not isinstance(result.message, Message):
            raise ValueError("a succeeded result without its message")
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
    if result.type == "canceled":
        return BatchLine(custom_id, "canceled")
    raise ValueError(f"unknown result type {result.type!r}")


def _provider_batch(batch: MessageBatch) -> ProviderBatch:
    counts = batch.request_counts
    return ProviderBatch(
        id=batch.id,
        created_at=batch.created_at.timestamp() if batch.created_at else None,
        ended_at=batch.ended_at.timestamp() if batch.ended_at else None,
        processing_status=batch.processing_status,
        request_counts={
            "processing": counts.processing,
            "succeeded": counts.succeeded,
            "errored": counts.errored,
            "canceled": counts.canceled,
            "expired": counts.expired,
        },
    )


# How far a ``Date`` header may be from the provider's clock: it counts whole seconds, and
# the answer took some time to come.
DATE_SLACK_SECONDS = 2.0


def provider_offset(date: str | None, now: float) -> float | None:
    """The provider's clock minus the shared one, from an answer dated ``date`` that came
    as the shared clock read ``now``; None without a ``Date`` anyone can read. The ``Date``
    counts whole seconds and was written before the answer came: the offset is at most the
    true one, by up to a second and the answer's time.

    >>> provider_offset("Thu, 01 Jan 1970 00:26:40 GMT", 1300.0)  # 300 s ahead
    300.0
    >>> provider_offset("yesterday", 1300.0) is None
    True
    """
    try:
        return parsedate_to_datetime(date).timestamp() - now if date else None
    except (TypeError, ValueError):
        return None


def provider_window(start: float, end: float, date: str | None, now: float) -> tuple[float, float]:
    """The window ``start``..``end`` (on the shared clock, which read ``now`` as an answer
    dated ``date`` came) on the provider's clock: moved by the provider's offset, and
    widened by :data:`DATE_SLACK_SECONDS` each side; as it is when the answer had no date.

    >>> provider_window(1000.0, 1240.0, "Thu, 01 Jan 1970 00:26:40 GMT", 1300.0)  # 300 s ahead
    (1298.0, 1542.0)
    >>> provider_window(1000.0, 1240.0, None, 1300.0)
    (1000.0, 1240.0)
    """
    offset = provider_offset(date, now)
    if offset is None:  # no Date, or one no one can read: the window as it is
        return start, end
    return start + offset - DATE_SLACK_SECONDS, end + offset + DATE_SLACK_SECONDS


def _call(fn: Callable[[], T], what: str) -> T:
    """One Message Batches API call, its failure translated into an attempt class, naming
    the call (``RerankAttemptError.call``): the poll tells a provider batch it could not read
    from a create of its resubmission that failed."""
    try:
        return _translated(fn, what)
    except RerankAttemptError as error:
        error.call = what
        raise


def _translated(fn: Callable[[], T], what: str) -> T:
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
