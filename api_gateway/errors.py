"""The gateway's error bodies and handlers: each is ``{"error": {"type","message","field"?}}``.

A malformed request always gets a 4xx whose message names the field, never a 500.
"""

from __future__ import annotations

import logging
import re
import ssl
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api_gateway.backpressure import FREES, FULL_RETRY_AFTER_SECONDS
from api_gateway.bodies import field_of
from api_gateway.paths import has_encoded_slash
from worker.constants import ERROR_JOB_STORE_FULL, ERROR_UNAVAILABLE
from worker.errors import InvalidRequest, validation_message
from worker.redis_client import CANNOT_PERSIST, DB_OUT_OF_RANGE, acl_refused, cannot_persist

log = logging.getLogger(__name__)

UNAVAILABLE_RETRY_AFTER_SECONDS = 1  # a Redis restart takes about that long
#: the header of every 503 that a Redis restart or a worker's return may end: when to ask again
UNAVAILABLE_RETRY_AFTER: Final[Mapping[str, str]] = MappingProxyType(
    {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_SECONDS)}
)
_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
_HEADER_NAMES = {"idempotency-key": "Idempotency-Key", "authorization": "Authorization"}
#: the most problems a 400 or 422 lists, in ``fields`` and its message, the first in the body;
#: it says more follow past them. Listing every one of a batch of 100,000 queries each with
#: three built a 46 MB answer on the event loop for an 8 MB body (``/healthz`` unanswered for
#: 2.6 s meanwhile)
MAX_LISTED_PROBLEMS = 100
MORE_PROBLEMS = f"more problems follow, not listed (the first {MAX_LISTED_PROBLEMS} are)"


class FieldProblem(BaseModel):
    field: str
    message: str


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: str | None = None
    fields: list[FieldProblem] | None = None


class ErrorBody(BaseModel):
    """Every 4xx and 5xx body."""

    error: ErrorDetail


class ApiError(Exception):
    """An error the gateway answers with a status, a type, and the field it is about."""

    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        *,
        field: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.field = field
        self.headers = headers


def error_response(
    status: int,
    type_: str,
    message: str,
    *,
    field: str | None = None,
    fields: Sequence[FieldProblem] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    detail = ErrorDetail(
        type=type_, message=message, field=field, fields=list(fields) if fields else None
    )
    return JSONResponse(
        ErrorBody(error=detail).model_dump(exclude_none=True), status_code=status, headers=headers
    )


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|bytes|[a-z-]+\[.*\]|\[key\])$")


def field_name(loc: Sequence[int | str]) -> str:
    """("body", "queries", 3, "id") -> "queries[3].id"; ("query", "wait") -> "wait".

    A union's branch tag at the end ("filters.a.str") is dropped: the field is "filters.a";
    so is a refused dict key's "[key]" ("filters.a b.[key]" -> "filters.a b").
    """
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        source = parts.pop(0)
        if source == "header" and parts:
            return _HEADER_NAMES.get(str(parts[0]).lower(), str(parts[0]))
        if not parts:
            return "body"
    if len(parts) > 1 and isinstance(parts[-1], str) and _UNION_TAG.match(parts[-1]):
        parts.pop()
    name = ""
    for part in parts:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += ("." if name else "") + part
    return name or "body"


def _badly_named_member(error: Any, body: Any) -> FieldProblem | None:
    """The problem of a member of ``body`` whose name is not valid Unicode (a lone surrogate:
    ``{"\\ud800": 1}`` is valid JSON), named as pydantic names a filter key so made (each of
    its bytes a U+FFFD); ``None`` for any other error. pydantic reports such a name as a
    string error at the object holding it (``body: Input should be a valid string``), which
    named no member and said the object should have been a string."""
    name, loc = error.get("input"), tuple(error.get("loc", ()))
    if error.get("type") != "string_unicode" or not isinstance(name, str) or loc[:1] != ("body",):
        return None
    node = body
    for part in loc[1:]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return None
    if not isinstance(node, dict) or name not in node:
        return None  # a string value that is not valid Unicode: pydantic names its field
    try:
        name.encode()
    except UnicodeEncodeError as exc:
        at = exc.start
    else:
        return None
    return FieldProblem(
        field=field_of((*loc[1:], name)),
        message=f"is not valid Unicode: its name holds a lone surrogate at character {at}",
    )


