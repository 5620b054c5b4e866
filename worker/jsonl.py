"""JSONL input files, read line by line: what ``sift ingest``, ``sift batch`` and ``sift eval``
share, so each names a bad line the same way (``file:line: field 'x': ...``).

And what they share with the gateway's JSON bodies: an object that gives a member twice is
refused (:class:`Members`), naming it. ``json.loads`` keeps the last silently, so
``{"limit": 3, "limit": 50}`` asked for 50 whatever the writer meant."""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, TextIO, TypeAlias, TypeVar

from pydantic import ValidationError

T = TypeVar("T")
Loc: TypeAlias = tuple[str | int, ...]  # a value's place in a JSON text: keys and positions
TWICE = "is given {times} times: give it once"  # as a repeated query parameter is answered


class Members:
    """An ``object_pairs_hook``: each JSON object a dict as ``json.loads`` makes it (the last
    of a repeated member wins), noting those that give a member more than once. One per
    text decoded. Only a dict and a length are checked per object; the repeated member's
    place is found afterwards, when there is one (:meth:`first_repeated`).

    >>> members = Members()
    >>> value = json.loads('{"a": [{"b": 1, "b": 2, "b": 3}]}', object_pairs_hook=members)
    >>> value, members.first_repeated(value)
    ({'a': [{'b': 3}]}, (('a', 0, 'b'), 3))
    """

    __slots__ = ("_marked",)

    def __init__(self) -> None:
        # the objects themselves are kept: an id is another's once its object is let go
        self._marked: dict[int, tuple[dict[str, Any], str, int]] = {}

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        found = dict(pairs)
        if len(found) != len(pairs):
            self.note(found, [key for key, _ in pairs])
        return found

    def note(self, found: dict[str, Any], keys: list[str]) -> None:
        """Note ``found``, an object whose members' names in order were ``keys``, when one
        is given more than once (its first such, and how many times)."""
        times: dict[str, int] = {}
        for key in keys:
            times[key] = times.get(key, 0) + 1
        repeated = next((key for key, n in times.items() if n > 1), None)
        if repeated is not None:
            self._marked.setdefault(id(found), (found, repeated, times[repeated]))

    def clear(self) -> None:
        """Forget every object noted (the text is to be decoded again)."""
        self._marked.clear()

    def first_repeated(self, value: Any) -> tuple[Loc, int] | None:
        """Where in ``value`` (the text's value) a member is first given more than once, in
        the text's order, outermost first, and how many times; ``None``: nowhere. A walk of
        ``value`` only when some object was noted."""
        if not self._marked:
            return None
        stack: list[tuple[Any, Loc]] = [(value, ())]
        while stack:  # depth first, in order, without recursion (a text may nest deep)
            node, loc = stack.pop()
            if isinstance(node, dict):
                if (mark := self._marked.get(id(node))) is not None and mark[0] is node:
                    return (*loc, mark[1]), mark[2]
                children: Any = node.items()
            elif isinstance(node, list):
                children = enumerate(node)
            else:
                continue
            stack.extend(
                (child, (*loc, at))
                for at, child in reversed(list(children))
                if isinstance(child, (dict, list))
            )
        return None  # not reached: a noted object let go was a repeated member's value


def open_text(path: Path) -> TextIO:
    """``path`` as text; bytes that are not UTF-8 are kept as lone surrogates
    (``surrogateescape``), which no decoded text holds, so :func:`parsed` names their line
    (a file cut off mid-line may be cut inside a character). A byte order mark first (as
    Windows editors save UTF-8) is skipped, as the gateway skips one in a body. Raises
    OSError."""
    return path.open(encoding="utf-8-sig", errors="surrogateescape")


def numbered(handle: TextIO) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` per non-blank line, numbered from 1 as an editor does."""
    for number, line in enumerate(handle, start=1):
        if line.strip():
            yield number, line


def parsed(line: str) -> Any:
    """One line's JSON; raises ValueError saying it is not UTF-8 or not JSON, or naming a
    member an object gives twice (as a field: ``field 'a.b': ...``).

    >>> parsed('{"id": "a"}')
    {'id': 'a'}
    >>> parsed("{nope")
    Traceback (most recent call last):
    ValueError: not valid JSON (Expecting property name enclosed in double quotes)
    >>> parsed('{"id": "a", "metadata": {"k": 1, "k": 2}}')
    Traceback (most recent call last):
    ValueError: field 'metadata.k': is given 2 times: give it once
    """
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # a byte surrogateescape kept: the line is not UTF-8
        raise ValueError("not UTF-8 text") from None
    members = Members()
    try:
        value = json.loads(line, object_pairs_hook=members)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    if (repeated := members.first_repeated(value)) is not None:
        loc, times = repeated
        where = ".".join(str(part) for part in loc)  # as field_problem names a field
        raise ValueError(f"field {where!r}: {TWICE.format(times=times)}")
    return value


def field_problem(exc: ValidationError, whole: str = "document") -> str:
    """pydantic's first error as ``field 'a.b': message`` (``whole`` when it is the line's)."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or whole
    return f"field {where!r}: {first['msg']}"


def lines(
    path: Path, error: type[Exception] = ValueError
) -> Generator[tuple[int, str], None, None]:
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
