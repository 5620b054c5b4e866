"""What the route modules share: the caller's tenant, the ``wait`` and ``page_size``
parameters, the app's job store and task sender, blocking calls off the event loop, ids checked
by shape, polling a job until it is final, the ``202``'s ``Location``, and page tokens."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import redis
from fastapi import Depends, Query, Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError
from starlette.concurrency import run_in_threadpool

from api_gateway.auth import authenticate
from api_gateway.errors import ErrorBody
from api_gateway.paths import decode_segments
from api_gateway.queue import OutboxSender
from api_gateway.routing import BODY_PROBLEM
from worker.constants import MAX_BATCH_QUERIES, MAX_PAGE_SIZE, MAX_WAIT_SECONDS
from worker.errors import InvalidRequest
from worker.queue.jobstore import AsyncJobStore, JobStore
from worker.settings import Settings

T = TypeVar("T")

log = logging.getLogger(__name__)

# what a read meets while Redis restarts or loads (the 503 "unavailable" of errors.py)
STORE_AWAY = (redis.ConnectionError, redis.TimeoutError)

Tenant = Annotated[str, Depends(authenticate)]


def written_as(kind: str, form: re.Pattern[str], words: str) -> BeforeValidator:
    """A query parameter's text refused unless all of it is ``form``, before pydantic converts
    it (a ``422`` naming the parameter, of pydantic's ``kind``). Pydantic's own conversion of
    a string is lax where a JSON body is strict (:mod:`worker.contract`): it takes
    ``page_size=%205`` (" 5"), ``+5`` (a ``+`` in a query is a space), ``%2B5``, ``1_0``
    (read as 10) and ``wait=.5``. A value that is no string (a default) passes untouched."""

    def check(value: object) -> object:
        if isinstance(value, str) and form.fullmatch(value) is None:
            raise PydanticCustomError(kind, "Input should be " + words)
        return value

    return BeforeValidator(check)


DIGITS = written_as(
    "int_parsing",
    re.compile(r"[0-9]+"),
    "an integer written in the digits 0-9 alone (no sign, space, underscore or point)",
)
# a wait is served as a number, and a client writes a small float with an exponent (Python's
# and JavaScript's 1e-07): refused, it was a number the OpenAPI document let through
DECIMAL = written_as(
    "float_parsing",
    re.compile(r"[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?"),
    "a number written in the digits 0-9, with a decimal point between digits and an exponent "
    "(e, a sign or none, digits) at most (no other sign, space or underscore)",
)
# each validator goes after its Query: before it, OpenAPI would show the bounds as "ge"/"le"
Wait = Annotated[
    float,
    Query(
        ge=0,
        le=MAX_WAIT_SECONDS,
        description="Seconds to wait for the job to finish; 200 if it did, else 202.",
    ),
    DECIMAL,  # "nan" and "inf" too ("1e309", infinite, is past the maximum)
]
PageSize = Annotated[
    int,
    Query(
        ge=1,
        le=MAX_PAGE_SIZE,
        description="Entries per page (a filtered job list's page may hold fewer).",
    ),
    DIGITS,
]
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 415, 422, 503)
}
LOCATION_HEADER: dict[str, dict[str, Any]] = {
    "Location": {
        "schema": {"type": "string"},
        "description": "The job's URL, to poll (a path on this gateway).",
    }
}
IDEMPOTENCY_KEY = "Idempotency-Key"
SINGLE_HEADERS = (IDEMPOTENCY_KEY,)  # each given at most once (checked_headers)
KEYED_ROUTES = "POST /v1/searches and POST /v1/batches"  # the routes that honour the key
POLL_MIN_SECONDS = 0.005
POLL_MAX_SECONDS = 0.1
_ID_DIGITS = re.compile(r"[0-9a-f]{32}")
TOKEN_DIGEST_BYTES = 8


def is_id(value: str, prefix: str) -> bool:
    """Whether ``value`` has the shape of the ids the store makes (``prefix`` and 32 hex
    digits). Any other is unknown without asking Redis: a client's text never becomes part
    of a key name, where it could name a key of another type (a WRONGTYPE error, a 5xx)."""
    return value.startswith(prefix) and _ID_DIGITS.fullmatch(value, len(prefix)) is not None


def _query_names(dependant: Dependant) -> frozenset[str]:
    """The query parameters a route's ``dependant`` takes: its own and its dependencies'."""
    names = {param.alias for param in dependant.query_params}
    return frozenset(names.union(*(_query_names(d) for d in dependant.dependencies)))


async def path_is_utf8(request: Request, _tenant: Tenant) -> None:
    """A dependency of every ``/v1`` route (their routers'): a path parameter whose
    percent-escapes are not UTF-8 (``%C0``, ``%FF``) is ``422`` naming it. The server decodes
    them with replacement characters, so ``DELETE .../documents/%C0`` deleted the document
    ``"\ufffd"``. After the key check (``_tenant``), as every ``422``: it was one of the
    app's dependencies, which run before the routers', so a caller without a key got this
    ``422`` instead of the ``401``. No other route takes a path parameter.

    The raw path, decoded strictly but for the bad bytes (kept as lone surrogates), is matched
    by the route's own pattern: the parameter holding one is the bad one."""
    raw: bytes | None = request.scope.get("raw_path")
    if raw is None:
        return
    # each encoded slash kept inside its segment, as the route was matched (api_gateway.paths)
    decoded = decode_segments(raw, lambda part: part.decode("utf-8", "surrogateescape"))
    if not _lone(decoded):
        return
    route: Any = request.scope.get("route")
    root = request.scope.get("root_path", "")
    found = getattr(route, "path_regex", None)
    match = found.match(decoded.removeprefix(root)) if found is not None else None
    bad = [name for name, value in (match.groupdict() if match else {}).items() if _lone(value)]
    raise InvalidRequest(
        bad[0] if bad else "path", "is not UTF-8 once its percent-escapes are decoded"
    )


def _lone(value: str) -> bool:
    """Whether ``value`` holds a byte that was no UTF-8 (a lone surrogate)."""
    return any("\udc80" <= char <= "\udcff" for char in value)


def query_parameters(request: Request, _tenant: Tenant) -> None:
    """Refuse a query parameter the route does not take, or one it takes given twice: a
    ``422`` naming it, as an unknown body field is. Ignored, a typo (``?statu=failed``,
    ``?wiat=10``) silently listed everything or did not wait, and ``?status=a&status=b`` kept
    the last. After the key check (``_tenant``), so a request without a key is still 401."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    known = _query_names(route.dependant)  # a walk of a few objects: no cache needed
    for name, times in Counter(name for name, _ in request.query_params.multi_items()).items():
        if name not in known:
            takes = ", ".join(sorted(known)) or "no query parameter"
            where = f"{request.method} {route.path_format}"
            if not name:  # "?=1": named as the query string, not as "" (": is not ...")
                raise InvalidRequest(
                    "query",
                    f"a parameter with no name is not a query parameter of {where} "
                    f"(it takes {takes})",
                )
            raise InvalidRequest(name, f"is not a query parameter of {where} (it takes {takes})")
        if times > 1:
            raise InvalidRequest(name, f"is given {times} times: give it once")


def body_as_read(request: Request, _tenant: Tenant) -> None:
    """Refuse a JSON body that is not JSON (``400`` naming ``body``), or one of whose objects
    gives a member twice (``{"limit": 3, "limit": 50}``: a ``422`` naming it, as a repeated
    query parameter is; ``json.loads`` kept the last silently). The body was read before
    (:class:`api_gateway.routing.Utf8JsonRequest`); this answers after the key check
    (``_tenant``), so a request without a key is 401 whatever its body. ``POST /v1/batches``
    reads its own body, after the key check too (:func:`api_gateway.bodies.parse_batch`)."""
    if (problem := request.scope.get(BODY_PROBLEM)) is not None:
        raise problem


def checked_headers(request: Request, _tenant: Tenant) -> None:
    """Refuse a header whose meaning is one value (``Idempotency-Key``) given on several
    lines: a ``422`` naming it, as a repeated query parameter is. Before, one of the values
    was silently used and the other ignored. And refuse an ``Idempotency-Key`` on a ``POST``
    or ``PATCH`` whose route does not honour it, as an unknown query parameter is: ignored,
    the client believed a resend gave back its first answer, and it ran again (``GET``,
    ``HEAD`` and ``DELETE`` are idempotent by HTTP's definition: there it adds nothing and is
    let be). After the key check (``_tenant``)."""
    for name in SINGLE_HEADERS:
        times = len(request.headers.getlist(name))
        if times > 1:
            raise InvalidRequest(name, f"is given {times} times: give it once")
    route = request.scope.get("route")
    if (
        request.method in ("POST", "PATCH")
        and IDEMPOTENCY_KEY in request.headers
        and isinstance(route, APIRoute)
        and not any(p.alias == IDEMPOTENCY_KEY for p in route.dependant.header_params)
    ):
        raise InvalidRequest(
            IDEMPOTENCY_KEY,
            f"is not taken by {request.method} {route.path}, which runs each time it is sent: "
            f"only {KEYED_ROUTES} replay a request by its key; send this one without it",
        )


def job_store(request: Request) -> JobStore:
    store: JobStore = request.app.state.store
    return store


def async_job_store(request: Request) -> AsyncJobStore:
    store: AsyncJobStore = request.app.state.async_store
    return store


def task_sender(request: Request) -> OutboxSender:
    sender: OutboxSender = request.app.state.sender
    return sender


def app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking Redis or broker call off the event loop."""
    return await run_in_threadpool(fn, *args, **kwargs)


async def poll_until(
    read: Callable[[], Awaitable[T | None]],
    final: Callable[[T], bool],
    wait: float,
    known: T | None = None,
) -> T | None:
    """Read until ``final`` or ``wait`` seconds pass, backing off from 5 ms to 100 ms; the
    last value read (None: the job is gone), or ``known`` if no read got through. A read
    that meets Redis away (a restart) is no news and the wait goes on: the request waiting
    made its job already, and a 503 had its client send it again and make a second one."""
    deadline = time.monotonic() + wait
    delay = POLL_MIN_SECONDS
    current = known
    away = False
    while True:
        try:
            current = await read()
        except STORE_AWAY as exc:
            if not away:
                log.warning("the job store is away while a request waits on its job: %s", exc)
            away = True
        else:
            if current is None or final(current):
                return current
        if time.monotonic() >= deadline:
            return current
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, POLL_MAX_SECONDS)


#: Stripe's header on an answer that is a job an earlier request with the same
#: ``Idempotency-Key`` made (``true``; absent on the request that made it).
REPLAYED_HEADER = "Idempotent-Replayed"
REPLAYED_HEADER_DOC: dict[str, dict[str, Any]] = {
    REPLAYED_HEADER: {
        "schema": {"type": "string", "enum": ["true"]},
        "description": "The job an earlier request with this Idempotency-Key made.",
    }
}


def location(request: Request, route: str, **params: str) -> dict[str, str]:
    """The ``Location`` header of a ``202``: the path of the job to poll, under this app's
    ``root_path`` (a relative reference, so it stays right behind a proxy that rewrites the
    host)."""
    path = request.app.url_path_for(route, **params)
    return {"Location": request.scope.get("root_path", "") + str(path)}


def job_answer(request: Request, body: str, *, final: bool, route: str, job_id: str) -> Response:
    """A job's JSON ``body``: ``200`` once it is ``final``, else ``202`` with the ``Location``
    of ``route`` (the job's ``GET``) to poll."""
    if final:
        return Response(body, media_type="application/json")
    headers = location(request, route, id=job_id)
    return Response(body, status_code=202, media_type="application/json", headers=headers)


def accepted(description: str, *, keyed: bool = False) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI entry of a route's ``202``: its description and its ``Location`` header
    (and, on a route that honours ``Idempotency-Key``, ``Idempotent-Replayed``)."""
    headers = {**LOCATION_HEADER, **(REPLAYED_HEADER_DOC if keyed else {})}
    return {202: {"description": description, "headers": headers}}


def encode_results_token(batch_id: str, offset: int) -> str:
    """The page token of a batch's results: the offset, and a digest that ties it to the
    batch (the digest is no secret: it only catches mix-ups and edits).

    >>> batch = "bat_" + "0" * 32
    >>> decode_results_token(encode_results_token(batch, 2), batch)
    2
    """
    return pack_token("r", token_digest(batch_id, str(offset)), str(offset))


def decode_results_token(token: str | None, batch_id: str) -> int:
    """The offset in a page token of ``batch_id``'s results (0 for none). Only the exact text
    :func:`encode_results_token` made for this batch is one: another batch's token (a bare
    offset was, and read this batch from there), a list's, or an edited one is a 422 naming
    ``page_token`` before Redis sees it, as the lists answer theirs."""
    parts = unpack_token(token, 3)
    if parts is None:
        return 0
    kind, _, value = parts
    offset = int(value) if value.isascii() and value.isdigit() else -1
    if (
        kind != "r"
        or not 0 <= offset <= MAX_BATCH_QUERIES
        or encode_results_token(batch_id, offset) != token
    ):
        raise InvalidRequest("page_token", NOT_OURS)
    return offset


NOT_OURS = "is not a token this list issued"


def token_digest(*fields: str) -> str:
    """What ties a page token to the list it was made for: a short digest of ``fields`` (no
    secret: it only catches mix-ups and edits)."""
    key = "\0".join(fields).encode()
    return hashlib.blake2b(key, digest_size=TOKEN_DIGEST_BYTES).hexdigest()


def max_cursor_chars(last_bytes: int) -> int:
    """The longest token :func:`encode_cursor` makes of a ``last`` of up to ``last_bytes``
    bytes ("k:<digest hex>:<last>" in unpadded base64)."""
    return 4 * -(-(3 + 2 * TOKEN_DIGEST_BYTES + last_bytes) // 3)


def encode_cursor(kind: str, scope: tuple[str, ...], last: str) -> str:
    """A listing's page token: its ``kind`` (one letter per listing), the last entry listed
    (a name, an id, a job's place), and a digest that ties it to ``scope`` (the listing it was
    made for: the tenant, and the index or list).

    >>> token = encode_cursor("i", ("i", "acme"), "docs")
    >>> decode_cursor(token, "i", ("i", "acme"), 128)
    'docs'
    >>> decode_cursor(token, "i", ("i", "bob"), 128)
    Traceback (most recent call last):
    worker.errors.InvalidRequest: page_token: is not a token this list issued
    """
    return pack_token(kind, token_digest(*scope, last), last)


def decode_cursor(token: str | None, kind: str, scope: tuple[str, ...], longest: int) -> str | None:
    """What ``token`` starts the page after (None: the first page). Only the exact text
    :func:`encode_cursor` made for this kind and scope is one; anything else (another
    tenant's, another listing's, an offset token a list gave before, an edited one) is a
    422 naming ``page_token``, which says nothing of what the token held. The digest is no
    secret (it only catches edits and mix-ups): a forged token starts the caller's own list
    somewhere, and shows nothing more than a page the caller may read anyway."""
    parts = unpack_token(token, 3)
    if parts is None:
        return None
    got, _, last = parts
    if got != kind or not 1 <= len(last) <= longest or encode_cursor(kind, scope, last) != token:
        raise InvalidRequest("page_token", NOT_OURS)
    return last


def pack_token(*fields: str) -> str:
    """A page token: ``fields`` joined by ``:``, URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(":".join(fields).encode()).decode().rstrip("=")


def unpack_token(token: str | None, fields: int) -> list[str] | None:
    """The ``fields`` of a page token :func:`pack_token` made (the last may hold ``:``);
    ``None`` for no token, a 422 naming ``page_token`` for an empty one or one not made so.
    Each list then checks its fields, and that packing them again gives the token exactly."""
    if token is None:
        return None
    if not token:
        raise InvalidRequest("page_token", "is empty: leave it out for the first page")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise InvalidRequest("page_token", NOT_OURS) from exc
    parts = raw.split(":", fields - 1)
    if len(parts) != fields:
        raise InvalidRequest("page_token", NOT_OURS)
    return parts