def problems_of(
    errors: Sequence[Any], body: Any = None, *, most: int | None = None
) -> list[FieldProblem]:
    """Each field's problem, once, from pydantic's ``errors`` of ``body`` (the JSON value
    validated, where there is one); with ``most``, the first ``most`` + 1 at most (the one
    past them says more follow), and the errors after it are not read."""
    seen: set[str] = set()
    problems: list[FieldProblem] = []
    for error in errors:
        if most is not None and len(problems) > most:
            break
        field = field_name(error.get("loc", ()))
        if (named := _badly_named_member(error, body)) is not None:
            field, message = named.field, named.message
        elif error.get("type") == "json_invalid":
            field = "body"
            message = "is not valid JSON: " + str(error.get("ctx", {}).get("error", "parse error"))
        else:
            message = validation_message(error.get("msg", "is invalid"))
        if field in seen:  # a union reports each branch; name the field once
            continue
        seen.add(field)
        problems.append(FieldProblem(field=field, message=message))
    return problems


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route takes on the request's path, asked of each route as the
    router does. Starlette's ``Allow`` lists the first matching route's alone, and here each
    method is a route of its own: a batch's ``GET`` without the ``DELETE`` that cancels it."""
    routes = request.app.router.routes
    return sorted(
        method
        for method in _METHODS
        if any(r.matches({**request.scope, "method": method})[0] is Match.FULL for r in routes)
    )


def _short_of_a_line_break(request: Request) -> bool:
    """Whether the route was matched short of the path's last character, a line break:
    Starlette's route regexes end in ``$``, which also matches before a last line break, so
    ``POST /v1/searches%0A`` was a search and ``POST .../documents/delete%0A`` a delete. A
    route ending in a parameter takes the line break into it (a document id may end in one)."""
    path: str = request.scope["path"]
    return path.endswith("\n") and not any(
        str(value).endswith("\n") for value in request.path_params.values()
    )


async def no_route_short_of_a_line_break(request: Request) -> None:
    """A dependency of every route (the app's): a path its route matched short of a last line
    break is a path no route has, answered ``404`` naming ``path`` as any other."""
    if _short_of_a_line_break(request):
        raise StarletteHTTPException(404)


UNREACHABLE = "Redis (SIFT_REDIS_URL) could not be reached"


def unavailable_reason(app: FastAPI, exc: Exception) -> str:
    """Why Redis failed a request, naming the setting that governs it: how long the gateway
    waits for an answer, or where it looks for Redis and how it connects (a database, the
    credentials, a command its ACL refuses the user, or the TLS handshake Redis refused). A
    refusal was said "could not be reached" of a Redis that was up."""
    if isinstance(exc, redis.TimeoutError):
        return _unanswered(app)
    return _refusal(app, exc) or UNREACHABLE


def public_unavailable_reason(app: FastAPI, exc: Exception) -> str:
    """Why Redis failed ``/readyz``, which answers anyone, without a key: refused (its
    credentials, its ACL, its database, its TLS handshake), unanswered in time, or
    unreachable, in words of the gateway's own. A refusal's :func:`unavailable_reason`
    quotes Redis (the command its ACL refuses, the credentials' fault, the certificate a
    handshake refused and the host it names): the gateway's log keeps that."""
    if isinstance(exc, redis.TimeoutError):
        return _unanswered(app)  # a setting's name, and its seconds: nothing Redis said
    if _refusal(app, exc) is None:
        return UNREACHABLE
    return "Redis refused the gateway (its log says why)"


def _unanswered(app: FastAPI) -> str:
    seconds = app.state.settings.gateway_redis_timeout_seconds
    return f"Redis did not answer within {seconds:g} s (SIFT_GATEWAY_REDIS_TIMEOUT_SECONDS)"


def _refusal(app: FastAPI, exc: Exception) -> str | None:
    """Why Redis refused the gateway, quoting what it said, when ``exc`` is a refusal: the
    database ``SIFT_REDIS_URL`` names, its credentials, a command its ACL refuses the user,
    or the TLS handshake. None when Redis refused nothing (it was not reached)."""
    if str(exc).startswith(DB_OUT_OF_RANGE):
        return "Redis has no such database as SIFT_REDIS_URL names (DB index is out of range)"
    if isinstance(exc, redis.AuthenticationError):  # NOAUTH, WRONGPASS
        if not app.state.store.redis.connection_pool.connection_kwargs.get("password"):
            return "Redis requires a password, and SIFT_REDIS_URL gives none"
        return f"Redis refused the credentials of SIFT_REDIS_URL ({exc})"
    if acl_refused(exc):
        noperm = "NOPERM " if isinstance(exc, redis.exceptions.NoPermissionError) else ""
        return (
            "Redis's ACL refuses the user of SIFT_REDIS_URL a command the gateway needs "
            f"({noperm}{exc})"
        )
    if (handshake := _tls_failure(exc)) is not None:
        return f"the TLS handshake with Redis (SIFT_REDIS_URL) failed ({handshake})"
    return None


