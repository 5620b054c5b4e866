"""What the route modules share: the caller's tenant, the ``wait`` and ``page_size``
parameters, the app's job store and task sender, blocking calls off the event loop, ids checked
by shape, polling a job until it is final, and the ``202``'s ``Location``. The request checks
are :mod:`api_gateway.checks`'s, the page tokens :mod:`api_gateway.tokens`'s."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import redis
from fastapi import Depends, Query, Request, Response
from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError
from starlette.concurrency import run_in_threadpool

from api_gateway.auth import authenticate
from api_gateway.errors import ErrorBody
from api_gateway.queue import OutboxSender
from worker.constants import MAX_PAGE_SIZE, MAX_RESULTS_PAGE_BYTES, MAX_WAIT_SECONDS
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
ResultsPageSize = Annotated[
    int,
    Query(
        ge=1,
        le=MAX_PAGE_SIZE,
        description=f"Results per page at most: a page also ends before the first item whose "
        f"stored result would take its items' past {MAX_RESULTS_PAGE_BYTES // 2**20} MiB "
        f"(one larger than that is a page alone), so a page can hold fewer; go on while "
        f"`next_page_token` is not null.",
    ),
    DIGITS,
]
#: What a 503's type tells a client about its request (docs/queue.md, "The 503s")
UNAVAILABLE_DOC = (
    "Retry after `Retry-After` seconds; the type says whether the request may have been "
    "applied. `unavailable`: the job store (Redis) is down, restarting or did not answer in "
    "time, or another part the request needs did not answer (the message says which); a "
    "write may have been made before the failure, so send again only a request that is safe "
    "to repeat (a read, a merge patch, one with an `Idempotency-Key`). `job_store_full`: "
    "Redis is at its `maxmemory` or cannot persist to its disk, or new jobs are refused "
    "past 90 % of its `maxmemory`; nothing was "
    "stored, so the request may be sent again as it is, a delete job's too. `starting`: "
    "`sift gateway` still waits for its Redis and its start checks; nothing was stored, so "
    "the request may be sent again as it is, a delete job's too."
)
ERRORS: dict[int | str, dict[str, Any]] = {
    **{code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 415, 422)},
    503: {"model": ErrorBody, "description": UNAVAILABLE_DOC},
}
LOCATION_HEADER: dict[str, dict[str, Any]] = {
    "Location": {
        "schema": {"type": "string"},
        "description": "The job's URL, to poll (a path on this gateway).",
    }
}
POLL_MIN_SECONDS = 0.005
POLL_MAX_SECONDS = 0.1
_ID_DIGITS = re.compile(r"[0-9a-f]{32}")


def is_id(value: str, prefix: str) -> bool:
    """Whether ``value`` has the shape of the ids the store makes (``prefix`` and 32 hex
    digits). Any other is unknown without asking Redis: a client's text never becomes part
    of a key name, where it could name a key of another type (a WRONGTYPE error, a 5xx)."""
    return value.startswith(prefix) and _ID_DIGITS.fullmatch(value, len(prefix)) is not None


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
