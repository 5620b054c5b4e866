"""Large request bodies, parsed off the event loop and a piece at a time.

FastAPI parses and validates a declared body on the event loop, in one pydantic call: for a
100,000-query batch that is about half a second with every other request waiting. A thread
alone would not do: a long C call holds the GIL (``json.loads`` of the 6 MB body, 30-100
ms; one pydantic call over every query, 0.5 s), and so does the garbage collector, whose
full passes walked the 100,000 query models kept alive together (up to 0.3 s each).
``POST /v1/batches`` therefore reads its raw body and hands it to :func:`parse_batch`, in a
worker thread, which decodes the JSON an array element per call, validates a thousand
queries per pydantic call and turns them into strings (each query's ``SearchSpec`` JSON,
and their share of the fingerprint) before the next thousand. Between two calls the event
loop gets the GIL back within the interpreter's switch interval. The errors are pydantic's
own, with the ``loc`` FastAPI gives them (``("body", "queries", 3, "id")``), so the answer
is the same 4xx naming the field.

Why a scanner of its own over the standard library's ``JSONDecoder.raw_decode``, not a
library: ``json.loads`` and jiter (pydantic's parser) decode a whole text in one call. An
incremental parser such as ijson does decode a piece at a time, but not in this shape: its
``kvitems`` builds each top-level value (the queries array, the one that matters) whole,
its ``items`` reads one path per pass, and its events would be a Python call per token;
its numbers are ``Decimal`` unless asked, and its errors are not ``json``'s message and
position, which the 400 quotes. This one falls back to ``json.loads`` for anything it does
not follow, so the answer is always ``json.loads``'s.

Every JSON body, on every route, is read as UTF-8 alone (:func:`json_text`; the route class
in :mod:`api_gateway.routing` gives FastAPI's handlers the same rule), and an object in it
that gives a member twice is a ``422`` naming the member (:func:`repeated_member`), at any
depth: ``json.loads`` kept the last silently. So is an integer of more digits than Python's
``int()`` reads (:class:`LongInteger`), which ``json.loads`` refused as a whole text.

The OpenAPI document still shows the model: :func:`document_bodies` adds its schema to the
components the route's ``openapi_extra`` refers to.
"""

from __future__ import annotations

import email.message
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import Field, TypeAdapter, ValidationError

from api_gateway.backpressure import traced_candidates, waiting_candidates
from api_gateway.schemas import BatchQueryIn, BatchRequest
from worker.constants import MAX_BATCH_QUERIES
from worker.contract import SearchSpec
from worker.errors import InvalidRequest
from worker.jsonl import TWICE, Loc, Members
from worker.settings import Settings

VALIDATE_CHUNK = 1_000  # queries per pydantic call: a few milliseconds each
#: The rerank window of a query that sets none, by default (SIFT_RERANK_CANDIDATE_LIMIT's)
DEFAULT_WINDOW: int = Settings.model_fields["rerank_candidate_limit"].default
BATCH_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/BatchRequest"}}},
    }
}

_QUERIES = TypeAdapter(list[BatchQueryIn])


class BatchHead(BatchRequest):
    """A batch's fields, with its queries as received (they are checked a slice at a time)."""

    queries: list[Any] = Field(min_length=1, max_length=MAX_BATCH_QUERIES)


@dataclass(frozen=True, slots=True)
class ParsedBatch:
    """A valid batch body: its fields, each query's id and ``SearchSpec`` JSON in order,
    its fingerprint (``""`` unless asked for), the most hits its results hold (the sum of
    its queries' limits), the candidates their traces list (:func:`traced_candidates`) and
    those its economy items keep while they wait at the provider
    (:func:`waiting_candidates`): what it will take of the job store, :func:`batch_bytes`."""

    head: BatchHead
    items: list[tuple[str, str]]
    fingerprint: str
    hits: int = 0
    traced: int = 0
    waiting: int = 0


