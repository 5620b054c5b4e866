"""JSONL input files, read line by line: what ``sift ingest``, ``sift batch`` and ``sift eval``
share, so each names a bad line the same way (``file:line: field 'x': ...``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO, TypeVar

from pydantic import ValidationError

T = TypeVar("T")


def open_text(path: Path) -> TextIO:
    """``path`` as text; bytes that are not UTF-8 are kept as lone surrogates
    (``surrogateescape``), which no decoded text holds, so :func:`parsed` names their line
    (a file cut off mid-line may be cut inside a character). Raises OSError."""
    return path.open(encoding="utf-8", errors="surrogateescape")


def numbered(handle: TextIO) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` per non-blank line, numbered from 1 as an editor does."""
    for number, line in enumerate(handle, start=1):
        if line.strip():
            yield number, line


def parsed(line: str) -> Any:
    """One line's JSON; raises ValueError saying it is not UTF-8 or not JSON.

    >>> parsed('{"id": "a"}')
    {'id': 'a'}
    >>> parsed("{nope")
    Traceback (most recent call last):
    ValueError: not valid JSON (Expecting property name enclosed in double quotes)
    """
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # a byte surrogateescape kept: the line is not UTF-8
        raise ValueError("not UTF-8 text") from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None


def field_problem(exc: ValidationError, whole: str = "document") -> str:
    """pydantic's first error as ``field 'a.b': message`` (``whole`` when it is the line's)."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or whole
    return f"field {where!r}: {first['msg']}"


def lines(path: Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, str]]:
    """:func:`numbered` lines of ``path``; raises ``error`` ``path: cannot read (...)``."""
    try:
        handle = open_text(path)
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc})") from exc
    with handle:
        yield from numbered(handle)


def records(path: Path, parse: Callable[[Any], T]) -> Iterator[tuple[int, T]]:
    """``(line number, parse(line's JSON))`` per non-blank line of ``path``. Raises
    ValueError ``path:line: problem`` at the first bad line (``parse`` raises ValueError
    naming the field), or ``path: cannot read (...)``."""
    for number, line in lines(path):
        try:
            record = parse(parsed(line))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        yield number, record
