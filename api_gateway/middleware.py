"""Pure ASGI middleware: the request body size limit (413), a compressed body or one in
another charset than UTF-8 (415), a request cut short by a forced stop (503), and per-route
HTTP metrics."""

from __future__ import annotations

import asyncio
import email.message
import time
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_gateway.auth import KeyRing, key_refused
from api_gateway.errors import (
    UNAVAILABLE_RETRY_AFTER,
    UNAVAILABLE_RETRY_AFTER_SECONDS,
    FieldProblem,
    error_response,
)
from api_gateway.metrics import GatewayMetrics
from worker.constants import ERROR_UNAVAILABLE


def _refusal(status: int, type_: str, field: str, problem: str) -> JSONResponse:
    """The gateway's error body (:func:`~api_gateway.errors.error_response`, as every other
    4xx's, ``fields`` too), to answer before the app has read anything."""
    message = f"{field}: {problem}"
    fields = [FieldProblem(field=field, message=problem)]
    return error_response(status, type_, message, field=field, fields=fields)


# The charset values that mean UTF-8: JSON between systems is UTF-8 (RFC 8259, 8.1), and
# ``application/json`` defines no charset parameter (section 11)
UTF8_CHARSETS = frozenset({"utf-8", "utf8"})
# US-ASCII is UTF-8's first 128 characters: a body that is ASCII, as declared, reads the same
ASCII_CHARSETS = frozenset({"us-ascii", "ascii"})


def charset_problem(values: list[bytes], body: bytes = b"") -> str | None:
    """Why a body sent under these ``Content-Type`` header values cannot be read as the UTF-8
    JSON it is read as, or ``None``. A body declared in another charset was read as UTF-8
    anyway: a 400 "can't decode byte 0xe9" for Latin-1's "é", or worse, another text without
    an error (Latin-1's "Ã©" is UTF-8's "é"). Two values: which one the body is in is a guess.
    """
    if len(values) > 1:
        return f"is given {len(values)} times: give it once"
    if not values:
        return None
    header = email.message.Message()  # the parser FastAPI reads the media type with
    header["content-type"] = values[0].decode("latin-1")
    if sum(name.strip().lower() == "charset" for name, _ in header.get_params() or []) > 1:
        return "its charset parameter is given twice: give it once"  # which one the body is in
    charset = header.get_param("charset")
    if charset is None or not isinstance(charset, str):  # absent, or RFC 2231 parts
        return None if charset is None else "its charset parameter is not understood"
    fix = "send the body as UTF-8 (charset=utf-8, or none)"
    if charset.strip().lower() in UTF8_CHARSETS:
        return None
    if charset.strip().lower() in ASCII_CHARSETS:
        if body.isascii():
            return None
        at = next(i for i, byte in enumerate(body) if byte > 127)
        return f"charset {charset!r} is not what the body is in (byte {body[at]:#x} at {at}): {fix}"
    return f"charset {charset!r} is not accepted: {fix}"


class BodyLimitMiddleware:
    """Refuse a body larger than ``limit`` bytes with 413, before the app parses it; and a
    compressed one (``Content-Encoding`` other than ``identity``) with 415: the body is read as
    sent, and a gzip body was a 400 "not valid JSON: can't decode byte 0x8b" that did not say
    why. So is a body whose ``Content-Type`` names a charset other than UTF-8, on every route
    (:func:`charset_problem`).

    The body of a request the key check will refuse (:func:`~api_gateway.auth.key_refused`,
    with ``keyring``) is read and dropped as it arrives, never kept: the app gets an empty
    body and answers its 401 or 403. Kept, each such request held its body (up to ``limit``)
    in the gateway's memory until that answer, so ten callers without a key sending 32 MB at
    once took the gateway past 500 MB, the memory limit of deploy/k8s's gateway pod."""

    def __init__(self, app: ASGIApp, limit: int, keyring: KeyRing | None = None) -> None:
        self.app = app
        self.limit = limit
        self.keyring = keyring

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"larger than the limit of {self.limit} bytes"
        await _refusal(413, "payload_too_large", "body", message)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        content_types: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_types.append(value)
            if name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
                why = f"{value.decode('latin-1')!r} is not accepted: send the body uncompressed"
                refusal = _refusal(415, "unsupported_media_type", "Content-Encoding", why)
                await refusal(scope, receive, send)
                return
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.limit:
                    await self._too_large(scope, receive, send)
                    return
        refused = self.keyring is not None and key_refused(Headers(scope=scope), self.keyring)
        # each piece goes into one buffer as it comes, and is freed: kept in a list until
        # joined, their heap space stayed resident beside the copies the app makes, and the
        # joined body beside Starlette's own (a 30 MB body took the gateway up 143 MiB, now
        # 86: the body, its decoded text, the parsed value; test_unkeyed_bodies.py)
        buffer = bytearray()
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await self._too_large(scope, receive, send)
                return
            if not refused:
                buffer += chunk
            if not message.get("more_body", False):
                break
        body = bytes(buffer)
        del buffer
        problem = charset_problem(content_types, body) if size else None
        if problem is not None:  # a body-less POST (a cancel) is read whatever its type says
            refusal = _refusal(415, "unsupported_media_type", "Content-Type", problem)
            await refusal(scope, receive, send)
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent, body
            if not sent:
                sent = True
                whole: Message = {"type": "http.request", "body": body, "more_body": False}
                body = b""  # the app's to hold now (Starlette's Request joins its own copy)
                return whole
            return await receive()

        await self.app(scope, replay, send)


class ForcedStopMiddleware:
    """A request the server cancels (uvicorn forced to stop, by a second Ctrl-C or SIGTERM
    during its graceful stop, cancels every request it still serves) is answered ``503``
    ``unavailable``, its outcome unknown, if nothing of its answer was sent: it may have
    made its job already (a search in its ``?wait=``). uvicorn's own answer is a plain-text
    ``500 Internal Server Error``, which says the request failed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_started(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except asyncio.CancelledError:
            if not started:
                answer = error_response(
                    503,
                    ERROR_UNAVAILABLE,
                    "the gateway was stopped before it answered, so whether the request was "
                    "applied is unknown; send it again after "
                    f"{UNAVAILABLE_RETRY_AFTER_SECONDS} s with its Idempotency-Key, or look "
                    "for its job in the job lists (GET /v1/searches, /v1/batches, "
                    "/v1/ingestions)",
                    headers=UNAVAILABLE_RETRY_AFTER,
                )
                await answer(scope, receive, send)
            raise


# The standard methods, counted as sent whether or not a route serves them (no route serves
# PUT: a PUT is counted as PUT); any other is counted as "other". The method is
# the caller's to choose (HTTP/1.1 allows any token; uvicorn's h11 parser takes them all), and
# each new value would be a new series on every scrape.
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class MetricsMiddleware:
    """Count and time every request by method, route template and status."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route: Any = scope.get("route")
            # the OpenAPI path: {id}, not the route's {id:doc_id} with its convertor
            template = getattr(route, "path_format", None) or getattr(route, "path", "unmatched")
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
            self.metrics.requests.labels(method, template, str(status)).inc()
            self.metrics.duration.labels(method, template).observe(time.perf_counter() - started)
