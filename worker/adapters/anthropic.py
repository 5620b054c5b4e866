"""The Anthropic reranker: one Messages API call per attempt, its outcome put in exactly one class.

Usage::

    reranker = AnthropicReranker("claude-haiku-4-5")  # the SDK reads ANTHROPIC_API_KEY/_BASE_URL
    reply = reranker.rerank(prompt, timeout_seconds=10.0)
    reply.positions  # raw integers, not range-checked: the core normalises them

Every failure is a :class:`~worker.errors.RerankAttemptError` whose ``outcome`` is one of
``timeout``, ``connection``, ``rate_limited``, ``http_5xx``, ``http_4xx``, ``malformed``
(DESIGN.md §4) or ``refused``, raised ``from`` the SDK's exception. A malformed answer is a
:class:`RerankMalformedError`, which also carries the ``usage`` of the response, because the
tokens spent on it are billed all the same; a refusal (``stop_reason: "refusal"``) is its
subclass :class:`RerankRefusedError`, billed too and never retried. A ``200`` whose body is
not a message (not JSON, no ``usage``...) is ``malformed`` too, raised from pydantic's
ValidationError.

The SDK sends the request and maps the transport and status errors; the body of an answer is
read by :func:`parse_body` (``with_raw_response``), not parsed into the SDK's ``Message``.

The SDK's own retries are off (``max_retries=0``): the core's tenacity loop is the one retry
layer, and it honours ``retry_after``.

An attempt's timeout is a deadline for the whole exchange: looking the host up, connecting,
sending, waiting for the answer and reading its body. The SDK's timeout (httpx's) bounds each
socket operation alone, so a body that trickles in, a piece now and then, kept an attempt of
1 s going for as long as the provider sent, and a name lookup (which takes no timeout) as
long as the resolver took. Each connection of the clients built here clamps every
operation's timeout to what is left of the attempt's, and looks its host up in a thread it
waits on no longer than that (:mod:`worker.adapters.attempt_deadline`).
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import logging
import math
import os
import ssl
import threading
import time
from collections import deque
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import anthropic
from anthropic._constants import DEFAULT_CONNECTION_LIMITS
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from worker import clock
from worker.adapters.attempt_deadline import attempt_deadline, bound_by_deadline
from worker.core.budget import answer_date, retry_after_seconds
from worker.core.types import RerankPrompt, RerankReply, TokenUsage
from worker.effort import EFFORT_MODELS, effort_for
from worker.errors import AttemptOutcome, RerankAttemptError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from types import ModuleType

    from anthropic.types import Message, MessageParam, OutputConfigParam, RefusalStopDetails

logger = logging.getLogger(__name__)

__all__ = [
    "EFFORT_MODELS",
    "AnthropicReranker",
    "RerankMalformedError",
    "RerankRefusedError",
    "effort_for",
]


class RerankMalformedError(RerankAttemptError):
    """A ``malformed`` attempt: the model answered, but not in the schema.

    ``usage`` is what the response reported (billed even though the answer is unusable);
    ``model`` is the model id the response named.
    """

    outcome_class = AttemptOutcome.MALFORMED

    def __init__(self, message: str, *, usage: TokenUsage, model: str) -> None:
        super().__init__(self.outcome_class, message)
        self.usage = usage
        self.model = model


class RerankRefusedError(RerankMalformedError):
    """A ``refused`` attempt: the model stopped with ``stop_reason: "refusal"`` (the API's
    classifiers declined the request). Billed like a malformed answer, whatever text it has
    is not an answer, and it is never retried: the API refuses the same prompt again."""

    outcome_class = AttemptOutcome.REFUSED


class _Positions(BaseModel):
    """The answer's shape: ``{"positions": [int, ...]}`` with JSON integers only."""

    model_config = ConfigDict(strict=True, extra="forbid")

    positions: list[StrictInt]


def _http() -> ModuleType:
    """The SDK's own HTTP library (``httpx``, or the ``httpx2`` that anthropic vendors)."""
    return importlib.import_module(type(DEFAULT_CONNECTION_LIMITS).__module__.partition(".")[0])


