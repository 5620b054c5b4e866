"""The gateway's route class: a ``GET`` route answers ``HEAD`` too."""

from __future__ import annotations

from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import Receive, Scope, Send


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
        return super().matches(self._as_get(scope))

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().handle(self._as_get(scope), receive, send)