def read_as_json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body sent under ``content_type`` as JSON (its strict rule:
    ``application/json`` or ``application/*+json``, parameters aside; no type at all is not).
    ``POST /v1/batches`` reads its body itself, so it asks this to refuse the same bodies.

    >>> [read_as_json(t) for t in ("application/json; charset=utf-8", "APPLICATION/x+json")]
    [True, True]
    >>> [read_as_json(t) for t in (None, "", "text/plain", "text/json", "application/jsonx")]
    [False, False, False, False, False]
    """
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def parse_batch(
    raw: bytes,
    route: str | None = None,
    *,
    rerank_default: bool | None = None,
    window: int = DEFAULT_WINDOW,
) -> ParsedBatch:
    """A ``POST /v1/batches`` body, validated as ``BatchRequest`` a slice of
    :data:`VALIDATE_CHUNK` queries at a time; with ``route``, its fingerprint (of the body
    as sent). Each query's spec says ``rerank_default`` (the gateway's ``SIFT_RERANK_ENABLED``)
    where the batch leaves ``rerank`` out, so the worker never decides it; ``window`` is the
    rerank window of one that sets no ``candidate_limit`` (``SIFT_RERANK_CANDIDATE_LIMIT``),
    for the candidates its trace lists, and an economy item keeps while it waits. Raises
    :class:`RequestValidationError` as FastAPI would, then :class:`InvalidRequest` for a
    member given twice or an integer too long to read (first), or a repeated query id.

    Each slice becomes strings (the specs' JSON) before the next: the model instances of
    100,000 queries, kept alive together, had the garbage collector's full passes walk them
    again and again, up to 0.3 s each with the GIL held."""
    data, problem = _json(raw)
    if problem is not None:
        raise problem
    errors: list[Any] = []
    try:
        head: BatchHead | None = BatchHead.model_validate(data)
    except ValidationError as exc:
        errors += _located(exc, ("body",))
        head = None
    queries = data.get("queries") if isinstance(data, dict) else None
    if head is None and not (isinstance(queries, list) and len(queries) <= MAX_BATCH_QUERIES):
        raise RequestValidationError(errors, body=data)
    assert isinstance(queries, list)
    items: list[tuple[str, str]] = []
    hits = traced = waiting = 0
    first_seen: dict[str, int] = {}
    repeated: InvalidRequest | None = None
    digest = _Fingerprint(route, head) if route and head else None
    for start in range(0, len(queries), VALIDATE_CHUNK):
        try:
            part = _QUERIES.validate_python(queries[start : start + VALIDATE_CHUNK])
        except ValidationError as exc:
            errors += _located(exc, ("body", "queries"), offset=start)
            continue
        if errors or head is None:
            continue  # only the remaining errors matter now
        for i, query in enumerate(part, start):
            if repeated is None and query.id in first_seen:
                repeated = InvalidRequest(
                    f"queries[{i}].id",
                    f"duplicate id {query.id!r} (first at queries[{first_seen[query.id]}])",
                )
            first_seen.setdefault(query.id, i)
            spec = _spec(head, query, rerank_default)
            hits += spec.limit
            traced += traced_candidates(spec, window)
            waiting += waiting_candidates(spec, window, head.lane)
            items.append((query.id, spec.model_dump_json()))
        if digest is not None:
            digest.add(part)
    if errors:
        raise RequestValidationError(errors, body=data)
    if repeated is not None:
        raise repeated
    assert head is not None
    return ParsedBatch(head, items, digest.hexdigest() if digest else "", hits, traced, waiting)


def json_text(raw: bytes) -> str:
    """A JSON body's text, read as UTF-8 alone (RFC 8259 §8.1: JSON between systems is
    UTF-8); raises :class:`json.JSONDecodeError` (a ``400`` naming ``body``) for any other
    encoding. ``json.loads`` of bytes guesses UTF-16 or UTF-32 from the zero bytes, so such
    a body was read. A UTF-8 byte order mark is skipped, as the RFC lets a parser do.
    ``surrogatepass``: an encoded lone surrogate is left for the field's own check (a 422
    naming it), as ``json.loads`` leaves it."""
    try:
        text = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 (byte 0x{raw[exc.start]:02x} at {exc.start}; RFC 8259 asks for UTF-8)"
        raise json.JSONDecodeError(why, "", exc.start) from exc
    if "\0" in text:  # no JSON text holds a NUL byte: UTF-16 or UTF-32 does
        at = text.index("\0")
        raise json.JSONDecodeError(f"not UTF-8 (a zero byte at {at}: UTF-16 or UTF-32?)", "", at)
    return text.removeprefix("\ufeff")


def repeated_member(loc: Loc, times: int) -> InvalidRequest:
    """The ``422`` of a body whose object at ``loc`` gives its last key ``times`` times.

    >>> repeated_member(("options", "limit"), 2).message
    'options.limit: is given 2 times: give it once'
    >>> repeated_member(("queries", 3, "filters", "k"), 3).field
    'queries[3].filters.k'

    A name holding a lone surrogate (``"\\ud800"`` is valid JSON, and no UTF-8) is named as
    pydantic names it, each of its bytes a U+FFFD: as it was, the answer could not be
    written in UTF-8, a ``500`` (a connection reset on ``POST /v1/batches``).

    >>> repeated_member(("filters", "\\ud800"), 2).field == "filters." + "\\ufffd" * 3
    True
    """
    return InvalidRequest(field_of(loc), TWICE.format(times=times))


def field_of(loc: Loc) -> str:
    """The name of the member at ``loc``, as a field is named (``queries[3].id``)."""
    field = ""
    for part in loc:
        if isinstance(part, int):
            field += f"[{part}]"
        else:
            name = part.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
            field += ("." if field else "") + name
    return field


class LongInteger:
    """Where a JSON text has an integer of more digits than Python's ``int()`` reads from
    text (``sys.get_int_max_str_digits()``, 4,300): valid JSON, past every bound a field of
    the API has. It stands in the value decoded for the integer, so the member holding it is
    named (:func:`long_integer`); ``json.loads`` refused the whole text with a ``ValueError``
    that named no member and told the client to call ``sys.set_int_max_str_digits()``."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _integer(text: str) -> int | LongInteger:
    """A JSON integer's value; a :class:`LongInteger` for one too long for ``int()``."""
    try:
        return int(text)
    except ValueError:
        return LongInteger(len(text.lstrip("-")))


def long_integer(value: Any) -> InvalidRequest | None:
    """The ``422`` of the first :class:`LongInteger` in ``value`` (in the text's order),
    naming its member; ``None`` when there is none.

    >>> long_integer({"a": [1, {"b": LongInteger(5000)}]}).message
    'a[1].b: is an integer of 5000 digits, past any limit here'
    >>> long_integer({"a": 1}) is None
    True
    """
    stack: list[tuple[Any, Loc]] = [(value, ())]
    while stack:  # depth first, in order, without recursion (a text may nest deep)
        node, loc = stack.pop()
        if isinstance(node, LongInteger):
            return InvalidRequest(
                field_of(loc) or "body",
                f"is an integer of {node.digits} digits, past any limit here",
            )
        if isinstance(node, (dict, list)):
            children = node.items() if isinstance(node, dict) else enumerate(node)
            stack.extend((child, (*loc, at)) for at, child in reversed(list(children)))
    return None


def loads_checked(text: str) -> tuple[Any, InvalidRequest | None]:
    """``json.loads(text)``, and the ``422`` of the first object in it that gives a member more
    than once, or else of an integer too long to read (:class:`LongInteger`); ``None`` when
    neither. The check is a dict and a length per object."""
    return _checked(text, lambda text, members: json.loads(text, object_pairs_hook=members))


def _checked(text: str, decode: Callable[[str, Members], Any]) -> tuple[Any, InvalidRequest | None]:
    """``decode(text, members)`` and its ``422``, as :func:`loads_checked` says. A
    ``ValueError`` that is no ``JSONDecodeError`` is an integer too long for ``int()``: the
    text is decoded again, each such integer a :class:`LongInteger`, and only then is the
    value walked to find it (a body without one is not walked)."""
    members = Members()
    try:
        value = decode(text, members)
        long = None
    except json.JSONDecodeError:
        raise
    except ValueError:
        members = Members()
        value = json.loads(text, object_pairs_hook=members, parse_int=_integer)
        long = long_integer(value)
    if (repeated := members.first_repeated(value)) is not None:
        return value, repeated_member(*repeated)
    return value, long


def _json(raw: bytes) -> tuple[Any, InvalidRequest | None]:
    """The body, decoded as ``json.loads`` would (UTF-8 alone: :func:`json_text`), and the
    ``422`` of a member it gives twice or of an integer too long to read, if any (as
    :func:`loads_checked`); raises :class:`RequestValidationError`."""
    if not raw:
        raise RequestValidationError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required"}]
        )
    try:
        return _checked(json_text(raw), loads_in_pieces)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise not_json(exc) from exc


def not_json(exc: ValueError | RecursionError) -> RequestValidationError:
    """The ``400`` naming ``body`` of a body ``json.loads`` refused, as FastAPI words it."""
    pos = getattr(exc, "pos", 0)
    return RequestValidationError(
        [{"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error",
          "input": {}, "ctx": {"error": getattr(exc, "msg", str(exc))}}]
    )  # fmt: skip


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _skip(text: str, at: int) -> int:
    """Where the whitespace from ``text[at]`` on ends."""
    space = _SPACE.match(text, at)
    assert space is not None  # the pattern matches the empty string
    return space.end()


class _NotSimple(Exception):
    """The text is not an object whose values this scanner reads: ``json.loads`` decides."""


def loads_in_pieces(text: str, members: Members | None = None) -> Any:
    """``json.loads(text, object_pairs_hook=members)``, but a top-level object's arrays are
    decoded one element per call: ``json.loads`` of a 6 MB batch is one 30-100 ms call
    holding the GIL. Anything this scanner does not follow (not an object, malformed) goes
    to ``json.loads``, whose answer or error is then the one given. ``members`` notes every
    object of the value returned that gives a member twice, the top-level one too."""
    try:
        return _object(text, json.JSONDecoder(object_pairs_hook=members), members)
    except (_NotSimple, ValueError, IndexError):
        if members is not None:
            members.clear()  # what the scanner noted is not of json.loads's value
        return json.loads(text, object_pairs_hook=members)


def _object(text: str, decoder: json.JSONDecoder, members: Members | None) -> dict[str, Any]:
    at = _skip(text, 0)
    if text[at] != "{":
        raise _NotSimple
    found: dict[str, Any] = {}
    keys: list[str] = []
    at = _skip(text, at + 1)
    if text[at] == "}":
        return _end(text, at + 1, found)
    while True:
        if text[at] != '"':
            raise _NotSimple
        key, at = _DECODER.raw_decode(text, at)
        keys.append(key)
        at = _skip(text, at)
        if text[at] != ":":
            raise _NotSimple
        at = _skip(text, at + 1)
        if text[at] == "[":
            found[key], at = _array(text, at, decoder)
        else:
            found[key], at = decoder.raw_decode(text, at)
        at = _skip(text, at)
        if text[at] == "}":
            if members is not None and len(keys) != len(found):
                members.note(found, keys)
            return _end(text, at + 1, found)
        if text[at] != ",":
            raise _NotSimple
        at = _skip(text, at + 1)


def _array(text: str, at: int, decoder: json.JSONDecoder) -> tuple[list[Any], int]:
    """The array at ``text[at]`` (a ``[``), an element per decoder call; and where it ends."""
    items: list[Any] = []
    at = _skip(text, at + 1)
    if text[at] == "]":
        return items, at + 1
    while True:
        item, at = decoder.raw_decode(text, at)
        items.append(item)
        at = _skip(text, at)
        if text[at] == "]":
            return items, at + 1
        if text[at] != ",":
            raise _NotSimple
        at = _skip(text, at + 1)


def _end(text: str, at: int, found: dict[str, Any]) -> dict[str, Any]:
    if _skip(text, at) != len(text):
        raise _NotSimple  # trailing data
    return found


def _spec(head: BatchHead, query: BatchQueryIn, rerank_default: bool | None) -> SearchSpec:
    """The search one query of the batch asks for; ``rerank_default`` where it asks none."""
    spec: dict[str, Any] = {
        "index": head.index,
        "query": query.query,
        "rerank": rerank_default if head.rerank is None else head.rerank,
        "include_trace": head.include_trace,
        "filters": query.filters,
        "fusion": head.fusion,
        "candidate_limit": head.candidate_limit,
    }
    if query.limit is not None:
        spec["limit"] = query.limit
    if query.mode is not None:
        spec["mode"] = query.mode
    return SearchSpec.model_validate(spec)


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


class _Fingerprint:
    """``worker.queue.jobstore.fingerprint(route, body.model_dump(mode="json"))`` of a batch, byte
    for byte the same hash (a key used before keeps matching its body), fed a slice of
    queries at a time: one ``model_dump`` of 100,000 queries holds the GIL for 0.2 s."""

    def __init__(self, route: str, head: BatchHead) -> None:
        self.digest = hashlib.sha256()
        self.after: list[bytes] = []  # the fields sorted after "queries"
        self.first = True
        fields = head.model_dump(mode="json", exclude={"queries"})
        self.digest.update(b"[" + _canonical(route) + b",{")
        for i, name in enumerate(sorted([*fields, "queries"])):
            text = (b"," if i else b"") + _canonical(name) + b":"
            if name == "queries":
                self.digest.update(text + b"[")
                self.after = [b"]"]
            elif self.after:
                self.after.append(text + _canonical(fields[name]))
            else:
                self.digest.update(text + _canonical(fields[name]))

    def add(self, queries: list[BatchQueryIn]) -> None:
        part = _canonical(_QUERIES.dump_python(queries, mode="json"))
        self.digest.update((b"" if self.first else b",") + part[1:-1])
        self.first = False

    def hexdigest(self) -> str:
        for text in self.after:
            self.digest.update(text)
        self.digest.update(b"}]")
        return self.digest.hexdigest()


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