#: How long a borrowed SDK client's connection is kept idle: the SDK's own keep-alive expiry
#: (what the provider's SDK keeps one by default; it was 30 s here, as long as the fake keeps
#: one, so the server could close first).
KEEPALIVE_SECONDS = float(DEFAULT_CONNECTION_LIMITS.keepalive_expiry or 5.0)


class AnthropicReranker:
    """A :class:`~worker.core.ports.Reranker` over the Anthropic Messages API.

    Each call borrows an SDK client of its own, with one keep-alive connection, from a stack
    of idle ones (a new one when the stack is empty), and gives it back afterwards: there are
    as many clients as calls were ever in flight at once. With one shared client, its
    connection pool's lock, held while it polls every idle connection, had a fifth of 300
    threads queued on it. The clients share one TLS context (building one costs ~19 ms).

    A client idle for ``keepalive_seconds`` is closed by a janitor thread, not kept: httpx
    closes an expired connection only when its pool is used again, and after a burst the
    stack's deeper clients are not, so each kept a socket the provider had closed in
    ``CLOSE-WAIT`` for as long as the process lived. The default is the SDK's own keep-alive
    expiry (5 s), so against a server that keeps an idle connection longer the client side
    closes first; one that closes sooner leaves the socket half-closed that long at most.
    """

    def __init__(
        self,
        model: str,
        *,
        client: anthropic.Anthropic | None = None,
        effort: str | None = "auto",
        api_key: str | None = None,
        on_headers: Callable[[Mapping[str, str]], None] | None = None,
        keepalive_seconds: float = KEEPALIVE_SECONDS,
    ) -> None:
        """``on_headers``: given every response's headers (answers and API errors alike),
        e.g. the rate budget learning the ``anthropic-ratelimit-*`` limits. ``effort``: the
        ``SIFT_GENERATION_EFFORT`` setting, resolved by :func:`effort_for`; ``self.effort`` is
        the ``output_config.effort`` sent (None: none). ``keepalive_seconds``: how long a
        borrowed client's connection is kept idle before it is closed."""
        self.model = model
        self.on_headers = on_headers
        self.effort = effort_for(model, effort)
        self.keepalive_seconds = keepalive_seconds
        self._api_key = api_key
        self._client = client
        self._owns_client = client is None
        # (client, when it was given back), the oldest at the left; append and pop need no lock
        self._idle: deque[tuple[anthropic.Anthropic, float]] = deque()
        self._janitor: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._tls: ssl.SSLContext | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> anthropic.Anthropic:
        """The given SDK client, or one built on first use (SDK retries off)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._new_client()
        return self._client

    def _new_client(self, connections: int | None = None) -> anthropic.Anthropic:
        spans = sdk_spans()
        if connections is None:
            return anthropic.Anthropic(api_key=self._api_key, max_retries=0, open_telemetry=spans)
        http = _http()
        if self._tls is None:
            self._tls = http.create_ssl_context()
        limits = http.Limits(
            max_connections=connections,
            max_keepalive_connections=connections,
            keepalive_expiry=self.keepalive_seconds,
        )
        http_client = anthropic.DefaultHttpxClient(limits=limits, verify=self._tls)
        bound_by_deadline(http_client)
        return anthropic.Anthropic(
            api_key=self._api_key, max_retries=0, http_client=http_client, open_telemetry=spans
        )

    @contextlib.contextmanager
    def _borrowed(self) -> Iterator[anthropic.Anthropic]:
        """A client for one call: the given one, else an idle one of the stack."""
        if not self._owns_client:
            yield self.client
            return
        try:
            client, _ = self._idle.pop()
        except IndexError:
            client = self._new_client(connections=1)
        try:
            yield client
        finally:
            if self._closed:  # closed while this call ran: close its client too
                client.close()
            else:
                self._idle.append((client, time.monotonic()))
                self._start_janitor()

    def _start_janitor(self) -> None:
        if self._janitor is None:
            with self._lock:
                if self._janitor is None and not self._closed:
                    self._janitor = threading.Thread(
                        target=self._close_idle_forever, name="sift-anthropic-idle", daemon=True
                    )
                    self._janitor.start()

    def _close_idle_forever(self) -> None:
        """Close each idle client once it has been idle ``keepalive_seconds``, waking when
        the oldest is due; ends with :meth:`close`, or once none is left idle (the next
        given back starts another), so an adapter dropped unclosed keeps no thread."""
        wait = self.keepalive_seconds
        while not self._stop.wait(wait):
            with self._lock:  # a client given back meanwhile finds this thread still on
                wait = self.close_idle(time.monotonic())
                if not self._idle:
                    self._janitor = None
                    return

    def close_idle(self, now: float) -> float:
        """Close the clients idle ``keepalive_seconds`` by ``now``, the oldest first; answers
        how long until the next one is due. A call borrowing meanwhile takes the newest (the
        right end), so a client taken here is one no call holds."""
        while True:
            try:
                client, since = self._idle.popleft()
            except IndexError:
                return self.keepalive_seconds
            if now - since < self.keepalive_seconds:
                self._idle.appendleft((client, since))  # the oldest still: back where it was
                return since + self.keepalive_seconds - now
            client.close()

    def close(self) -> None:
        """Close the HTTP pools of the clients this adapter built; a given one is the caller's."""
        if not self._owns_client:
            return
        with self._lock:
            clients, self._client, self._closed = [self._client], None, True
        self._stop.set()
        while self._idle:
            clients.append(self._idle.pop()[0])
        for client in clients:
            if client is not None:
                client.close()

    def request_params(self, prompt: RerankPrompt) -> dict[str, Any]:
        """The keyword arguments of ``messages.create`` for ``prompt`` (no sampling parameter)."""
        output_config: dict[str, object] = {
            "format": {"type": "json_schema", "schema": dict(prompt.output_schema)},
        }
        if self.effort is not None:
            output_config["effort"] = self.effort
        messages: list[MessageParam] = [{"role": "user", "content": prompt.user}]
        params: dict[str, Any] = {
            "model": self.model,
            "max_tokens": prompt.max_tokens,
            "messages": messages,
            "output_config": cast("OutputConfigParam", output_config),
        }
        if prompt.system:
            params["system"] = prompt.system
        return params

    def rerank(self, prompt: RerankPrompt, timeout_seconds: float) -> RerankReply:
        """One attempt: ask the model, parse its positions. Raises RerankAttemptError."""
        if not timeout_seconds > 0:
            raise RerankAttemptError(
                AttemptOutcome.TIMEOUT, "no time left for an attempt", sent=False
            )
        params = self.request_params(prompt)
        deadline = attempt_deadline.set(time.monotonic() + timeout_seconds)
        try:
            with self._borrowed() as client:
                raw = client.messages.with_raw_response.create(**params, timeout=timeout_seconds)
                body = raw.read()  # read in full already (not streamed): no I/O here
            self._tell_headers(raw.headers)
        except anthropic.APITimeoutError as exc:
            raise RerankAttemptError(
                AttemptOutcome.TIMEOUT,
                f"no answer within {timeout_seconds:g}s",
                sent=not _never_connected(exc),
            ) from exc
        except anthropic.APIConnectionError as exc:
            raise RerankAttemptError(
                AttemptOutcome.CONNECTION, _describe(exc), sent=not _never_connected(exc)
            ) from exc
        except anthropic.APIStatusError as exc:
            self._tell_headers(exc.response.headers)
            raise _status_error(exc) from exc
        except anthropic.AnthropicError as exc:
            # E.g. CredentialsError: nothing was sent, and retrying cannot help.
            raise RerankAttemptError(AttemptOutcome.HTTP_4XX, _describe(exc), sent=False) from exc
        except TypeError as exc:
            # The SDK raises TypeError when it finds no API key at all; that is permanent too.
            if "authentication" not in str(exc):
                raise
            raise RerankAttemptError(AttemptOutcome.HTTP_4XX, str(exc), sent=False) from exc
        finally:
            attempt_deadline.reset(deadline)
        return parse_body(body, max_positions=prompt.max_tokens)

    def _tell_headers(self, headers: Mapping[str, str]) -> None:
        if self.on_headers is None:
            return
        try:
            self.on_headers(headers)
        except Exception:  # a listener's fault must not fail the model call
            logger.warning("the response headers' listener failed", exc_info=True)


