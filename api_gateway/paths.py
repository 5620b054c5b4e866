"""A request path as its segments: a slash sent percent-encoded (``%2F``) is part of a
segment, never a boundary between two.

The server (uvicorn) decodes the whole path before routing, so ``demo%2Fdocuments%2Fchess-3``
became three segments: ``DELETE /v1/indexes/demo%2Fdocuments%2Fchess-3`` (the drop of an
index named ``demo/documents/chess-3``) deleted document ``chess-3`` of index ``demo``. Here
each encoded slash is held as :data:`SLASH_IN_SEGMENT`, which no route's literal text and
no ``{param}`` boundary matches as a ``/``, and given back as ``/`` in the parameter that holds
it (see :class:`api_gateway.routing.GetAnswersHead`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote_to_bytes

# A lone surrogate: a path decoded from UTF-8 never holds one (bad bytes decode to U+FFFD,
# or, decoded with "surrogateescape", to U+DC80..U+DCFF), so it stands for nothing else
SLASH_IN_SEGMENT = "\ud800"
_ENCODED_SLASH = re.compile(rb"%2f", re.IGNORECASE)


def has_encoded_slash(raw: bytes) -> bool:
    """Whether the raw path holds a percent-encoded slash.

    >>> has_encoded_slash(b"/v1/indexes/demo%2fx"), has_encoded_slash(b"/v1/indexes/demo/x")
    (True, False)
    """
    return _ENCODED_SLASH.search(raw) is not None


def decode_segments(raw: bytes, decode: Callable[[bytes], str]) -> str:
    """The raw path percent-decoded, its bytes read by ``decode``, with each encoded slash held
    as :data:`SLASH_IN_SEGMENT` (a ``/`` byte is ASCII: no UTF-8 sequence spans one).

    >>> utf8 = lambda b: b.decode("utf-8", "replace")
    >>> decode_segments(b"/v1/indexes/a%2Fb%20c/x", utf8) == "/v1/indexes/a\\ud800b c/x"
    True
    """
    pieces = _ENCODED_SLASH.split(raw)
    return SLASH_IN_SEGMENT.join(decode(unquote_to_bytes(piece)) for piece in pieces)


def routed_path(scope: Mapping[str, Any]) -> str | None:
    """The path to route ``scope`` on when its raw path holds an encoded slash: the routed
    ``path`` with each such slash held as :data:`SLASH_IN_SEGMENT`. ``None`` when there is
    none, or the raw path does not decode to ``path`` as the server decoded it (a server that
    sets ``raw_path`` otherwise): then ``path`` is routed as it is.

    >>> scope = {"path": "/v1/indexes/a/b", "raw_path": b"/v1/indexes/a%2Fb"}
    >>> routed_path(scope) == "/v1/indexes/a\\ud800b"
    True
    >>> routed_path({"path": "/v1/indexes/a/b", "raw_path": b"/v1/indexes/a/b"}) is None
    True
    """
    raw = scope.get("raw_path")
    if not isinstance(raw, bytes) or not has_encoded_slash(raw):
        return None
    kept = decode_segments(raw, lambda part: part.decode("utf-8", "replace"))
    return kept if kept.replace(SLASH_IN_SEGMENT, "/") == scope.get("path") else None


def slashes_back(params: dict[str, Any]) -> dict[str, Any]:
    """Path parameters with each held slash given back as ``/``.

    >>> slashes_back({"index": "a\\ud800b", "n": 3})
    {'index': 'a/b', 'n': 3}
    """
    return {
        name: value.replace(SLASH_IN_SEGMENT, "/") if isinstance(value, str) else value
        for name, value in params.items()
    }