def _tls_failure(exc: BaseException) -> str | None:
    """What failed in the TLS handshake that ``exc`` came of (redis-py raises its
    ``ConnectionError`` from the ``ssl`` module's error), else None."""
    cause = exc.__cause__
    if not isinstance(cause, ssl.SSLError):
        return None
    why = getattr(cause, "verify_message", None)  # a certificate's: why it was refused
    return f"{cause.reason}: {why}" if why else str(cause.reason or cause)


def job_store_unavailable(reason: str) -> ApiError:
    """The ``503 unavailable`` of a job store that failed a request (``reason``: how), the
    gateway's own Redis or a worker's on an index read for it."""
    return ApiError(
        503,
        ERROR_UNAVAILABLE,
        f"the job store is unavailable: {reason}; retry after {UNAVAILABLE_RETRY_AFTER_SECONDS} s",
        headers=UNAVAILABLE_RETRY_AFTER,
    )


def job_store_full(*, disk: bool = False) -> ApiError:
    """The ``503 job_store_full`` of a Redis that refused the write whole: at its
    ``maxmemory``, or, with ``disk``, unable to persist to its disk (``MISCONF``), which no
    expiry frees: its operator makes room, and Redis takes writes once a save succeeds."""
    if disk:
        message = (
            f"the job store is full: {CANNOT_PERSIST}; nothing was stored; it takes writes "
            f"again once its disk has room; retry after {FULL_RETRY_AFTER_SECONDS} s"
        )
    else:
        message = "the job store is full (Redis reached its maxmemory): nothing was stored; "
        message += FREES
    return ApiError(
        503,
        ERROR_JOB_STORE_FULL,
        message,
        headers={"Retry-After": str(FULL_RETRY_AFTER_SECONDS)},
    )