def sdk_spans() -> Literal[False] | None:
    """The SDK's ``open_telemetry`` option: its default (None: spans, as its
    ``ANTHROPIC_OPEN_TELEMETRY*`` variables say) when OpenTelemetry is set up in this process
    or its environment, else False.

    The SDK starts an OpenTelemetry span for every call, building its attributes from the
    request and injecting a trace context, even when no tracer provider records anything: a
    sixth of its Python function calls per call (3,785 against 4,499). Sift sets up no
    tracing of its own, so a worker that nobody instrumented pays that for nothing.
    """
    # not a setting, on purpose: the SDK and OpenTelemetry read these themselves (docs/settings.md
    # lists the variables Sift reads outside its settings object)
    if any(name in os.environ for name in _OTEL_VARIABLES):
        return None
    try:
        from opentelemetry import trace
    except ImportError:  # the SDK has no spans without it anyway
        return False
    provider = trace.get_tracer_provider()
    return False if isinstance(provider, trace.ProxyTracerProvider) else None


# whoever sets one of these wants the SDK's spans (or to choose them itself)
_OTEL_VARIABLES = (
    "ANTHROPIC_OPEN_TELEMETRY",
    "OTEL_PYTHON_TRACER_PROVIDER",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)


class _Usage(BaseModel):
    """The token counts of a response. The API always counts input and output (the SDK's
    ``Usage`` requires both): a body without one is not a message, where read as 0 it gave
    the budget back tokens the provider metered. A missing cache count is 0."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None


class _Block(BaseModel):
    """A content block: its type, and a ``text`` block's text (other blocks have none)."""

    type: str
    text: str = ""


