"""Large request bodies, parsed off the event loop and a slice at a time.

FastAPI parses and validates a declared body on the event loop, in one pydantic call: for a
100,000-query batch that is about half a second with every other request waiting (and a C
call that long holds the GIL, so a thread alone would not help). ``POST /v1/batches``
therefore reads its raw body and validates it here, in a worker thread, a thousand queries
per pydantic call: between two calls the event loop gets the GIL back within the
interpreter's switch interval. The errors are pydantic's own, with the same ``loc`` FastAPI
gives them (``("body", "queries", 3, "id")``), so the answer is the same 422 naming the field.

The OpenAPI document still shows the model: :func:`document_bodies` adds its schema to the
components the route's ``openapi_extra`` refers to.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import Field, TypeAdapter, ValidationError

from api_gateway.schemas import BatchQueryIn, BatchRequest
from worker.constants import MAX_BATCH_QUERIES

VALIDATE_CHUNK = 1_000  # queries per pydantic call: a few milliseconds each
BATCH_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/BatchRequest"}}},
    }
}

_QUERIES = TypeAdapter(list[BatchQueryIn])


class _BatchHead(BatchRequest):
    """A batch's fields with its queries unchecked (they are checked a slice at a time)."""

    queries: list[Any] = Field(min_length=1, max_length=MAX_BATCH_QUERIES)


def parse_batch(raw: bytes) -> BatchRequest:
    """``BatchRequest.model_validate_json(raw)``, in slices of :data:`VALIDATE_CHUNK`
    queries; raises :class:`RequestValidationError` as FastAPI would."""
    if not raw:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required"}]
        )
    try:
        data = json.loads(raw)
    except ValueError as exc:
        pos = getattr(exc, "pos", 0)
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error",
              "input": {}, "ctx": {"error": getattr(exc, "msg", str(exc))}}]
        ) from exc  # fmt: skip
    errors: list[Any] = []
    try:
        head = _BatchHead.model_validate(data)
    except ValidationError as exc:
        errors += _located(exc, ("body",))
        head = None
    queries = data.get("queries") if isinstance(data, dict) else None
    if head is None and not (isinstance(queries, list) and len(queries) <= MAX_BATCH_QUERIES):
        raise RequestValidationError(errors)
    assert isinstance(queries, list)
    valid: list[BatchQueryIn] = []
    for start in range(0, len(queries), VALIDATE_CHUNK):
        try:
            valid += _QUERIES.validate_python(queries[start : start + VALIDATE_CHUNK])
        except ValidationError as exc:
            errors += _located(exc, ("body", "queries"), offset=start)
    if errors:
        raise RequestValidationError(errors)
    # the queries are model instances now: pydantic takes them as they are
    return BatchRequest.model_validate({**data, "queries": valid})


def _located(
    exc: ValidationError, prefix: tuple[str, ...], offset: int = 0
) -> list[dict[str, Any]]:
    """``exc``'s errors with their ``loc`` as FastAPI's would be: under ``prefix``, the
    first index moved by ``offset`` (a slice's position in the whole list)."""
    found = []
    for error in exc.errors(include_url=False):
        loc = list(error["loc"])
        if offset and loc and isinstance(loc[0], int):
            loc[0] += offset
        found.append({**error, "loc": (*prefix, *loc)})
    return found


def batch_fingerprint(route: str, body: BatchRequest) -> str:
    """``worker.jobstore.fingerprint(route, body.model_dump(mode="json"))``, byte for byte
    the same hash (a key used before keeps matching), serialized a slice of queries at a
    time: one ``model_dump`` of 100,000 queries would hold the GIL for a quarter second."""
    digest = hashlib.sha256()
    dump = body.model_dump(mode="json", exclude={"queries"})
    digest.update(b"[" + _canonical(route) + b",{")
    for i, name in enumerate(sorted([*dump, "queries"])):
        digest.update((b"," if i else b"") + _canonical(name) + b":")
        if name != "queries":
            digest.update(_canonical(dump[name]))
            continue
        digest.update(b"[")
        for start in range(0, len(body.queries), VALIDATE_CHUNK):
            part = _canonical(
                _QUERIES.dump_python(body.queries[start : start + VALIDATE_CHUNK], mode="json")
            )
            digest.update((b"," if start else b"") + part[1:-1])
        digest.update(b"]")
    digest.update(b"}]")
    return digest.hexdigest()


def _canonical(value: Any) -> bytes:
    """What ``fingerprint`` writes for ``value``."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()


def document_bodies(app: FastAPI) -> None:
    """Add :class:`BatchRequest`'s schema (and the models it uses) to ``app``'s OpenAPI
    components, exactly as FastAPI renders it for a route that declares the body."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            models = generate().setdefault("components", {}).setdefault("schemas", {})
            for name, schema in _declared_schemas().items():
                models.setdefault(name, schema)
        return app.openapi_schema or generate()

    app.openapi = openapi  # type: ignore[method-assign]


def _declared_schemas() -> dict[str, Any]:
    """The component schemas of an app whose one route declares a ``BatchRequest`` body
    (without FastAPI's own 422 body, which the gateway does not answer)."""
    probe = FastAPI()

    @probe.post("/")
    def declared(body: BatchRequest) -> None:
        """Never served: only its OpenAPI document is read."""

    schemas: dict[str, Any] = probe.openapi()["components"]["schemas"]
    return {k: v for k, v in schemas.items() if k not in ("HTTPValidationError", "ValidationError")}
