"""The gateway's route class: a ``GET`` route answers ``HEAD`` too, a JSON body is read as
UTF-8 alone, and a path is routed on its segments (an encoded slash is no boundary)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

from api_gateway.bodies import json_text, loads_checked, not_json
from api_gateway.paths import routed_path, slashes_back

BODY_PROBLEM = "sift.body_problem"  # the scope key :class:`Utf8JsonRequest` sets


class Utf8JsonRequest(Request):
    """A request whose JSON body is read as UTF-8 alone (:func:`json_text`): Starlette's
    ``json.loads`` of the bytes read UTF-16 and UTF-32 too. A body that is not JSON, that
    gives a member twice, or that holds an integer too long to read (:func:`loads_checked`),
    is kept in the scope as its error (:data:`BODY_PROBLEM`) for
    :func:`api_gateway.checks.body_as_read`, which raises it after the key check: FastAPI
    reads the body before any dependency runs, so a body not JSON was a ``400`` to a caller
    without a key, and any error here but a ``JSONDecodeError`` is its ``400`` "There was an
    error parsing the body"."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json, problem = loads_checked(json_text(await self.body()))
            except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
                self._json, problem = None, None
                self.scope[BODY_PROBLEM] = not_json(exc)
            if problem is not None:
                self.scope[BODY_PROBLEM] = problem
        return self._json


class GetAnswersHead(APIRoute):
    """A route whose ``GET`` also answers ``HEAD`` (RFC 9110 9.3.2): the ``GET`` runs, with
    its key, tenant and parameter checks, and its status and headers are the answer; the
    server (uvicorn) sends no body to a ``HEAD``. FastAPI's routes take the methods they are
    declared with alone, so ``HEAD`` was a ``405`` everywhere but on the probes. ``HEAD`` is
    not made a method of the route: the OpenAPI document lists the ``GET``, not a ``head``
    operation beside each with the same id."""

    def _as_get(self, scope: Scope) -> Scope:
        if scope["type"] == "http" and scope["method"] == "HEAD" and "GET" in (self.methods or ()):
            return {**scope, "method": "GET"}
        return scope

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        """Matched on the path's segments (:mod:`api_gateway.paths`): a parameter's value
        never crosses a slash that was sent as one, nor takes a slash sent as ``%2F`` for a
        boundary. The server's decoded path made ``DELETE /v1/indexes/demo%2Fdocuments%2Fd1``
        the delete of document ``d1``; it is the drop of index ``demo/documents/d1`` (a 422
        naming ``index``), and ``.../documents/a%2Fb`` is document ``a/b``."""
        scope = self._as_get(scope)
        kept = routed_path(scope)
        if kept is None:
            return super().matches(scope)
        match, child = super().matches({**scope, "path": kept})
        if match is not Match.NONE:
            child = {**child, "path_params": slashes_back(child["path_params"])}
        return match, child

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().handle(self._as_get(scope), receive, send)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler, given a :class:`Utf8JsonRequest` (FastAPI's documented way
        to change how a route reads its body)."""
        handler = super().get_route_handler()

        async def utf8_json(request: Request) -> Response:
            return await handler(Utf8JsonRequest(request.scope, request.receive))

        return utf8_json