class _StopDetails(BaseModel):
    """A refusal's ``stop_details``: its policy ``category`` (None when it maps to none)."""

    category: str | None = None


class _Message(BaseModel):
    """What Sift reads of a Messages API response body, validated there (other fields ignored).

    Validated straight from the body's bytes by pydantic-core: the SDK's ``raw.parse()``
    builds its ``Message`` field by field in Python (``construct``, no validation), about a
    fifth of the SDK's CPU per call.
    """

    model: str
    content: list[_Block]
    stop_reason: str | None = None
    stop_details: _StopDetails | None = None
    usage: _Usage


class _UsageLike(Protocol):
    """The SDK's ``Usage`` or :class:`_Usage`."""

    @property
    def input_tokens(self) -> int | None: ...
    @property
    def output_tokens(self) -> int | None: ...
    @property
    def cache_read_input_tokens(self) -> int | None: ...
    @property
    def cache_creation_input_tokens(self) -> int | None: ...


def parse_body(body: bytes, *, max_positions: int | None = None) -> RerankReply:
    """Turn a Messages API response body into a reply, or raise RerankAttemptError
    (``malformed``: a body that is not a message; RerankMalformedError: an answer not in the
    schema, or with more than ``max_positions`` positions: the request's ``max_tokens``,
    since every position costs the model an output token at least)."""
    try:
        message = _Message.model_validate_json(body)
    except ValidationError as exc:
        raise RerankAttemptError(
            AttemptOutcome.MALFORMED,
            f"the response is not a message ({exc.error_count()} errors): {_clip(repr(body))}",
        ) from exc
    texts = [block.text for block in message.content if block.type == "text"]
    usage, category = read_usage(message.usage), _category(message.stop_details)
    reply = _reply(texts, message.stop_reason, message.model, usage, category)
    return reply if max_positions is None else check_positions(reply, max_positions)


