"""The economy lane's names for what it sends: each request's ``custom_id``, each create's
submission token, and the grouping of requests into provider batches under the provider's
limits. Pure: no I/O."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
SUBMISSION_CHARS = 12
_ENVELOPE = len('{"requests":[]}')


def custom_id(position: int, submission: str) -> str:
    """The ``custom_id`` of the item at ``position`` in the provider batch a submission
    creates (``^[a-zA-Z0-9_-]{1,64}$``): ``i<position>-<submission>``. The submission part
    tells a result of this create from one of any other provider batch."""
    return f"i{position}-{submission}"


def position_of(value: str) -> int | None:
    """The position a ``custom_id`` names, or None for one Sift did not write."""
    head = value.split("-", 1)[0]
    if not head.startswith("i") or not head[1:].isdigit():
        return None
    return int(head[1:])


def submission_of(value: str) -> str | None:
    """The submission a ``custom_id`` names (None: none)."""
    _, dash, tail = value.partition("-")
    return tail if dash and tail else None


def new_submission() -> str:
    """A fresh submission token: each create's own, written before the call is made."""
    return uuid.uuid4().hex[:SUBMISSION_CHARS]


def chunk_requests(
    requests: Iterable[T], size: Callable[[T], int], *, max_requests: int, max_bytes: int
) -> Iterator[list[T]]:
    """Group requests into provider batches: at most ``max_requests`` each, and a body
    (``{"requests":[r1,r2,...]}``, ``size(r)`` bytes per request) of at most ``max_bytes``.

    >>> [len(c) for c in chunk_requests(["ab"] * 5, len, max_requests=2, max_bytes=100)]
    [2, 2, 1]
    """
    chunk: list[T] = []
    used = _ENVELOPE
    for request in requests:
        n = size(request)
        if chunk and (len(chunk) >= max_requests or used + 1 + n > max_bytes):
            yield chunk
            chunk, used = [], _ENVELOPE
        used += n + (1 if chunk else 0)
        chunk.append(request)
    if chunk:
        yield chunk