def _answer(exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.type, exc.message, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if isinstance(exc.body, bytes):
            # FastAPI reads a body as JSON only under a JSON Content-Type (or none); any
            # other (curl -d sends a form's) left the raw bytes, which then "should be a
            # valid dictionary", a 422 that did not say why
            sent = request.headers.get("content-type")
            problem = FieldProblem(
                field="body",
                message=(f"was sent as {sent!r}" if sent else "was sent without a Content-Type")
                + ", not read as JSON: send it with Content-Type: application/json",
            )
            return error_response(
                415, "unsupported_media_type", f"body: {problem.message}", field="body",
                fields=[problem],
            )  # fmt: skip
        problems = problems_of(exc.errors(), exc.body, most=MAX_LISTED_PROBLEMS)
        if not problems:
            problems = [FieldProblem(field="body", message="is invalid")]
        more = problems[MAX_LISTED_PROBLEMS:]
        problems = problems[:MAX_LISTED_PROBLEMS]
        status = 400 if problems[0].field == "body" and "JSON" in problems[0].message else 422
        message = "; ".join(f"{p.field}: {p.message}" for p in problems)
        if more:
            message += f"; {MORE_PROBLEMS}"
        return error_response(
            status, "invalid_request", message, field=problems[0].field, fields=problems
        )

    @app.exception_handler(InvalidRequest)
    async def _invalid(request: Request, exc: InvalidRequest) -> JSONResponse:
        return error_response(
            422,
            "invalid_request",
            exc.message,
            field=exc.field,
            fields=[FieldProblem(field=exc.field, message=exc.problem)],
        )

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        fields = None
        if exc.status in (400, 422) and exc.field:  # listed as every 400's and 422's are
            message = exc.message.removeprefix(f"{exc.field}: ")
            fields = [FieldProblem(field=exc.field, message=message)]
        return error_response(
            exc.status, exc.type, exc.message, field=exc.field, fields=fields, headers=exc.headers
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:
            # FastAPI's one 400: a body its JSON reader could not decode (not UTF-8, -16
            # or -32), "There was an error parsing the body", which named no field
            reason = str(exc.__cause__ or exc.detail)
            problem = FieldProblem(field="body", message=f"is not valid JSON: {reason}")
            return error_response(
                400, "invalid_request", f"body: {problem.message}", field="body", fields=[problem]
            )
        headers = getattr(exc, "headers", None)
        path = request.scope["path"]  # as routed: ``url.path`` drops line breaks (urlsplit)
        if exc.status_code == 404 or (exc.status_code == 405 and _short_of_a_line_break(request)):
            # the routes' own 404s are ApiErrors: here, no route
            message = f"path: no route {path!r} (the routes are in /openapi.json)"
            raw = request.scope.get("raw_path")
            if isinstance(raw, bytes) and has_encoded_slash(raw):
                # decoded, it may read as a route there is (``'/v1/searches'``): name it raw
                message = (
                    f"path: no route {raw.decode('latin-1')!r}: a %2F is a character of its "
                    "segment, never the / between two (the routes are in /openapi.json)"
                )
            # a 405 made a 404 here keeps no Allow: Starlette's named the route short of the
            # line break (``Allow: POST`` on ``DELETE /v1/batches%0A``), which the path is not
            kept = {k: v for k, v in (headers or {}).items() if k.lower() != "allow"}
            return error_response(404, "not_found", message, field="path", headers=kept or None)
        if exc.status_code == 405:
            message = f"method: {request.method} is not a method of {path!r}"
            # none: a 405 of no route's (a /docs static file's), whose own Allow stands
            if allowed := _allowed_methods(request):
                headers = {**(headers or {}), "Allow": ", ".join(allowed)}
            return error_response(
                405, "method_not_allowed", message, field="method", headers=headers
            )
        return error_response(exc.status_code, "http_error", str(exc.detail), headers=headers)

    # Redis errors are handled here rather than by the catch-all below: Starlette re-raises
    # what reaches that one after answering, and uvicorn then closes the keep-alive
    # connection, so the client's next request on it was reset.

    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
        """Redis down, restarting or loading: a passing state, not a bug; one log line. The
        type is ``unavailable``, not ``job_store_full``: a timeout may come after the
        request's write was made, so the client cannot know that nothing was stored."""
        log.error(
            "job store unavailable on %s %s: %s: %s",
            request.method, request.url.path, type(exc).__name__, exc,
        )  # fmt: skip
        return _answer(job_store_unavailable(unavailable_reason(request.app, exc)))

    @app.exception_handler(redis.exceptions.OutOfMemoryError)
    async def _full(request: Request, exc: Exception) -> JSONResponse:
        """Redis at its ``maxmemory`` (``noeviction``): it refuses every write that would
        grow it, reads go on. Nothing was stored (a job's writes are one MULTI, which Redis
        refuses whole), and ``job_store_full`` says so: the client may send any request so
        refused again, a delete job's too, which ``unavailable`` does not allow. One log line,
        for the operator."""
        log.error(
            "job store full on %s %s: %s", request.method, request.url.path, exc
        )  # fmt: skip
        return _answer(job_store_full())

    @app.exception_handler(redis.ResponseError)
    async def _refused(request: Request, exc: Exception) -> JSONResponse:
        """A database Redis does not have (``SIFT_REDIS_URL=redis://…/99`` on a Redis of 16):
        Redis refuses each new connection's SELECT, which the URL mends, not the request: a
        503 naming it, as an unreachable Redis is. A Redis that cannot persist to its disk
        (``MISCONF``, its AOF disk full) refuses every write, a job's MULTI whole: the
        ``job_store_full`` of its maxmemory, naming the disk (it was a 500, logged as a bug).
        A command Redis's ACL refuses the URL's user (``NOPERM``) is the URL's user's setting,
        as a refused password is: a 503 naming it (it was a 500, logged as a bug). Any other
        refused command is a bug."""
        if cannot_persist(exc):
            log.error(
                "job store full on %s %s: %s", request.method, request.url.path, exc
            )  # fmt: skip
            return _answer(job_store_full(disk=True))
        if not (acl_refused(exc) or str(exc).startswith(DB_OUT_OF_RANGE)):
            return await _redis_bug(request, exc)
        log.error("job store unavailable on %s %s: %s", request.method, request.url.path, exc)
        return _answer(job_store_unavailable(unavailable_reason(request.app, exc)))

    @app.exception_handler(redis.RedisError)
    async def _redis_bug(request: Request, exc: Exception) -> JSONResponse:
        """Any other Redis error (a refused command) is the gateway's bug, whatever the input:
        every client value is checked before it reaches Redis."""
        log.error("job store error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal_error", "internal error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "internal error")