def check_positions(reply: RerankReply, max_positions: int) -> RerankReply:
    """``reply``, unless it has more than ``max_positions`` positions (the request's
    ``max_tokens``: every position costs the model an output token at least): then it is
    not a model's answer, a RerankMalformedError (billed all the same). Both lanes apply it:
    the standard lane's :func:`parse_body`, the economy lane's results."""
    if len(reply.positions) > max_positions:
        raise RerankMalformedError(
            f"{len(reply.positions)} positions, more than max_tokens ({max_positions}) lets "
            "a model write: not a model's answer",
            usage=reply.usage,
            model=reply.model,
        )
    return reply


def parse_reply(response: Message) -> RerankReply:
    """Turn the SDK's ``Message`` (a Message Batch's result) into a reply, or raise
    RerankMalformedError."""
    texts = [block.text for block in response.content if block.type == "text"]
    usage, category = read_usage(response.usage), _category(response.stop_details)
    return _reply(texts, response.stop_reason, response.model, usage, category)


def _category(details: _StopDetails | RefusalStopDetails | None) -> str | None:
    return None if details is None else details.category


def _reply(
    texts: list[str],
    stop_reason: str | None,
    model: str,
    usage: TokenUsage,
    refusal_category: str | None = None,
) -> RerankReply:
    """The positions of the answer's text blocks, or RerankMalformedError (a refusal's
    RerankRefusedError, whatever its text: the model was stopped mid-answer)."""
    if stop_reason == "refusal":
        raise RerankRefusedError(
            f"the model refused (stop_details.category={refusal_category}): "
            f"{_clip(''.join(texts))!r}",
            usage=usage,
            model=model,
        )
    if not texts:
        raise RerankMalformedError(
            f"no text block (stop_reason={stop_reason})", usage=usage, model=model
        )
    text = "".join(texts)
    try:
        answer = _Positions.model_validate_json(text)
    except ValidationError as exc:
        if stop_reason == "max_tokens":
            reason = "answer cut at max_tokens"
        elif any(error["type"] == "json_invalid" for error in exc.errors()):
            reason = "answer is not JSON"
        else:
            reason = "answer fails the schema"
        raise RerankMalformedError(
            f"{reason} (stop_reason={stop_reason}): {_clip(text)!r}", usage=usage, model=model
        ) from exc
    return RerankReply(positions=list(answer.positions), usage=usage, model=model)


def read_usage(usage: _UsageLike) -> TokenUsage:
    """A response's token counts; missing fields count as 0."""
    return TokenUsage(
        input_tokens=usage.input_tokens or 0,
        output_tokens=usage.output_tokens or 0,
        cache_read_input_tokens=usage.cache_read_input_tokens or 0,
        cache_creation_input_tokens=usage.cache_creation_input_tokens or 0,
    )


def provider_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait, from ``retry-after-ms``, or ``retry-after`` (seconds or an HTTP date,
    read against the answer's own ``Date``, else the shared clock: a date is on the
    provider's clock, and this host's may be minutes off it)."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            value = float(millis) / 1000.0
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            return value
    now = answer_date(headers.get("date")) or datetime.fromtimestamp(clock.now(), UTC)
    return retry_after_seconds(headers.get("retry-after"), now)


# 429 ``rate_limit_error``s that are no rate limit: the organisation's spend cap, its usage
# tier's monthly one or its contract's (``error.details.error_code``; the SDK's
# EnforcedSpendLimitReachedError and ContractSpendLimitReachedError). They come with no
# ``retry-after``, and every retry fails until the month ends or the cap is raised.
SPEND_LIMIT_CODES = frozenset({"enforced_spend_limit_reached", "contract_spend_limit_reached"})


def paid_destination() -> str | None:
    """Where a call made with this process's environment goes when the provider bills it: the
    SDK's base URL (``ANTHROPIC_BASE_URL``, else the API's). None when no credential is set
    (nothing is sent) or the URL is on this machine, as the tests' fake Messages API is:
    ``sift demo`` asks before it makes paid calls."""
    with anthropic.Anthropic(max_retries=0) as client:
        if not (client.api_key or client.auth_token):
            return None
        url = client.base_url
    return None if _on_this_machine(url.host) else str(url).rstrip("/")


