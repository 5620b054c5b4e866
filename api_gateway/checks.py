"""The request checks every ``/v1`` route runs after the key check: a gateway that is ready
(not still waiting for its Redis's start checks), path parameters that are UTF-8, only the
query parameters the route takes (each once), a body that is JSON with no member given
twice and none where the route reads none, and ``Idempotency-Key`` once and only where it
is honoured."""

from __future__ import annotations

from collections import Counter
from typing import Any

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.params import Depends as Dependency
from fastapi.routing import APIRoute

from api_gateway.deps import Tenant
from api_gateway.errors import (
    UNAVAILABLE_RETRY_AFTER,
    UNAVAILABLE_RETRY_AFTER_SECONDS,
    ApiError,
    no_route_short_of_a_line_break,
)
from api_gateway.paths import decode_segments
from api_gateway.routing import BODY_PROBLEM
from worker.constants import ERROR_STARTING
from worker.errors import InvalidRequest

IDEMPOTENCY_KEY = "Idempotency-Key"
SINGLE_HEADERS = (IDEMPOTENCY_KEY,)  # each given at most once (checked_headers)
# the POST routes that honour the key (and the DELETEs of a document or an index)
KEYED_ROUTES = (
    "POST /v1/searches, POST /v1/batches, POST /v1/indexes/{index}/documents and "
    "POST /v1/indexes/{index}/documents/delete"
)


def _query_names(dependant: Dependant) -> frozenset[str]:
    """The query parameters a route's ``dependant`` takes: its own and its dependencies'."""
    names = {param.alias for param in dependant.query_params}
    return frozenset(names.union(*(_query_names(d) for d in dependant.dependencies)))


def not_starting(request: Request, _tenant: Tenant) -> None:
    """503 ``starting`` while ``sift gateway`` still waits for its Redis and its start checks
    (``/readyz`` says the same): a request let through in the moment between Redis answering
    and the checks refusing it would have been stored on a Redis the gateway then refused to
    serve. Nothing is stored, and the type says so, as ``job_store_full``'s does: any request
    may be sent again, a delete job's too. It was ``unavailable``, whose write may have been
    made, so ``sift index delete`` stopped saying the delete may have run."""
    if (starting := request.app.state.starting) is not None:
        message = f"{starting}; nothing was stored; retry after {UNAVAILABLE_RETRY_AFTER_SECONDS} s"
        raise ApiError(503, ERROR_STARTING, message, headers=UNAVAILABLE_RETRY_AFTER)


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
    the client believed a resend gave back its first answer, and it ran again (``GET`` and
    ``HEAD`` are idempotent by HTTP's definition: there it adds nothing and is let be; a
    ``DELETE`` of a document or an index honours it). After the key check (``_tenant``)."""
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


#: the methods whose routes read no body (a ``DELETE`` of a document or an index, every read)
BODILESS_METHODS = ("GET", "HEAD", "DELETE")


async def no_unread_body(request: Request, _tenant: Tenant) -> None:
    """Refuse a body sent to a route that reads none (a ``GET``, ``HEAD`` or ``DELETE``): a
    ``422`` naming ``body``, as an unknown query parameter is, before anything is done.
    Ignored, an Elasticsearch user's ``GET /v1/searches`` with a search in its body would be
    answered ``200`` with the list of past searches, and a ``DELETE`` of one document with
    ``{"ids": [...]}`` would delete that one alone, answered as done. An empty body (a client's
    ``Content-Length: 0``) is no body. After the key check (``_tenant``), so a request
    without a key is 401 whatever its body."""
    route = request.scope.get("route")
    if request.method not in BODILESS_METHODS or not isinstance(route, APIRoute):
        return
    if await request.body():
        raise InvalidRequest(
            "body", f"{request.method} {route.path_format} takes no body; send it without one"
        )


#: The dependencies of every route of the app, the probes' and ``/metrics`` too: a path its
#: route matched short of a last line break is a ``404``
EVERY_ROUTE: list[Dependency] = [Depends(no_route_short_of_a_line_break)]
#: The dependencies of every ``/v1`` route (their routers'), each after the key check: a
#: gateway still starting is a 503; a path parameter's percent-escapes that are no UTF-8 are
#: a 422 naming it, an unknown or repeated query parameter too, and so is a repeated
#: Idempotency-Key or one on a POST or PATCH that does not honour it; a body not JSON is a
#: 400, one that gives a member twice a 422, and so is one sent to a route that reads none
V1_ROUTE: list[Dependency] = [
    *EVERY_ROUTE,
    Depends(not_starting),
    Depends(path_is_utf8),
    Depends(query_parameters),
    Depends(checked_headers),
    Depends(body_as_read),
    Depends(no_unread_body),
]