def _on_this_machine(host: str) -> bool:
    """
    >>> _on_this_machine("127.0.0.1"), _on_this_machine("localhost"), _on_this_machine("::1")
    (True, True, True)
    >>> _on_this_machine("api.anthropic.com")
    False
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return False


def provider_says_retry(headers: Mapping[str, str]) -> bool | None:
    """The provider's word on sending the request again, ``x-should-retry: true|false``
    (None: it said nothing). The SDK's own retry policy obeys it before the status; Sift's
    retries replace the SDK's, so they obey it too."""
    word = headers.get("x-should-retry")
    return {"true": True, "false": False}.get(word or "")


def retry_cannot_help(exc: anthropic.APIStatusError) -> bool:
    """Whether the provider says that sending the request again cannot succeed:
    ``x-should-retry: false``, or, unless it says ``true``, a spend cap's 429
    (:data:`SPEND_LIMIT_CODES`)."""
    says = provider_says_retry(exc.response.headers)
    if says is not None:
        return not says
    return exc.error_code in SPEND_LIMIT_CODES


def _status_error(exc: anthropic.APIStatusError) -> RerankAttemptError:
    """:func:`_status_class`, with the answer's HTTP status (``RerankAttemptError.status``)."""
    error = _status_class(exc)
    error.status = exc.status_code
    return error


def _status_class(exc: anthropic.APIStatusError) -> RerankAttemptError:
    """The class of an API error, retried as the SDK's own policy would (``_should_retry``):
    ``x-should-retry`` first, then 408, 409, 429 and 5xx. A 408 is the provider's request
    timeout, counted with the timeouts (and, for a Message Batches create, one that may have
    made its batch); a 409, or any other 4xx the provider says to retry, is its transient
    failure, counted with its 5xx. Every other 4xx is permanent: ``http_4xx``."""
    status = exc.status_code
    message = f"HTTP {status}: {_describe(exc)}"
    if exc.error_code:
        message += f" [{exc.error_code}]"
    if exc.request_id:
        message += f" (request-id {exc.request_id})"
    retry_after = provider_retry_after(exc.response.headers)
    if retry_cannot_help(exc):  # permanent: no retry, and no pause of every caller as a 429's
        return RerankAttemptError(AttemptOutcome.HTTP_4XX, message)
    if status == 429:
        return RerankAttemptError(AttemptOutcome.RATE_LIMITED, message, retry_after)
    if status == 408:
        return RerankAttemptError(AttemptOutcome.TIMEOUT, message, retry_after)
    if status >= 500 or status == 409 or provider_says_retry(exc.response.headers):
        return RerankAttemptError(AttemptOutcome.HTTP_5XX, message, retry_after)
    return RerankAttemptError(AttemptOutcome.HTTP_4XX, message)


def _never_connected(exc: anthropic.APIConnectionError) -> bool:
    """Whether the SDK's connection error or timeout came before any byte of the request left:
    the host not found or not answering its lookup in time, the connection refused, not
    made (TCP or TLS) in time, or the attempt's deadline over before its request's first
    write (:class:`~worker.adapters.attempt_deadline.Unsent`). The provider never saw such a
    request, so it is no request in the search's usage and the rate budget gets it back; a
    connection that broke or timed out later may have carried the request, and counts as
    sent."""
    http = _http()
    return isinstance(exc.__cause__, http.ConnectError | http.ConnectTimeout)


def _describe(exc: anthropic.AnthropicError) -> str:
    if isinstance(exc, anthropic.APIStatusError) and exc.api_message:
        kind = f"{exc.type}: " if exc.type else ""
        return f"{kind}{exc.api_message}"
    cause = exc.__cause__
    text = str(exc)
    return f"{text} ({type(cause).__name__}: {cause})" if cause is not None else text


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
